"""grouped_gemm's general form on the host: lists of operands in, one grouped launch out.

Turns validated arguments (ops/validation.py) into launch arguments: the kernel choice
(ops/heuristics.py), the per-problem metadata (pointers, leading dims, sizes) staged in pinned
memory and copied to the GPU in one transfer, the host visitor's table, and the compiled kernel
(ops/launch_kernel.py), called on the current stream through TVM-FFI.

Everything that follows from sizes, strides, dtypes and the config is built once and kept:
per problem set in a GeneralShape, per layout in a GeneralPlan. ops/api.py finds the plan of a
repeated call (ops/signature.py) and the call itself then only allocates its outputs, looks up
its metadata upload and workspace and calls the kernel. Nothing here reads a GPU value or
synchronizes.
"""

from __future__ import annotations

import functools
import itertools
import operator

import numpy as np
import torch

from moe_gemm.config import GemmConfig
from moe_gemm.ops import launch_kernel, launch_resources
from moe_gemm.ops import schedule as sched
from moe_gemm.ops.heuristics import choose_general, general_switches
from moe_gemm.ops.kernel_cache import kernel_constants
from moe_gemm.ops.launch_info import _local
from moe_gemm.ops.support import TMA_ALIGN_BYTES, GeneralLayout, analyze_general
from moe_gemm.ops.validation import GroupedGemmArgs

_PTR = torch.Tensor.data_ptr


@functools.lru_cache(maxsize=64)
def _general_placeholders(device: torch.device, ab: torch.dtype, d: torch.dtype, b_major: str):
    """The general form's unused/seed arguments (the real operands come from the metadata)."""
    return _new_placeholders(device, ab, d, b_major)


def _new_placeholders(device, ab, d, b_major):
    return (
        launch_resources._new_small("seed_a", device, ab, (128, 64), "n"),
        launch_resources._new_small("seed_w", device, ab, (64, 64), b_major),
        launch_resources._new_small("seed_d", device, d, (128, 64), "n"),
        launch_resources._new_small("offs", device, torch.int32, (1,), "n"),
        launch_resources._new_small("table", device, torch.int32, (1, 1, 2), "n"),
        launch_resources._new_small("trace", device, torch.int32, (1, 1, 4), "n"),
    )


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
            config, sizes, nsm, d.itemsize, **launch_kernel.table_keys(device, ab, d))
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
            # (a tail-split launch takes every SM: its last wave's tiles split over the idle
            # ones; a unit past the split's ends its CTA, so records per CTA stay bounded)
            self.num_ctas = nsm if choice.tail_split else max(1, min(nsm, self.total))
            self.max_tiles = -(-self.total // self.num_ctas)  # records per CTA, at most
        else:
            # A cluster walks cluster tiles (units): pairs of adjacent tiles of one problem.
            units = sum(sched.tiles_per_problem(ordered, choice.tile_m * choice.cluster_m,
                                                choice.tile_n * choice.cluster_n))
            self.num_ctas, self.max_tiles = launch_kernel._grid(None, nsm, size, units)
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
        self.kernel = (launch_kernel._kernel_for("general", ab, d, b_major, choice, trace)
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


def general_shape(sizes: tuple, ab: torch.dtype, d: torch.dtype, b_major: str,
                  config: GemmConfig, nsm: int, trace: bool, device: torch.device
                  ) -> GeneralShape:
    """The GeneralShape of a problem set, cached per value of the environment variables the
    kernel choice reads (heuristics.GENERAL_SWITCHES: a changed switch gets a new entry);
    device: its name picks tuned tables."""
    return _general_shape(sizes, ab, d, b_major, config, nsm, trace, general_switches(), device)


@functools.lru_cache(maxsize=256)
def _general_shape(sizes, ab, d, b_major, config, nsm, trace, switches, device) -> GeneralShape:
    return GeneralShape(sizes, ab, d, b_major, config, nsm, trace, device)


general_shape.cache_clear = _general_shape.cache_clear  # type: ignore[attr-defined]


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
        self.idx = launch_resources._device_index(device)
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
        self.workspace = launch_resources.WorkspaceSlot(device, shape.num_ctas, shape.choice)
        if launch_resources._fresh():
            ph = _new_placeholders(device, shape.ab_dtype, shape.out_dtype, shape.b_major)
        else:
            ph = _general_placeholders(device, shape.ab_dtype, shape.out_dtype, shape.b_major)
        self.placeholders = ph
        self.table = (launch_resources._table_tensor(shape.counts, shape.num_ctas, device)
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
        capturing = launch_resources._capturing()
        if not reuse or persistent or capturing or launch_resources._graph_owned > 0:
            return self._upload(ptrs, out_cols, persistent, capturing)
        addr = ptrs.tobytes() if out_cols is None else ptrs.tobytes() + out_cols.tobytes()
        key = (self, launch_resources._raw_stream(self.idx), addr)
        hit = _meta_cache.get(key)
        if hit is None:
            hit = _remember_upload(key, self._upload(ptrs, out_cols, False, False))
        return hit

    def _upload(self, ptrs: np.ndarray, out_cols: np.ndarray | None, persistent: bool,
                capturing: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Fill the rows in pinned memory and copy them to the device."""
        G, order = self.G, self.shape.order_np
        meta = launch_resources._pinned((G, 8), torch.int64)
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
            # The captured copy reads it at every replay.
            launch_resources._graph_keepalive.append(meta)
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
        capturing = launch_resources._capturing()
        if capturing or launch_resources._graph_owned > 0:
            if not self._aligned(ptrs):
                return None
            return self.launch_pointers(ptrs)
        stream = launch_resources._raw_stream(self.idx)
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
        handle if the caller read it outside capture (launch_resources.WorkspaceSlot.get)."""
        shape, c = self.shape, self.constants
        choice = shape.choice
        # (the workspace, a torch tensor, carries the stream: see kernel_constants)
        shape.kernel(c[0], c[1], c[2], meta[0], meta[1], c[3], c[4],
                     self.workspace.get(choice, stream), c[5] if trace_t is None else trace_t,
                     shape.G,
                     shape.num_ctas, choice.swizzle, choice.a_policy, choice.b_policy,
                     launch_kernel.PDL, d_base)
        self.note_launch(trace_t)

    def note_launch(self, trace_t: torch.Tensor | None) -> None:
        """Record a launch of this plan's kernel for launch_info.last_launch() (a new tuple
        per launch: it tells launches apart by identity)."""
        shape = self.shape
        _local.raw = (shape.choice, shape.num_ctas, shape.G, shape.launch_order, trace_t)

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


# A GroupedGemmPlan records its launch (the minority-layout B copies and the kernel) as a CUDA
# graph at its first call and replays it after that, instead of calling the kernel through
# TVM-FFI with its 16 arguments each time (H200 host, benchmarks.host_overhead, 2026-11-29:
# 8.6 against 11.4 us of CPU per call, a launch gap of 15.0 against 20.1 us); "0" turns it
# off.
# See GeneralLaunch.launch.
PLAN_GRAPH_ENV = "MOE_GEMM_PLAN_GRAPH"


def graphs_on(device) -> bool:
    """Whether a launch on `device` can be recorded as a CUDA graph (CUDA devices only: a
    launch elsewhere, e.g. a test's stand-in kernel on the CPU, launches directly)."""
    return torch.device(device).type == "cuda"


class GeneralLaunch:
    """A general-form launch from checked arguments (any `out`, minority-layout B operands,
    tracing). grouped_gemm's detailed path builds one per call; a GroupedGemmPlan keeps one
    (persistent=True: the metadata is uploaded once and each launch only re-copies
    minority-layout B operands; replay=True: recorded as a CUDA graph at the first launch and
    replayed)."""

    def __init__(self, args: GroupedGemmArgs, config: GemmConfig, *,
                 layout: GeneralLayout | None = None, trace: bool = False,
                 persistent: bool = False, replay: bool = False):
        if layout is None:
            res = analyze_general(args)
            if isinstance(res, str):
                raise ValueError(f"backend='cute' cannot take this input: {res}")
            layout = res
        self.device = device = args.device
        self.G = len(args.a)
        self.trace = trace
        self.persistent = persistent
        self.replay = replay and persistent and not trace and graphs_on(device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.shape = shape = general_shape(
            tuple(args.sizes), args.dtype, args.out_dtype, layout.b_major, config,
            launch_kernel.sm_count(device), trace, device)
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
        capturing = launch_resources._capturing()
        if capturing and persistent:
            raise RuntimeError("build a GroupedGemmPlan outside CUDA-graph capture (its "
                               "launches can be captured)")
        a_ld, b_ld = tuple(layout.a_ld), tuple(b_ld)
        self.plan = plan = (GeneralPlan(shape, device, a_ld, b_ld)
                            if launch_resources._fresh()
                            else general_plan(shape, device, a_ld, b_ld))
        ptrs = np.array(layout.a_ptr + list(b_ptr), dtype=np.int64)
        out_cols = None
        if args.out is not None:  # a caller's out: addresses and row strides (d_base is 0)
            out_cols = np.array([o.data_ptr() for o in outs] + [o.stride(0) for o in outs],
                                dtype=np.int64)
        if capturing:
            launch_resources._graph_keepalive.extend(f for _, f in self.fixes)
        self.meta = plan.metadata(ptrs, out_cols, persistent=persistent,
                                  reuse=not self.fixes)

    def launch(self) -> list[torch.Tensor]:
        if self.shape.total == 0:
            return list(self.outs)
        if self.replay and not launch_resources._capturing():
            graph = self.graph or self._record()
            if graph is not None:
                graph.replay()
                self.plan.note_launch(None)
                return list(self.outs)
        self._launch_now()
        return list(self.outs)

    def _launch_now(self) -> None:
        if self.persistent:
            for b, fixed in self.fixes:  # B may have new values since the plan was built
                fixed.copy_(b)
        trace_t = (launch_resources._trace_tensor(self.shape.num_ctas, self.shape.max_tiles,
                                                  self.device) if self.trace else None)
        self.plan.run(self.meta, self.d_base, trace_t)

    def _record(self) -> torch.cuda.CUDAGraph | None:
        """The launch captured as a CUDA graph, once (None, and no more tries, if the capture
        fails: the plan then launches directly).

        A replay runs on the caller's current stream and launches of one graph are ordered
        one after another whatever their streams, so the workspace the capture allocates (from
        the graph's own memory pool) is never used by two launches at once; the metadata and
        the B copies it reads are the plan's, kept as long as the plan. The capture runs on a
        side stream (CUDA captures no legacy default stream) in thread-local mode, so other
        threads' CUDA calls meanwhile are not disturbed; it launches nothing."""
        try:
            graph = torch.cuda.CUDAGraph()
            current = torch.cuda.current_stream(self.device)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(current)
            with torch.cuda.stream(side):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    self._launch_now()
                finally:
                    graph.capture_end()
        except RuntimeError:
            self.replay = False
            return None
        current.wait_stream(side)
        self.graph = graph
        return graph
