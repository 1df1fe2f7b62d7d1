"""The answers docs/HTTP-API.md promises, in-process: every route while starting and draining,
body limits that name their flag, one status for one mistake whatever the body format, and
error messages that say what is accepted."""

from __future__ import annotations

import asyncio
import gzip
import json
import re
import struct
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


def test_no_schema_or_docs_routes_outside_the_contract(tmp_path):
    """FastAPI's /docs, /redoc and /openapi.json would answer without a key and while
    starting or draining; the server does not serve them."""
    with TestClient(create_app(Settings(data_dir=tmp_path / "d", api_key=["k"]))) as client:
        _wait_ready(client)
        for path in ("/openapi.json", "/docs", "/redoc", "/docs/oauth2-redirect"):
            r = client.get(path)
            assert r.status_code == 404, (path, r.status_code)
            assert "no route" in r.json()["error"]
        assert client.get("/v1/weights").status_code == 401


def test_a_path_with_a_trailing_slash_is_a_json_404_not_a_redirect(tmp_path):
    """"/v1/weights/m/" is no route: 404 with the JSON error, before any key is checked. It
    used to be a bodiless 307 to the slash-less path (a PUT or DELETE that a client following
    redirects replays there, to the http:// URL the Host header names, behind a TLS proxy)."""
    settings = Settings(data_dir=tmp_path / "d", api_key=["k"], admin_key="adm")
    with TestClient(create_app(settings), follow_redirects=False) as client:
        _wait_ready(client)
        admin = {"Authorization": "Bearer adm"}
        for method, path in [("PUT", "/v1/weights/m/"), ("DELETE", "/v1/weights/m/"),
                             ("GET", "/v1/weights/"), ("POST", "/v1/weights/m/grouped-mm/"),
                             ("POST", "/v2/models/m/infer/")]:
            body = st_body({"w": torch.randn(2, 4, 3)}) if method == "PUT" else None
            r = client.request(method, path, content=body, headers=admin)
            assert r.status_code == 404, (method, path, r.status_code)
            assert "no route" in r.json()["error"] and r.json()["request_id"]
        assert not (tmp_path / "d" / "m.safetensors").exists()


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
    # a JSON upload is parsed whole in memory: it takes the smaller of the two limits
    r = small.put("/v1/weights/big", json={"w": w.tolist()})
    assert r.status_code == 413 and "4096 bytes (--max-body-bytes)" in r.json()["error"]


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
    for body in ({"a": 1, "b": [[[1.0]]]}, {"a": [[[1.0]]], "b": 2.0}):  # (a scalar: rank 0)
        r = small.post("/v1/grouped-gemm", json=body)
        assert r.status_code == 422 and "must be a list of matrices" in r.json()["error"]


def test_a_content_type_naming_no_media_type_is_415_not_safetensors(small):
    """No Content-Type is safetensors; one that names no type (a bare parameter, or only
    separators) is an unsupported type like any other, on the matmul and the upload routes."""
    assert small.put("/v1/weights/ct", content=st_body({"w": torch.randn(2, 3, 4)}),
                     headers={"Content-Type": "application/octet-stream"}).status_code == 201
    x = st_body({"x": torch.randn(3, 3), "counts": torch.tensor([1, 2], dtype=torch.int32)})
    for ctype in (";;;", "; charset=utf-8"):
        for method, url, body in (("POST", "/v1/weights/ct/grouped-mm", x),
                                  ("POST", "/v1/grouped-gemm", x),
                                  ("PUT", "/v1/weights/ct2", st_body({"w": torch.randn(2, 3, 4)}))):
            r = small.request(method, url, content=body, headers={"Content-Type": ctype})
            assert r.status_code == 415 and "Content-Type" in r.json()["error"], (ctype, url, r.text)
    assert small.get("/v1/weights/ct2").status_code == 404
    # (the request without any Content-Type still reads as safetensors)
    r = small.post("/v1/weights/ct/grouped-mm", content=x)
    assert r.status_code == 200, r.text


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


JS = {"Content-Type": "application/json"}


def _tiny(client: TestClient) -> None:
    r = client.put("/v1/weights/tiny", json={"w": [[[1, 0], [0, 1]], [[2, 0], [0, 2]]]})
    assert r.status_code in (200, 201), r.text


def test_a_json_dtype_that_is_not_a_string_is_422_on_every_route(small):
    """A list or object "dtype" is an unknown dtype like "float64" (was a TypeError: 500)."""
    _tiny(small)
    for dtype in (["float32"], {"a": 1}):
        for method, url, body in [
            ("PUT", "/v1/weights/d", {"w": [[[1.0]]], "dtype": dtype}),
            ("POST", "/v1/weights/tiny/grouped-mm", {"x": [[1, 2]], "counts": [1, 0],
                                                     "dtype": dtype}),
            ("POST", "/v1/grouped-gemm", {"a": [[[1.0]]], "b": [[[1.0]]], "dtype": dtype}),
        ]:
            r = small.request(method, url, json=body)
            assert r.status_code == 422, (url, r.text)
            assert "dtype must be one of float32, float16, bfloat16" in r.json()["error"]


def _st_header(header: bytes, data: bytes = b"") -> bytes:
    return struct.pack("<Q", len(header)) + header + data


@pytest.fixture
def roomy(tmp_path):
    """The default limits (a 200 KB header fits)."""
    with TestClient(create_app(Settings(data_dir=tmp_path / "d"))) as client:
        _wait_ready(client)
        yield client


def test_malformed_safetensors_headers_are_400_on_every_route(roomy):
    """A non-string dtype (a TypeError) and a header nested 100000 deep (a RecursionError)
    were 500s."""
    _tiny(roomy)
    bad_dtype = _st_header(b'{"w": {"dtype": ["F32"], "shape": [1, 1, 1], '
                           b'"data_offsets": [0, 4]}}', b"\0" * 4)
    deep = _st_header(b'{"w": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    for body in (bad_dtype, deep):
        for method, url in [("PUT", "/v1/weights/d"), ("POST", "/v1/weights/tiny/grouped-mm"),
                            ("POST", "/v1/grouped-gemm")]:
            r = roomy.request(method, url, content=body)
            assert r.status_code == 400, (url, r.text[:200])
            assert r.json()["error"].startswith("malformed safetensors"), r.text[:200]


def test_non_finite_weights_are_422_and_nan_tokens_are_400(small):
    """As a non-finite FP8 scale is refused (422), so are non-finite weights; the NaN and
    Infinity tokens Python's json would read are not JSON (400) on every JSON route."""
    _tiny(small)
    for bad in (float("nan"), float("inf"), -float("inf")):
        w = torch.ones(2, 3, 4)
        w[1, 2, 3] = bad
        r = small.put("/v1/weights/nf", content=st_body({"w": w}))
        assert r.status_code == 422 and "'w' must hold finite values" in r.json()["error"]
    # a JSON number beyond the requested dtype's range is refused before it becomes an
    # infinity: 400, as on every JSON route (docs/HTTP-API.md)
    r = small.put("/v1/weights/nf", json={"w_t": [[[1e6]]], "dtype": "float16"})
    assert r.status_code == 400, r.text
    assert "'w_t' holds a number beyond the range of float16" in r.json()["error"]
    v2 = (b'{"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [%s, 1]}, '
          b'{"name": "counts", "shape": [2], "datatype": "INT32", "data": [1, 0]}]}')
    for token in (b"NaN", b"Infinity", b"-Infinity"):
        for method, url, body in [
            ("PUT", "/v1/weights/nf", b'{"w": [[[%s]]]}' % token),
            ("POST", "/v1/weights/tiny/grouped-mm", b'{"x": [[%s, 1]], "counts": [1, 0]}' % token),
            ("POST", "/v1/grouped-gemm", b'{"a": [[[%s]]], "b": [[[1]]]}' % token),
            ("POST", "/v2/models/tiny/infer", v2 % token),
        ]:
            r = small.request(method, url, content=body, headers=JS)
            assert r.status_code == 400, (url, token, r.text)
            assert "not a JSON number" in r.json()["error"] or "not JSON" in r.json()["error"]
    assert small.get("/v1/weights/nf").status_code == 404


def test_a_duplicate_key_is_400_naming_it_on_every_json_route(small):
    """Python's json kept the last of two equal keys (and pydantic's parser too, on v2): each
    body below was served as if it said only its second half."""
    _tiny(small)
    v2 = (b'{"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}, '
          b'{"name": "counts", "shape": [2], "datatype": "INT32", "data": [1, 0], '
          b'"data": [0, 1]}]}')
    for method, url, body, key in [
        ("PUT", "/v1/weights/dup", b'{"w": [[[1]]], "w": [[[2]]]}', "w"),
        ("POST", "/v1/weights/tiny/grouped-mm",
         b'{"x": [[1, 2]], "counts": [1, 0], "counts": [0, 1]}', "counts"),
        ("POST", "/v1/grouped-gemm",
         b'{"a": [[[1]]], "b": [[[1]]], "dtype": "float32", "dtype": "float16"}', "dtype"),
        ("POST", "/v2/models/tiny/infer", v2, "data"),
    ]:
        r = small.request(method, url, content=body, headers=JS)
        assert r.status_code == 400, (url, r.status_code, r.text)
        assert f"duplicate key '{key}'" in r.json()["error"], (url, r.text)
    assert small.get("/v1/weights/dup").status_code == 404


def test_invalid_names_are_422_on_every_route(small):
    """A name no set can have is 422 wherever a name is taken (PUT and DELETE said so already;
    the reads, the matmul and the v2 routes said 404)."""
    _tiny(small)
    mm = {"x": [[1, 2]], "counts": [1, 0]}
    # (an encoded slash too: Starlette routes on the decoded path, where it matches no route)
    for name in ("a%20b", ".hidden", "x" * 129, "a%2Fb", "..%2fetc"):
        for method, url, body in [
            ("GET", f"/v1/weights/{name}", None), ("PUT", f"/v1/weights/{name}", {"w": [[[1]]]}),
            ("DELETE", f"/v1/weights/{name}", None),
            ("POST", f"/v1/weights/{name}/grouped-mm", mm),
            ("GET", f"/v2/models/{name}", None), ("GET", f"/v2/models/{name}/ready", None),
            ("GET", f"/v2/models/{name}/stats", None),
            ("POST", f"/v2/models/{name}/infer", {"inputs": [
                {"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}),
        ]:
            r = small.request(method, url, json=body)
            assert r.status_code == 422, (method, url, r.text)
            assert "invalid weight set name" in r.json()["error"]
    assert small.get("/v1/weights/unknown").status_code == 404  # valid but absent: still 404


def test_a_compressed_json_weight_upload_is_415(small):
    """Weight uploads take no Content-Encoding, JSON as safetensors (JSON was decoded: 201)."""
    body = gzip.compress(b'{"w": [[[1.0]]]}')
    for ctype in ("application/json", "application/octet-stream"):
        r = small.put("/v1/weights/gz", content=body,
                      headers={"Content-Type": ctype, "Content-Encoding": "gzip"})
        assert r.status_code == 415 and "no Content-Encoding" in r.json()["error"], r.text
    assert small.get("/v1/weights/gz").status_code == 404


def test_405_names_every_method_of_the_path_and_head_answers_like_get(small):
    _tiny(small)
    r = small.post("/v1/weights/tiny")  # (Starlette named only the first route's: PUT)
    assert r.status_code == 405 and r.headers["Allow"] == "GET, HEAD, PUT, DELETE"
    assert "GET, HEAD, PUT, DELETE" in r.json()["error"]
    r = small.get("/v1/weights/tiny/grouped-mm")
    assert r.status_code == 405 and r.headers["Allow"] == "POST"
    r = small.delete("/v1/weights")
    assert r.status_code == 405 and r.headers["Allow"] == "GET, HEAD"
    for url in ("/v1/weights/tiny", "/v1/weights", "/v2/health/ready", "/v2/models/tiny"):
        get, head = small.get(url), small.head(url)
        assert head.status_code == get.status_code == 200, url
        assert head.content == b"" and head.headers["content-length"] == \
            get.headers["content-length"], url
    assert small.head("/metrics").status_code == 200 and small.head("/metrics").content == b""
    assert small.head("/v1/weights/nope").status_code == 404
    r = small.head("/v1/grouped-gemm")
    assert r.status_code == 405 and r.headers["Allow"] == "POST"


def test_a_multi_member_gzip_body_is_read_whole_and_trailing_data_is_400(small):
    _tiny(small)
    body = json.dumps({"x": [[1, 2], [3, 4]], "counts": [1, 1]}).encode()
    gz = {**JS, "Content-Encoding": "gzip"}
    url = "/v1/weights/tiny/grouped-mm"
    r = small.post(url, content=gzip.compress(body[:10]) + gzip.compress(body[10:]), headers=gz)
    assert r.status_code == 200 and r.json()["y"] == [[1.0, 2.0], [6.0, 8.0]], r.text
    r = small.post(url, content=gzip.compress(body) + b"garbage", headers=gz)
    assert r.status_code == 400 and "after its gzip stream" in r.json()["error"]


def test_v2_id_true_is_400(small):
    _tiny(small)
    req = {"id": True, "inputs": [
        {"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]},
        {"name": "counts", "shape": [2], "datatype": "INT32", "data": [1, 0]}]}
    r = small.post("/v2/models/tiny/infer", json=req)
    assert r.status_code == 400 and "must be a string" in r.json()["error"], r.text
    req["id"] = "q-1"
    r = small.post("/v2/models/tiny/infer", json=req)
    assert r.status_code == 200 and r.json()["id"] == "q-1"


def _many_tensors(names: list[str]) -> bytes:
    """A safetensors body of empty tensors, every entry malformed (dtype "Q7")."""
    entry = {"dtype": "Q7", "shape": [0], "data_offsets": [0, 0]}
    return _st_header(json.dumps({n: entry for n in names}).encode())


def test_too_many_tensors_are_refused_for_their_names_before_any_is_built(roomy):
    """A body of more tensors (inputs, problems) than the route takes is refused by the route's
    own name rules before any entry is checked or any tensor built: a 49 MB header of 800k
    empty tensors took 45 s, on the event loop, before --max-problems refused it."""
    _tiny(roomy)
    pairs = [f"{s}.{i}" for i in range(4097) for s in "ab"]
    r = roomy.post("/v1/grouped-gemm", content=_many_tensors(pairs))
    assert r.status_code == 422 and "(--max-problems)" in r.json()["error"], r.text[:200]
    r = roomy.post("/v1/grouped-gemm", content=_many_tensors(pairs[:-2] + ["c.0", "c.1"]))
    assert r.status_code == 400 and "unexpected tensor" in r.json()["error"], r.text[:200]
    r = roomy.post("/v1/weights/tiny/grouped-mm",
                   content=_many_tensors(["x", "counts", "j.0", "j.1"]))
    assert r.status_code == 400 and "unexpected tensor(s)" in r.json()["error"], r.text[:200]
    # (a malformed body of as many tensors as the route takes still says it is malformed)
    r = roomy.post("/v1/weights/tiny/grouped-mm", content=_many_tensors(["x", "j"]))
    assert r.status_code == 400 and "malformed safetensors" in r.json()["error"], r.text[:200]
    r = roomy.post("/v1/grouped-gemm", json={"a": ["bad"] * 4097, "b": ["bad"] * 4097})
    assert r.status_code == 422 and "(--max-problems)" in r.json()["error"], r.text[:200]
    bad = {"name": "q", "shape": [0], "datatype": "FP33", "data": []}
    r = roomy.post("/v2/models/tiny/infer", json={"inputs": [bad] * 3})
    assert r.status_code == 400 and "unexpected input(s)" in r.json()["error"], r.text[:200]


def test_a_large_safetensors_body_is_decoded_off_the_event_loop(roomy, monkeypatch):
    """As a large JSON body is parsed: a header of many entries takes seconds to check, and on
    the event loop it stalled every other request and the liveness probe."""
    from moe_gemm_server.routers import matmul

    on_loop: list[bool] = []

    def decode(*args, **kwargs):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return real(*args, **kwargs)

    real = matmul.decode_safetensors
    monkeypatch.setattr(matmul, "decode_safetensors", decode)
    _tiny(roomy)
    big = torch.ones(150_000, 2)  # 1.2 MB
    r = roomy.post("/v1/weights/tiny/grouped-mm",
                   content=st_body({"x": big, "counts": torch.tensor([150_000, 0])}))
    assert r.status_code == 413, r.text[:200]  # (over --max-rows; what matters is where)
    r = roomy.post("/v1/grouped-gemm", content=st_body({"a.0": big, "b.0": torch.ones(2, 1)}))
    assert r.status_code == 413, r.text[:200]
    assert on_loop == [False, False]
