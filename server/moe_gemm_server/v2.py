"""Open Inference Protocol v2 (KServe / Triton) wire format, with the binary tensor extension.

A request body is a JSON header, optionally followed by raw tensor bytes; the header's length
is in `Inference-Header-Content-Length` (absent = the whole body is JSON). An input with
`parameters.binary_data_size` takes the next that many bytes of the binary section, in the
order the inputs appear; the sizes must add up to the section exactly. Bytes are little-endian
and row-major. BF16 travels as raw 2-byte bfloat16 values (what tritonclient >= 2.73 sends for
ml_dtypes.bfloat16 arrays). tritonclient sends no Content-Type, so the route parses raw bytes.
A header whose object holds one key twice is refused (400), as every JSON body is here.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator
from pydantic_core import from_json

from .codecs import (
    MAX_DIM,
    MAX_ELEMENTS,
    DuplicateKey,
    cast_json_floats,
    check_json_finite,
    encode_json,
    no_duplicate_keys,
    shape_overflows,
    tensor_from_buffer,
)
from .errors import bad_request

# v2 datatype -> torch dtype (BYTES has no tensor form here)
V2_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "UINT8": torch.uint8,
    "UINT16": torch.uint16,
    "UINT32": torch.uint32,
    "UINT64": torch.uint64,
    "INT8": torch.int8,
    "INT16": torch.int16,
    "INT32": torch.int32,
    "INT64": torch.int64,
    "FP16": torch.float16,
    "FP32": torch.float32,
    "FP64": torch.float64,
    "BF16": torch.bfloat16,
}
TORCH_TO_V2 = {v: k for k, v in V2_DTYPES.items()}

PARAM_VALUE = str | int | float | bool


class V2Input(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    shape: list[StrictInt]
    datatype: str
    parameters: dict[str, PARAM_VALUE] | None = None
    data: Any = None


class V2Output(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    parameters: dict[str, PARAM_VALUE] | None = None


class V2Request(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str | int | None = None
    # Not the protocol's, but the kserve client sends the model's name in the body; a name
    # (or version) there that is not the URL's is refused by the route.
    model_name: str | None = None
    model_version: str | None = None
    parameters: dict[str, PARAM_VALUE] | None = None
    inputs: list[V2Input] = Field(min_length=1)
    outputs: list[V2Output] | None = None

    @field_validator("id", mode="before")
    @classmethod
    def _id_is_a_string(cls, v: object) -> object:
        # The protocol's id is a string. An integer is still taken (and echoed as a string), as
        # this server always has; anything else (true, 1.5, a list) is refused, where the lax
        # union would have turned true into "1".
        if v is None or isinstance(v, str) or (isinstance(v, int) and not isinstance(v, bool)):
            return v
        raise ValueError(f"must be a string; got {type(v).__name__}")


def _json_data(inp: V2Input, dtype: torch.dtype, count: int) -> torch.Tensor:
    data = inp.data
    if data is None:
        raise bad_request(f"input {inp.name!r} has neither 'data' nor binary_data_size")
    try:
        arr = np.asarray(data)
    except (ValueError, TypeError, OverflowError):
        raise bad_request(f"input {inp.name!r}: 'data' must be a flat or nested, rectangular "
                          "list of numbers") from None
    if arr.size == 0 and count == 0:
        return torch.empty(0, dtype=dtype)
    if arr.dtype.kind == "O" and dtype.is_floating_point:
        arr = _big_ints_as_floats(inp, arr)
    if dtype == torch.uint64 and arr.dtype.kind in "fO":
        arr = _uint64_ints(data, arr)
    allowed = "b" if dtype == torch.bool else ("iuf" if dtype.is_floating_point else "iu")
    if arr.dtype.kind not in allowed or (dtype != torch.bool and _holds_bools(data)):
        # (an integer type's data that numpy read as floats: 2.0, or an integer past 2^64)
        what = ("booleans for" if dtype == torch.bool else "numbers for"
                if dtype.is_floating_point else "integers that fit")
        raise bad_request(f"input {inp.name!r}: 'data' must hold {what} {inp.datatype}")
    if arr.size != count:
        raise bad_request(
            f"input {inp.name!r}: shape {inp.shape} needs {count} values; 'data' has {arr.size}"
        )
    if arr.ndim > 1 and list(arr.shape) != list(inp.shape):
        # The protocol takes the data flat or nested as the shape: [[1, 2, 3], [4, 5, 6]]
        # under shape [3, 2] is one or the other client's mistake, not a reshape to guess.
        raise bad_request(f"input {inp.name!r}: 'data' is nested as {list(arr.shape)}, its "
                          f"shape is {inp.shape}; nest it as the shape or send it flat")
    flat = np.ascontiguousarray(arr.reshape(-1))
    if dtype == torch.bool:
        return torch.from_numpy(flat)
    if dtype.is_floating_point:
        return cast_json_floats(f"input {inp.name!r}", flat.astype(np.float64), dtype)
    if flat.size:
        info = torch.iinfo(dtype)  # a value the declared type cannot hold is an error, not a wrap
        lo, hi = int(flat.min()), int(flat.max())
        if lo < info.min or hi > info.max:
            bad = lo if lo < info.min else hi
            raise bad_request(f"input {inp.name!r}: {bad} does not fit {inp.datatype}")
    # (numpy holds integers past int64's range as uint64: UINT64's own, read as such)
    wide = np.uint64 if dtype == torch.uint64 else np.int64
    return torch.from_numpy(flat.astype(wide)).to(dtype)


def _big_ints_as_floats(inp: V2Input, arr: np.ndarray) -> np.ndarray:
    """A float input's values as float64 where numpy kept Python objects: a JSON integer beyond
    the int64 range (1e30 written out in digits) is a number like any other. Anything else
    (null, a string, an object) stays an object array, which the caller refuses."""
    flat = arr.reshape(-1).tolist()
    if not all(type(v) in (int, float) for v in flat):
        return arr
    try:
        return np.array(flat, dtype=np.float64).reshape(arr.shape)
    except OverflowError:
        raise bad_request(f"input {inp.name!r}: a value in 'data' does not fit "
                          f"{inp.datatype}") from None


def _uint64_ints(data: Any, arr: np.ndarray) -> np.ndarray:
    """A UINT64 input's values, exactly, where numpy did not read them as integers: integers
    past the int64 range beside smaller ones come out as float64 (rounded) or as objects,
    where the binary form of the same tensor is read bit for bit. Anything but integers that
    fit (a float, null, a ragged list, a negative one) is left as it was, for the caller to
    refuse."""
    try:
        obj = np.asarray(data, dtype=object)
    except ValueError:
        return arr
    flat = obj.reshape(-1).tolist()
    if not all(type(v) is int and 0 <= v < 1 << 64 for v in flat):
        return arr
    return np.array(flat, dtype=np.uint64).reshape(obj.shape)


def _holds_bools(data: Any) -> bool:
    """Whether a rectangular nested list holds a JSON true or false. numpy reads [1, true] as
    the integers [1, 1], so a boolean among numbers would pass as 1 or 0."""
    if isinstance(data, bool):
        return True
    if not isinstance(data, list):
        return False
    if data and isinstance(data[0], list):  # rectangular: every item is a list, or none is
        return any(_holds_bools(row) for row in data)
    return any(isinstance(v, bool) for v in data)


def parse_request(
    body: bytearray, header_length: str | None,
    check_names: Callable[[list[str]], None] | None = None,
) -> tuple[V2Request, dict[str, torch.Tensor]]:
    """Parse an infer request body into the request header and its input tensors.

    `check_names` (raises APIError) sees the inputs' names before any tensor is built: a
    request of a million inputs that the model would refuse costs no per-input work.

    Raises:
        APIError(400): malformed JSON, bad header length, binary sizes that do not add up,
            unknown datatypes, data that does not match the shape.
    """
    if header_length is not None:
        # Digits only, as HTTP's Content-Length (int() would also take '+12', '1_2' or
        # non-ASCII digits).
        text = header_length.strip()
        if not (text.isascii() and text.isdigit()):
            raise bad_request(
                f"Inference-Header-Content-Length must be a decimal byte count; got "
                f"{header_length!r}"
            )
        # A count of more digits than the body's length can never fit it; refusing it here
        # also keeps int() from raising past Python's 4,300-digit limit (a 500, not a 400).
        # (Leading zeros are still a plain decimal count.)
        digits = text.lstrip("0")
        too_long = len(digits) > len(str(len(body)))
        n = 0 if too_long else int(digits or "0")
        if too_long or not 0 < n <= len(body):
            shown = text if len(text) <= 40 else text[:40] + "..."
            raise bad_request(f"Inference-Header-Content-Length {shown} does not fit in a body "
                              f"of {len(body)} bytes")
    else:
        n = len(body)
    raw = bytes(body[:n])
    _check_no_nan_tokens(raw)
    try:
        # (pydantic's parser, then the model: as fast as model_validate_json, which would
        # leave no parsed objects to count keys in)
        obj = from_json(raw)
    except ValueError as e:
        raise bad_request(f"malformed inference request: Invalid JSON: {e}") from None
    _check_no_duplicate_keys(raw, obj)
    _check_fields(obj)
    try:
        req = V2Request.model_validate(obj)
    except ValidationError as e:
        raise bad_request(f"malformed inference request: {_first_error(e)}") from None
    if check_names is not None:
        check_names([inp.name for inp in req.inputs])
    mv = memoryview(body)
    pos = n
    tensors: dict[str, torch.Tensor] = {}
    for inp in req.inputs:
        if inp.name in tensors:
            raise bad_request(f"input {inp.name!r} appears twice")
        if inp.datatype == "BYTES":
            raise bad_request(f"input {inp.name!r}: BYTES tensors are not supported")
        dtype = V2_DTYPES.get(inp.datatype)
        if dtype is None:
            raise bad_request(f"input {inp.name!r}: unknown datatype {inp.datatype!r}")
        if any(s < 0 for s in inp.shape):
            raise bad_request(f"input {inp.name!r}: shape {inp.shape} has a negative dimension")
        if any(s > MAX_DIM for s in inp.shape):
            raise bad_request(f"input {inp.name!r}: shape {inp.shape} has a dimension over "
                              f"{MAX_DIM}")
        if shape_overflows(inp.shape):
            raise bad_request(f"input {inp.name!r}: shape {inp.shape} has more than "
                              f"{MAX_ELEMENTS} elements (counting only nonzero dimensions)")
        count = math.prod(inp.shape)
        params = inp.parameters or {}
        size = params.get("binary_data_size")
        if size is not None:
            if header_length is None:
                raise bad_request(
                    f"input {inp.name!r} has binary_data_size but the request has no "
                    "Inference-Header-Content-Length header"
                )
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise bad_request(f"input {inp.name!r}: binary_data_size must be an int >= 0")
            if inp.data is not None:
                # Two sources for one tensor: reading either one silently would answer a
                # request whose other copy says something else.
                raise bad_request(f"input {inp.name!r} has both 'data' and binary_data_size; "
                                  "send its values one way")
            itemsize = torch.empty((), dtype=dtype).element_size()
            if size != count * itemsize:
                raise bad_request(
                    f"input {inp.name!r}: {inp.datatype}{inp.shape} needs {count * itemsize} "
                    f"bytes; binary_data_size says {size}"
                )
            if pos + size > len(body):
                raise bad_request(
                    f"input {inp.name!r}: binary data runs past the end of the body "
                    f"({pos + size} > {len(body)} bytes)"
                )
            t = tensor_from_buffer(mv, dtype, (count,), pos)
            pos += size
        else:
            t = _json_data(inp, dtype, count)
        tensors[inp.name] = t.reshape(inp.shape)
    if pos != len(body):
        raise bad_request(
            f"the binary section has {len(body) - n} bytes but the inputs' binary_data_size "
            f"add up to {pos - n}"
        )
    return req, tensors


# The members the protocol defines (its extension point is `parameters`, at each level), and
# model_name / model_version, which the kserve client sends.
REQUEST_FIELDS = ("id", "parameters", "inputs", "outputs", "model_name", "model_version")
INPUT_FIELDS = ("name", "shape", "datatype", "parameters", "data")
OUTPUT_FIELDS = ("name", "parameters")


def _check_fields(obj: Any) -> None:
    """400 for a member the protocol does not define, at the top, in an input or an output:
    taken silently, a misspelt one ("output" for "outputs", "parameter", a top-level
    "priority") would be a request answered as if it had not asked for what it did (a JSON
    answer for a binary one, no timeout). Options beyond the protocol go in `parameters`."""
    if not isinstance(obj, dict):
        return  # (the model's validation says what is wrong)
    _unknown_fields("the request", obj, REQUEST_FIELDS)
    for key, allowed in (("inputs", INPUT_FIELDS), ("outputs", OUTPUT_FIELDS)):
        items = obj.get(key)
        for i, item in enumerate(items if isinstance(items, list) else ()):
            if isinstance(item, dict):
                _unknown_fields(f"{key}[{i}]", item, allowed)


def _unknown_fields(where: str, obj: dict[str, Any], allowed: tuple[str, ...]) -> None:
    unknown = [k for k in obj if k not in allowed]
    if unknown:
        shown = ", ".join(repr(k if len(k) <= 40 else k[:40] + "...") for k in unknown[:5])
        raise bad_request(f"malformed inference request: {where} has unknown field(s) {shown}; "
                          f"it takes {', '.join(allowed)} (other options go in 'parameters')")


def _check_no_nan_tokens(raw: bytes) -> None:
    """400 for the bare NaN / Infinity / -Infinity tokens, which are not JSON (RFC 8259) but which
    pydantic's parser reads as numbers. Only a header that holds the letters at all (in a
    name, say) pays for the second, strict parse."""
    if b"NaN" not in raw and b"Infinity" not in raw:
        return
    try:
        from_json(raw, allow_inf_nan=False)
    except ValueError as e:
        try:
            from_json(raw)
        except ValueError:
            return  # malformed for another reason: parse_request says which
        raise bad_request(f"malformed inference request: {e} (NaN and Infinity are not JSON "
                          "numbers)") from None


# A JSON string token (in a text already parsed as valid JSON).
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


def _check_no_duplicate_keys(raw: bytes, obj: Any) -> None:
    """400 for a key given twice in one object of the JSON header `raw` (parsed: `obj`), which
    pydantic's parser, as Python's json, reads as its last value, silently.

    Without a second parse of a large JSON body: outside strings, every ':' of a JSON text
    separates one member of one object, so a text with no more such ':' than its parsed
    objects have keys has no key twice. The ':' inside strings (an id "req:1") are counted
    only when the totals differ (a scan for strings: about 1 ms for 4 MB of JSON numbers);
    where they still differ, json with an object_pairs_hook reads the header again and names
    the key. The key count walks objects and lists of objects only, never the lists of
    numbers of JSON data: an object it skips can only make it fall short, which takes the
    exact path."""
    colons, keys = raw.count(b":"), _count_keys(obj)
    if colons == keys:
        return
    if colons - sum(s.count(b":") for s in _JSON_STRING.findall(raw)) == keys:
        return
    try:
        json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicate_keys)
    except DuplicateKey as e:
        raise bad_request(f"malformed inference request: {e}") from None
    except ValueError:
        pass  # (what json reads otherwise than pydantic's parser: that parser's reading stands)


def _count_keys(value: Any) -> int:
    if isinstance(value, dict):
        return len(value) + sum(_count_keys(v) for v in value.values())
    if isinstance(value, list) and value and isinstance(value[0], dict):
        return sum(_count_keys(v) for v in value)
    return 0


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err.get("loc", ()))
    return f"{loc}: {err.get('msg')}" if loc else str(err.get("msg"))


def _raw_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().to("cpu").contiguous()
    if t.numel() == 0:
        return b""
    return t.view(torch.uint8).numpy().tobytes()


def encode_response(
    model: str,
    request_id: str,
    outputs: dict[str, torch.Tensor],
    binary: dict[str, bool],
    version: str = "1",
) -> tuple[bytes, int | None]:
    """Body and header length (None = all JSON) of an infer response."""
    header_outputs = []
    blobs = []
    for name, t in outputs.items():
        entry: dict[str, Any] = {
            "name": name,
            "datatype": TORCH_TO_V2[t.dtype],
            "shape": list(t.shape),
        }
        if binary.get(name, False):
            raw = _raw_bytes(t)
            entry["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            check_json_finite(name, t, "ask for it as binary data (the request's "
                                       "parameters.binary_data_output, or the output's "
                                       "parameters.binary_data: true)")
            flat = t.detach().to("cpu").reshape(-1)
            entry["data"] = (flat.to(torch.float32) if t.is_floating_point() else flat).tolist()
        header_outputs.append(entry)
    header = encode_json(
        {"model_name": model, "model_version": version, "id": request_id,
         "outputs": header_outputs}
    )
    if not blobs:
        return header, None
    return header + b"".join(blobs), len(header)
