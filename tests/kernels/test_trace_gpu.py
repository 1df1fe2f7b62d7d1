"""The kernel visits tiles exactly as moe_gemm.ops.schedule says: trace variants write the
(problem, m_tile, n_tile) of every tile each CTA stores, compared with the schedule's
assignment for every form, both visitors, K-sort and clusters."""

from __future__ import annotations

import random

import pytest
import torch

from moe_gemm import GemmConfig
from moe_gemm.ops import schedule as sched
from moe_gemm.ops.validation import check_grouped_bmm, check_grouped_gemm, check_grouped_mm

from .gpu_report import record
from .helpers import CLUSTER_SHAPES, SCHEDULES, VISITORS, expert_counts

pytestmark = pytest.mark.gpu


def expected(counts, sizes_mn, tile_m, tile_n, num_ctas, swizzle):
    """Per CTA (problem, m_tile, n_tile) for 1x1 clusters."""
    owners = sched.linear_assignment(counts, num_ctas).per_cta
    out = []
    for cta in owners:
        row = []
        for p, local in cta:
            tm = -(-sizes_mn[p][0] // tile_m)
            tn = -(-sizes_mn[p][1] // tile_n)
            m, n = sched.tile_coord(local, tm, tn, swizzle)
            row.append((p, m, n))
        out.append(row)
    return out


def expected_cluster(rows_n, tile_m, tile_n, num_ctas, swizzle, cm, cn):
    """Per CTA (problem, m_tile, n_tile) for a cm x cn cluster grid (see scheduler_warp)."""
    size = cm * cn
    units = [-(-r // (tile_m * cm)) * -(-n // (tile_n * cn)) for r, n in rows_n]
    owners = sched.linear_assignment(units, num_ctas // size).per_cta
    out = [[] for _ in range(num_ctas)]
    for c, cluster in enumerate(owners):
        for p, local in cluster:
            r, n = rows_n[p]
            tiles_m, tiles_n = -(-r // tile_m), -(-n // tile_n)
            mu, nu = sched.tile_coord(local, -(-r // (tile_m * cm)), -(-n // (tile_n * cn)),
                                      swizzle)
            for rank in range(size):
                m = mu * cm + (rank if cm > 1 else 0)
                n_t = nu * cn + (rank if cn > 1 else 0)
                if m < tiles_m and n_t < tiles_n:
                    out[c * size + rank].append((p, m, n_t))
    return out


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("visitor", VISITORS)
@pytest.mark.parametrize("sort_by_k", [False, True])
def test_trace_general_matches_schedule(schedule, visitor, sort_by_k):
    from moe_gemm.ops.general_launch import grouped_gemm_cute
    from moe_gemm.ops.launch_info import last_launch, trace_assignment

    rng = random.Random(11)
    sizes = [(rng.choice([0, 1, 130, 257, 600]), 8 * rng.randint(1, 50), 8 * rng.randint(1, 90))
             for _ in range(90)]
    a = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m, n, k in sizes]
    b = [torch.randn(k, n, device="cuda", dtype=torch.bfloat16) for m, n, k in sizes]
    cfg = GemmConfig(backend="cute", schedule=schedule, visitor=visitor, sort_by_k=sort_by_k)
    grouped_gemm_cute(check_grouped_gemm(a, b, None, None), cfg, trace=True)
    torch.cuda.synchronize()
    info = last_launch()
    got = trace_assignment(info)
    order = list(info.order)
    ordered = [sizes[i] for i in order]
    ch = info.choice
    if ch.cluster_m * ch.cluster_n > 1:  # (the rules may pair n-tiles: the cluster schedule)
        want = expected_cluster([(m, n) for m, n, _ in ordered], ch.tile_m, ch.tile_n,
                                info.num_ctas, ch.swizzle, ch.cluster_m, ch.cluster_n)
    else:
        counts = sched.tiles_per_problem(ordered, ch.tile_m, ch.tile_n)
        want = expected(counts, [(m, n) for m, n, _ in ordered], ch.tile_m, ch.tile_n,
                        info.num_ctas, ch.swizzle)
    want = [[(order[p], m, n) for p, m, n in row] for row in want]
    ok = got == want
    record(f"trace/general/{schedule}/{visitor}/sort={sort_by_k}", ok)
    assert ok, "kernel tile visits differ from moe_gemm.schedule"


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("visitor", VISITORS)
def test_trace_varlen_matches_schedule(schedule, visitor):
    from moe_gemm.ops.launch_info import last_launch, trace_assignment
    from moe_gemm.ops.mm_launch import grouped_mm_cute

    E, T, N, K = 40, 3000, 264, 128
    counts = expert_counts("holes", E, T - 50, torch.Generator().manual_seed(1))
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).cuda()
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, K, N, device="cuda", dtype=torch.bfloat16)
    cfg = GemmConfig(backend="cute", schedule=schedule, visitor=visitor)
    grouped_mm_cute(check_grouped_mm(x, w, offs, None, None), cfg, trace=True)
    torch.cuda.synchronize()
    info = last_launch()
    got = trace_assignment(info)
    rows = counts + [T - sum(counts)]  # the zero tail is problem E
    ch = info.choice
    tile_counts = [-(-r // ch.tile_m) * -(-N // ch.tile_n) for r in rows]
    want = expected(tile_counts, [(r, N) for r in rows], ch.tile_m, ch.tile_n, info.num_ctas,
                    ch.swizzle)
    ok = got == want
    record(f"trace/varlen/{schedule}/{visitor}", ok)
    assert ok, "kernel tile visits differ from moe_gemm.schedule"


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_trace_batched_matches_schedule(schedule):
    from moe_gemm.ops.launch_info import last_launch, trace_assignment
    from moe_gemm.ops.mm_launch import grouped_bmm_cute

    G, M, N, K = 37, 300, 264, 128
    x = torch.randn(G, M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(G, K, N, device="cuda", dtype=torch.bfloat16)
    cfg = GemmConfig(backend="cute", schedule=schedule)
    grouped_bmm_cute(check_grouped_bmm(x, w, None, None), cfg, trace=True)
    torch.cuda.synchronize()
    info = last_launch()
    got = trace_assignment(info)
    ch = info.choice
    counts = [-(-M // ch.tile_m) * -(-N // ch.tile_n)] * G
    want = expected(counts, [(M, N)] * G, ch.tile_m, ch.tile_n, info.num_ctas, ch.swizzle)
    ok = got == want
    record(f"trace/batched/{schedule}", ok)
    assert ok, "kernel tile visits differ from moe_gemm.schedule"


@pytest.mark.parametrize("cl", list(CLUSTER_SHAPES))
def test_trace_cluster_varlen_and_batched_match_schedule(cl):
    from moe_gemm.ops.launch_info import last_launch, trace_assignment
    from moe_gemm.ops.mm_launch import grouped_bmm_cute, grouped_mm_cute

    cfg = GemmConfig(backend="cute", **CLUSTER_SHAPES[cl])
    cm, cn = CLUSTER_SHAPES[cl]["cluster_m"], CLUSTER_SHAPES[cl]["cluster_n"]
    E, T, N, K = 40, 3000, 264, 128
    counts = expert_counts("holes", E, T - 50, torch.Generator().manual_seed(1))
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).cuda()
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, K, N, device="cuda", dtype=torch.bfloat16)
    grouped_mm_cute(check_grouped_mm(x, w, offs, None, None), cfg, trace=True)
    torch.cuda.synchronize()
    info = last_launch()
    rows = counts + [T - sum(counts)]
    ch = info.choice
    assert (ch.cluster_m, ch.cluster_n) == (cm, cn) and info.num_ctas % 2 == 0
    want = expected_cluster([(r, N) for r in rows], ch.tile_m, ch.tile_n, info.num_ctas,
                            ch.swizzle, cm, cn)
    ok_varlen = trace_assignment(info) == want
    record(f"trace/cluster{cl}/varlen", ok_varlen)

    G, M = 9, 300
    x3 = torch.randn(G, M, K, device="cuda", dtype=torch.bfloat16)
    w3 = torch.randn(G, K, N, device="cuda", dtype=torch.bfloat16)
    grouped_bmm_cute(check_grouped_bmm(x3, w3, None, None), cfg, trace=True)
    torch.cuda.synchronize()
    info = last_launch()
    ch = info.choice
    want = expected_cluster([(M, N)] * G, ch.tile_m, ch.tile_n, info.num_ctas, ch.swizzle,
                            cm, cn)
    ok_batched = trace_assignment(info) == want
    record(f"trace/cluster{cl}/batched", ok_batched)
    assert ok_varlen and ok_batched, "kernel tile visits differ from the cluster schedule"


@pytest.mark.parametrize("cl", list(CLUSTER_SHAPES))
@pytest.mark.parametrize("sort_by_k", [False, True])
def test_trace_cluster_general_matches_schedule(cl, sort_by_k):
    from moe_gemm.ops.general_launch import grouped_gemm_cute
    from moe_gemm.ops.launch_info import last_launch, trace_assignment

    rng = random.Random(12)
    sizes = [(rng.choice([0, 1, 130, 257, 600]), 8 * rng.randint(1, 80), 8 * rng.randint(1, 90))
             for _ in range(70)]
    a = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m, n, k in sizes]
    b = [torch.randn(k, n, device="cuda", dtype=torch.bfloat16) for m, n, k in sizes]
    cfg = GemmConfig(backend="cute", sort_by_k=sort_by_k, **CLUSTER_SHAPES[cl])
    grouped_gemm_cute(check_grouped_gemm(a, b, None, None), cfg, trace=True)
    torch.cuda.synchronize()
    info = last_launch()
    ch = info.choice
    assert (ch.cluster_m, ch.cluster_n) == (CLUSTER_SHAPES[cl]["cluster_m"],
                                            CLUSTER_SHAPES[cl]["cluster_n"])
    order = list(info.order)
    want = expected_cluster([(sizes[i][0], sizes[i][1]) for i in order], ch.tile_m, ch.tile_n,
                            info.num_ctas, ch.swizzle, ch.cluster_m, ch.cluster_n)
    want = [[(order[p], m, n) for p, m, n in row] for row in want]
    ok = trace_assignment(info) == want
    record(f"trace/cluster{cl}/general/sort={sort_by_k}", ok)
    assert ok, "kernel tile visits differ from the cluster schedule"
