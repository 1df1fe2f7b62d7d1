"""Open Inference Protocol v2 (KServe / Triton): every weight set is a model.

Model `{name}` takes inputs "x" (T, K) in the set's dtype or FP32 and "counts" (E,) INT32
(or "offs", cumulative) and returns "y" (T, N) in x's dtype. JSON and the binary tensor data
extension are both accepted (tritonclient sends binary data and no Content-Type); outputs
come back binary when `binary_data_output` (request parameters) or an output's
`binary_data` parameter says so. `parameters.priority` (1 = highest, 0 = default) and
`parameters.timeout` (microseconds, 0 = none) feed the batcher. Only version "1" exists.
Triton's model configuration extension (`.../config`) describes each model as Triton's
ModelConfig does, for the tools that read it (perf_analyzer, model_analyzer).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from moe_gemm_server.engine import WeightSet

from .. import __version__
from ..config import MAX_US
from ..dependencies import ReaderDep, ServiceDep, ServingDep, hot_path
from ..errors import APIError, bad_request, request_id_of
from ..jobs import mm_job
from ..limits import read_body
from ..service import ClientGone, Service
from ..v2 import TORCH_TO_V2, V2Request, encode_response, parse_request
from .common import check_json_answer, off_loop_if_large, single_header

router = APIRouter(prefix="/v2", tags=["v2"])

VERSION = "1"
EXTENSIONS = ["binary_tensor_data", "model_configuration", "schedule_policy", "statistics"]
PLATFORM = "moe_gemm"


def _check_version(version: str) -> None:
    if version != VERSION:
        raise APIError(404, f"unknown model version {version!r}; only version '1' exists")


def _metadata(ws: WeightSet) -> dict[str, Any]:
    dt = TORCH_TO_V2[ws.act_dtype]  # (FP8 sets take and return bf16: the server quantizes)
    return {
        "name": ws.name,
        "versions": [VERSION],
        "platform": PLATFORM,
        "inputs": [
            {"name": "x", "datatype": dt, "shape": [-1, ws.K]},
            {"name": "counts", "datatype": "INT32", "shape": [ws.E]},
        ],
        "outputs": [{"name": "y", "datatype": dt, "shape": [-1, ws.N]}],
    }


def _config(ws: WeightSet, service: Service) -> dict[str, Any]:
    """The set's model configuration: Triton's ModelConfig protobuf as JSON (the field names
    and enum names of `model_config.proto`), its tensors those of the metadata (_metadata).

    max_batch_size is 0: in Triton's sense a model of max_batch_size > 0 takes a leading
    batch dimension on every input, cut off from its dims, and "counts" (E,) has none (a
    tool would send it as (batch,)). The server merges requests along the rows of x and y
    instead, the -1 of their dims: dynamic_batching (present while --batching is on) and
    the parameters give its limits.
    """
    s, engine = service.settings, service.engine
    assert engine is not None
    meta = _metadata(ws)
    device = engine.device
    config: dict[str, Any] = {
        "name": ws.name,
        "platform": PLATFORM,
        "backend": PLATFORM,
        "version_policy": {"specific": {"versions": [int(VERSION)]}},
        "max_batch_size": 0,
        "input": [{"name": t["name"], "data_type": f"TYPE_{t['datatype']}",
                   "dims": t["shape"]} for t in meta["inputs"]],
        "output": [{"name": t["name"], "data_type": f"TYPE_{t['datatype']}",
                    "dims": t["shape"]} for t in meta["outputs"]],
        # One launch at a time, on one device (the engine's lock and stream).
        "instance_group": [{"name": ws.name, "count": 1,
                            "kind": "KIND_GPU" if device.type == "cuda" else "KIND_CPU",
                            "gpus": [device.index or 0] if device.type == "cuda" else []}],
        "parameters": {
            "kernel_backend": {"string_value": engine.backend},
            "weight_dtype": {"string_value": str(ws.info()["dtype"])},
            "default_priority_level": {"string_value": str(s.default_priority)},
        },
    }
    if s.batching:
        config["dynamic_batching"] = {
            "max_queue_delay_microseconds": s.batch_delay_us,
            "preserve_ordering": False,
            # (the server's one queue, which every model shares)
            "default_queue_policy": {
                "timeout_action": "REJECT",
                "default_timeout_microseconds": s.default_timeout_us,
                "allow_timeout_override": True,
                "max_queue_size": s.max_queue,
            },
        }
        config["parameters"].update({
            "max_batch_rows": {"string_value": str(s.max_batch_rows)},
            "max_batch_flops": {"string_value": str(s.max_batch_flops)},
            "max_batch_requests": {"string_value": str(s.max_batch_requests)},
        })
    return config


@router.get("", dependencies=[ServingDep])
async def server_metadata(service: ServiceDep) -> dict[str, Any]:
    engine = service.engine
    return {
        "name": "moe-gemm-server",
        "version": __version__,
        "extensions": EXTENSIONS,
        "device": str(engine.device) if engine else None,
        "backend": engine.backend if engine else None,
    }


@router.get("/models/stats", dependencies=[ReaderDep, ServingDep])
async def all_stats(service: ServiceDep) -> dict[str, Any]:
    assert service.engine is not None
    return {"model_stats": [service.stats.as_v2(ws.name) for ws in service.engine.weight_sets()]}


@router.get("/models/{name}", dependencies=[ReaderDep, ServingDep])
async def model_metadata(name: str, service: ServiceDep) -> dict[str, Any]:
    return _metadata(await service.weight_set(name))


@router.get("/models/{name}/versions/{version}", dependencies=[ReaderDep, ServingDep])
async def model_version_metadata(name: str, version: str, service: ServiceDep) -> dict[str, Any]:
    _check_version(version)
    return _metadata(await service.weight_set(name))


@router.get("/models/{name}/config", dependencies=[ReaderDep, ServingDep])
async def model_config(name: str, service: ServiceDep) -> dict[str, Any]:
    return _config(await service.weight_set(name), service)


@router.get("/models/{name}/versions/{version}/config", dependencies=[ReaderDep, ServingDep])
async def model_version_config(name: str, version: str, service: ServiceDep) -> dict[str, Any]:
    _check_version(version)
    return _config(await service.weight_set(name), service)


async def _ready(name: str, request: Request, service: Service) -> JSONResponse:
    """A model's readiness probe: 503 while the server starts or drains (checked first: a set
    that is still loading is not unknown), 404 for an unknown model, else 200."""
    if not service.is_ready:
        return JSONResponse(
            {"name": name, "ready": False, "error": f"not ready: {service.not_ready_reason}",
             "request_id": request_id_of(request)}, status_code=503,
            headers={"Retry-After": "1"})
    await service.weight_set(name)
    return JSONResponse({"name": name, "ready": True})


@router.get("/models/{name}/ready", dependencies=[ReaderDep])
async def model_ready(name: str, request: Request, service: ServiceDep) -> JSONResponse:
    return await _ready(name, request, service)


@router.get("/models/{name}/versions/{version}/ready", dependencies=[ReaderDep])
async def model_version_ready(name: str, version: str, request: Request,
                              service: ServiceDep) -> JSONResponse:
    _check_version(version)
    return await _ready(name, request, service)


@router.get("/models/{name}/stats", dependencies=[ReaderDep, ServingDep])
async def model_stats(name: str, service: ServiceDep) -> dict[str, Any]:
    await service.weight_set(name)
    return {"model_stats": [service.stats.as_v2(name)]}


@router.get("/models/{name}/versions/{version}/stats", dependencies=[ReaderDep, ServingDep])
async def model_version_stats(name: str, version: str, service: ServiceDep) -> dict[str, Any]:
    _check_version(version)
    await service.weight_set(name)
    return {"model_stats": [service.stats.as_v2(name)]}


def _param_int(params: dict[str, Any], name: str) -> int | None:
    value = params.get(name)
    if value is None:
        return None
    # (the bound of the X-Priority / X-Timeout-Us headers, which these parameters mirror)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_US:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "..."
        raise bad_request(f"parameters.{name} must be a non-negative integer below 10^18; "
                          f"got {shown}")
    return value


def _binary_outputs(req: V2Request) -> dict[str, bool]:
    params = req.parameters or {}
    default = params.get("binary_data_output", False)
    if not isinstance(default, bool):
        raise bad_request("parameters.binary_data_output must be a boolean")
    if not req.outputs:
        return {"y": default}
    out: dict[str, bool] = {}
    for o in req.outputs:
        if o.name != "y":
            raise bad_request(f"unknown output {o.name!r}; the model has one output, 'y'")
        if o.name in out:
            # Two entries for one output may ask for it in two forms (binary and JSON); taking
            # the last one silently would answer a form the client may not read. Triton refuses
            # a repeated output as it does a repeated input (400 here too).
            raise bad_request(f"output {o.name!r} is requested twice")
        flag = (o.parameters or {}).get("binary_data", default)
        if not isinstance(flag, bool):
            raise bad_request("outputs[].parameters.binary_data must be a boolean")
        for p in ("classification", "shared_memory_region"):
            if p in (o.parameters or {}):
                raise bad_request(f"output parameter {p!r} is not supported")
        out["y"] = flag
    return out


def _check_inputs(model: str, names: list[str]) -> None:
    unknown = set(names) - {"x", "counts", "offs"}
    if unknown:
        raise bad_request(f"unexpected input(s) {sorted(unknown)}; model {model!r} takes "
                          "'x' and 'counts' (or 'offs')")


def _check_body_model(req: V2Request, name: str) -> None:
    """400 where the body names another model, or version, than the URL (the kserve client
    writes the model's name into the body): which of the two was meant is anyone's guess."""
    if req.model_name is not None and req.model_name != name:
        raise bad_request(f"the body's model_name {req.model_name!r} is not the URL's model "
                          f"{name!r}")
    if req.model_version not in (None, "", VERSION):
        raise bad_request(f"the body's model_version {req.model_version!r}: only version "
                          f"{VERSION!r} exists")


async def _infer(name: str, request: Request, service: Service) -> Response:
    with service.failures_counted(request, name):
        return await _infer_counted(name, request, service)


async def _infer_counted(name: str, request: Request, service: Service) -> Response:
    service.admit(request)
    ws = await service.weight_set(name)
    async with service.tracked():
        # (the request's own parameters.timeout is in the body: until it is read, the
        # server's --default-timeout-us bounds the wait for it)
        req, tensors = await service.by_deadline(service.deadline_for(request, None),
                                                 _infer_body(name, request, service))
        _check_body_model(req, name)
        params = req.parameters or {}
        for p in ("sequence_id", "sequence_start", "sequence_end"):
            if params.get(p):
                raise bad_request(f"parameters.{p}: this model is not a sequence model")
        binary = _binary_outputs(req)
        rid = str(req.id) if req.id is not None else request_id_of(request)
        job = mm_job(ws, tensors, service.settings,
                     priority=service.priority_level(_param_int(params, "priority")),
                     deadline=service.deadline_for(request, _param_int(params, "timeout")),
                     request_id=rid)
        if not binary["y"]:
            check_json_answer(job.rows * ws.N)
        try:
            y = await service.run(request, job)
        except ClientGone:
            return Response(status_code=499)
        if binary["y"] or y.numel() <= 65536:
            payload, hlen = encode_response(name, rid, {"y": y}, binary, VERSION)
        else:  # a large JSON answer is built off the event loop
            payload, hlen = await asyncio.to_thread(encode_response, name, rid, {"y": y},
                                                    binary, VERSION)
        if hlen is None:
            return Response(payload, media_type="application/json")
        return Response(payload, media_type="application/octet-stream",
                        headers={"Inference-Header-Content-Length": str(hlen)})


async def _infer_body(name: str, request: Request, service: Service
                      ) -> tuple[V2Request, dict[str, Any]]:
    """A v2 infer request's body, received and parsed: (request, input tensors)."""
    body = await read_body(request, service.settings.max_body_bytes)
    hlen = single_header(request, "inference-header-content-length")
    return await off_loop_if_large(
        body, lambda: parse_request(body, hlen, lambda names: _check_inputs(name, names)))


@router.post("/models/{name}/infer")
async def infer(name: str, request: Request) -> Response:
    return await _infer(name, request, hot_path(request))


@router.post("/models/{name}/versions/{version}/infer")
async def infer_version(name: str, version: str, request: Request) -> Response:
    service = hot_path(request)
    _check_version(version)
    return await _infer(name, request, service)
