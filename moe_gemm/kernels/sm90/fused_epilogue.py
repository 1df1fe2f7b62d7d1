"""The fused MoE epilogue: bias, gated activation and per-row scale on the accumulators.

Per stored value, in fp32 before the one rounding to the output dtype:

    gate-up GEMM:  out[r, j] = act(acc[r, gate(j)] + b[e, gate(j)], acc[r, up(j)] + b[e, up(j)])
    down GEMM:     out[r, j] = (acc[r, j] + b[e, j]) * row_weight[r]

(each option separately: bias, gate, row_scale), e the tile's expert and r the routed row.

Pairing (constants.py says why): the accumulator fragment of a thread is ((2, 2, tile_n / 8),
M repeat, 1) registers, column pairs x row halves x 8-column chunks; lane l holds columns
8c + 2 (l % 4) + {0, 1} of chunk c. The stored tile is tile_n / 2 wide, laid out as the C
fragment of an MMA of that width (the "half fragment"):
- concat:      gate = chunks [0, tile_n / 16), up = the next tile_n / 16 chunks;
- interleaved: gate = even chunks, up = odd chunks;
  (both: views of the accumulators shaped like the half fragment, read in place)
- alternating: a lane's own column pair is (gate, up) of output column 4c + l % 4, while the
  half fragment wants columns 8c' + 2q + {0, 1} (q = l % 4): output column 8c' + 2q + p comes
  from lane (2q + p) % 4 of the quad, chunk 2c' if q < 2 else 2c' + 1. Each lane computes
  its own outputs of chunks 2c' and 2c' + 1, and pulls the two it stores from the quad (two
  shuffles per stored value).
tests/kernels/test_fused_layouts.py proves on the CPU, thread by thread, that every output
value reads the gate and up accumulators of its own row and column pair (for alternating,
through the quad exchange as written here).

The zero tail (problem E, rows past offs[-1]) has zero accumulators and gets no bias and no
row weight: it stores zeros whatever the tail's weights hold.
"""

from __future__ import annotations

import dataclasses
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


LOG2_E = 1.4426950408889634


def sigmoid(x):
    return 1.0 / (1.0 + cute.math.exp(-x))


def sigmoid_fast(x):
    """1 / (1 + exp(-x)) from the SFU's approximate exp2 and reciprocal (MUFU.EX2, MUFU.RCP:
    a few fp32 ulp, far below the one rounding to bf16 / fp16 that follows). sigmoid's IEEE
    exp and divide take ~22 instructions a value, a convergence region and a slow-path call
    among them, which a cooperative tile's epilogue runs unhidden (64 values a thread at
    128x256). exp2 overflows to inf below x = -88 and the reciprocal of inf is 0, the limit."""
    return cute.arch.rcp_approx(1.0 + cute.math.exp2(x * -LOG2_E, fastmath=True))


def gate_value(kind: str, g, u, alpha: float, limit: float, fast: bool = False):
    """act(gate) * up for one value pair (fp32), as transformers computes it (fast: the
    sigmoid gates' sigmoid_fast)."""
    sig = sigmoid_fast if fast else sigmoid
    if kind == "silu":
        return g * sig(g) * u
    if kind == "gelu":
        return 0.5 * g * (1.0 + cute.math.erf(g * SQRT_HALF)) * u
    if kind == "gelu_tanh":
        inner = SQRT_2_OVER_PI * (g + GELU_TANH_CUBIC * g * g * g)
        return 0.5 * g * (1.0 + cute.math.tanh(inner)) * u
    # The clamped gates: gate clamped from above, up to [-limit, limit] (NaN stays NaN, as
    # torch.clamp), then silu(gate) * up ("clamped_silu") or gpt-oss's
    # (up + 1) * gate * sigmoid(alpha * gate).
    g = Float32(cutlass.select_(g > limit, Float32(limit), g))
    u = Float32(cutlass.select_(u > limit, Float32(limit), u))
    u = Float32(cutlass.select_(u < -limit, Float32(-limit), u))
    if kind == "clamped_silu":
        return g * sig(g) * u
    return (u + 1.0) * g * sig(alpha * g)


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
        if const_expr(cfg.gate_layout == "alternating"):
            # The compact half fragment: only its retiled layout is used (the index of each
            # stored value in it); partition() adds the accumulators themselves.
            half = cute.make_layout(((2, 2, cfg.tile_n // (2 * GATE_BLOCK)), m_rep, 1))
            return (cute.make_tensor(acc.iterator, half),)
        layout, up_offset = pair_views_layout(cfg.tile_n, m_rep, cfg.gate_layout)
        return (cute.make_tensor(acc.iterator, layout),
                cute.make_tensor(acc.iterator + up_offset, layout))

    def partition(self, tiled_mma: cute.TiledMma, sD: cute.Tensor, acc: cute.Tensor,
                  mma_tidx, epi_threads: int) -> EpilogueFrags:
        frags = super().partition(tiled_mma, sD, acc, mma_tidx, epi_threads)
        if const_expr(self.cfg.gate_layout == "alternating" and self.cfg.gate is not None):
            # The accumulators raw (not retiled) and each one's (row, col) in the tile.
            coords = tiled_mma.get_slice(mma_tidx).partition_C(
                cute.make_identity_tensor((self.cfg.tile_m, self.cfg.tile_n)))
            return dataclasses.replace(frags, tRS_rExtra=(acc, coords))
        return frags

    @cute.jit
    def load_subtile(self, frags: EpilogueFrags, e: cutlass.Constexpr, work: WorkTile,
                     problems):
        if const_expr(self.cfg.gate_layout == "alternating" and self.cfg.gate is not None):
            self._load_alternating(frags, e, work, problems)
        else:
            self._load_paired(frags, e, work, problems)

    @cute.jit
    def _load_paired(self, frags: EpilogueFrags, e: cutlass.Constexpr, work: WorkTile,
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
        # Values of a subtile share rows and columns (a thread holds 2 rows x 8 columns of a
        # 64 x 32 subtile): each bias and row weight is loaded once, for the first value of
        # its column or row (loaded per value, ptxas kept every copy: 16 loads of 2 row
        # weights, and the spills of their addresses).
        offsets = static_offsets(coords)
        biases, weights = {}, {}
        for v in cutlass.range_constexpr(size):
            g = frags.tRS_rAcc[e * size + v]
            u = Float32(0.0)
            if const_expr(cfg.gate is not None):
                u = frags.tRS_rExtra[0][e * size + v]
            if const_expr(cfg.has_bias and offsets[v][1] in biases):
                bg, bu = biases[offsets[v][1]]
                g = g + bg
                if const_expr(cfg.gate is not None):
                    u = u + bu
            elif const_expr(cfg.has_bias):
                col = coords[v][1]
                if const_expr(cfg.gate is None):
                    gcol = work.n_tile * cfg.tile_n + col
                elif const_expr(cfg.gate_layout == "concat"):
                    gcol = work.n_tile * cfg.d_tile_n + col
                    ucol = out_cols + gcol
                else:
                    gcol = (work.n_tile * cfg.tile_n + (col // GATE_BLOCK) * 2 * GATE_BLOCK
                            + col % GATE_BLOCK)
                    ucol = gcol + GATE_BLOCK
                bg = _bias_at(problems.bias, expert, gcol, bias_cols, live, cfg.gate is None)
                bu = Float32(0.0)
                if const_expr(cfg.gate is not None):
                    bu = _bias_at(problems.bias, expert, ucol, bias_cols, live, False)
                biases[offsets[v][1]] = (bg, bu)
                g = g + bg
                u = u + bu
            if const_expr(cfg.gate is not None):
                g = gate_value(cfg.gate, g, u, cfg.gate_alpha, cfg.gate_limit, cfg.fast_gate)
            if const_expr(cfg.row_scale):
                if const_expr(offsets[v][0] not in weights):
                    weights[offsets[v][0]] = _row_weight_at(
                        problems.row_weight, first_row + coords[v][0], last_row, live)
                g = g * weights[offsets[v][0]]
            frags.tRS_rD[v] = g
        frags.tRS_rD_out.store(frags.tRS_rD.load().to(cfg.d_dtype))

    @cute.jit
    def _load_alternating(self, frags: EpilogueFrags, e: cutlass.Constexpr, work: WorkTile,
                          problems):
        """The alternating layout (module docstring): own outputs of chunks 2c' and 2c' + 1,
        then the quad exchange."""
        cfg = self.cfg
        size = frags.size_rD
        acc, acc_coords = frags.tRS_rExtra
        sources = alternating_sources(frags.tRS_rAcc.layout, cfg.tile_n, e, size)
        coords = self.subtile_coords(frags.thr_copy_r2s, e)
        num_experts = problems.num_experts()
        live = work.problem < num_experts
        expert = cutlass.min(work.problem, num_experts - 1)
        bias_cols = problems.bias.shape[1]
        col0 = work.n_tile * cfg.tile_n
        first_row = work.row_start + work.m_tile * cfg.tile_m
        last_row = problems.mD.shape[0] - 1
        lane = cute.arch.lane_idx()
        q = lane % 4
        offsets = static_offsets(coords)
        weights = {}
        for v in cutlass.range_constexpr(size):
            (g_first, g_second), p = sources[v]
            own_first = self._own_output(acc, acc_coords, g_first, live, expert, bias_cols,
                                         col0, problems)
            own_second = self._own_output(acc, acc_coords, g_second, live, expert, bias_cols,
                                          col0, problems)
            src = (lane - q) + (2 * q + p) % 4
            first = cute.arch.shuffle_sync(own_first, src)
            second = cute.arch.shuffle_sync(own_second, src)
            val = Float32(cutlass.select_(q < 2, first, second))
            if const_expr(cfg.row_scale):
                if const_expr(offsets[v][0] not in weights):
                    weights[offsets[v][0]] = _row_weight_at(
                        problems.row_weight, first_row + coords[v][0], last_row, live)
                val = val * weights[offsets[v][0]]
            frags.tRS_rD[v] = val
        frags.tRS_rD_out.store(frags.tRS_rD.load().to(cfg.d_dtype))

    @cute.jit
    def _own_output(self, acc: cute.Tensor, acc_coords: cute.Tensor, g_idx: cutlass.Constexpr,
                    live, expert, bias_cols, col0, problems):
        """This lane's output of the (gate, up) pair in registers g_idx, g_idx + 1."""
        cfg = self.cfg
        g = acc[g_idx]
        u = acc[g_idx + 1]
        if const_expr(cfg.has_bias):
            col = col0 + acc_coords[g_idx][1]
            g = g + _bias_at(problems.bias, expert, col, bias_cols, live, False)
            u = u + _bias_at(problems.bias, expert, col + 1, bias_cols, live, False)
        return gate_value(cfg.gate, g, u, cfg.gate_alpha, cfg.gate_limit, cfg.fast_gate)


@cute.jit
def _bias_at(bias: cute.Tensor, expert, col, bias_cols, live, predicated: cutlass.Constexpr):
    """bias[expert, col] where the tile is not the zero tail, else 0. A column past the bias
    (a partial last tile's, never stored) reads 0 by a predicated load (`predicated`) or the
    last column. Which one ptxas keeps off the stack differs (spill bytes, sm_90a, per
    thread): without a gate the predicated load's address is the tile's base plus a constant
    (128x192 bias: 0 against 404 bytes clamped; 192x128: 12 against 408), with a gate the
    clamped column (clamped SwiGLU 128x192: 0 against 148-176 predicated)."""
    if const_expr(predicated):
        value = Float32(0.0)
        if col < bias_cols:
            value = Float32(bias[expert, col])
        return Float32(cutlass.select_(live, value, Float32(0.0)))
    return Float32(cutlass.select_(live, bias[expert, cutlass.min(col, bias_cols - 1)],
                                   Float32(0.0)))


@cute.jit
def _row_weight_at(row_weight: cute.Tensor, row, last_row, live):
    """row_weight[row] (clamped to the last row: rows past it are never stored) where the
    tile is not the zero tail, else 1."""
    return Float32(cutlass.select_(live, row_weight[cutlass.min(row, last_row)], Float32(1.0)))


def static_offsets(coords: cute.Tensor) -> list[tuple[int, int]]:
    """Each element's (row, col) in a coordinate tensor (a thread's partition of an identity
    tensor) less the thread's own base: the static part of its layout, known at trace time,
    so elements at the same offset are the same row or column for every thread."""
    return coord_offsets(coords.layout)


def coord_offsets(layout) -> list[tuple[int, int]]:
    """Every element's (row, col) offset of a coordinate layout (its strides are scaled bases
    of the identity tensor's two modes; an integer stride must be 0, a broadcast mode), in flat
    (column-major) order."""
    out = []
    for parts in _mode_indices(layout):
        crd = [0, 0]
        for idx, d in parts:
            if isinstance(d, int):
                if d:
                    raise ValueError(f"integer stride {d} in a coordinate layout {layout}")
                continue
            crd[d.mode[0] if isinstance(d.mode, (list, tuple)) else d.mode] += idx * d.value
        out.append((crd[0], crd[1]))
    return out


def flat_offsets(layout) -> list[int]:
    """Every offset of a static integer layout, in its flat (column-major) order."""
    return [sum(idx * d for idx, d in parts) for parts in _mode_indices(layout)]


def _mode_indices(layout):
    """For each flat (column-major) index of a static layout: its (index, stride) per mode."""
    shape, stride = _flat(layout.shape), _flat(layout.stride)
    size = 1
    for n in shape:
        size *= n
    for i in range(size):
        parts, rest = [], i
        for n, d in zip(shape, stride):
            parts.append((rest % n, d))
            rest //= n
        yield parts


def _flat(t) -> list:
    return [y for x in t for y in _flat(x)] if isinstance(t, tuple) else [t]


def alternating_sources(retiled_half, tile_n: int, e: int, size: int) -> list:
    """Per stored value v of subtile e (alternating layout): ((gate register of chunk 2c',
    gate register of chunk 2c' + 1), p) with p the value's column within its pair. The
    retiled half fragment's layout gives each value's index k = p + 2 h + 4 c' + 4 (tile_n /
    16) m in the compact half fragment; its accumulator gate registers are the same (h, m)
    at chunks 2c' and 2c' + 1: 2 h + 4 (2c') + 4 (tile_n / 8) m, then + 4."""
    half_chunks = tile_n // (2 * GATE_BLOCK)
    offsets = flat_offsets(retiled_half)
    sources = []
    for v in range(size):
        k = offsets[e * size + v]
        p, h, rest = k % 2, (k // 2) % 2, k // 4
        c, m = rest % half_chunks, rest // half_chunks
        g = 2 * h + 4 * (2 * c) + 4 * (2 * half_chunks) * m
        sources.append(((g, g + 4), p))
    return sources
