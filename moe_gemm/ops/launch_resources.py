"""What a launch uses besides its operands and its kernel: the CUDA-graph capture state and
the current stream, workspaces, placeholder tensors, pinned staging buffers, the host visitor's
table and trace buffers.

Workspaces and small tensors are cached (per stream, per device) so that a repeated call
allocates only its outputs; while a CUDA graph is being captured, or inside graph_owned(),
everything is allocated afresh and nothing is kept (_fresh). Nothing here reads a GPU value or
synchronizes.

The launch modules (general_launch, mm_launch, fused_launch, scaled_launch) call these names
through the module (launch_resources._capturing()), never from an import of the name: a test
or a script that replaces one (CPU stand-ins for the stream, the capture state, pinned memory)
then replaces it for every launch.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

from moe_gemm.kernels.sm90.constants import DESC_RING, SLOT_INTS, split_workspace_bytes
from moe_gemm.ops import schedule as sched
from moe_gemm.ops.heuristics import KernelChoice


def _device_index(device: torch.device | None) -> int:
    """A CUDA device's index (None or no index: the current device)."""
    if device is not None and device.index is not None:
        return device.index
    return torch.cuda.current_device() if torch.cuda.is_available() else 0


def _capturing() -> bool:
    """Whether the current stream is capturing a CUDA graph (one C call: this runs per launch;
    everything in this module runs on CUDA devices only)."""
    return torch._C._cuda_isCurrentStreamCapturing()


# Launches made by a compiled graph (the torch.library ops of ops/custom_ops.py): under
# torch.compile's CUDA-graph trees (mode="reduce-overhead") the graph's warm-up run allocates
# from the graph's private memory pool without capturing, and a tensor of that pool still alive
# after the run (a workspace, placeholder or metadata upload kept in one of the launch modules'
# caches) makes the graph refuse to record ("tensors in the cudagraph pool not tracked as
# outputs"). Inside graph_owned() nothing allocated is kept past the call. A plain counter (not
# thread-local): a concurrent eager call that sees it only allocates afresh, which is safe.
_graph_owned = 0


@contextlib.contextmanager
def graph_owned() -> Iterator[None]:
    global _graph_owned
    _graph_owned += 1
    try:
        yield
    finally:
        _graph_owned -= 1


def _fresh() -> bool:
    """Whether this launch must allocate everything afresh and cache nothing: a CUDA-graph
    capture (allocations then belong to the graph) or a compiled graph's call."""
    return _graph_owned > 0 or _capturing()


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda idx: torch.cuda.current_stream(idx).cuda_stream
)

# Host buffers and tensors a captured CUDA graph reads at every replay (pinned metadata, copies
# of minority-layout B operands): kept for the life of the process, since a graph may be
# replayed at any time.
_graph_keepalive: list[torch.Tensor] = []


# ---------------------------------------------------------------------------------------------
# Workspaces: the CTAs' descriptor rings (and the tail split's counters and partial tiles)

_workspaces: dict[tuple, torch.Tensor] = {}


def _workspace(device: torch.device, idx: int, stream: int, ints: int,
               zeroed: tuple[int, int] | None) -> torch.Tensor:
    """The workspace of `ints` int64 for launches on `stream`, shared by every plan.

    Launches on one stream run one after the other, whichever thread issues them (under the
    opt-in PDL a kernel waits on griddepcontrol before touching global memory), so no two
    launches ever use one workspace at once; reusing it saves an allocator call per call
    (~1.5 us of host time). `zeroed` is in the key: a tail-split kernel's counters (zero
    between launches: each finisher resets its own) never share memory with another kernel's
    descriptor rings.
    """
    key = (idx, stream, ints, zeroed)
    ws = _workspaces.get(key)
    if ws is None:
        if len(_workspaces) >= 256:
            _workspaces.clear()  # the caching allocator keeps the memory stream-ordered
        ws = _workspaces[key] = _new_workspace(device, ints, zeroed)
    return ws


def _new_workspace(device: torch.device, ints: int, zeroed: tuple[int, int] | None
                   ) -> torch.Tensor:
    """A workspace of `ints` int64; zeroed: the int64 range a tail-split kernel needs at zero
    (its counters). Only they are: the partial tiles are written before they are read, and
    zeroing them too (up to 17 MB, 131 tiles of 128x256) put a memset into every CUDA-graph
    replay of a captured call (~5 us on an H200)."""
    ws = torch.empty(ints, dtype=torch.int64, device=device)
    if zeroed is not None:
        ws[zeroed[0]:zeroed[1]].zero_()
    return ws


class WorkspaceSlot:
    """A plan's workspace: looked up per stream, the last (stream, tensor) pair remembered (one
    attribute, so a thread never pairs one stream with another's tensor). Never reused while a
    CUDA graph is being captured: a captured workspace belongs to the graph.

    get() takes the plan's current kernel choice and resizes the slot when it differs from the
    one the slot was sized for (the size follows the choice's tail split).
    """

    __slots__ = ("device", "idx", "num_ctas", "choice", "ints", "zeroed", "last")

    def __init__(self, device: torch.device, num_ctas: int, choice: KernelChoice):
        self.device = device
        self.idx = _device_index(device)
        self.num_ctas = num_ctas
        self._size(choice)

    def _size(self, choice: KernelChoice) -> None:
        self.choice = choice
        if choice.tail_split:
            counters, partials, total = split_workspace_bytes(self.num_ctas, choice.tile_m,
                                                              choice.tile_n)
            self.ints, self.zeroed = -(-total // 8), (counters // 8, -(-partials // 8))
        else:
            self.ints, self.zeroed = self.num_ctas * DESC_RING * SLOT_INTS, None
        self.last: tuple[int, torch.Tensor] | None = None

    def get(self, choice: KernelChoice, stream: int | None = None) -> torch.Tensor:
        """stream: the current stream's raw handle when the caller has just read it outside
        CUDA-graph capture (it then skips both queries); None: read here."""
        if choice is not self.choice:
            self._size(choice)
        if stream is None:
            if _fresh():  # (the zeroing is captured)
                return _new_workspace(self.device, self.ints, self.zeroed)
            stream = _raw_stream(self.idx)
        last = self.last
        if last is not None and last[0] == stream:
            return last[1]
        ws = _workspace(self.device, self.idx, stream, self.ints, self.zeroed)
        self.last = (stream, ws)
        return ws


def _kernel_workspace(device: torch.device, num_ctas: int, choice: KernelChoice) -> torch.Tensor:
    """The workspace of one launch (for callers without a plan: scripts, tests)."""
    return WorkspaceSlot(device, num_ctas, choice).get(choice)


# ---------------------------------------------------------------------------------------------
# Small tensors: placeholders, the host visitor's table, pinned staging, trace buffers

@functools.lru_cache(maxsize=64)
def _cached_small(kind: str, device: torch.device, dtype: torch.dtype, shape: tuple, major: str):
    return _new_small(kind, device, dtype, shape, major)


def _new_small(kind: str, device: torch.device, dtype: torch.dtype, shape: tuple, major: str):
    if major == "k":  # (K, N) with K contiguous
        return torch.zeros(shape[::-1], dtype=dtype, device=device).t()
    return torch.zeros(shape, dtype=dtype, device=device)


def _small(kind, device, dtype, shape, major="n"):
    """Placeholder tensors (seeds, unused slots). Cached, except while a CUDA graph is being
    captured (an allocation made then belongs to the graph's private pool)."""
    if _fresh():
        return _new_small(kind, device, dtype, shape, major)
    return _cached_small(kind, device, dtype, shape, major)


def _table_tensor(counts: tuple[int, ...], num_ctas: int, device: torch.device) -> torch.Tensor:
    if _fresh():
        return torch.from_numpy(sched.host_precompute_table(counts, num_ctas)).to(device)
    return _cached_table(counts, num_ctas, device)


@functools.lru_cache(maxsize=128)
def _cached_table(counts: tuple[int, ...], num_ctas: int, device: torch.device) -> torch.Tensor:
    """The host visitor's table, uploaded once per problem set (tile counts) and grid."""
    return torch.from_numpy(sched.host_precompute_table(counts, num_ctas)).to(device)


def _pinned(shape, dtype) -> torch.Tensor:
    try:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    except RuntimeError:  # no CUDA host allocator (unusual); pageable still works
        return torch.empty(shape, dtype=dtype)


def _trace_tensor(num_ctas: int, max_tiles: int, device: torch.device) -> torch.Tensor:
    return torch.full((num_ctas, max(1, max_tiles), 4), -1, dtype=torch.int32, device=device)
