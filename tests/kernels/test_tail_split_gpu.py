"""GPU tests of the tail split (cooperative, K >= 4096 by default; kernels/sm90/constants.py):
a last wave of at most half the grid runs as shares of K on several CTAs joined through fp32
workspace slots and a counter that each finisher resets."""

from __future__ import annotations

import pytest
import torch

import moe_gemm
from moe_gemm import GemmConfig
from moe_gemm.ops import schedule as sched
from moe_gemm.ops.validation import check_grouped_mm

from .gpu_report import record
from .helpers import (
    DTYPES,
    TS_K,
    TS_N,
    check,
    check_mm,
    num_sms,
    rand,
    run_batched,
    tail_split_counts,
)

pytestmark = pytest.mark.gpu

# The rules' own choice for these shapes without a tuned table (cooperative 128x256, split on
# long K), pinned: a GPU's table or swap window may pick other tiles for them (an H100's
# launched swapped ones), which these tests do not mean to split.
M_SIDE = GemmConfig(backend="cute", schedule="cooperative", tile_m=128, tile_n=256)


@pytest.mark.parametrize("dtype,out_dtype,w_layout,out_mode", [
    ("bf16", None, "nk_view", "given"),
    ("bf16", None, "kn", "alloc"),
    ("fp16", None, "nk_view", "alloc"),
    ("bf16", torch.float32, "nk_view", "alloc"),
])
def test_tail_split_rows(dtype, out_dtype, w_layout, out_mode):
    from moe_gemm.ops.launch_info import last_launch

    K, zero_tail = TS_K, 50
    # The kernel zeroes rows past offs[-1] only in the output it allocates.
    counts = tail_split_counts(num_sms(), 1 if out_mode == "alloc" else 0)
    E, T = len(counts), sum(counts) + zero_tail
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).cuda()
    g = torch.Generator(device="cuda").manual_seed(31)
    dt = DTYPES[dtype]
    x = rand((T, K), dt, g)
    w = (rand((E, TS_N, K), dt, g).transpose(1, 2) if w_layout == "nk_view"
         else rand((E, K, TS_N), dt, g))
    odt = out_dtype or dt
    out = None
    if out_mode == "given":
        out = torch.full((T, TS_N), float("nan"), dtype=odt, device="cuda")
        out[T - zero_tail:] = 7.0  # rows past offs[-1] must stay untouched
    y = moe_gemm.grouped_mm(x, w, offs, out=out, out_dtype=out_dtype, config=M_SIDE)
    torch.cuda.synchronize()
    info = last_launch()
    assert info.choice.tail_split and info.choice.schedule == "cooperative"
    ref = moe_gemm.ops.reference.grouped_mm_ref(x, w, offs)
    low = torch.zeros((T, TS_N), dtype=odt, device="cuda")
    start = 0
    for e, c in enumerate(counts):
        if c:
            low[start:start + c] = (x[start:start + c] @ w[e]).to(odt)
        start += c
    name = f"tail-split/{dtype}/{out_dtype}/{w_layout}/{out_mode}"
    if out_mode == "given":
        untouched = bool((y[T - zero_tail:] == 7.0).all())
        record(f"{name}/tail-untouched", untouched)
        assert untouched
        check(name, y[:T - zero_tail], ref[:T - zero_tail], low[:T - zero_tail], T=T, K=K)
    else:
        zeros = bool((y[T - zero_tail:] == 0).all())
        record(f"{name}/zero-tail", zeros)
        assert zeros
        check(name, y, ref, low, T=T, K=K)
    # The same call again (an allocated out adds the zero tail's tiles: another split).
    again = moe_gemm.grouped_mm(x, w, offs, out=None if out is None else torch.full_like(out, 3.0),
                                out_dtype=out_dtype, config=M_SIDE)
    same = torch.equal(again[:T - zero_tail], y[:T - zero_tail])
    record(f"{name}/run-to-run-bitwise", same)
    assert same


@pytest.mark.parametrize("extra_rows", [0, 40 * 128])
def test_tail_split_visits(extra_rows):
    """The trace (tiles stored per CTA) is schedule.tail_split_assignment: split tiles are
    stored by their finisher CTA; with a last wave over half the grid, plain round robin."""
    from moe_gemm.ops.launch_info import last_launch, trace_assignment
    from moe_gemm.ops.mm_launch import grouped_mm_cute

    K = TS_K
    nsm = num_sms()
    counts = tail_split_counts(nsm, 0)
    counts[4] += extra_rows
    while extra_rows and sched.tail_split_units(
            sum(-(-c // 128) for c in counts) * 8, nsm, K // 64) is not None:
        counts[4] += 128  # make the last wave more than half full
    T = sum(counts)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).cuda()
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(len(counts), K, TS_N, device="cuda", dtype=torch.bfloat16)
    grouped_mm_cute(check_grouped_mm(x, w, offs, None, None), M_SIDE,
                    trace=True)
    torch.cuda.synchronize()
    info = last_launch()
    assert info.choice.tail_split
    got = trace_assignment(info)
    ch = info.choice
    tiles = [-(-r // ch.tile_m) * (TS_N // ch.tile_n) for r in counts]
    owners = sched.tail_split_assignment(tiles, [K // 64] * len(counts), info.num_ctas).per_cta
    want = [[(p, *sched.tile_coord(local, -(-counts[p] // ch.tile_m), TS_N // ch.tile_n,
                                   ch.swizzle)) for p, local in cta] for cta in owners]
    ok = got == want
    split = sched.tail_split_units(sum(tiles), info.num_ctas, K // 64) is not None
    assert split == (not extra_rows)
    record(f"tail-split/visits/split={split}", ok)
    assert ok, "kernel tile visits differ from moe_gemm.schedule.tail_split_assignment"


def test_tail_split_replays_reset_counters():
    """Every finisher resets its counter: eager launches and CUDA-graph replays on new data
    stay right, and the counters read zero afterwards."""
    from moe_gemm.kernels.sm90.constants import split_workspace_bytes
    from moe_gemm.ops import launch_info, launch_resources

    K = TS_K
    counts = tail_split_counts(num_sms(), 0)
    T, E = sum(counts), len(counts)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).cuda()
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, TS_N, K, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    for trial in range(3):
        x.copy_(torch.randn(T, K, device="cuda", dtype=torch.bfloat16))
        y = moe_gemm.grouped_mm(x, w, offs, config=M_SIDE)
        torch.cuda.synchronize()
        check_mm(f"tail-split/eager{trial}", y, x, w, offs)
    info = launch_info.last_launch()
    assert info.choice.tail_split
    counters, _, total = split_workspace_bytes(info.num_ctas, info.choice.tile_m,
                                               info.choice.tile_n)
    spaces = [ws for key, ws in launch_resources._workspaces.items()
              if key[-1] and key[-2] == -(-total // 8)]
    assert spaces, "no tail-split workspace cached"
    for ws in spaces:
        raw = ws.view(torch.int32)[counters // 4:counters // 4 + info.num_ctas]
        zero = bool((raw == 0).all())
        record("tail-split/counters-zero-after-eager", zero)
        assert zero
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        yg = moe_gemm.grouped_mm(x, w, offs, config=M_SIDE)
    for trial in range(3):
        x.copy_(torch.randn(T, K, device="cuda", dtype=torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        check_mm(f"tail-split/graph-replay{trial}", yg, x, w, offs)
        eager = moe_gemm.grouped_mm(x, w, offs, config=M_SIDE)
        same = torch.equal(eager, yg)
        record(f"tail-split/graph-replay{trial}/eager-bitwise", same)
        assert same


def test_tail_split_switch_applies_to_next_call(monkeypatch):
    """MOE_GEMM_TAIL_SPLIT=0 takes effect on the next call of a shape already planned, and
    unset again brings the split back; results stay right either way."""
    from moe_gemm.ops.launch_info import last_launch

    counts = tail_split_counts(num_sms(), 0)
    T, E, K = sum(counts), len(counts), TS_K
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).cuda()
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, K, TS_N, device="cuda", dtype=torch.bfloat16)
    monkeypatch.delenv("MOE_GEMM_TAIL_SPLIT", raising=False)
    for value, want in ((None, True), ("0", False), (None, True)):
        if value is None:
            monkeypatch.delenv("MOE_GEMM_TAIL_SPLIT", raising=False)
        else:
            monkeypatch.setenv("MOE_GEMM_TAIL_SPLIT", value)
        y = moe_gemm.grouped_mm(x, w, offs, config=M_SIDE)
        torch.cuda.synchronize()
        got = last_launch().choice.tail_split
        record(f"tail-split/switch={value}/applied", got == want)
        assert got == want
        check_mm(f"tail-split/switch={value}", y, x, w, offs)


TAIL_SPLIT_BMM_SHAPES = [(37, 200, 512), (67, 1, 512), (70, 64, 264)]


@pytest.mark.parametrize("G,M,N", TAIL_SPLIT_BMM_SHAPES)
def test_tail_split_bmm(G, M, N, monkeypatch):
    """The 3-D form with the tail split forced (not a default choice there)."""
    import dataclasses

    from moe_gemm.ops import launch_info, mm_launch

    orig = mm_launch.choose_batched
    monkeypatch.setattr(mm_launch, "choose_batched", lambda *a, **k: dataclasses.replace(
        orig(*a, **k), tail_split=True, cluster_m=1, cluster_n=1))
    cfg = GemmConfig(backend="cute", schedule="cooperative")
    run_batched(f"tail-split/bmm/{G}x{M}x{N}", G, M, N, TS_K, config=cfg, out_mode="given")
    info = launch_info.last_launch()
    assert info.choice.tail_split


# A launch of few tiles on long K: 4 experts (one of 1 row, one empty) of 128x256 tiles make
# 10 tiles on the 132 SMs, so each is split over up to SPLIT_WAYS CTAs.
WAYS_COUNTS = [1, 130, 200, 0]
WAYS_N, WAYS_K = 512, 8192


@pytest.mark.parametrize("max_ways", [None, "2", "3", "16"])
def test_tail_split_ways(max_ways, monkeypatch):
    """A tail tile split over several CTAs (MOE_GEMM_SPLIT_WAYS caps how many): the result
    within the 2x rule, the stores where schedule.tail_split_assignment puts them, run-to-run
    bitwise (the finisher adds the partials in share order), the counters back at zero."""
    from moe_gemm.kernels.sm90.constants import SPLIT_WAYS, split_workspace_bytes
    from moe_gemm.ops import launch_resources
    from moe_gemm.ops.launch_info import last_launch, trace_assignment
    from moe_gemm.ops.mm_launch import grouped_mm_cute

    if max_ways is None:
        monkeypatch.delenv("MOE_GEMM_SPLIT_WAYS", raising=False)
    else:
        monkeypatch.setenv("MOE_GEMM_SPLIT_WAYS", max_ways)
    counts, N, K = WAYS_COUNTS, WAYS_N, WAYS_K
    T, E = sum(counts), len(counts)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).cuda()
    g = torch.Generator(device="cuda").manual_seed(7)
    x = rand((T, K), torch.bfloat16, g)
    w = rand((E, K, N), torch.bfloat16, g)
    cfg = GemmConfig(backend="cute", schedule="cooperative", tile_m=128, tile_n=256,
                     cluster_m=1, cluster_n=1, tail_split=True)
    name = f"tail-split/ways={max_ways}"
    y = moe_gemm.grouped_mm(x, w, offs, config=cfg)
    torch.cuda.synchronize()
    info = last_launch()
    cap = SPLIT_WAYS if max_ways is None else int(max_ways)
    assert info.choice.tail_split and info.choice.split_ways == cap
    tiles = [-(-r // 128) * (N // 256) for r in counts]
    split = sched.tail_split_units(sum(tiles), info.num_ctas, K // 64, cap)
    assert split is not None and split[2] == min(cap, info.num_ctas // sum(tiles), K // 64 // 16)
    check_mm(name, y, x, w, offs)
    again = moe_gemm.grouped_mm(x, w, offs, config=cfg)
    same = torch.equal(again, y)
    record(f"{name}/run-to-run-bitwise", same)
    assert same
    counters, _, total = split_workspace_bytes(info.num_ctas, 128, 256)
    spaces = [ws for key, ws in launch_resources._workspaces.items()
              if key[-1] and key[-2] == -(-total // 8)]
    assert spaces, "no tail-split workspace cached"
    zero = all(bool((ws.view(torch.int32)[counters // 4:counters // 4 + 256] == 0).all())
               for ws in spaces)
    record(f"{name}/counters-zero", zero)
    assert zero
    # The trace: every tile stored once, by the CTA the schedule names.
    grouped_mm_cute(check_grouped_mm(x, w, offs, None, None), cfg, trace=True)
    torch.cuda.synchronize()
    info = last_launch()
    owners = sched.tail_split_assignment(tiles, [K // 64] * E, info.num_ctas, cap).per_cta
    want = [[(p, *sched.tile_coord(local, -(-counts[p] // 128), N // 256, info.choice.swizzle))
             for p, local in cta] for cta in owners]
    ok = trace_assignment(info) == want
    record(f"{name}/visits", ok)
    assert ok, "kernel tile visits differ from moe_gemm.schedule.tail_split_assignment"


def test_tail_split_ways_bmm():
    """The 3-D form: 2 problems of 128x512 on K = 16384 (4 tiles, 8 ways each)."""
    from moe_gemm.ops import launch_info

    cfg = GemmConfig(backend="cute", schedule="cooperative", tile_m=128, tile_n=256,
                     cluster_m=1, cluster_n=1, tail_split=True)
    run_batched("tail-split/ways/bmm-2x128x512x16384", 2, 128, 512, 16384, config=cfg)
    info = launch_info.last_launch()
    assert info.choice.tail_split and info.choice.split_ways >= 8


# grouped_gemm's lists: the deepest problem sizes the launch's split and each tail tile takes
# its own shares of its own K (fewer where it is shallower; none under 1024 of K). Few
# problems of long, different K (the rules' default: 128x128 split), and a mix with an empty
# problem, a K = 0 one, K off the k-tile, a tile of 24 k-tiles (two shares) and one of short K.
LIST_CASES = {
    "long-k": ((256, 1024, 16384), (128, 1024, 16384), (384, 1024, 8192), (64, 2048, 16384)),
    "mixed-k": ((300, 512, 16384), (0, 512, 8192), (200, 256, 0), (129, 384, 1496),
                (64, 512, 696), (1, 128, 9000), (257, 256, 4104)),
}


def _list_operands(sizes, dtype, b_layout, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    a = [rand((m, k), dtype, gen) for m, n, k in sizes]
    if b_layout == "col":
        b = [rand((n, k), dtype, gen).t() for m, n, k in sizes]
    else:
        b = [rand((k, n), dtype, gen) for m, n, k in sizes]
    return a, b


@pytest.mark.parametrize("case,sort_by_k,dtype,out_dtype,b_layout", [
    ("long-k", None, torch.bfloat16, None, "row"),
    ("long-k", True, torch.float16, torch.float32, "col"),
    ("mixed-k", False, torch.bfloat16, None, "col"),
    ("mixed-k", True, torch.bfloat16, torch.float32, "row"),
])
def test_tail_split_lists(case, sort_by_k, dtype, out_dtype, b_layout):
    """grouped_gemm with the tail split: every output within the 2x rule (NaN-poisoned outs
    fully written), run-to-run bitwise, and the stores where schedule.tail_split_assignment
    puts them (per-problem k-tiles, K-sort undone)."""
    from moe_gemm.ops.general_launch import grouped_gemm_cute
    from moe_gemm.ops.launch_info import last_launch, trace_assignment
    from moe_gemm.ops.validation import check_grouped_gemm

    sizes = LIST_CASES[case]
    if case == "long-k":
        cfg = GemmConfig(backend="cute", sort_by_k=sort_by_k)  # the rules' own choice
    else:
        cfg = GemmConfig(backend="cute", schedule="cooperative", tile_m=128, tile_n=128,
                         cluster_m=1, cluster_n=1, tail_split=True, sort_by_k=sort_by_k)
    a, b = _list_operands(sizes, dtype, b_layout, 29)
    odt = out_dtype or dtype
    name = f"tail-split/lists/{case}/sort={sort_by_k}/{dtype}/{out_dtype}/{b_layout}"
    out = [torch.full((m, n), float("nan"), dtype=odt, device="cuda") for m, n, k in sizes]
    res = moe_gemm.grouped_gemm(a, b, out=out, config=cfg)
    torch.cuda.synchronize()
    info = last_launch()
    assert info.choice.tail_split and info.choice.schedule == "cooperative"
    for i, (ai, bi) in enumerate(zip(a, b)):
        ref = ai.float() @ bi.float()
        low = (ai @ bi).to(odt) if ai.shape[1] else torch.zeros_like(ref).to(odt)
        check(f"{name}[{i}]", res[i], ref, low, size=sizes[i])
    again = moe_gemm.grouped_gemm(a, b, config=cfg, out_dtype=out_dtype)
    same = all(torch.equal(x, y) for x, y in zip(again, res))
    record(f"{name}/run-to-run-bitwise", same)
    assert same
    grouped_gemm_cute(check_grouped_gemm(a, b, None, out_dtype), cfg, trace=True)
    torch.cuda.synchronize()
    info = last_launch()
    ch = info.choice
    order = list(info.order)
    ordered = [sizes[i] for i in order]
    tiles = sched.tiles_per_problem(ordered, ch.tile_m, ch.tile_n)
    k_tiles = [-(-k // 64) for _, _, k in ordered]
    split = sched.tail_split_units(sum(tiles), info.num_ctas, max(k_tiles), ch.split_ways)
    assert split is not None, "the case was meant to split its last wave"
    owners = sched.tail_split_assignment(tiles, k_tiles, info.num_ctas, ch.split_ways).per_cta
    want = [[(order[p], *sched.tile_coord(local, -(-ordered[p][0] // ch.tile_m),
                                          -(-ordered[p][1] // ch.tile_n), ch.swizzle))
             for p, local in cta] for cta in owners]
    ok = trace_assignment(info) == want
    record(f"{name}/visits", ok)
    assert ok, "kernel tile visits differ from moe_gemm.schedule.tail_split_assignment"


# Pinned splits of ping-pong tiles and of 2-CTA clusters (the split's unit is the cluster
# tile): column-tile counts that leave a 1x2 cluster's last rank past the edge (it computes its
# share for its peer and joins nothing), odd m-tile counts for 2x1, empty experts, 1 row.
CLUSTER_SPLITS = {
    "pp128x192-c1x2": dict(schedule="pingpong", tile_m=128, tile_n=192, cluster_m=1,
                           cluster_n=2),
    "pp128x192-c2x1": dict(schedule="pingpong", tile_m=128, tile_n=192, cluster_m=2,
                           cluster_n=1),
    "pp128x128": dict(schedule="pingpong", tile_m=128, tile_n=128, cluster_m=1, cluster_n=1),
    "pp192x128-c1x2": dict(schedule="pingpong", tile_m=192, tile_n=128, cluster_m=1,
                           cluster_n=2),
    "coop128x256-c1x2": dict(schedule="cooperative", tile_m=128, tile_n=256, cluster_m=1,
                             cluster_n=2, stages=3),
}
SPLIT_COUNTS = [1, 0, 700, 129, 1000, 300, 77, 0, 64]


def cluster_split_case(pins: dict, nsm: int) -> tuple[list[int], int, int]:
    """(expert rows, N, the launch's clusters) whose cluster tiles leave a last wave of at
    most half the clusters (so the kernel splits it): three column tiles (a 1x2 cluster's
    second column pair has one rank past the edge)."""
    from moe_gemm.ops.launch_kernel import max_clusters

    tm, tn, cm, cn = pins["tile_m"], pins["tile_n"], pins["cluster_m"], pins["cluster_n"]
    size = cm * cn
    clusters = min(max_clusters(0, size, nsm), nsm // size)
    N = 3 * tn
    counts = list(SPLIT_COUNTS)
    while True:
        units = sum(-(-c // (tm * cm)) for c in counts) * -(-N // (tn * cn))
        if sched.tail_split_units(units, clusters, TS_K // 64) is not None:
            return counts, N, clusters
        counts[2] += tm * cm


@pytest.mark.parametrize("name", list(CLUSTER_SPLITS))
def test_tail_split_clusters_and_pingpong(name):
    """A pinned split of ping-pong tiles or of cluster tiles: the result within the 2x rule
    (a NaN-poisoned out fully written below offs[-1], untouched past it; an allocated one's
    zero tail), run-to-run bitwise, the stores where schedule.tail_split_tiles puts them,
    CUDA-graph replays on new values equal to eager calls."""
    from moe_gemm.ops.launch_info import last_launch, trace_assignment
    from moe_gemm.ops.mm_launch import grouped_mm_cute

    pins = CLUSTER_SPLITS[name]
    counts, N, clusters = cluster_split_case(pins, num_sms())
    K, zero_tail = TS_K, 40
    E, T = len(counts), sum(counts) + zero_tail
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).cuda()
    g = torch.Generator(device="cuda").manual_seed(43)
    x = rand((T, K), torch.bfloat16, g)
    w = rand((E, N, K), torch.bfloat16, g).transpose(1, 2)
    cfg = GemmConfig(backend="cute", tail_split=True, **pins)
    label = f"tail-split/pinned/{name}"
    out = torch.full((T, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    out[T - zero_tail:] = 7.0
    y = moe_gemm.grouped_mm(x, w, offs, out=out, config=cfg)
    torch.cuda.synchronize()
    ch = last_launch().choice
    assert ch.tail_split and (ch.schedule, ch.tile_m, ch.tile_n, ch.cluster_m, ch.cluster_n) == (
        pins["schedule"], pins["tile_m"], pins["tile_n"], pins["cluster_m"], pins["cluster_n"])
    untouched = bool((y[T - zero_tail:] == 7.0).all())
    record(f"{label}/tail-untouched", untouched)
    assert untouched
    check_mm(label, y[:T - zero_tail], x[:T - zero_tail], w, offs)
    again = moe_gemm.grouped_mm(x, w, offs, out=torch.full_like(out, 3.0), config=cfg)
    same = torch.equal(again[:T - zero_tail], y[:T - zero_tail])
    record(f"{label}/run-to-run-bitwise", same)
    assert same
    # An allocated out adds the zero tail's tiles (another split): zeros past offs[-1].
    alloc = moe_gemm.grouped_mm(x, w, offs, config=cfg)
    zeros = bool((alloc[T - zero_tail:] == 0).all())
    record(f"{label}/zero-tail", zeros)
    assert zeros
    check_mm(f"{label}/alloc", alloc[:T - zero_tail], x[:T - zero_tail], w, offs)
    # The trace: every tile stored once, by the CTA the schedule names.
    xs = x[:T - zero_tail]
    grouped_mm_cute(check_grouped_mm(xs, w, offs, None, None), cfg, trace=True)
    torch.cuda.synchronize()
    info = last_launch()
    assert info.num_ctas == clusters * pins["cluster_m"] * pins["cluster_n"]
    want = sched.tail_split_tiles([(c, N) for c in counts], [K // 64] * E, pins["tile_m"],
                                  pins["tile_n"], info.num_ctas, info.choice.swizzle,
                                  pins["cluster_m"], pins["cluster_n"])
    ok = trace_assignment(info) == want
    record(f"{label}/visits", ok)
    assert ok, "kernel tile visits differ from moe_gemm.schedule.tail_split_tiles"
    # CUDA-graph replays on new values (the finishers reset their counters every launch).
    check_mm(f"{label}/no-zero-tail", moe_gemm.grouped_mm(xs, w, offs, config=cfg), xs, w, offs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        yg = moe_gemm.grouped_mm(xs, w, offs, config=cfg)
    for trial in range(2):
        xs.copy_(torch.randn_like(xs))
        graph.replay()
        torch.cuda.synchronize()
        eager = moe_gemm.grouped_mm(xs, w, offs, config=cfg)
        same = torch.equal(eager, yg)
        record(f"{label}/graph-replay{trial}/eager-bitwise", same)
        assert same
    check_mm(f"{label}/graph-replay", yg, xs, w, offs)


def test_tail_split_pingpong_lists():
    """grouped_gemm's lists with a pinned ping-pong split in a 1x2 cluster (each tile's own
    shares of its own K): every output within the 2x rule, NaN-poisoned outs fully written."""
    from moe_gemm.ops.launch_info import last_launch

    sizes = LIST_CASES["mixed-k"]
    cfg = GemmConfig(backend="cute", schedule="pingpong", tile_m=128, tile_n=128,
                     cluster_m=1, cluster_n=2, tail_split=True)
    a, b = _list_operands(sizes, torch.bfloat16, "col", 31)
    out = [torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
           for m, n, k in sizes]
    res = moe_gemm.grouped_gemm(a, b, out=out, config=cfg)
    torch.cuda.synchronize()
    ch = last_launch().choice
    assert ch.tail_split and ch.schedule == "pingpong" and ch.cluster_n == 2
    for i, (ai, bi) in enumerate(zip(a, b)):
        ref = ai.float() @ bi.float()
        low = (ai @ bi) if ai.shape[1] else torch.zeros_like(ref).to(torch.bfloat16)
        check(f"tail-split/pinned/lists-pp-c1x2[{i}]", res[i], ref, low, size=sizes[i])
