"""Which backends can run here, and if not, why not.

`backend="auto"` consults this on every call (cached per device), and `moe-gemm info` prints
it, so a user who expected the Hopper kernels sees the one reason they are not used.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from moe_gemm.env import env_value_reader

# The kernels use wgmma, setmaxnreg and the TMA engine: sm_90a only (H100, H200, H20, H800).
REQUIRED_CAPABILITY = (9, 0)


@functools.lru_cache(maxsize=1)
def cutlass_dsl_problem() -> str | None:
    """None if the CuTe DSL can be imported, else a one-line reason (without importing it)."""
    if importlib.util.find_spec("cutlass") is None:
        return "the CuTe DSL (nvidia-cutlass-dsl==4.8.1) is not installed"
    return None


_functorch_depth = torch._C._functorch.get_dynamic_layer_stack_depth
_cute_disabled = env_value_reader("MOE_GEMM_DISABLE_CUTE")  # (read at every call)


def cute_problem(device: torch.device | None = None) -> str | None:
    """None if the cute backend can run on `device` (default: the current CUDA device).

    Otherwise a sentence saying why not. Raises only moe_gemm.env.EnvError, for a
    MOE_GEMM_DISABLE_CUTE that is neither on nor off.
    """
    # (a flag: "false", "no" or "off" keep the kernels, as the other switches read them)
    if _cute_disabled():
        return "disabled by MOE_GEMM_DISABLE_CUTE"
    if device is not None and device.type != "cuda":
        return f"tensors are on {device.type}, the kernels run on CUDA sm_90a GPUs"
    if _functorch_depth() > 0:
        # grad, jvp or vmap(grad(...)): their wrapped tensors have no storage for a kernel to
        # read (a vmap alone runs each entry on plain tensors, at depth 0: ops/vmap.py).
        return "a torch.func transform (grad, jvp) is running: the kernels need plain tensors"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible (torch.cuda.is_available() is False)"
    index = device.index if device is not None and device.index is not None else None
    return _cuda_device_problem(torch.cuda.current_device() if index is None else index)


@functools.lru_cache(maxsize=16)
def _cuda_device_problem(index: int) -> str | None:
    cap = torch.cuda.get_device_capability(index)
    if cap != REQUIRED_CAPABILITY:
        name = torch.cuda.get_device_name(index)
        return f"{name} is sm_{cap[0]}{cap[1]}; the kernels need sm_90a (H100/H200)"
    return cutlass_dsl_problem()


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors on `device` (132 on H100 SXM and H200)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count(index)


@functools.lru_cache(maxsize=16)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def device_name(device: torch.device) -> str:
    """The CUDA device's name ("NVIDIA H100 80GB HBM3"): what tuned tables are keyed by."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _device_name(index)


@functools.lru_cache(maxsize=16)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)
