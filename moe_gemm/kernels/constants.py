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
