"""A math warpgroup's wait for its next A/B stage, split into a probe and a conditional wait.

The FP8 stage loop issues a stage's WGMMAs, waits for an older batch, promotes it (64 FFMAs
and the scale products per thread on a 128x128 tile) and only then waits for the next stage's
full barrier. Under ncu (H200, 2026-12-02, 8 experts x 8192 rows, N 4096, K 7168, base
clocks) the math warps were issue-bound there: 12.6% of their stall samples sat in that
barrier's try-wait and sleep loop while the tensor pipe idled (82.7% busy against cuBLAS's
91.5% on the same 128x128 tile). Probing the barrier right after a stage's WGMMAs are issued
(the pipeline's `consumer_try_wait`) lets the barrier complete in the shadow of the
promotion; the wait before the next issue (`wait_full_unless_ready`) then costs one predicated
branch when the probe already saw the stage full. Samples in the wait fell to 0.4% and the
tensor pipe rose to 87.8% (block scales) and 89.4% (row-wise scales).

The conditional wait is one inline-PTX block rather than the pipeline's
`consumer_wait(state, token)`: that one lowers to a structured `if` around the wait, and with
it between WGMMA batches ptxas serialized every WGMMA of the loop (warning C7514). The block's
labels are local to its braces, so it may be inlined any number of times.
"""

from __future__ import annotations

from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

# %0: the barrier's shared-memory address, %1: the phase parity waited for, %2: the probe's
# answer (non-zero: the phase has completed, nothing to wait for).
_WAIT_UNLESS_READY = (
    "{\n"
    ".reg .pred p;\n"
    "setp.ne.b32 p, $2, 0;\n"
    "@p bra DONE;\n"
    "WAIT:\n"
    "mbarrier.try_wait.parity.shared::cta.b64 p, [$0], $1;\n"
    "@!p bra WAIT;\n"
    "DONE:\n"
    "}"
)


@dsl_user_op
def _wait_unless_ready(barrier, phase, ready, *, loc=None, ip=None) -> None:
    llvm.inline_asm(
        None,
        [Int32(barrier.toint()).ir_value(loc=loc, ip=ip), Int32(phase).ir_value(loc=loc, ip=ip),
         Int32(ready).ir_value(loc=loc, ip=ip)],
        _WAIT_UNLESS_READY,
        "r,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )


def wait_full_unless_ready(pipe, state, ready) -> None:
    """Wait for the stage at `state` to be full, unless `ready` (an earlier
    `pipe.consumer_try_wait(state)`) already saw it full."""
    _wait_unless_ready(pipe.sync_object_full.get_barrier(state.index), state.phase, ready)
