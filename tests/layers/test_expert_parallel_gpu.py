"""Expert-parallel MoE on GPUs (NCCL, one GPU per rank): equal to the single-GPU MoE.

Needs two or more GPUs with the cute backend (skipped otherwise). Each world size (2, and 4
where four GPUs exist) is one spawn of W processes that runs every case on bf16 weights large
enough for our kernels; every rank builds the same full layer from a shared seed on its own
GPU, shards it, runs its own tokens (different counts per rank, one rank with none) and
compares with the full layer on the same GPU and tokens.
"""

from __future__ import annotations

import datetime
import os
import traceback
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ep_testutils import rank_errors, run_world

from moe_gemm.capability import cute_problem
from moe_gemm.layers.dispatch import AllToAllDispatcher
from moe_gemm.layers.expert_parallel import ExpertParallelMoE
from moe_gemm.layers.moe import MoE
from moe_gemm.testing import calc_diff

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS < 2, reason="needs two or more GPUs"),
]

H, I = 256, 128  # multiples of our tiles' alignment; large enough to run the cute kernels
# bf16: each rank's partial output is rounded once before the combine sums them (the
# single-GPU layer rounds once at the end), and the two runs group the rows into different
# kernel launches: a few bf16 ulps of the output's scale.
TOL = 2 ** -6



def _moe(seed: int, device: torch.device, **kw: object) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(H, I, kw.pop("E", 16), kw.pop("top_k", 4), dtype=torch.bfloat16,  # type: ignore[arg-type]
              device=device, **kw)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 1 / H ** 0.5)
        if moe.e_score_correction_bias is not None:
            moe.e_score_correction_bias.uniform_(-0.1, 0.1)
    return moe


def _tokens(rank: int, seed: int, device: torch.device, T: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100 + rank)
    n = T if T is not None else (0 if rank == 1 else 37 + 301 * rank)  # rank 1 has no tokens
    return torch.randn(n, H, generator=g).to(device, torch.bfloat16)


def _check(name: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    if got.shape != want.shape or got.dtype != want.dtype or got.device != want.device:
        return (f"{name}: {tuple(got.shape)} {got.dtype} {got.device} != "
                f"{tuple(want.shape)} {want.dtype} {want.device}")
    if want.numel() == 0:
        return None
    err = (got.double() - want.double()).abs().max().item()
    scale = want.double().abs().max().item()
    diff = calc_diff(got, want)
    if not err <= TOL * scale or not diff < 1e-4:
        return f"{name}: max error {err:.3g} vs scale {scale:.3g}, diff {diff:.3g}"
    return None


CASES: dict[str, Callable[[int, int, torch.device], list[str]]] = {}


def case(fn: Callable[[int, int, torch.device], list[str]]
         ) -> Callable[[int, int, torch.device], list[str]]:
    CASES[fn.__name__] = fn
    return fn


@case
def softmax_top4(rank: int, world: int, dev: torch.device) -> list[str]:
    moe = _moe(1, dev)
    ep = ExpertParallelMoE.from_moe(moe)
    x = _tokens(rank, 1, dev)
    return [m for m in [_check("softmax", ep(x), moe(x))] if m]


@case
def deepseek_sigmoid_groups_shared(rank: int, world: int, dev: torch.device) -> list[str]:
    moe = _moe(2, dev, E=32, top_k=8, scoring="sigmoid", n_group=8, topk_group=4,
               routed_scaling_factor=2.5, shared_intermediate_size=I)
    ep = ExpertParallelMoE.from_moe(moe, copy=False)
    x = _tokens(rank, 2, dev, T=513)
    return [m for m in [_check("deepseek", ep(x), moe(x))] if m]


@case
def skewed_to_one_rank(rank: int, world: int, dev: torch.device) -> list[str]:
    moe = _moe(3, dev, top_k=2)
    with torch.no_grad():  # every token to experts 0 and 1, both on rank 0
        moe.router_weight.zero_()
        moe.router_weight[0].fill_(5.0)
        moe.router_weight[1].fill_(4.0)
    ep = ExpertParallelMoE.from_moe(moe)
    x = _tokens(rank, 3, dev).abs()
    return [m for m in [_check("skewed", ep(x), moe(x))] if m]


@case
def static_splits_graph_replay(rank: int, world: int, dev: torch.device) -> list[str]:
    """static_splits never reads counts on the host: the forward is captured once and
    replayed on new tokens."""
    moe = _moe(4, dev)
    ep = ExpertParallelMoE.from_moe(moe, dispatcher=AllToAllDispatcher(static_splits=True))
    x = _tokens(rank, 4, dev, T=96)
    errs = [m for m in [_check("static eager", ep(x), moe(x))] if m]
    stream = torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):
        for _ in range(2):
            ep(x)
    torch.cuda.current_stream(dev).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ep(x)
    x.copy_(_tokens(rank, 5, dev, T=96))
    graph.replay()
    torch.cuda.synchronize(dev)
    errs += [m for m in [_check("static replay", out, moe(x))] if m]
    return errs


@case
def long_prefill(rank: int, world: int, dev: torch.device) -> list[str]:
    moe = _moe(6, dev, E=64, top_k=8)
    ep = ExpertParallelMoE.from_moe(moe)
    x = _tokens(rank, 6, dev, T=4096 + 17 * rank)
    return [m for m in [_check("prefill", ep(x), moe(x))] if m]


@case
def fp8_block_and_row(rank: int, world: int, dev: torch.device) -> list[str]:
    """FP8 experts sharded over NCCL, on our FP8 kernels: each rank quantizes the tokens it
    receives as the single-GPU layer quantizes them (per token, so the grouping of rows does
    not change a row's quantization), and the result is held to the FP8 FFN bar against the
    fp64 reference of what the layer computes."""
    from moe_gemm.testing_fp8 import FFN_REL_BOUND, fp8_errors, moe_fp8_reference

    errs = []
    for granularity in ("block", "row"):
        moe = _moe(7, dev, E=16, top_k=4, shared_intermediate_size=I).quantize_fp8(granularity)
        ep = ExpertParallelMoE.from_moe(moe)
        x = _tokens(rank, 7, dev)
        with torch.no_grad():
            got, single = ep(x), moe(x)
        if got.shape != single.shape or got.dtype != single.dtype:
            errs.append(f"fp8 {granularity}: {tuple(got.shape)} {got.dtype} != "
                        f"{tuple(single.shape)} {single.dtype}")
            continue
        if x.shape[0]:
            ref = moe_fp8_reference(moe, x)
            for label, y in (("expert-parallel", got), ("single-GPU", single)):
                e = fp8_errors(y, ref)
                if not (e["rel"] < FFN_REL_BOUND and torch.isfinite(y).all()):
                    errs.append(f"fp8 {granularity} {label}: {e} from the fp64 reference")
    return errs


def _worker(rank: int, world: int, port: int, queue: mp.SimpleQueue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    results: dict[str, list[str]] = {}
    try:
        # A rank that fails inside a case leaves the others in a collective: time out.
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev,
                                timeout=datetime.timedelta(seconds=120))
        for name, fn in CASES.items():
            try:
                results[name] = fn(rank, world, dev)
            except Exception:  # noqa: BLE001 - reported to the test
                results[name] = [traceback.format_exc()]
            dist.barrier()
    except Exception:  # noqa: BLE001
        results = {name: [traceback.format_exc()] for name in CASES}
    finally:
        queue.put((rank, results))
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture(scope="module", params=[w for w in (2, 4) if w <= GPUS],
                ids=lambda w: f"world{w}")
def ep_results(request: pytest.FixtureRequest) -> dict[int, dict[str, list[str]]]:
    reason = cute_problem()
    if reason:
        pytest.skip(reason)
    world = request.param
    return run_world(_worker, world, 420)


@pytest.mark.parametrize("name", list(CASES))
def test_expert_parallel_gpu_equals_single_gpu(ep_results, name: str) -> None:
    errors = rank_errors(ep_results, name)
    assert not errors, errors
