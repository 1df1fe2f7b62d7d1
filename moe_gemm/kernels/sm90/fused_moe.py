"""FusedMoeGemmSm90: the varlen grouped GEMM with the fused MoE options and their tensors.

The kernel body is GroupedGemmSm90's; the options (constants.fused_problem) switch on:
- gate (+ gate_layout, gate_alpha, gate_limit): the gated epilogue of the gate-up GEMM
  (fused_epilogue.py), out = act(gate) * up, I columns from 2I accumulator columns;
- bias: b[e, n] (fp32, w's column order) added to the accumulators;
- row_scale: each row times row_weight[r] (the routing weight of a routed row);
- gather_a: A's rows read as x[row_index[r]] by the gather warps (gather.py), so the caller
  passes the tokens x (T, K) and out has the routed rows (S, N).
Its launch takes the three tensors those options read, after the base kernel's arguments;
an option that is off reads nothing, and its tensor may be a one-element placeholder.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass.cute as cute
from cutlass import Int32, Int64

from .fused_epilogue import FusedEpilogue
from .grouped_gemm import GroupedGemmSm90, ProblemArgs, RunArgs
from .problems import FusedVarlenProblems


class FusedProblemArgs(ProblemArgs):
    FIELDS = (*ProblemArgs.FIELDS, "row_index", "row_weight", "bias")


class FusedMoeGemmSm90(GroupedGemmSm90):
    """GroupedGemmSm90 (varlen form) with the fused MoE options; see the module docstring."""

    def make_epilogue(self) -> FusedEpilogue:
        return FusedEpilogue(self)

    def make_problems(self, args: FusedProblemArgs) -> FusedVarlenProblems:
        return FusedVarlenProblems(self, args.num_problems, args.mA, args.mD, args.offs,
                                   args.row_index, args.row_weight, args.bias)

    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,  # x (T, K); with gather_a the tokens, else the routed rows
        mW: cute.Tensor,  # w (E, K, N), either major (concat gate layout: K-major)
        mD: cute.Tensor,  # out (S, N) (gated: (S, N / 2))
        meta: cute.Tensor,  # unused (1, 8) (the base kernel's general-form arguments)
        meta32: cute.Tensor,
        offs: cute.Tensor,  # (E,) int32 cumulative end rows of out's rows
        table: cute.Tensor,  # host visitor: (num_ctas, entries, 2) int32; else (1, 1, 2)
        workspace: cute.Tensor,
        trace: cute.Tensor,
        num_problems: Int32,  # E + 1 with the zero tail, else E
        num_ctas: Int32,
        swizzle: Int32,
        a_policy: Int64,
        b_policy: Int64,
        pdl: Int32,
        d_base: Int64,
        row_index: cute.Tensor,  # (S,) int32 token of each routed row (gather_a)
        row_weight: cute.Tensor,  # (S,) fp32 factor of each routed row (row_scale)
        bias: cute.Tensor,  # (E, N) fp32 (bias)
        stream: cuda.CUstream,
    ):
        self.build_and_launch(
            mA, mW, mD, FusedProblemArgs(mA, mD, meta, meta32, offs, table, num_problems,
                                         d_base, row_index, row_weight, bias),
            RunArgs(workspace, trace, swizzle, a_policy, b_policy), num_ctas, pdl, stream)
