"""The FP8 kernel's scale bookkeeping, checked on the CPU against the MMA's own layouts.

GroupedGemmFp8Sm90's promotion reads, at trace time, thread 0's (row, col) of every
accumulator value (FragmentMap) and assumes every math thread's coordinates are thread 0's
plus an offset of its own that stays inside an 8-column group. Here that is proven thread by
thread for the FP8 tile family: each thread's rows per row slot, its columns per column slot,
and, for every tile start a block-scaled tile can have, that the run-time split picks the
128-column scale block each value's column really lies in. Also the tile rules
(constants_fp8) and the register budget of each build.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from moe_gemm.capability import cutlass_dsl_problem
from moe_gemm.kernels.sm90.constants import REGS_DEFAULT, REGS_HEAVY
from moe_gemm.kernels.sm90.constants_fp8 import (
    FP8_MAX_ACC_REGS,
    fp8_register_split,
    fp8_tile_problem,
    scale_blocks_spanned,
)

pytestmark = pytest.mark.skipif(cutlass_dsl_problem() is not None,
                                reason=f"CuTe DSL: {cutlass_dsl_problem()}")

# Every tile the block-scaled kernel builds: cooperative 128 x n, ping-pong 64 x n and 128 x n.
TILES = [(s, (m, n)) for s, m, top in (("cooperative", 128, 192), ("pingpong", 64, 192),
                                       ("pingpong", 128, 96))
         for n in range(16, top + 1, 16) if fp8_tile_problem(s, m, n, "block") is None]


def _kernel(schedule, tile, mode="block", promote_lag=False):
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from moe_gemm.kernels.sm90.compile_fp8 import Fp8CompileKey

    return Fp8CompileKey("varlen", "float8_e4m3fn", "bfloat16", mode, schedule, "device",
                         *tile, promote_lag=promote_lag).kernel()


def _thread_coords(kernel):
    """[thread][value] -> (row, col) in the tile, for every math thread of one tile, and the
    kernel's FragmentMap (all read inside one DSL trace). Each thread's partition is its own
    base coordinate and a value layout; the value layout is checked to be the same for all."""
    import cutlass.cute as cute

    from moe_gemm.kernels.sm90.fused_epilogue import coord_offsets

    box = {}

    def collect():  # plain Python (the DSL rewrites loops inside @cute.jit functions)
        kernel._setup()
        mma = kernel.tiled_mma
        tile = cute.make_identity_tensor((kernel.tile_m, kernel.tile_n))
        threads = 128 if kernel.pingpong else 256
        parts = [mma.get_slice(t).partition_C(tile) for t in range(threads)]
        layouts = {str(c.layout) for c in parts}
        assert len(layouts) == 1, layouts
        offs = coord_offsets(parts[0].layout)  # raises on a malformed coordinate stride
        box["coords"] = [[(r + b[0], c + b[1]) for r, c in offs]
                         for b in (tuple(p.iterator) for p in parts)]
        # Spot check against the DSL's own element access.
        for t in (0, threads - 1):
            assert [tuple(parts[t][i]) for i in range(len(offs))] == box["coords"][t]
        box["fmap"] = kernel.fragment_map(mma)

    @cute.jit
    def probe():
        collect()

    cute.compile(probe)
    return box["coords"], box["fmap"]


@pytest.mark.parametrize("schedule,tile", TILES, ids=[f"{s}-{m}x{n}" for s, (m, n) in TILES])
def test_fragment_map_holds_for_every_thread(schedule, tile):
    kernel = _kernel(schedule, tile)
    coords, fmap = _thread_coords(kernel)
    base = coords[0]
    tile_m, tile_n = tile
    seen = set()
    for t, mine in enumerate(coords):
        dr, dc = mine[0][0] - base[0][0], mine[0][1] - base[0][1]
        for i, ((r, c), (r0, c0)) in enumerate(zip(mine, base)):
            assert (r - r0, c - c0) == (dr, dc), (t, i)  # thread 0's plus one offset
            assert 0 <= dc and (c0 & 7) + dc < 8, (t, i)  # inside the 8-column group
            # The slot's representative value is on the same row / column.
            assert mine[fmap.row_rep[fmap.row_slot[i]]][0] == r
            assert mine[fmap.col_rep[fmap.col_slot[i]]][1] == c
            seen.add((r, c))
    # Every element of the tile is held by exactly one value of one thread.
    assert len(seen) == tile_m * tile_n == sum(map(len, coords))
    # Block scales: for every start a tile can have within its 128-column block, the split
    # at 128 - start selects the block each value's column lies in.
    spans = scale_blocks_spanned(tile_n)
    starts = {(j * tile_n) % 128 for j in range(128)}
    for start in starts:
        split = 128 - start
        for mine in coords:
            for i, (_, c) in enumerate(mine):
                block = (start + c) // 128
                assert block < spans
                if spans == 1:
                    assert block == 0
                else:
                    assert block == int(fmap.col8[i] >= split), (start, i, c)


def test_tile_rules():
    assert fp8_tile_problem("cooperative", 128, 192, "block") is None
    assert fp8_tile_problem("cooperative", 128, 160, "block") is None
    assert "registers" in fp8_tile_problem("cooperative", 128, 256, "block")
    assert "registers" in fp8_tile_problem("cooperative", 256, 128, "outer")
    assert "registers" in fp8_tile_problem("pingpong", 128, 128, "block")
    assert fp8_tile_problem("pingpong", 128, 96, "block") is None
    assert fp8_tile_problem("pingpong", 64, 192, "outer") is None
    # A tile straddling three scale blocks is refused for block scales only.
    assert scale_blocks_spanned(176) == 3
    assert "scale blocks" in fp8_tile_problem("pingpong", 64, 176, "block")
    assert fp8_tile_problem("pingpong", 64, 176, "outer") is None
    assert [scale_blocks_spanned(n) for n in (16, 64, 128, 144, 160, 192)] == [1, 1, 1, 2, 2, 2]
    assert "scale mode" in fp8_tile_problem("cooperative", 128, 128, "tensor")
    with pytest.raises(ValueError, match="registers"):
        _kernel("cooperative", (128, 256))
    with pytest.raises(ValueError, match="float8"):
        import cutlass

        from moe_gemm.kernels.sm90.grouped_gemm_fp8 import GroupedGemmFp8Sm90

        GroupedGemmFp8Sm90(cutlass.BFloat16, cutlass.BFloat16, "varlen", "cooperative",
                           "device", (128, 128), "block")


@pytest.mark.parametrize("schedule,tile", [("cooperative", (128, 192)), ("pingpong", (64, 128)),
                                           ("pingpong", (128, 96))])
def test_builds_fit(schedule, tile):
    kernel = _kernel(schedule, tile)
    assert kernel.tile_k == 128 and kernel.b_major == "k"
    assert 2 * tile[0] * tile[1] // (128 if schedule == "pingpong" else 256) <= 2 * FP8_MAX_ACC_REGS
    assert kernel.ab_stages >= 3  # 128 x (tile_m + tile_n) bytes per stage
    assert kernel.load_regs * 128 + kernel.math_regs * 256 <= 65536


def test_lagged_promotion_rules():
    """The lagged promotion keeps a third accumulator: block scales and tiles of at most 64
    accumulator registers per thread; the heavy register split once the three take 160."""
    assert fp8_tile_problem("cooperative", 128, 128, "block", promote_lag=True) is None
    assert fp8_tile_problem("pingpong", 64, 128, "block", promote_lag=True) is None
    assert fp8_tile_problem("pingpong", 128, 64, "block", promote_lag=True) is None
    assert "three accumulators" in fp8_tile_problem("cooperative", 128, 192, "block",
                                                    promote_lag=True)
    assert "block scales" in fp8_tile_problem("cooperative", 128, 128, "outer",
                                              promote_lag=True)
    assert fp8_register_split("cooperative", 128, 128) == REGS_DEFAULT
    assert fp8_register_split("cooperative", 128, 128, promote_lag=True) == REGS_HEAVY
    assert fp8_register_split("cooperative", 128, 64, promote_lag=True) == REGS_DEFAULT
    with pytest.raises(ValueError, match="block scales"):
        _kernel("cooperative", (128, 128), "outer", promote_lag=True)
    kernel = _kernel("cooperative", (128, 128), promote_lag=True)
    assert kernel.promote_lag and kernel.math_regs == REGS_HEAVY[1]


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="needs ptxas (CUDA toolkit)")
@pytest.mark.parametrize("lag", [False, True], ids=["plain", "lagged"])
def test_ptxas_keeps_the_wgmmas_asynchronous(tmp_path, lag):
    """The lagged loop only pays if the WGMMAs stay asynchronous while the promotion reads the
    other temporary: ptxas serializes them (info C7514) when it cannot prove which group a
    read waits for, and spills if the three accumulators do not fit. Compile for sm_90a and
    ask ptxas."""
    from moe_gemm.kernels.sm90.compile_fp8 import Fp8CompileKey, compile_fp8_variant

    key = Fp8CompileKey("varlen", "float8_e4m3fn", "bfloat16", "block", "cooperative",
                        "device", 128, 128, cluster_n=2, promote_lag=lag)
    compile_fp8_variant(key, keep_dir=str(tmp_path))
    (ptx,) = tmp_path.glob("*.ptx")
    res = subprocess.run(["ptxas", "-arch=sm_90a", "-v", "-O3", str(ptx), "-o",
                          str(tmp_path / "k.cubin")], capture_output=True, text=True, check=True)
    assert "C7514" not in res.stderr, "ptxas serialized the WGMMAs"
    assert "0 bytes spill stores" in res.stderr and "0 bytes spill loads" in res.stderr
