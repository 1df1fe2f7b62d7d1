"""Peeked stage waits on the CPU: the switch that asks for them, the kernels it reaches (the
16-bit ones, every form; FP8 kernels have their own switch and peek by default), and the
compile key that names them. (The waits themselves run in test_peek_wait_gpu.py and, for FP8,
test_fp8_gpu.py.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_gemm.config import GemmConfig
from moe_gemm.env import EnvError
from moe_gemm.ops import api, heuristics
from moe_gemm.ops.heuristics import PEEK_WAIT_ENV
from moe_gemm.ops.heuristics_fp8 import PEEK_WAIT_FP8_ENV, choose_fp8
from moe_gemm.ops.launch_kernel import _compile_key
from moe_gemm.ops.scaled_launch import fp8_compile_key

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
    # FP8 kernels have their own mainloop and switch: this one does not reach them.
    monkeypatch.delenv(PEEK_WAIT_FP8_ENV, raising=False)
    assert choose_fp8("varlen", CFG, 512.0, 4096, 7168, 2, "block").peek_wait
    monkeypatch.setenv(PEEK_WAIT_ENV, "0")
    assert not any(c.peek_wait for c in _choices())
    monkeypatch.setenv(PEEK_WAIT_ENV, "sometimes")
    with pytest.raises(EnvError, match=PEEK_WAIT_ENV):
        heuristics.choose_varlen(CFG, 8192, 64, 2048, 2048, 132)


def _fp8_choices():
    """(form, granularity, choice) over the forms, decode and prefill row counts, both
    scale granularities."""
    return [(form, g, choose_fp8(form, CFG, avg, 4096, 7168, 2, g))
            for form in ("varlen", "batched", "general", "masked")
            for avg in (4.0, 512.0)  # ping-pong decode tiles, cooperative prefill tiles
            for g in ("block", "row")]


def test_fp8_default_probes_where_measured_faster_and_the_switch_forces_it(monkeypatch):
    # by default: the varlen form, but for row-wise ping-pong tiles (decode); not the batched,
    # general or masked forms
    monkeypatch.delenv(PEEK_WAIT_FP8_ENV, raising=False)
    monkeypatch.delenv(PEEK_WAIT_ENV, raising=False)
    choices = _fp8_choices()
    assert {c.schedule for _, _, c in choices} == {"pingpong", "cooperative"}
    for form, g, c in choices:
        want = form == "varlen" and not (g == "row" and c.schedule == "pingpong")
        assert c.peek_wait == want, (form, g, c.schedule)
    prefill = choose_fp8("varlen", CFG, 512.0, 4096, 7168, 2, "block")
    key = fp8_compile_key("varlen", torch.float8_e4m3fn, torch.bfloat16, "block", prefill)
    assert key.peek_wait and key.name().endswith("_peek")
    monkeypatch.setenv(PEEK_WAIT_FP8_ENV, "0")
    off = _fp8_choices()
    assert not any(c.peek_wait for _, _, c in off)
    key = fp8_compile_key("varlen", torch.float8_e4m3fn, torch.bfloat16, "block", off[5][2])
    assert not key.peek_wait and "peek" not in key.name()
    monkeypatch.setenv(PEEK_WAIT_FP8_ENV, "1")
    on = _fp8_choices()
    assert all(c.peek_wait for _, _, c in on)
    # only the waits differ: everything else about the kernel is the same
    for (_, _, a), (_, _, b) in zip(on, off):
        assert dataclasses.replace(b, peek_wait=True) == a
    # the 16-bit switch does not reach the FP8 kernels
    monkeypatch.setenv(PEEK_WAIT_ENV, "0")
    assert all(c.peek_wait for _, _, c in _fp8_choices())


def test_fp8_switch_refuses_other_values_and_keys_the_plan_caches(monkeypatch):
    monkeypatch.setenv(PEEK_WAIT_FP8_ENV, "sometimes")
    with pytest.raises(EnvError, match=PEEK_WAIT_FP8_ENV):
        choose_fp8("varlen", CFG, 512.0, 4096, 7168, 2, "block")
    # a cached plan made with one value is not reused under the other
    assert PEEK_WAIT_FP8_ENV in api._PLAN_SWITCHES
