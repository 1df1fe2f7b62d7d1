"""Native matmul routes: grouped-mm against a resident weight set, and ad-hoc grouped-gemm.

Bodies are safetensors (or JSON for small requests); the answer uses the request's format.
Per-request priority and timeout come from the X-Priority and X-Timeout-Us headers.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response

from ..codecs import (
    decode_json_grouped_gemm,
    decode_json_grouped_mm,
    decode_safetensors,
    dtype_name,
    parse_json_object,
)
from ..dependencies import hot_path
from ..errors import request_id_of
from ..jobs import check_mm_names, check_problem_count, gemm_job, gemm_problems, mm_job
from ..limits import read_body
from ..service import ClientGone, Service
from .common import (
    body_format,
    check_json_answer,
    native_params,
    off_loop_if_large,
    tensors_response,
)

router = APIRouter(tags=["matmul"])


@router.post("/v1/weights/{name}/grouped-mm")
async def grouped_mm(name: str, request: Request) -> Response:
    """y (T, N): rows of x grouped by expert (counts or offs) times the set's weights."""
    service = hot_path(request)
    with service.failures_counted(request, name):
        return await _grouped_mm(name, request, service)


async def _grouped_mm(name: str, request: Request, service: Service) -> Response:
    service.admit(request)
    ws = await service.weight_set(name)
    fmt = body_format(request)
    priority, timeout_us = native_params(request)
    deadline = service.deadline_for(request, timeout_us)
    async with service.tracked():
        tensors = await service.by_deadline(deadline, _mm_tensors(request, service, fmt, ws.K))
        job = mm_job(ws, tensors, service.settings,
                     priority=service.priority_level(priority),
                     deadline=deadline,
                     request_id=request_id_of(request))
        if fmt == "json":
            check_json_answer(job.rows * ws.N)
        try:
            y = await service.run(request, job)
        except ClientGone:
            return Response(status_code=499)
        extra = {"dtype": dtype_name(y.dtype)} if fmt == "json" else None
        return await tensors_response({"y": y}, fmt, extra)


@router.post("/v1/grouped-gemm")
async def grouped_gemm(request: Request) -> Response:
    """d.i = a.i @ b.i for every problem i of the request."""
    service = hot_path(request)
    service.admit(request)
    fmt = body_format(request)
    priority, timeout_us = native_params(request)
    deadline = service.deadline_for(request, timeout_us)
    async with service.tracked():
        tensors = await service.by_deadline(deadline, _gemm_tensors(request, service, fmt))
        job = gemm_job(tensors, service.settings,
                       priority=service.priority_level(priority),
                       deadline=deadline,
                       request_id=request_id_of(request))
        if fmt == "json":
            a, b = job.payload
            check_json_answer(sum(ai.shape[0] * bi.shape[1] for ai, bi in zip(a, b)))
        try:
            d = await service.run(request, job)
        except ClientGone:
            return Response(status_code=499)
        if fmt == "json":
            return await tensors_response({f"d.{i}": t for i, t in enumerate(d)}, "json-list",
                                          {"dtype": dtype_name(job.out_dtype)})
        return await tensors_response({f"d.{i}": t for i, t in enumerate(d)}, fmt)


async def _mm_tensors(request: Request, service: Service, fmt: str, K: int
                      ) -> dict[str, Any]:
    """A grouped-mm request's body, received and decoded: x, counts / offs."""
    body = await read_body(request, service.settings.max_body_bytes)
    if fmt == "json":
        return await off_loop_if_large(
            body, lambda: decode_json_grouped_mm(parse_json_object(body), K))
    # (a large header takes a while to parse: off the event loop, as JSON is)
    return await off_loop_if_large(body, lambda: decode_safetensors(
        body, max_tensors=3, name_rules=check_mm_names))


async def _gemm_tensors(request: Request, service: Service, fmt: str) -> dict[str, Any]:
    """A grouped-gemm request's body, received and decoded: a.i, b.i."""
    body = await read_body(request, service.settings.max_body_bytes)
    settings = service.settings
    if fmt == "json":
        return await off_loop_if_large(body, lambda: decode_json_grouped_gemm(
            parse_json_object(body), lambda G: check_problem_count(G, settings)))
    return await off_loop_if_large(body, lambda: decode_safetensors(
        body, max_tensors=2 * settings.max_problems,
        name_rules=lambda names: gemm_problems(names, settings)))
