"""create_app(): the FastAPI application, with the Service built in its lifespan.

Middleware order (outermost first): LingeringCloseMiddleware (the close after an early answer
waits while the body drains) -> ObservabilityMiddleware (request id, metrics, access log,
last-resort 500) -> BodyLimitMiddleware (413 before reading) -> the routers. Every error
answer is JSON {"error": ..., "request_id": ...}: our APIError, FastAPI's own 404/405 and
request-validation errors alike.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from urllib.parse import unquote

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match
from starlette.types import Scope

from moe_gemm_server.engine import Engine

from . import __version__
from .config import Settings, get_settings
from .errors import APIError, error_response, request_id_of
from .limits import BODY_FLAG, BodyLimit, BodyLimitMiddleware, LingeringCloseMiddleware
from .middleware import HeadAsGetMiddleware, ObservabilityMiddleware
from .routers import health, matmul, metrics, v2, weights
from .service import Service
from .service_weights import upload_limit
from .storage import check_name


def create_app(settings: Settings | None = None, *, engine: Engine | None = None) -> FastAPI:
    """Build the app. `engine` replaces the one the lifespan would build (tests, embedding)."""
    settings = settings or get_settings()
    service = Service(settings, engine=engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    app = FastAPI(
        title="moe-gemm-server",
        version=__version__,
        summary="Batched grouped-GEMM inference against resident MoE expert weights",
        lifespan=lifespan,
        # No /docs, /redoc or /openapi.json: they would answer without a key and while
        # starting or draining, outside the contract of docs/HTTP-API.md (app.openapi() stays).
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        # A path with a trailing slash is no route (404, JSON): Starlette's default answers a
        # bodiless 307 to the path without it, whose Location takes its scheme from the
        # request (http:// behind a TLS proxy), and a client following it replays a PUT there.
        redirect_slashes=False,
    )
    app.state.service = service

    def limit_for(scope: Scope) -> BodyLimit:
        if scope.get("method") == "PUT" and scope.get("path", "").startswith("/v1/weights/"):
            ctype = next((v.decode("latin-1") for k, v in scope.get("headers", ())
                          if k == b"content-type"), "")
            return upload_limit(settings, ctype)
        return BodyLimit(settings.max_body_bytes, BODY_FLAG)

    app.add_middleware(
        BodyLimitMiddleware,
        limit_for=limit_for,
        on_reject=service.metrics.rejections.labels("too_large").inc,
        body_timeout_s=settings.body_timeout_s,
        cutoff=service.body_cutoff,
    )
    app.add_middleware(HeadAsGetMiddleware)
    app.add_middleware(ObservabilityMiddleware, metrics=service.metrics,
                       route_for=lambda scope: route_template(
                           [*app.router.routes, *api_routes], scope))
    app.add_middleware(LingeringCloseMiddleware, body_timeout_s=settings.body_timeout_s,
                       cutoff=service.body_cutoff)

    routers = [module.router for module in (health, weights, matmul, v2, metrics)]
    # (the app's own route list holds wrappers of the included routers, not their routes)
    api_routes = [route for router in routers for route in router.routes]

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        if exc.status == 413:
            service.metrics.rejections.labels("too_large").inc()
        elif exc.reason is not None:
            service.metrics.rejections.labels(exc.reason).inc()
        return error_response(exc.status, exc.message, request_id_of(request), exc.headers,
                              exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 404 and message == "Not Found":
            name = encoded_slash_name([*app.router.routes, *api_routes], request.scope)
            if name is not None:
                try:
                    check_name(name)
                except APIError as bad:  # (always: a name holds no '/')
                    return error_response(bad.status, bad.message, request_id_of(request))
            message = f"no route {request.method} {request.url.path}"
        if exc.status_code == 405:
            # Starlette names the methods of the first route whose path matched; the answer
            # must name every method the path has (RFC 9110, 15.5.6).
            allow = allowed_methods([*app.router.routes, *api_routes], request.scope)
            headers["Allow"] = ", ".join(allow)
            message = f"method not allowed: {request.url.path} takes {', '.join(allow)}"
        return error_response(exc.status_code, message, request_id_of(request), headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = ".".join(str(p) for p in first.get("loc", ()))
        return error_response(422, f"invalid request: {loc}: {first.get('msg', exc)}",
                              request_id_of(request))

    for router in routers:
        app.include_router(router)
    return app


def route_template(routes: Iterable[BaseRoute], scope: Scope) -> str | None:
    """The path template of the route that takes the scope's method and path (else of one
    whose path matches), None where no route's path matches."""
    partial = None
    for route in routes:
        path = getattr(route, "path", None)
        if path is None:  # (a wrapper of an included router: its routes are listed too)
            continue
        match, _ = route.matches(scope)
        if match == Match.FULL:
            return path
        if match == Match.PARTIAL and partial is None:
            partial = path
    return partial


def encoded_slash_name(routes: Iterable[BaseRoute], scope: Scope) -> str | None:
    """The path segment holding an encoded slash ('a%2Fb' -> 'a/b') where, read as one
    segment, it would be a route's name: Starlette routes on the decoded path, so
    /v1/weights/a%2Fb matches no route (a 404) where the name is what is wrong (a 422). None
    for any other path."""
    raw = scope.get("raw_path") or b""
    if b"%2f" not in raw.lower():
        return None
    segments = raw.decode("latin-1").split("/")
    odd = [i for i, seg in enumerate(segments) if "%2f" in seg.lower()]
    probe = "/".join("x" if i in odd else unquote(seg) for i, seg in enumerate(segments))
    if route_template(routes, {**scope, "path": probe}) is None:
        return None
    return unquote(segments[odd[0]])


# The order methods are listed in an Allow header.
METHOD_ORDER = ("GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS")


def allowed_methods(routes: Iterable[BaseRoute], scope: Scope) -> list[str]:
    """Every method one of `routes` takes on the scope's path (HEAD wherever GET is)."""
    methods: set[str] = set()
    for route in routes:
        route_methods = getattr(route, "methods", None)
        if route_methods and route.matches(scope)[0] != Match.NONE:
            methods |= set(route_methods)
    if "GET" in methods:
        methods.add("HEAD")
    return sorted(methods, key=lambda m: (METHOD_ORDER.index(m) if m in METHOD_ORDER
                                          else len(METHOD_ORDER), m))
