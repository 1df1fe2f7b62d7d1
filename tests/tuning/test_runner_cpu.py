"""The tuner's device side (ShapeRunner) driven on the CPU: CUDA events, streams and graphs
replaced by host stand-ins, candidates run by the torch backend. This exercises inputs, the
reference, the 2x-rule check, graph bookkeeping and the search end to end; the GPU tests run
the same code on the kernels (tests/kernels/test_tuning_gpu.py)."""

from __future__ import annotations

import time

import pytest
import torch

from moe_gemm.tuning import runner as runner_mod
from moe_gemm.tuning import space, timing
from moe_gemm.tuning.tuner import TuneShape, tune_shape
from moe_gemm.tuning.zoo import topk_counts


class _Event:
    def __init__(self, enable_timing=True):
        self.t = 0.0

    def record(self, stream=None):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


class _Graph:
    def __init__(self):
        self.calls = []

    def replay(self):
        for fn in self.calls:
            fn()


class _Pool:
    def __init__(self):
        self.submitted = []

    def submit(self, keys):
        self.submitted += list(keys)

    def wait(self, keys, timeout_s=None):
        return {k: None for k in keys}


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (8 << 30, 16 << 30))
    monkeypatch.setattr(runner_mod, "sm_count", lambda device: 132)

    def capture(name, fns, calls, device):
        g = _Graph()  # one pass over the sets: the host stand-in needs no 2 ms of work
        g.calls = list(fns)
        return timing.Timed(name, g, len(fns))

    monkeypatch.setattr(timing, "capture", capture)
    monkeypatch.setattr(runner_mod.ShapeRunner, "backend", "torch")


def _shape(form="varlen", layout="ENK"):
    if form == "batched":
        return TuneShape("batched", 4, 48, 64, 4 * 24, layout=layout)
    counts = tuple(topk_counts(6, 40, 2, seed=1))
    return TuneShape(form, 6, 48, 64, 80, counts, layout=layout)


@pytest.mark.parametrize("form,layout", [("varlen", "ENK"), ("varlen", "EKN"),
                                         ("batched", "ENK"), ("general", "EKN")])
def test_search_end_to_end(fake_cuda, form, layout):
    shape = _shape(form, layout)
    pool = _Pool()
    r = runner_mod.ShapeRunner(shape, torch.device("cpu"), pool, seed=3, l2_bytes=1 << 14)
    assert len(r.sets) >= 2  # small sets rotate to defeat L2
    assert r.base_err > 0
    res = tune_shape(shape, r, rounds=2)
    assert res.winner is not None and not res.failures()
    assert pool.submitted  # compiles were handed to the pool before the checks
    e = res.entry()
    assert e["form"] == form and e["E"] == shape.problems and e["layout"] == layout
    assert all(s["us"] > 0 for s in res.samples())
    r.close()


def test_any_int_seeds_the_data(fake_cuda):
    # `moe-gemm tune --seed` takes any int (the routing's random.Random does): one past
    # torch's generator range was a ValueError once the run began. A negative seed keeps the
    # data torch gave it (read modulo 2^64).
    shape = _shape()
    weights = {}
    for seed in (2**70, -1, 2**64 - 1):
        r = runner_mod.ShapeRunner(shape, torch.device("cpu"), _Pool(), seed=seed)
        weights[seed] = r.sets[0][1].clone()
        r.close()
    assert torch.equal(weights[-1], weights[2**64 - 1])
    assert not torch.equal(weights[2**70], weights[-1])


def test_check_catches_wrong_and_unwritten_results(fake_cuda, monkeypatch):
    shape = _shape()
    r = runner_mod.ShapeRunner(shape, torch.device("cpu"), _Pool(), seed=3)
    cfg = space.config_of(r.rules_fields(), backend="torch")
    assert r.check(cfg) is None
    real = runner_mod.grouped_mm

    def off_by_a_bit(x, w, offs=None, *, out=None, config=None):
        y = real(x, w, offs, out=out, config=config)
        y[3, 5] += 0.25
        return y

    monkeypatch.setattr(runner_mod, "grouped_mm", off_by_a_bit)
    assert "wrong result" in r.check(cfg)

    def writes_nothing(x, w, offs=None, *, out=None, config=None):
        return out

    monkeypatch.setattr(runner_mod, "grouped_mm", writes_nothing)
    assert "wrong result" in r.check(cfg)  # NaN-poisoned output

    def raises(*a, **k):
        raise RuntimeError("launch failed")

    monkeypatch.setattr(runner_mod, "grouped_mm", raises)
    assert "run failed: RuntimeError: launch failed" in r.check(cfg)


def test_prepare_reports_compile_errors_and_refusals(fake_cuda):
    shape = _shape()

    class Failing(_Pool):
        def wait(self, keys, timeout_s=None):
            return {k: "ValueError: 5 stages do not fit; at most 4" for k in keys}

    r = runner_mod.ShapeRunner(shape, torch.device("cpu"), Failing(), seed=3)
    assert r.prepare(r.rules_fields()).startswith("compile: ValueError")
    refused = {**r.rules_fields(), "schedule": "pingpong", "tile_m": 128, "tile_n": 256}
    assert r.prepare(refused).startswith("refused:")
    assert r.identity(refused)[0] == "refused"


def test_stage1_keys_follow_layout_and_dtype():
    shape = _shape("varlen", "EKN")
    keys = runner_mod.stage1_keys(shape, 132)
    assert keys and all(k.b_major == "n" and k.form == "varlen" for k in keys)
    assert len(keys) == len(set(keys))
    fp32 = TuneShape("varlen", 6, 48, 64, 80, shape.counts, out_dtype="float32")
    assert all(k.d_dtype == "float32" and not k.epi_whole
               for k in runner_mod.stage1_keys(fp32, 132))


def test_sets_and_calls_arithmetic():
    l2 = 50 << 20
    assert timing.sets_needed(200 << 20, l2) == 1
    assert timing.sets_needed(10 << 20, l2) == 15
    assert timing.sets_needed(1, l2) == 16  # capped
    assert timing.calls_per_graph(0.01, 4) == 64  # 2 ms of 10 us calls, capped at 64
    assert timing.calls_per_graph(0.5, 3) == 3  # whole passes over the sets
    assert timing.calls_per_graph(25.0, 1) == 1
    assert timing.calls_per_graph(0.001, 100) == 100



@pytest.fixture
def gpu_log(monkeypatch):
    """A CUDA device whose events, graph replays, sleeps and synchronizations are logged:
    (the log, the Graph class that logs its replays); 2e6 sleep cycles per ms."""
    log = []

    class Event(_Event):
        def record(self, stream=None):
            log.append("event")
            super().record(stream)

    class Graph(_Graph):
        def replay(self):
            log.append("replay")

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append("sync"))
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: log.append(("sleep", cycles)))
    monkeypatch.setitem(timing._sleep_rate, 0, 2_000_000.0)  # cycles per ms, as if measured
    return log, Graph


def test_each_sample_starts_after_a_rest(gpu_log):
    """On a CUDA device every sample is queued behind its rest: sleep, start event, replay,
    end event; rest_ms=0 samples back to back (no sleep at all)."""
    log, Graph = gpu_log
    device = torch.device("cuda", 0)
    timed = [timing.Timed("a", Graph(), 4), timing.Timed("b", Graph(), 4)]
    timing.sample_rounds(timed, 3, device, rest_ms=0.5)
    # (a graph's sample never waits for the GPU; the round's events are read at its end)
    assert log == ([("sleep", 1_000_000), "event", "replay", "event"] * 2 + ["sync"]) * 3
    assert all(len(t.samples) == 3 for t in timed)
    log.clear()
    timing.sample_rounds(timed, 1, device, rest_ms=0)
    assert log == ["event", "replay", "event"] * 2 + ["sync"]
    log.clear()
    timing.rest(torch.device("cpu"), 1.0)  # the CPU stand-ins never sleep
    assert log == []


def test_the_runner_samples_with_its_rest(fake_cuda, monkeypatch):
    seen = []
    monkeypatch.setattr(timing, "sample_rounds",
                        lambda timed, rounds, device, rest_ms: seen.append(rest_ms))
    shape = _shape()
    for kwargs, want in (({}, timing.REST_MS), ({"rest_ms": 0.0}, 0.0)):
        r = runner_mod.ShapeRunner(shape, torch.device("cpu"), _Pool(), seed=3, **kwargs)
        r.measure([r.rules_fields()], 1)
        assert seen[-1] == want
        r.close()


def test_the_runner_sizes_its_graphs_to_its_sample_time(fake_cuda, monkeypatch):
    targets = []
    real = timing.calls_per_graph
    monkeypatch.setattr(timing, "calls_per_graph",
                        lambda est, n, target_ms=timing.TARGET_MS: targets.append(target_ms)
                        or real(est, n, target_ms))
    monkeypatch.setattr(timing, "sample_rounds", lambda timed, rounds, device, rest_ms: None)
    shape = _shape()
    for kwargs, want in (({}, timing.TARGET_MS), ({"sample_ms": 5.0}, 5.0)):
        r = runner_mod.ShapeRunner(shape, torch.device("cpu"), _Pool(), seed=3, **kwargs)
        r.measure([r.rules_fields()], 1)
        assert targets[-1] == want
        r.close()
    assert real(1.0, 1, 5.0) == 5 and real(1.0, 1) == 2  # 5 ms of 1 ms calls, or 2 ms


def test_eager_samples_wait_for_the_gpu_then_rest_at_least_their_backlog(gpu_log):
    """Eager candidates (no graph): each sample syncs, sleeps max(rest_ms, its backlog), then
    makes its launches between the events; graph candidates in the same rounds keep theirs."""
    log, Graph = gpu_log
    device = torch.device("cuda", 0)
    launches = []
    eager = timing.capture_eager("e", [lambda: launches.append(0), lambda: launches.append(1)],
                                 3, device)
    assert eager.eager and eager.graph is None and eager.calls == 3
    assert launches == [0, 1, 0] * 2  # warmed up once, then timed once for its host time
    assert eager.backlog_ms >= 0.1
    eager.backlog_ms = 2.0  # as if 3 launches took ~1.5 ms of host time
    graph = timing.Timed("g", Graph(), 4)
    log.clear()
    launches.clear()
    timing.sample_rounds([eager, graph], 2, device, rest_ms=0.5)
    e = ["sync", ("sleep", 4_000_000), "event", "event"]  # its launches go between the events
    g = [("sleep", 1_000_000), "event", "replay", "event"]
    assert log == e + g + ["sync"] + g + e + ["sync"]
    assert launches == [0, 1, 0] * 2
    assert len(eager.samples) == len(graph.samples) == 2
    eager.backlog_ms = 0.1
    log.clear()
    timing.sample_rounds([eager], 1, device, rest_ms=1.0)  # the rest when it is longer
    assert log[:2] == ["sync", ("sleep", 2_000_000)]


def test_the_runner_times_eagerly_when_asked(fake_cuda, monkeypatch):
    made = []
    monkeypatch.setattr(timing, "capture_eager",
                        lambda name, fns, calls, device: made.append(name)
                        or timing.Timed(name, None, calls, run=lambda: [f() for f in fns]))
    shape = _shape()
    r = runner_mod.ShapeRunner(shape, torch.device("cpu"), _Pool(), seed=3, timing_mode="eager")
    samples = r.measure([r.rules_fields()], 2)
    assert made == [space.name_of(r.rules_fields())]
    assert [len(v) for v in samples.values()] == [2]
    r.close()
    with pytest.raises(ValueError, match="timing_mode"):
        runner_mod.ShapeRunner(shape, torch.device("cpu"), _Pool(), timing_mode="burst")
