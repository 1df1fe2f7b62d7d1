"""The client against a real moe-gemm-server on 127.0.0.1 (CPU, torch backend).

The server runs as `python -m moe_gemm_server` in a subprocess, once for this module, with an
API key, an admin key and a small body limit, so the real 401/403/404/413/422 answers can be
checked against the exception classes. Skipped only when moe_gemm_server cannot be imported.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import ml_dtypes
import numpy as np
import pytest
import torch
from moe_client_testutils import dequantize_fp8, grouped_mm_ref, running_server

import moe_gemm_client as mgc
from moe_gemm_client import cli
from moe_gemm_client._calls import _Call
from moe_gemm_client._tensors import BFLOAT16, BytesPayload

pytest.importorskip("moe_gemm_server")
pytestmark = pytest.mark.slow  # the server takes ~12 s to start on the 2-core CPU machine

API_KEY = "reader-key"
ADMIN_KEY = "admin-key"
MAX_BODY = 1 << 20


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("live") / "data"


@pytest.fixture(scope="module")
def url(data_dir):
    with running_server(data_dir, "--api-key", API_KEY, "--admin-key", ADMIN_KEY,
                        "--max-body-bytes", str(MAX_BODY)) as u:
        yield u


@pytest.fixture
def admin(url):
    with mgc.Client(url, api_key=ADMIN_KEY, timeout=60) as c:
        yield c


@pytest.fixture
def reader(url):
    with mgc.Client(url, api_key=API_KEY, timeout=60) as c:
        yield c


def _bound(dtype) -> float:
    return {np.dtype(np.float32): 1e-4, np.dtype(np.float16): 4e-3, BFLOAT16: 3e-2}[
        np.dtype(dtype)]


def test_health_and_ready(reader):
    assert reader.health() is True
    assert reader.ready() is True
    assert reader.wait_until_ready(5.0) is True


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BFLOAT16], ids=["f32", "f16", "bf16"])
def test_weights_and_grouped_mm_round_trip(admin, reader, dtype):
    rng = np.random.default_rng(7)
    E, K, N = 4, 40, 24
    name = f"live-{np.dtype(dtype).name}"
    w = rng.standard_normal((E, K, N)).astype(np.float32).astype(dtype)
    info = admin.put_weights(name, w)
    assert (info.name, info.experts, info.k, info.n, info.layout) == (name, E, K, N, "w")
    assert info.dtype == {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16",
                          BFLOAT16: "bfloat16"}[np.dtype(dtype)]
    assert name in [i.name for i in reader.list_weights()]
    assert reader.get_weights(name) == info
    for counts in ([5, 0, 11, 1], [0, 0, 0, 1], [0, 17, 0, 0]):
        T = sum(counts)
        x = rng.standard_normal((T, K)).astype(np.float32).astype(dtype)
        y, rid = reader.grouped_mm(name, x, counts=counts, return_request_id=True,
                                   request_id=f"req-{T}")
        assert rid == f"req-{T}"
        assert y.shape == (T, N) and y.dtype == np.dtype(dtype)
        ref = grouped_mm_ref(x, w, np.array(counts))
        assert np.abs(ref).max() > 0
        err = np.abs(y.astype(np.float64) - ref).max()
        assert err <= _bound(dtype) * np.abs(ref).max(), err
        # offs (cumulative ends) give the same answer
        y2 = reader.grouped_mm(name, x, offs=np.cumsum(counts).astype(np.int32))
        np.testing.assert_array_equal(y2, y)
    assert admin.delete_weights(name) == mgc.WeightDeleted(name)
    with pytest.raises(mgc.NotFoundError):
        reader.get_weights(name)


def test_torch_bf16_and_transposed_upload(admin, reader):
    torch.manual_seed(3)
    E, K, N = 3, 16, 32
    w = torch.randn(E, K, N).to(torch.bfloat16)
    info = admin.put_weights("live-wt", w.transpose(1, 2).contiguous(), layout="w_t")
    assert (info.k, info.n, info.layout) == (K, N, "w_t")
    x = torch.randn(10, K).to(torch.bfloat16)
    y = reader.grouped_mm("live-wt", x, counts=torch.tensor([3, 0, 7]))
    assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16 and y.shape == (10, N)
    ref = grouped_mm_ref(x.float().numpy(), w.float().numpy(), np.array([3, 0, 7]))
    assert (y.double().numpy() - ref).__abs__().max() <= 3e-2 * np.abs(ref).max()
    # float32 x against bf16 weights is converted; y comes back float32
    y32 = reader.grouped_mm("live-wt", x.float(), counts=[3, 0, 7])
    assert y32.dtype == torch.float32
    admin.delete_weights("live-wt")


def test_grouped_gemm(reader):
    rng = np.random.default_rng(11)
    sizes = [(1, 8, 4), (0, 5, 3), (33, 17, 9), (7, 1, 64)]  # (M, N, K)
    a = [rng.standard_normal((m, k)).astype(np.float32) for m, n, k in sizes]
    b = [rng.standard_normal((k, n)).astype(np.float32) for m, n, k in sizes]
    d = reader.grouped_gemm(a, b)
    for i, (m, n, k) in enumerate(sizes):
        ref = a[i].astype(np.float64) @ b[i].astype(np.float64)
        assert d[i].shape == (m, n)
        np.testing.assert_allclose(d[i], ref, rtol=1e-4, atol=1e-4 * max(1, np.abs(ref).max(
            initial=0)))


def test_upload_safetensors_file(admin, reader, tmp_path):
    import safetensors.numpy

    rng = np.random.default_rng(5)
    w = rng.standard_normal((2, 8, 6)).astype(np.float32)
    path = tmp_path / "w.safetensors"
    safetensors.numpy.save_file({"w": w}, str(path))
    seen = []
    info = admin.upload_safetensors("live-file", path, progress=lambda s, t: seen.append(s))
    assert info.shape == (2, 8, 6)
    assert seen[0] == 0 and seen[-1] > w.nbytes  # the whole body: a header plus the data
    x = rng.standard_normal((4, 8)).astype(np.float32)
    y = reader.grouped_mm("live-file", x, counts=[1, 3])
    np.testing.assert_allclose(y, grouped_mm_ref(x, w, np.array([1, 3])), rtol=1e-4, atol=1e-4)
    admin.delete_weights("live-file")


def test_real_error_mapping(url, admin, reader):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((2, 8, 4)).astype(np.float32)
    admin.put_weights("live-err", w)
    x = rng.standard_normal((3, 8)).astype(np.float32)
    with mgc.Client(url, max_retries=0) as anon:
        with pytest.raises(mgc.AuthenticationError) as info:
            anon.list_weights()
        assert info.value.status_code == 401 and info.value.request_id
    with mgc.Client(url, api_key="wrong", max_retries=0) as wrong:
        with pytest.raises(mgc.PermissionDeniedError):
            wrong.grouped_mm("live-err", x, counts=[1, 2])
    with pytest.raises(mgc.PermissionDeniedError):
        reader.put_weights("live-nope", w)  # a reader key cannot change weights
    with pytest.raises(mgc.NotFoundError) as info:
        reader.grouped_mm("live-missing", x, counts=[1, 2], request_id="find-me")
    assert info.value.request_id == "find-me" and "live-missing" in info.value.message
    with pytest.raises(mgc.UnprocessableEntityError):  # K mismatch
        reader.grouped_mm("live-err", x[:, :5].copy(), counts=[1, 2])
    with pytest.raises(mgc.UnprocessableEntityError):  # counts not summing to T
        reader.grouped_mm("live-err", x, counts=[1, 1])
    with pytest.raises(mgc.UnprocessableEntityError):  # negative count
        reader.grouped_mm("live-err", x, counts=[4, -1])
    with pytest.raises(mgc.UnprocessableEntityError):  # wrong number of experts
        reader.grouped_mm("live-err", x, counts=[1, 1, 1])
    big = np.zeros((MAX_BODY // (8 * 4) + 16, 8), np.float32)  # body over --max-body-bytes
    with pytest.raises(mgc.PayloadTooLargeError):
        reader.grouped_mm("live-err", big, counts=[big.shape[0], 0])
    with pytest.raises(mgc.BadRequestError):  # not safetensors at all
        reader._request(_Call("POST", "/v1/weights/live-err/grouped-mm", lambda r: r,
                              body=BytesPayload(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")))
    admin.delete_weights("live-err")
    with pytest.raises(mgc.NotFoundError):
        admin.delete_weights("live-err")


def test_an_unreadable_stored_set_fails_at_once(url, data_dir):
    """A stored file that cannot be read as a set (written here as another server sharing
    the data directory could): the server answers 503 on the first request for it, with the
    code that says a retry cannot help, and the client raises at once instead of retrying
    it for about 1.5 s."""
    (data_dir / "live-unreadable.safetensors").write_bytes(b"not a safetensors file")
    sent: list[httpx.Request] = []
    with httpx.Client(event_hooks={"request": [sent.append]}, timeout=60) as http, \
            mgc.Client(url, api_key=API_KEY, http_client=http) as client:
        with pytest.raises(mgc.ServiceUnavailableError, match="could not be loaded") as info:
            client.get_weights("live-unreadable")
    assert info.value.code == "weight_set_unreadable" and info.value.retry_after is None
    assert len(sent) == 1
    # The listing names it as stored but not served, with the status its requests get.
    with mgc.Client(url, api_key=API_KEY, timeout=60) as client:
        listed = client.list_weights()
    assert "live-unreadable" not in [w.name for w in listed]
    (entry,) = [n for n in listed.not_loaded if n.name == "live-unreadable"]
    assert entry.status == 503 and "could not be loaded" in entry.error


def test_cli_list_names_a_set_not_loaded(url, data_dir, capsys, monkeypatch):
    (data_dir / "live-unreadable-cli.safetensors").write_bytes(b"\x00" * 64)
    with mgc.Client(url, api_key=API_KEY, timeout=60) as client, \
            pytest.raises(mgc.ServiceUnavailableError):
        client.get_weights("live-unreadable-cli")
    monkeypatch.setenv("MOE_GEMM_API_KEY", API_KEY)
    assert cli.main(["--url", url, "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert ("live-unreadable-cli", 503) in [(n["name"], n["status"])
                                             for n in listed["not_loaded"]]
    assert cli.main(["--url", url, "list"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("not loaded:"):].splitlines()
    assert table[1].split() == ["NAME", "STATUS", "ERROR"]
    assert any(line.split()[:2] == ["live-unreadable-cli", "503"] for line in table[2:])


def test_async_client_round_trip(url):
    rng = np.random.default_rng(9)
    w = rng.standard_normal((2, 8, 4)).astype(np.float32)
    x = rng.standard_normal((5, 8)).astype(np.float32)

    async def go() -> list[np.ndarray]:
        async with mgc.AsyncClient(url, api_key=ADMIN_KEY) as client:
            assert await client.ready()
            await client.put_weights("live-async", w)
            # concurrent requests (the server may batch them into one launch)
            ys = await asyncio.gather(*[client.grouped_mm("live-async", x, counts=[c, 5 - c])
                                        for c in range(6)])
            await client.delete_weights("live-async")
            return list(ys)

    ys = asyncio.run(go())
    for c, y in enumerate(ys):
        np.testing.assert_allclose(y, grouped_mm_ref(x, w, np.array([c, 5 - c])),
                                   rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------
# FP8 weight sets: the server quantizes x per token (group) to FP8, so y is compared with the
# fp64 product of x and the dequantized weights within FP8's precision (e4m3: 3 mantissa bits;
# about 4 % of max |y| was measured on these shapes).

FP8_BOUND = 8e-2


def _check_fp8_mm(reader, name, w64, rng, counts=(7, 0, 25)):
    x = rng.standard_normal((sum(counts), w64.shape[1])).astype(BFLOAT16)
    y = reader.grouped_mm(name, x, counts=list(counts))
    assert y.dtype == BFLOAT16 and y.shape == (sum(counts), w64.shape[2])
    ref = grouped_mm_ref(x, w64, np.array(counts))
    err = np.abs(y.astype(np.float64) - ref).max()
    assert 0 < np.abs(ref).max() and err <= FP8_BOUND * np.abs(ref).max(), err
    y32 = reader.grouped_mm(name, x.astype(np.float32), counts=list(counts))
    assert y32.dtype == np.float32  # float32 x works too, y in x's dtype


def test_fp8_block_scales_numpy(admin, reader, url, capsys):
    rng = np.random.default_rng(21)
    E, K, N = 3, 256, 200  # N=200: the last 128-column block is partial
    w8 = (rng.standard_normal((E, K, N)) * 40).astype(ml_dtypes.float8_e4m3fn)
    scale = (rng.random((E, 2, 2)) * 0.02 + 1e-3).astype(np.float32)  # distinct per block
    info = admin.put_weights("live-f8-block", w8, scale=scale)
    assert (info.dtype, info.scales, info.layout, info.shape) == (
        "float8_e4m3fn", "block", "w", (E, K, N))
    assert info.bytes == w8.nbytes + scale.nbytes and info.kernels == ()  # torch backend
    assert reader.get_weights("live-f8-block") == info
    assert info in reader.list_weights()
    _check_fp8_mm(reader, "live-f8-block", dequantize_fp8(w8, scale), rng)
    # the CLI's info shows the granularity
    assert cli.main(["--url", url, "--api-key", API_KEY, "info", "live-f8-block"]) == 0
    assert json.loads(capsys.readouterr().out)["scales"] == "block"
    admin.delete_weights("live-f8-block")


def test_fp8_row_scales_torch_transposed(admin, reader):
    torch.manual_seed(22)
    E, K, N = 3, 64, 48
    w_t = (torch.randn(E, N, K) * 40).to(torch.float8_e4m3fn)  # (E, N, K)
    scale = torch.rand(E, N) * 0.02 + 1e-3  # per output channel
    info = admin.put_weights("live-f8-row", w_t, scale=scale, layout="w_t")
    assert (info.k, info.n, info.layout, info.scales) == (K, N, "w_t", "row")
    w64 = dequantize_fp8(w_t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn),
                         scale.numpy(), "w_t")
    _check_fp8_mm(reader, "live-f8-row", w64, np.random.default_rng(22))
    admin.delete_weights("live-f8-row")


def test_fp8_file_upload_async(url, tmp_path):
    import safetensors.torch

    torch.manual_seed(23)
    E, K, N = 2, 128, 160
    w8 = (torch.randn(E, K, N) * 40).to(torch.float8_e4m3fn)
    scale = torch.rand(E, 1, 2) * 0.02 + 1e-3
    path = tmp_path / "f8.safetensors"
    safetensors.torch.save_file({"w": w8, "weight_scale_inv": scale}, str(path))
    x = np.random.default_rng(23).standard_normal((9, K)).astype(np.float32)

    async def go():
        async with mgc.AsyncClient(url, api_key=ADMIN_KEY) as client:
            info = await client.upload_safetensors("live-f8-file", path,
                                                   scale_tensor="weight_scale_inv")
            y = await client.grouped_mm("live-f8-file", x, counts=[4, 5])
            await client.delete_weights("live-f8-file")
            return info, y

    info, y = asyncio.run(go())
    assert (info.scales, info.layout) == ("block", "w")
    w64 = dequantize_fp8(w8.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn),
                         scale.numpy())
    ref = grouped_mm_ref(x, w64, np.array([4, 5]))
    assert np.abs(y - ref).max() <= FP8_BOUND * np.abs(ref).max()


def test_fp8_server_refusal_is_typed(admin):
    rng = np.random.default_rng(24)
    w8 = rng.standard_normal((2, 40, 8)).astype(ml_dtypes.float8_e4m3fn)  # K=40: not 16-aligned
    scale = np.ones((2, 8), np.float32)  # a valid row scale: only the server can refuse it
    with pytest.raises(mgc.UnprocessableEntityError, match="multiple of 16"):
        admin.put_weights("live-f8-bad", w8, scale=scale)
    with pytest.raises(ValueError, match="need their float32 decoding scale"):
        admin.put_weights("live-f8-bad", w8)  # local: never sent
