"""The general-form host wrapper (general_launch.GeneralShape / GeneralLaunch) on the CPU.

The compiled kernel is replaced by a recorder, so these tests check everything the host
hands the kernel: per-problem metadata rows (pointers, leading dims, sizes, K-sort order),
the outputs it allocates (shapes, 16-byte alignment, no overlap), and the grid. The GPU
tests (tests/kernels/test_general_gpu.py, test_repeated_calls_gpu.py) check the kernel's
arithmetic on the same metadata.
"""

from __future__ import annotations

import random

import pytest
import torch
from host_fakes import Recorder, check_outputs

from moe_gemm.config import GemmConfig
from moe_gemm.ops import general_launch, launch_resources
from moe_gemm.ops.launch_info import last_launch
from moe_gemm.ops.support import analyze_general
from moe_gemm.ops.validation import check_grouped_gemm


def _problems(sizes, dtype=torch.bfloat16, b_col=()):
    gen = torch.Generator().manual_seed(len(sizes))
    a = [torch.randn(m, k, generator=gen).to(dtype) for m, n, k in sizes]
    b = []
    for i, (_, n, k) in enumerate(sizes):
        if i in b_col:
            b.append(torch.randn(n, k, generator=gen).to(dtype).t())  # K contiguous
        else:
            b.append(torch.randn(k, n, generator=gen).to(dtype))
    return a, b


def _launch(a, b, cfg=GemmConfig(), out=None, out_dtype=None):
    args = check_grouped_gemm(a, b, out, out_dtype)
    layout = analyze_general(args)
    assert not isinstance(layout, str), layout
    gl = general_launch.GeneralLaunch(args, cfg, layout=layout)
    return gl, gl.launch()


def _check_rows(rec: Recorder, gl, a, b, outs, sizes) -> None:
    call = rec.calls[-1]
    meta, d_base = call[3], call[15]
    assert meta.shape == (len(sizes), 8) and meta.dtype == torch.int64
    order = last_launch().order
    assert sorted(order) == list(range(len(sizes)))
    for row, p in zip(meta.tolist(), order):
        m, n, k = sizes[p]
        assert row[6] == m | (n << 32) and row[7] == k, (p, row)
        if m == 0 or n == 0:
            continue
        assert row[2] + d_base == outs[p].data_ptr() and row[5] == outs[p].stride(0)
        if k == 0:
            continue
        assert row[0] == a[p].data_ptr() and row[3] == a[p].stride(0)
        bp = b[p]
        if row[1] == bp.data_ptr():  # B used in place: its leading dim must be the real one
            row_major = bp.stride(1) == 1 or n == 1
            assert row[4] == (bp.stride(0) if row_major else bp.stride(1))
    # The kernel is told the problem count and grid the shape computed.
    assert call[9] == len(sizes) and call[10] == gl.shape.num_ctas


@pytest.mark.parametrize("seed", range(6))
def test_metadata_rows_match_tensors(kernel: Recorder, seed: int) -> None:
    rng = random.Random(seed)
    n_common = 8 * rng.randint(1, 40)
    same_n = seed % 2 == 0
    sizes = [(rng.choice([0, 1, 5, 64, 129, 300]),
              n_common if same_n else 8 * rng.randint(1, 40),
              8 * rng.randint(1, 40) if rng.random() > 0.1 else 0) for _ in range(rng.randint(1, 40))]
    a, b = _problems(sizes)
    gl, outs = _launch(a, b)
    check_outputs(outs, sizes, torch.bfloat16)
    if gl.shape.total:
        _check_rows(kernel, gl, a, b, outs, sizes)
    else:
        assert kernel.calls == []


def test_k_sort_permutes_rows(kernel: Recorder) -> None:
    sizes = [(128, 256, 64), (128, 256, 4096), (128, 256, 512), (128, 256, 2048)]
    a, b = _problems(sizes)
    # (the tile pinned: four problems of one tile each would be narrowed to fill the grid)
    gl, outs = _launch(a, b, GemmConfig(sort_by_k=True, tile_m=128, tile_n=256))
    assert last_launch().order == (1, 3, 2, 0)
    assert gl.shape.counts == (1, 1, 1, 1)  # one 128x256 tile each
    _check_rows(kernel, gl, a, b, outs, sizes)
    meta = kernel.calls[0][3]
    assert [r[7] for r in meta.tolist()] == [4096, 2048, 512, 64]


def test_unsorted_keeps_caller_order(kernel: Recorder) -> None:
    sizes = [(64, 128, 64), (64, 128, 4096)]
    a, b = _problems(sizes)
    gl, outs = _launch(a, b, GemmConfig(sort_by_k=False))
    assert gl.shape.order is None and last_launch().order == (0, 1)
    _check_rows(kernel, gl, a, b, outs, sizes)


def test_out_given_and_fp32_out(kernel: Recorder) -> None:
    sizes = [(5, 24, 40), (9, 16, 8), (0, 8, 8)]
    a, b = _problems(sizes)
    out = [torch.empty(m, n, dtype=torch.float32) for m, n, _ in sizes]
    gl, outs = _launch(a, b, out=out)
    assert all(o is u for o, u in zip(outs, out))
    assert kernel.calls[-1][15] == 0  # absolute addresses in the rows
    _check_rows(kernel, gl, a, b, outs, sizes)
    # Other out tensors: other rows (the cached upload is keyed by the out addresses too).
    out2 = [torch.empty(m, n, dtype=torch.float32) for m, n, _ in sizes]
    gl2, outs2 = _launch(a, b, out=out2)
    assert kernel.calls[-1][3] is not kernel.calls[-2][3]
    _check_rows(kernel, gl2, a, b, outs2, sizes)
    # The same addresses with another row stride (views of a wider buffer): another key.
    wide = [torch.empty(m, 2 * n, dtype=torch.float32) for m, n, _ in sizes]
    narrow = [w[:, :n] for w, (_, n, _) in zip(wide, sizes)]
    _launch(a, b, out=[w.view(-1)[: m * n].view(m, n) for w, (m, n, _) in zip(wide, sizes)])
    gl3, outs3 = _launch(a, b, out=narrow)
    assert kernel.calls[-1][3] is not kernel.calls[-2][3]
    _check_rows(kernel, gl3, a, b, outs3, sizes)


def test_own_outputs_fp32_unequal_n(kernel: Recorder) -> None:
    sizes = [(3, 8, 16), (7, 24, 16), (1, 40, 16)]
    a, b = _problems(sizes)
    gl, outs = _launch(a, b, out_dtype=torch.float32)
    check_outputs(outs, sizes, torch.float32)
    _check_rows(kernel, gl, a, b, outs, sizes)


def test_minority_b_layout_is_copied(kernel: Recorder) -> None:
    sizes = [(16, 64, 64)] * 5
    a, b = _problems(sizes, b_col=(3,))  # four row-major B, one K-contiguous
    gl, outs = _launch(a, b)
    meta = kernel.calls[0][3].tolist()
    for p in range(5):
        if p == 3:
            assert meta[p][1] != b[3].data_ptr()  # a row-major copy, not the caller's tensor
            fixed = gl.fixes[0][1]
            assert meta[p][1] == fixed.data_ptr() and torch.equal(fixed, b[3])
        else:
            assert meta[p][1] == b[p].data_ptr()


def test_shape_is_cached_per_problem_set(kernel: Recorder) -> None:
    sizes = [(10, 64, 64), (3, 64, 128)]
    a, b = _problems(sizes)
    g1, o1 = _launch(a, b)
    g2, o2 = _launch(a, b)
    assert g1.shape is g2.shape
    # Each call's outputs are a fresh allocation the caller may keep.
    assert o1[0].data_ptr() != o2[0].data_ptr()
    a2, b2 = _problems([(11, 64, 64), (3, 64, 128)])
    g3, _ = _launch(a2, b2)
    assert g3.shape is not g1.shape


def test_all_empty_launches_nothing(kernel: Recorder) -> None:
    sizes = [(0, 64, 64), (5, 0, 64)]
    a, b = _problems(sizes)
    gl, outs = _launch(a, b)
    assert kernel.calls == [] and [tuple(o.shape) for o in outs] == [(0, 64), (5, 0)]


def test_repeated_call_reuses_uploaded_metadata(kernel: Recorder) -> None:
    sizes = [(7, 64, 128), (0, 64, 128), (33, 64, 64)]
    a, b = _problems(sizes)
    gl1, o1 = _launch(a, b)
    gl2, o2 = _launch(a, b)
    first, second = kernel.calls
    assert second[3] is first[3]  # one upload serves both calls
    assert first[15] != second[15]  # each call's own output block
    _check_rows(kernel, gl2, a, b, o2, sizes)
    # New operand addresses: a new upload with the new pointers.
    a3, b3 = _problems(sizes)
    gl3, o3 = _launch(a3, b3)
    assert kernel.calls[-1][3] is not first[3]
    _check_rows(kernel, gl3, a3, b3, o3, sizes)
    # A view with another leading dim at the same address is another key.
    wide = torch.randn(7, 256).to(torch.bfloat16)
    a4 = [wide[:, :128], a[1], a[2]]
    gl4, o4 = _launch(a4, b)
    assert kernel.calls[-1][3] is not first[3]
    _check_rows(kernel, gl4, a4, b, o4, sizes)


def test_metadata_cache_is_bounded(kernel: Recorder, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(general_launch, "META_CACHE_ENTRIES", 2)
    sizes = [(8, 64, 64)]
    alive = [_problems(sizes) for _ in range(5)]  # five distinct sets of addresses
    for a, b in alive:
        _launch(a, b)
    assert len(general_launch._meta_cache) == 2
    assert len({id(c[3]) for c in kernel.calls}) == 5


def test_minority_b_layout_is_not_cached(kernel: Recorder) -> None:
    sizes = [(16, 64, 64)] * 3
    a, b = _problems(sizes, b_col=(1,))
    _launch(a, b)
    _launch(a, b)
    assert general_launch._meta_cache == {}  # the copy of b[1] is new each call
    assert kernel.calls[0][3] is not kernel.calls[1][3]


def test_graph_owned_launches_keep_nothing(kernel: Recorder) -> None:
    """A compiled graph's launches (the torch.library ops) may allocate from a CUDA-graph
    pool: inside launch_resources.graph_owned() nothing they allocate is cached past the call,
    so a second call gets new workspace and metadata tensors and the caches stay as they
    were."""
    sizes = [(16, 64, 64), (5, 64, 128)]
    a, b = _problems(sizes)
    launch_resources._workspaces.clear()
    with launch_resources.graph_owned():
        _launch(a, b)
        _launch(a, b)
    first, second = kernel.calls[-2], kernel.calls[-1]
    assert first[3] is not second[3]  # metadata uploaded per call, never from the cache
    assert first[7] is not second[7]  # a fresh workspace each call
    assert general_launch._meta_cache == {} and launch_resources._workspaces == {}
    # Outside it the same launches reuse both.
    _launch(a, b)
    _launch(a, b)
    assert kernel.calls[-2][3] is kernel.calls[-1][3]
    assert kernel.calls[-2][7] is kernel.calls[-1][7]


def test_choice_switches_apply_to_the_next_call(kernel: Recorder,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A switch the kernel choice reads (peeked waits, L2 hints) takes effect at the next
    call of the same problem set: the cached shape keys on the switches' values."""
    from moe_gemm.ops import api
    from moe_gemm.ops.heuristics import GENERAL_SWITCHES, PEEK_WAIT_ENV

    assert set(GENERAL_SWITCHES) <= set(api._PLAN_SWITCHES)
    sizes = [(10, 64, 64), (3, 64, 128)]
    a, b = _problems(sizes)
    seen = []
    for value in ("0", "1", "0"):
        monkeypatch.setenv(PEEK_WAIT_ENV, value)
        gl, _ = _launch(a, b)
        seen.append((gl.shape.choice.peek_wait, last_launch().choice.peek_wait))
    assert seen == [(False, False), (True, True), (False, False)]
    monkeypatch.setenv("MOE_GEMM_L2_HINTS", "first,last")
    gl, _ = _launch(a, b)
    assert gl.shape.choice.l2_hints and last_launch().choice.l2_hints


def test_online_cache_switches_apply_to_the_next_general_call(
        kernel: Recorder, online_entry, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The choice reads the tuned tables' online results unless MOE_GEMM_DISK_CACHE=0, from
    MOE_GEMM_CACHE_DIR: a change of either reaches the next call of a cached problem set."""
    sizes = [(40, 512, 1024), (24, 512, 1024)]  # the rules: ping-pong 64x256
    cache = online_entry({"form": "general", "dtype": "bfloat16", "out_dtype": "bfloat16",
                          "E": 2, "N": 512, "K": 1024, "bucket": 5, "us": 1.0,
                          "config": {"schedule": "cooperative", "tile_m": 128, "tile_n": 192,
                                     "raster_panel": 4, "visitor": "device",
                                     "sort_by_k": False}})
    a, b = _problems(sizes)

    def tile(name: str, value: str) -> tuple[int, int]:
        monkeypatch.setenv(name, value)
        _launch(a, b)
        return last_launch().choice.tile_m, last_launch().choice.tile_n

    assert tile("MOE_GEMM_DISK_CACHE", "1") == (128, 192)  # the online entry
    assert tile("MOE_GEMM_DISK_CACHE", "0") == (64, 256)  # the rules
    assert tile("MOE_GEMM_DISK_CACHE", "1") == (128, 192)
    assert tile("MOE_GEMM_CACHE_DIR", str(tmp_path / "elsewhere")) == (64, 256)
    assert tile("MOE_GEMM_CACHE_DIR", str(cache)) == (128, 192)
