"""Decoded tensors -> checked Jobs, with the 4xx rules of docs/HTTP-API.md.

Everything a request can get wrong is caught here, before it reaches the queue: missing or
unexpected tensors (400), shapes, dtypes and counts that do not fit the weight set (422),
rows over the per-request limit (413) and FLOPs over it (422). Messages name what was
expected. The engine re-checks shapes, but a request never gets that far with bad input.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch

from moe_gemm.ops.validation import shape_text
from moe_gemm_server.engine import WeightSet

from .batcher import Job
from .codecs import DATA_DTYPES, dtype_name
from .config import Settings
from .errors import APIError, bad_request, unprocessable

INT_DTYPES = (torch.int32, torch.int64)
_GEMM_NAME = re.compile(r"([ab])\.(0|[1-9][0-9]{0,8})")


def _check_limits(rows: int, flops: int, settings: Settings, out_bytes: int = 0) -> None:
    if rows > settings.max_rows:
        raise APIError(413, f"request has {rows} rows; the per-request limit is "
                            f"{settings.max_rows} (--max-rows)")
    if flops > settings.max_flops:
        raise unprocessable(f"request needs {flops} FLOPs; the per-request limit is "
                            f"{settings.max_flops} (--max-flops)")
    if out_bytes > settings.max_output_bytes:
        raise unprocessable(f"the result would take {out_bytes} bytes; the per-request limit "
                            f"is {settings.max_output_bytes} (--max-output-bytes)")


def counts_from(
    tensors: Mapping[str, torch.Tensor], E: int, T: int, names: tuple[str, str] = ("counts", "offs")
) -> torch.Tensor:
    """The (E,) int64 counts from a `counts` or an `offs` tensor, checked against E and T."""
    c_name, o_name = names
    has_c, has_o = c_name in tensors, o_name in tensors
    if has_c and has_o:
        raise unprocessable(f"give {c_name!r} or {o_name!r}, not both")
    if not has_c and not has_o:
        raise bad_request(f"missing tensor {c_name!r} (E,) = ({E},) int32 (or {o_name!r})")
    name = c_name if has_c else o_name
    t = tensors[name]
    if t.dtype not in INT_DTYPES:
        raise unprocessable(f"{name!r} must be int32 (or int64); got {dtype_name(t.dtype)}")
    if t.dim() != 1 or t.shape[0] != E:
        raise unprocessable(f"{name!r} must be (E,) = ({E},) for this weight set; got "
                            f"{shape_text(t)}")
    v = t.to(torch.int64)
    if has_c:
        if E and int(v.min()) < 0:
            i = int(torch.nonzero(v < 0)[0])
            raise unprocessable(f"counts must be >= 0; got counts[{i}] = {int(v[i])}")
        if E and int(v.max()) > T:  # before summing: int64 counts could wrap the sum to T
            i = int(torch.nonzero(v > T)[0])
            raise unprocessable(f"counts must be <= T = {T} (rows of x); got counts[{i}] = "
                                f"{int(v[i])}")
        total = int(v.sum()) if E else 0
        if total != T:
            raise unprocessable(f"counts must sum to T = {T} (rows of x); they sum to {total}")
        return v
    if E and int(v[0]) < 0:
        raise unprocessable(f"offs must be >= 0; got offs[0] = {int(v[0])}")
    if E and (bool((v < 0).any()) or bool((v > T).any())):  # before differencing (int64 wrap)
        i = int(torch.nonzero((v < 0) | (v > T))[0])
        raise unprocessable(f"offs must lie in [0, T = {T}]; got offs[{i}] = {int(v[i])}")
    d = torch.diff(v, prepend=torch.zeros(1, dtype=torch.int64))
    if E and bool((d < 0).any()):
        i = int(torch.nonzero(d < 0)[0])
        raise unprocessable(f"offs must be non-decreasing; got offs[{i - 1}] = {int(v[i - 1])} "
                            f"> offs[{i}] = {int(v[i])}")
    last = int(v[-1]) if E else 0
    if last != T:
        raise unprocessable(f"offs[-1] must equal T = {T} (rows of x); got {last}")
    return d


def check_mm_names(names: Iterable[str], x_name: str = "x") -> None:
    """400 for a tensor other than x, counts and offs (also the refusal of a safetensors header
    of too many tensors, codecs.parse_safetensors_header)."""
    unknown = set(names) - {x_name, "counts", "offs"}
    if unknown:
        raise bad_request(f"unexpected tensor(s) {sorted(unknown)}; expected {x_name!r} and "
                          "'counts' (or 'offs')")


def mm_job(
    ws: WeightSet,
    tensors: Mapping[str, torch.Tensor],
    settings: Settings,
    *,
    x_name: str = "x",
    priority: int,
    deadline: float | None,
    request_id: str,
) -> Job:
    """A grouped-mm Job for `ws` from tensors "x" and "counts" (or "offs")."""
    check_mm_names(tensors, x_name)
    if x_name not in tensors:
        raise bad_request(f"missing tensor {x_name!r} (T, K) = (T, {ws.K})")
    x = tensors[x_name]
    if x.dim() != 2 or x.shape[1] != ws.K:
        raise unprocessable(f"{x_name!r} must be (T, K) = (T, {ws.K}) for weight set "
                            f"{ws.name!r}; got {shape_text(x)}")
    if x.dtype not in ws.request_dtypes:
        if ws.scale is not None:
            raise unprocessable(f"{x_name!r} must be bfloat16, float16 or float32 (weight set "
                                f"{ws.name!r} is FP8: the server quantizes activations); got "
                                f"{dtype_name(x.dtype)}")
        allowed = "" if ws.dtype == torch.float32 else " or float32"
        raise unprocessable(
            f"{x_name!r} must be {dtype_name(ws.dtype)} (the weight set's dtype){allowed}; "
            f"got {dtype_name(x.dtype)}"
        )
    T = x.shape[0]
    counts = counts_from(tensors, ws.E, T)
    flops = 2 * T * ws.K * ws.N
    _check_limits(T, flops, settings, T * ws.N * x.element_size())
    return Job(
        kind="mm",
        key=("mm", ws.name, ws.version, x.dtype, x.dtype),
        payload=(x, counts),
        rows=T,
        flops=flops,
        out_dtype=x.dtype,
        ws=ws,
        priority=priority,
        deadline=deadline,
        model=ws.name,
        request_id=request_id,
    )


def gemm_problems(names: Iterable[str], settings: Settings) -> int:
    """The number of problems G that tensors `names` hold: "a.0", "b.0" .. "a.{G-1}",
    "b.{G-1}" and nothing else (400), G <= --max-problems (422) (also the refusal of a
    safetensors header of too many tensors, codecs.parse_safetensors_header)."""
    idx: dict[str, set[int]] = {"a": set(), "b": set()}
    for name in names:
        m = _GEMM_NAME.fullmatch(name)
        if m is None:
            raise bad_request(f"unexpected tensor {name!r}; expected 'a.0', 'b.0', 'a.1', ...")
        idx[m.group(1)].add(int(m.group(2)))
    G = max(len(idx["a"]), len(idx["b"]))
    if G == 0:
        raise bad_request("no problems: send tensors 'a.0', 'b.0', 'a.1', 'b.1', ...")
    check_problem_count(G, settings)
    for i in range(G):
        for side in ("a", "b"):
            if i not in idx[side]:
                raise bad_request(f"missing tensor '{side}.{i}' (problems are numbered 0..{G - 1}"
                                  " and each needs an a and a b)")
    return G


def check_problem_count(G: int, settings: Settings) -> None:
    """422 for more problems than --max-problems."""
    if G > settings.max_problems:
        raise unprocessable(f"{G} problems exceed the per-request limit of "
                            f"{settings.max_problems} (--max-problems)")


def gemm_job(
    tensors: Mapping[str, torch.Tensor],
    settings: Settings,
    *,
    priority: int,
    deadline: float | None,
    request_id: str,
) -> Job:
    """A grouped-gemm Job from tensors "a.0", "b.0", "a.1", "b.1", ..."""
    G = gemm_problems(tensors, settings)
    a = [tensors[f"a.{i}"] for i in range(G)]
    b = [tensors[f"b.{i}"] for i in range(G)]
    dtype = a[0].dtype
    if dtype not in DATA_DTYPES:
        raise unprocessable(f"'a.0' must be bfloat16, float16 or float32; got {dtype_name(dtype)}")
    rows = flops = out_elems = 0
    for i, (ai, bi) in enumerate(zip(a, b)):
        for name, t in ((f"a.{i}", ai), (f"b.{i}", bi)):
            if t.dtype != dtype:
                raise unprocessable(f"{name!r} is {dtype_name(t.dtype)} but 'a.0' is "
                                    f"{dtype_name(dtype)}; all tensors must share one dtype")
            if t.dim() != 2:
                raise unprocessable(f"{name!r} must be 2-D; got shape {shape_text(t)}")
        if ai.shape[1] != bi.shape[0]:
            raise unprocessable(f"problem {i}: 'a.{i}' is (M, K) = {shape_text(ai)}, so "
                                f"'b.{i}' must be (K, N) = ({ai.shape[1]}, N); got "
                                f"{shape_text(bi)}")
        rows += ai.shape[0]
        flops += 2 * ai.shape[0] * ai.shape[1] * bi.shape[1]
        out_elems += ai.shape[0] * bi.shape[1]
    _check_limits(rows, flops, settings, out_elems * a[0].element_size())
    return Job(
        kind="gemm",
        key=("gemm", dtype),
        payload=(a, b),
        rows=rows,
        flops=flops,
        out_dtype=dtype,
        priority=priority,
        deadline=deadline,
        model="",
        request_id=request_id,
    )
