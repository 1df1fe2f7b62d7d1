"""FP8 weight sets in the engine and over HTTP, on the CPU: an F8_E4M3 tensor with its F32
scale uploads (both layouts, block / per-channel / per-expert scales), persists across a
restart, serves bf16 and fp32 requests (quantized by the server) alone and merged in one
launch, and every malformed upload is a 4xx that says what was expected."""

from __future__ import annotations

import re
import time

import pytest
import torch
from fastapi.testclient import TestClient
from server_testutils import st_body, st_load

from moe_gemm import quantize_fp8_per_block, quantize_fp8_per_row, quantize_fp8_per_token_group
from moe_gemm.ops.scaled_reference import scaled_grouped_mm_ref
from moe_gemm.testing_fp8 import assert_fp8_close
from moe_gemm_server import Settings, create_app
from moe_gemm_server.engine import Engine

E, N, K = 3, 64, 256


def _weights(granularity: str, layout: str, seed: int = 0):
    """(tensor as uploaded, scale as uploaded, w (E, K, N) view, scale_b for the op)."""
    g = torch.Generator().manual_seed(seed)
    w_nk = torch.randn(E, N, K, generator=g) / K ** 0.5
    if granularity == "block":
        q, s = quantize_fp8_per_block(w_nk)  # (E, N, K), (E, N/128, K/128)
        op_scale = s.transpose(1, 2)
    elif granularity == "row":
        q, s = quantize_fp8_per_row(w_nk)  # (E, N)
        op_scale = s
    else:
        pairs = [quantize_fp8_per_row(w.flatten()) for w in w_nk]
        s = torch.stack([p[1] for p in pairs])  # (E,)
        q = torch.stack([p[0].view(N, K) for p in pairs])
        op_scale = s[:, None].expand(E, N)
    w = q.transpose(1, 2)
    if layout == "w_t":
        return q, s, w, op_scale
    up = q.transpose(1, 2).contiguous()
    return up, (s.transpose(1, 2).contiguous() if granularity == "block" else s), w, op_scale


def _expected(x: torch.Tensor, counts: torch.Tensor, w, op_scale, granularity) -> torch.Tensor:
    if granularity == "block":
        xq, sa = quantize_fp8_per_token_group(x)
    else:
        xq, sa = quantize_fp8_per_row(x)
    offs = counts.cumsum(0).to(torch.int32)
    return scaled_grouped_mm_ref(xq, w, sa, op_scale, offs)


@pytest.mark.parametrize("granularity", ["block", "row", "tensor"])
@pytest.mark.parametrize("layout", ["w", "w_t"])
def test_engine_serves_fp8_sets(granularity, layout):
    engine = Engine("cpu")
    tensor, scale, w, op_scale = _weights(granularity, layout)
    ws = engine.add_weights("f", tensor, layout, scale=scale)
    assert ws.granularity == granularity and ws.dtype == torch.float8_e4m3fn
    info = ws.info()
    assert info["dtype"] == "float8_e4m3fn" and info["scales"] == granularity
    assert info["bytes"] == tensor.numel() + scale.numel() * 4
    g = torch.Generator().manual_seed(1)
    c1, c2 = torch.tensor([5, 0, 9]), torch.tensor([2, 7, 1])
    x1 = torch.randn(14, K, generator=g).bfloat16()
    x2 = torch.randn(10, K, generator=g).bfloat16()
    (y,) = engine.grouped_mm_many(ws, [(x1, c1)])
    assert y.dtype == torch.bfloat16
    assert_fp8_close(y, _expected(x1, c1, w, op_scale, granularity))
    y1, y2 = engine.grouped_mm_many(ws, [(x1, c1), (x2, c2)])  # merged in one launch
    assert_fp8_close(y1, _expected(x1, c1, w, op_scale, granularity))
    assert_fp8_close(y2, _expected(x2, c2, w, op_scale, granularity))
    y32 = engine.grouped_mm(ws, x1.float(), c1)
    assert y32.dtype == torch.float32
    with pytest.raises(TypeError, match="is FP8: the engine quantizes"):
        engine.grouped_mm(ws, x1.to(torch.float8_e4m3fn), c1)


@pytest.mark.parametrize("granularity", ["block", "row", "tensor"])
def test_an_fp8_set_uploaded_as_w_is_kept_k_major_for_the_kernel(granularity):
    """The FP8 kernel reads w K-major only: a set uploaded as "w" (E, K, N) is kept as its
    "w_t" equivalent (the same values, the scales' blocks following), so the kernel takes it
    instead of every request dequantizing the set in the torch backend."""
    from moe_gemm.ops.scaled_support import scaled_mm_unsupported
    from moe_gemm.ops.scaled_validation import check_scaled_grouped_mm
    from moe_gemm_server.fp8_weights import _op_scales

    engine = Engine("cpu")
    seed = int(torch.randint(0, 1 << 30, ()))
    tensor, scale, w, op_scale = _weights(granularity, "w", seed=seed)
    ws = engine.add_weights("f", tensor, "w", scale=scale, warm=False)
    tensor_t, scale_t, _, _ = _weights(granularity, "w_t", seed=seed)
    twin = engine.add_weights("g", tensor_t, "w_t", scale=scale_t, warm=False)
    assert ws.layout == "w" and ws.w.shape == (E, K, N)
    assert ws.w.stride() == twin.w.stride() and ws.scale.stride() == twin.scale.stride()
    assert torch.equal(ws.w.view(torch.uint8), w.view(torch.uint8))
    x = torch.randn(9, K, dtype=torch.bfloat16)
    offs = torch.tensor([4, 4, 9], dtype=torch.int32)
    xq, sa, sb = _op_scales(ws, x)
    args = check_scaled_grouped_mm(xq, ws.w, sa, sb, offs, None, None)
    assert scaled_mm_unsupported(args) is None
    y = engine.grouped_mm(ws, x, torch.tensor([4, 0, 5]))
    assert_fp8_close(y, _expected(x, torch.tensor([4, 0, 5]), w, op_scale, granularity))


def test_engine_refuses_bad_fp8_sets():
    engine = Engine("cpu")
    tensor, scale, _, _ = _weights("block", "w_t")
    with pytest.raises(ValueError, match="need their float32 'scale'"):
        engine.add_weights("f", tensor, "w_t")
    with pytest.raises(ValueError, match="fits no granularity"):
        engine.add_weights("f", tensor, "w_t", scale=scale[:, :, :1])
    with pytest.raises(TypeError, match="'scale' must be float32"):
        engine.add_weights("f", tensor, "w_t", scale=scale.double())
    with pytest.raises(ValueError, match="goes with FP8 weights only"):
        engine.add_weights("f", torch.randn(E, K, N), "w", scale=scale)
    for bad in (float("nan"), float("inf"), -float("inf")):
        wrong = scale.clone()
        wrong[1, 0, 1] = bad
        with pytest.raises(ValueError, match=r"'scale' of 'w_t' must hold finite decoding "
                                             r"scales > 0 .* at \[1, 0, 1\]"):
            engine.add_weights("f", tensor, "w_t", scale=wrong)
    with pytest.raises(KeyError):
        engine.get_weights("f")  # nothing was installed
    odd = torch.zeros(E, N, 200, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="K a multiple of 16"):
        engine.add_weights("f", odd, "w_t", scale=torch.ones(E))
    blocky = torch.zeros(E, N, 144, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="block scales need K a multiple of 128"):
        engine.add_weights("f", blocky, "w_t", scale=torch.ones(E, 1, 1))


@pytest.mark.parametrize("granularity", ["block", "row", "tensor"])
@pytest.mark.parametrize("layout", ["w", "w_t"])
@pytest.mark.parametrize("bad", [0.0, -0.0, -1e-3])
def test_engine_refuses_a_zero_or_negative_scale(granularity, layout, bad):
    """A zero decoding scale answers zeros for what it scales and a negative one the opposite
    sign, both as if right: refused, naming the first such value and where it is."""
    engine = Engine("cpu")
    tensor, scale, _, _ = _weights(granularity, layout)
    wrong = scale.clone()
    at = [E - 1] + [d - 1 for d in scale.shape[1:]]  # (the last value, for every rank)
    wrong[tuple(at)] = bad
    with pytest.raises(ValueError, match=rf"'scale' of '{layout}' must hold finite decoding "
                                         rf"scales > 0 \(w = fp8 \* scale\); got "
                                         rf"{re.escape(f'{bad:g}')} at {re.escape(str(at))} "
                                         rf"\(1 of its {scale.numel()} values are not\)"):
        engine.add_weights("f", tensor, layout, scale=wrong)
    with pytest.raises(KeyError):
        engine.get_weights("f")


def test_a_misshapen_scale_is_told_the_block_shape_with_its_condition():
    # K = 144: the block shape [E, 1, 1] the message offers is itself refused (K not a
    # multiple of 128), so the message says that condition with it.
    engine = Engine("cpu")
    blocky = torch.zeros(E, N, 144, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"blocks \[3, 1, 1\] \(K a multiple of 128\), per "
                                         r"channel \[3, 64\] or per expert \[3\]"):
        engine.add_weights("f", blocky, "w_t", scale=torch.ones(E, 2, 2))


def _wait_ready(client: TestClient) -> None:
    deadline = time.monotonic() + 30
    while client.get("/v2/health/ready").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_http_upload_persist_and_serve_fp8(tmp_path):
    tensor, scale, w, op_scale = _weights("block", "w_t", seed=2)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, K, generator=g).bfloat16()
    counts = torch.tensor([4, 0, 5], dtype=torch.int32)
    want = _expected(x, counts.long(), w, op_scale, "block")
    settings = Settings(data_dir=tmp_path / "d")
    with TestClient(create_app(settings)) as client:
        _wait_ready(client)
        r = client.put("/v1/weights/ds", content=st_body({"w_t": tensor, "scale": scale}))
        assert r.status_code == 201, r.text
        assert r.json()["dtype"] == "float8_e4m3fn" and r.json()["scales"] == "block"
        r = client.post("/v1/weights/ds/grouped-mm", content=st_body({"x": x, "counts": counts}))
        assert r.status_code == 200, r.text
        assert_fp8_close(st_load(r.content)["y"], want)
        # Malformed FP8 uploads: 422 naming the expectation, the stored set unchanged.
        r = client.put("/v1/weights/ds", content=st_body({"w_t": tensor}))
        assert r.status_code == 422 and "'scale'" in r.json()["error"]
        r = client.put("/v1/weights/ds", content=st_body({"w_t": tensor, "scale": scale[0]}))
        assert r.status_code == 422 and "fits no granularity" in r.json()["error"]
        r = client.put("/v1/weights/x", content=st_body({"w": torch.randn(E, K, N),
                                                         "scale": scale}))
        assert r.status_code == 422 and "FP8 weights only" in r.json()["error"]
        r = client.put("/v1/weights/ds", content=st_body(
            {"w_t": tensor, "scale": torch.full_like(scale, float("nan"))}))
        assert r.status_code == 422 and "finite" in r.json()["error"]
        for bad in (0.0, -1.0):  # (what a DeepSeek-style weight_scale_inv never holds)
            wrong = scale.clone()
            wrong[2, 0, 1] = bad
            r = client.put("/v1/weights/ds", content=st_body({"w_t": tensor, "scale": wrong}))
            assert r.status_code == 422, r.text
            assert (f"'scale' of 'w_t' must hold finite decoding scales > 0 (w = fp8 * scale); "
                    f"got {bad:g} at [2, 0, 1]") in r.json()["error"]
        r = client.post("/v1/weights/ds/grouped-mm", content=st_body({"x": x, "counts": counts}))
        assert r.status_code == 200  # the stored set still serves
        assert_fp8_close(st_load(r.content)["y"], want)
        r = client.put("/v1/weights/x", content=st_body({"w": tensor, "s": scale}))
        assert r.status_code == 422 and "expected one tensor" in r.json()["error"]
        r = client.post("/v1/weights/ds/grouped-mm", content=st_body(
            {"x": x.to(torch.float8_e4m3fn), "counts": counts}))
        assert r.status_code == 422 and "FP8: the server quantizes" in r.json()["error"]
        # KServe v2 metadata advertises the activations' dtype.
        meta = client.get("/v2/models/ds").json()
        assert meta["inputs"][0]["datatype"] == "BF16"
    with TestClient(create_app(settings)) as client:  # a restart reloads it from the disk
        _wait_ready(client)
        assert client.get("/v1/weights/ds").json()["scales"] == "block"
        r = client.post("/v1/weights/ds/grouped-mm", content=st_body({"x": x, "counts": counts}))
        assert r.status_code == 200
        assert_fp8_close(st_load(r.content)["y"], want)


def test_a_stored_set_with_a_zero_scale_is_skipped_at_start(tmp_path):
    """A file in the data directory whose scale holds a zero (written by an older server, or
    copied there) is not served: skipped as any file that cannot be loaded, the others load."""
    tensor, scale, _, _ = _weights("row", "w_t")
    wrong = scale.clone()
    wrong[1, 5] = 0.0
    (tmp_path / "zero.safetensors").write_bytes(st_body({"w_t": tensor, "scale": wrong}))
    (tmp_path / "good.safetensors").write_bytes(st_body({"w_t": tensor, "scale": scale}))
    app = create_app(Settings(data_dir=tmp_path))
    with TestClient(app) as client:
        _wait_ready(client)
        assert [w["name"] for w in client.get("/v1/weights").json()["weights"]] == ["good"]
        assert "got 0 at [1, 5]" in app.state.service.load_errors["zero"]


def test_an_e8m0_scale_is_422_naming_the_scale_dtype_taken(tmp_path):
    """A UE8M0 scale (safetensors F8_E8M0: DeepSeek's and DeepGEMM's power-of-two scales) was
    a 400 "malformed safetensors: ... unknown dtype", as if the body were broken. It is a
    valid body whose scale dtype the API does not take (docs/HTTP-API.md: an F32 scale): 422
    saying which dtype is taken and how to get it, at upload and at load alike."""
    tensor, scale, _, _ = _weights("block", "w_t")
    ue8m0 = torch.exp2(torch.round(torch.log2(scale))).to(torch.float8_e8m0fnu)
    body = st_body({"w_t": tensor, "scale": ue8m0})
    want = ("'scale' must be float32 (F32 decoding scales: w = fp8 * scale); got "
            "float8_e8m0fnu: UE8M0 scales are powers of two, 2^(e - 127), which float32 holds "
            "exactly: widen them before the upload")
    data = tmp_path / "d"
    app = create_app(Settings(data_dir=data))
    with TestClient(app) as client:
        _wait_ready(client)
        r = client.put("/v1/weights/ue8m0", content=body)
        assert r.status_code == 422, r.text
        assert r.json()["error"] == want
        assert client.get("/v1/weights/ue8m0").status_code == 404
        r = client.put("/v1/weights/ue8m0", content=st_body(
            {"w_t": tensor, "scale": ue8m0.float()}))  # widened: the same scales, taken
        assert r.status_code == 201, r.text
        # an F8_E8M0 tensor where a route takes data or counts: that route's dtype 422
        x = torch.ones(2, K).to(torch.float8_e8m0fnu)
        r = client.post("/v1/weights/ue8m0/grouped-mm", content=st_body(
            {"x": x, "counts": torch.tensor([2, 0, 0], dtype=torch.int32)}))
        assert r.status_code == 422 and "got float8_e8m0fnu" in r.json()["error"], r.text
    (data / "stored.safetensors").write_bytes(body)  # the same file found at start: skipped
    app = create_app(Settings(data_dir=data))
    with TestClient(app) as client:
        _wait_ready(client)
        assert [w["name"] for w in client.get("/v1/weights").json()["weights"]] == ["ue8m0"]
        assert app.state.service.load_errors["stored"] == want


def test_resident_budget_counts_the_fp8_scale(tmp_path):
    """--max-resident-bytes budgets what a set holds (WeightInfo "bytes"), its scale included:
    a set whose tensor fits but whose tensor and scale do not is 507, at upload and at start."""
    tensor, scale, _, _ = _weights("row", "w")  # E*K*N fp8 bytes + E*N float32 scales
    held = tensor.numel() + scale.numel() * 4
    settings = Settings(data_dir=tmp_path, max_resident_bytes=held - 1)
    with TestClient(create_app(settings)) as client:
        _wait_ready(client)
        r = client.put("/v1/weights/f", content=st_body({"w": tensor, "scale": scale}))
        assert r.status_code == 507, r.text
        assert f"needs {held} bytes" in r.json()["error"]
    (tmp_path / "f.safetensors").write_bytes(st_body({"w": tensor, "scale": scale}))
    with TestClient(create_app(settings)) as client:
        _wait_ready(client)
        assert client.get("/v1/weights").json()["weights"] == []
    with TestClient(create_app(Settings(data_dir=tmp_path, max_resident_bytes=held))) as client:
        _wait_ready(client)
        assert client.get("/v1/weights/f").json()["bytes"] == held


@pytest.mark.gpu
@pytest.mark.parametrize("granularity", ["block", "row"])
def test_engine_serves_fp8_sets_on_the_gpu(granularity):
    """The engine on an sm90 GPU: FP8 kernels and the quantizer, one request and a merge."""
    engine = Engine("cuda")
    assert engine.backend == "cute"
    tensor, scale, w, op_scale = _weights(granularity, "w_t", seed=4)
    ws = engine.add_weights("f", tensor, "w_t", scale=scale)
    assert ws.w.is_cuda and ws.kernels and all(k["config"].startswith("fp8") for k in ws.kernels)
    g = torch.Generator().manual_seed(5)
    c1, c2 = torch.tensor([30, 0, 70]), torch.tensor([5, 1, 2])
    x1 = torch.randn(100, K, generator=g).bfloat16()
    x2 = torch.randn(8, K, generator=g).bfloat16()
    y1, y2 = engine.grouped_mm_many(ws, [(x1, c1), (x2, c2)])
    assert_fp8_close(y1, _expected(x1, c1, w, op_scale, granularity))
    assert_fp8_close(y2, _expected(x2, c2, w, op_scale, granularity))


def test_the_client_and_the_server_read_a_scale_alike():
    """The client (no torch) checks an FP8 upload's scale shape before sending it, with its own
    copy of the server's rule (moe_gemm_client._fp8.scale_granularity): both name the same
    granularity, or both refuse, for every scale shape of a grid of weight shapes."""
    client_fp8 = pytest.importorskip("moe_gemm_client._fp8")
    from moe_gemm_server.fp8_weights import check_fp8_scale

    def verdict(fn, *args):
        try:
            return fn(*args)
        except ValueError:
            return "refused"

    checked = 0
    for layout in ("w", "w_t"):
        for E, N, K in ((3, 256, 384), (2, 200, 128), (4, 128, 96), (1, 40, 256)):
            shape = (E, K, N) if layout == "w" else (E, N, K)
            nb, kb = -(-N // 128), K // 128
            blocks = (E, kb, nb) if layout == "w" else (E, nb, kb)
            for scale_shape in (blocks, (E, N), (E,), (1,), (), (E, N + 1), (E, kb, nb + 1),
                                (E, 1, 1), (E + 1,)):
                w = torch.zeros(shape).to(torch.float8_e4m3fn)
                scale = torch.ones(scale_shape)
                server = verdict(check_fp8_scale, w, layout, scale)
                client = verdict(client_fp8.scale_granularity, layout, shape, scale_shape)
                assert client == server, (layout, shape, scale_shape)
                checked += 1
    assert checked == 72

