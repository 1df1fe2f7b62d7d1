"""The routers' top-k as one kernel each (layers/routing calls these first):
- softmax_topk: softmax(logits) in fp32, the k largest, best first, renormalised or not;
- sigmoid_grouped_topk: sigmoid scores, a selection bias, group-limited top-k (DeepSeek-V3),
  weights renormalised (+1e-20) or not, times the scaling factor.

On an sm90a GPU with the CuTe DSL, for 1 to 1024 experts, up to 32 slots and 32 groups
(kernels/sm90/router_topk.py: one warp per token reads its row once); ties then go to the
lower expert id (torch.topk leaves them unspecified). Otherwise (MOE_GEMM_ROUTER=torch, while
torch.compile traces, where the logits need a gradient: the kernel has no backward) these
return None and the caller runs its torch ops. Why a kernel: softmax, topk and the
renormalisation are four to six launches over the logits; on an H200 (2026-11-29, CUDA
graphs) the kernel took 25 us against 134 for the torch ops at 16384 tokens and 128 experts
(top-8), 33 against 251 with 256 experts, 3 against 14-19 us for one token.
"""

from __future__ import annotations

import functools

import torch

from moe_gemm.env import env_value
from moe_gemm.kernels.sm90.constants import ROUTER_MAX_E, ROUTER_MAX_GROUPS, ROUTER_MAX_K
from moe_gemm.ops import launch_resources

ROUTER_ENV = "MOE_GEMM_ROUTER"  # "torch": torch ops even where the kernel runs
_KERNEL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def softmax_topk(logits: torch.Tensor, k: int,
                 renormalize: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(weights [T, k] float32, ids [T, k] int64) from the kernel, or None where it does not
    run (see the module docstring). logits: [T, E], checked by the caller; 1 <= k <= E."""
    if not _kernel_ok(logits, k):
        return None
    T, E = logits.shape
    weights = torch.empty(T, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, k, dtype=torch.int64, device=logits.device)
    if T:
        _kernel(logits.dtype, E, k, bool(renormalize))(logits, weights, ids)
    return weights, ids


def sigmoid_grouped_topk(logits: torch.Tensor, bias: torch.Tensor | None, k: int,
                         n_group: int, topk_group: int, scale: float,
                         renormalize: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(weights [T, k] float32, ids [T, k] int64) from the kernel, or None where it does not
    run. Arguments checked by the caller (layers/routing.sigmoid_grouped_topk)."""
    if not _kernel_ok(logits, k) or n_group > ROUTER_MAX_GROUPS:
        return None
    if bias is not None and bias.requires_grad and torch.is_grad_enabled():
        return None
    T, E = logits.shape
    weights = torch.empty(T, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, k, dtype=torch.int64, device=logits.device)
    if T:
        b = (launch_resources._small("router_bias", logits.device, torch.float32, (1,))
             if bias is None else bias.detach().float().contiguous())
        _group_kernel(logits.dtype, E, k, n_group, topk_group, bool(renormalize),
                      bias is not None)(logits, b, weights, ids, float(scale))
    return weights, ids


def _kernel_ok(logits: torch.Tensor, k: int) -> bool:
    if logits.device.type != "cuda" or torch.compiler.is_compiling() or not _takes(logits, k):
        return False
    from moe_gemm.capability import cute_problem

    return cute_problem(logits.device) is None


def _takes(logits: torch.Tensor, k: int) -> bool:
    """Whether the kernel takes these logits and k (any device; the switch and autograd)."""
    if (env_value(ROUTER_ENV) == "torch"
            or (logits.requires_grad and torch.is_grad_enabled())):
        return False
    if logits.dtype not in _KERNEL_DTYPES or logits.dim() != 2:
        return False
    E = logits.shape[1]
    return 1 <= E <= ROUTER_MAX_E and 1 <= k <= min(E, ROUTER_MAX_K) and logits.stride(1) == 1


@functools.lru_cache(maxsize=32)
def _kernel(dtype: torch.dtype, E: int, k: int, renormalize: bool):
    from moe_gemm.kernels.sm90.router_topk import RouterTopkCompileKey, compile_router_topk
    from moe_gemm.ops import kernel_cache as cache

    key = RouterTopkCompileKey(_KERNEL_DTYPES[dtype], E, k, renormalize)
    return cache.get_or_compile(key, key.name, lambda: compile_router_topk(key))


@functools.lru_cache(maxsize=32)
def _group_kernel(dtype: torch.dtype, E: int, k: int, n_group: int, topk_group: int,
                  renormalize: bool, has_bias: bool):
    from moe_gemm.kernels.sm90.router_topk import GroupTopkCompileKey, compile_group_topk
    from moe_gemm.ops import kernel_cache as cache

    key = GroupTopkCompileKey(_KERNEL_DTYPES[dtype], E, k, n_group, topk_group, renormalize,
                              has_bias)
    return cache.get_or_compile(key, key.name, lambda: compile_group_topk(key))
