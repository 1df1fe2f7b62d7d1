"""The ops' environment switches read values as moe_gemm.env's switches do: words for on and
off, and an error naming the variable for anything else (never a silent default)."""

from __future__ import annotations

import pytest

from moe_gemm.env import EnvError, env_value
from moe_gemm.ops import api, heuristics
from moe_gemm.ops.validation import offs_check_requested


@pytest.mark.parametrize("value,on", [("1", True), ("true", True), ("On", True),
                                      ("0", False), ("false", False), ("no", False),
                                      ("", False)])
def test_check_offs_reads_words(monkeypatch, value, on):
    monkeypatch.setenv("MOE_GEMM_CHECK_OFFS", value)
    assert offs_check_requested() is on


def test_check_offs_refuses_other_values(monkeypatch):
    monkeypatch.setenv("MOE_GEMM_CHECK_OFFS", "sometimes")
    with pytest.raises(EnvError, match="MOE_GEMM_CHECK_OFFS='sometimes'"):
        offs_check_requested()


def test_plans_are_cached_when_the_switches_say_off():
    # (DISABLE_CUTE, CHECK_OFFS) as read: "false" and "off" keep plans cacheable.
    assert api._cacheable((None, None))
    assert api._cacheable(("false", "off"))
    assert not api._cacheable(("1", None))
    assert not api._cacheable((None, "yes"))
    with pytest.raises(EnvError, match="MOE_GEMM_DISABLE_CUTE"):
        api._cacheable(("maybe", None))


@pytest.mark.parametrize("value", ["banana", "first", "first,last,normal", "first,x"])
def test_l2_hints_must_name_two_policies(monkeypatch, value):
    monkeypatch.setenv("MOE_GEMM_L2_HINTS", value)
    choice = heuristics.KernelChoice("cooperative", "device", 128, 128, 4, False, 1)
    with pytest.raises(EnvError, match="MOE_GEMM_L2_HINTS"):
        heuristics.with_l2_hints(choice)


def test_l2_hints_take_two_policies(monkeypatch):
    monkeypatch.setenv("MOE_GEMM_L2_HINTS", " first , last")
    choice = heuristics.KernelChoice("cooperative", "device", 128, 128, 4, False, 1)
    hinted = heuristics.with_l2_hints(choice)
    assert hinted.l2_hints and hinted.a_policy == heuristics.L2_POLICY["first"]
    assert hinted.b_policy == heuristics.L2_POLICY["last"]


@pytest.mark.parametrize("name", ["MOE_GEMM_FP8_QUANT", "MOE_GEMM_ROUTER", "MOE_GEMM_COMBINE"])
def test_torch_choices_read_any_case_and_refuse_other_words(monkeypatch, name):
    # "torch", or "kernel" (the default, where the kernel runs), in any case
    monkeypatch.setenv(name, "Torch")
    assert env_value(name) == "torch"
    monkeypatch.setenv(name, "KERNEL")
    assert env_value(name) == "kernel"
    monkeypatch.setenv(name, "")
    assert env_value(name) is None
    monkeypatch.setenv(name, "1")
    with pytest.raises(EnvError, match=f"{name}='1'"):
        env_value(name)


@pytest.mark.parametrize("name,value", [("MOE_GEMM_FP8_SCALE_AHEAD", "7"),
                                        ("MOE_GEMM_FP8_SMEM_SCALES", "sometimes")])
def test_fp8_switches_refuse_other_values_as_env_errors(monkeypatch, name, value):
    # EnvError, as every switch: the CLI turns it into one line naming the variable.
    from moe_gemm.ops import heuristics_fp8

    monkeypatch.setenv(name, value)
    read = (heuristics_fp8.scale_ahead_requested if name.endswith("AHEAD")
            else heuristics_fp8.smem_scales_requested)
    with pytest.raises(EnvError, match=name):
        read()
