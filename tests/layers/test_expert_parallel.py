"""Expert-parallel MoE on CPU processes (gloo): equal to the single-process MoE on 2 and 4 ranks.

Each world size is one spawn of W processes that runs every case (a spawn costs seconds on the
2-core CI machine; the cases cost milliseconds). Every rank builds the same full layer from a
shared seed, shards it, runs its own tokens (different counts per rank, one rank with none)
and compares with the full layer on the same tokens; the results come back through a queue.
"""

from __future__ import annotations

import datetime
import os
import traceback
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from ep_testutils import rank_errors, run_world
from moe_testutils import naive_experts, naive_moe, near_tie_sigmoid_moe

from moe_gemm.layers.dispatch import AllToAllDispatcher, Dispatched, Dispatcher, expert_range
from moe_gemm.layers.expert_parallel import ExpertParallelMoE
from moe_gemm.layers.gate_activations import ClampedSiLU
from moe_gemm.layers.moe import MoE
from moe_gemm.testing import assert_close_to_ref, calc_diff


def _full_moe(seed: int, dtype: torch.dtype, **kw: object) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(16, 8, kw.pop("E", 8), kw.pop("top_k", 2), dtype=dtype, **kw)  # type: ignore[arg-type]
    if moe.e_score_correction_bias is not None:
        moe.e_score_correction_bias.uniform_(-0.1, 0.1)  # a bias that changes the selection
    return moe


def _tokens(rank: int, seed: int, dtype: torch.dtype, T: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100 + rank)
    n = T if T is not None else (0 if rank == 1 else 5 + 7 * rank)  # rank 1 has no tokens
    return torch.randn(n, 16, generator=g).to(dtype)


def _check(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> str | None:
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{name}: {tuple(got.shape)} {got.dtype} != {tuple(want.shape)} {want.dtype}"
    if want.numel() == 0:
        return None
    err = (got.double() - want.double()).abs().max().item()
    scale = want.double().abs().max().item()
    if not err <= tol * scale or not calc_diff(got, want) < 1e-5:
        return f"{name}: max error {err:.3g} vs scale {scale:.3g} (tol {tol})"
    return None


CASES: dict[str, Callable[[int, int], list[str]]] = {}


def case(fn: Callable[[int, int], list[str]]) -> Callable[[int, int], list[str]]:
    CASES[fn.__name__] = fn
    return fn


@case
def softmax_fp32(rank: int, world: int) -> list[str]:
    moe = _full_moe(1, torch.float32)
    ep = ExpertParallelMoE.from_moe(moe)
    x = _tokens(rank, 1, torch.float32)
    errs = [m for m in [_check("softmax fp32", ep(x), moe(x), 1e-5)] if m]
    # Mistral-4-style routing (softmax groups, a scaling factor) on clamped experts
    # (ClampedSiLU: the swiglu_limit gate of both halves) with a shared expert
    moe = _full_moe(11, torch.float32, top_k=3, n_group=4, topk_group=2,
                    routed_scaling_factor=1.5, shared_intermediate_size=8,
                    activation=ClampedSiLU(0.5))
    ep = ExpertParallelMoE.from_moe(moe)
    return errs + [m for m in [_check("softmax groups, clamped", ep(x), moe(x), 1e-5)] if m]


@case
def deepseek_v4_hash_and_sqrtsoftplus(rank: int, world: int) -> list[str]:
    # DeepSeek-V4: a hash-routed layer (experts from each token's id; rank 1 has no tokens)
    # and a sqrt(softplus)-scored one; each rank's own input_ids
    x = _tokens(rank, 12, torch.float32)
    g = torch.Generator().manual_seed(12 * 100 + rank)
    ids = torch.randint(0, 50, (x.shape[0],), generator=g)
    moe = _full_moe(12, torch.float32, top_k=3, scoring="sqrtsoftplus", hash_vocab_size=50,
                    routed_scaling_factor=1.5, shared_intermediate_size=8,
                    activation=ClampedSiLU(0.5))
    moe.tid2eid = torch.randint(0, 8, (50, 3), generator=torch.Generator().manual_seed(5))
    ep = ExpertParallelMoE.from_moe(moe)
    errs = [m for m in [_check("hash", ep(x, input_ids=ids), moe(x, input_ids=ids), 1e-5)]
            if m]
    # its own state_dict, each rank's, read back
    again = ExpertParallelMoE.from_state_dict(ep.state_dict(), 3, scoring="sqrtsoftplus",
                                              routed_scaling_factor=1.5,
                                              activation=ClampedSiLU(0.5))
    errs += [m for m in [_check("hash, reloaded", again(x, input_ids=ids),
                                moe(x, input_ids=ids), 1e-5)] if m]
    moe = _full_moe(13, torch.float32, top_k=3, scoring="sqrtsoftplus",
                    routed_scaling_factor=1.5)
    ep = ExpertParallelMoE.from_moe(moe)
    return errs + [m for m in [_check("sqrtsoftplus", ep(x), moe(x), 1e-5)] if m]


@case
def static_splits_3d_input(rank: int, world: int) -> list[str]:
    moe = _full_moe(2, torch.float32, top_k=3)
    ep = ExpertParallelMoE.from_moe(moe, dispatcher=AllToAllDispatcher(static_splits=True))
    x = _tokens(rank, 2, torch.float32, T=6).view(2, 3, 16)
    return [m for m in [_check("static splits", ep(x), moe(x), 1e-5)] if m]


@case
def deepseek_sigmoid_shared_bf16(rank: int, world: int) -> list[str]:
    moe = _full_moe(3, torch.bfloat16, E=16, top_k=4, scoring="sigmoid", n_group=4,
                    topk_group=2, routed_scaling_factor=2.5, shared_intermediate_size=8)
    ep = ExpertParallelMoE.from_moe(moe, copy=False)
    x = _tokens(rank, 3, torch.bfloat16, T=40)
    # bf16: each rank's partial is rounded once before the sum (the single-process layer
    # rounds once at the end), so the bound is a few bf16 ulps of the output scale.
    return [m for m in [_check("deepseek bf16", ep(x), moe(x), 2 ** -6)] if m]


@case
def qwen2_gated_shared_all_to_one_rank(rank: int, world: int) -> list[str]:
    moe = _full_moe(4, torch.float32, shared_intermediate_size=8, shared_expert_gate=True)
    # a router that sends every token to experts 0 and 1 (both on rank 0): skewed traffic
    with torch.no_grad():
        moe.router_weight.zero_()
        moe.router_weight[0].fill_(5.0)
        moe.router_weight[1].fill_(4.0)
    ep = ExpertParallelMoE.from_moe(moe)
    x = _tokens(rank, 4, torch.float32).abs()
    return [m for m in [_check("skewed", ep(x), moe(x), 1e-5)] if m]


class _Recording(dict):  # type: ignore[type-arg]
    """A state dict that records which keys were read."""

    def __init__(self, *a: object) -> None:
        super().__init__(*a)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> torch.Tensor:
        self.read.add(key)
        return super().__getitem__(key)


@case
def state_dict_reads_local_experts_only(rank: int, world: int) -> list[str]:
    moe = _full_moe(5, torch.float32)
    E, I = moe.num_experts, moe.intermediate_size
    sd = _Recording({"model.layers.0.block_sparse_moe.gate.weight": moe.router_weight})
    for e in range(E):
        base = f"model.layers.0.block_sparse_moe.experts.{e}."
        sd[base + "w1.weight"] = moe.gate_up_proj[e, :I]
        sd[base + "w3.weight"] = moe.gate_up_proj[e, I:]
        sd[base + "w2.weight"] = moe.down_proj[e]
    ep = ExpertParallelMoE.from_state_dict(sd, 2, prefix="model.layers.0.block_sparse_moe.")
    errs = []
    start, end = expert_range(E, rank, world)
    others = {k for k in sd if ".experts." in k and not start <= int(k.split(".")[5]) < end}
    if sd.read & others:
        errs.append(f"rank {rank} read other ranks' experts: {sorted(sd.read & others)[:3]}")
    if ep.local.num_experts != E // world:
        errs.append(f"rank {rank} holds {ep.local.num_experts} experts")
    x = _tokens(rank, 5, torch.float32)
    errs += [m for m in [_check("state dict", ep(x), moe(x), 1e-5)] if m]
    # a DeepSeek-style fused checkpoint with a correction bias: routing options pass through
    ds = _full_moe(6, torch.float32, scoring="sigmoid", n_group=2, topk_group=1)
    fused = {"gate.weight": ds.router_weight, "gate.e_score_correction_bias":
             ds.e_score_correction_bias, "experts.gate_up_proj": ds.gate_up_proj,
             "experts.down_proj": ds.down_proj}
    ep2 = ExpertParallelMoE.from_state_dict(fused, 2, n_group=2, topk_group=1)
    errs += [m for m in [_check("fused sigmoid", ep2(x), ds(x), 1e-5)] if m]
    # MoE's own state_dict ("router_weight", "gate_up_proj", ...), which MoE.from_state_dict
    # reads: it was a KeyError about "gate.weight"
    for label, full, kw in (("own state_dict", moe, {}),
                            ("own sigmoid state_dict", ds, {"n_group": 2, "topk_group": 1})):
        try:
            ep3 = ExpertParallelMoE.from_state_dict(full.state_dict(), 2, **kw)
            errs += [m for m in [_check(label, ep3(x), full(x), 1e-5)] if m]
        except KeyError as e:
            errs.append(f"{label}: {e}")
    return errs


@case
def own_state_dict_round_trip(rank: int, world: int) -> list[str]:
    """from_state_dict(ep.state_dict()) on every rank, each its own state dict (the full
    router beside its "local." experts): it was a KeyError about the expert keys, while
    load_state_dict took the same mapping. Sigmoid routing with a correction bias and shared
    experts, under a prefix too, and a layer built from a checkpoint saved again."""
    errs = []
    opts = {"scoring": "sigmoid", "n_group": 2, "topk_group": 1}
    moe = _full_moe(26, torch.float32, shared_intermediate_size=8, **opts)
    x = _tokens(rank, 26, torch.float32)
    want = moe(x)
    ep = ExpertParallelMoE.from_moe(moe)
    sd = ep.state_dict()
    for label, layer in (
            ("own state_dict", lambda: ExpertParallelMoE.from_state_dict(sd, 2, **opts)),
            ("own state_dict, prefixed", lambda: ExpertParallelMoE.from_state_dict(
                {"model.layers.1.mlp." + k: v for k, v in sd.items()}, 2,
                prefix="model.layers.1.mlp.", **opts)),
            ("saved twice", lambda: ExpertParallelMoE.from_state_dict(
                ExpertParallelMoE.from_state_dict(sd, 2, **opts).state_dict(), 2, **opts))):
        try:
            got = layer()
        except KeyError as e:
            errs.append(f"{label}: {e!r}")
            continue
        errs += [m for m in [_check(label, got(x), want, 1e-5)] if m]
        if got.local.num_experts != moe.num_experts // world:
            errs.append(f"{label}: rank {rank} holds {got.local.num_experts} experts")
    return errs


@case
def from_hf_deepseek_v3_block(rank: int, world: int) -> list[str]:
    """A transformers DeepseekV3MoE block, sharded: equal to the block's own output.
    On 2 ranks only: importing transformers costs seconds per process on the CI machine."""
    if world != 2:
        return []
    try:
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    except ImportError:  # transformers is a dev dependency: CI has it
        return ["transformers is not installed"]
    config = DeepseekV3Config(hidden_size=32, moe_intermediate_size=16, n_routed_experts=16,
                              num_experts_per_tok=4, n_group=4, topk_group=2,
                              n_shared_experts=1, routed_scaling_factor=2.5)
    config._experts_implementation = "eager"
    torch.manual_seed(9)
    block = DeepseekV3MoE(config).eval()
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        block.gate.e_score_correction_bias.copy_(torch.randn(16, generator=g) * 0.1)
    ep = ExpertParallelMoE.from_hf(block)
    x = torch.randn(1, 9 + rank, 32, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        want = block(x)
    return [m for m in [_check("from_hf", ep(x), want, 1e-5)] if m]


@case
def fp8_experts(rank: int, world: int) -> list[str]:
    """FP8 experts: an FP8 layer sharded and an FP8 checkpoint read per rank (fused keys, and
    per-expert keys with their scales). The received tokens are quantized on the fly as in
    the single-process layer, so the result is that layer's, and within the FP8 bound of its
    fp64 reference."""
    from moe_gemm.testing_fp8 import REL_BOUND, fp8_errors, moe_fp8_reference

    errs = []
    for granularity, suffix in (("block", "weight_scale_inv"), ("row", "weight_scale")):
        torch.manual_seed(11)
        moe = MoE(128, 128, 8, 2, shared_intermediate_size=64).quantize_fp8(granularity)
        T = 0 if rank == 1 else 5 + 7 * rank  # rank 1 has no tokens
        x = torch.randn(T, 128, generator=torch.Generator().manual_seed(11 + rank))
        want = moe(x)
        s1, s2 = moe.gate_up_proj_scale_inv, moe.down_proj_scale_inv
        I = moe.intermediate_size
        n = I // 128 if granularity == "block" else I  # the gate's rows of s1
        sd = {"gate.weight": moe.router_weight}
        sd.update({f"shared_experts.{p}.weight": getattr(moe.shared_experts, p).weight
                   for p in ("gate_proj", "up_proj", "down_proj")})
        fused = {**sd, "experts.gate_up_proj": moe.gate_up_proj,
                 "experts.down_proj": moe.down_proj, "experts.gate_up_proj_scale_inv": s1,
                 "experts.down_proj_scale_inv": s2}
        per_expert = dict(sd)
        for e in range(moe.num_experts):
            for p, w, s in (("gate_proj", moe.gate_up_proj[e, :I], s1[e, :n]),
                            ("up_proj", moe.gate_up_proj[e, I:], s1[e, n:]),
                            ("down_proj", moe.down_proj[e], s2[e])):
                per_expert[f"experts.{e}.{p}.weight"] = w
                per_expert[f"experts.{e}.{p}.{suffix}"] = s
        for label, ep in (
            ("from_moe", ExpertParallelMoE.from_moe(moe)),
            ("fused keys", ExpertParallelMoE.from_state_dict(fused, 2)),
            ("per-expert keys", ExpertParallelMoE.from_state_dict(per_expert, 2)),
        ):
            name = f"fp8 {granularity} {label}"
            got = ep(x)
            errs += [m for m in [_check(name, got, want, 1e-5)] if m]
            if T:
                rel = fp8_errors(got, moe_fp8_reference(moe, x))["rel"]
                if not rel < REL_BOUND[torch.float32]:
                    errs.append(f"{name}: {rel:.3g} from the fp64 reference")
    return errs


@case
def custom_dispatcher_is_used(rank: int, world: int) -> list[str]:
    """A user dispatcher (e.g. DeepEP's) replaces the all-to-all: the layer calls it."""

    class Counting(AllToAllDispatcher):
        calls = 0

        def dispatch(self, *a, **k):  # type: ignore[no-untyped-def]
            Counting.calls += 1
            return super().dispatch(*a, **k)

    moe = _full_moe(7, torch.float32)
    disp = Counting()
    ep = ExpertParallelMoE.from_moe(moe, dispatcher=disp)
    x = _tokens(rank, 7, torch.float32)
    errs = [m for m in [_check("custom", ep(x), moe(x), 1e-5)] if m]
    if Counting.calls != 1 or not isinstance(disp, Dispatcher):
        errs.append(f"custom dispatcher called {Counting.calls} times")
    return errs


@case
def bad_arguments(rank: int, world: int) -> list[str]:
    errs = []
    moe = MoE(16, 8, 6, 2) if world == 4 else MoE(16, 8, 5, 2)  # E not a multiple of W
    try:
        ExpertParallelMoE.from_moe(moe)
        errs.append("E not a multiple of the group size was accepted")
    except ValueError as e:
        if "multiple of the group size" not in str(e):
            errs.append(f"unclear message: {e}")
    ep = ExpertParallelMoE.from_moe(_full_moe(8, torch.float32))
    try:
        ep(torch.randn(3, 15))
        errs.append("wrong hidden size accepted")
    except ValueError as e:
        if "(..., 16)" not in str(e):
            errs.append(f"unclear message: {e}")
    # Strings were truthy: "no" gave static splits, and the replica check, where declined (the
    # refused flag is raised on every rank after the replica check's all-gather: no rank waits).
    for label, build in (
            ("static_splits", lambda: AllToAllDispatcher(static_splits="no")),
            ("check_replicated", lambda: ExpertParallelMoE.from_moe(
                _full_moe(8, torch.float32), check_replicated="no"))):
        try:
            build()
            errs.append(f"{label}='no' accepted")
        except TypeError as e:
            if f"{label} must be a bool" not in str(e):
                errs.append(f"unclear message: {e}")
    return errs


@case
def static_splits_need_one_token_count(rank: int, world: int) -> list[str]:
    """Static splits send T rows to every rank: token counts that differ between the ranks (one
    rank with none) are a ValueError on every rank, not a gloo abort of the process."""
    moe = _full_moe(9, torch.float32)
    ep = ExpertParallelMoE.from_moe(moe, dispatcher=AllToAllDispatcher(static_splits=True))
    try:
        ep(_tokens(rank, 9, torch.float32, T=0 if rank == 0 else 3))
        return ["unequal token counts with static splits were accepted"]
    except ValueError as e:
        return [] if "same token count on every rank" in str(e) else [f"unclear message: {e}"]


@case
def dispatcher_outside_its_group(rank: int, world: int) -> list[str]:
    """A rank that is not in the group gets a clear error, not rank -1 and world size -1 (and
    then a message about E being a multiple of the group size -1)."""
    group = dist.new_group([0])  # (every rank calls new_group)
    if rank == 0:
        d = AllToAllDispatcher(group)
        return [] if (d.rank, d.world_size) == (0, 1) else [f"member: {d!r}"]
    try:
        d = AllToAllDispatcher(group)
        return [f"a rank outside the group was accepted: {d!r}"]
    except ValueError as e:
        return [] if "not a member of the expert-parallel group" in str(e) else [
            f"unclear message: {e}"]


def _ref64(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The softmax top-k layer (no shared experts) in float64, token by token."""
    x64 = x.double().reshape(-1, moe.hidden_size)
    probs = torch.softmax(x64 @ moe.router_weight.double().t(), dim=-1)
    w, ids = probs.topk(moe.top_k, dim=-1)
    w = w / w.sum(dim=-1, keepdim=True)
    I = moe.intermediate_size
    out = torch.zeros_like(x64)
    for t in range(x64.shape[0]):
        for j in range(moe.top_k):
            e = int(ids[t, j])
            h = moe.gate_up_proj[e].double() @ x64[t]
            out[t] += w[t, j] * (moe.down_proj[e].double() @ (F.silu(h[:I]) * h[I:]))
    return out.reshape(x.shape)


@case
def replicas_must_match(rank: int, world: int) -> list[str]:
    """Ranks built from different router, shared-expert weights or activation, or top_k: a
    ValueError on every rank at construction naming what differs (each rank would otherwise
    route the same token differently, or abort gloo inside the all-to-all);
    check_replicated=False skips."""
    errs = []
    for what, kw in (("router_weight", {}), ("shared_experts.down_proj",
                                             {"shared_intermediate_size": 8}),
                     ("top_k", {}), ("shared activation", {"shared_intermediate_size": 8}),
                     ("tid2eid", {"hash_vocab_size": 20})):
        moe = _full_moe(12, torch.float32, **kw)
        if what == "tid2eid":  # (a hash router's token -> experts table: DeepSeek-V4)
            moe.tid2eid = torch.arange(40).view(20, 2) % 8
        if rank == world - 1:
            with torch.no_grad():
                if what == "tid2eid":
                    moe.tid2eid[7, 1] = 3
                elif what == "router_weight":
                    moe.router_weight[3, 5] += 1e-6
                elif what == "top_k":
                    moe.top_k = 3
                elif what == "shared activation":
                    moe.shared_experts.activation = "gelu"
                else:
                    moe.shared_experts.down_proj.weight[1, 2] += 1e-6
        try:
            ExpertParallelMoE.from_moe(moe)
            errs.append(f"different {what} on rank {world - 1} accepted")
        except ValueError as e:
            if f"{what} (ranks {list(range(world - 1))} vs [{world - 1}])" not in str(e):
                errs.append(f"unclear message: {e}")
    ep = ExpertParallelMoE.from_moe(moe, check_replicated=False)
    try:
        ep.check_replicated()
        errs.append("check_replicated() accepted different shared experts")
    except ValueError:
        pass
    return errs


@case
def one_rank_refuses_its_input(rank: int, world: int) -> list[str]:
    """A rank whose input is refused (wrong hidden size, not a tensor) joins the dispatch's
    first collective flagged, so every rank raises (gloo used to reset the others' connection
    or leave them waiting); the next forward runs and matches the fp64 reference."""
    moe = _full_moe(13, torch.float32)
    errs = []
    for label, disp in (("dynamic", AllToAllDispatcher()),
                        ("static", AllToAllDispatcher(static_splits=True))):
        ep = ExpertParallelMoE.from_moe(moe, dispatcher=disp)
        bad: object = torch.randn(4, 15) if label == "dynamic" else [0.0] * 16
        try:
            ep(bad if rank == 0 else _tokens(rank, 13, torch.float32, T=4))
            errs.append(f"{label}: rank {rank} ran")
        except (TypeError, ValueError) as e:
            if rank and "rank(s) [0] refused their input" not in str(e):
                errs.append(f"{label}: unclear message: {e}")
        x = _tokens(rank, 14, torch.float32, T=4)
        errs += [m for m in [_check(label, ep(x).double(), _ref64(moe, x), 1e-5)] if m]
    return errs


@case
def fp8_tokens_of_different_dtypes_refused(rank: int, world: int) -> list[str]:
    """FP8 experts take the tokens in the caller's dtype: ranks passing fp32 and bf16 are a
    ValueError on every rank (gloo aborted the processes on the size mismatch); 16-bit experts
    take each rank's dtype (the tokens travel in the experts' dtype)."""
    torch.manual_seed(15)
    moe = MoE(128, 128, 8, 2).quantize_fp8("block")
    ep = ExpertParallelMoE.from_moe(moe)
    x = torch.randn(3, 128).to(torch.bfloat16 if rank % 2 else torch.float32)
    try:
        ep(x)
        return ["FP8 experts took tokens of different dtypes"]
    except ValueError as e:
        if "the ranks' dtype: ['float32', 'bfloat16'" not in str(e):
            return [f"unclear message: {e}"]
    plain = _full_moe(16, torch.float32)
    ep = ExpertParallelMoE.from_moe(plain)
    x = _tokens(rank, 16, torch.float32, T=3).to(torch.bfloat16 if rank % 2 else torch.float32)
    y = ep(x)
    return [m for m in [_check("mixed dtypes", y.double(), _ref64(plain, x).to(x.dtype).double(),
                                2 ** -7)] if m]


@case
def backward_raises_as_moe_does(rank: int, world: int) -> list[str]:
    """Inference only, as MoE: with gradients enabled on the input, a backward through the
    output raises (it ran, the layer's gradient silently missing, with a residual around it);
    under no_grad nothing is linked. (Compiled: test_compiled_backward_raises_as_moe_does.)"""
    moe = _full_moe(17, torch.float32, shared_intermediate_size=8)
    ep = ExpertParallelMoE.from_moe(moe)
    x = _tokens(rank, 17, torch.float32, T=3).requires_grad_()
    errs = [m for m in [_check("grad enabled", ep(x).detach(), moe(x).detach(), 1e-5)] if m]
    try:
        (x + ep(x)).sum().backward()
        errs.append("a backward through the layer ran")
    except RuntimeError as e:
        if "inference-only" not in str(e):
            errs.append(f"unclear message: {e}")
    with torch.no_grad():
        if ep(x).requires_grad:
            errs.append("linked under no_grad")
    return errs


@case
def one_rank_fails_to_build(rank: int, world: int) -> list[str]:
    """A rank whose constructor arguments are refused (a bad top_k, a missing key) joins the
    replica check flagged, so every rank raises ValueError instead of waiting in it until the
    group's timeout; with check_replicated=False too (the others built their layers, to wait
    for that rank in their first forward)."""
    moe = _full_moe(18, torch.float32)
    fused = {"gate.weight": moe.router_weight, "experts.gate_up_proj": moe.gate_up_proj,
             "experts.down_proj": moe.down_proj}
    errs = []
    last = rank == world - 1
    for label, build in (
        ("bad top_k", lambda: ExpertParallelMoE.from_state_dict(fused, 0 if last else 2)),
        ("missing key", lambda: ExpertParallelMoE.from_state_dict(
            {k: v for k, v in fused.items() if not (last and k == "experts.down_proj")}, 2)),
        ("E not a multiple of W", lambda: ExpertParallelMoE.from_moe(
            _full_moe(18, torch.float32, E=8 * world + last))),
        ("bad top_k, unchecked", lambda: ExpertParallelMoE.from_state_dict(
            fused, 0 if last else 2, check_replicated=False)),
    ):
        try:
            build()
            errs.append(f"{label}: rank {rank} built the layer")
        except (TypeError, ValueError, KeyError) as e:
            if not last and f"rank(s) [{world - 1}] could not build" not in str(e):
                errs.append(f"{label}: unclear message: {e}")
    return errs


class _MissingFile(dict):  # type: ignore[type-arg]
    """A lazy checkpoint mapping whose tensors at `missing` live in a file this rank's disk
    lacks (a safetensors shard copied to some nodes only): indexing one raises OSError."""

    def __init__(self, sd: dict, missing: set[str]):
        super().__init__(sd)
        self.missing = missing

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self.missing:
            raise FileNotFoundError(f"model-00002-of-00002.safetensors (holding {key!r})")
        return super().__getitem__(key)


@case
def one_rank_cannot_read_its_checkpoint(rank: int, world: int) -> list[str]:
    """A rank whose construction fails with an error other than a refusal (its lazy
    checkpoint's shard file missing: OSError) joins the replica check flagged as well: the
    other ranks raise ValueError at once instead of waiting in the check's all-gather for the
    group's timeout."""
    # A group of its own with a short timeout: a rank left waiting fails this case in seconds.
    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=5))
    moe = _full_moe(24, torch.float32)
    sd = {"gate.weight": moe.router_weight}
    for e in range(moe.num_experts):
        I = moe.intermediate_size
        sd[f"experts.{e}.gate_proj.weight"] = moe.gate_up_proj[e, :I]
        sd[f"experts.{e}.up_proj.weight"] = moe.gate_up_proj[e, I:]
        sd[f"experts.{e}.down_proj.weight"] = moe.down_proj[e]
    last = rank == world - 1
    missing = {f"experts.{moe.num_experts - 1}.down_proj.weight"} if last else set()
    try:
        ExpertParallelMoE.from_state_dict(_MissingFile(sd, missing), 2, group=group)
        return [f"rank {rank} built the layer"]
    except FileNotFoundError:
        return [] if last else [f"rank {rank} raised the last rank's FileNotFoundError"]
    except ValueError as e:
        if last or f"rank(s) [{world - 1}] could not build" not in str(e):
            return [f"unclear message on rank {rank}: {e}"]
    return []


@case
def ranks_disagreeing_on_check_replicated(rank: int, world: int) -> list[str]:
    """check_replicated True on some ranks and False on the others: a ValueError on every rank
    naming the disagreement (the checking ranks waited in the replica check's all-gather,
    which the others never entered, until the group's timeout)."""
    # A group of its own with a short timeout: a rank left waiting fails this case in seconds
    # instead of holding the default group's later cases.
    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=5))
    moe = _full_moe(19, torch.float32)
    try:
        ExpertParallelMoE.from_moe(moe, group=group, check_replicated=rank % 2 == 0)
        return [f"rank {rank} built the layer"]
    except ValueError as e:
        on, off = list(range(0, world, 2)), list(range(1, world, 2))
        if f"check_replicated (True on ranks {on}, False on ranks {off})" not in str(e):
            return [f"unclear message: {e}"]
    # The refusal left every rank in step: the group still serves a layer.
    ep = ExpertParallelMoE.from_moe(moe, group=group, check_replicated=False)
    x = _tokens(rank, 19, torch.float32)
    return [m for m in [_check("after the refusal", ep(x), moe(x), 1e-5)] if m]


@case
def float64_layer_refused_before_the_dispatch(rank: int, world: int) -> list[str]:
    """A layer cast to float64 is a TypeError naming the dtypes it runs in, as MoE's, raised
    before the dispatch (its tokens travelled in float64 and every rank failed in the
    experts' GEMM, naming its input); a rank whose layer alone is cast makes the others raise
    too, and the next forward runs."""
    moe = _full_moe(20, torch.float32)
    x = _tokens(rank, 20, torch.float32, T=4)
    errs = []
    for label, cast in (("every rank", True), ("rank 0 only", rank == 0)):
        ep = ExpertParallelMoE.from_moe(moe)
        if cast:
            ep.double()
        try:
            ep(x)
            errs.append(f"{label}: rank {rank} ran")
        except (TypeError, ValueError) as e:
            want = ("weights are torch.float64; ExpertParallelMoE runs in torch.bfloat16, "
                    "torch.float16 or torch.float32" if cast else "rank(s) [0] refused their input")
            if want not in str(e):
                errs.append(f"{label}: unclear message: {e}")
        ep.float()
        errs += [m for m in [_check(f"{label}, then float32", ep(x), moe(x), 1e-5)] if m]
    return errs


@case
def fused_setting_carried(rank: int, world: int) -> list[str]:
    """MoE's `fused` comes along with from_moe and from_state_dict (it was dropped: the local
    experts took the unfused GEMMs whatever it said); fused=True runs the fused ops' torch
    backend here, and equals MoE's fused layer, a rank receiving no tokens included."""
    moe = _full_moe(21, torch.float32, fused=True)
    with torch.no_grad():  # every token to experts 0 and 1 (rank 0): the others get none
        moe.router_weight[0].add_(5.0)
        moe.router_weight[1].add_(4.0)
    x = _tokens(rank, 21, torch.float32).abs()
    sd = {"gate.weight": moe.router_weight, "experts.gate_up_proj": moe.gate_up_proj,
          "experts.down_proj": moe.down_proj}
    errs = []
    for label, ep in (("from_moe", ExpertParallelMoE.from_moe(moe)),
                      ("from_state_dict", ExpertParallelMoE.from_state_dict(sd, 2, fused=True))):
        if ep.local.fused is not True:
            errs.append(f"{label}: local fused={ep.local.fused}")
        errs += [m for m in [_check(f"fused {label}", ep(x), moe(x), 1e-5)] if m]
    return errs


@case
def reassigned_activation_reaches_the_shared_expert(rank: int, world: int) -> list[str]:
    """A layer whose `activation` was reassigned after construction: its shared expert
    follows it, and from_moe's shards (which build their shared expert from the attribute)
    equal it (the layer's shared expert kept the constructor's activation: they differed)."""
    moe = _full_moe(22, torch.float32, shared_intermediate_size=8, shared_expert_gate=True)
    moe.activation = "gelu"
    ep = ExpertParallelMoE.from_moe(moe)
    x = _tokens(rank, 22, torch.float32) * 3
    errs = [m for m in [_check("reassigned activation", ep(x), moe(x), 1e-5)] if m]
    if ep.local.shared_experts.activation != "gelu":
        errs.append(f"shared activation {ep.local.shared_experts.activation!r}")
    return errs


class _Gelu:
    """A callable instance activation: its default repr holds its address, which differs
    between processes."""

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return F.gelu(t)


@case
def callable_activations_agree_between_ranks(rank: int, world: int) -> list[str]:
    """Activations given as callables without a name of ours (a functools.partial of a Python
    function, a callable instance) are the same on every rank: the replica check compared
    their reprs, memory addresses included, and refused every such layer on every rank."""
    import functools

    errs = []
    for label, act in (("partial", functools.partial(F.silu, inplace=False)),
                       ("instance", _Gelu())):
        moe = _full_moe(24, torch.float32, activation=act, shared_intermediate_size=8)
        x = _tokens(rank, 24, torch.float32)
        try:
            errs += [m for m in [_check(label, ExpertParallelMoE.from_moe(moe)(x), moe(x),
                                        1e-5)] if m]
        except ValueError as e:
            errs.append(f"{label}: {e}")
    return errs


@case
def module_activation_values_are_checked(rank: int, world: int) -> list[str]:
    """A module activation's parameters (nn.PReLU's weight) are replicated parts too: ranks
    holding different values raise ValueError naming the activation (its repr alone was
    compared, and they ran, each rank's experts applying its own activation)."""
    moe = _full_moe(26, torch.float32, activation=torch.nn.PReLU(), shared_intermediate_size=8)
    if rank == world - 1:
        with torch.no_grad():
            moe.activation.weight.fill_(0.5)
    try:
        ExpertParallelMoE.from_moe(moe)
        return ["different activation parameters accepted"]
    except ValueError as e:
        want = f"activation (ranks {list(range(world - 1))} vs [{world - 1}])"
        return [] if want in str(e) else [f"unclear message: {e}"]


@case
def meta_device_layer_is_built_checked_and_loaded(rank: int, world: int) -> list[str]:
    """A layer sharded from a MoE on the meta device (materialized and loaded later) builds
    with the replica check on (it read the meta tensors' values: a RuntimeError on every
    rank), then loads a state_dict, passes check_replicated() and equals the MoE."""
    errs = []
    try:
        ep = ExpertParallelMoE.from_moe(MoE(16, 8, 8, 2, shared_intermediate_size=8,
                                            device="meta"))
    except RuntimeError as e:
        return [f"meta layer refused: {e}"]
    ep.to_empty(device="cpu")
    moe = _full_moe(25, torch.float32, shared_intermediate_size=8)
    ep.load_state_dict(ExpertParallelMoE.from_moe(moe).state_dict())
    ep.check_replicated()
    x = _tokens(rank, 25, torch.float32)
    errs += [m for m in [_check("meta, then loaded", ep(x), moe(x), 1e-5)] if m]
    return errs


class _Counting(AllToAllDispatcher):
    """The all-to-all dispatcher, recording each dispatch's num_valid_slots."""

    def __init__(self) -> None:
        super().__init__()
        self.valid: list[int | None] = []

    def dispatch(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        d, extra = super().dispatch(*args, **kwargs)
        self.valid.append(d.num_valid_slots)
        return d, extra


@case
def fused_computes_only_the_valid_slots(rank: int, world: int) -> list[str]:
    """fused=True computes the rows of the received slots whose expert is here
    (num_valid_slots), as the unfused path gathers them, not every received slot (top-4 of 8
    experts over the ranks: most received slots are other ranks'); the result equals the
    single-process layer and the unfused shards', a rank receiving no tokens included."""
    import moe_gemm.layers.fused_experts as fused_experts

    moe = _full_moe(23, torch.float32, top_k=4, shared_intermediate_size=8)
    x = _tokens(rank, 23, torch.float32)
    want = moe(x)
    moe.fused = False
    unfused = ExpertParallelMoE.from_moe(moe)(x)
    moe.fused = True
    dispatcher = _Counting()
    ep = ExpertParallelMoE.from_moe(moe, dispatcher=dispatcher)
    rows: list[int] = []
    real = fused_experts.fused_grouped_mm
    fused_experts.fused_grouped_mm = lambda *a, **k: (lambda y: rows.append(y.shape[0]) or y)(
        real(*a, **k))
    try:
        got = ep(x)
    finally:
        fused_experts.fused_grouped_mm = real
    errs = [m for m in [_check("fused vs MoE", got, want, 1e-5),
                        _check("fused vs unfused shards", got, unfused, 1e-5)] if m]
    (valid,) = dispatcher.valid
    if rows != [valid, valid]:
        errs.append(f"rank {rank}: the fused GEMMs computed {rows} rows; {valid} slots are valid")
    return errs


@case
def ranks_disagreeing_on_static_splits(rank: int, world: int) -> list[str]:
    """Static splits on rank 0 only: a ValueError on every rank naming it, at construction
    (the replica check) and, unchecked, in each forward's count exchange (gloo aborted every
    process on the all-to-all's size mismatch); the group then still serves a layer."""
    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=5))
    moe = _full_moe(27, torch.float32)
    x = _tokens(rank, 27, torch.float32, T=3)
    errs = []
    for label, check, want in (
            ("checked", True, f"dispatcher (ranks [0] vs {list(range(1, world))})"),
            ("unchecked", False, "the same static_splits; the ranks' static_splits: "
                                 f"{[True] + [False] * (world - 1)}")):
        try:
            disp = AllToAllDispatcher(group, static_splits=rank == 0)
            ExpertParallelMoE.from_moe(moe, dispatcher=disp, check_replicated=check)(x)
            errs.append(f"{label}: rank {rank} ran")
        except ValueError as e:
            if want not in str(e):
                errs.append(f"{label}: unclear message: {e}")
    ep = ExpertParallelMoE.from_moe(moe, group=group)
    return errs + [m for m in [_check("after the refusals", ep(x), moe(x), 1e-5)] if m]


@case
def one_rank_fails_in_routing_or_shared_experts(rank: int, world: int) -> list[str]:
    """A rank whose routing refuses its options (n_group=3 over 8 experts set on it alone:
    the value passes its assignment's check, the forward refuses the combination) makes the others raise as a refused input does; a rank whose shared experts fail (a weight of
    another shape set on it alone) raises its own error after the combine, the others'
    outputs unharmed. Both left the other ranks waiting in a collective until the group's
    timeout."""
    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=5))
    moe = _full_moe(28, torch.float32, shared_intermediate_size=8)
    x = _tokens(rank, 28, torch.float32)
    want = moe(x)
    last = rank == world - 1
    errs = []
    ep = ExpertParallelMoE.from_moe(moe, group=group)
    if last:
        ep.n_group = 3
    try:
        ep(x)
        errs.append(f"n_group=3 over 8 experts: rank {rank} ran")
    except ValueError as e:
        if not last and f"rank(s) [{world - 1}] refused their input" not in str(e):
            errs.append(f"n_group=3 over 8 experts: unclear message: {e}")
    ep = ExpertParallelMoE.from_moe(moe, group=group)
    up = ep.local.shared_experts.up_proj
    if last:
        up.weight = torch.nn.Parameter(torch.zeros(8, 15), requires_grad=False)
    try:
        errs += [m for m in [_check("beside a failing shared expert", ep(x), want, 1e-5)] if m]
        if last:
            errs.append("a shared expert of the wrong shape ran")
    except RuntimeError as e:
        if not last:
            errs.append(f"rank {rank}: {e}")
    up.weight = moe.shared_experts.up_proj.weight
    return errs + [m for m in [_check("after the failures", ep(x), want, 1e-5)] if m]


def _worker(rank: int, world: int, port: int, queue: mp.SimpleQueue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # A rank that fails inside a case leaves the others in a collective: time out, not hang.
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    results: dict[str, list[str]] = {}
    try:
        for name, fn in CASES.items():
            try:
                results[name] = fn(rank, world)
            except Exception:  # noqa: BLE001 - reported to the test
                results[name] = [traceback.format_exc()]
            dist.barrier()
    finally:
        queue.put((rank, results))
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def ep_results(request: pytest.FixtureRequest) -> dict[int, dict[str, list[str]]]:
    world = request.param
    return run_world(_worker, world, 240)


@pytest.mark.parametrize("name", list(CASES))
def test_expert_parallel_equals_single_process(ep_results, name: str) -> None:
    errors = rank_errors(ep_results, name)
    assert not errors, errors


def test_expert_range_and_dispatcher_needs_init() -> None:
    assert expert_range(8, 0, 2) == (0, 4) and expert_range(8, 3, 4) == (6, 8)
    with pytest.raises(ValueError, match="multiple of the group size"):
        expert_range(6, 0, 4)
    with pytest.raises(ValueError, match="rank must be in"):
        expert_range(8, 2, 2)
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="init_process_group"):
            AllToAllDispatcher()


class _OneRank:
    """A Dispatcher of one rank, for the constructor's checks (no process group)."""

    rank, world_size = 0, 1

    def dispatch(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("not called by the constructor")

    def combine(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("not called by the constructor")


@pytest.mark.parametrize("change,exc,pattern", [
    ({"router_fp32": "no"}, TypeError, "router_fp32 must be a bool"),
    ({"router_weight": torch.zeros(4, 16, dtype=torch.long)}, TypeError,
     "router_weight must be a floating-point tensor"),
    ({"router_weight": [[0.0] * 16] * 4}, TypeError, "router_weight must be a torch.Tensor"),
    ({"router_weight": torch.zeros(4, 15)}, ValueError, r"router_weight must be \(E, H\) = \(4, 16\)"),
    ({"scoring": "sigmoid", "e_score_correction_bias": torch.zeros(3)}, ValueError,
     r"e_score_correction_bias must be \(E,\) = \(4,\)"),
    ({"scoring": "sigmoid", "e_score_correction_bias": torch.zeros(4, dtype=torch.long)},
     TypeError, "e_score_correction_bias must be a float tensor"),
])
def test_constructor_checks_the_router(change: dict, exc: type[Exception], pattern: str) -> None:
    # Each would otherwise be taken as it is: a string router_fp32 as True, the others failing
    # (or not) only at the first forward, inside the router.
    router = dict(router_weight=torch.randn(4, 16), e_score_correction_bias=None, top_k=2,
                  scoring="softmax", renormalize=True, n_group=1, topk_group=1,
                  routed_scaling_factor=1.0, router_fp32=False)
    ExpertParallelMoE(MoE(16, 8, 4, 1), router, 4, dispatcher=_OneRank())
    with pytest.raises(exc, match=pattern):
        ExpertParallelMoE(MoE(16, 8, 4, 1), {**router, **change}, 4, dispatcher=_OneRank())


def test_constructors_check_the_dispatcher_and_flags() -> None:
    # A dispatcher that is not one failed in from_moe with an AttributeError about the object
    # (its `rank`); a string `copy` was truthy (copied where declined).
    moe = MoE(16, 8, 4, 2)
    router = dict(router_weight=torch.randn(4, 16), e_score_correction_bias=None, top_k=2,
                  scoring="softmax", renormalize=True, n_group=1, topk_group=1,
                  routed_scaling_factor=1.0, router_fp32=False)
    dispatcher = r"dispatcher must be a Dispatcher \(rank, world_size, .*\) or None; got str"
    for build in (lambda: ExpertParallelMoE.from_moe(moe, dispatcher="all_to_all"),
                  lambda: ExpertParallelMoE.from_state_dict(moe.state_dict(), 2,
                                                            dispatcher="all_to_all"),
                  lambda: ExpertParallelMoE(MoE(16, 8, 4, 1), router, 4,
                                            dispatcher="all_to_all")):
        with pytest.raises(TypeError, match=dispatcher):
            build()
    with pytest.raises(TypeError, match="copy must be a bool; got 'no'"):
        ExpertParallelMoE.from_moe(moe, dispatcher=_OneRank(), copy="no")
    with pytest.raises(TypeError, match="check_replicated must be a bool; got 'no'"):
        ExpertParallelMoE.from_moe(moe, dispatcher=_OneRank(), check_replicated="no")
    ep = ExpertParallelMoE.from_moe(moe, dispatcher=_OneRank(), copy=0, check_replicated=1)
    assert ep.local.gate_up_proj.data_ptr() == moe.gate_up_proj.data_ptr()  # (not copied)


def test_correction_bias_keeps_float32_under_casts() -> None:
    # As MoE's: module.to(torch.bfloat16) leaves the selection-only bias float32 (a bf16 one
    # chooses other experts), so the cast layer routes as the float32 one does.
    moe = near_tie_sigmoid_moe(16, 8)
    ep = ExpertParallelMoE.from_moe(moe, dispatcher=_OneRank(), check_replicated=False)
    x = torch.randn(256, 16).bfloat16()
    _, want = ep.route(x.float())
    ep = ep.to(torch.bfloat16)
    assert ep.e_score_correction_bias.dtype == torch.float32
    assert ep.router_weight.dtype == ep.local.gate_up_proj.dtype == torch.bfloat16
    _, ids = ep.route(x)
    assert torch.equal(ids.sort(-1)[0], want.sort(-1)[0])


def test_route_takes_forward_input_and_names_bad_input() -> None:
    moe = MoE(16, 8, 8, 2)
    ep = ExpertParallelMoE.from_moe(moe, dispatcher=_OneRank(), check_replicated=False)
    x = torch.randn(2, 3, 16)
    w, i = ep.route(x)
    probs = F.linear(x.reshape(-1, 16).double(), moe.router_weight.double()).softmax(-1)
    want_w, want_i = probs.topk(2, dim=-1)
    assert torch.equal(i, want_i)
    torch.testing.assert_close(w.double(), want_w / want_w.sum(-1, keepdim=True))
    with pytest.raises(ValueError, match=r"hidden_states must be \(\.\.\., H\) = \(\.\.\., 16\)"):
        ep.route(torch.randn(4, 15))


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided", "jagged"])
def test_forward_and_route_name_a_nested_input(layout: torch.layout) -> None:
    # A nested tensor (torch.nested) has no sizes of its own: named, as MoE names it, rather
    # than torch's internal error from the shape check.
    ep = ExpertParallelMoE.from_moe(MoE(16, 8, 4, 2), dispatcher=_OneRank(),
                                    check_replicated=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (the strided layout is a prototype)
        x = torch.nested.nested_tensor([torch.randn(3, 16), torch.randn(5, 16)], layout=layout)
    for call in (ep, ep.route):
        with pytest.raises(TypeError, match=r"^hidden_states must be a dense \(strided\) "
                                            r"tensor; got a nested tensor \(torch\.nested\)"):
            call(x)


class _Local(_OneRank):
    """A Dispatcher of one rank that dispatches to itself (no process group)."""

    def dispatch(self, x, topk_ids, topk_weights, num_experts, *,  # type: ignore[no-untyped-def]
                 during=None):
        extra = during() if during is not None else None
        return Dispatched(x, topk_ids, topk_weights.float(), None, None), extra

    def combine(self, y, handle):  # type: ignore[no-untyped-def]
        return y


def test_compiled_backward_raises_as_moe_does() -> None:
    # Under torch.compile the forward's result (computed under no_grad) was not linked to the
    # input: the layer's gradient silently missing, as in eager before.
    moe = MoE(16, 8, 4, 2, shared_intermediate_size=8)
    ep = ExpertParallelMoE.from_moe(moe, dispatcher=_Local(), check_replicated=False)
    x = torch.randn(3, 16, requires_grad=True)
    for layer in (ep, torch.compile(ep)):
        y = layer(x)
        torch.testing.assert_close(y.detach(), moe(x).detach())
        with pytest.raises(RuntimeError, match="inference-only"):
            (x + y).sum().backward()
    with torch.no_grad():
        assert not torch.compile(ep)(x).requires_grad


def test_float64_refused_before_the_dispatch_as_moe_does() -> None:
    # MoE refuses a layer cast to float64 and float64 tokens with a TypeError naming the
    # dtypes it runs in; the cast expert-parallel layer sent float64 tokens into the dispatch
    # to fail in the experts' GEMM.

    class Refusing(_OneRank):
        def dispatch(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            raise AssertionError("a refused input reached the dispatch")

    moe = MoE(16, 8, 4, 2)
    ep = ExpertParallelMoE.from_moe(moe, dispatcher=Refusing(), check_replicated=False)
    x = torch.randn(3, 16)
    dtypes = "torch.bfloat16, torch.float16 or torch.float32"
    for layer in (moe.double(), ep.double()):
        with pytest.raises(TypeError, match=f"weights are torch.float64; .*runs in {dtypes}"):
            layer(x)
    for layer in (moe.float(), ep.float()):
        with pytest.raises(TypeError, match=f"hidden_states must be {dtypes}; got torch.float64"):
            layer(x.double())


@pytest.mark.parametrize(
    "name,value,pattern",
    [
        # another E: ids past the experts were dropped silently (a wrong output, no error)
        ("router_weight", torch.zeros(5, 16), r"router_weight must be \(E, H\) = \(4, 16\)"),
        # another H: F.linear's RuntimeError
        ("router_weight", torch.zeros(4, 15), r"router_weight must be \(E, H\) = \(4, 16\)"),
        ("router_weight", torch.zeros(4, 16, device="meta"),
         "the layer's router_weight is on meta but its expert weights are on cpu"),
        ("local.down_proj", torch.zeros(3, 16, 8),
         r"the layer's down_proj must be \(E, H, I\) = \(4, 16, 8\)"),
    ],
)
def test_weights_assigned_after_construction_refused_before_the_dispatch(
        name: str, value: torch.Tensor, pattern: str) -> None:
    class Refusing(_OneRank):
        def dispatch(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            raise AssertionError("a refused layer reached the dispatch")

    ep = ExpertParallelMoE.from_moe(MoE(16, 8, 4, 2), dispatcher=Refusing(),
                                    check_replicated=False)
    owner, _, attr = name.rpartition(".")
    setattr(ep.get_submodule(owner), attr, torch.nn.Parameter(value, requires_grad=False))
    for call in (ep, ep.route):
        with pytest.raises(ValueError, match=pattern):
            call(torch.randn(3, 16))


def test_from_moe_and_from_state_dict_carry_fused(monkeypatch: pytest.MonkeyPatch) -> None:
    # MoE's `fused` picks the fused expert path (True: the fused ops' torch backend on the
    # CPU); the expert-parallel layer dropped it and always ran the unfused GEMMs.
    import moe_gemm.layers.fused_experts as fused_experts

    calls: list[int] = []
    real = fused_experts.fused_grouped_mm
    monkeypatch.setattr(fused_experts, "fused_grouped_mm",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randn(5, 16)
    for fused in (True, False, None):  # None: where the Hopper kernel runs, not on the CPU
        moe = MoE(16, 8, 4, 2, fused=fused)
        want = moe(x)
        sd = {"gate.weight": moe.router_weight, "experts.gate_up_proj": moe.gate_up_proj,
              "experts.down_proj": moe.down_proj}
        for ep in (ExpertParallelMoE.from_moe(moe, dispatcher=_Local(), check_replicated=False),
                   ExpertParallelMoE.from_state_dict(sd, 2, dispatcher=_Local(), fused=fused,
                                                     check_replicated=False)):
            assert ep.local.fused is fused
            calls.clear()
            torch.testing.assert_close(ep(x), want)
            assert len(calls) == (2 if fused else 0)  # the two fused GEMMs


def test_from_moe_equals_moe_after_the_activation_is_reassigned() -> None:
    # MoE's shared expert kept its construction-time activation after `moe.activation` was
    # reassigned, while from_moe built the shard's shared expert with the new one: the two
    # layers disagreed. Both follow the attribute now, against a float64 reference.
    moe = MoE(16, 8, 4, 2, shared_intermediate_size=8, shared_expert_gate=True)
    x = torch.randn(23, 16) * 3
    for act in ("gelu", torch.tanh):
        moe.activation = act
        ep = ExpertParallelMoE.from_moe(moe, dispatcher=_Local(), check_replicated=False)
        want = naive_moe(moe, x)
        assert_close_to_ref(moe(x), want, name=f"MoE, activation {act!r}")
        assert_close_to_ref(ep(x), want, name=f"ExpertParallelMoE, activation {act!r}")
        ep.local.activation = "silu"  # the shard's own layer: both of its parts switch
        moe.activation = "silu"
        assert_close_to_ref(ep(x), naive_moe(moe, x), name="shard switched to silu")
    # A shared expert's activation set apart from the layer's is carried as it is.
    moe.shared_experts.activation = "gelu_tanh"
    ep = ExpertParallelMoE.from_moe(moe, dispatcher=_Local(), check_replicated=False)
    assert ep.local.shared_experts.activation == "gelu_tanh" and ep.local.activation == "silu"
    torch.testing.assert_close(ep(x), moe(x))


def test_from_moe_carries_the_router_jitter_and_the_mode() -> None:
    # MoE's router jitter (Mixtral's, training mode only) was not a routing option of the
    # expert-parallel layer: from_moe of a training-mode layer routed unjittered tokens.
    moe = MoE(16, 8, 4, 2, router_jitter_noise=0.2, shared_intermediate_size=8)
    x = torch.randn(3, 5, 16)
    for training in (True, False):
        moe.train(training)
        ep = ExpertParallelMoE.from_moe(moe, dispatcher=_Local(), check_replicated=False)
        assert ep.router_jitter_noise == 0.2 and ep.training is training
        seed = int(torch.randint(1 << 30, ()))
        torch.manual_seed(seed)
        want = moe(x)
        torch.manual_seed(seed)
        torch.testing.assert_close(ep(x), want)
    # Read from a state dict's options too; a router mapping without it means no jitter.
    ep = ExpertParallelMoE.from_state_dict(moe.state_dict(), 2, router_jitter_noise=0.2,
                                           dispatcher=_Local(), check_replicated=False)
    assert ep.router_jitter_noise == 0.2
    router = dict(router_weight=torch.randn(4, 16), e_score_correction_bias=None, top_k=2,
                  scoring="softmax", renormalize=True, n_group=1, topk_group=1,
                  routed_scaling_factor=1.0, router_fp32=False)
    assert ExpertParallelMoE(MoE(16, 8, 4, 1), router, 4,
                             dispatcher=_OneRank()).router_jitter_noise == 0.0
    with pytest.raises(ValueError, match="router_jitter_noise must be a finite float >= 0"):
        ExpertParallelMoE(MoE(16, 8, 4, 1), {**router, "router_jitter_noise": -1.0}, 4,
                          dispatcher=_OneRank())


def test_constructors_under_a_float64_default_dtype() -> None:
    # MoE refuses dtype=None under a float64 default (its forward cannot run float64): the
    # expert-parallel constructors' own meta-device probes name a dtype, so they still build
    # a shard of a float32 layer.
    moe = MoE(16, 8, 4, 2, scoring="sigmoid", n_group=2, topk_group=1)
    x = torch.randn(5, 16)
    want = moe(x)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        for ep in (ExpertParallelMoE.from_moe(moe, dispatcher=_Local(), check_replicated=False),
                   ExpertParallelMoE.from_state_dict(moe.state_dict(), 2, dispatcher=_Local(),
                                                     scoring="sigmoid", n_group=2, topk_group=1,
                                                     check_replicated=False)):
            torch.testing.assert_close(ep(x), want)
    finally:
        torch.set_default_dtype(before)


def test_own_state_dict_round_trip_on_one_process() -> None:
    # An ExpertParallelMoE's own state_dict was a KeyError in from_state_dict (the experts
    # under "local." matched no checkpoint layout).
    x = torch.randn(9, 128)
    # FP8 experts keep their scales: the same layer, bit for bit.
    fp8 = MoE(128, 128, 4, 2).quantize_fp8("block")
    ep = ExpertParallelMoE.from_moe(fp8, dispatcher=_Local(), check_replicated=False)
    got = ExpertParallelMoE.from_state_dict(ep.state_dict(), 2, dispatcher=_Local(),
                                            check_replicated=False)
    assert sorted(got.state_dict()) == sorted(ep.state_dict())
    torch.testing.assert_close(got(x), fp8(x), rtol=0, atol=0)
    # A module activation's slope, which only the state dict carries, is loaded into the
    # module passed (a fresh PReLU's is 0.25), shared expert included.
    slope = 0.5 + torch.rand(()).item() / 4
    moe = MoE(128, 64, 4, 2, activation=torch.nn.PReLU(init=slope), shared_intermediate_size=32)
    ep = ExpertParallelMoE.from_moe(moe, dispatcher=_Local(), check_replicated=False)
    got = ExpertParallelMoE.from_state_dict(ep.state_dict(), 2, activation=torch.nn.PReLU(),
                                            dispatcher=_Local(), check_replicated=False)
    w64 = torch.tensor([slope], dtype=torch.float32).double()
    assert_close_to_ref(got(x), naive_moe(moe, x, act=lambda v: F.prelu(v, w64)),
                        name="round trip, PReLU")
    # A key this layer does not use is refused (strict) or ignored, as in MoE.from_state_dict.
    extra = {**ep.state_dict(), "router_bias": torch.zeros(4)}
    with pytest.raises(ValueError, match=r"does not use .*\['router_bias'\]"):
        ExpertParallelMoE.from_state_dict(extra, 2, activation=torch.nn.PReLU(),
                                          dispatcher=_Local(), check_replicated=False)
    got = ExpertParallelMoE.from_state_dict(extra, 2, activation=torch.nn.PReLU(), strict=False,
                                            dispatcher=_Local(), check_replicated=False)
    torch.testing.assert_close(got(x), ep(x))
    # A state dict saved by a group of another size holds another share of the experts.
    with pytest.raises(ValueError, match=r"holds 4 of 4 experts .* rank 0 of 2 holds 2"):
        ExpertParallelMoE.from_state_dict(ep.state_dict(), 2, activation=torch.nn.PReLU(),
                                          dispatcher=_LocalShare(2))


def test_from_moe_keeps_a_module_activation_registered_once() -> None:
    moe = MoE(16, 8, 4, 2, activation=torch.nn.PReLU(init=0.1), shared_intermediate_size=8)
    ep = ExpertParallelMoE.from_moe(moe, dispatcher=_Local(), check_replicated=False)
    assert ep.local.shared_experts.activation is ep.local.activation is moe.activation
    assert [k for k in ep.state_dict() if "activation" in k] == ["local.activation.weight"]
    x = torch.randn(7, 16)
    torch.testing.assert_close(ep(x), moe(x))


class _LocalShare(_OneRank):
    """Rank 0 of two, without a process group: it receives every token but keeps only the
    slots of its experts [0, E / 2) (the others marked -1, as other ranks' slots are), with
    their count."""

    world_size = 2

    def __init__(self, local_experts: int) -> None:
        self.local_experts = local_experts

    def dispatch(self, x, topk_ids, topk_weights, num_experts, *,  # type: ignore[no-untyped-def]
                 during=None):
        extra = during() if during is not None else None
        here = topk_ids < self.local_experts
        ids = torch.where(here, topk_ids, -1)
        w = torch.where(here, topk_weights.float(), 0.0)
        return Dispatched(x, ids, w, int(here.sum()), None), extra

    def combine(self, y, handle):  # type: ignore[no-untyped-def]
        return y


@pytest.mark.parametrize("gather", ["1", "0"], ids=["gather-in-kernel", "index-select"])
def test_fused_experts_compute_only_the_valid_slots(monkeypatch: pytest.MonkeyPatch,
                                                    gather: str) -> None:
    # The fused path ignored Dispatched.num_valid_slots: its GEMMs sized and wrote a row per
    # received slot (here 6 x 4 = 24) where the unfused path gathers the valid ones. Now both
    # compute those alone; the other ranks' slots add nothing, with every uninitialized buffer
    # NaN-filled (deterministic mode), so a row that is read but never written shows.
    import moe_gemm.layers.fused_experts as fused_experts

    monkeypatch.setenv(fused_experts.GATHER_ENV, gather)
    rows: list[int] = []
    real = fused_experts.fused_grouped_mm
    monkeypatch.setattr(fused_experts, "fused_grouped_mm",
                        lambda *a, **k: (lambda y: rows.append(y.shape[0]) or y)(real(*a, **k)))
    E, k = 8, 4
    moe = MoE(16, 12, E // 2, k, fused=True)  # this rank's half of the experts
    ep = ExpertParallelMoE(moe, {**_router_full(E), "top_k": k}, E,
                           dispatcher=_LocalShare(E // 2))
    x = torch.randn(6, 16)
    w, ids = ep.route(x)
    d, _ = ep.dispatcher.dispatch(x, ids, w, E)
    assert 0 < d.num_valid_slots < 6 * k
    want = naive_experts(x, d.local_ids, d.weights, moe.gate_up_proj, moe.down_proj)
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        for fused in (True, False):
            moe.fused = fused
            rows.clear()
            assert_close_to_ref(ep.experts(d), want, name=f"fused={fused}")
            assert rows == ([d.num_valid_slots] * 2 if fused else [])
        # Without a count (static splits), every received slot, as the unfused path does.
        moe.fused = True
        rows.clear()
        d.num_valid_slots = None
        assert_close_to_ref(ep.experts(d), want, name="fused, count unknown")
        assert rows == [6 * k, 6 * k]
    finally:
        torch.use_deterministic_algorithms(deterministic)


def _router_full(E: int) -> dict:
    return dict(router_weight=torch.randn(E, 16), e_score_correction_bias=None, top_k=2,
                scoring="softmax", renormalize=True, n_group=1, topk_group=1,
                routed_scaling_factor=1.0, router_fp32=False)


@pytest.mark.parametrize("granularity", ["block", "row"])
def test_fp8_experts_compute_only_the_valid_slots(monkeypatch: pytest.MonkeyPatch,
                                                  granularity: str) -> None:
    # The FP8 experts sized and wrote a row per received slot (here 6 x 4 = 24) where the
    # 16-bit path gathers the valid ones; now they compute those alone, with every
    # uninitialized buffer NaN-filled (deterministic mode), so a row read but never written
    # shows; without a count, every slot as before, to the same result.
    import moe_gemm.layers.experts_fp8 as experts_fp8

    rows: list[int] = []
    real = experts_fp8.scaled_grouped_mm
    monkeypatch.setattr(experts_fp8, "scaled_grouped_mm",
                        lambda *a, **k: (lambda y: rows.append(y.shape[0]) or y)(real(*a, **k)))
    E, k = 8, 4
    moe = MoE(128, 128, E // 2, k).quantize_fp8(granularity)  # this rank's half
    router = {**_router_full(E), "top_k": k,
              "router_weight": torch.randn(E, 128)}
    ep = ExpertParallelMoE(moe, router, E, dispatcher=_LocalShare(E // 2))
    x = torch.randn(6, 128)
    w, ids = ep.route(x)
    d, _ = ep.dispatcher.dispatch(x, ids, w, E)
    assert 0 < d.num_valid_slots < 6 * k
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        got = ep.experts(d)
        assert rows == [d.num_valid_slots] * 2
        rows.clear()
        d.num_valid_slots = None
        every = ep.experts(d)
        assert rows == [6 * k] * 2
    finally:
        torch.use_deterministic_algorithms(deterministic)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, every, rtol=0, atol=0)


class _Rank(_OneRank):
    """Rank `rank` of `world`, for the constructors (no process group)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world_size = rank, world


def test_another_ranks_own_state_dict_is_refused() -> None:
    # It loaded without a word, its experts answering for this rank's expert ids: 0.9-1.4
    # relative error (a restart that remapped ranks).
    moe = MoE(16, 8, 8, 2)
    sds = [ExpertParallelMoE.from_moe(moe, dispatcher=_Rank(r, 2), check_replicated=False
                                      ).state_dict() for r in range(2)]
    for r in range(2):
        got = ExpertParallelMoE.from_state_dict(sds[r], 2, dispatcher=_Rank(r, 2),
                                                check_replicated=False)
        torch.testing.assert_close(got.local.gate_up_proj, moe.gate_up_proj[4 * r:4 * r + 4])
        with pytest.raises(ValueError, match=rf"holds rank {r}'s experts of the 2-rank .* "
                                             rf"rank {1 - r} must load its own"):
            ExpertParallelMoE.from_state_dict(sds[r], 2, dispatcher=_Rank(1 - r, 2),
                                              check_replicated=False)
    # load_state_dict too (it loaded another rank's experts silently); its own loads, also
    # under a prefix, as a submodule of a model.
    ep = ExpertParallelMoE.from_moe(MoE(16, 8, 8, 2), dispatcher=_Rank(0, 2),
                                    check_replicated=False)
    with pytest.raises(ValueError, match="holds rank 1's experts .* rank 0 must load its own"):
        ep.load_state_dict(sds[1])
    ep.load_state_dict(sds[0])
    torch.testing.assert_close(ep.local.gate_up_proj, moe.gate_up_proj[:4])
    model = torch.nn.Sequential(ep)
    with pytest.raises(ValueError, match="holds rank 1's experts"):
        model.load_state_dict({"0." + k: v for k, v in sds[1].items()})
    model.load_state_dict({"0." + k: v for k, v in sds[0].items()})


def _router_of(moe: MoE, **change) -> dict:
    names = ("top_k", "scoring", "renormalize", "n_group", "topk_group",
             "routed_scaling_factor", "router_fp32", "router_jitter_noise")
    return {"router_weight": moe.router_weight,
            "e_score_correction_bias": moe.e_score_correction_bias,
            **{n: getattr(moe, n) for n in names}, **change}


def test_constructor_takes_the_routing_options_as_moe_resolves_them() -> None:
    # router_fp32=None is True for sigmoid scoring in MoE; kept as None the shard routed in
    # the weights' dtype (bf16 here: other experts picked than the layer's). 2 and 2.0 are one
    # scaling factor on every rank.
    moe = MoE(64, 16, 16, 4, scoring="sigmoid", n_group=4, topk_group=2,
              routed_scaling_factor=2.0, dtype=torch.bfloat16)
    ep = ExpertParallelMoE(moe, _router_of(moe, router_fp32=None, routed_scaling_factor=2),
                           16, dispatcher=_Local(), check_replicated=False)
    assert ep.router_fp32 is True and type(ep.routed_scaling_factor) is float
    x = torch.randn(50, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(ep(x), moe(x))


@pytest.mark.parametrize("name,value,exc,pattern", [
    ("top_k", 0, ValueError, "top_k must be an int >= 1"),
    ("top_k", 9, ValueError, r"top_k must be in \[1, num_experts=8\]"),
    ("top_k", "2", TypeError, "top_k must be an int"),
    ("scoring", "soft", ValueError, "scoring must be"),
    ("renormalize", "no", TypeError, "renormalize must be a bool"),
    ("n_group", 0, ValueError, "n_group must be an int >= 1"),
    ("routed_scaling_factor", float("inf"), ValueError, "routed_scaling_factor must be finite"),
    ("router_fp32", "yes", TypeError, "router_fp32 must be a bool or None"),
    ("router_jitter_noise", -0.1, ValueError, "router_jitter_noise"),
    ("hidden_size", 0, ValueError, "hidden_size must be an int >= 1"),
])
def test_routing_options_are_checked_when_assigned(name: str, value: object,
                                                     exc: type[Exception], pattern: str) -> None:
    # They were plain attributes: a bad one failed only inside the next forward (after the
    # other ranks had entered the dispatch), where MoE's are refused at the assignment.
    moe = MoE(16, 8, 4, 2)  # rank 0's 4 of 8 experts
    ep = ExpertParallelMoE(moe, _router_of(_full_moe(3, torch.float32)), 8,
                           dispatcher=_LocalShare(4), check_replicated=False)
    before = getattr(ep, name)
    with pytest.raises(exc, match=pattern):
        setattr(ep, name, value)
    assert getattr(ep, name) == before  # the layer unchanged


def test_top_k_is_bounded_by_all_ranks_experts_and_router_fp32_follows_the_scoring() -> None:
    moe = MoE(16, 8, 4, 2)  # rank 0's 4 of 8 experts: top_k 6 is valid for the layer
    ep = ExpertParallelMoE(moe, _router_of(_full_moe(3, torch.float32)), 8,
                           dispatcher=_LocalShare(4), check_replicated=False)
    ep.top_k = 6
    assert ep.top_k == 6 and ep.router_fp32 is False
    ep.router_fp32 = None  # None follows the scoring, as in MoE
    ep.scoring = "sigmoid"
    assert ep.router_fp32 is True
    weights, ids = ep.route(torch.randn(5, 16))
    assert ids.shape == (5, 6) and int(ids.max()) < 8


def test_constructor_refuses_a_bias_of_softmax_scoring_and_names_missing_options() -> None:
    moe = MoE(16, 8, 4, 2)
    with pytest.raises(ValueError, match="correction_bias .*sigmoid"):
        ExpertParallelMoE(moe, _router_of(moe, e_score_correction_bias=torch.zeros(4)), 4,
                          dispatcher=_OneRank())
    router = _router_of(moe)
    del router["router_fp32"], router["top_k"]
    with pytest.raises(ValueError, match="router is missing 'top_k', 'router_fp32'"):
        ExpertParallelMoE(moe, router, 4, dispatcher=_OneRank())


def test_rank_text_names_global_ranks_of_a_subgroup(monkeypatch: pytest.MonkeyPatch) -> None:
    # Messages quoted the ranks within the group: with groups [0, 2] and [1, 3], global rank 2
    # refusing its input read "rank(s) [1] refused" on rank 0.
    from moe_gemm.layers import dispatch

    assert dispatch.rank_text(None, [1]) == "[1]"  # (the default group: the world's ranks)
    monkeypatch.setattr(dispatch.dist, "is_initialized", lambda: True)
    sub = object()
    monkeypatch.setattr(dispatch.dist, "get_global_rank", lambda g, r: 2 * r if g is sub else r)
    assert dispatch.rank_text(sub, [0, 1]) == "[0, 1] (global ranks [0, 2])"
    assert dispatch.rank_text(object(), [1]) == "[1]"  # (numbered as the world)

    def not_member(g, r):
        raise ValueError("not in the group")

    monkeypatch.setattr(dispatch.dist, "get_global_rank", not_member)
    assert dispatch.rank_text(sub, [1]) == "[1]"
