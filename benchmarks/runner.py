"""Running one benchmark case: every implementation checked, then timed interleaved.

`run_shape` builds a case's input sets (rotated when one set would fit in L2) and its float32
reference, then for each implementation `prepare_impl` builds it, makes its first call,
checks the result (ours into a NaN-poisoned `out`) and warms it up, and `time_interleaved`
samples every implementation that passed once per round. Nothing here raises: a failing
implementation becomes an "error" row with its message, one that cannot take the case an
"n/a" row with the reason, and a sticky CUDA error marks the rest "not run".
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import platform
import sys
import time
import warnings
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.clock import B2B_TARGET_MS, Clock, median, quantile
from benchmarks.report import write_json
from benchmarks.scoring import flops, shape_bytes
from benchmarks.suite import (
    TOLERANCE,
    Impl,
    Inputs,
    NotApplicable,
    Prepared,
    ShapeSpec,
    implementations,
    input_bytes,
    input_sets_needed,
    make_inputs,
    reference,
    rel_err,
    short_error,
)
from moe_gemm.tuning import space
from moe_gemm.tuning.table_io import json_line, write_text_atomic

# Fault injection for testing --isolate: "SHAPE/IMPL" makes that implementation abort the
# process the moment it starts ("SHAPE/IMPL@timing": at its first timed sample), like a crash
# that takes the CUDA context with it.
ABORT_ENV = "MOE_GEMM_BENCH_ABORT_IN"
# Substrings of errors after which the CUDA context cannot be trusted (sticky errors).
_STICKY = ("illegal memory access", "illegal instruction", "misaligned address",
           "unspecified launch failure", "device-side assert", "an illegal", "launch timeout")


def device_info(device: torch.device) -> tuple[str, dict[str, Any], int]:
    """(device name, versions and properties for a results file, L2 bytes; 0 off the GPU)."""
    from importlib.metadata import PackageNotFoundError, version

    from moe_gemm import __version__

    info: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(),
                            "moe_gemm": __version__}
    try:
        info["quack_kernels"] = version("quack-kernels")
    except PackageNotFoundError:
        info["quack_kernels"] = None
    if device.type != "cuda":
        return f"cpu ({platform.machine()})", info, 0
    props = torch.cuda.get_device_properties(device)
    l2 = int(getattr(props, "L2_cache_size", 0) or 0) or 50 * 2**20
    info.update(name=props.name, capability=f"sm_{props.major}{props.minor}",
                sms=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1),
                l2_mib=round(l2 / 2**20, 1), cuda=torch.version.cuda)
    return props.name, info, l2


def names_problem(text: str, known: Sequence[str] | None, option: str = "--models",
                  sep: str = ",") -> str | None:
    """Why a `sep`-separated list of names is unusable (a name not in `known`, an empty one
    among them), or None. Names are read stripped (`split_names`) and a duplicate is kept.
    With `known` None any name goes, but an empty one (a stray or trailing separator) is still
    refused: dropping it silently would let `--x "a,"` stand for a list it does not spell."""
    names = split_names(text, sep)
    if known is None:
        if "" in names:
            return f"{option}: an empty entry in {text!r} (a stray {sep!r}?)"
        return None
    unknown = [n for n in names if n not in known]
    if unknown:
        return (f"{option}: unknown {', '.join(map(repr, unknown))}; expected some of "
                f"{', '.join(known)}")
    return None


def split_names(text: str, sep: str = ",") -> list[str]:
    """The stripped items of a `sep`-separated option value, in order, empty ones and
    duplicates kept (the checks above refuse an empty one; a duplicate is the caller's)."""
    return [n.strip() for n in text.split(sep)]


def given_options(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> set[str]:
    """The dests of the options argv sets explicitly (a preset such as --smoke fills only the
    others: an explicit --hidden 128 beside it is what the user asked for)."""
    actions = parser._actions  # noqa: SLF001 - argparse has no public walk of its actions
    kept = [(a.default, a.required) for a in actions]
    try:
        for a in actions:
            a.default, a.required = argparse.SUPPRESS, False
        seen, _ = parser.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    finally:
        for a, (default, required) in zip(actions, kept):
            a.default, a.required = default, required
    return set(vars(seen))


def counts_problem(text: str, option: str = "--tokens") -> str | None:
    """Why a comma-separated list of positive integers is not one, or None."""
    # (isdecimal, not isdigit: '²' is a digit that int() refuses, a ValueError traceback)
    if not all(t.isdecimal() and int(t) > 0 for t in split_names(text)):
        return f"{option} takes comma-separated positive integers; got {text!r}"
    return None


def zoo_tokens_problem(text: str, option: str = "--tokens") -> str | None:
    """counts_problem for a zoo --tokens, which also takes 'all' (moe_gemm.tuning.zoo's
    parse_tokens, which itself drops an empty item: `--tokens 2048,` is refused here)."""
    return None if text.strip().lower() == "all" else counts_problem(text, option)


def number_problem(value: float, option: str, zero: bool = False) -> str | None:
    """Why an option's number is not a finite one > 0 (>= 0 with `zero`), or None. (A plain
    `value <= 0` test lets nan and inf through: a run that then times nothing, or never
    stops.)"""
    if math.isfinite(value) and (value >= 0 if zero else value > 0):
        return None
    what = "a non-negative" if zero else "a positive"
    what += " integer" if isinstance(value, int) else " finite number"
    return f"{option} must be {what}; got {value}"


def bench_device(requested: str | None, smoke: bool, needs: str) -> torch.device:
    """The device a benchmark runs on: `requested` ("cuda", "cuda:1", "cpu"; None or "auto":
    the GPU if there is one), made current when it is a GPU. Raises ValueError with the line to
    print for a bad name, a missing GPU, or a CPU without --smoke (`needs`: what the full run
    needs the GPU for)."""
    name = requested if requested not in (None, "auto") else (
        "cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ValueError(f"bad --device {name!r}: {exc}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: no CUDA GPU is visible here")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        elif device.index >= torch.cuda.device_count():
            # (torch.cuda.set_device raises "invalid device ordinal": a traceback)
            raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} "
                             "GPU(s)")
        torch.cuda.set_device(device)
    elif not smoke:
        raise ValueError(f"{needs} needs a CUDA GPU; use --smoke on the CPU")
    return device


def unknown_skip(skip: Sequence[str] | None, known: Sequence[str]) -> str | None:
    """The error line for --skip-impl names that are none of `known`, or None when all are.

    Rows are matched by exact name, so a misspelt name skipped nothing: the run then timed
    (or crashed in) the implementation it was asked to leave out, and said nothing.
    """
    bad = [name for name in dict.fromkeys(skip or ()) if name not in known]
    if not bad:
        return None
    return (f"--skip-impl: no implementation named {', '.join(map(repr, bad))}; the names "
            f"are {', '.join(map(repr, dict.fromkeys(known)))}")


def _context_alive(device: torch.device) -> bool:
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
        return (torch.ones(1, device=device) + 1).item() == 2.0
    except Exception:
        return False


@dataclass
class Run:
    """Settings and accumulated results of one bench process."""

    device: torch.device
    clock: Clock
    reps: int
    seed: int
    smoke: bool
    variants: bool
    skip: frozenset[str]
    doc: dict[str, Any]
    out_path: Path | None
    l2_bytes: int = 0
    progress: bool = True

    def save(self) -> None:
        if self.out_path is not None:
            write_json(self.out_path, self.doc, compact=True)

    def mark(self, shape: str | None, impl: str | None = None) -> None:
        """Record what is running in a sidecar file (cheap enough to call per sample), so a
        parent process can tell which implementation a hard crash happened in."""
        if self.out_path is None:
            return
        side = progress_path(self.out_path)
        if shape is None:
            side.unlink(missing_ok=True)
            return
        write_text_atomic(side, json_line({"shape": shape, "impl": impl}))

    @property
    def poisoned(self) -> dict[str, Any] | None:
        return self.doc.get("poisoned_by")

    def log(self, msg: str) -> None:
        if self.progress:
            print(msg, file=sys.stderr, flush=True)


def progress_path(out_path: Path) -> Path:
    return out_path.with_name(out_path.name + ".inprogress")


def _shape_seed(seed: int, name: str, index: int) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode()) * 101 + index) % (2**63)


def input_sets(run: Run, spec: ShapeSpec) -> list[Inputs]:
    """A shape's input sets: the first, then as many more as rotating through them needs to
    find no operand left in L2 by the previous launch (suite.input_sets_needed)."""
    counts = spec.counts(run.seed)
    sets = [make_inputs(spec, counts, run.device, _shape_seed(run.seed, spec.name, 0))]
    nsets = input_sets_needed(input_bytes(sets[0]), run.l2_bytes, 2 if run.smoke else 64)
    sets += [make_inputs(spec, counts, run.device, _shape_seed(run.seed, spec.name, i))
             for i in range(1, nsets)]
    return sets


def after_error(run: Run, shape: str, impl: str, exc: BaseException) -> None:
    if run.device.type != "cuda":
        return
    if not _context_alive(run.device):
        run.doc["poisoned_by"] = {"shape": shape, "impl": impl, "error": short_error(exc)}
    elif any(s in str(exc).lower() for s in _STICKY):
        # The error text says sticky but a probe still works: note it, keep going.
        run.doc.setdefault("sticky_errors", []).append({"shape": shape, "impl": impl})
    else:
        gc.collect()
        torch.cuda.empty_cache()  # after an OOM or a half-built implementation


def _poison_note(run: Run) -> str:
    p = run.poisoned or {}
    return (f"not run: CUDA context poisoned by {p.get('impl')} on {p.get('shape')} "
            "(use --isolate)")


def our_failures(doc: dict[str, Any]) -> list[str]:
    """'shape: impl: error' for each of our rows (not a peer's) that failed: a wrong result,
    an exception or a process that died. A benchmark's exit status says whether there are
    any (a peer that cannot run here is not a failure of ours)."""
    return [f"{r.get('shape', r.get('case'))}: {r['impl']}: {r.get('error')}"
            for r in doc.get("results", []) if not r.get("peer") and r.get("status") == "error"]


def _not_run_row(spec: ShapeSpec, impl: Impl, why: str) -> dict[str, Any]:
    return {"shape": spec.name, "impl": impl.name, "peer": impl.peer, "default": impl.default,
            "status": "error", "ms": None, "error": why, "not_run": True}


def _last_launch() -> object | None:
    """What our host wrapper last launched on this thread, if it was ever loaded."""
    host = sys.modules.get("moe_gemm.ops.launch_info")  # loaded only once cute has run
    fn = getattr(host, "last_launch", None)
    try:
        return fn() if callable(fn) else None
    except Exception:
        return None


def _launch_fields(before: object | None, after: object | None) -> dict[str, Any]:
    """backend (and the kernel choice the heuristics made) for one of our calls."""
    if after is None or after is before:
        return {"backend": "torch"}
    fields: dict[str, Any] = {"backend": "cute"}
    choice = getattr(after, "choice", None)
    if dataclasses.is_dataclass(choice) and not isinstance(choice, type):
        fields["kernel"] = dataclasses.asdict(choice)
    elif choice is not None:
        fields["kernel"] = repr(choice)
    if isinstance(getattr(after, "num_ctas", None), int):
        fields["num_ctas"] = after.num_ctas  # type: ignore[attr-defined]
    return fields


@dataclass(eq=False)  # identity semantics: `t in active` must not compare tensors
class _Timing:
    """An implementation that passed its check, waiting for its interleaved samples."""

    impl: Impl
    row: dict[str, Any]
    prepared: list[Prepared]
    calls: int
    backlog_ms: float
    single: list[float] = field(default_factory=list)
    b2b: list[float] = field(default_factory=list)
    repeat: list[float] = field(default_factory=list)
    states: list[tuple[float | None, float | None]] = field(default_factory=list)

    @property
    def fns(self) -> list[Callable[[], object]]:
        return [p.run for p in self.prepared]


def _describe(prepared: Prepared) -> str | None:
    """The implementation's own account of what it chose; never raises (it is a note)."""
    if prepared.describe is None:
        return None
    try:
        return prepared.describe()
    except Exception:
        return None


def prepare_impl(
    run: Run, spec: ShapeSpec, impl: Impl, sets: list[Inputs], ref: torch.Tensor
) -> tuple[dict[str, Any], _Timing | None]:
    """Build, first-call, check and warm up one implementation; never raises.

    Returns its row ("pending" when it passed and waits for timing, else "n/a" or "error")
    and the timing state for the pending ones.
    """
    row: dict[str, Any] = {"shape": spec.name, "impl": impl.name, "peer": impl.peer,
                           "default": impl.default, "status": "pending", "ms": None,
                           "dtype": impl.dtype or spec.dtype}
    if impl.scale:
        row["scale"] = impl.scale
    if impl.ceiling:
        row["ceiling"] = True
    if impl.notes:
        row["notes"] = impl.notes
    if impl.config is not None:
        row["config"] = impl.config.as_dict()
    if run.poisoned:
        return _not_run_row(spec, impl, _poison_note(run)), None
    run.mark(spec.name, impl.name)
    if os.environ.get(ABORT_ENV) == f"{spec.name}/{impl.name}":
        os.abort()  # fault injection: a hard crash, as an illegal address can end a process
    clock = run.clock
    try:
        prepared = [impl.build(spec, s, run.device) for s in sets]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            before = _last_launch()
            t0 = time.perf_counter()
            prepared[0].run()
            clock.sync()
            row["first_call_s"] = time.perf_counter() - t0  # includes any JIT compile
            if not impl.peer:
                row.update(_launch_fields(before, _last_launch()))
            out = prepared[0].check()
            clock.sync()
            chosen = _describe(prepared[0])
            if chosen:
                row["chosen"] = chosen
        if caught:
            row["warnings"] = sorted({str(w.message)[:300] for w in caught})[:5]
        own = prepared[0]
        err = own.error(out) if own.error is not None else rel_err(out, ref)
        del out
        row["rel_err"] = err
        tol = own.tolerance if own.tolerance is not None else TOLERANCE[spec.dtype]
        if not err <= tol:
            row.update(status="error", error=f"wrong result: relative error {err:.3g} > {tol}")
            return row, None
        fns = [p.run for p in prepared]
        for i in range(max(3, len(fns))):
            fns[i % len(fns)]()
        host = clock.host_ms(fns, 5)
        est = max(median(clock.single(fns, 3)), 1e-4)
        calls = 1 if run.smoke else max(1, min(1000, math.ceil(B2B_TARGET_MS / est)))
        row["host_us"] = median(host) * 1e3
        row["est_ms"] = est
        return row, _Timing(impl, row, prepared, calls, median(host) * calls * 1.25 + 0.1)
    except NotApplicable as exc:
        row.update(status="n/a", reason=str(exc))
        return row, None
    except Exception as exc:  # one failing implementation must never abort the run
        row.update(status="error", error=short_error(exc))
        after_error(run, spec.name, impl.name, exc)
        return row, None


def state_fields(states: Sequence[tuple[float | None, float | None]]) -> dict[str, float]:
    """Median SM clock (MHz) and board power (W) over an implementation's timed samples,
    where NVML read them (nothing where it did not)."""
    out: dict[str, float] = {}
    mhz = [m for m, _ in states if m is not None]
    watts = [w for _, w in states if w is not None]
    if mhz:
        out["sm_mhz"] = median(mhz)
    if watts:
        out["power_w"] = median(watts)
    return out


def time_interleaved(run: Run, spec: ShapeSpec, timings: list[_Timing]) -> None:
    """Sample every pending implementation once per round, `reps` rounds.

    Interleaving puts clock and power drift (seen: 6% between two timings of the same kernel
    10 s apart on an H200 running large GEMMs) on every implementation alike instead of on
    whichever ran last. Each round starts one implementation later, and the default is sampled
    again at the end of each round (`ms_repeat`): its spread against `ms` is the noise floor.
    """
    clock, active = run.clock, list(timings)
    default = next((t for t in timings if t.impl.default), None)
    for r in range(run.reps):
        if not active or run.poisoned:
            break
        k = r % len(active)
        order = active[k:] + active[:k]
        if default is not None and default in active:
            order.append(default)
        seen: set[int] = set()
        for t in order:
            if t not in active:
                continue
            run.mark(spec.name, t.impl.name)
            if os.environ.get(ABORT_ENV) == f"{spec.name}/{t.impl.name}@timing":
                os.abort()
            try:
                fns = t.fns
                if id(t) in seen:
                    t.repeat += clock.back_to_back(fns, 1, t.calls, t.backlog_ms)
                    continue
                seen.add(id(t))
                t.single += clock.single([fns[r % len(fns)]], 1)
                t.b2b += clock.back_to_back(fns, 1, t.calls, t.backlog_ms)
                t.states += clock.last_states
            except Exception as exc:
                t.row.update(status="error", error=short_error(exc))
                active.remove(t)
                after_error(run, spec.name, t.impl.name, exc)
                if run.poisoned:
                    break
    for t in timings:
        if t.row["status"] != "pending":
            continue
        if run.poisoned or len(t.b2b) < run.reps:
            t.row.update(status="error", error=_poison_note(run), not_run=True)
            continue
        t.row.update(
            status="ok", ms=median(t.b2b), ms_p10=quantile(t.b2b, 0.1),
            ms_p90=quantile(t.b2b, 0.9), ms_single=median(t.single),
            ms_single_p10=quantile(t.single, 0.1), ms_single_p90=quantile(t.single, 0.9),
            calls_per_sample=t.calls, reps=run.reps, input_sets=len(t.prepared),
            # each round's sample, in round order: the paired ratios of zoo_report read them
            ms_rounds=[round(x, 6) for x in t.b2b],
        )
        if t.repeat:
            t.row["ms_repeat"] = median(t.repeat)
        t.row.update(state_fields(t.states))


def run_shape(run: Run, spec: ShapeSpec, impls: Sequence[Impl] | None = None) -> None:
    """Every implementation (default: the suite's for `spec`) on one shape; rows appended to
    run.doc['results']."""
    sizes = spec.sizes(run.seed)
    info = spec.describe(run.seed)
    info.update(shape_bytes(sizes, spec.dtype), flops=flops(sizes))
    run.doc["shapes"][spec.name] = info
    if impls is None:
        impls = implementations(spec, run.variants)
    impls = [i for i in impls if i.name not in run.skip]
    results = run.doc["results"]
    if run.poisoned:
        results.extend(_not_run_row(spec, i, _poison_note(run)) for i in impls)
        run.save()
        return
    t_shape = time.perf_counter()
    try:
        run.mark(spec.name, "input generation")
        sets = input_sets(run, spec)
        info.update(input_sets=len(sets), set_bytes=input_bytes(sets[0]))
        ref = reference(sets[0])
    except Exception as exc:
        results.extend(_not_run_row(spec, i, f"input generation failed: {short_error(exc)}")
                       for i in impls)
        after_error(run, spec.name, "input generation", exc)
        run.save()
        return
    timings: list[_Timing] = []
    for impl in impls:
        row, timing = prepare_impl(run, spec, impl, sets, ref)
        results.append(row)
        run.save()
        if timing is not None:
            timings.append(timing)
        else:
            why = row.get("error") or row.get("reason") or ""
            run.log(f"[bench] {spec.name:13s} {impl.name:37s} {row['status']}: {why[:100]}")
    del ref
    time_interleaved(run, spec, timings)
    for t in timings:
        status = f"{t.row['ms'] * 1e3:.1f} us" if t.row["status"] == "ok" else (
            f"{t.row['status']}: {str(t.row.get('error'))[:100]}")
        run.log(f"[bench] {spec.name:13s} {t.impl.name:37s} {status}")
    info["wall_s"] = time.perf_counter() - t_shape
    del sets, timings
    gc.collect()
    if run.device.type == "cuda" and not run.poisoned:
        torch.cuda.empty_cache()
    run.mark(None)
    run.save()


# ---------------------------------------------------------------------------------------------
# The A/B scripts on zoo cases (benchmarks.same_config, benchmarks.pick_ab): one GPU, a Run.

ZOO_TIMING = ("ms: back-to-back median of interleaved rounds behind a sleep backlog (the zoo's "
              "harness)")


def add_ab_options(p, reps: int) -> None:
    """--reps, --seed, --device and --out, as the A/B scripts take them."""
    p.add_argument("--reps", type=int, default=reps, help=f"interleaved rounds (default {reps})")
    p.add_argument("--seed", type=int, default=1234, help="routing and data seed")
    p.add_argument("--device", default="cuda", help="cuda or cuda:N")
    p.add_argument("--out", help="write the rows as JSON here")


def config_fields(text: str, name: Callable[[str], str] = str, **parse: Any) -> list[dict]:
    """`--configs`: ';'-separated config names (each through `name` first) -> their fields,
    each buildable by us; ValueError naming a bad one (an empty name too, as in 'a;')."""
    if why := names_problem(text, None, "--configs", ";"):
        raise ValueError(why)
    fields = [space.parse_name(name(n), **parse) for n in split_names(text, ";")]
    for f in fields:
        space.config_of(f)
    return fields


def ab_start(args, argv: list[str] | None, prog: str, needs: str, parse: Callable[[], Any]
             ) -> tuple[Any, Run] | None:
    """An A/B script's start: `parse()` (its options; a ValueError is printed as `prog: ...`)
    and then ab_run's Run. None after printing why it cannot run (the script exits 2)."""
    try:
        parsed = parse()
    except ValueError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return None
    run = ab_run(args, argv, prog, needs)
    if isinstance(run, str):
        print(run, file=sys.stderr)
        return None
    return parsed, run


def ab_run(args, argv: list[str] | None, prog: str, needs: str, **doc_fields: Any
           ) -> Run | str:
    """The Run of an A/B script on a CUDA GPU (args: add_ab_options'), or the line to print
    when it cannot run (`needs`: what the GPU is needed for). doc_fields: more of the JSON's
    top-level fields ("settings" is added to)."""
    if args.reps < 1:
        return f"{prog}: --reps must be at least 1"
    if not torch.cuda.is_available() or not str(args.device).startswith("cuda"):
        return f"{prog}: needs a CUDA GPU ({needs})"
    try:  # (a plain "cuda" becomes the current GPU with its index, and is made current)
        device = bench_device(args.device, False, prog)
    except ValueError as exc:
        return f"{prog}: {exc}"
    name, info, l2 = device_info(device)
    settings = {"reps": args.reps, "seed": args.seed, "timing": ZOO_TIMING,
                **doc_fields.pop("settings", {})}
    doc: dict[str, Any] = {
        "device": name, "date": time.strftime("%Y-%m-%d", time.gmtime()), "device_info": info,
        "argv": list(sys.argv[1:] if argv is None else argv), **doc_fields,
        "settings": settings, "shapes": {}, "results": []}
    return Run(device=device, clock=Clock(device), reps=args.reps, seed=args.seed,
               smoke=False, variants=False, skip=frozenset(), doc=doc,
               out_path=Path(args.out) if args.out else None, l2_bytes=l2)
