"""Which compiled kernel a launch runs, and on how many CTAs: the CompileKey of a kernel choice,
the compiled-kernel lookup (ops/kernel_cache.py), the device name tuned tables are keyed by,
the persistent grid, and the PDL switch.

The launch modules (general_launch, mm_launch, fused_launch, scaled_launch) call these names
through the module (launch_kernel._compiled(key), launch_kernel.sm_count(device)), never from
an import of the name: a test or a script that replaces one (a recorder for the kernel, a fixed
SM count) then replaces it for every launch.
"""

from __future__ import annotations

import functools

import torch

# sm_count: unused here; every launch module looks it up as launch_kernel.sm_count (see above).
from moe_gemm.capability import device_name, sm_count  # noqa: F401
from moe_gemm.env import env_value
from moe_gemm.ops import kernel_cache as cache
from moe_gemm.ops import launch_resources
from moe_gemm.ops.heuristics import KernelChoice

_TORCH_TO_NAME = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}

# Programmatic dependent launch of the main kernel (see GroupedGemmSm90.__call__): opt-in
# (MOE_GEMM_PDL=1). Measured neutral on an H200 (2026-11-21, back-to-back CUDA-graph timing,
# on / off): mixtral 2831 / 2826 us, uniform list 559 / 555, moe-decode 288 / 283,
# k-varying 122 / 124; the GPU tests pass both ways. A module attribute (read at every launch)
# so one process can time both (tests/kernels/test_graphs_gpu.py switches it).
PDL = int(bool(env_value("MOE_GEMM_PDL")))


def _compile_key(form, ab, d, b_major, choice: KernelChoice, trace: bool):
    from moe_gemm.kernels.sm90.compile import CompileKey

    return CompileKey(
        form, _TORCH_TO_NAME[ab], _TORCH_TO_NAME[d], b_major, choice.schedule, choice.visitor,
        choice.tile_m, choice.tile_n, choice.stages, trace, choice.l2_hints, choice.epi_n,
        choice.cluster_m, choice.cluster_n, choice.epi_whole, choice.tail_split,
        trim_a=choice.trim_a and form == "varlen", peek_wait=choice.peek_wait,
        split_ways=choice.split_ways, swap_ab=choice.swap_ab,
        packed_pairs=choice.packed_pairs and form == "varlen",
    )


@functools.lru_cache(maxsize=16)
def max_clusters(device_index: int, size: int, nsm: int) -> int:
    """How many `size`-CTA clusters of our kernel (one CTA per SM) can be resident at once:
    the persistent grid must not exceed it, or the excess clusters would wait for the first
    ones to finish. GPCs have an uneven SM count, so this can be below nsm / 2 (H200: 66)."""
    if size == 1:
        return nsm
    try:
        from cutlass.utils import HardwareInfo

        return max(1, int(HardwareInfo(device_index).get_max_active_clusters(size)))
    except Exception:  # noqa: BLE001 - a driver without the query: a safe lower bound
        return max(1, nsm // (2 * size))


def _grid(device: torch.device | None, nsm: int, size: int, units: int,
          whole: bool = False) -> tuple[int, int]:
    """(CTAs, units per cluster upper bound) for `units` cluster tiles of work. whole: every
    SM whatever the units (a tail-split kernel splits a launch of fewer tiles than SMs over
    K on the idle ones; a CTA without work exits at once)."""
    idx = launch_resources._device_index(device)
    clusters = max(1, min(max_clusters(idx, size, nsm), nsm // size,
                          nsm if whole else units))
    return clusters * size, -(-units // clusters)


def varlen_grid(device: torch.device | None, nsm: int, choice: KernelChoice, rows: int,
                num_problems: int, N: int) -> tuple[int, int]:
    """(CTAs, cluster tiles per cluster upper bound) of a varlen launch on the device visitor:
    the sum over problems of ceil(rows_p / unit) is at most ceil(rows / unit) plus one partial
    unit per problem, times the column units."""
    unit = choice.tile_m * choice.cluster_m
    units_n = -(-N // (choice.tile_n * choice.cluster_n))
    bound = (-(-rows // unit) + num_problems) * units_n
    return _grid(device, nsm, choice.cluster_m * choice.cluster_n, bound, choice.tail_split)


@functools.lru_cache(maxsize=256)
def _kernel_for(form, ab, d, b_major, choice: KernelChoice, trace: bool):
    """The compiled kernel for a launch's static choices (one dict lookup per call)."""
    return _compiled(_compile_key(form, ab, d, b_major, choice, trace))


def _compiled(key):
    from moe_gemm.kernels.sm90.compile import compile_variant

    return cache.get_or_compile(key, key.name, lambda: compile_variant(key))


def _table_device(device: torch.device | None) -> str | None:
    """The name tuned tables are keyed by: the CUDA device's, None elsewhere (rules only)."""
    return device_name(device) if device is not None and device.type == "cuda" else None


def table_keys(device: torch.device | None, ab: torch.dtype, d: torch.dtype) -> dict:
    """The keyword arguments a kernel choice (ops/heuristics.py) looks the tuned tables up
    by: the device's name and the operand and output dtypes' names."""
    return {"device": _table_device(device), "dtype": _TORCH_TO_NAME[ab],
            "out_dtype": _TORCH_TO_NAME[d]}
