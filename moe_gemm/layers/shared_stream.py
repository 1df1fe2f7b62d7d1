"""The MoE layer's shared expert on a second CUDA stream, beside the routed experts.

A layer with a shared expert (DeepSeek-V3, Qwen2-MoE) runs two independent pieces on the same
tokens: the routed experts (router, top-k, token gather, two grouped GEMMs, combine) and the
shared expert's three dense GEMMs. On one stream they run back to back, although at decode
sizes both are small weight-streaming kernels that leave the GPU idle between launches, and
at prefill the routed path's memory-bound kernels (gather, combine) leave the tensor cores
idle. So the shared expert is issued on a side stream that first waits for the caller's
stream, and the caller's stream waits for it before the sum: the same values (the same kernels
on the same inputs, summed as before). DeepSeek-V3 EP8's layer (32 experts, H 7168, I 2048,
one shared expert) on an H200 (2026-12-04, CUDA graphs, two runs of benchmarks.bench_moe_layer
with the other order timed as a switch row, docs/measurements.md): 1.09x at 1 token in both
(0.229 against 0.249 ms), 1.02-1.03x at 16 and 128 tokens (one run); at 1024-4096 tokens
1.08-1.09x in one run and 0.93-0.94x in the other, the switch row faster in both: a row-position
effect of the harness at the power limit, larger than the gain, so no gain claimed there; a tie
at 16384. MOE_GEMM_SHARED_STREAM=0 runs them one after the other on the caller's stream.

CUDA-graph capture records the two streams as two branches of the graph (the side stream is
forked from and joined to the capturing stream), so replays overlap them too. While
torch.compile traces, and off CUDA, the pieces run one after the other.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moe_gemm.env import env_value

SHARED_STREAM_ENV = "MOE_GEMM_SHARED_STREAM"

_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def side_stream_wanted(x: torch.Tensor) -> bool:
    """Whether the shared expert of a layer called on x goes to a side stream now."""
    # (is_compiling first: the switch is not read while torch.compile traces)
    return (x.device.type == "cuda" and not torch.compiler.is_compiling()
            and bool(env_value(SHARED_STREAM_ENV)))  # (on unless set to 0)


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device, kept (a new stream per call would cost a driver call and
    give a CUDA graph a new stream every capture)."""
    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams.setdefault(device, torch.cuda.Stream(device))
    return stream


def routed_beside_shared(device: torch.device, routed: Callable[[], torch.Tensor],
                         shared: Callable[[], torch.Tensor | None]
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(routed(), shared()), shared() issued on the device's side stream after the work the
    caller's stream already holds, and the caller's stream made to wait for it before this
    returns: both results are ready for the caller's stream.

    Memory: the shared expert's tensors are allocated from the side stream's pool and its
    input from the caller's. The input is not reused early: the caller's stream waits for the
    side stream here, before anything after this call. The result is marked as used by the
    caller's stream (record_stream), so that its block is not handed to later side-stream work
    before the caller's stream has read it, even where that work follows another stream (two
    threads, or one thread on two streams, calling layers on one device)."""
    main = torch.cuda.current_stream(device)
    side = _side_stream(torch.device(device))
    side.wait_stream(main)
    with torch.cuda.stream(side):
        s = shared()
    r = routed()
    main.wait_stream(side)
    if s is not None:
        s.record_stream(main)
    return r, s
