"""Splitting a work list over several GPUs: `--shard I/N` of `moe-gemm tune` and the zoo.

One process per GPU (CUDA_VISIBLE_DEVICES=I) takes every N-th item of the list, starting at
item I. The lists are in priority order and alternate models and projections, so taking every
N-th item spreads the heavy and the light shapes over the shards about evenly, and shard I
of N always gets the same items (a shard can be rerun alone). Each shard writes its own file;
`moe-gemm tune --merge` and `python -m benchmarks.zoo --merge` put them together; `--gpus N`
of both does all of it in one command (run_shards starts the N processes).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Callable, Sequence, TypeVar

T = TypeVar("T")


def parse_shard(text: str) -> tuple[int, int]:
    """'I/N' -> (I, N) with 0 <= I < N (argparse type: a clear error otherwise)."""
    try:
        i_text, n_text = text.split("/")
        i, n = int(i_text), int(n_text)
    except ValueError:
        i, n = -1, 0
    if n < 1 or not 0 <= i < n:
        raise argparse.ArgumentTypeError(
            f"expected I/N with 0 <= I < N (shard I of N, e.g. 0/4), got {text!r}")
    return i, n


def take_shard(items: Sequence[T], shard: tuple[int, int] | None) -> list[T]:
    """Shard I of N of `items`: items I, I + N, I + 2N, ... (all of them for None)."""
    if shard is None:
        return list(items)
    i, n = shard
    return list(items[i::n])


def gpu_ids(n: int, count: int | None = None) -> list[str]:
    """CUDA_VISIBLE_DEVICES entries of the first `n` GPUs this process may use (the visible
    list when set, else 0..count-1; count None: shard processes on the CPU, at most one per
    core); ValueError naming what is visible when fewer than n."""
    if n < 1:  # said as such: "--gpus 0: 2 GPU(s) visible" read as if too few were visible
        raise ValueError(f"--gpus {n}: must be >= 1")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
    elif count is None:
        # (the zoo's --smoke shards: n ids were built before any check, and `--gpus 10**20`
        # never returned)
        cores = os.cpu_count() or 1
        if n > cores:
            raise ValueError(f"--gpus {n}: at most one shard process per CPU core here "
                             f"({cores}) without GPUs")
        ids = [str(i) for i in range(n)]
    else:
        ids = [str(i) for i in range(count)]
    if len(ids) < n:
        raise ValueError(f"--gpus {n}: {len(ids)} GPU(s) visible"
                         + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""))
    return ids[:n]


def run_shards(commands: list[list[str]], gpus: list[str],
               log: Callable[[str], None]) -> list[int]:
    """Run commands[i] on GPU gpus[i] (CUDA_VISIBLE_DEVICES), all at once; every output line
    is passed to `log` prefixed with its GPU. Returns the exit codes; Ctrl-C stops them all."""
    procs = []
    threads = []
    for cmd, gpu in zip(commands, gpus):
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpu)
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1)
        procs.append(proc)

        def pump(proc=proc, gpu=gpu) -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                log(f"[gpu {gpu}] {line.rstrip()}")

        t = threading.Thread(target=pump, daemon=True)
        t.start()
        threads.append(t)
    try:
        codes = [p.wait() for p in procs]
    except KeyboardInterrupt:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()
        raise
    for t in threads:
        t.join(timeout=5)
    return codes


def launch_shards(module: str, argv: list[str], gpus: list[str], name: str, extra: list[str],
                  log: Callable[[str], None]) -> tuple[Path, list[int], list[str]]:
    """`python -m module argv` once per GPU, as shard i of len(gpus) writing `--out
    <folder>/<name><i>.json` (plus `extra`); argparse keeps an option's last value, so these
    override the caller's --gpus, --shard and --out. Returns (the temporary folder, the exit
    codes, the shard files that exist)."""
    folder = Path(tempfile.mkdtemp(prefix=f"moe-gemm-{name}-"))
    n = len(gpus)
    outs = [folder / f"{name}{i}.json" for i in range(n)]
    commands = [[sys.executable, "-m", module, *argv, "--gpus", "1", "--shard", f"{i}/{n}",
                 "--out", str(outs[i]), *extra] for i in range(n)]
    log(f"[{name}] {n} GPUs ({','.join(gpus)}); the shards' files in {folder}")
    codes = run_shards(commands, gpus, log)
    return folder, codes, [str(o) for o in outs if o.exists()]


def finish_shards(prefix: str, gpus: list[str], codes: list[int], joined: int, merge_rc: int,
                  folder: Path) -> int:
    """The exit code of a `--gpus` run: 0, and the shards' folder removed, when every shard
    and the merge succeeded; else 1, saying which shards failed and keeping the folder."""
    failed = [f"GPU {g} (exit {c})" for g, c in zip(gpus, codes) if c != 0]
    if failed or merge_rc != 0:
        print(f"{prefix}: shards failed: {', '.join(failed) or 'none'}; merged {joined} of "
              f"{len(gpus)}; the shards' files are kept in {folder}", file=sys.stderr)
        return 1
    shutil.rmtree(folder, ignore_errors=True)
    return 0
