"""benchmarks/lists_ab without a GPU: its case and config parsing, the rows' ratios, and its
refusal where no GPU runs."""

from __future__ import annotations

import pytest

from benchmarks import lists_ab
from benchmarks.suite import DEFAULT_NAME


def test_cases_parse():
    assert lists_ab.parse_cases("132x16x4096x4096, 2x0x8x8") == [(132, 16, 4096, 4096),
                                                                 (2, 0, 8, 8)]
    for bad in ("132x16x4096", "0x16x8x8", "2x1x0x8", "2x1x8x0", "2x-1x8x8", "2x1.5x8x8",
                "2x1x8x8,", ""):
        with pytest.raises(ValueError, match="--cases"):
            lists_ab.parse_cases(bad)


def test_configs_parse():
    (f,) = lists_ab.parse_configs("coop 128x256 c1x2")
    assert (f["schedule"], f["tile_m"], f["tile_n"], f["cluster_n"]) == ("cooperative", 128,
                                                                         256, 2)
    assert f["sort_by_k"] is False  # (the general form's field)
    assert lists_ab.parse_configs("") == []
    assert len(lists_ab.parse_configs("pp 64x256;coop 128x256 c1x2")) == 2
    with pytest.raises(ValueError):
        lists_ab.parse_configs("coop 128x256 c9x9;")
    with pytest.raises(ValueError):
        lists_ab.parse_configs("fast 128x256")


def test_implementations_default_first():
    impls = lists_ab.implementations(lists_ab.parse_configs("pp 64x256"), peers=True)
    assert impls[0].name == DEFAULT_NAME and impls[0].default and impls[0].config is None
    assert impls[1].name.startswith("moe_gemm pp 64x256") and impls[1].config.tile_m == 64
    assert [i.peer for i in impls] == [False, False, True, True]
    assert len(lists_ab.implementations([], peers=False)) == 1


def test_ratios():
    rows = [{"impl": DEFAULT_NAME, "ms": 2.0}, {"impl": "moe_gemm pp 64x256", "ms": 1.0},
            {"impl": "torch.mm loop (CUDA graph)", "status": "error"}]
    lines = lists_ab.add_ratios(rows, flops=4e12, nbytes=2e9)
    assert rows[0]["vs_default"] == 1.0 and rows[1]["vs_default"] == 2.0
    assert rows[1]["tflops"] == pytest.approx(4000.0) and rows[0]["gbps"] == pytest.approx(1000.0)
    assert "vs_default" not in rows[2] and "error" in lines[2]
    assert "2.000" in lines[1]


def test_no_gpu_is_refused(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert lists_ab.main(["--reps", "1"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert lists_ab.main(["--cases", "1x2x3"]) == 2
    assert "PxMxNxK" in capsys.readouterr().err


def test_b_layouts():
    """--b-layout nk hands each B as the transposed view of an (N, K) weight; kn as (K, N)."""
    import torch

    from benchmarks.suite import ShapeSpec, make_inputs

    for layout, stride in (("KN", (5, 1)), ("NK", (1, 16))):
        spec = ShapeSpec(name="t", form="general", problems=((3, 5, 16),) * 2, b_layout=layout)
        inp = make_inputs(spec, spec.counts(0), torch.device("cpu"), 0)
        assert [tuple(b.shape) for b in inp.b] == [(16, 5)] * 2
        assert all(b.stride() == stride for b in inp.b)
        assert ("transposed view" in spec.describe(0)["layout"]) == (layout == "NK")
    with pytest.raises(ValueError, match="b_layout"):
        ShapeSpec(name="t", form="general", problems=((1, 8, 8),), b_layout="nk")
