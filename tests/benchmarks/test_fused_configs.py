"""benchmarks.fused_configs on the CPU: variant parsing, the cases, the kernel keys, and a
smoke run end to end (the torch backend: the harness, not the speed)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import fused_configs as fc


def test_parse_variant():
    cfg = fc.parse_variant("coop 256x192 c2x1")
    assert (cfg.schedule, cfg.tile_m, cfg.tile_n, cfg.cluster_m, cfg.cluster_n) == (
        "cooperative", 256, 192, 2, 1)
    cfg = fc.parse_variant(" pp 128x128 ")
    assert (cfg.schedule, cfg.cluster_m, cfg.cluster_n) == ("pingpong", 1, 1)
    for bad in ("coop", "wide 128x128", "pp 128x128 c2", "pp 128 x 128", "pp 128x128 narrow"):
        with pytest.raises(ValueError, match="pp\\|coop MxN"):
            fc.parse_variant(bad)
    assert fc.parse_variant("pp 128x192 c2x1 wide").cluster_m == 2
    assert fc.variant_env("pp 128x192 c2x1 wide") == {"MOE_GEMM_FUSED_GATHER_WIDE": "1"}
    assert fc.variant_env("pp 128x192 c2x1") == {} and fc.variant_env("default") == {}
    assert fc.parse_variant("coop 128x256 c2x1 select").tile_n == 256
    assert fc.variant_env("coop 128x256 c2x1 select") == {}
    assert fc.parse_variant("default select") is None and fc.selects_first("default select")
    assert fc.parse_variant("default ieeegate") is None
    # the bare default: the row every case times first, named again without an error
    assert fc.parse_variant("default") is None and fc.variant_env("default") == {}
    assert fc.variant_env("default ieeegate") == {"MOE_GEMM_FUSED_FAST_GATE": "0"}
    assert fc.variant_env("pp 128x192 c2x1 wide ieeegate") == {
        "MOE_GEMM_FUSED_GATHER_WIDE": "1", "MOE_GEMM_FUSED_FAST_GATE": "0"}
    cfg = fc.parse_variant("pp 128x192 c2x1 select ieeegate")
    assert cfg.tile_n == 192 and fc.selects_first("pp 128x192 c2x1 select ieeegate")
    with pytest.raises(ValueError, match="wide\\|select"):
        fc.parse_variant("pp 128x192 ieeegate ieeegate")
    assert fc.parse_variant("default wide") is None  # the default's kernel, gathering wide
    # swapped tiles: pinned, or kept out of the default's kernel
    assert fc.parse_variant("swap 256x128").swap_ab is True
    assert fc.parse_variant("default noswap") is None
    assert fc.variant_env("default noswap") == {"MOE_GEMM_SWAP_AB": "0"}
    assert fc.variant_env("coop 256x192 c2x1 ieeegate noswap") == {
        "MOE_GEMM_FUSED_FAST_GATE": "0", "MOE_GEMM_SWAP_AB": "0"}
    assert fc.variant_env("default wide nofence") == {
        "MOE_GEMM_FUSED_GATHER_WIDE": "1", "MOE_GEMM_GATHER_FENCE": "0"}
    assert fc.parse_variant("pp 128x192 wide nofence").tile_n == 192
    # the A/A control: the default's kernel and environment under a second name
    assert fc.parse_variant("default control") is None and fc.variant_env("default control") == {}
    assert not fc.selects_first("default control")
    cfg = fc.parse_variant("pp 128x192 c2x1 p8ns")  # the tuner's raster words
    assert (cfg.raster_panel, cfg.raster_along, cfg.raster_serpentine) == (8, "n", True)
    for bad in ("pp 128x128 wide select", "pp 128x128 c2x1 host"):
        with pytest.raises(ValueError, match="wide\\|select"):
            fc.parse_variant(bad)


def test_select_variant_gathers_first_and_matches_the_in_kernel_gather():
    case = fc.build_cases(fc.parser().parse_args(
        ["--models", "qwen3-30b-a3b", "--tokens", "9", "--smoke", "--up", "pp 128x128 select",
         "--down", "pp 128x128"]), torch.device("cpu"))[0]
    kw = case["kw"]
    host = fc.variant_kw(kw, "pp 128x128 select")
    assert "row_index" not in host and host["x"].shape == (kw["row_index"].shape[0],
                                                           kw["x"].shape[1])
    assert fc.variant_kw(kw, "pp 128x128") is kw
    cfg = fc.parse_variant("pp 128x128 select")
    torch.testing.assert_close(fc.variant_call(kw, cfg, "pp 128x128 select")(),
                               fc.variant_call(kw, cfg, "pp 128x128")())
    keys = fc.compile_keys([case], torch.device("cpu"), 132)
    assert False in {k.gather for k in keys}  # the select variant's kernel reads routed rows


@pytest.mark.parametrize("model", ["deepseek-v3-ep8", "gpt-oss-120b"])
def test_unfused_variant_computes_what_the_fused_call_does(model):
    """'unfused' (grouped_mm, then bias, gate and row weight as torch ops) against the fused
    call, on the up (gather, gate; gpt-oss: bias, clamped SwiGLU, alternating) and the down
    (row weight; gpt-oss: bias) GEMM."""
    assert fc.parse_variant("unfused") == fc.GemmConfig()
    assert fc.parse_variant("unfused noswap").swap_ab is False
    for bad in ("unfused wide", "unfused noswap noswap", "unfused coop 128x128"):
        with pytest.raises(ValueError, match="'unfused' or 'unfused noswap'"):
            fc.parse_variant(bad)
    for case in fc.build_cases(fc.parser().parse_args(
            ["--models", model, "--tokens", "9", "--smoke", "--up", "unfused", "--down",
             "unfused noswap"]), torch.device("cpu")):
        name = "unfused" if case["proj"] == "up" else "unfused noswap"
        want = fc.variant_call(case["kw"], None, "default")()
        got = fc.variant_call(case["kw"], case["configs"][name], name)()
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert fc.kernel_choices(case, torch.device("cpu"), 132)[name] is None


def test_with_environment_sets_the_variables_for_the_call_only(monkeypatch):
    import os

    monkeypatch.delenv("MOE_GEMM_FUSED_GATHER_WIDE", raising=False)
    fn = fc.with_environment(lambda: os.environ.get("MOE_GEMM_FUSED_GATHER_WIDE"),
                             {"MOE_GEMM_FUSED_GATHER_WIDE": "1"})
    assert fn() == "1" and "MOE_GEMM_FUSED_GATHER_WIDE" not in os.environ


@pytest.mark.parametrize("model", list(fc.SMOKE_MODELS))
def test_layer_case_routes_every_slot_once(model):
    m = fc.SMOKE_MODELS[model]
    T = 13
    case = fc.layer_case(m, T, torch.device("cpu"), torch.float32)
    up, down = case["up"]["kw"], case["down"]["kw"]
    S = T * m["k"]
    assert up["row_index"].shape == (S,) and int(up["offs"][-1]) == S
    # each token appears k times, each expert's rows in token order
    assert torch.bincount(up["row_index"].long(), minlength=T).tolist() == [m["k"]] * T
    assert down["x"].shape == (S, m["I"]) and down["row_weight"].shape == (S,)
    assert ("bias" in up) == (m["kind"] == "gpt-oss")
    assert case["up"]["flops"] == 2 * S * m["H"] * 2 * m["I"]


def test_compile_keys_one_per_kernel():
    args = fc.parser().parse_args(["--models", "qwen3-30b-a3b", "--tokens", "64",
                                   "--up", "pp 128x192 c2x1", "--up", "pp 128x192 c2x1",
                                   "--down", "coop 256x128 c2x1"])
    cases = fc.build_cases(args, torch.device("cpu"))
    assert [c["proj"] for c in cases] == ["up", "down"]
    assert list(cases[0]["configs"]) == [fc.DEFAULT, "pp 128x192 c2x1"]
    keys = fc.compile_keys(cases, torch.device("cpu"), 132)
    assert 2 <= len(keys) <= 4  # the defaults and the variants (a variant may be a default)
    wide = fc.build_cases(fc.parser().parse_args(
        ["--models", "qwen3-30b-a3b", "--tokens", "64", "--up", "pp 128x192 c2x1 wide",
         "--down", "pp 128x128"]), torch.device("cpu"))
    gathers = [k.gather for k in fc.compile_keys(wide[:1], torch.device("cpu"), 132)]
    assert True in gathers  # the wide variant's kernel gathers
    assert all(k.name() for k in keys)


def test_smoke_run_writes_rows(tmp_path):
    out = tmp_path / "fc.json"
    rc = fc.main(["--smoke", "--models", "qwen3-30b-a3b", "--tokens", "9", "--rounds", "2",
                  "--calls", "1", "--up", "coop 256x192 c2x1", "--down", "pp 128x128 c1x2",
                  "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["suite"] == "fused-configs" and data["device"] == "cpu"
    rows = data["rows"]
    assert [(r["proj"], r["variant"]) for r in rows] == [
        ("up", "default"), ("up", "coop 256x192 c2x1"), ("down", "default"),
        ("down", "pp 128x128 c1x2")]
    assert all(r["us"] > 0 and r["rel_err"] <= 2e-2 for r in rows)
    assert rows[0]["ratio"] == 1.0
    assert data["timing"]["order_seed"] == 0


def test_the_order_seed_changes_which_variant_follows_which():
    def orders(seed: int) -> list[list[int]]:
        seen: list[int] = []
        fns = [lambda i=i: seen.append(i) for i in range(5)]
        fc.time_interleaved(fns, rounds=4, calls=1, device=torch.device("cpu"),
                            order_seed=seed)
        # each batch runs behind its own warm-up: one warm-up call and one timed call per fn
        timed = seen[1::2]
        assert sorted(timed) == sorted(list(range(5)) * 4)
        return [timed[5 * r:5 * r + 5] for r in range(4)]

    assert orders(0) == orders(0)  # reproducible
    assert orders(0) != orders(1)
    assert all(sorted(o) == list(range(5)) for o in orders(1))  # every fn once a round


def test_bad_arguments_are_errors(capsys):
    assert fc.main(["--smoke", "--models", "nope"]) == 2
    assert "--models: unknown 'nope'" in capsys.readouterr().err
    assert fc.main(["--smoke", "--up", "coop"]) == 2
    assert "pp|coop MxN" in capsys.readouterr().err


def test_kernel_choices_name_the_fitted_tile():
    args = fc.parser().parse_args(["--models", "deepseek-v3-ep8", "--tokens", "64",
                                   "--up", "pp 128x192 c2x1", "--up", "pp 128x192 c2x1 wide",
                                   "--down", "pp 128x128 c1x2"])
    up, down = fc.build_cases(args, torch.device("cpu"))
    picked = fc.kernel_choices(up, torch.device("cpu"), 132)
    assert set(picked) == {fc.DEFAULT, "pp 128x192 c2x1", "pp 128x192 c2x1 wide"}
    # A 128x192 gathered tile takes the shared-memory row form: without 'wide' the plan gathers.
    assert fc.describe(*picked["pp 128x192 c2x1"]) == "pp 128x192 c2x1 p8"
    assert fc.describe(*picked["pp 128x192 c2x1 wide"]) == "pp 128x192 c2x1 p8, in-kernel gather"
    assert fc.describe(*fc.kernel_choices(down, torch.device("cpu"), 132)["pp 128x128 c1x2"]) \
        == "pp 128x128 c1x2 p8"
    # A raster pinned in the variant reaches the kernel's choice.
    args = fc.parser().parse_args(["--models", "deepseek-v3-ep8", "--tokens", "64",
                                   "--up", "pp 128x192 c2x1 p8ns", "--down", "pp 128x128"])
    up, _ = fc.build_cases(args, torch.device("cpu"))
    assert fc.describe(*fc.kernel_choices(up, torch.device("cpu"), 132)[
        "pp 128x192 c2x1 p8ns"]) == "pp 128x192 c2x1 p8ns"


def test_quack_peer_rows_say_why_they_did_not_run(tmp_path):
    out = tmp_path / "fc.json"
    rc = fc.main(["--smoke", "--models", "qwen3-30b-a3b,gpt-oss-120b", "--tokens", "9",
                  "--rounds", "1", "--calls", "1", "--up", "pp 128x128", "--down", "pp 128x128",
                  "--quack", "--out", str(out)])
    assert rc == 0
    peers = [r for r in json.loads(out.read_text())["rows"] if r["variant"] == fc.QUACK]
    assert len(peers) == 4 and all(r["peer"] and "us" not in r for r in peers)
    why = {(r["model"], r["proj"]): r["error"] for r in peers}
    # gpt-oss's clamped SwiGLU over alternating columns has no QuACK counterpart on any device.
    assert "alternating" in why["gpt-oss-120b", "up"]
    assert all("GPU" in e for k, e in why.items() if k != ("gpt-oss-120b", "up"))


def test_a_non_finite_result_is_written_as_null(tmp_path, monkeypatch):
    # The record was json.dumps output: a NaN rel_err (the check of an unwritten output) was
    # written as the bare word NaN, which strict JSON readers refuse with the whole file.
    real = fc.run_case
    monkeypatch.setattr(fc, "run_case", lambda *a, **kw: [
        {**r, "rel_err": float("nan")} for r in real(*a, **kw)])
    out = tmp_path / "fc.json"
    assert fc.main(["--smoke", "--models", "qwen3-30b-a3b", "--tokens", "9", "--rounds", "2",
                    "--calls", "1", "--out", str(out)]) == 0

    def no_constant(word):
        raise ValueError(f"not JSON: {word}")

    rows = json.loads(out.read_text(), parse_constant=no_constant)["rows"]
    assert rows and all(r["rel_err"] is None for r in rows)


def test_a_layer_of_your_own():
    name, layer = fc.parse_layer("2880, 2880,32,4,gpt-oss")
    assert name == "layer-2880x2880x32x4-gpt-oss"
    assert layer == dict(kind="gpt-oss", H=2880, I=2880, E=32, k=4)
    assert fc.parse_layer("64,32,8,2") == ("layer-64x32x8x2", dict(kind="custom", H=64, I=32,
                                                                  E=8, k=2))
    for bad in ("64,32,8", "64,32,8,9", "64,32,0,1", "64,32,8,2,mixtral", "a,b,c,d"):
        with pytest.raises(ValueError, match="H,I,E,K"):
            fc.parse_layer(bad)
    cases = fc.build_cases(fc.parser().parse_args(
        ["--layer", "64,32,8,2,gpt-oss", "--tokens", "5", "--smoke", "--up", "pp 128x128",
         "--down", "pp 128x128"]), torch.device("cpu"))
    assert [c["model"] for c in cases] == ["layer-64x32x8x2-gpt-oss"] * 2
    up = cases[0]
    assert up["shape"] == dict(form="fused-gate-bias", dtype="float32", out_dtype="float32",
                               E=8, N=64, K=64, rows=10)
    assert up["kw"]["gate"] == "clamped_swiglu" and up["kw"]["bias"].shape == (8, 64)
    assert cases[1]["shape"]["form"] == "fused-bias"
    # with --models too, both
    both = fc.build_cases(fc.parser().parse_args(
        ["--models", "qwen3-30b-a3b", "--layer", "64,32,8,2", "--tokens", "5", "--smoke",
         "--up", "pp 128x128", "--down", "pp 128x128"]), torch.device("cpu"))
    assert [c["model"] for c in both][::2] == ["qwen3-30b-a3b", "layer-64x32x8x2"]
    assert both[2]["shape"]["form"] == "fused-gate" and both[3]["shape"]["form"] == "fused"
    assert fc.main(["--layer", "64,32", "--smoke"]) == 2


@pytest.mark.parametrize("argv,message", [
    (["--smoke", "--tokens", "0"], "--tokens takes comma-separated positive integers"),
    (["--smoke", "--tokens", "abc"], "--tokens takes comma-separated positive integers"),
    (["--smoke", "--rounds", "0"], "--rounds and --calls must be at least 1"),
    (["--smoke", "--calls", "0"], "--rounds and --calls must be at least 1"),
    (["--smoke", "--models", ""], "--models: unknown"),
    (["--smoke", "--models", "qwen3-30b-a3b,bogus"], "--models: unknown 'bogus'; expected some of"),
])
def test_bad_arguments_are_one_line_before_any_work(argv, message, capsys):
    assert fc.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_an_unwritable_out_is_refused_before_the_run(tmp_path, capsys):
    assert fc.main(["--smoke", "--out", str(tmp_path)]) == 2  # a folder
    assert "--out" in capsys.readouterr().err
