"""The fused MoE kernel's static facts, checked on the CPU (the CuTe DSL traces for sm_90a).

The gated epilogue (kernels/sm90/fused_epilogue.py) stores a tile of tile_n / 2 columns from
views of the accumulators that pick gate and up chunks. Both are layouts, so for every thread
of every gated tile and both gate layouts the coordinates are compared exactly: output value
(row, j) of subtile e reads the accumulator the WGMMA computed at (row, gate column of j) and
the one at (row, up column of j), and every output element is written once. Then the refusals
of the fused options and the register split of gather-A kernels.
"""

from __future__ import annotations

import os

import pytest

from moe_gemm.capability import cutlass_dsl_problem

from .test_tile_layouts import _coords, _flatten, _trace

pytestmark = pytest.mark.skipif(cutlass_dsl_problem() is not None,
                                reason=f"CuTe DSL: {cutlass_dsl_problem()}")


def _key(schedule, tile, **fused):
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from moe_gemm.kernels.sm90.compile import CompileKey

    b_major = fused.pop("b_major", "k")
    return CompileKey("varlen", "bfloat16", "bfloat16", b_major, schedule, "device", *tile,
                      **fused)


def _offsets(layout) -> list[int]:
    """Every offset of a static integer layout, in its flat (column-major) order."""
    shape = list(_flatten(layout.shape))
    stride = list(_flatten(layout.stride))
    size = 1
    for s in shape:
        size *= s
    out = []
    for i in range(size):
        off, rest = 0, i
        for s, d in zip(shape, stride):
            off += (rest % s) * d
            rest //= s
        out.append(off)
    return out


def _gate_columns(j: int, tile_n: int, gate_layout: str) -> tuple[int, int]:
    """The (gate, up) accumulator columns of output column j of a tile (the pairing the
    weight layouts define: constants.py)."""
    if gate_layout == "concat":
        return j, tile_n // 2 + j
    if gate_layout == "alternating":
        return 2 * j, 2 * j + 1
    block = 8
    gate = (j // block) * 2 * block + j % block
    return gate, gate + block


def _gated_mapping(k, gate_layout: str):
    import cutlass
    import cutlass.cute as cute

    from moe_gemm.kernels.sm90.fused_epilogue import alternating_sources, pair_views_layout

    k._setup()
    epi = k.epi
    half = epi.copy_mma(k.tiled_mma)
    tiled_copy = epi.tiled_copy(half)
    out_tile = cute.make_identity_tensor((k.tile_m, k.d_tile_n))
    acc_tile = cute.make_identity_tensor((k.tile_m, k.tile_n))
    sD = cute.make_tensor(cute.make_ptr(k.d_dtype, 0, cute.AddressSpace.smem, assumed_align=1024),
                          k.d_smem_staged.outer)
    threads = 128 if k.pingpong else 256
    layout = epi.subtile_layout()
    subtiles = [cute.local_tile(out_tile, k.epi_tile, layout.get_hier_coord(e))
                for e in range(cute.size(layout))]
    fake_acc = cute.make_tensor(cute.make_ptr(cutlass.Float32, 0, cute.AddressSpace.gmem),
                                k.tiled_mma.get_slice(0).partition_C(acc_tile).shape)
    views = epi.acc_views(fake_acc)
    m_rep = cute.size(fake_acc, mode=[1])
    acc_of = [_coords(k.tiled_mma.get_slice(t).partition_C(acc_tile)) for t in range(threads)]
    written: set = set()
    bad = 0
    if gate_layout == "alternating":
        # Each stored value is pulled from a lane of the quad (fused_epilogue._load_alternating):
        # follow the shuffle to the lane whose registers computed it.
        assert len(views) == 1
        retiled = tiled_copy.retile(views[0]).layout
        for t in range(threads):
            lane, q = t % 32, t % 4
            thr_copy = tiled_copy.get_slice(t)
            size = cute.size(cute.shape(thr_copy.partition_S(sD))[:3])
            for e, sub in enumerate(subtiles):
                sources = alternating_sources(retiled, k.tile_n, e, size)
                for v, (row, j) in enumerate(_coords(thr_copy.partition_S(sub))):
                    (g_first, g_second), p = sources[v]
                    src = t - lane + (lane - q) + (2 * q + p) % 4
                    reg = g_first if q < 2 else g_second
                    g_col, u_col = _gate_columns(j, k.tile_n, gate_layout)
                    bad += acc_of[src][reg] != (row, g_col)
                    bad += acc_of[src][reg + 1] != (row, u_col)
                    written.add((row, j))
        return bad, written, 1
    gate_view, up_view = views
    assert str(gate_view.layout) == str(up_view.layout)
    _, up_off = pair_views_layout(k.tile_n, m_rep, gate_layout)
    gate_regs = _offsets(tiled_copy.retile(gate_view).layout)
    up_regs = _offsets(tiled_copy.retile(up_view).layout)
    for t in range(threads):
        acc = acc_of[t]
        thr_copy = tiled_copy.get_slice(t)
        size = cute.size(cute.shape(thr_copy.partition_S(sD))[:3])
        assert len(gate_regs) == len(subtiles) * size == len(up_regs)
        for e, sub in enumerate(subtiles):
            for v, (row, j) in enumerate(_coords(thr_copy.partition_S(sub))):
                g_col, u_col = _gate_columns(j, k.tile_n, gate_layout)
                bad += acc[gate_regs[e * size + v]] != (row, g_col)
                bad += acc[up_regs[e * size + v] + up_off] != (row, u_col)
                written.add((row, j))
    return bad, written, up_off


GATED = [("cooperative", (128, 256)), ("cooperative", (256, 192)), ("cooperative", (128, 160)),
         ("pingpong", (128, 192)), ("pingpong", (64, 256)), ("pingpong", (128, 64))]


@pytest.mark.parametrize("gate_layout", ["concat", "interleaved", "alternating"])
@pytest.mark.parametrize("schedule,tile", GATED, ids=[f"{s}-{m}x{n}" for s, (m, n) in GATED])
def test_gated_epilogue_pairs_gate_and_up_of_each_output(schedule, tile, gate_layout):
    k = _key(schedule, tile, gate="silu", gate_layout=gate_layout).kernel()
    assert k.d_tile_n == tile[1] // 2
    bad, written, up_off = _trace(lambda: _gated_mapping(k, gate_layout))
    assert up_off > 0
    assert bad == 0, f"{bad} gated values read an accumulator of another row or column"
    assert written == {(r, c) for r in range(tile[0]) for c in range(tile[1] // 2)}


def test_fused_refusals_name_the_rule():
    with pytest.raises(ValueError, match="multiple of 32"):
        _key("pingpong", (128, 208), gate="silu", gate_layout="concat").kernel()
    with pytest.raises(ValueError, match="K-major"):
        _key("cooperative", (128, 256), gate="silu", gate_layout="concat",
             b_major="n").kernel()
    with pytest.raises(ValueError, match="unknown gate"):
        _key("cooperative", (128, 256), gate="relu", gate_layout="concat").kernel()
    with pytest.raises(ValueError, match="gate layout"):
        _key("cooperative", (128, 256), gate="silu", gate_layout="halves").kernel()
    with pytest.raises(ValueError, match="208 accumulator registers"):
        _key("cooperative", (256, 208), gather=True).kernel()
    with pytest.raises(ValueError, match="producer's 40 registers"):
        _key("pingpong", (128, 208), gather=True).kernel()
    with pytest.raises(ValueError, match="1x2 cluster"):
        _key("cooperative", (128, 256), gather=True, cluster_n=2).kernel()
    from moe_gemm.kernels.sm90.compile import CompileKey

    with pytest.raises(ValueError, match="varlen form"):
        CompileKey("batched", "bfloat16", "bfloat16", "k", "cooperative", "device", 128, 256,
                   row_scale=True).kernel()


def test_gather_register_split_and_warps():
    from moe_gemm.kernels.sm90.constants import GATHER_FIRST_WARP, GATHER_WARPS, REGS_GATHER

    k = _key("cooperative", (128, 256), gather=True).kernel()
    assert (k.load_regs, k.math_regs) == REGS_GATHER
    assert 128 * k.load_regs + 256 * k.math_regs <= 65536
    # The whole producer warpgroup gathers: warps 0 (B's TMA) and 1 (the scheduler) beside
    # their roles, 2 and 3 only that; 4 threads per 128-byte row.
    assert GATHER_WARPS == 4 and GATHER_FIRST_WARP == 2
    from moe_gemm.kernels.sm90.gather import ROWS_PER_PASS

    assert k.tile_m % ROWS_PER_PASS == 0 and ROWS_PER_PASS * 4 == GATHER_WARPS * 32
    plain = _key("cooperative", (128, 256), bias=True).kernel()
    assert (plain.load_regs, plain.math_regs) != REGS_GATHER and plain.d_tile_n == 256
    assert not k.gather_rows_in_smem and not plain.gather_rows_in_smem
    # Larger tiles: the rows' indices in shared memory, the default split, 4 bytes a row.
    from moe_gemm.kernels.sm90.constants import REGS_DEFAULT

    for tile, schedule in (((128, 192), "pingpong"), ((256, 128), "cooperative")):
        wide = _key(schedule, tile, gather=True, gate="silu", gate_layout="concat").kernel()
        assert wide.gather_rows_in_smem and (wide.load_regs, wide.math_regs) == REGS_DEFAULT
        same = _key(schedule, tile, gate="silu", gate_layout="concat").kernel()
        assert wide.ab_stages <= same.ab_stages


@pytest.mark.parametrize("tile_m", [64, 128, 192, 256])
def test_gather_threads_cover_each_row_chunk_of_a_stage_once(tile_m):
    # gather.RowGather: thread gtid copies rows r0 + i * ROWS_PER_PASS, chunks c + j *
    # THREADS_PER_ROW of each (r0 = gtid // THREADS_PER_ROW, c = gtid % THREADS_PER_ROW); every
    # (row, 16-byte chunk) of a tile_m x 128-byte stage must be copied by exactly one thread, and
    # a warp's rows must be its own (the shared-memory form's rows are written and read back
    # by the same warp, with only a warp sync between tiles).
    from moe_gemm.kernels.sm90 import gather as g
    from moe_gemm.kernels.sm90.constants import TILE_K

    assert g.GATHER_THREADS == 128 and tile_m % g.ROWS_PER_PASS == 0
    seen: dict[tuple[int, int], int] = {}
    warp_rows: dict[int, set[int]] = {}
    for gtid in range(g.GATHER_THREADS):
        r0, c = gtid // g.THREADS_PER_ROW, gtid % g.THREADS_PER_ROW
        for i in range(tile_m // g.ROWS_PER_PASS):
            row = r0 + i * g.ROWS_PER_PASS
            warp_rows.setdefault(row, set()).add(gtid // 32)
            for j in range(g.CHUNKS_PER_THREAD):
                key = (row, c + j * g.THREADS_PER_ROW)
                assert key not in seen, (key, gtid, seen.get(key))
                seen[key] = gtid
    assert set(seen) == {(r, ch) for r in range(tile_m) for ch in range(TILE_K // g.CHUNK)}
    assert all(len(w) == 1 for w in warp_rows.values())


def test_swizzle_matches_the_tma_128_byte_pattern():
    from moe_gemm.kernels.sm90.gather import swizzle_128b

    for row in range(24):
        for chunk in range(8):
            offset = row * 128 + chunk * 16
            # The TMA unit's 128-byte swizzle: 16-byte chunk index XOR (row mod 8).
            assert swizzle_128b(offset) == row * 128 + ((chunk ^ (row % 8)) * 16)
            assert swizzle_128b(offset + 4) == swizzle_128b(offset) + 4


def test_fused_compile_key_names_are_distinct():
    base = _key("cooperative", (128, 256))
    names = {base.name()}
    for fused in ({"gate": "silu", "gate_layout": "concat"},
                  {"gate": "silu", "gate_layout": "interleaved"},
                  {"gate": "clamped_swiglu", "gate_layout": "interleaved", "gate_alpha": 1.702,
                   "gate_limit": 7.0},
                  {"bias": True}, {"row_scale": True}, {"gather": True},
                  {"bias": True, "row_scale": True}):
        key = _key("cooperative", (128, 256), **fused)
        assert key.fused and key.name() not in names
        names.add(key.name())
    assert not base.fused
    # The plain kernels' names (and disk-cache entries) are unchanged.
    assert base.name() == "varlen_bfloat16_bfloat16_k_cooperative_device_128_256"


def _shared_loads(k):
    """For every thread and subtile: whether the epilogue's one load per static row / column
    offset (fused_epilogue.static_offsets) serves exactly the values of that row / column."""
    import cutlass.cute as cute

    from moe_gemm.kernels.sm90.fused_epilogue import static_offsets

    k._setup()
    epi = k.epi
    tiled_copy = epi.tiled_copy(epi.copy_mma(k.tiled_mma))
    threads = 128 if k.pingpong else 256
    layout = epi.subtile_layout()
    bad = loads = values = 0
    for t in range(threads):
        thr_copy = tiled_copy.get_slice(t)
        for e in range(cute.size(layout)):
            coords = epi.subtile_coords(thr_copy, e)
            offsets = static_offsets(coords)
            actual = _coords(coords)
            base = actual[0]
            bad += any((base[0] + r - offsets[0][0], base[1] + c - offsets[0][1]) != a
                       for (r, c), a in zip(offsets, actual))
            for axis in (0, 1):  # one load per distinct offset covers every value's row/col
                first = {}
                for off, a in zip(offsets, actual):
                    bad += first.setdefault(off[axis], a[axis]) != a[axis]
                loads += len(first)
            values += len(actual)
    return bad, loads, values


SHARED = [("pingpong", (128, 192), {}), ("pingpong", (192, 128), {}),
          ("cooperative", (256, 192), {}), ("pingpong", (128, 192),
                                            dict(gate="silu", gate_layout="interleaved"))]


@pytest.mark.parametrize("schedule,tile,fused", SHARED,
                         ids=[f"{s}-{m}x{n}{'-gated' if f else ''}" for s, (m, n), f in SHARED])
def test_bias_and_row_weight_loads_are_shared_by_static_offset(schedule, tile, fused):
    # The fused epilogue loads each bias (column) and row weight (row) once per subtile, for
    # the first value at that static offset: valid only if the offsets are the same for every
    # thread and equal offsets mean equal rows / columns.
    k = _key(schedule, tile, bias=True, row_scale=True, **fused).kernel()
    bad, loads, values = _trace(lambda: _shared_loads(k))
    assert bad == 0, f"{bad} values would take another row's or column's bias or weight"
    assert loads < values  # (the sharing saves loads: a thread holds 2 rows x 8 columns)


@pytest.mark.parametrize("schedule,tile", [("pingpong", (128, 192)), ("cooperative", (256, 192)),
                                           ("pingpong", (192, 128))])
def test_gather_with_rows_in_shared_memory_compiles_without_spills(tmp_path, schedule, tile):
    """The gather kernels past the register form's limits: the tile's row indices in shared
    memory keep the gather threads within the producer's 40 registers (ptxas -v, where the
    CUDA toolkit is on PATH; the register form spilled 40 and 148 bytes on the first two)."""
    import re
    import shutil
    import subprocess

    from moe_gemm.kernels.sm90.compile import compile_variant

    key = _key(schedule, tile, gather=True, gate="silu", gate_layout="concat", cluster_m=2)
    assert key.kernel().gather_rows_in_smem
    compile_variant(key, keep_dir=str(tmp_path))
    ptx = next(tmp_path.glob("*.ptx"))
    text = ptx.read_text()
    assert "cp.async.cg.shared.global" in text and "cp.async.mbarrier.arrive.noinc" in text
    if shutil.which("ptxas") is None:
        pytest.skip("no ptxas on PATH: compiled, spills not checked")
    res = subprocess.run(["ptxas", "-arch=sm_90a", "-v", str(ptx), "-o", "/dev/null"],
                         capture_output=True, text=True, check=True)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", res.stderr)
    assert spills and all(s == ("0", "0") for s in spills), res.stderr[-2000:]
