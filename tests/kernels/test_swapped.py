"""Swapped tiles (kernels/sm90/swapped.py) on the CPU (the CuTe DSL traces for sm_90a).

Thread by thread, for every variant N = 16u: the variant's accumulator holds, at its flat
index i, the (weight column, row) that the N = 256 accumulator holds at i (a smaller N's C
fragment is a prefix of the larger one's), and the epilogue's copy, made once from the N = 256
MMA, stages subtile e (rows 16e..16e+15) from exactly the values [8e, 8e + 8): so every
variant's values land where its WGMMA computed them and each tile element is written once.
Then the kernel's fixed choices and its refusals. (The numbers run in test_swapped_gpu.py.)
"""

from __future__ import annotations

import os

import pytest

from moe_gemm.capability import cutlass_dsl_problem

from .test_tile_layouts import _coords, _trace

pytestmark = pytest.mark.skipif(cutlass_dsl_problem() is not None,
                                reason=f"CuTe DSL: {cutlass_dsl_problem()}")


def _swapped(b_major="k", d_dtype="bfloat16", cluster_n=1):
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from moe_gemm.kernels.sm90.compile import CompileKey

    return CompileKey("varlen", "bfloat16", d_dtype, b_major, "cooperative", "device", 256, 128,
                      epi_n=16, trim_a=True, swap_ab=True, cluster_n=cluster_n).kernel()


def _variant_mapping(k) -> tuple[int, int, set]:
    import cutlass.cute as cute

    from moe_gemm.kernels.sm90.constants import SWAP_ROW_UNIT, SWAP_TILE_COLS

    k._setup()
    full = k.tiled_mma
    tiled_copy = k.epi.tiled_copy(full)
    sD = cute.make_tensor(cute.make_ptr(k.d_dtype, 0, cute.AddressSpace.smem, assumed_align=1024),
                          k.d_smem_staged.outer)
    prefix_bad = staged_bad = 0
    written: set = set()
    for u in range(1, 17):
        n = u * SWAP_ROW_UNIT
        mma = k.swapped_mma(n)
        tile = cute.make_identity_tensor((SWAP_TILE_COLS, n))
        for t in range(0, 256, 5 if u < 16 else 1):
            acc_u = _coords(mma.get_slice(t).partition_C(tile))
            acc_full = _coords(full.get_slice(t).partition_C(
                cute.make_identity_tensor((SWAP_TILE_COLS, 256))))
            assert len(acc_u) == 8 * u
            prefix_bad += sum(a != b for a, b in zip(acc_u, acc_full))
            if u == 16:  # the epilogue's subtile partitions, per thread
                thr = tiled_copy.get_slice(t)
                assert cute.size(cute.shape(thr.partition_S(sD))[:3]) == 8  # one subtile
                for e in range(16):
                    sub = _coords(thr.partition_S(cute.local_tile(
                        cute.make_identity_tensor((SWAP_TILE_COLS, 256)), k.epi_tile, (0, e))))
                    assert len(sub) == 8
                    staged_bad += sum(a != b for a, b in zip(acc_full[8 * e:8 * e + 8], sub))
                    written.update(sub)
    return prefix_bad, staged_bad, written


@pytest.mark.parametrize("b_major", ["k", "n"])
def test_every_variant_stages_its_accumulators_where_its_mma_computed_them(b_major):
    k = _swapped(b_major)
    prefix_bad, staged_bad, written = _trace(lambda: _variant_mapping(k))
    assert prefix_bad == 0, f"{prefix_bad} variant accumulators off the N = 256 prefix"
    assert staged_bad == 0, f"{staged_bad} accumulators staged at the wrong (column, row)"
    assert written == {(c, r) for c in range(128) for r in range(256)}


def test_fixed_choices_and_shared_memory():
    from moe_gemm.kernels.sm90.constants import SWAP_ROW_UNIT, SWAP_TILE_COLS, SWAP_TILE_ROWS

    k = _swapped("n")
    assert (k.form, k.schedule, k.visitor, k.tile_m, k.tile_n) == (
        "varlen", "cooperative", "device", SWAP_TILE_ROWS, SWAP_TILE_COLS)
    assert k.trim_a and not k.tail_split and k.cluster_size == 1
    assert k.epi_tile == (SWAP_TILE_COLS, SWAP_ROW_UNIT) and k.epi_stages == 8
    # 48 KiB a stage (256 rows of x and 128 weight columns of 64 K): four beside 32 KiB of
    # epilogue staging.
    assert k.ab_stages == 4
    # The 1x2 pair: the rows of x (A) multicast to both CTAs, nothing else changes.
    pair = _swapped("k", cluster_n=2)
    assert (pair.cluster_m, pair.cluster_n, pair.cluster_size) == (1, 2, 2)
    assert pair.ab_stages == 4 and pair.epi_tile == k.epi_tile


def test_refusals():
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from moe_gemm.kernels.sm90.compile import CompileKey

    with pytest.raises(ValueError, match="16-bit output"):
        _swapped(d_dtype="float32")
    base = dict(epi_n=16, trim_a=True, swap_ab=True)
    for form, schedule, tile, extra, what in (
            ("batched", "cooperative", (256, 128), {}, "'form': 'batched'"),
            ("varlen", "pingpong", (128, 128), {}, "'schedule': 'pingpong'"),
            ("varlen", "cooperative", (128, 256), {}, "'tile_m': 128"),
            ("varlen", "cooperative", (256, 128), {"cluster_m": 2}, "'cluster_m': 2"),
            ("varlen", "cooperative", (256, 128), {"cluster_m": 2, "cluster_n": 2},
             "'cluster_m': 2"),
            ("varlen", "cooperative", (256, 128), {"cluster_n": 4}, "1x1 or 1x2 cluster"),
            ("varlen", "cooperative", (256, 128), {"tail_split": True}, "'tail_split': True"),
            ("varlen", "cooperative", (256, 128),
             {"gate": "silu", "gate_layout": "concat", "gather": True}, "gather-A")):
        key = CompileKey(form, "bfloat16", "bfloat16", "k", schedule, "device", *tile,
                         **{**base, **extra})
        with pytest.raises(ValueError, match=what):
            key.kernel()
