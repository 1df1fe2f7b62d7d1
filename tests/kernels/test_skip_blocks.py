"""Skipped empty row blocks on the CPU: the switch that asks for them (on, off, or the default
rule), the kernels it reaches (the 16-bit ones, every form; not FP8), the compile key that
names them, and the row-block count the kernel derives from a tile. (The skipping itself runs
in test_skip_blocks_gpu.py.)"""

from __future__ import annotations

import pytest
import torch

from moe_gemm.config import GemmConfig
from moe_gemm.env import EnvError
from moe_gemm.ops import heuristics
from moe_gemm.ops.heuristics import SKIP_BLOCKS_ENV
from moe_gemm.ops.heuristics_fp8 import choose_fp8
from moe_gemm.ops.launch_kernel import _compile_key

CFG = GemmConfig()


def _choices():
    return (heuristics.choose_varlen(CFG, 8192, 64, 2048, 2048, 132),
            heuristics.choose_general(CFG, ((64, 128, 256), (3, 200, 64)), 132),
            heuristics.choose_batched(CFG, 4, 64, 256, 512, 132))


def test_switch_forces_it_either_way(monkeypatch):
    monkeypatch.delenv(SKIP_BLOCKS_ENV, raising=False)
    default = [heuristics.skip_blocks_default(c) for c in _choices()]
    assert [c.skip_blocks for c in _choices()] == default
    monkeypatch.setenv(SKIP_BLOCKS_ENV, "1")
    varlen, general, batched = _choices()
    assert varlen.skip_blocks and general.skip_blocks and batched.skip_blocks
    key = _compile_key("varlen", torch.bfloat16, torch.bfloat16, "k", varlen, False)
    assert key.skip_blocks and key.name().endswith("_skipm")
    # FP8 kernels have their own mainloop: the switch does not reach them.
    assert not choose_fp8("varlen", CFG, 512.0, 4096, 7168, 2, "block").skip_blocks
    monkeypatch.setenv(SKIP_BLOCKS_ENV, "0")
    assert not any(c.skip_blocks for c in _choices())
    monkeypatch.setenv(SKIP_BLOCKS_ENV, "often")
    with pytest.raises(EnvError, match=SKIP_BLOCKS_ENV):
        heuristics.choose_varlen(CFG, 8192, 64, 2048, 2048, 132)


@pytest.mark.parametrize("schedule,tile_m,blocks", [
    ("pingpong", 64, 1), ("pingpong", 128, 2), ("pingpong", 192, 3),
    ("cooperative", 128, 1), ("cooperative", 256, 2)])
def test_row_blocks_per_warpgroup(schedule, tile_m, blocks):
    from moe_gemm.kernels.sm90.compile import CompileKey

    k = CompileKey("varlen", "bfloat16", "bfloat16", "k", schedule, "device", tile_m, 128,
                   skip_blocks=True).kernel()
    assert (k.m_wgs, k.m_blocks) == (1 if schedule == "pingpong" else 2, blocks)
