"""`Client` and `AsyncClient`: the moe-gemm-server HTTP API (docs/HTTP-API.md) over httpx.

Why the split into `_BaseClient` + two thin classes: every request is first described as a `_Call`
(method, path, headers, body, how to parse the answer) by code both clients share, and every
answer and failure goes through the same `_on_response` / `_on_transport_error` decisions. The
only code that differs is the loop that sends and sleeps (`send` vs `await send`), so the sync
and async clients cannot drift apart.

Retries (the rule, also in the README):
- Every route of this API is safe to repeat: GET, PUT (a full replacement of one weight set) and
  DELETE are idempotent by HTTP semantics, and the two POST matmul routes are pure functions of
  their body that change no server state. A request is retried when
  * no answer came back: the connection was refused, reset or closed, a protocol error, or a
    timeout (connect, read, write or pool; as in openai-python, each attempt gets the full
    `timeout` again); or
  * the server answered 408, 429, 502 or 503 (429 and 503 come with Retry-After).
- Never retried: other 4xx (the same request would fail the same way), 500 (a server bug
  repeats), 504 (the request's own X-Timeout-Us deadline passed), and setup errors (a bad
  URL scheme, a proxy error).
- A request marked not safe to repeat (`_Call.retry_safe=False`; no public route is, today) is
  retried only when it certainly never reached the server (connect errors and timeouts, pool
  timeouts).
- Delay: the server's Retry-After (seconds or an HTTP date; Retry-After-Ms too) capped at 60 s;
  otherwise 0.5 s doubling per retry up to 8 s, times a jitter factor in (0.75, 1].
- A DELETE retried after a lost answer may find the weight set already gone (the first try did
  delete it); that 404 is reported as success.
"""

from __future__ import annotations

import email.utils
import json
import math
import os
import random
import re
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar, overload

import anyio  # a hard dependency of httpx, so always present alongside it
import httpx
import numpy as np

from . import _constants as C
from ._exceptions import (
    APIConnectionError,
    APIError,
    APIResponseValidationError,
    APIStatusError,
    APITimeoutError,
    status_error_class,
)
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
from .types import WeightDeleted, WeightInfo

__all__ = ["Client", "AsyncClient", "ProgressCallback", "TimeoutTypes"]

R = TypeVar("R")
T = TypeVar("T")

TimeoutTypes = float | httpx.Timeout | None
ProgressCallback = Callable[[int, int], None]
"""Called as progress(bytes_sent, bytes_total) while a request body is sent."""

_NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")


def _version() -> str:
    from . import __version__

    return __version__


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


def parse_retry_after(headers: httpx.Headers, now: float | None = None) -> float | None:
    """Seconds the server asks us to wait: Retry-After-Ms, else Retry-After (seconds or date)."""
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            value = float(ms) / 1000.0
        except ValueError:
            value = math.nan
        if math.isfinite(value) and value >= 0:
            return value
    ra = headers.get("retry-after")
    if ra is None:
        return None
    try:
        value = float(ra)
    except ValueError:
        parsed = email.utils.parsedate_tz(ra)
        if parsed is None:
            return None
        value = email.utils.mktime_tz(parsed) - (time.time() if now is None else now)
        value = max(value, 0.0)
    if not math.isfinite(value) or value < 0:
        return None
    return value


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


@dataclass
class _RetryState:
    retries_left: int
    retries_done: int = 0
    # True once an attempt may have reached the server without us seeing the answer.
    in_doubt: bool = False


@dataclass
class _Done(Generic[R]):
    value: R


def _header_request_id(headers: Mapping[str, str]) -> str | None:
    for k, v in headers.items():
        if k.lower() == C.REQUEST_ID_HEADER.lower():
            return v
    return None


def _json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"expected a JSON body, got {response.content[:200]!r}") from exc


def _is_json(response: httpx.Response) -> bool:
    return "json" in response.headers.get("content-type", "").lower()


class _BaseClient:
    """Everything Client and AsyncClient share: configuration, request building, answers."""

    def __init__(
        self,
        *,
        base_url: str | httpx.URL | None,
        api_key: str | None,
        timeout: TimeoutTypes,
        max_retries: int,
        default_headers: Mapping[str, str] | None,
    ) -> None:
        if base_url is None:
            base_url = os.environ.get(C.ENV_BASE_URL) or C.DEFAULT_BASE_URL
        url = httpx.URL(str(base_url))
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError(f"base_url must be an http(s) URL such as {C.DEFAULT_BASE_URL}; "
                             f"got {str(base_url)!r}")
        # A trailing slash makes join() keep a path prefix (a server behind /moe/ on a proxy).
        self.base_url = httpx.URL(str(url).rstrip("/") + "/")
        if api_key is None:
            api_key = os.environ.get(C.ENV_API_KEY) or None
        if api_key is not None and not isinstance(api_key, str):
            raise TypeError(f"api_key must be a str or None; got {type(api_key).__name__}")
        self.api_key = api_key
        if isinstance(max_retries, bool) or not isinstance(max_retries, int):
            raise TypeError(f"max_retries must be an int; got {max_retries!r}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0; got {max_retries}")
        self.max_retries = max_retries
        self.timeout = self._check_timeout(timeout)
        self.default_headers = dict(default_headers or {})
        self._random: Callable[[], float] = random.random

    def __repr__(self) -> str:
        key = "set" if self.api_key else "none"
        return (f"{type(self).__name__}(base_url={str(self.base_url)!r}, api_key=<{key}>, "
                f"max_retries={self.max_retries})")

    @staticmethod
    def _check_timeout(timeout: object) -> httpx.Timeout:
        if isinstance(timeout, httpx.Timeout):
            return timeout
        if timeout is None:
            return httpx.Timeout(None)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"timeout must be seconds > 0, an httpx.Timeout or None; got "
                             f"{timeout!r}")
        return httpx.Timeout(float(timeout))

    # -- request building ------------------------------------------------------------------

    def _headers(self, call: _Call[Any]) -> dict[str, str]:
        headers = {
            "User-Agent": f"moe-gemm-client/{_version()} httpx/{httpx.__version__}",
            "Accept": "application/json",
        }
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        headers.update(self.default_headers)
        headers.update(call.headers)
        if call.body is not None:
            headers["Content-Type"] = call.body.content_type
            headers["Content-Length"] = str(call.body.nbytes)
        return headers

    def _build_request(self, http: httpx.Client | httpx.AsyncClient, call: _Call[Any],
                       *, asynchronous: bool) -> httpx.Request:
        content: Any = None
        body = call.body
        if body is not None:
            if call.progress is None and body.nbytes <= C.STREAM_THRESHOLD_BYTES:
                content = body.to_bytes()
            elif asynchronous:
                content = _aiter_body(body, call.progress)
            else:
                content = _iter_body(body, call.progress)
        timeout = self.timeout if call.timeout is None else self._check_timeout(call.timeout)
        return http.build_request(
            call.method,
            self.base_url.join(call.path.lstrip("/")),
            content=content,
            headers=self._headers(call),
            timeout=timeout,
        )

    # -- answers ---------------------------------------------------------------------------

    def _retry_delay(self, state: _RetryState, response: httpx.Response | None) -> float:
        if response is not None:
            after = parse_retry_after(response.headers)
            if after is not None:
                return min(after, C.MAX_RETRY_AFTER)
        base = min(C.INITIAL_RETRY_DELAY * 2.0**state.retries_done, C.MAX_RETRY_DELAY)
        return base * (1.0 - C.RETRY_JITTER * self._random())

    def _take_retry(self, state: _RetryState, response: httpx.Response | None) -> float:
        delay = self._retry_delay(state, response)
        state.retries_left -= 1
        state.retries_done += 1
        return delay

    def _on_transport_error(self, call: _Call[Any], request: httpx.Request, exc: Exception,
                            state: _RetryState) -> float:
        """Decide after a failure with no answer: the delay before retrying, or raise."""
        never_sent = isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout))
        err: APIError
        if isinstance(exc, httpx.TimeoutException):
            err = APITimeoutError(f"Request timed out: {type(exc).__name__}: {exc}".rstrip(": "),
                                  request=request, request_id=call.request_id)
            retryable = True
        elif isinstance(exc, httpx.TransportError):
            err = APIConnectionError(f"Connection error: {type(exc).__name__}: {exc}".rstrip(": "),
                                     request=request, request_id=call.request_id)
            # ConnectError/Read/Write/RemoteProtocol: the network or the server went away.
            # UnsupportedProtocol, ProxyError, LocalProtocolError: our setup; retrying is futile.
            retryable = isinstance(exc, httpx.NetworkError) or isinstance(
                exc, httpx.RemoteProtocolError)
        elif isinstance(exc, httpx.RequestError):
            # DecodingError (a corrupt compressed body), TooManyRedirects: not worth repeating.
            raise APIError(f"{type(exc).__name__}: {exc}", request=request,
                           request_id=call.request_id) from exc
        else:
            raise exc
        if not never_sent:
            state.in_doubt = True
            retryable = retryable and call.retry_safe
        if retryable and state.retries_left > 0:
            return self._take_retry(state, None)
        raise err from exc

    def _on_response(self, call: _Call[R], response: httpx.Response,
                     state: _RetryState) -> _Done[R] | float:
        """Decide after an answer: the parsed result, the delay before retrying, or raise."""
        status = response.status_code
        if 200 <= status < 300 or status in call.answer_statuses:
            return _Done(self._parse(call, response))
        if status == 404 and state.in_doubt and call.gone_after_retry is not None:
            return _Done(call.gone_after_retry())
        if status in C.RETRYABLE_STATUSES and call.retry_safe and state.retries_left > 0:
            return self._take_retry(state, response)
        raise self._status_error(call, response)

    def _request_id(self, call: _Call[Any], response: httpx.Response) -> str | None:
        return response.headers.get(C.REQUEST_ID_HEADER) or call.request_id

    def _parse(self, call: _Call[R], response: httpx.Response) -> R:
        try:
            return call.parse(response)
        except (ValueError, KeyError, TypeError) as exc:
            raise APIResponseValidationError(
                f"unexpected answer to {call.method} {call.path}: {exc}",
                response=response,
                request_id=self._request_id(call, response),
            ) from exc

    def _status_error(self, call: _Call[Any], response: httpx.Response) -> APIStatusError:
        body: Any
        try:
            body = response.json()
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
            body = response.text
        request_id = response.headers.get(C.REQUEST_ID_HEADER)
        message: Any = None
        if isinstance(body, dict):
            message = body.get("error") or body.get("detail") or body.get("message")
            request_id = request_id or (body.get("request_id") if isinstance(
                body.get("request_id"), str) else None)
        elif isinstance(body, str) and body.strip():
            message = body.strip()[:500]
        if message is None:
            message = response.reason_phrase or f"HTTP {response.status_code}"
        elif not isinstance(message, str):
            message = json.dumps(message)
        cls = status_error_class(response.status_code)
        return cls(
            message,
            response=response,
            request_id=request_id or call.request_id,
            body=body,
            retry_after=parse_retry_after(response.headers),
        )

    # -- the calls -------------------------------------------------------------------------

    @staticmethod
    def _common(call: _Call[R], *, request_id: str | None, timeout: TimeoutTypes,
                max_retries: int | None, extra_headers: Mapping[str, str] | None) -> _Call[R]:
        if extra_headers:
            call.headers.update(extra_headers)
        if request_id is not None:
            if not isinstance(request_id, str) or not request_id:
                raise TypeError(f"request_id must be a non-empty str; got {request_id!r}")
            call.headers[C.REQUEST_ID_HEADER] = request_id
        call.request_id = request_id or _header_request_id(call.headers)
        call.timeout = timeout
        if max_retries is not None:
            if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
                raise ValueError(f"max_retries must be an int >= 0; got {max_retries!r}")
            call.max_retries = max_retries
        return call

    def _state(self, call: _Call[Any]) -> _RetryState:
        n = self.max_retries if call.max_retries is None else call.max_retries
        return _RetryState(retries_left=n)

    def _health_call(self, path: str, key: str, **common: Any) -> _Call[bool]:
        def parse(response: httpx.Response) -> bool:
            if response.status_code != 200:
                return False
            try:
                data = response.json()
            except (json.JSONDecodeError, UnicodeDecodeError):
                return True  # the spec allows an empty body: 200 alone means yes
            return not (isinstance(data, dict) and data.get(key) is False)

        call = _Call("GET", path, parse, answer_statuses=frozenset({503}))
        return self._common(call, **common)

    def _list_call(self, **common: Any) -> _Call[list[WeightInfo]]:
        def parse(response: httpx.Response) -> list[WeightInfo]:
            data = _json(response)
            if not isinstance(data, dict) or not isinstance(data.get("weights"), list):
                raise ValueError(f'expected {{"weights": [...]}}; got {data!r:.200}')
            return [WeightInfo.from_json(item) for item in data["weights"]]

        return self._common(_Call("GET", "/v1/weights", parse), **common)

    def _get_call(self, name: str, **common: Any) -> _Call[WeightInfo]:
        name = check_name(name)
        call = _Call("GET", f"/v1/weights/{name}", lambda r: WeightInfo.from_json(_json(r)))
        return self._common(call, **common)

    def _delete_call(self, name: str, **common: Any) -> _Call[WeightDeleted]:
        name = check_name(name)
        call = _Call("DELETE", f"/v1/weights/{name}",
                     lambda r: WeightDeleted.from_json(_json(r)),
                     gone_after_retry=lambda: WeightDeleted(deleted=name))
        return self._common(call, **common)

    def _put_call(self, name: str, w: object, layout: str, progress: ProgressCallback | None,
                  **common: Any) -> _Call[WeightInfo]:
        name = check_name(name)
        if layout not in ("w", "w_t"):
            raise ValueError(f'layout must be "w" (E, K, N) or "w_t" (E, N, K); got {layout!r}')
        hint = "(E, K, N)" if layout == "w" else "(E, N, K)"
        arr, _ = as_data_array(w, "w", hint, 3)
        call = _Call("PUT", f"/v1/weights/{name}", lambda r: WeightInfo.from_json(_json(r)),
                     body=encode_safetensors({layout: arr}), progress=progress)
        return self._common(call, **common)

    def _upload_file_call(self, name: str, path: str | os.PathLike[str], tensor: str | None,
                          layout: str | None, progress: ProgressCallback | None,
                          **common: Any) -> _Call[WeightInfo]:
        name = check_name(name)
        entries = read_safetensors_header(path)
        if tensor is None:
            for candidate in ("w", "w_t"):
                if candidate in entries:
                    tensor = candidate
                    break
            else:
                if len(entries) != 1:
                    raise ValueError(
                        f"{os.fspath(path)} holds {sorted(entries)}; name the tensor to upload "
                        "(tensor=...) or store it as 'w' (E, K, N) or 'w_t' (E, N, K)")
                tensor = next(iter(entries))
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
        if entry.dtype not in ("F32", "F16", "BF16"):
            raise TypeError(f"tensor {tensor!r} must be F32, F16 or BF16; got {entry.dtype}")
        call = _Call("PUT", f"/v1/weights/{name}", lambda r: WeightInfo.from_json(_json(r)),
                     body=FileTensorPayload(path, entry, layout), progress=progress)
        return self._common(call, **common)

    @staticmethod
    def _matmul_headers(priority: int | None, request_timeout_us: int | None) -> dict[str, str]:
        headers = {"Accept": "application/octet-stream, application/json;q=0.9"}
        if priority is not None:
            if isinstance(priority, bool) or not isinstance(priority, int) or priority < 0:
                raise ValueError(f"priority must be an int >= 0 (1 = highest, 0 = default); "
                                 f"got {priority!r}")
            headers[C.PRIORITY_HEADER] = str(priority)
        if request_timeout_us is not None:
            if (isinstance(request_timeout_us, bool) or not isinstance(request_timeout_us, int)
                    or request_timeout_us <= 0):
                raise ValueError(f"request_timeout_us must be an int > 0 (microseconds); "
                                 f"got {request_timeout_us!r}")
            headers[C.TIMEOUT_US_HEADER] = str(request_timeout_us)
        return headers

    def _grouped_mm_call(self, name: str, x: object, counts: object, offs: object,
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
            out = kind.wrap(y)
            return (out, self._request_id(call, response)) if return_request_id else out

        call: _Call[Any] = _Call(
            "POST", f"/v1/weights/{name}/grouped-mm", parse, body=encode_safetensors(tensors),
            headers=self._matmul_headers(priority, request_timeout_us))
        return self._common(call, **common)

    def _grouped_gemm_call(self, a_list: object, b_list: object, return_request_id: bool,
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
        for i, (a, b) in enumerate(zip(a_items, b_items)):
            a_arr, kind = as_data_array(a, f"a_list[{i}]", "(M_i, K_i)", 2)
            b_arr, _ = as_data_array(b, f"b_list[{i}]", "(K_i, N_i)", 2)
            tensors[f"a.{i}"] = a_arr
            tensors[f"b.{i}"] = b_arr
            kinds.append(kind)
            shapes.append((a_arr.shape[0], b_arr.shape[1]))

        def parse(response: httpx.Response) -> Any:
            outs = []
            for i, (m, n) in enumerate(shapes):
                d = _matmul_output(response, f"d.{i}")
                if d.shape != (m, n):
                    raise ValueError(f"expected d.{i} of shape ({m}, {n}); got {d.shape}")
                outs.append(kinds[i].wrap(d))
            return (outs, self._request_id(call, response)) if return_request_id else outs

        call: _Call[Any] = _Call(
            "POST", "/v1/grouped-gemm", parse, body=encode_safetensors(tensors),
            headers=self._matmul_headers(priority, request_timeout_us))
        return self._common(call, **common)


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
        out["y"] = np.asarray(np.asarray(data["y"], dtype=np.float32), dtype=dtype)
    if "d" in data:
        for i, d in enumerate(data["d"]):
            out[f"d.{i}"] = np.asarray(np.asarray(d, dtype=np.float32), dtype=dtype)
    return out


def _iter_body(body: Payload, progress: ProgressCallback | None) -> Iterator[bytes]:
    total, sent = body.nbytes, 0
    if progress is not None:
        progress(0, total)
    for chunk in body.iter_chunks(C.STREAM_CHUNK_BYTES):
        yield chunk  # returns once the transport has taken the chunk
        sent += len(chunk)
        if progress is not None:
            progress(sent, total)


async def _aiter_body(body: Payload, progress: ProgressCallback | None) -> AsyncIterator[bytes]:
    # File chunks are read synchronously: 1 MiB from a local file is far shorter than sending it.
    for chunk in _iter_body(body, progress):
        yield chunk


def _empty_grouped_gemm(return_request_id: bool) -> Any:
    return ([], None) if return_request_id else []


class Client(_BaseClient):
    """Synchronous client of moe-gemm-server.

    Args:
        base_url: The server, e.g. "http://127.0.0.1:8000" (default: $MOE_GEMM_BASE_URL, else
            that). A path prefix is kept ("http://host/moe" talks to /moe/v1/...).
        api_key: Sent as `Authorization: Bearer <key>` (default: $MOE_GEMM_API_KEY, else none).
            Weight changes need the server's admin key.
        timeout: Seconds per connect/read/write phase, an `httpx.Timeout`, or None for none.
            Default: 5 s to connect, 300 s for the rest. Every method also takes `timeout=`.
        max_retries: Retries after the first attempt (default 2); see "Retries" in the module
            docstring or the README. Every method also takes `max_retries=`.
        default_headers: Headers added to every request.
        http_client: An `httpx.Client` to send with (proxies, TLS, a mock transport). It is not
            closed by `close()`; the client's `timeout` still applies per request.

    Every method also takes `request_id=` (sent as X-Request-Id; the server echoes it) and
    `extra_headers=`. Errors raise subclasses of `MoeGemmError` (see `moe_gemm_client`).
    """

    def __init__(
        self,
        base_url: str | httpx.URL | None = None,
        api_key: str | None = None,
        timeout: TimeoutTypes = C.DEFAULT_TIMEOUT,
        max_retries: int = C.DEFAULT_MAX_RETRIES,
        *,
        default_headers: Mapping[str, str] | None = None,
        http_client: httpx.Client | None = None,
    ) -> None:
        super().__init__(base_url=base_url, api_key=api_key, timeout=timeout,
                         max_retries=max_retries, default_headers=default_headers)
        if http_client is not None and not isinstance(http_client, httpx.Client):
            raise TypeError(f"http_client must be an httpx.Client; got "
                            f"{type(http_client).__name__} (AsyncClient takes httpx.AsyncClient)")
        self._owns_http = http_client is None
        self._http = http_client or httpx.Client(limits=C.DEFAULT_CONNECTION_LIMITS,
                                                 follow_redirects=False)
        self._sleep: Callable[[float], None] = time.sleep

    # -- plumbing --------------------------------------------------------------------------

    def close(self) -> None:
        """Close the connection pool (not an http_client passed in)."""
        if self._owns_http:
            self._http.close()

    @property
    def is_closed(self) -> bool:
        return self._http.is_closed

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _request(self, call: _Call[R]) -> R:
        state = self._state(call)
        while True:
            request = self._build_request(self._http, call, asynchronous=False)
            try:
                response = self._http.send(request)
            except httpx.HTTPError as exc:
                delay = self._on_transport_error(call, request, exc, state)
            else:
                outcome = self._on_response(call, response, state)
                if isinstance(outcome, _Done):
                    return outcome.value
                delay = outcome
            self._sleep(delay)

    # -- health ----------------------------------------------------------------------------

    def health(self, *, request_id: str | None = None, timeout: TimeoutTypes = None,
               max_retries: int | None = None,
               extra_headers: Mapping[str, str] | None = None) -> bool:
        """Whether the server process is live (GET /v2/health/live).

        Returns:
            True on 200, False on 503.

        Raises:
            APIConnectionError: the server cannot be reached (after retries).
        """
        return self._request(self._health_call(
            "/v2/health/live", "live", request_id=request_id, timeout=timeout,
            max_retries=max_retries, extra_headers=extra_headers))

    def ready(self, *, request_id: str | None = None, timeout: TimeoutTypes = None,
              max_retries: int | None = None,
              extra_headers: Mapping[str, str] | None = None) -> bool:
        """Whether the server is ready to compute (GET /v2/health/ready).

        Returns:
            True on 200; False on 503 (warming up, draining). A 503 is an answer here and is
            not retried.

        Raises:
            APIConnectionError: the server cannot be reached (after retries).
        """
        return self._request(self._health_call(
            "/v2/health/ready", "ready", request_id=request_id, timeout=timeout,
            max_retries=max_retries, extra_headers=extra_headers))

    def wait_until_ready(self, timeout: float = 60.0, *, interval: float = 0.25) -> bool:
        """Poll ready() until it says yes or `timeout` seconds pass.

        Connection errors count as "not yet" (the server may still be starting).

        Returns:
            True once ready, False if the deadline passed first.
        """
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                if self.ready(max_retries=0, timeout=max(min(left, 5.0), 0.05)):
                    return True
            except APIConnectionError:
                pass
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._sleep(min(interval, left))

    # -- weights ---------------------------------------------------------------------------

    def list_weights(self, *, request_id: str | None = None, timeout: TimeoutTypes = None,
                     max_retries: int | None = None,
                     extra_headers: Mapping[str, str] | None = None) -> list[WeightInfo]:
        """The resident weight sets (GET /v1/weights)."""
        return self._request(self._list_call(
            request_id=request_id, timeout=timeout, max_retries=max_retries,
            extra_headers=extra_headers))

    def get_weights(self, name: str, *, request_id: str | None = None,
                    timeout: TimeoutTypes = None, max_retries: int | None = None,
                    extra_headers: Mapping[str, str] | None = None) -> WeightInfo:
        """Metadata of one weight set (GET /v1/weights/{name}).

        Raises:
            NotFoundError: no weight set of that name.
            ValueError: the name is not 1-128 characters from [A-Za-z0-9._-].
        """
        return self._request(self._get_call(
            name, request_id=request_id, timeout=timeout, max_retries=max_retries,
            extra_headers=extra_headers))

    def put_weights(self, name: str, w: Any, *, layout: Literal["w", "w_t"] = "w",
                    progress: ProgressCallback | None = None, request_id: str | None = None,
                    timeout: TimeoutTypes = None, max_retries: int | None = None,
                    extra_headers: Mapping[str, str] | None = None) -> WeightInfo:
        """Upload (or replace) a weight set (PUT /v1/weights/{name}).

        Args:
            name: 1-128 characters from [A-Za-z0-9._-], not starting with ".".
            w: float32/float16/bfloat16 numpy array (ml_dtypes.bfloat16) or torch tensor,
                (E, K, N) for layout "w", (E, N, K) for layout "w_t". Sent in its own dtype
                (bf16 as raw bf16, never via float32), streamed when large.
            layout: "w" or "w_t", as above.
            progress: Called as progress(bytes_sent, bytes_total) while the body is sent.

        Returns:
            The stored weight set's WeightInfo (acknowledged once durable on the server).

        Raises:
            PermissionDeniedError: the key is not the server's admin key.
            UnprocessableEntityError: the server rejected the shape or dtype.
        """
        return self._request(self._put_call(
            name, w, layout, progress, request_id=request_id, timeout=timeout,
            max_retries=max_retries, extra_headers=extra_headers))

    def upload_safetensors(self, name: str, path: str | os.PathLike[str], *,
                           tensor: str | None = None, layout: Literal["w", "w_t"] | None = None,
                           progress: ProgressCallback | None = None,
                           request_id: str | None = None, timeout: TimeoutTypes = None,
                           max_retries: int | None = None,
                           extra_headers: Mapping[str, str] | None = None) -> WeightInfo:
        """Upload one tensor of a .safetensors file as a weight set, streamed from disk.

        Args:
            name: The weight set's name.
            path: The .safetensors file.
            tensor: Which tensor of the file (default: "w", else "w_t", else the only one).
            layout: "w" (E, K, N) or "w_t" (E, N, K) (default: the tensor's name if it is one
                of those, else "w").
            progress: Called as progress(bytes_sent, bytes_total).
        """
        return self._request(self._upload_file_call(
            name, path, tensor, layout, progress, request_id=request_id, timeout=timeout,
            max_retries=max_retries, extra_headers=extra_headers))

    def delete_weights(self, name: str, *, request_id: str | None = None,
                       timeout: TimeoutTypes = None, max_retries: int | None = None,
                       extra_headers: Mapping[str, str] | None = None) -> WeightDeleted:
        """Delete a weight set (DELETE /v1/weights/{name}).

        Raises:
            NotFoundError: no weight set of that name.
        """
        return self._request(self._delete_call(
            name, request_id=request_id, timeout=timeout, max_retries=max_retries,
            extra_headers=extra_headers))

    # -- matmuls ---------------------------------------------------------------------------

    @overload
    def grouped_mm(self, name: str, x: T, counts: Any = None, offs: Any = None, *,
                   return_request_id: Literal[False] = False, priority: int | None = None,
                   request_timeout_us: int | None = None, request_id: str | None = None,
                   timeout: TimeoutTypes = None, max_retries: int | None = None,
                   extra_headers: Mapping[str, str] | None = None) -> T: ...

    @overload
    def grouped_mm(self, name: str, x: T, counts: Any = None, offs: Any = None, *,
                   return_request_id: Literal[True], priority: int | None = None,
                   request_timeout_us: int | None = None, request_id: str | None = None,
                   timeout: TimeoutTypes = None, max_retries: int | None = None,
                   extra_headers: Mapping[str, str] | None = None) -> tuple[T, str | None]: ...

    def grouped_mm(self, name: str, x: Any, counts: Any = None, offs: Any = None, *,
                   return_request_id: bool = False, priority: int | None = None,
                   request_timeout_us: int | None = None, request_id: str | None = None,
                   timeout: TimeoutTypes = None, max_retries: int | None = None,
                   extra_headers: Mapping[str, str] | None = None) -> Any:
        """y = x @ w per expert, against the resident weight set `name`.

        Rows of x are grouped by expert: the first counts[0] rows use expert 0, the next
        counts[1] expert 1, and so on (or offs, the cumulative ends: offs[e] = sum(counts[:e+1])).

        Args:
            name: The weight set, of (E, K, N) experts.
            x: (T, K) float32/float16/bfloat16 numpy array or torch tensor. Its dtype must be
                the weight set's or float32.
            counts: (E,) non-negative ints summing to T (array, tensor or list; sent as int32).
            offs: (E,) non-decreasing cumulative ends with offs[-1] == T. Exactly one of
                counts and offs.
            return_request_id: Also return the server's X-Request-Id: (y, request_id).
            priority: X-Priority (0 = default, 1 = highest).
            request_timeout_us: X-Timeout-Us: the server gives up (504) if the request has not
                started within this many microseconds.

        Returns:
            y (T, N) in x's dtype and kind: numpy in -> numpy out; torch in -> torch out, on
            x's device.

        Raises:
            TypeError / ValueError: x is not 2-D float, counts/offs not 1-D ints, both or
                neither given (raised before any request).
            NotFoundError: no weight set `name`.
            UnprocessableEntityError: K mismatch, counts negative or not summing to T, ...
        """
        return self._request(self._grouped_mm_call(
            name, x, counts, offs, return_request_id, priority, request_timeout_us,
            request_id=request_id, timeout=timeout, max_retries=max_retries,
            extra_headers=extra_headers))

    def grouped_gemm(self, a_list: Sequence[Any], b_list: Sequence[Any], *,
                     return_request_id: bool = False, priority: int | None = None,
                     request_timeout_us: int | None = None, request_id: str | None = None,
                     timeout: TimeoutTypes = None, max_retries: int | None = None,
                     extra_headers: Mapping[str, str] | None = None) -> Any:
        """D_i = A_i @ B_i for independent problems of any sizes (POST /v1/grouped-gemm).

        Args:
            a_list: A_i, each (M_i, K_i), float32/float16/bfloat16 arrays or tensors.
            b_list: B_i, each (K_i, N_i), one per A_i.
            return_request_id: Also return the server's X-Request-Id: (d_list, request_id).
            priority, request_timeout_us: As for grouped_mm.

        Returns:
            [D_0, D_1, ...], each (M_i, N_i) in the kind of A_i (torch on A_i's device). Empty
            lists give [] without a request.

        Raises:
            TypeError / ValueError: not lists of 2-D float arrays of equal length.
            UnprocessableEntityError: K_i mismatch, mixed dtypes, over the FLOPs limit.
        """
        call = self._grouped_gemm_call(
            a_list, b_list, return_request_id, priority, request_timeout_us,
            request_id=request_id, timeout=timeout, max_retries=max_retries,
            extra_headers=extra_headers)
        if call is None:
            return _empty_grouped_gemm(return_request_id)
        return self._request(call)


class AsyncClient(_BaseClient):
    """Asynchronous client of moe-gemm-server; the same arguments and methods as `Client`,
    as coroutines. Works under asyncio and trio (through anyio, as httpx does).

    Args:
        base_url, api_key, timeout, max_retries, default_headers: As for `Client`.
        http_client: An `httpx.AsyncClient` to send with; not closed by `close()`.
    """

    def __init__(
        self,
        base_url: str | httpx.URL | None = None,
        api_key: str | None = None,
        timeout: TimeoutTypes = C.DEFAULT_TIMEOUT,
        max_retries: int = C.DEFAULT_MAX_RETRIES,
        *,
        default_headers: Mapping[str, str] | None = None,
        http_client: httpx.AsyncClient | None = None,
    ) -> None:
        super().__init__(base_url=base_url, api_key=api_key, timeout=timeout,
                         max_retries=max_retries, default_headers=default_headers)
        if http_client is not None and not isinstance(http_client, httpx.AsyncClient):
            raise TypeError(f"http_client must be an httpx.AsyncClient; got "
                            f"{type(http_client).__name__}")
        self._owns_http = http_client is None
        self._http = http_client or httpx.AsyncClient(limits=C.DEFAULT_CONNECTION_LIMITS,
                                                      follow_redirects=False)
        self._sleep: Callable[[float], Any] = anyio.sleep

    async def close(self) -> None:
        """Close the connection pool (not an http_client passed in)."""
        if self._owns_http:
            await self._http.aclose()

    @property
    def is_closed(self) -> bool:
        return self._http.is_closed

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _request(self, call: _Call[R]) -> R:
        state = self._state(call)
        while True:
            request = self._build_request(self._http, call, asynchronous=True)
            try:
                response = await self._http.send(request)
            except httpx.HTTPError as exc:
                delay = self._on_transport_error(call, request, exc, state)
            else:
                outcome = self._on_response(call, response, state)
                if isinstance(outcome, _Done):
                    return outcome.value
                delay = outcome
            await self._sleep(delay)

    async def health(self, *, request_id: str | None = None, timeout: TimeoutTypes = None,
                     max_retries: int | None = None,
                     extra_headers: Mapping[str, str] | None = None) -> bool:
        """Whether the server process is live; see `Client.health`."""
        return await self._request(self._health_call(
            "/v2/health/live", "live", request_id=request_id, timeout=timeout,
            max_retries=max_retries, extra_headers=extra_headers))

    async def ready(self, *, request_id: str | None = None, timeout: TimeoutTypes = None,
                    max_retries: int | None = None,
                    extra_headers: Mapping[str, str] | None = None) -> bool:
        """Whether the server is ready to compute; see `Client.ready`."""
        return await self._request(self._health_call(
            "/v2/health/ready", "ready", request_id=request_id, timeout=timeout,
            max_retries=max_retries, extra_headers=extra_headers))

    async def wait_until_ready(self, timeout: float = 60.0, *, interval: float = 0.25) -> bool:
        """Poll ready() until it says yes or `timeout` seconds pass; see `Client`."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                if await self.ready(max_retries=0, timeout=max(min(left, 5.0), 0.05)):
                    return True
            except APIConnectionError:
                pass
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            await self._sleep(min(interval, left))

    async def list_weights(self, *, request_id: str | None = None, timeout: TimeoutTypes = None,
                           max_retries: int | None = None,
                           extra_headers: Mapping[str, str] | None = None) -> list[WeightInfo]:
        """The resident weight sets; see `Client.list_weights`."""
        return await self._request(self._list_call(
            request_id=request_id, timeout=timeout, max_retries=max_retries,
            extra_headers=extra_headers))

    async def get_weights(self, name: str, *, request_id: str | None = None,
                          timeout: TimeoutTypes = None, max_retries: int | None = None,
                          extra_headers: Mapping[str, str] | None = None) -> WeightInfo:
        """Metadata of one weight set; see `Client.get_weights`."""
        return await self._request(self._get_call(
            name, request_id=request_id, timeout=timeout, max_retries=max_retries,
            extra_headers=extra_headers))

    async def put_weights(self, name: str, w: Any, *, layout: Literal["w", "w_t"] = "w",
                          progress: ProgressCallback | None = None,
                          request_id: str | None = None, timeout: TimeoutTypes = None,
                          max_retries: int | None = None,
                          extra_headers: Mapping[str, str] | None = None) -> WeightInfo:
        """Upload (or replace) a weight set; see `Client.put_weights`."""
        return await self._request(self._put_call(
            name, w, layout, progress, request_id=request_id, timeout=timeout,
            max_retries=max_retries, extra_headers=extra_headers))

    async def upload_safetensors(self, name: str, path: str | os.PathLike[str], *,
                                 tensor: str | None = None,
                                 layout: Literal["w", "w_t"] | None = None,
                                 progress: ProgressCallback | None = None,
                                 request_id: str | None = None, timeout: TimeoutTypes = None,
                                 max_retries: int | None = None,
                                 extra_headers: Mapping[str, str] | None = None) -> WeightInfo:
        """Upload one tensor of a .safetensors file; see `Client.upload_safetensors`."""
        return await self._request(self._upload_file_call(
            name, path, tensor, layout, progress, request_id=request_id, timeout=timeout,
            max_retries=max_retries, extra_headers=extra_headers))

    async def delete_weights(self, name: str, *, request_id: str | None = None,
                             timeout: TimeoutTypes = None, max_retries: int | None = None,
                             extra_headers: Mapping[str, str] | None = None) -> WeightDeleted:
        """Delete a weight set; see `Client.delete_weights`."""
        return await self._request(self._delete_call(
            name, request_id=request_id, timeout=timeout, max_retries=max_retries,
            extra_headers=extra_headers))

    @overload
    async def grouped_mm(self, name: str, x: T, counts: Any = None, offs: Any = None, *,
                         return_request_id: Literal[False] = False, priority: int | None = None,
                         request_timeout_us: int | None = None, request_id: str | None = None,
                         timeout: TimeoutTypes = None, max_retries: int | None = None,
                         extra_headers: Mapping[str, str] | None = None) -> T: ...

    @overload
    async def grouped_mm(self, name: str, x: T, counts: Any = None, offs: Any = None, *,
                         return_request_id: Literal[True], priority: int | None = None,
                         request_timeout_us: int | None = None, request_id: str | None = None,
                         timeout: TimeoutTypes = None, max_retries: int | None = None,
                         extra_headers: Mapping[str, str] | None = None
                         ) -> tuple[T, str | None]: ...

    async def grouped_mm(self, name: str, x: Any, counts: Any = None, offs: Any = None, *,
                         return_request_id: bool = False, priority: int | None = None,
                         request_timeout_us: int | None = None, request_id: str | None = None,
                         timeout: TimeoutTypes = None, max_retries: int | None = None,
                         extra_headers: Mapping[str, str] | None = None) -> Any:
        """y = x @ w per expert; see `Client.grouped_mm`."""
        return await self._request(self._grouped_mm_call(
            name, x, counts, offs, return_request_id, priority, request_timeout_us,
            request_id=request_id, timeout=timeout, max_retries=max_retries,
            extra_headers=extra_headers))

    async def grouped_gemm(self, a_list: Sequence[Any], b_list: Sequence[Any], *,
                           return_request_id: bool = False, priority: int | None = None,
                           request_timeout_us: int | None = None, request_id: str | None = None,
                           timeout: TimeoutTypes = None, max_retries: int | None = None,
                           extra_headers: Mapping[str, str] | None = None) -> Any:
        """D_i = A_i @ B_i; see `Client.grouped_gemm`."""
        call = self._grouped_gemm_call(
            a_list, b_list, return_request_id, priority, request_timeout_us,
            request_id=request_id, timeout=timeout, max_retries=max_retries,
            extra_headers=extra_headers)
        if call is None:
            return _empty_grouped_gemm(return_request_id)
        return await self._request(call)
