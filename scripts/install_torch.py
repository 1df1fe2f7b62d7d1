"""Install the torch build this machine should have (the first step of scripts/setup.sh).

Run it with the interpreter to install into; it needs only the standard library, since torch
is not there yet. The choice, in order:

1. A torch >= MIN_TORCH is already installed (a CUDA build, a CPU build, a source build): keep
   it untouched. Installing over it could swap a working CUDA build for another.
2. An NVIDIA GPU is here (`nvidia-smi` on PATH, or a /dev/nvidia<N> device): torch==TORCH_PIN
   from the configured package index, which on Linux x86_64 (PyPI) is the CUDA build.
3. No NVIDIA GPU: torch==TORCH_PIN from PyTorch's CPU-only wheel index (CPU_INDEX, or
   $MOE_GEMM_TORCH_CPU_INDEX for a mirror), ~200 MB instead of several GB of CUDA libraries.
   Where that index cannot be reached (no route to it, a firewall, an air-gapped mirror), from
   the configured package index instead, with a warning: pip then takes a CPU build if the
   index serves one (a local `+cpu` version sorts above the plain one) and otherwise the plain
   wheel, which on Linux x86_64 PyPI is the CUDA build.

$MOE_GEMM_TORCH_BUILD=cpu or =cuda skips the GPU detection (e.g. building an image for GPU
machines on a machine without one); an installed torch is still kept.

    python scripts/install_torch.py [--dry-run] [--cpu-index URL] [--dev-dir DIR]

--dry-run prints the decision and the pip command without running it (the tests use it with a
fake nvidia-smi on PATH, an empty --dev-dir and an unreachable --cpu-index).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

# Keep in step with pyproject.toml's "torch>=2.9" (a test checks it).
MIN_TORCH = (2, 9)
TORCH_PIN = "2.13.0"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
CPU_INDEX_ENV = "MOE_GEMM_TORCH_CPU_INDEX"
BUILD_ENV = "MOE_GEMM_TORCH_BUILD"
# Reaching the index is a request or two; a dead route fails at once, a black-holed one must
# not stall setup for pip's 15 s x 5 retries.
PROBE_TIMEOUT_S = 10.0


@dataclass
class Plan:
    """What to do about torch, and why (printed before it is done)."""

    action: str  # "keep" | "install"
    reason: str
    build: str = ""  # "cuda" | "cpu" | "configured index": what the install is expected to give
    pip_args: list[str] = field(default_factory=list)
    warning: str = ""


def installed_torch() -> str | None:
    """The version of the torch distribution in this interpreter's environment, if any."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def version_tuple(version: str) -> tuple[int, ...]:
    """(2, 13, 0) from "2.13.0+cpu" or "2.13.0a0+git1234": the leading numeric release parts."""
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) != len(piece):  # "0a0", "0rc1": the release part ends here
            break
    return tuple(parts)


def nvidia_gpu(path: str | None = None, dev_dir: str = "/dev") -> str | None:
    """Why we think an NVIDIA GPU is here, or None. nvidia-smi ships with the driver; a
    container given a GPU without the driver tools still has the /dev/nvidia<N> nodes."""
    smi = shutil.which("nvidia-smi", path=path)
    if smi:
        return f"nvidia-smi found at {smi}"
    devices = sorted(p.name for p in Path(dev_dir).glob("nvidia[0-9]*"))
    if devices:
        return f"{dev_dir}/{devices[0]} present"
    return None


def probe_index(url: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """None if `url`/torch/ answers 200 (a PEP 503 index that lists torch), else why not."""
    page = url.rstrip("/") + "/torch/"
    try:
        with urllib.request.urlopen(page, timeout=timeout) as resp:  # body not read
            if resp.status != 200:
                return f"{page} answered HTTP {resp.status}"
    except urllib.error.HTTPError as exc:
        return f"{page} answered HTTP {exc.code}"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return f"{page} not reachable ({reason})"
    return None


def decide(*, path: str | None = None, dev_dir: str = "/dev",
           cpu_index: str | None = None, build: str | None = None) -> Plan:
    """The plan for this interpreter and machine (reads the environment, installs nothing).

    `build` ("auto", "cpu", "cuda"; default $MOE_GEMM_TORCH_BUILD or "auto") skips the GPU
    detection when not "auto".
    """
    build = (build or os.environ.get(BUILD_ENV) or "auto").strip().lower()
    if build not in ("auto", "cpu", "cuda"):
        raise ValueError(f"{BUILD_ENV} must be auto, cpu or cuda; got {build!r}")
    have = installed_torch()
    if have is not None:
        if version_tuple(have) >= MIN_TORCH:
            return Plan("keep", f"torch {have} is already installed; keeping it as it is")
        why_new = (f"torch {have} is installed but moe_gemm needs >= "
                   f"{'.'.join(map(str, MIN_TORCH))}; ")
    else:
        why_new = "torch is not installed; "
    pin = f"torch=={TORCH_PIN}"
    gpu = nvidia_gpu(path, dev_dir) if build == "auto" else None
    if build == "cuda" or gpu:
        why = f"NVIDIA GPU ({gpu})" if gpu else f"{BUILD_ENV}=cuda"
        return Plan("install", why_new + f"{why}: {pin} from the configured package index (the "
                    "CUDA build on Linux)", "cuda", [pin])
    why = "no NVIDIA GPU" if build == "auto" else f"{BUILD_ENV}=cpu"
    index = cpu_index or os.environ.get(CPU_INDEX_ENV) or CPU_INDEX
    problem = probe_index(index)
    if problem is None:
        return Plan("install", why_new + f"{why}: {pin}, the CPU-only build, from {index}",
                    "cpu", [pin, "--index-url", index])
    return Plan(
        "install",
        why_new + f"{why}, and PyTorch's CPU-only index cannot be used: {problem}; {pin} from "
        "the configured package index instead",
        "configured index", [pin],
        warning="where the configured index serves only the plain torch wheel (PyPI on Linux "
        "x86_64) that is the CUDA build, several GB of nvidia-* packages; to get the CPU-only "
        f"build set {CPU_INDEX_ENV} to a reachable copy of {CPU_INDEX} and run setup again")

def pip_command(plan: Plan, python: str = sys.executable) -> list[str]:
    return [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", *plan.pip_args]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="print the decision and the pip command; install nothing")
    parser.add_argument("--cpu-index", default=None,
                        help=f"PyTorch CPU-only index URL (default ${CPU_INDEX_ENV} or "
                        f"{CPU_INDEX})")
    parser.add_argument("--dev-dir", default="/dev", help="where to look for /dev/nvidia<N>")
    args = parser.parse_args(argv)
    try:
        plan = decide(dev_dir=args.dev_dir, cpu_index=args.cpu_index)
    except ValueError as exc:
        print(f"torch: {exc}", file=sys.stderr)
        return 2
    print(f"torch: {plan.reason}", flush=True)
    if plan.warning:
        print(f"torch: warning: {plan.warning}", file=sys.stderr, flush=True)
    if plan.action == "keep":
        return 0
    cmd = pip_command(plan)
    if args.dry_run:
        print("torch: would run: " + " ".join(cmd))
        return 0
    rc = subprocess.call(cmd)
    if rc != 0:
        print(f"torch: pip failed (exit {rc}): {' '.join(cmd)}", file=sys.stderr)
        return rc
    importlib.invalidate_caches()
    print(f"torch: installed torch {installed_torch()}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
