"""Repeated calls on the CPU (the kernel replaced by a recorder): ops/signature.py's matching,
and which calls ops/api.py sends to a cached plan and which it must not (another dtype,
stride, neg bit, subclass or autograd flag, a misaligned address, a changed switch, an `out`
that overlaps an operand)."""

from __future__ import annotations

import warnings

import pytest
import torch
from host_fakes import Recorder

from moe_gemm import GemmConfig, grouped_gemm, grouped_mm
from moe_gemm.ops import api, mm_launch, signature
from moe_gemm.ops.launch_info import last_launch
from moe_gemm.ops.signature import PlanCache, TensorSignature

BF16 = torch.bfloat16
SENTINEL_OUT = -7.0  # exactly representable in bf16


@pytest.fixture
def cute(kernel: Recorder, monkeypatch: pytest.MonkeyPatch) -> Recorder:
    """The cute path on CPU tensors (capability says yes; the recorder is the kernel)."""
    monkeypatch.setattr(api, "cute_problem", lambda device=None: None)
    monkeypatch.setattr(api, "_warned", set())
    for name in ("MOE_GEMM_CHECK_OFFS", "MOE_GEMM_TAIL_SPLIT"):
        monkeypatch.delenv(name, raising=False)
    return kernel


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """t's values, same shape and strides, at an address 2 bytes past a 16-byte boundary."""
    flat = torch.empty(t.numel() + 8, dtype=t.dtype)
    off = next(i for i in range(8) if (flat.data_ptr() + i * t.element_size()) % 16 == 2)
    return flat[off:off + t.numel()].view(t.shape).copy_(t)


# ---------------------------------------------------------------------------------------------
# TensorSignature and PlanCache


@pytest.fixture(params=["guards", "python"])
def which(request, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways a signature compares: torch's C++ tensor guards and the Python fallback."""
    if request.param == "python":
        monkeypatch.setattr(signature, "guards_usable", lambda: False)
    else:
        assert signature.guards_usable(), "TensorGuards should pass its self-test here"
    return request.param


def test_signature_accepts_equal_metadata_and_rejects_each_change(which: str) -> None:
    x, w = torch.randn(6, 16, dtype=BF16), torch.randn(3, 8, 16, dtype=BF16).transpose(1, 2)
    sig = TensorSignature([x, w])
    assert sig.check(torch.randn(6, 16, dtype=BF16), torch.randn(3, 8, 16).to(BF16).mT)
    changed = {
        "sizes": torch.randn(7, 16, dtype=BF16),
        "strides": torch.randn(16, 6, dtype=BF16).t(),
        "dtype": torch.randn(6, 16, dtype=torch.float16),
        "neg bit": torch._neg_view(torch.randn(6, 16, dtype=BF16)),
        "requires_grad": torch.randn(6, 16, dtype=BF16, requires_grad=True),
        "type": torch.nn.Parameter(torch.randn(6, 16, dtype=BF16), requires_grad=False),
        "inference tensor": torch.inference_mode()(lambda: torch.randn(6, 16, dtype=BF16))(),
    }
    for what, t in changed.items():
        assert not sig.check(t, w), f"a change of {what} must not match"
    assert not sig.check(x, w.contiguous())  # w's strides
    assert not sig.check(x, "not a tensor")


def test_signature_of_a_tensor_used_twice(which: str) -> None:
    w, x = torch.randn(8, 16), torch.randn(4, 8)
    sig = TensorSignature([x, w, w])  # one weight for two problems
    assert sig.check(torch.randn(4, 8), w, w)
    w2 = torch.randn(8, 16)
    assert sig.check(torch.randn(4, 8), w2, w2)
    assert not sig.check(x, w, torch.randn(8, 17))
    assert not sig.check(x, w, w.t())


def test_plan_cache_recent_first_and_bounded() -> None:
    cache = PlanCache(per_bucket=2, buckets=2)
    ts = [torch.randn(n, 4) for n in (1, 2, 3)]
    for i, t in enumerate(ts):
        cache.add("b", "x", [t], f"plan{i}")
    assert len(cache) == 2  # plan0 evicted (least recently added)
    assert cache.find("b", "x", [torch.randn(1, 4)]) is None
    assert cache.find("b", "x", [torch.randn(2, 4)]) == "plan1"
    assert cache.find("b", "other extra", [torch.randn(2, 4)]) is None
    cache.add("b", "x", [torch.randn(9, 4)], "plan9")  # evicts plan2, not the one just used
    assert cache.find("b", "x", [torch.randn(2, 4)]) == "plan1"
    assert cache.find("b", "x", [torch.randn(3, 4)]) is None
    cache.add("c", "x", [torch.randn(1, 4)], "c")
    cache.add("d", "x", [torch.randn(1, 4)], "d")  # a third bucket: the cache starts over
    assert cache.find("b", "x", [torch.randn(2, 4)]) is None
    assert cache.find("d", "x", [torch.randn(1, 4)]) == "d"


# ---------------------------------------------------------------------------------------------
# grouped_mm


def _mm_inputs(T=24, E=3, K=32, N=16, dtype=BF16):
    x = torch.randn(T, K).to(dtype)
    w = torch.randn(E, N, K).to(dtype).transpose(1, 2)  # K-major, as MoE weights are
    offs = torch.tensor([5, 5, T - 2], dtype=torch.int32)[:E]
    return x, w, offs


@pytest.fixture
def plans_built(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Counts the MmPlan / BmmPlan constructions."""
    built: list[str] = []
    for name in ("MmPlan", "BmmPlan"):
        cls = getattr(mm_launch, name)
        sub = type(name, (cls,), {"__init__": lambda self, *a, _c=cls, _n=name, **k: (
            built.append(_n), _c.__init__(self, *a, **k))[1]})
        monkeypatch.setattr(mm_launch, name, sub)
    return built


def test_repeated_grouped_mm_reuses_its_plan(cute: Recorder, plans_built: list[str]) -> None:
    x, w, offs = _mm_inputs()
    y1 = grouped_mm(x, w, offs)
    first = last_launch()
    x2 = torch.randn_like(x)
    y2 = grouped_mm(x2, w, offs)
    assert last_launch() is not first  # each launch is told apart (benchmarks do)
    assert plans_built == ["MmPlan"] and len(cute.calls) == 2
    assert cute.calls[1][0] is x2 and cute.calls[1][2] is y2 and y1 is not y2
    assert y2.shape == (24, 16) and y2.dtype == BF16
    # The batched form and an out= call are their own signatures.
    x3 = torch.randn(3, 8, 32).to(BF16)
    grouped_mm(x3, w)
    grouped_mm(x3, w)
    out = torch.empty(24, 16, dtype=BF16)
    assert grouped_mm(x, w, offs, out=out) is out
    assert grouped_mm(x2, w, offs, out=out) is out
    assert plans_built == ["MmPlan", "BmmPlan", "MmPlan"] and len(cute.calls) == 6
    assert cute.calls[-1][2] is out


@pytest.mark.parametrize("change", ["neg", "misaligned", "dtype", "config", "out_dtype",
                                    "disable-switch"])
def test_grouped_mm_changes_that_must_miss_the_plan(
    cute: Recorder, plans_built: list[str], monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    x, w, offs = _mm_inputs()
    grouped_mm(x, w, offs)
    calls = len(cute.calls)
    kwargs: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the torch fallbacks warn once)
        if change == "neg":
            y = grouped_mm(x, torch._neg_view(w), offs)
            assert len(cute.calls) == calls  # the kernel reads memory, not the sign bit
            want = grouped_mm(x, -w, offs, config=GemmConfig(backend="torch"))
            torch.testing.assert_close(y, want, rtol=0, atol=0)
        elif change == "misaligned":
            y = grouped_mm(_misaligned(x), w, offs)
            assert len(cute.calls) == calls  # TMA needs 16-byte aligned addresses
            want = grouped_mm(x, w, offs, config=GemmConfig(backend="torch"))
            torch.testing.assert_close(y, want, rtol=0, atol=0)
        elif change == "dtype":
            grouped_mm(x.half(), w.half(), offs)
            assert plans_built == ["MmPlan", "MmPlan"]
        elif change in ("config", "out_dtype"):
            kwargs = ({"config": GemmConfig(schedule="cooperative")} if change == "config"
                      else {"out_dtype": torch.float32})
            y = grouped_mm(x, w, offs, **kwargs)
            assert plans_built == ["MmPlan", "MmPlan"]
            assert y.dtype == (torch.float32 if change == "out_dtype" else BF16)
        else:
            monkeypatch.setenv("MOE_GEMM_DISABLE_CUTE", "1")
            monkeypatch.setattr(api, "cute_problem",
                                lambda device=None: "disabled by MOE_GEMM_DISABLE_CUTE")
            y = grouped_mm(x, w, offs)
            assert len(cute.calls) == calls
            want = grouped_mm(x, w, offs, config=GemmConfig(backend="torch"))
            torch.testing.assert_close(y, want, rtol=0, atol=0)


def test_offs_check_switch_bypasses_the_plan(cute: Recorder,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    x, w, offs = _mm_inputs()
    grouped_mm(x, w, offs)
    monkeypatch.setenv("MOE_GEMM_CHECK_OFFS", "1")
    bad = torch.tensor([5, 3, 22], dtype=torch.int32)  # decreasing: unchecked on a plan
    with pytest.raises(ValueError, match="offs must be non-decreasing"):
        grouped_mm(x, w, bad)
    # Calls made while the switch is on keep no plan either (the next would skip the check).
    grouped_mm(x, w, offs)
    grouped_mm(x, w, offs)
    with pytest.raises(ValueError, match="offs must be non-decreasing"):
        grouped_mm(x, w, bad)


def test_grad_inputs_on_a_plan_are_linked(cute: Recorder) -> None:
    x, w, offs = _mm_inputs(dtype=torch.float16)
    grouped_mm(x, w, offs)
    grouped_mm(x, w, offs)  # the plan, without a link
    xg = x.clone().requires_grad_()
    y = grouped_mm(xg, w, offs)
    y2 = grouped_mm(xg, w, offs)  # again: now from the plan of this signature
    assert y.requires_grad and y2.requires_grad
    with pytest.raises(RuntimeError, match="inference-only"):
        y2.float().sum().backward()
    with torch.no_grad():
        assert not grouped_mm(xg, w, offs).requires_grad


def test_out_that_overlaps_an_operand_is_never_written_directly(cute: Recorder) -> None:
    x, w, offs = _mm_inputs(T=24, K=16, N=16)
    out = torch.empty(24, 16, dtype=BF16)
    grouped_mm(x, w, offs, out=out)
    grouped_mm(x, w, offs, out=out)  # a plan for out= calls of this signature
    y = grouped_mm(out, w, offs, out=out)  # out is also x: computed elsewhere, then copied
    assert y is out and cute.calls[-1][2] is not out and cute.calls[-1][0] is out


def _kernel_strides_ok(t: torch.Tensor, unit: int) -> bool:
    """The compiled kernels' contract for a tensor argument: unit stride on `unit`, every
    other stride a 16-byte multiple (kernels/sm90/compile.py's fake tensors), size-1 dims
    included (the call's argument check reads them all)."""
    align = 16 // t.element_size()
    return t.stride(unit) == 1 and all(s % align == 0 for d, s in enumerate(t.stride())
                                       if d != unit)


def test_grouped_mm_size_one_dims_reach_the_kernel_with_aligned_strides(cute: Recorder) -> None:
    # A decode step (T = 1) with K = 20 keeps x's row stride of 20 elements (40 bytes) on its
    # size-1 dim; a (5, 1) column slice keeps K's stride 16 on its size-1 unit dim; a given
    # (1, 8) out of a wider buffer keeps the buffer's row stride. None addresses memory, so
    # the kernels take them, but the compiled kernel's argument check refuses any stride off
    # its rule: the host must hand over views that keep it, as the batched form does.
    offs = torch.tensor([0, 1, 1], dtype=torch.int32)
    x1 = torch.randn(1, 20).to(BF16)
    w1 = torch.randn(3, 20, 16).to(BF16)
    col = torch.randn(5, 16).to(BF16)[:, ::16]  # (5, 1), strides (16, 16)
    w_k1 = torch.randn(3, 1, 16).to(BF16)
    wide = torch.full((1, 12), SENTINEL_OUT, dtype=BF16)
    out = wide[:, :8]  # (1, 8), row stride 12
    w8 = torch.randn(3, 20, 8).to(BF16)
    w_kmajor = torch.randn(3, 16, 24).to(BF16)[:, :, :20].transpose(1, 2)  # ld 24
    cases = [(x1, w1, offs, None), (col, w_k1, torch.tensor([2, 2, 5], dtype=torch.int32), None),
             (x1, w8, offs, out), (x1, w_kmajor, offs, None)]
    for x, w, o, given in cases:
        for _ in range(2):  # the first call and the cached plan's
            calls = len(cute.calls)
            y = grouped_mm(x, w, o, out=given)
            assert len(cute.calls) == calls + 1
            xk, wk, yk = cute.calls[-1][:3]
            w_unit = 1 if w.stride(1) == 1 and w.shape[2] > 1 else 2
            assert _kernel_strides_ok(xk, 1) and _kernel_strides_ok(yk, 1), (xk.stride(),
                                                                             yk.stride())
            assert _kernel_strides_ok(wk, w_unit), wk.stride()
            # The same elements: views of the operands and of the result, not copies.
            for given_t, seen in ((x, xk), (w, wk), (y, yk)):
                assert seen.shape == given_t.shape and seen.data_ptr() == given_t.data_ptr()
            assert torch.equal(xk, x) and torch.equal(wk, w)
            if given is not None:
                assert y is given and bool((wide[:, 8:] == SENTINEL_OUT).all())


@pytest.mark.parametrize("x_make", [lambda T: torch.empty(T, 0, dtype=BF16),
                                    lambda T: torch.randn(T, 24).to(BF16)[:, :0]],
                         ids=["empty", "slice"])
def test_grouped_mm_k_zero_is_zeros_without_a_launch(cute: Recorder, x_make) -> None:
    # K = 0: every routed row is an empty sum. The kernel's launch-time TMA descriptors of x
    # and w would have an empty K extent (and torch.empty(T, 0) has row stride 1, off the
    # compiled kernel's rule), so the host writes the zeros, as the batched form does; a given
    # out keeps its rows past offs[-1].
    T, N = 9, 16
    x = x_make(T)
    w = torch.empty(3, 0, N, dtype=BF16)
    offs = torch.tensor([2, 2, 6], dtype=torch.int32)
    for _ in range(2):  # the first call and the cached plan's
        y = grouped_mm(x, w, offs)
        assert y.shape == (T, N) and y.dtype == BF16 and bool((y == 0).all())
        out = torch.full((T, N), SENTINEL_OUT, dtype=BF16)
        assert grouped_mm(x, w, offs, out=out) is out
        assert bool((out[:6] == 0).all()) and bool((out[6:] == SENTINEL_OUT).all())
        y32 = grouped_mm(x, w, offs, out_dtype=torch.float32)
        assert y32.dtype == torch.float32 and bool((y32 == 0).all())
    assert cute.calls == []


# ---------------------------------------------------------------------------------------------
# grouped_gemm


def _lists(ms=(5, 0, 17, 8), K=32, N=16):
    a = [torch.randn(m, K).to(BF16) for m in ms]
    b = [torch.randn(N, K).to(BF16).t() for _ in ms]
    return a, b


@pytest.fixture
def scans(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts api's scan_general calls."""
    seen: list[int] = []
    real = api.scan_general

    def counting(a, b, out_dtype):
        seen.append(len(a))
        return real(a, b, out_dtype)

    monkeypatch.setattr(api, "scan_general", counting)
    return seen


def _rows_point_at(call: tuple, a, b) -> None:
    meta, order = call[3], last_launch().order
    for row, p in zip(meta.tolist(), order):
        if a[p].shape[0]:
            assert row[0] == a[p].data_ptr() and row[1] == b[p].data_ptr()


def test_repeated_grouped_gemm_skips_the_scan(cute: Recorder, scans: list[int]) -> None:
    a, b = _lists()
    infos = []
    for _ in range(3):
        outs = grouped_gemm(a, b)
        infos.append(last_launch())
    assert len({id(i) for i in infos}) == 3
    # The scan runs on the first two calls (the second takes the signature), not after.
    assert scans == [4, 4] and len(cute.calls) == 3
    assert [o.shape for o in outs] == [(5, 16), (0, 16), (17, 16), (8, 16)]
    _rows_point_at(cute.calls[-1], a, b)
    assert cute.calls[2][3] is cute.calls[1][3]  # the same addresses: one metadata upload
    # New addresses, same signature: no scan, new rows.
    a2, _ = _lists()
    grouped_gemm(a2, b)
    assert scans == [4, 4] and cute.calls[-1][3] is not cute.calls[1][3]
    _rows_point_at(cute.calls[-1], a2, b)
    # Another problem set: the scan again.
    a3, b3 = _lists(ms=(5, 1, 17, 8))
    grouped_gemm(a3, b3)
    assert scans == [4, 4, 4]


def test_one_weight_for_every_problem_skips_the_scan_too(cute: Recorder,
                                                          scans: list[int]) -> None:
    a, _ = _lists(ms=(3, 9, 4))
    w = torch.randn(16, 32).to(BF16).t()
    for _ in range(3):
        grouped_gemm(a, [w] * 3)
    assert scans == [3, 3] and len(cute.calls) == 3
    _rows_point_at(cute.calls[-1], a, [w] * 3)


def test_grouped_gemm_signature_misses(cute: Recorder, scans: list[int]) -> None:
    a, b = _lists()
    grouped_gemm(a, b)
    grouped_gemm(a, b)
    n = len(cute.calls)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outs = grouped_gemm([_misaligned(a[0]), *a[1:]], b)  # same signature, bad address
        assert len(cute.calls) == n  # the torch backend took it
        want = grouped_gemm(a, b, config=GemmConfig(backend="torch"))
        torch.testing.assert_close(outs[0], want[0], rtol=0, atol=0)
        grouped_gemm(a, [torch._neg_view(b[0]), *b[1:]])
        assert len(cute.calls) == n
    grouped_gemm(a, b, out_dtype=torch.float32)  # another extra: the scan
    assert scans[-1] == 4 and len(cute.calls) == n + 1


def test_grouped_gemm_grad_operands_are_linked(cute: Recorder) -> None:
    a, b = _lists()
    b = [t.detach().requires_grad_() for t in b]
    for _ in range(3):  # the scan, the scan taking the signature, the signature
        outs = grouped_gemm(a, b)
        assert all(o.requires_grad for o in outs)
    with pytest.raises(RuntimeError, match="inference-only"):
        outs[0].float().sum().backward()


def test_workspace_follows_the_plans_choice(cute: Recorder) -> None:
    import dataclasses

    from moe_gemm.kernels.sm90.constants import DESC_RING, SLOT_INTS, split_workspace_bytes

    x, w, offs = _mm_inputs()
    grouped_mm(x, w, offs)
    plan = api.cached_mm_plan(x, w, offs)
    assert plan is not None and not plan.choice.tail_split
    assert cute.calls[-1][7].numel() == plan.num_ctas * DESC_RING * SLOT_INTS
    # A tuning script swaps the choice of a built plan: the workspace must grow with it.
    plan.choice = dataclasses.replace(plan.choice, tail_split=True)
    grouped_mm(x, w, offs)
    ws = cute.calls[-1][7]
    counters, partials, total = split_workspace_bytes(plan.num_ctas, plan.choice.tile_m,
                                                      plan.choice.tile_n)
    assert ws.numel() * 8 >= total
    assert bool((ws[counters // 8:partials // 8] == 0).all())  # (counters start at zero)


def test_a_tail_split_workspace_zeroes_its_counters_only() -> None:
    """The partial tiles are written before they are read: zeroing them would be a memset of
    megabytes in every replay of a captured call."""
    from moe_gemm.kernels.sm90.constants import split_workspace_bytes
    from moe_gemm.ops.heuristics import KernelChoice
    from moe_gemm.ops.launch_resources import WorkspaceSlot

    choice = KernelChoice("cooperative", "device", 128, 256, None, False, 8, tail_split=True)
    slot = WorkspaceSlot(torch.device("cpu"), 132, choice)
    counters, partials, total = split_workspace_bytes(132, 128, 256)
    assert slot.ints * 8 >= total and slot.zeroed == (counters // 8, partials // 8)
    plain = WorkspaceSlot(torch.device("cpu"), 132, KernelChoice(
        "cooperative", "device", 128, 256, None, False, 8))
    assert plain.zeroed is None


def test_switching_the_tuned_tables_reaches_a_cached_plan(cute, tmp_path, monkeypatch) -> None:
    # MOE_GEMM_TUNED_TABLES (and MOE_GEMM_TUNED_TABLE) change the config a call launches, so
    # a change between two calls of one signature must miss the cached plan (A/B runs in one
    # process), as the other switches do.
    import json

    from moe_gemm.ops import heuristics, launch_kernel, tuned

    dev = "NVIDIA Test GPU 80GB"
    monkeypatch.setattr(launch_kernel, "_table_device", lambda device: dev)
    monkeypatch.setenv("MOE_GEMM_CACHE_DIR", str(tmp_path / "cache"))
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setattr(tuned, "TABLES_DIR", shipped)
    entry = {"form": "varlen", "dtype": "bfloat16", "out_dtype": "bfloat16", "E": 3, "N": 16,
             "K": 32, "bucket": 3, "us": 1.0,
             "config": {"schedule": "pingpong", "tile_m": 64, "tile_n": 256,
                        "raster_panel": 8, "visitor": "device"}}
    (shipped / f"{tuned.device_slug(dev)}.json").write_text(json.dumps(
        {"format": tuned.FORMAT, "device": dev, "sm_count": 132, "entries": [entry]}))
    tuned.clear_caches()
    heuristics.clear_caches()
    x = torch.randn(24, 32).to(BF16)
    w = torch.randn(3, 16, 32).to(BF16).transpose(1, 2)
    offs = torch.tensor([5, 5, 22], dtype=torch.int32)

    def tile(switch: str) -> tuple[int, int]:
        monkeypatch.setenv("MOE_GEMM_TUNED_TABLES", switch)
        grouped_mm(torch.randn_like(x), w, offs)
        return last_launch().choice.tile_m, last_launch().choice.tile_n

    try:
        assert tile("0") != (64, 256)  # the rules
        assert tile("1") == (64, 256)  # the table's entry, though a plan of this call exists
        assert tile("0") != (64, 256)
    finally:
        tuned.clear_caches()
        heuristics.clear_caches()


def test_online_cache_switches_reach_a_cached_plan(cute, online_entry, tmp_path,
                                                   monkeypatch) -> None:
    # MOE_GEMM_DISK_CACHE=0 stops the online autotune results on disk from being read and
    # MOE_GEMM_CACHE_DIR says where they are: either changes the config a call launches, so a
    # change between two calls of one signature must miss the cached plan.
    cache = online_entry({"form": "varlen", "dtype": "bfloat16", "out_dtype": "bfloat16",
                          "E": 3, "N": 48, "K": 64, "bucket": 4, "us": 1.0,
                          "config": {"schedule": "pingpong", "tile_m": 64, "tile_n": 256,
                                     "raster_panel": 8, "visitor": "device"}})
    x = torch.randn(48, 64).to(BF16)
    w = torch.randn(3, 48, 64).to(BF16).transpose(1, 2)
    offs = torch.tensor([7, 30, 41], dtype=torch.int32)

    def tile(name: str, value: str) -> tuple[int, int]:
        monkeypatch.setenv(name, value)
        grouped_mm(torch.randn_like(x), w, offs)
        return last_launch().choice.tile_m, last_launch().choice.tile_n

    assert tile("MOE_GEMM_DISK_CACHE", "1") == (64, 256)  # the online result
    assert tile("MOE_GEMM_DISK_CACHE", "0") != (64, 256)  # the rules, though a plan exists
    assert tile("MOE_GEMM_DISK_CACHE", "1") == (64, 256)
    assert tile("MOE_GEMM_CACHE_DIR", str(tmp_path / "elsewhere")) != (64, 256)
    assert tile("MOE_GEMM_CACHE_DIR", str(cache)) == (64, 256)
