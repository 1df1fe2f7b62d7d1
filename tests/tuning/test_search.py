"""The tuner's search space and search logic on the CPU (a fake runner stands in for the GPU)."""

from __future__ import annotations

import math
import re
import statistics

import pytest

from moe_gemm import config as cfgmod
from moe_gemm.config import GemmConfig
from moe_gemm.tuning import space
from moe_gemm.tuning.tuner import FINAL_ROUNDS, TuneShape, compare_configs, tune_shape

# ---------------------------------------------------------------------------------------------
# The space


def test_stage1_follows_the_config_lists(monkeypatch):
    names = {space.name_of(f) for f in space.stage1("varlen")}
    assert {"pp 64x256 p8", "coop 128x256 p8", "coop 128x256 c1x2 p8"} <= names
    assert len(names) == len(space.stage1("varlen"))  # no duplicates
    for f in space.stage1("varlen"):
        assert space.config_of(f).tuning_pinned and f["tail_split"] is False
    # A tile added to the kernel's list is tried; one removed is not.
    monkeypatch.setattr(cfgmod, "COOPERATIVE_TILES", cfgmod.COOPERATIVE_TILES + ((256, 160),))
    monkeypatch.setattr(cfgmod, "PINGPONG_TILES", tuple(t for t in cfgmod.PINGPONG_TILES
                                                         if t != (64, 256)))
    names = {space.name_of(f) for f in space.stage1("varlen")}
    assert "coop 256x160 p8" in names and "coop 256x160 c2x1 p8" in names
    assert not any(n.startswith("pp 64x256") for n in names)


def test_stage1_clusters_follow_validation(monkeypatch):
    # Stage 1 tries exactly the schedule x tile x cluster combinations GemmConfig builds:
    # ping-pong clusters included, since the kernel builds them for both schedules.
    stage1 = space.stage1("varlen")
    assert any(f["schedule"] == "pingpong" and f["cluster_m"] == 2 for f in stage1)
    for f in stage1:
        space.config_of(f)  # every candidate validates
    # Where validation refuses ping-pong clusters, stage 1 drops them.
    real = GemmConfig.__post_init__

    def strict(self):
        real(self)
        if self.schedule == "pingpong" and (self.cluster_m or 1) * (self.cluster_n or 1) > 1:
            raise ValueError("no ping-pong clusters")

    monkeypatch.setattr(GemmConfig, "__post_init__", strict)
    assert not any(f["schedule"] == "pingpong" and (f["cluster_m"], f["cluster_n"]) != (1, 1)
                   for f in space.stage1("varlen"))


def _changed(parent, variant):
    """The fields a variant changes; the raster order (axis and serpentine) counts as one."""
    diff = {k for k in set(parent) | set(variant) if parent.get(k) != variant.get(k)}
    return "raster order" if diff == {"raster_along", "raster_serpentine"} else diff


def test_stage2_varies_one_field_and_only_what_builds():
    parent = next(f for f in space.stage1("varlen") if space.name_of(f) == "coop 128x256 p8")
    variants = space.stage2(parent, "varlen")
    changed = set()
    for v in variants:
        diff = _changed(parent, v)
        assert diff == "raster order" or len(diff) == 1, (v, diff)
        changed.add(diff if isinstance(diff, str) else next(iter(diff)))
    assert changed == {"stages", "raster_panel", "whole_epilogue", "tail_split", "raster order"}
    # The raster variant is QuACK's varlen-M order: panels of n-tiles, serpentine.
    (rv,) = [v for v in variants if v.get("raster_along")]
    assert space.name_of(rv) == "coop 128x256 p8ns"
    assert space.config_of(rv).raster_along == "n" and space.config_of(rv).raster_serpentine
    # A clustered parent and a ping-pong one get a tail split too (the split's unit is then
    # the cluster tile); ping-pong never a whole epilogue; fp32 output never a whole
    # epilogue; general lists get visitor and K-sort besides.
    clustered = {**parent, "cluster_m": 2}
    assert [space.name_of(v) for v in space.stage2(clustered, "varlen")
            if v.get("tail_split")] == ["coop 128x256 c2x1 p8 ts"]
    pp = next(f for f in space.stage1("varlen") if f["schedule"] == "pingpong")
    assert any(v.get("tail_split") for v in space.stage2(pp, "varlen"))
    assert not any(v.get("whole_epilogue") for v in space.stage2(pp, "varlen"))
    assert not any(v.get("whole_epilogue") for v in space.stage2(parent, "varlen", 4))
    gen_parent = next(f for f in space.stage1("general") if f["schedule"] == "cooperative")
    changed = {next(iter(d)) if isinstance(d := _changed(gen_parent, v), set) else d
               for v in space.stage2(gen_parent, "general")}
    assert {"sort_by_k", "visitor", "tail_split"} <= changed
    # (the tail split is built for the device visitor only: a host-visitor parent has none)
    host_parent = {**gen_parent, "visitor": "host"}
    assert not any(v.get("tail_split") for v in space.stage2(host_parent, "general"))


def test_no_candidate_pins_more_stages_than_shared_memory_holds():
    # Seen in tuning runs before this rule: 'coop 128x256 s4 ew' and 'coop 256x192 s4' were
    # compiled only to be refused by the kernel. Every stage-2 variant the tuner proposes now
    # fits, and those two are refused up front.
    from moe_gemm.kernels.sm90.constants import TILE_K, ab_stage_limit, epilogue_staging

    for out_itemsize in (2, 4):
        for parent in space.stage1("varlen", out_itemsize):
            for v in space.stage2(parent, "varlen", out_itemsize):
                if not v.get("stages"):
                    continue
                whole = bool(v.get("whole_epilogue"))
                sub, bufs, groups = epilogue_staging(v["schedule"], v["tile_n"], 32, whole)
                limit, _ = ab_stage_limit(v["tile_m"], v["tile_n"], TILE_K, 16,
                                          8 * out_itemsize, sub, bufs, groups, whole,
                                          want=v["stages"])
                assert v["stages"] <= limit, space.name_of(v)
    too_deep = space.parse_name("coop 128x256 s4 p16 ts ew")
    assert not space._buildable(too_deep, "varlen", 2)
    assert space._buildable({**too_deep, "stages": 3}, "varlen", 2)
    assert not space._buildable(space.parse_name("coop 256x192 s4"), "varlen", 2)
    assert space._buildable(space.parse_name("coop 256x192 s3"), "varlen", 2)
    assert not space._buildable(space.parse_name("coop 256x208 ew"), "varlen", 2)


def test_swapped_tiles_are_a_varlen_candidate_with_16_bit_output():
    swap = [f for f in space.stage1("varlen") if f.get("swap_ab")]
    assert [space.name_of(f) for f in swap] == ["swap 256x128 p8", "swap 256x128 c1x2 p8"]
    cfg = space.config_of(swap[0])
    assert cfg.swap_ab and cfg.tuning_pinned
    for form, size in (("varlen", 4), ("batched", 2), ("general", 2)):
        assert not any(f.get("swap_ab") for f in space.stage1(form, size))
    variants = {space.name_of(f) for f in space.stage2(swap[0], "varlen")}
    assert {"swap 256x128 s3 p8", "swap 256x128 p16", "swap 256x128 p8ns"} <= variants
    assert not any(" ts" in n or " ew" in n for n in variants)  # (the kernel has neither)
    for f in swap + space.stage2(swap[0], "varlen"):
        assert space.parse_name(space.name_of(f)) == f


def test_packed_pairs_vary_2x1_varlen_parents_and_round_trip():
    parent = space.parse_name("pp 64x256 c2x1 p8")
    packed = {**parent, "packed_pairs": True}
    assert space.name_of(packed) == "pp 64x256 c2x1 p8 pk"
    assert space.parse_name("pp 64x256 c2x1 p8 pk") == packed
    assert space.config_of(packed).packed_pairs
    assert packed in space.stage2(parent, "varlen")
    for f in space.stage2(packed, "varlen"):  # (no tail split beside it: it does not build)
        assert space.parse_name(space.name_of(f)) == f and " ts" not in space.name_of(f)
    for form, name in (("batched", "pp 64x256 c2x1 p8"), ("varlen", "pp 64x256 c1x2 p8")):
        assert not any(f.get("packed_pairs")
                       for f in space.stage2(space.parse_name(name, form), form))
    with pytest.raises(ValueError, match="given twice"):
        space.parse_name("pp 64x256 c2x1 pk pk")


def test_combine_and_names_round_trip():
    parent = next(f for f in space.stage1("varlen") if space.name_of(f) == "coop 128x256 p8")
    a = {**parent, "stages": 3}
    b = {**parent, "raster_panel": 16}
    merged = space.combine(parent, [a, b], "varlen")
    assert merged == {**parent, "stages": 3, "raster_panel": 16}
    assert space.combine(parent, [a], "varlen") is None  # nothing new beyond `a` itself
    assert space.combine(parent, [], "varlen") is None
    for f in space.stage1("varlen") + space.stage2(parent, "varlen") + [merged]:
        assert space.parse_name(space.name_of(f)) == f
    assert space.parse_name("coop:128x256:c1x2:s3:p16:ts:ew")["cluster_n"] == 2
    with pytest.raises(ValueError, match="cannot read"):
        space.parse_name("coop 128x256 z9")
    with pytest.raises(ValueError, match="expected"):
        space.parse_name("fast")


def test_fields_of_reproduces_the_rules_choice():
    from moe_gemm.ops.heuristics import choose_varlen

    for args in ((16384, 8, 14336, 4096, 132), (1024, 256, 512, 7168, 132),
                 (32768, 128, 2048, 768, 132)):
        rules = choose_varlen(GemmConfig(), *args)
        again = choose_varlen(space.config_of(space.fields_of(rules, "varlen")), *args)
        assert again == rules


# ---------------------------------------------------------------------------------------------
# The search, on a fake device


class FakeRunner:
    """Times from a formula; `broken` configs fail their check, `uncompilable` their compile.
    Kernels are identified by their name without the raster panel when `panel_free`."""

    def __init__(self, cost, broken=(), uncompilable=(), noise=0.0):
        self.cost = cost
        self.broken = set(broken)
        self.uncompilable = set(uncompilable)
        self.prepared: list[str] = []
        self.measured: dict[str, int] = {}
        self.released: set[str] = set()
        self.noise = noise

    def rules_fields(self):
        return space.parse_name("coop 128x256 s3 p16 ts ew")

    def identity(self, fields):
        return space.name_of({**fields, "stages": fields.get("stages") or 3})

    def submit(self, candidates):
        pass

    def prepare(self, fields):
        name = space.name_of(fields)
        self.prepared.append(name)
        if name in self.uncompilable:
            return "compile: too many stages"
        if name in self.broken:
            return "wrong result: max|out - ref| = nan"
        return None

    def measure(self, candidates, rounds):
        out = {}
        for i, f in enumerate(candidates):
            name = space.name_of(f)
            self.measured[name] = self.measured.get(name, 0) + rounds
            out[name] = [self.cost(f) * (1 + self.noise * ((i + r) % 3 - 1))
                         for r in range(rounds)]
        return out

    def release(self, names):
        self.released.update(names)


SHAPE = TuneShape("varlen", 8, 14336, 4096, 16384, (2048,) * 8)


def cost_by_tile(f):
    base = 1.0 + (256 - f["tile_n"]) / 256  # wider tiles cost less, 256 the least
    base *= 1.0 if f["schedule"] == "cooperative" else 1.1
    if f.get("stages") == 4:
        base *= 0.97
    if f.get("raster_panel") == 16:
        base *= 0.98
    if (f.get("cluster_m"), f.get("cluster_n")) == (1, 2):
        base *= 0.99
    return base


def test_search_finds_the_fastest_and_keeps_samples():
    runner = FakeRunner(cost_by_tile)
    res = tune_shape(SHAPE, runner)
    w = res.winner
    assert (w.fields["tile_n"], w.fields["schedule"]) == (256, "cooperative")
    # stage 2 found the better stages and panel, stage 3 combined them with the cluster
    assert w.fields["stages"] == 4 and w.fields["raster_panel"] == 16
    assert w.fields["cluster_n"] == 2 and w.origin == "combined"
    assert w.ms == pytest.approx(0.97 * 0.98 * 0.99)
    assert res.rules is not None and res.rules.origin == "rules" and res.rules.samples
    e = res.entry()
    # (the search timed the swapped kernel in stage 1 and it lost: the entry says so)
    assert e["config"] == {**{k: v for k, v in w.fields.items() if v is not None},
                           "swap_ab": False}
    assert e["us"] == pytest.approx(w.ms * 1e3, rel=1e-3) and e["rules_us"] > e["us"]
    assert (e["E"], e["N"], e["K"], e["bucket"], e["form"]) == (8, 14336, 4096, 11, "varlen")
    samples = res.samples()
    assert len(samples) == sum(1 for o in res.outcomes if o.status == "ok" and o.samples)
    assert all(s["rows"] == 16384 and s["us"] > 0 for s in samples)
    # Every graph is released at the end; losers were released early.
    assert set(runner.measured) <= runner.released


def test_a_config_that_fails_its_check_never_wins():
    fastest = "coop 128x192 p8"
    runner = FakeRunner(lambda f: 0.1 if space.name_of(f) == fastest else cost_by_tile(f),
                        broken={fastest}, uncompilable={"coop 128x128 p8"})
    res = tune_shape(SHAPE, runner)
    assert res.winner.name != fastest
    failed = {f["name"]: f["error"] for f in res.failures()}
    assert "wrong result" in failed[fastest] and "compile" in failed["coop 128x128 p8"]
    assert fastest not in runner.measured  # checked before timing: never timed


def test_duplicates_are_timed_once():
    runner = FakeRunner(cost_by_tile)
    res = tune_shape(SHAPE, runner)
    dups = [o for o in res.outcomes if o.status == "duplicate"]
    # "coop 128x256 p8" with stages None is the same kernel as the rules' stages 3 variant
    # under this fake's identity, and so on: none of them was prepared or timed.
    for o in dups:
        assert o.name not in runner.prepared and o.name not in runner.measured


def test_deadline_stops_after_stage1_with_a_winner():
    runner = FakeRunner(cost_by_tile)
    res = tune_shape(SHAPE, runner, deadline=0.0)
    assert res.stopped == "deadline after stage 1"
    assert res.winner is not None and res.winner.origin in ("stage1", "rules")
    assert not any(o.origin == "stage2" for o in res.outcomes)


def test_nothing_passes():
    runner = FakeRunner(cost_by_tile, broken={space.name_of(f) for f in space.stage1("varlen")}
                        | {"coop 128x256 s3 p16 ts ew"})
    res = tune_shape(SHAPE, runner)
    assert res.winner is None and res.entry() is None and "no candidate" in res.stopped


def test_compare_configs():
    runner = FakeRunner(cost_by_tile, broken={"pp 128x128 p8"})
    configs = [space.parse_name("coop 128x192 p8"), space.parse_name("pp 128x128 p8")]
    res = compare_configs(SHAPE, runner, configs, rounds=3)
    assert [o.origin for o in res.outcomes] == ["rules", "given", "given"]
    assert res.outcomes[2].status == "error" and not res.outcomes[2].samples
    assert res.winner.name == "coop 128x256 s3 p16 ts ew"  # the rules' choice (1.0 x 0.98)
    assert all(len(o.samples) == 3 for o in res.outcomes[:2])


def test_tune_shape_validation():
    with pytest.raises(ValueError, match="counts"):
        TuneShape("varlen", 4, 64, 64, 10, (1, 2, 3, 5))
    with pytest.raises(ValueError, match="multiple"):
        TuneShape("batched", 4, 64, 64, 10)
    with pytest.raises(ValueError, match="layout"):
        TuneShape("batched", 4, 64, 64, 8, layout="KNE")
    g = TuneShape("general", 4, 64, 64, 10, (0, 5, 5, 0))
    assert g.problems == 2 and g.key().E == 2 and g.key().bucket == round(math.log2(5))
    assert TuneShape("batched", 4, 64, 64, 512).key().bucket == 7


def test_five_stages_are_tried_only_where_the_default_staging_holds_four():
    deep = {space.name_of(p): [space.name_of(v) for v in space.stage2(p, "varlen")
                               if v.get("stages") == space.DEEP_STAGES]
            for p in space.stage1("varlen")}
    assert deep["coop 128x192 c1x2 p8"] == ["coop 128x192 c1x2 s5 p8"]
    assert deep["pp 128x208 c2x1 p8"] == ["pp 128x208 c2x1 s5 p8"]
    assert deep["pp 128x192 c2x1 p8"] == []  # five already, with the default staging
    assert deep["coop 128x256 p8"] == []  # 48 KiB a stage: four either way
    assert space._buildable(space.parse_name("coop 128x192 c1x2 s5 p8"), "varlen", 2)
    assert not space._buildable(space.parse_name("coop 128x256 s5"), "varlen", 2)


def test_kernel_identity_resolves_the_default_depth():
    # coop 128x256 at bf16 holds 4 A/B stages: None and 4 are one kernel, 3 another; a
    # pinned depth the default staging cannot hold (5 on coop 128x192) stays itself.
    from moe_gemm.ops.heuristics import KernelChoice

    def choice(tile_n, stages, whole=False):
        return KernelChoice("cooperative", "device", 128, tile_n, stages, False, 8,
                            epi_whole=whole)

    ident = space.kernel_identity
    assert ident(choice(256, None), 2) == ident(choice(256, 4), 2)
    assert ident(choice(256, None), 2).stages == 4
    assert ident(choice(256, 3), 2) != ident(choice(256, None), 2)
    assert ident(choice(192, 5), 2).stages == 5
    assert ident(choice(192, 5), 2) != ident(choice(192, None), 2)
    # fp32 output: 16 KiB subtiles leave coop 128x256 three stages; the whole-tile epilogue
    # (a buffer per subtile) leaves it three at bf16.
    assert ident(choice(256, None), 4).stages == 3
    assert ident(choice(256, None, whole=True), 2).stages == 3
    assert ident(choice(256, 3, whole=True), 2) == ident(choice(256, None, whole=True), 2)


def test_the_final_rounds_decide():
    """Early samples only rank within their stage: in the final rounds every leader runs in
    the same rounds, and those rounds alone pick the winner and its time."""

    class Drifting(FakeRunner):
        def measure(self, candidates, rounds):
            got = super().measure(candidates, rounds)
            if rounds == FINAL_ROUNDS:  # the final stage: the order reverses
                got = {n: [3.0 - v for v in vs] for n, vs in got.items()}
            return got

    runner = Drifting(cost_by_tile)
    res = tune_shape(SHAPE, runner)
    finalists = [o for o in res.outcomes if o.final]
    assert len(finalists) >= 2 and all(len(o.final) == FINAL_ROUNDS for o in finalists)
    best = min(finalists, key=lambda o: statistics.median(o.final))
    assert res.winner is best
    assert best is not min(finalists, key=lambda o: cost_by_tile(o.fields))
    assert res.entry()["us"] == pytest.approx(statistics.median(best.final) * 1e3, rel=1e-3)


@pytest.mark.parametrize("text,words", [
    ("pp 128", "cannot read '128' (expected two counts as AxB)"),  # (Python's unpack error)
    ("pp 128x", "cannot read '128x' (expected a positive count)"),
    ("pp 128x128 s", "cannot read 's' (expected a positive count)"),
    ("pp 128x128 s3 s4", "cannot read 's4' (that field is given twice)"),  # (s4 won)
    ("pp 128x128 p8 p16", "cannot read 'p16' (that field is given twice)"),
    ("pp 1_28x128", "cannot read '1_28x128' (expected a positive count)"),  # (int(): 128)
    ("pp -128x128", "cannot read '-128x128' (expected a positive count)"),
    ("pp 128x128 s-3", "cannot read 's-3' (expected a positive count)"),
    ("pp 128x128 c0x0", "cannot read 'c0x0' (expected a positive count)"),
    ("pp 128x128 zz", "cannot read 'zz'"),
])
def test_a_malformed_name_says_which_word(text, words):
    with pytest.raises(ValueError, match=re.escape(f"config {text!r}: {words}")):
        space.parse_name(text)


def test_a_name_that_is_not_a_str_is_a_type_error():
    with pytest.raises(TypeError, match="a config name must be a str; got int"):
        space.parse_name(5)  # type: ignore[arg-type]
