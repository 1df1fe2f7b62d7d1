"""moe_gemm_client._tensors: numpy/torch <-> safetensors, checked against the reference library."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch

from moe_gemm_client._tensors import (
    BFLOAT16,
    NUMPY,
    ArrayKind,
    FileTensorPayload,
    as_data_array,
    as_index_array,
    decode_safetensors,
    encode_safetensors,
    read_safetensors_header,
)

NP_DTYPES = [np.float32, np.float16, BFLOAT16]


@pytest.mark.parametrize("dtype", NP_DTYPES, ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("shape", [(5, 7), (1, 1), (0, 3), (3, 0), (2, 3, 4)])
def test_numpy_roundtrip_is_bit_exact(rng, dtype, shape):
    a = rng.standard_normal(shape).astype(np.float32).astype(dtype)
    out = decode_safetensors(encode_safetensors({"a": a}).to_bytes())
    assert out["a"].dtype == a.dtype and out["a"].shape == a.shape
    assert out["a"].tobytes() == a.tobytes()
    assert out["a"].flags.writeable  # results may be modified in place by the caller
    out["a"][...] = 0


def test_encoding_is_read_by_the_reference_library(rng):
    a = rng.standard_normal((4, 3)).astype(np.float32)
    c = np.array([1, 0, 3], np.int32)
    h = rng.standard_normal((2, 2)).astype(np.float16)
    data = encode_safetensors({"x": a, "counts": c, "h": h}).to_bytes()
    ref = safetensors.numpy.load(data)
    np.testing.assert_array_equal(ref["x"], a)
    np.testing.assert_array_equal(ref["counts"], c)
    np.testing.assert_array_equal(ref["h"], h)
    # header is 8-byte aligned, as the reference writer makes it
    (hlen,) = struct.unpack("<Q", data[:8])
    assert hlen % 8 == 0


def test_bf16_matches_torch_bits_both_ways():
    t = torch.randn(6, 5, dtype=torch.float32).to(torch.bfloat16)
    arr, kind = as_data_array(t, "x", "(T, K)", 2)
    assert arr.dtype == BFLOAT16 and kind.torch
    data = encode_safetensors({"x": arr}).to_bytes()
    back = safetensors.torch.load(data)["x"]
    assert back.dtype == torch.bfloat16 and torch.equal(back, t)
    # and the other direction: torch's writer, our reader, torch out again
    ours = decode_safetensors(safetensors.torch.save({"y": t}))["y"]
    assert ours.dtype == BFLOAT16
    again = ArrayKind(torch=True, device=t.device).wrap(ours)
    assert again.dtype == torch.bfloat16 and torch.equal(again, t)


def test_bf16_torch_keeps_raw_bits():
    # Raw int16 bit patterns survive, including a NaN payload, -0 and a subnormal.
    bits = torch.tensor([[0x7FC1, -32768, 0x0001, 0x3F81]], dtype=torch.int16)
    t = bits.view(torch.bfloat16)
    arr, _ = as_data_array(t, "x", "(T, K)", 2)
    assert arr.view(np.int16).tolist() == bits.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_torch_in_torch_out(dtype):
    t = torch.randn(3, 4).to(dtype)
    arr, kind = as_data_array(t, "x", "(T, K)", 2)
    out = kind.wrap(decode_safetensors(encode_safetensors({"x": arr}).to_bytes())["x"])
    assert isinstance(out, torch.Tensor) and out.dtype == dtype and torch.equal(out, t)


def test_non_contiguous_and_big_endian_inputs(rng):
    a = rng.standard_normal((4, 6)).astype(np.float32)
    arr, _ = as_data_array(a.T, "x", "(T, K)", 2)
    assert arr.flags.c_contiguous
    np.testing.assert_array_equal(decode_safetensors(encode_safetensors({"x": arr}).to_bytes())["x"],
                                  a.T)
    big = a.astype(">f4")
    arr, _ = as_data_array(big, "x", "(T, K)", 2)
    out = decode_safetensors(encode_safetensors({"x": arr}).to_bytes())["x"]
    np.testing.assert_array_equal(out, a)
    t = torch.randn(5, 4)[:, ::2]
    arr, _ = as_data_array(t, "x", "(T, K)", 2)
    np.testing.assert_array_equal(arr, t.numpy())


def test_torch_tensors_without_plain_values_are_refused_or_materialized():
    # A meta, sparse or nested tensor failed deep inside torch (NotImplementedError,
    # RuntimeError), not as the documented TypeError / ValueError; a negated view (torch's
    # lazy negation bit) could not be turned into numpy at all.
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match="x is a meta tensor"):
        as_data_array(torch.empty(3, 4, device="meta"), "x", "(T, K)", 2)
    with pytest.raises(TypeError, match="x must be a dense tensor; got layout torch.sparse_coo"):
        as_data_array(x.to_sparse(), "x", "(T, K)", 2)
    nested = torch.nested.nested_tensor([torch.zeros(2, 4), torch.zeros(3, 4)])
    with pytest.raises(TypeError, match="x must be a dense tensor; got a nested tensor"):
        as_data_array(nested, "x", "(T, K)", 2)
    arr, _ = as_data_array(x._neg_view(), "x", "(T, K)", 2)
    np.testing.assert_array_equal(arr, (-x).numpy())
    counts = torch.tensor([1, 2, 0])
    with pytest.raises(ValueError, match="counts is a meta tensor"):
        as_index_array(torch.empty(3, dtype=torch.int64, device="meta"), "counts", "(E,)")
    with pytest.raises(TypeError, match="counts must be a dense tensor"):
        as_index_array(counts.to_sparse(), "counts", "(E,)")


def test_torch_requires_grad_is_detached():
    t = torch.randn(2, 3, requires_grad=True)
    arr, kind = as_data_array(t, "x", "(T, K)", 2)
    np.testing.assert_array_equal(arr, t.detach().numpy())


@pytest.mark.parametrize(
    "obj, exc, words",
    [
        (np.zeros((2, 3), np.float64), TypeError, "astype(np.float32)"),
        (np.zeros((2, 3), np.int32), TypeError, "float32, float16 or bfloat16"),
        (np.zeros(3, np.float32), ValueError, "2-D (T, K)"),
        ([[1.0, 2.0]], TypeError, "numpy array or torch tensor (T, K)"),
        (torch.zeros(2, 3, dtype=torch.float64), TypeError, "torch.float32"),
        (torch.zeros(2, 3, 4), ValueError, "got shape (2, 3, 4)"),
    ],
)
def test_data_array_errors_name_what_was_expected(obj, exc, words):
    with pytest.raises(exc, match=None) as info:
        as_data_array(obj, "x", "(T, K)", 2)
    assert words in str(info.value)


def test_index_arrays():
    assert as_index_array([3, 0, 5], "counts", "(E,)").dtype == np.int32
    np.testing.assert_array_equal(as_index_array(np.array([1, 2], np.int64), "c", "(E,)"), [1, 2])
    np.testing.assert_array_equal(as_index_array(torch.tensor([4, 5]), "c", "(E,)"), [4, 5])
    assert as_index_array([], "c", "(E,)").shape == (0,)
    for bad, exc in [
        ([1.5, 2], TypeError),
        ([True, False], TypeError),
        (np.array([1.0]), TypeError),
        (np.array([True]), TypeError),
        (np.zeros((2, 2), np.int32), ValueError),
        (np.array([2**31], np.int64), ValueError),
        (torch.tensor([1.0]), TypeError),
        ("3,4", TypeError),
    ]:
        with pytest.raises(exc, match="c"):
            as_index_array(bad, "c", "(E,)")


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x01\x00",
        struct.pack("<Q", 1000) + b"{}",  # header length that lies
        struct.pack("<Q", 2) + b"[]",
        struct.pack("<Q", 8) + b"not json",
        # offsets that run past the end of the buffer
        struct.pack("<Q", 64) + b'{"x":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}'.ljust(64)
        + b"\x00" * 8,
        # a dtype the API never uses
        struct.pack("<Q", 64) + b'{"x":{"dtype":"U16","shape":[1],"data_offsets":[0,2]}}'.ljust(64)
        + b"\x00" * 2,
    ],
)
def test_malformed_bodies_raise_valueerror(data):
    with pytest.raises(ValueError):
        decode_safetensors(data)


def test_file_payload_streams_one_tensor_renamed(tmp_path, rng):
    w = rng.standard_normal((3, 4, 5)).astype(np.float32)
    other = rng.standard_normal((7,)).astype(np.float32)
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file({"other": other, "experts": w}, str(path))
    entries = read_safetensors_header(path)
    assert set(entries) == {"other", "experts"} and entries["experts"].shape == (3, 4, 5)
    payload = FileTensorPayload(path, entries["experts"], "w")
    chunks = list(payload.iter_chunks(16))
    assert max(len(c) for c in chunks[1:]) <= 16
    body = b"".join(chunks)
    assert len(body) == payload.nbytes
    out = decode_safetensors(body)
    assert list(out) == ["w"]
    np.testing.assert_array_equal(out["w"], w)
    # a second pass (a retry) yields the same bytes again
    assert b"".join(payload.iter_chunks(1 << 20)) == body


def test_read_header_rejects_bad_files(tmp_path):
    p = tmp_path / "bad.safetensors"
    p.write_bytes(b"\x00\x01")
    with pytest.raises(ValueError, match="shorter than 8 bytes"):
        read_safetensors_header(p)
    p.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ValueError, match="header length"):
        read_safetensors_header(p)
    p.write_bytes(struct.pack("<Q", 56) + b'{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}'
                  + b"}" + b" ")
    with pytest.raises(ValueError, match="does not fit"):
        read_safetensors_header(p)


@pytest.mark.parametrize("values", [[2**63, 0], [-(2**70), 0], [np.uint64(2**63), 1]])
def test_index_lists_beyond_int64_are_a_valueerror(values):
    """Were a bare OverflowError from numpy (not the documented ValueError naming int32)."""
    with pytest.raises(ValueError, match="counts has values outside int32"):
        as_index_array(values, "counts", "(E,)")


def test_read_header_dtype_that_is_not_a_string_is_a_valueerror(tmp_path):
    """Was a bare TypeError (unhashable list) instead of "bad header entry"."""
    header = b'{"w":{"dtype":["F32"],"shape":[1,1,1],"data_offsets":[0,4]}}'
    p = tmp_path / "odd.safetensors"
    p.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    with pytest.raises(ValueError, match="bad header entry for 'w'"):
        read_safetensors_header(p)


def test_read_header_nested_too_deeply_is_a_valueerror(tmp_path):
    """Was a bare RecursionError: `moe-gemm-client upload` died with a traceback, not exit 2."""
    header = b'{"w": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    p = tmp_path / "deep.safetensors"
    p.write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(ValueError, match="not JSON"):
        read_safetensors_header(p)


def test_numpy_kind_returns_the_array_itself():
    a = np.ones((2, 2), np.float32)
    assert NUMPY.wrap(a) is a


@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint16, torch.uint32, torch.uint64,
                                   torch.int8, torch.int16, torch.int32, torch.int64])
def test_index_tensors_of_every_integer_dtype(dtype):
    # torch's uint16/32/64 were refused ("must be an integer tensor") though numpy's are taken.
    got = as_index_array(torch.tensor([3, 0, 5]).to(dtype), "counts", "(E,)")
    assert got.dtype == np.int32 and got.tolist() == [3, 0, 5]
    for bad in (torch.tensor([True]), torch.tensor([1.0]).to(torch.float8_e4m3fn),
                torch.tensor([1 + 1j])):
        with pytest.raises(TypeError, match="counts must be an integer tensor"):
            as_index_array(bad, "counts", "(E,)")
    with pytest.raises(ValueError, match="outside int32"):
        as_index_array(torch.tensor([2**31]).to(torch.uint32), "counts", "(E,)")
