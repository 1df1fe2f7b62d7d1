"""The kernels are bitwise deterministic: the same inputs give the same bits on every eager
call and every CUDA-graph replay (no floating-point atomics: each output tile is reduced over
K in a fixed order). The tail split's own run-to-run checks are in test_tail_split_gpu.py."""

from __future__ import annotations

import pytest
import torch

import moe_gemm
from moe_gemm import GemmConfig

from .gpu_report import record
from .helpers import check_general, check_mm, general_problems, rand

pytestmark = pytest.mark.gpu

CONFIGS = {
    "default": None,
    "pingpong-64x256": GemmConfig(backend="cute", schedule="pingpong", tile_m=64, tile_n=256),
    "pingpong": GemmConfig(backend="cute", schedule="pingpong"),
    "cooperative": GemmConfig(backend="cute", schedule="cooperative"),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_grouped_mm_bitwise_repeatable(name):
    cfg = CONFIGS[name]
    gen = torch.Generator(device="cuda").manual_seed(17)
    E, T, K, N = 32, 384, 512, 512
    x = rand((T, K), torch.bfloat16, gen)
    w = rand((E, N, K), torch.bfloat16, gen).transpose(1, 2)
    idx = torch.randint(0, E, (T - 7,), generator=torch.Generator().manual_seed(17))
    offs = torch.bincount(idx, minlength=E).cumsum(0).to(torch.int32).cuda()
    ys = [moe_gemm.grouped_mm(x, w, offs, config=cfg) for _ in range(30)]
    torch.cuda.synchronize()
    check_mm(f"determinism/grouped_mm/{name}", ys[0], x, w, offs)
    eager_diffs = sum(not torch.equal(ys[0], y) for y in ys[1:])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        yg = moe_gemm.grouped_mm(x, w, offs, config=cfg)
    graph_diffs = 0
    for _ in range(10):
        graph.replay()
        torch.cuda.synchronize()
        graph_diffs += not torch.equal(yg, ys[0])
    record(f"determinism/grouped_mm/{name}/bitwise", eager_diffs + graph_diffs == 0,
           eager_diffs=eager_diffs, graph_diffs=graph_diffs)
    assert (eager_diffs, graph_diffs) == (0, 0)


def test_grouped_gemm_bitwise_repeatable():
    a, b, _ = general_problems(18, [(1, 384, 256), (77, 384, 256), (130, 384, 256),
                                    (256, 384, 256)])
    ds = [moe_gemm.grouped_gemm(a, b) for _ in range(20)]
    torch.cuda.synchronize()
    check_general("determinism/grouped_gemm", ds[0], a, b)
    diffs = sum(not all(torch.equal(p, q) for p, q in zip(ds[0], d)) for d in ds[1:])
    record("determinism/grouped_gemm/bitwise", diffs == 0, eager_diffs=diffs)
    assert diffs == 0
