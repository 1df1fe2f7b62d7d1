"""grid_fit.py: tile counts and the whole-wave tile fit (no GPU)."""

import pytest

from moe_gemm import GemmConfig
from moe_gemm.ops import grid_fit, heuristics, tuned
from moe_gemm.ops.grid_fit import (
    FAMILY,
    GAIN,
    MAX_WAVES,
    MIN_INTENSITY,
    SHORT_K_TILES,
    cluster_ctas,
    expected_tiles,
    expected_waves,
    routed_ctas,
    wave_fit,
    waves,
)
from moe_gemm.ops.heuristics import choose_batched, choose_general, choose_varlen

NSM = 132


def _name(c):
    return c.schedule, (c.tile_m, c.tile_n), (c.cluster_m, c.cluster_n)


def test_expected_tiles_counts_active_experts_and_partial_tiles():
    # One row: one expert, one m-tile; N=2048 in 256-wide tiles: 8.
    assert expected_tiles(1, 64, 2048, 64, 256) == pytest.approx(8.0)
    # One expert of 3000 rows: 3000/128 + half a partial tile, times ceil(1000/256) = 4.
    assert expected_tiles(3000, 1, 1000, 128, 256) == pytest.approx((3000 / 128 + 0.5) * 4)
    # Many rows over many experts: every expert active, ~T/tile_m + E/2 m-tiles.
    got = expected_tiles(65536, 64, 4096, 128, 256)
    assert got == pytest.approx((65536 / 128 + 32) * 16, rel=1e-6)
    assert expected_tiles(0, 8, 512, 128, 256) == 0.0


def test_cluster_ctas_pads_each_problem_to_whole_pairs():
    count = cluster_ctas([(1, 3000, 1000)])
    assert count(128, 128, 1, 1) == (24 * 8, 24 * 8)
    assert count(192, 128, 1, 2) == (16 * 8, 16 * 8)
    # 5 n-tiles of 128 in a 1x2 pair: the fifth's partner idles, 6 CTAs per m-tile.
    assert cluster_ctas([(1, 256, 640)])(128, 128, 1, 2) == (2 * 6, 2 * 6)
    # 3 m-tiles in 2x1 pairs: 4 per n-tile; per problem, so two problems pad twice.
    assert cluster_ctas([(2, 300, 128)])(128, 128, 2, 1) == (2 * 4, 2 * 4)
    # Empty problems take nothing.
    assert cluster_ctas([(3, 0, 512), (1, 64, 0)])(128, 128, 1, 1) == (0, 0)


def test_routed_ctas_spans_every_routing():
    # 1000 rows over 3 experts, N = 2304 in 192-wide tiles (12, pairs of 12): at fewest 8
    # m-tiles (1000 / 128 rounded up), at most 7 whole ones plus a partial per expert.
    count = routed_ctas(1000, 3, 2304)
    assert count(128, 192, 1, 2) == (8 * 12, (7 + 3) * 12)
    # In 2x1 pairs each expert may add its partial tile and a partner: 8 .. 7 + 6.
    assert count(128, 192, 2, 1) == (8 * 12, (7 + 6) * 12)
    # Every routing of the rows lies in the span (brute force over splits of 1000 rows).
    for a in range(0, 1001, 37):
        for b in range(0, 1001 - a, 53):
            rows = (a, b, 1000 - a - b)
            tiles = sum(-(-r // 128) for r in rows) * 12
            lo, hi = count(128, 192, 1, 1)
            assert lo <= tiles <= hi
    # More experts than rows: only the rows can be active.
    assert routed_ctas(2, 64, 256)(128, 256, 1, 1) == (1, 2)


def test_expected_waves_average_the_span():
    assert expected_waves((132, 132), NSM, 1, 1) == 1
    # A span straddling the end of a wave costs between one and two.
    got = expected_waves((100, 164), NSM, 1, 1)
    assert 1 < got < 2
    assert expected_waves((133, 264), NSM, 1, 1) == 2


def test_waves_round_up_and_the_split_charges_its_share_plus_the_join():
    assert waves(132, NSM, 1, 1) == 1
    assert waves(133, NSM, 1, 1) == 2
    assert waves(264, NSM, 1, 2) == 2
    # A split last wave of at most half the grid: its share of the grid plus the join.
    assert waves(192, NSM, 1, 1, split=True) == pytest.approx(1 + 60 / 132
                                                              + grid_fit.SPLIT_JOIN_WAVES)
    # More than half the grid: the kernel does not split it.
    assert waves(240, NSM, 1, 1, split=True) == 2


def _fit(schedule, tile, cluster, blocks, K, split=False, num_sms=NSM):
    M = sum(g * m for g, m, _ in blocks)
    flops = sum(2.0 * g * m * n * K for g, m, n in blocks)
    bytes_moved = sum(g * ((m * K + n * K) * 2 + m * n * 2) for g, m, n in blocks)
    return wave_fit(schedule, tile, cluster, split, cluster_ctas(blocks), num_sms,
                    grid_fit.intensity(flops, bytes_moved), K / 64, SHORT_K_TILES) if M else None


def test_wave_fit_moves_a_launch_one_wave_past_the_grid_to_a_whole_wave():
    # One 3000 x 1000 x 1536 GEMM: 192 tiles of 128x128 (1.45 waves); 192x128 pairs: 128
    # CTAs, one wave of 1.5x the area (measured, H200: 17.3 us against 19.7).
    got = _fit("pingpong", (128, 128), (1, 2), [(1, 3000, 1000)], 1536)
    assert got == ("pingpong", 192, 128, 1, 2)
    # 1536^3: 64x256 pairs run 147 CTAs (2 waves); 128x160 pairs one wave of 125.
    assert _fit("pingpong", (64, 256), (2, 1), [(1, 1536, 1536)], 1536) == (
        "pingpong", 128, 160, 1, 2)


def test_wave_fit_takes_the_split_into_account():
    # 6144 x 1024 x 4096 in cooperative 128x256 with the tail split: 192 tiles, a split last
    # wave (1.70 waves of 32768) against 2 waves of 192x128 pairs (24576): 0.88 -> move.
    assert _fit("cooperative", (128, 256), (1, 1), [(1, 6144, 1024)], 4096, split=True) == (
        "pingpong", 192, 128, 1, 2)


def test_wave_fit_keeps_what_it_should():
    # Already whole waves (132 tiles of 128x128 at N=1408: 12 x 11).
    assert _fit("pingpong", (128, 128), (1, 1), [(1, 1536, 1408)], 4096) is None
    # Short K: bound by the epilogues (measured: the fit's pick lost at K = 1024).
    assert _fit("pingpong", (128, 128), (1, 2), [(1, 3000, 1000)], SHORT_K_TILES * 64) is None
    # Memory-bound: the decode headline, 256 x 128x512x7168 (~102 FLOPs per byte).
    assert _fit("cooperative", (128, 256), (1, 2), [(256, 128, 512)], 7168) is None
    # At most half a wave: the grid-filling rule's.
    assert _fit("pingpong", (128, 128), (1, 1), [(1, 1024, 1024)], 4096) is None
    # More than MAX_WAVES.
    blocks = [(1, 128 * 33, 128 * 33)]
    assert expected_waves(cluster_ctas(blocks)(128, 128, 1, 1), NSM, 1, 1) > MAX_WAVES
    assert _fit("pingpong", (128, 128), (1, 1), blocks, 8192) is None


def test_wave_fit_moves_only_past_the_gain():
    # Every member's cost against the choice's: the fit's pick is the cheapest, and no
    # member at all is taken when none is at most GAIN of the choice's cost.
    blocks = [(1, 3000, 1000)]
    count = cluster_ctas(blocks)
    now = expected_waves(count(128, 128, 1, 2), NSM, 1, 2) * 128 * 128
    costs = {m: expected_waves(count(m[1], m[2], m[3], m[4]), NSM, m[3], m[4]) * m[1] * m[2]
             for m in FAMILY}
    picked = _fit("pingpong", (128, 128), (1, 2), blocks, 1536)
    assert costs[picked] == min(costs.values()) <= GAIN * now
    assert MIN_INTENSITY > 200  # (compute-bound only: see the module's numbers)


def test_choose_varlen_fits_one_expert_and_routed_launches():
    assert _name(choose_varlen(GemmConfig(), 3000, 1, 1000, 1536, NSM)) == (
        "pingpong", (192, 128), (1, 2))
    # Two experts of 1800 rows, N = 1536, K = 2560: 128x128 pairs span 15-16 m-tiles x 12
    # (1.4 waves); 192x128 pairs 10-12 x 12, one wave (measured, H200: 24.0 us against 30.4).
    rules = heuristics._varlen_rules(GemmConfig(), 1800, 2, 1536, 2560, 2,
                                     heuristics.split_shares(), NSM)
    two = choose_varlen(GemmConfig(), 1800, 2, 1536, 2560, NSM)
    assert _name(two) == ("pingpong", (192, 128), (1, 2)) != _name(rules)
    # Many experts on a short launch of long K whose span covers whole waves either way
    # keep the rules' tile (the model zoo's shapes: every choice unchanged).
    many = choose_varlen(GemmConfig(), 4096, 64, 2048, 7168, NSM)
    assert _name(many) == _name(heuristics._varlen_rules(
        GemmConfig(), 4096, 64, 2048, 7168, 2, heuristics.split_shares(), NSM))
    # A pinned tuned field: the rules decide, no fit.
    pinned = choose_varlen(GemmConfig(schedule="cooperative"), 3000, 1, 1000, 1536, NSM)
    assert pinned.schedule == "cooperative"


def test_fitted_choice_runs_without_split_or_whole_epilogue():
    c = choose_varlen(GemmConfig(), 6144, 1, 1024, 4096, NSM)
    assert _name(c) == ("pingpong", (192, 128), (1, 2))
    assert not c.tail_split and not c.epi_whole and c.stages is None


def test_choose_batched_and_general_fit_known_counts():
    # One list problem and the 3-D form of one problem: the same fit as grouped_mm's.
    got = choose_general(GemmConfig(), ((3000, 1000, 1536),), NSM)
    assert _name(got) == ("pingpong", (192, 128), (1, 2))
    b = choose_batched(GemmConfig(), 1, 3000, 1000, 1536, NSM)
    assert _name(b) == ("pingpong", (192, 128), (1, 2))
    # The headline (memory-bound) keeps its rule: cooperative 128x256 in a 1x2 cluster.
    head = choose_batched(GemmConfig(), 256, 128, 512, 7168, NSM)
    assert _name(head) == ("cooperative", (128, 256), (1, 2))


def test_general_fit_skips_many_distinct_sizes():
    sizes = tuple((3000 + 8 * i, 1000, 1536) for i in range(heuristics.FIT_MAX_SIZES + 1))
    assert choose_general(GemmConfig(), sizes, NSM) == heuristics._choose_general(
        GemmConfig(), sizes, NSM, 2, heuristics.split_shares())


def test_an_exact_table_entry_is_never_refitted(monkeypatch):
    fields = (("schedule", "pingpong"), ("tile_m", 128), ("tile_n", 128),
              ("cluster_m", 1), ("cluster_n", 2))
    monkeypatch.setattr(heuristics, "_varlen_hit", lambda *a, **k: tuned.Hit(
        fields, "exact", "table.json"))
    heuristics.clear_caches()
    try:
        got = choose_varlen(GemmConfig(), 3000, 1, 1000, 1536, NSM, device="NVIDIA H200")
        assert _name(got) == ("pingpong", (128, 128), (1, 2))
        monkeypatch.setattr(heuristics, "_varlen_hit", lambda *a, **k: tuned.Hit(
            fields, "neighbours", "table.json"))
        heuristics.clear_caches()
        got = choose_varlen(GemmConfig(), 3000, 1, 1000, 1536, NSM, device="NVIDIA H200")
        assert _name(got) == ("pingpong", (192, 128), (1, 2))
    finally:
        heuristics.clear_caches()


def test_general_fit_skips_long_lists():
    # More than FIT_MAX_PROBLEMS problems (one size): left as the rules have it.
    sizes = ((3000, 1000, 1536),) * (heuristics.FIT_MAX_PROBLEMS + 1)
    assert choose_general(GemmConfig(), sizes, NSM) == heuristics._choose_general(
        GemmConfig(), sizes, NSM, 2, heuristics.split_shares())


def test_wave_fit_stops_at_the_area_bound_without_counting_members():
    # A choice within GAIN of the output area spread over the grid cannot be beaten by
    # 1 - GAIN: the members are never counted.
    calls = []
    exact = cluster_ctas([(1, 128 * 12, 128 * 11)])  # 132 tiles of 128x128: one full wave

    def counting(tm, tn, cm, cn):
        calls.append((tm, tn, cm, cn))
        return exact(tm, tn, cm, cn)

    area = 128 * 12 * 128 * 11
    assert wave_fit("pingpong", (128, 128), (1, 1), False, counting, NSM, 1000.0, 64,
                    SHORT_K_TILES, area) is None
    assert calls == [(128, 128, 1, 1)]


def test_choice_records_the_fit_and_reports_say_so():
    fitted = choose_varlen(GemmConfig(), 3000, 1, 1000, 1536, NSM)
    assert fitted.wave_fit
    assert heuristics.choice_source(None, fitted) == "rules+waves"
    hit = tuned.Hit((("tile_m", 128),), "neighbours", "t.json")
    assert heuristics.choice_source(hit, fitted) == "table:neighbours+waves"
    kept = choose_varlen(GemmConfig(), 65536, 64, 4096, 7168, NSM)
    assert not kept.wave_fit and heuristics.choice_source(None, kept) == "rules"
    assert choose_batched(GemmConfig(), 3, 1500, 1024, 2048, NSM).wave_fit
    assert choose_general(GemmConfig(), ((3000, 1000, 1536),), NSM).wave_fit
