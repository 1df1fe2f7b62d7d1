"""Empty row blocks skipped (GroupedGemmSm90 skip_blocks): a tile's WGMMAs leave out its m64
row blocks that hold none of its problem's rows. Every block count a warpgroup can have
(ping-pong tiles of 64, 128 and 192 rows; cooperative 128- and 256-row tiles, whose two
warpgroups interleave their blocks), tails on both sides of each 64-row line, empty experts,
a 2x1 cluster's rank past its expert's end, a 1x2 cluster, with and without trimmed A loads,
the fused gated epilogue, and the general, batched and masked forms: the result equals the
whole tile's bit for bit and the fp32 reference within bf16 accuracy, and rows past the
problems keep `out`'s values."""

from __future__ import annotations

import pytest
import torch

import moe_gemm
from moe_gemm import GemmConfig
from moe_gemm.ops.fused_reference import fused_grouped_mm_ref
from moe_gemm.ops.heuristics import SKIP_BLOCKS_ENV, TRIM_A_ENV
from moe_gemm.ops.launch_info import last_launch

from .helpers import check, rand, varlen_low

pytestmark = pytest.mark.gpu

# (schedule, tile, cluster, trim): every row block count per warpgroup (1, 2, 3), both
# clusters, whole A boxes and trimmed ones.
CONFIGS = [("pingpong", (64, 256), (2, 1), True), ("pingpong", (128, 128), (1, 2), True),
           ("pingpong", (128, 192), (1, 1), False), ("pingpong", (192, 128), (1, 1), False),
           ("cooperative", (128, 256), (1, 1), True), ("cooperative", (256, 128), (2, 1), False),
           ("cooperative", (128, 192), (1, 2), True), ("cooperative", (256, 192), (1, 1), True)]


def skip_counts(tile_m: int) -> list[int]:
    """Expert row counts whose last tiles end on both sides of every 64-row line of a tile
    (and inside a cooperative tile's second warpgroup's first block), empty experts between."""
    tails = sorted({t for b in range(0, tile_m, 64) for t in (b + 1, b + 37, b + 63, b + 64,
                                                              b + 65) if 0 < t < tile_m})
    counts = []
    for i, t in enumerate(tails):
        counts.append(t + (i % 2) * tile_m)  # a tail alone, or after a whole tile
        if i % 3 == 0:
            counts.append(0)
    return counts + [tile_m]


def _both_ways(monkeypatch, run, *, trim: bool | None = None):
    """{'0': out, '1': out} of run(out) with the switch off and on (the launch asserted)."""
    if trim is not None:
        monkeypatch.setenv(TRIM_A_ENV, "1" if trim else "0")
    outs = {}
    for value in ("0", "1"):
        monkeypatch.setenv(SKIP_BLOCKS_ENV, value)
        outs[value] = run()
        assert last_launch().choice.skip_blocks == (value == "1")
    torch.cuda.synchronize()
    return outs


@pytest.mark.parametrize("schedule,tile,cluster,trim", CONFIGS,
                         ids=[f"{s[:4]}{t[0]}x{t[1]}c{c[0]}x{c[1]}{'t' if tr else ''}"
                              for s, t, c, tr in CONFIGS])
@pytest.mark.parametrize("K", [64, 1000])
def test_varlen_skip_equals_whole_tile(monkeypatch, schedule, tile, cluster, trim, K):
    counts = skip_counts(tile[0])
    E, N, tail = len(counts), 264, 29
    T = sum(counts) + tail
    offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).cuda()
    g = torch.Generator(device="cuda").manual_seed(31 + K)
    x = rand((T, K), torch.bfloat16, g)
    w = rand((E, N, K), torch.bfloat16, g).transpose(1, 2)
    cfg = GemmConfig(backend="cute", schedule=schedule, tile_m=tile[0], tile_n=tile[1],
                     cluster_m=cluster[0], cluster_n=cluster[1])

    def run():
        out = torch.full((T, N), 7.0, dtype=torch.bfloat16, device="cuda")
        moe_gemm.grouped_mm(x, w, offs, out=out, config=cfg)
        return out

    outs = _both_ways(monkeypatch, run, trim=trim)
    assert torch.equal(outs["0"], outs["1"]), "skipping empty row blocks changed the result"
    y = outs["1"]
    assert bool((y[T - tail:] == 7.0).all()), "rows past offs[-1] were written"
    rows = T - tail
    ref = moe_gemm.ops.reference.grouped_mm_ref(x[:rows], w, offs)
    check(f"skip-blocks/{schedule}/{tile[0]}x{tile[1]}/K={K}", y[:rows], ref,
          varlen_low(x, w, counts), E=E, T=T, N=N, K=K)


@pytest.mark.parametrize("schedule,tile", [("pingpong", (128, 128)),
                                           ("cooperative", (256, 128))])
def test_general_and_batched_skip(monkeypatch, schedule, tile):
    """grouped_gemm's problems and grouped_mm's batched form end in partial tiles too."""
    g = torch.Generator(device="cuda").manual_seed(5)
    cfg = GemmConfig(backend="cute", schedule=schedule, tile_m=tile[0], tile_n=tile[1])
    ms = [1, 63, 65, 129, 200, 0, 255]
    a = [rand((m, 136), torch.bfloat16, g) for m in ms]
    b = [rand((136, 200), torch.bfloat16, g) for _ in ms]
    outs = _both_ways(monkeypatch, lambda: moe_gemm.grouped_gemm(a, b, config=cfg))
    for i, (y0, y1) in enumerate(zip(outs["0"], outs["1"])):
        assert torch.equal(y0, y1), f"general problem {i}: skipping changed the result"
        ref = a[i].double() @ b[i].double()
        check(f"skip-blocks/general/{schedule}/{i}", y1, ref.float(), a[i] @ b[i])
    xb = rand((5, 97, 136), torch.bfloat16, g)
    wb = rand((5, 136, 264), torch.bfloat16, g)
    outs = _both_ways(monkeypatch, lambda: moe_gemm.grouped_mm(xb, wb, config=cfg))
    assert torch.equal(outs["0"], outs["1"]), "batched: skipping changed the result"
    check(f"skip-blocks/batched/{schedule}", outs["1"], (xb.double() @ wb.double()).float(),
          torch.bmm(xb, wb))


def test_masked_and_fused_skip(monkeypatch):
    """The masked form (row counts on the GPU) and the fused gated kernel (gather-A, row
    weights): same bits with the skip as without."""
    g = torch.Generator(device="cuda").manual_seed(9)
    G, M, N, K = 6, 300, 264, 200
    xm = rand((G, M, K), torch.bfloat16, g)
    wm = rand((G, K, N), torch.bfloat16, g)
    counts = torch.tensor([0, 1, 64, 65, 191, 300], dtype=torch.int32, device="cuda")
    cfg = GemmConfig(backend="cute", schedule="pingpong", tile_m=128, tile_n=128)

    def masked():
        out = torch.full((G, M, N), 3.0, dtype=torch.bfloat16, device="cuda")
        return moe_gemm.grouped_mm_masked(xm, wm, counts, out=out, config=cfg)

    outs = _both_ways(monkeypatch, masked)
    assert torch.equal(outs["0"], outs["1"]), "masked: skipping changed the result"
    for p, c in enumerate(counts.tolist()):
        y = outs["1"][p]
        assert bool((y[c:] == 3.0).all()), f"masked problem {p}: rows past its count written"
        check(f"skip-blocks/masked/{p}", y[:c], (xm[p, :c].double() @ wm[p].double()).float(),
              xm[p, :c] @ wm[p])

    T, E, N2 = 700, 8, 512
    x = rand((T, K), torch.bfloat16, g)
    w = rand((E, N2, K), torch.bfloat16, g).transpose(1, 2)
    row_counts = [0, 65, 1, 130, 63, 200, 192, 129]
    S = sum(row_counts)
    offs = torch.tensor(row_counts).cumsum(0).to(torch.int32).cuda()
    row_index = torch.randint(0, T, (S,), generator=g, device="cuda")
    row_weight = torch.rand(S, generator=g, device="cuda")
    fcfg = GemmConfig(backend="cute", schedule="cooperative", tile_m=128, tile_n=256)

    def fused():
        return moe_gemm.fused_grouped_mm(x, w, offs, row_index=row_index, gate="silu",
                                         row_weight=row_weight, config=fcfg)

    outs = _both_ways(monkeypatch, fused)
    assert torch.equal(outs["0"], outs["1"]), "fused: skipping changed the result"

    kw = {"row_index": row_index, "gate": "silu", "row_weight": row_weight}
    ref = fused_grouped_mm_ref(x, w, offs, dtype=torch.float32, **kw)
    low = fused_grouped_mm_ref(x, w, offs, dtype=torch.bfloat16, **kw)
    check("skip-blocks/fused-silu", outs["1"], ref, low)
