"""The sm90 kernel's tile family, checked on the CPU (no GPU: the CuTe DSL traces for sm_90a).

For every tile the config lists, thread by thread: the epilogue reads subtile e's values as the
flat slice [e * size, (e + 1) * size) of the accumulators retiled for its copy, and writes
them to the subtile's shared-memory staging by the copy's source partition. Both are layouts,
so their coordinates are compared exactly: every accumulator lands on the (row, col) the WGMMA
computed it for, and every element of the tile is written once. (A 256-row cooperative tile
once stored wrong results from exactly this mapping.) Then the static facts of each build:
the epilogue subtile divides the tile, the register split, the shared-memory budget.
"""

from __future__ import annotations

import os

import pytest

from moe_gemm.capability import cutlass_dsl_problem
from moe_gemm.config import COOPERATIVE_TILES, PINGPONG_TILES
from moe_gemm.kernels.sm90.constants import REGS_DEFAULT, REGS_HEAVY, acc_regs

pytestmark = pytest.mark.skipif(cutlass_dsl_problem() is not None,
                                reason=f"CuTe DSL: {cutlass_dsl_problem()}")

SMEM_BYTES = 227 * 1024  # what one sm90 CTA may use


def _flatten(x):
    if isinstance(x, tuple):
        for y in x:
            yield from _flatten(y)
    else:
        yield x


def _coords(tensor) -> list[tuple[int, int]]:
    """Every element of a coordinate tensor (a partition of an identity tensor), in its flat
    (column-major) order, evaluated from its static layout."""
    base = tuple(tensor.iterator)
    shape = list(_flatten(tensor.layout.shape))
    stride = list(_flatten(tensor.layout.stride))
    size = 1
    for s in shape:
        size *= s
    out = []
    for i in range(size):
        crd = list(base)
        rest = i
        for s, d in zip(shape, stride):
            idx, rest = rest % s, rest // s
            if isinstance(d, int):
                assert d == 0, f"unexpected integer stride {d} in a coordinate layout"
                continue
            mode = d.mode
            mode = mode[0] if isinstance(mode, (list, tuple)) else mode
            crd[mode] += idx * d.value
        out.append(tuple(crd))
    return out


def _kernel(schedule, tile, d_dtype="bfloat16", b_major="n"):
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from moe_gemm.kernels.sm90.compile import CompileKey

    return CompileKey("varlen", "bfloat16", d_dtype, b_major, schedule, "device", *tile).kernel()


def _trace(fn):
    """Run fn inside a DSL trace (layouts need an MLIR context); returns its result."""
    import cutlass.cute as cute

    box = {}

    @cute.jit
    def probe():
        box["result"] = fn()

    cute.compile(probe)
    return box["result"]


def _epilogue_mapping(k) -> tuple[int, set]:
    import cutlass.cute as cute

    k._setup()
    tiled_copy = k.epi.tiled_copy(k.tiled_mma)
    tile = cute.make_identity_tensor((k.tile_m, k.tile_n))
    sD = cute.make_tensor(cute.make_ptr(k.d_dtype, 0, cute.AddressSpace.smem, assumed_align=1024),
                          k.d_smem_staged.outer)
    threads = 128 if k.pingpong else 256
    layout = k.epi.subtile_layout()
    subtiles = [cute.local_tile(tile, k.epi_tile, layout.get_hier_coord(e))
                for e in range(cute.size(layout))]
    written: set = set()
    bad = 0
    for t in range(threads):
        acc = _coords(tiled_copy.retile(k.tiled_mma.get_slice(t).partition_C(tile)))
        thr_copy = tiled_copy.get_slice(t)
        size = cute.size(cute.shape(thr_copy.partition_S(sD))[:3])
        assert len(acc) == len(subtiles) * size, (t, len(acc), len(subtiles), size)
        for e, sub_tile in enumerate(subtiles):
            sub = _coords(thr_copy.partition_S(sub_tile))
            if t in (0, threads - 1):  # the hook's coordinates are these
                assert _coords(k.epi.subtile_coords(thr_copy, e)) == sub
            assert len(sub) == size
            bad += sum(a != b for a, b in zip(acc[e * size:(e + 1) * size], sub))
            written.update(sub)
    return bad, written


TILES = [("pingpong", t) for t in PINGPONG_TILES] + [("cooperative", t) for t in COOPERATIVE_TILES]
# The mapping check costs ~1-3 s per tile on the CPU: the tiles added with the 192- and 256-row
# and non-64-multiple family, plus two long-proven ones (GPU-tested since the first kernel) that
# anchor the check itself.
MAPPED = [(s, t) for s, t in TILES if t[0] in (192, 256) or t[1] % 64 or t == (64, 192)] + [
    ("pingpong", (128, 192)), ("cooperative", (128, 256))]


@pytest.mark.parametrize("schedule,tile", MAPPED, ids=[f"{s}-{m}x{n}" for s, (m, n) in MAPPED])
def test_epilogue_reads_each_accumulator_where_the_mma_computed_it(schedule, tile):
    k = _kernel(schedule, tile)
    bad, written = _trace(lambda: _epilogue_mapping(k))
    assert bad == 0, f"{bad} accumulators staged at the wrong (row, col)"
    # Ping-pong: one warpgroup's 128 threads hold its whole tile; cooperative: 256 threads.
    assert written == {(r, c) for r in range(tile[0]) for c in range(tile[1])}


@pytest.mark.parametrize("schedule,tile", [("cooperative", (256, 208)),
                                           ("pingpong", (128, 208)), ("cooperative", (128, 160))])
def test_epilogue_mapping_with_fp32_output(schedule, tile):
    k = _kernel(schedule, tile, d_dtype="float32")
    bad, written = _trace(lambda: _epilogue_mapping(k))
    assert bad == 0 and len(written) == tile[0] * tile[1]


def _smem_bytes(k) -> int:
    import cutlass.cute as cute

    k._setup()
    ab = (cute.cosize(k.a_smem_staged) + cute.cosize(k.b_smem_staged)) * k.ab_dtype.width // 8
    d = cute.cosize(k.d_smem_staged) * k.d_dtype.width // 8
    return 1024 + ab + d  # barriers and the scheduler ring fit in the first 1 KiB block


@pytest.mark.parametrize("schedule,tile", TILES, ids=[f"{s}-{m}x{n}" for s, (m, n) in TILES])
@pytest.mark.parametrize("d_dtype", ["bfloat16", "float32"])
def test_static_facts_of_each_tile(schedule, tile, d_dtype):
    # An N-major B (the layout MoE weights (E, K, N) have): 64- or 32-byte swizzle atoms where
    # tile_n is not a multiple of 64 (K-major B always uses 128-byte rows of K).
    k = _kernel(schedule, tile, d_dtype, "n")
    m, n = tile
    assert n % k.epi_tile[1] == 0 and m % k.epi_tile[0] == 0
    assert k.epi_tile[1] in (16, 32)
    heavy = acc_regs(schedule, m, n) >= 208
    assert (k.load_regs, k.math_regs) == (REGS_HEAVY if heavy else REGS_DEFAULT)
    assert 128 * k.load_regs + 256 * k.math_regs <= 65536
    assert k.load_regs % 8 == 0 and k.math_regs % 8 == 0
    assert k.ab_stages >= 3 if (m + n) * 128 <= 60 * 1024 else k.ab_stages >= 2
    used = _trace(lambda: _smem_bytes(k))
    # Staged layouts hold exactly the tiles (the swizzle atoms divide them: no padding).
    assert used == 1024 + ((m + n) * 64 * 2 * k.ab_stages
                           + k.epi_tile[0] * k.epi_tile[1] * (4 if d_dtype == "float32" else 2)
                           * k.epi_stages * k.num_epi_groups)
    assert used <= SMEM_BYTES


def test_refusals_are_value_errors_before_tracing():
    with pytest.raises(ValueError, match="accumulator registers"):
        _kernel("pingpong", (128, 256))
    with pytest.raises(ValueError, match="accumulator registers"):
        _kernel("cooperative", (256, 256))
    with pytest.raises(ValueError, match="multiple of 16"):
        _kernel("cooperative", (128, 200))
    with pytest.raises(ValueError, match="128 or 256 rows"):
        _kernel("cooperative", (64, 128))
    from moe_gemm.kernels.sm90.compile import CompileKey

    with pytest.raises(ValueError, match="do not fit in shared memory; at most 3"):
        CompileKey("varlen", "bfloat16", "bfloat16", "n", "cooperative", "device", 256, 208,
                   stages=4).kernel()
    with pytest.raises(ValueError, match="whole-tile epilogue"):
        CompileKey("varlen", "bfloat16", "bfloat16", "n", "cooperative", "device", 256, 128,
                   epi_whole=True).kernel()


@pytest.mark.parametrize("schedule,tile", TILES, ids=[f"{s}-{m}x{n}" for s, (m, n) in TILES])
def test_host_side_stage_limit_is_the_kernels(schedule, tile):
    # The tuner asks constants.ab_stage_limit which pinned stage counts build; the kernel must
    # accept exactly those (one more is refused with the limit in the message).
    from moe_gemm.kernels.sm90.compile import CompileKey
    from moe_gemm.kernels.sm90.constants import TILE_K, ab_stage_limit, epilogue_staging

    wholes = [False, True] if schedule == "cooperative" and tile[0] == 128 else [False]
    for d_dtype, d_bits in (("bfloat16", 16), ("float32", 32)):
        for whole in wholes:
            if whole and d_bits != 16:
                continue
            key = CompileKey("varlen", "bfloat16", d_dtype, "k", schedule, "device", *tile,
                             epi_whole=whole)
            k = key.kernel()
            subtile, buffers, groups = epilogue_staging(schedule, tile[1], 32, whole)
            limit, buffers = ab_stage_limit(*tile, TILE_K, 16, d_bits, subtile, buffers,
                                            groups, whole)
            assert (k.ab_stages, k.epi_tile, k.epi_stages, k.num_epi_groups) == (
                limit, subtile, buffers, groups), (d_dtype, whole)
            # One stage deeper than the default staging holds: built with fewer staging
            # buffers (at least 2) where that makes room, else refused with the true limit.
            deeper, fewer = ab_stage_limit(*tile, TILE_K, 16, d_bits, subtile, buffers,
                                           groups, whole, want=limit + 1)
            deepest, _ = ab_stage_limit(*tile, TILE_K, 16, d_bits, subtile, buffers, groups,
                                        whole, want=99)
            if deeper > limit:
                assert 2 <= fewer < buffers and not whole
                deep = CompileKey("varlen", "bfloat16", d_dtype, "k", schedule, "device", *tile,
                                  stages=limit + 1).kernel()
                assert (deep.ab_stages, deep.epi_stages) == (limit + 1, fewer), (d_dtype, whole)
            else:
                assert deepest == limit
            with pytest.raises(ValueError, match=f"at most {deepest}"):
                CompileKey("varlen", "bfloat16", d_dtype, "k", schedule, "device", *tile,
                           stages=deepest + 1, epi_whole=whole).kernel()


def test_a_fifth_stage_shrinks_the_staging_only_where_it_must():
    # bf16 A/B and D, tile_k 64: cooperative 128x192 and ping-pong 128x208 hold four stages
    # beside the default staging (4 x 128x32 shared; 4 x 64x16 per ping-pong warpgroup) and
    # five beside three buffers (a sixth fits nowhere: the deepest, 2 buffers, still holds
    # five); ping-pong 128x192 holds five with its default staging, and cooperative 128x256
    # (48 KiB a stage) holds four either way.
    from moe_gemm.kernels.sm90.constants import TILE_K, ab_stage_limit, epilogue_staging

    def limits(schedule, tile, want=5):
        sub, bufs, groups = epilogue_staging(schedule, tile[1], 32, False)
        default = ab_stage_limit(*tile, TILE_K, 16, 16, sub, bufs, groups, False)
        deep = ab_stage_limit(*tile, TILE_K, 16, 16, sub, bufs, groups, False, want=want)
        return default, deep

    assert limits("cooperative", (128, 192)) == ((4, 4), (5, 3))
    assert limits("pingpong", (128, 208)) == ((4, 4), (5, 3))
    assert limits("cooperative", (128, 192), want=6) == ((4, 4), (5, 2))
    assert limits("pingpong", (128, 192)) == ((5, 2), (5, 2))
    assert limits("cooperative", (128, 256)) == ((4, 4), (4, 4))
    # The whole-tile epilogue keeps a buffer per subtile: never shrunk for depth.
    sub, bufs, groups = epilogue_staging("cooperative", 192, 32, True)
    whole = ab_stage_limit(128, 192, TILE_K, 16, 16, sub, bufs, groups, True, want=5)
    assert whole == ab_stage_limit(128, 192, TILE_K, 16, 16, sub, bufs, groups, True)
