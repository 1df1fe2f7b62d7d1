"""Peeked stage waits on the CPU: the switch that asks for them, the kernels it reaches (the
16-bit ones, every form; not FP8), and the compile key that names them. (The waits themselves
run in test_peek_wait_gpu.py.)"""

from __future__ import annotations

import pytest
import torch

from moe_gemm.config import GemmConfig
from moe_gemm.env import EnvError
from moe_gemm.ops import heuristics
from moe_gemm.ops.heuristics import PEEK_WAIT_ENV
from moe_gemm.ops.heuristics_fp8 import choose_fp8
from moe_gemm.ops.launch_kernel import _compile_key

CFG = GemmConfig()


def _choices():
    return (heuristics.choose_varlen(CFG, 8192, 64, 2048, 2048, 132),
            heuristics.choose_general(CFG, ((64, 128, 256), (3, 200, 64)), 132),
            heuristics.choose_batched(CFG, 4, 64, 256, 512, 132))


def test_off_by_default_on_with_the_switch(monkeypatch):
    monkeypatch.delenv(PEEK_WAIT_ENV, raising=False)
    assert not any(c.peek_wait for c in _choices())
    monkeypatch.setenv(PEEK_WAIT_ENV, "1")
    varlen, general, batched = _choices()
    assert varlen.peek_wait and general.peek_wait and batched.peek_wait
    key = _compile_key("varlen", torch.bfloat16, torch.bfloat16, "k", varlen, False)
    assert key.peek_wait and key.name().endswith("_peek")
    # FP8 kernels have their own mainloop: the switch does not reach them.
    assert not choose_fp8("varlen", CFG, 512.0, 4096, 7168, 2, "block").peek_wait
    monkeypatch.setenv(PEEK_WAIT_ENV, "0")
    assert not any(c.peek_wait for c in _choices())
    monkeypatch.setenv(PEEK_WAIT_ENV, "sometimes")
    with pytest.raises(EnvError, match=PEEK_WAIT_ENV):
        heuristics.choose_varlen(CFG, 8192, 64, 2048, 2048, 132)
