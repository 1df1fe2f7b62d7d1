"""Numbers the sm90 kernel and its host side must agree on. No DSL import, so the host wrapper
and the heuristics can use them without loading the CuTe DSL."""

TILE_K = 64  # one 128-byte swizzle row of 16-bit data
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

# Tail split (cooperative, device visitor, 1x1 cluster; compile-time): when the last wave of
# tiles fills at most half the grid, each of its tiles is computed by two CTAs, each over half
# of K. The lower CTA (launched first) writes its fp32 accumulators to a workspace slot and
# bumps the tile's counter; the upper one adds them to its own and runs the epilogue. The
# last wave then takes ~half a tile's time (mixtral, 56.4 waves of 128x256 tiles: ~1%).
SPLIT_MIN_K_TILES = 16  # below this a half tile saves less than the 2 x 128 KiB fixup costs
SPLIT_COUNTER_BYTES = 1024  # per-tile counters (one int32 per CTA, 132 on an H100/H200) ...
SPLIT_MAX_CTAS = SPLIT_COUNTER_BYTES // 4  # ... so at most this many CTAs


def split_workspace_bytes(num_ctas: int, tile_m: int, tile_n: int) -> tuple[int, int, int]:
    """(counters offset, partials offset, total bytes) of a tail-split kernel's workspace:
    the descriptor rings, then the counters (zeroed once, reset by every finisher), then
    num_ctas // 2 fp32 partial tiles (a split tail has at most half the grid's tiles)."""
    counters = num_ctas * DESC_RING * SLOT_BYTES
    partials = counters + SPLIT_COUNTER_BYTES
    return counters, partials, partials + (num_ctas // 2) * tile_m * tile_n * 4
