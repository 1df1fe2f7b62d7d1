"""What `moe-gemm bench` measures; `benchmarks.bench` runs it, `benchmarks.scoring` scores it.

Plain Python/torch, runs on any machine:
- the suites (`full_suite`, `smoke_suite`): shapes in two problem forms, as in the library:
  general, `grouped_gemm(a_list, b_list)` with every problem its own A (M, K) and row-major
  B (K, N) allocation; varlen, `grouped_mm(x (T, K), w (E, K, N), offs)` with w the transposed
  view of an (E, N, K) weight (`w_t.transpose(1, 2)`, the layout transformers stores) and offs
  int32 cumulative row ends on the device;
- routing for the MoE shapes (`zipf_counts`): expert popularity 1/rank^s over a seeded
  permutation of the experts, rows drawn one by one. It uses only `random.Random.random()`,
  whose stream Python keeps stable across versions, so a seed routes the same everywhere;
- input generation (fresh `randn * 0.1`, never zeros) and the L2 rotation count;
- the implementations (ours and the peers) bound to inputs, with a float32 reference.
The arithmetic (bytes needed, FLOPs, floors, the derived columns and the table) is in
`benchmarks.scoring`.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.fp8_operands import Scaled, scaled_operands
from moe_gemm.capability import cute_problem
from moe_gemm.config import GemmConfig
from moe_gemm.ops import api as ops

Size = tuple[int, int, int]  # (M, N, K)
DEFAULT_NAME = "moe_gemm (default)"
LIST_NAME = "moe_gemm grouped_gemm (list)"
GROUPED_MM_FN = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
GROUPED_MM_NAME = "F.grouped_mm" if hasattr(F, "grouped_mm") else "torch._grouped_mm"

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# An "fp8" shape draws bf16 inputs (its bf16 rows' operands and output dtype) and quantizes
# them for its FP8 rows (benchmarks.suite_fp8).
FP8 = "fp8"
# Relative Frobenius error allowed against the float32 reference: bf16/fp16 output rounding
# alone gives ~2e-3 / ~3e-4; anything past these is a wrong result, not rounding. FP8 rows are
# checked against the product of their own dequantized operands, so quantization error is not
# counted and only the bf16 output rounding remains.
TOLERANCE = {"bf16": 1e-2, "fp16": 2e-3, "fp32": 1e-4, FP8: 1e-2}
# Zipf exponent for the skewed MoE shapes: at s=1.2 the top expert of 256 takes about a quarter
# of the rows and the tail ranks expect well under one row each, so decode leaves ~100 of 256
# experts empty (seed 1234: 97).
ZIPF_S = 1.2
# Inputs are randn * INPUT_SCALE: random (never zeros, which can run faster and hide unwritten
# outputs) and small enough that K=7168 sums stay far from bf16/fp16 overflow.
INPUT_SCALE = 0.1
# The CUTLASS grouped-scheduler document's example (media/docs/cpp/grouped_scheduler.md),
# the case where sorting by K helps: two K=128 and two K=1024 problems.
CUTLASS_SCHEDULER_EXAMPLE: tuple[Size, ...] = (
    (1152, 768, 128),
    (1152, 768, 1024),
    (768, 1152, 128),
    (768, 1152, 1024),
)


@dataclass(frozen=True)
class ShapeSpec:
    """One benchmark case.

    Args:
        name: short id used by --only and in the JSON.
        form: "general" (grouped_gemm on lists) or "varlen" (grouped_mm on x, w, offs).
        dtype: "bf16", "fp16" or "fp32" (inputs and output), or "fp8" (bf16 inputs, quantized
            for the FP8 rows; the general form then needs one (M, N, K) for all problems).
        description: one line for the README/JSON.
        problems: general form only, (M, N, K) per problem.
        experts, rows, n, k: varlen form only: E, T, N, K.
        zipf_s: varlen routing exponent; 0 = every expert equally likely.
        variants: whether the variant matrix (schedule x visitor x K-sort) runs here.
        headline: the shape the roofline bar (>= 0.95 of the floor) applies to.
        fixed_counts: varlen only: rows per expert given outright (then `rows` must be their
            sum) instead of drawn by zipf_counts.
        layout: varlen only: the weights' storage, "ENK" ((E, N, K) K-contiguous, passed as
            w_t.transpose(1, 2)) or "EKN" ((E, K, N) N-contiguous, passed as is).
        b_layout: general only: each B's storage, "KN" ((K, N) row-major) or "NK" (the
            transposed view of an (N, K) row-major weight, as nn.Linear stores it).
    """

    name: str
    form: str
    dtype: str = "bf16"
    description: str = ""
    problems: tuple[Size, ...] = ()
    experts: int = 0
    rows: int = 0
    n: int = 0
    k: int = 0
    zipf_s: float = ZIPF_S
    variants: bool = False
    headline: bool = False
    fixed_counts: tuple[int, ...] = ()
    layout: str = "ENK"
    b_layout: str = "KN"

    def __post_init__(self) -> None:
        if self.form not in ("general", "varlen"):
            raise ValueError(f"form must be 'general' or 'varlen'; got {self.form!r}")
        if self.dtype not in DTYPES and self.dtype != FP8:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, {FP8}; got "
                             f"{self.dtype!r}")
        if self.dtype == FP8 and self.form == "general" and len(set(self.problems)) != 1:
            raise ValueError(f"{self.name}: an fp8 general-form shape needs one (M, N, K) for "
                             "all problems (the batched form)")
        if self.form == "general" and not self.problems:
            raise ValueError(f"{self.name}: a general-form shape needs problems")
        if self.form == "varlen" and min(self.experts, self.n, self.k) <= 0:
            raise ValueError(f"{self.name}: a varlen shape needs experts, n and k > 0")
        if self.fixed_counts and (len(self.fixed_counts) != self.experts
                                  or sum(self.fixed_counts) != self.rows):
            raise ValueError(f"{self.name}: fixed_counts must hold `experts` counts summing "
                             "to rows")
        if self.layout not in ("ENK", "EKN"):
            raise ValueError(f"{self.name}: layout must be 'ENK' or 'EKN'; got {self.layout!r}")
        if self.b_layout not in ("KN", "NK"):
            raise ValueError(f"{self.name}: b_layout must be 'KN' or 'NK'; got "
                             f"{self.b_layout!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The inputs' (and output's) 16/32-bit dtype; bf16 for an fp8 shape."""
        return DTYPES.get(self.dtype, torch.bfloat16)

    def counts(self, seed: int) -> list[int]:
        """Rows per problem (varlen: the routing draw for `seed`; general: each M)."""
        if self.form == "general":
            return [m for m, _, _ in self.problems]
        if self.fixed_counts:
            return list(self.fixed_counts)
        return zipf_counts(self.experts, self.rows, self.zipf_s, seed)

    def sizes(self, seed: int) -> list[Size]:
        """(M_i, N_i, K_i) per problem; for varlen, M_i from the routing draw."""
        if self.form == "general":
            return list(self.problems)
        return [(m, self.n, self.k) for m in self.counts(seed)]

    def describe(self, seed: int) -> dict[str, object]:
        """What the JSON records about this shape (sizes summarised, generator documented)."""
        sizes = self.sizes(seed)
        ms = [m for m, _, _ in sizes]
        info: dict[str, object] = {
            "form": self.form,
            "dtype": self.dtype,
            "description": self.description,
            "problems": len(sizes),
            "rows_total": sum(ms),
            "rows_min": min(ms),
            "rows_max": max(ms),
            "empty_problems": sum(1 for m in ms if m == 0),
            "headline": self.headline,
            "variants": self.variants,
        }
        if self.form == "general":
            info["distinct_sizes"] = [list(s) for s in dict.fromkeys(sizes)]
            info["layout"] = ("a[i] (M,K) and b[i] (K,N) row-major, one allocation per problem"
                              if self.b_layout == "KN" else
                              "a[i] (M,K) row-major, b[i] the (K,N) transposed view of an "
                              "(N,K) row-major weight, one allocation per problem")
        else:
            info.update(experts=self.experts, N=self.n, K=self.k)
            if self.fixed_counts:
                info["routing"] = {"kind": "given", "counts": ms}
            else:
                info["routing"] = {
                    "kind": "zipf" if self.zipf_s > 0 else "uniform",
                    "s": self.zipf_s,
                    "seed": seed,
                    "generator": "benchmarks.suite.zipf_counts: p(rank r) ~ r^-s over a "
                    "seeded permutation of experts, one random.Random(seed) draw per row",
                    "counts": ms,
                }
            info["layout"] = (
                "x (T,K) row-major; w = w_t.transpose(1, 2) of an (E,N,K) contiguous weight; "
                "offs int32 cumulative row ends on the device" if self.layout == "ENK" else
                "x (T,K) row-major; w (E,K,N) contiguous (N fastest); offs int32 cumulative "
                "row ends on the device")
        return info


# ---------------------------------------------------------------------------------------------
# Routing


def zipf_counts(experts: int, rows: int, s: float, seed: int) -> list[int]:
    """Rows per expert from a Zipf-like popularity, deterministic per seed.

    Expert popularity is 1/rank^s, ranks assigned by a seeded Fisher-Yates permutation (so the
    busiest expert is not always expert 0); each of `rows` rows picks an expert by inverse CDF.

    Args:
        experts: number of experts E (> 0).
        rows: rows to route T (>= 0).
        s: Zipf exponent (>= 0); 0 gives every expert the same probability.
        seed: any int; the same seed gives the same counts on every machine.

    Returns:
        E non-negative ints summing to `rows`.
    """
    if experts <= 0:
        raise ValueError(f"experts must be positive; got {experts}")
    if rows < 0:
        raise ValueError(f"rows must be >= 0; got {rows}")
    if s < 0 or not math.isfinite(s):
        raise ValueError(f"s must be a finite number >= 0; got {s}")
    rng = random.Random(seed)
    order = list(range(experts))
    for i in range(experts - 1, 0, -1):  # Fisher-Yates on random() alone (stable stream)
        j = int(rng.random() * (i + 1))
        order[i], order[j] = order[j], order[i]
    weights = [(rank + 1) ** -s for rank in range(experts)]
    total = sum(weights)
    cdf = list(itertools.accumulate(w / total for w in weights))
    counts = [0] * experts
    for _ in range(rows):
        rank = min(bisect.bisect_right(cdf, rng.random()), experts - 1)
        counts[order[rank]] += 1
    return counts


def offsets(counts: Sequence[int]) -> list[int]:
    """Cumulative row ends (torch grouped_mm's `offs`)."""
    return list(itertools.accumulate(counts))


# ---------------------------------------------------------------------------------------------
# L2 rotation


def input_sets_needed(set_bytes: int, l2_bytes: int, max_sets: int) -> int:
    """How many independent input sets to rotate so that repeated runs miss L2.

    One set when it alone is at least twice L2; otherwise enough sets that their total is at
    least twice L2 (never fewer than two), capped at `max_sets`.
    """
    if l2_bytes <= 0 or set_bytes >= 2 * l2_bytes:
        return 1
    return max(1, min(max_sets, max(2, math.ceil(2 * l2_bytes / max(set_bytes, 1)))))


# ---------------------------------------------------------------------------------------------
# Inputs


@dataclass
class GeneralInputs:
    a: list[torch.Tensor]  # each (M_i, K_i)
    b: list[torch.Tensor]  # each (K_i, N_i)
    fp8: dict[str, Scaled] | None = None  # fp8 shapes: stacked, quantized per granularity


@dataclass
class VarlenInputs:
    x: torch.Tensor  # (T, K)
    w: torch.Tensor  # (E, K, N): the transposed view of w_t, or the storage itself ("EKN")
    w_t: torch.Tensor  # the weights' contiguous storage: (E, N, K), or w for "EKN"
    offs: torch.Tensor  # (E,) int32 on the device
    counts: list[int]  # rows per expert, on the host
    fp8: dict[str, Scaled] | None = None  # fp8 shapes: x and w quantized per granularity


def _randn(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
           gen: torch.Generator) -> torch.Tensor:
    t = torch.randn(shape, dtype=dtype, device=device, generator=gen)
    return t.mul_(INPUT_SCALE)


def make_inputs(
    spec: ShapeSpec, counts: Sequence[int], device: torch.device, seed: int
) -> GeneralInputs | VarlenInputs:
    """One fresh random input set for `spec` (the caller varies `seed` per set); an fp8
    shape's also carries its FP8 operands (quantized here, outside any timed region)."""
    dtype = spec.torch_dtype
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    inp: GeneralInputs | VarlenInputs
    if spec.form == "general":
        a, b = [], []
        for m, n, k in spec.problems:
            a.append(_randn((m, k), dtype, device, gen))
            b.append(_randn((k, n), dtype, device, gen) if spec.b_layout == "KN"
                     else _randn((n, k), dtype, device, gen).t())
        inp = GeneralInputs(a, b)
        if spec.dtype == FP8:  # the batched form: x (G, M, K), w (G, K, N)
            inp.fp8 = scaled_operands(torch.stack(a), torch.stack(b).transpose(1, 2), None)
        return inp
    T = sum(counts)
    x = _randn((T, spec.k), dtype, device, gen)
    offs = torch.tensor(offsets(counts), dtype=torch.int32, device=device)
    if spec.layout == "EKN":
        w = _randn((spec.experts, spec.k, spec.n), dtype, device, gen)
        inp = VarlenInputs(x, w, w, offs, list(counts))
    else:
        w_t = _randn((spec.experts, spec.n, spec.k), dtype, device, gen)
        inp = VarlenInputs(x, w_t.transpose(1, 2), w_t, offs, list(counts))
    if spec.dtype == FP8:
        inp.fp8 = scaled_operands(x, inp.w.transpose(1, 2), offs)
    return inp


Inputs = GeneralInputs | VarlenInputs


def input_bytes(inputs: Inputs) -> int:
    """Bytes one input set occupies (what must fall out of L2 between runs); for an fp8 set
    the smallest FP8 operand set, the least any of its rows streams."""
    if inputs.fp8:
        return min(s.nbytes() for s in inputs.fp8.values())
    if isinstance(inputs, GeneralInputs):
        return sum(t.numel() * t.element_size() for t in itertools.chain(inputs.a, inputs.b))
    return inputs.x.numel() * inputs.x.element_size() + (
        inputs.w_t.numel() * inputs.w_t.element_size()
    )


# ---------------------------------------------------------------------------------------------
# The suites

VARIANTS: tuple[tuple[str, str, bool], ...] = tuple(
    (schedule, visitor, ksort)
    for schedule in ("pingpong", "cooperative")
    for visitor in ("device", "host")
    for ksort in (True, False)
)


def variant_name(schedule: str, visitor: str, sort_by_k: bool) -> str:
    return f"moe_gemm {schedule}/{visitor}/ksort-{'on' if sort_by_k else 'off'}"


def full_suite() -> list[ShapeSpec]:
    """The suite (bf16 unless named)."""
    headline = ((128, 512, 7168),) * 256
    return [
        ShapeSpec("uniform", "general", "bf16",
                  "256 x (M=128, N=512, K=7168), each problem its own A and B (headline)",
                  problems=headline, variants=True, headline=True),
        ShapeSpec("moe-decode", "varlen", "bf16",
                  "E=256, 1024 rows Zipf-routed (some experts empty), N=512, K=7168",
                  experts=256, rows=1024, n=512, k=7168),
        ShapeSpec("moe-prefill", "varlen", "bf16",
                  "E=32, 32768 rows Zipf-routed, N=4096, K=7168",
                  experts=32, rows=32768, n=4096, k=7168),
        ShapeSpec("mixtral", "varlen", "bf16",
                  "E=8, 16384 rows routed uniformly at random, N=14336, K=4096",
                  experts=8, rows=16384, n=14336, k=4096, zipf_s=0.0),
        ShapeSpec("moe-down", "varlen", "bf16",
                  "E=64, 16384 rows Zipf-routed, N=2048, K=1408",
                  experts=64, rows=16384, n=2048, k=1408),
        ShapeSpec("k-varying", "general", "bf16",
                  "64 problems: the CUTLASS grouped-scheduler example x16 "
                  "(1152x768x128, 1152x768x1024, 768x1152x128, 768x1152x1024)",
                  problems=CUTLASS_SCHEDULER_EXAMPLE * 16, variants=True),
        ShapeSpec("uniform-fp16", "general", "fp16",
                  "the headline in fp16", problems=headline),
    ]


def smoke_suite() -> list[ShapeSpec]:
    """Tiny stand-ins with the same names and forms: the whole harness in seconds on a CPU."""
    small_kv = ((48, 32, 16), (48, 32, 64), (32, 48, 16), (32, 48, 64))
    return [
        ShapeSpec("uniform", "general", "bf16", "smoke: 8 x (16, 32, 64)",
                  problems=((16, 32, 64),) * 8, variants=True, headline=True),
        ShapeSpec("moe-decode", "varlen", "bf16", "smoke: E=16, 24 rows Zipf",
                  experts=16, rows=24, n=32, k=64),
        ShapeSpec("moe-prefill", "varlen", "bf16", "smoke: E=4, 128 rows Zipf",
                  experts=4, rows=128, n=64, k=64),
        ShapeSpec("mixtral", "varlen", "bf16", "smoke: E=4, 128 rows uniform",
                  experts=4, rows=128, n=64, k=32, zipf_s=0.0),
        ShapeSpec("moe-down", "varlen", "bf16", "smoke: E=8, 96 rows Zipf",
                  experts=8, rows=96, n=32, k=48),
        ShapeSpec("k-varying", "general", "bf16", "smoke: 4 K-varying problems x2",
                  problems=small_kv * 2, variants=True),
        ShapeSpec("uniform-fp16", "general", "fp16", "smoke: the headline stand-in in fp16",
                  problems=((16, 32, 64),) * 8),
    ]


# ---------------------------------------------------------------------------------------------
# Implementations


def short_error(exc: BaseException, limit: int = 400) -> str:
    """One line naming the exception type, at most `limit` characters (for JSON and table)."""
    text = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


class NotApplicable(Exception):
    """The implementation cannot take this shape; recorded as n/a with the reason."""


@dataclass
class Prepared:
    """One implementation bound to one input set: `run` is timed, `check` is verified."""

    run: Callable[[], object]
    check: Callable[[], object]
    # An implementation with its own reference (FP8: the product of its own dequantized
    # operands): check()'s output -> relative error, and the error allowed.
    error: Callable[[object], float] | None = None
    tolerance: float | None = None
    # What the implementation chose on its first call (a peer's autotuned config), as text
    # for the row: where a peer wins, the row says with which tile.
    describe: Callable[[], str | None] | None = None


@dataclass(frozen=True)
class Impl:
    """One row of the table: ours (default or a variant config) or a peer.

    `build(spec, inputs, device)` does all setup outside the timed region (stacking, views,
    output buffers, graph capture) and raises NotApplicable when the shape is not its kind.
    """

    name: str
    peer: bool
    build: Callable[[ShapeSpec, Inputs, torch.device], Prepared]
    default: bool = False
    config: GemmConfig | None = None
    notes: str = ""
    dtype: str | None = None  # the operands it reads, when not the shape's ("bf16", "fp8")
    scale: str | None = None  # FP8 scale granularity ("block", "row")
    ceiling: bool = False  # a bound to compare against (dense FP8), not a peer


def _sizes_of(inp: Inputs) -> list[tuple[int, int, int]]:
    if isinstance(inp, GeneralInputs):
        return [(a.shape[0], b.shape[1], a.shape[1]) for a, b in zip(inp.a, inp.b)]
    return [(m, inp.w.shape[2], inp.w.shape[1]) for m in inp.counts]


def _ours(config: GemmConfig | None) -> Callable[[ShapeSpec, Inputs, torch.device], Prepared]:
    def build(spec: ShapeSpec, inp: Inputs, device: torch.device) -> Prepared:
        if config is not None and config.backend == "cute" and (why := cute_problem(device)):
            raise NotApplicable(f"the Hopper kernels cannot run here: {why}")
        nan = float("nan")
        if isinstance(inp, GeneralInputs):
            a, b = inp.a, inp.b

            def run() -> object:
                return ops.grouped_gemm(a, b, config=config)

            def check() -> object:
                out = [torch.full((x.shape[0], y.shape[1]), nan, dtype=x.dtype, device=device)
                       for x, y in zip(a, b)]
                return ops.grouped_gemm(a, b, out=out, config=config)

            return Prepared(run, check)
        x, w, offs = inp.x, inp.w, inp.offs

        def run_mm() -> object:
            return ops.grouped_mm(x, w, offs, config=config)

        def check_mm() -> object:
            out = torch.full((x.shape[0], w.shape[2]), nan, dtype=x.dtype, device=device)
            return ops.grouped_mm(x, w, offs, out=out, config=config)

        return Prepared(run_mm, check_mm)

    return build


def _ours_batched(spec: ShapeSpec, inp: Inputs, device: torch.device) -> Prepared:
    """grouped_mm's 3D x 3D form on the operands stacked as torch.bmm gets them."""
    sizes = _sizes_of(inp)
    if not isinstance(inp, GeneralInputs) or len(set(sizes)) != 1:
        raise NotApplicable("the batched form needs the same (M, N, K) for every problem")
    A, B = torch.stack(inp.a), torch.stack(inp.b)  # copies, made outside the timed region

    def run() -> object:
        return ops.grouped_mm(A, B)

    def check() -> object:
        out = torch.full((A.shape[0], A.shape[1], B.shape[2]), float("nan"), dtype=A.dtype,
                         device=device)
        return ops.grouped_mm(A, B, out=out)

    return Prepared(run, check)


def uniform_problems(spec: ShapeSpec) -> bool:
    return spec.form == "general" and len(set(spec.problems)) == 1


def _build_bmm(spec: ShapeSpec, inp: Inputs, device: torch.device) -> Prepared:
    sizes = _sizes_of(inp)
    if len(set(sizes)) != 1 or sizes[0][0] == 0:
        raise NotApplicable("torch.bmm needs the same (M, N, K) for every problem")
    if isinstance(inp, GeneralInputs):
        A, B = torch.stack(inp.a), torch.stack(inp.b)  # copies, made outside the timed region
    else:
        G, (M, _, K) = len(sizes), sizes[0]
        A, B = inp.x[: G * M].view(G, M, K), inp.w
    run = lambda: torch.bmm(A, B)  # noqa: E731
    return Prepared(run, run)


def _as_varlen(inp: Inputs, device: torch.device, what: str) -> tuple[torch.Tensor, ...]:
    """x (T, K), w (G, K, N), offs int32: the 2D x 3D form (one K and N for all groups)."""
    if isinstance(inp, VarlenInputs):
        return inp.x, inp.w, inp.offs
    sizes = _sizes_of(inp)
    if len({(n, k) for _, n, k in sizes}) != 1:
        raise NotApplicable(f"{what}'s 2D x 3D form takes one K and one N for all groups")
    x = torch.cat(inp.a)  # copies, made outside the timed region
    w = torch.stack(inp.b)
    offs = torch.tensor(offsets([m for m, _, _ in sizes]), dtype=torch.int32, device=device)
    return x, w, offs


def _build_grouped_mm(spec: ShapeSpec, inp: Inputs, device: torch.device) -> Prepared:
    if GROUPED_MM_FN is None:
        raise NotApplicable("this torch has neither F.grouped_mm nor torch._grouped_mm")
    x, w, offs = _as_varlen(inp, device, GROUPED_MM_NAME)
    fn = GROUPED_MM_FN
    run = lambda: fn(x, w, offs=offs)  # noqa: E731
    return Prepared(run, run)


_quack_cache: dict[str, Any] = {}


def _quack_gemm() -> tuple[Callable[..., Any] | None, str | None]:
    """quack.gemm_interface.gemm, or why it cannot be used (imported once, on a GPU only)."""
    if "fn" not in _quack_cache:
        import importlib.util

        if importlib.util.find_spec("quack") is None:
            _quack_cache.update(fn=None, why="quack-kernels is not installed")
        else:
            try:
                from quack.gemm_interface import gemm  # type: ignore[import-not-found]

                _quack_cache.update(fn=gemm, why=None)
            except Exception as exc:  # any import failure: record it, never abort the run
                _quack_cache.update(fn=None, why=f"import quack failed: {short_error(exc)}")
    return _quack_cache["fn"], _quack_cache["why"]


def quack_operands(inp: Inputs, device: torch.device):
    """QuACK's gemm and the varlen operands it takes: (gemm, x, w, cu_seqlens_m);
    NotApplicable where QuACK cannot run or the inputs are not its kind."""
    if device.type != "cuda":
        raise NotApplicable("QuACK needs a CUDA GPU (not imported here)")
    fn, why = _quack_gemm()
    if fn is None:
        raise NotApplicable(why or "QuACK unavailable")
    x, w, offs = _as_varlen(inp, device, "QuACK varlen_m")
    return fn, x, w, torch.cat([torch.zeros(1, dtype=torch.int32, device=device), offs])


def _build_quack(spec: ShapeSpec, inp: Inputs, device: torch.device) -> Prepared:
    fn, x, w, cu = quack_operands(inp, device)
    # tuned=False: QuACK's default (heuristic) config; its autotuner would take minutes.
    run = lambda: fn(x, w, cu_seqlens_m=cu, tuned=False)  # noqa: E731
    return Prepared(run, run)


# QuACK's SM90 autotune space for a varlen GEMM (quack-kernels 0.6.5 gemm_config.py): 6
# cooperative and 5 ping-pong tiles x 2 clusters (swap-AB is pruned for varlen).
QUACK_TUNE_CONFIGS = 22


def quack_autotune_seconds(call_ms: float) -> float:
    """About how long QuACK's autotuner takes on a shape whose call takes `call_ms`: per
    config a warm-up of max(200 ms, 50 calls) (a Python loop: short kernels are host-bound
    there), a captured graph of 200 timed calls and ~0.3 s of capture and priming
    (quack/bench/bench_utils.py); not counted: the first compiles, which its own process pool
    runs once per config and layout (QUACK_CACHE_DIR keeps them, and its results)."""
    per_config = max(200.0, 50 * call_ms) + 200 * call_ms + 300.0
    return QUACK_TUNE_CONFIGS * per_config / 1e3


def _build_quack_tuned(spec: ShapeSpec, inp: Inputs, device: torch.device) -> Prepared:
    """QuACK with tuned=True: its autotuner picks among its configs on the first call (per
    shape, cached in memory and, with QUACK_CACHE_AUTOTUNING=1, on disk)."""
    fn, x, w, cu = quack_operands(inp, device)
    run = lambda: fn(x, w, cu_seqlens_m=cu, tuned=True)  # noqa: E731
    return Prepared(run, run, describe=_quack_tuned_choice)


def build_quack_config(inp: Inputs, device: torch.device, config: dict[str, Any],
                       describe: str | None = None) -> Prepared:
    """QuACK's varlen GEMM run with one fixed config (quack.gemm_config.GemmConfig keyword
    arguments; those this QuACK lacks are dropped), no autotune: gemm_tuned.fn writes into a
    preallocated out, which the check reads. `describe`: the row's "chosen"."""
    _, x, w, cu = quack_operands(inp, device)
    from quack.gemm_config import GemmConfig as QuackConfig  # type: ignore[import-not-found]
    from quack.gemm_interface import gemm_tuned  # type: ignore[import-not-found]

    known = getattr(QuackConfig, "__dataclass_fields__", None)
    cfg = QuackConfig(**{k: v for k, v in config.items() if known is None or k in known})
    out = torch.empty(x.shape[0], w.shape[2], dtype=x.dtype, device=device)

    def run() -> torch.Tensor:
        gemm_tuned.fn(x, w, out, cu_seqlens_m=cu, config=cfg)
        return out

    return Prepared(run, run, describe=None if describe is None else (lambda: describe))


def _quack_tuned_choice() -> str | None:
    """The config QuACK's autotuner chose for its latest call (its Autotuner object keeps it
    as best_config), or None where this QuACK does not say."""
    try:
        from quack import gemm_interface  # type: ignore[import-not-found]
    except Exception:
        return None
    best = getattr(getattr(gemm_interface, "gemm_tuned", None), "best_config", None)
    return None if best is None else str(best)[:300]


def loop_body(inp: Inputs, device: torch.device) -> Callable[[], object]:
    """One torch.mm per non-empty problem, views and outputs built outside the timed region."""
    if isinstance(inp, GeneralInputs):
        outs = [torch.empty(a.shape[0], b.shape[1], dtype=a.dtype, device=device)
                for a, b in zip(inp.a, inp.b)]
        triples = [(a, b, o) for a, b, o in zip(inp.a, inp.b, outs) if a.shape[0] > 0]
        result: object = outs
    else:
        y = torch.empty(inp.x.shape[0], inp.w.shape[2], dtype=inp.x.dtype, device=device)
        triples, start = [], 0
        for e, end in enumerate(offsets(inp.counts)):
            if end > start:
                triples.append((inp.x[start:end], inp.w[e], y[start:end]))
            start = end
        result = y

    def body() -> object:
        for a, b, o in triples:
            torch.mm(a, b, out=o)
        return result

    return body


def _build_loop(spec: ShapeSpec, inp: Inputs, device: torch.device) -> Prepared:
    body = loop_body(inp, device)
    return Prepared(body, body)


def _build_graph(spec: ShapeSpec, inp: Inputs, device: torch.device) -> Prepared:
    if device.type != "cuda":
        raise NotApplicable("CUDA graphs need a CUDA device")
    body = loop_body(inp, device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm cuBLAS (handles, workspaces) before capture
        for _ in range(2):
            body()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = body()

    def replay() -> object:
        graph.replay()
        return result

    return Prepared(replay, replay)


QUACK_NAME = "QuACK varlen"
QUACK_TUNED_NAME = "QuACK varlen (tuned)"


def implementations(spec: ShapeSpec, variants: bool, quack_tuned: bool = False) -> list[Impl]:
    """Ours (default) first, then the peers, then the variant matrix where it applies."""
    if uniform_problems(spec):
        # One (M, N, K) for all: the natural call is the 3-D one torch.bmm also gets.
        ours = [
            Impl(DEFAULT_NAME, False, _ours_batched, default=True,
                 notes="grouped_mm(x (G, M, K), w (G, K, N)), config=None; operands stacked "
                 "outside the timed region, as for torch.bmm"),
            Impl(LIST_NAME, False, _ours(None),
                 notes="grouped_gemm on the per-problem allocations, config=None"),
        ]
    else:
        ours = [Impl(DEFAULT_NAME, False, _ours(None), default=True, notes="config=None")]
    impls = [
        *ours,
        Impl("torch.bmm", True, _build_bmm,
             notes="cuBLAS batched; operands stacked outside the timed region"),
        Impl(GROUPED_MM_NAME, True, _build_grouped_mm,
             notes="2D x 3D with int32 offs; general-form operands concatenated/stacked "
             "outside the timed region"),
        Impl("torch.mm loop", True, _build_loop,
             notes="offsets known on the host, views and outputs prebuilt, empty problems "
             "skipped: the ideal host-known loop"),
        Impl("torch.mm loop (CUDA graph)", True, _build_graph,
             notes="the same loop captured once per input set and replayed"),
        Impl(QUACK_NAME, True, _build_quack,
             notes="quack.gemm_interface.gemm(x, w, cu_seqlens_m=..., tuned=False)"),
    ]
    if quack_tuned:
        impls.append(Impl(QUACK_TUNED_NAME, True, _build_quack_tuned,
                          notes="quack.gemm_interface.gemm(..., tuned=True): QuACK's "
                          "autotuner on the first call"))
    if variants and spec.variants:
        for schedule, visitor, ksort in VARIANTS:
            cfg = GemmConfig(backend="cute", schedule=schedule, visitor=visitor,  # type: ignore[arg-type]
                             sort_by_k=ksort)
            impls.append(Impl(variant_name(schedule, visitor, ksort), False, _ours(cfg),
                              config=cfg))
    return impls


# ---------------------------------------------------------------------------------------------
# Checking: a float32 reference for every output


@contextmanager
def _exact_fp32() -> Iterator[None]:
    """float32 matmuls without TF32 for the reference."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)


def reference(inp: Inputs) -> torch.Tensor:
    """All outputs in float32, flattened in problem order (the order `_flatten` uses)."""
    with _exact_fp32():
        if isinstance(inp, GeneralInputs):
            return torch.cat([(a.float() @ b.float()).reshape(-1) for a, b in zip(inp.a, inp.b)])
        y = torch.zeros(inp.x.shape[0], inp.w.shape[2], dtype=torch.float32,
                        device=inp.x.device)
        start = 0
        for e, end in enumerate(offsets(inp.counts)):
            if end > start:
                y[start:end] = inp.x[start:end].float() @ inp.w[e].float()
            start = end
        return y.reshape(-1)


def _flatten(out: object) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out.reshape(-1)
    if isinstance(out, (list, tuple)) and all(isinstance(o, torch.Tensor) for o in out):
        return torch.cat([o.reshape(-1) for o in out])
    raise TypeError(f"unexpected output type {type(out).__name__}")


def rel_err(out: object, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float32 (NaN if any output is NaN, e.g. left unwritten)."""
    flat = _flatten(out)
    if flat.numel() != ref.numel():
        raise RuntimeError(f"output has {flat.numel()} elements, expected {ref.numel()}")
    num = torch.linalg.vector_norm(flat.float() - ref).item()
    den = torch.linalg.vector_norm(ref).item()
    return num / den if den > 0 else num
