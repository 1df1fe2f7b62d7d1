"""Randomized bad input: a valid call of each public op (and of GroupedGemmPlan and the MoE
layer's constructor) with one or two of its arguments replaced by something a user might pass
by mistake (another dtype, rank, size, device type, offsets out of order, a list for a tensor,
a string for a dtype, ...). The op must either accept it (some replacements are valid input)
and return the documented result (checked against an fp64 reference of the arguments it
took), or raise TypeError or ValueError: never another exception type, a crash or a hang.

Fresh cases every run; MOE_GEMM_FUZZ_SEED replays one (the failure message names it).
"""

from __future__ import annotations

import os
import random
import secrets
from collections.abc import Callable
from typing import Any

import pytest
import torch

import moe_gemm
from moe_gemm import GemmConfig
from moe_gemm.ops.fused_reference import fused_grouped_mm_ref
from moe_gemm.ops.reference import grouped_gemm_ref, grouped_mm_ref
from moe_gemm.ops.scaled_reference import scaled_grouped_mm_ref
from moe_gemm.testing import assert_close_to_ref

SEED = int(os.environ.get("MOE_GEMM_FUZZ_SEED") or secrets.randbits(31))
CASES = int(os.environ.get("MOE_GEMM_FUZZ_CASES") or 120)
BF16 = torch.bfloat16
E4M3 = torch.float8_e4m3fn

# What users pass by mistake, for any tensor argument: each is a function of the valid value.
TENSOR_MISTAKES: dict[str, Callable[[torch.Tensor, random.Random], Any]] = {
    "none": lambda t, r: None,
    "int": lambda t, r: 3,
    "list": lambda t, r: t.tolist() if t.numel() < 64 else [t],
    "numpy": lambda t, r: t.float().numpy(),
    "float64": lambda t, r: t.double(),
    "int32": lambda t, r: t.to(torch.int32),
    "int64": lambda t, r: t.to(torch.int64),
    "bool": lambda t, r: t != 0,
    "complex": lambda t, r: t.to(torch.complex64),
    "e5m2": lambda t, r: t.float().to(torch.float8_e5m2),
    "unsqueezed": lambda t, r: t.unsqueeze(0),
    "flattened": lambda t, r: t.reshape(-1),
    "scalar": lambda t, r: t.reshape(-1)[:1].reshape(()) if t.numel() else torch.tensor(1.0),
    "shorter": lambda t, r: t[..., :-1] if t.dim() and t.shape[-1] else t,
    "longer": lambda t, r: torch.cat([t, t[..., :1]], -1) if t.dim() and t.shape[-1] else t,
    "fewer rows": lambda t, r: t[:-1] if t.dim() and t.shape[0] else t,
    "transposed": lambda t, r: t.transpose(-1, -2) if t.dim() >= 2 else t,
    "meta": lambda t, r: t.to("meta"),
    "nan": lambda t, r: t.float().fill_(float("nan")).to(t.dtype) if t.is_floating_point()
    else t,
}


def _offs_mistakes(offs: torch.Tensor, T: int, r: random.Random) -> Any:
    kind = r.choice(["decreasing", "past T", "negative", "float", "int64", "2-D", "extra",
                     "empty", "list"])
    o = offs.clone()
    if kind == "decreasing" and len(o) > 1:
        o[0] = o[-1] + 1
    elif kind == "past T":
        o[-1] = T + r.randint(1, 50)
    elif kind == "negative":
        o[0] = -r.randint(1, 5)
    elif kind == "float":
        return o.float()
    elif kind == "int64":
        return o.long()
    elif kind == "2-D":
        return o[None]
    elif kind == "extra":
        return torch.cat([o, o[-1:]])
    elif kind == "empty":
        return o[:0]
    elif kind == "list":
        return o.tolist()
    return o


OTHER_MISTAKES: dict[str, list[Any]] = {
    "out_dtype": ["bf16", torch.int32, torch.float64, 16, torch.float8_e4m3fn],
    "config": [{"backend": "torch"}, "torch", 1, GemmConfig],
}


def _mutate(args: dict[str, Any], r: random.Random, T: int) -> tuple[dict[str, Any], str]:
    """One or two arguments replaced; returns the new arguments and what was done."""
    args = dict(args)
    done = []
    for _ in range(r.choice([1, 1, 2])):
        try:
            done.append(_mutate_one(args, r, T))
        except Exception:  # noqa: BLE001 - a mistake that cannot be made of a mutated value
            name = r.choice(sorted(args))
            args[name] = None
            done.append(f"{name}=None")
    return args, "; ".join(done)


def _mutate_one(args: dict[str, Any], r: random.Random, T: int) -> str:
    """Replace one argument in place; returns what was done."""
    name = r.choice(sorted(args))
    value = args[name]
    if name == "offs" and isinstance(value, torch.Tensor) and r.random() < 0.6:
        args[name] = _offs_mistakes(value, T, r)
        return f"{name}: offs mistake"
    if name in OTHER_MISTAKES:
        args[name] = r.choice(OTHER_MISTAKES[name])
        return f"{name}={args[name]!r}"
    if isinstance(value, torch.Tensor):
        kind = r.choice(sorted(TENSOR_MISTAKES))
        args[name] = TENSOR_MISTAKES[kind](value, r)
        return f"{name}: {kind}"
    if isinstance(value, list) and value:
        i = r.randrange(len(value))
        kind = r.choice(sorted(TENSOR_MISTAKES) + ["drop", "tuple-of-one"])
        if kind in TENSOR_MISTAKES and not isinstance(value[i], torch.Tensor):
            kind = "drop"  # (mutated already)
        if kind == "drop":
            args[name] = value[:i] + value[i + 1:]
        elif kind == "tuple-of-one":
            args[name] = value[i]
        else:
            args[name] = value[:i] + [TENSOR_MISTAKES[kind](value[i], r)] + value[i + 1:]
        return f"{name}[{i}]: {kind}"
    args[name] = r.choice([None, 0, "x", []])
    return f"{name}={args[name]!r}"


def _call(op: Callable[..., Any], args: dict[str, Any], positional: tuple[str, ...]) -> Any:
    pos = [args[n] for n in positional]
    kw = {n: v for n, v in args.items() if n not in positional}
    return op(*pos, **kw)


def _check(op_name: str, i: int, op, args, positional, T, shape_of) -> None:
    r = random.Random(f"{SEED}/{op_name}/{i}")
    bad, what = _mutate(args, r, T)
    try:
        out = _call(op, bad, positional)
    except (TypeError, ValueError):
        return
    except Exception as exc:  # noqa: BLE001 - the point: name the wrong exception type
        raise AssertionError(f"seed={SEED} {op_name}[{i}] ({what}): {type(exc).__name__}: "
                             f"{str(exc)[:300]}") from None
    shape_of(out, bad)  # accepted: the documented result of what was passed


def _close(out: torch.Tensor, ref: torch.Tensor, name: str) -> None:
    """An accepted call's result against the fp64 reference of the arguments it took."""
    assert_close_to_ref(out, ref, name=f"seed={SEED} {name}")


def _given_out(a: dict[str, Any], y: Any, name: str = "out") -> None:
    """A result written into a caller's `out` is that tensor."""
    if isinstance(a.get(name), torch.Tensor):
        assert y is a[name]
    elif isinstance(a.get(name), list):
        assert len(y) == len(a[name]) and all(yi is oi for yi, oi in zip(y, a[name]))


def _moe_args(r: random.Random):
    E, T, K, N = r.randint(1, 5), r.randint(0, 40), 8 * r.randint(1, 8), 8 * r.randint(1, 8)
    offs = torch.sort(torch.randint(0, T + 1, (E,))).values.to(torch.int32)
    x = torch.randn(T, K).to(BF16)
    w = torch.randn(E, N, K).to(BF16).transpose(1, 2)
    args = {"x": x, "w": w, "offs": offs}
    if r.random() < 0.3:
        args["out"] = torch.empty(T, N, dtype=BF16)
    if r.random() < 0.3:
        args["out_dtype"] = BF16
    if r.random() < 0.3:
        args["config"] = GemmConfig()
    return args, T


@pytest.mark.parametrize("i", range(CASES))
def test_grouped_mm_bad_input(i):
    r = random.Random(f"{SEED}/grouped_mm-args/{i}")
    args, T = _moe_args(r)

    def shape_of(y, a):
        assert isinstance(y, torch.Tensor) and y.dim() == a["x"].dim()
        _given_out(a, y)
        x, w, offs = a["x"], a["w"], a["offs"]
        if offs is None:  # the batched form
            ref = torch.bmm(x.double(), w.double())
        else:  # rows past offs[-1]: zero in a new result, untouched in a given one
            ref = grouped_mm_ref(x, w, offs, torch.float64)
            live = int(offs[-1]) if offs.numel() else 0
            y, ref = (y[:live], ref[:live]) if isinstance(a.get("out"), torch.Tensor) else (y, ref)
        _close(y, ref, "grouped_mm")

    _check("grouped_mm", i, moe_gemm.grouped_mm, args, ("x", "w", "offs"), T, shape_of)


def _gemm_lists(r: random.Random, most: int) -> tuple[list[tuple[int, int, int]], dict]:
    """Up to `most` small problems' sizes (M, N, K) and grouped_gemm's a and b lists."""
    sizes = [(r.randint(0, 9), 8 * r.randint(1, 4), 8 * r.randint(1, 4))
             for _ in range(r.randint(1, most))]
    return sizes, {"a": [torch.randn(m, k).to(BF16) for m, _, k in sizes],
                   "b": [torch.randn(k, n).to(BF16) for _, n, k in sizes]}


@pytest.mark.parametrize("i", range(CASES))
def test_grouped_gemm_bad_input(i):
    r = random.Random(f"{SEED}/grouped_gemm-args/{i}")
    sizes, args = _gemm_lists(r, 5)
    if r.random() < 0.3:
        args["out"] = [torch.empty(m, n, dtype=BF16) for m, n, _ in sizes]

    def shape_of(ys, a):
        assert isinstance(ys, list) and len(ys) == len(a["a"])
        _given_out(a, ys)
        for i, (y, ref) in enumerate(zip(ys, grouped_gemm_ref(a["a"], a["b"], torch.float64))):
            _close(y, ref, f"grouped_gemm[{i}]")

    _check("grouped_gemm", i, moe_gemm.grouped_gemm, args, ("a", "b"), 0, shape_of)


@pytest.mark.parametrize("i", range(CASES))
def test_grouped_mm_masked_bad_input(i):
    r = random.Random(f"{SEED}/masked-args/{i}")
    G, M, K, N = r.randint(1, 4), r.randint(1, 20), 8 * r.randint(1, 6), 8 * r.randint(1, 6)
    args = {"x": torch.randn(G, M, K).to(BF16), "w": torch.randn(G, K, N).to(BF16),
            "masked_m": torch.randint(0, M + 1, (G,), dtype=torch.int32)}
    if r.random() < 0.3:
        args["expected_m"] = r.choice([1, M, 0, -1, 2.5, "4"])

    def shape_of(y, a):
        assert isinstance(y, torch.Tensor) and y.dim() == 3
        # rows at and past masked_m[g] are unspecified
        for g, m in enumerate(a["masked_m"].reshape(-1).tolist()):
            _close(y[g, :m], a["x"][g, :m].double() @ a["w"][g].double(), f"masked[{g}]")

    _check("grouped_mm_masked", i, moe_gemm.grouped_mm_masked, args, ("x", "w", "masked_m"),
           M, shape_of)


@pytest.mark.parametrize("i", range(CASES))
def test_scaled_grouped_mm_bad_input(i):
    r = random.Random(f"{SEED}/scaled-args/{i}")
    gran = r.choice(["block", "row", "tensor"])
    E, T, K, N = r.randint(1, 4), r.randint(0, 30), 128 * r.randint(1, 2), 16 * r.randint(1, 9)
    x = torch.randn(T, K)
    w = torch.randn(E, N, K) / K ** 0.5
    if gran == "block":
        xq, sa = moe_gemm.quantize_fp8_per_token_group(x)
        wq, sb = moe_gemm.quantize_fp8_per_block(w)
        wq, sb = wq.transpose(1, 2), sb.transpose(1, 2)
    elif gran == "row":
        xq, sa = moe_gemm.quantize_fp8_per_row(x)
        wq, sb = moe_gemm.quantize_fp8_per_row(w)
        wq = wq.transpose(1, 2)
    else:
        xq, sa = moe_gemm.quantize_fp8_per_tensor(x)
        wq, sb = moe_gemm.quantize_fp8_per_tensor(w)
        wq = wq.transpose(1, 2)
    offs = torch.sort(torch.randint(0, T + 1, (E,))).values.to(torch.int32)
    args = {"x": xq, "w": wq, "scale_a": sa, "scale_b": sb, "offs": offs}

    def shape_of(y, a):
        assert isinstance(y, torch.Tensor)
        ref = scaled_grouped_mm_ref(a["x"], a["w"], a["scale_a"], a["scale_b"], a["offs"])
        _close(y, ref, "scaled_grouped_mm")

    _check("scaled_grouped_mm", i, moe_gemm.scaled_grouped_mm, args,
           ("x", "w", "scale_a", "scale_b", "offs"), T, shape_of)


@pytest.mark.parametrize("i", range(CASES))
def test_fused_grouped_mm_bad_input(i):
    r = random.Random(f"{SEED}/fused-args/{i}")
    args, T = _moe_args(r)
    args.pop("out", None)
    S = T
    if r.random() < 0.5:
        args["row_index"] = torch.randint(0, max(1, T), (S,))
    if r.random() < 0.5:
        args["row_weight"] = torch.rand(S)
    if r.random() < 0.3:
        args["bias"] = torch.randn(args["w"].shape[0], args["w"].shape[2])
    if r.random() < 0.5:
        args["gate"] = r.choice(["silu", "gelu", "clamped_swiglu", "relu", "SiLU"])
        args["gate_layout"] = r.choice(["concat", "interleaved", "alternating", "split"])

    def shape_of(y, a):
        assert isinstance(y, torch.Tensor) and y.dim() == 2
        opts = {n: a[n] for n in ("row_index", "row_weight", "bias", "gate", "gate_layout")
                if n in a}
        _close(y, fused_grouped_mm_ref(a["x"], a["w"], a["offs"], dtype=torch.float64, **opts),
               "fused_grouped_mm")

    _check("fused_grouped_mm", i, moe_gemm.fused_grouped_mm, args, ("x", "w", "offs"), T,
           shape_of)


QUANTIZERS = ["quantize_fp8_per_token_group", "quantize_fp8_per_block", "quantize_fp8_per_row",
              "quantize_fp8_per_tensor"]


@pytest.mark.parametrize("i", range(CASES // 2))
def test_quantizers_bad_input(i):
    r = random.Random(f"{SEED}/quantize-args/{i}")
    name = r.choice(QUANTIZERS)
    shape = (r.randint(1, 3), 128 * r.randint(1, 2), 128 * r.randint(1, 2))
    args = {"x": torch.randn(shape[r.randint(0, 1):]).to(r.choice([BF16, torch.float32]))}
    if r.random() < 0.4:
        args["dtype"] = r.choice([E4M3, torch.float8_e5m2, BF16, "e4m3"])

    def shape_of(res, a):
        q, s = res
        assert isinstance(q, torch.Tensor) and isinstance(s, torch.Tensor)

    _check(name, i, getattr(moe_gemm, name), args, ("x",), 0, shape_of)


@pytest.mark.parametrize("i", range(CASES // 2))
def test_grouped_gemm_plan_bad_input(i):
    """Building a plan from mistaken lists, and calling a good plan with mistaken tensors."""
    r = random.Random(f"{SEED}/plan-args/{i}")
    sizes, args = _gemm_lists(r, 4)

    def built(plan, a):
        assert isinstance(plan, moe_gemm.GroupedGemmPlan)

    _check("GroupedGemmPlan", i, moe_gemm.GroupedGemmPlan, args, ("a", "b"), 0, built)
    plan = moe_gemm.GroupedGemmPlan(args["a"], args["b"])

    def called(ys, a):
        assert isinstance(ys, list) and len(ys) == len(sizes)

    _check("GroupedGemmPlan call", i, plan, args, ("a", "b"), 0, called)


# MoE(hidden_size, intermediate_size, num_experts, top_k, **options): a user's mistakes in the
# layer's arguments.
MOE_MISTAKES: dict[str, list[Any]] = {
    "hidden_size": [0, -8, 8.5, "64", None, True],
    "intermediate_size": [0, -1, 3.0, "x", None],
    "num_experts": [0, -2, 2.0, None],
    "top_k": [0, 9, -1, 1.5, None],
    "scoring": ["softmax ", "sigmoid_", 3, None],
    "n_group": [0, 3, -1, 2.0],
    "topk_group": [0, 5, 1.0],
    "routed_scaling_factor": [float("nan"), float("inf"), "2", -1.0, 0.0],
    "router_jitter_noise": [-0.1, float("nan"), "0"],
    "activation": ["swish!", 3, None, "relu2"],
    "shared_intermediate_size": [-1, 1.5, "8"],
    "dtype": ["bf16", torch.int32, 16],
    "config": [{"backend": "torch"}, "cute"],
    "fused": ["yes", 1, 0.0],
}


@pytest.mark.parametrize("i", range(CASES // 2))
def test_moe_layer_bad_arguments(i):
    r = random.Random(f"{SEED}/moe-args/{i}")
    kw = {"hidden_size": 64, "intermediate_size": 32, "num_experts": 8, "top_k": 2,
          "n_group": 2, "topk_group": 1}
    done = []
    for name in r.sample(sorted(MOE_MISTAKES), r.choice([1, 1, 2])):
        kw[name] = r.choice(MOE_MISTAKES[name])
        done.append(f"{name}={kw[name]!r}")
    try:
        layer = moe_gemm.MoE(**kw)
    except (TypeError, ValueError):
        return
    except Exception as exc:  # noqa: BLE001 - the point: name the wrong exception type
        raise AssertionError(f"seed={SEED} MoE[{i}] ({'; '.join(done)}): "
                             f"{type(exc).__name__}: {str(exc)[:300]}") from None
    # accepted: a forward of the documented shape
    x = torch.randn(3, layer.hidden_size, dtype=layer.router_weight.dtype)
    with torch.no_grad():
        assert layer(x).shape == x.shape

