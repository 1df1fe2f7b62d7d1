"""Request id, metrics, access log and last-resort error handling, as one pure ASGI layer.

Pure ASGI (not BaseHTTPMiddleware) so that bodies stream through untouched and a client's
disconnect still reaches the handler. For each HTTP request it:
- takes `X-Request-Id` from the request if it is a sane token (<= 128 printable characters),
  else generates one; puts it in the scope state, the logging context and the response;
- counts requests by route template (not raw path, to bound label cardinality), method (the
  standard ones; "other" for any other token a client sends) and status, times them, and
  tracks the in-flight gauge; a request that ends without an answer from the app (its client
  left, or its handler was cancelled from outside) is status 499;
- writes one access-log line with the request id;
- turns any exception that escaped the app into a JSON 500 (if nothing was sent yet), so a
  bug in one request never takes the process down or leaks a traceback to the client.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import Callable

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import APIError
from .logs import log_field, request_id_var
from .metrics import Metrics

log = logging.getLogger("moe_gemm_server.access")
errlog = logging.getLogger("moe_gemm_server")

_RID_RE = re.compile(r"[\x21-\x7e]{1,128}")
_QUIET = ("/metrics", "/v2/health/live", "/v2/health/ready")
# The method label of the request metrics: the methods of RFC 9110 (and PATCH), else "other".
# The method is the client's: h11 (uvicorn's parser without httptools) takes any token, and
# labelled as sent, each new one made ~19 series (a counter and a histogram) that no request
# needed a key to create, so the exposition and the process grew without bound.
METRIC_METHODS = frozenset(("GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS",
                            "CONNECT", "TRACE"))


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", ()):
        if k == name:
            return v.decode("latin-1")
    return None


class ObservabilityMiddleware:
    """route_for(scope): the route template of a request that the router never saw (one a
    middleware below answered, e.g. a 413 from its Content-Length), None where no route has
    its path; the label is then "unmatched"."""

    def __init__(self, app: ASGIApp, metrics: Metrics,
                 route_for: Callable[[Scope], str | None] | None = None) -> None:
        self.app = app
        self.metrics = metrics
        self.route_for = route_for

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = _header(scope, b"x-request-id")
        rid = given if given is not None and _RID_RE.fullmatch(given) else uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        t0 = state["t_arrival"] = time.monotonic()
        token = request_id_var.set(rid)
        status = 0
        sent_start = False
        cancelled = False

        async def send_with_id(message: Message) -> None:
            nonlocal status, sent_start
            if message["type"] == "http.response.start":
                status = message["status"]
                sent_start = True
                headers = [(k, v) for k, v in message.get("headers", []) if k != b"x-request-id"]
                headers.append((b"x-request-id", rid.encode()))
                message = {**message, "headers": headers}
            await send(message)

        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, send_with_id)
        except ClientDisconnect:
            # The client went away mid-body: nobody to answer, nothing to log as an error.
            state["disconnected"] = True
        except asyncio.CancelledError:
            # Cancelled from outside (by uvicorn at its graceful-shutdown timeout, by Ray Serve
            # for a caller gone): no server error. Without an answer started it is counted
            # 499 below, as a client that left is (nginx's "client closed request"); uvicorn's
            # own plain-text 500, written after this, is not the app's answer.
            cancelled = True
            raise
        except Exception as e:  # noqa: BLE001 - last resort: answer 500 and keep serving
            if isinstance(e, APIError):
                code, msg = e.status, e.message
            else:
                errlog.exception("unhandled error in %s %s", log_field(scope.get("method", "")),
                                 log_field(scope.get("path", "")))
                code, msg = 500, f"internal error ({type(e).__name__}); request id {rid}"
            if not sent_start:
                body = json.dumps({"error": msg, "request_id": rid}).encode()
                await send_with_id({"type": "http.response.start", "status": code, "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode())]})
                await send_with_id({"type": "http.response.body", "body": body})
        finally:
            self.metrics.in_flight.dec()
            dt = time.monotonic() - t0
            route = scope.get("route")
            label = getattr(route, "path", None)
            if label is None and self.route_for is not None:
                label = self.route_for(scope)
            label = label or "unmatched"
            method = scope.get("method", "")
            method_label = method if method in METRIC_METHODS else "other"
            if state.get("disconnected") or (cancelled and not sent_start):
                status = 499  # nginx's "client closed request": no answer was delivered
            self.metrics.requests.labels(label, method_label, str(status or 500)).inc()
            self.metrics.latency.labels(label, method_label).observe(dt)
            path = scope.get("path", "")
            if path not in _QUIET or status >= 400:
                # (the path is the client's, decoded: escaped so that it cannot end the line)
                log.info("%s %s %s %.1fms", log_field(method), log_field(path), status or 500,
                         dt * 1e3)
            request_id_var.reset(token)


class HeadAsGetMiddleware:
    """HEAD wherever GET is (RFC 9110, 9.3.2): the GET route answers, without its body.

    FastAPI routes take only the methods they declare (Starlette's own routes add HEAD to GET
    themselves). The app below runs on a copy of the scope that says GET: the server's own
    scope must keep saying HEAD (uvicorn sends no body for a HEAD by it, and the access log
    and the metrics name the method the client used). A HEAD on a path without GET gets 405.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "HEAD":
            await self.app(scope, receive, send)
            return

        async def send_headers_only(message: Message) -> None:
            if message["type"] == "http.response.body":
                # (Content-Length stays the GET answer's, as HEAD requires)
                message = {**message, "body": b""}
            await send(message)

        as_get = {**scope, "method": "GET"}  # (the state dict is shared, not copied)
        try:
            await self.app(as_get, receive, send_headers_only)
        finally:
            if "route" in as_get:  # the route template the metrics label requests with
                scope["route"] = as_get["route"]
