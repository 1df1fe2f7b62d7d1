"""Host side of the fused MoE grouped GEMM (kernels/sm90/fused_moe.py): kernel choice, the
TMA rules of its operands, and FusedPlan, built once per signature like mm_launch.MmPlan.

The kernel choice starts from grouped_mm's (heuristics.choose_varlen over the accumulator shape:
S routed rows, N = w's columns, K; tuned tables included); what a table measured on the fused
kernels themselves (tuned.FUSED_FORMS, by gate and bias) takes precedence (fused_tuned). Where
grouped_mm would run swapped tiles (swap_rules' window: about one 256-row tile per expert), a
gate over concat weights runs on them too (kernels/sm90/swapped_fused.py; without a gate only
on long K with at most one such tile per expert, or where config.swap_ab pins them:
`swappable`). Otherwise the choice is fitted to what the plain fused kernel can build
(fit_fused): a gated tile needs tile_n a multiple of 32; the in-kernel gather (gather-A)
serves decode batches below GATHER_MAX_ROWS routed rows, where it saves index_select's launch;
it needs no A multicast and, in that form, at most 128 rows and 128 accumulator registers per
thread (its rows' indices sit in registers). The wide form
(MOE_GEMM_FUSED_GATHER_WIDE=1, opt-in) gathers at every batch size and keeps any tile below
the heavy accumulators (its rows' indices in shared memory). It saves the routed copy of x
(S x K elements) but runs the gate-up GEMM slower than index_select + the same tile on wide
weights (H200, 2026-11-29: 0.87-0.96x on DeepSeek-V3 EP8, 0.90-0.95x on Mixtral-8x7B) and
the whole layer slower on narrow ones (GATHER_MAX_ROWS says by how much). The fused
epilogue's extra registers (bias, row weights, activation) are kept off the heaviest
accumulators (> 192 registers: ptxas spilled a few bytes there), and with both a bias and row
weights from the whole-tile epilogue. The sigmoid gates (SiLU, clamped SwiGLU) take the SFU's
exp2 and reciprocal except on biased tiles of 192 accumulator registers (fast_gate).
"""

from __future__ import annotations

import dataclasses

import torch

from moe_gemm.capability import sm_count
from moe_gemm.config import COOPERATIVE_TILES, GemmConfig
from moe_gemm.env import env_value
from moe_gemm.kernels.sm90.constants import (
    CLAMPED_GATES,
    HEAVY_ACC_REGS,
    SIGMOID_GATES,
    SWAP_TILE_ROWS,
    acc_regs,
    fused_problem,
)
from moe_gemm.ops import launch_info, launch_kernel, launch_resources, tuned
from moe_gemm.ops.fused_validation import FusedMmArgs
from moe_gemm.ops.heuristics import (
    FAST_GATE_ENV,
    GATHER_FENCE_ENV,
    GATHER_WIDE_ENV,
    SWAP_AB_ENV,
    KernelChoice,
    choose_varlen,
    varlen_hit_choice,
    with_peek_wait,
    with_split_ways,
    with_trim_a,
)
from moe_gemm.ops.signature import BuiltFor, CheckedPlan
from moe_gemm.ops.support import (
    MAX_PROBLEMS,
    TMA_ALIGN_BYTES,
    _dtype_problem,
    _neg_problem,
    _out_row_problem,
    operand_major,
    tma_problem,
    tma_views,
)
from moe_gemm.ops.token_gather import gather_untracked

FUSED_MAX_ACC_REGS = 192
# The SFU sigmoid (fast_gate) frees ptxas to hoist a biased epilogue's loads: with a bias on
# 192 accumulator registers a thread it spilled 496-680 bytes (sm_90a: ping-pong 128x192 in
# every gate layout, cooperative 256x192; the IEEE sigmoid none) and ran gpt-oss-120b's gate-up
# at 4096 tokens 9.5% slower (H200, 2026-11-29). Those tiles keep the IEEE sigmoid.
FAST_GATE_BIASED_ACC_REGS = 192
# The in-kernel gather only below this many routed rows (decode: a token or a few); from it on
# the plan gathers with index_select. Whole MoE layer forward, default against index_select,
# CUDA-graph replays (H200, 2026-12-02 and 12-03, benchmarks.bench_moe_layer): 1 token
# 0.99-1.04x (Qwen3-30B-A3B 1.04x, DeepSeek-V3 EP8 1.01x), but from 16 tokens (32-1024 routed
# rows) index_select is as fast or faster, by 1.5-2.5% at 16 tokens on three of four models
# (DeepSeek-V3 EP8: 0.7771 ms gathered, 0.7576 ms with index_select, 0.7657 ms unfused): its
# launch costs less than the cp.async gather's slower main loop (5-11% of the GEMM where it
# is compute-bound) once a tile has more than a few rows. The wide form on narrow weights,
# which won the gate-up GEMM alone (Qwen3-30B-A3B, N = 1536: 1.06-1.11x at 8192 routed rows,
# benchmarks.fused_configs), lost the whole layer in both runs: 0.98-0.99x at 1024 tokens,
# 0.94-0.98x at 4096, 0.93-0.95x at 16384 (2026-12-03). With the gather's copies at a few
# instructions each (kernels/sm90/gather.py, 2026-12-04) the wide form ran the whole layer at
# 0.96-1.06x index_select's speed (Qwen3-30B-A3B, DeepSeek-V3 EP8, gpt-oss-120b, Mixtral-8x7B,
# 1024-16384 tokens, two runs), within what the harness gives one kernel timed under two names
# (Qwen3's 16384-token gate-up keeps its 1x2 cluster and so index_select under the switch:
# 1.040 and 1.025x); the gate-up GEMM alone gained beyond that only on Qwen3-30B-A3B at 4096
# tokens (1.05-1.06x). It stays opt-in (gather-ab-nvidia-h200-2026-12-04.json).
GATHER_MAX_ROWS = 32
_GATHER_PINGPONG_N = (128, 192, 256)  # ping-pong 64-row tiles (config.PINGPONG_TILES)


def fused_unsupported(args: FusedMmArgs) -> str | None:
    """Why the fused kernel cannot take these arguments (the torch backend then runs), or
    None."""
    why = _dtype_problem(args.dtype, args.out_dtype)
    if why:
        return why
    if args.E > MAX_PROBLEMS:
        return f"{args.E} experts exceed the kernel's {MAX_PROBLEMS}"
    if args.S == 0 or args.E == 0 or args.N_out == 0:
        return None
    if args.K > 0:
        why = (_neg_problem("x or w", args.x, args.w) or tma_problem("x", args.x)
               or tma_problem("w", args.w))
        if why:
            return why
        if operand_major(args.x) != "row":
            return "x must be row-major (K contiguous) for the kernel"
    if args.gate is not None and args.gate_layout == "concat" and operand_major(args.w) != "col":
        return ("the concat gate layout needs a K-major w (gate_up_proj (E, 2I, H) passed as "
                "gate_up_proj.transpose(1, 2)); repack other layouts with "
                "moe_gemm.fused.interleave_gate_up")
    if args.out is not None:
        if args.out.stride(-1) != 1 and args.N_out > 1:
            return "out must have unit stride along N"
        return tma_problem("out", args.out)
    return _out_row_problem("out", args.N_out, args.out_dtype)


def fit_fused(choice: KernelChoice, gate: bool, gather: bool,
              bias_and_scale: bool = False, heavy_epilogue: bool = True,
              wide_gather: bool = False) -> KernelChoice:
    """grouped_mm's choice fitted to the fused options (see the module docstring). With a
    bias and row weights both, the whole-tile epilogue (every subtile's loads at once) spilled
    32 bytes under ptxas: those kernels store subtile by subtile. heavy_epilogue: a gate or a
    bias (their per-column values and the activation need registers beside the accumulator);
    row weights alone (one value per row) keep grouped_mm's tile. wide_gather: a gather keeps
    any tile below HEAVY_ACC_REGS accumulator registers (the module docstring)."""
    if bias_and_scale and choice.epi_whole:
        choice = dataclasses.replace(choice, epi_whole=False)
    if choice.tail_split and (choice.schedule != "cooperative"
                              or choice.cluster_m * choice.cluster_n > 1):
        # The fused epilogues were built and GPU-tested with the tail split of cooperative
        # 1x1 tiles only; a ping-pong or clustered split (grouped_mm's) runs unsplit here.
        choice = dataclasses.replace(choice, tail_split=False)
    schedule, tm, tn = choice.schedule, choice.tile_m, choice.tile_n
    cn = choice.cluster_n
    if gate and tn % 32:
        tn -= tn % 32  # 208 -> 192
    if heavy_epilogue and acc_regs(schedule, tm, tn) > FUSED_MAX_ACC_REGS:
        tm, tn = (128, 256) if schedule == "cooperative" else (128, 192)
    if gather:
        cn = 1
        if wide_gather and acc_regs(schedule, tm, tn) < HEAVY_ACC_REGS:
            pass  # the tile as it is: its rows' indices in shared memory
        elif schedule == "cooperative":
            tm = 128
        elif acc_regs(schedule, tm, tn) > 128:
            tm, tn = 64, next(n for n in _GATHER_PINGPONG_N if n >= min(tn, 256))
    if schedule == "cooperative" and (tm, tn) not in COOPERATIVE_TILES:
        tm, tn = 128, 256
    if (tm, tn, cn) == (choice.tile_m, choice.tile_n, choice.cluster_n):
        return dataclasses.replace(choice, visitor="device")
    # A new tile: the stage count and the whole-tile epilogue were chosen for the old one.
    return dataclasses.replace(choice, visitor="device", tile_m=tm, tile_n=tn, cluster_n=cn,
                               stages=None, epi_whole=False)


def _same_tile(a: KernelChoice, b: KernelChoice) -> bool:
    return (a.schedule, a.tile_m, a.tile_n, a.cluster_m, a.cluster_n) == (
        b.schedule, b.tile_m, b.tile_n, b.cluster_m, b.cluster_n)


def fused_choice(args: FusedMmArgs, config: GemmConfig, nsm: int,
                 device: torch.device, rows: int | None = None) -> tuple[KernelChoice, bool]:
    """(the kernel's config, whether the kernel gathers A's rows itself). rows: the routed
    rows the choice plans for (the masked layout: experts times the expected rows each;
    default S).

    With a row_index, the in-kernel gather is used below GATHER_MAX_ROWS routed rows (at any
    size with MOE_GEMM_FUSED_GATHER_WIDE=1, in the wide form), and only where it keeps the
    tile the options would get without it: gather-A caps the tile (no A multicast; in the
    register form at most 128 rows and 128 accumulator registers per thread), and on an H100
    (2026-11-25) a capped tile lost 1.3-2x on prefill shapes (Mixtral 8x7B gate-up at 2k
    routed rows: 1.76 ms gathered in a 64x192 tile against 0.96 ms for a 128x192 tile after a
    0.02 ms index_select). Otherwise the plan gathers with index_select and the kernel reads the
    routed rows."""
    # table_unswap=False: a tuned entry timed on grouped_mm's kernels with the swapped kernel
    # slower does not keep these kernels off swapped tiles where `swappable` and the window
    # take them. Mixtral-8x22B's down GEMM at 192-256 rows per expert (H200, 2026-12-04,
    # benchmarks.fused_configs): the entry's ping-pong 192x128 in a 1x2 cluster, 1.021x the
    # swapped kernel on grouped_mm (the tuner's skewed routing), ran the fused down GEMM at
    # 0.86-0.88x of the swapped tiles under the layer's router.
    choice = choose_varlen(
        config, args.S if rows is None else rows, args.E, args.N, args.K, nsm,
        args.out_dtype.itemsize, **launch_kernel.table_keys(device, args.dtype, args.out_dtype),
        swap_ok=rows is None and swappable(args, config), table_unswap=False)
    if rows is None:
        choice = fused_tuned(args, config, nsm, device) or choice
    if choice.swap_ab:
        # The swapped kernel's fixed tile (kernels/sm90/swapped_fused.py); the plan gathers
        # the routed rows with index_select.
        return choice, False
    gate = args.gate is not None
    extra = dict(bias_and_scale=args.bias is not None and args.row_weight is not None,
                 heavy_epilogue=gate or args.bias is not None)
    fitted = fit_fused(choice, gate, False, **extra)
    wide = env_value(GATHER_WIDE_ENV)
    gather = (args.row_index is not None and whole_chunk_rows(args)
              and (args.S < GATHER_MAX_ROWS or wide))
    if gather:
        gathered = fit_fused(choice, gate, True, wide_gather=wide, **extra)
        gather = _same_tile(gathered, fitted)
        if gather:
            fitted = gathered
    # Trimmed A loads decided for the fitted tile (the fit may change it); none where the
    # kernel gathers A's rows itself.
    fitted = dataclasses.replace(fitted, trim_a=False, packed_pairs=False)
    if not gather:
        fitted = with_trim_a(fitted)
    fitted = with_split_ways(with_peek_wait(fitted))
    b_major = "k" if operand_major(args.w) == "col" else "n"
    why = fused_problem("varlen", fitted.schedule, fitted.tile_m, fitted.tile_n, b_major,
                        fitted.cluster_n, args.gate or "", args.gate_layout, gather)
    if why is not None:  # (a config that pins what the options cannot build)
        raise ValueError(f"the fused kernel cannot use this config: {why}")
    return fitted, gather


def fused_tuned(args: FusedMmArgs, config: GemmConfig, nsm: int,
                device: torch.device) -> KernelChoice | None:
    """The tuned tables' answer for the fused kernel itself (tuned.FUSED_FORMS, timed on the
    fused kernels): the entry for this launch's form (gate, bias), dtypes, E, N, K and
    rows-per-expert bucket, else the config timed fastest on this shape within a quarter
    octave of its rows (tuned.measured_lookup; no vote: grouped_mm's answer stays where the
    fused kernels were not timed); None without either, for a pinned config, or for swapped
    tiles these options cannot run or were turned off.

    gpt-oss-120b's biased GEMMs on an H200 (2026-12-04, benchmarks.fused_configs): grouped_mm's
    cooperative picks at 32-128 rows per expert ran the fused gate-up 0.93-0.97x and the fused
    down 0.91-0.99x as fast as the best ping-pong tile timed (the bias and the activation
    beside the accumulators weigh on a cooperative tile, whose two warpgroups both leave the
    k-loop for its epilogue; a ping-pong warpgroup's epilogue overlaps the other's k-loop)."""
    keys = launch_kernel.table_keys(device, args.dtype, args.out_dtype)
    if keys["device"] is None or config.tuning_pinned or args.S <= 0 or args.E <= 0:
        return None
    key = tuned.Key(tuned.fused_form(args.gate is not None, args.bias is not None),
                    keys["dtype"], keys["out_dtype"], args.E, args.N, args.K,
                    tuned.rows_bucket(args.S / args.E))
    hit = tuned.measured_lookup(keys["device"], key, args.S)
    if hit is None:
        return None
    if dict(hit.fields).get("swap_ab") and (
            config.swap_ab is False or env_value(SWAP_AB_ENV) is False
            or not swappable(args, GemmConfig(swap_ab=True))):
        return None
    return varlen_hit_choice(config, hit, args.S, args.E, args.N, args.K, nsm,
                             args.out_dtype.itemsize)


# Where the down GEMM (no gate) takes swapped tiles unpinned (swappable): K of at least 4096
# and at most one 256-row swapped tile per expert on average.
DOWN_SWAP_MIN_K = 4096
DOWN_SWAP_MAX_ROWS = SWAP_TILE_ROWS


def swappable(args: FusedMmArgs, config: GemmConfig) -> bool:
    """Whether these options may run swapped tiles (kernels/sm90/swapped_fused.py; 16-bit
    output, swap_rules checks): a gate over concat weights (the kernel pairs gate and up
    columns across its two math warpgroups); the options without a gate (the down GEMM) where
    config.swap_ab pins them, else on long K with at most one swapped tile per expert
    (DOWN_SWAP_MIN_K, DOWN_SWAP_MAX_ROWS).

    Without a gate the window's guess holds only there. On an H200 (2026-12-04,
    benchmarks.fused_configs, the epilogue's row weights loaded once a tile), swapped tiles
    over the plain fused kernel's at 192-256 rows per expert: Mixtral-8x7B (N 4096, K 14336)
    1.01-1.20x, Mixtral-8x22B (N 6144, K 16384) 1.01-1.20x, Llama-4-Scout (N 5120, K 8192)
    0.97-1.03x; at 320 rows (two swapped tiles an expert, each reading the expert's whole
    weight panel) Mixtral-8x7B 0.92x; on DeepSeek-V3 EP8's short K (N 7168, K 2048, where the
    epilogue weighs more against the k-loop) 0.97-1.01x. The gated gate-up GEMM gained
    1.02-1.09x at 192-320 rows on DeepSeek-V3 EP8 and Mixtral-8x7B."""
    if args.gate is None:
        if config.swap_ab is not None:
            return bool(config.swap_ab)
        return args.K >= DOWN_SWAP_MIN_K and args.S <= DOWN_SWAP_MAX_ROWS * max(args.E, 1)
    return args.gate_layout == "concat"


def whole_chunk_rows(args: FusedMmArgs) -> bool:
    """Whether x's rows are whole 16-byte chunks (K a multiple of 8 16-bit values), which the
    in-kernel gather needs: it copies a row 16 bytes at a time and a chunk that starts before
    K whole, so a shorter row would read up to 14 bytes past it (the row's padding, the next
    row, or past x's memory after its last row) into products with B's zero-filled rows,
    where a NaN or inf there makes the row NaN. (The TMA rule admits such rows only where x
    has one row, or a padded row stride.) The plan gathers those rows itself."""
    return (args.K * args.dtype.itemsize) % TMA_ALIGN_BYTES == 0


def masked_fused_choice(args: FusedMmArgs, config: GemmConfig, nsm: int,
                        device: torch.device, expected_m: int) -> KernelChoice:
    """The masked layout's choice (ops/fused_masked.py): fused_choice for E experts of
    expected_m rows, on the device visitor and without the tail split (the kernel finds the
    row counts on the GPU)."""
    from moe_gemm.ops.masked_launch import _masked_choice

    choice, _ = fused_choice(args, config, nsm, device, rows=args.E * expected_m)
    return _masked_choice(choice, config)


def fused_key(args: FusedMmArgs, choice: KernelChoice, b_major: str, gather: bool):
    key = launch_kernel._compile_key("varlen", args.dtype, args.out_dtype, b_major, choice, False)
    gate = args.gate or ""
    clamped = gate in CLAMPED_GATES
    return dataclasses.replace(
        key, gate=gate, gate_layout=args.gate_layout if gate else "",
        gate_alpha=args.gate_alpha if gate == "clamped_swiglu" else 0.0,
        gate_limit=args.gate_limit if clamped else 0.0, bias=args.bias is not None,
        row_scale=args.row_weight is not None, gather=gather,
        gather_fence=not gather or gather_fence(), fast_gate=fast_gate(args, choice))


def gather_fence() -> bool:
    """Whether an in-kernel gather's math warps fence the proxies before their WGMMAs read a
    gathered stage (GroupedGemmSm90._acquire_gathered; MOE_GEMM_GATHER_FENCE)."""
    return bool(env_value(GATHER_FENCE_ENV))


def fast_gate(args: FusedMmArgs, choice: KernelChoice) -> bool:
    """Whether the gated epilogue takes the SFU sigmoid: a sigmoid gate, the switch on, and
    no bias on FAST_GATE_BIASED_ACC_REGS accumulator registers or more."""
    if args.gate not in SIGMOID_GATES or not env_value(FAST_GATE_ENV):
        return False
    return args.bias is None or acc_regs(choice.schedule, choice.tile_m,
                                         choice.tile_n) < FAST_GATE_BIASED_ACC_REGS


class FusedPlan(CheckedPlan):
    """Everything about a fused launch that follows from shapes, strides, dtypes, the options
    and the config (ops/fused.py caches it per signature); a call converts the small per-row
    tensors when needed, allocates its output and launches."""

    def __init__(self, args: FusedMmArgs, config: GemmConfig, *,
                 expected_m: int | None = None):
        """expected_m: the masked layout (ops/fused_masked.py): x has E * M rows, offs holds
        each expert's valid row count (the kernel's row_counts), and the kernel choice plans
        for expected_m rows per expert."""
        self.built_for = BuiltFor("FusedPlan", x=args.x, w=args.w, offs=args.offs,
                                  row_index=args.row_index, row_weight=args.row_weight,
                                  bias=args.bias, out=args.out)
        self.device = device = args.x.device
        self.S, self.N_out, self.E = args.S, args.N_out, args.E
        self.out_dtype = args.out_dtype
        self.counts = expected_m is not None
        self.zero_tail = args.out is None and not self.counts
        self.trivial = self.S == 0 or self.N_out == 0 or self.E == 0
        self.cacheable = not launch_resources._fresh()
        if self.trivial:
            return
        nsm = sm_count(device)
        if self.counts:
            choice, self.gather = masked_fused_choice(args, config, nsm, device,
                                                      expected_m), False
        else:
            choice, self.gather = fused_choice(args, config, nsm, device)
        self.choice = choice
        # With a row_index the kernel does not gather itself: the plan does (index_select).
        self.host_gather = args.row_index is not None and not self.gather
        # index_select's copy has rows K elements apart, a stride that breaks the TMA rule
        # (16-byte multiples) where K is not a multiple of 8 16-bit values and several rows
        # are routed (a decode step's x (1, K) routed to its top-k experts, or a padded x):
        # those rows are gathered from x padded by gather_pad columns to a 16-byte multiple,
        # and the kernel reads the first K of each (TMA zero-fills past K, as for any padded
        # x). Only x's T rows are copied.
        align = TMA_ALIGN_BYTES // args.dtype.itemsize
        self.gather_pad = -args.K % align if self.host_gather else 0
        b_major = "k" if operand_major(args.w) == "col" else "n"
        # Size-1 dimensions with strides the compiled kernel's 16-byte rule would refuse (one
        # routed row of odd K, given; a (1, N) out of a wider buffer) travel as views that
        # keep it, as in grouped_mm's plans. A gathered x is a new (S, K + gather_pad) tensor's
        # first K columns: its layout stands in for it.
        x = (torch.empty(self.S, args.K + self.gather_pad, dtype=args.dtype,
                         device="meta")[:, :args.K] if self.host_gather else args.x)
        self.views = tma_views((x, 1), (args.w, 1 if b_major == "k" else 2), (args.out, 1))
        self.num_problems = self.E + (1 if self.zero_tail else 0)
        self.num_ctas, _ = launch_kernel.varlen_grid(device, nsm, choice, self.S,
                                                     self.num_problems, args.N)
        self.workspace = launch_resources.WorkspaceSlot(device, self.num_ctas, choice)
        self.meta = launch_resources._small("meta", device, torch.int64, (1, 8))
        self.meta32 = self.meta.view(torch.int32)
        self.no_table = launch_resources._small("table", device, torch.int32, (1, 1, 2))
        self.no_trace = launch_resources._small("trace", device, torch.int32, (1, 1, 4))
        self.no_index = launch_resources._small("fused_index", device, torch.int32, (1,))
        self.no_weight = launch_resources._small("fused_weight", device, torch.float32, (1,))
        self.no_bias = launch_resources._small("fused_bias", device, torch.float32, (1, 1))
        self.key = fused_key(args, choice, b_major, self.gather)
        if self.counts:
            self.key = dataclasses.replace(self.key, row_counts=True)
        self.kernel = launch_kernel._compiled(self.key)

    def launch(self, x, w, offs, row_index, row_weight, bias, out):
        if out is None:
            out = torch.empty(self.S, self.N_out, dtype=self.out_dtype, device=self.device)
        if self.trivial:
            return out.zero_() if self.zero_tail and self.E == 0 else out
        choice = self.choice
        index = self.no_index
        if self.host_gather:
            # Clamped as the kernel's gather clamps: unchecked indices on the GPU may give
            # wrong rows, never an out-of-bounds read (ops/token_gather.py).
            if self.gather_pad:
                K = x.shape[1]
                x = gather_untracked(torch.nn.functional.pad(x, (0, self.gather_pad)),
                                     row_index)[:, :K]
            else:
                x = gather_untracked(x, row_index)
        if row_index is not None and not self.host_gather:
            index = row_index if row_index.dtype == torch.int32 else row_index.int()
            index = index if index.is_contiguous() else index.contiguous()
        weight = self.no_weight
        if row_weight is not None:
            weight = row_weight.float() if row_weight.dtype != torch.float32 else row_weight
            weight = weight if weight.is_contiguous() else weight.contiguous()
        b = self.no_bias
        if bias is not None:
            b = bias.float() if bias.dtype != torch.float32 else bias
            b = b if b.is_contiguous() else b.contiguous()
        fused_args = (index, weight, b) if self.key.fused else ()  # (no option: the plain kernel)
        kernel_out = out
        if self.views is not None:
            x, w, kernel_out = self.views(x, w, out)
        self.kernel(x, w, kernel_out, self.meta, self.meta32, offs, self.no_table,
                    self.workspace.get(choice), self.no_trace, self.num_problems, self.num_ctas,
                    choice.swizzle, choice.a_policy, choice.b_policy, launch_kernel.PDL, 0,
                    *fused_args)
        launch_info._local.raw = (choice, self.num_ctas, self.num_problems, None, None)
        return out
