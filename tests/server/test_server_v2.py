"""Open Inference Protocol v2 against the real server: raw HTTP and the stock tritonclient."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
import torch
from server_testutils import (
    ADMIN_KEY,
    API_KEY,
    assert_close_to_ref,
    mm_ref,
    random_counts,
    st_body,
    st_load,
)

ml_dtypes = pytest.importorskip("ml_dtypes")
httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

E, K, N = 4, 32, 24
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def auth() -> dict[str, str]:
    """A fresh headers dict: tritonclient writes Inference-Header-Content-Length into the dict
    it is given, which would leak into the next request."""
    return dict(AUTH)


@pytest.fixture(scope="module")
def models(main_server) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(21)
    sets = {
        "v2-fp32": torch.randn(E, K, N, generator=gen),
        "v2-bf16": torch.randn(E, K, N, generator=gen).to(torch.bfloat16),
        "v2-fp16": torch.randn(E, K, N, generator=gen).to(torch.float16),
    }
    with httpx.Client(base_url=main_server.url, timeout=30,
                      headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as admin:
        for name, w in sets.items():
            r = admin.put(f"/v1/weights/{name}", content=st_body({"w": w}))
            assert r.status_code in (200, 201), r.text
    return sets


@pytest.fixture(scope="module")
def triton(main_server):
    client = httpclient.InferenceServerClient(main_server.url.removeprefix("http://"),
                                              network_timeout=60.0)
    yield client
    client.close()


def _inputs(x: np.ndarray, counts: np.ndarray, datatype: str, binary: bool) -> list:
    i0 = httpclient.InferInput("x", list(x.shape), datatype)
    i0.set_data_from_numpy(x, binary_data=binary)
    i1 = httpclient.InferInput("counts", list(counts.shape), "INT32")
    i1.set_data_from_numpy(counts, binary_data=binary)
    return [i0, i1]


def _case(T: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(T, K, generator=gen).to(dtype), random_counts(T, E, gen, empty=1)


def test_tritonclient_health_and_metadata(triton, models):
    assert triton.is_server_live(headers=auth())
    assert triton.is_server_ready(headers=auth())
    assert triton.is_model_ready("v2-bf16", headers=auth())
    assert not triton.is_model_ready("no-such-model", headers=auth())
    meta = triton.get_server_metadata(headers=auth())
    assert meta["name"] == "moe-gemm-server" and "binary_tensor_data" in meta["extensions"]
    mm = triton.get_model_metadata("v2-bf16", headers=auth())
    assert mm["name"] == "v2-bf16" and mm["versions"] == ["1"]
    assert mm["inputs"] == [{"name": "x", "datatype": "BF16", "shape": [-1, K]},
                            {"name": "counts", "datatype": "INT32", "shape": [E]}]
    assert mm["outputs"] == [{"name": "y", "datatype": "BF16", "shape": [-1, N]}]
    with pytest.raises(InferenceServerException) as ei:
        triton.get_model_metadata("no-such-model", headers=auth())
    assert "no-such-model" in ei.value.message()


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("T", [1, 45])
def test_tritonclient_infer_fp32(triton, models, binary, T):
    x, c = _case(T, torch.float32, T)
    outputs = None if binary else [httpclient.InferRequestedOutput("y", binary_data=False)]
    res = triton.infer("v2-fp32", _inputs(x.numpy(), c.numpy(), "FP32", binary),
                       outputs=outputs, request_id=f"req-{T}", headers=auth())
    resp = res.get_response()
    assert resp["id"] == f"req-{T}" and resp["model_name"] == "v2-fp32"
    out = resp["outputs"][0]
    assert ("binary_data_size" in out.get("parameters", {})) == binary
    y = res.as_numpy("y").copy()
    assert y.dtype == np.float32 and y.shape == (T, N)
    assert_close_to_ref(torch.from_numpy(y), mm_ref(x, models["v2-fp32"], c), torch.float32)


@pytest.mark.parametrize("binary_out", [True, False])
def test_tritonclient_infer_bf16(main_server, triton, models, binary_out):
    x, c = _case(33, torch.bfloat16, 3)
    x_np = x.float().numpy().astype(ml_dtypes.bfloat16)
    inputs = _inputs(x_np, c.numpy(), "BF16", True)  # BF16 input is binary-only in tritonclient
    outputs = [httpclient.InferRequestedOutput("y", binary_data=binary_out)]
    res = triton.infer("v2-bf16", inputs, outputs=outputs, headers=auth())
    y = res.as_numpy("y")
    assert y.shape == (33, N) and y.dtype == np.dtype(ml_dtypes.bfloat16)
    y_t = torch.from_numpy(y.astype(np.float32))
    assert_close_to_ref(y_t, mm_ref(x, models["v2-bf16"], c), torch.bfloat16)
    # the binary answer carries the raw bf16 bits of the engine's result, exactly
    r = httpx.post(f"{main_server.url}/v1/weights/v2-bf16/grouped-mm", headers=auth(),
                   content=st_body({"x": x, "counts": c}))
    from safetensors.torch import load

    assert torch.equal(load(r.content)["y"].float(), y_t)


def test_tritonclient_infer_fp16_priority_timeout_and_compression(triton, models):
    x, c = _case(20, torch.float16, 4)
    res = triton.infer("v2-fp16", _inputs(x.numpy(), c.numpy(), "FP16", True),
                       priority=1, timeout=30_000_000, headers=auth(),
                       request_compression_algorithm="gzip")
    y = torch.from_numpy(res.as_numpy("y").copy())
    assert y.dtype == torch.float16
    assert_close_to_ref(y, mm_ref(x, models["v2-fp16"], c), torch.float16)


def test_tritonclient_errors(triton, models):
    x, c = _case(5, torch.float32, 5)
    with pytest.raises(InferenceServerException) as ei:
        triton.infer("no-such-model", _inputs(x.numpy(), c.numpy(), "FP32", True), headers=auth())
    assert ei.value.status() == "404"
    bad_c = np.array([1, 1, 1, 1], dtype=np.int32)  # sums to 4, x has 5 rows
    with pytest.raises(InferenceServerException) as ei:
        triton.infer("v2-fp32", _inputs(x.numpy(), bad_c, "FP32", True), headers=auth())
    assert ei.value.status() == "422" and "sum to T = 5" in ei.value.message()
    with pytest.raises(InferenceServerException) as ei:
        triton.infer("v2-fp32", _inputs(x.numpy(), c.numpy(), "FP32", True))  # no key
    assert ei.value.status() == "401"
    assert triton.is_server_ready()


def test_tritonclient_stats(triton, models):
    x, c = _case(9, torch.float32, 6)
    for _ in range(2):
        triton.infer("v2-fp32", _inputs(x.numpy(), c.numpy(), "FP32", True), headers=auth())
    stats = triton.get_inference_statistics("v2-fp32", headers=auth())["model_stats"][0]
    assert stats["name"] == "v2-fp32" and stats["version"] == "1"
    inf = stats["inference_stats"]
    assert inf["success"]["count"] >= 2 and inf["success"]["ns"] > 0
    assert inf["queue"]["count"] >= 2 and inf["compute_infer"]["count"] >= 2
    assert stats["inference_count"] >= 18 and stats["execution_count"] >= 1
    assert sum(b["compute_infer"]["count"] for b in stats["batch_stats"]) == \
        stats["execution_count"]
    every = triton.get_inference_statistics(headers=auth())["model_stats"]
    assert "v2-fp32" in [s["name"] for s in every]


def _tensor_specs(specs: list[dict], config: bool) -> list[tuple]:
    """(name, datatype, shape) of the tensors of a model config (Triton's TYPE_ enum names)
    or of the model metadata."""
    if config:
        return [(t["name"], t["data_type"].removeprefix("TYPE_"), t["dims"]) for t in specs]
    return [(t["name"], t["datatype"], t["shape"]) for t in specs]


# Parses the JSON list on stdin as Triton's ModelConfig protobufs, strictly (an unknown field
# or enum name raises). In a child: tritonclient.grpc registers the "inference" protobuf
# package, which the kserve client's own registers again, and a process takes one of them.
_PARSE_AS_MODEL_CONFIG = """
import json, sys
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2
for config in json.load(sys.stdin):
    json_format.ParseDict(config, model_config_pb2.ModelConfig())
"""


def test_tritonclient_model_config(main_server, triton, models):
    """GET /v2/models/{name}/config, Triton's model configuration extension, which
    perf_analyzer reads before its first request, was 404 "no route". It is the set's
    ModelConfig now: Triton's field and enum names (it parses, strictly, as Triton's own
    protobuf), the metadata's tensors, max_batch_size 0 (counts has no batch dimension) and
    the dynamic batcher the server runs (this one: --batch-delay-us 2000)."""
    pytest.importorskip("google.protobuf.json_format")
    assert "model_configuration" in triton.get_server_metadata(headers=auth())["extensions"]
    configs = [triton.get_model_config(name, headers=auth()) for name in models]
    parsed = subprocess.run([sys.executable, "-c", _PARSE_AS_MODEL_CONFIG], capture_output=True,
                            text=True, input=json.dumps(configs), timeout=120)
    assert parsed.returncode == 0, parsed.stderr
    for name, config in zip(models, configs):
        meta = triton.get_model_metadata(name, headers=auth())
        assert config["name"] == name
        assert config["platform"] == config["backend"] == meta["platform"] == "moe_gemm"
        assert config["max_batch_size"] == 0
        assert _tensor_specs(config["input"], True) == _tensor_specs(meta["inputs"], False)
        assert _tensor_specs(config["output"], True) == _tensor_specs(meta["outputs"], False)
        assert config["input"][0]["dims"] == [-1, K]
        batcher = config["dynamic_batching"]
        assert batcher["max_queue_delay_microseconds"] == 2000
        assert batcher["default_queue_policy"]["max_queue_size"] == 1024
        assert config["instance_group"][0]["count"] == 1
        assert triton.get_model_config(name, model_version="1", headers=auth()) == config
    # errors: the answers of the metadata route, in the same JSON shape
    for path in ("/v2/models/no-such-model", "/v2/models/v2-fp32/versions/2"):
        meta_r = httpx.get(f"{main_server.url}{path}", headers=auth())
        r = httpx.get(f"{main_server.url}{path}/config", headers=auth())
        assert r.status_code == meta_r.status_code == 404, r.text
        assert set(r.json()) == set(meta_r.json()) == {"error", "request_id"}
    with pytest.raises(InferenceServerException) as ei:
        triton.get_model_config("no-such-model", headers=auth())
    assert ei.value.status() == "404" and "no-such-model" in ei.value.message()
    r = httpx.get(f"{main_server.url}/v2/models/.hidden/config", headers=auth())
    assert r.status_code == 422 and "invalid weight set name" in r.json()["error"]
    assert httpx.get(f"{main_server.url}/v2/models/v2-fp32/config").status_code == 401


def _config_of_a_set(settings) -> dict:
    """/v2/models/m/config of an in-process server with `settings` and one bf16 set "m"."""
    from fastapi.testclient import TestClient

    from moe_gemm_server import create_app
    from moe_gemm_server.engine import Engine

    app = create_app(settings, engine=Engine("cpu", warmup_rows=[1]))
    with TestClient(app) as client:
        deadline = time.monotonic() + 30
        while client.get("/v2/health/ready").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        w = torch.randn(E, K, N).to(torch.bfloat16)
        assert client.put("/v1/weights/m", content=st_body({"w": w})).status_code == 201
        return client.get("/v2/models/m/config").json()


def test_model_config_says_when_the_server_does_not_batch(tmp_path):
    """With --no-batching the config has no dynamic_batching (nor the merge limits)."""
    from moe_gemm_server import Settings

    config = _config_of_a_set(Settings(data_dir=tmp_path, batching=False))
    assert "dynamic_batching" not in config and "max_batch_rows" not in config["parameters"]
    assert config["input"][0] == {"name": "x", "data_type": "TYPE_BF16", "dims": [-1, K]}
    assert config["instance_group"][0]["kind"] == "KIND_CPU"


def test_model_config_numbers_fit_tritons_fields_at_the_largest_settings(tmp_path):
    """Every number the config reports fits its ModelConfig field (uint64 microseconds,
    uint32 max_queue_size) at the largest values the settings take; one past them refuses
    the start (a config past them did not parse as Triton's)."""
    pytest.importorskip("google.protobuf.json_format")
    from pydantic import ValidationError

    from moe_gemm_server import Settings

    largest = {"default_timeout_us": 10**18 - 1, "batch_delay_us": 10**18 - 1,
               "max_queue": (1 << 32) - 1}
    for field, value in largest.items():
        with pytest.raises(ValidationError, match=field):
            Settings(data_dir=tmp_path, **{field: value + 1})
    config = _config_of_a_set(Settings(data_dir=tmp_path, **largest))
    batcher = config["dynamic_batching"]
    assert batcher["max_queue_delay_microseconds"] == largest["batch_delay_us"]
    policy = batcher["default_queue_policy"]
    assert policy["default_timeout_microseconds"] == largest["default_timeout_us"]
    assert policy["max_queue_size"] == largest["max_queue"]
    parsed = subprocess.run([sys.executable, "-c", _PARSE_AS_MODEL_CONFIG], capture_output=True,
                            text=True, input=json.dumps([config]), timeout=120)
    assert parsed.returncode == 0, parsed.stderr


# --------------------------------------------------------------------------- raw protocol


def _binary_body(header: dict, *blobs: bytes) -> tuple[bytes, dict[str, str]]:
    h = json.dumps(header).encode()
    return h + b"".join(blobs), {"Inference-Header-Content-Length": str(len(h)), **AUTH}


def test_raw_json_infer_nested_and_flat(main_server, models):
    x, c = _case(6, torch.float32, 7)
    for data in (x.tolist(), x.flatten().tolist()):
        req = {"id": "j1", "inputs": [
            {"name": "x", "shape": [6, K], "datatype": "FP32", "data": data},
            {"name": "counts", "shape": [E], "datatype": "INT32", "data": c.tolist()}]}
        r = httpx.post(f"{main_server.url}/v2/models/v2-fp32/infer", json=req, headers=auth())
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["id"] == "j1" and body["model_name"] == "v2-fp32"
        out = body["outputs"][0]
        assert out["name"] == "y" and out["shape"] == [6, N] and out["datatype"] == "FP32"
        y = torch.tensor(out["data"]).reshape(6, N)
        assert_close_to_ref(y, mm_ref(x, models["v2-fp32"], c), torch.float32)
    # version path and offs input
    req["inputs"][1] = {"name": "offs", "shape": [E], "datatype": "INT32",
                        "data": torch.cumsum(c, 0).tolist()}
    r = httpx.post(f"{main_server.url}/v2/models/v2-fp32/versions/1/infer", json=req,
                   headers=auth())
    assert r.status_code == 200, r.text
    assert httpx.post(f"{main_server.url}/v2/models/v2-fp32/versions/7/infer", json=req,
                      headers=auth()).status_code == 404


def test_raw_json_float_data_with_integers_beyond_int64(main_server, models):
    """A JSON integer is a number for a float input whatever its size: 10**20 written out in
    digits (beyond int64, where numpy keeps Python objects) answers as 1e20 does."""
    x, c = _case(2, torch.float32, 9)
    answers = []
    for big in (10**20, 1e20, -(10**19), -1e19):
        data = x.flatten().tolist()
        data[0] = big
        req = {"inputs": [{"name": "x", "shape": [2, K], "datatype": "FP32", "data": data},
                          {"name": "counts", "shape": [E], "datatype": "INT32",
                           "data": c.tolist()}]}
        r = httpx.post(f"{main_server.url}/v2/models/v2-fp32/infer",
                       content=json.dumps(req).encode(), headers=auth())
        assert r.status_code == 200, r.text
        answers.append(r.json()["outputs"][0]["data"])
    assert answers[0] == answers[1] and answers[2] == answers[3]
    for bad in (10**400, None, "1"):  # no float holds 10**400; null and strings stay refused
        data = [10**20] + x.flatten().tolist()[1:]
        data[1] = bad
        req["inputs"][0]["data"] = data
        r = httpx.post(f"{main_server.url}/v2/models/v2-fp32/infer",
                       content=json.dumps(req).encode(), headers=auth())
        assert r.status_code == 400, r.text


def test_raw_binary_infer_and_binary_output(main_server, models):
    x, c = _case(10, torch.float32, 8)
    xb, cb = x.numpy().tobytes(), c.numpy().tobytes()
    header = {"inputs": [
        {"name": "x", "shape": [10, K], "datatype": "FP32",
         "parameters": {"binary_data_size": len(xb)}},
        {"name": "counts", "shape": [E], "datatype": "INT32",
         "parameters": {"binary_data_size": len(cb)}}],
        "outputs": [{"name": "y", "parameters": {"binary_data": True}}]}
    body, headers = _binary_body(header, xb, cb)
    r = httpx.post(f"{main_server.url}/v2/models/v2-fp32/infer", content=body, headers=headers)
    assert r.status_code == 200, r.text
    hlen = int(r.headers["inference-header-content-length"])
    meta = json.loads(r.content[:hlen])
    size = meta["outputs"][0]["parameters"]["binary_data_size"]
    assert size == 10 * N * 4 and len(r.content) == hlen + size
    y = torch.from_numpy(np.frombuffer(r.content[hlen:], dtype=np.float32).reshape(10, N).copy())
    assert_close_to_ref(y, mm_ref(x, models["v2-fp32"], c), torch.float32)
    # gzip-compressed request body
    r = httpx.post(f"{main_server.url}/v2/models/v2-fp32/infer", content=gzip.compress(body),
                   headers={**headers, "Content-Encoding": "gzip"})
    assert r.status_code == 200 and r.content[hlen:] == body_y(r)


def body_y(r: httpx.Response) -> bytes:
    return r.content[int(r.headers["inference-header-content-length"]):]


def _bad_v2_cases() -> list[tuple[str, bytes, dict[str, str], int]]:
    x = np.ones((2, K), np.float32).tobytes()
    c = np.array([2, 0, 0, 0], np.int32).tobytes()

    def hdr(xsize: int = len(x), csize: int = len(c), xdt: str = "FP32",
            xshape: list | None = None, extra: dict | None = None) -> dict:
        h = {"inputs": [
            {"name": "x", "shape": xshape or [2, K], "datatype": xdt,
             "parameters": {"binary_data_size": xsize}},
            {"name": "counts", "shape": [E], "datatype": "INT32",
             "parameters": {"binary_data_size": csize}}]}
        h.update(extra or {})
        return h

    cases = []
    body, h = _binary_body(hdr(), x, c)
    cases.append(("header length larger than body", body,
                  {**h, "Inference-Header-Content-Length": str(len(body) + 1)}, 400))
    cases.append(("header length not a number", body,
                  {**h, "Inference-Header-Content-Length": "abc"}, 400))
    n = h["Inference-Header-Content-Length"]
    for loose in (f"+{n}", f"{n[:-1]}_{n[-1]}", f"0x{int(n):x}"):
        cases.append((f"header length {loose!r} is not a plain byte count", body,
                      {**h, "Inference-Header-Content-Length": loose}, 400))
    cases.append(("header length of 5000 digits", body,
                  {**h, "Inference-Header-Content-Length": "9" * 5000}, 400))
    cases.append(("header length cuts the JSON", body,
                  {**h, "Inference-Header-Content-Length": "10"}, 400))
    body, h = _binary_body(hdr(xsize=len(x) - 4), x, c)
    cases.append(("binary size does not match shape", body, h, 400))
    body, h = _binary_body(hdr(), x, c + b"\0\0\0\0")
    cases.append(("extra trailing bytes", body, h, 400))
    body, h = _binary_body(hdr(), x)
    cases.append(("binary data missing", body, h, 400))
    both = hdr()
    both["inputs"][0]["data"] = [0.0] * 2 * K  # disagrees with the binary copy of x
    body, h = _binary_body(both, x, c)
    cases.append(("input with both data and binary_data_size", body, h, 400))
    body, h = _binary_body(hdr(xdt="FP33"), x, c)
    cases.append(("unknown datatype", body, h, 400))
    body, h = _binary_body(hdr(xdt="BYTES"), x, c)
    cases.append(("BYTES input", body, h, 400))
    body, h = _binary_body(hdr(extra={"outputs": [{"name": "z"}]}), x, c)
    cases.append(("unknown output", body, h, 400))
    body, h = _binary_body(hdr(extra={"outputs": [{"name": "y", "parameters": {"binary_data": True}},
                                                  {"name": "y"}]}), x, c)
    cases.append(("output requested twice", body, h, 400))
    body, h = _binary_body(hdr(xdt="FP64", xsize=2 * len(x)), x + x, c)
    cases.append(("wrong dtype for the model", body, h, 422))
    body, h = _binary_body(hdr(xshape=[1, 2 * K]), x, c)
    cases.append(("wrong K", body, h, 422))
    j = {"inputs": [{"name": "x", "shape": [2, K], "datatype": "FP32", "data": [1.0] * 3},
                    {"name": "counts", "shape": [E], "datatype": "INT32", "data": [2, 0, 0, 0]}]}
    cases.append(("json data count mismatch", json.dumps(j).encode(), AUTH, 400))
    # nested, the right count, another shape: [[...K...], [...K...]] is [2, K], not [K, 2]
    jn = {"inputs": [{"name": "x", "shape": [K, 2], "datatype": "FP32",
                      "data": [[1.0] * K, [1.0] * K]},
                     {"name": "counts", "shape": [E], "datatype": "INT32",
                      "data": [2, 0, 0, 0]}]}
    cases.append(("json nested other than its shape", json.dumps(jn).encode(), AUTH, 400))
    jn2 = {"inputs": [{"name": "x", "shape": [2, K], "datatype": "FP32",
                       "data": [[1.0] * (2 * K)]},
                      {"name": "counts", "shape": [E], "datatype": "INT32",
                       "data": [2, 0, 0, 0]}]}
    cases.append(("json nested one level short", json.dumps(jn2).encode(), AUTH, 400))
    j2 = {"inputs": [{"name": "q", "shape": [1], "datatype": "FP32", "data": [1.0]}]}
    cases.append(("unexpected input", json.dumps(j2).encode(), AUTH, 400))
    cases.append(("not json", b"{{{", AUTH, 400))
    cases.append(("no inputs", b'{"inputs": []}', AUTH, 400))
    j3 = dict(j, parameters={"priority": -1})
    j3["inputs"][0]["data"] = [1.0] * 2 * K
    cases.append(("negative priority", json.dumps(j3).encode(), AUTH, 400))
    for name, huge in (("priority", 2 ** 70), ("timeout", 10 ** 30), ("timeout", 10 ** 18)):
        # (the bound of the X-Priority / X-Timeout-Us headers these mirror)
        jh = dict(j3, parameters={name: huge})
        cases.append((f"{name} {huge} past 10^18", json.dumps(jh).encode(), AUTH, 400))
    j4 = dict(j3, parameters={})
    j4["inputs"][0]["data"] = [1.0] * (2 * K - 1) + [1e39]  # finite JSON, beyond FP32: not inf
    cases.append(("json value beyond the datatype's range", json.dumps(j4).encode(), AUTH, 400))
    return cases


def test_a_binary_header_length_given_twice_with_different_values_is_refused(main_server,
                                                                            models):
    x = np.ones((2, K), np.float32).tobytes()
    c = np.array([2, 0, 0, 0], np.int32).tobytes()
    h = {"inputs": [{"name": "x", "shape": [2, K], "datatype": "FP32",
                     "parameters": {"binary_data_size": len(x)}},
                    {"name": "counts", "shape": [E], "datatype": "INT32",
                     "parameters": {"binary_data_size": len(c)}}]}
    body, headers = _binary_body(h, x, c)
    n = headers.pop("Inference-Header-Content-Length")
    url = f"{main_server.url}/v2/models/v2-fp32/infer"
    twice = [*headers.items(), ("Inference-Header-Content-Length", n)]
    r = httpx.post(url, content=body, headers=[*twice, ("Inference-Header-Content-Length", "5")])
    assert r.status_code == 400 and "given 2 times" in r.json()["error"], r.text
    r = httpx.post(url, content=body, headers=[*twice, ("Inference-Header-Content-Length", n)])
    assert r.status_code == 200, r.text  # the same value twice is that value
    r = httpx.post(url, content=body,
                   headers=[*twice, ("Inference-Header-Content-Length", "00" + n)])
    assert r.status_code == 200, r.text  # ... also written with leading zeros


@pytest.mark.parametrize("case", _bad_v2_cases(), ids=lambda c: c[0])
def test_bad_v2_requests(main_server, models, case):
    _, body, headers, status = case
    r = httpx.post(f"{main_server.url}/v2/models/v2-fp32/infer", content=body, headers=headers)
    assert r.status_code == status, r.text
    assert isinstance(r.json()["error"], str)
    assert httpx.get(f"{main_server.url}/v2/health/ready").status_code == 200


def _overflowing(T: int) -> tuple[list[float], list[int]]:
    """FP32 x whose products with the v2-fp32 set overflow: every answer row holds an inf (or
    a NaN, inf - inf), and so does expert 0's."""
    return [3e38] * (T * K), [T, 0, 0, 0]


def test_a_json_answer_holding_non_finite_values_is_422_pointing_to_binary(main_server,
                                                                              models):
    """NaN and Infinity are no JSON: the answer was written with Python's NaN / Infinity
    tokens, which strict parsers (the kserve client's, this server's own request parser)
    refuse. It is a 422 naming the binary form now, and the binary form carries the values."""
    data, counts = _overflowing(2)
    req = {"inputs": [{"name": "x", "shape": [2, K], "datatype": "FP32", "data": data},
                      {"name": "counts", "shape": [E], "datatype": "INT32", "data": counts}]}
    url = f"{main_server.url}/v2/models/v2-fp32/infer"
    r = httpx.post(url, json=req, headers=auth())
    assert r.status_code == 422, r.text
    msg = json.loads(r.content)["error"]  # (strict JSON: the answer parses)
    assert "the result 'y' holds" in msg and "NaN or infinity" in msg, msg
    assert "binary_data_output" in msg and "binary_data: true" in msg, msg
    r = httpx.post(url, json={**req, "parameters": {"binary_data_output": True}},
                   headers=auth())
    assert r.status_code == 200, r.text
    y = np.frombuffer(body_y(r), dtype=np.float32)
    assert y.size == 2 * N and not np.isfinite(y).any()
    # the native JSON form alike, pointing to safetensors
    x = torch.tensor(data).reshape(2, K)
    r = httpx.post(f"{main_server.url}/v1/weights/v2-fp32/grouped-mm", headers=auth(),
                   json={"x": x.tolist(), "counts": counts})
    assert r.status_code == 422 and "send the request as safetensors" in r.json()["error"]
    r = httpx.post(f"{main_server.url}/v1/weights/v2-fp32/grouped-mm", headers=auth(),
                   content=st_body({"x": x, "counts": torch.tensor(counts)}))
    assert r.status_code == 200 and not torch.isfinite(st_load(r.content)["y"]).any()


def test_uint64_values_past_int64_are_read_as_uint64_in_json_as_in_binary(main_server, models):
    """A UINT64 counts of 2^63 was 400 "outside the int64 range" in JSON, 422 (counts must be
    int32 or int64) in binary: the same tensor, two statuses. JSON now reads it as UINT64
    too (exactly: beside small values numpy made it a float) and both are 422."""
    url = f"{main_server.url}/v2/models/v2-fp32/infer"
    x = {"name": "x", "shape": [1, K], "datatype": "FP32", "data": [1.0] * K}
    for values in ([2**63, 0, 0, 0], [2**64 - 1, 1, 2, 3], [1, 0, 0, 0]):
        counts = np.array(values, dtype=np.uint64)
        binary = {"inputs": [x, {"name": "counts", "shape": [E], "datatype": "UINT64",
                                 "parameters": {"binary_data_size": counts.nbytes}}]}
        body, headers = _binary_body(binary, counts.tobytes())
        as_binary = httpx.post(url, content=body, headers=headers)
        as_json = httpx.post(url, headers=auth(), json={"inputs": [
            x, {"name": "counts", "shape": [E], "datatype": "UINT64", "data": values}]})
        assert as_binary.status_code == as_json.status_code == 422, (values, as_json.text)
        assert as_json.json()["error"] == as_binary.json()["error"]
        assert "got uint64" in as_json.json()["error"]
    r = httpx.post(url, headers=auth(), json={"inputs": [
        x, {"name": "counts", "shape": [E], "datatype": "UINT64", "data": [2**64, 0, 0, 0]}]})
    assert r.status_code == 400 and "UINT64" in r.json()["error"]  # (no UINT64 holds it)


@pytest.mark.parametrize("where, field", [
    ("the request", "output"), ("the request", "priority"), ("the request", "parameter"),
    ("inputs[1]", "contents"), ("outputs[0]", "binary_data"),
])
def test_unknown_v2_fields_are_400_naming_them(main_server, models, where, field):
    """A member the protocol does not define was dropped silently: a misspelt "output" or a
    top-level "priority" was a request answered as if it had not asked. 400 now, naming the
    field and `parameters`, the protocol's place for other options."""
    x, c = _case(1, torch.float32, 3)
    req: dict = {"inputs": [
        {"name": "x", "shape": [1, K], "datatype": "FP32", "data": x.flatten().tolist()},
        {"name": "counts", "shape": [E], "datatype": "INT32", "data": c.tolist()}],
        "outputs": [{"name": "y"}]}
    target = req if where == "the request" else req[where[:-3]][int(where[-2])]
    target[field] = True
    r = httpx.post(f"{main_server.url}/v2/models/v2-fp32/infer", json=req, headers=auth())
    assert r.status_code == 400, r.text
    msg = r.json()["error"]
    assert f"{where} has unknown field(s) {field!r}" in msg and "'parameters'" in msg, msg


def test_the_kserve_client_works_and_gets_the_non_finite_refusal(main_server, models):
    """The kserve client sends the model's name in the body ("model_name", beside the
    protocol's members): taken where it names the URL's model, 400 where it names another.
    A non-finite JSON answer made it fail parsing the answer; it gets the 422 now."""
    kserve = pytest.importorskip("kserve")
    import asyncio

    x, c = _case(3, torch.float32, 5)

    def request(model: str, xs: np.ndarray):
        i0 = kserve.InferInput("x", list(xs.shape), "FP32")
        i0.set_data_from_numpy(xs, binary_data=False)
        i1 = kserve.InferInput("counts", [E], "INT32")
        i1.set_data_from_numpy(c.numpy(), binary_data=False)
        return kserve.InferRequest(model_name=model, infer_inputs=[i0, i1])

    async def infer(model: str, xs: np.ndarray, url_model: str = "v2-fp32"):
        client = kserve.InferenceRESTClient(kserve.RESTConfig(protocol="v2", retries=0))
        return await client.infer(main_server.url, request(model, xs), model_name=url_model,
                                  headers=auth())

    answer = asyncio.run(infer("v2-fp32", x.numpy()))
    y = torch.from_numpy(answer.outputs[0].as_numpy().reshape(3, N).copy())
    assert_close_to_ref(y, mm_ref(x, models["v2-fp32"], c), torch.float32)
    with pytest.raises(httpx.HTTPStatusError) as ei:
        asyncio.run(infer("v2-bf16", x.numpy()))
    assert ei.value.response.status_code == 400 and "model_name 'v2-bf16'" in str(ei.value)
    with pytest.raises(httpx.HTTPStatusError) as ei:
        asyncio.run(infer("v2-fp32", np.full((3, K), 3e38, np.float32)))
    assert ei.value.response.status_code == 422 and "binary_data" in str(ei.value)


def test_stats_fail_counts_every_failed_request_of_the_model(main_server):
    """Triton's `fail` counts a model's failed requests; it counted only those that reached
    the queue (a timeout, a device error), never a refused body or parameter. Now every
    request naming a resident set that ends in an error counts, on both APIs, once."""
    name = "v2-failcount"
    w = torch.randn(E, K, N)
    url = main_server.url
    with httpx.Client(base_url=url, timeout=30) as http:
        assert http.put(f"/v1/weights/{name}", content=st_body({"w": w}),
                        headers={"Authorization": f"Bearer {ADMIN_KEY}"}).status_code == 201

        def counts() -> tuple[int, int]:
            r = http.get(f"/v2/models/{name}/stats", headers=AUTH)
            inf = r.json()["model_stats"][0]["inference_stats"]
            return inf["success"]["count"], inf["fail"]["count"]

        good = {"inputs": [{"name": "x", "shape": [2, K], "datatype": "FP32",
                            "data": [0.5] * (2 * K)},
                           {"name": "counts", "shape": [E], "datatype": "INT32",
                            "data": [2, 0, 0, 0]}]}
        bad_shape = json.loads(json.dumps(good))
        bad_shape["inputs"][0]["shape"] = [2, K + 1]
        bad_param = dict(good, parameters={"sequence_id": 7})
        assert http.post(f"/v2/models/{name}/infer", json=good, headers=AUTH).status_code == 200
        assert counts() == (1, 0)
        for body in (bad_shape, bad_param):
            r = http.post(f"/v2/models/{name}/infer", json=body, headers=AUTH)
            assert r.status_code == 400, r.text
        assert counts() == (1, 2)
        r = http.post(f"/v1/weights/{name}/grouped-mm", content=b"not safetensors",
                      headers=AUTH)
        assert r.status_code in (400, 422), r.text
        assert counts() == (1, 3)
        # a request the server never saw as this model's: no count
        assert http.post(f"/v2/models/{name}-other/infer", json=good,
                         headers=AUTH).status_code == 404
        assert http.post(f"/v2/models/{name}/infer", json=good).status_code == 401
        assert counts() == (1, 3)
        assert http.delete(f"/v1/weights/{name}",
                           headers={"Authorization": f"Bearer {ADMIN_KEY}"}).status_code == 200
