"""The fused MoE kernel's default pick against other configs, on MoE layers' two expert GEMMs.

    python -m benchmarks.fused_configs [--models deepseek-v3-ep8,qwen3-30b-a3b]
        [--layer H,I,E,K[,gpt-oss] ...] [--tokens 4096,16384] [--up 'pp 128x192 c2x1' ...]
        [--down 'pp 128x128 c1x2' ...] [--rounds 7] [--order-seed 0] [--out FILE] [--smoke]

The fused layer's GEMMs take a tuned table's entries of their own forms where it has them
(moe_gemm.ops.tuned.FUSED_FORMS: `python -m benchmarks.fused_adopt` writes them from this
benchmark's --out file), else grouped_mm's pick for the shape (its tuned table, then the rules)
fitted to the fused options (ops/fused_launch.fit_fused:
a gated tile's N a multiple of 32, the epilogue's register cap, and the in-kernel gather only
where it keeps that tile; elsewhere the plan gathers with index_select, and the time here
includes it). This measures what another config would give, per model and token count:

- up: fused_grouped_mm(x, w_gate_up, offs, row_index=token, gate=...) (the layer's gather and
  gated activation; gpt-oss: biases and clamped SwiGLU over alternating columns);
- down: fused_grouped_mm(h, w_down, offs, row_weight=...) (gpt-oss: with its bias).

A variant is "CONFIG [wide|select] [nofence] [ieeegate] [noswap] [control]" or "default" with
those words: CONFIG as
`moe-gemm tune` names configs (tuning/space.py: "pp|coop MxN [cAxB] [sS] [pP[n][s]]", e.g.
"coop 256x192 c2x1 p8ns", or "swap 256x128": swapped tiles); `noswap` runs it with
MOE_GEMM_SWAP_AB=0 (where the default would take swapped tiles, the M-side tiles); `control`
changes nothing ("default control": the default timed again under a second name, what the
harness gives one kernel twice); `wide` runs it with MOE_GEMM_FUSED_GATHER_WIDE=1 (the up
GEMM's gather in the kernel at every batch size, also on tiles past 128 rows or 128
accumulator registers), `nofence` with MOE_GEMM_GATHER_FENCE=0 (an in-kernel gather without
the math warps' proxy fence before each gathered stage), `ieeegate` with
MOE_GEMM_FUSED_FAST_GATE=0 (SiLU's sigmoid from the IEEE exp and divide, not the SFU's
approximations), `select` gathers the up GEMM's rows with index_select
first, as the plan does where the kernel does not gather (its time included). The default (no
config) is always the first. "unfused" (or "unfused noswap") is the unfused layer's way
instead: grouped_mm on its own choice (swapped tiles where its rules take them; "noswap":
without) writing every column, then the bias, the gate and the row weight as torch ops (the
up GEMM's rows gathered with index_select first). With `--quack`, a peer row: QuACK's own
kernel for the same GEMM, autotuned (quack.gemm_interface, tuned=True, what SonicMoE calls): for gate-up its gated
GEMM with its A gather (A_idx, SwiGLU over concatenated gate/up columns), for down its varlen
GEMM (with the bias, without the row weights, which ours applies in its epilogue: its output is
checked scaled by them); not for gpt-oss's gate-up (its clamped SwiGLU over alternating
columns).
QUACK_PRINT_AUTOTUNING=1 prints the config its autotuner picked. Every variant's output is
checked against the default's before timing (a mismatch is an error, not a time). Kernels are
compiled first, in parallel. Timing: `--calls` back-to-back calls between CUDA events, variants
interleaved round by round (the layer bench's order: a shuffle each round seeded by
`--order-seed`, each batch behind half a batch of warm-up), the median round. What precedes a
kernel moves its time (power state): an H200 ran one config 1.024-1.030x faster under one name
than under another in two runs of the same order (2026-12-04), so a run that confirms leaders
takes another seed. Routing: each token's top-k distinct experts of seeded random logits with a
linear skew across experts. The rows print us | TFLOP/s | GB/s | ratio (the default's time
over the variant's: above 1, faster).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks.bench_moe_layer import round_order, time_calls, warm_calls, with_env  # noqa: E402
from benchmarks.report import write_json  # noqa: E402
from benchmarks.runner import counts_problem, names_problem, split_names  # noqa: E402
from moe_gemm import GemmConfig  # noqa: E402
from moe_gemm.capability import sm_count  # noqa: E402
from moe_gemm.ops.fused import fused_grouped_mm  # noqa: E402
from moe_gemm.ops.heuristics import choice_fields  # noqa: E402
from moe_gemm.ops.tuned import fused_form  # noqa: E402
from moe_gemm.tuning import space  # noqa: E402

MODELS: dict[str, dict[str, Any]] = {  # (the layers of benchmarks.bench_moe_layer)
    "deepseek-v3-ep8": dict(kind="deepseek", H=7168, I=2048, E=32, k=8),
    "qwen3-30b-a3b": dict(kind="qwen3", H=2048, I=768, E=128, k=8),
    "gpt-oss-120b": dict(kind="gpt-oss", H=2880, I=2880, E=128, k=4),
    "mixtral-8x7b": dict(kind="mixtral", H=4096, I=14336, E=8, k=2),
    # (gate-up widths 2I from 2048 to 3072: where the in-kernel gather and index_select cross)
    "olmoe-1b-7b": dict(kind="qwen3", H=2048, I=1024, E=64, k=8),
    "qwen3-235b-a22b": dict(kind="qwen3", H=4096, I=1536, E=128, k=8),
    "glm-4.5": dict(kind="qwen3", H=5120, I=1536, E=160, k=8),
    # (down GEMMs of long K: where the down GEMM's swapped tiles pay, fused_launch.swappable)
    "mixtral-8x22b": dict(kind="mixtral", H=6144, I=16384, E=8, k=2),
    "llama-4-scout": dict(kind="llama4", H=5120, I=8192, E=16, k=1),
}
DEFAULT_MODELS = "deepseek-v3-ep8,qwen3-30b-a3b"


def parse_layer(text: str) -> tuple[str, dict[str, Any]]:
    """'H,I,E,K[,gpt-oss]' -> (its name, a layer as MODELS holds them); ValueError naming the
    form."""
    parts = [p.strip() for p in text.split(",")]
    kind = parts.pop() if len(parts) == 5 and parts[-1] == "gpt-oss" else "custom"
    try:
        H, I, E, k = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"--layer is 'H,I,E,K[,gpt-oss]' (positive integers, K <= E), "
                         f"e.g. '2880,2880,128,4,gpt-oss'; got {text!r}") from None
    if min(H, I, E, k) <= 0 or k > E:
        raise ValueError(f"--layer is 'H,I,E,K[,gpt-oss]' (positive integers, K <= E); "
                         f"got {text!r}")
    return f"layer-{H}x{I}x{E}x{k}" + ("-gpt-oss" if kind == "gpt-oss" else ""), dict(
        kind=kind, H=H, I=I, E=E, k=k)


SMOKE_MODELS = {name: dict(m, H=64, I=32, E=8, k=min(m["k"], 4)) for name, m in MODELS.items()}
UP = ("coop 128x256", "coop 128x256 c2x1", "coop 256x128 c2x1", "coop 256x192",
      "coop 256x192 c2x1", "coop 256x160 c2x1", "pp 128x192 c2x1", "pp 128x128 c2x1",
      "pp 128x192", "pp 128x192 wide", "pp 128x192 c2x1 wide", "coop 256x192 c2x1 wide")
DOWN = ("coop 256x128 c2x1", "coop 256x192 c2x1", "coop 256x208 c2x1", "coop 128x256 c2x1",
        "pp 128x192 c2x1", "pp 128x128 c1x2", "coop 256x128 c1x2", "pp 64x256 c2x1")
DEFAULT = "default"
QUACK = "QuACK (tuned)"


GATHER_WORDS = ("wide", "select")  # how the up GEMM gathers (at most one)
# ("control" changes nothing: "default control" is the default's kernel timed again under a
# second name, the run's own A/A margin)
OPTION_WORDS = GATHER_WORDS + ("nofence", "ieeegate", "noswap", "control")  # a variant's trailing words


def variant_words(text: str) -> tuple[list[str], set[str]]:
    """(the config's words, the trailing option words) of a variant."""
    words = text.split()
    options: set[str] = set()
    while words and words[-1] in OPTION_WORDS and words[-1] not in options:
        options.add(words.pop())
    return words, options


UNFUSED = "unfused"


def is_unfused(text: str) -> bool:
    """Whether a variant is the unfused way ('unfused' or 'unfused noswap')."""
    return text.split()[:1] == [UNFUSED]


def parse_variant(text: str) -> GemmConfig | None:
    """'coop 256x192 c2x1 [wide|select] [nofence] [ieeegate] [noswap]' -> its GemmConfig (ValueError naming the
    form); 'default', alone or with option words -> None (the default's kernel, under them:
    the bare word is the row every case times first anyway)."""
    if is_unfused(text):
        if text.split() not in ([UNFUSED], [UNFUSED, "noswap"]):
            raise ValueError(f"the unfused variant is 'unfused' or 'unfused noswap'; got {text!r}")
        return GemmConfig(swap_ab=False) if "noswap" in text.split() else GemmConfig()
    words, options = variant_words(text)
    if options >= set(GATHER_WORDS):
        raise ValueError(f"a variant gathers one way, [wide|select]; got {text!r}")
    if words == [DEFAULT]:
        return None
    try:
        fields = space.parse_name(" ".join(words))
        if fields.get("visitor") == "host":
            raise ValueError("the fused kernels take the device visitor")
        return space.config_of(fields, backend="auto")
    except (TypeError, ValueError) as exc:
        raise ValueError(f"a variant is 'pp|coop MxN [cAxB] [sS] [pP[n][s]] [wide|select] "
                         f"[nofence] [ieeegate] [noswap]', e.g. 'coop 256x192 c2x1'; got {text!r} ({exc})"
                         ) from None


def variant_env(text: str) -> dict[str, str]:
    """The environment a variant runs under ('wide': the wide in-kernel gather; 'nofence': the
    gather without the proxy fence; 'ieeegate': the IEEE sigmoid in the gated epilogue;
    'noswap': no swapped tiles)."""
    from moe_gemm.ops.heuristics import (
        FAST_GATE_ENV,
        GATHER_FENCE_ENV,
        GATHER_WIDE_ENV,
        SWAP_AB_ENV,
    )

    options = variant_words(text)[1]
    env = {GATHER_WIDE_ENV: "1"} if "wide" in options else {}
    if "nofence" in options:
        env[GATHER_FENCE_ENV] = "0"
    if "ieeegate" in options:
        env[FAST_GATE_ENV] = "0"
    if "noswap" in options:
        env[SWAP_AB_ENV] = "0"
    return env


def selects_first(text: str) -> bool:
    """Whether a variant gathers the up GEMM's rows with index_select before the kernel."""
    return "select" in variant_words(text)[1]


def variant_kw(kw: dict, text: str, gathered: torch.Tensor | None = None) -> dict:
    """The fused call's arguments for a variant: 'select' passes the routed rows (gathered, or an
    empty stand-in of their shape for choosing kernels) instead of x and row_index."""
    if not selects_first(text) or kw.get("row_index") is None:
        return kw
    rest = {k: v for k, v in kw.items() if k not in ("x", "row_index")}
    if gathered is None:
        gathered = kw["x"].new_empty((kw["row_index"].shape[0], kw["x"].shape[1]))
    return dict(rest, x=gathered)


def unfused_call(kw: dict, cfg: GemmConfig):
    """The unfused layer's way for the fused call `kw`: index_select, grouped_mm writing every
    column on its own choice under cfg, then bias, gate and row weight as torch ops."""
    from moe_gemm import grouped_mm
    from moe_gemm.ops.fused_reference import expert_of_rows, gate_torch, split_gate_up

    def run():
        x = kw["x"]
        if kw.get("row_index") is not None:
            x = x.index_select(0, kw["row_index"])
        h = grouped_mm(x, kw["w"], kw["offs"], config=cfg)
        if kw.get("bias") is not None:
            expert = expert_of_rows(kw["offs"], h.shape[0]).clamp(max=kw["w"].shape[0] - 1)
            h = h + kw["bias"].to(h.dtype).index_select(0, expert)
        if kw.get("gate") is not None:
            h = gate_torch(kw["gate"], *split_gate_up(h, kw["gate_layout"]),
                           kw.get("gate_alpha", 1.702), kw.get("gate_limit", 7.0))
        if kw.get("row_weight") is not None:
            h = h * kw["row_weight"].to(h.dtype)[:, None]
        return h

    return run


def variant_call(kw: dict, cfg, text: str):
    """The variant's timed call, under its environment ('select': the index_select included)."""
    if is_unfused(text):
        return unfused_call(kw, cfg)
    if selects_first(text) and kw.get("row_index") is not None:
        def run():
            gathered = kw["x"].index_select(0, kw["row_index"])
            return fused_grouped_mm(**variant_kw(kw, text, gathered), config=cfg)
    else:
        def run():
            return fused_grouped_mm(**kw, config=cfg)
    return with_environment(run, variant_env(text))


def with_environment(fn, env: dict[str, str]):
    """fn with `env` set during each call (the plans key on the switches they read)."""
    return with_env(fn, env) if env else fn


def quack_peer(case: dict) -> tuple[Any, Any, str | None]:
    """QuACK's autotuned kernel for the case's GEMM: (the timed call, a call returning the
    output to check against ours, None), or (None, None, why not)."""
    kw = case["kw"]
    if case["proj"] == "up" and (kw["gate"] != "silu" or kw["gate_layout"] != "concat"):
        return None, None, "QuACK's gated GEMM has no clamped SwiGLU over alternating columns"
    if kw["x"].device.type != "cuda":
        return None, None, "QuACK runs on a GPU only"
    try:
        from quack.gemm_interface import gemm, gemm_gated  # type: ignore[import-not-found]
    except Exception as exc:  # noqa: BLE001 - recorded
        return None, None, f"import quack failed: {type(exc).__name__}: {exc}"[:200]
    x, w, offs = kw["x"], kw["w"], kw["offs"]
    cu = torch.cat([offs.new_zeros(1), offs]).to(torch.int32)  # (E + 1,) row starts
    if case["proj"] == "up":
        idx = kw["row_index"]
        out = torch.empty(idx.shape[0], w.shape[2] // 2, dtype=x.dtype, device=x.device)

        def up() -> torch.Tensor:
            gemm_gated(x, w, activation="swiglu", cu_seqlens_m=cu, A_idx=idx, postact_out=out,
                       store_preact=False, concat_layout=("B",))
            return out

        return up, up, None
    out = torch.empty(x.shape[0], w.shape[2], dtype=x.dtype, device=x.device)
    weight = kw["row_weight"][:, None]

    def down() -> torch.Tensor:
        gemm(x, w, out=out, bias=kw.get("bias"), cu_seqlens_m=cu)
        return out

    return down, (lambda: down().float() * weight), None


def agreement(y: torch.Tensor, ref: torch.Tensor, case: dict, name: str, against: str
              ) -> float:
    """y's relative max difference from ref; an AssertionError past 2e-2 (a wrong output is
    an error, not a time)."""
    err = ((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
    if not err <= 2e-2:
        raise AssertionError(f"{case['model']} {case['proj']} {name}: output differs from "
                             f"{against} by {err:.3g} (relative max)")
    return err


def peer_row(case: dict, ref: torch.Tensor | None) -> tuple[dict, Any]:
    """QuACK's row for the case (quack_peer) and its timed call, or the row saying why not; its
    output checked against ours (ref) first."""
    row = dict(model=case["model"], proj=case["proj"], tokens=case["tokens"], variant=QUACK,
               peer=True)
    if ref is None:
        return dict(row, error="no variant of ours ran to check it against"), None
    fn, checked, why = quack_peer(case)
    if fn is None:
        return dict(row, error=why), None
    try:
        y = checked().float()  # (its first call autotunes)
    except Exception as exc:  # noqa: BLE001 - a peer that fails is recorded
        return dict(row, error=f"{type(exc).__name__}: {exc}"[:300]), None
    return dict(row, rel_err=agreement(y, ref, case, "QuACK", "ours")), fn


def layer_case(m: dict, T: int, device: torch.device, dtype: torch.dtype,
               seed: int = 0) -> dict[str, dict]:
    """The two fused calls' keyword arguments (besides config) and their FLOPs and bytes."""
    H, I, E, k = m["H"], m["I"], m["E"], m["k"]
    g = torch.Generator(device="cpu").manual_seed(seed)
    logits = torch.randn(T, E, generator=g) + torch.linspace(0.0, 1.0, E)
    expert = logits.topk(k, dim=1).indices.reshape(-1)
    order = torch.argsort(expert, stable=True)
    token = (order // k).to(torch.int32).to(device)
    offs = torch.cumsum(torch.bincount(expert, minlength=E), 0).to(torch.int32).to(device)
    S = T * k

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    gpt = m["kind"] == "gpt-oss"
    # The layers' weight layouts: K-major gate_up_proj (E, 2I, H) seen as (E, H, 2I), gpt-oss's
    # N-major (E, H, 2I) with alternating gate/up columns.
    w1 = rand(E, H, 2 * I, scale=0.02) if gpt else rand(E, 2 * I, H, scale=0.02).transpose(1, 2)
    w2 = rand(E, I, H, scale=0.02) if gpt else rand(E, H, I, scale=0.02).transpose(1, 2)
    up = dict(x=rand(T, H), w=w1, offs=offs, row_index=token,
              gate="clamped_swiglu" if gpt else "silu",
              gate_layout="alternating" if gpt else "concat")
    down = dict(x=rand(S, I), w=w2, offs=offs,
                row_weight=torch.rand(S, generator=g).to(device))
    if gpt:
        up["bias"] = torch.randn(E, 2 * I, generator=g).to(device)
        down["bias"] = torch.randn(E, H, generator=g).to(device)
    size = torch.finfo(dtype).bits // 8
    name = str(dtype).removeprefix("torch.")
    return {
        "up": dict(kw=up, flops=2 * S * H * 2 * I,
                   bytes=(T * H + E * H * 2 * I + S * I) * size,
                   shape=dict(form=fused_form(True, gpt), dtype=name, out_dtype=name, E=E,
                              N=2 * I, K=H, rows=S)),
        "down": dict(kw=down, flops=2 * S * I * H, bytes=(S * I + E * I * H + S * H) * size,
                     shape=dict(form=fused_form(False, gpt), dtype=name, out_dtype=name, E=E,
                                N=H, K=I, rows=S)),
    }


def kernel_choices(case: dict, device: torch.device, nsm: int) -> dict[str, tuple | None]:
    """Per variant: (the fitted KernelChoice, whether the kernel gathers), None where the
    fused options cannot build it (reported when the variant runs)."""
    from moe_gemm.ops.fused_launch import fused_choice
    from moe_gemm.ops.fused_validation import check_fused_mm

    picked: dict[str, tuple | None] = {}
    for name, cfg in case["configs"].items():
        if is_unfused(name):
            picked[name] = None  # (grouped_mm's kernels: compiled at the check call)
            continue
        args = check_fused_mm(**variant_kw(case["kw"], name))
        try:
            picked[name] = with_environment(
                lambda cfg=cfg, args=args: fused_choice(args, cfg or GemmConfig(), nsm, device),
                variant_env(name))()
        except ValueError:
            picked[name] = None
    return picked


def describe(choice, in_kernel: bool) -> str:
    """A fitted choice in the tuner's notation, e.g. 'coop 128x256 c2x1 s3 p16 ew, in-kernel
    gather' (stages named where the choice pins them, else the kernel takes what fits)."""
    return space.name_of(choice_fields(choice, "varlen")) + (
        ", in-kernel gather" if in_kernel else "")


def compile_keys(cases: list[dict], device: torch.device, nsm: int) -> set:
    """The kernels the variants launch, for the parallel precompile."""
    from moe_gemm.ops import launch_kernel
    from moe_gemm.ops.fused_launch import fused_key
    from moe_gemm.ops.fused_validation import check_fused_mm
    from moe_gemm.ops.heuristics import choose_varlen

    keys = set()
    for case in cases:
        major = "k" if case["kw"]["w"].stride(1) == 1 else "n"
        for name, picked in kernel_choices(case, device, nsm).items():
            if is_unfused(name):  # grouped_mm's choice, as its plan makes it (ops/mm_launch)
                kw = case["kw"]
                E, K, N = kw["w"].shape
                bf16 = kw["x"].dtype
                S = (kw["x"] if kw.get("row_index") is None else kw["row_index"]).shape[0]
                choice = choose_varlen(case["configs"][name], S, E, N, K, nsm, bf16.itemsize,
                                       **launch_kernel.table_keys(device, bf16, bf16),
                                       swap_ok=True)
                keys.add(launch_kernel._compile_key("varlen", bf16, bf16, major, choice, False))
            elif picked is not None:
                args = check_fused_mm(**variant_kw(case["kw"], name))
                keys.add(with_environment(  # (fused_key reads the sigmoid's switch)
                    lambda args=args, picked=picked: fused_key(args, picked[0], major,
                                                               picked[1]),
                    variant_env(name))())
    return keys


def time_interleaved(fns: list, rounds: int, calls: int, device: torch.device,
                     order_seed: int = 0) -> list[float]:
    """Median ms per call of each fn, interleaved round by round in the layer bench's round
    order (a shuffle per round from order_seed), each batch behind its own warm-up
    (bench_moe_layer.round_order, warm_calls)."""
    times: list[list[float]] = [[] for _ in fns]
    for r in range(rounds):
        for i in round_order(range(len(fns)), r, order_seed):
            time_calls(fns[i], warm_calls(calls), device)
            times[i].append(time_calls(fns[i], calls, device))
    return [statistics.median(t) for t in times]


def run_case(case: dict, rounds: int, calls: int, device: torch.device,
             picked: dict[str, tuple | None] | None = None, quack: bool = False,
             order_seed: int = 0) -> list[dict]:
    """One GEMM's variants: checked against the default, then timed. picked: each variant's
    kernel choice (kernel_choices; GPU runs), recorded as the row's 'kernel'; quack: QuACK's
    autotuned kernel as a peer row (quack_peer)."""
    rows, fns, ref = [], [], None
    for name, cfg in case["configs"].items():
        row: dict[str, Any] = dict(model=case["model"], proj=case["proj"],
                                   tokens=case["tokens"], variant=name, shape=case["shape"])
        if picked and picked.get(name) is not None:
            row["kernel"] = describe(*picked[name])
            row["fields"] = choice_fields(picked[name][0], "varlen")
        fn = variant_call(case["kw"], cfg, name)
        try:
            y = fn().float()
        except ValueError as exc:  # a config the fused options cannot build
            rows.append(dict(row, error=str(exc)))
            continue
        if ref is None:
            ref = y
        err = agreement(y, ref, case, name, "the default's")
        fn()  # (warm)
        rows.append(dict(row, rel_err=err))
        fns.append((rows[-1], fn))
    if quack:
        row, fn = peer_row(case, ref)
        rows.append(row)
        if fn is not None:
            fns.append((row, fn))
    if device.type == "cuda":
        torch.cuda.synchronize()
    ms = time_interleaved([f for _, f in fns], rounds, calls, device, order_seed)
    base = ms[0]
    for (row, _), t in zip(fns, ms):
        row.update(us=round(t * 1e3, 2), tflops=round(case["flops"] / t / 1e9, 1),
                   gbps=round(case["bytes"] / t / 1e6, 1), ratio=round(base / t, 3))
    return rows


def build_cases(args: argparse.Namespace, device: torch.device) -> list[dict]:
    models = dict(SMOKE_MODELS if args.smoke else MODELS)
    for text in args.layer or ():
        name, layer = parse_layer(text)
        models[name] = layer
    dtype = torch.float32 if args.smoke else torch.bfloat16
    variants = {"up": args.up if args.up is not None else list(UP),
                "down": args.down if args.down is not None else list(DOWN)}
    cases = []
    names = [] if args.layer and args.models is None else (args.models or DEFAULT_MODELS).split(",")
    for name in names + [parse_layer(text)[0] for text in args.layer or ()]:
        for T in (int(t) for t in args.tokens.split(",")):
            for proj, case in layer_case(models[name], T, device, dtype).items():
                configs = {DEFAULT: None}
                configs.update({v: parse_variant(v) for v in variants[proj]})
                cases.append(dict(case, model=name, proj=proj, tokens=T, configs=configs))
    return cases


def table(rows: list[dict]) -> str:
    lines = [f"{'model':16} {'proj':5} {'tokens':>6} {'variant':20} {'us':>10} {'TFLOP/s':>8} "
             f"{'GB/s':>8} {'ratio':>6}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['model']:16} {r['proj']:5} {r['tokens']:6d} {r['variant']:20} "
                         f"not built: {r['error'][:60]}")
            continue
        lines.append(f"{r['model']:16} {r['proj']:5} {r['tokens']:6d} {r['variant']:20} "
                     f"{r['us']:10.1f} {r['tflops']:8.1f} {r['gbps']:8.1f} {r['ratio']:6.3f}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fused_configs",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=None,
                   help=f"comma-separated subset of {','.join(MODELS)} (default "
                        f"{DEFAULT_MODELS}, none where --layer is given)")
    p.add_argument("--layer", action="append", default=None, metavar="H,I,E,K[,gpt-oss]",
                   help="a layer of your own (repeatable): hidden size, expert intermediate "
                        "size, experts, top-k; 'gpt-oss' for biases and clamped SwiGLU over "
                        "alternating columns (else SiLU over concat weights)")
    p.add_argument("--tokens", default="16384", help="comma-separated token counts")
    p.add_argument("--up", action="append", default=None,
                   help="a gate-up variant (repeatable; default: a built-in list)")
    p.add_argument("--down", action="append", default=None,
                   help="a down variant (repeatable; default: a built-in list)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=3, help="calls per timed batch")
    p.add_argument("--order-seed", type=int, default=0,
                   help="seeds the rounds' shuffled order; a run repeated to confirm leaders "
                        "takes another (the same order repeats any bias of what precedes what)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile workers")
    p.add_argument("--compile-timeout", type=float, default=300.0)
    p.add_argument("--quack", action="store_true",
                   help="add QuACK's autotuned kernel for each GEMM as a peer row")
    p.add_argument("--out", help="write the JSON here")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes on the CPU (fp32, the torch backend): the harness only")
    return p


def arg_problem(args: argparse.Namespace) -> str | None:
    """Why the arguments cannot make a run, or None (checked before any work: a bad --tokens
    or --rounds ended in a traceback, and a bad --out only after the whole run)."""
    from moe_gemm.tuning.argcheck import output_problem

    if args.models is not None and (why := names_problem(args.models, list(MODELS))):
        return why
    if why := counts_problem(args.tokens):
        return why
    if args.rounds < 1 or args.calls < 1:
        return f"--rounds and --calls must be at least 1; got {args.rounds} and {args.calls}"
    return output_problem(Path(args.out), "--out") if args.out else None


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    problem = arg_problem(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.models is not None:
        args.models = ",".join(split_names(args.models))
    device = torch.device("cpu" if args.smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA GPU (use --smoke on a CPU)", file=sys.stderr)
        return 2
    try:
        cases = build_cases(args, device)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result: dict[str, Any] = {
        "suite": "fused-configs", "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "timing": dict(rounds=args.rounds, calls=args.calls, order_seed=args.order_seed),
        "precompile": None,
    }
    if device.type == "cuda":
        from benchmarks.bench_moe_layer import precompile

        result["precompile"] = precompile(compile_keys(cases, device, sm_count(device)),
                                          args.jobs, args.compile_timeout)
    rows = []
    for case in cases:
        picked = kernel_choices(case, device, sm_count(device)) if device.type == "cuda" else None
        rows += run_case(case, args.rounds, args.calls, device, picked, args.quack,
                         args.order_seed)
    result["rows"] = rows
    if args.out:
        write_json(Path(args.out), result)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
