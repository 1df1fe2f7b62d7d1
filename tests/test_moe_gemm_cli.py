"""The `moe-gemm` command (moe_gemm/cli.py) and the light `import moe_gemm`.

--help and --version must not import torch (it costs seconds); the lazy package must still
offer every public name exactly as an eager import did.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import moe_gemm
from moe_gemm import cli
from moe_gemm._version import __version__

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "numpy", "cutlass", "tvm_ffi", "moe_gemm.ops", "moe_gemm.layers")


def _run(*code_or_args: str, module: bool = True) -> subprocess.CompletedProcess[str]:
    """`python -X importtime -m moe_gemm.cli ARGS` (or `-c CODE`) in a fresh interpreter."""
    cmd = [sys.executable, "-X", "importtime"]
    cmd += ["-m", "moe_gemm.cli", *code_or_args] if module else ["-c", *code_or_args]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)


def _imported(stderr: str) -> set[str]:
    """Module names from -X importtime's lines ("import time: self | cumulative | name")."""
    names = set()
    for line in stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            name = line.rsplit("|", 1)[1].strip()
            if name != "imported package":  # the header line
                names.add(name)
    return names


def _heavy(names: set[str]) -> set[str]:
    return {n for n in names if any(n == h or n.startswith(h + ".") for h in HEAVY)}


def _program_stderr(stderr: str) -> str:
    return "\n".join(ln for ln in stderr.splitlines() if not ln.startswith("import time:"))


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["info", "--help"],
                                  ["check", "--help"], ["demo", "--help"], []])
def test_help_and_version_import_no_torch(args: list[str]) -> None:
    out = _run(*args)
    names = _imported(out.stderr)
    assert {"moe_gemm", "moe_gemm._version", "argparse"} <= names  # the probe sees imports
    assert not _heavy(names), sorted(_heavy(names))
    assert out.returncode == (2 if not args else 0), out  # no command: usage error
    if not args:
        assert "required: COMMAND" in _program_stderr(out.stderr)


def test_version_prints_the_package_version() -> None:
    out = _run("--version")
    assert out.stdout.strip() == f"moe-gemm {__version__}"
    assert moe_gemm.__version__ == __version__
    assert __version__.count(".") >= 1 and all(p.isdigit() for p in __version__.split(".")[:2])


def test_pyproject_reads_the_version_from_the_light_module() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert 'version = { attr = "moe_gemm._version.__version__" }' in text
    assert 'moe-gemm = "moe_gemm.cli:main"' in text


def test_help_names_every_command_and_says_what_demo_does() -> None:
    out = _run("--help")
    for command in ("info", "check", "demo", "bench", "tune"):
        assert f"\n    {command} " in out.stdout, command
    assert "float32 reference" in out.stdout and "install works" in out.stdout
    demo = _run("demo", "--help").stdout
    assert "GPU if there is one, else on the CPU" in demo and "grouped_mm" in demo


def test_tune_dispatches_to_the_tuning_module(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    fake = types.ModuleType("moe_gemm.tuning.cli")
    fake.main = lambda argv: seen.append(argv) or 3  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "moe_gemm.tuning", types.ModuleType("moe_gemm.tuning"))
    monkeypatch.setitem(sys.modules, "moe_gemm.tuning.cli", fake)
    assert cli.main(["tune", "--shapes", "mixtral", "--help"]) == 3
    assert seen == [["--shapes", "mixtral", "--help"]]
    fake.main = lambda argv: None  # type: ignore[attr-defined]
    assert cli.main(["tune"]) == 0


def test_tune_without_the_tuning_module_says_so_in_one_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "moe_gemm.tuning", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "moe_gemm.tuning.cli", raising=False)
    assert cli.main(["tune", "--help"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "moe-gemm tune: not available" in err
    assert "moe_gemm.tuning" in err


def test_tune_missing_module_in_a_fresh_process() -> None:
    if importlib.util.find_spec("moe_gemm.tuning") is not None:
        pytest.skip("moe_gemm.tuning is installed here; the dispatch test covers it")
    out = _run("tune", "--shapes", "x")
    err = _program_stderr(out.stderr)
    assert out.returncode == 2 and "Traceback" not in err
    assert err.strip().startswith("moe-gemm tune: not available") and err.count("\n") == 0


def test_tune_keeps_the_traceback_of_a_broken_tuning_module(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # A tuning module that exists but needs something missing is a real error, not "absent".
    (tmp_path / "tuning").mkdir()
    (tmp_path / "tuning/__init__.py").write_text("")
    (tmp_path / "tuning/cli.py").write_text("import a_dependency_that_is_not_there_9f3\n")
    monkeypatch.setattr(moe_gemm, "__path__", [str(tmp_path), *moe_gemm.__path__])
    # Each entry set (recording what was there, or that nothing was) before it is removed,
    # so the broken package the import leaves in sys.modules and on moe_gemm.tuning is undone
    # after the test even where the real one had not been imported yet.
    for name in ("moe_gemm.tuning", "moe_gemm.tuning.cli"):
        monkeypatch.setitem(sys.modules, name, None)
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(moe_gemm, "tuning", None, raising=False)
    monkeypatch.delattr(moe_gemm, "tuning")
    with pytest.raises(ModuleNotFoundError, match="a_dependency_that_is_not_there_9f3"):
        cli.main(["tune"])


def test_a_command_without_torch_says_so_in_one_line() -> None:
    code = ("import sys; sys.modules['torch'] = None\n"
            "from moe_gemm.cli import main\n"
            "sys.exit(main(['info']))")
    out = _run(code, module=False)
    err = _program_stderr(out.stderr)
    assert out.returncode == 2 and "Traceback" not in err, err
    assert "moe-gemm info: needs torch" in err


def test_demo_runs_and_checks_its_results(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "grouped_gemm: 4 problems" in out and "rows past offs[-1] zero: True" in out
    assert out.rstrip().endswith("ok")


@pytest.mark.parametrize("broken", ["grouped_gemm", "grouped_mm"])
def test_demo_fails_on_wrong_results(broken: str, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    # A check of the install: results off by more than bf16 rounding are exit 1, not "0.248".
    import moe_gemm

    real = getattr(moe_gemm, broken)

    def off(*args, **kwargs):
        res = real(*args, **kwargs)
        if isinstance(res, list):
            return [r * 1.05 for r in res]
        return res * 1.05

    monkeypatch.setattr(moe_gemm, broken, off)
    assert cli.main(["demo"]) == 1
    assert "moe-gemm demo: FAILED" in capsys.readouterr().err


def test_info_json(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    assert cli.main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["moe_gemm"] == __version__ and info["auto_picks"] in ("cute", "torch")


def test_info_shows_the_library_variables_set_and_hides_other_values(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A MOE_GEMM_* variable the library reads is shown with its value and what it does;
    any other one (the server's API keys, a typo) only by name."""
    import json

    for name in [k for k in os.environ if k.startswith("MOE_GEMM_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("MOE_GEMM_FP8_SCALE_AHEAD", "2")
    monkeypatch.setenv("MOE_GEMM_API_KEY", "s3cret-value")
    monkeypatch.setenv("MOE_GEMM_TAIL_SPLT", "0")
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "MOE_GEMM_FP8_SCALE_AHEAD=2  (1-4: stages ahead" in out
    assert "not read by the library: MOE_GEMM_API_KEY, MOE_GEMM_TAIL_SPLT" in out
    assert "s3cret-value" not in out
    assert cli.main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["environment"] == {"MOE_GEMM_FP8_SCALE_AHEAD": "2"}
    assert info["environment_other"] == ["MOE_GEMM_API_KEY", "MOE_GEMM_TAIL_SPLT"]


def test_bench_outside_a_checkout_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    # An installed package has no benchmarks/ beside it: cli.py resolves the root from its file.
    fake_pkg = tmp_path / "site/moe_gemm"
    fake_pkg.mkdir(parents=True)
    monkeypatch.setattr(cli, "__file__", str(fake_pkg / "cli.py"))
    assert cli.cmd_bench(["--list"]) == 2
    assert "runs from a checkout" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# import moe_gemm: light, and the same public API as an eager import


def test_import_moe_gemm_is_light_until_a_public_name_is_used() -> None:
    out = _run("import moe_gemm; print(moe_gemm.__version__)", module=False)
    assert out.returncode == 0 and out.stdout.strip() == __version__
    assert not _heavy(_imported(out.stderr)), sorted(_heavy(_imported(out.stderr)))
    out = _run("import moe_gemm; moe_gemm.grouped_mm", module=False)
    assert out.returncode == 0 and {"torch", "moe_gemm.ops.api"} <= _imported(out.stderr)


def test_star_import_and_every_public_name() -> None:
    code = ("from moe_gemm import *\n"
            "import moe_gemm\n"
            "names = [n for n in moe_gemm.__all__ if n != '__version__']\n"
            "missing = [n for n in names if n not in globals()]\n"
            "assert not missing, missing\n"
            "assert grouped_mm is moe_gemm.grouped_mm and MoE is moe_gemm.MoE\n"
            "from moe_gemm.ops.api import grouped_gemm as g\n"
            "assert g is grouped_gemm\n"
            "assert set(moe_gemm.__all__) <= set(dir(moe_gemm))\n"
            # Submodules the ops load stay attributes, as after an eager import.
            "assert moe_gemm.ops.reference.grouped_mm_ref and moe_gemm.layers.routing\n"
            "print(len(names))")
    out = _run(code, module=False)
    assert out.returncode == 0, _program_stderr(out.stderr)
    assert int(out.stdout) == len(moe_gemm.__all__) - 1 >= 11


def test_unknown_and_dunder_names_raise_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        moe_gemm.not_a_name  # noqa: B018
    assert not hasattr(moe_gemm, "__wrapped__")
    out = _run("import moe_gemm; assert not hasattr(moe_gemm, '__wrapped__'); "
               "assert not hasattr(moe_gemm, '__test__'); print('ok')", module=False)
    assert out.stdout.strip() == "ok" and "torch" not in _imported(out.stderr)


def test_first_use_from_many_threads_sees_one_api() -> None:
    code = ("import threading, moe_gemm\n"
            "got, errors = [], []\n"
            "def use():\n"
            "    try:\n"
            "        got.append((moe_gemm.grouped_mm, moe_gemm.GemmConfig, moe_gemm.MoE))\n"
            "    except Exception as exc:\n"
            "        errors.append(repr(exc))\n"
            "ts = [threading.Thread(target=use) for _ in range(16)]\n"
            "[t.start() for t in ts]; [t.join() for t in ts]\n"
            "assert not errors, errors\n"
            "assert len(got) == 16 and len(set(got)) == 1\n"
            "print('ok')")
    out = _run(code, module=False)
    assert out.stdout.strip() == "ok", _program_stderr(out.stderr)


def test_a_failed_first_use_fails_again_not_silently() -> None:
    code = ("import sys; sys.modules['torch'] = None\n"
            "import moe_gemm\n"
            "for _ in range(2):\n"
            "    try:\n"
            "        moe_gemm.grouped_mm\n"
            "    except ImportError as exc:\n"
            "        print(type(exc).__name__)\n")
    out = _run(code, module=False)
    assert out.stdout.split() == ["ModuleNotFoundError", "ModuleNotFoundError"], out



@pytest.mark.parametrize("command", [["moe_gemm.cli", "tune"], ["moe_gemm.tuning"]],
                         ids=["moe-gemm-tune", "python-m-moe_gemm.tuning"])
def test_a_closed_stdout_ends_quietly(command) -> None:
    """`moe-gemm tune --list --zoo | head -1` ended with a BrokenPipeError traceback and exit 1:
    now it stops as a command that SIGPIPE ends does (141), saying nothing; `python -m
    moe_gemm.tuning` too."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    proc = subprocess.Popen([sys.executable, "-m", *command, "--list", "--zoo"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the first write: every write fails
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == cli.SIGPIPE_EXIT
    assert err == ""



@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("command", [["moe_gemm.cli", "info", "--json"],
                                     ["moe_gemm.cli", "tune", "--list", "--zoo"]],
                         ids=["info", "tune-list"])
def test_output_that_cannot_be_written_is_one_line_and_exit_1(command) -> None:
    """`moe-gemm info --json > /dev/full` ended in an OSError traceback: now one line naming
    the failure, exit 1."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    with open("/dev/full", "w") as full:
        out = subprocess.run([sys.executable, "-m", *command], stdout=full,
                             stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT, timeout=120)
    assert out.returncode == 1, out.stderr
    assert out.stderr == f"moe-gemm {command[1]}: No space left on device\n", out.stderr


def test_a_bad_switch_value_is_one_line_and_exit_2(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("MOE_GEMM_DISABLE_CUTE", "maybe")
    assert cli.main(["demo"]) == 2
    captured = capsys.readouterr()
    assert captured.err == ("moe-gemm demo: MOE_GEMM_DISABLE_CUTE='maybe': expected one of 1, "
                            "true, yes, on (on) or 0, false, no, off (off)\n")
    assert captured.out == ""


def test_check_without_the_dsl_names_the_command(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Its one line began "check:", where every other command's says "moe-gemm COMMAND:"."""
    from moe_gemm import capability

    monkeypatch.setattr(capability, "cutlass_dsl_problem", lambda: "the DSL is missing")
    assert cli.main(["check"]) == 2
    assert capsys.readouterr().err == "moe-gemm check: cannot compile: the DSL is missing\n"


@pytest.mark.parametrize("arch", ["sm_80", "bogus"])
def test_check_under_another_target_is_one_line(arch: str, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A CUTE_DSL_ARCH other than sm_90a failed every variant alike (101 errors, exit 1, read
    as kernel regressions): one line naming the variable, exit 2, before any compile."""
    monkeypatch.setenv("CUTE_DSL_ARCH", arch)
    assert cli.main(["check"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"CUTE_DSL_ARCH is {arch!r}" in err


def test_info_prints_everything_and_marks_each_refused_variable(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A refused MOE_GEMM_DISABLE_CUTE stopped `info` with one line and nothing else: now it
    prints every line, marks each variable the library would refuse with the reader's message
    (in the JSON too) and exits 1."""
    import json

    for name in [k for k in os.environ if k.startswith("MOE_GEMM_")]:
        monkeypatch.delenv(name)
    refused = {
        "MOE_GEMM_DISABLE_CUTE": "MOE_GEMM_DISABLE_CUTE='maybe': expected one of 1, true, yes, "
                                 "on (on) or 0, false, no, off (off)",
        "MOE_GEMM_FP8_SCALE_AHEAD": "MOE_GEMM_FP8_SCALE_AHEAD='9': expected an integer from 1 "
                                    "to 4 (or unset)",
        "MOE_GEMM_L2_HINTS": "MOE_GEMM_L2_HINTS='first': expected 'a,b' (A's and B's policy), "
                             "each one of first, normal, last",
    }
    for name, message in refused.items():
        monkeypatch.setenv(name, message.split("'")[1])
    monkeypatch.setenv("MOE_GEMM_FUSED", "off")  # taken: shown, not marked
    assert cli.main(["info"]) == 1
    captured = capsys.readouterr()
    out = captured.out.splitlines()
    assert out[0].startswith(f"moe_gemm {__version__}") and out[1].startswith("device:")
    assert "backend cute  not usable: MOE_GEMM_DISABLE_CUTE is set to a value the library " \
           "refuses" in out
    assert "backend='auto' uses: nothing: every op refuses the environment" in out
    for name, message in refused.items():
        shown = out.index(next(ln for ln in out if ln.startswith(f"env      {name}=")))
        assert out[shown + 1] == f"         REFUSED: {message}"
    fused = out.index(next(ln for ln in out if ln.startswith("env      MOE_GEMM_FUSED=off")))
    assert not out[fused + 1].lstrip().startswith("REFUSED")
    assert captured.err == ("moe-gemm info: the library refuses " + ", ".join(sorted(refused))
                            + " (see REFUSED above)\n")
    assert cli.main(["info", "--json"]) == 1
    info = json.loads(capsys.readouterr().out)
    assert info["environment_refused"] == refused and info["auto_picks"] is None
    assert info["environment"]["MOE_GEMM_FUSED"] == "off"


def test_info_with_every_value_taken_exits_0(monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    import json

    for name in [k for k in os.environ if k.startswith("MOE_GEMM_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("MOE_GEMM_DISABLE_CUTE", "1")
    assert cli.main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["environment_refused"] == {} and info["auto_picks"] == "torch"
    assert cli.main(["info"]) == 0
    captured = capsys.readouterr()
    assert "REFUSED" not in captured.out and captured.err == ""


@pytest.mark.parametrize("full", [False, True])
def test_check_lines_name_every_variant_apart(full: bool) -> None:
    """`moe-gemm check` prints one line per variant: two variants (e.g. FP8 keys that differ
    only in promote_lag, scale_ahead or smem_scales) must not read alike, or a FAIL line
    cannot be traced to its variant."""
    keys = cli.check_variants(full)
    assert len({cli.check_label(k) for k in keys}) == len(set(keys))


def test_python_dash_m_moe_gemm_is_the_command() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    run = [sys.executable, "-X", "importtime", "-m", "moe_gemm"]
    out = subprocess.run([*run, "--version"], capture_output=True, text=True, timeout=120,
                         env=env, cwd=ROOT)
    assert out.returncode == 0 and __version__ in out.stdout, out
    assert not _heavy(_imported(out.stderr))
    bad = subprocess.run([*run, "no-such-command"], capture_output=True, text=True,
                         timeout=120, env=env, cwd=ROOT)
    assert bad.returncode == 2 and "no-such-command" in _program_stderr(bad.stderr), bad


def _only(monkeypatch: pytest.MonkeyPatch, **values: str) -> None:
    """The library's variables set to `values` alone (whatever this machine's shell set)."""
    for name in [k for k in os.environ if k.startswith("MOE_GEMM_")]:
        monkeypatch.delenv(name)
    for name, value in values.items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("argv", [["demo"], ["check"], ["tune", "--list"], ["bench", "--list"]])
def test_every_command_refuses_a_value_the_library_refuses(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        argv: list[str]) -> None:
    # `MOE_GEMM_TUNED_TABLES=maybe moe-gemm demo` exited 0 on a CPU (no table is read there)
    # while `info` flagged the value and every GPU call would refuse it.
    _only(monkeypatch, MOE_GEMM_TUNED_TABLES="maybe", MOE_GEMM_SPLIT_WAYS="1")
    monkeypatch.setitem(sys.modules, "moe_gemm.tuning.cli", None)  # (never reached)
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err == (
        f"moe-gemm {argv[0]}: MOE_GEMM_SPLIT_WAYS='1': expected an integer from 2 to 16 (or "
        "unset); MOE_GEMM_TUNED_TABLES='maybe': expected one of 1, true, yes, on (on) or 0, "
        "false, no, off (off)\n")
    assert captured.out == ""


@pytest.mark.parametrize("argv", [["tune", "--help"], ["tune", "-h"], ["bench", "--hel"],
                                  ["bench", "--suite", "zoo", "--help"]])
def test_bench_and_tune_help_answer_whatever_is_set(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        argv: list[str]) -> None:
    # Their help was refused (one line, exit 2) under a refused MOE_GEMM_* value, while every
    # other command's help answered.
    _only(monkeypatch, MOE_GEMM_TUNED_TABLES="maybe")
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 0 and f"usage: moe-gemm {argv[0]}" in capsys.readouterr().out


def test_a_help_word_after_the_options_end_is_an_argument() -> None:
    assert cli._asks_help(["--list", "-h"]) and cli._asks_help(["--he"])
    assert not cli._asks_help(["--", "--help"]) and not cli._asks_help(["--hx", "-"])


def test_help_answers_and_info_reports_whatever_is_set(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _only(monkeypatch, MOE_GEMM_TUNED_TABLES="maybe")
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--help"])
    assert e.value.code == 0 and "usage: moe-gemm demo" in capsys.readouterr().out
    assert cli.main(["info"]) == 1  # (info marks the value and goes on)
    assert "REFUSED: MOE_GEMM_TUNED_TABLES='maybe'" in capsys.readouterr().out
    monkeypatch.setenv("MOE_GEMM_TUNED_TABLES", "off")
    assert cli.main(["demo"]) == 0


def test_info_notes_a_tuned_table_path_that_does_not_exist(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    # A mistyped MOE_GEMM_TUNED_TABLE is not refused (the lookup warns and goes on), but info
    # showed it as if it were read.
    _only(monkeypatch, MOE_GEMM_TUNED_TABLE=str(tmp_path / "typo.json"))
    assert cli.main(["info"]) == 0
    assert "NOTE: no such file, not a table" in capsys.readouterr().out
    _only(monkeypatch, MOE_GEMM_TUNED_TABLE=str(tmp_path))
    assert cli.main(["info"]) == 0
    assert "NOTE: a folder, not a table" in capsys.readouterr().out
    _only(monkeypatch, MOE_GEMM_TUNED_TABLE=str(tmp_path / "typo.json"))
    (tmp_path / "typo.json").write_text("{}")
    assert cli.main(["info"]) == 0
    assert "NOTE" not in capsys.readouterr().out
    if os.path.exists("/dev/null"):  # (it exists; it is not a file that holds a table)
        _only(monkeypatch, MOE_GEMM_TUNED_TABLE="/dev/null")
        assert cli.main(["info"]) == 0
        assert "NOTE: a device or other special file, not a table" in capsys.readouterr().out


def test_info_prints_a_value_that_is_not_text_as_its_escapes() -> None:
    # Bytes the locale cannot decode arrive as surrogates: printed raw on a strict stdout,
    # a UnicodeEncodeError traceback instead of the REFUSED line.
    env = {**os.environ, "MOE_GEMM_SWAP_AB": "\udcff", "PYTHONIOENCODING": "utf-8:strict"}
    done = subprocess.run([sys.executable, "-m", "moe_gemm", "info"], env=env,
                          capture_output=True, text=True, timeout=120,
                          encoding="utf-8", errors="backslashreplace")
    assert done.returncode == 1, done.stderr
    assert "MOE_GEMM_SWAP_AB=\\udcff" in done.stdout
    assert "REFUSED: MOE_GEMM_SWAP_AB='\\udcff'" in done.stdout
    assert "Traceback" not in done.stderr


def test_bench_puts_the_checkout_on_its_child_processes_path(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # `--isolate` and the zoo's `--gpus` run `python -m benchmarks...`: from another working
    # folder they found no `benchmarks` module and reported every shape failed.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    seen = {}
    from benchmarks import bench as bench_module

    monkeypatch.setattr(bench_module, "main", lambda argv: seen.setdefault("argv", argv) and 0)
    assert cli.cmd_bench(["--list"]) == 0
    root = str(Path(cli.__file__).resolve().parents[1])
    assert os.environ["PYTHONPATH"].split(os.pathsep) == [root, "/elsewhere"]
    child = subprocess.run([sys.executable, "-c", "import benchmarks.bench"],
                           capture_output=True, text=True, cwd=tmp_path)
    assert child.returncode == 0, child.stderr
