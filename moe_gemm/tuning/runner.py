"""The tuner's device side: inputs, reference, checks and timed graphs for one shape.

Every candidate runs through the public ops (grouped_mm / grouped_gemm with a GemmConfig that
pins it), exactly as a caller's config would. Its first output goes into a NaN-poisoned
buffer and must pass the accuracy rule of the kernel tests against a float32 reference:
max|out - ref| <= 2 * max|torch - ref| + 1e-3 * max|ref|, where `torch` is the same product
computed by torch.mm in the inputs' dtype (the 2x rule), so an unwritten element, a wrong tile
or a race fails, and only fp32-accumulation-order differences pass.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable

import torch

from moe_gemm import grouped_gemm, grouped_mm
from moe_gemm.capability import sm_count
from moe_gemm.config import GemmConfig
from moe_gemm.ops import heuristics
from moe_gemm.tuning import space, timing
from moe_gemm.tuning.compile_pool import CompilePool
from moe_gemm.tuning.tuner import TuneShape

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
INPUT_SCALE = 0.1  # randn * 0.1: never zeros, K=7168 sums far from bf16 overflow
REL_TOL = 1e-3  # of max|ref|: the kernel tests' absolute slack (fp32 outputs need it)


@contextlib.contextmanager
def _fp32_exact():
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)


class ShapeRunner:
    """Implements tuner.Runner on a CUDA device for one TuneShape."""

    backend = "cute"  # what candidates run on (tests drive the search on the torch backend)

    def __init__(self, shape: TuneShape, device: torch.device, pool: CompilePool, *,
                 seed: int = 0, l2_bytes: int = 50 << 20, mem_fraction: float = 0.4,
                 rest_ms: float = timing.REST_MS,
                 sample_ms: float = timing.TARGET_MS, timing_mode: str = "graph") -> None:
        if timing_mode not in timing.TIMINGS:
            raise ValueError(f"timing_mode must be one of {timing.TIMINGS}; got {timing_mode!r}")
        self.shape = shape
        self.rest_ms = rest_ms
        self.sample_ms = sample_ms
        self.timing_mode = timing_mode
        self.device = device
        self.pool = pool
        self.nsm = sm_count(device)
        self.ab = DTYPES[shape.dtype]
        self.d = DTYPES[shape.out_dtype]
        self.b_major = "k" if shape.layout == "ENK" else "n"
        self._timed: dict[str, timing.Timed] = {}
        gen = torch.Generator(device=device)
        # (torch takes -2^63 .. 2^64 - 1, reading a negative seed modulo 2^64: any int of
        # `moe-gemm tune --seed` is read so, where 2^70 was a ValueError once the run began)
        gen.manual_seed(seed % 2**64)
        first = self._new_set(gen)
        set_bytes = sum(t.numel() * t.element_size() for t in _tensors(first))
        free, _ = torch.cuda.mem_get_info(device)
        cap = max(1, int(free * mem_fraction) // max(1, set_bytes))
        n = min(cap, timing.sets_needed(set_bytes, l2_bytes))
        self.sets = [first] + [self._new_set(gen) for _ in range(n - 1)]
        self.outs = [self._new_out() for _ in self.sets]
        self.ref, self.base_err, self.ref_scale = self._reference()

    # -- inputs -----------------------------------------------------------------------------

    def _weights(self, gen: torch.Generator) -> torch.Tensor:
        s = self.shape
        if s.layout == "ENK":  # (E, N, K) storage, passed as the (E, K, N) view
            w = torch.randn(s.E, s.N, s.K, device=self.device, dtype=self.ab, generator=gen)
            return w.mul_(INPUT_SCALE).transpose(1, 2)
        w = torch.randn(s.E, s.K, s.N, device=self.device, dtype=self.ab, generator=gen)
        return w.mul_(INPUT_SCALE)

    def _new_set(self, gen: torch.Generator) -> tuple:
        s = self.shape
        w = self._weights(gen)
        if s.form == "batched":
            x = torch.randn(s.E, s.rows // s.E, s.K, device=self.device, dtype=self.ab,
                            generator=gen).mul_(INPUT_SCALE)
            return (x, w)
        x = torch.randn(s.rows, s.K, device=self.device, dtype=self.ab,
                        generator=gen).mul_(INPUT_SCALE)
        ends = torch.tensor(s.counts, dtype=torch.int64).cumsum(0)
        offs = ends.to(torch.int32).to(self.device)
        if s.form == "varlen":
            return (x, w, offs)
        starts = [0, *ends.tolist()[:-1]]
        a = [x[b:e] for b, e in zip(starts, ends.tolist())]
        return (a, [w[i] for i in range(s.E)])

    def _new_out(self):
        s = self.shape
        if s.form == "varlen":
            return torch.empty(s.rows, s.N, device=self.device, dtype=self.d)
        if s.form == "batched":
            return torch.empty(s.E, s.rows // s.E, s.N, device=self.device, dtype=self.d)
        return [torch.empty(c, s.N, device=self.device, dtype=self.d) for c in s.counts]

    def _call(self, cfg: GemmConfig, i: int, out=None) -> object:
        args, out = self.sets[i], self.outs[i] if out is None else out
        if self.shape.form == "varlen":
            return grouped_mm(args[0], args[1], args[2], out=out, config=cfg)
        if self.shape.form == "batched":
            return grouped_mm(args[0], args[1], out=out, config=cfg)
        return grouped_gemm(args[0], args[1], out=out, config=cfg)

    # -- the reference and the check ---------------------------------------------------------

    def _pairs(self) -> list[tuple[torch.Tensor, torch.Tensor, slice | int]]:
        """(A_e, B_e, where its rows go in the flattened output) per non-empty problem."""
        s, args = self.shape, self.sets[0]
        if s.form == "batched":
            return [(args[0][g], args[1][g], g) for g in range(s.E)]
        if s.form == "general":
            return [(a, b, i) for i, (a, b) in enumerate(zip(args[0], args[1])) if a.shape[0]]
        x, w = args[0], args[1]
        pairs, start = [], 0
        for e, c in enumerate(s.counts):
            if c:
                pairs.append((x[start:start + c], w[e], slice(start, start + c)))
            start += c
        return pairs

    def _reference(self) -> tuple[list[torch.Tensor], float, float]:
        """The float32 reference per problem, torch's own error against it, and max|ref|."""
        refs, errs, scales = [], [], []
        with _fp32_exact():
            for a, b, _ in self._pairs():
                ref = a.float() @ b.float()
                errs.append((torch.mm(a, b).float() - ref).abs().max())
                scales.append(ref.abs().max())
                refs.append(ref)
        if not refs:
            return refs, 0.0, 0.0
        return refs, torch.stack(errs).max().item(), torch.stack(scales).max().item()

    def _pieces(self, out) -> list[torch.Tensor]:
        s = self.shape
        if s.form == "general":
            return [o for o, c in zip(out, s.counts) if c]
        if s.form == "batched":
            return [out[g] for g in range(s.E)]
        pieces, start = [], 0
        for c in s.counts:
            if c:
                pieces.append(out[start:start + c])
            start += c
        return pieces

    def check(self, cfg: GemmConfig) -> str | None:
        """Run once into a NaN-poisoned output and apply the 2x rule; the error or None."""
        out = self._new_out()
        for o in (out if isinstance(out, list) else [out]):
            o.fill_(float("nan"))
        try:
            self._call(cfg, 0, out)
            torch.cuda.synchronize(self.device)
        except Exception as exc:  # noqa: BLE001 - reported as this candidate's error
            return f"run failed: {type(exc).__name__}: {exc}"[:400]
        bound = 2 * self.base_err + REL_TOL * self.ref_scale
        errs = [(piece.float() - ref).abs().max() for piece, ref in zip(self._pieces(out),
                                                                       self.ref)]
        e = torch.stack(errs).max().item() if errs else 0.0
        if not e <= bound:  # NaN (an unwritten element) fails here too
            return (f"wrong result: max|out - ref| = {e:.3g} > {bound:.3g} (2 x torch's "
                    f"{self.base_err:.3g} + {REL_TOL:g} x max|ref|)")
        return None

    # -- tuner.Runner -------------------------------------------------------------------------

    def _choice(self, fields: dict) -> heuristics.KernelChoice:
        return choice_for(self.shape, space.config_of(fields), self.nsm)

    def rules_fields(self) -> dict:
        return rules_fields(self.shape, self.nsm)

    def identity(self, fields: dict) -> object:
        try:
            return space.kernel_identity(self._choice(fields), self.d.itemsize)
        except ValueError as exc:  # refused by the rules: unique, fails in prepare
            return ("refused", str(exc), space.name_of(fields))

    def compile_key(self, fields: dict):
        return compile_key_for(self.shape, fields, self.nsm)

    def submit(self, candidates: list[dict]) -> None:
        keys = []
        for f in candidates:
            with contextlib.suppress(ValueError):
                keys.append(self.compile_key(f))
        self.pool.submit(keys)

    def prepare(self, fields: dict) -> str | None:
        try:
            key = self.compile_key(fields)
        except ValueError as exc:
            return f"refused: {exc}"
        err = self.pool.wait([key])[key]
        if err is not None:
            return f"compile: {err}"
        return self.check(self._config(fields))

    def _config(self, fields: dict) -> GemmConfig:
        return space.config_of(fields, backend=self.backend)

    def _fns(self, cfg: GemmConfig) -> list[Callable[[], object]]:
        return [lambda i=i: self._call(cfg, i) for i in range(len(self.sets))]

    def measure(self, candidates: list[dict], rounds: int) -> dict[str, list[float]]:
        timed = []
        for f in candidates:
            name = space.name_of(f)
            t = self._timed.get(name)
            if t is None:
                fns = self._fns(self._config(f))
                est = timing.estimate_ms(fns, self.device)
                calls = timing.calls_per_graph(est, len(fns), self.sample_ms)
                make = timing.capture_eager if self.timing_mode == "eager" else timing.capture
                t = self._timed[name] = make(name, fns, calls, self.device)
            timed.append(t)
        before = {t.name: len(t.samples) for t in timed}
        timing.sample_rounds(timed, rounds, self.device, self.rest_ms)
        return {t.name: t.samples[before[t.name]:] for t in timed}

    def release(self, names: list[str]) -> None:
        for n in names:
            self._timed.pop(n, None)

    def close(self) -> None:
        self._timed.clear()
        self.sets = self.outs = self.ref = []  # type: ignore[assignment]
        gc.collect()
        torch.cuda.empty_cache()


def choice_for(shape: TuneShape, cfg: GemmConfig, nsm: int) -> heuristics.KernelChoice:
    """What the rules make of `cfg` for `shape` (no tables: the config pins the choice)."""
    s, isz = shape, DTYPES[shape.out_dtype].itemsize
    if s.form == "varlen":
        return heuristics.choose_varlen(cfg, s.rows, s.E, s.N, s.K, nsm, isz, swap_ok=True)
    if s.form == "batched":
        return heuristics.choose_batched(cfg, s.E, s.rows // s.E, s.N, s.K, nsm, isz)
    sizes = tuple((c, s.N, s.K) for c in s.counts)
    return heuristics.choose_general(cfg, sizes, nsm, isz)


def rules_fields(shape: TuneShape, nsm: int) -> dict:
    """The explicit fields of the rules' choice for `shape`."""
    return space.fields_of(choice_for(shape, GemmConfig(backend="cute"), nsm), shape.form)


def compile_key_for(shape: TuneShape, fields: dict, nsm: int):
    """The CompileKey a candidate runs (ValueError when the rules refuse it)."""
    from moe_gemm.ops.launch_kernel import _compile_key

    return _compile_key(shape.form, DTYPES[shape.dtype], DTYPES[shape.out_dtype],
                        "k" if shape.layout == "ENK" else "n",
                        choice_for(shape, space.config_of(fields), nsm), False)


def stage1_keys(shape: TuneShape, nsm: int) -> list:
    """CompileKeys of the rules' choice and every stage-1 candidate of `shape`."""
    keys = []
    isz = DTYPES[shape.out_dtype].itemsize
    for fields in [rules_fields(shape, nsm), *space.stage1(shape.form, isz)]:
        with contextlib.suppress(ValueError):
            keys.append(compile_key_for(shape, fields, nsm))
    return list(dict.fromkeys(keys))


def _tensors(item) -> list[torch.Tensor]:
    out = []
    for v in item:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(_tensors(v))
    return out
