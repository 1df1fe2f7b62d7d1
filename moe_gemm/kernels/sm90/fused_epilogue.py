"""The fused MoE epilogue: bias, gated activation and per-row scale on the accumulators.

Per stored value, in fp32 before the one rounding to the output dtype:

    gate-up GEMM:  out[r, j] = act(acc[r, gate(j)] + b[e, gate(j)], acc[r, up(j)] + b[e, up(j)])
    down GEMM:     out[r, j] = (acc[r, j] + b[e, j]) * row_weight[r]

(each option separately: bias, gate, row_scale), e the tile's expert and r the routed row.

Pairing (constants.py says why chunks of 8 columns): the accumulator fragment of a thread is
((2, 2, tile_n / 8), M repeat, 1) registers, column pairs x row halves x 8-column chunks. A
gated tile's gate and up views select chunks of it with the same shape as the C fragment of a
tile_n / 2 wide MMA, the tile the epilogue stores:
- concat:      gate = chunks [0, tile_n / 16), up = the next tile_n / 16 chunks;
- interleaved: gate = even chunks, up = odd chunks.
tests/kernels/test_fused_layouts.py proves on the CPU, thread by thread, that every output
value reads the gate and up accumulators of its own row and column pair.

The zero tail (problem E, rows past offs[-1]) has zero accumulators and gets no bias and no
row weight: it stores zeros whatever the tail's weights hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from .constants import GATE_BLOCK
from .epilogue import Epilogue, EpilogueFrags
from .tile_scheduler import WorkTile

SQRT_HALF = 0.7071067811865476
SQRT_2_OVER_PI = 0.7978845608028654
GELU_TANH_CUBIC = 0.044715


def pair_views_layout(tile_n: int, m_rep: int, gate_layout: str):
    """(layout, up offset) of the gate view of a (tile_m, tile_n) accumulator fragment
    ((2, 2, tile_n / 8), m_rep, 1) : ((1, 2, 4), tile_n / 2, 0); the up view is the same
    layout `up offset` registers further."""
    chunks = tile_n // GATE_BLOCK
    chunk_stride = 4 if gate_layout == "concat" else 8
    up_offset = 4 * (chunks // 2) if gate_layout == "concat" else 4
    layout = cute.make_layout(((2, 2, chunks // 2), m_rep, 1),
                              stride=((1, 2, chunk_stride), 4 * chunks, 0))
    return layout, up_offset


def sigmoid(x):
    return 1.0 / (1.0 + cute.math.exp(-x))


def gate_value(kind: str, g, u, alpha: float, limit: float):
    """act(gate) * up for one value pair (fp32), as transformers computes it."""
    if kind == "silu":
        return g * sigmoid(g) * u
    if kind == "gelu":
        return 0.5 * g * (1.0 + cute.math.erf(g * SQRT_HALF)) * u
    if kind == "gelu_tanh":
        inner = SQRT_2_OVER_PI * (g + GELU_TANH_CUBIC * g * g * g)
        return 0.5 * g * (1.0 + cute.math.tanh(inner)) * u
    # gpt-oss: gate clamped from above, up to [-limit, limit] (NaN stays NaN, as torch.clamp),
    # then (up + 1) * gate * sigmoid(alpha * gate).
    g = Float32(cutlass.select_(g > limit, Float32(limit), g))
    u = Float32(cutlass.select_(u > limit, Float32(limit), u))
    u = Float32(cutlass.select_(u < -limit, Float32(-limit), u))
    return (u + 1.0) * g * sigmoid(alpha * g)


@dataclass(frozen=True, eq=False)
class FusedEpilogue(Epilogue):
    """The epilogue of fused_moe.FusedMoeGemmSm90 (options on the kernel object `cfg`)."""

    def copy_mma(self, tiled_mma: cute.TiledMma) -> cute.TiledMma:
        cfg = self.cfg
        if const_expr(cfg.gate is not None):
            # The stored tile is d_tile_n = tile_n / 2 wide (built inside the kernel: an MMA
            # made on the host could not be used in the kernel's own IR function).
            return cfg.make_tiled_mma(cfg.d_tile_n)
        return tiled_mma

    def acc_views(self, acc: cute.Tensor) -> tuple:
        cfg = self.cfg
        if const_expr(cfg.gate is None):
            return (acc,)
        m_rep = cute.size(acc, mode=[1])
        expect = ((2, 2, cfg.tile_n // GATE_BLOCK), m_rep, 1)
        if cute.shape(acc) != expect:
            raise ValueError(f"unexpected accumulator fragment {cute.shape(acc)}; the gated "
                             f"epilogue pairs chunks of {expect}")
        layout, up_offset = pair_views_layout(cfg.tile_n, m_rep, cfg.gate_layout)
        return (cute.make_tensor(acc.iterator, layout),
                cute.make_tensor(acc.iterator + up_offset, layout))

    @cute.jit
    def load_subtile(self, frags: EpilogueFrags, e: cutlass.Constexpr, work: WorkTile,
                     problems):
        cfg = self.cfg
        size = frags.size_rD
        coords = self.subtile_coords(frags.thr_copy_r2s, e)
        num_experts = problems.num_experts()
        live = work.problem < num_experts  # (not the zero tail)
        expert = cutlass.min(work.problem, num_experts - 1)
        out_cols = problems.mD.shape[1]
        last_row = problems.mD.shape[0] - 1
        bias_cols = problems.bias.shape[1]
        first_row = work.row_start + work.m_tile * cfg.tile_m
        for v in cutlass.range_constexpr(size):
            g = frags.tRS_rAcc[e * size + v]
            u = Float32(0.0)
            if const_expr(cfg.gate is not None):
                u = frags.tRS_rExtra[0][e * size + v]
            if const_expr(cfg.has_bias):
                col = coords[v][1]
                if const_expr(cfg.gate is None):
                    gcol = work.n_tile * cfg.tile_n + col
                elif const_expr(cfg.gate_layout == "concat"):
                    gcol = work.n_tile * cfg.d_tile_n + col
                    ucol = cutlass.min(out_cols + gcol, bias_cols - 1)
                else:
                    gcol = (work.n_tile * cfg.tile_n + (col // GATE_BLOCK) * 2 * GATE_BLOCK
                            + col % GATE_BLOCK)
                    ucol = cutlass.min(gcol + GATE_BLOCK, bias_cols - 1)
                gcol = cutlass.min(gcol, bias_cols - 1)
                bias = problems.bias
                g = g + Float32(cutlass.select_(live, bias[expert, gcol], Float32(0.0)))
                if const_expr(cfg.gate is not None):
                    u = u + Float32(cutlass.select_(live, bias[expert, ucol], Float32(0.0)))
            if const_expr(cfg.gate is not None):
                g = gate_value(cfg.gate, g, u, cfg.gate_alpha, cfg.gate_limit)
            if const_expr(cfg.row_scale):
                r = cutlass.min(first_row + coords[v][0], last_row)
                g = g * Float32(cutlass.select_(live, problems.row_weight[r], Float32(1.0)))
            frags.tRS_rD[v] = g
        frags.tRS_rD_out.store(frags.tRS_rD.load().to(cfg.d_dtype))

