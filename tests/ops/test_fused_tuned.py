"""The fused kernels' own tuned entries (tuned.FUSED_FORMS, ops/fused_launch.fused_tuned), on
the CPU (meta tensors, a test device's name for the tables): an entry of the launch's form
(gate, bias) outranks grouped_mm's answer for the shape, never the other way round; pins,
swapped tiles the options cannot run and the swap switch keep it out; the shape's own samples
near the call's rows decide where no entry does, and nothing unmeasured is guessed."""

from __future__ import annotations

import json

import pytest
import torch

from moe_gemm import GemmConfig
from moe_gemm.ops import heuristics, launch_kernel, tuned
from moe_gemm.ops.fused_launch import fused_choice, masked_fused_choice
from moe_gemm.ops.fused_validation import check_fused_mm
from moe_gemm.ops.swap_rules import SWAP_AB_ENV

DEV = "NVIDIA Test GPU 80GB"
META = torch.device("meta")
BF16 = torch.bfloat16
E, H, I = 128, 2880, 2880  # gpt-oss-120b's experts
S = 32 * E  # 32 routed rows per expert: bucket 5
COOP = {"schedule": "cooperative", "tile_m": 128, "tile_n": 192, "cluster_m": 1,
        "cluster_n": 2, "raster_panel": 8, "visitor": "device"}
PP = {"schedule": "pingpong", "tile_m": 128, "tile_n": 128, "cluster_m": 1, "cluster_n": 2,
      "raster_panel": 8, "visitor": "device"}
PP_160 = dict(PP, tile_n=160)
SWAP = {"schedule": "cooperative", "tile_m": 256, "tile_n": 128, "raster_panel": 8,
        "visitor": "device", "swap_ab": True}


@pytest.fixture(autouse=True)
def _tables(tmp_path, monkeypatch):
    """Tables from tmp_path/shipped for a test device the meta tensors stand on; caches
    cleared."""
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setattr(tuned, "TABLES_DIR", shipped)
    monkeypatch.setattr(launch_kernel, "_table_device", lambda device: DEV)
    monkeypatch.setenv("MOE_GEMM_CACHE_DIR", str(tmp_path / "cache"))
    for name in (tuned.USER_TABLE_ENV, tuned.TABLES_ENV, SWAP_AB_ENV):
        monkeypatch.delenv(name, raising=False)
    tuned.clear_caches()
    heuristics.clear_caches()
    yield shipped
    tuned.clear_caches()
    heuristics.clear_caches()


def _ship(shipped, entries, samples=()):
    doc = {"format": tuned.FORMAT, "device": DEV, "sm_count": 132, "entries": list(entries),
           "samples": list(samples)}
    (shipped / f"{tuned.device_slug(DEV)}.json").write_text(json.dumps(doc))
    tuned.clear_caches()
    heuristics.clear_caches()


def _shape(form, N, K, rows=S):
    return {"form": form, "dtype": "bfloat16", "out_dtype": "bfloat16", "E": E, "N": N,
            "K": K, "rows": rows}


def _entry(form, N, K, config, rows=S, us=100.0):
    shape = _shape(form, N, K, rows)
    del shape["rows"]
    return dict(shape, bucket=tuned.rows_bucket(rows / E), config=config, us=us)


def _up(rows=S, *, bias=True, layout="alternating"):
    """gpt-oss's gate-up GEMM (clamped SwiGLU, biases) or, bias=False, a plain gated one."""
    w = (torch.empty(E, H, 2 * I, dtype=BF16, device=META) if layout != "concat" else
         torch.empty(E, 2 * I, H, dtype=BF16, device=META).transpose(1, 2))
    return check_fused_mm(
        torch.empty(rows, H, dtype=BF16, device=META), w,
        torch.empty(E, dtype=torch.int32, device=META),
        bias=torch.empty(E, 2 * I, device=META) if bias else None,
        gate="clamped_swiglu" if bias else "silu", gate_layout=layout, concrete=False)


def _down(rows=S, *, bias=True):
    return check_fused_mm(
        torch.empty(rows, I, dtype=BF16, device=META),
        torch.empty(E, I, H, dtype=BF16, device=META),
        torch.empty(E, dtype=torch.int32, device=META),
        row_weight=torch.empty(rows, device=META),
        bias=torch.empty(E, H, device=META) if bias else None, concrete=False)


def _tile(choice):
    return (choice.schedule, choice.tile_m, choice.tile_n, choice.cluster_n, choice.swap_ab)


def _grouped_mm_choice(rows, N, K):
    return heuristics.choose_varlen(GemmConfig(), rows, E, N, K, 132, device=DEV, swap_ok=True)


def test_forms_name_the_epilogue():
    assert tuned.fused_form(True, True) == "fused-gate-bias"
    assert tuned.fused_form(True, False) == "fused-gate"
    assert tuned.fused_form(False, True) == "fused-bias"
    assert tuned.fused_form(False, False) == "fused"
    assert set(tuned.FUSED_FORMS) <= set(tuned.FORMS)


def test_a_fused_entry_outranks_grouped_mms_answer_and_only_for_the_fused_kernels(_tables):
    _ship(_tables, [_entry("varlen", 2 * I, H, COOP), _entry("varlen", H, I, COOP),
                    _entry("fused-gate-bias", 2 * I, H, PP), _entry("fused-bias", H, I, PP_160)])
    up, _ = fused_choice(_up(), GemmConfig(), 132, META)
    down, _ = fused_choice(_down(), GemmConfig(), 132, META)
    assert _tile(up) == ("pingpong", 128, 128, 2, False)
    assert _tile(down) == ("pingpong", 128, 160, 2, False)
    # grouped_mm keeps its own entries
    assert _tile(_grouped_mm_choice(S, 2 * I, H)) == ("cooperative", 128, 192, 2, False)
    assert _tile(_grouped_mm_choice(S, H, I)) == ("cooperative", 128, 192, 2, False)


def test_entries_are_keyed_by_what_the_epilogue_carries(_tables):
    """A gated, biased entry answers neither a gated launch without the bias nor the down
    GEMM (another form), nor another bucket of its shape."""
    _ship(_tables, [_entry("varlen", 2 * I, H, COOP), _entry("varlen", H, I, COOP),
                    _entry("fused-gate-bias", 2 * I, H, PP)])
    no_bias, _ = fused_choice(_up(bias=False, layout="concat"), GemmConfig(), 132, META)
    assert _tile(no_bias)[:3] == ("cooperative", 128, 192)
    down, _ = fused_choice(_down(), GemmConfig(), 132, META)
    assert _tile(down)[:3] == ("cooperative", 128, 192)
    other_bucket, _ = fused_choice(_up(rows=4 * S), GemmConfig(), 132, META)
    assert _tile(other_bucket) != ("pingpong", 128, 128, 2, False)


def test_pins_and_the_masked_layout_keep_the_entry_out(_tables):
    _ship(_tables, [])
    masked_before = masked_fused_choice(_up(), GemmConfig(), 132, META, expected_m=S // E)
    _ship(_tables, [_entry("fused-gate-bias", 2 * I, H, PP)])
    assert _tile(fused_choice(_up(), GemmConfig(), 132, META)[0]) == (
        "pingpong", 128, 128, 2, False)
    pinned, _ = fused_choice(_up(), GemmConfig(schedule="cooperative", tile_m=128, tile_n=192),
                             132, META)
    assert _tile(pinned)[:3] == ("cooperative", 128, 192)
    # the masked layout (expected rows per expert, counts read on the GPU) keeps its choice
    assert masked_fused_choice(_up(), GemmConfig(), 132, META,
                               expected_m=S // E) == masked_before


def test_a_swapped_entry_runs_only_where_the_options_take_swapped_tiles(_tables, monkeypatch):
    gated = _entry("fused-gate", 2 * I, H, SWAP)
    _ship(_tables, [gated, _entry("fused-gate-bias", 2 * I, H, SWAP)])
    concat, _ = fused_choice(_up(bias=False, layout="concat"), GemmConfig(), 132, META)
    assert concat.swap_ab and (concat.tile_m, concat.tile_n) == (256, 128)
    # alternating gate columns: no swapped kernel, so grouped_mm's answer
    alternating, _ = fused_choice(_up(), GemmConfig(), 132, META)
    assert not alternating.swap_ab
    assert not fused_choice(_up(bias=False, layout="concat"), GemmConfig(swap_ab=False), 132,
                            META)[0].swap_ab
    monkeypatch.setenv(SWAP_AB_ENV, "0")
    heuristics.clear_caches()
    assert not fused_choice(_up(bias=False, layout="concat"), GemmConfig(), 132,
                            META)[0].swap_ab


def test_a_timed_row_count_keeps_what_ran_fastest_there_and_nothing_else_is_guessed(_tables):
    """Without an entry (the adoption kept the default there), the shape's own samples within a
    quarter octave of the call's rows decide; past that reach nothing fused was measured, and
    grouped_mm's answer stays (no vote among a few fused shapes); grouped_mm's own choice never
    reads the fused samples."""
    samples = []
    # grouped_mm's rules' config at 45 rows per expert, timed slower than both on its shapes
    # (the vote then has it to beat)
    rules = heuristics.rules_baseline("varlen", GemmConfig(), 132, shape=(45 * E, E, 2 * I, H))
    for rows_per_expert in (16, 32, 64, 128, 256):
        samples.append(dict(_shape("varlen", 2 * I, H, rows_per_expert * E), config=rules,
                            us=220.0 * rows_per_expert / 16))
        pp_wins = rows_per_expert != 32
        for config, us in ((PP, 100.0 if pp_wins else 104.0),
                           (COOP, 106.0 if pp_wins else 100.0)):
            samples.append(dict(_shape("fused-gate-bias", 2 * I, H, rows_per_expert * E),
                                config=config, us=us * rows_per_expert / 16))
            # grouped_mm timed the other way round on the same shapes
            samples.append(dict(_shape("varlen", 2 * I, H, rows_per_expert * E),
                                config=config, us=(206.0 - us) * rows_per_expert / 16))
    _ship(_tables, [], samples)
    assert _tile(fused_choice(_up(rows=32 * E), GemmConfig(), 132, META)[0])[:3] == (
        "cooperative", 128, 192)
    assert _tile(fused_choice(_up(rows=34 * E), GemmConfig(), 132, META)[0])[:3] == (
        "cooperative", 128, 192)  # within a quarter octave of the timed 32 rows
    assert _tile(fused_choice(_up(rows=64 * E), GemmConfig(), 132, META)[0]) == (
        "pingpong", 128, 128, 2, False)
    # 45 rows: half an octave from 32 and from 64, nothing measured: grouped_mm's answer (here
    # its neighbours' vote, where its own samples favour the other tile)
    between = 45 * E
    grouped = _grouped_mm_choice(between, 2 * I, H)
    assert _tile(grouped)[:3] == ("cooperative", 128, 192)
    fused = fused_choice(_up(rows=between), GemmConfig(), 132, META)[0]
    assert _tile(fused)[:3] == ("cooperative", 128, 192)
