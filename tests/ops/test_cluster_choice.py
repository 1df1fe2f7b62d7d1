"""Thread-block clusters (2x1, 1x2): where the heuristics pick or honour them and where they
refuse them."""

from __future__ import annotations

import pytest

from moe_gemm import GemmConfig, grouped_gemm
from moe_gemm.ops.heuristics import choose_batched, choose_general, choose_varlen

C2 = {"cluster_m": 2, "cluster_n": 1}


def test_varlen_honours_2x1_and_forces_cooperative_device() -> None:
    # A decode-like shape would pick ping-pong; a pinned 2x1 cluster needs cooperative.
    c = choose_varlen(GemmConfig(**C2), 64, 16, 512, 7168, 132)
    assert (c.cluster_m, c.schedule, c.visitor) == (2, "cooperative", "device")
    assert choose_varlen(GemmConfig(), 16384, 8, 14336, 4096, 132).cluster_m == 1


def test_batched_honours_2x1() -> None:
    c = choose_batched(GemmConfig(**C2), 4, 512, 768, 128, 132)
    assert (c.cluster_m, c.schedule) == (2, "cooperative")
    assert choose_batched(GemmConfig(), 4, 512, 768, 128, 132).cluster_m == 1


def test_general_form_honours_a_pinned_cluster() -> None:
    # A short-K, narrow set would pick ping-pong; a pinned cluster needs cooperative and the
    # device visitor.
    for cm, cn in ((2, 1), (1, 2)):
        c = choose_general(GemmConfig(cluster_m=cm, cluster_n=cn), ((128, 128, 64),), 132)
        assert (c.cluster_m, c.cluster_n, c.schedule, c.visitor) == (cm, cn, "cooperative",
                                                                     "device")
    c = choose_general(GemmConfig(cluster_m=1, cluster_n=1), ((128, 512, 7168),) * 256, 132)
    assert (c.cluster_m, c.cluster_n) == (1, 1)


def test_general_form_picks_1x2_where_pairs_fill() -> None:
    # The uniform headline as lists: two n-tiles per problem, cooperative 128x256.
    c = choose_general(GemmConfig(), ((128, 512, 7168),) * 256, 132)
    assert (c.schedule, c.tile_n, c.cluster_m, c.cluster_n, c.visitor) == (
        "cooperative", 256, 1, 2, "device")
    # One n-tile per problem: the pair's second CTA would idle on every tile.
    assert choose_general(GemmConfig(), ((128, 256, 7168),) * 64, 132).cluster_n == 1
    # Three n-tiles: a third of the work idles.
    assert choose_general(GemmConfig(), ((128, 768, 7168),) * 64, 132).cluster_n == 1
    # Mostly pairs, one odd problem in 40: within PAIR_IDLE_MAX.
    sizes = ((256, 1024, 4096),) * 39 + ((256, 768, 4096),)
    assert choose_general(GemmConfig(), sizes, 132).cluster_n == 2
    # Short K sets go ping-pong (k-varying): no cluster; the host visitor: no cluster.
    assert choose_general(GemmConfig(), ((1152, 768, 128),) * 64, 132).cluster_n == 1
    assert choose_general(GemmConfig(visitor="host"), ((128, 512, 7168),) * 256,
                          132).cluster_n == 1
    # Empty problems count for nothing; a set of only empty problems picks no cluster.
    assert choose_general(GemmConfig(), ((0, 512, 7168),) * 4, 132).cluster_n == 1
    assert choose_general(GemmConfig(), ((0, 256, 64),) + ((128, 512, 7168),) * 64,
                          132).cluster_n == 2


def test_grouped_gemm_torch_backend_ignores_cluster_choice() -> None:
    import torch

    a = [torch.randn(4, 8)]
    b = [torch.randn(8, 16)]
    out = grouped_gemm(a, b, config=GemmConfig(backend="torch", **C2))
    torch.testing.assert_close(out[0], a[0] @ b[0])


def test_1x2_cluster_choice() -> None:
    c = choose_batched(GemmConfig(cluster_m=1, cluster_n=2), 256, 128, 512, 7168, 132)
    assert (c.cluster_m, c.cluster_n, c.schedule) == (1, 2, "cooperative")
    v = choose_varlen(GemmConfig(cluster_m=1, cluster_n=2), 4096, 8, 1024, 512, 132)
    assert (v.cluster_m, v.cluster_n, v.visitor) == (1, 2, "device")


@pytest.mark.parametrize("cluster", [(2, 1), (1, 2)])
def test_pingpong_cluster_is_honoured(cluster) -> None:
    # The kernel builds 2x1 / 1x2 clusters for the ping-pong schedule too: a pinned pair is
    # kept in every form (device visitor).
    cfg = GemmConfig(schedule="pingpong", cluster_m=cluster[0], cluster_n=cluster[1])
    for c in (choose_varlen(cfg, 4096, 8, 1024, 512, 132),
              choose_batched(cfg, 8, 512, 768, 256, 132),
              choose_general(cfg, ((256, 512, 1024),) * 8, 132)):
        assert (c.schedule, c.cluster_m, c.cluster_n, c.visitor) == (
            "pingpong", *cluster, "device")


def test_batched_headline_defaults_to_1x2() -> None:
    c = choose_batched(GemmConfig(), 256, 128, 512, 7168, 132)
    assert (c.schedule, c.tile_m, c.tile_n, c.stages) == ("cooperative", 128, 256, 3)
    assert (c.cluster_m, c.cluster_n) == (1, 2)
    # One n-tile: nothing to pair; a pinned 1x1 is honoured.
    assert choose_batched(GemmConfig(), 8, 512, 256, 7168, 132).cluster_n == 1
    pinned = choose_batched(GemmConfig(cluster_m=1, cluster_n=1), 256, 128, 512, 7168, 132)
    assert (pinned.cluster_m, pinned.cluster_n) == (1, 1)


def test_whole_tile_epilogue_choice() -> None:
    # Long K, 16-bit output: the whole-tile epilogue with 3 stages (mixtral, moe-prefill).
    c = choose_varlen(GemmConfig(), 16384, 8, 14336, 4096, 132)
    assert (c.schedule, c.tile_n, c.stages, c.epi_whole) == ("cooperative", 256, 3, True)
    # Short K (moe-down) keeps the 4th stage; fp32 output has no room for it; pinned stages.
    assert not choose_varlen(GemmConfig(), 16384, 64, 2048, 1408, 132).epi_whole
    assert not choose_varlen(GemmConfig(), 16384, 8, 14336, 4096, 132, 4).epi_whole
    assert not choose_varlen(GemmConfig(stages=4), 16384, 8, 14336, 4096, 132).epi_whole


@pytest.mark.parametrize("cluster,stages,whole", [((1, 1), 3, True), ((2, 1), 3, True),
                                                  ((1, 2), None, False)])
def test_long_k_128x256_stages_by_cluster(cluster, stages, whole) -> None:
    # Long K, cooperative 128x256: three stages and the whole-tile epilogue, but under an A
    # multicast (1x2) the fourth stage that fits (None: the most that fit) and the subtiled
    # epilogue it needs; a pinned depth or epilogue is kept.
    cfg = GemmConfig(schedule="cooperative", tile_m=128, tile_n=256, cluster_m=cluster[0],
                     cluster_n=cluster[1])
    c = choose_varlen(cfg, 65536, 384, 4096, 7168, 132)
    assert (c.cluster_m, c.cluster_n, c.stages, c.epi_whole) == (*cluster, stages, whole)
    pinned = GemmConfig(schedule="cooperative", tile_m=128, tile_n=256, cluster_m=1,
                        cluster_n=2, stages=3)
    assert choose_varlen(pinned, 65536, 384, 4096, 7168, 132).stages == 3
    # Short K keeps the most stages that fit in every cluster shape.
    assert choose_varlen(cfg, 65536, 384, 4096, 2048, 132).stages is None


def test_tail_split_choice(monkeypatch) -> None:
    # Cooperative varlen with K >= 4096 (mixtral, moe-prefill, fp32 output too): built in;
    # the GPU decides per launch whether the last wave is short enough to split.
    assert choose_varlen(GemmConfig(), 16384, 8, 14336, 4096, 132).tail_split
    assert choose_varlen(GemmConfig(), 16384, 8, 14336, 4096, 132, 4).tail_split
    assert choose_varlen(GemmConfig(schedule="cooperative"), 1024, 256, 512, 7168,
                         132).tail_split
    # Short K, ping-pong (moe-decode's default), a cluster or the host visitor: not built.
    assert not choose_varlen(GemmConfig(), 16384, 64, 2048, 1408, 132).tail_split
    assert not choose_varlen(GemmConfig(), 1024, 256, 512, 7168, 132).tail_split
    assert not choose_varlen(GemmConfig(cluster_m=2, cluster_n=1), 16384, 8, 14336, 4096,
                             132).tail_split
    assert not choose_varlen(GemmConfig(visitor="host"), 16384, 8, 14336, 4096, 132).tail_split
    # Never for the general and batched forms by default.
    assert not choose_batched(GemmConfig(), 256, 128, 512, 7168, 132).tail_split
    monkeypatch.setenv("MOE_GEMM_TAIL_SPLIT", "0")
    assert not choose_varlen(GemmConfig(), 16384, 8, 14336, 4096, 132).tail_split


def test_raster_panel_choice() -> None:
    # Long-K 128x256 (mixtral, moe-prefill): panels of 16 m-tiles; everything else 8.
    assert choose_varlen(GemmConfig(), 16384, 8, 14336, 4096, 132).swizzle == 16
    assert choose_varlen(GemmConfig(), 32768, 32, 4096, 7168, 132).swizzle == 16
    assert choose_varlen(GemmConfig(), 16384, 64, 2048, 1408, 132).swizzle == 8
    assert choose_varlen(GemmConfig(), 1024, 256, 512, 7168, 132).swizzle == 8
    assert choose_varlen(GemmConfig(stages=4), 16384, 8, 14336, 4096, 132).swizzle == 8
