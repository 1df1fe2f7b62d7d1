"""Every API call described once, as a `_Call`, for both clients.

A `_Call` says what to send (method, path, headers, body) and how to read the answer; the
builders here check their arguments locally (names, shapes, dtypes: a ValueError or TypeError
before anything goes out) and apply the per-call options every method takes (`request_id=`,
`timeout=`, `max_retries=`, `extra_headers=`). Sending, retrying and error mapping are the
clients' (`_base.py`); this module knows the routes of docs/HTTP-API.md.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import httpx
import numpy as np

from . import _constants as C
from ._fp8 import FP8_WIRE, file_scale_parts, weight_tensors
from ._tensors import (
    ArrayKind,
    FileTensorPayload,
    Payload,
    as_data_array,
    as_index_array,
    decode_safetensors,
    dtype_from_name,
    encode_safetensors,
    read_safetensors_header,
)
from .types import WeightDeleted, WeightInfo, WeightList

R = TypeVar("R")

TimeoutTypes = float | httpx.Timeout | None
ProgressCallback = Callable[[int, int], None]
"""Called as progress(bytes_sent, bytes_total) while a request body is sent."""

_NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")


def check_name(name: object) -> str:
    """Validate a weight-set name locally: it goes into the URL path, so a bad one must never
    reach the wire (a "/" would address another route)."""
    if not isinstance(name, str):
        raise TypeError(f"weight set name must be a str; got {type(name).__name__}")
    if not _NAME_RE.fullmatch(name):
        raise ValueError(
            "weight set name must be 1-128 characters from [A-Za-z0-9._-], not starting with "
            f"'.'; got {name!r}"
        )
    return name


@dataclass
class _Call(Generic[R]):
    """One API call, described once for both clients."""

    method: str
    path: str
    parse: Callable[[httpx.Response], R]
    body: Payload | None = None
    headers: dict[str, str] = field(default_factory=dict)
    timeout: TimeoutTypes | httpx.Timeout = None
    max_retries: int | None = None
    retry_safe: bool = True
    progress: ProgressCallback | None = None
    request_id: str | None = None
    # Statuses handed to `parse` instead of raising (a readiness probe's 503 is an answer).
    answer_statuses: frozenset[int] = frozenset()
    # Value to return when a retry after an in-flight failure gets 404 (DELETE already done).
    gone_after_retry: Callable[[], R] | None = None


def _header_request_id(headers: Mapping[str, str]) -> str | None:
    for k, v in headers.items():
        if k.lower() == C.REQUEST_ID_HEADER.lower():
            return v
    return None


# What json.loads raises on a body that is not JSON. A RecursionError comes from arrays nested
# deeper than the parser's stack: an answer like any other malformed one, not a crash.
JSON_ERRORS = (json.JSONDecodeError, UnicodeDecodeError, RecursionError)


def _json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except JSON_ERRORS as exc:
        raise ValueError(f"expected a JSON body, got {response.content[:200]!r}") from exc


def _is_json(response: httpx.Response) -> bool:
    return "json" in response.headers.get("content-type", "").lower()


def answer_request_id(call: _Call[Any], response: httpx.Response) -> str | None:
    """The answer's X-Request-Id, else the one the call sent."""
    return response.headers.get(C.REQUEST_ID_HEADER) or call.request_id


# The server's rule for an X-Request-Id it echoes (1-128 printable ASCII, no spaces); any
# other id is replaced by a generated one, so the caller's id would be lost.
_REQUEST_ID_RE = re.compile(r"[\x21-\x7e]{1,128}")
# RFC 9110 token characters (header names) and what a header value may hold on HTTP/1.1:
# visible ASCII, space and tab. httpx encodes values as ASCII, so anything else fails deep
# inside it (a UnicodeEncodeError), and a CR/LF only at send time, as a "connection error".
_HEADER_NAME_RE = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_HEADER_VALUE_RE = re.compile(r"[\t\x20-\x7e]*")


def check_headers(headers: Mapping[str, str] | None, what: str) -> dict[str, str]:
    """Header names and values that can go on the wire (TypeError / ValueError before any
    request, naming the header)."""
    if headers is not None and not isinstance(headers, Mapping):
        # (a list of pairs, as httpx takes, had no .items(): an AttributeError)
        raise TypeError(f"{what} must be a mapping of header names to str values; got "
                        f"{type(headers).__name__}")
    out: dict[str, str] = {}
    for name, value in (headers or {}).items():
        if not isinstance(name, str) or not _HEADER_NAME_RE.fullmatch(name):
            raise ValueError(f"{what}: {name!r} is not a valid HTTP header name")
        if not isinstance(value, str):
            raise TypeError(f"{what}: header {name!r} must be a str; got "
                            f"{type(value).__name__}")
        if not _HEADER_VALUE_RE.fullmatch(value):
            raise ValueError(f"{what}: header {name!r} must hold printable ASCII only (no "
                             f"line breaks or other control characters); got {value!r:.80}")
        out[name] = value
    return out


def set_header(headers: dict[str, str], name: str, value: str) -> None:
    """headers[name] = value, replacing the header in any spelling of its name (HTTP header
    names are case-insensitive; a plain dict kept "x-request-id" beside "X-Request-Id")."""
    for key in [k for k in headers if k.lower() == name.lower()]:
        del headers[key]
    headers[name] = value


def with_options(call: _Call[R], *, request_id: str | None, timeout: TimeoutTypes,
                 max_retries: int | None, extra_headers: Mapping[str, str] | None) -> _Call[R]:
    """Apply the options every method takes to `call` (checked here, before sending)."""
    if extra_headers:
        for name, value in check_headers(extra_headers, "extra_headers").items():
            set_header(call.headers, name, value)
    if request_id is not None:
        if not isinstance(request_id, str) or not request_id:
            raise TypeError(f"request_id must be a non-empty str; got {request_id!r}")
        if not _REQUEST_ID_RE.fullmatch(request_id):
            raise ValueError("request_id must be 1-128 printable ASCII characters without "
                             f"spaces (the server replaces any other id); got {request_id!r:.80}")
        set_header(call.headers, C.REQUEST_ID_HEADER, request_id)
    call.request_id = request_id or _header_request_id(call.headers)
    call.timeout = timeout
    if max_retries is not None:
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be an int >= 0; got {max_retries!r}")
        call.max_retries = max_retries
    return call


def health_call(path: str, key: str, **common: Any) -> _Call[bool]:
    def parse(response: httpx.Response) -> bool:
        if response.status_code != 200:
            return False
        try:
            data = response.json()
        except JSON_ERRORS:
            return True  # the spec allows an empty body: 200 alone means yes
        return not (isinstance(data, dict) and data.get(key) is False)

    call = _Call("GET", path, parse, answer_statuses=frozenset({503}))
    return with_options(call, **common)


def list_call(**common: Any) -> _Call[WeightList]:
    def parse(response: httpx.Response) -> WeightList:
        return WeightList.from_json(_json(response))

    return with_options(_Call("GET", "/v1/weights", parse), **common)


def get_call(name: str, **common: Any) -> _Call[WeightInfo]:
    name = check_name(name)

    def parse(response: httpx.Response) -> WeightInfo:
        info = WeightInfo.from_json(_json(response))
        if info.name != name:
            raise ValueError(f"asked for weight set {name!r}; the answer describes {info.name!r}")
        return info

    return with_options(_Call("GET", f"/v1/weights/{name}", parse), **common)


def delete_call(name: str, **common: Any) -> _Call[WeightDeleted]:
    name = check_name(name)
    call = _Call("DELETE", f"/v1/weights/{name}",
                 lambda r: WeightDeleted.from_json(_json(r)),
                 gone_after_retry=lambda: WeightDeleted(deleted=name))
    return with_options(call, **common)


def put_call(name: str, w: object, scale: object, layout: str,
             progress: ProgressCallback | None, **common: Any) -> _Call[WeightInfo]:
    name = check_name(name)
    if layout not in ("w", "w_t"):
        raise ValueError(f'layout must be "w" (E, K, N) or "w_t" (E, N, K); got {layout!r}')
    call = _Call("PUT", f"/v1/weights/{name}", lambda r: WeightInfo.from_json(_json(r)),
                 body=encode_safetensors(weight_tensors(w, scale, layout)), progress=progress)
    return with_options(call, **common)


def upload_file_call(name: str, path: str | os.PathLike[str], tensor: str | None,
                     layout: str | None, scale_tensor: str | None,
                     progress: ProgressCallback | None, **common: Any) -> _Call[WeightInfo]:
    name = check_name(name)
    if not isinstance(path, (str, os.PathLike)):
        # An int is a file descriptor to open() and os.stat(): the upload would read whatever
        # that descriptor is, then close it under its owner.
        raise TypeError(f"path must be a str or os.PathLike naming a .safetensors file; got "
                        f"{type(path).__name__}")
    entries = read_safetensors_header(path)
    if tensor is None:
        for candidate in ("w", "w_t"):
            if candidate in entries:
                tensor = candidate
                break
        else:
            # An FP8 file's scale is not a candidate: {"experts", "scale"} names its tensor.
            others = [k for k in entries if k != (scale_tensor or "scale")]
            if len(others) != 1:
                raise ValueError(
                    f"{os.fspath(path)} holds {sorted(entries)}; name the tensor to upload "
                    "(tensor=...) or store it as 'w' (E, K, N) or 'w_t' (E, N, K)")
            tensor = others[0]
    if tensor not in entries:
        raise ValueError(f"{os.fspath(path)} has no tensor {tensor!r}; it holds "
                         f"{sorted(entries)}")
    entry = entries[tensor]
    if layout is None:
        layout = tensor if tensor in ("w", "w_t") else "w"
    if layout not in ("w", "w_t"):
        raise ValueError(f'layout must be "w" (E, K, N) or "w_t" (E, N, K); got {layout!r}')
    hint = "(E, K, N)" if layout == "w" else "(E, N, K)"
    if len(entry.shape) != 3:
        raise ValueError(f"tensor {tensor!r} must be 3-D {hint}; got shape {entry.shape}")
    if entry.dtype not in ("F32", "F16", "BF16", *FP8_WIRE):
        raise TypeError(f"tensor {tensor!r} must be F32, F16, BF16, F8_E4M3 or F8_E5M2; got "
                        f"{entry.dtype}")
    also = file_scale_parts(path, entries, tensor, layout, scale_tensor)
    call = _Call("PUT", f"/v1/weights/{name}", lambda r: WeightInfo.from_json(_json(r)),
                 body=FileTensorPayload(path, entry, layout, also), progress=progress)
    return with_options(call, **common)


def _header_int(name: str, value: object, meaning: str) -> str:
    # The server takes non-negative decimal integers below 10^18 in these headers (else 400):
    # refused here, before a body is sent, with what was expected.
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 10**18:
        raise ValueError(f"{name} must be an int in [0, 10**18) ({meaning}); got {value!r}")
    return str(value)


def matmul_headers(priority: int | None, request_timeout_us: int | None) -> dict[str, str]:
    headers = {"Accept": "application/octet-stream, application/json;q=0.9"}
    if priority is not None:
        headers[C.PRIORITY_HEADER] = _header_int("priority", priority,
                                                 "1 = highest, 0 = the server's default")
    if request_timeout_us is not None:
        headers[C.TIMEOUT_US_HEADER] = _header_int(
            "request_timeout_us", request_timeout_us,
            "microseconds; 0 = the server's --default-timeout-us")
    return headers


def grouped_mm_call(name: str, x: object, counts: object, offs: object,
                    return_request_id: bool, priority: int | None,
                    request_timeout_us: int | None, **common: Any) -> _Call[Any]:
    name = check_name(name)
    x_arr, kind = as_data_array(x, "x", "(T, K)", 2)
    if counts is None and offs is None:
        raise ValueError("grouped_mm needs counts (E,) rows per expert or offs (E,) "
                         "cumulative end rows; got neither")
    if counts is not None and offs is not None:
        raise ValueError("grouped_mm takes counts (E,) or offs (E,), not both")
    tensors: dict[str, np.ndarray] = {"x": x_arr}
    if counts is not None:
        tensors["counts"] = as_index_array(counts, "counts", "(E,)")
    else:
        tensors["offs"] = as_index_array(offs, "offs", "(E,)")
    rows = x_arr.shape[0]

    def parse(response: httpx.Response) -> Any:
        y = _matmul_output(response, "y")
        if y.ndim != 2 or y.shape[0] != rows:
            raise ValueError(f"expected y of shape ({rows}, N); got {y.shape}")
        if y.dtype != x_arr.dtype:  # (y comes back in x's dtype)
            raise ValueError(f"expected y in x's dtype {x_arr.dtype}; got {y.dtype}")
        out = kind.wrap(y)
        return (out, answer_request_id(call, response)) if return_request_id else out

    call: _Call[Any] = _Call(
        "POST", f"/v1/weights/{name}/grouped-mm", parse, body=encode_safetensors(tensors),
        headers=matmul_headers(priority, request_timeout_us))
    return with_options(call, **common)


def grouped_gemm_call(a_list: object, b_list: object, return_request_id: bool,
                      priority: int | None, request_timeout_us: int | None,
                      **common: Any) -> _Call[Any] | None:
    a_items = _as_list("a_list", a_list, "(M_i, K_i)")
    b_items = _as_list("b_list", b_list, "(K_i, N_i)")
    if len(a_items) != len(b_items):
        raise ValueError(f"expected one b per a: got len(a_list)={len(a_items)} and "
                         f"len(b_list)={len(b_items)}")
    if not a_items:
        return None
    tensors: dict[str, np.ndarray] = {}
    kinds: list[ArrayKind] = []
    shapes: list[tuple[int, int]] = []
    dtypes: list[np.dtype[Any]] = []
    for i, (a, b) in enumerate(zip(a_items, b_items)):
        a_arr, kind = as_data_array(a, f"a_list[{i}]", "(M_i, K_i)", 2)
        b_arr, _ = as_data_array(b, f"b_list[{i}]", "(K_i, N_i)", 2)
        tensors[f"a.{i}"] = a_arr
        tensors[f"b.{i}"] = b_arr
        kinds.append(kind)
        shapes.append((a_arr.shape[0], b_arr.shape[1]))
        dtypes.append(a_arr.dtype)

    def parse(response: httpx.Response) -> Any:
        outs = []
        for i, (m, n) in enumerate(shapes):
            d = _matmul_output(response, f"d.{i}")
            if d.shape != (m, n):
                raise ValueError(f"expected d.{i} of shape ({m}, {n}); got {d.shape}")
            if d.dtype != dtypes[i]:  # (d_i comes back in a_i's dtype)
                raise ValueError(f"expected d.{i} in a_list[{i}]'s dtype {dtypes[i]}; got "
                                 f"{d.dtype}")
            outs.append(kinds[i].wrap(d))
        return (outs, answer_request_id(call, response)) if return_request_id else outs

    call: _Call[Any] = _Call(
        "POST", "/v1/grouped-gemm", parse, body=encode_safetensors(tensors),
        headers=matmul_headers(priority, request_timeout_us))
    return with_options(call, **common)


def _as_list(name: str, seq: object, hint: str) -> list[object]:
    if isinstance(seq, np.ndarray) or (hasattr(seq, "shape") and hasattr(seq, "dtype")):
        raise TypeError(f"{name} must be a list or tuple of 2-D arrays {hint}; got a single "
                        f"array (use list(arr) for a 3-D batch)")
    if not isinstance(seq, Sequence) or isinstance(seq, (str, bytes)):
        raise TypeError(f"{name} must be a list or tuple of 2-D arrays {hint}; got "
                        f"{type(seq).__name__}")
    return list(seq)


def _matmul_output(response: httpx.Response, key: str) -> np.ndarray:
    """One output tensor of a matmul answer (safetensors, or the JSON form)."""
    decoded = response.extensions.get("moe_gemm_decoded")
    if decoded is None:
        decoded = _decode_matmul(response)
        response.extensions["moe_gemm_decoded"] = decoded
    if key not in decoded:
        raise ValueError(f"answer has no tensor {key!r}; it has {sorted(decoded)}")
    return decoded[key]


def _decode_matmul(response: httpx.Response) -> dict[str, np.ndarray]:
    if not _is_json(response):
        return decode_safetensors(response.content)
    data = _json(response)
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object; got {data!r:.200}")
    dtype = dtype_from_name(data.get("dtype", "float32"))
    out: dict[str, np.ndarray] = {}
    if "y" in data:
        out["y"] = _json_numbers("y", data["y"], dtype)
    if "d" in data:
        if not isinstance(data["d"], list):
            raise ValueError(f"'d' must be a list of matrices; got {data['d']!r:.80}")
        for i, d in enumerate(data["d"]):
            out[f"d.{i}"] = _json_numbers(f"d[{i}]", d, dtype)
    return out


def _json_numbers(name: str, value: Any, dtype: np.dtype[Any]) -> np.ndarray:
    """A rectangular nested list of JSON numbers as an array of `dtype`. Checked first:
    numpy would read a null as NaN and a boolean as 1.0, turning a broken answer into a result."""
    try:
        arr = np.asarray(value)
    except ValueError as exc:  # ragged
        raise ValueError(f"{name!r} is not a rectangular list of numbers: {exc}") from exc
    if arr.dtype.kind not in "iuf" or _holds_bools(value):
        raise ValueError(f"{name!r} must hold only numbers; got {value!r:.80}")
    return np.asarray(arr.astype(np.float32), dtype=dtype)


def _holds_bools(value: Any) -> bool:
    """Whether a rectangular nested list holds a JSON true or false (numpy reads them as 1, 0)."""
    if isinstance(value, bool):
        return True
    if not isinstance(value, list):
        return False
    if value and isinstance(value[0], list):
        return any(_holds_bools(row) for row in value)
    return any(isinstance(v, bool) for v in value)


def empty_grouped_gemm(return_request_id: bool) -> Any:
    return ([], None) if return_request_id else []

