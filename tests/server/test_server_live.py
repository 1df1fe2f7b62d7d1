"""Every endpoint and every bad input against a real uvicorn process on 127.0.0.1 (CPU)."""

from __future__ import annotations

import json
import struct
import threading

import httpx
import pytest
import torch
from server_testutils import (
    ADMIN_KEY,
    API_KEY,
    API_KEY_2,
    MAX_BODY,
    MAX_ROWS,
    assert_close_to_ref,
    metric,
    mm_ref,
    random_counts,
    st_body,
    st_load,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
E, K, N = 6, 48, 40


def put(admin: httpx.Client, name: str, tensors: dict[str, torch.Tensor]) -> httpx.Response:
    return admin.put(f"/v1/weights/{name}", content=st_body(tensors))


@pytest.fixture(scope="module")
def weights(main_server) -> dict[str, torch.Tensor]:
    """Three resident sets (fp32 uploaded as w_t, bf16 and fp16 as w) on the shared server."""
    gen = torch.Generator().manual_seed(11)
    sets = {f"api-{d}": torch.randn(E, K, N, generator=gen).to(dt) for d, dt in DTYPES.items()}
    with httpx.Client(base_url=main_server.url, timeout=30,
                      headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as admin:
        for name, w in sets.items():
            body = ({"w_t": w.transpose(1, 2)} if w.dtype == torch.float32 else {"w": w})
            r = put(admin, name, body)
            assert r.status_code in (200, 201), r.text
    return sets


def mm(client: httpx.Client, name: str, x: torch.Tensor, counts: torch.Tensor,
       **kw: object) -> httpx.Response:
    return client.post(f"/v1/weights/{name}/grouped-mm",
                       content=st_body({"x": x, "counts": counts}), **kw)


def assert_healthy(client: httpx.Client) -> None:
    assert client.get("/v2/health/live").status_code == 200
    assert client.get("/v2/health/ready").status_code == 200


# --------------------------------------------------------------------------- health, metadata


def test_health_and_server_metadata(reader):
    r = reader.get("/v2/health/live")
    assert r.status_code == 200 and r.json() == {"live": True}
    r = reader.get("/v2/health/ready")
    assert r.status_code == 200 and r.json() == {"ready": True}
    meta = reader.get("/v2").json()
    assert meta["name"] == "moe-gemm-server"
    assert {"binary_tensor_data", "statistics"} <= set(meta["extensions"])
    if torch.cuda.is_available():  # the server picks the GPU on its own ("auto")
        assert meta["device"].startswith("cuda")
    else:
        assert meta["device"] == "cpu" and meta["backend"] == "torch"


# --------------------------------------------------------------------------- weight sets


def test_weight_set_crud(admin, reader):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(3, 8, 5, generator=gen)
    r = put(admin, "crud.set-1", {"w": w})
    assert r.status_code == 201, r.text
    info = r.json()
    assert info == {"name": "crud.set-1", "experts": 3, "k": 8, "n": 5, "dtype": "float32",
                    "bytes": 3 * 8 * 5 * 4, "layout": "w"}
    assert reader.get("/v1/weights/crud.set-1").json() == info
    assert info in reader.get("/v1/weights").json()["weights"]
    # replace with a w_t upload of another shape: 200 and the new shape
    w2 = torch.randn(3, 6, 8, generator=gen).to(torch.bfloat16)  # (E, N, K)
    r = put(admin, "crud.set-1", {"w_t": w2})
    assert r.status_code == 200, r.text
    assert r.json() == {"name": "crud.set-1", "experts": 3, "k": 8, "n": 6,
                        "dtype": "bfloat16", "bytes": 3 * 6 * 8 * 2, "layout": "w_t"}
    x = torch.randn(4, 8, generator=gen).to(torch.bfloat16)
    c = torch.tensor([1, 0, 3], dtype=torch.int32)
    y = st_load(mm(reader, "crud.set-1", x, c).content)["y"]
    assert_close_to_ref(y, mm_ref(x, w2.transpose(1, 2), c), torch.bfloat16)
    r = admin.delete("/v1/weights/crud.set-1")
    assert r.status_code == 200 and r.json() == {"deleted": "crud.set-1"}
    assert reader.get("/v1/weights/crud.set-1").status_code == 404
    assert admin.delete("/v1/weights/crud.set-1").status_code == 404
    assert mm(reader, "crud.set-1", x, c).status_code == 404
    assert "crud.set-1" not in [i["name"] for i in reader.get("/v1/weights").json()["weights"]]


def test_weights_json_upload(admin, reader):
    w = torch.randn(2, 3, 4)
    r = admin.put("/v1/weights/json-set", json={"w": w.tolist(), "dtype": "float32"})
    assert r.status_code == 201, r.text
    assert r.json()["k"] == 3 and r.json()["n"] == 4
    x = torch.randn(5, 3)
    c = torch.tensor([2, 3], dtype=torch.int32)
    y = st_load(mm(reader, "json-set", x, c).content)["y"]
    assert_close_to_ref(y, mm_ref(x, w, c), torch.float32)
    assert admin.delete("/v1/weights/json-set").status_code == 200


def test_resident_bytes_metric(admin, reader, weights):
    listing = reader.get("/v1/weights").json()["weights"]
    text = reader.get("/metrics").text
    assert metric(text, "moe_gemm_resident_weight_bytes") == sum(i["bytes"] for i in listing)
    assert metric(text, "moe_gemm_weight_sets") == len(listing)


# --------------------------------------------------------------------------- matmuls


@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("T", [0, 1, 37, 300])
def test_grouped_mm_matches_reference(reader, weights, dname, T):
    dtype = DTYPES[dname]
    w = weights[f"api-{dname}"]
    gen = torch.Generator().manual_seed(T)
    x = torch.randn(T, K, generator=gen).to(dtype)
    c = random_counts(T, E, gen, empty=2)
    r = mm(reader, f"api-{dname}", x, c)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/octet-stream"
    y = st_load(r.content)["y"]
    assert y.dtype == dtype and y.shape == (T, N)
    assert_close_to_ref(y, mm_ref(x, w, c), dtype)


def test_grouped_mm_offs_int64_counts_and_float32_activations(reader, weights):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(20, K, generator=gen)
    c = random_counts(20, E, gen)
    offs = torch.cumsum(c, 0).to(torch.int32)
    w = weights["api-float32"]
    y1 = st_load(reader.post("/v1/weights/api-float32/grouped-mm",
                             content=st_body({"x": x, "offs": offs})).content)["y"]
    y2 = st_load(mm(reader, "api-float32", x, c.to(torch.int64)).content)["y"]
    assert_close_to_ref(y1, mm_ref(x, w, c), torch.float32)
    assert torch.equal(y1, y2)
    # float32 x against bf16 weights: converted to bf16, answered in float32
    wb = weights["api-bfloat16"]
    r = mm(reader, "api-bfloat16", x, c)
    assert r.status_code == 200, r.text
    y = st_load(r.content)["y"]
    assert y.dtype == torch.float32
    assert_close_to_ref(y, mm_ref(x.to(torch.bfloat16), wb, c), torch.float32)


def test_grouped_mm_json(reader, weights):
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(7, K, generator=gen)
    c = random_counts(7, E, gen)
    r = reader.post("/v1/weights/api-float32/grouped-mm",
                    json={"x": x.tolist(), "counts": c.tolist(), "dtype": "float32"})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert body["dtype"] == "float32"
    y = torch.tensor(body["y"])
    assert_close_to_ref(y, mm_ref(x, weights["api-float32"], c), torch.float32)
    # bf16 via JSON: values rounded to bf16 on the way in, answer values are bf16-exact
    xb = x.to(torch.bfloat16)
    r = reader.post("/v1/weights/api-bfloat16/grouped-mm",
                    json={"x": xb.float().tolist(), "counts": c.tolist(), "dtype": "bfloat16"})
    assert r.status_code == 200, r.text
    yb = torch.tensor(r.json()["y"])
    assert torch.equal(yb.to(torch.bfloat16).float(), yb)
    assert_close_to_ref(yb, mm_ref(xb, weights["api-bfloat16"], c), torch.bfloat16)
    # empty request in JSON form
    r = reader.post("/v1/weights/api-float32/grouped-mm",
                    json={"x": [], "counts": [0] * E})
    assert r.status_code == 200 and r.json()["y"] == []


def test_grouped_gemm_safetensors_and_json(reader):
    gen = torch.Generator().manual_seed(8)
    shapes = [(5, 16, 24), (0, 8, 8), (1, 3, 7), (130, 64, 17)]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        body = {}
        for i, (m, k, n) in enumerate(shapes):
            body[f"a.{i}"] = torch.randn(m, k, generator=gen).to(dtype)
            body[f"b.{i}"] = torch.randn(k, n, generator=gen).to(dtype)
        r = reader.post("/v1/grouped-gemm", content=st_body(body))
        assert r.status_code == 200, r.text
        d = st_load(r.content)
        assert sorted(d) == [f"d.{i}" for i in range(len(shapes))]
        for i, (m, k, n) in enumerate(shapes):
            ref = body[f"a.{i}"].double() @ body[f"b.{i}"].double()
            assert d[f"d.{i}"].dtype == dtype and d[f"d.{i}"].shape == (m, n)
            if m:
                assert_close_to_ref(d[f"d.{i}"], ref, dtype)
    a = [torch.randn(3, 4, generator=gen), torch.randn(2, 5, generator=gen)]
    b = [torch.randn(4, 6, generator=gen), torch.randn(5, 1, generator=gen)]
    r = reader.post("/v1/grouped-gemm", json={"a": [t.tolist() for t in a],
                                              "b": [t.tolist() for t in b]})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["dtype"] == "float32" and len(out["d"]) == 2
    for di, ai, bi in zip(out["d"], a, b):
        assert_close_to_ref(torch.tensor(di), ai.double() @ bi.double(), torch.float32)


def test_request_id_echoed_generated_and_logged(main_server, reader, weights):
    x = torch.randn(2, K)
    c = torch.tensor([2] + [0] * (E - 1), dtype=torch.int32)
    r = mm(reader, "api-float32", x, c, headers={"X-Request-Id": "trace-abc-123"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-abc-123"
    r = reader.get("/v1/weights/does-not-exist", headers={"X-Request-Id": "trace-404"})
    assert r.status_code == 404
    assert r.headers["x-request-id"] == "trace-404" and r.json()["request_id"] == "trace-404"
    generated = reader.get("/v2/health/live").headers["x-request-id"]
    assert len(generated) >= 16
    # an unusable id (spaces) is replaced by a generated one
    r = reader.get("/v2/health/live", headers={"X-Request-Id": "has spaces"})
    assert r.headers["x-request-id"] != "has spaces"
    assert "[trace-abc-123]" in main_server.log() and "[trace-404]" in main_server.log()


# --------------------------------------------------------------------------- auth


def test_auth(main_server, weights):
    url = main_server.url
    x = torch.randn(1, K)
    c = torch.tensor([1] + [0] * (E - 1), dtype=torch.int32)
    body = st_body({"x": x, "counts": c})
    r = httpx.post(f"{url}/v1/weights/api-float32/grouped-mm", content=body)
    assert r.status_code == 401 and "error" in r.json()
    assert r.headers["www-authenticate"] == "Bearer"
    r = httpx.post(f"{url}/v1/weights/api-float32/grouped-mm", content=body,
                   headers={"Authorization": "Bearer nope"})
    assert r.status_code == 403 and "error" in r.json()
    r = httpx.post(f"{url}/v1/weights/api-float32/grouped-mm", content=body,
                   headers={"Authorization": "Basic " + API_KEY})
    assert r.status_code == 401
    for key in (API_KEY, API_KEY_2, ADMIN_KEY):
        r = httpx.post(f"{url}/v1/weights/api-float32/grouped-mm", content=body,
                       headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
    assert httpx.get(f"{url}/v1/weights").status_code == 401
    assert httpx.get(f"{url}/v2/models/api-float32").status_code == 401
    # unknown sets are not revealed to unauthenticated callers
    assert httpx.get(f"{url}/v1/weights/zzz").status_code == 401
    # weight changes need the admin key: a reader key is refused
    wbody = st_body({"w": torch.randn(2, 2, 2)})
    hdr = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.put(f"{url}/v1/weights/auth-x", content=wbody, headers=hdr).status_code == 403
    assert httpx.put(f"{url}/v1/weights/auth-x", content=wbody).status_code == 401
    assert httpx.delete(f"{url}/v1/weights/api-float32", headers=hdr).status_code == 403
    # probes and metrics stay open
    assert httpx.get(f"{url}/v2/health/ready").status_code == 200
    assert httpx.get(f"{url}/metrics").status_code == 200


# --------------------------------------------------------------------------- bad input


def _st_with_header(header: dict, data: bytes, n: int | None = None) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if n is None else n) + raw + data


GOOD_X = torch.randn(3, K)
GOOD_C = torch.tensor([1, 2] + [0] * (E - 2), dtype=torch.int32)


def _bad_mm_bodies() -> list[tuple[str, bytes, str, int]]:
    x4 = GOOD_X.numpy().tobytes()
    c4 = GOOD_C.numpy().tobytes()
    hdr = {"x": {"dtype": "F32", "shape": [3, K], "data_offsets": [0, len(x4)]},
           "counts": {"dtype": "I32", "shape": [E], "data_offsets": [len(x4), len(x4) + len(c4)]}}
    lying_shape = json.loads(json.dumps(hdr))
    lying_shape["x"]["shape"] = [1000, K]
    past_end = json.loads(json.dumps(hdr))
    past_end["counts"]["data_offsets"] = [len(x4), len(x4) + 10**9]
    overlap = json.loads(json.dumps(hdr))
    overlap["counts"]["data_offsets"] = [0, len(c4)]
    bad_dtype = json.loads(json.dumps(hdr))
    bad_dtype["x"]["dtype"] = "F33"
    ct = "application/octet-stream"
    return [
        ("garbage", b"not a safetensors body", ct, 400),
        ("empty", b"", ct, 400),
        ("header length lies (huge)", _st_with_header(hdr, x4 + c4, n=2**62), ct, 400),
        ("header length lies (too long)", _st_with_header(hdr, x4 + c4, n=10_000), ct, 400),
        ("header not json", struct.pack("<Q", 5) + b"{abc}" + x4, ct, 400),
        ("shape lies", _st_with_header(lying_shape, x4 + c4), ct, 400),
        ("offsets past the end", _st_with_header(past_end, x4 + c4), ct, 400),
        ("overlapping offsets", _st_with_header(overlap, x4 + c4), ct, 400),
        ("unknown dtype", _st_with_header(bad_dtype, x4 + c4), ct, 400),
        ("truncated data", _st_with_header(hdr, (x4 + c4)[:-4]), ct, 400),
        ("missing x", st_body({"counts": GOOD_C}), ct, 400),
        ("missing counts", st_body({"x": GOOD_X}), ct, 400),
        ("unexpected tensor", st_body({"x": GOOD_X, "counts": GOOD_C, "z": GOOD_C.clone()}), ct, 400),
        ("malformed json", b'{"x": [[1, 2]', "application/json", 400),
        ("json ragged", json.dumps({"x": [[1.0] * K, [1.0]], "counts": [2] + [0] * (E - 1)})
         .encode(), "application/json", 400),
        ("json strings", json.dumps({"x": [["a"] * K], "counts": [1] + [0] * (E - 1)}).encode(),
         "application/json", 400),
        ("json not an object", b"[1, 2, 3]", "application/json", 400),
        ("wrong K", st_body({"x": torch.randn(3, K + 1), "counts": GOOD_C}), ct, 422),
        ("x 3-D", st_body({"x": torch.randn(1, 3, K), "counts": GOOD_C}), ct, 422),
        ("x float64", st_body({"x": GOOD_X.double(), "counts": GOOD_C}), ct, 422),
        ("x fp16 vs fp32 set", st_body({"x": GOOD_X.half(), "counts": GOOD_C}), ct, 422),
        ("counts wrong length", st_body({"x": GOOD_X, "counts": GOOD_C[:-1]}), ct, 422),
        ("counts float", st_body({"x": GOOD_X, "counts": GOOD_C.float()}), ct, 422),
        ("negative counts", st_body({"x": GOOD_X, "counts": torch.tensor(
            [4, -1] + [0] * (E - 2), dtype=torch.int32)}), ct, 422),
        ("counts do not sum to T", st_body({"x": GOOD_X, "counts": torch.tensor(
            [1, 1] + [0] * (E - 2), dtype=torch.int32)}), ct, 422),
        ("offs decreasing", st_body({"x": GOOD_X, "offs": torch.tensor(
            [2, 1] + [3] * (E - 2), dtype=torch.int32)}), ct, 422),
        ("offs not ending at T", st_body({"x": GOOD_X, "offs": torch.tensor(
            [1] * E, dtype=torch.int32)}), ct, 422),
        ("counts and offs", st_body({"x": GOOD_X, "counts": GOOD_C,
                                     "offs": torch.cumsum(GOOD_C, 0).int()}), ct, 422),
        ("bad dtype name", json.dumps({"x": [[1.0] * K], "counts": [1] + [0] * (E - 1),
                                       "dtype": "float64"}).encode(), "application/json", 422),
        ("unsupported content type", st_body({"x": GOOD_X, "counts": GOOD_C}), "text/plain",
         415),
    ]


@pytest.mark.parametrize("case", _bad_mm_bodies(), ids=lambda c: c[0])
def test_bad_grouped_mm_input(reader, weights, case):
    _, body, ctype, status = case
    r = reader.post("/v1/weights/api-float32/grouped-mm", content=body,
                    headers={"Content-Type": ctype})
    assert r.status_code == status, r.text
    err = r.json()
    assert isinstance(err["error"], str) and err["error"]
    assert err["request_id"] == r.headers["x-request-id"]
    assert_healthy(reader)


def test_bad_input_leaves_server_serving(reader, weights):
    """After every kind of bad input above, a good request still gets the right answer."""
    y = st_load(mm(reader, "api-float32", GOOD_X, GOOD_C).content)["y"]
    assert_close_to_ref(y, mm_ref(GOOD_X, weights["api-float32"], GOOD_C), torch.float32)


def test_unknown_weight_set_and_route(reader):
    r = mm(reader, "no-such-set", GOOD_X, GOOD_C)
    assert r.status_code == 404 and "no-such-set" in r.json()["error"]
    unmatched = metric(reader.get("/metrics").text, "moe_gemm_requests_total",
                       route="unmatched", method="GET", status="404")
    r = reader.get("/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()
    assert metric(reader.get("/metrics").text, "moe_gemm_requests_total", route="unmatched",
                  method="GET", status="404") == unmatched + 1  # (no path of its own)
    r = reader.get("/v1/grouped-gemm")
    assert r.status_code == 405 and "error" in r.json()


def test_body_over_limit(reader, weights, main_server):
    # declared by Content-Length: refused before the body is read (and before routing, yet
    # counted under its route's template, not as an unmatched path)
    route = "/v1/weights/{name}/grouped-mm"
    counted = metric(reader.get("/metrics").text, "moe_gemm_requests_total", route=route,
                     method="POST", status="413")
    big = b"\0" * (MAX_BODY + 1)
    r = reader.post("/v1/weights/api-float32/grouped-mm", content=big)
    assert r.status_code == 413 and "limit" in r.json()["error"]
    assert metric(reader.get("/metrics").text, "moe_gemm_requests_total", route=route,
                  method="POST", status="413") == counted + 1

    # no Content-Length (chunked): refused once the counted bytes pass the limit
    def chunks():
        for _ in range(40):
            yield b"\0" * 65536

    r = reader.post("/v1/weights/api-float32/grouped-mm", content=chunks())
    assert r.status_code == 413 and "limit" in r.json()["error"]
    assert metric(reader.get("/metrics").text, "moe_gemm_rejections_total",
                  reason="too_large") >= 2
    assert_healthy(reader)


def test_rows_and_flops_limits(reader, weights, admin):
    x = torch.randn(MAX_ROWS + 1, K)
    c = torch.tensor([MAX_ROWS + 1] + [0] * (E - 1), dtype=torch.int32)
    r = mm(reader, "api-float32", x, c)
    assert r.status_code == 413 and "--max-rows" in r.json()["error"]
    # FLOPs: 2*T*K*N over 2e9 with few rows needs a wide set
    wide = torch.randn(1, 4096, 4096).to(torch.bfloat16)
    assert put(admin, "wide", {"w": wide}).status_code == 201
    x = torch.randn(64, 4096).to(torch.bfloat16)
    r = mm(reader, "wide", x, torch.tensor([64], dtype=torch.int32))
    assert r.status_code == 422 and "--max-flops" in r.json()["error"]
    assert admin.delete("/v1/weights/wide").status_code == 200
    # grouped-gemm rows are summed over problems
    body = {"a.0": torch.randn(MAX_ROWS, 2), "b.0": torch.randn(2, 2),
            "a.1": torch.randn(1, 2), "b.1": torch.randn(2, 2)}
    r = reader.post("/v1/grouped-gemm", content=st_body(body))
    assert r.status_code == 413
    assert_healthy(reader)


@pytest.mark.parametrize(
    "body, status",
    [
        ({"a.0": torch.randn(2, 3), "b.0": torch.randn(4, 5)}, 422),  # K mismatch
        ({"a.0": torch.randn(2, 3), "b.0": torch.randn(3, 5), "a.1": torch.randn(1, 1)}, 400),
        ({"a.0": torch.randn(2, 3), "b.0": torch.randn(3, 5).half()}, 422),  # mixed dtypes
        ({"a.0": torch.randn(2, 3, 1), "b.0": torch.randn(3, 5)}, 422),  # 3-D
        ({"a.1": torch.randn(2, 3), "b.1": torch.randn(3, 5)}, 400),  # not numbered from 0
        ({"a.00": torch.randn(2, 3), "b.0": torch.randn(3, 5)}, 400),  # bad name
        ({"a.0": torch.randn(2, 3).double(), "b.0": torch.randn(3, 5).double()}, 422),
        ({}, 400),  # no problems
    ],
)
def test_bad_grouped_gemm_input(reader, body, status):
    r = reader.post("/v1/grouped-gemm", content=st_body(body))
    assert r.status_code == status, r.text
    assert r.json()["error"]
    assert_healthy(reader)


@pytest.mark.parametrize(
    "name, status",
    [(".hidden", 422), ("bad%20name", 422), ("x" * 129, 422), ("a%2Fb", 422),
     ("semi;colon", 422)],
)
def test_weight_set_names(admin, name, status):
    r = admin.put(f"/v1/weights/{name}", content=st_body({"w": torch.randn(2, 2, 2)}))
    assert r.status_code == status, r.text
    assert "error" in r.json()


@pytest.mark.parametrize(
    "tensors, status",
    [
        ({"w": torch.randn(2, 3)}, 422),
        ({"w": torch.randn(2, 3, 4), "w_t": torch.randn(2, 4, 3)}, 422),
        ({"weights": torch.randn(2, 3, 4)}, 422),
        ({"w": torch.randn(2, 3, 4).double()}, 422),
        ({"w": torch.randint(0, 3, (2, 3, 4), dtype=torch.int32)}, 422),
        ({"w": torch.randn(2, 0, 4)}, 422),
    ],
)
def test_bad_weight_uploads(admin, reader, tensors, status):
    r = put(admin, "bad-upload", tensors)
    assert r.status_code == status, r.text
    assert reader.get("/v1/weights/bad-upload").status_code == 404
    r = admin.put("/v1/weights/bad-upload", content=b"\x10\0\0\0\0\0\0\0{not json at all}")
    assert r.status_code == 400
    assert reader.get("/v1/weights/bad-upload").status_code == 404


# --------------------------------------------------------------------------- concurrency


def test_32_concurrent_clients(main_server, weights):
    """32 threads, each with its own connection, random sizes and dtypes: every answer right."""
    errors: list[str] = []
    names = list(weights)

    def client(i: int) -> None:
        gen = torch.Generator().manual_seed(1000 + i)
        name = names[i % len(names)]
        w = weights[name]
        with httpx.Client(base_url=main_server.url, timeout=60,
                          headers={"Authorization": f"Bearer {API_KEY}"}) as c:
            for j in range(3):
                T = int(torch.randint(0, 64, (1,), generator=gen))
                x = torch.randn(T, K, generator=gen).to(w.dtype)
                cnt = random_counts(T, E, gen)
                r = mm(c, name, x, cnt, headers={"X-Request-Id": f"c{i}-{j}"})
                if r.status_code != 200 or r.headers["x-request-id"] != f"c{i}-{j}":
                    errors.append(f"{i}/{j}: {r.status_code} {r.text[:200]}")
                    continue
                try:
                    assert_close_to_ref(st_load(r.content)["y"], mm_ref(x, w, cnt), w.dtype)
                except AssertionError as e:
                    errors.append(f"{i}/{j}: wrong answer {e}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert errors == []


# --------------------------------------------------------------------------- metrics


def test_metrics(reader, weights):
    before = reader.get("/metrics").text
    n0 = metric(before, "moe_gemm_requests_total", route="/v1/weights/{name}/grouped-mm",
                method="POST", status="200")
    b0 = metric(before, "moe_gemm_batch_requests_count", kind="mm")
    for _ in range(3):
        assert mm(reader, "api-float32", GOOD_X, GOOD_C).status_code == 200
    text = reader.get("/metrics").text
    assert metric(text, "moe_gemm_requests_total", route="/v1/weights/{name}/grouped-mm",
                  method="POST", status="200") == n0 + 3
    assert metric(text, "moe_gemm_batch_requests_count", kind="mm") >= b0 + 1
    for family in ("moe_gemm_request_duration_seconds_bucket", "moe_gemm_requests_in_flight",
                   "moe_gemm_queue_time_seconds_bucket", "moe_gemm_compute_time_seconds_bucket",
                   "moe_gemm_batch_rows_bucket", "moe_gemm_queued_requests",
                   "moe_gemm_resident_weight_bytes", "moe_gemm_ready"):
        assert family in text, family
    assert metric(text, "moe_gemm_ready") == 1
    # (the scrape itself is being handled: counted by the same middleware as any request)
    assert metric(text, "moe_gemm_requests_in_flight") >= 1
