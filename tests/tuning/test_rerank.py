"""moe_gemm.tuning.rerank on the CPU: which configs a re-rank times, when the pick changes, what
the entry records, and the CLI's checks (timing itself runs on a GPU)."""

from __future__ import annotations

import pytest
from test_search import FakeRunner

from moe_gemm.ops.tuned import rows_bucket
from moe_gemm.tuning import cli, rerank, space, table_io
from moe_gemm.tuning.tuner import TuneShape

SHAPE = TuneShape("varlen", 4, 512, 1024, 4096, counts=(1024,) * 4, label="toy")


def _sample(name: str, us: float, rows: int = 4096, E: int = 4, N: int = 512) -> dict:
    return {"form": "varlen", "dtype": "bfloat16", "out_dtype": "bfloat16", "E": E, "N": N,
            "K": 1024, "rows": rows, "config": space.parse_name(name), "us": us}


def _table(pick: str = "pp 128x192 p8") -> dict:
    k = SHAPE.key()
    config = {f: v for f, v in space.parse_name(pick).items() if v is not None}
    entry = {"form": k.form, "dtype": k.dtype, "out_dtype": k.out_dtype, "E": k.E, "N": k.N,
             "K": k.K, "bucket": k.bucket, "rows": SHAPE.rows, "config": config, "us": 100.0,
             "name": pick}
    samples = [_sample("pp 128x192 p8", 100.0), _sample("pp 128x128 c1x2 p8", 101.0),
               _sample("pp 128x192 p8ns", 102.0), _sample("coop 128x256 p8", 103.0),
               _sample("coop 128x256 s3 p16 ts ew", 150.0),
               _sample("pp 64x256 p8", 50.0, N=1024),  # another shape: faster, not a rival
               _sample("pp 64x128 p8", 40.0, rows=64)]  # another rows bucket
    assert rows_bucket(64 / 4) != k.bucket
    return {"device": "X", "entries": [entry], "samples": samples}


def test_leaders_are_the_pick_and_the_fastest_other_configs_of_its_key():
    found = rerank.leaders(_table(), SHAPE, top=2)
    assert space.name_of(found.pick) == "pp 128x192 p8"
    assert [space.name_of(f) for f in found.rivals] == ["pp 128x128 c1x2 p8", "pp 128x192 p8ns"]
    found = rerank.leaders(_table(), SHAPE, top=10)
    assert len(found.rivals) == 4  # every other config of the key, none of other shapes
    other = TuneShape("varlen", 4, 512, 2048, 4096, counts=(1024,) * 4)
    assert rerank.leaders(_table(), other, top=2) is None


def _costs(times: dict[str, float]):
    return lambda f: times[space.name_of(f)] / 1e3


RULES = "coop 128x256 s3 p16 ts ew"


@pytest.mark.parametrize("rival_us,expect", [(97.0, "pp 128x128 c1x2 p8"),
                                             (99.5, "pp 128x192 p8")])
def test_a_rival_replaces_the_pick_only_beyond_the_margin(rival_us, expect):
    found = rerank.leaders(_table(), SHAPE, top=1)
    times = {"pp 128x192 p8": 100.0, "pp 128x128 c1x2 p8": rival_us, RULES: 150.0}
    res = rerank.rerank_shape(SHAPE, FakeRunner(_costs(times)), found, rounds=5, margin=0.01,
                              regime="eager")
    assert res.winner.name == expect
    entry = res.entry()
    assert entry["name"] == expect and entry["config"]["tile_m"] == 128
    assert entry["rerank"]["from"] == "pp 128x192 p8"
    assert entry["rerank"]["from_us"] == pytest.approx(100.0)
    assert entry["rerank"]["regime"] == "eager"
    assert set(entry["rerank"]["timed"]) == {"pp 128x192 p8", "pp 128x128 c1x2 p8", RULES}
    assert table_io._valid_entry(entry)
    assert res.samples()  # timed, though the CLI keeps the source table's samples


def test_the_rules_choice_can_win_and_a_broken_rival_never_does():
    found = rerank.leaders(_table(), SHAPE, top=2)
    times = {"pp 128x192 p8": 100.0, "pp 128x128 c1x2 p8": 10.0, "pp 128x192 p8ns": 99.8,
             RULES: 90.0}
    res = rerank.rerank_shape(SHAPE, FakeRunner(_costs(times), broken={"pp 128x128 c1x2 p8"}),
                              found, rounds=5)
    assert res.winner.name == RULES


def test_rerank_takes_the_zoos_regime_unless_told_otherwise():
    args = cli.parse_args(["--zoo", "--rerank", "t.json"])
    assert (args.timing, args.rest_ms, args.sample_ms) == ("eager", 0.0, 5.0)
    args = cli.parse_args(["--zoo", "--rerank", "t.json", "--timing", "graph", "--rest-ms",
                           "1"])
    assert (args.timing, args.rest_ms, args.sample_ms) == ("graph", 1.0, 5.0)
    args = cli.parse_args(["--zoo"])
    assert (args.timing, args.top, args.margin) == ("graph", rerank.DEFAULT_TOP,
                                                    rerank.DEFAULT_MARGIN)


@pytest.mark.parametrize("extra,message", [
    (["--configs", "pp 128x192"], "give one"),
    (["--top", "0"], "--top 0"),
    (["--margin", "1"], "--margin 1"),
    (["--margin", "nan"], "--margin nan"),
])
def test_bad_rerank_options_are_refused(extra, message, capsys):
    assert cli.main(["--zoo", "--rerank", "t.json", *extra]) == 2
    assert message in capsys.readouterr().err


def test_an_empty_rerank_table_name_is_refused(capsys):
    assert cli.main(["--zoo", "--rerank", ""]) == 2
    assert "--rerank" in capsys.readouterr().err
