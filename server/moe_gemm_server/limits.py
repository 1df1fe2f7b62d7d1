"""Body limits, enforced before the body is read: Content-Length first, then counted bytes.

`BodyLimitMiddleware` (pure ASGI, so it never buffers) answers 413 straight from the
Content-Length header when it is over the route's limit, without reading a byte of the body;
for bodies without a length (chunked) it counts bytes as the app receives them and raises a
413 APIError as soon as the count passes the limit. `read_body` collects a body into one
buffer and undoes a gzip/deflate Content-Encoding (tritonclient can compress requests) with
the same limit on the decompressed size, so a compression bomb is a 413 too.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from typing import NamedTuple

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import APIError, bad_request
from .logs import request_id_var

MiB = 1 << 20


BODY_FLAG = "--max-body-bytes"
WEIGHT_FLAG = "--max-weight-bytes"


class BodyLimit(NamedTuple):
    """A body limit in bytes and the flag that sets it (named in the 413's message)."""

    bytes: int
    flag: str = BODY_FLAG


class BodyTooLarge(APIError):
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


class BodyLimitMiddleware:
    """413 for bodies over `limit_for(scope)` bytes, decided before reading them."""

    def __init__(self, app: ASGIApp, limit_for: Callable[[Scope], BodyLimit],
                 on_reject: Callable[[], None] | None = None) -> None:
        self.app = app
        self.limit_for = limit_for
        self.on_reject = on_reject

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

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit, flag=flag)
            return message

        await self.app(scope, limited_receive, send)


async def _send_error(send: Send, status: int, message: str, close: bool = False) -> None:
    body = json.dumps({"error": message, "request_id": request_id_var.get()}).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    if close:
        # The body was not read: the connection cannot be reused for another request.
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _decompress(data: bytes | bytearray, encoding: str, limit: int,
                flag: str = BODY_FLAG) -> bytearray:
    wbits = 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS
    d = zlib.decompressobj(wbits)
    out = bytearray()
    try:
        chunk = d.decompress(bytes(data), limit + 1 - len(out))
        out += chunk
        while d.unconsumed_tail and len(out) <= limit:
            out += d.decompress(d.unconsumed_tail, limit + 1 - len(out))
        if len(out) > limit:
            raise BodyTooLarge(limit, "decompressed request body", flag)
        out += d.flush()
    except zlib.error as e:
        raise bad_request(f"request body is not valid {encoding} data: {e}") from None
    if len(out) > limit:
        raise BodyTooLarge(limit, "decompressed request body", flag)
    if not d.eof:
        raise bad_request(f"request body is truncated {encoding} data")
    return out


async def read_body(request: Request, limit: int, *, allow_encoding: bool = True,
                    flag: str = BODY_FLAG) -> bytearray:
    """The whole request body (decompressed), at most `limit` bytes (set by `flag`), else 413."""
    declared = content_length(request.scope)
    if declared is not None and declared <= limit:
        # One allocation of the announced size, filled in place: no regrowth copies of a
        # multi-megabyte body (h11 has already checked the chunks against Content-Length).
        buf = bytearray(declared)
        view = memoryview(buf)
        n = 0
        async for chunk in request.stream():
            end = n + len(chunk)
            if end > declared:
                raise bad_request("request body is longer than its Content-Length")
            view[n:end] = chunk
            n = end
        view.release()
        if n != declared:
            raise bad_request("request body is shorter than its Content-Length")
    else:
        buf = bytearray()
        async for chunk in request.stream():
            buf += chunk
            if len(buf) > limit:
                raise BodyTooLarge(limit, flag=flag)
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        return buf
    if encoding in ("gzip", "deflate") and allow_encoding:
        return _decompress(buf, encoding, limit, flag)
    raise APIError(415, f"unsupported Content-Encoding {encoding!r}; use gzip, deflate or none")
