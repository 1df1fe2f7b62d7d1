"""FastAPI dependencies: the Service, its Settings, and the auth checks, as Annotated aliases.

All are `async def` on purpose: FastAPI runs a plain `def` dependency in its thread pool,
which costs a thread hop (and a GIL hand-off) per dependency per request.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from .auth import check_admin, check_reader
from .config import Settings
from .service import Service


async def get_service(request: Request) -> Service:
    return request.app.state.service


async def get_settings_dep(request: Request) -> Settings:
    return request.app.state.service.settings


ServiceDep = Annotated[Service, Depends(get_service)]
SettingsDep = Annotated[Settings, Depends(get_settings_dep)]


async def require_reader(request: Request, service: ServiceDep) -> None:
    check_reader(request, service.settings)


async def require_admin(request: Request, service: ServiceDep) -> None:
    check_admin(request, service.settings)


async def require_serving(request: Request, service: ServiceDep) -> None:
    service.check_serving(request)


ReaderDep = Depends(require_reader)
AdminDep = Depends(require_admin)
# 503 while starting or draining: every route but the health probes and /metrics has it (the
# matmul routes check the same through Service.admit).
ServingDep = Depends(require_serving)


def hot_path(request: Request) -> Service:
    """Service + reader auth without FastAPI's dependency machinery, for the matmul routes.

    solve_dependencies costs ~0.2 ms per request on a 2-core CPU, a sixth of a whole small
    matmul request; the hot routes call this instead (same checks, same errors).
    """
    service: Service = request.app.state.service
    check_reader(request, service.settings)
    return service
