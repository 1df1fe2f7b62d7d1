"""All GPU tests on a Hopper machine in one command, bounded in time, results in one JSON:

    PYTHONUNBUFFERED=1 python3 scripts/gpu_session.py --out $OUT

1. Probe the machine (GPU, torch, CuTe DSL). If the kernels cannot run here it stops with
   exit 2: every GPU test would skip and pass.
2. Compile every kernel variant the tests launch (scripts/precompile.py, one spawned worker
   per core) while pytest collects the tests marked `gpu` under tests/ (any file, so new GPU
   tests join without editing this script).
3. Run the tests in groups (one per file; big files split by test name), --jobs pytest
   processes at a time on the GPU (or spread over --gpus N of them), each in its own process
   group with a wall-clock limit, so a fault or hang costs one group, never the session;
   nothing starts or keeps running past --budget.
4. Write $OUT/gpu-tests.json (machine, precompile, per-group and per-test results, checked
   cases, kernels compiled inside tests) and $OUT/gpu-logs.txt (every process's output),
   then print a table. Exit 1 on any failed or unfinished test, collection error, group
   timeout or precompile failure.

Select with --groups (names or shell patterns, see --list), -k (pytest's expression) and
--paths (files or folders to collect from). On a machine of several GPUs, `--gpus N` runs each
group's process on the least busy of the first N GPUs (3 processes per GPU unless --jobs
says otherwise; a group that needs several GPUs sees them all). Reports of sessions run
apart (one per GPU, each with its own --groups) join with
`--merge g0/gpu-tests.json g1/gpu-tests.json ... --out DIR`.
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Files split into several groups by test name (first match wins) so the parallel processes
# finish together; any other file with GPU tests is one group named after it.
SPLITS = {
    "tests/kernels/test_general_gpu.py": [("general-matrix", "test_general_matrix*"),
                                          ("general", "*")],
    "tests/kernels/test_clusters_gpu.py": [("clusters-general", "test_cluster_general*"),
                                           ("clusters", "*")],
    "tests/kernels/test_fuzz_gpu.py": [("fuzz-masked", "test_fuzz_grouped_mm_masked*"),
                                       ("fuzz-grouped-mm", "test_fuzz_grouped_mm*"),
                                       ("fuzz-grouped-gemm", "test_fuzz_grouped_gemm*"),
                                       ("fuzz-fp8", "test_fuzz_*fp8*"),
                                       ("fuzz-fp8", "test_fuzz_scaled*"),
                                       ("fuzz-fused", "test_fuzz_fused*"),
                                       ("fuzz", "*")],
}
OUTCOME_ORDER = ("passed", "xfailed", "skipped", "xpassed", "failed", "error")
# Groups that need several GPUs in one process (NCCL): with --gpus they see every GPU given.
ALL_GPU_GROUPS = ("layers-expert-parallel",)


@dataclass
class Group:
    name: str
    tests: list[str] = field(default_factory=list)
    rc: int | str | None = None  # pytest's exit status, "timeout" or "not run"
    seconds: float = 0.0
    log: str = ""
    report: str = ""
    proc: subprocess.Popen | None = None
    started: float = 0.0
    deadline: float = 0.0
    gpu: str | None = None  # CUDA_VISIBLE_DEVICES of its process (--gpus), else None


def group_name(nodeid: str) -> str:
    path, _, test = nodeid.partition("::")
    for name, pattern in SPLITS.get(path, []):
        if fnmatch.fnmatchcase(test, pattern):
            return name
    stem = os.path.basename(path).removesuffix(".py").removeprefix("test_").removesuffix("_gpu")
    folder = os.path.basename(os.path.dirname(path))
    return stem.replace("_", "-") if folder == "kernels" else f"{folder}-{stem}".replace("_", "-")


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    # ROOT: the report plugin is `tests.kernels.gpu_report`, the name pytest gives it. tests/
    # itself stays off the path: its folders would shadow installed packages of the same name.
    paths = [ROOT, os.path.join(ROOT, "server"), os.path.join(ROOT, "client")]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("MOE_GEMM_CACHE_DIR", "/tmp/kcache")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def start(cmd: list[str], log: str, env: dict[str, str]) -> subprocess.Popen:
    """A child in its own session (so a timeout kills it with everything it started)."""
    with open(log, "w") as f:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def wait(proc: subprocess.Popen, seconds: float) -> int | str:
    try:
        return proc.wait(timeout=max(0.0, seconds))
    except subprocess.TimeoutExpired:
        stop(proc)
        return "timeout"


PROBE = """
import importlib.util, json, torch
from importlib.metadata import version
from moe_gemm.capability import cute_problem
info = {"torch": torch.__version__, "problem": cute_problem(),
        "pytest_timeout": importlib.util.find_spec("pytest_timeout") is not None}
try:
    info["cutlass_dsl"] = version("nvidia-cutlass-dsl")
except Exception as exc:
    info["cutlass_dsl"] = repr(exc)
info["gpu_count"] = torch.cuda.device_count()
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info.update(gpu=p.name, sms=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30))
print(json.dumps(info, allow_nan=False))
"""


def _sh(cmd: list[str]) -> str | None:
    """A command's output, or None where it is missing or fails (git, nvidia-smi)."""
    try:
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def probe() -> dict:
    res = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=child_env(),
                         capture_output=True, text=True, timeout=120)
    try:
        info = json.loads(res.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        info = {"problem": f"probe failed: {res.stderr.strip()[-500:]}"}
    info["date"] = datetime.datetime.now().isoformat(timespec="seconds")
    info["commit"] = _sh(["git", "rev-parse", "--short", "HEAD"])
    info["uncommitted_files"] = len((_sh(["git", "status", "--porcelain"]) or "").splitlines())
    info["cpus"] = os.cpu_count()
    info["nvidia_smi"] = _sh(["nvidia-smi", "--format=csv,noheader",
                              "--query-gpu=name,driver_version,clocks.max.sm,memory.total"])
    return info


def collect(paths: list[str], kexpr: str | None, log: str) -> tuple[list[str], list[str]]:
    """(node ids of the gpu-marked tests, collection errors)."""
    ids_file = log + ".json"
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu",
           "-p", "no:cacheprovider", "-p", "tests.kernels.gpu_report",
           "--continue-on-collection-errors", *paths]
    if kexpr:
        cmd += ["-k", kexpr]
    rc = wait(start(cmd, log, child_env({"MOE_GEMM_GPU_COLLECT": ids_file})), 180)
    ids = json.load(open(ids_file)) if os.path.exists(ids_file) else []
    errors = [ln for ln in open(log).read().splitlines() if ln.startswith("ERROR ")]
    if rc not in (0, 5) and not errors:
        errors.append(f"collection exited with {rc}")
    return ids, errors


def summarize(group: Group) -> dict:
    """Per-test outcomes (the worst of a test's rows), cases and compiles from the report."""
    outcome: dict[str, str] = {}
    seconds: dict[str, float] = {}
    messages: dict[str, str] = {}
    cases, compiles = [], []
    if os.path.exists(group.report):
        for line in open(group.report):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a kill
            if row.get("kind") == "test":
                node, new = row["nodeid"], row["outcome"]
                old = outcome.get(node, "passed")
                if node not in outcome or OUTCOME_ORDER.index(new) > OUTCOME_ORDER.index(old):
                    outcome[node] = new
                seconds[node] = seconds.get(node, 0.0) + row["seconds"]
                if "message" in row:
                    messages[node] = row["message"]
            elif row.get("kind") == "compile":
                compiles.append(row)
            else:
                cases.append(row)
    for node in group.tests:
        outcome.setdefault(node, "unfinished")
    tests = [{"nodeid": n, "group": group.name, "outcome": outcome[n],
              "seconds": round(seconds.get(n, 0.0), 3),
              **({"message": messages[n]} if n in messages else {})} for n in group.tests]
    counts = {k: sum(t["outcome"] == k for t in tests)
              for k in ("passed", "failed", "error", "skipped", "xfailed", "xpassed",
                        "unfinished")}
    ok = (group.rc in (0, 5) and not counts["failed"] and not counts["error"]
          and not counts["unfinished"] and not counts["xpassed"])
    return {"group": group.name, "rc": group.rc, "seconds": round(group.seconds, 1),
            **({"gpu": group.gpu} if group.gpu is not None else {}),
            "tests": len(group.tests), **counts, "compiled_in_tests": len(compiles),
            "ok": ok, "_tests": tests, "_cases": cases, "_compiles": compiles}


def select_groups(groups: dict, spec: str) -> dict:
    """The groups named by `spec` (comma-separated names or shell patterns). ValueError naming
    the patterns that match no group, and the groups there are."""
    wanted = [w.strip() for w in spec.split(",") if w.strip()]
    unmatched = [w for w in wanted if not any(fnmatch.fnmatchcase(n, w) for n in groups)]
    if unmatched or not wanted:
        raise ValueError(f"--groups {', '.join(unmatched) or repr(spec)} matches no group; "
                         f"the groups: {', '.join(sorted(groups))}")
    return {n: g for n, g in groups.items() if any(fnmatch.fnmatchcase(n, w) for w in wanted)}


def pick_gpu(gpus: list[str], running: list[Group]) -> str | None:
    """The GPU (of `gpus`, none: the process's own) running the fewest groups now."""
    if not gpus:
        return None
    load = {g: sum(1 for r in running if r.gpu == g) for g in gpus}
    return min(gpus, key=lambda g: (load[g], gpus.index(g)))


def run_groups(groups: list[Group], jobs: int, group_timeout: float, deadline: float,
               pytest_args: list[str], work: str, gpus: list[str] | None = None) -> None:
    """Runs the groups, largest first, at most `jobs` at once, none past `deadline`; with
    `gpus`, each group's process on the least busy of them (CUDA_VISIBLE_DEVICES)."""
    pending = sorted(groups, key=lambda g: -len(g.tests))
    running: list[Group] = []
    while pending or running:
        while pending and len(running) < jobs:
            if deadline - time.monotonic() < 30:  # too late to start one: say so
                for g in pending:
                    g.rc = "not run"
                pending.clear()
                break
            g = pending.pop(0)
            g.log = os.path.join(work, f"{g.name}.log")
            g.report = os.path.join(work, f"{g.name}.jsonl")
            cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                   "-p", "no:randomly", "-p", "tests.kernels.gpu_report", "--tb=short", "-rfE",
                   *pytest_args, *g.tests]
            extra = {"MOE_GEMM_GPU_REPORT": g.report}
            if gpus:
                g.gpu = ",".join(gpus) if g.name in ALL_GPU_GROUPS else pick_gpu(gpus, running)
                extra["CUDA_VISIBLE_DEVICES"] = g.gpu
            g.proc = start(cmd, g.log, child_env(extra))
            g.started = time.monotonic()
            g.deadline = min(g.started + group_timeout, deadline)
            running.append(g)
            print(f"started {g.name} ({len(g.tests)} tests)"
                  + (f" on GPU {g.gpu}" if g.gpu is not None else ""), flush=True)
        time.sleep(0.2)
        for g in list(running):
            rc = g.proc.poll()
            if rc is None and time.monotonic() >= g.deadline:
                stop(g.proc)
                rc = "timeout"
            if rc is not None:
                g.rc, g.seconds = rc, time.monotonic() - g.started
                running.remove(g)
                print(f"finished {g.name}: rc={rc} in {g.seconds:.1f} s", flush=True)


def precompile(jobs: int, timeout: float, log: str) -> subprocess.Popen:
    cmd = [sys.executable, "scripts/precompile.py", "--set", "tests", "-j", str(jobs),
           "--timeout", str(timeout)]
    return start(cmd, log, child_env())


def read_precompile(log: str, rc: int | str, seconds: float) -> dict:
    lines = open(log).read().splitlines() if os.path.exists(log) else []
    summary = next((ln for ln in reversed(lines) if " compiled, " in ln), None)
    return {"rc": rc, "seconds": round(seconds, 1), "summary": summary,
            "failed": [ln for ln in lines if ln.startswith("FAILED")][:20]}


def table(results: list[dict], pre: dict | None) -> str:
    cols = ("tests", "passed", "failed", "other", "skipped", "compiled")
    head = f"{'group':20s} " + " ".join(f"{c:>8s}" for c in cols) + f" {'seconds':>8s}  status"
    lines = [head, "-" * len(head)]
    for r in [*results, None]:
        if r is None:  # the total line
            r = {k: sum(x[k] for x in results) for k in ("tests", "passed", "failed", "error",
                                                          "unfinished", "xpassed", "skipped",
                                                          "compiled_in_tests", "seconds")}
            r.update(group="total", ok=all(x["ok"] for x in results), rc="-")
        row = {**r, "other": r["error"] + r["unfinished"] + r["xpassed"],
               "compiled": r["compiled_in_tests"]}
        status = "ok" if r["ok"] else f"FAILED (rc={r['rc']})"
        lines.append(f"{r['group']:20s} " + " ".join(f"{row[c]:8d}" for c in cols)
                     + f" {r['seconds']:8.1f}  {status}")
    if pre is not None:
        lines.append(f"precompile: rc={pre['rc']} in {pre['seconds']} s: {pre['summary']}")
    lines.append("other = errors + unfinished + strict xpasses; compiled = kernels compiled "
                 "inside the tests (missed by the precompile); seconds: total = sum")
    return "\n".join(lines)


def write_report(path: str, report: dict) -> None:
    """The report as JSON, one test or case per line (the repository keeps these records:
    indented, a run of every group took 1.9 MB); all on one line where moe_gemm does not import.
    Strict either way: a NaN error of a case is null, or (without moe_gemm, where only --merge
    of strictly written reports gets here) a ValueError, never the bare word NaN that jq and
    other strict readers refuse along with the whole file."""
    try:
        from moe_gemm.tuning.table_io import dumps_by_line
        text = dumps_by_line(report, default=str)
    except ImportError:
        text = json.dumps(report, separators=(",", ":"), default=str, allow_nan=False) + "\n"
    with open(path, "w") as f:
        f.write(text)


def merge_reports(reports: list[dict]) -> dict:
    """One report from several sessions' (one per GPU of a machine, each with its own
    --groups): each session's machine, command, time and precompile under "sessions", the
    groups, tests, cases and compiles of all. ValueError if two sessions ran one group (a
    test would count twice)."""
    merged: dict = {"sessions": [], "collection_errors": [], "groups": [], "tests": [],
                    "cases": [], "compiled_in_tests": [], "seconds": 0.0}
    seen: set[str] = set()
    for r in reports:
        # (a report merged before is a list of sessions already)
        sessions = r.get("sessions") or [{k: r.get(k) for k in ("machine", "command",
                                                                 "seconds", "precompile")}]
        twice = seen & {g["group"] for g in r.get("groups", [])}
        if twice:
            raise ValueError(f"groups {sorted(twice)} are in two reports")
        seen |= {g["group"] for g in r.get("groups", [])}
        merged["sessions"] += sessions
        for key in ("collection_errors", "groups", "tests", "cases", "compiled_in_tests"):
            merged[key] += r.get(key) or []
        merged["seconds"] = max(merged["seconds"], float(r.get("seconds") or 0.0))
    merged["groups"].sort(key=lambda g: g["group"])
    return merged


def merge_main(files: list[str], out: str) -> int:
    """--merge: join the reports in `files` into `out`/gpu-tests.json; print the table."""
    # (an --out that is a file raised FileExistsError out of os.makedirs: a traceback)
    if os.path.exists(out) and not os.path.isdir(out):
        print(f"error: --out {out} is a file; --out names the folder for gpu-tests.json",
              file=sys.stderr)
        return 2
    try:
        reports = [json.load(open(f)) for f in files]
        # (a JSON list or string raised AttributeError out of merge_reports: a traceback)
        if bad := [f for f, r in zip(files, reports) if not isinstance(r, dict)]:
            raise ValueError(f"{', '.join(bad)}: not a gpu-tests.json report (an object)")
        merged = merge_reports(reports)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"error: --merge: {exc}", file=sys.stderr)
        return 2
    os.makedirs(out, exist_ok=True)
    write_report(os.path.join(out, "gpu-tests.json"), merged)
    print(table(merged["groups"], None))
    # A run whose precompile failed exited 1 on its own; merged, that failure was dropped and
    # the join exited 0.
    pre_failed = [s["precompile"] for s in merged["sessions"]
                  if isinstance(s, dict) and isinstance(s.get("precompile"), dict)
                  and (s["precompile"].get("rc") != 0 or s["precompile"].get("failed"))]
    for pre in pre_failed:
        print(f"precompile: rc={pre.get('rc')}: {pre.get('summary')}", file=sys.stderr)
    ok = (all(g.get("ok") for g in merged["groups"]) and not merged["collection_errors"]
          and not pre_failed)
    return 0 if ok and merged["groups"] else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="folder for gpu-tests.json and gpu-logs.txt (not needed with "
                   "--list)")
    p.add_argument("--groups", default="", help="comma-separated group names or patterns")
    p.add_argument("-k", dest="kexpr", default=None, help="pytest -k expression")
    p.add_argument("--paths", nargs="*", default=["tests"], help="where to collect")
    p.add_argument("--jobs", type=int, default=None,
                   help="pytest processes at once (default 4, or 3 per GPU with --gpus)")
    p.add_argument("--gpus", type=int, default=1, metavar="N", help="spread the groups over "
                   "the first N visible GPUs (each group's process on the least busy one)")
    p.add_argument("--compile-jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--no-precompile", action="store_true")
    p.add_argument("--precompile-timeout", type=float, default=200)
    p.add_argument("--group-timeout", type=float, default=300)
    p.add_argument("--test-timeout", type=float, default=240, help="per test (pytest-timeout)")
    p.add_argument("--budget", type=float, default=480, help="seconds for the whole session")
    p.add_argument("--list", action="store_true", help="list the groups and exit")
    p.add_argument("--allow-no-gpu", action="store_true",
                   help="run even where the kernels cannot (the GPU tests then skip)")
    p.add_argument("--merge", nargs="+", metavar="FILE", help="join these gpu-tests.json "
                   "(one session per GPU of a machine, each with its own --groups) into "
                   "--out/gpu-tests.json and exit; no GPU needed")
    args = p.parse_args()
    if not args.out and (args.merge or not args.list):
        # (argparse's own required=True asked --list, which writes nothing, for it too)
        p.error("--out is required (except with --list)")
    if args.merge:
        return merge_main(args.merge, args.out)
    t0 = time.monotonic()
    if not args.list:
        os.makedirs(args.out, exist_ok=True)
    # The processes' logs go here and are copied into --out's gpu-logs.txt: removed after, or
    # every run (--list too) left its mkdtemp folder behind in the temporary directory.
    work = tempfile.mkdtemp(prefix="gpu_session_")
    try:
        return _run(args, t0, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(args: argparse.Namespace, t0: float, work: str) -> int:
    """The run of main's steps 1-4, its processes' logs in `work`."""
    deadline = t0 + args.budget
    info = probe()
    print(json.dumps(info, allow_nan=False), flush=True)  # (the probe's own JSON)
    if info.get("problem") and not (args.allow_no_gpu or args.list):
        print(f"the kernels cannot run here: {info['problem']}", file=sys.stderr)
        return 2
    gpus: list[str] = []
    if args.gpus != 1:
        from moe_gemm.tuning.shards import gpu_ids

        try:
            gpus = gpu_ids(args.gpus, info.get("gpu_count") or 0)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    jobs = args.jobs or (3 * len(gpus) if gpus else 4)

    pre_log = os.path.join(work, "precompile.log")
    pre_proc = None
    if not (args.no_precompile or args.list):
        pre_proc = precompile(args.compile_jobs, args.precompile_timeout, pre_log)
    pre_start = time.monotonic()
    ids, collect_errors = collect(args.paths, args.kexpr, os.path.join(work, "collect.log"))
    groups: dict[str, Group] = {}
    for node in ids:
        groups.setdefault(group_name(node), Group(group_name(node))).tests.append(node)
    if args.groups:
        try:
            groups = select_groups(groups, args.groups)
        except ValueError as exc:  # a typo must not cost a device call running nothing
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if args.list:
        for name, g in sorted(groups.items()):
            print(f"{name:20s} {len(g.tests):4d} tests")
        for err in collect_errors:
            print(err)
        return 0
    pre = None
    if pre_proc is not None:
        rc = wait(pre_proc, args.precompile_timeout + 30 - (time.monotonic() - pre_start))
        pre = read_precompile(pre_log, rc, time.monotonic() - pre_start)
        print(f"precompile: {pre}", flush=True)

    pytest_args = []
    if info.get("pytest_timeout"):
        pytest_args = [f"--timeout={args.test_timeout:.0f}", "--timeout-method=thread"]
    run_groups(list(groups.values()), jobs, args.group_timeout, deadline, pytest_args, work,
               gpus)

    results = [summarize(g) for g in sorted(groups.values(), key=lambda g: g.name)]
    report = {
        "machine": info, "command": sys.argv, "seconds": round(time.monotonic() - t0, 1),
        "precompile": pre, "collection_errors": collect_errors,
        "groups": [{k: v for k, v in r.items() if not k.startswith("_")} for r in results],
        "tests": [t for r in results for t in r["_tests"]],
        "cases": [c for r in results for c in r["_cases"]],
        "compiled_in_tests": [c for r in results for c in r["_compiles"]],
    }
    write_report(os.path.join(args.out, "gpu-tests.json"), report)
    with open(os.path.join(args.out, "gpu-logs.txt"), "w") as f:
        logs = [("precompile", pre_log), ("collection", os.path.join(work, "collect.log"))]
        logs += [(g.name, g.log) for g in groups.values() if g.log]
        for name, path in logs:
            if os.path.exists(path):
                f.write(f"\n===== {name} =====\n{open(path).read()}")
    failed = [t for t in report["tests"] if t["outcome"] in ("failed", "error", "xpassed")]
    for t in failed[:20]:
        print(f"{t['outcome'].upper():8s} {t['nodeid']}\n  {t.get('message', '')[-300:]}")
    for err in collect_errors:
        print(err)
    print(table(results, pre))
    bad = (collect_errors or not results or any(not r["ok"] for r in results)
           or (pre is not None and (pre["rc"] != 0 or pre["failed"])))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
