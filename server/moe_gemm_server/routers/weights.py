"""Resident weight sets: PUT (admin), GET list, GET one, DELETE (admin)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..dependencies import AdminDep, ReaderDep, ServiceDep, ServingDep
from ..storage import check_name

router = APIRouter(prefix="/v1/weights", tags=["weights"])


@router.put("/{name}", dependencies=[AdminDep])
async def put_weights(name: str, request: Request, service: ServiceDep) -> JSONResponse:
    """Upload a safetensors body with "w" (E, K, N) or "w_t" (E, N, K); 201 new, 200 replaced."""
    check_name(name)
    service.check_serving(request)
    async with service.tracked():
        ws, created = await service.put_weights(name, request)
    return JSONResponse(ws.info(), status_code=201 if created else 200)


@router.get("", dependencies=[ReaderDep, ServingDep])
async def list_weights(service: ServiceDep) -> dict[str, object]:
    assert service.engine is not None
    return {"weights": [ws.info() for ws in service.engine.weight_sets()]}


@router.get("/{name}", dependencies=[ReaderDep, ServingDep])
async def get_weights(name: str, service: ServiceDep) -> dict[str, object]:
    return service.weight_set(name).info()


@router.delete("/{name}", dependencies=[AdminDep])
async def delete_weights(name: str, request: Request, service: ServiceDep) -> dict[str, str]:
    check_name(name)
    service.check_serving(request)
    await service.delete_weights(name)
    return {"deleted": name}
