"""Engine: resident weight sets, merged launches, warm-up, errors (CPU; one GPU check)."""

from __future__ import annotations

import threading

import pytest
import torch

from moe_gemm.ops.reference import grouped_gemm_ref, grouped_mm_ref
from moe_gemm_server.engine import Engine, EngineOutOfMemory, resolve_device
from moe_gemm_server.engine_launches import _merge_permutation


def _counts(T: int, E: int, gen: torch.Generator, empty: tuple[int, ...] = ()) -> torch.Tensor:
    allowed = [e for e in range(E) if e not in empty]
    experts = torch.tensor(allowed)[torch.randint(0, len(allowed), (T,), generator=gen)]
    return torch.bincount(experts, minlength=E).to(torch.int32)


def _offs(counts: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(counts.to(torch.int64), 0).to(torch.int32)


@pytest.fixture
def engine() -> Engine:
    return Engine("cpu")


def test_device_resolution():
    assert resolve_device("cpu").type == "cpu"
    assert resolve_device(None).type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="auto"):
        resolve_device("tpu")
    assert resolve_device("cpu:0") == torch.device("cpu")
    with pytest.raises(ValueError, match="index 0 only"):
        resolve_device("cpu:1")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            resolve_device("cuda")


def test_backend_on_cpu(engine):
    assert engine.backend == "torch"
    assert engine.backend_reason
    with pytest.raises(RuntimeError, match="cute"):
        from moe_gemm.config import GemmConfig

        Engine("cpu", config=GemmConfig(backend="cute"))


@pytest.mark.parametrize("layout", ["w", "w_t"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grouped_mm_matches_reference(engine, layout, dtype):
    gen = torch.Generator().manual_seed(1)
    E, K, N, T = 5, 24, 40, 37
    w = torch.randn(E, K, N, generator=gen).to(dtype)
    uploaded = w if layout == "w" else w.transpose(1, 2).contiguous()
    ws = engine.add_weights("m", uploaded, layout)
    assert (ws.E, ws.K, ws.N, ws.dtype, ws.layout) == (E, K, N, dtype, layout)
    assert ws.nbytes == E * K * N * w.element_size()
    x = torch.randn(T, K, generator=gen).to(dtype)
    counts = _counts(T, E, gen, empty=(1,))  # expert 1 gets no rows
    y = engine.grouped_mm("m", x, counts)
    ref = grouped_mm_ref(x, w, _offs(counts))
    assert y.shape == (T, N) and y.dtype == dtype and y.device.type == "cpu"
    assert ref.abs().max() > 0
    tol = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 4e-3}[dtype]
    torch.testing.assert_close(y.float(), ref, atol=tol * 4, rtol=tol)


def test_float32_activations_against_bf16_weights(engine):
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(3, 16, 8, generator=gen).to(torch.bfloat16)
    ws = engine.add_weights("b", w)
    x = torch.randn(9, 16, generator=gen)
    counts = torch.tensor([4, 0, 5])
    y = engine.grouped_mm(ws, x, counts)
    assert y.dtype == torch.float32
    # x is converted to the set's dtype, the result comes back in float32
    ref = grouped_mm_ref(x.to(torch.bfloat16), w, _offs(counts))
    torch.testing.assert_close(y, ref, atol=1e-3, rtol=1e-3)


def test_merge_permutation_is_expert_major():
    C = torch.tensor([[1, 0, 2], [2, 1, 0]])  # request 0: 3 rows, request 1: 3 rows
    perm = _merge_permutation(C, [3, 3])
    # expert 0: r0 row 0, r1 rows 3, 4; expert 1: r1 row 5; expert 2: r0 rows 1, 2
    assert perm.tolist() == [0, 3, 4, 5, 1, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merged_launch_is_bitwise_equal_to_solo_runs_on_exact_data(engine, dtype):
    """Integer-valued data: every summation order gives the exact sum, so any difference
    between merged and solo results can only come from rows landing in the wrong place."""
    gen = torch.Generator().manual_seed(3)
    E, K, N = 6, 32, 24
    w = torch.randint(-3, 4, (E, K, N), generator=gen).to(dtype)
    ws = engine.add_weights("exact", w)
    reqs = []
    for T in (1, 0, 7, 19, 2, 33):
        x = torch.randint(-3, 4, (T, K), generator=gen).to(dtype)
        reqs.append((x, _counts(T, E, gen, empty=(T % E,))))
    launches = engine.launches
    merged = engine.grouped_mm_many(ws, reqs)
    assert engine.launches == launches + 1
    for (x, c), y in zip(reqs, merged):
        solo = engine.grouped_mm(ws, x, c)
        assert y.dtype == dtype and y.shape == (x.shape[0], N)
        assert torch.equal(y, solo)
        assert torch.equal(y.double(), grouped_mm_ref(x, w, _offs(c), torch.float64).to(dtype)
                           .double())


def test_merged_launch_edge_cases(engine):
    """All-empty requests, float32 activations against bf16 weights (converted in the
    staging buffer), and staging buffers reused by a second, smaller batch."""
    gen = torch.Generator().manual_seed(8)
    E, K, N = 3, 16, 8
    w = torch.randint(-3, 4, (E, K, N), generator=gen).to(torch.bfloat16)
    ws = engine.add_weights("edge", w)
    empty = [(torch.empty(0, K), torch.zeros(E, dtype=torch.int32)) for _ in range(3)]
    out = engine.grouped_mm_many(ws, empty)
    assert [y.shape for y in out] == [(0, N)] * 3 and all(y.dtype == torch.float32 for y in out)
    for sizes in ((5, 0, 9, 1), (2, 3)):  # the second batch reuses the first one's buffers
        reqs = [(torch.randint(-3, 4, (T, K), generator=gen).float(), _counts(T, E, gen))
                for T in sizes]
        merged = engine.grouped_mm_many(ws, reqs)
        for (x, c), y in zip(reqs, merged):
            assert y.dtype == torch.float32
            assert torch.equal(y, engine.grouped_mm(ws, x, c))
            assert torch.equal(y, grouped_mm_ref(x, w, _offs(c), torch.float64).float())
    # answers handed out are copies: a later launch must not change them
    kept = [y.clone() for y in merged]
    engine.grouped_mm_many(ws, [(torch.ones(4, K), torch.tensor([4, 0, 0])),
                                (torch.ones(1, K), torch.tensor([0, 0, 1]))])
    assert all(torch.equal(a, b) for a, b in zip(kept, merged))


def test_merged_launch_matches_solo_on_random_data(engine):
    """Random normal data: CPU BLAS does not promise row-invariant results (it picks a gemv
    kernel for one row and different K blocking for different M), so merged and solo runs
    agree to fp32 rounding, and both agree with a float64 reference."""
    gen = torch.Generator().manual_seed(4)
    E, K, N = 4, 128, 64
    w = torch.randn(E, K, N, generator=gen)
    ws = engine.add_weights("rnd", w)
    reqs = [(torch.randn(T, K, generator=gen), _counts(T, E, gen)) for T in (1, 5, 64, 3)]
    merged = engine.grouped_mm_many(ws, reqs)
    for (x, c), y in zip(reqs, merged):
        solo = engine.grouped_mm(ws, x, c)
        ref = grouped_mm_ref(x, w, _offs(c), torch.float64)
        torch.testing.assert_close(y, solo, atol=1e-4, rtol=1e-5)
        assert (y.double() - ref).abs().max() <= 2 * (solo.double() - ref).abs().max() + 1e-5


def test_grouped_gemm_many(engine):
    gen = torch.Generator().manual_seed(5)
    r0 = ([torch.randn(3, 8, generator=gen), torch.randn(0, 5, generator=gen)],
          [torch.randn(8, 4, generator=gen), torch.randn(5, 6, generator=gen)])
    r1 = ([torch.randn(1, 7, generator=gen)], [torch.randn(7, 9, generator=gen)])
    out = engine.grouped_gemm_many([r0, r1])
    assert [len(o) for o in out] == [2, 1]
    for (a, b), d in zip([r0, r1], out):
        for di, ri in zip(d, grouped_gemm_ref(list(a), list(b))):
            assert di.shape == ri.shape
            torch.testing.assert_close(di, ri, atol=1e-5, rtol=1e-5)
        assert torch.equal(torch.cat([t.flatten() for t in d]),
                           torch.cat([t.flatten() for t in engine.grouped_gemm(a, b)]))


def test_versions_follow_the_order_sets_are_installed_in(engine):
    """A set prepared first but installed last (a slow upload's warm-up) is the newest version,
    newer than the one it replaces and than one deleted before it was installed."""
    slow = engine.prepare_weights("a", torch.randn(2, 4, 3))
    fast = engine.add_weights("a", torch.randn(2, 4, 3))
    deleted = engine.remove_weights("a")
    assert deleted is fast
    engine.install(slow)
    installed = engine.get_weights("a")
    assert installed.version > deleted.version
    assert torch.equal(installed.w, slow.w)


def test_weight_set_lifecycle(engine):
    w1 = torch.randn(2, 4, 3)
    ws1 = engine.add_weights("a", w1)
    ws2 = engine.prepare_weights("a", torch.randn(2, 4, 5))
    assert engine.get_weights("a") is ws1  # prepared, not yet visible
    assert engine.install(ws2) is ws1
    installed = engine.get_weights("a")  # ws2, numbered as it is installed
    assert installed.version > ws1.version and installed.w is ws2.w
    assert installed.N == 5
    assert engine.resident_bytes == ws2.nbytes
    # a launch holding the replaced set still runs against it
    y = engine.grouped_mm(ws1, torch.randn(2, 4), torch.tensor([1, 1]))
    assert y.shape == (2, 3)
    assert engine.remove_weights("a") is installed
    assert engine.remove_weights("a") is None
    with pytest.raises(KeyError):
        engine.get_weights("a")
    assert engine.weight_sets() == []


@pytest.mark.parametrize(
    "tensor, layout, exc, match",
    [
        (torch.randn(2, 3), "w", ValueError, "3-D"),
        (torch.randn(2, 0, 3), "w", ValueError, ">= 1"),
        (torch.randn(2, 3, 4).double(), "w", TypeError, "float64"),
        (torch.randn(2, 3, 4), "wt", ValueError, "layout"),
        ("nope", "w", TypeError, "torch.Tensor"),
    ],
)
def test_bad_weights(engine, tensor, layout, exc, match):
    with pytest.raises(exc, match=match):
        engine.add_weights("bad", tensor, layout)
    assert engine.weight_sets() == []


def test_bad_requests_name_the_expected_shape(engine):
    ws = engine.add_weights("m", torch.randn(3, 8, 4))
    with pytest.raises(ValueError, match=r"\(T, 8\)"):
        engine.grouped_mm(ws, torch.randn(2, 7), torch.tensor([1, 1, 0]))
    with pytest.raises(ValueError, match=r"\(3,\)"):
        engine.grouped_mm(ws, torch.randn(2, 8), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="sum to T = 2"):
        engine.grouped_mm(ws, torch.randn(2, 8), torch.tensor([1, 0, 0]))
    with pytest.raises(ValueError, match=">= 0"):
        engine.grouped_mm(ws, torch.randn(2, 8), torch.tensor([3, -1, 0]))
    with pytest.raises(TypeError, match="float32"):
        engine.grouped_mm(ws, torch.randn(2, 8).half(), torch.tensor([2, 0, 0]))
    wb = engine.add_weights("mb", torch.randn(3, 8, 4).to(torch.bfloat16))
    with pytest.raises(TypeError, match="one dtype"):
        engine.grouped_mm_many(wb, [(torch.randn(1, 8), torch.tensor([1, 0, 0])),
                                    (torch.randn(1, 8).to(torch.bfloat16),
                                     torch.tensor([1, 0, 0]))])


def test_empty_requests(engine):
    ws = engine.add_weights("m", torch.randn(3, 8, 4))
    assert engine.grouped_mm_many(ws, []) == []
    y = engine.grouped_mm(ws, torch.randn(0, 8), torch.zeros(3, dtype=torch.int32))
    assert y.shape == (0, 4)


def test_warm_up_runs_every_served_dtype(monkeypatch):
    engine = Engine("cpu", warmup_rows=(1, 3, 17))
    seen = []
    real = engine.grouped_mm_many

    def spy(ws, reqs, *, out_dtype=None):
        seen.append((reqs[0][0].shape[0], out_dtype))
        return real(ws, reqs, out_dtype=out_dtype)

    monkeypatch.setattr(engine, "grouped_mm_many", spy)
    engine.add_weights("m", torch.randn(4, 8, 8).to(torch.bfloat16))
    assert set(seen) == {(t, d) for t in (1, 3, 17) for d in (torch.bfloat16, torch.float32)}
    assert len(seen) == 6
    with pytest.raises(ValueError, match="warmup_rows"):
        Engine("cpu", warmup_rows=(-1,))


def test_warm_up_ladder_covers_every_heuristic_choice(monkeypatch):
    """With the cute backend the warm-up runs one T per kernel configuration the heuristics
    can pick for this weight set, up to max_rows (checked here against the heuristics
    themselves, with a pretend 132-SM device)."""
    import moe_gemm.capability as cap
    from moe_gemm.ops.heuristics import choose_varlen
    from moe_gemm_server.engine import WeightSet

    monkeypatch.setattr(cap, "sm_count", lambda device: 132)
    engine = Engine("cpu", max_rows=40000)
    engine.backend = "cute"
    assert Engine("cpu").warmup_rows_for(
        WeightSet("x", torch.empty(2, 2, 2), "w", 1)) == (1,)  # torch backend: nothing to build

    def key(c):
        return (c.schedule, c.tile_m, c.tile_n, c.stages, c.swap_ab)

    def choice(T, E, N, K):  # (the engine's launches are grouped_mm's: swapped tiles too)
        return choose_varlen(engine.config, T, E, N, K, 132, swap_ok=True)

    for E, K, N in [(256, 7168, 512), (8, 4096, 14336), (64, 2048, 1024)]:
        ws = WeightSet("x", torch.empty(E, K, N), "w", 1)
        rows = engine.warmup_rows_for(ws)
        assert max(rows) <= 40000
        warmed = {key(choice(T, E, N, K)) for T in rows}
        every = {key(choice(T, E, N, K)) for T in range(1, 40001, 7)}
        assert every <= warmed, (E, K, N, rows)
        assert any(k[-1] for k in every) == (E <= 160)  # the swap window on 8 and 64 experts
        assert len(rows) == len(warmed)  # one run per configuration, no more


def test_out_of_memory_is_reported_and_engine_survives(engine, monkeypatch):
    ws = engine.add_weights("m", torch.randn(2, 4, 4))
    import moe_gemm_server.engine_launches as eng

    def boom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 TiB")

    monkeypatch.setattr(eng, "grouped_mm", boom)
    with pytest.raises(EngineOutOfMemory, match="out of memory"):
        engine.grouped_mm(ws, torch.randn(2, 4), torch.tensor([1, 1]))
    monkeypatch.undo()
    assert engine.grouped_mm(ws, torch.randn(2, 4), torch.tensor([1, 1])).shape == (2, 4)


def test_concurrent_launches_are_serialized(engine):
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(4, 32, 16, generator=gen)
    ws = engine.add_weights("m", w)
    xs = [torch.randn(20, 32, generator=gen) for _ in range(8)]
    c = torch.tensor([5, 5, 5, 5])
    results: dict[int, torch.Tensor] = {}

    def work(i: int) -> None:
        results[i] = engine.grouped_mm(ws, xs[i], c)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for i, x in enumerate(xs):
        torch.testing.assert_close(results[i], grouped_mm_ref(x, w, _offs(c)),
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_merged_launch_is_bitwise_equal_on_gpu():
    """The cute kernel computes each output row from its own row of x in a fixed K order,
    so merging requests must not change a single bit."""
    engine = Engine("cuda", warmup_rows=(1,))
    gen = torch.Generator().manual_seed(7)
    E, K, N = 8, 256, 128
    ws = engine.add_weights("g", torch.randn(E, K, N, generator=gen).to(torch.bfloat16))
    reqs = [(torch.randn(T, K, generator=gen).to(torch.bfloat16), _counts(T, E, gen))
            for T in (1, 3, 64, 130, 7)]
    merged = engine.grouped_mm_many(ws, reqs)
    for (x, c), y in zip(reqs, merged):
        assert torch.equal(y, engine.grouped_mm(ws, x, c))
