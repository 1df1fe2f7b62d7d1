"""FP8 weight uploads and the full WeightInfo, over a mock transport (both clients) and the CLI.

What goes on the wire (the FP8 tensor's raw bytes plus its F32 "scale"), the local checks
that keep a bad upload from ever being sent, and the WeightInfo fields FP8 and Hopper servers
add (scales, kernels) next to older servers that send neither. test_live_server.py runs FP8
uploads and matmuls against the real server.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from typing import Any

import httpx
import ml_dtypes
import numpy as np
import pytest
import safetensors.torch
import torch
from moe_client_testutils import (
    ContractHandler,
    make_async_client,
    make_client,
    sequence,
)

import moe_gemm_client as mgc
from moe_gemm_client import _constants as C
from moe_gemm_client import cli
from moe_gemm_client._tensors import FileTensorPayload, decode_safetensors, read_safetensors_header

MODES = ["sync", "async"]
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E5M2 = np.dtype(ml_dtypes.float8_e5m2)


def make(mode: str, handler: Any, **kwargs: Any) -> Any:
    return (make_client if mode == "sync" else make_async_client)(handler, **kwargs)


def run(client: Any, method: str, *args: Any, **kwargs: Any) -> Any:
    out = getattr(client, method)(*args, **kwargs)
    return asyncio.run(out) if inspect.iscoroutine(out) else out


def fp8(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype = E4M3) -> np.ndarray:
    return (rng.standard_normal(shape) * 30).astype(dtype)


def scale(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return (rng.random(shape) * 0.01 + 1e-3).astype(np.float32)


# ------------------------------------------------------------------------------------------
# in-memory uploads


@pytest.mark.parametrize("mode", MODES)
def test_numpy_fp8_block_upload_sends_raw_bytes_and_scale(mode, rng):
    handler = ContractHandler()
    client = make(mode, handler)
    w8, s = fp8(rng, (2, 256, 200)), scale(rng, (2, 2, 2))  # N=200: a partial last block
    info = run(client, "put_weights", "f8", w8, scale=s)
    assert (info.dtype, info.scales, info.layout, info.shape) == (
        "float8_e4m3fn", "block", "w", (2, 256, 200))
    assert info.bytes == w8.nbytes + s.nbytes
    sent = handler.seen[-1].tensors()
    assert sorted(sent) == ["scale", "w"]
    assert sent["w"].dtype == E4M3 and sent["w"].tobytes() == w8.tobytes()
    assert sent["scale"].dtype == np.float32 and np.array_equal(sent["scale"], s)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tdtype, ndtype", [(torch.float8_e4m3fn, E4M3),
                                            (torch.float8_e5m2, E5M2)], ids=["e4m3", "e5m2"])
def test_torch_fp8_row_upload_transposed(mode, tdtype, ndtype):
    handler = ContractHandler()
    client = make(mode, handler)
    torch.manual_seed(0)
    w_t = (torch.randn(3, 48, 32) * 20).to(tdtype)  # (E, N, K)
    s = torch.rand(3, 48) * 0.01 + 1e-3  # (E, N): per output channel
    info = run(client, "put_weights", "f8t", w_t, scale=s, layout="w_t")
    assert (info.k, info.n, info.layout, info.scales) == (32, 48, "w_t", "row")
    sent = handler.seen[-1].tensors()
    assert sorted(sent) == ["scale", "w_t"] and sent["w_t"].dtype == ndtype
    assert sent["w_t"].view(np.uint8).tolist() == w_t.view(torch.uint8).tolist()
    np.testing.assert_array_equal(sent["scale"], s.numpy())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("s_shape, granularity", [((4,), "tensor"), ((1,), "tensor"),
                                                  ((), "tensor"), ((4, 24), "row")])
def test_every_documented_scale_shape_is_accepted(mode, rng, s_shape, granularity):
    handler = ContractHandler()
    client = make(mode, handler)
    info = run(client, "put_weights", "f8", fp8(rng, (4, 32, 24)), scale=scale(rng, s_shape))
    assert info.scales == granularity
    assert handler.seen[-1].tensors()["scale"].shape == s_shape


W8 = np.zeros((2, 256, 200), E4M3)
BAD_UPLOADS = [
    # (w, kwargs, exception, match)
    (W8, {}, ValueError, r"FP8 weights need their float32 decoding scale .*\[2, 2, 2\]"),
    (W8, {"scale": np.ones((2, 2, 2))}, TypeError, r"scale must be float32.*float64"),
    (W8, {"scale": torch.ones(2, 200, dtype=torch.bfloat16)}, TypeError,
     r"scale must be float32.*bfloat16"),
    # UE8M0 scales (DeepSeek / DeepGEMM): refused here, as the server refuses them (422), with
    # the conversion that is exact for them
    (W8, {"scale": torch.ones(2, dtype=torch.float8_e8m0fnu)}, TypeError,
     r"scale must be float32.*float8_e8m0fnu \(convert with \.float\(\)\)"),
    (W8, {"scale": np.ones(2, ml_dtypes.float8_e8m0fnu)}, TypeError,
     r"scale must be float32.*float8_e8m0fnu \(convert with \.astype\(np\.float32\)\)"),
    (W8, {"scale": [1.0, 2.0]}, TypeError, "scale must be a float32 numpy array or torch"),
    (W8, {"scale": np.ones((2, 200, 256), np.float32)}, ValueError,
     r"scale \[2, 200, 256\] fits no granularity of 'w' \(2, 256, 200\)"),
    (W8, {"scale": np.ones((2, 200), np.float32), "layout": "w_t"}, ValueError,
     r"fits no granularity of 'w_t'.*per channel \[2, 256\]"),
    (W8, {"scale": np.array([1.0, np.nan], np.float32)}, ValueError, "finite"),
    # a zero decoding scale answers zeros, a negative one the opposite sign: the server's 422
    (W8, {"scale": np.array([1.0, 0.0], np.float32)}, ValueError,
     r"scale must hold finite decoding scales > 0 \(w = fp8 \* scale\); got 0 at \[1\]"),
    (W8, {"scale": np.full((2, 200), -0.5, np.float32)}, ValueError,
     r"got -0.5 at \[0, 0\] \(400 of its 400 values are not\)"),
    (W8, {"scale": np.float32(-0.0)}, ValueError, r"got -0 at \[\]"),
    (np.zeros((2, 200, 64), E4M3), {"scale": np.ones((2, 1, 1), np.float32)}, ValueError,
     "block scales need K a multiple of 128; got K=200"),
    (np.zeros((2, 256), E4M3), {"scale": np.ones(2, np.float32)}, ValueError,
     r"w must be 3-D \(E, K, N\)"),
    (np.zeros((2, 4, 4), np.float32), {"scale": np.ones(2, np.float32)}, ValueError,
     "scale= goes with FP8 weights only"),
    (np.zeros((2, 4, 4), np.float64), {}, TypeError, r"or FP8 \(float8_e4m3fn"),
    (torch.zeros(2, 4, 4, dtype=torch.float8_e4m3fnuz), {"scale": torch.ones(2)}, TypeError,
     r"torch.bfloat16, or FP8.*got torch.float8_e4m3fnuz"),
    # tensors with no values to send (torch failed inside .cpu(): NotImplementedError)
    (torch.empty(2, 256, 200, dtype=torch.float8_e4m3fn, device="meta"),
     {"scale": torch.ones(2)}, ValueError, "w is a meta tensor"),
    (torch.zeros(2, 256, 200, dtype=torch.float8_e4m3fn),
     {"scale": torch.empty(2, device="meta")}, ValueError, "scale is a meta tensor"),
    (torch.zeros(2, 256, 200, dtype=torch.float8_e4m3fn),
     {"scale": torch.ones(2).to_sparse()}, TypeError, "scale must be a dense tensor"),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("w, kwargs, exc, match", BAD_UPLOADS)
def test_bad_fp8_uploads_are_refused_locally(mode, w, kwargs, exc, match):
    handler = ContractHandler()
    client = make(mode, handler)
    with pytest.raises(exc, match=match):
        run(client, "put_weights", "f8", w, **kwargs)
    assert handler.seen == []  # nothing went out


@pytest.mark.parametrize("mode", MODES)
def test_server_422_on_fp8_upload_is_typed(mode, rng):
    handler, seen = sequence(httpx.Response(
        422, json={"error": "FP8 weights need K a multiple of 16 (16-byte rows); got K=40"}))
    client = make(mode, handler, max_retries=3)
    with pytest.raises(mgc.UnprocessableEntityError, match="multiple of 16"):
        run(client, "put_weights", "f8", fp8(rng, (2, 40, 8)), scale=scale(rng, (2, 8)))
    assert len(seen) == 1


# ------------------------------------------------------------------------------------------
# safetensors files


def _save(path, tensors: dict[str, Any]) -> None:
    safetensors.torch.save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))


@pytest.mark.parametrize("mode", MODES)
def test_fp8_file_upload_streams_tensor_and_scale(mode, tmp_path, monkeypatch):
    monkeypatch.setattr(C, "STREAM_THRESHOLD_BYTES", 1000)  # stream it, in small chunks
    monkeypatch.setattr(C, "STREAM_CHUNK_BYTES", 512)
    handler = ContractHandler()
    client = make(mode, handler)
    torch.manual_seed(1)
    w_t = (torch.randn(2, 160, 128) * 20).to(torch.float8_e4m3fn)  # (E, N, K)
    s = torch.rand(2, 2, 1) + 0.5  # w_t blocks: (E, ceil(N/128), K/128)
    path = tmp_path / "f8.safetensors"
    _save(path, {"w_t": w_t, "scale": s, "bias": torch.zeros(3)})
    progress: list[int] = []
    info = run(client, "upload_safetensors", "f8f", path, progress=lambda a, b: progress.append(a))
    assert (info.layout, info.k, info.n, info.scales) == ("w_t", 128, 160, "block")
    sent = handler.seen[-1].tensors()
    assert sorted(sent) == ["scale", "w_t"]  # "bias" stays home
    assert sent["w_t"].view(np.uint8).tolist() == w_t.view(torch.uint8).tolist()
    np.testing.assert_array_equal(sent["scale"], s.numpy())
    assert progress[0] == 0 and progress[-1] == len(handler.seen[-1].body) and len(progress) > 3


@pytest.mark.parametrize("mode", MODES)
def test_fp8_file_with_named_tensor_and_scale(mode, tmp_path):
    handler = ContractHandler()
    client = make(mode, handler)
    w = (torch.randn(2, 32, 16) * 20).to(torch.float8_e5m2)
    path = tmp_path / "ckpt.safetensors"
    _save(path, {"experts": w, "weight_scale_inv": torch.rand(2)})
    # the only tensor besides the named scale is the one to upload
    info = run(client, "upload_safetensors", "f8n", path, scale_tensor="weight_scale_inv")
    assert (info.dtype, info.scales, info.layout) == ("float8_e5m2", "tensor", "w")
    assert sorted(handler.seen[-1].tensors()) == ["scale", "w"]


@pytest.mark.parametrize("mode", MODES)
def test_bad_fp8_files_are_refused_locally(mode, tmp_path):
    handler = ContractHandler()
    client = make(mode, handler)
    w = torch.zeros(2, 128, 16).to(torch.float8_e4m3fn)
    cases = [
        ({"w": w}, {}, ValueError, r"needs its float32 decoding scale, but .* has no tensor "
                                   r"'scale' .*\[2, 1, 1\]"),
        ({"w": w, "s": torch.ones(2)}, {"scale_tensor": "scale"}, ValueError,
         "store it as 'scale' or name it"),
        ({"w": w, "scale": torch.ones(2, dtype=torch.float16)}, {}, TypeError,
         "scale 'scale' in .* must be F32; got F16"),
        ({"w": w, "scale": torch.ones(2, dtype=torch.float8_e8m0fnu)}, {}, TypeError,
         "scale 'scale' in .* must be F32; got F8_E8M0"),
        ({"w": w, "scale": torch.ones(2, 3)}, {}, ValueError, r"scale \[2, 3\] fits no "
                                                              "granularity"),
        ({"w": torch.zeros(2, 4, 4), "s": torch.ones(2)}, {"scale_tensor": "s"}, ValueError,
         "scale_tensor goes with FP8 tensors only; 'w' .* is F32"),
        ({"w": torch.zeros(2, 4, 4, dtype=torch.int8)}, {}, TypeError,
         "must be F32, F16, BF16, F8_E4M3 or F8_E5M2; got I8"),
    ]
    for i, (tensors, kwargs, exc, match) in enumerate(cases):
        path = tmp_path / f"bad{i}.safetensors"
        _save(path, tensors)
        with pytest.raises(exc, match=match):
            run(client, "upload_safetensors", "bad", path, **kwargs)
    assert handler.seen == []


def test_file_payload_with_scale_is_one_valid_body(tmp_path):
    w = (torch.randn(2, 128, 8) * 20).to(torch.float8_e4m3fn)
    s = torch.rand(2, 8)
    path = tmp_path / "m.safetensors"
    _save(path, {"scale": s, "other": torch.ones(5), "experts": w})
    entries = read_safetensors_header(path)
    assert entries["experts"].dtype == "F8_E4M3" and entries["experts"].nbytes == w.numel()
    payload = FileTensorPayload(path, entries["experts"], "w", [(entries["scale"], "scale")])
    body = b"".join(payload.iter_chunks(7))
    assert len(body) == payload.nbytes and body == payload.to_bytes()
    got = safetensors.torch.load(body)  # the reference parser agrees
    assert got["w"].dtype == torch.float8_e4m3fn and torch.equal(got["w"].view(torch.uint8),
                                                                   w.view(torch.uint8))
    assert torch.equal(got["scale"], s)
    assert decode_safetensors(body)["w"].dtype == E4M3


# ------------------------------------------------------------------------------------------
# WeightInfo: every field the server sends, and none from an older server

OLD = {"name": "l0", "experts": 2, "k": 3, "n": 4, "dtype": "float32", "bytes": 96,
       "layout": "w"}
FP8_INFO = {**OLD, "dtype": "float8_e4m3fn", "bytes": 40, "scales": "row",
            "kernels": [{"rows": 1, "config": "coop 128x256 s3 p16 ts ew", "source": "rules"},
                        {"rows": 256, "config": "pp 64x128 s4", "source": "table:exact"}]}


def test_weight_info_carries_scales_and_kernels():
    info = mgc.WeightInfo.from_json(FP8_INFO)
    assert info.scales == "row"
    assert info.kernels == (mgc.KernelInfo(1, "coop 128x256 s3 p16 ts ew", "rules"),
                            mgc.KernelInfo(256, "pp 64x128 s4", "table:exact"))
    assert info.to_json() == FP8_INFO
    hash(info)  # still a frozen, hashable value


def test_weight_info_from_an_older_server():
    info = mgc.WeightInfo.from_json(OLD)
    assert (info.scales, info.kernels) == (None, ())
    assert info.to_json() == OLD  # no fields the server did not send
    assert mgc.WeightInfo.from_json({**OLD, "scales": None, "kernels": None}) == info
    assert mgc.WeightInfo(*OLD.values()) == info  # positional construction as before


@pytest.mark.parametrize("bad, match", [
    ({"scales": 3}, "field 'scales' must be str"),
    ({"kernels": "coop"}, "field 'kernels' must be list"),
    ({"kernels": [{"rows": "1", "config": "c", "source": "rules"}]}, "field 'rows' must be int"),
    ({"kernels": [{"rows": 1, "config": "c"}]}, "missing field 'source'"),
    ({"kernels": [3]}, "kernels entry must be a JSON object"),
])
@pytest.mark.parametrize("mode", MODES)
def test_mistyped_info_fields_are_validation_errors(mode, bad, match):
    handler, _ = sequence(httpx.Response(200, json={**OLD, **bad}))
    client = make(mode, handler)
    with pytest.raises(mgc.APIResponseValidationError, match=match):
        run(client, "get_weights", "l0")


@pytest.mark.parametrize("mode", MODES)
def test_list_mixes_fp8_and_older_entries(mode):
    handler, _ = sequence(httpx.Response(200, json={"weights": [FP8_INFO, OLD]}))
    got = run(make(mode, handler), "list_weights")
    assert [(i.scales, len(i.kernels)) for i in got] == [("row", 2), (None, 0)]


# ------------------------------------------------------------------------------------------
# the command line


def _cli_on(monkeypatch, handler) -> None:
    monkeypatch.setattr(cli, "_make_client", lambda args: make_client(handler))


def test_cli_info_shows_scales_and_kernels(monkeypatch, capsys):
    handler, _ = sequence(httpx.Response(200, json=FP8_INFO))
    _cli_on(monkeypatch, handler)
    assert cli.main(["info", "l0"]) == 0
    assert json.loads(capsys.readouterr().out) == FP8_INFO
    handler, _ = sequence(httpx.Response(200, json=OLD))  # an older server: as before
    _cli_on(monkeypatch, handler)
    assert cli.main(["info", "l0"]) == 0
    assert json.loads(capsys.readouterr().out) == OLD


def test_cli_uploads_fp8_file_with_its_scale(monkeypatch, capsys, tmp_path):
    handler = ContractHandler()
    _cli_on(monkeypatch, handler)
    w = (torch.randn(2, 128, 16) * 20).to(torch.float8_e4m3fn)
    path = tmp_path / "f8.safetensors"
    _save(path, {"w": w, "scale_inv": torch.rand(2, 1, 1)})
    assert cli.main(["upload", "f8", str(path), "--scale-tensor", "scale_inv"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["dtype"], out["scales"]) == ("float8_e4m3fn", "block")
    assert sorted(handler.seen[-1].tensors()) == ["scale", "w"]
    assert cli.main(["info", "f8"]) == 0
    assert json.loads(capsys.readouterr().out)["scales"] == "block"
    # without the scale: a usage error, nothing sent
    n = len(handler.seen)
    assert cli.main(["upload", "f8", str(path)]) == 2
    assert "has no tensor 'scale'" in capsys.readouterr().err
    assert len(handler.seen) == n
