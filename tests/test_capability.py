"""moe_gemm.capability: whether the cute backend can run here, and the one reason why not.

CUDA queries are monkeypatched to stand in for GPUs this CPU machine does not have; the caches
of the module are cleared around every test so no fake answer leaks out.
"""

from __future__ import annotations

import importlib.util
import types
from collections.abc import Iterator

import pytest
import torch

from moe_gemm import GemmConfig, capability, grouped_gemm, grouped_mm
from moe_gemm.capability import cute_problem, cutlass_dsl_problem, sm_count
from moe_gemm.testing import make_grouped_inputs, make_moe_inputs

NO_GPU = not torch.cuda.is_available()
# The real cached functions, captured before any test monkeypatches the module's names.
_CACHED = (capability.cutlass_dsl_problem, capability._cuda_device_problem, capability._sm_count)


@pytest.fixture(autouse=True)
def _clear_caches(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("MOE_GEMM_DISABLE_CUTE", raising=False)
    for f in _CACHED:
        f.cache_clear()
    yield
    for f in _CACHED:
        f.cache_clear()


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, cap: tuple[int, int], name: str = "Fake GPU",
               sms: int = 132) -> list[int]:
    """Make torch.cuda look like one GPU per index with capability `cap`; returns the indices
    that were queried."""
    queried: list[int] = []

    def get_cap(index: int = 0) -> tuple[int, int]:
        queried.append(index)
        return cap

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", get_cap)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index=0: types.SimpleNamespace(multi_processor_count=sms))
    return queried


@pytest.mark.skipif(not NO_GPU, reason="checks the answer on a machine without a GPU")
def test_no_gpu_sentence() -> None:
    why = cute_problem()
    assert isinstance(why, str)
    assert why == "no CUDA GPU is visible (torch.cuda.is_available() is False)"
    # A CUDA device asked for explicitly gets the same answer, never an exception.
    assert cute_problem(torch.device("cuda")) == why
    assert cute_problem(torch.device("cuda", 3)) == why


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_non_cuda_tensors(device: str) -> None:
    why = cute_problem(torch.device(device))
    assert why == f"tensors are on {device}, the kernels run on CUDA sm_90a GPUs"


@pytest.mark.parametrize("value", ["1", "yes", "true"])
def test_disable_env_wins(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("MOE_GEMM_DISABLE_CUTE", value)
    assert cute_problem() == "disabled by MOE_GEMM_DISABLE_CUTE"
    assert cute_problem(torch.device("cpu")) == "disabled by MOE_GEMM_DISABLE_CUTE"
    _fake_cuda(monkeypatch, (9, 0))
    assert cute_problem(torch.device("cuda", 0)) == "disabled by MOE_GEMM_DISABLE_CUTE"


@pytest.mark.parametrize("value", ["", "0"])
def test_disable_env_off_values(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("MOE_GEMM_DISABLE_CUTE", value)
    assert cute_problem(torch.device("cpu")) == (
        "tensors are on cpu, the kernels run on CUDA sm_90a GPUs"
    )


def test_disable_env_reaches_forced_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOE_GEMM_DISABLE_CUTE", "1")
    a, b = make_grouped_inputs([(4, 8, 8)], torch.bfloat16)
    x, w, offs = make_moe_inputs(8, 2, 8, 8, torch.bfloat16)
    cfg = GemmConfig(backend="cute")
    with pytest.raises(RuntimeError, match="backend='cute' cannot run here: disabled by "
                                           "MOE_GEMM_DISABLE_CUTE"):
        grouped_gemm(a, b, config=cfg)
    with pytest.raises(RuntimeError, match="disabled by MOE_GEMM_DISABLE_CUTE"):
        grouped_mm(x, w, offs, config=cfg)
    # auto quietly uses the torch backend.
    assert grouped_gemm(a, b)[0].shape == (4, 8)


def test_wrong_architecture_names_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, (8, 0), name="NVIDIA A100-SXM4-80GB")
    why = cute_problem(torch.device("cuda", 0))
    assert why == "NVIDIA A100-SXM4-80GB is sm_80; the kernels need sm_90a (H100/H200)"
    capability._cuda_device_problem.cache_clear()
    _fake_cuda(monkeypatch, (10, 0), name="NVIDIA B200")
    assert "is sm_100; the kernels need sm_90a" in cute_problem(torch.device("cuda", 0))


def test_hopper_with_dsl_can_run(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, (9, 0))
    monkeypatch.setattr(capability, "cutlass_dsl_problem", lambda: None)
    assert cute_problem(torch.device("cuda", 0)) is None
    assert cute_problem() is None


def test_hopper_without_dsl(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, (9, 0))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None)
    why = cute_problem(torch.device("cuda", 0))
    assert why == "the CuTe DSL (nvidia-cutlass-dsl==4.8.1) is not installed"


def test_cutlass_dsl_problem_reflects_install(monkeypatch: pytest.MonkeyPatch) -> None:
    installed = importlib.util.find_spec("cutlass") is not None
    assert (cutlass_dsl_problem() is None) == installed
    cutlass_dsl_problem.cache_clear()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None)
    assert "nvidia-cutlass-dsl" in (cutlass_dsl_problem() or "")


def test_device_index_is_respected(monkeypatch: pytest.MonkeyPatch) -> None:
    queried = _fake_cuda(monkeypatch, (9, 0))
    monkeypatch.setattr(capability, "cutlass_dsl_problem", lambda: None)
    cute_problem(torch.device("cuda", 2))
    cute_problem(torch.device("cuda"))  # no index: the current device (0)
    assert queried == [2, 0]
    cute_problem(torch.device("cuda", 2))  # cached per index
    assert queried == [2, 0]


def test_sm_count(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, (9, 0), sms=114)
    assert sm_count(torch.device("cuda", 0)) == 114
    assert sm_count(torch.device("cuda")) == 114


def test_cute_problem_never_raises_on_odd_devices() -> None:
    for dev in (None, torch.device("cpu"), torch.device("meta"), torch.device("cuda")):
        why = cute_problem(dev)
        assert why is None or (isinstance(why, str) and len(why) > 10)


def test_func_transforms_take_the_torch_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under grad (and vmap(grad(...))) the operands are functorch wrappers without storage:
    the kernels cannot read them, so cute_problem names the transform (a vmap alone runs its
    entries on plain tensors, at depth 0)."""
    from torch.func import grad, vmap

    _fake_cuda(monkeypatch, (9, 0))
    assert cute_problem(torch.device("cuda", 0)) is None
    seen = []

    def f(x):
        seen.append(cute_problem(torch.device("cuda", 0)))
        return x.sum()

    grad(f)(torch.ones(3))
    vmap(grad(f))(torch.ones(2, 3))
    assert len(seen) == 2 and all(w and "torch.func transform" in w for w in seen)
    assert cute_problem(torch.device("cuda", 0)) is None
