"""When the MoE layers' row kernels (the top-k combine, the token gather) run: a tensor on a
CUDA device the CuTe kernels serve, outside torch.compile's tracing, with their switch not set
to "torch", and rows of 16-byte vectors (kernels/sm90/vector_rows.py)."""

from __future__ import annotations

import torch

from moe_gemm.env import env_value
from moe_gemm.kernels.sm90.constants import COMBINE_VEC


def row_kernel_allowed(t: torch.Tensor, switch: str) -> bool:
    """Whether a row kernel may run on t's device now (MOE_GEMM_* `switch` not "torch")."""
    if t.device.type != "cuda" or torch.compiler.is_compiling() or env_value(switch) == "torch":
        return False
    from moe_gemm.capability import cute_problem

    # (before any layout check: under torch.func's grad the tensors have no data pointer)
    return cute_problem(t.device) is None


def vector_rows_ok(t: torch.Tensor) -> bool:
    """Whether a (rows, H) tensor is rows of 16-byte vectors the kernels read: at least one
    row, H a multiple of COMBINE_VEC and contiguous, rows 16-byte aligned."""
    rows, H = t.shape
    return not (rows == 0 or H % COMBINE_VEC or t.stride(1) != 1 or t.stride(0) % COMBINE_VEC
                or t.data_ptr() % 16)
