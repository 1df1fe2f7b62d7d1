"""Checks of the masked ops' arguments (ops/masked.py): the batched form's checks
(ops/validation.py, ops/scaled_validation.py) plus the row counts and the kernel-choice hint.

masked_m is (G,) int32 on x's device: problem g's valid rows are x[g, :masked_m[g]]. Values on
the CPU are checked (0 <= masked_m[g] <= M); on the GPU they are read by the kernel only (no
host synchronisation, CUDA-graph safe) and clamped into [0, M] there, unless
MOE_GEMM_CHECK_OFFS=1 asks for the check (one device-to-host copy).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from moe_gemm.ops.scaled_validation import ScaledMmArgs, check_scaled_grouped_mm
from moe_gemm.ops.validation import (
    GroupedBmmArgs,
    check_dense,
    check_grouped_bmm,
    offs_check_requested,
    shape_text,
)


@dataclass(frozen=True)
class MaskedArgs:
    """Checked arguments of grouped_mm_masked (bmm) or scaled_grouped_mm_masked (scaled)."""

    batch: GroupedBmmArgs | ScaledMmArgs  # the batched form's checked operands
    masked_m: torch.Tensor  # (G,) int32
    expected_m: int  # rows per problem the kernel choice plans for (1..M; M if not given)

    @property
    def x(self) -> torch.Tensor:
        return self.batch.x

    @property
    def out(self) -> torch.Tensor | None:
        return self.batch.out

    @property
    def shape(self) -> tuple[int, int, int]:
        x = self.batch.x
        return x.shape[0], x.shape[1], self.batch.w.shape[2]


def check_masked_m(masked_m: object, G: int, M: int, device: torch.device, *,
                   concrete: bool = True) -> torch.Tensor:
    if not isinstance(masked_m, torch.Tensor):
        raise TypeError(f"masked_m must be a torch.Tensor ({G},) of int32 row counts; got "
                        f"{type(masked_m).__name__}")
    check_dense("masked_m", masked_m)
    if masked_m.dtype != torch.int32:
        raise TypeError(f"masked_m must be int32 row counts ({G},); got dtype {masked_m.dtype}")
    if masked_m.dim() != 1 or masked_m.shape[0] != G:
        raise ValueError(f"masked_m must have one row count per problem: ({G},); got "
                         f"{shape_text(masked_m)}")
    if masked_m.device != device:
        raise ValueError(f"masked_m is on {masked_m.device} but x is on {device}; it must live "
                         "with x")
    if concrete and G and (masked_m.device.type == "cpu" or offs_check_requested()):
        v = masked_m.detach().to("cpu", torch.int64)
        bad = torch.nonzero((v < 0) | (v > M))
        if bad.numel():
            g = int(bad[0])
            raise ValueError(f"masked_m values must be in [0, M] = [0, {M}] (valid rows of each "
                             f"problem); got masked_m[{g}]={int(v[g])}")
    return masked_m


def check_expected_m(expected_m: object, M: int) -> int:
    if expected_m is None:
        return max(M, 1)
    # Python ints and the integer scalars of numpy (numbers.Integral); not a bool, nor a
    # tensor (reading a GPU one would synchronise: the kernel choice is the host's).
    if isinstance(expected_m, bool) or not isinstance(expected_m, numbers.Integral):
        raise TypeError(f"expected_m must be an int (typical valid rows per problem) or None; "
                        f"got {type(expected_m).__name__}")
    expected_m = int(expected_m)
    if expected_m < 1:
        raise ValueError(f"expected_m must be >= 1 (typical valid rows per problem); got "
                         f"{expected_m}")
    return min(expected_m, max(M, 1))


def _check_x_rank(x: object) -> None:
    # (before the batched form's checks, whose rank message points at grouped_mm's offs)
    if isinstance(x, torch.Tensor) and x.dim() != 3:
        raise ValueError(f"x must be 3-D (G, M, K): M rows of capacity per problem; got shape "
                         f"{shape_text(x)}")


def check_config_fits(config) -> None:
    """A config the masked form can run: no pinned tail split (its plan needs the tile count
    on the host)."""
    if config is not None and getattr(config, "tail_split", None):
        raise ValueError("the masked form has no tail split (its plan needs the row counts on "
                         "the host): leave GemmConfig.tail_split unset")


def check_grouped_mm_masked(x: object, w: object, masked_m: object, expected_m: object,
                            out: object, out_dtype: torch.dtype | None, *,
                            concrete: bool = True) -> MaskedArgs:
    _check_x_rank(x)
    batch = check_grouped_bmm(x, w, out, out_dtype)
    G, M = batch.G, batch.M
    return MaskedArgs(batch, check_masked_m(masked_m, G, M, batch.x.device, concrete=concrete),
                      check_expected_m(expected_m, M))


def check_scaled_grouped_mm_masked(x: object, w: object, scale_a: object, scale_b: object,
                                   masked_m: object, expected_m: object, out: object,
                                   out_dtype: object, *, concrete: bool = True) -> MaskedArgs:
    _check_x_rank(x)
    batch = check_scaled_grouped_mm(x, w, scale_a, scale_b, None, out, out_dtype,
                                    concrete=concrete)
    G, M = batch.x.shape[0], batch.x.shape[1]
    return MaskedArgs(batch, check_masked_m(masked_m, G, M, batch.x.device, concrete=concrete),
                      check_expected_m(expected_m, M))
