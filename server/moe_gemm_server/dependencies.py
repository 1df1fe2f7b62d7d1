"""FastAPI dependencies: the Service, its Settings, and the auth checks, as Annotated aliases."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from .auth import check_admin, check_reader
from .config import Settings
from .service import Service


def get_service(request: Request) -> Service:
    return request.app.state.service


def get_settings_dep(request: Request) -> Settings:
    return request.app.state.service.settings


ServiceDep = Annotated[Service, Depends(get_service)]
SettingsDep = Annotated[Settings, Depends(get_settings_dep)]


def require_reader(request: Request, service: ServiceDep) -> None:
    check_reader(request, service.settings)


def require_admin(request: Request, service: ServiceDep) -> None:
    check_admin(request, service.settings)


ReaderDep = Depends(require_reader)
AdminDep = Depends(require_admin)
