"""moe_gemm: many GEMMs in one persistent launch on Hopper, with a torch fallback everywhere.

Public API:
    grouped_gemm(a, b)        general grouped GEMM, D_i = A_i @ B_i, any sizes per problem
    grouped_mm(x, w, offs)    MoE expert GEMM (torch.nn.functional.grouped_mm's 2D x 3D form);
                              grouped_mm(x, w) is the batched 3D x 3D form
    GroupedGemmPlan(a, b)     grouped_gemm prepared once; each call only launches
    GemmConfig                backend / schedule / visitor / tile choices (frozen)
    MoE                       an inference MoE layer (routing + fused expert FFN) on grouped_mm
    ExpertParallelMoE         the MoE layer with its experts split over a process group
"""

__version__ = "0.1.0"

from moe_gemm.config import GemmConfig  # noqa: E402
from moe_gemm.integrations import register_transformers_lazily  # noqa: E402
from moe_gemm.layers.dispatch import AllToAllDispatcher, Dispatcher  # noqa: E402
from moe_gemm.layers.expert_parallel import ExpertParallelMoE  # noqa: E402
from moe_gemm.layers.moe import MoE, moe_experts, moe_forward  # noqa: E402
from moe_gemm.layers.routing import (  # noqa: E402
    ExpertPermutation,
    permute_by_expert,
    sigmoid_grouped_topk,
    softmax_topk,
)
from moe_gemm.ops.api import GroupedGemmPlan, grouped_gemm, grouped_mm  # noqa: E402

# `model.set_experts_implementation("moe_gemm")` works once transformers' MoE module loads.
register_transformers_lazily()

__all__ = [
    "AllToAllDispatcher",
    "Dispatcher",
    "ExpertParallelMoE",
    "ExpertPermutation",
    "GemmConfig",
    "GroupedGemmPlan",
    "MoE",
    "__version__",
    "grouped_gemm",
    "grouped_mm",
    "moe_experts",
    "moe_forward",
    "permute_by_expert",
    "sigmoid_grouped_topk",
    "softmax_topk",
]
