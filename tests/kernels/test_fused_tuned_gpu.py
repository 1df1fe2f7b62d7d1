"""The fused kernels' own tuned entries on the GPU (tuned.FUSED_FORMS, ops/fused_launch.
fused_tuned): a user table naming one tile for grouped_mm's form of a shape and another for
the fused gate-up GEMM's form (clamped SwiGLU over alternating columns with biases, as
gpt-oss) and for the down GEMM's (bias and row weights): each launch runs its own entry's
tile, and both results match the fp32 reference.

    python3 scripts/gpu_session.py --paths tests/kernels/test_fused_tuned_gpu.py --out $OUT
"""

from __future__ import annotations

import json

import pytest
import torch

import moe_gemm
from moe_gemm.capability import device_name
from moe_gemm.ops import heuristics, tuned
from moe_gemm.ops.fused_reference import fused_grouped_mm_ref
from moe_gemm.ops.launch_info import last_launch

from .gpu_report import record
from .helpers import check

pytestmark = pytest.mark.gpu

COOP = {"schedule": "cooperative", "tile_m": 128, "tile_n": 192, "cluster_m": 1,
        "cluster_n": 2, "raster_panel": 8, "visitor": "device"}
PP = {"schedule": "pingpong", "tile_m": 128, "tile_n": 128, "cluster_m": 1, "cluster_n": 2,
      "raster_panel": 8, "visitor": "device"}
PP_160 = dict(PP, tile_n=160)


def _tile(choice):
    return (choice.schedule, choice.tile_m, choice.tile_n, choice.cluster_n)


def test_fused_entries_pick_the_fused_kernels_tiles(monkeypatch, tmp_path):
    counts = [40, 0, 33, 27, 41, 29, 38, 32]  # ~32 rows an expert: bucket 5
    E, S, H, I = len(counts), sum(counts), 512, 320
    g = torch.Generator(device="cuda").manual_seed(11)
    x = (torch.randn(S, H, generator=g, device="cuda") * 0.5).bfloat16()
    w1 = (torch.randn(E, H, 2 * I, generator=g, device="cuda") / H ** 0.5).bfloat16()
    b1 = torch.randn(E, 2 * I, generator=g, device="cuda") * 0.1
    w2 = (torch.randn(E, I, H, generator=g, device="cuda") / I ** 0.5).bfloat16()
    b2 = torch.randn(E, H, generator=g, device="cuda") * 0.1
    weight = torch.rand(S, generator=g, device="cuda")
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).cuda()
    bucket = tuned.rows_bucket(S / E)

    def entry(form, N, K, config):
        return {"form": form, "dtype": "bfloat16", "out_dtype": "bfloat16", "E": E, "N": N,
                "K": K, "bucket": bucket, "config": config, "us": 10.0}

    doc = {"format": tuned.FORMAT, "device": device_name(torch.device("cuda")),
           "sm_count": torch.cuda.get_device_properties(0).multi_processor_count,
           "entries": [entry("varlen", 2 * I, H, COOP), entry("varlen", H, I, COOP),
                       entry("fused-gate-bias", 2 * I, H, PP),
                       entry("fused-bias", H, I, PP_160)]}
    path = tmp_path / "table.json"
    path.write_text(json.dumps(doc))
    monkeypatch.delenv(tuned.TABLES_ENV)  # (the tests' default turns the tables off)
    monkeypatch.setenv(tuned.USER_TABLE_ENV, str(path))
    tuned.clear_caches()
    heuristics.clear_caches()
    up_opts = dict(bias=b1, gate="clamped_swiglu", gate_layout="alternating")
    down_opts = dict(bias=b2, row_weight=weight)
    try:
        plain = moe_gemm.grouped_mm(x, w1, offs)
        plain_tile = _tile(last_launch().choice)
        h = moe_gemm.fused_grouped_mm(x, w1, offs, **up_opts)
        up_tile = _tile(last_launch().choice)
        y = moe_gemm.fused_grouped_mm(h, w2, offs, **down_opts)
        down_tile = _tile(last_launch().choice)
        torch.cuda.synchronize()
    finally:
        monkeypatch.delenv(tuned.USER_TABLE_ENV)
        tuned.clear_caches()
        heuristics.clear_caches()
    ok = (plain_tile == ("cooperative", 128, 192, 2) and up_tile == ("pingpong", 128, 128, 2)
          and down_tile == ("pingpong", 128, 160, 2))
    record("fused-tuned/entries", ok, tiles=[plain_tile, up_tile, down_tile])
    assert plain_tile == ("cooperative", 128, 192, 2), plain_tile
    assert up_tile == ("pingpong", 128, 128, 2), up_tile
    assert down_tile == ("pingpong", 128, 160, 2), down_tile
    for name, got, a, w, opts in (("up", h, x, w1, up_opts), ("down", y, h, w2, down_opts)):
        ref = fused_grouped_mm_ref(a, w, offs, dtype=torch.float32, **opts)
        low = fused_grouped_mm_ref(a, w, offs, dtype=torch.bfloat16, **opts)
        check(f"fused-tuned/{name}", got, ref, low)
    ref = moe_gemm.ops.reference.grouped_mm_ref(x, w1, offs)
    check("fused-tuned/grouped_mm", plain, ref, moe_gemm.grouped_mm(
        x, w1, offs, config=moe_gemm.GemmConfig(backend="torch")))
