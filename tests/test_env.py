"""moe_gemm.env.env_get: the same answer as os.environ.get, for every way the environment changes.

env_get reads os.environ's underlying bytes mapping on POSIX (to skip the per-call encode and
decode); these tests pin that it never drifts from os.environ.get. Every variable here has a
MOE_GEMM_TEST_ENV_ prefix and is removed again by monkeypatch.
"""

from __future__ import annotations

import os

import pytest

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
    from moe_gemm.env import env_switch

    if value is not None:
        os.environ[NAME] = value
    assert env_switch(NAME) is on


@pytest.mark.parametrize("value,on", [(None, False), ("", False), ("0", False), ("no", False),
                                      ("1", True), ("true", True), (" Yes ", True), ("ON", True)])
def test_env_flag_default_off(path: str, clean: pytest.MonkeyPatch, value, on: bool) -> None:
    from moe_gemm.env import env_flag

    if value is not None:
        os.environ[NAME] = value
    assert env_flag(NAME) is on


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
    # env_flag reads "on" as on; a default-on switch reads "off" as off (MOE_GEMM_FUSED=off).
    from moe_gemm.env import env_switch

    os.environ[NAME] = value
    assert env_switch(NAME) is False


@pytest.mark.parametrize("value", ["banana", "flase", "2", "-1", "enabled", "0 1"])
@pytest.mark.parametrize("reader", ["env_switch", "env_flag"])
def test_switch_values_neither_on_nor_off_are_refused(path: str, clean: pytest.MonkeyPatch,
                                                      reader: str, value: str) -> None:
    read = getattr(env_module, reader)
    os.environ[NAME] = value
    with pytest.raises(env_module.EnvError, match=rf"^{NAME}={value!r}: expected one of 1, "
                       r"true, yes, on \(on\) or 0, false, no, off \(off\)$"):
        read(NAME)
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
