"""The answers docs/HTTP-API.md promises, in-process: every route while starting and draining,
body limits that name their flag, one status for one mistake whatever the body format, and
error messages that say what is accepted."""

from __future__ import annotations

import gzip
import re
import threading
import time

import pytest
import torch
from fastapi.testclient import TestClient
from server_testutils import st_body

from moe_gemm_server import Settings, create_app
from moe_gemm_server.engine import Engine

# Probes and metrics answer while starting and draining; every other route answers 503.
PROBES = {"/v2/health/live": 200, "/v2/health/ready": 503, "/metrics": 200,
          "/v2/models/{name}/ready": 503, "/v2/models/{name}/versions/{version}/ready": 503}


def _wait_ready(client: TestClient) -> None:
    deadline = time.monotonic() + 30
    while client.get("/v2/health/ready").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def _every_route(client: TestClient) -> list[tuple[str, str, str]]:
    """(method, template, concrete path) for every API route of the app."""
    out = []
    for template, methods in client.app.openapi()["paths"].items():
        path = template.replace("{name}", "m").replace("{version}", "1")
        for method in sorted(methods):
            out.append((method.upper(), template, path))
    return out


def _check_every_route(client: TestClient, reason: str) -> None:
    routes = _every_route(client)
    templates = {t for _, t, _ in routes}
    # The walk covers the whole API (a new route is checked without editing this test).
    assert {"/v1/weights", "/v1/weights/{name}", "/v1/weights/{name}/grouped-mm",
            "/v1/grouped-gemm", "/v2", "/v2/models/{name}/infer"} <= templates
    for method, template, path in routes:
        r = client.request(method, path, content=b"{}",
                           headers={"Content-Type": "application/json"})
        want = PROBES.get(template, 503)
        assert r.status_code == want, (method, path, r.status_code, r.text)
        if want == 503:
            assert r.headers.get("Retry-After") == "1", (method, path)
            assert reason in r.json()["error"], (method, path, r.text)


def test_every_route_but_the_probes_answers_503_while_draining(tmp_path):
    with TestClient(create_app(Settings(data_dir=tmp_path / "d"))) as client:
        _wait_ready(client)
        assert client.put("/v1/weights/m", content=st_body({"w": torch.randn(2, 4, 3)})
                          ).status_code == 201
        assert client.get("/v1/weights").status_code == 200
        service = client.app.state.service
        assert client.portal.call(service.drain, 1.0) is True
        _check_every_route(client, "draining")


class SlowStartEngine(Engine):
    def __init__(self) -> None:
        super().__init__("cpu")
        self.release = threading.Event()

    def warm_up_grouped_gemm(self, dtypes=(torch.bfloat16,)):
        assert self.release.wait(30)
        super().warm_up_grouped_gemm(dtypes)


def test_every_route_but_the_probes_answers_503_while_starting(tmp_path):
    engine = SlowStartEngine()
    with TestClient(create_app(Settings(data_dir=tmp_path / "d"), engine=engine)) as client:
        try:
            _check_every_route(client, "not ready")
        finally:
            engine.release.set()
        _wait_ready(client)
        assert client.get("/v1/weights").status_code == 200


@pytest.fixture
def small(tmp_path):
    settings = Settings(data_dir=tmp_path / "d", max_body_bytes=4096, max_weight_bytes=8192)
    with TestClient(create_app(settings)) as client:
        _wait_ready(client)
        yield client


def test_body_limits_name_their_flag(small):
    big = b"\0" * 5000
    url = "/v1/grouped-gemm"
    r = small.post(url, content=big)  # Content-Length over the limit: refused before reading
    assert r.status_code == 413 and "4096 bytes (--max-body-bytes)" in r.json()["error"]
    r = small.post(url, content=iter([big[:3000], big[3000:]]))  # chunked: counted
    assert r.status_code == 413 and "4096 bytes (--max-body-bytes)" in r.json()["error"]
    r = small.post(url, content=gzip.compress(big), headers={"Content-Encoding": "gzip"})
    assert r.status_code == 413 and "decompressed" in r.json()["error"]
    assert "(--max-body-bytes)" in r.json()["error"]
    w = torch.randn(4, 16, 40)  # ~10 KB of safetensors
    r = small.put("/v1/weights/big", content=st_body({"w": w}))
    assert r.status_code == 413 and "8192 bytes (--max-weight-bytes)" in r.json()["error"]
    r = small.put("/v1/weights/big", content=iter([st_body({"w": w})]))
    assert r.status_code == 413 and "(--max-weight-bytes)" in r.json()["error"]
    r = small.put("/v1/weights/big", json={"w": w.tolist()})
    assert r.status_code == 413 and "(--max-weight-bytes)" in r.json()["error"]


def test_a_weight_of_the_wrong_rank_is_422_in_json_and_safetensors(small):
    w2 = torch.randn(4, 3)
    r_st = small.put("/v1/weights/flat", content=st_body({"w": w2}))
    r_js = small.put("/v1/weights/flat", json={"w": w2.tolist()})
    assert r_st.status_code == r_js.status_code == 422, (r_st.text, r_js.text)
    assert "3-D (E, K, N)" in r_st.json()["error"] and "3-D (E, K, N)" in r_js.json()["error"]
    r = small.put("/v1/weights/flat", json={"w_t": [1.0, 2.0]})
    assert r.status_code == 422 and "3-D (E, N, K)" in r.json()["error"]
    # Malformed (ragged, not numbers) is a different mistake: 400.
    assert small.put("/v1/weights/flat", json={"w": [[[1.0], [1.0, 2.0]]]}).status_code == 400
    assert small.put("/v1/weights/flat", json={"w": [[["a"]]]}).status_code == 400
    assert small.get("/v1/weights/flat").status_code == 404


def test_an_activation_of_the_wrong_rank_is_422_in_json_and_safetensors(small):
    assert small.put("/v1/weights/m", content=st_body({"w": torch.randn(2, 3, 4)})
                     ).status_code == 201
    x1 = torch.randn(3)
    counts = torch.tensor([1, 2], dtype=torch.int32)
    r_st = small.post("/v1/weights/m/grouped-mm", content=st_body({"x": x1, "counts": counts}))
    r_js = small.post("/v1/weights/m/grouped-mm", json={"x": x1.tolist(), "counts": [1, 2]})
    assert r_st.status_code == r_js.status_code == 422, (r_st.text, r_js.text)
    r = small.post("/v1/grouped-gemm", json={"a": [[1.0, 2.0]], "b": [[[1.0], [2.0]]]})
    assert r.status_code == 422 and "'a[0]' must be 2-D (M_i, K_i)" in r.json()["error"]


@pytest.mark.parametrize("set_dtype,x_dtype,accepted", [
    (torch.float32, torch.float16, "must be float32 (the weight set's dtype); got float16"),
    (torch.bfloat16, torch.float16,
     "must be bfloat16 (the weight set's dtype) or float32; got float16"),
])
def test_dtype_error_says_what_is_accepted_once(small, set_dtype, x_dtype, accepted):
    name = f"d-{str(set_dtype)[6:]}"
    w = torch.randn(2, 3, 4).to(set_dtype)
    assert small.put(f"/v1/weights/{name}", content=st_body({"w": w})).status_code == 201
    x = torch.randn(3, 3).to(x_dtype)
    r = small.post(f"/v1/weights/{name}/grouped-mm", content=st_body(
        {"x": x, "counts": torch.tensor([1, 2], dtype=torch.int32)}))
    assert r.status_code == 422
    msg = r.json()["error"]
    assert accepted in msg
    assert len(re.findall("float32", msg)) == 1  # said once, not "float32 ... or float32"


def test_engine_dtype_error_does_not_repeat_itself():
    engine = Engine("cpu")
    ws = engine.add_weights("m", torch.randn(2, 3, 4))
    x = torch.randn(3, 3, dtype=torch.float16)
    with pytest.raises(TypeError) as e:
        engine.grouped_mm_many(ws, [(x, torch.tensor([1, 2]))])
    assert "x must be float32 (the weight set's dtype); got float16" in str(e.value)
