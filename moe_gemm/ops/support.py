"""What the sm90 kernels can take, decided from shapes, strides and dtypes alone.

Pure torch (no CuTe import), so `backend="auto"` can decide on any machine. The rules come
from the hardware: TMA descriptors need a 16-byte aligned base address and 16-byte multiples
for every stride but the unit one; WGMMA takes 16-bit inputs from shared memory (bf16, fp16).
Returns None when the kernel can run, else a sentence naming the first reason it cannot.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np
import torch

from moe_gemm.config import GemmConfig
from moe_gemm.ops.validation import GroupedBmmArgs, GroupedGemmArgs, GroupedMmArgs

KERNEL_IN_DTYPES = (torch.bfloat16, torch.float16)
KERNEL_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TMA_ALIGN_BYTES = 16
# Per-problem TMA descriptors live in a (G, 3, 128 B) workspace and the device visitor scans
# problem sizes 32 at a time; 65,535 keeps every index comfortably in Int32 arithmetic.
MAX_PROBLEMS = 65535
# Largest M, N or K of one problem: the metadata packs M | N << 32 and the kernel's K is Int32.
MAX_DIM = 2**31 - 1
# Tensor types grouped_gemm's fast scans take (a Parameter is a plain tensor with a flag; other
# subclasses may not own plain memory: FakeTensor, DTensor, ...).
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def operand_major(t: torch.Tensor) -> str | None:
    """'row' if the last dim has unit stride, 'col' if the one before it does, else None."""
    if t.shape[-1] <= 1 or t.stride(-1) == 1:
        return "row"
    if t.shape[-2] <= 1 or t.stride(-2) == 1:
        return "col"
    return None


def tma_problem(name: str, t: torch.Tensor) -> str | None:
    """Why `t` (2-D or 3-D) cannot be a TMA operand, or None."""
    if t.numel() == 0:
        return None
    elem = t.element_size()
    if t.data_ptr() % TMA_ALIGN_BYTES:
        return f"{name}'s data pointer is not {TMA_ALIGN_BYTES}-byte aligned"
    major = operand_major(t)
    if major is None:
        return f"{name} has no unit-stride dimension among its last two (strides {t.stride()})"
    unit_dim = t.dim() - 1 if major == "row" else t.dim() - 2
    for d in range(t.dim()):
        if d == unit_dim or t.shape[d] == 1:
            continue
        if (t.stride(d) * elem) % TMA_ALIGN_BYTES:
            return (
                f"{name} stride {t.stride(d)} (dim {d}) is not a multiple of "
                f"{TMA_ALIGN_BYTES // elem} elements ({TMA_ALIGN_BYTES} bytes), as TMA needs"
            )
    return None


def _neg_problem(names: str, *tensors: torch.Tensor) -> str | None:
    if any(t.is_neg() for t in tensors):
        return (f"{names} is a lazily negated view (the kernel reads memory, not the sign bit; "
                "call .resolve_neg())")
    return None


def _dtype_problem(dtype: torch.dtype, out_dtype: torch.dtype) -> str | None:
    if dtype not in KERNEL_IN_DTYPES:
        return f"the kernels take bf16 or fp16 inputs, not {dtype}"
    if out_dtype not in KERNEL_OUT_DTYPES:
        return f"the kernels write bf16, fp16 or fp32, not {out_dtype}"
    return None


def _out_row_problem(name: str, n: int, out_dtype: torch.dtype) -> str | None:
    elem = out_dtype.itemsize
    if (n * elem) % TMA_ALIGN_BYTES:
        return (
            f"{name} rows of {n} {out_dtype} elements are not a multiple of {TMA_ALIGN_BYTES} "
            "bytes, as the TMA store needs"
        )
    return None


@dataclass
class GeneralLayout:
    """What the host wrapper needs per problem, gathered in the same pass that checks it."""

    a_ptr: list[int]
    a_ld: list[int]
    b_ptr: list[int]
    b_ld: list[int]
    b_major: str  # "k" (B stored (N, K), K contiguous) or "n"; the majority of the problems
    b_fix: list[int]  # problems whose B has the other major (copied by the host wrapper)


def analyze_general(args: GroupedGemmArgs) -> GeneralLayout | str:
    """GeneralLayout when the kernel can take the problem set, else the first reason not.

    One pass over the problems, reading each tensor's strides and data pointer once: this
    runs per call, for hundreds of problems.
    """
    why = _dtype_problem(args.dtype, args.out_dtype)
    if why:
        return why
    G = len(args.a)
    if G > MAX_PROBLEMS:
        return f"{G} problems exceed the kernel's {MAX_PROBLEMS}"
    elem = args.a[0].element_size()
    align = TMA_ALIGN_BYTES // elem
    out_elem = args.out_dtype.itemsize
    a_ptr, a_ld, b_ptr, b_ld, majors = [0] * G, [0] * G, [0] * G, [0] * G, [""] * G
    for i, ((M, N, K), a, b) in enumerate(zip(args.sizes, args.a, args.b)):
        if M == 0 or N == 0:
            continue  # no tiles: never touched by the kernel
        if args.out is None and (N * out_elem) % TMA_ALIGN_BYTES:
            return _out_row_problem(f"out[{i}]", N, args.out_dtype)
        if K == 0:
            continue  # A and B are never loaded: the tile stores zeros
        if neg := _neg_problem(f"a[{i}] or b[{i}]", a, b):
            return neg
        sa = a.stride()
        if sa[1] != 1 and K > 1:
            return f"a[{i}] must be row-major (K contiguous) for the kernel"
        pa = a.data_ptr()
        if pa % TMA_ALIGN_BYTES or (M > 1 and sa[0] % align):
            return tma_problem(f"a[{i}]", a) or f"a[{i}] is not TMA-aligned"
        sb = b.stride()
        pb = b.data_ptr()
        # ld strides the dimension that is not contiguous (K for N-major, N for K-major):
        # TMA needs it 16-byte aligned wherever that dimension has more than one element.
        if sb[1] == 1 or N == 1:  # (K, N) row-major: N contiguous
            majors[i], ld, strided = "n", sb[0], K
        elif sb[0] == 1 or K == 1:  # w.T of an (N, K) weight: K contiguous
            majors[i], ld, strided = "k", sb[1], N
        else:
            return f"b[{i}] has no unit-stride dimension (strides {tuple(sb)})"
        if pb % TMA_ALIGN_BYTES or (ld % align and strided > 1):
            return tma_problem(f"b[{i}]", b) or f"b[{i}] is not TMA-aligned"
        a_ptr[i], a_ld[i], b_ptr[i], b_ld[i] = pa, sa[0], pb, ld
    if args.out is not None:
        for i, ((M, N, _), o) in enumerate(zip(args.sizes, args.out)):
            if M == 0 or N == 0:
                continue
            so = o.stride()
            if so[1] != 1 and N > 1:
                return f"out[{i}] must have unit stride along N"
            if o.data_ptr() % TMA_ALIGN_BYTES or (M > 1 and (so[0] * out_elem) % TMA_ALIGN_BYTES):
                return tma_problem(f"out[{i}]", o) or f"out[{i}] is not TMA-aligned"
    k_count = majors.count("k")
    b_major = "k" if k_count > majors.count("n") else "n"
    other = "n" if b_major == "k" else "k"
    b_fix = [i for i, m in enumerate(majors) if m == other]
    return GeneralLayout(a_ptr, a_ld, b_ptr, b_ld, b_major, b_fix)


def grouped_gemm_unsupported(args: GroupedGemmArgs) -> str | None:
    res = analyze_general(args)
    return res if isinstance(res, str) else None


def grouped_mm_unsupported(args: GroupedMmArgs, config: GemmConfig) -> str | None:
    why = _dtype_problem(args.dtype, args.out_dtype)
    if why:
        return why
    if args.E > MAX_PROBLEMS:
        return f"{args.E} experts exceed the kernel's {MAX_PROBLEMS}"
    if args.T == 0 or args.E == 0 or args.N == 0:
        return None
    if args.K > 0:
        why = _neg_problem("x or w", args.x, args.w) or tma_problem("x", args.x) or tma_problem("w", args.w)
        if why:
            return why
        if operand_major(args.x) != "row":
            return "x must be row-major (K contiguous) for the kernel"
    if args.out is not None:
        if args.out.stride(-1) != 1 and args.N > 1:
            return "out must have unit stride along N"
        return tma_problem("out", args.out)
    return _out_row_problem("out", args.N, args.out_dtype)


# The batched form's linear tile index (problem * tiles per problem + tile) is Int32 on the GPU.
MAX_BATCHED_TILES = 2**31 - 1


def grouped_bmm_unsupported(args: GroupedBmmArgs, config: GemmConfig) -> str | None:
    why = _dtype_problem(args.dtype, args.out_dtype)
    if why:
        return why
    G, M, N, K = args.G, args.M, args.N, args.K
    if G == 0 or M == 0 or N == 0:
        return None  # nothing to launch
    # Smallest tile any schedule uses is 64 x 64: the most tiles one launch can have.
    if G * -(-M // 64) * -(-N // 64) > MAX_BATCHED_TILES:
        return f"{G} problems of {M}x{N} exceed the kernel's {MAX_BATCHED_TILES} tiles"
    if K > 0:
        if args.x.stride(2) != 1 and K > 1:
            return "x must be row-major (K contiguous) for the kernel"
        why = _neg_problem("x or w", args.x, args.w) or tma_problem("x", args.x) or tma_problem("w", args.w)
        if why:
            return why
    if args.out is not None:
        if args.out.stride(2) != 1 and N > 1:
            return "out must have unit stride along N"
        return tma_problem("out", args.out)
    return _out_row_problem("out", N, args.out_dtype)


def empty_k_result(out: torch.Tensor, offs: torch.Tensor, given: bool) -> torch.Tensor:
    """The varlen forms' result at K = 0, where every routed row is an empty sum (the kernels'
    launch-time TMA descriptors cannot have an empty K extent, so no launch): zeros, but a
    given `out` keeps its rows past offs[-1]; on the GPU with no host sync (offs clamped into
    [0, T] as the kernels and the torch backend read it, so a decreasing entry cannot end the
    routed rows before an earlier one)."""
    if not given:
        return out.zero_()
    T = out.shape[0]
    end = offs.clamp(0, T).amax()
    rows = torch.arange(T, device=out.device)
    return out.masked_fill_((rows < end)[:, None], 0)


def tma_view(t: torch.Tensor, unit_dim: int) -> torch.Tensor:
    """`t` with every size-1 dimension given a 16-byte-multiple stride (a view, no copy).

    A size-1 dimension's stride is never used to address memory, but torch leaves whatever
    the producing op left there (e.g. K for a (G, 1, K) slice with odd K), and the compiled
    kernel and the TMA descriptor require 16-byte multiples for every non-unit stride.
    """
    align = TMA_ALIGN_BYTES // t.element_size()
    shape = t.shape
    strides = list(t.stride())
    changed = False
    for d, size in enumerate(shape):
        if size == 1 and d != unit_dim and strides[d] % align:
            if not changed:
                # Past the farthest element the other dims reach, rounded up to the rule.
                # (A plain loop: a plan's call pays this, and a generator cost ~0.9 us more.)
                reach = 1
                for s, n in zip(strides, shape):
                    if n > 1 and s * n > reach:
                        reach = s * n
                safe = -(-reach // align) * align
            strides[d] = safe
            changed = True
    if unit_dim >= 0 and shape[unit_dim] == 1 and strides[unit_dim] != 1:
        strides[unit_dim] = 1
        changed = True
    return t.as_strided(shape, strides) if changed else t


class TmaViews:
    """The operands of one launch that reach the kernel as tma_view views.

    Made by tma_views when a plan is built: plans are cached per strides (ops/signature.py),
    so which operands carry a size-1 dim's stride off the 16-byte rule holds for every call
    that finds the plan. Called with the operands in the order tma_views was given them, it
    returns them with the views in place (a rare path: the common one has no TmaViews).
    """

    __slots__ = ("fixes",)

    def __init__(self, fixes: tuple[tuple[int, int], ...]):
        self.fixes = fixes  # (position, unit dim) of each operand that needs a view

    def __call__(self, *operands: torch.Tensor) -> list[torch.Tensor]:
        views = list(operands)
        for i, unit in self.fixes:
            views[i] = tma_view(views[i], unit)
        return views


def tma_views(*operands: tuple[torch.Tensor | None, int]) -> TmaViews | None:
    """TmaViews of (operand, unit_dim) pairs, each operand as the kernel will receive it
    (None: an output the launch allocates, contiguous, which never needs a view); None when
    no operand needs a view, so that a plan's call tests one attribute for all of them."""
    fixes = tuple((i, unit) for i, (t, unit) in enumerate(operands)
                  if t is not None and tma_view(t, unit) is not t)
    return TmaViews(fixes) if fixes else None


_SEQUENCES = (list, tuple)
_PLAIN_SET = frozenset(PLAIN_TENSORS)
_ONE, _TWO = {1}, {2}
_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")
_T = torch.Tensor


class GeneralScan:
    """grouped_gemm's operands as the kernel needs them, read by scan_general.

    sizes: G (M, N, K); a_ld / b_ld: leading dims (for problems without work, whatever the
    tensors hold: the kernel never reads them); b_major: "n" or "k" for every B; ptrs: A's
    then B's data pointers (2G int64), those the kernel loads checked 16-byte aligned.
    """

    __slots__ = ("sizes", "dtype", "out_dtype", "device", "a_ld", "b_ld", "b_major", "ptrs")

    def __init__(self, sizes, dtype, out_dtype, device, a_ld, b_ld, b_major, ptrs):
        self.sizes = sizes
        self.dtype = dtype
        self.out_dtype = out_dtype
        self.device = device
        self.a_ld = a_ld
        self.b_ld = b_ld
        self.b_major = b_major
        self.ptrs = ptrs


def scan_general(a: object, b: object, out_dtype: torch.dtype | None) -> GeneralScan | None:
    """grouped_gemm's check and layout analysis in one pass, for the common case: lists of
    plain tensors, one dtype and device, every operand TMA-ready, one major for every B.

    Returns None at the first thing outside that case (the caller then takes the detailed
    path, which raises or falls back with the exact message), so this never decides an error.
    Each property is read for all operands at once through map() (a C loop per property, no
    Python bytecode per problem) and checked on its distinct values; problems without work
    (M, N or K = 0, an expert with no tokens) get numpy masks. ~1.35 us per problem on the
    CPU-only dev machine (the per-problem loop it replaced: ~1.5); a call whose operands match
    an earlier signature skips it (ops/api.py).
    """
    if type(a) not in _SEQUENCES or type(b) not in _SEQUENCES:
        return None
    G = len(a)
    if G == 0 or G > MAX_PROBLEMS or len(b) != G:
        return None
    ab = (*a, *b)
    if not set(map(type, ab)) <= _PLAIN_SET:
        return None
    dtypes = set(map(_DTYPE, ab))
    if len(dtypes) != 1:
        return None
    dtype = dtypes.pop()
    odt = dtype if out_dtype is None else out_dtype
    if dtype not in KERNEL_IN_DTYPES or odt not in KERNEL_OUT_DTYPES:
        return None
    if len(set(map(_T.get_device, ab))) != 1:
        return None
    if any(map(_T.is_neg, ab)):
        return None  # the detailed path falls back to torch, which resolves the sign
    try:
        shapes = list(map(_SHAPE, ab))
    except RuntimeError:  # a nested tensor has no sizes: the detailed path names it
        return None
    if set(map(len, shapes)) != _TWO:
        return None
    Ms, Ks = zip(*shapes[:G])
    Kb, Ns = zip(*shapes[G:])
    if Ks != Kb or max(Ms) > MAX_DIM or max(Ns) > MAX_DIM or max(Ks) > MAX_DIM:
        return None
    strides = list(map(_T.stride, ab))
    lda, a_unit = zip(*strides[:G])
    s0b, s1b = zip(*strides[G:])
    if set(s1b) == _ONE:  # (K, N) row-major: N contiguous
        b_major, ldb = "n", s0b
    elif set(s0b) == _ONE:  # w.T of an (N, K) weight: K contiguous
        b_major, ldb = "k", s1b
    else:
        return None  # mixed majors (one is copied) or a size-1 dim's odd stride
    align = TMA_ALIGN_BYTES // dtype.itemsize
    out_align = TMA_ALIGN_BYTES // odt.itemsize
    ptrs = np.fromiter(map(_T.data_ptr, ab), np.int64, 2 * G)
    if 0 in Ms or 0 in Ns or 0 in Ks:
        if not _active_ok(Ms, Ns, Ks, lda, a_unit, ldb, b_major, ptrs, align, out_align):
            return None
    elif (any(n % out_align for n in set(Ns)) or set(a_unit) != _ONE
          or any(s % align for s in set(lda)) or any(s % align for s in set(ldb))
          or int(np.bitwise_or.reduce(ptrs)) % TMA_ALIGN_BYTES):
        # (a stride that only a size-1 dim carries is harmless, but rare: the detailed path)
        return None
    return GeneralScan(tuple(zip(Ms, Ns, Ks)), dtype, odt, a[0].device, lda, ldb, b_major,
                       ptrs)


def _active_ok(Ms, Ns, Ks, lda, a_unit, ldb, b_major, ptrs, align, out_align) -> bool:
    """scan_general's checks where some problems have no work: only the others count."""
    M, N, K = np.array(Ms), np.array(Ns), np.array(Ks)
    rows = (M > 0) & (N > 0)  # problems with output rows (they are stored)
    loads = rows & (K > 0)  # ... whose A and B are loaded
    strided = K if b_major == "n" else N  # B's non-contiguous dim
    bad = (
        (N % out_align != 0) & rows
        | (np.array(a_unit) != 1) & (K > 1) & loads
        | (np.array(lda) % align != 0) & (M > 1) & loads
        | (np.array(ldb) % align != 0) & (strided > 1) & loads
    )
    if bad.any():
        return False
    loaded = ptrs[np.concatenate([loads, loads])]
    return not (loaded.size and int(np.bitwise_or.reduce(loaded)) % TMA_ALIGN_BYTES)
