"""Where fused_grouped_mm runs swapped tiles (ops/fused_launch.fused_choice,
kernels/sm90/swapped_fused.py): grouped_mm's window (about one 256-row tile per expert) for a
gate over concat weights; the down GEMM's options (no gate) on long K with at most one
swapped tile per expert, or where config.swap_ab pins them;
never for the other gate layouts, the masked layout or 32-bit output, and never with the
in-kernel gather. (Meta tensors: no GPU; the kernel objects are built, not compiled.)"""

from __future__ import annotations

import pytest
import torch

from moe_gemm import GemmConfig
from moe_gemm.ops.fused_launch import fused_choice, fused_key, masked_fused_choice
from moe_gemm.ops.fused_validation import check_fused_mm
from moe_gemm.ops.swap_rules import SWAP_AB_ENV

META = torch.device("meta")
BF16 = torch.bfloat16
E, I, H = 8, 2048, 7168  # DeepSeek-V3's expert sizes on 8 experts
WINDOW_ROWS = 256 * E  # one 256-row tile per expert


def _args(S, *, gate="silu", layout="concat", weight=False, bias=False, index=False,
          out_dtype=None, K=H, N=2 * I):
    if layout == "concat" or gate is None:
        w = torch.empty(E, N, K, dtype=BF16, device=META).transpose(1, 2)
    else:
        w = torch.empty(E, K, N, dtype=BF16, device=META)
    return check_fused_mm(
        torch.empty(S, K, dtype=BF16, device=META), w,
        torch.empty(E, dtype=torch.int32, device=META),
        row_index=torch.empty(S, dtype=torch.int64, device=META) if index else None,
        row_weight=torch.empty(S, device=META) if weight else None,
        bias=torch.empty(E, N, device=META) if bias else None, gate=gate, gate_layout=layout,
        out_dtype=out_dtype, concrete=False)


def _choose(args, config=GemmConfig()):
    return fused_choice(args, config, 132, META)


@pytest.mark.parametrize("options,config", [
    (dict(gate="silu", index=True), GemmConfig()),
    (dict(gate="clamped_swiglu", bias=True), GemmConfig()),
    (dict(gate=None, weight=True, K=I, N=H), GemmConfig(swap_ab=True)),
    (dict(gate=None, weight=True, bias=True, K=I, N=H), GemmConfig(swap_ab=True)),
], ids=["gate-up", "clamped-biased", "down-pinned", "down-biased-pinned"])
def test_the_window_runs_swapped_tiles_with_the_options(options, config):
    from moe_gemm.kernels.sm90.swapped_fused import SwappedFusedMoeGemmSm90

    args = _args(WINDOW_ROWS, **options)
    choice, in_kernel = _choose(args, config)
    assert choice.swap_ab and not in_kernel
    assert (choice.schedule, choice.tile_m, choice.tile_n) == ("cooperative", 256, 128)
    key = fused_key(args, choice, "k", in_kernel)
    assert key.swap_ab and key.gate == (options["gate"] or "")
    assert key.row_scale == options.get("weight", False)
    kernel = key.kernel()
    assert isinstance(kernel, SwappedFusedMoeGemmSm90)
    assert kernel.gate == options["gate"] and kernel.has_bias == options.get("bias", False)


@pytest.mark.parametrize("layout", ["interleaved", "alternating"])
def test_other_gate_layouts_keep_the_plain_fused_tiles(layout):
    choice, _ = _choose(_args(WINDOW_ROWS, layout=layout))
    assert not choice.swap_ab


def test_the_down_gemm_keeps_the_plain_fused_tiles_on_short_k_unless_pinned():
    # DeepSeek-V3's down GEMM (K = I = 2048) in the window
    for extra in (dict(weight=True), dict(weight=True, bias=True)):
        choice, _ = _choose(_args(WINDOW_ROWS, gate=None, K=I, N=H, **extra))
        assert not choice.swap_ab, extra


@pytest.mark.parametrize("rows_per_expert", [192, 224, 256])
def test_the_down_gemm_on_long_k_takes_one_swapped_tile_per_expert(rows_per_expert):
    # Mixtral-8x7B's down GEMM: K = 14336, N = 4096 (256 swapped tiles: a wave and more)
    args = _args(rows_per_expert * E, gate=None, weight=True, K=14336, N=4096)
    choice, in_kernel = _choose(args)
    assert choice.swap_ab and not in_kernel
    assert not _choose(args, GemmConfig(swap_ab=False))[0].swap_ab


@pytest.mark.parametrize("rows_per_expert,K", [(288, 14336), (320, 14336), (256, 2048),
                                               (256, 4088), (128, 14336)])
def test_the_down_gemm_keeps_the_plain_fused_tiles_past_one_tile_or_on_shorter_k(
        rows_per_expert, K):
    args = _args(rows_per_expert * E, gate=None, weight=True, K=K, N=4096)
    assert not _choose(args)[0].swap_ab


def test_outside_the_window_and_when_turned_off(monkeypatch):
    for rows in (64 * E, 1024 * E):  # tiles of many experts' rows, or several per expert
        choice, _ = _choose(_args(rows))
        assert not choice.swap_ab, rows
    assert not _choose(_args(WINDOW_ROWS), GemmConfig(swap_ab=False))[0].swap_ab
    assert not _choose(_args(WINDOW_ROWS, out_dtype=torch.float32))[0].swap_ab
    monkeypatch.setenv(SWAP_AB_ENV, "0")
    assert not _choose(_args(WINDOW_ROWS))[0].swap_ab


def test_a_pin_runs_them_anywhere_without_the_gather():
    # One decode row per expert: the pin's swapped tiles, the rows gathered by index_select.
    choice, in_kernel = _choose(_args(E, index=True), GemmConfig(swap_ab=True))
    assert choice.swap_ab and not in_kernel
    assert _choose(_args(E, index=True))[1]  # (without the pin the kernel gathers)


def test_the_masked_layout_never_runs_them():
    choice = masked_fused_choice(_args(WINDOW_ROWS), GemmConfig(), 132, META, expected_m=256)
    assert not choice.swap_ab
