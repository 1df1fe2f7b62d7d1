"""Wire formats and persistence helpers, without a server: strict parsing of lying input."""

from __future__ import annotations

import gzip
import json
import struct
import zlib

import numpy as np
import pytest
import torch
from safetensors.torch import save

from moe_gemm_server.codecs import (
    decode_json_grouped_gemm,
    decode_json_grouped_mm,
    decode_safetensors,
    encode_safetensors,
    parse_json_object,
)
from moe_gemm_server.errors import APIError
from moe_gemm_server.limits import _decompress
from moe_gemm_server.storage import WeightStore, check_name, read_weight_file
from moe_gemm_server.v2 import encode_response, parse_request


def _raw(header: dict | bytes, data: bytes = b"", n: int | None = None) -> bytearray:
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    return bytearray(struct.pack("<Q", len(h) if n is None else n) + h + data)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int32,
                                   torch.int64, torch.uint8, torch.bool])
def test_safetensors_round_trip(dtype):
    gen = torch.Generator().manual_seed(0)
    t = (torch.randn(3, 5, generator=gen) * 10).to(dtype)
    e = torch.empty(0, 7, dtype=dtype)
    out = decode_safetensors(bytearray(encode_safetensors({"t": t, "e": e})))
    assert torch.equal(out["t"], t) and out["t"].dtype == dtype
    assert out["e"].shape == (0, 7)


def test_safetensors_unaligned_offsets_are_copied():
    data = b"\0" + np.arange(4, dtype=np.float32).tobytes()
    hdr = {"pad": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
           "x": {"dtype": "F32", "shape": [4], "data_offsets": [1, 17]}}
    body = _raw(hdr, data)
    out = decode_safetensors(body)
    assert out["x"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert out["x"].data_ptr() % 4 == 0


@pytest.mark.parametrize(
    "body, match",
    [
        (bytearray(b"\1\2\3"), "shorter than the 8-byte"),
        (_raw({}, n=2**63), "does not fit"),
        (_raw({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, n=999),
         "does not fit"),
        (_raw(b"[1, 2]"), "JSON object"),
        (_raw(b"\xff\xfe"), "not valid JSON"),
        (_raw(b'{"a": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}, "a": 1}'),
         "duplicate"),
        (_raw({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4),
         "needs 8 bytes"),
        (_raw({"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4),
         "shape must be a list of ints in"),
        (_raw({"x": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, b"\0" * 4),
         "shape must be a list of ints in"),
        (_raw({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 4),
         "do not lie"),
        (_raw({"x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, b"\0" * 4),
         "do not lie"),
        (_raw({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 8),
         "cover 4 bytes of a 8-byte"),
        (_raw({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
               "y": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 8),
         "contiguous"),
        (_raw({"x": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
         "unknown dtype"),
        (_raw({"x": [1, 2]}), "must be an object"),
        (_raw({"__metadata__": {"a": 1}}), "__metadata__"),
        (_raw({"x": {"dtype": "F32", "shape": [2**31 - 1, 2**31 - 1], "data_offsets": [0, 4]}},
              b"\0" * 4), "needs"),
        (_raw({"x": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 4]}},
              b"\0" * 4), "shape must be a list of ints in"),
    ],
)
def test_safetensors_lies_are_400(body, match):
    with pytest.raises(APIError, match=match) as ei:
        decode_safetensors(body)
    assert ei.value.status == 400


def test_encode_copies_shared_views():
    base = torch.arange(12.0).reshape(3, 4)
    a, b = base.unbind(0)[:2]
    out = decode_safetensors(bytearray(encode_safetensors({"a": a, "b": b})))
    assert out["a"].tolist() == [0, 1, 2, 3] and out["b"].tolist() == [4, 5, 6, 7]


def test_json_decoders():
    obj = parse_json_object(b'{"x": [[1, 2.5], [3, 4]], "counts": [1, 1], "dtype": "bfloat16"}')
    t = decode_json_grouped_mm(obj, K=2)
    assert t["x"].dtype == torch.bfloat16 and t["x"].tolist() == [[1, 2.5], [3, 4]]
    assert t["counts"].dtype == torch.int64
    assert decode_json_grouped_mm({"x": [], "offs": [0, 0]}, K=5)["x"].shape == (0, 5)
    g = decode_json_grouped_gemm({"a": [[[1, 2]], []], "b": [[[1], [2]], [[1, 2, 3]]]})
    assert g["a.0"].shape == (1, 2) and g["a.1"].shape == (0, 1) and g["b.1"].shape == (1, 3)
    for bad, status in [
        (b"[1]", 400), (b"{", 400), (b"\xff", 400),
    ]:
        with pytest.raises(APIError) as ei:
            parse_json_object(bad)
        assert ei.value.status == status
    for obj, status in [
        ({"x": [[1, 2], [3]], "counts": [2]}, 400),
        ({"x": [["1", 2]], "counts": [1]}, 400),
        ({"x": [[True, 2]], "counts": [1]}, 400),
        ({"x": [[1, 2]], "counts": [1.5]}, 400),
        ({"x": [[1, 2]], "counts": [2**70]}, 422),
        ({"counts": [1]}, 400),
        ({"x": [[1, 2]], "counts": [1], "y": 1}, 400),
        ({"x": [[1, 2]], "counts": [1], "dtype": "int8"}, 422),
    ]:
        with pytest.raises(APIError) as ei:
            decode_json_grouped_mm(obj, K=2)
        assert ei.value.status == status, obj


def test_v2_parse_and_encode():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    hdr = json.dumps({"id": 7, "inputs": [
        {"name": "x", "shape": [2, 3], "datatype": "FP32",
         "parameters": {"binary_data_size": 24}},
        {"name": "counts", "shape": [1], "datatype": "INT32", "data": [2]}]}).encode()
    req, tensors = parse_request(bytearray(hdr + x.tobytes()), str(len(hdr)))
    assert req.id == 7
    assert tensors["x"].tolist() == x.tolist() and tensors["counts"].tolist() == [2]
    y = torch.arange(4, dtype=torch.float32).reshape(2, 2).to(torch.bfloat16)
    body, hlen = encode_response("m", "7", {"y": y}, {"y": True})
    meta = json.loads(body[:hlen])
    assert meta["outputs"][0]["datatype"] == "BF16"
    assert meta["outputs"][0]["parameters"]["binary_data_size"] == 8
    got = torch.frombuffer(bytearray(body[hlen:]), dtype=torch.bfloat16).reshape(2, 2)
    assert torch.equal(got, y)
    body, hlen = encode_response("m", "7", {"y": y}, {"y": False})
    assert hlen is None and json.loads(body)["outputs"][0]["data"] == [0.0, 1.0, 2.0, 3.0]


def test_decompress_limits():
    data = b"a" * 10000
    assert _decompress(gzip.compress(data), "gzip", 10000) == data
    assert _decompress(zlib.compress(data), "deflate", 10000) == data
    with pytest.raises(APIError) as ei:
        _decompress(gzip.compress(b"\0" * 1_000_000), "gzip", 1000)  # a small bomb
    assert ei.value.status == 413
    with pytest.raises(APIError) as ei:
        _decompress(b"not gzip", "gzip", 1000)
    assert ei.value.status == 400
    with pytest.raises(APIError) as ei:
        _decompress(gzip.compress(data)[:-10], "gzip", 100000)
    assert ei.value.status == 400


@pytest.mark.parametrize("name", ["a", "A-b_c.d", "x" * 128, "0.1", "-"])
def test_good_names(name):
    check_name(name)


@pytest.mark.parametrize("name", ["", ".a", "..", "a/b", "a b", "x" * 129, "é", "a\n"])
def test_bad_names(name):
    with pytest.raises(APIError) as ei:
        check_name(name)
    assert ei.value.status == 422


def test_store_writes_atomically(tmp_path):
    store = WeightStore(tmp_path / "d")
    body = save({"w": torch.randn(2, 3, 4)})
    store.write("s", body)
    assert (tmp_path / "d" / "s.safetensors").read_bytes() == body
    t, layout, scale = store.load("s")
    assert layout == "w" and t.shape == (2, 3, 4) and scale is None
    # leftovers of a crashed upload are invisible and removed at start
    (tmp_path / "d" / ".upload-dead.tmp").write_bytes(b"half")
    assert store.names() == ["s"]
    assert store.cleanup_temp() == 1
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["s.safetensors"]
    assert store.delete("s") and not store.delete("s")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(save({"w": torch.randn(2, 3)}))
    with pytest.raises(APIError, match="3-D"):
        read_weight_file(bad)
