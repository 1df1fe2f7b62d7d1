"""What ptxas says about each kernel variant: register spills and the WGMMA pipeline notes.

Compiles every variant of `moe-gemm check --full` (or the FP8 GPU tests' set) for sm_90a on
this machine (no GPU), runs `ptxas -v` on its PTX and reports, per variant, the spill bytes
and ptxas's WGMMA notes:
  C7514 / C7515 / C7510  the WGMMAs of a stage are serialized (a performance loss);
  C7520                  every WGMMA serialized: a compiler-inserted warpgroup.arrive sits
                         in what ptxas takes for a divergent path;
  C7517                  a warpgroup.wait injected so that other code can read WGMMA
                         results (one per tile where it sits outside the stage loop);
  C7519                  a warpgroup.arrive (wgmma.fence) injected.
Needs ptxas (the CUDA toolkit's) on PATH.

    python scripts/ptxas_audit.py [--set check|fp8] [-j 4] [--out audit.json]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]  # moe_gemm; the tests package (tests.kernels.variants_fp8)
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

SERIALIZED = ("C7514", "C7515", "C7510", "C7520")
SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def ptxas_report(ptx: str) -> dict:
    """Spill bytes and ptxas's WGMMA note codes of one PTX file."""
    res = subprocess.run(["ptxas", "-arch=sm_90a", "-v", "-O3", ptx, "-o", os.devnull],
                         capture_output=True, text=True)
    notes = re.findall(r"\((C75\d\d)\)", res.stderr)
    spills = [tuple(map(int, m)) for m in SPILL.findall(res.stderr)]
    return {"rc": res.returncode, "notes": {c: notes.count(c) for c in sorted(set(notes))},
            "spill_stores": sum(s for s, _ in spills), "spill_loads": sum(ld for _, ld in spills),
            "serialized": any(c in notes for c in SERIALIZED)}


def audit(key) -> tuple[str, dict]:
    from moe_gemm.kernels.sm90.compile_fp8 import compile_any

    work = tempfile.mkdtemp(prefix="ptxas_audit_")
    try:
        compile_any(key, keep_dir=work)
        ptx = [os.path.join(work, f) for f in os.listdir(work) if f.endswith(".ptx")]
        return key.name(), ptxas_report(ptx[0]) if ptx else {"error": "no PTX written"}
    except Exception as exc:  # noqa: BLE001 - one variant's failure must not lose the others
        return key.name(), {"error": repr(exc)[:300]}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def variants(which: str) -> list:
    if which == "fp8":
        from tests.kernels.variants_fp8 import fp8_test_variants

        return [k for k in fp8_test_variants() if k.name().startswith("fp8_")]
    from moe_gemm.cli import check_variants

    return check_variants(full=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--set", default="check", choices=["check", "fp8"])
    p.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--out", help="write {variant: report} as JSON")
    args = p.parse_args(argv)
    if shutil.which("ptxas") is None:
        print("error: ptxas is not on PATH", file=sys.stderr)
        return 2
    keys = variants(args.set)
    results: dict[str, dict] = {}
    with ProcessPoolExecutor(args.jobs) as pool:
        for name, rep in pool.map(audit, keys):
            results[name] = rep
            flag = ("!!" if "error" in rep or rep["serialized"] or rep["spill_stores"]
                    else "  ")
            detail = rep.get("error") or (
                f"spills {rep['spill_stores']}/{rep['spill_loads']} B  notes {rep['notes']}")
            print(f"{flag} {name:70} {detail}", flush=True)
    bad = [n for n, r in results.items() if "error" in r or r["serialized"] or r["spill_stores"]]
    print(f"{len(results)} variants: {len(bad)} with an error, serialized WGMMAs or spills")
    if args.out:
        from moe_gemm.tuning.table_io import write_json

        write_json(Path(args.out), dict(sorted(results.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
