"""`AsyncClient`: the asynchronous client of moe-gemm-server; `Client`'s methods as coroutines.

Works under asyncio and trio (through anyio, as httpx does). The calls and the decisions on
answers are shared with `Client` (`_calls.py`, `_base.py`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypeVar, overload

import anyio  # a hard dependency of httpx, so always present alongside it
import anyio.lowlevel
import httpx

from . import _calls as calls
from . import _constants as C
from ._base import _BaseClient, _Done
from ._calls import ProgressCallback, TimeoutTypes, _Call
from ._exceptions import APIConnectionError, APIStatusError
from .types import WeightDeleted, WeightInfo, WeightList

R = TypeVar("R")
T = TypeVar("T")

__all__ = ["AsyncClient"]


def _new_pool() -> httpx.AsyncClient:
    return httpx.AsyncClient(limits=C.DEFAULT_CONNECTION_LIMITS, follow_redirects=False)


def _running_loop() -> object:
    """The running event loop (asyncio) or run (trio), as an object compared by identity.

    anyio >= 4.11 wraps the backend's own token in an EventLoopToken; earlier versions return
    it directly (the asyncio loop, trio's TrioToken).
    """
    token = anyio.lowlevel.current_token()
    return getattr(token, "native_token", token)


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
        self._http = http_client or _new_pool()
        # The event loop whose connections the owned pool holds (None: not used yet).
        self._loop: object | None = None
        self._sleep: Callable[[float], Any] = anyio.sleep

    def _pool(self) -> httpx.AsyncClient:
        """The httpx client to send with in the running event loop.

        A pooled connection belongs to the loop that opened it: after `asyncio.run()` returns,
        the next `asyncio.run()` found the first loop's keep-alive connection in the pool and
        failed its first call with "RuntimeError: Event loop is closed". An owned pool first
        used in another loop is therefore replaced by a fresh one. The old one is dropped, not
        awaited: closing its connections needs their own loop, which is gone (their sockets
        close when collected). An http_client passed in is the caller's to manage and is
        always used as it is.
        """
        if not self._owns_http or self._http.is_closed:
            return self._http  # (a closed client stays closed: _request refused it before)
        loop = _running_loop()
        if self._loop is not None and loop is not self._loop:
            self._http = _new_pool()
        self._loop = loop
        return self._http

    async def close(self) -> None:
        """Close the connection pool (not an http_client passed in). Calls afterwards raise
        ClientClosedError."""
        self._closed = True
        if self._owns_http:
            if self._loop is not None and _running_loop() is not self._loop:
                # Its connections belong to an earlier loop: aclose() here would raise
                # "Event loop is closed"; a fresh pool closes cleanly and leaves is_closed set.
                self._http = _new_pool()
            await self._http.aclose()

    @property
    def is_closed(self) -> bool:
        return self._closed or self._http.is_closed

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _request(self, call: _Call[R]) -> R:
        self._check_open(self._http)
        state = self._state(call)
        http = self._pool()
        while True:
            request = self._build_request(http, call, asynchronous=True)
            try:
                response = await http.send(request)
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
        return await self._request(calls.health_call(
            "/v2/health/live", "live", request_id=request_id, timeout=timeout,
            max_retries=max_retries, extra_headers=extra_headers))

    async def ready(self, *, request_id: str | None = None, timeout: TimeoutTypes = None,
                    max_retries: int | None = None,
                    extra_headers: Mapping[str, str] | None = None) -> bool:
        """Whether the server is ready to compute; see `Client.ready`."""
        return await self._request(calls.health_call(
            "/v2/health/ready", "ready", request_id=request_id, timeout=timeout,
            max_retries=max_retries, extra_headers=extra_headers))

    async def wait_until_ready(self, timeout: float = 60.0, *, interval: float = 0.25,
                               raise_unreachable: bool = False) -> bool:
        """Poll ready() until it says yes or `timeout` seconds pass; see `Client`."""
        self._check_wait(timeout, interval)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            unreachable: APIConnectionError | None = None
            try:
                if await self.ready(max_retries=0, timeout=max(min(left, 5.0), 0.05)):
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
            await self._sleep(min(interval, left))

    async def list_weights(self, *, request_id: str | None = None, timeout: TimeoutTypes = None,
                           max_retries: int | None = None,
                           extra_headers: Mapping[str, str] | None = None) -> WeightList:
        """The resident weight sets; see `Client.list_weights`."""
        return await self._request(calls.list_call(
            request_id=request_id, timeout=timeout, max_retries=max_retries,
            extra_headers=extra_headers))

    async def get_weights(self, name: str, *, request_id: str | None = None,
                          timeout: TimeoutTypes = None, max_retries: int | None = None,
                          extra_headers: Mapping[str, str] | None = None) -> WeightInfo:
        """Metadata of one weight set; see `Client.get_weights`."""
        return await self._request(calls.get_call(
            name, request_id=request_id, timeout=timeout, max_retries=max_retries,
            extra_headers=extra_headers))

    async def put_weights(self, name: str, w: Any, *, scale: Any = None,
                          layout: Literal["w", "w_t"] = "w",
                          progress: ProgressCallback | None = None,
                          request_id: str | None = None, timeout: TimeoutTypes = None,
                          max_retries: int | None = None,
                          extra_headers: Mapping[str, str] | None = None) -> WeightInfo:
        """Upload (or replace) a weight set, FP8 with its `scale`; see `Client.put_weights`."""
        return await self._request(calls.put_call(
            name, w, scale, layout, progress, request_id=request_id, timeout=timeout,
            max_retries=max_retries, extra_headers=extra_headers))

    async def upload_safetensors(self, name: str, path: str | os.PathLike[str], *,
                                 tensor: str | None = None,
                                 layout: Literal["w", "w_t"] | None = None,
                                 scale_tensor: str | None = None,
                                 progress: ProgressCallback | None = None,
                                 request_id: str | None = None, timeout: TimeoutTypes = None,
                                 max_retries: int | None = None,
                                 extra_headers: Mapping[str, str] | None = None) -> WeightInfo:
        """Upload one tensor of a .safetensors file (an FP8 one with its scale); see
        `Client.upload_safetensors`."""
        return await self._request(calls.upload_file_call(
            name, path, tensor, layout, scale_tensor, progress, request_id=request_id,
            timeout=timeout, max_retries=max_retries, extra_headers=extra_headers))

    async def delete_weights(self, name: str, *, request_id: str | None = None,
                             timeout: TimeoutTypes = None, max_retries: int | None = None,
                             extra_headers: Mapping[str, str] | None = None) -> WeightDeleted:
        """Delete a weight set; see `Client.delete_weights`."""
        return await self._request(calls.delete_call(
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
        return await self._request(calls.grouped_mm_call(
            name, x, counts, offs, return_request_id, priority, request_timeout_us,
            request_id=request_id, timeout=timeout, max_retries=max_retries,
            extra_headers=extra_headers))

    async def grouped_gemm(self, a_list: Sequence[Any], b_list: Sequence[Any], *,
                           return_request_id: bool = False, priority: int | None = None,
                           request_timeout_us: int | None = None, request_id: str | None = None,
                           timeout: TimeoutTypes = None, max_retries: int | None = None,
                           extra_headers: Mapping[str, str] | None = None) -> Any:
        """D_i = A_i @ B_i; see `Client.grouped_gemm`."""
        call = calls.grouped_gemm_call(
            a_list, b_list, return_request_id, priority, request_timeout_us,
            request_id=request_id, timeout=timeout, max_retries=max_retries,
            extra_headers=extra_headers)
        if call is None:
            return calls.empty_grouped_gemm(return_request_id)
        return await self._request(call)
