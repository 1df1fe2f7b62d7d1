"""Repeated calls, the serving loop: what the host caches between calls (grouped_mm's launch
plans, grouped_gemm's uploaded metadata, GroupedGemmPlan) must never serve a stale answer.

Each test calls again with new values at the same addresses, new tensors (new addresses,
also freed memory handed back), new offs values, new or given outputs, from another stream
or thread, and under grad mode, and checks every result against float32.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import zlib

import pytest
import torch

import moe_gemm
from moe_gemm import GemmConfig

from .gpu_report import record
from .helpers import check, check_general, check_mm, general_case, general_problems, rand

pytestmark = pytest.mark.gpu

GENERAL_CONFIGS = [None, GemmConfig(sort_by_k=True, visitor="host")]


# ---------------------------------------------------------------------------------------------
# grouped_gemm


@pytest.mark.parametrize("config", GENERAL_CONFIGS)
def test_general_repeated_calls_reuse_metadata(config):
    """Repeated grouped_gemm calls on the same buffers reuse one metadata upload: every call
    must still write its own fresh outputs, see values updated in place, and work from another
    stream; `out=` tensors that change between calls are honoured."""
    from moe_gemm.ops import general_launch

    sizes = [(37, 256, 512), (0, 256, 64), (128, 256, 4096), (1, 256, 72), (200, 256, 1024)]
    gen = torch.Generator(device="cuda").manual_seed(21)
    a = [rand((m, k), torch.bfloat16, gen) for m, n, k in sizes]
    b = [rand((k, n), torch.bfloat16, gen) for m, n, k in sizes]
    general_launch._meta_cache.clear()

    def verify(tag, res):
        for i, (ai, bi) in enumerate(zip(a, b)):
            check(f"general/meta-cache/{tag}[{i}]", res[i], ai.float() @ bi.float(), ai @ bi)

    first = moe_gemm.grouped_gemm(a, b, config=config)
    assert len(general_launch._meta_cache) == 1
    torch.cuda.synchronize()
    verify("first", first)
    kept = [r.clone() for r in first]
    for t in a:  # new values, same addresses
        t.copy_(rand(t.shape, torch.bfloat16, gen))
    second = moe_gemm.grouped_gemm(a, b, config=config)
    assert len(general_launch._meta_cache) == 1  # reused, not uploaded again
    assert second[0].data_ptr() != first[0].data_ptr()
    torch.cuda.synchronize()
    verify("second", second)
    assert all(torch.equal(x, y) for x, y in zip(first, kept))  # first results untouched
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        third = moe_gemm.grouped_gemm(a, b, config=config)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    verify("side-stream", third)
    for rep in range(2):
        out = [torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
               for m, n, _ in sizes]
        res = moe_gemm.grouped_gemm(a, b, out=out, config=config)
        torch.cuda.synchronize()
        assert all(r is o for r, o in zip(res, out))
        verify(f"out{rep}", res)


@pytest.mark.parametrize("config", GENERAL_CONFIGS)
def test_general_new_operand_addresses(config):
    """New operand addresses for a problem set launched before (fresh activations each step),
    each call made twice (the second from the cached upload): right against float32 and
    bitwise equal, on the default and a side stream, with earlier inputs freed and their
    memory handed back with new values."""
    sizes = ((64, 256, 512), (0, 256, 64), (129, 256, 1024), (1, 256, 72), (300, 256, 264),
             (17, 256, 2056))
    a, b, gen = general_problems(70, sizes)
    moe_gemm.grouped_gemm(a, b, config=config)
    side = torch.cuda.Stream()
    kept = [a]
    for step in range(6):
        if step == 4:
            kept.clear()  # old inputs freed: their addresses come back with new values
        a = [rand(t.shape, torch.bfloat16, gen) for t in a]
        kept.append(a)
        if step % 3 == 2:
            b = [rand(t.shape, torch.bfloat16, gen) for t in b]
        stream = side if step >= 4 else torch.cuda.current_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            res = moe_gemm.grouped_gemm(a, b, config=config)
            res2 = moe_gemm.grouped_gemm(a, b, config=config)  # same addresses again
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        check_general(f"general/new-addresses/{step}", res, a, b)
        same = all(torch.equal(x, y) for x, y in zip(res, res2))
        record(f"general/new-addresses/{step}/repeat-bitwise", same)
        assert same


def test_general_launches_queued_behind_a_busy_gpu():
    """The GPU held back (a sleep kernel) while the host makes ~90 launches on new operand
    addresses: each upload's pinned staging buffer, and each metadata entry evicted from the
    cache, must stay untouched until the queued copy and kernel have read it. Every output
    right against float32, first and repeated calls alike."""
    sizes = ((64, 256, 512), (5, 256, 1024), (130, 256, 264))
    a, b, gen = general_problems(71, sizes)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        inputs = [[rand(t.shape, torch.bfloat16, gen) for t in a] for _ in range(60)]
        moe_gemm.grouped_gemm(a, b)
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of everything below
        results = []  # (tag, inputs, outputs)
        for i, a1 in enumerate(inputs):
            results.append((f"{i}/once", a1, moe_gemm.grouped_gemm(a1, b)))
            if i % 2:  # seen again: from the cached upload
                results.append((f"{i}/again", a1, moe_gemm.grouped_gemm(a1, b)))
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for tag, a1, res in results:
        check_general(f"general/queued/{tag}", res, a1, b)


def test_general_threads():
    """Threads calling grouped_gemm at once (each its own operands, then shared ones): every
    result right (caches are shared; streams and outputs are per call)."""
    sets = [general_problems(40 + i) for i in range(4)]
    shared = general_problems(50)
    results: dict[tuple, list] = {}
    errors: list[BaseException] = []

    def work(i):
        try:
            for rep in range(5):
                a, b, _ = sets[i]
                results[(i, rep)] = moe_gemm.grouped_gemm(a, b)
                results[(i, rep, "shared")] = moe_gemm.grouped_gemm(shared[0], shared[1])
            torch.cuda.current_stream().synchronize()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    assert not errors, errors
    for key, res in results.items():
        a, b = (shared[0], shared[1]) if "shared" in key else sets[key[0]][:2]
        check_general(f"general/threads/{key}", res, a, b)


def test_general_grad_and_no_grad():
    """Operands requiring grad: under no_grad grouped_gemm runs plainly (repeated calls give
    the same bits); under grad mode its outputs are linked to the graph so that backward
    raises (inference-only kernels)."""
    a, b, _ = general_problems(60)
    w = [t.clone().requires_grad_() for t in b]
    with torch.no_grad():
        first = moe_gemm.grouped_gemm(a, w)
        second = moe_gemm.grouped_gemm(a, w)
    torch.cuda.synchronize()
    check_general("general/grad/no-grad", second, a, b)
    assert all(torch.equal(x, y) for x, y in zip(first, second))
    linked = moe_gemm.grouped_gemm(a, w)
    torch.cuda.synchronize()
    assert all(r.requires_grad for r in linked if r.numel())
    check_general("general/grad/grad-mode", [r.detach() for r in linked], a, b)
    with pytest.raises(RuntimeError, match="inference-only"):
        sum(r.float().sum() for r in linked).backward()


@pytest.mark.parametrize("replay", [False, True], ids=["launch", "graph-replay"])
@pytest.mark.parametrize("config", GENERAL_CONFIGS, ids=["default", "host-ksort"])
def test_plan_recomputes_and_captures(replay, config, monkeypatch):
    """GroupedGemmPlan: prepared once, recomputed from the operands' current values (a
    minority-layout B included), from another stream, and captured in a CUDA graph; with
    MOE_GEMM_PLAN_GRAPH=1 its own graph is recorded at the first call and replayed."""
    from moe_gemm.ops.general_launch import PLAN_GRAPH_ENV
    from moe_gemm.ops.launch_info import last_launch

    monkeypatch.setenv(PLAN_GRAPH_ENV, "1" if replay else "0")
    rng = random.Random(3)
    sizes = general_case("mixed", rng)
    gen = torch.Generator(device="cuda").manual_seed(5)
    a = [rand((m, k), torch.bfloat16, gen) for m, n, k in sizes]
    b = [(rand((n, k), torch.bfloat16, gen).t() if i % 3 == 0 else
          rand((k, n), torch.bfloat16, gen)) for i, (m, n, k) in enumerate(sizes)]
    plan = moe_gemm.GroupedGemmPlan(a, b, config=GemmConfig(backend="cute") if config is None
                                    else dataclasses.replace(config, backend="cute"))
    assert plan.backend == "cute"

    def verify(tag):
        for i, (ai, bi) in enumerate(zip(a, b)):
            ref = ai.float() @ bi.float()
            low = (ai @ bi) if ai.shape[1] > 0 else torch.zeros_like(ref).to(torch.bfloat16)
            check(f"plan/{tag}[{i}]", plan.out[i], ref, low)

    plan()
    torch.cuda.synchronize()
    verify("first")
    assert (plan._launch.graph is not None) == replay
    before = last_launch()
    for t in (*a, *b):  # new values in place, minority-layout B included
        t.copy_(rand(t.shape, torch.bfloat16, gen))
    plan()
    torch.cuda.synchronize()
    verify("updated")
    assert last_launch() is not before  # a replay is a launch too
    for t in (*a, *b):
        t.copy_(rand(t.shape, torch.bfloat16, gen))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # (after the new values are written)
    with torch.cuda.stream(side):
        plan()
    side.synchronize()
    verify("other stream")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan()
    for t in (*a, *b):
        t.copy_(rand(t.shape, torch.bfloat16, gen))
    graph.replay()
    torch.cuda.synchronize()
    verify("graph")


@pytest.mark.parametrize("replay", [False, True], ids=["launch", "graph-replay"])
def test_plan_follows_autograd_flags_between_calls(replay, monkeypatch):
    """A GroupedGemmPlan whose operand starts requiring grad after the build: grad-mode calls
    return results linked to autograd (backward raising, values right), while the plan's own
    `out` stays outside the graph, so later calls under no_grad, or after the flag is
    cleared, return plain tensors."""
    from moe_gemm.ops.general_launch import PLAN_GRAPH_ENV

    monkeypatch.setenv(PLAN_GRAPH_ENV, "1" if replay else "0")
    a, b, _ = general_problems(61)
    plan = moe_gemm.GroupedGemmPlan(a, b)
    assert plan.backend == "cute"
    assert not any(o.requires_grad for o in plan())
    b[1].requires_grad_()
    for _ in range(2):
        linked = plan()
        torch.cuda.synchronize()
        assert all(o.requires_grad for o in linked if o.numel())
        assert not any(o.requires_grad for o in plan.out)
        check_general("plan/grad/grad-mode", [o.detach() for o in linked], a,
                      [t.detach() for t in b])
        with pytest.raises(RuntimeError, match="inference-only"):
            sum(o.float().sum() for o in linked if o.numel()).backward()
    with torch.no_grad():
        plain = plan()
    assert not any(o.requires_grad for o in plain)
    b[1].requires_grad_(False)
    plain = plan()
    torch.cuda.synchronize()
    assert not any(o.requires_grad for o in plain)
    check_general("plan/grad/cleared", plain, a, b)


# ---------------------------------------------------------------------------------------------
# grouped_mm (varlen and batched): repeated calls run from the cached launch plan

MM_REPEAT_CASES = {
    # name: (T, row counts, N, K, dtype, out_dtype, w K-major, out given, config)
    "skewed": (1000, [0, 1, 300, 0, 99, 600], 256, 512, torch.bfloat16, None, False, False,
               None),
    "fp16-kmajor-fp32out": (515, [64, 1, 0, 450], 136, 264, torch.float16, torch.float32,
                            True, False, None),
    "out-given": (700, [200, 0, 500], 512, 1024, torch.bfloat16, None, False, True, None),
    "cooperative-256": (2048, [512] * 4, 1024, 2048, torch.bfloat16, None, True, False,
                        GemmConfig(schedule="cooperative", tile_m=128, tile_n=256)),
    "cluster-2x1": (1030, [7, 1000, 23], 512, 512, torch.bfloat16, None, False, False,
                    GemmConfig(schedule="cooperative", cluster_m=2, cluster_n=1)),
    "tail-split-default": (8192, [1024] * 8, 2048, 4096, torch.bfloat16, None, True, False,
                           None),
}


@pytest.mark.parametrize("case", sorted(MM_REPEAT_CASES))
def test_grouped_mm_repeated_calls(case):
    """Calls 1-2 build and reuse the plan; the next ones change one thing each: new x values
    at the same address, a new x tensor, new offs values (read on the GPU), new outputs."""
    T, counts, N, K, dtype, out_dtype, k_major, with_out, cfg = MM_REPEAT_CASES[case]
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(case.encode()))
    E = len(counts)
    w = (rand((E, N, K), dtype, gen).transpose(1, 2) if k_major
         else rand((E, K, N), dtype, gen))
    x = rand((T, K), dtype, gen)
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32).cuda()
    odt = out_dtype or dtype
    out = torch.empty(T, N, dtype=odt, device="cuda") if with_out else None

    def run(xv, ov):
        return moe_gemm.grouped_mm(xv, w, offs, out=ov, config=cfg, out_dtype=out_dtype)

    run(x, out)
    run(x, out)
    for step in range(4):
        if step == 1:
            x.copy_(rand((T, K), dtype, gen))  # same address, new values
        if step == 2:
            x = rand((T, K), dtype, gen)  # a new tensor (same alignment)
        if step == 3:  # new offs values, same shape (the kernel reads them on the GPU)
            cuts = sorted(random.Random(step).sample(range(T - 4), E - 1))
            offs.copy_(torch.tensor(cuts + [T - 5], dtype=torch.int32))
        ov = torch.full((T, N), float("nan"), dtype=odt, device="cuda") if with_out else None
        y = run(x, ov)
        if with_out:
            assert y is ov
        ref = moe_gemm.ops.reference.grouped_mm_ref(x, w, offs)
        low = moe_gemm.grouped_mm(x, w, offs, config=GemmConfig(backend="torch"))
        end = int(offs[-1])
        if with_out:  # rows past offs[-1] are the caller's (left as they were)
            y, ref, low = y[:end], ref[:end], low[:end]
        else:
            assert bool((y[end:] == 0).all())
        check(f"mm-repeat/{case}/{step}", y, ref, low.to(odt))


def test_grouped_mm_batched_repeated_calls():
    gen = torch.Generator(device="cuda").manual_seed(5)
    for G, M, N, K, k_major in ((6, 100, 264, 512, False), (3, 1, 512, 1024, True),
                                (64, 128, 512, 7168, False)):
        w = (rand((G, N, K), torch.bfloat16, gen).transpose(1, 2) if k_major
             else rand((G, K, N), torch.bfloat16, gen))
        x = rand((G, M, K), torch.bfloat16, gen)
        moe_gemm.grouped_mm(x, w)
        moe_gemm.grouped_mm(x, w)
        for _ in range(2):  # new x tensors on the cached plan
            x = rand((G, M, K), torch.bfloat16, gen)
            y = moe_gemm.grouped_mm(x, w)
            ref = torch.bmm(x.float(), w.float())
            check(f"mm-repeat/batched/{G}x{M}x{N}x{K}", y, ref, torch.bmm(x, w))


def test_grouped_mm_launches_on_the_callers_stream():
    """The kernel runs on the caller's current stream: behind a long sleep on a side stream,
    then a copy into x on it, the kernel must read the new x. The default stream's calls
    (their own cached workspace) stay right too."""
    gen = torch.Generator(device="cuda").manual_seed(9)
    x = rand((512, 256), torch.bfloat16, gen)
    w = rand((4, 256, 128), torch.bfloat16, gen)
    offs = torch.tensor([100, 200, 400, 512], dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    new_x = rand((512, 256), torch.bfloat16, gen)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        for _ in range(3):  # the plan, then calls from it on this stream
            moe_gemm.grouped_mm(x, w, offs)
        torch.cuda._sleep(200_000_000)  # ~0.1 s at ~2 GHz
        x.copy_(new_x)
        y = moe_gemm.grouped_mm(x, w, offs)
    side.synchronize()
    ref = moe_gemm.ops.reference.grouped_mm_ref(new_x, w, offs)
    low = moe_gemm.grouped_mm(new_x, w, offs, config=GemmConfig(backend="torch"))
    check("mm-repeat/side-stream", y, ref, low)
    torch.cuda.synchronize()
    for _ in range(3):
        y2 = moe_gemm.grouped_mm(new_x, w, offs)
    torch.cuda.synchronize()
    check("mm-repeat/default-stream", y2, ref, low)


def test_grouped_mm_grad_mode():
    """Grad-requiring weights: under no_grad the cached plan's calls give plain results; under
    grad mode the output is linked to the graph and backward raises."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    x = rand((256, 128), torch.bfloat16, gen)
    w = torch.nn.Parameter(rand((2, 128, 128), torch.bfloat16, gen))
    offs = torch.tensor([100, 256], dtype=torch.int32, device="cuda")
    with torch.no_grad():
        for _ in range(3):
            y0 = moe_gemm.grouped_mm(x, w, offs)
        assert y0.grad_fn is None
    check_mm("mm-repeat/grad/no-grad", y0, x, w.detach(), offs)
    y = moe_gemm.grouped_mm(x, w, offs)
    assert y.requires_grad
    with pytest.raises(RuntimeError):
        y.float().sum().backward()


def test_backward_raises_in_every_form():
    """The kernels have no backward: with inputs that require grad, backward says so, from a
    new plan and from the cached one, in the varlen, batched and general forms."""
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    offs = torch.tensor([10, 30, 30, 64], dtype=torch.int32, device="cuda")
    cfg = GemmConfig(backend="cute")
    for _ in range(2):  # first call builds the plan, the second takes the cached one
        y = moe_gemm.grouped_mm(x, w, offs, config=cfg)
        assert y.requires_grad
        with pytest.raises(RuntimeError, match="inference-only"):
            y.float().sum().backward()
    y3 = moe_gemm.grouped_mm(x.view(4, 16, 128), w, config=cfg)
    with pytest.raises(RuntimeError, match="inference-only"):
        y3.float().sum().backward()
    outs = moe_gemm.grouped_gemm([x[:10], x[10:]], [w[0], w[1]], config=cfg)
    with pytest.raises(RuntimeError, match="inference-only"):
        sum(o.float().sum() for o in outs).backward()
    with torch.no_grad():
        assert moe_gemm.grouped_mm(x, w, offs, config=cfg).grad_fn is None
    # The values are the kernel's either way.
    ref = moe_gemm.ops.reference.grouped_mm_ref(x, w.detach(), offs)
    check("autograd-link/values", y.detach(), ref, moe_gemm.grouped_mm(
        x, w.detach(), offs, config=GemmConfig(backend="torch")))
    record("autograd-link/backward-raises", True)
