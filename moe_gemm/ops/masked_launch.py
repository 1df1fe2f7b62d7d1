"""The masked form on the host: grouped_mm_masked and scaled_grouped_mm_masked, one grouped
launch each, built once per signature like mm_launch.BmmPlan (ops/masked.py caches the plans).

The kernel (kernels/sm90 form "masked") takes the batched operands and the (G,) row counts on
the GPU; the counts reach it as the launch's `offs` argument. Nothing here reads them: the
persistent grid is sized for the upper bound (every problem full), and CTAs past the real work
find none and exit. The kernel choice is the MoE (varlen) one for G experts of `expected_m`
rows each (its rules and tuned tables, ops/heuristics.py and heuristics_fp8.py: the batched
rules plan for full problems: their 128x256 tiles ran 32-256-row experts up to 27% slower
than the varlen pick on an H200), never a tail split (its plan needs the tile count on
the host) and always the device visitor.
"""

from __future__ import annotations

import dataclasses

import torch

from moe_gemm.config import GemmConfig
from moe_gemm.ops import launch_info, launch_kernel, launch_resources
from moe_gemm.ops.heuristics import choose_varlen
from moe_gemm.ops.heuristics_fp8 import choose_fp8
from moe_gemm.ops.masked_validation import MaskedArgs, check_config_fits
from moe_gemm.ops.scaled_launch import _dense, _kernel, _placeholders, fp8_compile_key
from moe_gemm.ops.scaled_validation import a_scale_view, b_scale_view
from moe_gemm.ops.signature import BuiltFor, CheckedPlan
from moe_gemm.ops.support import operand_major, tma_views


def _masked_choice(choice, config: GemmConfig):
    check_config_fits(config)
    return dataclasses.replace(choice, tail_split=False, visitor="device")


def rows_mask(masked_m: torch.Tensor, M: int) -> torch.Tensor:
    """(G, M, 1) bool: row r of problem g is valid (r < masked_m[g], clamped into [0, M]).
    GPU ops only: no host synchronisation."""
    rows = torch.arange(M, device=masked_m.device, dtype=torch.int32)
    return (rows[None, :] < masked_m.clamp(0, M)[:, None])[..., None]


class _Plan(CheckedPlan):
    """What both dtypes' plans share: the shape, the trivial cases and the grid."""

    def _setup(self, args: MaskedArgs, K: int) -> bool:
        G, M, N = args.shape
        self.device = args.x.device
        self.shape = (G, M, N)
        self.out_dtype = args.batch.out_dtype
        self.trivial = G == 0 or M == 0 or N == 0
        self.zero = K == 0
        self.cacheable = not launch_resources._fresh()
        return not (self.trivial or self.zero)

    def _grid(self, choice) -> None:
        G, M, N = self.shape
        tiles = G * (-(-M // (choice.tile_m * choice.cluster_m))) * (
            -(-N // (choice.tile_n * choice.cluster_n)))
        self.num_ctas, self.max_tiles = launch_kernel._grid(
            self.device, launch_kernel.sm_count(self.device),
            choice.cluster_m * choice.cluster_n, tiles)
        self.no_workspace = launch_resources._small("workspace", self.device, torch.int64,
                                                    (16,))

    def _empty(self, masked_m, out):
        """The trivial calls: nothing to compute (or K = 0: the valid rows are zeros)."""
        if out is None:
            out = torch.empty(self.shape, dtype=self.out_dtype, device=self.device)
        if self.zero and not self.trivial:
            out.masked_fill_(rows_mask(masked_m, self.shape[1]), 0)
        return out


class MaskedPlan(_Plan):
    """grouped_mm_masked's launch (16-bit operands)."""

    def __init__(self, args: MaskedArgs, config: GemmConfig):
        b = args.batch
        self.built_for = BuiltFor("MaskedPlan", x=b.x, w=b.w, masked_m=args.masked_m,
                                  out=b.out)
        if not self._setup(args, b.K):
            return
        G, M, N = self.shape
        device = self.device
        # (trimmed A loads are the varlen form's: the masked form's A is one box per problem)
        self.choice = choice = dataclasses.replace(_masked_choice(choose_varlen(
            config, G * args.expected_m, G, N, b.K, launch_kernel.sm_count(device),
            b.out_dtype.itemsize, **launch_kernel.table_keys(device, b.dtype, b.out_dtype),
            split_ok=False), config), trim_a=False, packed_pairs=False)
        self.w_major = "k" if operand_major(b.w) == "col" else "n"
        self._grid(choice)
        self.meta = launch_resources._small("meta", device, torch.int64, (1, 8))
        self.meta32 = self.meta.view(torch.int32)
        self.no_table = launch_resources._small("table", device, torch.int32, (1, 1, 2))
        self.no_trace = launch_resources._small("trace", device, torch.int32, (1, 1, 4))
        self.kernel = launch_kernel._compiled(launch_kernel._compile_key(
            "masked", b.dtype, b.out_dtype, self.w_major, choice, False))
        self.views = tma_views((b.x, 2), (b.w, 1 if self.w_major == "k" else 2), (b.out, 2))

    def launch(self, x, w, masked_m, out):
        if self.trivial or self.zero:
            return self._empty(masked_m, out)
        if out is None:
            out = torch.empty(self.shape, dtype=self.out_dtype, device=self.device)
        choice = self.choice
        kernel_out = out
        if self.views is not None:
            x, w, kernel_out = self.views(x, w, out)
        self.kernel(x, w, kernel_out, self.meta, self.meta32, masked_m, self.no_table,
                    self.no_workspace, self.no_trace, self.shape[0], self.num_ctas,
                    choice.swizzle, choice.a_policy, choice.b_policy, launch_kernel.PDL, 0)
        launch_info._local.raw = (choice, self.num_ctas, self.shape[0], None, None)
        return out


class Fp8MaskedPlan(_Plan):
    """scaled_grouped_mm_masked's launch (FP8 operands, any of the scale granularities)."""

    def __init__(self, args: MaskedArgs, config: GemmConfig):
        b = args.batch
        self.built_for = BuiltFor("Fp8MaskedPlan", x=b.x, w=b.w, scale_a=b.scale_a,
                                  scale_b=b.scale_b, masked_m=args.masked_m, out=b.out)
        if not self._setup(args, b.K):
            return
        G, M, N = self.shape
        device = self.device
        self.granularity = b.granularity
        self.choice = choice = _masked_choice(choose_fp8(
            "masked", config, args.expected_m, N, b.K, b.out_dtype.itemsize, b.granularity),
            config)
        self._grid(choice)
        self.meta, self.smeta, self.no_table, self.no_trace = _placeholders(device)
        self.meta32 = self.meta.view(torch.int32)
        self.kernel = _kernel(fp8_compile_key("masked", b.dtype, b.out_dtype, b.granularity,
                                              choice))
        self.views = tma_views((b.x, 2), (b.w, 1), (b.out, 2))  # (w: K-major, (G, N, K).mT)

    def launch(self, x, w, scale_a, scale_b, masked_m, out):
        if self.trivial or self.zero:
            return self._empty(masked_m, out)
        if out is None:
            out = torch.empty(self.shape, dtype=self.out_dtype, device=self.device)
        G, M, N = self.shape
        sfa = _dense(a_scale_view(scale_a, self.granularity, (G,), M))
        sfb = _dense(b_scale_view(scale_b, self.granularity, (G,), N))
        choice = self.choice
        kernel_out = out
        if self.views is not None:
            x, w, kernel_out = self.views(x, w, out)
        self.kernel(x, w, kernel_out, sfa, sfb, self.smeta, self.meta, self.meta32, masked_m,
                    self.no_table, self.no_workspace, self.no_trace, G, self.num_ctas,
                    choice.swizzle, choice.a_policy, choice.b_policy, launch_kernel.PDL, 0)
        launch_info._local.raw = (choice, self.num_ctas, G, None, None)
        return out
