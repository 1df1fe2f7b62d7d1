"""Test helpers that ship with the package: accuracy checks and random case generators.

They live in the package (as DeepGEMM's `deep_gemm.testing` and FA4's `flash_attn.cute.testing`
do) so that the CPU tests, the GPU kernel tests and the benchmarks judge accuracy the same way
and draw cases from the same generators. Nothing here is used by the ops themselves.

Accuracy, per STYLE.md:
- `calc_diff(x, y)`: DeepGEMM's 1 - 2*sum(x*y) / sum(x*x + y*y), in float64. 0 for identical
  tensors, about (relative error)^2 / 2 for small noise; insensitive to a few outliers, so it is
  a second guard, not the main one.
- `assert_close_to_ref(out, ref, baseline)`: the "2x rule" of quack's GEMM tests and FA4:
  max|out - ref| <= 2 * max|baseline - ref| + atol, where `ref` is a float32/float64 reference
  and `baseline` the same computation done by plain torch in the output's low precision. Without
  a baseline it falls back to quack's per-dtype tolerance table.

Generators take a `torch.Generator` (CPU) so a case is reproducible on any device: data is drawn
on the CPU and then moved.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Size = tuple[int, int, int]  # (M, N, K), the order moe_gemm.schedule uses

# quack's per-dtype tolerances (used as both atol and rtol) for the no-baseline fallback.
TOLERANCES: dict[torch.dtype, float] = {
    torch.bfloat16: 1e-2,
    torch.float16: 1e-3,
    torch.float32: 1e-4,
    torch.float64: 1e-10,
}
# calc_diff ceiling: bf16 output rounding alone gives about 6e-7 (relative error <= 2^-9).
DEFAULT_MAX_CALC_DIFF = 1e-5


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepGEMM's similarity distance, 1 - 2*sum(x*y)/sum(x*x + y*y), computed in float64.

    Args:
        x, y: tensors of the same shape, any float dtype and device.

    Returns:
        0.0 for equal tensors (including two empty or two all-zero tensors), up to 2.0 for
        x = -y; NaN if either holds a NaN.
    """
    if x.shape != y.shape:
        raise ValueError(f"calc_diff needs equal shapes; got {tuple(x.shape)} and {tuple(y.shape)}")
    x64 = x.detach().to(torch.float64)
    y64 = y.detach().to(torch.float64).to(x64.device)
    denominator = float((x64 * x64 + y64 * y64).sum())
    if denominator == 0.0:
        return 0.0  # both all zero (or empty): identical
    similarity = 2.0 * float((x64 * y64).sum()) / denominator
    return 1.0 - similarity


def _nonfinite_mismatch(out: torch.Tensor, ref: torch.Tensor) -> str | None:
    """Where out and ref disagree on NaN/inf (a poisoned, never-written output shows here)."""
    out_bad, ref_bad = ~torch.isfinite(out), ~torch.isfinite(ref)
    if torch.equal(out_bad, ref_bad):
        ob, rb = out[out_bad], ref[ref_bad]
        # NaN != NaN, so NaN positions are compared as a mask and +-inf by value.
        if torch.equal(torch.isnan(ob), torch.isnan(rb)) and torch.equal(
            torch.where(torch.isnan(ob), 0.0, ob), torch.where(torch.isnan(rb), 0.0, rb)
        ):
            return None
        first = torch.nonzero(out_bad)[0]
    else:
        first = torch.nonzero(out_bad != ref_bad)[0]
    where = tuple(int(i) for i in first)
    return (
        f"{int(out_bad.sum())} non-finite values in out vs {int(ref_bad.sum())} in the "
        f"reference; first mismatch at index {where}: out={out[where].item()}, "
        f"ref={ref[where].item()}"
    )


def assert_close_to_ref(
    out: torch.Tensor,
    ref: torch.Tensor,
    out_lowprec_baseline: torch.Tensor | None = None,
    atol: float | None = None,
    *,
    max_calc_diff: float | None = DEFAULT_MAX_CALC_DIFF,
    name: str = "out",
) -> None:
    """Assert `out` is as close to the high-precision `ref` as torch itself gets.

    With a baseline (the same op computed by plain torch in out's low precision), the 2x rule:
    max|out - ref| <= 2 * max|baseline - ref| + atol (atol default 1e-5). Without one, every
    element must satisfy |out - ref| <= tol + tol * |ref| with tol from TOLERANCES[out.dtype].
    Then calc_diff(out, ref) <= max_calc_diff (None skips this guard). Non-finite values must
    sit where the reference has them, so a NaN-poisoned output that was never written fails.

    Args:
        out: the tensor under test, any float dtype.
        ref: the reference, same shape, ideally float32 or float64 (compared in float64).
        out_lowprec_baseline: optional low-precision torch result, same shape.
        atol: absolute slack of the 2x rule, or the tolerance of the table fallback.
        max_calc_diff: ceiling for calc_diff(out, ref); None to skip.
        name: what to call `out` in the failure message.

    Raises:
        AssertionError: with the max error, its index and both bounds.
    """
    if tuple(out.shape) != tuple(ref.shape):
        raise AssertionError(f"{name} has shape {tuple(out.shape)}, reference {tuple(ref.shape)}")
    if out.numel() == 0:
        return
    o = out.detach().to(torch.float64).cpu()
    r = ref.detach().to(torch.float64).cpu()
    bad = _nonfinite_mismatch(o, r)
    if bad is not None:
        raise AssertionError(f"{name}: {bad}")
    finite = torch.isfinite(r)
    o, r = torch.where(finite, o, 0.0), torch.where(finite, r, 0.0)
    err = (o - r).abs()
    worst = int(err.argmax())
    worst_idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), err.shape))
    max_err = float(err.max())
    detail = f"at index {worst_idx}: out={float(o[worst_idx])!r}, ref={float(r[worst_idx])!r}"
    if out_lowprec_baseline is not None:
        if tuple(out_lowprec_baseline.shape) != tuple(ref.shape):
            raise AssertionError(
                f"baseline has shape {tuple(out_lowprec_baseline.shape)}, reference "
                f"{tuple(ref.shape)}"
            )
        base = torch.where(finite, out_lowprec_baseline.detach().to(torch.float64).cpu(), 0.0)
        base_err = float((base - r).abs().max())
        slack = 1e-5 if atol is None else atol
        bound = 2.0 * base_err + slack
        if not max_err <= bound:
            raise AssertionError(
                f"{name}: max|out - ref| = {max_err:.6g} > 2 * max|baseline - ref| + atol = "
                f"2 * {base_err:.6g} + {slack:g} = {bound:.6g} ({detail})"
            )
    else:
        tol = TOLERANCES.get(out.dtype, 1e-4) if atol is None else atol
        allowed = tol + tol * r.abs()
        if not bool((err <= allowed).all()):
            excess = int((err - allowed).argmax())
            idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(excess), err.shape))
            raise AssertionError(
                f"{name}: |out - ref| > {tol:g} + {tol:g} * |ref| at index {idx}: "
                f"out={float(o[idx])!r}, ref={float(r[idx])!r} (max error {max_err:.6g} {detail})"
            )
    if max_calc_diff is not None:
        diff = calc_diff(o, r)
        if not diff <= max_calc_diff:
            raise AssertionError(f"{name}: calc_diff(out, ref) = {diff:.3g} > {max_calc_diff:g}")


def _uniform_int(low: int, high: int, generator: torch.Generator | None) -> int:
    """An int in [low, high], inclusive."""
    if high < low:
        raise ValueError(f"empty range [{low}, {high}]")
    return int(torch.randint(low, high + 1, (1,), generator=generator))


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def random_problem_sizes(
    num_problems: int,
    *,
    m_range: tuple[int, int] = (1, 300),
    n_range: tuple[int, int] = (1, 300),
    k_range: tuple[int, int] = (1, 300),
    empty_fraction: float = 0.0,
    align_n: int = 1,
    align_k: int = 1,
    generator: torch.Generator | None = None,
) -> list[Size]:
    """Random (M, N, K) per problem, for grouped_gemm cases.

    Args:
        num_problems: G.
        m_range, n_range, k_range: inclusive ranges for each size.
        empty_fraction: probability that a problem gets M = 0.
        align_n, align_k: round N and K up to these multiples (e.g. 8 so a bf16 row is 16 bytes,
            as the TMA-based kernels need); 1 leaves them free.
        generator: a CPU torch.Generator; None uses the global RNG.

    Returns:
        G tuples (M, N, K).
    """
    if num_problems < 0:
        raise ValueError(f"num_problems must be >= 0; got {num_problems}")
    if not 0.0 <= empty_fraction <= 1.0:
        raise ValueError(f"empty_fraction must be in [0, 1]; got {empty_fraction}")
    sizes: list[Size] = []
    for _ in range(num_problems):
        m = _uniform_int(*m_range, generator)
        n = _round_up(_uniform_int(*n_range, generator), align_n)
        k = _round_up(_uniform_int(*k_range, generator), align_k)
        if empty_fraction and float(torch.rand((), generator=generator)) < empty_fraction:
            m = 0
        sizes.append((m, n, k))
    return sizes


def random_offs(
    T: int,
    E: int,
    empty_fraction: float = 0.0,
    generator: torch.Generator | None = None,
    *,
    skew: float = 0.0,
    total: int | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Random int32 cumulative end rows (E,) for grouped_mm, as a router would produce.

    Args:
        T: rows of x.
        E: experts.
        empty_fraction: probability that an expert is made empty (gets no rows). At least one
            expert keeps rows whenever total > 0 and empty_fraction < 1.
        generator: a CPU torch.Generator; None uses the global RNG.
        skew: 0 spreads rows evenly at random; larger values concentrate them Zipf-like
            (expert weights (rank + 1) ** -skew over a random ranking of the experts).
        total: rows assigned to experts, offs[-1] (default T); total < T leaves tail rows.
        device: where the result lives.

    Returns:
        (E,) int32, non-decreasing, offs[-1] == total (0 when E == 0 has no entries).
    """
    total = T if total is None else total
    if not 0 <= total <= T:
        raise ValueError(f"total must be in [0, T={T}]; got {total}")
    if E < 0:
        raise ValueError(f"E must be >= 0; got {E}")
    if E == 0:
        if total:
            raise ValueError(f"E = 0 experts cannot take total = {total} rows")
        return torch.zeros(0, dtype=torch.int32, device=device)
    rank = torch.randperm(E, generator=generator).to(torch.float64)
    weights = (rank + 1.0) ** (-float(skew))
    if empty_fraction:
        empty = torch.rand(E, generator=generator) < empty_fraction
        if total and empty.all() and empty_fraction < 1.0:
            empty[int(torch.randint(0, E, (1,), generator=generator))] = False
        weights = torch.where(empty, 0.0, weights)
    counts = torch.zeros(E, dtype=torch.int64)
    if total:
        if float(weights.sum()) == 0.0:
            raise ValueError("every expert is empty but total > 0 rows must be placed")
        picks = torch.multinomial(weights, total, replacement=True, generator=generator)
        counts = torch.bincount(picks, minlength=E)
    return torch.cumsum(counts, 0).to(torch.int32).to(device)


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill `t` in place with values no correct kernel writes: NaN for floats, the max for ints.

    An output element the op forgot to write then fails assert_close_to_ref.
    """
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return t.fill_(float("nan"))
    if t.dtype == torch.bool:
        return t.fill_(True)
    return t.fill_(torch.iinfo(t.dtype).max)


def _randn(shape: Sequence[int], generator: torch.Generator | None) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=generator, dtype=torch.float32)


def make_grouped_inputs(
    sizes: Sequence[Size],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    b_layout: str = "row",
    generator: torch.Generator | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Random a_i (M_i, K_i) and b_i (K_i, N_i) for grouped_gemm.

    Args:
        sizes: (M, N, K) per problem.
        dtype: element type of every operand.
        device: where the tensors live (data is drawn on the CPU first).
        b_layout: "row" (b_i contiguous (K, N)), "col" (b_i = w_i.T of a contiguous (N, K)
            weight, the nn.Linear layout) or "mixed" (alternating, starting with "row").
        generator: a CPU torch.Generator; None uses the global RNG.

    Returns:
        (a, b): two lists of G tensors; values are standard normal, rounded to `dtype`.
    """
    if b_layout not in ("row", "col", "mixed"):
        raise ValueError(f"b_layout must be 'row', 'col' or 'mixed'; got {b_layout!r}")
    a: list[torch.Tensor] = []
    b: list[torch.Tensor] = []
    for i, (m, n, k) in enumerate(sizes):
        a.append(_randn((m, k), generator).to(device=device, dtype=dtype))
        col = b_layout == "col" or (b_layout == "mixed" and i % 2 == 1)
        if col:
            b.append(_randn((n, k), generator).to(device=device, dtype=dtype).T)
        else:
            b.append(_randn((k, n), generator).to(device=device, dtype=dtype))
    return a, b


def make_moe_inputs(
    T: int,
    E: int,
    K: int,
    N: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    w_layout: str = "kn",
    skew: float = 0.0,
    *,
    empty_fraction: float = 0.0,
    total: int | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random x (T, K), w (E, K, N) and int32 offs (E,) for grouped_mm.

    Args:
        T, E, K, N: tokens (rows of x), experts, hidden and output sizes.
        dtype: element type of x and w.
        device: where the tensors live (data is drawn on the CPU first).
        w_layout: "kn" (w contiguous (E, K, N)) or "nk_view" (w = w_t.transpose(1, 2) of a
            contiguous (E, N, K) weight, the nn.Linear layout).
        skew: routing skew, see random_offs.
        empty_fraction: probability that an expert gets no rows, see random_offs.
        total: offs[-1] (default T); fewer leaves tail rows that belong to no expert.
        generator: a CPU torch.Generator; None uses the global RNG.

    Returns:
        (x, w, offs).
    """
    if w_layout not in ("kn", "nk_view"):
        raise ValueError(f"w_layout must be 'kn' or 'nk_view'; got {w_layout!r}")
    x = _randn((T, K), generator).to(device=device, dtype=dtype)
    if w_layout == "kn":
        w = _randn((E, K, N), generator).to(device=device, dtype=dtype)
    else:
        w = _randn((E, N, K), generator).to(device=device, dtype=dtype).transpose(1, 2)
    offs = random_offs(
        T, E, empty_fraction, generator, skew=skew, total=total, device=device
    )
    return x, w, offs
