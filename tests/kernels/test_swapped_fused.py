"""Swapped tiles with the fused MoE options (kernels/sm90/swapped_fused.py) on the CPU (the
CuTe DSL traces for sm_90a).

Thread by thread: thread t of math warpgroup 1 holds, at every flat accumulator index, the up
value of the (weight column, row) whose gate value thread t of warpgroup 0 holds there (64
columns further along M: the concat load's up half), which the exchange relies on; and the
gated epilogue's copy (one warpgroup's 64 x 16 MMA) stages subtile e from exactly warpgroup
0's values [8e, 8e + 8), each output (column, row) of the 64 x 256 tile once. Then the
kernel's fixed choices and refusals. (The numbers run in test_swapped_fused_gpu.py.)
"""

from __future__ import annotations

import os

import pytest

from moe_gemm.capability import cutlass_dsl_problem

from .test_tile_layouts import _coords, _trace

pytestmark = pytest.mark.skipif(cutlass_dsl_problem() is not None,
                                reason=f"CuTe DSL: {cutlass_dsl_problem()}")


def _key(**fused):
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from moe_gemm.kernels.sm90.compile import CompileKey

    return CompileKey("varlen", "bfloat16", fused.pop("d_dtype", "bfloat16"),
                      fused.pop("b_major", "k"),
                      "cooperative", "device", 256, 128, epi_n=16, trim_a=True, swap_ab=True,
                      **fused)


def _gated_mapping(k) -> tuple[int, int, int, set]:
    import cutlass.cute as cute

    from moe_gemm.kernels.sm90.constants import SWAP_TILE_COLS, SWAP_TILE_ROWS

    k._setup()
    full = k.tiled_mma
    tiled_copy = k.epi.tiled_copy(k.epi.gated_copy_mma())
    sD = cute.make_tensor(cute.make_ptr(k.d_dtype, 0, cute.AddressSpace.smem, assumed_align=1024),
                          k.d_smem_staged.outer)
    tile = cute.make_identity_tensor((SWAP_TILE_COLS, SWAP_TILE_ROWS))
    out_tile = cute.make_identity_tensor((SWAP_TILE_COLS // 2, SWAP_TILE_ROWS))
    pair_bad = gate_bad = staged_bad = 0
    written: list = []
    for t in range(128):
        gate = _coords(full.get_slice(t).partition_C(tile))
        up = _coords(full.get_slice(t + 128).partition_C(tile))
        pair_bad += sum((m + 64, n) != (um, un) for (m, n), (um, un) in zip(gate, up))
        gate_bad += sum(not 0 <= m < 64 for m, _ in gate)
        thr = tiled_copy.get_slice(t)
        assert cute.size(cute.shape(thr.partition_S(sD))[:3]) == 8  # one subtile
        for e in range(16):
            sub = _coords(thr.partition_S(cute.local_tile(out_tile, k.epi_tile, (0, e))))
            assert len(sub) == 8
            staged_bad += sum(a != b for a, b in zip(gate[8 * e:8 * e + 8], sub))
            written.extend(sub)
    return pair_bad, gate_bad, staged_bad, written


def test_gated_pairs_and_stages_every_output_once():
    k = _key(gate="silu", gate_layout="concat").kernel()
    pair_bad, gate_bad, staged_bad, written = _trace(lambda: _gated_mapping(k))
    assert pair_bad == 0, f"{pair_bad} up values off their gate value's (column, row)"
    assert gate_bad == 0, f"{gate_bad} warpgroup-0 values outside the gate half"
    assert staged_bad == 0, f"{staged_bad} outputs staged at the wrong (column, row)"
    assert sorted(written) == [(c, r) for c in range(64) for r in range(256)]


def _tile_input_mapping(k, threads: int):
    import cutlass.cute as cute

    from moe_gemm.kernels.sm90.constants import SWAP_ROW_UNIT, SWAP_TILE_COLS, SWAP_TILE_ROWS
    from moe_gemm.kernels.sm90.fused_epilogue import static_offsets
    from moe_gemm.kernels.sm90.swapped_fused import SUBTILE_VALUES, row_lane_split, row_slots

    k._setup()
    tile = cute.make_identity_tensor((SWAP_TILE_COLS, SWAP_TILE_ROWS))
    bad_lane = bad_slot = bad_col = 0
    for t in range(threads):
        part = k.tiled_mma.get_slice(t).partition_C(tile)
        coords, offsets = _coords(part), static_offsets(part)
        for i, ((col, row), (col_off, row_off)) in enumerate(zip(coords, offsets)):
            lane, slot = row_lane_split(row, row_off)
            # the lane that loaded row `row` (row = 32 slot + lane), among the tile's slots
            bad_lane += slot * 32 + lane != row
            subtiles = i // SUBTILE_VALUES + 1  # the fewest subtiles a tile holding i has
            bad_slot += not slot < row_slots(subtiles) or row >= subtiles * SWAP_ROW_UNIT
            # every subtile's value at this column offset has its first subtile's column
            first = [v for v in range(SUBTILE_VALUES) if offsets[v][0] == col_off]
            bad_col += not first or coords[first[0]][0] != col
    return bad_lane, bad_slot, bad_col


@pytest.mark.parametrize("fused", [dict(row_scale=True, bias=True),
                                   dict(gate="silu", gate_layout="concat", row_scale=True,
                                        bias=True)], ids=["down", "gated"])
def test_tile_inputs_reach_every_value(fused):
    """The epilogue loads a tile's biases and row weights once (lane l the rows l, l + 32,
    ...) and hands each value its row's weight by a shuffle from that lane: for every thread
    (both warpgroups; the gated tile's warpgroup 0 uses them) and every value, the lane and
    slot it reads hold its own row, the slot is one its tile's row count loads, and its
    bias is the one loaded for its column."""
    k = _key(**fused).kernel()
    bad_lane, bad_slot, bad_col = _trace(lambda: _tile_input_mapping(k, 256))
    assert bad_lane == 0, f"{bad_lane} values read another row's weight"
    assert bad_slot == 0, f"{bad_slot} values read a slot their tile does not load"
    assert bad_col == 0, f"{bad_col} values read another column's bias"


def test_fixed_choices_and_shared_memory():
    from moe_gemm.kernels.sm90.constants import SWAP_ROW_UNIT
    from moe_gemm.kernels.sm90.swapped_fused import SwappedFusedMoeGemmSm90

    gated = _key(gate="clamped_swiglu", gate_layout="concat", gate_alpha=1.702,
                 gate_limit=7.0, bias=True).kernel()
    assert isinstance(gated, SwappedFusedMoeGemmSm90)
    assert gated.gate_halves and gated.d_tile_n == 64
    assert gated.epi_tile == (64, SWAP_ROW_UNIT) and gated.epi_stages == 8
    assert gated.epi_scratch_floats == 2 * 8 * 128
    # The plain swapped kernel's four 48 KiB stages: the output staging (8 x 2 KiB) and the
    # exchange (8 KiB) fit in its 32 KiB of staging.
    assert gated.ab_stages == 4
    down = _key(b_major="n", bias=True, row_scale=True).kernel()
    assert isinstance(down, SwappedFusedMoeGemmSm90)
    assert down.epi_tile == (128, SWAP_ROW_UNIT) and down.epi_scratch_floats == 0
    assert down.ab_stages == 4 and not down.gate_halves
    assert "swap" in _key(row_scale=True).name() and "rowscale" in _key(row_scale=True).name()


def test_refusals():
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import cutlass

    from moe_gemm.kernels.sm90.swapped_fused import SwappedFusedMoeGemmSm90

    for layout in ("interleaved", "alternating"):
        with pytest.raises(ValueError, match="concat gate layout only"):
            _key(gate="silu", gate_layout=layout).kernel()
    with pytest.raises(ValueError, match="gather-A"):
        _key(gate="silu", gate_layout="concat", gather=True).kernel()
    with pytest.raises(ValueError, match="K-major"):  # concat needs a K-major weight
        _key(b_major="n", gate="silu", gate_layout="concat").kernel()
    with pytest.raises(ValueError, match="needs a fused option"):
        SwappedFusedMoeGemmSm90(cutlass.BFloat16, cutlass.BFloat16, "k")
    with pytest.raises(ValueError, match="16-bit output"):
        _key(row_scale=True, d_dtype="float32").kernel()

