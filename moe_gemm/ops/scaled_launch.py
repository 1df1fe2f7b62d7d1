"""Host side of GroupedGemmFp8Sm90: torch tensors in, one grouped FP8 launch out.

The FP8 counterpart of ops/mm_launch.py and ops/general_launch.py, built from the same parts
(the grid: launch_kernel.py; workspaces, placeholder tensors, pinned staging:
launch_resources.py; the compiled-kernel cache; LaunchInfo): Fp8MmPlan (varlen) and Fp8BmmPlan
(batched) are built once per signature and cached by ops/scaled.py, so a repeated call
allocates its output and calls the kernel; Fp8GeneralLaunch uploads the general form's
per-problem tables (operands and scales, addresses and strides) in one copy per call. Nothing
here reads a GPU value or synchronizes: the varlen form reads offs on the GPU (CUDA-graph safe,
bad offsets clamped by the kernel).

Scales reach the kernel as the views of ops/scaled_validation.py (A (..., rows, KB), B
(..., KB, C)), any strides; a single per-tensor value is expanded into a small tensor per call
(the kernel reads each row's and column's scale from memory).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from moe_gemm.capability import sm_count
from moe_gemm.config import GemmConfig
from moe_gemm.ops import kernel_cache as cache
from moe_gemm.ops import launch_info, launch_kernel, launch_resources
from moe_gemm.ops.heuristics_fp8 import choose_fp8, kernel_scale_mode
from moe_gemm.ops.quantize import token_major_scales
from moe_gemm.ops.scaled_validation import (
    ScaledGemmArgs,
    ScaledMmArgs,
    a_scale_view,
    b_scale_view,
)
from moe_gemm.ops.signature import BuiltFor, CheckedPlan
from moe_gemm.ops.support import empty_k_result, tma_views

_NAMES = {torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2",
          torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
SMETA_INTS = 8  # kernels/sm90/grouped_gemm_fp8.SMETA_INTS (no DSL import here)


def fp8_compile_key(form: str, ab: torch.dtype, d: torch.dtype, granularity: str, choice,
                    trace: bool = False):
    from moe_gemm.kernels.sm90.compile_fp8 import Fp8CompileKey

    return Fp8CompileKey(
        form, _NAMES[ab], _NAMES[d], kernel_scale_mode(granularity), choice.schedule,
        choice.visitor, choice.tile_m, choice.tile_n, choice.stages, trace, choice.l2_hints,
        choice.epi_n, choice.cluster_m, choice.cluster_n, choice.epi_whole, choice.tail_split,
        choice.promote_lag, choice.scale_ahead, choice.smem_scales, choice.split_ways,
        choice.peek_wait, choice.skip_empty_half)


@functools.lru_cache(maxsize=256)
def _kernel(key):
    from moe_gemm.kernels.sm90.compile_fp8 import compile_fp8_variant

    return cache.get_or_compile(key, key.name, lambda: compile_fp8_variant(key))


def _dense(t: torch.Tensor) -> torch.Tensor:
    """A scale view with a repeated (stride-0) dimension, copied into its own memory."""
    if any(s == 0 and n > 1 for s, n in zip(t.stride(), t.shape)):
        return t.contiguous()
    return t


def _tma_scales(sfa: torch.Tensor, sfb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The block scales as the staged-scale kernel's TMA loads take them (smem_scales):
    sfa (T, KB), or (G, M, KB) in the batched form, M-major and sfb (E, KB, C) k-block-major,
    each with 16-byte aligned strides and base. Scales already laid out so are used as they
    are: M-major A scales (DeepGEMM's and torch's blockwise scaled_mm's layout, and
    quantize_acts' of a 2-D or 3-D x with M a multiple of 4) and a checkpoint's (N / 128,
    K / 128) weight scales transposed with K / 128 a multiple of 4 (every DeepSeek-V3, Kimi-K2
    and Qwen3 shape); others are copied (T x KB and E x KB x C floats: a few us beside the
    GEMM).
    """
    KB = sfa.shape[-1]
    if sfa.dim() == 2:
        T = sfa.shape[0]
        if not (sfa.stride(0) == 1 and sfa.stride(1) % 4 == 0 and sfa.stride(1) >= T
                and sfa.data_ptr() % 16 == 0):
            sfa = token_major_scales(T, KB, sfa.device).copy_(sfa)
    else:
        G, M, _ = sfa.shape
        if not (sfa.stride(1) == 1 and sfa.stride(2) % 4 == 0 and sfa.stride(2) >= M
                and sfa.stride(0) % 4 == 0 and sfa.data_ptr() % 16 == 0):
            mp = -(-M // 4) * 4  # (each problem's k-block columns 16-byte aligned)
            buf = torch.empty(G, KB, mp, dtype=torch.float32, device=sfa.device)[:, :, :M]
            sfa = buf.transpose(1, 2).copy_(sfa)
    E, _, C = sfb.shape
    if not (sfb.stride(1) == 1 and sfb.stride(2) % 4 == 0 and sfb.stride(0) % 4 == 0
            and sfb.stride(2) >= KB and sfb.data_ptr() % 16 == 0):
        kbp = -(-KB // 4) * 4
        buf = torch.empty(E, C, kbp, dtype=torch.float32, device=sfb.device)[:, :, :KB]
        sfb = buf.copy_(sfb.transpose(1, 2)).transpose(1, 2)
    return sfa, sfb


def _placeholders(device):
    return (launch_resources._small("meta", device, torch.int64, (1, 8)),
            launch_resources._small("smeta", device, torch.int64, (1, SMETA_INTS)),
            launch_resources._small("table", device, torch.int32, (1, 1, 2)),
            launch_resources._small("trace", device, torch.int32, (1, 1, 4)))


class Fp8MmPlan(CheckedPlan):
    """scaled_grouped_mm's MoE (varlen) launch, built once per signature."""

    def __init__(self, args: ScaledMmArgs, config: GemmConfig, trace: bool = False):
        x = args.x
        self.built_for = BuiltFor("Fp8MmPlan", x=x, w=args.w, scale_a=args.scale_a,
                                  scale_b=args.scale_b, offs=args.offs, out=args.out)
        self.device = device = x.device
        T, K, E, N = args.rows, args.K, args.E, args.N
        self.T, self.N, self.E = T, N, E
        self.out_dtype = args.out_dtype
        self.granularity = args.granularity
        self.zero_tail = args.out is None
        self.trivial = T == 0 or N == 0 or E == 0
        # K = 0: every routed row is an empty sum, written here (as Fp8BmmPlan and
        # mm_launch.MmPlan do): the launch-time TMA descriptors of x and w cannot have an
        # empty K extent.
        self.zero = K == 0
        self.cacheable = not launch_resources._fresh()
        if self.trivial or self.zero:
            return
        nsm = sm_count(device)
        self.choice = choice = choose_fp8("varlen", config, T / E, N, K,
                                          args.out_dtype.itemsize, args.granularity)
        self.num_problems = E + (1 if self.zero_tail else 0)
        self.num_ctas, self.max_tiles = launch_kernel.varlen_grid(
            device, nsm, choice, T, self.num_problems, N)
        self.workspace = launch_resources.WorkspaceSlot(device, self.num_ctas, choice)
        self.meta, self.smeta, self.no_table, self.no_trace = _placeholders(device)
        self.meta32 = self.meta.view(torch.int32)
        self.trace = trace
        self.kernel = _kernel(fp8_compile_key("varlen", args.dtype, args.out_dtype,
                                              args.granularity, choice, trace))
        # Size-1 dimensions with strides the compiled kernel's 16-byte rule would refuse
        # travel as views that keep it (w: K-major, an (E, N, K) weight's transpose).
        self.views = tma_views((x, 1), (args.w, 1), (args.out, 1))

    def launch(self, x, w, scale_a, scale_b, offs, out):
        if out is None:
            out = torch.empty(self.T, self.N, dtype=self.out_dtype, device=self.device)
        if self.trivial:
            return out.zero_() if self.zero_tail and self.E == 0 else out
        if self.zero:
            return empty_k_result(out, offs, given=not self.zero_tail)
        g = self.granularity
        sfa = _dense(a_scale_view(scale_a, g, (), self.T))
        sfb = _dense(b_scale_view(scale_b, g, (self.E,), self.N))
        choice = self.choice
        if choice.smem_scales:
            sfa, sfb = _tma_scales(sfa, sfb)
        trace_t = (launch_resources._trace_tensor(self.num_ctas, self.max_tiles, self.device)
                   if self.trace else None)
        kernel_out = out
        if self.views is not None:
            x, w, kernel_out = self.views(x, w, out)
        self.kernel(x, w, kernel_out, sfa, sfb, self.smeta, self.meta, self.meta32, offs,
                    self.no_table, self.workspace.get(choice),
                    self.no_trace if trace_t is None else trace_t, self.num_problems,
                    self.num_ctas, choice.swizzle, choice.a_policy, choice.b_policy,
                    launch_kernel.PDL, 0)
        launch_info._local.raw = (choice, self.num_ctas, self.num_problems, None, trace_t)
        return out


# Batched block-scaled calls with at least this many rows per problem run the varlen kernel
# on x's G x M rows (offs every M rows), whose default stages the scales in shared memory,
# promotes a stage behind and stores whole tiles, where the batched kernel loads its scales
# three stages ahead: on an H200 (2026-12-02, bench_fp8, in one run) DeepGEMM's 4 x 8192
# rows took 1906-1914 us (up, N 4096, K 7168) and 1032-1054 (down, N 7168, K 2048) in the
# batched kernel against 1514-1521 and 784-785 in the varlen one, and on 8 x 1024-row
# experts the varlen default ran 414-427 us against 562-592 with that scale ring. Below, the
# decode-sized problems keep the batched kernel (unmeasured there).
BATCHED_AS_VARLEN_MIN_ROWS = 1024
# Those calls' offsets [M, 2M, ..., G * M] per (device, G, M), kept for good: a CUDA graph
# that captured a launch reads them at every replay, after its plan may have left the cache.
_ROW_OFFS: dict[tuple[torch.device, int, int], torch.Tensor] = {}


def _row_offsets(device: torch.device, G: int, M: int) -> torch.Tensor:
    key = (device, G, M)
    offs = _ROW_OFFS.get(key)
    if offs is None:
        offs = _ROW_OFFS[key] = torch.arange(M, G * M + 1, M, dtype=torch.int32, device=device)
    return offs


class Fp8BmmPlan(CheckedPlan):
    """scaled_grouped_mm's batched (3D x 3D) launch: one descriptor per operand; compute-bound
    block-scaled problems through the varlen kernel (BATCHED_AS_VARLEN_MIN_ROWS)."""

    def __init__(self, args: ScaledMmArgs, config: GemmConfig, trace: bool = False):
        x, w = args.x, args.w
        self.built_for = BuiltFor("Fp8BmmPlan", x=x, w=w, scale_a=args.scale_a,
                                  scale_b=args.scale_b, out=args.out)
        self.device = device = x.device
        G, M, N, K = x.shape[0], x.shape[1], args.N, args.K
        self.shape = (G, M, N)
        self.out_dtype = args.out_dtype
        self.granularity = args.granularity
        self.trivial = G == 0 or M == 0 or N == 0
        self.zero = K == 0
        self.cacheable = not launch_resources._fresh()
        self.varlen: Fp8MmPlan | None = None
        if self.trivial or self.zero:
            return
        if _as_varlen(args, config, trace):
            # x's G x M rows as one (G * M, K) operand with an expert every M rows (the
            # offsets made outside any capture: _as_varlen)
            self.offs = _row_offsets(device, G, M)
            self.varlen = Fp8MmPlan(dataclasses.replace(
                args, x=x.view(G * M, K), scale_a=args.scale_a.reshape(G * M, -1),
                offs=self.offs, out=None), config)
            self.choice = self.varlen.choice
            return
        nsm = sm_count(device)
        self.choice = choice = choose_fp8("batched", config, M, N, K, args.out_dtype.itemsize,
                                          args.granularity)
        tiles = G * (-(-M // (choice.tile_m * choice.cluster_m))) * (
            -(-N // (choice.tile_n * choice.cluster_n)))
        self.num_ctas, self.max_tiles = launch_kernel._grid(
            device, nsm, choice.cluster_m * choice.cluster_n, tiles, choice.tail_split)
        self.workspace = launch_resources.WorkspaceSlot(device, self.num_ctas, choice)
        self.no_workspace = launch_resources._small("workspace", device, torch.int64, (16,))
        self.meta, self.smeta, self.no_table, self.no_trace = _placeholders(device)
        self.meta32 = self.meta.view(torch.int32)
        self.offs = launch_resources._small("offs", device, torch.int32, (1,))
        self.trace = trace
        self.kernel = _kernel(fp8_compile_key("batched", args.dtype, args.out_dtype,
                                              args.granularity, choice, trace))
        self.views = tma_views((x, 2), (w, 1), (args.out, 2))  # (as in Fp8MmPlan)

    def launch(self, x, w, scale_a, scale_b, out):
        if out is None:
            out = torch.empty(self.shape, dtype=self.out_dtype, device=self.device)
        if self.trivial:
            return out
        if self.zero:
            return out.zero_()
        G, M, N = self.shape
        if self.varlen is not None:
            # (out's rows as one (G * M, N) view: _as_varlen checked that out has one)
            self.varlen.launch(x.view(G * M, -1), w, scale_a.reshape(G * M, -1), scale_b,
                               self.offs, out.view(G * M, N))
            return out
        g = self.granularity
        sfa = _dense(a_scale_view(scale_a, g, (G,), M))
        sfb = _dense(b_scale_view(scale_b, g, (G,), N))
        choice = self.choice
        if choice.smem_scales:
            sfa, sfb = _tma_scales(sfa, sfb)
        trace_t = (launch_resources._trace_tensor(self.num_ctas, self.max_tiles, self.device)
                   if self.trace else None)
        workspace = self.workspace.get(choice) if choice.tail_split else self.no_workspace
        kernel_out = out
        if self.views is not None:
            x, w, kernel_out = self.views(x, w, out)
        self.kernel(x, w, kernel_out, sfa, sfb, self.smeta, self.meta, self.meta32, self.offs,
                    self.no_table, workspace,
                    self.no_trace if trace_t is None else trace_t, G, self.num_ctas,
                    choice.swizzle, choice.a_policy, choice.b_policy, launch_kernel.PDL, 0)
        launch_info._local.raw = (choice, self.num_ctas, G, None, trace_t)
        return out


def _as_varlen(args: ScaledMmArgs, config: GemmConfig, trace: bool) -> bool:
    """Whether a batched call runs as the varlen form (BATCHED_AS_VARLEN_MIN_ROWS): block
    scales, the default config, at least that many rows per problem, x's and out's problems
    one run of rows each (a (G * M, .) view), A scales (G, M, K / 128), no trace, and not
    while a CUDA graph is being captured (the offsets are made outside it)."""
    x, out = args.x, args.out
    M = x.shape[1]
    return (args.granularity == "block" and M >= BATCHED_AS_VARLEN_MIN_ROWS and not trace
            and dataclasses.replace(config, backend="auto") == GemmConfig()
            and x.stride(0) == M * x.stride(1) and args.scale_a.dim() == 3
            and (out is None or out.stride(0) == M * out.stride(1))
            and not launch_resources._fresh())


class Fp8GeneralLaunch:
    """scaled_grouped_gemm's lists in one launch. Per call the (G, 8) operand rows
    [a_ptr, b_ptr, d_ptr, a_ld, b_ld, d_ld, M | N << 32, K] and the (G, 8) scale rows
    [sa_ptr, sa row stride, sa k-block stride, sb_ptr, sb k-block stride, sb column stride,
    0, 0] (kernels/sm90/grouped_gemm_fp8.Fp8GeneralProblems) go up in one pinned copy."""

    def __init__(self, args: ScaledGemmArgs, config: GemmConfig, trace: bool = False):
        self.args = args
        self.device = device = args.device
        sizes = args.sizes
        self.G = len(sizes)
        live = [(m, n, k) for m, n, k in sizes if m > 0 and n > 0]
        avg_m = sum(m for m, _, _ in live) / max(1, len(live))
        max_n = max((n for _, n, _ in live), default=128)
        max_k = max((k for _, _, k in live), default=0)
        self.choice = choice = choose_fp8("general", config, avg_m, max_n, max_k,
                                          args.out_dtype.itemsize, args.granularity)
        tm, tn = choice.tile_m * choice.cluster_m, choice.tile_n * choice.cluster_n
        self.total = sum(-(-m // tm) * -(-n // tn) for m, n, _ in live)
        if not self.total:
            return
        nsm = sm_count(device)
        self.num_ctas, self.max_tiles = launch_kernel._grid(
            device, nsm, choice.cluster_m * choice.cluster_n, self.total)
        self.workspace = launch_resources.WorkspaceSlot(device, self.num_ctas, choice)
        _, _, self.no_table, self.no_trace = _placeholders(device)
        self.seed_a = launch_resources._small("seed_a8", device, args.dtype, (128, 128), "n")
        self.seed_w = launch_resources._small("seed_w8", device, args.dtype, (128, 128), "k")
        # (N as the weight seed's: the compiled call checks that out and w share N)
        self.seed_d = launch_resources._small("seed_d8", device, args.out_dtype, (128, 128), "n")
        self.seed_sa = launch_resources._small("seed_sa", device, torch.float32, (1, 1))
        self.seed_sb = launch_resources._small("seed_sb", device, torch.float32, (1, 1, 1))
        self.trace = trace
        self.kernel = _kernel(fp8_compile_key("general", args.dtype, args.out_dtype,
                                              args.granularity, choice, trace))

    def launch(self, outs: list[torch.Tensor]) -> list[torch.Tensor]:
        """D_i = the scaled A_i @ B_i into outs (one per problem)."""
        if not self.total:
            return outs  # (every problem is empty: M = 0 or N = 0)
        args, G = self.args, self.G
        g = args.granularity
        host = launch_resources._pinned((2, G, 8), torch.int64)
        rows = host.numpy()
        rows[:] = 0
        for i, (a, b, sa, sb, o, (m, n, k)) in enumerate(zip(args.a, args.b, args.scale_a,
                                                             args.scale_b, outs, args.sizes)):
            rows[0, i, 6] = m | (n << 32)
            if m == 0 or n == 0:
                continue  # no tiles: nothing else of the row is read
            # The scale views' strides go into the table as they are: a single per-tensor
            # value is read through zero strides, with no copy.
            va = a_scale_view(sa, g, (), m)
            vb = b_scale_view(sb, g, (), n)
            rows[0, i] = (a.data_ptr(), b.data_ptr(), o.data_ptr(), a.stride(0), b.stride(1),
                          o.stride(0), m | (n << 32), k)
            rows[1, i, :6] = (va.data_ptr(), va.stride(0), va.stride(1), vb.data_ptr(),
                              vb.stride(0), vb.stride(1))
        dev = host.to(self.device, non_blocking=True)
        if launch_resources._capturing():
            # The captured copy reads it at every replay.
            launch_resources._graph_keepalive.append(host)
        meta, smeta = dev[0], dev[1]
        choice = self.choice
        trace_t = (launch_resources._trace_tensor(self.num_ctas, self.max_tiles, self.device)
                   if self.trace else None)
        self.kernel(self.seed_a, self.seed_w, self.seed_d, self.seed_sa, self.seed_sb, smeta,
                    meta, meta.view(torch.int32),
                    launch_resources._small("offs", self.device, torch.int32, (1,)),
                    self.no_table, self.workspace.get(choice),
                    self.no_trace if trace_t is None else trace_t, G, self.num_ctas,
                    choice.swizzle, choice.a_policy, choice.b_policy, launch_kernel.PDL, 0)
        launch_info._local.raw = (choice, self.num_ctas, G, None, trace_t)
        return outs


def new_outputs(sizes, dtype, device) -> list[torch.Tensor]:
    """The general form's outputs as row blocks of one allocation per distinct N (rows are
    16-byte multiples wherever the kernel stores them, so every output starts aligned)."""
    by_n: dict[int, list[int]] = {}
    for i, (_, n, _) in enumerate(sizes):
        by_n.setdefault(n, []).append(i)
    outs: list[torch.Tensor | None] = [None] * len(sizes)
    for n, members in by_n.items():
        per = [sizes[i][0] for i in members]
        block = torch.empty(sum(per), n, dtype=dtype, device=device)
        for i, piece in zip(members, block.split_with_sizes(per)):
            outs[i] = piece
    return outs  # type: ignore[return-value]


def trace_fp8(args: ScaledMmArgs, config: GemmConfig):
    """Run scaled_grouped_mm with the tile trace on (tests): (out, LaunchInfo)."""
    plan = (Fp8BmmPlan(args, config, trace=True) if args.batched
            else Fp8MmPlan(args, config, trace=True))
    if args.batched:
        out = plan(args.x, args.w, args.scale_a, args.scale_b, args.out)
    else:
        out = plan(args.x, args.w, args.scale_a, args.scale_b, args.offs.contiguous(), args.out)
    return out, launch_info.last_launch()

