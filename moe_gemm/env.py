"""Reading MOE_GEMM_* environment switches on the per-call hot path.

`os.environ.get` encodes the key and decodes the value on every call (~0.5 us each on the
H200 host, 2 us on the CI machine); grouped_mm's cached-plan path checks three switches per
call, which was most of its gap to torch's own grouped_mm. On POSIX
`os.environ` keeps its bytes mapping in `_data`, kept in step by `os.environ[...] = ...`,
`del` and pytest's monkeypatch, so a lookup there sees every change made through os.environ.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

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


def env_switch(name: str) -> bool:
    """A default-on MOE_GEMM_* switch: off when set to 0, false, no or off (any case); on when
    unset, empty or set to 1, true, yes or on; EnvError for any other value."""
    value = env_get(name)
    return value is None or _switch_value(name, value, default=True)


def env_flag(name: str) -> bool:
    """A default-off MOE_GEMM_* switch: on when set to 1, true, yes or on (any case); off when
    unset, empty or set to 0, false, no or off; EnvError for any other value."""
    value = env_get(name)
    return value is not None and _switch_value(name, value, default=False)


def env_override(name: str) -> bool | None:
    """A MOE_GEMM_* switch over a default the library chooses case by case: True or False
    when set to an on or off word (as env_switch reads them), None when unset or empty;
    EnvError for any other value."""
    value = env_get(name)
    if value is None or not value.strip():
        return None
    return _switch_value(name, value, default=False)


def flag_on(name: str, value: str | None) -> bool:
    """env_flag for a value already read (one of env_reader's tuple)."""
    return value is not None and _switch_value(name, value, default=False)


def env_choice(name: str, choices: tuple[str, ...]) -> str | None:
    """A MOE_GEMM_* variable that names one of `choices` (any case): that choice, or None when
    unset or empty; EnvError for any other value."""
    value = env_get(name)
    if value is None or not value.strip():
        return None
    word = value.strip().lower()
    if word not in choices:
        raise EnvError(f"{name}={value!r}: expected {' or '.join(choices)} (or unset)")
    return word


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

    def read() -> tuple[str | None, ...]:
        raw = tuple(map(get, keys))
        values = decoded.get(raw)
        if values is None:
            if len(decoded) >= 64:
                decoded.clear()
            values = decoded[raw] = tuple(
                None if v is None else v.decode(_ENCODING, "surrogateescape") for v in raw)
        return values

    return read


# Every MOE_GEMM_* variable the library reads, with what it does (docs/USAGE.md's table and
# `moe-gemm info` show these; tests/test_env.py checks that the sources read no other). The
# server's flags have their own (server/README.md).
LIBRARY_VARIABLES: dict[str, str] = {
    "MOE_GEMM_DISABLE_CUTE": "1: never run the Hopper kernels (the torch backend everywhere)",
    "MOE_GEMM_CACHE_DIR": "where compiled kernels are kept (default ~/.cache/moe_gemm)",
    "MOE_GEMM_DISK_CACHE": "0: keep compiled kernels and online-tuned configs in memory only",
    "MOE_GEMM_TUNED_TABLE": "a tuned table (JSON) consulted before the shipped ones",
    "MOE_GEMM_TUNED_TABLES": "0: no tuned tables, the built-in rules choose every config",
    "MOE_GEMM_AUTOTUNE": "1: tune a grouped_mm shape no table holds the first time it is seen",
    "MOE_GEMM_AUTOTUNE_BUDGET_S": "seconds one online tune may take (default 30)",
    "MOE_GEMM_CHECK_OFFS": "1: check offs values on the host also for GPU tensors (a sync)",
    "MOE_GEMM_TAIL_SPLIT": "0: no split of a short last wave over K (needed where SMs are "
                           "fenced off, e.g. an MPS thread limit)",
    "MOE_GEMM_TRIM_A": "1 / 0: an expert's last tile of grouped_mm loads only that "
                       "expert's rows of x (rounded up to 16) / a whole tile of rows, "
                       "wherever the kernel builds it (default: trimmed but on ping-pong "
                       "tiles of 128+ rows and under 192 columns outside 1x2 clusters)",
    "MOE_GEMM_PEEK_WAIT": "1: the 16-bit kernels' math warps test the next A/B stage's "
                          "barrier a k-tile ahead (opt-in, even in time on an H200; "
                          "default: wait at each k-tile)",
    "MOE_GEMM_L2_HINTS": "'a,b', each first, normal or last: L2 eviction hints on the A and "
                         "B loads",
    "MOE_GEMM_PDL": "1: programmatic dependent launch of the kernels (read at import)",
    "MOE_GEMM_PLAN_GRAPH": "0: a GroupedGemmPlan calls its kernel directly instead of "
                           "replaying a CUDA graph of its launch recorded at its first call "
                           "(read when the plan is built)",
    "MOE_GEMM_FUSED": "0: the MoE layers take the unfused path where they would fuse",
    "MOE_GEMM_FUSED_GATHER": "0: the fused path gathers tokens with index_select, not in the "
                             "kernel",
    "MOE_GEMM_FUSED_GATHER_WIDE": "1: the fused kernel gathers in kernel at every batch size "
                                  "and on tiles past 128 rows or 128 accumulator registers "
                                  "on any weight (by default below 1024 routed rows, or "
                                  "on weights of at most 2048 columns; no routed copy of x, "
                                  "but 0.87-0.96x the speed of index_select + TMA on wider "
                                  "ones on the H200)",
    "MOE_GEMM_FUSED_FAST_GATE": "0: the fused SiLU / clamped SwiGLU epilogue takes its sigmoid "
                                "from the IEEE exp and divide, not the SFU's approximate "
                                "exp2 and reciprocal (a few fp32 ulp apart)",
    "MOE_GEMM_FP8_SCALE_AHEAD": "1-4: stages ahead the math threads load the FP8 block scales "
                                "where they are not staged (default 3 on tiles within one "
                                "scale block; 1: the plain loop)",
    "MOE_GEMM_FP8_SMEM_SCALES": "1 / 0: the FP8 block scales of the varlen form staged in "
                                "shared memory by TMA, with the lagged promotion, on tiles "
                                "with room for it / loaded by the math threads (default: "
                                "staged, except on decode-sized experts whose K / 128 is not "
                                "a multiple of 4)",
    "MOE_GEMM_FP8_PROMOTE_LAG": "1: the FP8 promotion one stage behind the WGMMAs also where "
                                "the scales are not staged",
    "MOE_GEMM_FP8_QUANT": "torch: the FP8 quantizers run torch ops even where the kernel runs",
    "MOE_GEMM_ROUTER": "torch: the routers' top-k (softmax; sigmoid with groups) as torch "
                       "ops even where their kernels run",
    "MOE_GEMM_COMBINE": "torch: the MoE layers' top-k combine as embedding_bag even where "
                        "its kernel runs",
}


def variables_set() -> dict[str, str]:
    """The MOE_GEMM_* variables set in this process's environment (known or not)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("MOE_GEMM_")}

