"""Numbers and rules the sm90 kernel and its host side must agree on. No DSL import, so the host
wrapper, the config checks and the heuristics can use them without loading the CuTe DSL."""

from __future__ import annotations

import math

TILE_K = 64  # one 128-byte swizzle row of 16-bit data
# Trimmed A loads (GroupedGemmSm90 trim_a, trimmed_a.py): an expert's last tile loads its A
# rows rounded up to 16 (two 8-row swizzle atoms, 2 KiB of 16-bit data) instead of a whole
# tile_m box, as 64-row boxes and then at most one 32- and one 16-row box, stacked from row 0
# (15 x 16 rows: 64 + 64 + 64 + 32 + 16 in a 256-row tile). Every height is a multiple of the
# swizzle atom, so each box lands at the swizzle phase the whole box would have; the binary
# split keeps a tail to at most a few TMA issues a stage (one box per 16 rows ran slower than
# whole boxes where most tiles are tails: GLM-4.5 gate/up, H200, 2026-11-30).
A_ROW_BOXES = (64, 32, 16)
# Swapped tiles (swapped.py): 128 weight columns (two m64 WGMMA blocks) by up to 256 rows (the
# WGMMA's largest N), an expert's rows split evenly over its tiles in units of 16 (the
# epilogue's stmatrix subtile; WGMMA's own step is 8).
SWAP_TILE_COLS = 128
SWAP_TILE_ROWS = 256
SWAP_ROW_UNIT = 16
DESC_BYTES = 128  # one CUtensorMap
SCHED_STAGES = 8  # scheduler records in flight: the search runs up to 8 tiles ahead
# general / varlen: the scheduler warp writes each record's descriptors (general: A, B, D;
# varlen: D) into a per-CTA ring of this many slots in the workspace. A slot is rewritten
# DESC_RING records later; the scheduler runs at most SCHED_STAGES records ahead of the store
# warp, whose TMA stores of a record have all drained (PipelineTmaStore keeps < 4 in flight)
# before it reads the next one.
DESC_RING = 2 * SCHED_STAGES
SLOT_BYTES = 3 * DESC_BYTES  # a ring slot: the record's A, B and D descriptors
SLOT_INTS = SLOT_BYTES // 8  # the same in the int64 workspace

# Tail split (device visitor, compile-time; both schedules, and per cluster tile under a 2-CTA
# cluster): when the last wave of tiles fills at most half the grid, each of its tiles is
# computed by several CTAs (`ways`), each over a share of K. The lower shares (launched
# first) write their fp32 accumulators to workspace slots and bump the tile's counter; the
# last one adds them to its own and runs the epilogue. The last wave then takes ~1/ways of a
# tile's time (mixtral, 56.4 waves of 128x256 tiles: ~1%; a launch of 16 tiles on 132 SMs:
# most of its time).
SPLIT_MIN_K_TILES = 16  # below this a half tile saves less than the 2 x 128 KiB fixup costs
# A share of fewer k-tiles than this (1024 of K) costs about as much in its fixup (the
# finisher reads each partial, 128 KiB for 128x256) as it saves: ways <= k_tiles / 16.
SPLIT_PART_K_TILES = 16
SPLIT_WAYS = 8  # the most CTAs one tile is split over (the kernel's split_ways default)
SPLIT_COUNTER_BYTES = 1024  # per-tile counters (one int32 per CTA, 132 on an H100/H200) ...
SPLIT_MAX_CTAS = SPLIT_COUNTER_BYTES // 4  # ... so at most this many CTAs


def split_workspace_bytes(num_ctas: int, tile_m: int, tile_n: int) -> tuple[int, int, int]:
    """(counters offset, partials offset, total bytes) of a tail-split kernel's workspace:
    the descriptor rings, then the counters (zeroed once, reset by every finisher), then
    num_ctas - 1 fp32 partial tiles (rem tail tiles of `ways` shares each, ways * rem <=
    num_ctas, publish at most num_ctas - rem partials)."""
    counters = num_ctas * DESC_RING * SLOT_BYTES
    partials = counters + SPLIT_COUNTER_BYTES
    return counters, partials, partials + max(num_ctas - 1, 0) * tile_m * tile_n * 4


# ---------------------------------------------------------------------------------------------
# Raster: the order of one problem's tiles (run-time, the kernel's `swizzle` argument).
#
# Tiles go in panels: `panel` consecutive m-tiles (along "m") or n-tiles (along "n"), the panel's
# own axis fastest, then across the other axis, panel after panel. With the persistent grid
# running ~one wave of consecutive tiles at a time, a panel keeps its rows of A (along "m") in
# L2 while B's columns stream through once per panel. Serpentine: odd panels walk the other
# axis backwards, so a panel starts on the columns (rows) the previous one ended on, still in
# L2. A panel of 0 means one panel spanning the problem (plain column-major along "m").
# The code packs the three choices into one int32, so the kernel's argument list is unchanged:
# bits 0-15 panel, bit 16 along "n", bit 17 serpentine. The plain numbers the heuristics have
# always passed (8, 16: panels of 8 or 16 m-tiles) keep their meaning.

RASTER_PANEL_MASK = 0xFFFF
RASTER_ALONG_N = 1 << 16
RASTER_SERPENTINE = 1 << 17


def raster_code(panel: int, along: str = "m", serpentine: bool = False) -> int:
    """The `swizzle` value of a raster: `panel` tiles per panel (0: one panel) along "m" or
    "n", odd panels reversed when `serpentine`."""
    if isinstance(panel, bool) or not isinstance(panel, int) or not 0 <= panel <= RASTER_PANEL_MASK:
        raise ValueError(f"raster panel must be an int in [0, {RASTER_PANEL_MASK}]; got {panel!r}")
    if along not in ("m", "n"):
        raise ValueError(f"raster along must be 'm' or 'n'; got {along!r}")
    return panel | (RASTER_ALONG_N if along == "n" else 0) | (
        RASTER_SERPENTINE if serpentine else 0)


def raster_fields(code: int) -> tuple[int, str, bool]:
    """(panel, along, serpentine) of a raster code (the inverse of raster_code)."""
    return (code & RASTER_PANEL_MASK, "n" if code & RASTER_ALONG_N else "m",
            bool(code & RASTER_SERPENTINE))


# ---------------------------------------------------------------------------------------------
# Tiles the kernel can build, and its register split.

# setmaxnreg budgets (registers per thread, multiples of 8): producer warpgroup / each of the
# two math warpgroups. 128 x 40 + 256 x 232 = 64,512 of the SM's 65,536. Accumulators of
# 208 fp32 registers per thread or more (128x208 ping-pong, 256x208 cooperative) leave too
# few of 232 for the epilogue's fragments and addresses (ptxas spilled ~3 KiB at 232): the
# producer drops to 24, the math warpgroups get 240 (128 x 24 + 256 x 240 = 64,512).
REGS_DEFAULT = (40, 232)
REGS_HEAVY = (24, 240)
HEAVY_ACC_REGS = 208
MAX_ACC_REGS = 208  # beyond this the epilogue no longer fits beside the accumulators


def acc_regs(schedule: str, tile_m: int, tile_n: int) -> int:
    """fp32 accumulator registers per math thread: a ping-pong warpgroup (128 threads) holds a
    whole tile, the two cooperative warpgroups (256 threads) one tile between them."""
    return tile_m * tile_n // (128 if schedule == "pingpong" else 256)


def register_split(schedule: str, tile_m: int, tile_n: int) -> tuple[int, int]:
    """(producer, math) registers per thread for setmaxnreg."""
    heavy = acc_regs(schedule, tile_m, tile_n) >= HEAVY_ACC_REGS
    return REGS_HEAVY if heavy else REGS_DEFAULT


SM90_SMEM_BYTES = 227 * 1024  # shared memory one sm90 CTA may use (the opt-in maximum)
SMEM_RESERVED = 2048  # the pipelines' mbarriers and buffer alignment
RECORD_INTS = 9  # int32 fields of a scheduler record (tile_scheduler.WorkTile)


def epilogue_staging(schedule: str, d_tile_n: int, epi_n: int = 32,
                     epi_whole: bool = False) -> tuple[tuple[int, int], int, int]:
    """(subtile (rows, columns), staging buffers per group, groups) of the epilogue.

    Ping-pong: each warpgroup stages its own 64-row subtiles (2 x 64x32 per warpgroup);
    cooperative: 4 x 128 x epi_n shared by both. The subtile width divides the stored tile (a
    wider one would write the neighbour tile's columns: 128x208 stores 13 subtiles of 16), and
    narrower subtiles get proportionally more buffers. The whole-tile epilogue has a buffer
    for every subtile of the tile."""
    pingpong = schedule == "pingpong"
    subtile = (64 if pingpong else 128, math.gcd(32 if pingpong else epi_n, d_tile_n))
    if epi_whole:
        buffers = d_tile_n // subtile[1]
    else:
        buffers = (2 if pingpong else 4) * 32 // subtile[1]
    return subtile, buffers, 2 if pingpong else 1


def ab_stage_limit(tile_m: int, tile_n: int, tile_k: int, ab_bits: int, d_bits: int,
                   subtile: tuple[int, int], buffers: int, groups: int, epi_whole: bool,
                   smem_bytes: int = SM90_SMEM_BYTES,
                   want: int | None = None, extra_bytes: int = 0,
                   stage_extra_bytes: int = 0) -> tuple[int, int]:
    """(most A/B stages, epilogue buffers per group) that fit in `smem_bytes` beside the
    epilogue staging, the scheduler ring and the barriers. When the default staging would
    leave fewer than 3 A/B stages (256-row tiles with fp32 output), it shrinks to 2 buffers:
    the mainloop needs a stage in flight while one is consumed and one refilled.

    `want`: a pinned A/B depth. Where the default staging cannot hold it, the staging keeps
    the most buffers per group (at least 2) that leave room for it: fewer subtiles' TMA stores
    in flight while the next are written, for one more A/B stage. That is the trade QuACK makes
    by default (A/B stages first): cooperative 128x192 and ping-pong 128x208 get a fifth stage
    at bf16 (40-42 KiB a stage) with 3 buffers instead of 4. Which one is faster is the
    tuner's question, so the default (want None) keeps the staging. `extra_bytes`: other
    shared memory of the kernel (the gather's row buffer); `stage_extra_bytes`: what each A/B
    stage carries beside its operands (the FP8 kernel's staged block scales)."""
    ab_bytes = (tile_m + tile_n) * tile_k * ab_bits // 8 + stage_extra_bytes
    subtile_bytes = subtile[0] * subtile[1] * d_bits // 8

    def fit(n_buffers: int) -> int:
        reserved = (SMEM_RESERVED + subtile_bytes * n_buffers * groups
                    + SCHED_STAGES * RECORD_INTS * 4 + extra_bytes)
        return (smem_bytes - reserved) // ab_bytes

    stages = fit(buffers)
    if stages < 3 and not epi_whole and fit(2) > stages:
        return fit(2), 2
    if want is not None and want > stages and not epi_whole and fit(2) > stages:
        # The most buffers that hold `want` stages; 2 (the deepest ring) if none does.
        fewer = next((b for b in range(buffers - 1, 1, -1) if fit(b) >= want), 2)
        return fit(fewer), fewer
    return stages, buffers


def config_stage_limit(schedule: str, tile_m: int, tile_n: int, whole_epilogue: bool,
                       ab_bits: int, d_bits: int, want: int | None = None) -> int:
    """The most A/B stages the plain kernel builds for a config as a tuned table or the tuner
    names it (the cooperative subtile at its default 32 columns), counting a staging shrunk to
    make room for `want`: ab_stage_limit for that config."""
    subtile, buffers, groups = epilogue_staging(schedule, tile_n, 32, whole_epilogue)
    return ab_stage_limit(tile_m, tile_n, TILE_K, ab_bits, d_bits, subtile, buffers, groups,
                          whole_epilogue, want=want)[0]


def tile_problem(schedule: str, tile_m: int, tile_n: int) -> str | None:
    """Why the kernel cannot build this tile for this schedule, or None if it can.

    WGMMA is m64 per warpgroup instruction and N a multiple of 8 up to 256; the epilogue's
    stmatrix (four 8x8 matrices per warp) and its subtiles need N a multiple of 16. Ping-pong:
    one warpgroup per tile of 64, 128 or 192 rows (one to three m64 WGMMAs per k-block; the
    epilogue stores 64-row subtiles). Cooperative:
    two warpgroups split 128 rows (one m64 each) or 256 rows (two m64 each, interleaved: warp-
    group 0 takes rows 0-63 and 128-191)."""
    if schedule == "pingpong":
        if tile_m not in (64, 128, 192):
            return f"ping-pong tiles have 64, 128 or 192 rows; got {tile_m}"
    elif schedule == "cooperative":
        if tile_m not in (128, 256):
            return f"cooperative tiles have 128 or 256 rows; got {tile_m}"
    else:
        return f"unknown schedule {schedule!r}"
    if tile_n % 16 or not 16 <= tile_n <= 256:
        return f"tile_n must be a multiple of 16 in [16, 256]; got {tile_n}"
    regs = acc_regs(schedule, tile_m, tile_n)
    if regs > MAX_ACC_REGS:
        return (f"{schedule} {tile_m}x{tile_n} needs {regs} accumulator registers per thread "
                f"(at most {MAX_ACC_REGS} fit beside the epilogue)")
    return None


# ---------------------------------------------------------------------------------------------
# Fused MoE options (compile-time; varlen form only; all off = the plain grouped GEMM).
#
# Gated epilogue: the gate-up GEMM computes 2 * I accumulator columns and stores I outputs,
# act(gate + b_gate) * (up + b_up), so every output needs its gate and up accumulator in the
# same thread. A WGMMA accumulator gives each thread two adjacent columns of every 8-column
# chunk (the same two in every chunk), so pairing whole 8-column chunks keeps each pair in one
# thread and leaves the output fragment laid out like the accumulator of a tile half as wide:
# the ordinary stmatrix epilogue then stores it. Two weight layouts pair chunks that way:
# - "concat": gate columns [0, I), up columns [I, 2I) (transformers, vLLM w13). The load warp
#   fetches B's tile as two TMA boxes of tile_n / 2 rows, the gate half then the up half, so
#   accumulator chunk c pairs with chunk c + tile_n / 16. Needs a K-major B (the halves are
#   whole swizzle atoms of K-contiguous rows).
# - "interleaved": gate and up alternate in blocks of GATE_BLOCK columns (gate 0-7, up 0-7,
#   gate 8-15, ...): chunk 2c pairs with 2c + 1; any B major, one TMA box.
# - "alternating": gate and up alternate column by column (gpt-oss: gate = h[:, ::2]). Each
#   thread's two adjacent columns are then one (gate, up) pair: it computes the output of
#   column 4c + lane % 4 of every chunk c, and a quad of lanes exchanges values by two
#   shuffles per output so each lane holds the two adjacent output columns stmatrix stores
#   (fused_epilogue.py); any B major, one TMA box, no repacked copy of the weight.
# The clamped gates clamp the gate from above and up into [-limit, limit] first:
# "clamped_swiglu" (gpt-oss) then takes (up + 1) * gate * sigmoid(alpha * gate),
# "clamped_silu" (swiglu_limit: GLM-5-Next, HY-V4, Step-3.7) silu(gate) * up.
GATES = ("silu", "gelu", "gelu_tanh", "clamped_swiglu", "clamped_silu")
CLAMPED_GATES = ("clamped_swiglu", "clamped_silu")  # the gates with a limit
SIGMOID_GATES = ("silu", "clamped_swiglu", "clamped_silu")  # the gates fast_gate applies to
GATE_LAYOUTS = ("concat", "interleaved", "alternating")
GATE_BLOCK = 8
# Gather-A: the four warps of the producer warpgroup load A's rows by index with cp.async
# (kernels/sm90/gather.py): warps 2 and 3 only that, warp 0 beside B's TMA, warp 1 beside the
# scheduler (two warps alone were bound by their instructions per stage on 128-row tiles). Where
# a tile has at most 128 rows and 128 accumulator registers a thread, each gather thread keeps
# the indices of its tile_m / 32 rows in registers, more than the default 40-register producer
# budget holds:
# those kernels split 56 / 224 (128 x 56 + 256 x 224 = 64,512 of 65,536; ptxas: no spills at
# 128 x 256). Larger tiles keep the tile's row indices in shared memory (4 bytes a row) and the
# default split: ptxas spills nothing at 40 producer registers for ping-pong 128x192 and
# cooperative 256x192 (the register form spilled 40 and 148 bytes there), but 28 bytes at the
# heavy split's 24, so a gathered tile needs fewer than HEAVY_ACC_REGS accumulator registers.
GATHER_WARPS = 4  # warps that gather
GATHER_FIRST_WARP = 2  # the first warp that only gathers
REGS_GATHER = (56, 224)
GATHER_MAX_ACC_REGS = 128  # the register form
GATHER_MAX_TILE_M = 128


def gather_rows_in_registers(schedule: str, tile_m: int, tile_n: int) -> bool:
    """Whether a gather kernel of this tile keeps its rows' indices in registers (the 56 / 224
    split), else in shared memory (the default split)."""
    return tile_m <= GATHER_MAX_TILE_M and acc_regs(schedule, tile_m, tile_n) <= GATHER_MAX_ACC_REGS


def fused_problem(form: str, schedule: str, tile_m: int, tile_n: int, b_major: str,
                  cluster_n: int, gate: str, gate_layout: str, gather: bool) -> str | None:
    """Why the kernel cannot build these fused options, or None if it can."""
    if form != "varlen":
        return f"the fused MoE options are built for the varlen form; got {form!r}"
    if gate:
        if gate not in GATES:
            return f"unknown gate {gate!r}; expected one of {', '.join(GATES)}"
        if gate_layout not in GATE_LAYOUTS:
            return f"unknown gate layout {gate_layout!r}; expected one of {GATE_LAYOUTS}"
        if tile_n % 32:
            # The output tile (tile_n / 2 columns) must be a multiple of 16 for stmatrix.
            return f"a gated tile needs tile_n a multiple of 32; got {tile_n}"
        if gate_layout == "concat" and b_major != "k":
            return "the concat gate layout needs a K-major weight (w = gate_up_proj.transpose)"
    if gather:
        if cluster_n != 1:
            return "gather-A loads A per CTA: no 1x2 cluster (A multicast)"
        acc = acc_regs(schedule, tile_m, tile_n)
        if not gather_rows_in_registers(schedule, tile_m, tile_n) and acc >= HEAVY_ACC_REGS:
            return (f"gather-A needs the producer's {REGS_DEFAULT[0]} registers: {schedule} "
                    f"{tile_m}x{tile_n} needs {acc} accumulator registers (at most "
                    f"{HEAVY_ACC_REGS - 1} with a gather)")
    return None


# The top-k combine (combine.py): each thread sums one 16-byte vector (8 bf16 / fp16 values) of
# a token's row over its k slots, all k loads issued together (k is compile-time, up to 16).
COMBINE_VEC = 8
COMBINE_MAX_K = 16

# The routers' top-k (router_topk.py): one warp per token, E / 32 values a lane (at most 32:
# E up to 1024), one output slot a lane (k up to 32).
ROUTER_MAX_E = 1024
ROUTER_MAX_K = 32
ROUTER_MAX_GROUPS = 32  # the sigmoid router's eligible groups: a bit each in one register
