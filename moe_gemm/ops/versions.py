"""The versions a measured result depends on: library, DSL, driver, device, kernel sources.

Online-autotune results (moe_gemm.tuning.online) are cached on disk with these and ignored
when any differs, so a driver or DSL upgrade, an edited kernel or another GPU never reuses a
measurement made under other conditions. Tables written by `moe-gemm tune` record them too.
"""

from __future__ import annotations

import functools
from importlib.metadata import PackageNotFoundError, version


def _dist(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


@functools.lru_cache(maxsize=1)
def driver_version() -> str:
    """The CUDA driver's version as 'major.minor', or 'none' where no driver loads."""
    try:
        import cuda.bindings.driver as drv

        err, v = drv.cuDriverGetVersion()
        if int(err) == 0:
            return f"{v // 1000}.{(v % 1000) // 10}"
    except Exception:  # noqa: BLE001 - no driver library on this machine
        pass
    return "none"


@functools.lru_cache(maxsize=8)
def runtime_versions(device: str) -> dict[str, str]:
    """{moe_gemm, nvidia-cutlass-dsl, driver, device, kernels} for results measured here."""
    from moe_gemm import __version__
    from moe_gemm.ops.kernel_cache import fingerprint

    return {"moe_gemm": __version__, "nvidia-cutlass-dsl": _dist("nvidia-cutlass-dsl"),
            "driver": driver_version(), "device": device, "kernels": fingerprint()}
