"""Re-ranking a tuned table's leaders in the regime the benchmarks time in.

    moe-gemm tune --rerank moe_gemm/tables/nvidia-h200.json --zoo --tokens 8192 \\
        --out moe_gemm/tables/nvidia-h200.json [--top 4] [--margin 0.03]

The search (moe_gemm.tuning.tuner) ranks candidates by samples taken among many others, by
default as CUDA-graph replays after a rest. Long kernels rank differently when launched back
to back as a serving loop (and the model zoo) runs them: on an H200 the zoo ran a table's pick
1-9% slower than the tuner had timed it, and picks of a table tuned in that regime outright
(`--timing eager --rest-ms 0`) won more zoo rows but lost others by more, since every
candidate of a search gets few samples.

A re-rank takes, per shape, the table's pick and the `top` fastest other configs of its
samples for that shape (and --rivals, configs the search had not tried when the table was made,
such as 'swap 256x128'; with those, shapes the table has no entry for are re-ranked too, from
the rules' choice), and times only those (and the rules' choice) against one another in
one process, interleaved, for --rounds rounds, by default eagerly, back to back, in 5 ms
samples (the zoo's regime). The pick is replaced only by a config faster than it by more than
`margin` (3%) in those rounds, so a tie, or a gain within the noise, keeps the searched pick.
Where the default launches swapped tiles instead of an entry's pick (the swapped tiles' window,
moe_gemm.ops.swap_rules.swap_ab_wanted, for an entry that does not name swap_ab), the swapped
kernel is the pick to beat and the entry's pick one of its rivals; an entry written after the
swapped kernel was timed names swap_ab, so the lookup follows the measurement there.
Entries are written as the search writes them, with a "rerank" record (the regime, the
earlier pick and its time); the source table's samples are not touched (they are the search's,
in its own regime).
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_gemm.config import GemmConfig
from moe_gemm.ops import swap_rules
from moe_gemm.ops.tuned import rows_bucket
from moe_gemm.tuning import space, table_io
from moe_gemm.tuning.tuner import Runner, ShapeResult, TuneShape, compare_configs

DEFAULT_TOP = 4
# A rival must beat the pick by more than this in the re-rank's rounds: equal kernels'
# interleaved medians differ by about 1% within one process, and the zoo's run-to-run spread on
# one config is 2-6% (H200, 2026-11-28), so a smaller gain does not justify leaving the searched
# pick.
DEFAULT_MARGIN = 0.03
# The zoo's regime (benchmarks/clock.py): eager launches, no rest beyond the enqueue
# backlog, samples of at least 5 ms. --timing, --rest-ms and --sample-ms override.
TIMING = "eager"
REST_MS = 0.0
SAMPLE_MS = 5.0


@dataclass(frozen=True)
class Leaders:
    """What a re-rank times on one shape: the table's pick and its nearest rivals."""

    entry: dict
    pick: dict
    rivals: list[dict]


def leaders(doc: dict, shape: TuneShape, top: int, extra: tuple[dict, ...] = (),
            nsm: int = 132) -> Leaders | None:
    """The table's entry for `shape`'s key, the pick the default launches with it, and as
    rivals the `top` fastest other configs of the table's samples of that key (fastest first;
    one per name), then `extra`. None without an entry, unless `extra` is given: then the
    pick is the rules' choice. nsm: the GPU's SM count (the rules' choice depends on it)."""
    from moe_gemm.tuning.runner import rules_fields

    k = shape.key()
    key = table_io.key_tuple(k)
    entry = table_io.find_entry(doc, key)
    if entry is None and not extra:
        return None
    rivals: list[dict] = []
    if entry is None:
        entry, pick = {}, rules_fields(shape, nsm)
    else:
        pick = table_io.explicit_fields(entry["config"])
        swapped = window_swapped(pick, shape, nsm)
        if swapped is not None:
            rivals.append(pick)
            pick = swapped
    seen = {space.name_of(f) for f in (pick, *rivals)}
    mine = [s for s in doc.get("samples", [])
            if table_io.sample_shape(s)[:6] == key[:6]
            and rows_bucket(int(s["rows"]) / max(1, int(s["E"]))) == k.bucket]
    from_samples = 0
    for s in sorted(mine, key=lambda s: float(s["us"])):
        if from_samples == top:
            break
        fields = table_io.explicit_fields(s["config"])
        name = space.name_of(fields)
        if name not in seen:
            seen.add(name)
            rivals.append(fields)
            from_samples += 1
    for fields in extra:
        if space.name_of(fields) not in seen:
            seen.add(space.name_of(fields))
            rivals.append(fields)
    return Leaders(entry, pick, rivals)


def window_swapped(pick: dict, shape: TuneShape, nsm: int) -> dict | None:
    """The swapped kernel's fields where the default launches it instead of the entry's
    `pick` (grouped_mm's varlen form, an entry that does not name swap_ab, a shape inside the
    window); else None."""
    from moe_gemm.tuning.runner import DTYPES, choice_for

    isz = DTYPES[shape.out_dtype].itemsize
    if shape.form != "varlen" or "swap_ab" in pick or not swap_rules.swap_ab_wanted(
            GemmConfig(), shape.rows, shape.E, shape.K, isz, N=shape.N, num_sms=nsm):
        return None
    choice = choice_for(shape, space.config_of(pick), nsm)
    return space.fields_of(swap_rules.swapped_choice(choice, isz), "varlen")


def rerank_shape(shape: TuneShape, runner: Runner, found: Leaders, *, rounds: int,
                 margin: float = DEFAULT_MARGIN, regime: str = "") -> ShapeResult:
    """Time the pick, its rivals and the rules' choice interleaved; the winner is the
    fastest, unless it beats the pick by `margin` or less (then the pick stays)."""
    res = compare_configs(shape, runner, [found.pick, *found.rivals], rounds=rounds)
    pick_name = space.name_of(found.pick)
    pick = next((o for o in res.outcomes if o.name == pick_name and o.samples), None)
    if pick is not None and res.winner is not None and res.winner is not pick \
            and not res.winner.ms < pick.ms * (1.0 - margin):
        res.winner = pick
    if (found.pick.get("swap_ab") is False and res.winner is not None
            and "swap_ab" not in res.winner.fields):
        # The table's measurement against the swapped kernel stands for the new pick too (a
        # rival of the same name, the rules' choice first among them, does not carry it).
        res.winner.fields = {**res.winner.fields, "swap_ab": False}
    # "from" is the pick timed here (what the default launched); "table_pick" the entry's
    # own where the swapped tiles' window had replaced it.
    res.rerank = {"regime": regime, "from": pick_name,
                  "from_us": round(pick.ms * 1e3, 2) if pick is not None else None,
                  "from_table_us": found.entry.get("us"), "margin": margin,
                  "timed": [o.name for o in res.outcomes if o.samples]}
    if found.entry.get("name", pick_name) != pick_name:
        res.rerank["table_pick"] = found.entry["name"]
    return res

