"""Host side of GroupedGemmSm90: torch tensors in, one grouped launch out.

Turns validated arguments (ops/validation.py) into launch arguments: the kernel choice
(ops/heuristics.py), the per-problem metadata of the general form (pointers, leading dims,
sizes) staged in pinned memory and copied to the GPU in one transfer, the host visitor's table,
and the compiled kernel (ops/kernel_cache.py), called on the current stream through TVM-FFI.
grouped_mm never reads GPU values on the host unless visitor="host" is asked for.

Everything that follows from shapes, strides, dtypes and the config is built once per
signature and kept in a plan (MmPlan, BmmPlan, GeneralPlan): ops/api.py finds the plan of a
repeated call (ops/signature.py) and the call itself then only allocates its output, looks up
its workspace and calls the kernel. Nothing here reads a GPU value or synchronizes.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import operator
import os
from collections.abc import Iterator

import numpy as np
import torch

from moe_gemm.capability import device_name, sm_count
from moe_gemm.config import GemmConfig
from moe_gemm.env import env_get
from moe_gemm.kernels.sm90.constants import DESC_RING, SLOT_INTS, split_workspace_bytes
from moe_gemm.ops import kernel_cache as cache
from moe_gemm.ops import schedule as sched
from moe_gemm.ops.heuristics import KernelChoice, choose_batched, choose_general, choose_varlen
from moe_gemm.ops.kernel_cache import kernel_constants

# LaunchInfo, last_launch and trace_assignment are re-exported: callers read launch.last_launch().
from moe_gemm.ops.launch_info import LaunchInfo, _local, last_launch, trace_assignment  # noqa: F401
from moe_gemm.ops.support import (
    TMA_ALIGN_BYTES,
    GeneralLayout,
    analyze_general,
    operand_major,
    tma_view,
)
from moe_gemm.ops.validation import GroupedBmmArgs, GroupedGemmArgs, GroupedMmArgs

_TORCH_TO_NAME = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_PTR = torch.Tensor.data_ptr

# Programmatic dependent launch of the main kernel (see GroupedGemmSm90.__call__): opt-in
# (MOE_GEMM_PDL=1). Measured neutral on an H200 (2026-11-21, scripts/tune.py back-to-back,
# on / off): mixtral 2831 / 2826 us, uniform list 559 / 555, moe-decode 288 / 283,
# k-varying 122 / 124; the GPU tests pass both ways. A module attribute (read at every launch)
# so tune.py can compare both in one process.
PDL = 1 if os.environ.get("MOE_GEMM_PDL", "0") not in ("", "0") else 0


def _compile_key(form, ab, d, b_major, choice: KernelChoice, trace: bool):
    from moe_gemm.kernels.sm90.compile import CompileKey

    return CompileKey(
        form, _TORCH_TO_NAME[ab], _TORCH_TO_NAME[d], b_major, choice.schedule, choice.visitor,
        choice.tile_m, choice.tile_n, choice.stages, trace, choice.l2_hints, choice.epi_n,
        choice.cluster_m, choice.cluster_n, choice.epi_whole, choice.tail_split,
    )


@functools.lru_cache(maxsize=16)
def max_clusters(device_index: int, size: int, nsm: int) -> int:
    """How many `size`-CTA clusters of our kernel (one CTA per SM) can be resident at once:
    the persistent grid must not exceed it, or the excess clusters would wait for the first
    ones to finish. GPCs have an uneven SM count, so this can be below nsm / 2 (H200: 66)."""
    if size == 1:
        return nsm
    try:
        from cutlass.utils import HardwareInfo

        return max(1, int(HardwareInfo(device_index).get_max_active_clusters(size)))
    except Exception:  # noqa: BLE001 - a driver without the query: a safe lower bound
        return max(1, nsm // (2 * size))


def _device_index(device: torch.device | None) -> int:
    """A CUDA device's index (None or no index: the current device)."""
    if device is not None and device.index is not None:
        return device.index
    return torch.cuda.current_device() if torch.cuda.is_available() else 0


def _grid(device: torch.device | None, nsm: int, size: int, units: int) -> tuple[int, int]:
    """(CTAs, units per cluster upper bound) for `units` cluster tiles of work."""
    idx = _device_index(device)
    clusters = max(1, min(max_clusters(idx, size, nsm), nsm // size, units))
    return clusters * size, -(-units // clusters)


@functools.lru_cache(maxsize=256)
def _kernel_for(form, ab, d, b_major, choice: KernelChoice, trace: bool):
    """The compiled kernel for a launch's static choices (one dict lookup per call)."""
    return _compiled(_compile_key(form, ab, d, b_major, choice, trace))


@functools.lru_cache(maxsize=64)
def _general_placeholders(device: torch.device, ab: torch.dtype, d: torch.dtype, b_major: str):
    """The general form's unused/seed arguments (the real operands come from the metadata)."""
    return _new_placeholders(device, ab, d, b_major)


def _new_placeholders(device, ab, d, b_major):
    return (
        _new_small("seed_a", device, ab, (128, 64), "n"),
        _new_small("seed_w", device, ab, (64, 64), b_major),
        _new_small("seed_d", device, d, (128, 64), "n"),
        _new_small("offs", device, torch.int32, (1,), "n"),
        _new_small("table", device, torch.int32, (1, 1, 2), "n"),
        _new_small("trace", device, torch.int32, (1, 1, 4), "n"),
    )


def _table_device(device: torch.device | None) -> str | None:
    """The name tuned tables are keyed by: the CUDA device's, None elsewhere (rules only)."""
    return device_name(device) if device is not None and device.type == "cuda" else None


def _maybe_autotune(form: str, args, config: GemmConfig) -> None:
    """Online autotune (MOE_GEMM_AUTOTUNE=1, moe_gemm.tuning.online) of a new grouped_mm
    signature, before its kernel is chosen; never while a CUDA graph is being captured."""
    if env_get("MOE_GEMM_AUTOTUNE") and not _capturing():
        from moe_gemm.tuning import online

        if online.requested(config):
            tune = online.ensure_tuned_varlen if form == "varlen" else online.ensure_tuned_batched
            tune(args, config)


def _compiled(key):
    from moe_gemm.kernels.sm90.compile import compile_variant

    return cache.get_or_compile(key, key.name, lambda: compile_variant(key))


def _capturing() -> bool:
    """Whether the current stream is capturing a CUDA graph (one C call: this runs per launch;
    everything in this module runs on CUDA devices only)."""
    return torch._C._cuda_isCurrentStreamCapturing()


# Launches made by a compiled graph (the torch.library ops of ops/custom_ops.py): under
# torch.compile's CUDA-graph trees (mode="reduce-overhead") the graph's warm-up run allocates
# from the graph's private memory pool without capturing, and a tensor of that pool still alive
# after the run (a workspace, placeholder or metadata upload kept in one of this module's
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

# ---------------------------------------------------------------------------------------------
# Workspaces: the CTAs' descriptor rings (and the tail split's counters and partial tiles)

_workspaces: dict[tuple, torch.Tensor] = {}


def _workspace(device: torch.device, idx: int, stream: int, ints: int, zeroed: bool
               ) -> torch.Tensor:
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
        new = torch.zeros if zeroed else torch.empty
        ws = _workspaces[key] = new(ints, dtype=torch.int64, device=device)
    return ws


class WorkspaceSlot:
    """A plan's workspace: looked up per stream, the last (stream, tensor) pair remembered (one
    attribute, so a thread never pairs one stream with another's tensor). Never reused while a
    CUDA graph is being captured: a captured workspace belongs to the graph.

    get() takes the plan's current kernel choice: its size follows the choice's tail split,
    and scripts/tune.py swaps a plan's choice after building it.
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
            total = split_workspace_bytes(self.num_ctas, choice.tile_m, choice.tile_n)[2]
            self.ints, self.zeroed = -(-total // 8), True
        else:
            self.ints, self.zeroed = self.num_ctas * DESC_RING * SLOT_INTS, False
        self.last: tuple[int, torch.Tensor] | None = None

    def get(self, choice: KernelChoice, stream: int | None = None) -> torch.Tensor:
        """stream: the current stream's raw handle when the caller has just read it outside
        CUDA-graph capture (it then skips both queries); None: read here."""
        if choice is not self.choice:
            self._size(choice)
        if stream is None:
            if _fresh():
                new = torch.zeros if self.zeroed else torch.empty
                return new(self.ints, dtype=torch.int64, device=self.device)  # (zeroing captured)
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
# Small device tensors

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



# ---------------------------------------------------------------------------------------------
# The general form: grouped_gemm's lists

_graph_keepalive: list[torch.Tensor] = []
# Uploaded general-form metadata by (plan, stream, operand addresses, out addresses and row
# strides); see GeneralPlan.metadata. 64 entries of G * 64 bytes of GPU memory.
META_CACHE_ENTRIES = 64
_meta_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _remember_upload(key: tuple, uploaded: tuple) -> tuple:
    """Keep an upload under its key (plan, stream, addresses): only for addresses that were
    checked, since a later call with the same key launches without checking them again
    (GeneralPlan.launch_operands)."""
    if len(_meta_cache) >= META_CACHE_ENTRIES:
        # Oldest first. Safe while a launch may still read it: the entry was made on this
        # key's stream, so the allocator reuses it only after that work. (pop, not del:
        # another thread may have evicted the same entry)
        _meta_cache.pop(next(iter(_meta_cache), None), None)
    _meta_cache[key] = uploaded
    return uploaded


class GeneralShape:
    """Everything about a general-form launch that depends only on the problem sizes, dtypes,
    B's major, the config and the device's SM count: the kernel choice, problem order, grid,
    compiled kernel, and the layout of the outputs we allocate. Built once per problem set
    (general_shape caches it).

    Own outputs live in one allocation: for each distinct N a (sum of its M_i, N) region
    split by rows (one region and one split for an MoE layer's experts). Their byte offsets
    from the block's start are fixed here, so the per-call metadata needs the block's address
    only.
    """

    def __init__(self, sizes: tuple, ab: torch.dtype, d: torch.dtype, b_major: str,
                 config: GemmConfig, nsm: int, trace: bool, device: torch.device | None = None):
        self.G = G = len(sizes)
        self.sizes = sizes
        self.ab_dtype = ab
        self.out_dtype = d
        self.b_major = b_major
        self.choice = choice = choose_general(
            config, sizes, nsm, d.itemsize, device=_table_device(device),
            dtype=_TORCH_TO_NAME[ab], out_dtype=_TORCH_TO_NAME[d])
        order = sched.ksort_permutation(sizes) if choice.sort_by_k else None
        # None when the order is the caller's: the per-call metadata then skips a gather.
        self.order = tuple(order) if order and order != list(range(G)) else None
        self.order_np = np.asarray(self.order, dtype=np.int64) if self.order else None
        self.launch_order = self.order or tuple(range(G))  # what LaunchInfo reports
        ordered = [sizes[i] for i in self.order] if self.order else sizes
        self.counts = tuple(sched.tiles_per_problem(ordered, choice.tile_m, choice.tile_n))
        self.total = sum(self.counts)
        size = choice.cluster_m * choice.cluster_n
        if size == 1:
            self.num_ctas = max(1, min(nsm, self.total))
            self.max_tiles = -(-self.total // self.num_ctas)  # records per CTA, at most
        else:
            # A cluster walks cluster tiles (units): pairs of adjacent tiles of one problem.
            units = sum(sched.tiles_per_problem(ordered, choice.tile_m * choice.cluster_m,
                                                choice.tile_n * choice.cluster_n))
            self.num_ctas, self.max_tiles = _grid(None, nsm, size, units)
        elem = d.itemsize
        by_n: dict[int, list[int]] = {}
        for i, (_, n, _) in enumerate(sizes):
            by_n.setdefault(n, []).append(i)
        # One region of the block per distinct N, (rows, N), split by rows: a row is a 16-byte
        # multiple wherever it holds anything (ops/support.py), so every region and every
        # output starts 16-byte aligned, with no padding.
        self.regions: list[tuple[int, int, int, list[int]]] = []  # (start, rows, N, per problem)
        d_off = [0] * G
        start = 0
        for n, members in by_n.items():
            rows = [sizes[i][0] for i in members]
            row = 0
            for i, m in zip(members, rows):
                d_off[i] = (start + row * n) * elem
                row += m
            self.regions.append((start, row, n, rows))
            start += row * n
        self.out_elems = start
        region_order = [i for members in by_n.values() for i in members]
        position = [0] * G
        for p, i in enumerate(region_order):
            position[i] = p
        # The outputs in the caller's order, from the regions' (None: already that order).
        self.unpermute = (None if region_order == list(range(G))
                          else operator.itemgetter(*position))
        d_ld = [n for _, n, _ in sizes]
        # Metadata columns that do not change between calls, in the caller's problem order:
        # [D byte offset, D leading dim, M | N << 32, K].
        self.static = np.array(
            [[off, ld, m | (n << 32), k] for off, ld, (m, n, k) in zip(d_off, d_ld, sizes)],
            dtype=np.int64).reshape(G, 4)
        # Problems whose A and B the kernel loads (the others' pointers are never read).
        self.loads = np.array([m > 0 and n > 0 and k > 0 for m, n, k in sizes], dtype=bool)
        self.kernel = (_kernel_for("general", ab, d, b_major, choice, trace)
                       if self.total else None)

    def new_outputs(self, device: torch.device) -> tuple[list[torch.Tensor], int]:
        """The G outputs as views of one fresh allocation, and its address."""
        block = torch.empty(self.out_elems, dtype=self.out_dtype, device=device)
        # The views are made below autograd's view tracking: they never overlap and the
        # block is never seen, so there is nothing to track, and 256 views take ~70 us on the
        # CPU-only dev machine instead of ~90.
        with _untracked_views():
            if len(self.regions) == 1:
                _, rows, n, per = self.regions[0]
                pieces = block.view(rows, n).split_with_sizes(per)
            else:
                pieces = []
                for start, rows, n, per in self.regions:
                    region = block[start:start + rows * n].view(rows, n)
                    pieces.extend(region.split_with_sizes(per) if len(per) > 1 else (region,))
        outs = list(pieces if self.unpermute is None else self.unpermute(pieces))
        return outs, block.data_ptr()


_untracked_views = torch._C._AutoDispatchBelowADInplaceOrView


@functools.lru_cache(maxsize=256)
def general_shape(sizes: tuple, ab: torch.dtype, d: torch.dtype, b_major: str,
                  config: GemmConfig, nsm: int, trace: bool, l2_env: str | None,
                  device: torch.device) -> GeneralShape:
    """The GeneralShape of a problem set, cached (l2_env: MOE_GEMM_L2_HINTS, which the kernel
    choice reads, so a changed switch gets a new entry; device: its name picks tuned
    tables)."""
    return GeneralShape(sizes, ab, d, b_major, config, nsm, trace, device)


class GeneralPlan:
    """A general-form launch for one layout: the GeneralShape plus the operands' leading dims,
    so that a call only reads its operands' data pointers.

    The (G, 8) int64 metadata rows [a_ptr, b_ptr, d_ptr - d_base, a_ld, b_ld, d_ld,
    M | N << 32, K] are kept here in launch order with the pointer columns empty; a call fills
    them in pinned memory and uploads them, or reuses the upload of an earlier call with the
    same addresses (the usual serving loop: ~10 us of host time and a copy on the GPU saved).
    Our own outputs enter the rows as offsets from d_base, a kernel argument, so that reuse
    holds while every call gets fresh outputs.
    """

    def __init__(self, shape: GeneralShape, device: torch.device, a_ld: tuple, b_ld: tuple):
        self.shape = shape
        self.device = device
        self.G = G = shape.G
        self.idx = _device_index(device)
        rows = np.zeros((G, 8), dtype=np.int64)
        rows[:, 2] = shape.static[:, 0]
        rows[:, 3] = a_ld
        rows[:, 4] = b_ld
        rows[:, 5] = shape.static[:, 1]
        rows[:, 6:] = shape.static[:, 2:]
        self.rows = rows if shape.order_np is None else rows[shape.order_np]
        loads = shape.loads
        # The pointers a call must check for 16-byte alignment: A's then B's, loaded only.
        self.load_mask = None if loads.all() else np.concatenate([loads, loads])
        self.last_scan = -(1 << 62)  # when grouped_gemm's scan last led here (ops/api.py)
        self.signatures = 0  # ... and how many signatures it made for this plan
        if not shape.total:
            return
        self.workspace = WorkspaceSlot(device, shape.num_ctas, shape.choice)
        if _fresh():
            ph = _new_placeholders(device, shape.ab_dtype, shape.out_dtype, shape.b_major)
        else:
            ph = _general_placeholders(device, shape.ab_dtype, shape.out_dtype, shape.b_major)
        self.placeholders = ph
        self.table = (_table_tensor(shape.counts, shape.num_ctas, device)
                      if shape.choice.visitor == "host" else ph[4])
        # The kernel's constant arguments: seeds A, B, D, offs, table, trace.
        self.constants = kernel_constants(shape.kernel, ph[0], ph[1], ph[2], ph[3], self.table,
                                          ph[5])

    def pointers(self, a, b) -> np.ndarray | None:
        """A's then B's data pointers (2G int64), or None if one the kernel loads is not
        16-byte aligned (TMA needs aligned base addresses; the caller then takes the path that
        says why or falls back)."""
        ptrs = np.fromiter(itertools.chain(map(_PTR, a), map(_PTR, b)), np.int64, 2 * self.G)
        return ptrs if self._aligned(ptrs) else None

    def _aligned(self, ptrs: np.ndarray) -> bool:
        """Whether every pointer the kernel loads is 16-byte aligned."""
        loaded = ptrs if self.load_mask is None else ptrs[self.load_mask]
        return not (loaded.size and int(np.bitwise_or.reduce(loaded)) % TMA_ALIGN_BYTES)

    def metadata(self, ptrs: np.ndarray, out_cols: np.ndarray | None = None, *,
                 persistent: bool = False, reuse: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows on the device (int64 and its int32 view) for these pointers (and a caller's
        outputs: out_cols = [addresses, row strides], 2G int64). reuse: look the upload up by
        its addresses (not for copies made for this call, which are new every time)."""
        capturing = _capturing()
        if not reuse or persistent or capturing or _graph_owned > 0:
            return self._upload(ptrs, out_cols, persistent, capturing)
        addr = ptrs.tobytes() if out_cols is None else ptrs.tobytes() + out_cols.tobytes()
        key = (self, _raw_stream(self.idx), addr)
        hit = _meta_cache.get(key)
        if hit is None:
            hit = _remember_upload(key, self._upload(ptrs, out_cols, False, False))
        return hit

    def _upload(self, ptrs: np.ndarray, out_cols: np.ndarray | None, persistent: bool,
                capturing: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Fill the rows in pinned memory and copy them to the device."""
        G, order = self.G, self.shape.order_np
        meta = _pinned((G, 8), torch.int64)
        m = meta.numpy()
        m[:] = self.rows
        pa, pb = ptrs[:G], ptrs[G:]
        m[:, 0] = pa if order is None else pa[order]
        m[:, 1] = pb if order is None else pb[order]
        if out_cols is not None:
            po, lo = out_cols[:G], out_cols[G:]
            m[:, 2] = po if order is None else po[order]
            m[:, 5] = lo if order is None else lo[order]
        # A plan's rows are uploaded once, synchronously (its pinned buffer can go); a call's
        # are copied in stream order.
        dev = meta.to(self.device, non_blocking=not persistent)
        if capturing:
            _graph_keepalive.append(meta)  # the captured copy reads it at every replay
        return kernel_constants(self.shape.kernel, dev, dev.view(torch.int32))

    def launch_operands(self, ab: tuple) -> list[torch.Tensor] | None:
        """grouped_gemm for operands of this plan's signature (A's then B's; ops/api.py
        checked it) at their current addresses: fresh outputs, or None if an address the
        kernel loads is not 16-byte aligned (the caller then takes the path that says why).

        The repeated call's path, so each step is done once: the addresses are read in one
        pass, the capture state and the stream are queried once, and an upload found by its
        addresses needs no alignment check (only checked addresses are ever uploaded under
        a key: see _remember_upload)."""
        ptrs = np.fromiter(map(_PTR, ab), np.int64, 2 * self.G)
        capturing = _capturing()
        if capturing or _graph_owned > 0:
            if not self._aligned(ptrs):
                return None
            return self.launch_pointers(ptrs)
        stream = _raw_stream(self.idx)
        key = (self, stream, ptrs.tobytes())
        meta = _meta_cache.get(key)
        if meta is None:
            if not self._aligned(ptrs):
                return None
            if not self.shape.total:
                return self.shape.new_outputs(self.device)[0]
            meta = _remember_upload(key, self._upload(ptrs, None, False, False))
        outs, d_base = self.shape.new_outputs(self.device)
        self.run(meta, d_base, None, stream)
        return outs

    def run(self, meta: tuple[torch.Tensor, torch.Tensor], d_base: int,
            trace_t: torch.Tensor | None = None, stream: int | None = None) -> None:
        """Launch the kernel on the current stream (shape.total > 0); stream: its raw
        handle if the caller read it outside capture (WorkspaceSlot.get)."""
        shape, c = self.shape, self.constants
        choice = shape.choice
        # (the workspace, a torch tensor, carries the stream: see kernel_constants)
        shape.kernel(c[0], c[1], c[2], meta[0], meta[1], c[3], c[4],
                     self.workspace.get(choice, stream), c[5] if trace_t is None else trace_t,
                     shape.G,
                     shape.num_ctas, choice.swizzle, choice.a_policy, choice.b_policy, PDL,
                     d_base)
        # A new tuple per launch: last_launch() tells launches apart by identity.
        _local.raw = (choice, shape.num_ctas, shape.G, shape.launch_order, trace_t)

    def launch_pointers(self, ptrs: np.ndarray) -> list[torch.Tensor]:
        """grouped_gemm for operands of this plan's layout (ops/api.py checked their
        signature) at these checked addresses (`pointers`): fresh outputs."""
        shape = self.shape
        outs, d_base = shape.new_outputs(self.device)
        if shape.total:
            self.run(self.metadata(ptrs), d_base)
        return outs


@functools.lru_cache(maxsize=256)
def general_plan(shape: GeneralShape, device: torch.device, a_ld: tuple, b_ld: tuple
                 ) -> GeneralPlan:
    """The GeneralPlan of a layout, cached (never called during CUDA-graph capture: a plan
    holds placeholders that must outlive any one graph)."""
    return GeneralPlan(shape, device, a_ld, b_ld)


def grouped_gemm_cute(
    args: GroupedGemmArgs, config: GemmConfig, *, layout: GeneralLayout | None = None,
    trace: bool = False,
) -> list[torch.Tensor]:
    return GeneralLaunch(args, config, layout=layout, trace=trace).launch()


class GeneralLaunch:
    """A general-form launch from checked arguments (any `out`, minority-layout B operands,
    tracing). grouped_gemm's detailed path builds one per call; a GroupedGemmPlan keeps one
    (persistent=True: the metadata is uploaded once and each launch only re-copies
    minority-layout B operands)."""

    def __init__(self, args: GroupedGemmArgs, config: GemmConfig, *,
                 layout: GeneralLayout | None = None, trace: bool = False,
                 persistent: bool = False):
        if layout is None:
            res = analyze_general(args)
            if isinstance(res, str):
                raise ValueError(f"backend='cute' cannot take this input: {res}")
            layout = res
        self.device = device = args.device
        self.G = len(args.a)
        self.trace = trace
        self.persistent = persistent
        self.shape = shape = general_shape(
            tuple(args.sizes), args.dtype, args.out_dtype, layout.b_major, config,
            sm_count(device), trace, env_get("MOE_GEMM_L2_HINTS"), device)
        self.choice = shape.choice
        b_major = layout.b_major
        b_ptr, b_ld = layout.b_ptr, layout.b_ld
        self.fixes: list[tuple[torch.Tensor, torch.Tensor]] = []  # (B as given, its copy)
        if layout.b_fix:
            b_ptr, b_ld = list(b_ptr), list(b_ld)
            for i in layout.b_fix:
                b = args.b[i]
                fixed = b.t().contiguous().t() if b_major == "k" else b.contiguous()
                self.fixes.append((b, fixed))
                b_ptr[i] = fixed.data_ptr()
                b_ld[i] = fixed.stride(1) if b_major == "k" else fixed.stride(0)
        if args.out is None:
            outs, self.d_base = shape.new_outputs(device)
        else:
            outs, self.d_base = args.out, 0
        self.outs = outs
        if shape.total == 0:
            return
        capturing = _capturing()
        if capturing and persistent:
            raise RuntimeError("build a GroupedGemmPlan outside CUDA-graph capture (its "
                               "launches can be captured)")
        a_ld, b_ld = tuple(layout.a_ld), tuple(b_ld)
        self.plan = plan = (GeneralPlan(shape, device, a_ld, b_ld) if _fresh()
                            else general_plan(shape, device, a_ld, b_ld))
        ptrs = np.array(layout.a_ptr + list(b_ptr), dtype=np.int64)
        out_cols = None
        if args.out is not None:  # a caller's out: addresses and row strides (d_base is 0)
            out_cols = np.array([o.data_ptr() for o in outs] + [o.stride(0) for o in outs],
                                dtype=np.int64)
        if capturing:
            _graph_keepalive.extend(f for _, f in self.fixes)
        self.meta = plan.metadata(ptrs, out_cols, persistent=persistent,
                                  reuse=not self.fixes)

    def launch(self) -> list[torch.Tensor]:
        if self.shape.total == 0:
            return list(self.outs)
        if self.persistent:
            for b, fixed in self.fixes:  # B may have new values since the plan was built
                fixed.copy_(b)
        trace_t = (_trace_tensor(self.shape.num_ctas, self.shape.max_tiles, self.device)
                   if self.trace else None)
        self.plan.run(self.meta, self.d_base, trace_t)
        return list(self.outs)


# ---------------------------------------------------------------------------------------------
# grouped_mm: the MoE (varlen) form and the batched form


class MmPlan:
    """Everything about a grouped_mm launch that depends only on shapes, strides, dtypes and
    the config: built once per signature (ops/api.py caches it), so a repeated call costs its
    output's allocation and the kernel call."""

    def __init__(self, args: GroupedMmArgs, config: GemmConfig, trace: bool = False):
        x, w = args.x, args.w
        self.device = device = x.device
        T, K, E, N = args.T, args.K, args.E, args.N
        self.T, self.N, self.E = T, N, E
        self.out_dtype = args.out_dtype
        self.zero_tail = args.out is None
        self.trivial = T == 0 or N == 0 or E == 0
        self.cacheable = not _fresh()  # (placeholders made while capturing are the graph's)
        if self.trivial:
            return
        nsm = sm_count(device)
        _maybe_autotune("varlen", args, config)
        self.choice = choice = choose_varlen(
            config, T, E, N, K, nsm, args.out_dtype.itemsize, device=_table_device(device),
            dtype=_TORCH_TO_NAME[args.dtype], out_dtype=_TORCH_TO_NAME[args.out_dtype])
        b_major = "k" if operand_major(w) == "col" else "n"
        self.num_problems = E + (1 if self.zero_tail else 0)
        self.tiles_n = -(-N // choice.tile_n)
        self.nsm = nsm
        self.trace = trace
        if choice.visitor == "device":
            # Upper bound on (cluster) tiles: sum over experts of ceil(rows_e / unit) is at
            # most ceil(T / unit) + one partial unit per problem.
            unit = choice.tile_m * choice.cluster_m
            units_n = -(-N // (choice.tile_n * choice.cluster_n))
            bound = (-(-T // unit) + self.num_problems) * units_n
            self.num_ctas, self.max_tiles = _grid(device, nsm, choice.cluster_m * choice.cluster_n,
                                                  bound)
            self.workspace = WorkspaceSlot(device, self.num_ctas, choice)
        self.meta = _small("meta", device, torch.int64, (1, 8))
        self.meta32 = self.meta.view(torch.int32)
        self.no_table = _small("table", device, torch.int32, (1, 1, 2))
        self.no_trace = _small("trace", device, torch.int32, (1, 1, 4))
        self.kernel = _compiled(_compile_key("varlen", args.dtype, args.out_dtype, b_major,
                                             choice, trace))
        self.constants = kernel_constants(self.kernel, self.meta, self.meta32, self.no_table,
                                          self.no_trace)

    def __call__(self, x, w, offs, out):
        if out is None:
            out = torch.empty(self.T, self.N, dtype=self.out_dtype, device=self.device)
        if self.trivial:
            return out.zero_() if self.zero_tail and self.E == 0 else out
        choice = self.choice
        if choice.visitor == "host":
            return self._host_visitor(x, w, offs, out)
        if self.trace:
            return self._launch(x, w, offs, out, self.num_ctas, self.no_table, self.max_tiles,
                                self.workspace.get(choice))
        meta, meta32, no_table, no_trace = self.constants
        self.kernel(x, w, out, meta, meta32, offs, no_table, self.workspace.get(choice),
                    no_trace, self.num_problems, self.num_ctas, choice.swizzle, choice.a_policy,
                    choice.b_policy, PDL, 0)
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
        table = _table_tensor(counts, num_ctas, self.device)
        workspace = _kernel_workspace(self.device, num_ctas, choice)
        return self._launch(x, w, offs, out, num_ctas, table, -(-total // num_ctas), workspace)

    def _launch(self, x, w, offs, out, num_ctas, table, max_tiles, workspace):
        choice = self.choice
        trace_t = _trace_tensor(num_ctas, max_tiles, self.device) if self.trace else None
        self.kernel(x, w, out, self.meta, self.meta32, offs, table, workspace,
                    self.no_trace if trace_t is None else trace_t, self.num_problems, num_ctas,
                    choice.swizzle, choice.a_policy, choice.b_policy, PDL, 0)
        _local.raw = (choice, num_ctas, self.num_problems, None, trace_t)
        return out


def grouped_mm_cute(args: GroupedMmArgs, config: GemmConfig, *, trace: bool = False
                    ) -> torch.Tensor:
    offs = args.offs if args.offs.is_contiguous() else args.offs.contiguous()
    return MmPlan(args, config, trace)(args.x, args.w, offs, args.out)


class BmmPlan:
    """grouped_mm's 3D x 3D (batched) launch, built once per signature like MmPlan: one
    descriptor per operand, no per-problem metadata, so a call is O(1) on the host."""

    def __init__(self, args: GroupedBmmArgs, config: GemmConfig, trace: bool = False):
        x, w = args.x, args.w
        self.device = device = x.device
        G, M, N, K = args.G, args.M, args.N, args.K
        self.shape = (G, M, N)
        self.out_dtype = args.out_dtype
        self.trivial = G == 0 or M == 0 or N == 0
        self.zero = K == 0
        self.cacheable = not _fresh()
        if self.trivial or self.zero:
            return
        nsm = sm_count(device)
        _maybe_autotune("batched", args, config)
        self.choice = choice = choose_batched(
            config, G, M, N, K, nsm, args.out_dtype.itemsize, device=_table_device(device),
            dtype=_TORCH_TO_NAME[args.dtype], out_dtype=_TORCH_TO_NAME[args.out_dtype])
        self.w_major = "k" if operand_major(w) == "col" else "n"
        self.w_unit = 1 if self.w_major == "k" else 2
        self.tiles = G * (-(-M // (choice.tile_m * choice.cluster_m))) * (
            -(-N // (choice.tile_n * choice.cluster_n)))
        self.num_ctas, self.max_tiles = _grid(device, nsm, choice.cluster_m * choice.cluster_n,
                                              self.tiles)
        self.trace = trace
        self.meta = _small("meta", device, torch.int64, (1, 8))
        self.meta32 = self.meta.view(torch.int32)
        self.offs = _small("offs", device, torch.int32, (1,))
        self.no_table = _small("table", device, torch.int32, (1, 1, 2))
        self.no_trace = _small("trace", device, torch.int32, (1, 1, 4))
        # Without the tail split the kernel never touches its workspace (one descriptor per
        # operand, no ring): a small placeholder does.
        self.workspace = WorkspaceSlot(device, self.num_ctas, choice)
        self.no_workspace = _small("workspace", device, torch.int64, (16,))
        self.kernel = _compiled(_compile_key("batched", args.dtype, args.out_dtype,
                                             self.w_major, choice, trace))
        self.constants = kernel_constants(self.kernel, self.meta, self.meta32, self.offs,
                                          self.no_table, self.no_trace, self.no_workspace)
        # Plans are cached per strides (ops/api.py), so whether a size-1 dimension's stride
        # needs rewriting is known here; our own `out` is contiguous and never does.
        self.fix_x = tma_view(x, 2) is not x
        self.fix_w = tma_view(w, self.w_unit) is not w
        self.fix_out = args.out is not None and tma_view(args.out, 2) is not args.out

    def __call__(self, x, w, out):
        if out is None:
            out = torch.empty(self.shape, dtype=self.out_dtype, device=self.device)
        if self.trivial:
            return out
        if self.zero:
            return out.zero_()
        choice = self.choice
        trace_t = (_trace_tensor(self.num_ctas, self.max_tiles, self.device)
                   if self.trace else None)
        xv = tma_view(x, 2) if self.fix_x else x
        wv = tma_view(w, self.w_unit) if self.fix_w else w
        ov = tma_view(out, 2) if self.fix_out else out
        meta, meta32, offs, no_table, no_trace, no_workspace = self.constants
        workspace = self.workspace.get(choice) if choice.tail_split else no_workspace
        self.kernel(xv, wv, ov, meta, meta32, offs, no_table, workspace,
                    no_trace if trace_t is None else trace_t, self.shape[0],
                    self.num_ctas, choice.swizzle, choice.a_policy, choice.b_policy, PDL, 0)
        _local.raw = (choice, self.num_ctas, self.shape[0], None, trace_t)
        return out


def grouped_bmm_cute(args: GroupedBmmArgs, config: GemmConfig, *, trace: bool = False
                     ) -> torch.Tensor:
    return BmmPlan(args, config, trace)(args.x, args.w, args.out)
