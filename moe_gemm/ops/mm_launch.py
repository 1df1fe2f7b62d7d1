"""grouped_mm on the host: the MoE (varlen) form and the batched (3-D x 3-D) form, one grouped
launch each.

Everything that follows from shapes, strides, dtypes and the config is built once per signature
and kept in a plan (MmPlan, BmmPlan): the kernel choice (ops/heuristics.py), the grid and the
compiled kernel (ops/launch_kernel.py), the workspace and placeholders
(ops/launch_resources.py). ops/api.py finds the plan of a repeated call (ops/signature.py) and
the call itself then only allocates its output, looks up its workspace and calls the kernel.
grouped_mm never reads GPU values on the host unless visitor="host" is asked for.
"""

from __future__ import annotations

import torch

from moe_gemm.config import GemmConfig
from moe_gemm.env import env_value
from moe_gemm.ops import launch_kernel, launch_resources
from moe_gemm.ops.heuristics import choose_batched, choose_varlen
from moe_gemm.ops.kernel_cache import kernel_constants
from moe_gemm.ops.launch_info import _local
from moe_gemm.ops.signature import BuiltFor, CheckedPlan
from moe_gemm.ops.support import empty_k_result, operand_major, tma_views
from moe_gemm.ops.validation import GroupedBmmArgs, GroupedMmArgs


def _maybe_autotune(form: str, args, config: GemmConfig) -> None:
    """Online autotune (MOE_GEMM_AUTOTUNE=1, moe_gemm.tuning.online) of a new grouped_mm
    signature, before its kernel is chosen; never while a CUDA graph is being captured."""
    if env_value("MOE_GEMM_AUTOTUNE") and not launch_resources._capturing():
        from moe_gemm.tuning import online

        if online.requested(config):
            tune = online.ensure_tuned_varlen if form == "varlen" else online.ensure_tuned_batched
            tune(args, config)


class MmPlan(CheckedPlan):
    """Everything about a grouped_mm launch that depends only on shapes, strides, dtypes and
    the config: built once per signature (ops/api.py caches it), so a repeated call costs its
    output's allocation and the kernel call."""

    def __init__(self, args: GroupedMmArgs, config: GemmConfig, trace: bool = False):
        x, w = args.x, args.w
        self.built_for = BuiltFor("MmPlan", x=x, w=w, offs=args.offs, out=args.out)
        self.device = device = x.device
        T, K, E, N = args.T, args.K, args.E, args.N
        self.T, self.N, self.E = T, N, E
        self.out_dtype = args.out_dtype
        self.zero_tail = args.out is None
        self.trivial = T == 0 or N == 0 or E == 0
        # K = 0: every routed row is an empty sum, written here (as BmmPlan does): the launch-
        # time TMA descriptors of x and w cannot have an empty K extent.
        self.zero = K == 0
        # (placeholders made while capturing are the graph's)
        self.cacheable = not launch_resources._fresh()
        if self.trivial or self.zero:
            return
        nsm = launch_kernel.sm_count(device)
        _maybe_autotune("varlen", args, config)
        self.choice = choice = choose_varlen(
            config, T, E, N, K, nsm, args.out_dtype.itemsize,
            **launch_kernel.table_keys(device, args.dtype, args.out_dtype), swap_ok=True)
        b_major = "k" if operand_major(w) == "col" else "n"
        # Size-1 dimensions with strides the compiled kernel's 16-byte rule would refuse (a
        # decode step's x (1, K) of odd K, a (T, 1) column slice): its argument check reads
        # every stride, so they travel as views that keep the rule (as in BmmPlan).
        self.views = tma_views((x, 1), (w, 1 if b_major == "k" else 2), (args.out, 1))
        self.num_problems = E + (1 if self.zero_tail else 0)
        self.tiles_n = -(-N // choice.tile_n)
        self.nsm = nsm
        self.trace = trace
        if choice.visitor == "device":
            self.num_ctas, self.max_tiles = launch_kernel.varlen_grid(
                device, nsm, choice, T, self.num_problems, N)
            self.workspace = launch_resources.WorkspaceSlot(device, self.num_ctas, choice)
        self.meta = launch_resources._small("meta", device, torch.int64, (1, 8))
        self.meta32 = self.meta.view(torch.int32)
        self.no_table = launch_resources._small("table", device, torch.int32, (1, 1, 2))
        self.no_trace = launch_resources._small("trace", device, torch.int32, (1, 1, 4))
        self.kernel = launch_kernel._compiled(launch_kernel._compile_key(
            "varlen", args.dtype, args.out_dtype, b_major, choice, trace))
        self.constants = kernel_constants(self.kernel, self.meta, self.meta32, self.no_table,
                                          self.no_trace)

    def launch(self, x, w, offs, out):
        if out is None:
            out = torch.empty(self.T, self.N, dtype=self.out_dtype, device=self.device)
        if self.trivial:
            return out.zero_() if self.zero_tail and self.E == 0 else out
        if self.zero:
            return empty_k_result(out, offs, given=not self.zero_tail)
        choice = self.choice
        ov = out
        if self.views is not None:
            x, w, ov = self.views(x, w, out)
        if choice.visitor == "host":
            self._host_visitor(x, w, offs, ov)
            return out
        if self.trace:
            self._launch(x, w, offs, ov, self.num_ctas, self.no_table, self.max_tiles,
                         self.workspace.get(choice))
            return out
        meta, meta32, no_table, no_trace = self.constants
        self.kernel(x, w, ov, meta, meta32, offs, no_table, self.workspace.get(choice),
                    no_trace, self.num_problems, self.num_ctas, choice.swizzle, choice.a_policy,
                    choice.b_policy, launch_kernel.PDL, 0)
        _local.raw = (choice, self.num_ctas, self.num_problems, None, None)
        return out

    def _host_visitor(self, x, w, offs, out):
        # The host visitor needs per-expert sizes on the host: one device-to-host copy of offs
        # (a synchronisation). "auto" never picks it for grouped_mm.
        choice, T = self.choice, self.T
        bounds = offs.to("cpu", torch.int64).clamp(0, T).tolist()
        starts = [0] + bounds[:-1]
        rows = [max(0, e - s) for s, e in zip(starts, bounds)]
        if self.zero_tail:
            rows.append(max(0, T - (bounds[-1] if bounds else 0)))
        counts = tuple(-(-r // choice.tile_m) * self.tiles_n for r in rows)
        total = sum(counts)
        if total == 0:
            return out
        num_ctas = max(1, min(self.nsm, total))
        table = launch_resources._table_tensor(counts, num_ctas, self.device)
        workspace = launch_resources._kernel_workspace(self.device, num_ctas, choice)
        return self._launch(x, w, offs, out, num_ctas, table, -(-total // num_ctas), workspace)

    def _launch(self, x, w, offs, out, num_ctas, table, max_tiles, workspace):
        choice = self.choice
        trace_t = (launch_resources._trace_tensor(num_ctas, max_tiles, self.device)
                   if self.trace else None)
        self.kernel(x, w, out, self.meta, self.meta32, offs, table, workspace,
                    self.no_trace if trace_t is None else trace_t, self.num_problems, num_ctas,
                    choice.swizzle, choice.a_policy, choice.b_policy, launch_kernel.PDL, 0)
        _local.raw = (choice, num_ctas, self.num_problems, None, trace_t)
        return out


def grouped_mm_cute(args: GroupedMmArgs, config: GemmConfig, *, trace: bool = False
                    ) -> torch.Tensor:
    offs = args.offs if args.offs.is_contiguous() else args.offs.contiguous()
    return MmPlan(args, config, trace).launch(args.x, args.w, offs, args.out)


class BmmPlan(CheckedPlan):
    """grouped_mm's 3D x 3D (batched) launch, built once per signature like MmPlan: one
    descriptor per operand, no per-problem metadata, so a call is O(1) on the host."""

    def __init__(self, args: GroupedBmmArgs, config: GemmConfig, trace: bool = False):
        x, w = args.x, args.w
        self.built_for = BuiltFor("BmmPlan", x=x, w=w, out=args.out)
        self.device = device = x.device
        G, M, N, K = args.G, args.M, args.N, args.K
        self.shape = (G, M, N)
        self.out_dtype = args.out_dtype
        self.trivial = G == 0 or M == 0 or N == 0
        self.zero = K == 0
        self.cacheable = not launch_resources._fresh()
        if self.trivial or self.zero:
            return
        nsm = launch_kernel.sm_count(device)
        _maybe_autotune("batched", args, config)
        self.choice = choice = choose_batched(
            config, G, M, N, K, nsm, args.out_dtype.itemsize,
            **launch_kernel.table_keys(device, args.dtype, args.out_dtype))
        self.w_major = "k" if operand_major(w) == "col" else "n"
        self.tiles = G * (-(-M // (choice.tile_m * choice.cluster_m))) * (
            -(-N // (choice.tile_n * choice.cluster_n)))
        self.num_ctas, self.max_tiles = launch_kernel._grid(
            device, nsm, choice.cluster_m * choice.cluster_n, self.tiles, choice.tail_split)
        self.trace = trace
        self.meta = launch_resources._small("meta", device, torch.int64, (1, 8))
        self.meta32 = self.meta.view(torch.int32)
        self.offs = launch_resources._small("offs", device, torch.int32, (1,))
        self.no_table = launch_resources._small("table", device, torch.int32, (1, 1, 2))
        self.no_trace = launch_resources._small("trace", device, torch.int32, (1, 1, 4))
        # Without the tail split the kernel never touches its workspace (one descriptor per
        # operand, no ring): a small placeholder does.
        self.workspace = launch_resources.WorkspaceSlot(device, self.num_ctas, choice)
        self.no_workspace = launch_resources._small("workspace", device, torch.int64, (16,))
        self.kernel = launch_kernel._compiled(launch_kernel._compile_key(
            "batched", args.dtype, args.out_dtype, self.w_major, choice, trace))
        self.constants = kernel_constants(self.kernel, self.meta, self.meta32, self.offs,
                                          self.no_table, self.no_trace, self.no_workspace)
        # Size-1 dimensions whose strides the compiled kernel's 16-byte rule would refuse (a
        # (G, 1, K) slice of odd K) travel as views that keep it.
        self.views = tma_views((x, 2), (w, 1 if self.w_major == "k" else 2), (args.out, 2))

    def launch(self, x, w, out):
        if out is None:
            out = torch.empty(self.shape, dtype=self.out_dtype, device=self.device)
        if self.trivial:
            return out
        if self.zero:
            return out.zero_()
        choice = self.choice
        trace_t = (launch_resources._trace_tensor(self.num_ctas, self.max_tiles, self.device)
                   if self.trace else None)
        ov = out
        if self.views is not None:
            x, w, ov = self.views(x, w, out)
        meta, meta32, offs, no_table, no_trace, no_workspace = self.constants
        workspace = self.workspace.get(choice) if choice.tail_split else no_workspace
        self.kernel(x, w, ov, meta, meta32, offs, no_table, workspace,
                    no_trace if trace_t is None else trace_t, self.shape[0],
                    self.num_ctas, choice.swizzle, choice.a_policy, choice.b_policy,
                    launch_kernel.PDL, 0)
        _local.raw = (choice, self.num_ctas, self.shape[0], None, trace_t)
        return out


def grouped_bmm_cute(args: GroupedBmmArgs, config: GemmConfig, *, trace: bool = False
                     ) -> torch.Tensor:
    return BmmPlan(args, config, trace).launch(args.x, args.w, args.out)
