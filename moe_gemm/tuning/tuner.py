"""The search: which of our configs runs a shape fastest, never trading correctness for it.

`tune_shape` drives a runner (moe_gemm.tuning.runner.ShapeRunner on a GPU; tests use a fake)
through the stages of moe_gemm.tuning.space:

1. the rules' own choice and every stage-1 config (schedule x tile x cluster), deduplicated
   by the kernel they run; each is compiled (in the pool) and its output checked against the
   float32 reference before it is timed: a config that fails either is dropped and reported
   (a failed check is a kernel bug: tuning must never change results beyond fp32
   accumulation order);
2. timing by successive halving: two interleaved rounds for all, then more rounds for those
   within PRUNE of the best;
3. one-field variations (stages, raster panel, tail split, whole-tile epilogue, visitor,
   K-sort) of the best TOP configs, and a config combining every variation that won;
4. a final set of rounds for the leaders and the rules' choice, all of them in the same
   rounds: the lowest median of those rounds wins (earlier samples were taken among other
   candidates, at other moments, and only rank within their stage).

Every candidate's median is kept as a sample (the lookup's neighbours step votes with them).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from moe_gemm.ops.tuned import Key, rows_bucket
from moe_gemm.tuning import space

PRUNE = 1.25  # after the first rounds, keep candidates within this factor of the best
KEEP = 8  # ... but at most this many
TOP = 3  # stage-2 parents
WIN = 0.99  # a variation "wins" when its median is below this fraction of its parent's
FINAL_ROUNDS = 10  # the final stage's rounds (a round of ~6 leaders is ~20-60 ms of GPU time)


@dataclass(frozen=True)
class TuneShape:
    """One shape to tune. varlen: E experts, `rows` = T routed rows split by `counts`;
    batched: E problems of `rows` // E rows each; general: E problems with `counts` rows."""

    form: str
    E: int
    N: int
    K: int
    rows: int
    counts: tuple[int, ...] = ()
    dtype: str = "bfloat16"
    out_dtype: str = "bfloat16"
    layout: str = "ENK"  # weights as (E, N, K) K-contiguous, or "EKN"
    label: str = ""

    def __post_init__(self) -> None:
        if self.form not in ("varlen", "batched", "general"):
            raise ValueError(f"form must be varlen, batched or general; got {self.form!r}")
        if min(self.E, self.N, self.K) <= 0 or self.rows <= 0:
            raise ValueError(f"E, N, K and rows must be positive; got {self}")
        if self.layout not in ("ENK", "EKN"):
            raise ValueError(f"layout must be 'ENK' or 'EKN'; got {self.layout!r}")
        if self.form == "batched" and self.rows % self.E:
            raise ValueError(f"batched rows ({self.rows}) must be a multiple of E ({self.E})")
        if self.form != "batched" and (len(self.counts) != self.E
                                       or sum(self.counts) != self.rows):
            raise ValueError(f"{self.form} needs E counts summing to rows")

    @property
    def problems(self) -> int:
        """E for varlen and batched; the non-empty problems for general."""
        if self.form == "general":
            return sum(1 for c in self.counts if c > 0)
        return self.E

    def key(self) -> Key:
        return Key(self.form, self.dtype, self.out_dtype, self.problems, self.N, self.K,
                   rows_bucket(self.rows / max(1, self.problems)))

    def describe(self) -> str:
        return (self.label or f"{self.form} E={self.E} N={self.N} K={self.K}") + \
            f" rows={self.rows}"


class Runner(Protocol):
    """What tune_shape needs from the device side (see runner.ShapeRunner)."""

    def rules_fields(self) -> dict: ...

    def identity(self, fields: dict) -> Any: ...

    def submit(self, candidates: list[dict]) -> None: ...

    def prepare(self, fields: dict) -> str | None: ...

    def measure(self, candidates: list[dict], rounds: int) -> dict[str, list[float]]: ...

    def release(self, names: list[str]) -> None: ...


@dataclass
class Outcome:
    """One candidate's fate on one shape."""

    name: str
    fields: dict
    origin: str  # "rules" | "stage1" | "stage2" | "combined"
    status: str = "pending"  # "ok" | "error" | "duplicate"
    error: str | None = None
    samples: list[float] = field(default_factory=list)
    final: list[float] = field(default_factory=list)  # its samples of the final rounds

    @property
    def ms(self) -> float:
        """The median of every sample (what each stage ranks by)."""
        return statistics.median(self.samples) if self.samples else math.inf

    @property
    def decisive_ms(self) -> float:
        """The median of the final rounds when it took part in them, else of every sample."""
        return statistics.median(self.final) if self.final else self.ms


@dataclass
class ShapeResult:
    shape: TuneShape
    outcomes: list[Outcome]
    winner: Outcome | None
    rules: Outcome | None
    seconds: float
    stopped: str | None = None  # why the search stopped early, if it did
    rerank: dict | None = None  # a re-rank's record (moe_gemm.tuning.rerank), kept in the entry

    def entry(self) -> dict | None:
        """The table entry (moe_gemm.ops.tuned format) or None when nothing ran."""
        if self.winner is None:
            return None
        k = self.shape.key()
        config = {f: v for f, v in self.winner.fields.items() if v is not None}
        if not config.get("swap_ab") and any(o.fields.get("swap_ab") and o.samples
                                             for o in self.outcomes):
            # The swapped kernel was timed here and lost: say so, so the lookup keeps this
            # pick where the swapped tiles' window would take the shape (heuristics).
            config["swap_ab"] = False
        entry = {"form": k.form, "dtype": k.dtype, "out_dtype": k.out_dtype, "E": k.E,
                 "N": k.N, "K": k.K, "bucket": k.bucket, "rows": self.shape.rows,
                 "config": config,
                 "us": round(self.winner.decisive_ms * 1e3, 2), "name": self.winner.name,
                 "layout": self.shape.layout,
                 "candidates": sum(1 for o in self.outcomes if o.status == "ok")}
        if self.rules is not None and self.rules.samples:
            entry["rules_us"] = round(self.rules.decisive_ms * 1e3, 2)
            entry["rules_name"] = self.rules.name
        if self.shape.label:
            entry["label"] = self.shape.label
        if self.rerank is not None:
            entry["rerank"] = self.rerank
        return entry

    def samples(self) -> list[dict]:
        """Every timed candidate's median (the table's samples)."""
        k = self.shape.key()
        return [{"form": k.form, "dtype": k.dtype, "out_dtype": k.out_dtype, "E": k.E,
                 "N": k.N, "K": k.K, "rows": self.shape.rows, "config": o.fields,
                 "us": round(o.ms * 1e3, 3)}
                for o in self.outcomes if o.status == "ok" and o.samples]

    def failures(self) -> list[dict]:
        return [{"name": o.name, "config": o.fields, "error": o.error}
                for o in self.outcomes if o.status == "error"]


def tune_shape(shape: TuneShape, runner: Runner, *, rounds: int = FINAL_ROUNDS,
               deadline: float | None = None, out_itemsize: int = 2,
               log: Callable[[str], None] = lambda s: None) -> ShapeResult:
    """Search `shape` with `runner`; deadline: time.monotonic() after which no new stage
    starts (what was measured still decides)."""
    t0 = time.monotonic()
    outcomes: dict[str, Outcome] = {}
    by_kernel: dict[Any, str] = {}
    stopped = None

    def admit(fields: dict, origin: str) -> Outcome | None:
        name = space.name_of(fields)
        if name in outcomes:
            return None
        o = outcomes[name] = Outcome(name, fields, origin)
        ident = runner.identity(fields)
        if ident in by_kernel:  # the same kernel and arguments as one already admitted
            o.status = "duplicate"
            return None
        by_kernel[ident] = name
        return o

    def prepared(items: list[Outcome]) -> list[Outcome]:
        runner.submit([o.fields for o in items])
        ok = []
        for o in items:
            err = runner.prepare(o.fields)
            if err is None:
                o.status = "ok"
                ok.append(o)
            else:
                o.status, o.error = "error", err
                log(f"  {o.name}: {err}")
        return ok

    def measure(items: list[Outcome], n: int, final: bool = False) -> None:
        got = runner.measure([o.fields for o in items], n)
        for o in items:
            o.samples.extend(got.get(o.name, []))
            if final:
                o.final = list(got.get(o.name, []))

    def late() -> bool:
        return deadline is not None and time.monotonic() > deadline

    rules = admit(runner.rules_fields(), "rules")
    first = [rules] if rules else []
    first += [o for o in (admit(f, "stage1") for f in space.stage1(shape.form, out_itemsize))
              if o is not None]
    live = prepared(first)
    rules = rules if rules is not None and rules.status == "ok" else None
    if not live:
        return ShapeResult(shape, list(outcomes.values()), None, None,
                           time.monotonic() - t0, "no candidate compiled and passed its check")
    measure(live, 2)
    live.sort(key=lambda o: o.ms)
    best = live[0].ms
    keep = [o for o in live if o.ms <= PRUNE * best][:KEEP]
    runner.release([o.name for o in live if o not in keep and o is not rules])
    if late():
        stopped = "deadline after stage 1"
    else:
        measure(keep + ([rules] if rules and rules not in keep else []), 2)
        keep.sort(key=lambda o: o.ms)
        parents = keep[:TOP]
        runner.release([o.name for o in keep[TOP:] if o is not rules])
        second: list[Outcome] = []
        for p in parents:
            second += [o for o in (admit(f, "stage2") for f in space.stage2(
                p.fields, shape.form, out_itemsize)) if o is not None]
        second = prepared(second)
        if second and not late():
            measure(parents + second + ([rules] if rules and rules not in parents else []),
                    rounds // 2 + 1)
            combos = []
            for p in parents:
                winners = [o.fields for o in second if o.ms < WIN * p.ms
                           and _parent_of(o.fields, p.fields)]
                merged = space.combine(p.fields, winners, shape.form, out_itemsize)
                if merged is not None:
                    o = admit(merged, "combined")
                    if o is not None:
                        combos.append(o)
            combos = prepared(combos)  # (not timed yet: they join the leaders as they are)
            leaders = sorted(parents + second, key=lambda o: o.ms)[:TOP + 1] + combos
            runner.release([o.name for o in second if o not in leaders and o is not rules])
            if not late():
                final = leaders + ([rules] if rules and rules not in leaders else [])
                measure(final, rounds, final=True)
        elif late():
            stopped = "deadline before stage 2"
    timed = [o for o in outcomes.values() if o.status == "ok" and o.samples]
    finalists = [o for o in timed if o.final]
    if finalists:  # ranked by the rounds they ran together
        winner = min(finalists, key=lambda o: o.decisive_ms)
    else:
        winner = min(timed, key=lambda o: o.ms) if timed else None
    runner.release(list(outcomes))
    return ShapeResult(shape, list(outcomes.values()), winner, rules, time.monotonic() - t0,
                       stopped)


def _parent_of(child: dict, parent: dict) -> bool:
    """Whether `child` differs from `parent` in exactly one field."""
    return sum(1 for k in set(child) | set(parent) if child.get(k) != parent.get(k)) == 1


def compare_configs(shape: TuneShape, runner: Runner, configs: list[dict], *,
                    rounds: int = 10) -> ShapeResult:
    """Time only `configs` and the rules' choice on `shape`, interleaved (an A/B, not a
    search); each is checked first like any candidate."""
    t0 = time.monotonic()
    outcomes: list[Outcome] = []
    seen: set[str] = set()
    for fields, origin in [(runner.rules_fields(), "rules")] + [(c, "given") for c in configs]:
        name = space.name_of(fields)
        if name not in seen:
            seen.add(name)
            outcomes.append(Outcome(name, fields, origin))
    runner.submit([o.fields for o in outcomes])
    live = []
    for o in outcomes:
        err = runner.prepare(o.fields)
        o.status, o.error = ("ok", None) if err is None else ("error", err)
        if err is None:
            live.append(o)
    if live:
        got = runner.measure([o.fields for o in live], rounds)
        for o in live:
            o.samples.extend(got.get(o.name, []))
    runner.release([o.name for o in outcomes])
    timed = [o for o in live if o.samples]
    rules = outcomes[0] if outcomes[0].status == "ok" else None
    return ShapeResult(shape, outcomes, min(timed, key=lambda o: o.ms) if timed else None,
                       rules, time.monotonic() - t0)
