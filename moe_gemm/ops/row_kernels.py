"""When the MoE layers' row kernels (the top-k combine, the token gather) run: a tensor on a
CUDA device the CuTe kernels serve, outside torch.compile's tracing, with their switch not set
to "torch", and rows of 16-byte vectors (kernels/sm90/vector_rows.py) within the kernels'
sizes: row counts an Int32 indexes, rows no wider than the launch grid's y dimension covers.

A tensor the kernels are not given (the callers take torch's op instead): a subclass (a
FakeTensor or DTensor has no memory of its own, and any subclass's __torch_function__ or
__torch_dispatch__ should see the op), and any tensor while a TorchDispatchMode runs
(FakeTensorMode over real tensors, make_fx's tracer, FlopCounterMode...: a kernel launch is
invisible to them, so a traced graph would lose the copy)."""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as fwad

from moe_gemm.env import env_value
from moe_gemm.kernels.sm90.constants import COMBINE_VEC
from moe_gemm.ops.validation import shape_text

# A launch grid's y dimension (the 16-byte vectors of a row, in CTAs of ROW_THREADS threads)
# is at most 65535 CTAs (x: 2^31 - 1).
MAX_GRID_Y = 65535
# The fewest threads a row kernel's CTA has (the token gather's 64; the combine's 128): rows
# of up to MAX_GRID_Y * ROW_THREADS vectors (33,553,920 values) fit every row kernel's grid.
ROW_THREADS = 64
MAX_ROW_VECS = MAX_GRID_Y * ROW_THREADS
# Row counts the kernels index in Int32 (their shapes are Int32, the wrapper refuses larger
# ones), with room past the last for a CTA's rows (the gather rounds S up to its 8 rows).
MAX_ROWS = 2**31 - 1024

# The kernels' row and index dtypes, by the names their compile keys take.
KERNEL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
INDEX_DTYPES = {torch.int64: "int64", torch.int32: "int32"}

_PLAIN = (torch.Tensor, torch.nn.Parameter)  # (a Parameter is a plain tensor with a flag)
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 0)


def row_kernel_allowed(t: torch.Tensor, switch: str) -> bool:
    """Whether a row kernel may run on t's device now (MOE_GEMM_* `switch` not "torch")."""
    if t.device.type != "cuda" or torch.compiler.is_compiling() or env_value(switch) == "torch":
        return False
    from moe_gemm.capability import cute_problem

    # (before any layout check: under torch.func's grad the tensors have no data pointer)
    return cute_problem(t.device) is None


def autograd_tracked(t: torch.Tensor | None) -> bool:
    """Whether autograd differentiates through t here (the kernels have no derivative: the
    callers then take torch's op): backward (t requires grad, grad enabled) or forward mode
    (t a dual tensor of an open torch.autograd.forward_ad level, which no_grad leaves on).
    (torch.func's grad and jvp keep the kernels off by themselves: capability.cute_problem.)"""
    if t is None:
        return False
    return (t.requires_grad and torch.is_grad_enabled()) or forward_dual(t)


def forward_dual(t: torch.Tensor | None) -> bool:
    """Whether t is a dual tensor of an open torch.autograd.forward_ad level."""
    # (_current_level is -1 outside any `with forward_ad.dual_level()`: one attribute read)
    return (t is not None and fwad._current_level >= 0
            and fwad.unpack_dual(t).tangent is not None)


def plain_tensor(t: torch.Tensor) -> bool:
    """Whether t is a tensor a kernel may be given: a dense torch.Tensor (or Parameter) of
    its own memory, its values as stored (no lazy negation), with no TorchDispatchMode
    running (see the module docstring)."""
    return (type(t) in _PLAIN and t.layout == torch.strided and not t.is_nested
            and not t.is_neg() and not _dispatch_modes())


def vector_rows_ok(t: torch.Tensor) -> bool:
    """Whether a (rows, H) tensor is rows of 16-byte vectors the kernels read: a plain tensor,
    1 to MAX_ROWS rows, H a multiple of COMBINE_VEC of at most MAX_ROW_VECS vectors and
    contiguous, rows 16-byte aligned."""
    if not plain_tensor(t):  # (before data_ptr: a FakeTensor's is a placeholder)
        return False
    rows, H = t.shape
    return not (rows == 0 or rows > MAX_ROWS or H % COMBINE_VEC or H > MAX_ROW_VECS * COMBINE_VEC
                or t.stride(1) != 1 or t.stride(0) % COMBINE_VEC or t.data_ptr() % 16)


def check_row_operands(op: str, name: str, t: torch.Tensor, t_shape: str, rows: torch.Tensor,
                       rows_shape: str, rank: int) -> None:
    """TypeError / ValueError naming what `op` expects, from metadata only (no host sync):
    `name` a dense 2-D `t_shape` floating tensor, `rows` a dense int64 / int32 tensor of
    `rows_shape` (`rank` dimensions) on t's device. (Unchecked, a CPU rows beside
    a GPU t reached a kernel as a host pointer, and a sparse or nested tensor failed inside
    torch with a message about its own arguments.)"""
    for label, x in ((name, t), ("rows", rows)):
        # (first: a nested tensor has no sizes to read, and reports the strided layout)
        if x.is_nested or x.layout != torch.strided:
            got = "a nested tensor" if x.is_nested else f"layout {x.layout}"
            raise TypeError(f"{op}: {label} must be a dense (strided) tensor; got {got}")
    if t.dim() != 2 or not t.is_floating_point():
        raise TypeError(f"{op}: {name} must be a 2-D {t_shape} floating tensor; got "
                        f"{shape_text(t)} {t.dtype}")
    if rows.dim() != rank or rows.dtype not in INDEX_DTYPES:
        raise TypeError(f"{op}: rows must be a {rank}-D {rows_shape} int64 or int32 tensor; got "
                        f"{shape_text(rows)} {rows.dtype}")
    if rows.device != t.device:
        raise ValueError(f"{op}: rows must be on {name}'s device {t.device}; got {rows.device}")
