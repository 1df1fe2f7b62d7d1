"""GPU tests of the general form (grouped_gemm's lists of independent problems).

Every case draws fresh random data, poisons the outputs with NaN before the launch (so an
unwritten element fails), and compares with a float32 reference by the 2x rule (helpers.py).
"""

from __future__ import annotations

import random

import pytest
import torch

import moe_gemm
from moe_gemm import GemmConfig

from .gpu_report import record
from .helpers import DTYPES, SCHEDULES, VISITORS, check, general_case, rand, run_general

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kind", ["mixed", "many", "one", "kvary"])
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("visitor", VISITORS)
@pytest.mark.parametrize("sort_by_k", [False, True])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_general_matrix(kind, schedule, visitor, sort_by_k, dtype):
    rng = random.Random(7)
    sizes = general_case(kind, rng)
    cfg = GemmConfig(backend="cute", schedule=schedule, visitor=visitor, sort_by_k=sort_by_k)
    subset = None if len(sizes) < 64 else rng.sample(range(len(sizes)), 48)
    run_general(f"general/{kind}/{schedule}/{visitor}/sort={sort_by_k}/{dtype}", sizes,
                DTYPES[dtype], "col" if kind != "many" else "row", cfg, check_subset=subset)


@pytest.mark.parametrize("b_layout", ["row", "col"])
@pytest.mark.parametrize("out_dtype", [torch.float32, None])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_general_layouts_and_out_dtype(b_layout, out_dtype, schedule):
    sizes = general_case("mixed", random.Random(3))
    cfg = GemmConfig(backend="cute", schedule=schedule)
    run_general(f"general/layout={b_layout}/out={out_dtype}/{schedule}", sizes, torch.bfloat16,
                b_layout, cfg, out_dtype=out_dtype)


@pytest.mark.parametrize("tile", [(64, 128), (64, 256), (128, 64), (128, 192)])
def test_general_pingpong_tiles(tile):
    sizes = general_case("mixed", random.Random(5))
    cfg = GemmConfig(backend="cute", schedule="pingpong", tile_m=tile[0], tile_n=tile[1])
    run_general(f"general/pingpong-tile={tile}", sizes, torch.bfloat16, "col", cfg)


@pytest.mark.parametrize("tile", [(128, 64), (128, 128), (128, 192)])
def test_general_cooperative_tiles(tile):
    sizes = general_case("mixed", random.Random(5))
    cfg = GemmConfig(backend="cute", schedule="cooperative", tile_m=tile[0], tile_n=tile[1])
    run_general(f"general/cooperative-tile={tile}", sizes, torch.bfloat16, "row", cfg)


@pytest.mark.parametrize("config", [None, GemmConfig(backend="cute", schedule="cooperative")],
                         ids=["default", "cooperative"])
def test_headline(config):
    sizes = general_case("headline", random.Random(1))
    name = "headline/" + ("default" if config is None else config.schedule)
    run_general(name, sizes, torch.bfloat16, "col", config,
                check_subset=random.Random(2).sample(range(256), 24))


def test_default_picks_cute():
    from moe_gemm.ops.launch_info import last_launch

    a = [torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)]
    b = [torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)]
    moe_gemm.grouped_gemm(a, b)
    info = last_launch()
    record("default_picks_cute", info is not None)
    assert info is not None


# ---------------------------------------------------------------------------------------------
# grouped_gemm without `out` (the one-pass host path, ops/support.fast_general): our outputs
# are views of one allocation.


@pytest.mark.parametrize("kind", ["mixed", "kvary", "mixed-majors", "tuple"])
@pytest.mark.parametrize("config", [None, GemmConfig(backend="cute", schedule="pingpong")],
                         ids=["default", "pingpong"])
def test_general_fast_path_without_out(kind, config):
    from moe_gemm.ops.launch_info import last_launch

    rng = random.Random(7)
    sizes = general_case("mixed" if kind in ("mixed-majors", "tuple") else kind, rng)
    gen = torch.Generator(device="cuda").manual_seed(77)
    a = [rand((m, k), torch.bfloat16, gen) for m, n, k in sizes]
    b = []
    for i, (m, n, k) in enumerate(sizes):
        if kind == "mixed-majors" and i % 3 == 0:
            b.append(rand((n, k), torch.bfloat16, gen).t())  # minority layout: copied
        else:
            b.append(rand((k, n), torch.bfloat16, gen))
    if kind == "tuple":
        a, b = tuple(a), tuple(b)
    before = last_launch()
    res = moe_gemm.grouped_gemm(a, b, config=config)
    torch.cuda.synchronize()
    assert last_launch() is not before  # the kernel ran
    for i, (ai, bi) in enumerate(zip(a, b)):
        ref = ai.float() @ bi.float()
        low = (ai @ bi) if ai.shape[1] > 0 else torch.zeros_like(ref).to(torch.bfloat16)
        assert res[i].shape == (ai.shape[0], bi.shape[1]) and res[i].dtype == torch.bfloat16
        check(f"general/fast/{kind}/{'default' if config is None else 'pingpong'}[{i}]",
              res[i], ref, low)


@pytest.mark.parametrize("seed", range(3))
def test_general_fast_path_random_sets(seed):
    """Fresh random problem sets (empty, M=1, K=0, sizes off the tiles, K-major B for odd
    seeds) through grouped_gemm without `out` match the float32 reference, and a repeated
    call (the cached metadata upload) gives the same bits."""
    rng = random.Random(seed)
    sizes = [(rng.choice([0, 1, 7, 64, 130, 300]), 8 * rng.randint(1, 48),
              rng.choice([0, 8, 72, 520, 2056])) for _ in range(rng.randint(3, 20))]
    gen = torch.Generator(device="cuda").manual_seed(300 + seed)
    a = [rand((m, k), torch.bfloat16, gen) for m, n, k in sizes]
    if seed % 2:
        b = [rand((n, k), torch.bfloat16, gen).t() for m, n, k in sizes]
    else:
        b = [rand((k, n), torch.bfloat16, gen) for m, n, k in sizes]
    res = moe_gemm.grouped_gemm(a, b)
    torch.cuda.synchronize()
    for i, (ai, bi) in enumerate(zip(a, b)):
        assert res[i].shape == (ai.shape[0], bi.shape[1])
        ref = ai.float() @ bi.float()
        low = (ai @ bi) if ai.shape[1] else torch.zeros_like(ref).to(torch.bfloat16)
        check(f"general/random-set/{seed}[{i}]", res[i], ref, low, size=sizes[i])
    repeat = moe_gemm.grouped_gemm(a, b)
    torch.cuda.synchronize()
    same = all(torch.equal(x, y) for x, y in zip(res, repeat))
    record(f"general/random-set/{seed}/repeat-bitwise", same)
    assert same
