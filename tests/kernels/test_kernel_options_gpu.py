"""Kernel options that are not default choices, forced on every form: programmatic dependent
launch (PDL, opt-in through MOE_GEMM_PDL) and the whole-tile cooperative epilogue (a
compile-time variant the defaults pick for long-K varlen only)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_gemm import GemmConfig

from .helpers import run_batched, run_general, run_varlen

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("pdl", [0, 1])
def test_general_and_varlen_with_and_without_pdl(pdl, monkeypatch):
    """Both launch modes of the descriptor prologue + main kernel pair give right results."""
    from moe_gemm.ops import launch_kernel

    monkeypatch.setattr(launch_kernel, "PDL", pdl)
    run_general(f"general/pdl={pdl}", [(130, 200, 72), (256, 512, 1024), (1, 64, 64)],
                torch.bfloat16, "row", GemmConfig(backend="cute"))
    run_varlen(f"varlen/pdl={pdl}", 8, 700, 256, 512, "holes", torch.bfloat16, "kn",
               GemmConfig(backend="cute"), "alloc")


EPI_WHOLE_GENERAL_SIZES = [(130, 200, 72), (256, 512, 1024), (1, 64, 64), (300, 264, 4096)]


@pytest.mark.parametrize("form", ["general", "varlen", "batched"])
def test_epilogue_whole_tile_variant(form, monkeypatch):
    from moe_gemm.ops import general_launch, launch_info, mm_launch

    for module, name in ((general_launch, "choose_general"), (mm_launch, "choose_varlen"),
                         (mm_launch, "choose_batched")):
        orig = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _o=orig, **k: dataclasses.replace(
            _o(*a, **k), epi_whole=True))
    cfg = GemmConfig(backend="cute", schedule="cooperative")
    if form == "general":
        run_general("epi-whole/general", EPI_WHOLE_GENERAL_SIZES, torch.bfloat16, "row", cfg)
    elif form == "varlen":
        run_varlen("epi-whole/varlen", 12, 2500, 512, 640, "holes", torch.bfloat16, "nk_view",
                   cfg, "given", tail=21)
    else:
        run_batched("epi-whole/batched", 9, 300, 512, 1024, config=cfg, out_mode="given")
        run_batched("epi-whole/batched-fp16", 4, 129, 264, 200, torch.float16, config=cfg,
                    out_mode="alloc")
    info = launch_info.last_launch()
    assert info is not None and info.choice.epi_whole
