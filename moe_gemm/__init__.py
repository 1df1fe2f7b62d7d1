"""moe_gemm: many GEMMs in one persistent launch on Hopper, with a torch fallback everywhere.

Public API:
    grouped_gemm(a, b)        general grouped GEMM, D_i = A_i @ B_i, any sizes per problem
    grouped_mm(x, w, offs)    MoE expert GEMM (torch.nn.functional.grouped_mm's 2D x 3D form)
    GemmConfig                backend / schedule / visitor / tile choices (frozen)
"""

__version__ = "0.1.0"

from .config import GemmConfig  # noqa: E402
from .ops import grouped_gemm, grouped_mm  # noqa: E402

__all__ = ["GemmConfig", "grouped_gemm", "grouped_mm", "__version__"]
