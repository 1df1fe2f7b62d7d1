"""One device call: GPU tests (in crash-isolated groups) and benchmarks, results under --out.

Run on the GPU machine from the repo root after the CuTe DSL is unpacked (see AGENTS.md):
    PYTHONUNBUFFERED=1 python3 scripts/gpu_session.py --out $OUT --tests --bench

Each pytest group runs in its own process with a wall-clock limit, so a kernel fault or hang
costs one group, not the session. Every finished case is appended to gpu-cases.jsonl at once.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEST_FILE = "tests/kernels/test_grouped_gemm_gpu.py"
GROUPS = [
    ("smoke", "test_default_picks_cute or single_row"),
    ("trace", "trace and not cluster and not tail_split"),
    ("varlen", "(varlen or cuda_graph or no_host_sync) and not cluster and not edge_rows "
               "and not tail_split"),
    ("general-matrix", "general_matrix"),
    ("general-other", "(layouts or tiles or fast_path) and not batched"),
    ("batched", "(batched or pdl or epilogue_whole) and not trace and not cluster "
                "and not edge_rows and not tail_split"),
    ("edge-rows", "edge_rows"),
    ("tail-split", "tail_split"),
    ("cluster", "cluster"),
    ("headline", "headline"),
    ("aliasing", "aliasing"),
    ("expanded", "expanded"),
    ("moe-layer", None),
]


def sh(cmd: str) -> str:
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=60).stdout
    except Exception as exc:  # noqa: BLE001
        return f"<{exc}>"


def run_group(name: str, expr: str | None, out: str, timeout: int, extra: list[str]) -> dict:
    target = [TEST_FILE, "-k", expr] if expr else ["tests/test_moe_gpu.py"]
    if expr is None and not os.path.exists(os.path.join(ROOT, "tests/test_moe_gpu.py")):
        return {"group": name, "rc": None, "skipped": "no file"}
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-x" if False else "-q",
           "-p", "no:cacheprovider", "--tb=line", *target, *extra]
    t = time.time()
    log = os.path.join(out, f"pytest-{name}.log")
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    tail = open(log).read().strip().splitlines()[-3:]
    return {"group": name, "rc": rc, "seconds": round(time.time() - t, 1), "tail": tail}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tests", action="store_true")
    p.add_argument("--groups", default="")
    p.add_argument("--bench", action="store_true")
    p.add_argument("--bench-args", default="")
    p.add_argument("--group-timeout", type=int, default=240)
    p.add_argument("--precompile", type=int, default=0, help="compile variants with N jobs first")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    carried = os.path.join(ROOT, ".kcache")
    if os.path.isdir(carried):
        shutil.copytree(carried, "/tmp/kcache", dirs_exist_ok=True)
    os.environ.setdefault("MOE_GEMM_CACHE_DIR", "/tmp/kcache")
    os.environ["MOE_GEMM_GPU_REPORT"] = os.path.join(args.out, "gpu-cases.jsonl")
    env = {
        "date": datetime.date.today().isoformat(),
        "gpu": sh("nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader"),
        "torch": sh(f"{sys.executable} -c 'import torch;print(torch.__version__)'").strip(),
    }
    print(json.dumps(env), flush=True)
    summary = {"env": env, "groups": []}
    if args.precompile:
        t = time.time()
        r = subprocess.run([sys.executable, "scripts/precompile.py", "--set", "tests", "-j",
                            str(args.precompile)], cwd=ROOT, capture_output=True, text=True,
                           timeout=400)
        fails = [ln for ln in r.stdout.splitlines() if "FAILED" in ln]
        summary["precompile"] = {"rc": r.returncode, "seconds": round(time.time() - t, 1),
                                 "failed": fails[:10]}
        print(json.dumps(summary["precompile"]), flush=True)
    if args.tests:
        wanted = set(args.groups.split(",")) if args.groups else None
        for name, expr in GROUPS:
            if wanted and name not in wanted:
                continue
            res = run_group(name, expr, args.out, args.group_timeout, [])
            summary["groups"].append(res)
            print(json.dumps(res), flush=True)
    if args.bench:
        cmd = f"{sys.executable} -m benchmarks.bench --out {args.out}/bench.json " \
              f"--png {args.out}/bench.png {args.bench_args}"
        t = time.time()
        rc = subprocess.run(cmd, shell=True, cwd=ROOT, timeout=560).returncode
        summary["bench"] = {"rc": rc, "seconds": round(time.time() - t, 1)}
    with open(os.path.join(args.out, "session.json"), "w") as f:
        json.dump(summary, f, indent=1)
    cases = os.environ["MOE_GEMM_GPU_REPORT"]
    if os.path.exists(cases):
        rows = [json.loads(line) for line in open(cases)]
        bad = [r for r in rows if not r["passed"]]
        print(f"cases: {len(rows)} recorded, {len(bad)} failed")
        for r in bad[:15]:
            print("FAIL", r["name"], {k: r.get(k) for k in ("max_rel_err", "baseline_err")})
    for g in summary["groups"]:
        print(f"{g['group']:16s} rc={g.get('rc')} {g.get('seconds', '')}s {g.get('tail', '')[-1:]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
