"""GPU tests of the FP8 grouped GEMM (GroupedGemmFp8Sm90) and the 1x128 quantization kernel.

Every variant is checked against the exact (fp64) product of the dequantized operands
(moe_gemm.ops.scaled_reference), outputs poisoned with NaN first so an unwritten element
fails: the varlen form with empty experts, tail rows and both output modes, every
granularity and schedule, the FP8 tile family (two-scale-block tiles, 128-row ping-pong),
clusters, the tail split, long K (7168, 14336) accuracy, M = 1 and edge row counts, bad offs
(never a write outside out), CUDA-graph replay with new offs and no host synchronisation,
the batched form (the decode headline 256 x 128x512x7168) and the general lists, e5m2 and
every output dtype, and the quantization kernel bit for bit against its torch formula.

Run alone (device machine, DSL unpacked):
    python3 scripts/precompile.py --set fp8 -j 16 && python3 scripts/gpu_session.py --out $OUT \
        --paths tests/kernels/test_fp8_gpu.py --no-precompile
"""

from __future__ import annotations

import pytest
import torch

from moe_gemm import (
    GemmConfig,
    quantize_fp8_per_token_group,
    scaled_grouped_gemm,
    scaled_grouped_mm,
)
from moe_gemm.ops import launch_info
from moe_gemm.ops.heuristics_fp8 import (
    HALF_SKIP_ENV,
    PEEK_WAIT_FP8_ENV,
    PROMOTE_LAG_ENV,
    SCALE_AHEAD_ENV,
    SMEM_SCALES_ENV,
)
from moe_gemm.ops.quantize import _kernel_ok, _per_token_group_torch, token_major_scales
from moe_gemm.ops.scaled_reference import scaled_grouped_gemm_ref, scaled_grouped_mm_ref
from moe_gemm.testing import poison_
from moe_gemm.testing_fp8 import (
    GRANULARITIES,
    REL_BOUND,
    fp8_errors,
    make_fp8_batched_inputs,
    make_fp8_grouped_inputs,
    make_fp8_moe_inputs,
)

from .gpu_report import record
from .variants_fp8 import (
    FORM_LOOPS,
    HALF_SKIP_CASES,
    HALF_SKIP_COUNTS,
    LOOP_CASES,
    PEEK_CASES,
    PEEK_LOOP_ENV,
    STAGED_PLAIN_CASES,
)

pytestmark = pytest.mark.gpu

DEV = "cuda"
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def cute(**fields) -> GemmConfig:
    return GemmConfig(backend="cute", **fields)


def _ran_kernel(before) -> bool:
    """Whether a kernel launch was recorded since `before` (launch_info._local.raw's identity)."""
    return getattr(launch_info._local, "raw", None) is not before


def check(name, out, ref, **info):
    """out against the fp64 reference: relative (Frobenius) error within REL_BOUND of the
    output dtype, no element off by 2% of max|ref|, nothing non-finite."""
    if out.numel() == 0:
        record(name, True, **info)
        return
    finite = bool(torch.isfinite(out).all())
    e = fp8_errors(out, ref)
    bound = REL_BOUND[out.dtype]
    passed = finite and e["rel"] <= bound and e["max_rel"] <= 2e-2
    record(name, passed, finite=finite, bound=bound, **e, **info)
    assert finite, f"{name}: output has NaN/inf (unwritten elements?)"
    assert e["rel"] <= bound, f"{name}: relative error {e['rel']:.3g} > {bound:g} ({e})"
    assert e["max_rel"] <= 2e-2, f"{name}: max error {e['max_rel']:.3g} of max|ref| ({e})"


def run_mm(name, T, E, K, N, granularity, config, out_mode="alloc", *, total=None,
           empty=0.3, seed=0, out_dtype=BF16, fp8=E4M3, skew=0.0):
    x, w, sa, sb, offs = make_fp8_moe_inputs(T, E, K, N, granularity, dtype=fp8, device=DEV,
                                             empty_fraction=empty, total=total, seed=seed,
                                             skew=skew)
    ref = scaled_grouped_mm_ref(x, w, sa, sb, offs)
    end = int(offs[-1]) if E else 0
    before = getattr(launch_info._local, "raw", None)
    if out_mode == "given":
        out = poison_(torch.empty(T, N, dtype=out_dtype, device=DEV))
        y = scaled_grouped_mm(x, w, sa, sb, offs, out=out, config=config)
        assert y is out
        untouched = bool(torch.isnan(out[end:].float()).all())
        record(f"{name}/rows-past-offs-untouched", untouched)
        assert untouched, f"{name}: rows past offs[-1] were written"
        y, ref = y[:end], ref[:end]
    else:
        y = scaled_grouped_mm(x, w, sa, sb, offs, out_dtype=out_dtype, config=config)
    torch.cuda.synchronize()
    assert _ran_kernel(before) or T * E * N == 0, f"{name}: the FP8 kernel did not run"
    info = launch_info.last_launch()
    c = info.choice
    check(name, y, ref, tile=f"{c.schedule} {c.tile_m}x{c.tile_n} c{c.cluster_m}x{c.cluster_n}",
          tail_split=c.tail_split)
    return x, w, sa, sb, offs, y


# ---------------------------------------------------------------------------------------------
# varlen


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("schedule,tile", [("cooperative", (128, 128)), ("pingpong", (64, 128))])
@pytest.mark.parametrize("out_mode", ["alloc", "given"])
def test_varlen_matrix(granularity, schedule, tile, out_mode):
    cfg = cute(schedule=schedule, tile_m=tile[0], tile_n=tile[1])
    run_mm(f"fp8/varlen/{granularity}/{schedule}/{out_mode}", 1000, 10, 384, 264, granularity,
           cfg, out_mode, total=901, seed=1)


@pytest.mark.parametrize("schedule,tile", [("cooperative", (128, 192)),
                                           ("cooperative", (128, 160)),
                                           ("cooperative", (128, 64)),
                                           ("pingpong", (64, 192)), ("pingpong", (128, 64))])
@pytest.mark.parametrize("granularity", ["block", "row"])
def test_varlen_tile_family(schedule, tile, granularity):
    # N = 712: tiles starting at every offset within a 128-column scale block, a partial last
    # tile and a partial last scale block; K = 640 (5 scale blocks).
    cfg = cute(schedule=schedule, tile_m=tile[0], tile_n=tile[1])
    run_mm(f"fp8/varlen/tile={schedule}-{tile[0]}x{tile[1]}/{granularity}", 700, 6, 640, 712,
           granularity, cfg, "given", total=650, seed=2)


@pytest.mark.parametrize("cluster", [(2, 1), (1, 2)])
def test_varlen_clusters(cluster):
    cfg = cute(schedule="cooperative", tile_m=128, tile_n=128, cluster_m=cluster[0],
               cluster_n=cluster[1])
    run_mm(f"fp8/varlen/cluster={cluster[0]}x{cluster[1]}", 1500, 8, 512, 392, "block", cfg,
           "alloc", seed=3)


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("out_mode", ["alloc", "given"])
def test_varlen_whole_epilogue_in_pairs(granularity, out_mode):
    """The compute-bound default (cooperative 128x128, 1x2 cluster, the whole-tile epilogue):
    experts ending on every side of a tile's 64- and 128-row lines, N = 392 (a partial last
    tile, an odd tile count: the last pair's second CTA past the edge), rows past offs[-1]
    untouched."""
    counts = [1, 63, 64, 65, 127, 128, 129, 0, 191, 193, 300]
    T = sum(counts) + 9
    x, w, sa, sb, offs = make_fp8_moe_inputs(T, len(counts), 512, 392, granularity,
                                             device=DEV, seed=13)
    offs.copy_(torch.tensor(counts, device=DEV).cumsum(0).to(torch.int32))
    cfg = cute(schedule="cooperative", tile_m=128, tile_n=128, cluster_m=1, cluster_n=2)
    ref = scaled_grouped_mm_ref(x, w, sa, sb, offs)
    end = int(offs[-1])
    if out_mode == "given":
        out = poison_(torch.empty(T, 392, dtype=BF16, device=DEV))
        y = scaled_grouped_mm(x, w, sa, sb, offs, out=out, config=cfg)
        assert y is out and bool(torch.isnan(out[end:].float()).all())
    else:
        y = scaled_grouped_mm(x, w, sa, sb, offs, config=cfg)
    torch.cuda.synchronize()
    c = launch_info.last_launch().choice
    assert c.epi_whole and (c.cluster_m, c.cluster_n) == (1, 2), c
    check(f"fp8/varlen/whole-epilogue-1x2/{granularity}/{out_mode}", y[:end], ref[:end])
    # bit for bit the subtile epilogue's result (the same accumulators, stored another way)
    sub = scaled_grouped_mm(x, w, sa, sb, offs, config=cute(
        schedule="cooperative", tile_m=128, tile_n=128, cluster_m=1, cluster_n=2,
        whole_epilogue=False))
    assert torch.equal(sub[:end], y[:end])


def test_varlen_tail_split():
    # 8 x 300 rows, N = 1024: 24 x 8 = 192 tiles of 128x128 on 132 SMs: a last wave of 60 tiles
    # (<= half the grid) split in two halves of K = 4096.
    cfg = cute(schedule="cooperative", tile_m=128, tile_n=128, tail_split=True)
    counts = [300] * 8
    x, w, sa, sb, offs = make_fp8_moe_inputs(2400, 8, 4096, 1024, "block", device=DEV, seed=4)
    offs.copy_(torch.tensor(counts, device=DEV).cumsum(0).to(torch.int32))
    y = scaled_grouped_mm(x, w, sa, sb, offs, config=cfg)
    info = launch_info.last_launch()
    assert info.choice.tail_split
    check("fp8/varlen/tail-split", y, scaled_grouped_mm_ref(x, w, sa, sb, offs))
    unsplit = scaled_grouped_mm(x, w, sa, sb, offs, config=cute(schedule="cooperative",
                                                                 tile_m=128, tile_n=128,
                                                                 tail_split=False))
    diff = float((unsplit.float() - y.float()).abs().max())
    record("fp8/varlen/tail-split-vs-unsplit", diff <= 1e-2 * float(y.float().abs().max()),
           max_abs_diff=diff)


# The loops beside the plain one: the lagged promotion (MOE_GEMM_FP8_PROMOTE_LAG=1), the
# prefetched scales (MOE_GEMM_FP8_SCALE_AHEAD=n) and the scales staged in shared memory
# (MOE_GEMM_FP8_SMEM_SCALES=1). Each does the plain loop's FMAs in the same order, so its
# output is bit for bit the plain kernel's. A loop: (switch, value, the choice field it sets).
LOOPS = {"lagged": (PROMOTE_LAG_ENV, "1", "promote_lag"),
         **{f"ahead{n}": (SCALE_AHEAD_ENV, str(n), "scale_ahead") for n in (2, 3, 4)},
         "smem": (SMEM_SCALES_ENV, "1", "smem_scales")}


def _plain_and(monkeypatch, run, loop: str):
    """run() on the plain loop, then with `loop` switched on: (plain, other)."""
    env, value, field = LOOPS[loop]
    want = int(value) if field == "scale_ahead" else True
    monkeypatch.delenv(PROMOTE_LAG_ENV, raising=False)
    monkeypatch.setenv(SCALE_AHEAD_ENV, "1")  # the plain loop (the default loads 3 ahead)
    monkeypatch.setenv(SMEM_SCALES_ENV, "0")
    plain = run()
    assert launch_info.last_launch().choice.scale_ahead == 1
    assert not launch_info.last_launch().choice.smem_scales
    assert getattr(launch_info.last_launch().choice, field) != want
    monkeypatch.setenv(env, value)
    other = run()
    assert getattr(launch_info.last_launch().choice, field) == want, f"{loop} did not run"
    monkeypatch.delenv(env)
    return plain, other


# 1 to 7 stages: both parities of the lagged loop's pairs, fewer stages than a ring, and each
# remainder of rings of 2, 3 and 4
@pytest.mark.parametrize("K", [128, 256, 384, 512, 640, 896])
@pytest.mark.parametrize("case", LOOP_CASES,
                         ids=lambda c: f"{c[0]}-{c[1]}-{c[2][0]}x{c[2][1]}-c{c[3]}x{c[4]}")
def test_scale_loop_equals_plain_loop(monkeypatch, case, K):
    loop, sched, tile, cm, cn = case
    cfg = cute(schedule=sched, tile_m=tile[0], tile_n=tile[1], cluster_m=cm, cluster_n=cn,
               tail_split=False)
    x, w, sa, sb, offs = make_fp8_moe_inputs(700, 6, K, 392, "block", device=DEV,
                                             empty_fraction=0.3, total=650, seed=11 + K)
    end = int(offs[-1])

    def run():
        out = poison_(torch.empty(700, 392, dtype=BF16, device=DEV))
        return scaled_grouped_mm(x, w, sa, sb, offs, out=out, config=cfg)

    plain, other = _plain_and(monkeypatch, run, loop)
    if loop == "smem":  # staged scales run with the lag
        assert launch_info.last_launch().choice.promote_lag
    name = f"fp8/{loop}/{sched}-{tile[0]}x{tile[1]}-c{cm}x{cn}/K={K}"
    check(name, other[:end], scaled_grouped_mm_ref(x, w, sa, sb, offs)[:end])
    same = torch.equal(other[:end], plain[:end])
    record(f"{name}/equals-plain", same)
    assert same, f"{name}: differs from the plain loop"
    assert bool(torch.isnan(other[end:].float()).all()), f"{name}: rows past offs written"


@pytest.mark.parametrize("loop", FORM_LOOPS)
def test_scale_loop_long_k_tail_split_and_forms(monkeypatch, loop):
    # long K with the tail split (each CTA's K range starts mid-way), the batched and the
    # general forms, a narrow tile spanning two scale blocks
    x, w, sa, sb, offs = make_fp8_moe_inputs(2400, 8, 4096, 1024, "block", device=DEV, seed=21)
    offs.copy_(torch.tensor([300] * 8, device=DEV).cumsum(0).to(torch.int32))
    cfg = cute(schedule="cooperative", tile_m=128, tile_n=128, tail_split=True)
    plain, other = _plain_and(
        monkeypatch, lambda: scaled_grouped_mm(x, w, sa, sb, offs, config=cfg), loop)
    assert launch_info.last_launch().choice.tail_split
    _close_under_the_split(f"fp8/{loop}/tail-split", other, plain,
                           scaled_grouped_mm_ref(x, w, sa, sb, offs), "plain")
    cfg = cute(schedule="cooperative", tile_m=128, tile_n=128)
    # a narrow output: the default 128x48 tile spans two 128-column scale blocks
    x, w, sa, sb, offs = make_fp8_moe_inputs(300, 4, 640, 40, "block", device=DEV, seed=24)
    plain, other = _plain_and(monkeypatch, lambda: scaled_grouped_mm(x, w, sa, sb, offs), loop)
    assert launch_info.last_launch().choice.tile_n == 48
    check(f"fp8/{loop}/narrow", other, scaled_grouped_mm_ref(x, w, sa, sb, offs))
    assert torch.equal(other, plain)
    xb, wb, sab, sbb = make_fp8_batched_inputs(5, 100, 384, 264, "block", device=DEV, seed=22)
    plain, other = _plain_and(
        monkeypatch, lambda: scaled_grouped_mm(xb, wb, sab, sbb, config=cfg), loop)
    check(f"fp8/{loop}/batched", other, scaled_grouped_mm_ref(xb, wb, sab, sbb))
    assert torch.equal(other, plain)
    if loop == "smem":
        # Staged from A scales whose problems are not a multiple of 4 rows (the launch lays
        # them out padded) and from the token-major layout the quantizer gives, as it is.
        xb, wb, sab, sbb = make_fp8_batched_inputs(3, 37, 512, 136, "block", device=DEV,
                                                   seed=25)
        plain, other = _plain_and(
            monkeypatch, lambda: scaled_grouped_mm(xb, wb, sab, sbb, config=cfg), loop)
        check(f"fp8/{loop}/batched-odd-rows", other, scaled_grouped_mm_ref(xb, wb, sab, sbb))
        assert torch.equal(other, plain)
        tm = token_major_scales(3 * 40, 4, DEV).view(3, 40, 4)[:, :37]
        tm.copy_(sab)
        assert tm.stride(1) == 1
        monkeypatch.setenv(SMEM_SCALES_ENV, "1")  # (_plain_and cleared it; the depth is 1)
        again = scaled_grouped_mm(xb, wb, tm, sbb, config=cfg)
        assert launch_info.last_launch().choice.smem_scales
        assert torch.equal(again, other)
        return  # (general's per-problem scales have no TMA descriptor: not staged)
    a, b, ga, gb = make_fp8_grouped_inputs([(100, 264, 384), (37, 136, 256), (0, 64, 128)],
                                           "block", device=DEV, seed=23)
    plain, other = _plain_and(
        monkeypatch, lambda: scaled_grouped_gemm(a, b, ga, gb, config=cfg), loop)
    for i, (p, q, r) in enumerate(zip(plain, other, scaled_grouped_gemm_ref(a, b, ga, gb))):
        check(f"fp8/{loop}/general/{i}", q, r)
        assert torch.equal(p, q)


def _each_value(monkeypatch, env, values, run, expect):
    """run() with `env` at each of `values`: {value: output}; expect(value, choice) checks
    the kernel each launched."""
    outs = {}
    for value in values:
        monkeypatch.setenv(env, value)
        outs[value] = run()
        expect(value, launch_info.last_launch().choice)
    return outs


def _bit_for_bit(name, new, base, ref, end, what):
    """new (poisoned first) against the fp64 reference and bit for bit against base (the
    `what` it must equal) up to row `end`; rows past it untouched."""
    check(name, new[:end], ref[:end])
    same = torch.equal(new[:end], base[:end])
    record(f"{name}/equals-{what}", same)
    assert same, f"{name}: differs from the {what}"
    assert bool(torch.isnan(new[end:].float()).all()), f"{name}: rows past offs written"


def _close_under_the_split(name, new, base, ref, what):
    """A tail-split launch against the reference and within 1% of max|base| of base (the
    split's parts add in any order)."""
    check(name, new, ref)
    diff = float((new.float() - base.float()).abs().max())
    bound = 1e-2 * float(base.float().abs().max())
    record(f"{name}-vs-{what}", diff <= bound, max_abs_diff=diff)
    assert diff <= bound


def _loop_inputs(g, K, seed):
    """700 rows over 6 experts (some empty), 650 routed, N = 392: the loop tests' operands."""
    return make_fp8_moe_inputs(700, 6, K, 392, g, device=DEV, empty_fraction=0.3, total=650,
                               seed=seed)


def _poisoned_run(x, w, sa, sb, offs, cfg):
    return lambda: scaled_grouped_mm(x, w, sa, sb, offs, config=cfg,
                                     out=poison_(torch.empty(700, 392, dtype=BF16, device=DEV)))


# Probed stage waits (MOE_GEMM_FP8_PEEK_WAIT, the default) against waits in full, in every
# stage loop: only the waits differ, so the outputs are bit for bit equal. 1, 3 and 7 stages
# (the lagged loop's pairs of both parities; the ring's remainders), empty experts.
@pytest.mark.parametrize("K", [128, 384, 896])
@pytest.mark.parametrize("case", PEEK_CASES,
                         ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}-{c[3][0]}x{c[3][1]}-c{c[4]}x{c[5]}")
def test_probed_waits_equal_full_waits(monkeypatch, case, K):
    loop, g, sched, tile, cm, cn = case
    cfg = cute(schedule=sched, tile_m=tile[0], tile_n=tile[1], cluster_m=cm, cluster_n=cn,
               tail_split=False)
    x, w, sa, sb, offs = _loop_inputs(g, K, 31 + K)
    for name, value in PEEK_LOOP_ENV[loop].items():
        monkeypatch.setenv(name, value)

    def expect(peek, choice):
        assert choice.peek_wait == (peek == "1")
        assert choice.smem_scales == (loop == "staged" and g == "block")
        assert choice.promote_lag == (loop in ("staged", "lagged") and g == "block")

    outs = _each_value(monkeypatch, PEEK_WAIT_FP8_ENV, ("0", "1"),
                       _poisoned_run(x, w, sa, sb, offs, cfg), expect)
    _bit_for_bit(f"fp8/peek/{loop}-{g}-{sched}-{tile[0]}x{tile[1]}-c{cm}x{cn}/K={K}",
                 outs["1"], outs["0"], scaled_grouped_mm_ref(x, w, sa, sb, offs),
                 int(offs[-1]), "full-waits")


def _tail_split_each_way(monkeypatch, name, env, values, expect, seed, what):
    """The long-K tail-split case (each CTA's K range starts mid-way) with `env` at each of
    `values` (base, new): new against the reference and within the split's bound of base."""
    x, w, sa, sb, offs = make_fp8_moe_inputs(2400, 8, 4096, 1024, "block", device=DEV,
                                             seed=seed)
    cfg = cute(schedule="cooperative", tile_m=128, tile_n=128, tail_split=True)
    outs = _each_value(monkeypatch, env, values,
                       lambda: scaled_grouped_mm(x, w, sa, sb, offs, config=cfg), expect)
    _close_under_the_split(name, outs[values[1]], outs[values[0]],
                           scaled_grouped_mm_ref(x, w, sa, sb, offs), what)


def test_probed_waits_with_the_tail_split_long_k(monkeypatch):
    def expect(peek, choice):
        assert choice.tail_split and choice.peek_wait == (peek == "1")

    _tail_split_each_way(monkeypatch, "fp8/peek/tail-split", PEEK_WAIT_FP8_ENV, ("0", "1"),
                         expect, 33, "full-waits")


# A cooperative 128-row tile's second warpgroup idle where its 64 rows are all past the
# expert's end (MOE_GEMM_FP8_HALF_SKIP=1) against the whole tile computed (the default): those
# rows are never stored, so the outputs are bit for bit equal. Experts whose last tiles hold
# 1, 2, 44 and 64 rows (skipped) and 65, 72 and 127 (not), an empty one, rows past offs
# untouched; each stage loop, clusters both ways, a two-block tile, row-wise scales.
@pytest.mark.parametrize("K", [128, 896])
@pytest.mark.parametrize("case", HALF_SKIP_CASES,
                         ids=lambda c: f"{c[0]}-{c[1]}-128x{c[2]}-c{c[3]}x{c[4]}")
def test_skipped_empty_halves_equal_the_whole_tile(monkeypatch, case, K):
    loop, g, tile_n, cm, cn = case
    cfg = cute(schedule="cooperative", tile_m=128, tile_n=tile_n, cluster_m=cm, cluster_n=cn,
               tail_split=False)
    x, w, sa, sb, _ = make_fp8_moe_inputs(1200, len(HALF_SKIP_COUNTS), K, 392, g,
                                          device=DEV, seed=51 + K)
    offs = torch.tensor(HALF_SKIP_COUNTS).cumsum(0).to(torch.int32).to(DEV)
    for name, value in PEEK_LOOP_ENV[loop].items():
        monkeypatch.setenv(name, value)

    def expect(skip, choice):
        assert choice.skip_empty_half == (skip == "1")

    run = lambda: scaled_grouped_mm(  # noqa: E731
        x, w, sa, sb, offs, config=cfg,
        out=poison_(torch.empty(1200, 392, dtype=BF16, device=DEV)))
    outs = _each_value(monkeypatch, HALF_SKIP_ENV, ("0", "1"), run, expect)
    _bit_for_bit(f"fp8/half-skip/{loop}-{g}-128x{tile_n}-c{cm}x{cn}/K={K}", outs["1"],
                 outs["0"], scaled_grouped_mm_ref(x, w, sa, sb, offs), int(offs[-1]),
                 "whole-tile")


def test_skipped_empty_halves_batched_and_tail_split(monkeypatch):
    """The batched form (problems of 190 rows: a last tile of 62) with its default tile, and
    the long-K tail split, each with and without the skip."""
    x, w, sa, sb = make_fp8_batched_inputs(3, 190, 384, 264, "block", device=DEV, seed=52)

    def expect(skip, choice):
        assert choice.skip_empty_half == (skip == "1")

    outs = _each_value(monkeypatch, HALF_SKIP_ENV, ("0", "1"),
                       lambda: scaled_grouped_mm(x, w, sa, sb, config=cute()), expect)
    check("fp8/half-skip/batched", outs["1"], scaled_grouped_mm_ref(x, w, sa, sb))
    same = torch.equal(outs["1"], outs["0"])
    record("fp8/half-skip/batched/equals-whole-tile", same)
    assert same

    def expect_split(skip, choice):
        assert choice.tail_split and choice.skip_empty_half == (skip == "1")

    _tail_split_each_way(monkeypatch, "fp8/half-skip/tail-split", HALF_SKIP_ENV, ("0", "1"),
                         expect_split, 53, "whole-tile")


# Staged scales promoted in the plain loop (MOE_GEMM_FP8_PROMOTE_LAG=0: two accumulators)
# against the lagged loop (the default): the same FMAs in the same order, so bit for bit equal;
# 1 to 7 stages, empty experts, rows past offs untouched; and with the tail split on long K.
@pytest.mark.parametrize("K", [128, 256, 384, 640, 896])
@pytest.mark.parametrize("case", STAGED_PLAIN_CASES,
                         ids=lambda c: f"{c[0]}-{c[1][0]}x{c[1][1]}-c{c[2]}x{c[3]}")
def test_staged_scales_in_the_plain_loop_equal_the_lagged_loop(monkeypatch, case, K):
    sched, tile, cm, cn = case
    cfg = cute(schedule=sched, tile_m=tile[0], tile_n=tile[1], cluster_m=cm, cluster_n=cn,
               tail_split=False)
    x, w, sa, sb, offs = _loop_inputs("block", K, 41 + K)

    def expect(lag, choice):
        assert choice.smem_scales and choice.promote_lag == (lag == "")

    outs = _each_value(monkeypatch, PROMOTE_LAG_ENV, ("", "0"),
                       _poisoned_run(x, w, sa, sb, offs, cfg), expect)
    _bit_for_bit(f"fp8/staged-plain/{sched}-{tile[0]}x{tile[1]}-c{cm}x{cn}/K={K}",
                 outs["0"], outs[""], scaled_grouped_mm_ref(x, w, sa, sb, offs),
                 int(offs[-1]), "lagged")


def test_staged_scales_in_the_plain_loop_with_the_tail_split(monkeypatch):
    def expect(lag, choice):
        assert choice.tail_split and choice.smem_scales and choice.promote_lag == (lag == "")

    _tail_split_each_way(monkeypatch, "fp8/staged-plain/tail-split", PROMOTE_LAG_ENV, ("", "0"),
                         expect, 43, "lagged")


# Scale layouts the staged-scale kernel's TMA loads take as they are (M-major A scales with
# 16-byte aligned columns, k-block-major B scales with K / 128 a multiple of 4) and ones the
# launch copies first (row-major A scales, an unaligned column pitch, K / 128 = 5); T = 701 so
# the last tile's A-scale box runs past T.
@pytest.mark.parametrize("a_layout", ["row-major", "m-major", "m-major-unaligned"])
@pytest.mark.parametrize("K", [512, 640])
def test_staged_scale_layouts(monkeypatch, a_layout, K):
    x, w, sa, sb, offs = make_fp8_moe_inputs(701, 5, K, 392, "block", device=DEV,
                                             empty_fraction=0.2, total=690, seed=K)
    T, KB = sa.shape
    if a_layout != "row-major":
        ld = T + 3 if a_layout == "m-major" else T + 2  # 704: aligned; 703: not
        sa = torch.empty(KB, ld, device=DEV)[:, :T].copy_(sa.t()).t()
    end = int(offs[-1])

    def run():
        return scaled_grouped_mm(x, w, sa, sb, offs, config=cute(tail_split=False))

    plain, other = _plain_and(monkeypatch, run, "smem")
    name = f"fp8/smem/layouts/{a_layout}/K={K}"
    check(name, other[:end], scaled_grouped_mm_ref(x, w, sa, sb, offs)[:end])
    assert torch.equal(other[:end], plain[:end]), f"{name}: differs from the plain loop"


@pytest.mark.parametrize("K", [7168, 14336])
@pytest.mark.parametrize("granularity", ["block", "row"])
def test_long_k_accuracy(K, granularity):
    """fp32 output, so the error is the kernel's own: the promotion every 128 of K keeps it at
    fp32-accumulation level (DeepGEMM-class: well under 1e-3 relative)."""
    run_mm(f"fp8/long-k/K={K}/{granularity}", 512, 4, K, 256, granularity, None, "alloc",
           empty=0.0, seed=5, out_dtype=FP32)


@pytest.mark.parametrize("N", [16, 40, 104])
@pytest.mark.parametrize("rows", [4, 300])
@pytest.mark.parametrize("granularity", ["block", "row"])
def test_narrow_outputs_take_their_own_tiles(N, rows, granularity):
    """N < 128: the default tile is the narrowest multiple of 16 that covers N (16, 48, 112:
    tiles outside the 16-bit kernel's tile sets), ping-pong 64-row at a few rows per expert and
    cooperative 128-row beyond; each against the fp64 reference."""
    E = 8
    run_mm(f"fp8/narrow-N/N={N}/rows={rows}/{granularity}", rows * E, E, 256, N, granularity,
           cute(), "alloc", empty=0.0, seed=N + rows)
    c = launch_info.last_launch().choice
    assert c.tile_n == max(16, -(-N // 16) * 16)
    assert (c.schedule, c.tile_m) == (("pingpong", 64) if rows <= 64 else ("cooperative", 128))


@pytest.mark.parametrize("schedule", ["cooperative", "pingpong"])
def test_edge_rows_and_single_rows(schedule):
    # Experts of 1, 63, 64, 65, 127, 128, 129, 0, 191, 193 rows: every side of the 64-row
    # line of a tile and of the tile itself; then T = 1.
    counts = [1, 63, 64, 65, 127, 128, 129, 0, 191, 193]
    T = sum(counts) + 7
    x, w, sa, sb, offs = make_fp8_moe_inputs(T, len(counts), 256, 136, "block", device=DEV,
                                             seed=6)
    offs.copy_(torch.tensor(counts, device=DEV).cumsum(0).to(torch.int32))
    y = scaled_grouped_mm(x, w, sa, sb, offs, config=cute(schedule=schedule))
    check(f"fp8/edge-rows/{schedule}", y, scaled_grouped_mm_ref(x, w, sa, sb, offs))
    run_mm(f"fp8/M=1/{schedule}", 1, 4, 256, 136, "block", cute(schedule=schedule), "alloc",
           empty=0.0, seed=7)


def test_decode_and_prefill_defaults():
    """The default choices on the issue's shapes: E=256 decode routing (~8 rows per expert,
    N=512 K=7168) and a DeepSeek-V3 EP-shard prefill slice (E=8 local experts, 8k rows)."""
    run_mm("fp8/default/decode-E256", 2048, 256, 7168, 512, "block", None, "alloc", empty=0.0,
           seed=8, skew=1.0)
    run_mm("fp8/default/prefill-E8", 8192, 8, 7168, 2048, "block", None, "given", empty=0.0,
           seed=9)


def test_out_dtypes_and_e5m2():
    for odt in (BF16, FP16, FP32):
        run_mm(f"fp8/out={odt}", 600, 5, 256, 200, "block", None, "alloc", seed=10,
               out_dtype=odt)
    run_mm("fp8/e5m2/block", 600, 5, 256, 200, "block", None, "given", seed=11, fp8=E5M2)
    run_mm("fp8/e5m2/row", 600, 5, 256, 200, "row", None, "alloc", seed=12, fp8=E5M2)


def test_bad_offs_never_write_outside_out():
    T, N = 300, 64
    x, w, sa, sb, offs = make_fp8_moe_inputs(T, 4, 256, N, "block", device=DEV, seed=13)
    buf = poison_(torch.empty(T + 256, N, dtype=BF16, device=DEV))
    out = buf[128:128 + T]
    for bad in ([-7, T + 50, 3, T + 1000], [5, 2, 2**31 - 1, -2**31], [T, T, T, T]):
        offs.copy_(torch.tensor(bad, dtype=torch.int32, device=DEV))
        scaled_grouped_mm(x, w, sa, sb, offs, out=out, config=cute())
        torch.cuda.synchronize()
        intact = bool(torch.isnan(buf[:128].float()).all() and
                      torch.isnan(buf[128 + T:].float()).all())
        record(f"fp8/bad-offs/{bad}", intact)
        assert intact, f"bad offs {bad} wrote outside out"
        y = scaled_grouped_mm(x, w, sa, sb, offs, config=cute())
        assert bool(torch.isfinite(y.float()).all())


def test_cuda_graph_replay_and_no_host_sync():
    E, T, K, N = 16, 512, 512, 256
    x, w, sa, sb, offs = make_fp8_moe_inputs(T, E, K, N, "block", device=DEV, seed=14)
    cfg = cute()
    scaled_grouped_mm(x, w, sa, sb, offs, config=cfg)  # compile + plan outside capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a synchronising call raises
    try:
        scaled_grouped_mm(x, w, sa, sb, offs, config=cfg)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    record("fp8/no-host-sync", True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = scaled_grouped_mm(x, w, sa, sb, offs, config=cfg)
    for trial in range(3):
        x2, _, sa2, _, offs2 = make_fp8_moe_inputs(T, E, K, N, "block", device=DEV,
                                                   seed=100 + trial, empty_fraction=0.3)
        x.copy_(x2)
        sa.copy_(sa2)
        offs.copy_(offs2)
        graph.replay()
        torch.cuda.synchronize()
        check(f"fp8/cuda-graph/replay{trial}", y, scaled_grouped_mm_ref(x, w, sa, sb, offs))


def test_deterministic():
    x, w, sa, sb, offs = make_fp8_moe_inputs(3000, 16, 2048, 512, "block", device=DEV, seed=15)
    a = scaled_grouped_mm(x, w, sa, sb, offs, config=cute())
    b = scaled_grouped_mm(x, w, sa, sb, offs, config=cute())
    same = bool(torch.equal(a, b))
    record("fp8/deterministic", same)
    assert same


# ---------------------------------------------------------------------------------------------
# batched and general


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_batched(granularity):
    x, w, sa, sb = make_fp8_batched_inputs(12, 200, 384, 264, granularity, device=DEV, seed=16)
    out = poison_(torch.empty(12, 200, 264, dtype=BF16, device=DEV))
    y = scaled_grouped_mm(x, w, sa, sb, out=out, config=cute())
    check(f"fp8/batched/{granularity}", y, scaled_grouped_mm_ref(x, w, sa, sb))


def test_compute_bound_batched_runs_the_varlen_kernel():
    """A batched block-scaled call of BATCHED_AS_VARLEN_MIN_ROWS rows a problem launches the
    varlen kernel on x's rows: close to the reference and bit for bit the varlen call on the
    same rows with an expert every M rows; a given out is written in place."""
    from moe_gemm.ops.scaled_launch import BATCHED_AS_VARLEN_MIN_ROWS as M

    G, K, N = 2, 512, 264
    x, w, sa, sb = make_fp8_batched_inputs(G, M, K, N, "block", device=DEV, seed=41)
    out = poison_(torch.empty(G, M, N, dtype=BF16, device=DEV))
    y = scaled_grouped_mm(x, w, sa, sb, out=out)
    assert y.data_ptr() == out.data_ptr()
    assert launch_info.last_launch().choice.smem_scales  # (the varlen default's staging)
    check("fp8/batched-as-varlen", y, scaled_grouped_mm_ref(x, w, sa, sb))
    offs = torch.arange(M, G * M + 1, M, dtype=torch.int32, device=DEV)
    v = scaled_grouped_mm(x.view(G * M, K), w, sa.reshape(G * M, -1), sb, offs)
    assert torch.equal(y.view(G * M, N), v)
    assert torch.equal(scaled_grouped_mm(x, w, sa, sb), y)  # the cached plan, out allocated


def test_batched_decode_headline():
    """256 x (128 x 512 x 7168), each problem its own weights: the FP8 decode headline."""
    x, w, sa, sb = make_fp8_batched_inputs(256, 128, 7168, 512, "block", device=DEV, seed=17)
    y = scaled_grouped_mm(x, w, sa, sb)
    c = launch_info.last_launch().choice
    check("fp8/batched/headline-256x128x512x7168", y, scaled_grouped_mm_ref(x, w, sa, sb),
          tile=f"{c.schedule} {c.tile_m}x{c.tile_n}")
    # M = 1 problems.
    x, w, sa, sb = make_fp8_batched_inputs(64, 1, 1024, 256, "row", device=DEV, seed=18)
    check("fp8/batched/M=1", scaled_grouped_mm(x, w, sa, sb, config=cute()),
          scaled_grouped_mm_ref(x, w, sa, sb))


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("out_mode", ["alloc", "given"])
def test_general(granularity, out_mode):
    sizes = [(300, 256, 512), (0, 128, 256), (1, 64, 128), (129, 520, 384), (64, 16, 1024),
             (77, 200, 128), (5, 48, 0 if granularity != "block" else 128)]
    a, b, sa, sb = make_fp8_grouped_inputs(sizes, granularity, device=DEV, seed=19)
    refs = scaled_grouped_gemm_ref(a, b, sa, sb)
    if out_mode == "given":
        outs = [poison_(torch.empty(m, n, dtype=FP16, device=DEV)) for m, n, _ in sizes]
        res = scaled_grouped_gemm(a, b, sa, sb, out=outs, config=cute())
        assert all(r is o for r, o in zip(res, outs))
    else:
        res = scaled_grouped_gemm(a, b, sa, sb, config=cute())
    for i, (r, ref) in enumerate(zip(res, refs)):
        check(f"fp8/general/{granularity}/{out_mode}/{i}", r, ref)


def test_block_scales_in_any_layout_and_past_32_bit_offsets():
    """Block scales as our quantizers do not lay them out: A's MN-major (the transpose of a
    (KB, T) tensor: torch's blockwise layout on Hopper), B's (E, KB, C) compact; A's as a view
    whose element offsets pass 2^31 (rows ~7M elements apart in an 8 GiB tensor: the kernel's
    scale addresses are 64-bit); the general form with MN-major A scales per problem."""
    T, E, K, N = 300, 4, 512, 384
    x, w, sa, sb, offs = make_fp8_moe_inputs(T, E, K, N, "block", device=DEV,
                                             empty_fraction=0.25, seed=31)
    ref = scaled_grouped_mm_ref(x, w, sa, sb, offs)
    sa_mn, sb_c = sa.t().contiguous().t(), sb.contiguous()
    assert sa_mn.stride() == (1, T) and sb_c.stride() != sb.stride()
    check("fp8/scale-layouts/varlen-mn-major", scaled_grouped_mm(x, w, sa_mn, sb_c, offs,
                                                                 config=cute()), ref)
    KB = K // 128
    stride = 2**31 // (T - 1) + 1
    base = torch.empty((T - 1) * stride + KB, device=DEV)
    far = base.as_strided((T, KB), (stride, 1))
    far.copy_(sa)
    y = scaled_grouped_mm(x, w, far, sb, offs, config=cute())
    check("fp8/scale-layouts/varlen-past-2^31", y, ref, row_stride=stride)
    del base, far
    sizes = [(129, 256, 384), (0, 128, 256), (7, 200, 128), (64, 64, 640)]
    a, b, sal, sbl = make_fp8_grouped_inputs(sizes, "block", device=DEV, seed=32)
    refs = scaled_grouped_gemm_ref(a, b, sal, sbl)
    res = scaled_grouped_gemm(a, b, [s.t().contiguous().t() for s in sal], sbl, config=cute())
    for i, (r, ref_i) in enumerate(zip(res, refs)):
        check(f"fp8/scale-layouts/general-mn-major/{i}", r, ref_i)


# ---------------------------------------------------------------------------------------------
# the 1x128 quantization kernel


@pytest.mark.parametrize("src", [BF16, FP16, FP32])
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_quantize_kernel_matches_torch_bit_for_bit(src, fp8):
    gen = torch.Generator(device=DEV).manual_seed(20)
    for T, K in ((1, 128), (777, 7168), (64, 2048)):
        x = (torch.randn(T, K, generator=gen, device=DEV)
             * 10.0 ** torch.randint(-3, 4, (T, 1), generator=gen, device=DEV)).to(src)
        x[0, :128] = 0  # an all-zero group
        assert _kernel_ok(x)  # the DSL kernel, not the torch formula, runs below
        qt, st = _per_token_group_torch(x, 128, fp8)
        for column_major in (False, True):  # the scales row- or token-major in memory
            q, s = quantize_fp8_per_token_group(x, dtype=fp8, column_major_scales=column_major)
            if K > 128:  # (one group per token: both layouts have stride 1 there)
                assert (s.stride(0) == 1) == column_major
            same = bool(torch.equal(q.view(torch.uint8), qt.view(torch.uint8))
                        and torch.equal(s, st))
            record(f"fp8/quantize/{src}->{fp8}/T={T},K={K}/column-major={column_major}", same)
            assert same, (f"kernel and torch quantization differ ({src} -> {fp8}, {T}x{K}, "
                          f"column_major_scales={column_major})")
    # A strided view (rows of a wider tensor) and 3-D input.
    wide = torch.randn(33, 1024 + 256, generator=gen, device=DEV).to(src)
    q, s = quantize_fp8_per_token_group(wide[:, 256:], dtype=fp8)
    qt, st = _per_token_group_torch(wide[:, 256:], 128, fp8)
    assert torch.equal(q.view(torch.uint8), qt.view(torch.uint8)) and torch.equal(s, st)
    x3 = torch.randn(2, 5, 384, generator=gen, device=DEV).to(src)
    q, s = quantize_fp8_per_token_group(x3, dtype=fp8)
    assert q.shape == x3.shape and s.shape == (2, 5, 3)
