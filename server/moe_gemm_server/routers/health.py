"""Liveness and readiness (Kubernetes probes; tritonclient's is_server_live/ready)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..dependencies import ServiceDep
from ..errors import request_id_of

router = APIRouter(tags=["health"])


@router.get("/v2/health/live")
async def live(request: Request, service: ServiceDep) -> JSONResponse:
    """200 while the process serves; 503 once a sticky device error has made it unusable (it
    is then exiting; a liveness probe restarts it should the exit hang)."""
    if service.fatal_error is None:
        return JSONResponse({"live": True})
    return JSONResponse(
        {"live": False, "error": f"device failed: {service.fatal_error}",
         "request_id": request_id_of(request)},
        status_code=503,
    )


@router.get("/v2/health/ready")
async def ready(request: Request, service: ServiceDep) -> JSONResponse:
    """200 once weights are loaded and kernels compiled; 503 before that and while draining."""
    if service.is_ready:
        return JSONResponse({"ready": True})
    return JSONResponse(
        {"ready": False, "error": f"not ready: {service.not_ready_reason}",
         "request_id": request_id_of(request)},
        status_code=503,
        headers={"Retry-After": "1"},
    )
