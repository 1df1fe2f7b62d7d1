"""Tensor wire formats of the native API: safetensors bodies and small JSON bodies.

No pickle anywhere. The safetensors parser is our own, strict, and never trusts a length it
was given: the header length must fit in the body, the header must be a JSON object with no
duplicate names, every dtype must be known, every shape a list of non-negative ints, and the
data offsets must tile the data region exactly (sorted, contiguous, no gaps, no overlap, the
last one ending at the end of the body), with each tensor's byte count equal to
prod(shape) * itemsize. Anything else is a 400 that says which rule was broken.
Decoded tensors are zero-copy views of the body buffer when aligned (a copy otherwise).
"""

from __future__ import annotations

import json
import math
import struct
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from pydantic import StrictFloat, StrictInt, TypeAdapter, ValidationError
from safetensors.torch import save as _st_save

from .errors import bad_request, unprocessable

# safetensors dtype name -> torch dtype (only those torch can hold)
ST_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    # UE8M0 (exponent-only scales): no route takes it, but a body holding it is well formed;
    # known here, it gets the route's own dtype error (422) rather than "malformed" (400).
    "F8_E8M0": torch.float8_e8m0fnu,
}
# safetensors dtypes no route here reads (sub-byte floats, complex): a body holding one is well
# formed, so it is a 422 naming the dtype, not a "malformed" 400.
ST_UNREAD = ("F4", "F6_E2M3", "F6_E3M2", "C64")
# safetensors' own cap on the header (100 MB); ours is tighter still via the body limit.
MAX_HEADER_BYTES = 100_000_000

DATA_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
JSON_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


# Largest dimension a tensor may declare (int32 row/column indices in the kernels); larger,
# even in an empty tensor, is a 400 rather than an allocation error.
MAX_DIM = (1 << 31) - 1
# torch computes an empty tensor's strides and size from its nonzero dimensions too, in int64:
# a shape such as [2**31 - 1] * 3 + [0] holds no byte yet cannot be built (RuntimeError).
MAX_ELEMENTS = (1 << 63) - 1


def shape_overflows(shape: list[int] | tuple[int, ...]) -> bool:
    """True when the product of the nonzero dimensions does not fit torch's int64 sizes."""
    return math.prod(s for s in shape if s) > MAX_ELEMENTS


@dataclass(frozen=True)
class TensorSpec:
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def _not_json(token: str) -> Any:
    """json.loads' parse_constant: Python's json reads NaN and (-)Infinity, which are not JSON
    (RFC 8259) and would put non-finite numbers where the checks expect finite ones."""
    raise ValueError(f"{token} is not a JSON number")


class DuplicateKey(ValueError):
    """A JSON object holds one key twice."""


def no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json.loads' object_pairs_hook: a key given twice is an error (json keeps the last one,
    silently). Called once per JSON object, never per array element: free on tensor bodies,
    whose numbers are all in arrays."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise DuplicateKey(f"duplicate key {k!r}")
        out[k] = v
    return out


NameRules = Callable[[list[str]], None]


def parse_safetensors_header(
    prefix: bytes | bytearray | memoryview, total_size: int | None, *,
    max_tensors: int | None = None, name_rules: NameRules | None = None,
) -> tuple[dict[str, TensorSpec], int, dict[str, str]]:
    """Parse and check a safetensors header.

    Args:
        prefix: at least the first 8 + header-length bytes of the body (or all of it).
        total_size: the size of the whole body in bytes; None while it is not known (a
            chunked upload checked from its first bytes): the data region is then as long as
            the offsets say, and the caller checks the body against it.
        max_tensors: the most tensors the route can take. A header of more is refused
            before any entry is checked (a million entries take a minute to check one by
            one), by `name_rules`: the route's rules on names, which refuse such a list and
            say why as the route would (else a 400 says how many tensors it takes).

    Returns:
        (specs by name, byte offset where the data region starts, __metadata__).

    Raises:
        APIError(400): any violation of the format, named in the message.
    """
    if (total_size is not None and total_size < 8) or len(prefix) < 8:
        raise bad_request(f"malformed safetensors: {total_size} bytes is shorter than the "
                          "8-byte header length")
    (n,) = struct.unpack("<Q", bytes(prefix[:8]))
    if n > MAX_HEADER_BYTES or (total_size is not None and 8 + n > total_size):
        raise bad_request(
            f"malformed safetensors: header length {n} does not fit in a body of "
            f"{total_size} bytes" if total_size is not None else
            f"malformed safetensors: header length {n} is over the {MAX_HEADER_BYTES}-byte "
            "limit"
        )
    if len(prefix) < 8 + n:
        raise bad_request("malformed safetensors: truncated header")
    raw = bytes(prefix[8:8 + n])
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicate_keys,
                            parse_constant=_not_json)
    except (UnicodeDecodeError, ValueError) as e:
        raise bad_request(f"malformed safetensors: header is not valid JSON ({e})") from None
    except RecursionError:  # a header of nested lists deeper than the parser's stack
        raise bad_request("malformed safetensors: header is nested too deeply") from None
    if not isinstance(header, dict):
        raise bad_request("malformed safetensors: header must be a JSON object")
    # (null is "no metadata", as safetensors' own Option reads it; [], 0, false or "" are not
    # an object, and `or {}` would have taken them as one)
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise bad_request("malformed safetensors: __metadata__ must map strings to strings")
    if max_tensors is not None and len(header) > max_tensors:
        if name_rules is not None:
            name_rules(list(header))
        raise bad_request(f"the body holds {len(header)} tensors; this route takes at most "
                          f"{max_tensors}")
    data_start = 8 + n
    data_len = None if total_size is None else total_size - data_start
    specs: dict[str, TensorSpec] = {}
    for name, entry in header.items():
        if not isinstance(entry, dict):
            raise bad_request(f"malformed safetensors: entry {name!r} must be an object")
        dt, shape, offs = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dt, str) or dt not in ST_DTYPES:  # (a list or object is unhashable)
            if dt in ST_UNREAD:
                raise unprocessable(
                    f"tensor {name!r} has dtype {dt}, which this service does not read (it "
                    f"reads {', '.join(ST_DTYPES)}; each route names the ones it takes)")
            raise bad_request(f"malformed safetensors: tensor {name!r} has unknown dtype {dt!r}")
        if not isinstance(shape, list) or not all(
            isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= MAX_DIM for s in shape
        ):
            raise bad_request(
                f"malformed safetensors: tensor {name!r} shape must be a list of ints in "
                f"[0, {MAX_DIM}]; "
                f"got {shape!r}"
            )
        if shape_overflows(shape):
            raise bad_request(f"malformed safetensors: tensor {name!r} shape {shape!r} has more "
                              f"than {MAX_ELEMENTS} elements (counting only nonzero dimensions)")
        if (
            not isinstance(offs, list)
            or len(offs) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
            or not 0 <= offs[0] <= offs[1]
            or (data_len is not None and offs[1] > data_len)
        ):
            raise bad_request(
                f"malformed safetensors: tensor {name!r} data_offsets {offs!r} do not lie in "
                f"the {data_len}-byte data region" if data_len is not None else
                f"malformed safetensors: tensor {name!r} data_offsets {offs!r} are not "
                "[start, end] with 0 <= start <= end"
            )
        dtype = ST_DTYPES[dt]
        want = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if offs[1] - offs[0] != want:
            raise bad_request(
                f"malformed safetensors: tensor {name!r} {dt}{list(shape)} needs {want} bytes "
                f"but its data_offsets span {offs[1] - offs[0]}"
            )
        specs[name] = TensorSpec(dtype, tuple(shape), offs[0], offs[1])
    pos = 0
    for name, spec in sorted(specs.items(), key=lambda kv: (kv[1].start, kv[1].end)):
        if spec.start != pos:
            raise bad_request(
                f"malformed safetensors: tensor {name!r} starts at {spec.start}, expected "
                f"{pos} (data must be contiguous, without gaps or overlaps)"
            )
        pos = spec.end
    if data_len is not None and pos != data_len:
        raise bad_request(
            f"malformed safetensors: tensors cover {pos} bytes of a {data_len}-byte data region"
        )
    return specs, data_start, metadata


def tensor_from_buffer(
    buf: bytearray | memoryview, dtype: torch.dtype, shape: tuple[int, ...], offset: int
) -> torch.Tensor:
    """A [shape] tensor of `dtype` over buf[offset:...] (zero-copy when aligned)."""
    count = math.prod(shape)
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    t = torch.frombuffer(buf, dtype=dtype, count=count, offset=offset)
    if t.data_ptr() % t.element_size():
        t = t.clone()  # unaligned views work on the CPU but not for every op or copy path
    return t.view(shape)


def decode_safetensors(buf: bytearray, *, max_tensors: int | None = None,
                       name_rules: NameRules | None = None) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors body (views of `buf`, which must stay alive);
    `max_tensors` and `name_rules` as in parse_safetensors_header."""
    specs, data_start, _ = parse_safetensors_header(buf, len(buf), max_tensors=max_tensors,
                                                    name_rules=name_rules)
    mv = memoryview(buf)
    return {
        name: tensor_from_buffer(mv, s.dtype, s.shape, data_start + s.start)
        for name, s in specs.items()
    }


def encode_safetensors(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """A safetensors body holding `tensors` (made contiguous, on the CPU)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for k, v in tensors.items():
        t = v.detach().to("cpu").contiguous()
        if t.numel():
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:  # views of one result (e.g. unbind of a bmm): safetensors refuses
                t = t.clone()
            seen.add(t.untyped_storage().data_ptr())
        out[k] = t
    return _st_save(out)


# ----------------------------------------------------------------------------- JSON bodies

_NUM = StrictFloat | StrictInt
_ROWS = TypeAdapter(list[list[_NUM]])
_INTS = TypeAdapter(list[StrictInt])
_MATS = TypeAdapter(list[list[list[_NUM]]])


def _json_error(e: ValueError) -> str:
    """json's reason, without the advice Python gives its own programmers: an integer
    literal past the interpreter's digit limit says to call sys.set_int_max_str_digits()."""
    if "integer string conversion" in str(e):
        return f"an integer of more than {sys.get_int_max_str_digits()} digits"
    return str(e)


def parse_json_object(body: bytes | bytearray) -> dict[str, Any]:
    """The body as a JSON object (400 otherwise, and for a key given twice in any object)."""
    try:
        # (decoded straight from the buffer: bytes(body) would copy the whole body first)
        obj = json.loads(body.decode("utf-8"), object_pairs_hook=no_duplicate_keys,
                         parse_constant=_not_json)
    except (UnicodeDecodeError, ValueError) as e:
        raise bad_request(f"malformed JSON body: {_json_error(e)}") from None
    except RecursionError:
        raise bad_request("malformed JSON body: nested too deeply") from None
    if not isinstance(obj, dict):
        raise bad_request("malformed JSON body: expected a JSON object")
    return obj


def json_dtype(obj: Mapping[str, Any]) -> torch.dtype:
    """The torch dtype a JSON body's "dtype" field names ("float32" if absent); 422 otherwise."""
    name = obj.get("dtype", "float32")
    if not isinstance(name, str) or name not in JSON_DTYPES:  # (a list or object is unhashable)
        raise unprocessable(
            f"dtype must be one of {', '.join(JSON_DTYPES)}; got {name!r}"
        )
    return JSON_DTYPES[name]


def nested_shape(value: Any) -> tuple[int, ...] | None:
    """The shape of a rectangular nested list of JSON numbers (any depth), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return ()
    if not isinstance(value, list):
        return None
    if not value:
        return (0,)
    try:
        inner = {nested_shape(v) for v in value}
    except RecursionError:
        return None
    if len(inner) != 1 or None in inner:
        return None
    return (len(value), *inner.pop())


def _wrong_rank(name: str, value: Any, ndim: int, hint: str) -> None:
    """422 when `value` is a well-formed list of numbers of another rank than `ndim`.

    A list of the wrong rank is the same mistake as a safetensors tensor of the wrong rank,
    and gets the same status; a list that is not numbers, or ragged, stays a 400.
    """
    shape = nested_shape(value)
    if shape is not None and len(shape) != ndim:
        got = "a number" if not shape else f"a {len(shape)}-D list of shape {shape}"
        raise unprocessable(f"{name!r} must be {ndim}-D {hint}; got {got}")


def _to_float32_round_to_odd(arr: np.ndarray) -> np.ndarray:
    """float64 -> float32 rounded to odd (truncated toward zero, the last bit set when
    inexact). float32 keeps at least 2 more bits than float16 (11) and bfloat16 (8) do, so a
    round-to-nearest-even from this value to either gives the float64 value's own rounding."""
    with np.errstate(over="ignore"):  # (beyond float32: inf, refused by the caller)
        f = arr.astype(np.float32)
    over = np.abs(f.astype(np.float64)) > np.abs(arr)  # rounded away from zero: step back
    f = np.where(over, np.nextafter(f, np.float32(0)), f).astype(np.float32)
    inexact = f.astype(np.float64) != arr
    return (f.view(np.uint32) | inexact.astype(np.uint32)).view(np.float32)


def cast_json_floats(what: str, arr: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """JSON numbers (float64, all finite: JSON has no NaN or Infinity) -> `dtype`. A number
    past the type's range would become an infinity on the way (70000 as float16) and turn the
    answer into inf/NaN with no word why: a 400 naming the limit instead.

    float16 and bfloat16 are rounded once, from the float64 value: torch converts float64 to
    them through float32, and that double rounding is an ulp off for a number just past a
    halfway point (1 + 2^-11 + 2^-40 became 1.0 in float16, not 1 + 2^-10 as numpy rounds it)."""
    if dtype in (torch.float16, torch.bfloat16):
        arr = _to_float32_round_to_odd(arr)
    out = torch.from_numpy(arr).to(dtype)
    if dtype.is_floating_point and out.numel() and not bool(torch.isfinite(out).all()):
        limit = torch.finfo(dtype).max
        type_name = str(dtype).removeprefix("torch.")
        raise bad_request(f"{what} holds a number beyond the range of {type_name} "
                          f"(magnitude at most {limit:.6g})")
    return out


def _matrix(name: str, value: Any, dtype: torch.dtype, inner: int | None = None,
            hint: str = "(rows, columns)") -> torch.Tensor:
    """A nested list of numbers -> 2-D tensor; [] means (0, inner) when inner is known."""
    try:
        rows = _ROWS.validate_python(value)
    except ValidationError:
        _wrong_rank(name, value, 2, hint)
        raise bad_request(f"{name!r} must be a list of rows of numbers") from None
    if not rows:
        return torch.empty(0, inner or 0, dtype=dtype)
    width = len(rows[0])
    if any(len(r) != width for r in rows):
        raise bad_request(f"{name!r} is ragged: every row must have {width} numbers")
    try:
        arr = np.asarray(rows, dtype=np.float64)
    except (OverflowError, ValueError):  # e.g. an integer beyond float64's range
        raise bad_request(f"{name!r} holds a number float64 cannot represent") from None
    return cast_json_floats(repr(name), arr, dtype)


def json_tensor3(name: str, value: Any, dtype: torch.dtype, hint: str = "") -> torch.Tensor:
    """A 3-level nested list of numbers -> 3-D tensor (400 if not numbers or ragged, 422 if
    well-formed but of another rank)."""
    try:
        mats = _MATS.validate_python(value)
        arr = np.asarray(mats, dtype=np.float64)
    except (ValidationError, ValueError, OverflowError):
        _wrong_rank(name, value, 3, hint)
        raise bad_request(f"{name!r} must be a rectangular 3-D nested list of numbers") from None
    if arr.ndim != 3:
        _wrong_rank(name, value, 3, hint)
        raise bad_request(f"{name!r} must be a rectangular 3-D nested list of numbers")
    return cast_json_floats(repr(name), arr, dtype)


def json_int_vector(name: str, value: Any, hint: str = "(E,)") -> torch.Tensor:
    """A list of integers -> 1-D int64 tensor (400 if not integers, 422 if well-formed but of
    another rank, as a safetensors tensor of the wrong rank is)."""
    try:
        ints = _INTS.validate_python(value)
    except ValidationError:
        _wrong_rank(name, value, 1, hint)
        raise bad_request(f"{name!r} must be a list of integers") from None
    try:
        return torch.tensor(ints, dtype=torch.int64).reshape(-1)
    except (OverflowError, RuntimeError, ValueError):
        raise unprocessable(f"{name!r} has values outside the int64 range") from None


def decode_json_grouped_mm(obj: Mapping[str, Any], K: int) -> dict[str, torch.Tensor]:
    """{"x": [[...]], "counts"|"offs": [...], "dtype"} -> tensors named like the wire form."""
    dtype = json_dtype(obj)
    unknown = set(obj) - {"x", "counts", "offs", "dtype"}
    if unknown:
        raise bad_request(f"unexpected field(s) {sorted(unknown)}; expected x, counts or offs, "
                          "dtype")
    if "x" not in obj:
        raise bad_request("missing tensor 'x' (T, K)")
    out = {"x": _matrix("x", obj["x"], dtype, K, "(T, K)")}
    for key in ("counts", "offs"):
        if key in obj:
            out[key] = json_int_vector(key, obj[key])
    return out


def decode_json_grouped_gemm(obj: Mapping[str, Any],
                             check_count: Callable[[int], None] | None = None
                             ) -> dict[str, torch.Tensor]:
    """{"a": [A_0, ...], "b": [B_0, ...], "dtype"} -> {"a.i", "b.i"} tensors. `check_count`
    (raises APIError) sees the number of problems before any matrix is built: a million
    empty problems would otherwise cost tens of seconds before the limit refused them."""
    dtype = json_dtype(obj)
    unknown = set(obj) - {"a", "b", "dtype"}
    if unknown:
        raise bad_request(f"unexpected field(s) {sorted(unknown)}; expected a, b, dtype")
    for key in ("a", "b"):
        if key not in obj:
            raise bad_request(f"missing field {key!r} (a list of matrices)")
        if not isinstance(obj[key], list):
            # (a value of the wrong rank: 422, as a matrix of the wrong rank is)
            raise unprocessable(f"{key!r} must be a list of matrices")
    a, b = obj["a"], obj["b"]
    if check_count is not None:
        check_count(max(len(a), len(b)))
    out: dict[str, torch.Tensor] = {}
    for i, bi in enumerate(b):
        out[f"b.{i}"] = _matrix(f"b[{i}]", bi, dtype, hint="(K_i, N_i)")
    for i, ai in enumerate(a):
        inner = out[f"b.{i}"].shape[0] if f"b.{i}" in out else None
        out[f"a.{i}"] = _matrix(f"a[{i}]", ai, dtype, inner, "(M_i, K_i)")
    return out


def tensor_to_json(t: torch.Tensor) -> list[Any]:
    """Nested lists of Python floats (the exact values of the tensor's dtype)."""
    return t.detach().to("cpu", torch.float32).tolist() if t.is_floating_point() else t.tolist()


def check_json_finite(name: str, t: torch.Tensor, instead: str) -> None:
    """422 for a result holding NaN or an infinity (an fp16 overflow), which JSON has no
    number for: written as Python's json writes them (NaN, Infinity), the answer is no JSON
    (strict parsers, the kserve client and this server's own request parser refuse it), and
    written as null it would lose which of the three it was, and its sign. `instead` names
    the form that carries the exact values (safetensors, v2 binary outputs)."""
    if not t.is_floating_point() or t.numel() == 0:
        return
    bad = ~torch.isfinite(t)
    if not bool(bad.any()):
        return
    first = [int(i) for i in torch.nonzero(bad)[0]]
    value = float(t[tuple(first)])
    raise unprocessable(f"the result {name!r} holds {int(bad.sum())} value(s) JSON has no "
                        f"number for (NaN or infinity; the first at {first}: {value}); "
                        f"{instead} to get them")


def encode_json(obj: Any) -> bytes:
    # (allow_nan=False: a non-finite number is never written as a NaN / Infinity token)
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
