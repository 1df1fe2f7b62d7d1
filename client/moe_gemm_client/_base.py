"""`_BaseClient`: what `Client` and `AsyncClient` share, so that they cannot drift apart.

Every request is first described as a `_Call` (method, path, headers, body, how to parse the
answer; `_calls.py`), and every answer and failure goes through the same `_on_response` /
`_on_transport_error` decisions here. The only code that differs between the two clients is
the loop that sends and sleeps (`send` vs `await send`: `_client.py`, `_async_client.py`).

Retries (the rule, also in the README):
- Every route of this API is safe to repeat: GET, PUT (a full replacement of one weight set) and
  DELETE are idempotent by HTTP semantics, and the two POST matmul routes are pure functions of
  their body that change no server state. A request is retried when
  * no answer came back: the connection was refused, reset or closed, a protocol error, or a
    timeout (connect, read, write or pool; as in openai-python, each attempt gets the full
    `timeout` again); or
  * the server answered 408, 429, 502 or 503 (429 and 503 come with Retry-After).
- Never retried: other 4xx (the same request would fail the same way), 500 (a server bug
  repeats), 504 (the request's own X-Timeout-Us deadline passed), an answer whose error code
  says it lasts (`PERMANENT_ERROR_CODES`: the 503 of a stored weight set that cannot be read),
  and setup errors (a bad URL scheme, a proxy error).
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
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import httpx

from . import _constants as C
from ._calls import (
    JSON_ERRORS,
    ProgressCallback,
    TimeoutTypes,
    _Call,
    answer_request_id,
    check_headers,
    set_header,
)
from ._exceptions import (
    APIConnectionError,
    APIError,
    APIResponseValidationError,
    APIStatusError,
    APITimeoutError,
    ClientClosedError,
    status_error_class,
)
from ._tensors import Payload

R = TypeVar("R")

# What a key can hold in an HTTP/1.1 header value: printable ASCII (no line breaks).
# No spaces: the server's keys have none, and one at the end of the header value (a key read
# with a trailing blank) makes h11 refuse every request, reported as a connection error.
_API_KEY_RE = re.compile(r"[\x21-\x7e]+")
# "scheme://" then everything up to the last "@" before the path, query or fragment.
_USERINFO_RE = re.compile(r"^(\s*[A-Za-z][A-Za-z0-9+.-]*://)[^/?#]*@")


def _without_userinfo(url: str) -> str:
    """`url` with any "user:password@" masked, for error messages (the text is masked, not a
    parsed httpx.URL, because a URL that fails to parse is echoed too)."""
    return _USERINFO_RE.sub(r"\1***@", url)


def _version() -> str:
    from . import __version__

    return __version__



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
        try:
            stamp = email.utils.mktime_tz(parsed)
        except (ValueError, OverflowError):
            # A date the platform cannot represent (year 99999, from a proxy or a broken
            # gateway) says nothing usable; raising here would replace the status error.
            return None
        value = stamp - (time.time() if now is None else now)
        value = max(value, 0.0)
    if not math.isfinite(value) or value < 0:
        return None
    return value



def error_code(response: httpx.Response) -> str | None:
    """The `code` of a JSON error body (the server sets one where a status has causes a
    client must tell apart), else None: bodies that are not JSON objects (a gateway's HTML
    page, a proxy's text) have none."""
    try:
        body = response.json()
    except (*JSON_ERRORS, ValueError):
        return None
    code = body.get("code") if isinstance(body, dict) else None
    return code if isinstance(code, str) else None


@dataclass
class _RetryState:
    retries_left: int
    retries_done: int = 0
    # True once an attempt may have reached the server without us seeing the answer.
    in_doubt: bool = False


@dataclass
class _Done(Generic[R]):
    value: R


# Doublings of INITIAL_RETRY_DELAY that reach MAX_RETRY_DELAY (0.5 s -> 8 s: 4).
_DOUBLINGS_TO_CAP = math.ceil(math.log2(C.MAX_RETRY_DELAY / C.INITIAL_RETRY_DELAY))


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
        shown = _without_userinfo(str(base_url))  # what a message may echo
        try:
            url = httpx.URL(str(base_url))
        except httpx.InvalidURL as exc:  # (not a ValueError: "http://[::1" was a traceback)
            raise ValueError(f"base_url must be an http(s) URL such as {C.DEFAULT_BASE_URL}; "
                             f"got {shown!r} ({exc})") from None
        # httpx turns "http://user:password@host" into Basic auth, which replaced the bearer
        # api_key on every request without a word, and the password then showed in repr() and
        # in every message that echoed the URL. The server takes bearer keys only.
        if url.userinfo:
            raise ValueError(f"base_url must not carry credentials (user:password@); pass the "
                             f"key as api_key= or ${C.ENV_API_KEY} (sent as a bearer token); "
                             f"got {shown!r}")
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError(f"base_url must be an http(s) URL such as {C.DEFAULT_BASE_URL}; "
                             f"got {shown!r}")
        # httpx takes any port number, and getaddrinfo wraps one past 65535 modulo 2^16:
        # "http://127.0.0.1:84267" would talk to whatever listens on 18731.
        if url.port is not None and not 0 < url.port <= 65535:
            raise ValueError(f"base_url's port must be 1-65535; got {url.port} in {shown!r}")
        # A query or fragment cannot be part of a prefix: appending "/" then lands in the query
        # ("http://h/moe?x=1/"), join() resolves against "/moe" without its trailing slash, and
        # every request silently went to http://h/v2/... with the prefix and the query dropped.
        if url.query or url.fragment:
            raise ValueError(f"base_url must not have a query or fragment (a path prefix such "
                             f"as http://host/moe is kept); got {shown!r}")
        # A trailing slash makes join() keep a path prefix (a server behind /moe/ on a proxy).
        self.base_url = httpx.URL(str(url).rstrip("/") + "/")
        if api_key is None:
            api_key = os.environ.get(C.ENV_API_KEY) or None
        if api_key is not None and not isinstance(api_key, str):
            raise TypeError(f"api_key must be a str or None; got {type(api_key).__name__}")
        if api_key and not _API_KEY_RE.fullmatch(api_key):
            # (checked here: httpx would fail at every request, a non-ASCII key deep inside
            # with a UnicodeEncodeError, a line break as a "connection error"; never echo it)
            raise ValueError("api_key must be printable ASCII, without spaces, line breaks or "
                             "other control characters (it is sent as 'Authorization: Bearer "
                             "<key>')")
        self.api_key = api_key
        if isinstance(max_retries, bool) or not isinstance(max_retries, int):
            raise TypeError(f"max_retries must be an int; got {max_retries!r}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0; got {max_retries}")
        self.max_retries = max_retries
        self.timeout = self._check_timeout(timeout)
        self.default_headers = check_headers(default_headers, "default_headers")
        self._random: Callable[[], float] = random.random
        self._closed = False  # close() was called (an http_client passed in stays open)

    def _check_open(self, http: httpx.Client | httpx.AsyncClient) -> None:
        """ClientClosedError, before any request is built or sent, for a call on a closed
        client (httpx's own "Cannot send a request, as the client has been closed" came from
        deep in the send, naming neither this client nor what to do)."""
        name = type(self).__name__
        if self._closed:
            raise ClientClosedError(f"this {name} is closed (close() was called); create a "
                                    "new one to send requests")
        if http.is_closed:
            raise ClientClosedError(f"the http_client this {name} sends with has been closed "
                                    "by its owner; pass an open one")

    def __repr__(self) -> str:
        key = "set" if self.api_key else "none"
        return (f"{type(self).__name__}(base_url={str(self.base_url)!r}, api_key=<{key}>, "
                f"max_retries={self.max_retries})")

    @staticmethod
    def _check_timeout(timeout: object) -> httpx.Timeout:
        if isinstance(timeout, httpx.Timeout):
            # The same bounds on each phase (a phase of 0 is httpx's "do not wait").
            for phase, value in timeout.as_dict().items():
                if value is not None and not (math.isfinite(value)
                                              and 0 <= value <= C.MAX_TIMEOUT):
                    raise ValueError(f"timeout's {phase} must be finite seconds from 0 to "
                                     f"{C.MAX_TIMEOUT:g}, or None; got {value!r}")
            return timeout
        if timeout is None:
            return httpx.Timeout(None)
        # (nan and inf too: httpx would refuse nan only at the request, and inf, as any
        # number of seconds past ~9.2e9, reaches socket.settimeout as an OverflowError;
        # None is the way to say "no timeout")
        if (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                or not math.isfinite(timeout) or not 0 < timeout <= C.MAX_TIMEOUT):
            raise ValueError(f"timeout must be finite seconds > 0 (at most {C.MAX_TIMEOUT:g}), "
                             f"an httpx.Timeout or None; got {timeout!r}")
        return httpx.Timeout(float(timeout))

    @staticmethod
    def _check_wait(timeout: object, interval: object) -> None:
        """wait_until_ready's arguments, checked before the first poll: a None or NaN deadline
        failed inside the loop with a message about the per-request timeout (which says None
        is fine), a negative or NaN interval only at the first sleep."""
        for name, value in (("timeout", timeout), ("interval", interval)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"wait_until_ready {name} must be seconds >= 0; got {value!r}")
            if math.isnan(value) or value < 0:
                raise ValueError(f"wait_until_ready {name} must be seconds >= 0; got {value!r}")

    @staticmethod
    def _not_ready_yet(exc: APIStatusError) -> bool:
        """Whether a status error of a readiness poll means "not yet", as a connection error
        does: the statuses the client retries (a gateway's 502 while the server behind it
        starts, a 429 or a 408), which say nothing of the server's readiness except that it
        did not answer this poll. Any other status (a 401 from a gateway, a 404 for a wrong
        URL prefix) says the poll itself is wrong, and ends the wait."""
        return exc.status_code in C.RETRYABLE_STATUSES

    # -- request building ------------------------------------------------------------------

    def _headers(self, call: _Call[Any]) -> dict[str, str]:
        headers = {
            "User-Agent": f"moe-gemm-client/{_version()} httpx/{httpx.__version__}",
            "Accept": "application/json",
        }
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        # set_header, not dict.update: header names are case-insensitive, and an extra/default
        # "x-request-id", "authorization" or "content-length" went out *beside* the client's
        # own (request_id= lost to the other value, two bearer keys, conflicting lengths).
        for name, value in (*self.default_headers.items(), *call.headers.items()):
            set_header(headers, name, value)
        if call.body is not None:
            set_header(headers, "Content-Type", call.body.content_type)
            set_header(headers, "Content-Length", str(call.body.nbytes))
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
        # (the exponent is capped once the delay has reached its cap: 2.0 ** 1024 overflows,
        # and max_retries has no upper bound)
        doublings = min(state.retries_done, _DOUBLINGS_TO_CAP)
        base = min(C.INITIAL_RETRY_DELAY * 2.0**doublings, C.MAX_RETRY_DELAY)
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
        if (status in C.RETRYABLE_STATUSES and call.retry_safe and state.retries_left > 0
                and error_code(response) not in C.PERMANENT_ERROR_CODES):
            if status == 502:
                # A 502 comes from a gateway (ingress, Ray's proxy), not from the server: the
                # server's own answer was lost on the way, so the request may have been done
                # (a DELETE whose retry then finds the set gone), as after a dropped connection.
                state.in_doubt = True
            return self._take_retry(state, response)
        raise self._status_error(call, response)

    def _request_id(self, call: _Call[Any], response: httpx.Response) -> str | None:
        return answer_request_id(call, response)

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
        except (*JSON_ERRORS, ValueError):
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
            code=error_code(response),
        )

    # -- the calls -------------------------------------------------------------------------

    def _state(self, call: _Call[Any]) -> _RetryState:
        n = self.max_retries if call.max_retries is None else call.max_retries
        return _RetryState(retries_left=n)


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
