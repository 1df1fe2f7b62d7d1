"""Body limits, enforced before the body is read: Content-Length first, then counted bytes.

`BodyLimitMiddleware` (pure ASGI, so it never buffers) answers 413 straight from the
Content-Length header when it is over the route's limit, without reading a byte of the body;
for bodies without a length (chunked) it counts bytes as the app receives them and raises a
413 APIError as soon as the count passes the limit. It also bounds each wait for a piece of a
body: 408 after --body-timeout-s, 503 once a drain stops waiting for bodies (`BodyCutoff`). `read_body` collects a body into one
buffer and undoes a gzip/deflate Content-Encoding (tritonclient can compress requests) with
the same limit on the decompressed size, so a compression bomb is a 413 too.
`LingeringCloseMiddleware` (outermost) holds back the close after an answer sent before its
request's body is in, while the rest of the body drains.
"""

from __future__ import annotations

import asyncio
import json
import zlib
from collections.abc import Callable
from typing import NamedTuple

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import APIError, bad_request
from .logs import request_id_var

MiB = 1 << 20

# A request answered before its body is in (401, 403, 404, 413, a refused upload header) gets
# Connection: close. Closing a socket with unread bytes makes the kernel send a reset, and a
# client still writing its body (httpx's async client reads only once its body is out) then
# loses the answer already sent and sees a connection error (a 60 MB grouped-mm to an unknown
# set: ReadError after retries, where the 404 was due). So the answer goes out at once, and the
# rest of the body is read and discarded for at most this long before the close, as nginx's
# lingering close (bounded by time alone there too: lingering_time, 30 s; 5 s pass ~600 MB
# over a 1 Gbit link).
LINGER_S = 5.0


BODY_FLAG = "--max-body-bytes"
WEIGHT_FLAG = "--max-weight-bytes"


class BodyLimit(NamedTuple):
    """A body limit in bytes and the flag that sets it (named in the 413's message)."""

    bytes: int
    flag: str = BODY_FLAG


class BodyTooLarge(APIError):
    """413. Refused while the body is still arriving, its connection is closed as after any
    answer sent before the body is in (BodyLimitMiddleware)."""

    def __init__(self, limit: int, what: str = "request body", flag: str = BODY_FLAG) -> None:
        super().__init__(413, f"{what} exceeds the limit of {limit} bytes ({flag})")


def content_length(scope: Scope) -> int | None:
    for k, v in scope.get("headers", ()):
        if k == b"content-length":
            try:
                n = int(v)
            except ValueError:
                raise bad_request(f"invalid Content-Length {v.decode('latin-1')!r}") from None
            if n < 0:
                raise bad_request("invalid Content-Length: negative")
            return n
    return None


class BodyTimeout(APIError):
    """No piece of the request body arrived for `timeout` seconds: 408, and the connection is
    closed (should the rest of the body come after all, it could not be told from the next
    request)."""

    def __init__(self, timeout: float) -> None:
        super().__init__(408, f"no part of the request body arrived for {timeout:g} s "
                              "(--body-timeout-s); send the body without pauses",
                         {"Connection": "close"})


class BodyCut(APIError):
    """503: the server stopped waiting for the rest of this body (it is shutting down). The
    connection is closed, as after a 408: the rest of the body could not be told from a next
    request."""

    def __init__(self, reason: str) -> None:
        super().__init__(503, f"{reason}; the rest of the request body did not arrive in time",
                         {"Retry-After": "1", "Connection": "close"})


class BodyCutoff:
    """The request bodies still arriving, and the switch that stops waiting for them.

    A drain waits --drain-timeout-s for requests in flight, a body still arriving included.
    Left waiting past that, such a request would be cancelled by uvicorn at its
    graceful-shutdown timeout and answered a plain-text 500. `cut` ends every wait for a piece
    of a body at once with a 503 (BodyCut), and every later one: each wait runs under the
    asyncio.timeout of --body-timeout-s, which `cut` moves to now, so the wait ends as a body
    timeout does, by asyncio's own cancellation, and the request unwinds as after a 408.
    """

    def __init__(self, on_cut: Callable[[], None] | None = None) -> None:
        self.reason: str | None = None
        self.on_cut = on_cut  # called once per request refused
        self._waits: set[asyncio.Timeout] = set()

    def cut(self, reason: str) -> None:
        """From now on, bodies still arriving are answered 503 `reason`. Event-loop thread."""
        self.reason = reason
        now = asyncio.get_running_loop().time()
        for wait in list(self._waits):
            if not wait.expired():  # (one that just timed out ends as a 503 all the same)
                wait.reschedule(now)

    def refuse(self) -> BodyCut:
        assert self.reason is not None
        if self.on_cut is not None:
            self.on_cut()
        return BodyCut(self.reason)


async def _receive_within(receive: Receive, timeout: float | None,
                          cutoff: BodyCutoff | None = None) -> Message:
    if cutoff is None:
        if timeout is None:
            return await receive()
    elif cutoff.reason is not None:
        raise cutoff.refuse()
    try:
        async with asyncio.timeout(timeout) as wait:
            if cutoff is not None:
                cutoff._waits.add(wait)
            try:
                return await receive()
            finally:
                if cutoff is not None:
                    cutoff._waits.discard(wait)
    except TimeoutError:
        if cutoff is not None and cutoff.reason is not None:
            raise cutoff.refuse() from None
        assert timeout is not None  # (without one, only a cut ends the wait)
        raise BodyTimeout(timeout) from None


class BodyLimitMiddleware:
    """413 for bodies over `limit_for(scope)` bytes, decided before reading them; 408 when the
    body stalls for `body_timeout_s` (None: wait for ever); 503 for bodies still arriving once
    `cutoff` is cut.

    Without that timeout a client that announces a body and never sends it would hold its
    connection, its handler and the in-flight count a drain waits on, for as long as it likes.
    The timeout is between pieces of the body (as nginx's client_body_timeout), so a large
    upload over a slow link is not cut while it makes progress.
    """

    def __init__(self, app: ASGIApp, limit_for: Callable[[Scope], BodyLimit],
                 on_reject: Callable[[], None] | None = None,
                 body_timeout_s: float | None = None,
                 cutoff: BodyCutoff | None = None) -> None:
        self.app = app
        self.limit_for = limit_for
        self.on_reject = on_reject
        self.body_timeout_s = body_timeout_s
        self.cutoff = cutoff

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, flag = self.limit_for(scope)
        try:
            declared = content_length(scope)
        except APIError as e:
            await _send_error(send, e.status, e.message)
            return
        if declared is not None and declared > limit:
            if self.on_reject is not None:
                self.on_reject()
            await _send_error(send, 413, f"request body of {declared} bytes exceeds the limit of "
                                         f"{limit} bytes ({flag})", close=True)
            return
        received = 0
        body_done = False

        async def limited_receive() -> Message:
            nonlocal received, body_done
            if body_done:
                # The body is in: the app now waits for the client to leave (service.py), as
                # long as its answer takes; that wait has no timeout.
                return await receive()
            message = await _receive_within(receive, self.body_timeout_s, self.cutoff)
            if message["type"] != "http.request":
                body_done = True  # a disconnect
                return message
            received += len(message.get("body", b""))
            if received > limit:
                raise BodyTooLarge(limit, flag=flag)
            body_done = not message.get("more_body", False)
            return message

        has_body = (declared or 0) > 0 or _is_chunked(scope)

        async def closing_send(message: Message) -> None:
            headers = message.get("headers", [])
            if (message["type"] == "http.response.start" and has_body and not body_done
                    and not any(k.lower() == b"connection" for k, _ in headers)):
                # Answered before its body is in (a 401, a 404, a refused header): left open,
                # the connection would go on receiving the rest, however long, only for the
                # server to discard it before the next request could be read.
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        await self.app(scope, limited_receive, closing_send)


class LingeringCloseMiddleware:
    """The close after an early answer, held back while the rest of the body drains
    (LINGER_S): outermost, so that the request is logged and counted when its answer is out,
    not after the drain.

    An answer that says Connection: close, to a request with a body the app has not read to
    its end, goes out whole at once; its last (empty) piece, on which uvicorn closes the
    connection, waits until the body has ended, LINGER_S have passed, a piece of it took
    longer than `body_timeout_s`, or `cutoff` is cut (a stopping server does not linger). Not
    for a client waiting for 100 Continue: it has sent nothing and, answered, sends nothing.
    """

    def __init__(self, app: ASGIApp, body_timeout_s: float | None = None,
                 cutoff: BodyCutoff | None = None) -> None:
        self.app = app
        self.body_timeout_s = body_timeout_s
        self.cutoff = cutoff

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _may_linger(scope):
            await self.app(scope, receive, send)
            return
        body_in = False
        closing = held = False

        async def watched_receive() -> Message:
            nonlocal body_in
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_in = True
            return message

        async def holding_send(message: Message) -> None:
            nonlocal closing, held
            if message["type"] == "http.response.start":
                closing = not body_in and any(
                    k.lower() == b"connection" and b"close" in v.lower()
                    for k, v in message.get("headers", ()))
            elif (closing and message["type"] == "http.response.body"
                    and not message.get("more_body", False)):
                message = {**message, "more_body": True}
                held = True
            await send(message)

        await self.app(scope, watched_receive, holding_send)
        if held:
            await self._drain(receive)
            await send({"type": "http.response.body", "body": b""})

    async def _drain(self, receive: Receive) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + LINGER_S
        while (left := end - loop.time()) > 0:
            if self.body_timeout_s is not None:
                left = min(left, self.body_timeout_s)
            try:
                message = await _receive_within(receive, left, self.cutoff)
            except APIError:  # (the piece's time, or the drain's cut)
                return
            if message["type"] != "http.request" or not message.get("more_body", False):
                return


def _may_linger(scope: Scope) -> bool:
    """A request with a body (announced, or chunked) whose client is not waiting for
    100 Continue."""
    headers = scope.get("headers", ())
    if any(k == b"expect" and v.lower().startswith(b"100") for k, v in headers):
        return False
    try:
        declared = content_length(scope)
    except APIError:
        return False
    return (declared or 0) > 0 or _is_chunked(scope)


def _is_chunked(scope: Scope) -> bool:
    return any(k == b"transfer-encoding" and b"chunked" in v.lower()
               for k, v in scope.get("headers", ()))


async def _send_error(send: Send, status: int, message: str, close: bool = False) -> None:
    body = json.dumps({"error": message, "request_id": request_id_var.get()}).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    if close:
        # The body was not read: the connection cannot be reused for another request.
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# Compressed input is fed to zlib in pieces of this size: after a gzip member ends, zlib copies
# the rest of its input (unused_data), and a body of many tiny members must not cost a copy of
# the whole remainder per member.
INFLATE_PIECE = 1 << 16


def _decompress(data: bytes | bytearray, encoding: str, limit: int,
                flag: str = BODY_FLAG) -> bytearray:
    """Undo a gzip / deflate Content-Encoding, at most `limit` decompressed bytes (else 413).

    A gzip body may be several members one after the other (RFC 1952; what `cat a.gz b.gz`
    gives): all are decoded. Anything after the end of the stream that is not a further gzip
    member is a 400, as is a stream that stops before its end.
    """
    wbits = 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS
    view = memoryview(data)
    out = bytearray()
    d = zlib.decompressobj(wbits)
    members = 1
    pos = 0
    pending: bytes | memoryview = b""
    try:
        while pending or pos < len(view):
            if not pending:
                pending, pos = view[pos:pos + INFLATE_PIECE], pos + INFLATE_PIECE
            out += d.decompress(pending, limit + 1 - len(out))
            if len(out) > limit:
                raise BodyTooLarge(limit, "decompressed request body", flag)
            pending = d.unconsumed_tail
            if d.eof and (d.unused_data or pos < len(view)):
                if encoding != "gzip":
                    raise bad_request(f"request body has data after the end of its {encoding} "
                                      "stream")
                pending, d, members = d.unused_data, zlib.decompressobj(wbits), members + 1
    except zlib.error as e:
        raise bad_request(_inflate_error(encoding, members, f"not valid {encoding} data: {e}")
                          ) from None
    if not d.eof:
        raise bad_request(_inflate_error(encoding, members, f"truncated {encoding} data"))
    return out


def _inflate_error(encoding: str, members: int, what: str) -> str:
    if members == 1:
        return f"request body is {what}"
    return f"request body has data after its {encoding} stream that is not a gzip member ({what})"


# Compressed bodies up to this size are decoded on the event loop; larger ones in a worker
# thread (a body of many small gzip members takes a while to walk).
INLINE_INFLATE_BYTES = 64 << 10


def _body_encoding(request: Request, allow_encoding: bool) -> str | None:
    """"gzip" / "deflate" / None (identity) from Content-Encoding; 415 for anything else."""
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        return None
    if encoding in ("gzip", "deflate") and allow_encoding:
        return encoding
    raise APIError(415, f"unsupported Content-Encoding {encoding!r}; use gzip, deflate or none")


async def read_body(request: Request, limit: int, *, allow_encoding: bool = True,
                    flag: str = BODY_FLAG) -> bytearray:
    """The whole request body (decompressed), at most `limit` bytes (set by `flag`), else 413."""
    encoding = _body_encoding(request, allow_encoding)  # 415 before reading a byte
    declared = content_length(request.scope)
    # Grown as the bytes arrive, never allocated from Content-Length up front: a client that
    # announces 64 MB and sends 100 bytes must cost 100 bytes, not 64 MB (twenty such
    # connections cost 1.3 GB). bytearray grows geometrically, in place where the allocator
    # can (large blocks are remapped, not copied).
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > limit:
            raise BodyTooLarge(limit, flag=flag)
        if declared is not None and len(buf) > declared:
            raise bad_request("request body is longer than its Content-Length")
    if declared is not None and len(buf) != declared:
        raise bad_request("request body is shorter than its Content-Length")
    if encoding is None:
        return buf
    if len(buf) <= INLINE_INFLATE_BYTES:
        return _decompress(buf, encoding, limit, flag)
    return await asyncio.to_thread(_decompress, buf, encoding, limit, flag)
