"""Argument checks for the public ops, with messages that name what was expected.

Every check here runs on the host from shapes, dtypes and devices only; none reads a CUDA
tensor's values (that would synchronize). The one value check, on `offs`, runs when offs lives
on the CPU or when the caller asks for it (MOE_GEMM_CHECK_OFFS=1); the kernels themselves
clamp offsets into [0, T] so that bad values on the GPU can never write out of bounds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from moe_gemm.env import env_value_reader
from moe_gemm.ops.aliasing import has_internal_overlap, outputs_aliasing_inputs

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_DTYPE_NAMES = "torch.bfloat16, torch.float16 or torch.float32"


@dataclass(frozen=True)
class GroupedGemmArgs:
    a: list[torch.Tensor]  # each (M_i, K_i)
    b: list[torch.Tensor]  # each (K_i, N_i)
    out: list[torch.Tensor] | None  # each (M_i, N_i)
    dtype: torch.dtype
    out_dtype: torch.dtype
    device: torch.device
    sizes: list[tuple[int, int, int]] = None  # type: ignore[assignment]  # (M_i, N_i, K_i)
    # out indices that may share memory with an operand: the op computes those into fresh
    # tensors and copies (moe_gemm/aliasing.py)
    out_aliased: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.sizes is None:
            sizes = [(a.shape[0], b.shape[1], a.shape[1]) for a, b in zip(self.a, self.b)]
            object.__setattr__(self, "sizes", sizes)

    @classmethod
    def trusted(cls, a, b, dtype, out_dtype, device, sizes) -> GroupedGemmArgs:
        """Built by grouped_gemm's per-call scans, which have checked every field: one dict
        update instead of the frozen dataclass's seven guarded setattrs (~1 us per call on
        an H200 host, a few percent of a small grouped_gemm)."""
        self = object.__new__(cls)
        self.__dict__.update(a=a, b=b, out=None, dtype=dtype, out_dtype=out_dtype,
                             device=device, sizes=sizes)
        return self


@dataclass(frozen=True)
class GroupedMmArgs:
    x: torch.Tensor  # (T, K)
    w: torch.Tensor  # (E, K, N)
    offs: torch.Tensor  # (E,) int32, cumulative end rows
    out: torch.Tensor | None  # (T, N)
    dtype: torch.dtype
    out_dtype: torch.dtype

    @property
    def T(self) -> int:
        return self.x.shape[0]

    @property
    def K(self) -> int:
        return self.x.shape[1]

    @property
    def E(self) -> int:
        return self.w.shape[0]

    @property
    def N(self) -> int:
        return self.w.shape[2]


@dataclass(frozen=True)
class GroupedBmmArgs:
    """The batched form: every problem has the same (M, N, K)."""

    x: torch.Tensor  # (G, M, K)
    w: torch.Tensor  # (G, K, N)
    out: torch.Tensor | None  # (G, M, N)
    dtype: torch.dtype
    out_dtype: torch.dtype

    @property
    def G(self) -> int:
        return self.x.shape[0]

    @property
    def M(self) -> int:
        return self.x.shape[1]

    @property
    def K(self) -> int:
        return self.x.shape[2]

    @property
    def N(self) -> int:
        return self.w.shape[2]


def shape_text(t: torch.Tensor) -> str:
    """A tensor's shape as Python writes a tuple, for messages: (2, 3), (4,), ().

    Built from each size's int so that torch.compile traces it with dynamic shapes too
    (dynamo cannot trace str() of a tuple holding symbolic sizes: the message was lost, and
    without fullgraph the resumed frame raised a TypeError instead of ours); int() reads the
    size the call has, where an f-string would print a symbol's name."""
    dims = [f"{int(d)}" for d in t.shape]
    return "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"


# A nested tensor (torch.nested, a prototype API) has no sizes or strides of its own: torch
# raises an internal error when asked for them (and torch.compile's C++ tensor guards, which
# the plan caches use, abort the process).
NESTED = "a nested tensor (torch.nested), which moe_gemm's ops do not support"


def check_dense(name: str, t: object) -> None:
    """A nested, sparse, mkldnn or other non-strided tensor: a TypeError naming the operand.
    (Both backends slice rows and read strides, which those layouts do not have: without this
    the call fails deep inside torch.) Every public op asks this of each tensor argument
    before it reads a shape. (The nested check comes first: a nested tensor built with the
    default layout reports torch.strided.)"""
    if isinstance(t, torch.Tensor):
        if t.is_nested:
            raise TypeError(f"{name} must be a dense (strided) tensor; got {NESTED} (its "
                            f"components, {name}.unbind(), are dense tensors)")
        if t.layout != torch.strided:
            raise TypeError(f"{name} must be a dense (strided) tensor; got layout {t.layout}")


def _check_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be {_DTYPE_NAMES}; got {t.dtype}")


def resolve_out_dtype(dtype: torch.dtype, out_dtype: torch.dtype | None) -> torch.dtype:
    if out_dtype is None:
        return dtype
    if not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"out_dtype must be a torch.dtype or None; got {out_dtype!r}")
    if out_dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"out_dtype must be {_DTYPE_NAMES}; got {out_dtype}")
    return out_dtype


def _as_tensor_list(name: str, seq: object, shape_hint: str,
                    kind: str = "2-D tensors") -> list[torch.Tensor]:
    if isinstance(seq, torch.Tensor) and seq.is_nested:
        # (the closest thing to the list asked for: say how to get that list)
        raise TypeError(f"{name} must be a sequence (list or tuple) of {kind} {shape_hint}; "
                        f"got {NESTED} (pass list({name}.unbind()))")
    if isinstance(seq, torch.Tensor):
        raise TypeError(
            f"{name} must be a sequence (list or tuple) of {kind} {shape_hint}; got a single "
            f"tensor of shape {shape_text(seq)} (use list(t.unbind(0)) for a 3-D batch)"
        )
    if not isinstance(seq, Sequence) or isinstance(seq, (str, bytes)):
        raise TypeError(
            f"{name} must be a sequence (list or tuple) of {kind} {shape_hint}; "
            f"got {type(seq).__name__}"
        )
    items = list(seq)
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}[{i}] must be a torch.Tensor {shape_hint}; got {type(t).__name__}")
    return items


def _check_writable_out(name: str, out: torch.Tensor) -> None:
    """An output the op can write: distinct elements, not a tensor autograd tracks, and not
    an inference tensor outside inference mode."""
    if has_internal_overlap(out):
        raise ValueError(f"{name} has elements that share memory (an expanded or zero-stride "
                         f"tensor); pass a tensor whose elements are distinct")
    check_out_untracked(name, out)
    check_out_not_inference(name, out)


def check_out_not_inference(name: str, out: torch.Tensor) -> None:
    """torch's RuntimeError for an inference tensor (made under torch.inference_mode) written
    outside inference mode. The torch backend's in-place writes raise it themselves, the
    kernels' writes would not: checked here, before the backend is chosen, both raise it."""
    if out.is_inference() and not torch.is_inference_mode_enabled():
        raise RuntimeError(
            f"Inplace update to inference tensor outside InferenceMode is not allowed: {name} "
            f"was made under torch.inference_mode and this call is outside it; call it under "
            f"torch.inference_mode, or pass {name}.clone() (a normal tensor)")


def check_out_untracked(name: str, out: torch.Tensor) -> None:
    """An output autograd does not track (written in place, it could not be differentiated).
    Also asked by the traced wrappers (ops/custom_ops.py), whose registered ops run under
    no_grad, where the check above would never fire."""
    if out.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{name} requires grad (a leaf that requires grad, or the result of "
                         f"an earlier differentiable call that wrote it): an output written in "
                         f"place cannot be differentiated; pass out=None for a differentiable "
                         f"result, or {name}.detach() to reuse its memory")


def check_grouped_gemm(
    a: object, b: object, out: object, out_dtype: torch.dtype | None, *, concrete: bool = True
) -> GroupedGemmArgs:
    """concrete=False (fake tensors): skip the checks that read memory addresses."""
    a_list = _as_tensor_list("a", a, "(M_i, K_i)")
    b_list = _as_tensor_list("b", b, "(K_i, N_i)")
    if len(a_list) != len(b_list):
        raise ValueError(
            f"expected one b per a: got len(a)={len(a_list)} and len(b)={len(b_list)}"
        )
    if not a_list:
        if out is not None and (n_out := len(_as_tensor_list("out", out, "(M_i, N_i)"))):
            raise ValueError(
                f"expected one out per problem: got len(out)={n_out} for 0 problems"
            )
        return GroupedGemmArgs([], [], [] if out is not None else None, torch.bfloat16,
                               resolve_out_dtype(torch.bfloat16, out_dtype), torch.device("cpu"),
                               [])
    dtype, device = a_list[0].dtype, a_list[0].device
    try:
        a_shapes = [t.shape for t in a_list]
        b_shapes = [t.shape for t in b_list]
    except RuntimeError:  # a nested tensor has no shape: the detailed check names it
        _explain_grouped_gemm(a_list, b_list, dtype, device)
        raise
    # Fast path: one set per property (this runs for hundreds of problems per call); the
    # detailed loop below only runs to say exactly what is wrong.
    ok = (
        dtype in SUPPORTED_DTYPES
        and {t.dtype for t in a_list} == {dtype} == {t.dtype for t in b_list}
        and {t.device for t in a_list} == {device} == {t.device for t in b_list}
        and {t.layout for t in a_list} == {torch.strided} == {t.layout for t in b_list}
        and all(len(sa) == 2 and len(sb) == 2 and sa[1] == sb[0]
                for sa, sb in zip(a_shapes, b_shapes))
    )
    if not ok:
        _explain_grouped_gemm(a_list, b_list, dtype, device)
    sizes = [(sa[0], sb[1], sa[1]) for sa, sb in zip(a_shapes, b_shapes)]
    odt = resolve_out_dtype(dtype, out_dtype)
    out_list = None
    aliased: tuple[int, ...] = ()
    if out is not None:
        out_list = _as_tensor_list("out", out, "(M_i, N_i)")
        if len(out_list) != len(a_list):
            raise ValueError(
                f"expected one out per problem: got len(out)={len(out_list)} for "
                f"{len(a_list)} problems"
            )
        if out_dtype is None:
            odt = out_list[0].dtype
            _check_dtype("out[0]", out_list[0])
        for i, (oi, (m, n, _)) in enumerate(zip(out_list, sizes)):
            check_dense(f"out[{i}]", oi)
            want = (m, n)
            if tuple(oi.shape) != want:
                raise ValueError(
                    f"out[{i}] must be (M_i, N_i) = ({want[0]}, {want[1]}); got {shape_text(oi)}"
                )
            if oi.dtype != odt:
                raise TypeError(f"out[{i}] must have dtype {odt}; got {oi.dtype}")
            if oi.device != device:
                raise ValueError(f"out[{i}] is on {oi.device} but the operands are on {device}")
            _check_writable_out(f"out[{i}]", oi)
        if concrete and not torch.compiler.is_compiling():  # (traced: no memory to compare)
            aliased = tuple(outputs_aliasing_inputs(out_list, a_list + b_list))
    return GroupedGemmArgs(a_list, b_list, out_list, dtype, odt, device, sizes, aliased)


def _explain_grouped_gemm(
    a_list: list[torch.Tensor], b_list: list[torch.Tensor], dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Raise the error that names the first offending operand (the fast check failed)."""
    for i, (ai, bi) in enumerate(zip(a_list, b_list)):
        check_dense(f"a[{i}]", ai)
        check_dense(f"b[{i}]", bi)
    _check_dtype("a[0]", a_list[0])
    for i, (ai, bi) in enumerate(zip(a_list, b_list)):
        if ai.dim() != 2:
            raise ValueError(f"a[{i}] must be 2-D (M_i, K_i); got shape {shape_text(ai)}")
        if bi.dim() != 2:
            raise ValueError(f"b[{i}] must be 2-D (K_i, N_i); got shape {shape_text(bi)}")
        for name, t in ((f"a[{i}]", ai), (f"b[{i}]", bi)):
            _check_dtype(name, t)
            if t.dtype != dtype:
                raise TypeError(
                    f"{name} has dtype {t.dtype} but a[0] has {dtype}; every operand must "
                    "share one dtype"
                )
            if t.device != device:
                raise ValueError(
                    f"{name} is on {t.device} but a[0] is on {device}; every operand must be "
                    "on one device"
                )
        if ai.shape[1] != bi.shape[0]:
            raise ValueError(
                f"problem {i}: a[{i}] is (M, K) = {shape_text(ai)}, so b[{i}] must be "
                f"(K, N) = ({ai.shape[1]}, N); got {shape_text(bi)}"
            )
    raise AssertionError("unreachable: fast check failed but no operand is wrong")



def check_tensor_args(*specs: tuple[str, object, str]) -> None:
    """TypeError for the first (name, value, shape hint) whose value is not a tensor."""
    for name, t, hint in specs:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor {hint}; got {type(t).__name__}")


def _check_weight(x: torch.Tensor, w: torch.Tensor, lead: str,
                  check_x_dtype: Callable[[str, torch.Tensor], None]) -> None:
    """w 3-D, x's dtype (check_x_dtype) shared by w, and one device."""
    if w.dim() != 3:
        article = "an" if lead == "E" else "a"
        raise ValueError(f"w must be 3-D ({lead}, K, N) (for {article} ({lead}, N, K) weight "
                         f"pass w.transpose(1, 2)); got shape {shape_text(w)}")
    check_x_dtype("x", x)
    if w.dtype != x.dtype:
        raise TypeError(f"w has dtype {w.dtype} but x has {x.dtype}; they must match")
    if w.device != x.device:
        raise ValueError(f"w is on {w.device} but x is on {x.device}; they must be on one device")


def check_varlen_operands(
    x: object, w: object, offs: object, *, dense: tuple[tuple[str, object], ...] = (),
    check_x_dtype: Callable[[str, torch.Tensor], None] | None = None,
    batched_form: bool = True, offs_hint: str = "(E,)",
) -> None:
    """The MoE form's operands: x (T, K), w (E, K, N) of x's dtype, offs (E,) int32, dense,
    on x's device (the tensors of `dense`, (name, value) pairs, are checked dense too, first:
    a nested tensor has no shape to check). check_x_dtype: the op's dtype check of x (16-bit
    or fp32 by default); batched_form: whether the op has a batched form a 3-D x could mean."""
    check_tensor_args(("x", x, "(T, K)"), ("w", w, "(E, K, N)"), ("offs", offs, offs_hint))
    assert isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor)
    assert isinstance(offs, torch.Tensor)
    for name, t in (("x", x), ("w", w), ("offs", offs), *dense):
        check_dense(name, t)
    if x.dim() != 2:
        when = " when offs is given" if batched_form else ""
        hint = (" (3-D x (G, M, K) is the batched form: pass offs=None)"
                if batched_form and x.dim() == 3 else "")
        raise ValueError(f"x must be 2-D (T, K){when}; got shape {shape_text(x)}{hint}")
    _check_weight(x, w, "E", check_x_dtype or _check_dtype)
    if offs.device != x.device:
        raise ValueError(
            f"offs is on {offs.device} but x is on {x.device}; offs must live with x"
        )
    if offs.dtype != torch.int32:
        raise TypeError(f"offs must be int32 cumulative end rows (E,); got dtype {offs.dtype}")
    if offs.dim() != 1:
        raise ValueError(f"offs must be 1-D (E,) = ({w.shape[0]},); got shape {shape_text(offs)}")
    K = x.shape[1]
    E, Kw, _ = w.shape
    if Kw != K:
        raise ValueError(f"x is (T, K) = {shape_text(x)}, so w must be (E, {K}, N); got "
                         f"{shape_text(w)}")
    if offs.shape[0] != E:
        raise ValueError(f"offs must have one entry per expert: ({E},); got {shape_text(offs)}")


def check_batched_operands(
    x: object, w: object, *, dense: tuple[tuple[str, object], ...] = (),
    check_x_dtype: Callable[[str, torch.Tensor], None] | None = None,
) -> None:
    """The batched form's operands: x (G, M, K), w (G, K, N) of x's dtype, dense, one device
    (`dense` and check_x_dtype as check_varlen_operands takes them)."""
    check_tensor_args(("x", x, "(G, M, K)"), ("w", w, "(G, K, N)"))
    assert isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor)
    for name, t in (("x", x), ("w", w), *dense):
        check_dense(name, t)
    if x.dim() != 3:
        hint = " (2-D x (T, K) is the MoE form: pass offs)" if x.dim() == 2 else ""
        raise ValueError(f"x must be 3-D (G, M, K) when offs is None; got shape "
                         f"{shape_text(x)}{hint}")
    _check_weight(x, w, "G", check_x_dtype or _check_dtype)
    G, _, K = x.shape
    if w.shape[0] != G or w.shape[1] != K:
        raise ValueError(f"x is (G, M, K) = {shape_text(x)}, so w must be ({G}, {K}, N); "
                         f"got {shape_text(w)}")


def check_out(out: object, want: tuple[int, ...], dims: str, odt: torch.dtype,
              device: torch.device, *, dtype_from_out: bool = False) -> torch.dtype:
    """An `out` argument (None passes): a tensor of shape `want` (`dims` names it, e.g.
    "(T, N)"), dtype odt, on the operands' device, writable. dtype_from_out (no out_dtype
    given, and the op takes out's dtype then): out's own dtype, if supported, is the output
    dtype. Returns the output dtype."""
    if out is None:
        return odt
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor {dims}; got {type(out).__name__}")
    if dtype_from_out:
        odt = out.dtype
        _check_dtype("out", out)
    if tuple(out.shape) != want:
        raise ValueError(f"out must be {dims} = {want}; got {shape_text(out)}")
    if out.dtype != odt:
        raise TypeError(f"out must have dtype {odt}; got {out.dtype}")
    if out.device != device:
        raise ValueError(f"out is on {out.device} but x is on {device}")
    _check_writable_out("out", out)
    return odt


# MOE_GEMM_CHECK_OFFS, read at every call that could check on the host.
offs_check_requested = env_value_reader("MOE_GEMM_CHECK_OFFS")


def check_grouped_mm(
    x: object, w: object, offs: object, out: object, out_dtype: torch.dtype | None, *,
    concrete: bool = True,
) -> GroupedMmArgs:
    """concrete=False (fake tensors): skip the check that reads offs values."""
    check_varlen_operands(x, w, offs, dense=(("out", out),))
    assert isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor)
    assert isinstance(offs, torch.Tensor)
    T, N = x.shape[0], w.shape[2]
    if concrete and (offs.device.type == "cpu" or offs_check_requested()):
        check_offs_values(offs, T)
    odt = check_out(out, (T, N), "(T, N)", resolve_out_dtype(x.dtype, out_dtype), x.device,
                    dtype_from_out=out_dtype is None)
    return GroupedMmArgs(x, w, offs, out, x.dtype, odt)


def check_offs_values(offs: torch.Tensor, T: int) -> None:
    """offs must be non-decreasing, start at >= 0 and end at <= T. Reads values (syncs on GPU)."""
    if offs.numel() == 0:
        return
    v = offs.detach().to("cpu", torch.int64)
    if int(v[0]) < 0:
        raise ValueError(f"offs must be >= 0 (cumulative end rows); got offs[0]={int(v[0])}")
    d = v[1:] - v[:-1]
    if bool((d < 0).any()):
        i = int(torch.nonzero(d < 0)[0]) + 1
        raise ValueError(
            f"offs must be non-decreasing (cumulative end rows); got offs[{i - 1}]="
            f"{int(v[i - 1])} > offs[{i}]={int(v[i])}"
        )
    if int(v[-1]) > T:
        raise ValueError(f"offs[-1] must be <= T = {T} (rows of x); got {int(v[-1])}")


def check_grouped_bmm(
    x: object, w: object, out: object, out_dtype: torch.dtype | None
) -> GroupedBmmArgs:
    """grouped_mm without offs: x (G, M, K) @ w (G, K, N) -> (G, M, N)."""
    check_batched_operands(x, w, dense=(("out", out),))
    assert isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor)
    (G, M, _), N = x.shape, w.shape[2]
    odt = check_out(out, (G, M, N), "(G, M, N)", resolve_out_dtype(x.dtype, out_dtype),
                    x.device, dtype_from_out=out_dtype is None)
    return GroupedBmmArgs(x, w, out, x.dtype, odt)
