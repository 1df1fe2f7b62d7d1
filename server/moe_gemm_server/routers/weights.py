"""Resident weight sets: PUT (admin), GET list, GET one, DELETE (admin)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..dependencies import AdminDep, ReaderDep, ServiceDep, ServingDep
from ..security import audited
from ..storage import check_name

router = APIRouter(prefix="/v1/weights", tags=["weights"])


@router.put("/{name}", dependencies=[AdminDep])
async def put_weights(name: str, request: Request, service: ServiceDep) -> JSONResponse:
    """Upload a safetensors body with "w" (E, K, N) or "w_t" (E, N, K); 201 new, 200 replaced."""
    with audited(request, "put_weights", name) as record:
        check_name(name)
        service.check_serving(request)
        async with service.tracked():
            ws, created = await service.put_weights(name, request)
        record.status = 201 if created else 200
        record.detail = f"{ws.E}x{ws.K}x{ws.N} {ws.info()['dtype']} {ws.nbytes} bytes"
    return JSONResponse(ws.info(), status_code=record.status)


@router.get("", dependencies=[ReaderDep, ServingDep])
async def list_weights(service: ServiceDep) -> dict[str, object]:
    assert service.engine is not None
    return {"weights": [ws.info() for ws in service.engine.weight_sets()],
            "not_loaded": service.not_loaded()}


@router.get("/{name}", dependencies=[ReaderDep, ServingDep])
async def get_weights(name: str, service: ServiceDep) -> dict[str, object]:
    return (await service.weight_set(name)).info()


@router.delete("/{name}", dependencies=[AdminDep])
async def delete_weights(name: str, request: Request, service: ServiceDep) -> dict[str, str]:
    with audited(request, "delete_weights", name) as record:
        check_name(name)
        service.check_serving(request)
        await service.delete_weights(name)
        record.status = 200
    return {"deleted": name}
