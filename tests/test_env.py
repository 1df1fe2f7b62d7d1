"""moe_gemm.env: env_get gives the same answer as os.environ.get, for every way the environment
changes; each kind of variable reads its values as documented; and for every declared variable,
`moe-gemm info`'s verdict and the library's own reader agree.

env_get reads os.environ's underlying bytes mapping on POSIX (to skip the per-call encode and
decode); these tests pin that it never drifts from os.environ.get. Every variable of the first
tests has a MOE_GEMM_TEST_ENV_ prefix and is removed again by monkeypatch.
"""

from __future__ import annotations

import os

import pytest
import torch

from moe_gemm import env as env_module
from moe_gemm.env import env_get

NAME = "MOE_GEMM_TEST_ENV_SWITCH"


@pytest.fixture(params=["fast", "fallback"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run each test on the bytes-mapping path (where the platform has it) and on the plain
    os.environ.get fallback."""
    if request.param == "fallback":
        monkeypatch.setattr(env_module, "_BYTES", False)
    elif not env_module._BYTES:
        pytest.skip("os.environ has no bytes mapping on this platform")
    return request.param


@pytest.fixture
def clean(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """NAME unset now; whatever a test sets through os.environ is undone afterwards."""
    _unset(monkeypatch, NAME)
    return monkeypatch


def _unset(mp: pytest.MonkeyPatch, name: str) -> None:
    """Unset `name` so that mp's undo removes whatever the test sets later (delenv of a name
    that is absent records nothing, so set it first)."""
    mp.setenv(name, "placeholder")
    mp.delenv(name)


def _same(name: str) -> str | None:
    got = env_get(name)
    assert got == os.environ.get(name), (got, os.environ.get(name))
    return got


def test_fast_path_active_on_posix() -> None:
    if os.name == "posix":
        assert env_module._BYTES, "POSIX os.environ keeps a bytes mapping; env_get should use it"


@pytest.mark.parametrize("value", ["1", "0", "", " ", "first,last", "a=b", "x" * 10_000])
def test_set_values(path: str, clean: pytest.MonkeyPatch, value: str) -> None:
    clean.setenv(NAME, value)
    assert _same(NAME) == value


def test_unset_is_none(path: str, clean: pytest.MonkeyPatch) -> None:
    assert _same(NAME) is None
    assert _same("MOE_GEMM_TEST_ENV_NEVER_SET_ANYWHERE") is None


def test_empty_value_is_not_none(path: str, clean: pytest.MonkeyPatch) -> None:
    clean.setenv(NAME, "")
    assert _same(NAME) == ""
    assert env_get(NAME) is not None


def test_names_are_case_sensitive(path: str, clean: pytest.MonkeyPatch) -> None:
    if os.name != "posix":
        pytest.skip("environment names are case-insensitive on Windows")
    _unset(clean, NAME.lower())
    clean.setenv(NAME, "upper")
    assert _same(NAME) == "upper"
    assert _same(NAME.lower()) is None


def test_sees_os_environ_assignment_and_del(path: str, clean: pytest.MonkeyPatch) -> None:
    assert _same(NAME) is None
    os.environ[NAME] = "one"
    assert _same(NAME) == "one"
    os.environ[NAME] = "two"  # overwrite
    assert _same(NAME) == "two"
    del os.environ[NAME]
    assert _same(NAME) is None
    os.environ[NAME] = ""
    assert _same(NAME) == ""


def test_sees_other_os_environ_mutators(path: str, clean: pytest.MonkeyPatch) -> None:
    os.environ.update({NAME: "updated"})
    assert _same(NAME) == "updated"
    assert os.environ.pop(NAME) == "updated"
    assert _same(NAME) is None
    os.environ.setdefault(NAME, "default")
    assert _same(NAME) == "default"
    os.environ.setdefault(NAME, "ignored")
    assert _same(NAME) == "default"


def test_sees_monkeypatch_setenv_and_delenv(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NAME, "patched")
    assert _same(NAME) == "patched"
    monkeypatch.setenv(NAME, "again")
    assert _same(NAME) == "again"
    monkeypatch.delenv(NAME)
    assert _same(NAME) is None
    monkeypatch.delenv(NAME, raising=False)
    assert _same(NAME) is None


def test_sees_monkeypatch_undo(path: str) -> None:
    mp = pytest.MonkeyPatch()
    _unset(mp, NAME)
    try:
        mp.setenv(NAME, "temporary")
        assert _same(NAME) == "temporary"
    finally:
        mp.undo()
    assert _same(NAME) is None


def test_sees_monkeypatch_restoring_an_earlier_value(path: str,
                                                     clean: pytest.MonkeyPatch) -> None:
    os.environ[NAME] = "original"
    mp = pytest.MonkeyPatch()
    try:
        mp.setenv(NAME, "override")
        assert _same(NAME) == "override"
        mp.delenv(NAME)
        assert _same(NAME) is None
    finally:
        mp.undo()
    assert _same(NAME) == "original"


def test_putenv_is_invisible_to_both(path: str, clean: pytest.MonkeyPatch) -> None:
    # os.putenv changes the process environment but not os.environ: neither sees it.
    if not hasattr(os, "putenv") or not hasattr(os, "unsetenv"):
        pytest.skip("no os.putenv/os.unsetenv here")
    os.putenv(NAME, "behind-the-back")
    try:
        assert _same(NAME) is None
    finally:
        os.unsetenv(NAME)


@pytest.mark.parametrize(
    "value",
    ["h\u00e9llo", "\u4e16\u754c", "\U0001f600 emoji", "\u00a0non-breaking\u2009spaces",
     "mixed ASCII \u00fc\u00f1\u00ee\u00e7\u00f8d\u00eb", "\u0394=\u03bb,\u03bc"],
)
def test_non_ascii_values(path: str, clean: pytest.MonkeyPatch, value: str) -> None:
    clean.setenv(NAME, value)
    got = _same(NAME)
    assert got == value and isinstance(got, str)


def test_undecodable_bytes_round_trip(path: str, clean: pytest.MonkeyPatch) -> None:
    # Bytes that are not UTF-8 come back as surrogate escapes, as os.environ gives them.
    value = "a\udcffb\udc80"
    os.environ[NAME] = value
    assert _same(NAME) == value
    if isinstance(getattr(os.environ, "_data", None), dict):
        assert os.environ._data[NAME.encode()] == b"a\xffb\x80"  # type: ignore[attr-defined]


def test_non_ascii_name(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    name = "MOE_GEMM_TEST_ENV_\u00c9T\u00c9"
    _unset(monkeypatch, name)
    assert _same(name) is None
    monkeypatch.setenv(name, "\u00e9t\u00e9")
    assert _same(name) == "\u00e9t\u00e9"


def test_surrogate_escaped_name() -> None:
    if not env_module._BYTES:
        pytest.skip("the fallback path is os.environ.get itself")
    name = "MOE_GEMM_TEST_ENV_\udcff"
    mp = pytest.MonkeyPatch()
    try:
        mp.setenv(name, "v")
        assert os.environ.get(name) == "v"
        assert env_get(name) == "v"
    finally:
        mp.undo()


def test_real_switches_agree(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The switches the ops read on their hot path.
    for name in ("MOE_GEMM_CHECK_OFFS", "MOE_GEMM_DISABLE_CUTE", "MOE_GEMM_L2_HINTS"):
        _same(name)
        monkeypatch.setenv(name, "1")
        assert _same(name) == "1"
        monkeypatch.delenv(name)
        assert _same(name) is None


def test_offs_check_switch_follows_env(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from moe_gemm.ops.validation import offs_check_requested

    _unset(monkeypatch, "MOE_GEMM_CHECK_OFFS")
    assert offs_check_requested() is False
    for value, expected in (("1", True), ("0", False), ("", False), ("yes", True)):
        monkeypatch.setenv("MOE_GEMM_CHECK_OFFS", value)
        assert offs_check_requested() is expected


@pytest.mark.parametrize("value,on", [(None, True), ("1", True), ("yes", True), ("", True),
                                      ("0", False), ("false", False), ("No", False),
                                      (" FALSE ", False)])
def test_env_switch_default_on(path: str, clean: pytest.MonkeyPatch, value, on: bool) -> None:
    if value is not None:
        os.environ[NAME] = value
    assert env_module.switch_value(NAME, env_get(NAME)) is on


@pytest.mark.parametrize("value,on", [(None, False), ("", False), ("0", False), ("no", False),
                                      ("1", True), ("true", True), (" Yes ", True), ("ON", True)])
def test_env_flag_default_off(path: str, clean: pytest.MonkeyPatch, value, on: bool) -> None:
    if value is not None:
        os.environ[NAME] = value
    assert env_module.flag_value(NAME, env_get(NAME)) is on


def test_env_reader_follows_every_change(path: str, clean: pytest.MonkeyPatch) -> None:
    other = NAME + "_OTHER"
    _unset(clean, other)
    read = env_module.env_reader((NAME, other))
    assert read() == (None, None)
    clean.setenv(NAME, "1")
    assert read() == ("1", None)
    os.environ[other] = "é,x"  # (a non-ASCII value decodes as os.environ does)
    assert read() == ("1", "é,x") == (os.environ.get(NAME), os.environ.get(other))
    clean.delenv(NAME)
    del os.environ[other]
    assert read() == (None, None)
    clean.setenv(other, "")  # set but empty is set (each reader parses it as it does)
    assert read() == (None, "")
    clean.delenv(other)
    assert read() == (None, None)


def test_every_variable_the_library_reads_is_listed_and_documented() -> None:
    """LIBRARY_VARIABLES is the list of MOE_GEMM_* names the package's sources mention (no
    more, no fewer), and docs/USAGE.md's table of environment variables lists exactly them."""
    import pathlib
    import re

    root = pathlib.Path(env_module.__file__).resolve().parents[1]
    named = set()
    for src in (root / "moe_gemm").rglob("*.py"):
        named |= set(re.findall(r"MOE_GEMM_[A-Z0-9_]*[A-Z0-9]", src.read_text()))
    assert named == set(env_module.LIBRARY_VARIABLES)
    usage = (root / "docs" / "USAGE.md").read_text()
    table = usage[usage.index("## Environment variables"):]
    documented = re.findall(r"^\| `(MOE_GEMM_[A-Z0-9_]+)` \|", table, flags=re.M)
    assert sorted(documented) == sorted(env_module.LIBRARY_VARIABLES)
    assert len(documented) == len(set(documented))


def test_variables_set_lists_only_moe_gemm_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOE_GEMM_TEST_ENV_SET", "x")
    monkeypatch.setenv("NOT_MOE_GEMM_TEST_ENV", "y")
    got = env_module.variables_set()
    assert got["MOE_GEMM_TEST_ENV_SET"] == "x"
    assert all(k.startswith("MOE_GEMM_") for k in got)



@pytest.mark.parametrize("value", ["off", "OFF", " Off "])
def test_env_switch_takes_off_as_off(path: str, clean: pytest.MonkeyPatch, value: str) -> None:
    # flag_value reads "on" as on; a default-on switch reads "off" as off (MOE_GEMM_FUSED=off).
    os.environ[NAME] = value
    assert env_module.switch_value(NAME, env_get(NAME)) is False


@pytest.mark.parametrize("value", ["banana", "flase", "2", "-1", "enabled", "0 1"])
@pytest.mark.parametrize("reader", ["switch_value", "flag_value", "override_value"])
def test_switch_values_neither_on_nor_off_are_refused(path: str, clean: pytest.MonkeyPatch,
                                                      reader: str, value: str) -> None:
    read = getattr(env_module, reader)
    os.environ[NAME] = value
    with pytest.raises(env_module.EnvError, match=rf"^{NAME}={value!r}: expected one of 1, "
                       r"true, yes, on \(on\) or 0, false, no, off \(off\)$"):
        read(NAME, env_get(NAME))
    assert issubclass(env_module.EnvError, ValueError)


@pytest.mark.parametrize("value,disabled", [("false", False), ("no", False), ("off", False),
                                            ("on", True)])
def test_disable_cute_reads_words_as_the_switches_do(monkeypatch: pytest.MonkeyPatch,
                                                     value: str, disabled: bool) -> None:
    from moe_gemm.capability import cute_problem

    monkeypatch.setenv("MOE_GEMM_DISABLE_CUTE", value)
    assert (cute_problem() == "disabled by MOE_GEMM_DISABLE_CUTE") is disabled


def test_disable_cute_refuses_other_values(monkeypatch: pytest.MonkeyPatch) -> None:
    from moe_gemm.capability import cute_problem

    monkeypatch.setenv("MOE_GEMM_DISABLE_CUTE", "sometimes")
    with pytest.raises(ValueError, match="MOE_GEMM_DISABLE_CUTE='sometimes': expected"):
        cute_problem()


# --------------------------------------------------------------------------------------------
# Every variable: `moe-gemm info`'s verdict and the library's own reader agree

class _OnCuda:
    """A tensor's stand-in for readers that look at their switch for CUDA tensors only."""

    device = torch.device("cuda")


def _choice():
    from moe_gemm.ops.heuristics import KernelChoice

    return KernelChoice("cooperative", "device", 128, 128, 4, False, 1)


def _fused_args(gate: str | None = None):
    from moe_gemm.ops.fused_validation import check_fused_mm

    meta = torch.device("meta")
    return check_fused_mm(
        torch.empty(64, 512, dtype=torch.bfloat16, device=meta),
        torch.empty(4, 512, 256, dtype=torch.bfloat16, device=meta),
        torch.empty(4, dtype=torch.int32, device=meta),
        row_index=torch.empty(128, dtype=torch.int64, device=meta), concrete=False, gate=gate)


def _pdl() -> object:
    """launch_kernel reads MOE_GEMM_PDL when it is imported: import it in a fresh process."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "import moe_gemm.ops.launch_kernel as k; "
                          "print(k.PDL)"], capture_output=True, text=True, timeout=120)
    if out.returncode:
        raise env_module.EnvError(out.stderr.strip().splitlines()[-1].split(": ", 1)[1])
    return int(out.stdout)


def _readers() -> dict[str, object]:
    """The function of the library that reads each variable (called with nothing else set)."""
    from moe_gemm import capability
    from moe_gemm.config import GemmConfig
    from moe_gemm.layers import fused_experts, shared_stream
    from moe_gemm.ops import (
        combine,
        fused_launch,
        heuristics,
        heuristics_fp8,
        kernel_cache,
        quantize,
        router_topk,
        token_gather,
        tuned,
        validation,
    )
    from moe_gemm.tuning import online

    return {
        "MOE_GEMM_DISABLE_CUTE": capability.cute_problem,
        "MOE_GEMM_CACHE_DIR": kernel_cache.cache_root,
        "MOE_GEMM_DISK_CACHE": kernel_cache.disk_cache_enabled,
        "MOE_GEMM_TUNED_TABLE": tuned.state,
        "MOE_GEMM_TUNED_TABLES": tuned.enabled,
        "MOE_GEMM_AUTOTUNE": lambda: online.requested(GemmConfig()),
        "MOE_GEMM_AUTOTUNE_BUDGET_S": lambda: online.requested(GemmConfig()),
        "MOE_GEMM_CHECK_OFFS": validation.offs_check_requested,
        "MOE_GEMM_TAIL_SPLIT": heuristics.tail_split_enabled,
        "MOE_GEMM_SPLIT_WAYS": lambda: heuristics.with_split_ways(_choice()),
        "MOE_GEMM_TRIM_A": lambda: heuristics.with_trim_a(_choice()),
        "MOE_GEMM_PACKED_PAIRS": lambda: heuristics.with_packed_pairs(_choice()),
        "MOE_GEMM_PEEK_WAIT": lambda: heuristics.with_peek_wait(_choice()),
        "MOE_GEMM_SWAP_AB": lambda: heuristics.swap_ab_wanted(GemmConfig(), 4096, 16, 5120, 2),
        "MOE_GEMM_L2_HINTS": lambda: heuristics.with_l2_hints(_choice()),
        "MOE_GEMM_PDL": _pdl,
        # (GroupedGemmPlan reads it so where the kernel runs, on a GPU only)
        "MOE_GEMM_PLAN_GRAPH": lambda: env_module.env_value("MOE_GEMM_PLAN_GRAPH"),
        "MOE_GEMM_FUSED": lambda: fused_experts._kernel_ready("cpu"),
        "MOE_GEMM_FUSED_GATHER": fused_experts._gather_in_kernel,
        "MOE_GEMM_FUSED_GATHER_WIDE": lambda: fused_launch.fused_choice(
            _fused_args(), GemmConfig(), 132, torch.device("meta")),
        "MOE_GEMM_GATHER_FENCE": fused_launch.gather_fence,
        "MOE_GEMM_FUSED_FAST_GATE": lambda: fused_launch.fast_gate(_fused_args("silu"),
                                                                   _choice()),
        "MOE_GEMM_FP8_SCALE_AHEAD": heuristics_fp8.scale_ahead_requested,
        "MOE_GEMM_FP8_SMEM_SCALES": heuristics_fp8.smem_scales_requested,
        "MOE_GEMM_FP8_PROMOTE_LAG": heuristics_fp8.promote_lag_requested,
        "MOE_GEMM_FP8_PEEK_WAIT": heuristics_fp8.peek_wait_requested,
        "MOE_GEMM_FP8_HALF_SKIP": heuristics_fp8.half_skip_requested,
        "MOE_GEMM_FP8_QUANT": lambda: quantize._kernel_ok(_OnCuda()),
        "MOE_GEMM_ROUTER": lambda: router_topk._takes(torch.zeros(2, 4), 2),
        "MOE_GEMM_COMBINE": lambda: combine._kernel_ok(_OnCuda(), None, None),
        "MOE_GEMM_TOKEN_GATHER": lambda: token_gather._kernel_ok(_OnCuda(), None),
        "MOE_GEMM_SHARED_STREAM": lambda: shared_stream.side_stream_wanted(_OnCuda()),
    }


# name: (a value the library refuses, None where it takes any; a value it takes)
VALUES = {
    "MOE_GEMM_DISABLE_CUTE": ("maybe", "yes"),
    "MOE_GEMM_CACHE_DIR": (None, "{tmp}/cache"),
    "MOE_GEMM_DISK_CACHE": ("flase", "off"),
    "MOE_GEMM_TUNED_TABLE": (None, "{tmp}/table.json"),
    "MOE_GEMM_TUNED_TABLES": ("2", "0"),
    "MOE_GEMM_AUTOTUNE": ("always", "true"),
    "MOE_GEMM_AUTOTUNE_BUDGET_S": ("30s", "12.5"),
    "MOE_GEMM_CHECK_OFFS": ("sometimes", "1"),
    "MOE_GEMM_TAIL_SPLIT": ("-1", "0"),
    "MOE_GEMM_SPLIT_WAYS": ("1", "4"),
    "MOE_GEMM_TRIM_A": ("auto", "1"),
    "MOE_GEMM_PACKED_PAIRS": ("packed", "1"),
    "MOE_GEMM_PEEK_WAIT": ("enabled", "On"),
    "MOE_GEMM_SWAP_AB": ("swapped", "0"),
    "MOE_GEMM_L2_HINTS": ("first", " first , last"),
    "MOE_GEMM_PDL": ("2", "1"),
    "MOE_GEMM_PLAN_GRAPH": ("graph", "no"),
    "MOE_GEMM_FUSED": ("flase", "0"),
    "MOE_GEMM_FUSED_GATHER": ("index_select", "false"),
    "MOE_GEMM_FUSED_GATHER_WIDE": ("wide", "1"),
    "MOE_GEMM_GATHER_FENCE": ("fenced", "0"),
    "MOE_GEMM_FUSED_FAST_GATE": ("sfu", "0"),
    "MOE_GEMM_FP8_SCALE_AHEAD": ("5", "2"),
    "MOE_GEMM_FP8_SMEM_SCALES": ("staged", "0"),
    "MOE_GEMM_FP8_PROMOTE_LAG": ("lag", "yes"),
    "MOE_GEMM_FP8_PEEK_WAIT": ("probe", "0"),
    "MOE_GEMM_FP8_HALF_SKIP": ("half", "off"),
    "MOE_GEMM_FP8_QUANT": ("cuda", "torch"),
    "MOE_GEMM_ROUTER": ("torch ops", "KERNEL"),
    "MOE_GEMM_COMBINE": ("embedding_bag", " Torch "),
    "MOE_GEMM_TOKEN_GATHER": ("index_select", "kernel"),
    "MOE_GEMM_SHARED_STREAM": ("side", "0"),
}


def test_every_variable_has_a_reader_and_values_here() -> None:
    assert set(_readers()) == set(VALUES) == set(env_module.VARIABLES)


def _only(mp: pytest.MonkeyPatch, name: str, value: str) -> None:
    for other in [k for k in os.environ if k.startswith("MOE_GEMM_")]:
        mp.delenv(other)
    if name == "MOE_GEMM_AUTOTUNE_BUDGET_S":
        mp.setenv("MOE_GEMM_AUTOTUNE", "1")  # (the budget is read when autotune is on)
    mp.setenv(name, value)


@pytest.mark.parametrize("name", sorted(VALUES))
def test_info_flags_exactly_what_the_reader_refuses(name: str, monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path) -> None:
    """For each variable, a value its reader refuses is flagged by `moe-gemm info` with the
    reader's own message, and a value it takes is neither refused nor flagged."""
    from moe_gemm.cli import info_dict

    bad, good = VALUES[name]
    read = _readers()[name]
    (tmp_path / "table.json").write_text("{}")
    _only(monkeypatch, name, good.format(tmp=tmp_path))
    read()
    assert info_dict()["environment_refused"] == {}
    if bad is None:
        return
    _only(monkeypatch, name, bad)
    with pytest.raises(env_module.EnvError) as refused:
        read()
    assert str(refused.value).startswith(f"{name}={bad!r}: expected")
    assert info_dict()["environment_refused"] == {name: str(refused.value)}


def test_library_modules_read_variables_only_through_the_declarations() -> None:
    """No module interprets a MOE_GEMM_* value itself (os.environ, env_get): each goes through
    env_value / env_value_reader / env_parse (or env_reader's raw values, cache keys only)."""
    import pathlib
    import re

    root = pathlib.Path(env_module.__file__).resolve().parent
    direct = re.compile(r"\benv_get\b|os\.(environ\.get|getenv)\(\s*(\"MOE_GEMM|[A-Z_]*ENV\b)"
                        r"|os\.environ\[\s*(\"MOE_GEMM|[A-Z_]*ENV\b)")
    offenders = [f"{src.relative_to(root)}:{n}" for src in root.rglob("*.py")
                 if src.name != "env.py"
                 for n, line in enumerate(src.read_text().splitlines(), 1)
                 if direct.search(line)]
    assert offenders == []


def test_l2_hint_words_are_the_policies_the_heuristics_encode() -> None:
    from moe_gemm.ops.heuristics import L2_POLICY

    assert set(env_module.L2_HINT_WORDS) == set(L2_POLICY)


def test_refused_variables_are_the_library_values_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # (what every moe-gemm command but info refuses to start with; a name the library does
    # not read is never judged: MOE_GEMM_API_KEY is the server's)
    for name in [k for k in os.environ if k.startswith("MOE_GEMM_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("MOE_GEMM_FUSED", "off")
    monkeypatch.setenv("MOE_GEMM_API_KEY", "maybe")
    assert env_module.refused_variables() == {}
    monkeypatch.setenv("MOE_GEMM_TUNED_TABLES", "maybe")
    assert env_module.refused_variables() == {
        "MOE_GEMM_TUNED_TABLES": env_module.refusal("MOE_GEMM_TUNED_TABLES", "maybe")}


def test_refusal_names_nothing_for_values_taken() -> None:
    assert env_module.refusal("MOE_GEMM_FUSED", "off") is None
    assert env_module.refusal("MOE_GEMM_FUSED", "") is None
    assert env_module.refusal("MOE_GEMM_FP8_SCALE_AHEAD", "0") == (
        "MOE_GEMM_FP8_SCALE_AHEAD='0': expected an integer from 1 to 4 (or unset)")
    with pytest.raises(KeyError):
        env_module.env_value("MOE_GEMM_NOT_DECLARED")


def test_l2_hints_read_blank_as_unset_and_words_in_any_case() -> None:
    # (a blank value was refused and First,LAST was, where every other variable takes both)
    read = env_module.l2_hints_value
    assert read("MOE_GEMM_L2_HINTS", " ") is None and read("MOE_GEMM_L2_HINTS", "") is None
    assert read("MOE_GEMM_L2_HINTS", "First, LAST") == ("first", "last")
    with pytest.raises(env_module.EnvError, match="expected 'a,b'"):
        read("MOE_GEMM_L2_HINTS", "first")


def test_paths_expand_a_tilde_and_read_blank_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    # (" " was a cache folder named " " in the working directory, "~/x" a folder named "~")
    from moe_gemm.ops import kernel_cache

    monkeypatch.setenv("HOME", "/home/someone")
    assert env_module.text_value("MOE_GEMM_CACHE_DIR", "~/kc") == "/home/someone/kc"
    assert env_module.text_value("MOE_GEMM_CACHE_DIR", " ") is None
    monkeypatch.setenv("MOE_GEMM_CACHE_DIR", "~/kc")
    assert str(kernel_cache.cache_root()) == "/home/someone/kc"
    monkeypatch.setenv("MOE_GEMM_CACHE_DIR", "  ")
    assert kernel_cache.cache_root() == kernel_cache.Path.home() / ".cache" / "moe_gemm"
