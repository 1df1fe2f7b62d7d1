"""GET /metrics: Prometheus text exposition."""

from __future__ import annotations

from fastapi import APIRouter, Response

from ..dependencies import ServiceDep
from ..metrics import CONTENT_TYPE

router = APIRouter(tags=["metrics"])


@router.get("/metrics")
async def metrics(service: ServiceDep) -> Response:
    return Response(service.metrics.render(), media_type=CONTENT_TYPE)
