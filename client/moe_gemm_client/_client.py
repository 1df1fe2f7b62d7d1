"""`Client`: the synchronous client of moe-gemm-server (docs/HTTP-API.md) over httpx.

The calls are described in `_calls.py` and answered by the rules of `_base.py` (retries, error
mapping); here `_SyncTransport` only sends and sleeps, and `Client` exposes the methods.
`AsyncClient` (`_async_client.py`) is the same with `await`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypeVar, overload

import httpx

from . import _calls as calls
from . import _constants as C
from ._base import _BaseClient, _Done
from ._calls import ProgressCallback, TimeoutTypes, _Call
from ._exceptions import APIConnectionError, APIStatusError
from .types import WeightDeleted, WeightInfo, WeightList

R = TypeVar("R")
T = TypeVar("T")
_Transport = TypeVar("_Transport", bound="_SyncTransport")

__all__ = ["Client"]


class _SyncTransport(_BaseClient):
    """What `Client` sends with: its httpx.Client (a pool of its own, or the caller's, which
    `close()` leaves open), and the attempt loop over it: send, let `_BaseClient` judge the
    answer or the failure, sleep out the delay it names, send again."""

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

    def close(self) -> None:
        """Close the connection pool (not an http_client passed in). Calls afterwards raise
        ClientClosedError."""
        self._closed = True
        if self._owns_http:
            self._http.close()

    @property
    def is_closed(self) -> bool:
        return self._closed or self._http.is_closed

    def __enter__(self: _Transport) -> _Transport:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _request(self, call: _Call[R]) -> R:
        self._check_open(self._http)
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


class Client(_SyncTransport):
    """Synchronous client of moe-gemm-server.

    Args:
        base_url: The server, e.g. "http://127.0.0.1:8000" (default: $MOE_GEMM_BASE_URL, else
            that). A path prefix is kept ("http://host/moe" talks to /moe/v1/...).
        api_key: Sent as `Authorization: Bearer <key>` (default: $MOE_GEMM_API_KEY, else none).
            Weight changes need the server's admin key.
        timeout: Seconds per connect/read/write phase, an `httpx.Timeout`, or None for none.
            Default: 5 s to connect, 300 s for the rest. Every method also takes `timeout=`.
        max_retries: Retries after the first attempt (default 2); the rule is in the README
            ("Retries") and in `moe_gemm_client._base`. Every method also takes `max_retries=`.
        default_headers: Headers added to every request.
        http_client: An `httpx.Client` to send with (proxies, TLS, a mock transport). It is not
            closed by `close()`; the client's `timeout` still applies per request.

    Every method also takes `request_id=` (sent as X-Request-Id; the server echoes it) and
    `extra_headers=`. Errors raise subclasses of `MoeGemmError` (see `moe_gemm_client`).
    """

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
        return self._request(calls.health_call(
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
        return self._request(calls.health_call(
            "/v2/health/ready", "ready", request_id=request_id, timeout=timeout,
            max_retries=max_retries, extra_headers=extra_headers))

    def wait_until_ready(self, timeout: float = 60.0, *, interval: float = 0.25,
                         raise_unreachable: bool = False) -> bool:
        """Poll ready() until it says yes or `timeout` seconds pass.

        Connection errors count as "not yet" (the server may still be starting), and so do the
        statuses the client retries (408, 429, 502: a gateway whose server is not up yet).

        Args:
            raise_unreachable: if the last poll before the deadline could not reach the
                server, raise its APIConnectionError instead of returning False (False then
                means the server answered "not ready").

        Returns:
            True once ready, False if the deadline passed first.

        Raises:
            TypeError / ValueError: timeout or interval not seconds >= 0 (inf waits without a
                deadline), before the first poll.
        """
        self._check_wait(timeout, interval)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            unreachable: APIConnectionError | None = None
            try:
                if self.ready(max_retries=0, timeout=max(min(left, 5.0), 0.05)):
                    return True
            except APIConnectionError as exc:
                unreachable = exc
            except APIStatusError as exc:
                if not self._not_ready_yet(exc):
                    raise
            left = deadline - time.monotonic()
            if left <= 0:
                if raise_unreachable and unreachable is not None:
                    raise unreachable
                return False
            self._sleep(min(interval, left))

    # -- weights ---------------------------------------------------------------------------

    def list_weights(self, *, request_id: str | None = None, timeout: TimeoutTypes = None,
                     max_retries: int | None = None,
                     extra_headers: Mapping[str, str] | None = None) -> WeightList:
        """The resident weight sets (GET /v1/weights): a list of WeightInfo whose
        `not_loaded` names the sets stored on the server but not served from its memory now
        (each with the status a request for it gets: 507 left out for room, 503 unreadable)."""
        return self._request(calls.list_call(
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
        return self._request(calls.get_call(
            name, request_id=request_id, timeout=timeout, max_retries=max_retries,
            extra_headers=extra_headers))

    def put_weights(self, name: str, w: Any, *, scale: Any = None,
                    layout: Literal["w", "w_t"] = "w", progress: ProgressCallback | None = None,
                    request_id: str | None = None, timeout: TimeoutTypes = None,
                    max_retries: int | None = None,
                    extra_headers: Mapping[str, str] | None = None) -> WeightInfo:
        """Upload (or replace) a weight set (PUT /v1/weights/{name}).

        Args:
            name: 1-128 characters from [A-Za-z0-9._-], not starting with ".".
            w: numpy array or torch tensor, (E, K, N) for layout "w", (E, N, K) for layout
                "w_t": float32/float16/bfloat16 (numpy: ml_dtypes.bfloat16), or FP8
                (float8_e4m3fn / float8_e5m2; numpy: ml_dtypes) together with `scale`. Sent in
                its own dtype (bf16 and FP8 as their raw bytes, never via float32), streamed
                when large.
            scale: For FP8 `w` only, and required then: its float32 decoding scale
                (w = fp8 * scale), a numpy array or torch tensor in w's own orientation:
                128x128 blocks (E, K/128, ceil(N/128)) for "w" or (E, ceil(N/128), K/128) for
                "w_t" (K a multiple of 128), per output channel (E, N), or per expert (E,) /
                one value ((1,) or ()).
            layout: "w" or "w_t", as above.
            progress: Called as progress(bytes_sent, bytes_total) while the body is sent.

        Returns:
            The stored weight set's WeightInfo (acknowledged once durable on the server); for
            FP8, dtype "float8_e4m3fn" / "float8_e5m2" and `scales` "block" | "row" | "tensor".

        Raises:
            TypeError: w neither float32/float16/bfloat16 nor FP8; scale not float32 (raised
                before any request).
            ValueError: w not 3-D; FP8 w without scale, or scale with 16/32-bit w; a scale
                whose shape fits no granularity above, or holding NaN / infinity (raised
                before any request).
            PermissionDeniedError: the key is not the server's admin key.
            UnprocessableEntityError: the server rejected the shape or dtype.
        """
        return self._request(calls.put_call(
            name, w, scale, layout, progress, request_id=request_id, timeout=timeout,
            max_retries=max_retries, extra_headers=extra_headers))

    def upload_safetensors(self, name: str, path: str | os.PathLike[str], *,
                           tensor: str | None = None, layout: Literal["w", "w_t"] | None = None,
                           scale_tensor: str | None = None,
                           progress: ProgressCallback | None = None,
                           request_id: str | None = None, timeout: TimeoutTypes = None,
                           max_retries: int | None = None,
                           extra_headers: Mapping[str, str] | None = None) -> WeightInfo:
        """Upload one tensor of a .safetensors file as a weight set, streamed from disk.

        Args:
            name: The weight set's name.
            path: The .safetensors file.
            tensor: Which tensor of the file (default: "w", else "w_t", else the only one
                besides an FP8 scale).
            layout: "w" (E, K, N) or "w_t" (E, N, K) (default: the tensor's name if it is one
                of those, else "w").
            scale_tensor: For an F8_E4M3 / F8_E5M2 tensor, the file's F32 tensor holding its
                decoding scale (default "scale"; shapes as for `put_weights`' scale). Sent
                beside it, as "scale".
            progress: Called as progress(bytes_sent, bytes_total).

        Raises:
            TypeError / ValueError: as for `put_weights`, from the file's header (before any
                request); OSError: the file cannot be read.
        """
        return self._request(calls.upload_file_call(
            name, path, tensor, layout, scale_tensor, progress, request_id=request_id,
            timeout=timeout, max_retries=max_retries, extra_headers=extra_headers))

    def delete_weights(self, name: str, *, request_id: str | None = None,
                       timeout: TimeoutTypes = None, max_retries: int | None = None,
                       extra_headers: Mapping[str, str] | None = None) -> WeightDeleted:
        """Delete a weight set (DELETE /v1/weights/{name}).

        Raises:
            NotFoundError: no weight set of that name.
        """
        return self._request(calls.delete_call(
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
            request_timeout_us: X-Timeout-Us: the server answers 504 if y is not ready this
                many microseconds after the request arrived, whether it is still queued or
                already running (its result is then discarded, never sent late).

        Returns:
            y (T, N) in x's dtype and kind: numpy in -> numpy out; torch in -> torch out, on
            x's device.

        Raises:
            TypeError / ValueError: x is not 2-D float, counts/offs not 1-D ints, both or
                neither given (raised before any request).
            NotFoundError: no weight set `name`.
            UnprocessableEntityError: K mismatch, counts negative or not summing to T, ...
            GatewayTimeoutError: request_timeout_us passed first (504; not retried).
        """
        return self._request(calls.grouped_mm_call(
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
        call = calls.grouped_gemm_call(
            a_list, b_list, return_request_id, priority, request_timeout_us,
            request_id=request_id, timeout=timeout, max_retries=max_retries,
            extra_headers=extra_headers)
        if call is None:
            return calls.empty_grouped_gemm(return_request_id)
        return self._request(call)
