"""moe_gemm: many GEMMs in one persistent launch on Hopper, with a torch fallback everywhere.

Public API:
    grouped_gemm(a, b)        general grouped GEMM, D_i = A_i @ B_i, any sizes per problem
    grouped_mm(x, w, offs)    MoE expert GEMM (torch.nn.functional.grouped_mm's 2D x 3D form);
                              grouped_mm(x, w) is the batched 3D x 3D form
    fused_grouped_mm(...)     grouped_mm with the MoE layer's token gather, bias, gated
                              activation and routing weights fused into the kernel
    interleave_gate_up(w)     a gate-up weight repacked for the interleaved gate layout
    GroupedGemmPlan(a, b)     grouped_gemm prepared once; each call checks and launches
    grouped_mm_masked(x, w, masked_m)   the batched form on each problem's first
                              masked_m[g] rows (DeepGEMM's masked layout; FP8:
                              scaled_grouped_mm_masked; with the fused bias, gate and row
                              weights: fused_grouped_mm_masked)
    scaled_grouped_mm(x, w, scale_a, scale_b, offs)   the FP8 expert GEMM (block-wise
                              1x128 / 128x128, row-wise or per-tensor scales); and
                              scaled_grouped_gemm for lists
    quantize_fp8_per_token_group / _per_block / _per_row / _per_tensor, dequantize_fp8
    GemmConfig                backend / schedule / visitor / tile choices (frozen)
    MoE                       an inference MoE layer (routing + fused expert FFN) on grouped_mm
    ExpertParallelMoE         the MoE layer with its experts split over a process group

`import moe_gemm` is light: torch and the ops load on first use of any public name (PEP 562
module __getattr__), so that `moe-gemm --help`, `--version` and tools that only read the
version do not pay the ~1.5-4 s of importing torch. After the first use the package is exactly
what an eager import would have made (every submodule the ops import is an attribute).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from moe_gemm._version import __version__
from moe_gemm.integrations import register_transformers_lazily

if TYPE_CHECKING:  # what static tools see; at run time these come from _load()
    from moe_gemm.config import GemmConfig
    from moe_gemm.layers.dispatch import AllToAllDispatcher, Dispatcher
    from moe_gemm.layers.expert_parallel import ExpertParallelMoE
    from moe_gemm.layers.gate_activations import ClampedSiLU, ClampedSwiGLU, PostClampedSiLU
    from moe_gemm.layers.moe import MoE, moe_experts, moe_forward
    from moe_gemm.layers.routing import (
        ExpertPermutation,
        hash_topk,
        permute_by_expert,
        sigmoid_grouped_topk,
        softmax_grouped_topk,
        softmax_topk,
        sqrtsoftplus_grouped_topk,
    )
    from moe_gemm.ops.api import GroupedGemmPlan, grouped_gemm, grouped_mm
    from moe_gemm.ops.fused import fused_grouped_mm, interleave_gate_up
    from moe_gemm.ops.fused_masked import fused_grouped_mm_masked
    from moe_gemm.ops.masked import grouped_mm_masked, scaled_grouped_mm_masked
    from moe_gemm.ops.quantize import (
        dequantize_fp8,
        quantize_fp8_per_block,
        quantize_fp8_per_row,
        quantize_fp8_per_tensor,
        quantize_fp8_per_token_group,
    )
    from moe_gemm.ops.scaled import scaled_grouped_gemm, scaled_grouped_mm

# `model.set_experts_implementation("moe_gemm")` works once transformers' MoE module loads
# (the hook imports nothing heavy until then).
register_transformers_lazily()

__all__ = [
    "AllToAllDispatcher",
    "ClampedSiLU",
    "ClampedSwiGLU",
    "Dispatcher",
    "ExpertParallelMoE",
    "ExpertPermutation",
    "GemmConfig",
    "GroupedGemmPlan",
    "MoE",
    "PostClampedSiLU",
    "__version__",
    "dequantize_fp8",
    "fused_grouped_mm",
    "fused_grouped_mm_masked",
    "grouped_gemm",
    "grouped_mm",
    "grouped_mm_masked",
    "hash_topk",
    "interleave_gate_up",
    "moe_experts",
    "moe_forward",
    "permute_by_expert",
    "quantize_fp8_per_block",
    "quantize_fp8_per_row",
    "quantize_fp8_per_tensor",
    "quantize_fp8_per_token_group",
    "scaled_grouped_gemm",
    "scaled_grouped_mm",
    "scaled_grouped_mm_masked",
    "sigmoid_grouped_topk",
    "softmax_grouped_topk",
    "softmax_topk",
    "sqrtsoftplus_grouped_topk",
]

# 0: not loaded, 1: loading (a module below touching `moe_gemm.X` sees what is there so far,
# as with an eager circular import), 2: loaded.
_load_lock = threading.RLock()
_state = 0


def _load() -> None:
    """Import the public API into this module's namespace (once; thread-safe)."""
    global _state
    with _load_lock:
        if _state:
            return
        _state = 1
        try:
            from moe_gemm.config import GemmConfig
            from moe_gemm.layers.dispatch import AllToAllDispatcher, Dispatcher
            from moe_gemm.layers.expert_parallel import ExpertParallelMoE
            from moe_gemm.layers.gate_activations import ClampedSiLU, ClampedSwiGLU, PostClampedSiLU
            from moe_gemm.layers.moe import MoE, moe_experts, moe_forward
            from moe_gemm.layers.routing import (
                ExpertPermutation,
                hash_topk,
                permute_by_expert,
                sigmoid_grouped_topk,
                softmax_grouped_topk,
                softmax_topk,
                sqrtsoftplus_grouped_topk,
            )
            from moe_gemm.ops.api import GroupedGemmPlan, grouped_gemm, grouped_mm
            from moe_gemm.ops.custom_ops import share_flop_formulas
            from moe_gemm.ops.fused import fused_grouped_mm, interleave_gate_up
            from moe_gemm.ops.fused_masked import fused_grouped_mm_masked
            from moe_gemm.ops.masked import grouped_mm_masked, scaled_grouped_mm_masked
            from moe_gemm.ops.quantize import (
                dequantize_fp8,
                quantize_fp8_per_block,
                quantize_fp8_per_row,
                quantize_fp8_per_tensor,
                quantize_fp8_per_token_group,
            )
            from moe_gemm.ops.scaled import scaled_grouped_gemm, scaled_grouped_mm

            # (a first use inside `with FlopCounterMode()`: that counter predates the ops)
            share_flop_formulas()
        except BaseException:
            _state = 0  # e.g. torch missing: the next use raises the same ImportError again
            raise
        globals().update(
            AllToAllDispatcher=AllToAllDispatcher,
            ClampedSiLU=ClampedSiLU,
            ClampedSwiGLU=ClampedSwiGLU,
            PostClampedSiLU=PostClampedSiLU,
            Dispatcher=Dispatcher,
            ExpertParallelMoE=ExpertParallelMoE,
            ExpertPermutation=ExpertPermutation,
            GemmConfig=GemmConfig,
            GroupedGemmPlan=GroupedGemmPlan,
            MoE=MoE,
            grouped_gemm=grouped_gemm,
            grouped_mm=grouped_mm,
            grouped_mm_masked=grouped_mm_masked,
            fused_grouped_mm=fused_grouped_mm,
            fused_grouped_mm_masked=fused_grouped_mm_masked,
            interleave_gate_up=interleave_gate_up,
            moe_experts=moe_experts,
            moe_forward=moe_forward,
            permute_by_expert=permute_by_expert,
            sigmoid_grouped_topk=sigmoid_grouped_topk,
            softmax_grouped_topk=softmax_grouped_topk,
            softmax_topk=softmax_topk,
            sqrtsoftplus_grouped_topk=sqrtsoftplus_grouped_topk,
            hash_topk=hash_topk,
            dequantize_fp8=dequantize_fp8,
            quantize_fp8_per_block=quantize_fp8_per_block,
            quantize_fp8_per_row=quantize_fp8_per_row,
            quantize_fp8_per_tensor=quantize_fp8_per_tensor,
            quantize_fp8_per_token_group=quantize_fp8_per_token_group,
            scaled_grouped_gemm=scaled_grouped_gemm,
            scaled_grouped_mm=scaled_grouped_mm,
            scaled_grouped_mm_masked=scaled_grouped_mm_masked,
        )
        _state = 2


def __getattr__(name: str) -> Any:
    # Dunder probes (copy, pickle, inspect, pytest) must not pull in torch. Another thread's
    # first use waits in _load() until the names are there.
    if not name.startswith("__") and _state != 2:
        _load()
        if name in globals():
            return globals()[name]
    raise AttributeError(f"module 'moe_gemm' has no attribute {name!r}")


def __dir__() -> list[str]:
    _load()
    return sorted(globals())
