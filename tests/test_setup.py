"""The install path of README.md: scripts/install_torch.py's choice of torch, scripts/setup.sh,
and the Makefile's environment choice and setup stamp.

Nothing here installs torch: the torch step runs for real up to pip's command line, which
--dry-run prints. The machine is faked where it must be (a fake `nvidia-smi` on PATH, a fake
/dev, an index on a local port that answers or refuses), never the decision code.
"""

from __future__ import annotations

import http.server
import importlib.util
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import venv
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# scripts/ is not a package: load the script as a module (registered, for its dataclass).
SPEC = importlib.util.spec_from_file_location("setup_install_torch",
                                              ROOT / "scripts/install_torch.py")
assert SPEC is not None and SPEC.loader is not None
it = importlib.util.module_from_spec(SPEC)
sys.modules[SPEC.name] = it
SPEC.loader.exec_module(it)


# --------------------------------------------------------------------------------------------
# Fakes of the machine: indexes, GPUs, a Python without torch


@pytest.fixture()
def cpu_index(tmp_path: Path) -> Iterator[str]:
    """A PEP 503 index on a local port that lists torch (stands in for the CPU index)."""
    (tmp_path / "idx/torch").mkdir(parents=True)
    (tmp_path / "idx/torch/index.html").write_text("<a href='x.whl'>x.whl</a>")
    handler = type("Quiet", (http.server.SimpleHTTPRequestHandler,),
                   {"log_message": lambda *a: None})
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), lambda *a: handler(*a, directory=str(tmp_path / "idx")))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture()
def dead_index() -> str:
    """An index URL on a local port nobody listens on: connection refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/whl/cpu"


@pytest.fixture()
def no_gpu(tmp_path: Path) -> dict[str, str]:
    """decide() arguments for a machine without NVIDIA: an empty PATH dir and an empty /dev."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "dev").mkdir()
    return {"path": str(tmp_path / "bin"), "dev_dir": str(tmp_path / "dev")}


def _fake_nvidia_smi(bindir: Path) -> None:
    bindir.mkdir(exist_ok=True)
    smi = bindir / "nvidia-smi"
    smi.write_text("#!/bin/sh\nexit 0\n")
    smi.chmod(0o755)


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A fresh venv's python: pip (for setup.sh's check) but no torch."""
    env_dir = tmp_path_factory.mktemp("bare-venv")
    venv.create(env_dir, with_pip=True)
    return str(env_dir / "bin/python")


def _clean_env(bindir: Path, **extra: str) -> dict[str, str]:
    """The environment for a subprocess: PATH only `bindir` (plus bash's helpers linked in),
    none of this process's Python settings."""
    bindir.mkdir(exist_ok=True)
    for tool in ("dirname",):
        found = shutil.which(tool)
        assert found, tool
        if not (bindir / tool).exists():
            (bindir / tool).symlink_to(found)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "MOE_GEMM_TORCH", "VIRTUAL_ENV"))}
    env.update(PATH=str(bindir), **extra)
    return env


# --------------------------------------------------------------------------------------------
# install_torch.decide: each branch


def test_installed_torch_is_kept_whatever_its_build(monkeypatch: pytest.MonkeyPatch,
                                                    no_gpu: dict[str, str],
                                                    dead_index: str) -> None:
    for version in ("2.13.0+cpu", "2.9.0+cu128", "2.10.0a0+git1234", "3.0.0"):
        monkeypatch.setattr(it, "installed_torch", lambda v=version: v)
        plan = it.decide(cpu_index=dead_index, **no_gpu)
        assert plan.action == "keep" and version in plan.reason, (version, plan)
        assert plan.pip_args == []
    # ...even when the machine would get another build.
    _fake_nvidia_smi(Path(no_gpu["path"]))
    assert it.decide(cpu_index=dead_index, **no_gpu).action == "keep"


def test_too_old_torch_is_replaced(monkeypatch: pytest.MonkeyPatch, no_gpu: dict[str, str],
                                   cpu_index: str) -> None:
    monkeypatch.setattr(it, "installed_torch", lambda: "2.5.1+cu121")
    plan = it.decide(cpu_index=cpu_index, **no_gpu)
    assert plan.action == "install" and "2.5.1+cu121" in plan.reason and ">= 2.9" in plan.reason
    assert plan.pip_args == [f"torch=={it.TORCH_PIN}", "--index-url", cpu_index]


def test_no_gpu_takes_the_cpu_index_when_it_answers(monkeypatch: pytest.MonkeyPatch,
                                                    no_gpu: dict[str, str],
                                                    cpu_index: str) -> None:
    monkeypatch.setattr(it, "installed_torch", lambda: None)
    plan = it.decide(cpu_index=cpu_index, **no_gpu)
    assert (plan.action, plan.build, plan.warning) == ("install", "cpu", "")
    assert plan.pip_args == [f"torch=={it.TORCH_PIN}", "--index-url", cpu_index]
    # The environment variable names a mirror the same way.
    monkeypatch.setenv(it.CPU_INDEX_ENV, cpu_index)
    assert it.decide(**no_gpu).pip_args[-1] == cpu_index


def test_no_gpu_falls_back_to_the_configured_index(monkeypatch: pytest.MonkeyPatch,
                                                   no_gpu: dict[str, str],
                                                   dead_index: str, cpu_index: str) -> None:
    monkeypatch.setattr(it, "installed_torch", lambda: None)
    plan = it.decide(cpu_index=dead_index, **no_gpu)
    assert (plan.action, plan.build) == ("install", "configured index")
    assert plan.pip_args == [f"torch=={it.TORCH_PIN}"]  # no --index-url: pip's configuration
    assert "not reachable" in plan.reason and dead_index in plan.reason
    assert it.CPU_INDEX_ENV in plan.warning and "CUDA" in plan.warning
    # An index that answers but does not list torch is as good as none.
    plan = it.decide(cpu_index=cpu_index + "/elsewhere", **no_gpu)
    assert plan.build == "configured index" and "HTTP 404" in plan.reason


def test_gpu_takes_the_configured_index(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                        no_gpu: dict[str, str], cpu_index: str) -> None:
    monkeypatch.setattr(it, "installed_torch", lambda: None)
    # nvidia-smi on PATH...
    _fake_nvidia_smi(Path(no_gpu["path"]))
    plan = it.decide(cpu_index=cpu_index, **no_gpu)
    assert (plan.build, plan.pip_args) == ("cuda", [f"torch=={it.TORCH_PIN}"])
    assert "nvidia-smi" in plan.reason
    # ...or, without it (a container given a GPU), the device nodes.
    (tmp_path / "dev2").mkdir()
    (tmp_path / "dev2/nvidia0").write_text("")
    plan = it.decide(path=str(tmp_path / "empty"), dev_dir=str(tmp_path / "dev2"),
                     cpu_index=cpu_index)
    assert plan.build == "cuda" and "nvidia0" in plan.reason
    # nvidiactl alone (driver loaded, no device) is not a GPU.
    (tmp_path / "dev3").mkdir()
    (tmp_path / "dev3/nvidiactl").write_text("")
    assert it.nvidia_gpu(str(tmp_path / "empty"), str(tmp_path / "dev3")) is None


def test_build_override(monkeypatch: pytest.MonkeyPatch, no_gpu: dict[str, str],
                        cpu_index: str) -> None:
    monkeypatch.setattr(it, "installed_torch", lambda: None)
    assert it.decide(cpu_index=cpu_index, build="cuda", **no_gpu).build == "cuda"
    _fake_nvidia_smi(Path(no_gpu["path"]))
    assert it.decide(cpu_index=cpu_index, build="cpu", **no_gpu).build == "cpu"
    monkeypatch.setenv(it.BUILD_ENV, "CPU")
    assert it.decide(cpu_index=cpu_index, **no_gpu).build == "cpu"
    with pytest.raises(ValueError, match="MOE_GEMM_TORCH_BUILD must be auto, cpu or cuda"):
        it.decide(cpu_index=cpu_index, build="rocm", **no_gpu)


def test_version_tuple() -> None:
    assert it.version_tuple("2.13.0+cpu") == (2, 13, 0)
    assert it.version_tuple("2.10.0a0+git1234") == (2, 10, 0)
    assert it.version_tuple("2.9.0rc1") == (2, 9, 0)
    assert it.version_tuple("2.9") == (2, 9)
    assert it.version_tuple("2.8.1") < it.MIN_TORCH <= it.version_tuple("2.9.0")


def test_pins_agree_with_pyproject() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    floor = re.search(r'"torch>=([0-9.]+)"', text)
    assert floor, "pyproject.toml must require torch>=X.Y"
    assert it.version_tuple(floor.group(1)) == it.MIN_TORCH
    assert it.version_tuple(it.TORCH_PIN) >= it.MIN_TORCH


# --------------------------------------------------------------------------------------------
# The scripts as setup runs them (subprocesses, a Python without torch)


def test_install_torch_script_in_a_python_without_torch(bare_python: str, tmp_path: Path,
                                                        dead_index: str) -> None:
    env = _clean_env(tmp_path / "bin")
    out = subprocess.run([bare_python, str(ROOT / "scripts/install_torch.py"), "--dry-run",
                          "--cpu-index", dead_index, "--dev-dir", str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "torch is not installed; no NVIDIA GPU" in out.stdout
    assert f"would run: {bare_python} -m pip install" in out.stdout
    assert out.stdout.rstrip().endswith(f"torch=={it.TORCH_PIN}")
    assert "--index-url" not in out.stdout and it.CPU_INDEX_ENV in out.stderr


def test_setup_sh_dry_run_with_an_unreachable_cpu_index(bare_python: str, tmp_path: Path,
                                                        dead_index: str) -> None:
    env = _clean_env(tmp_path / "bin", PYTHON=bare_python, MOE_GEMM_TORCH_BUILD="cpu",
                     MOE_GEMM_TORCH_CPU_INDEX=dead_index)
    out = subprocess.run(["/bin/bash", str(ROOT / "scripts/setup.sh"), "--dry-run"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any("CPU-only index cannot be used" in ln and dead_index in ln for ln in lines)
    assert f"torch: would run: {bare_python} -m pip install -q --disable-pip-version-check " \
           f"torch=={it.TORCH_PIN}" in lines
    assert lines[-1].startswith(f"packages: would run: {bare_python} -m pip install")
    assert '-e .[dev,bench] -e ./client -e ./server[test]' in lines[-1]


def test_setup_sh_dry_run_with_a_gpu(bare_python: str, tmp_path: Path,
                                     cpu_index: str) -> None:
    _fake_nvidia_smi(tmp_path / "bin")
    env = _clean_env(tmp_path / "bin", PYTHON=bare_python, MOE_GEMM_TORCH_CPU_INDEX=cpu_index)
    out = subprocess.run(["/bin/bash", str(ROOT / "scripts/setup.sh"), "--dry-run"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"nvidia-smi found at {tmp_path / 'bin/nvidia-smi'}" in out.stdout
    assert out.stdout.count("--index-url") == 0


def test_setup_sh_refuses_a_python_without_pip_or_too_old(tmp_path: Path) -> None:
    bare = tmp_path / "nopip"
    venv.create(bare, with_pip=False)
    env = _clean_env(tmp_path / "bin", PYTHON=str(bare / "bin/python"))
    out = subprocess.run(["/bin/bash", str(ROOT / "scripts/setup.sh"), "--dry-run"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "has no pip" in out.stderr, out
    old = tmp_path / "bin/python-old"
    old.write_text("#!/bin/sh\nexit 1\n")  # what `sys.exit(version < (3, 10))` gives on 3.9
    old.chmod(0o755)
    env["PYTHON"] = str(old)
    out = subprocess.run(["/bin/bash", str(ROOT / "scripts/setup.sh")], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and ">= 3.10" in out.stderr, out


# --------------------------------------------------------------------------------------------
# The Makefile: which Python, and the setup stamp (setup.sh replaced by a recorder)

MAKE = shutil.which("make")
needs_make = pytest.mark.skipif(MAKE is None, reason="make is not installed")


@pytest.fixture()
def repo_copy(tmp_path: Path) -> Path:
    """The Makefile and the packaging files it watches, with a setup.sh that only records the
    interpreter it was given."""
    repo = tmp_path / "repo"
    for rel in ("Makefile", "pyproject.toml", "server/pyproject.toml", "client/pyproject.toml",
                "scripts/install_torch.py"):
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, repo / rel)
    (repo / "scripts/setup.sh").write_text('echo "$PYTHON" >> setup-runs.log\n')
    return repo


def _make(repo: Path, *args: str, **env_extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PY", "MAKEFLAGS")}
    env.update(env_extra)
    return subprocess.run([MAKE or "make", "-C", str(repo), *args], env=env,
                          capture_output=True, text=True, timeout=120)


def _change(repo: Path, path: Path) -> None:
    """`path` changed after the last setup: the stamps are made older than a fresh mtime."""
    for stamp in (repo / ".make").glob("*.stamp"):
        os.utime(stamp, (stamp.stat().st_atime, stamp.stat().st_mtime - 100))
    path.touch()


def _runs(repo: Path) -> list[str]:
    log = repo / "setup-runs.log"
    return log.read_text().splitlines() if log.exists() else []


@needs_make
def test_make_setup_runs_once_until_a_packaging_file_changes(repo_copy: Path) -> None:
    py = sys.executable
    for _ in range(3):
        assert _make(repo_copy, "setup", f"PY={py}").returncode == 0
    assert _runs(repo_copy) == [py]
    for changed in ("pyproject.toml", "server/pyproject.toml", "client/pyproject.toml",
                    "scripts/install_torch.py", "scripts/setup.sh"):
        _change(repo_copy, repo_copy / changed)
        assert _make(repo_copy, "setup", f"PY={py}").returncode == 0
        assert _make(repo_copy, "setup", f"PY={py}").returncode == 0
    assert len(_runs(repo_copy)) == 1 + 5
    # Another interpreter has a stamp of its own; `reinstall` always runs.
    assert _make(repo_copy, "setup", "PY=/opt/other/python").returncode == 0
    assert _make(repo_copy, "reinstall", f"PY={py}").returncode == 0
    assert _runs(repo_copy)[-2:] == ["/opt/other/python", py]
    assert _make(repo_copy, "setup", f"PY={py}").returncode == 0
    assert len(_runs(repo_copy)) == 8


@needs_make
def test_make_uses_the_active_virtualenv(repo_copy: Path, tmp_path: Path) -> None:
    env_dir = tmp_path / "userenv"
    venv.create(env_dir, with_pip=False)
    assert _make(repo_copy, "setup", VIRTUAL_ENV=str(env_dir)).returncode == 0
    assert _runs(repo_copy) == [f"{env_dir}/bin/python"]
    assert not (repo_copy / ".venv").exists()
    # Recreating that venv (a new pyvenv.cfg) makes setup run again.
    _change(repo_copy, env_dir / "pyvenv.cfg")
    assert _make(repo_copy, "setup", VIRTUAL_ENV=str(env_dir)).returncode == 0
    assert len(_runs(repo_copy)) == 2


@needs_make
def test_make_creates_the_project_venv(repo_copy: Path) -> None:
    out = _make(repo_copy, "setup", f"PYTHON={sys.executable}")
    assert out.returncode == 0, out.stderr
    assert "creating the project virtual environment .venv" in out.stdout
    assert (repo_copy / ".venv/pyvenv.cfg").is_file()
    assert _runs(repo_copy) == [".venv/bin/python"]
    assert _make(repo_copy, "setup").returncode == 0
    assert len(_runs(repo_copy)) == 1
    # A .venv that is not a venv is refused, not overwritten.
    shutil.rmtree(repo_copy / ".venv")
    (repo_copy / ".venv").mkdir()
    (repo_copy / ".venv/keep.txt").write_text("mine")
    out = _make(repo_copy, "setup")
    assert out.returncode != 0 and "is not a virtual environment" in out.stderr
    assert (repo_copy / ".venv/keep.txt").read_text() == "mine"


@needs_make
def test_make_refuses_an_old_python(repo_copy: Path, tmp_path: Path) -> None:
    old = tmp_path / "python3.9"
    old.write_text("#!/bin/sh\nexit 1\n")
    old.chmod(0o755)
    out = _make(repo_copy, "setup", f"PYTHON={old}")
    assert out.returncode != 0 and "is not Python >= 3.10" in out.stderr
    assert not (repo_copy / ".venv").exists() and _runs(repo_copy) == []


@needs_make
def test_make_cleans_up_a_failed_venv(repo_copy: Path, tmp_path: Path) -> None:
    # A Python without the venv module's pip (Debian without python3-venv) fails half-way.
    broken = tmp_path / "python3"
    broken.write_text('#!/bin/sh\ncase "$1" in -c) exit 0;; -m) mkdir -p .venv; exit 1;; esac\n')
    broken.chmod(0o755)
    out = _make(repo_copy, "setup", f"PYTHON={broken}")
    assert out.returncode != 0 and "apt install python3-venv" in out.stderr
    assert not (repo_copy / ".venv").exists() and _runs(repo_copy) == []


@needs_make
def test_make_serve_leaves_host_and_port_to_the_server_unless_port_is_given(
        repo_copy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # MOE_GEMM_PORT / MOE_GEMM_HOST (server/README.md) reach `make serve`'s server: no flag of
    # the Makefile overrides them (a flag wins over its variable).
    monkeypatch.delenv("PORT", raising=False)
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\necho "server-args: $*"\n')
    fake.chmod(0o755)

    def served(*args: str, **env: str) -> str:
        out = _make(repo_copy, "serve", f"PY={fake}", *args, **env)
        assert out.returncode == 0, out.stderr
        return [line for line in out.stdout.splitlines() if line.startswith("server-args:")][-1]

    assert served(MOE_GEMM_PORT="9100", MOE_GEMM_HOST="127.0.0.2") == \
        "server-args: -m moe_gemm_server"
    assert served("PORT=9000") == "server-args: -m moe_gemm_server --port 9000"
