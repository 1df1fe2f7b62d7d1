"""The MOE_GEMM_* environment variables: how each one is read (VARIABLES), and reading them
on the per-call hot path.

`os.environ.get` encodes the key and decodes the value on every call (~0.5 us each on the
H200 host, 2 us on the CI machine); grouped_mm's cached-plan path checks three switches per
call, which was most of its gap to torch's own grouped_mm. On POSIX
`os.environ` keeps its bytes mapping in `_data`, kept in step by `os.environ[...] = ...`,
`del` and pytest's monkeypatch, so a lookup there sees every change made through os.environ.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from typing import NamedTuple

_ENCODING = sys.getfilesystemencoding()
_DATA = getattr(os.environ, "_data", None)
_BYTES = isinstance(_DATA, dict) and all(isinstance(k, bytes) for k in list(_DATA)[:8])


def env_get(name: str) -> str | None:
    """os.environ.get(name), without the per-call encode/decode where the platform allows."""
    if _BYTES:
        # The same codec and error handler os.environ uses for its keys and values.
        value = _DATA.get(name.encode(_ENCODING, "surrogateescape"))  # type: ignore[union-attr]
        return None if value is None else value.decode(_ENCODING, "surrogateescape")
    return os.environ.get(name)


ON_VALUES = ("1", "true", "yes", "on")
OFF_VALUES = ("0", "false", "no", "off")


class EnvError(ValueError):
    """A MOE_GEMM_* variable set to a value the library does not accept (the message names
    the variable and the values it takes)."""


# How each kind of variable is read: a parser takes the variable's name and its raw value
# (None when unset) and returns what the library uses, or raises EnvError. VARIABLES below
# names one parser per variable; the library reads a variable only through env_value,
# env_value_reader or env_parse, which call that parser, and `moe-gemm info` judges a value
# with the same call (refusal), so the two cannot disagree.
Parser = Callable[[str, "str | None"], object]


def switch_value(name: str, value: str | None) -> bool:
    """A default-on switch: off when set to 0, false, no or off (any case); on when unset,
    empty or set to 1, true, yes or on; EnvError for any other value."""
    return value is None or _switch_value(name, value, default=True)


def flag_value(name: str, value: str | None) -> bool:
    """A default-off switch: on when set to 1, true, yes or on (any case); off when unset,
    empty or set to 0, false, no or off; EnvError for any other value."""
    return value is not None and _switch_value(name, value, default=False)


def override_value(name: str, value: str | None) -> bool | None:
    """A switch over a default the library chooses case by case: True or False when set to an
    on or off word (as switch_value reads them), None when unset or empty; EnvError for any
    other value."""
    if value is None or not value.strip():
        return None
    return _switch_value(name, value, default=False)


def text_value(name: str, value: str | None) -> str | None:
    """A path: the value with a leading ~ expanded (an env file or a quoted value reaches us
    unexpanded), None when unset, empty or blank (no value is refused)."""
    return os.path.expanduser(value) if value and value.strip() else None


def choice_of(*choices: str) -> Parser:
    """A variable that names one of `choices` (any case): that choice, or None when unset or
    empty; EnvError for any other value."""
    def parse(name: str, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        word = value.strip().lower()
        if word not in choices:
            raise EnvError(f"{name}={value!r}: expected {' or '.join(choices)} (or unset)")
        return word
    return parse


def integer_in(low: int, high: int) -> Parser:
    """An integer from `low` to `high`: that integer, or None when unset or empty; EnvError
    for anything else."""
    def parse(name: str, value: str | None) -> int | None:
        if value is None or not value.strip():
            return None
        try:
            number = int(value)
        except ValueError:
            number = low - 1
        if not low <= number <= high:
            raise EnvError(f"{name}={value!r}: expected an integer from {low} to {high} "
                           "(or unset)")
        return number
    return parse


def seconds(default: float, least: float) -> Parser:
    """A positive finite number of seconds, raised to `least`; `default` when unset or empty;
    EnvError for anything else (nan, inf, 0, a negative number, a unit after the number)."""
    def parse(name: str, value: str | None) -> float:
        if value is None or not value.strip():
            return default
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not (math.isfinite(number) and number > 0):
            raise EnvError(f"{name}={value!r}: expected a positive finite number of seconds "
                           f"(default {default:g})")
        return max(least, number)
    return parse


L2_HINT_WORDS = ("first", "normal", "last")  # the TMA loads' L2 eviction priorities


def l2_hints_value(name: str, value: str | None) -> tuple[str, str] | None:
    """'a,b', each one of L2_HINT_WORDS (A's and B's policy): the pair, None when unset or
    empty; EnvError for anything else."""
    if not value or not value.strip():  # (set but blank: the default, as for the others)
        return None
    parts = [v.strip().lower() for v in value.split(",")]  # (any case, as the others)
    if len(parts) != 2 or not all(p in L2_HINT_WORDS for p in parts):
        raise EnvError(f"{name}={value!r}: expected 'a,b' (A's and B's policy), each one of "
                       f"{', '.join(L2_HINT_WORDS)}")
    return parts[0], parts[1]


def _switch_value(name: str, value: str, default: bool) -> bool:
    # A value that is neither on nor off is refused rather than read as the default, so that
    # a typo (MOE_GEMM_FUSED=flase) or a word of another convention cannot silently keep the
    # behaviour it was meant to change.
    word = value.strip().lower()
    if word in ON_VALUES:
        return True
    if word in OFF_VALUES:
        return False
    if not word:  # set but empty, as an unset shell variable exports it: the default
        return default
    raise EnvError(f"{name}={value!r}: expected one of {', '.join(ON_VALUES)} (on) or "
                   f"{', '.join(OFF_VALUES)} (off)")


def env_reader(names: tuple[str, ...]) -> Callable[[], tuple[str | None, ...]]:
    """A function that returns tuple(env_get(name) for name in names), for switches read at
    every call: the keys are encoded once and the decoded values are kept per tuple of raw
    values (~0.2 us a call on the CPU-only dev machine against ~0.55 for four env_get)."""
    if not _BYTES:
        return lambda: tuple(map(os.environ.get, names))
    keys = tuple(name.encode(_ENCODING, "surrogateescape") for name in names)
    get = _DATA.get  # type: ignore[union-attr]
    decoded: dict[tuple, tuple[str | None, ...]] = {}
    # None of them set, the usual case: one C-level intersection answers it (~0.7 us for
    # twenty names against ~1.4 for reading each; it looks each name up in the environment,
    # so a large environment costs no more).
    names_set, present, unset = frozenset(keys), _DATA.keys(), (None,) * len(keys)  # type: ignore[union-attr]

    def read() -> tuple[str | None, ...]:
        if not present & names_set:
            return unset
        raw = tuple(map(get, keys))
        values = decoded.get(raw)
        if values is None:
            if len(decoded) >= 64:
                decoded.clear()
            values = decoded[raw] = tuple(
                None if v is None else v.decode(_ENCODING, "surrogateescape") for v in raw)
        return values

    return read


class Variable(NamedTuple):
    """How the library reads one MOE_GEMM_* variable: its parser (one of the kinds above) and
    what it does."""

    parse: Parser
    doc: str


# Every MOE_GEMM_* variable the library reads, with what it does (docs/USAGE.md's table and
# `moe-gemm info` show these; tests/test_env.py checks that the sources read no other). The
# server's flags have their own (server/README.md).
VARIABLES: dict[str, Variable] = {
    "MOE_GEMM_DISABLE_CUTE": Variable(
        flag_value,
        "1: never run the Hopper kernels (the torch backend everywhere)"),
    "MOE_GEMM_CACHE_DIR": Variable(
        text_value,
        "where compiled kernels are kept (default ~/.cache/moe_gemm)"),
    "MOE_GEMM_DISK_CACHE": Variable(
        switch_value,
        "0: keep compiled kernels and online-tuned configs in memory only"),
    "MOE_GEMM_TUNED_TABLE": Variable(
        text_value,
        "a tuned table (JSON) consulted before the shipped ones"),
    "MOE_GEMM_TUNED_TABLES": Variable(
        switch_value,
        "0: no tuned tables, the built-in rules choose every config"),
    "MOE_GEMM_AUTOTUNE": Variable(
        flag_value,
        "1: tune a grouped_mm shape no table holds the first time it is seen"),
    "MOE_GEMM_AUTOTUNE_BUDGET_S": Variable(
        seconds(default=30.0, least=1.0),
        "seconds one online tune may take (default 30)"),
    "MOE_GEMM_CHECK_OFFS": Variable(
        flag_value,
        "1: check offs values on the host also for GPU tensors (a sync)"),
    "MOE_GEMM_TAIL_SPLIT": Variable(
        switch_value,
        "0: no split of a short last wave over K (needed where SMs are fenced off, e.g. an MPS "
        "thread limit)"),
    "MOE_GEMM_SPLIT_WAYS": Variable(
        integer_in(2, 16),
        "2-16: the most CTAs one tile of a short last wave is split over along K (default 8; "
        "2 = halves)"),
    "MOE_GEMM_TRIM_A": Variable(
        override_value,
        "1 / 0: an expert's last tile of grouped_mm loads only that expert's rows of x (rounded "
        "up to 16) / a whole tile of rows, wherever the kernel builds it (default: trimmed but on "
        "ping-pong tiles of 128+ rows and under 192 columns outside 1x2 clusters)"),
    "MOE_GEMM_PACKED_PAIRS": Variable(
        override_value,
        "1 / 0: grouped_mm's varlen kernels in 2x1 clusters pair consecutive tiles of the tile "
        "order across experts (B multicast where the pair shares it), so no cluster computes a "
        "tile past an expert's end / never (default: where a pin or a tuned table's entry "
        "says)"),
    "MOE_GEMM_PEEK_WAIT": Variable(
        flag_value,
        "1: the 16-bit kernels' math warps test the next A/B stage's barrier a k-tile ahead "
        "(opt-in, even in time on an H200; default: wait at each k-tile)"),
    "MOE_GEMM_SWAP_AB": Variable(
        override_value,
        "1 / 0: grouped_mm's 2-D x 3-D form runs swapped tiles (the routed rows on the WGMMA's "
        "N side, 128 weight columns x up to 256 rows) everywhere / nowhere (default: as a "
        "tuned table's entry measured it, else where about 192-320 rows reach each of at most "
        "160 experts, K >= 2048 and the tiles fill the SMs; GemmConfig.swap_ab pins it)"),
    "MOE_GEMM_L2_HINTS": Variable(
        l2_hints_value,
        "'a,b', each first, normal or last: L2 eviction hints on the A and B loads"),
    "MOE_GEMM_PDL": Variable(
        flag_value,
        "1: programmatic dependent launch of the kernels (read at import)"),
    "MOE_GEMM_PLAN_GRAPH": Variable(
        switch_value,
        "0: a GroupedGemmPlan calls its kernel directly instead of replaying a CUDA graph of its "
        "launch recorded at its first call (read when the plan is built)"),
    "MOE_GEMM_FUSED": Variable(
        switch_value,
        "0: the MoE layers take the unfused path where they would fuse"),
    "MOE_GEMM_FUSED_GATHER": Variable(
        switch_value,
        "0: the fused path gathers tokens with index_select, not in the kernel"),
    "MOE_GEMM_FUSED_GATHER_WIDE": Variable(
        flag_value,
        "1: the fused kernel gathers in kernel at every batch size and on tiles past 128 rows or "
        "128 accumulator registers on any weight (by default below 32 routed rows; no routed "
        "copy of x; the whole layer 0.96-1.06x the speed of index_select + TMA loads, on the "
        "H200)"),
    "MOE_GEMM_GATHER_FENCE": Variable(
        switch_value,
        "0: the in-kernel gather's math warps read a gathered stage once its barrier completes, "
        "without a proxy fence before their WGMMAs (as CUTLASS's cp.async mainloop does)"),
    "MOE_GEMM_FUSED_FAST_GATE": Variable(
        switch_value,
        "0: the fused SiLU / clamped SwiGLU epilogue takes its sigmoid from the IEEE exp and "
        "divide, not the SFU's approximate exp2 and reciprocal (a few fp32 ulp apart)"),
    "MOE_GEMM_FP8_SCALE_AHEAD": Variable(
        integer_in(1, 4),
        "1-4: stages ahead the math threads load the FP8 block scales where they are not staged "
        "(default 3 on tiles within one scale block; 1: the plain loop; set, it turns the staged "
        "scales off unless MOE_GEMM_FP8_SMEM_SCALES=1 asks for them)"),
    "MOE_GEMM_FP8_SMEM_SCALES": Variable(
        override_value,
        "1 / 0: the FP8 block scales of the varlen and batched forms staged in shared memory by "
        "TMA, with the lagged promotion, on tiles with room for it / loaded by the math "
        "threads (default: staged in the varlen form, except on decode-sized experts whose "
        "K / 128 is not a multiple of 4; loaded by the math threads in the batched form)"),
    "MOE_GEMM_FP8_PEEK_WAIT": Variable(
        override_value,
        "0 / 1: the FP8 stage loops wait for each stage's operands in full / take a probe of "
        "its barrier made a stage earlier (default: the probe in the varlen form, but for "
        "row-wise decode tiles)"),
    "MOE_GEMM_FP8_HALF_SKIP": Variable(
        override_value,
        "1 / 0: an FP8 cooperative 128-row tile's second warpgroup skips / runs its WGMMAs "
        "where all its 64 rows are past the problem's end (default: the skip from 768 rows "
        "per problem in grouped_mm's forms; it measured slower on experts of a few hundred "
        "rows)"),
    "MOE_GEMM_FP8_PROMOTE_LAG": Variable(
        override_value,
        "1: the FP8 promotion one stage behind the WGMMAs also where the scales are not staged; "
        "0: staged scales promoted in the plain loop, not a stage behind (slower: an A/B "
        "switch)"),
    "MOE_GEMM_FP8_QUANT": Variable(
        choice_of("torch", "kernel"),
        "torch: the FP8 quantizers run torch ops even where the kernel runs"),
    "MOE_GEMM_ROUTER": Variable(
        choice_of("torch", "kernel"),
        "torch: the routers' top-k (softmax; sigmoid with groups) as torch ops even where their "
        "kernels run"),
    "MOE_GEMM_COMBINE": Variable(
        choice_of("torch", "kernel"),
        "torch: the MoE layers' top-k combine as embedding_bag even where its kernel runs"),
    "MOE_GEMM_TOKEN_GATHER": Variable(
        choice_of("torch", "kernel"),
        "torch: the MoE layers' token gather as index_select even where its kernel runs"),
    "MOE_GEMM_SHARED_STREAM": Variable(
        switch_value,
        "0: a MoE layer's shared expert runs after its routed experts on the caller's stream, "
        "not on a second CUDA stream beside them"),
}


LIBRARY_VARIABLES: dict[str, str] = {name: v.doc for name, v in VARIABLES.items()}


def env_value(name: str) -> object:
    """What the library makes of the variable `name` now, by its declared parser (EnvError
    for a value it refuses). A name not in VARIABLES is a KeyError: declare it first."""
    return _READERS[name]()


def env_parse(name: str, value: str | None) -> object:
    """env_value for a value already read (one of env_reader's tuple)."""
    return VARIABLES[name].parse(name, value)


def env_value_reader(name: str) -> Callable[[], object]:
    """env_value(name) as a function of no arguments, for a variable read at every call: the
    key is encoded and the parser looked up once (env_get encodes the key at each call)."""
    parse = VARIABLES[name].parse
    if not _BYTES:
        return lambda: parse(name, os.environ.get(name))
    key = name.encode(_ENCODING, "surrogateescape")
    get = _DATA.get  # type: ignore[union-attr]

    def read() -> object:
        raw = get(key)
        return parse(name, None if raw is None else raw.decode(_ENCODING, "surrogateescape"))

    return read


# (env_value's readers, keys encoded once: no slower than one env_get)
_READERS = {name: env_value_reader(name) for name in VARIABLES}


def refusal(name: str, value: str) -> str | None:
    """Why the library would refuse `value` for the variable `name` (its reader's EnvError
    message), or None when it takes it: `moe-gemm info`'s verdict, from the same parser."""
    try:
        env_parse(name, value)
    except EnvError as exc:
        return str(exc)
    return None


def variables_set() -> dict[str, str]:
    """The MOE_GEMM_* variables set in this process's environment (known or not)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("MOE_GEMM_")}


def refused_variables() -> dict[str, str]:
    """{name: why} for each library variable set now to a value its reader refuses (`refusal`):
    what `moe-gemm info` marks, and what every other `moe-gemm` command refuses to run with."""
    return {k: why for k, v in variables_set().items()
            if k in VARIABLES and (why := refusal(k, v)) is not None}
