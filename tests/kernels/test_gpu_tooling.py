"""CPU tests of the GPU-run tooling: the variant list the precompile step compiles
(variants.py) against the launch path's own compile keys, the session's grouping and
summaries (scripts/gpu_session.py), and the report plugin (gpu_report.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import sys

import pytest
import torch

from moe_gemm import GemmConfig
from moe_gemm.ops import general_launch, launch_kernel, launch_resources, mm_launch
from moe_gemm.ops.support import analyze_general
from moe_gemm.ops.validation import check_grouped_bmm, check_grouped_gemm, check_grouped_mm

from . import helpers as h
from .variants import Variants, kernel_test_variants, router_test_variants

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts",
                                                                      f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def keys_of_launches(monkeypatch: pytest.MonkeyPatch):
    """The launch path on the CPU, its compiled kernel replaced by the CompileKey it asks for."""
    monkeypatch.setattr(launch_kernel, "sm_count", lambda device: 132)
    monkeypatch.setattr(launch_resources, "_capturing", lambda: False)
    monkeypatch.setattr(launch_kernel, "_compiled", lambda key: key)
    monkeypatch.setattr(launch_kernel, "_kernel_for", lambda *a: launch_kernel._compile_key(*a))
    monkeypatch.delenv("MOE_GEMM_L2_HINTS", raising=False)
    monkeypatch.delenv("MOE_GEMM_TAIL_SPLIT", raising=False)


def _one(v: Variants):
    assert len(v.keys) == 1
    return next(iter(v.keys))


def _empty(shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype)  # (the values never matter to the key)


@pytest.mark.parametrize("sizes,layout,config,out_dtype", [
    (h.general_case("mixed", random.Random(7)), "col", GemmConfig(schedule="pingpong",
                                                                   tile_m=64, tile_n=256), None),
    (h.general_case("mixed", random.Random(7)), "row", GemmConfig(schedule="cooperative"),
     torch.float32),
    (h.general_case("many", random.Random(7)), "row", GemmConfig(visitor="host"), None),
    (h.general_case("kvary", random.Random(7)), "col", GemmConfig(cluster_m=1, cluster_n=2),
     None),
    ([(128, 512, 1088), (200, 1024, 1088), (129, 512, 4096)], "row", GemmConfig(), None),
])
@pytest.mark.parametrize("trace", [False, True])
def test_general_variant_is_the_launch_key(keys_of_launches, sizes, layout, config, out_dtype,
                                           trace):
    a = [_empty((m, k)) for m, n, k in sizes]
    b = [_empty((n, k)).t() if layout == "col" else _empty((k, n)) for m, n, k in sizes]
    args = check_grouped_gemm(a, b, None, out_dtype)
    lay = analyze_general(args)
    shape = general_launch.GeneralShape(tuple(args.sizes), args.dtype, args.out_dtype,
                                        lay.b_major, config, 132, trace)
    v = Variants()
    v.general(sizes, config, out_dtype=out_dtype, b_major="k" if layout == "col" else "n",
              trace=trace)
    assert shape.kernel == _one(v)


@pytest.mark.parametrize("T,E,N,K,layout,config,dtype,out_dtype", [
    (1000, 10, 136, 264, "nk_view", GemmConfig(schedule="pingpong", visitor="host"),
     torch.float16, None),
    (1024, 256, 512, 7168, "nk_view", GemmConfig(), torch.bfloat16, None),
    (8192, 8, 2048, 4096, "kn", GemmConfig(), torch.bfloat16, None),  # tail split, whole epi
    (8192, 8, 2048, 4096, "nk_view", GemmConfig(), torch.bfloat16, torch.float32),
    (3000, 24, 264, 200, "kn", GemmConfig(cluster_m=2, cluster_n=1), torch.bfloat16, None),
    (6000, 24, 392, 768, "nk_view", None, torch.bfloat16, None),
])
def test_varlen_variant_is_the_launch_key(keys_of_launches, T, E, N, K, layout, config, dtype,
                                          out_dtype):
    x = _empty((T, K), dtype)
    w = _empty((E, N, K), dtype).transpose(1, 2) if layout == "nk_view" else _empty((E, K, N),
                                                                                  dtype)
    offs = torch.linspace(0, T, E).round().to(torch.int32)  # (sorted: validation checks them)
    plan = mm_launch.MmPlan(check_grouped_mm(x, w, offs, None, out_dtype), config or GemmConfig())
    v = Variants()
    v.varlen(T, E, N, K, config, dtype, out_dtype, b_major="k" if layout == "nk_view" else "n")
    assert plan.kernel == _one(v)


@pytest.mark.parametrize("G,M,N,K,layout,config,out_dtype", [
    (7, 130, 200, 72, "nk_view", GemmConfig(schedule="pingpong"), None),
    (256, 128, 512, 7168, "kn", GemmConfig(), None),  # the 1x2 default
    (6, 100, 192, 320, "kn", GemmConfig(schedule="cooperative"), torch.float16),
    (5, 65, 264, 136, "nk_view", GemmConfig(cluster_m=2, cluster_n=1), torch.float32),
])
def test_batched_variant_is_the_launch_key(keys_of_launches, G, M, N, K, layout, config,
                                           out_dtype):
    x = _empty((G, M, K))
    w = _empty((G, N, K)).transpose(1, 2) if layout == "nk_view" else _empty((G, K, N))
    plan = mm_launch.BmmPlan(check_grouped_bmm(x, w, None, out_dtype), config)
    v = Variants()
    v.batched(G, M, N, K, config, out_dtype=out_dtype,
              b_major="k" if layout == "nk_view" else "n")
    assert plan.kernel == _one(v)


@pytest.mark.parametrize("G,M,N,K,layout,config,out_dtype,expected_m", [
    (6, 200, 264, 136, "kn", GemmConfig(schedule="pingpong"), None, None),
    (32, 128, 4096, 7168, "nk_view", GemmConfig(), None, 8),
    (7, 384, 512, 256, "nk_view", GemmConfig(cluster_m=1, cluster_n=2), torch.float32, None),
])
def test_masked_variant_is_the_launch_key(keys_of_launches, G, M, N, K, layout, config,
                                          out_dtype, expected_m):
    from moe_gemm.ops.masked_launch import MaskedPlan
    from moe_gemm.ops.masked_validation import check_grouped_mm_masked

    x = _empty((G, M, K))
    w = _empty((G, N, K)).transpose(1, 2) if layout == "nk_view" else _empty((G, K, N))
    counts = torch.zeros(G, dtype=torch.int32)
    plan = MaskedPlan(check_grouped_mm_masked(x, w, counts, expected_m, None, out_dtype),
                      config)
    v = Variants()
    v.masked(G, M, N, K, config, out_dtype=out_dtype,
             b_major="k" if layout == "nk_view" else "n", expected_m=expected_m)
    assert plan.kernel == _one(v)


@pytest.mark.parametrize("G,M,N,K,gate,layout,major,bias,scale,expected_m", [
    (6, 200, 256, 136, "silu", "concat", "k", True, True, None),
    (32, 128, 4096, 7168, "silu", "concat", "k", False, False, 8),
    (6, 200, 272, 136, "clamped_swiglu", "alternating", "n", True, True, None),
    (6, 200, 272, 136, None, "concat", "n", False, True, 16),
])
def test_fused_masked_variant_is_the_launch_key(keys_of_launches, monkeypatch, G, M, N, K,
                                                gate, layout, major, bias, scale, expected_m):
    from moe_gemm.ops import fused_launch
    from moe_gemm.ops.fused_masked import check_fused_masked

    from .variants import fused_masked_key

    monkeypatch.setattr(fused_launch, "sm_count", lambda device: 132)
    x = _empty((G, M, K))
    w = _empty((G, N, K)).transpose(1, 2) if major == "k" else _empty((G, K, N))
    args = check_fused_masked(x, w, torch.zeros(G, dtype=torch.int32),
                              bias=torch.zeros(G, N) if bias else None,
                              row_weight=torch.zeros(G, M) if scale else None, gate=gate,
                              gate_layout=layout, expected_m=expected_m)
    plan = fused_launch.FusedPlan(args.flat, GemmConfig(), expected_m=args.expected_m)
    assert plan.kernel == fused_masked_key(G, M, N, K, gate=gate, layout=layout, w_major=major,
                                           bias=bias, scale=scale, expected_m=expected_m)
    assert plan.kernel.row_counts and not plan.kernel.gather and not plan.kernel.tail_split


def test_test_variants_cover_every_kind():
    keys = kernel_test_variants()
    names = [k.name() for k in keys]
    assert len(names) == len(set(names))
    assert {k.form for k in keys} == {"general", "varlen", "batched", "masked"}
    for flag in ("trace", "tail_split", "epi_whole"):
        assert any(getattr(k, flag) for k in keys), flag
    assert {(k.cluster_m, k.cluster_n) for k in keys} >= {(1, 1), (2, 1), (1, 2)}
    assert {k.visitor for k in keys} == {"device", "host"}


def test_router_test_variants_compile_through_the_precompile_path():
    """The router keys the precompile adds are distinct and compile_any builds one of each kind
    (on the CPU, for sm90a)."""
    pytest.importorskip("cutlass")
    from moe_gemm.kernels.sm90.compile_fp8 import compile_any
    from moe_gemm.kernels.sm90.router_topk import GroupTopkCompileKey, RouterTopkCompileKey

    keys = router_test_variants()
    assert len({k.name() for k in keys}) == len(keys) >= 20
    for kind in (RouterTopkCompileKey, GroupTopkCompileKey):
        first = next(k for k in keys if isinstance(k, kind))
        assert compile_any(first) is not None


def test_fp8_test_variants_are_kernels_that_build():
    """Every FP8 variant the GPU tests precompile is one the kernel's constructor accepts (a
    list that pairs options the kernel refuses fails the precompile on the GPU machine)."""
    pytest.importorskip("cutlass")
    from moe_gemm.kernels.sm90.compile_fp8 import Fp8CompileKey

    from .variants_fp8 import fp8_test_variants

    keys = [k for k in fp8_test_variants() if isinstance(k, Fp8CompileKey)]
    assert any(k.promote_lag for k in keys) and any(k.scale_ahead > 1 for k in keys)
    for key in keys:
        key.kernel()


def test_session_groups_split_big_files_and_name_the_rest():
    gs = _load_script("gpu_session")
    assert gs.group_name("tests/kernels/test_general_gpu.py::test_general_matrix[a]") == \
        "general-matrix"
    assert gs.group_name("tests/kernels/test_general_gpu.py::test_headline[x]") == "general"
    assert gs.group_name("tests/kernels/test_clusters_gpu.py::test_cluster_general[1]") == \
        "clusters-general"
    assert gs.group_name("tests/kernels/test_tail_split_gpu.py::test_tail_split_bmm") == \
        "tail-split"
    assert gs.group_name("tests/layers/test_moe_gpu.py::test_x") == "layers-moe"
    assert gs.group_name("tests/server/test_engine.py::test_y") == "server-engine"


def test_session_group_selection_refuses_patterns_that_match_nothing():
    gs = _load_script("gpu_session")
    groups = {n: gs.Group(n) for n in ("fp8", "layers-moe", "layers-moe-fp8", "tiles")}
    assert set(gs.select_groups(groups, "fp8, layers-*")) == {"fp8", "layers-moe",
                                                              "layers-moe-fp8"}
    for bad in ("fp9", "fp8,server-*", " , "):
        with pytest.raises(ValueError, match="matches no group; the groups: fp8, layers-moe"):
            gs.select_groups(groups, bad)


def test_ptxas_audit_reads_spills_and_wgmma_notes(monkeypatch):
    audit = _load_script("ptxas_audit")
    stderr = (
        "ptxas info    : (C7517) warpgroup.wait is injected in around line 1388 by compiler\n"
        "ptxas info    : (C7519) warpgroup.arrive is injected in around line 1277\n"
        "ptxas info    : (C7519) warpgroup.arrive is injected in around line 1509\n"
        "    32 bytes stack frame, 36 bytes spill stores, 32 bytes spill loads\n")

    class Done:
        returncode = 0

    def run(cmd, **kw):
        assert cmd[:3] == ["ptxas", "-arch=sm_90a", "-v"]
        done = Done()
        done.stderr = stderr
        return done

    monkeypatch.setattr(audit.subprocess, "run", run)
    rep = audit.ptxas_report("k.ptx")
    assert rep["notes"] == {"C7517": 1, "C7519": 2} and not rep["serialized"]
    assert (rep["spill_stores"], rep["spill_loads"]) == (36, 32)
    stderr = "ptxas info    : (C7514) Potential Performance Loss: wgmma serialized\n" \
             "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
    rep = audit.ptxas_report("k.ptx")
    assert rep["serialized"] and rep["spill_stores"] == 0


def test_session_summary_counts_the_worst_outcome_and_unfinished_tests(tmp_path):
    gs = _load_script("gpu_session")
    report = tmp_path / "g.jsonl"
    rows = [{"kind": "test", "nodeid": "t::a", "outcome": "passed", "seconds": 1.0},
            {"kind": "test", "nodeid": "t::a", "outcome": "error", "seconds": 0.5},
            {"kind": "test", "nodeid": "t::b", "outcome": "skipped", "seconds": 0.0},
            {"kind": "case", "name": "c", "passed": True},
            {"kind": "compile", "name": "k", "seconds": 2.0}]
    report.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"cut')
    group = gs.Group("g", tests=["t::a", "t::b", "t::c"], rc=1, report=str(report))
    s = gs.summarize(group)
    assert (s["passed"], s["error"], s["skipped"], s["unfinished"]) == (0, 1, 1, 1)
    assert s["compiled_in_tests"] == 1 and len(s["_cases"]) == 1 and not s["ok"]
    assert [t["seconds"] for t in s["_tests"]] == [1.5, 0.0, 0.0]
    group = gs.Group("g", tests=["t::b"], rc=0, report=str(report))
    assert gs.summarize(group)["ok"]


pytest_plugins = ["pytester"]


def test_report_plugin_writes_tests_cases_and_collected_ids(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [
        ROOT, os.environ.get("PYTHONPATH")])))
    report, ids = pytester.path / "r.jsonl", pytester.path / "ids.json"
    monkeypatch.setenv("MOE_GEMM_GPU_REPORT", str(report))
    monkeypatch.setenv("MOE_GEMM_GPU_COLLECT", str(ids))
    pytester.makepyfile(test_inner="""
        import pytest
        from tests.kernels.gpu_report import record

        def test_ok():
            record("case-ok", True, err=0.5)

        def test_bad():
            assert False

        @pytest.mark.skip(reason="no")
        def test_skip():
            pass
    """)
    result = pytester.runpytest_subprocess("-p", "tests.kernels.gpu_report", "-q")
    result.assert_outcomes(passed=1, failed=1, skipped=1)
    rows = [json.loads(line) for line in report.read_text().splitlines()]
    tests = {r["nodeid"].split("::")[1]: r["outcome"] for r in rows if r["kind"] == "test"}
    assert tests == {"test_ok": "passed", "test_bad": "failed", "test_skip": "skipped"}
    cases = [r for r in rows if r["kind"] == "case"]
    assert cases[0]["name"] == "case-ok" and cases[0]["test"].endswith("::test_ok")
    assert [i.split("::")[1] for i in json.loads(ids.read_text())] == [
        "test_ok", "test_bad", "test_skip"]


def _no_constant(word: str):
    raise ValueError(f"not JSON: {word}")


def test_report_rows_are_strict_json(tmp_path, monkeypatch):
    # A case's error is NaN by design where a kernel left its (NaN-poisoned) output unwritten;
    # the row held the bare word NaN, and strict readers (jq) refused the whole report.
    from .gpu_report import record

    report = tmp_path / "r.jsonl"
    monkeypatch.setenv("MOE_GEMM_GPU_REPORT", str(report))
    record("case-nan", False, err=float("nan"), ratio=float("-inf"))
    row = json.loads(report.read_text(), parse_constant=_no_constant)
    assert row["name"] == "case-nan" and row["err"] is None and row["ratio"] is None


def test_precompile_zoo_set_is_what_the_zoo_launches(monkeypatch):
    # scripts/precompile.py --set zoo: every zoo projection's default kernel on the named
    # GPU (its shipped table), as the launch path keys it; an unknown GPU gets the rules'.
    monkeypatch.setenv("MOE_GEMM_TUNED_TABLES", "1")  # (the shipped tables, as a user has)
    from moe_gemm.ops.heuristics import choose_varlen
    from moe_gemm.tuning import zoo

    pre = _load_script("precompile")
    h100 = pre.zoo_variants("NVIDIA H100 80GB HBM3")
    assert len(h100) >= 10 and {k.form for k in h100} == {"varlen"}
    model = zoo.select_models("Qwen3-235B-A22B")[0]
    proj = model.projections()[0]
    choice = choose_varlen(GemmConfig(), proj.rows(8192), proj.E, proj.N, proj.K, 132,
                           device="NVIDIA H100 80GB HBM3")
    key = launch_kernel._compile_key("varlen", torch.bfloat16, torch.bfloat16,
                                     "k" if proj.layout == "ENK" else "n", choice, False)
    assert key in h100
    assert pre.zoo_variants("a GPU with no table") != h100
    with pytest.raises(SystemExit, match="needs --device"):
        pre.variant_set("zoo")


def test_precompile_zoo_fp8_set_is_what_the_fp8_zoo_launches(monkeypatch):
    # scripts/precompile.py --set zoo-fp8: our FP8 rows' kernels (block-scaled default, its
    # ring row, row-wise) for every FP8 model's projections, whatever the switch is outside.
    from moe_gemm.ops.heuristics_fp8 import SMEM_SCALES_ENV, choose_fp8
    from moe_gemm.ops.scaled_launch import fp8_compile_key
    from moe_gemm.tuning import zoo

    monkeypatch.setenv(SMEM_SCALES_ENV, "1")
    pre = _load_script("precompile")
    keys = pre.zoo_fp8_variants()
    assert os.environ[SMEM_SCALES_ENV] == "1"  # (restored)
    assert {k.form for k in keys} == {"varlen"} and {k.scale_mode for k in keys} == {
        "block", "outer"}
    assert any(k.smem_scales for k in keys) and any(
        k.scale_mode == "block" and not k.smem_scales for k in keys)
    monkeypatch.delenv(SMEM_SCALES_ENV)
    model = zoo.select_models("DeepSeek-V3")[0]
    proj = model.projections()[0]
    rows = sum(zoo.topk_counts(proj.E, 2048, proj.top_k, 0))
    choice = choose_fp8("varlen", GemmConfig(), rows / proj.E, proj.N, proj.K, 2, "block")
    assert fp8_compile_key("varlen", torch.float8_e4m3fn, torch.bfloat16, "block",
                           choice) in keys
    assert pre.variant_set("zoo-fp8") == keys


def _session_report(groups: dict[str, list[str]], seconds: float) -> dict:
    tests = [{"nodeid": f"{g}::{t}", "outcome": o, "seconds": 1.0}
             for g, ts in groups.items() for t, o in (x.split(":") for x in ts)]
    rows = []
    for g, ts in groups.items():
        outs = [x.split(":")[1] for x in ts]
        rows.append({"group": g, "tests": len(ts), "passed": outs.count("passed"),
                     "failed": outs.count("failed"), "error": 0, "unfinished": 0,
                     "xpassed": 0, "skipped": 0, "compiled_in_tests": 0, "seconds": 1.0,
                     "ok": "failed" not in outs, "rc": 0 if "failed" not in outs else 1})
    return {"machine": {"gpu": "H200"}, "command": ["gpu_session.py", "--groups",
                                                    ",".join(groups)],
            "seconds": seconds, "precompile": None, "collection_errors": [], "groups": rows,
            "tests": tests, "cases": [{"name": g} for g in groups], "compiled_in_tests": []}


def test_session_reports_of_several_gpus_merge_into_one(tmp_path, capsys, monkeypatch):
    gs = _load_script("gpu_session")
    a = _session_report({"tiles": ["x:passed", "y:passed"]}, 200.0)
    b = _session_report({"fp8": ["z:passed"], "graphs": ["w:passed"]}, 300.0)
    merged = gs.merge_reports([a, b])
    assert [g["group"] for g in merged["groups"]] == ["fp8", "graphs", "tiles"]
    assert len(merged["tests"]) == 4 and len(merged["sessions"]) == 2
    assert merged["seconds"] == 300.0 and merged["sessions"][1]["command"][-1] == "fp8,graphs"
    # A merged report merges again (its sessions kept); one group in two reports is refused.
    c = _session_report({"varlen": ["v:failed"]}, 10.0)
    again = gs.merge_reports([merged, c])
    assert len(again["sessions"]) == 3 and len(again["tests"]) == 5
    with pytest.raises(ValueError, match="tiles"):
        gs.merge_reports([a, a])
    # The command line: files in, one report out; exit 1 when a merged group failed.
    for name, doc in (("a", a), ("b", b), ("c", c)):
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    argv = ["gpu_session.py", "--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
            "--out", str(tmp_path / "out")]
    monkeypatch.setattr(sys, "argv", argv)
    assert gs.main() == 0
    assert json.loads((tmp_path / "out" / "gpu-tests.json").read_text()) == merged
    assert "total" in capsys.readouterr().out
    argv[2:4] = [str(tmp_path / "a.json"), str(tmp_path / "c.json")]
    assert gs.main() == 1
    argv[2:4] = [str(tmp_path / "a.json"), str(tmp_path / "missing.json")]
    assert gs.main() == 2


def test_session_spreads_groups_over_gpus(tmp_path, monkeypatch):
    """--gpus: each group's process goes to the least busy GPU; a multi-GPU group sees all."""
    gs = _load_script("gpu_session")
    started = []

    class Done:
        def __init__(self, env):
            self.env = env

        def poll(self):
            return 0

    def fake_start(cmd, log, env):
        started.append(env.get("CUDA_VISIBLE_DEVICES"))
        return Done(env)

    monkeypatch.setattr(gs, "start", fake_start)
    monkeypatch.setattr(gs.time, "sleep", lambda s: None)
    sizes = {"tiles": 9, "fp8": 7, "batched": 5, "varlen": 3, "layers-expert-parallel": 2}
    groups = [gs.Group(n, tests=[f"t::{i}" for i in range(k)]) for n, k in sizes.items()]
    gs.run_groups(groups, jobs=4, group_timeout=60, deadline=gs.time.monotonic() + 600,
                  pytest_args=[], work=str(tmp_path), gpus=["2", "5"])
    by = {g.name: g.gpu for g in groups}
    # Largest first, four at once: tiles -> 2, fp8 -> 5, batched -> 2, varlen -> 5; then the
    # NCCL group on both.
    assert by == {"tiles": "2", "fp8": "5", "batched": "2", "varlen": "5",
                  "layers-expert-parallel": "2,5"}
    assert started == ["2", "5", "2", "5", "2,5"]
    assert all(g.rc == 0 for g in groups) and gs.summarize(groups[0])["gpu"] == "2"
    running = [gs.Group("a", gpu="2"), gs.Group("b", gpu="2"), gs.Group("c", gpu="5")]
    assert gs.pick_gpu(["2", "5"], running) == "5" and gs.pick_gpu([], running) is None
    # Without --gpus nothing changes: the process's own GPU, no gpu in the summary.
    plain = [gs.Group("tiles", tests=["t::0"])]
    started.clear()
    gs.run_groups(plain, jobs=4, group_timeout=60, deadline=gs.time.monotonic() + 600,
                  pytest_args=[], work=str(tmp_path))
    assert started == [None] and plain[0].gpu is None and "gpu" not in gs.summarize(plain[0])


def test_gpu_tests_merge_refuses_bad_inputs_in_one_line_and_keeps_precompile_failures(
        tmp_path, capsys):
    gs = _load_script("gpu_session")
    group = {"group": "g", "rc": 0, "seconds": 1.0, "tests": 1, "passed": 1, "failed": 0,
             "error": 0, "skipped": 0, "xfailed": 0, "xpassed": 0, "unfinished": 0,
             "compiled_in_tests": 0, "ok": True}
    pre = {"rc": 1, "seconds": 3.0, "summary": "1 compiled, 0 cached, 1 failed",
           "failed": ["FAILED k: boom"]}
    good = tmp_path / "g0.json"
    good.write_text(json.dumps({"groups": [group], "precompile": {**pre, "rc": 0,
                                                                  "failed": []}}))
    assert gs.merge_main([str(good)], str(tmp_path / "m")) == 0
    # A run whose precompile failed exited 1 by itself; merged, the join said 0.
    failed = tmp_path / "g1.json"
    failed.write_text(json.dumps({"groups": [dict(group, group="h")], "precompile": pre}))
    capsys.readouterr()
    assert gs.merge_main([str(good), str(failed)], str(tmp_path / "m")) == 1
    assert "precompile: rc=1: 1 compiled, 0 cached, 1 failed" in capsys.readouterr().err
    # Tracebacks before: an --out that is a file (FileExistsError), a report that is a list
    # (AttributeError).
    listed = tmp_path / "list.json"
    listed.write_text("[]")
    for files, out, words in (([good], good, f"error: --out {good} is a file"),
                              ([good, listed], tmp_path / "m", "not a gpu-tests.json report")):
        assert gs.merge_main([str(f) for f in files], str(out)) == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err


def test_gpu_tests_run_leaves_no_work_folder_behind(tmp_path, monkeypatch, capsys):
    # Every run (--list too) left its folder of logs in the temporary directory;
    # the logs are copied into --out's gpu-logs.txt.
    import tempfile

    gs = _load_script("gpu_session")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    monkeypatch.setattr(gs, "probe", lambda: {"problem": None})
    monkeypatch.setattr(gs, "collect", lambda paths, k, log: (["tests/x/test_a.py::t"], []))
    monkeypatch.setattr(sys, "argv", [gs.__file__, "--list", "--out", str(tmp_path / "o")])
    assert gs.main() == 0
    assert "x-a" in capsys.readouterr().out
    assert list(scratch.iterdir()) == []


def test_gpu_tests_list_needs_no_out_and_a_run_does(tmp_path, monkeypatch, capsys):
    # --list writes nothing, but argparse asked it for --out (and then --out was created).
    gs = _load_script("gpu_session")
    monkeypatch.setattr(gs, "probe", lambda: {"problem": None})
    monkeypatch.setattr(gs, "collect", lambda paths, k, log: (["tests/x/test_a.py::t"], []))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [gs.__file__, "--list"])
    assert gs.main() == 0
    assert "x-a" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", [gs.__file__, "--list", "--out", str(tmp_path / "o")])
    assert gs.main() == 0
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(gs, "run_groups", lambda *a, **k: pytest.fail("ran without --out"))
    for argv in ([], ["--merge", str(tmp_path / "a.json")]):
        monkeypatch.setattr(sys, "argv", [gs.__file__, *argv])
        with pytest.raises(SystemExit) as exc:
            gs.main()
        assert exc.value.code == 2
        assert "--out is required (except with --list)" in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["--set", "check", "-j", "0"], "-j/--jobs 0: must be at least 1"),
    (["--set", "check", "-j", "-3"], "-j/--jobs -3: must be at least 1"),
    (["--set", "check", "--timeout", "0"], "--timeout 0.0: must be positive"),
    (["--set", "zoo", "--list"], "--set zoo needs --device")])
def test_precompile_usage_errors_exit_2_in_one_line(argv, words, capsys, monkeypatch):
    # -j -3 raised ValueError out of multiprocessing.Pool (a traceback); --set zoo without
    # --device exited 1, the status of a failed compile.
    pre = _load_script("precompile")
    monkeypatch.setattr(pre, "compile_all", lambda *a: pytest.fail("compiled"))
    with pytest.raises(SystemExit) as exc:
        pre.main(argv)
    assert exc.value.code == 2
    assert f"error: {words}" in capsys.readouterr().err.splitlines()[-1]


def test_gpu_session_keeps_tests_folder_off_the_path():
    # tests/ on PYTHONPATH would make tests/kernels the top-level `kernels`, shadowing the
    # Hugging Face package transformers imports (its GPU tests would fail to collect).
    gs = _load_script("gpu_session")
    paths = gs.child_env()["PYTHONPATH"].split(os.pathsep)
    assert ROOT in paths and os.path.join(ROOT, "tests") not in paths


@pytest.mark.slow
def test_precompile_lists_the_test_sets_from_a_plain_shell(tmp_path):
    # The precompile step imports tests.kernels' variant lists by the package name pytest
    # gives them, with no PYTHONPATH and from another working directory.
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for which in ("fused", "fp8"):
        run = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "precompile.py"),
                              "--list", "--set", which], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        names = run.stdout.split()
        assert names and all(n.startswith(("varlen_", "fp8", "general_", "batched_", "masked_"))
                             for n in names[:3]), names[:3]


def test_ncu_probe_layer_calls_are_the_fused_gemms_and_their_plain_twins(monkeypatch):
    """scripts/ncu_probe.py --layer: on the CPU (the torch backend) the fused gate-up call is
    the gate over the plain call's columns, the interleaved weight gives the same, and the
    fused down call is the plain one times the row weights."""
    import torch

    from benchmarks import fused_configs
    from moe_gemm.ops.fused_reference import gate_torch, split_gate_up

    probe = _load_script("ncu_probe")
    # (a small layer of Qwen3's kind: the real ones' weights take a minute to draw on a CPU)
    monkeypatch.setitem(fused_configs.MODELS, "tiny", dict(kind="qwen3", H=256, I=768 // 8,
                                                           E=8, k=4))
    monkeypatch.setitem(fused_configs.MODELS, "tiny-gpt", dict(kind="gpt-oss", H=64, I=64,
                                                               E=4, k=2))
    calls = probe.layer_calls("tiny", 16, True, torch.device("cpu"))
    assert list(calls) == ["plain up", "fused up", "plain down", "fused down",
                           "fused up, interleaved"]
    out = {name: call().float() for name, call in calls.items()}
    gate, up = split_gate_up(out["plain up"], "concat")
    want = gate_torch("silu", gate, up, 1.702, 7.0)
    assert out["fused up"].shape == want.shape == (64, 96)
    # (the plain call rounds its 2I columns to bf16 before the gate; the fused one does not)
    torch.testing.assert_close(out["fused up"], want, atol=0.1, rtol=0.05)
    assert torch.equal(out["fused up, interleaved"], out["fused up"])
    assert out["fused down"].shape == out["plain down"].shape == (64, 256)
    assert not torch.equal(out["fused down"], out["plain down"])  # (row weights in (0, 1))
    with pytest.raises(SystemExit, match="concat-gate"):
        probe.layer_calls("tiny-gpt", 4, False, torch.device("cpu"))
