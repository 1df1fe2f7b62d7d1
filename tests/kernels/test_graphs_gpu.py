"""CUDA-graph capture and host synchronisation: grouped_mm never reads GPU values on the host,
so a captured call replays with new offs and new operand values in place; grouped_gemm and
the batched form capture too, also after eager calls made cached plans and metadata."""

from __future__ import annotations

import pytest
import torch

import moe_gemm
from moe_gemm import GemmConfig

from .gpu_report import record
from .helpers import CLUSTER_SHAPES, check, check_general, check_mm, general_problems, rand

pytestmark = pytest.mark.gpu


def test_cuda_graph_replay_with_new_offsets():
    E, T, N, K = 16, 512, 128, 256
    dev = "cuda"
    x = torch.randn(T, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(E, N, K, device=dev, dtype=torch.bfloat16).transpose(1, 2)
    offs = torch.linspace(0, T, E, device=dev).round().to(torch.int32)
    cfg = GemmConfig(backend="cute")
    moe_gemm.grouped_mm(x, w, offs, config=cfg)  # compile + warm outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = moe_gemm.grouped_mm(x, w, offs, config=cfg)
    for trial in range(3):
        gen = torch.Generator().manual_seed(trial)
        counts = torch.multinomial(torch.ones(E), T, replacement=True, generator=gen)
        new = torch.bincount(counts, minlength=E).cumsum(0).to(torch.int32)
        offs.copy_(new)
        x.copy_(torch.randn(T, K, device=dev, dtype=torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        check_mm(f"cuda-graph/replay{trial}", y, x, w, offs)


def test_grouped_mm_no_host_sync():
    x = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4, 128, 64, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor([10, 100, 100, 250], dtype=torch.int32, device="cuda")
    cfg = GemmConfig(backend="cute")
    moe_gemm.grouped_mm(x, w, offs, config=cfg)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a synchronising call raises
    try:
        moe_gemm.grouped_mm(x, w, offs, config=cfg)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    record("grouped_mm/no-host-sync", True)


def test_grouped_mm_capture_after_eager_calls_replays_new_offs():
    """Eager calls first (the cached plan), then a capture on a side stream: replays read new
    x values and new offs, and eager calls after the capture still run right."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = rand((300, 128), torch.bfloat16, gen)
    w = rand((3, 128, 256), torch.bfloat16, gen)
    offs = torch.tensor([100, 100, 290], dtype=torch.int32, device="cuda")
    for _ in range(3):
        moe_gemm.grouped_mm(x, w, offs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph):
            y = moe_gemm.grouped_mm(x, w, offs)
    torch.cuda.current_stream().wait_stream(side)
    x.copy_(rand((300, 128), torch.bfloat16, gen))
    offs.copy_(torch.tensor([0, 150, 300], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    check_mm("grouped_mm/capture-after-eager/replay", y, x, w, offs)
    z = moe_gemm.grouped_mm(x, w, offs)  # eager again after the capture
    torch.cuda.synchronize()
    check_mm("grouped_mm/capture-after-eager/eager-after", z, x, w, offs)


@pytest.mark.parametrize("cl", list(CLUSTER_SHAPES))
def test_cluster_graph_replay_with_new_offsets(cl):
    E, T, N, K = 16, 700, 256, 256
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    offs = torch.linspace(0, T, E, device="cuda").round().to(torch.int32)
    cfg = GemmConfig(backend="cute", **CLUSTER_SHAPES[cl])
    moe_gemm.grouped_mm(x, w, offs, config=cfg)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = moe_gemm.grouped_mm(x, w, offs, config=cfg)
    for trial in range(3):
        gen = torch.Generator().manual_seed(100 + trial)
        counts = torch.multinomial(torch.ones(E), T - 20, replacement=True, generator=gen)
        offs.copy_(torch.bincount(counts, minlength=E).cumsum(0).to(torch.int32))
        x.copy_(torch.randn(T, K, device="cuda", dtype=torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        check_mm(f"cluster{cl}/graph/replay{trial}", y, x, w, offs)


@pytest.mark.parametrize("pdl", [0, 1])
def test_batched_graph_replay_and_pdl(pdl, monkeypatch):
    from moe_gemm.ops import launch_kernel

    monkeypatch.setattr(launch_kernel, "PDL", pdl)
    G, M, N, K = 16, 96, 256, 512
    x = torch.randn(G, M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(G, K, N, device="cuda", dtype=torch.bfloat16)
    cfg = GemmConfig(backend="cute")
    moe_gemm.grouped_mm(x, w, config=cfg)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = moe_gemm.grouped_mm(x, w, config=cfg)
    for trial in range(2):
        x.copy_(torch.randn_like(x))
        w.copy_(torch.randn_like(w))
        graph.replay()
        torch.cuda.synchronize()
        check(f"batched/graph/pdl={pdl}/{trial}", y, x.float() @ w.float(), torch.bmm(x, w))
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe_gemm.grouped_mm(x, w, config=cfg)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_general_graph_capture_after_eager_calls():
    """grouped_gemm captured in a CUDA graph after eager calls cached its metadata upload: the
    capture makes its own (kept alive for the replays) and replays with new operand values in
    place, bitwise equal to eager calls on the same values."""
    a, b, gen = general_problems(31)
    for _ in range(2):
        eager = moe_gemm.grouped_gemm(a, b)
    torch.cuda.synchronize()
    check_general("general/graph-after-eager/eager", eager, a, b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe_gemm.grouped_gemm(a, b)
    for trial in range(3):
        for t in (*a, *b):
            t.copy_(rand(t.shape, torch.bfloat16, gen))
        graph.replay()
        torch.cuda.synchronize()
        check_general(f"general/graph-after-eager/replay{trial}", captured, a, b)
        again = moe_gemm.grouped_gemm(a, b)
        torch.cuda.synchronize()
        same = all(torch.equal(x, y) for x, y in zip(again, captured))
        record(f"general/graph-after-eager/replay{trial}/eager-bitwise", same)
        assert same
