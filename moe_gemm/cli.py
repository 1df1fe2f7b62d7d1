"""The `moe-gemm` command: info, check, demo, bench, tune.

Arguments are parsed before anything heavy loads: `--help` and `--version` import neither torch
nor the ops (~1.5-4 s), and each command imports what it needs when it runs. `bench` and `tune`
hand their arguments to their own modules (benchmarks/bench.py in a checkout,
moe_gemm.tuning.cli).
"""

from __future__ import annotations

import argparse
import os
import sys

from moe_gemm.env import LIBRARY_VARIABLES, EnvError, refused_variables, variables_set
from moe_gemm.env import text_value as env_text


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def info_dict() -> dict[str, object]:
    import platform

    import torch

    from moe_gemm._version import __version__
    from moe_gemm.capability import cute_problem

    device: dict[str, object] = {"cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        idx = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(idx)
        device.update(
            name=props.name,
            capability=f"sm_{props.major}{props.minor}",
            sm_count=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
        )
    env = {k: v for k, v in variables_set().items() if k in LIBRARY_VARIABLES}
    # Each value judged by the parser the library reads it with: what a call would refuse.
    refused = refused_variables()
    try:
        problem = cute_problem()
    except EnvError:  # MOE_GEMM_DISABLE_CUTE refused (in `refused`): every op raises
        problem = "MOE_GEMM_DISABLE_CUTE is set to a value the library refuses"
        picks = None
    else:
        picks = "cute" if problem is None else "torch"
    return {
        "moe_gemm": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "nvidia-cutlass-dsl": _version("nvidia-cutlass-dsl"),
        "apache-tvm-ffi": _version("apache-tvm-ffi"),
        "device": device,
        "backends": {
            "cute": "usable" if problem is None else f"not usable: {problem}",
            "torch": "usable",
        },
        "auto_picks": picks,
        "environment": env,
        "environment_refused": refused,
        "environment_other": [k for k in variables_set() if k not in LIBRARY_VARIABLES],
    }


def cmd_info(args: argparse.Namespace) -> int:
    info = info_dict()
    refused = info["environment_refused"]
    assert isinstance(refused, dict)
    rc = 1 if refused else 0
    if args.json:
        import json

        print(json.dumps(info, indent=2))
        return rc
    print(f"moe_gemm {info['moe_gemm']}  (python {info['python']}, torch {info['torch']}, "
          f"nvidia-cutlass-dsl {info['nvidia-cutlass-dsl']}, tvm-ffi {info['apache-tvm-ffi']})")
    dev = info["device"]
    assert isinstance(dev, dict)
    if dev.get("cuda_available"):
        print(f"device:   {dev['name']} ({dev['capability']}, {dev['sm_count']} SMs, "
              f"{dev['memory_gib']} GiB)")
    else:
        print("device:   no CUDA GPU visible")
    backends = info["backends"]
    assert isinstance(backends, dict)
    for name, status in backends.items():
        print(f"backend {name:5s} {status}")
    print(f"backend='auto' uses: {info['auto_picks'] or 'nothing: every op refuses the environment'}")
    env = info["environment"]
    assert isinstance(env, dict)
    for name, value in env.items():
        # (a value that is not valid text, e.g. bytes undecodable in the locale, as its
        # escapes: printed raw it was a UnicodeEncodeError traceback on a strict stdout)
        shown = value.encode("utf-8", "backslashreplace").decode() if isinstance(
            value, str) else value
        print(f"env      {name}={shown}  ({LIBRARY_VARIABLES[name]})")
        if name in refused:
            print(f"         REFUSED: {refused[name]}")
        elif name == "MOE_GEMM_TUNED_TABLE" and (path := env_text(name, value)) and (
                not os.path.isfile(path)):
            # (not a refusal: the lookup warns once and goes on without it)
            what = ("a folder" if os.path.isdir(path) else
                    "a device or other special file" if os.path.exists(path) else "no such file")
            print(f"         NOTE: {what}, not a table; the kernels' config lookup warns and "
                  "skips it")
    others = info["environment_other"]
    assert isinstance(others, list)
    if others:
        # (values not shown: the server's API keys are among them)
        print(f"env      also set, not read by the library: {', '.join(others)}")
    if refused:
        print(f"moe-gemm info: the library refuses {', '.join(refused)} (see REFUSED above)",
              file=sys.stderr)
    return rc


CHECK_MARKERS = ("wgmma.mma_async", "cp.async.bulk.tensor", "setmaxnreg")
# FP8 variants also: e4m3/e5m2 WGMMAs and the promotion's fp32 adds (FMAs with block scales).
FP8_MARKERS = {"float8_e4m3fn": ".e4m3.e4m3", "float8_e5m2": ".e5m2.e5m2"}


def check_variants(full: bool):
    from moe_gemm.config import COOPERATIVE_TILES, PINGPONG_TILES
    from moe_gemm.kernels.sm90.compile import CompileKey

    keys = []
    for form in ("general", "varlen"):
        for schedule in ("pingpong", "cooperative"):
            for visitor in ("device", "host"):
                for ab in ("bfloat16", "float16"):
                    tile = (128, 128)
                    keys.append(CompileKey(form, ab, ab, "k", schedule, visitor, *tile))
    keys.append(CompileKey("general", "bfloat16", "float32", "n", "pingpong", "device", 128, 128))
    keys.append(CompileKey("varlen", "bfloat16", "bfloat16", "n", "cooperative", "device", 128,
                           256))
    keys.append(CompileKey("general", "bfloat16", "bfloat16", "k", "pingpong", "device", 128, 128,
                           None, True))
    # The variants the heuristics pick by default for the suite shapes.
    keys.append(CompileKey("general", "bfloat16", "bfloat16", "n", "cooperative", "device", 128,
                           256, 3))
    keys.append(CompileKey("general", "bfloat16", "bfloat16", "n", "pingpong", "device", 128, 192))
    keys.append(CompileKey("varlen", "bfloat16", "bfloat16", "k", "pingpong", "device", 64, 256))
    keys.append(CompileKey("varlen", "bfloat16", "bfloat16", "k", "pingpong", "device", 128, 192))
    keys.append(CompileKey("batched", "bfloat16", "bfloat16", "n", "cooperative", "device", 128,
                           256, 3, cluster_n=2))
    keys.append(CompileKey("general", "bfloat16", "bfloat16", "n", "cooperative", "device", 128,
                           256, 3, cluster_n=2))
    keys.append(CompileKey("general", "float16", "float32", "k", "cooperative", "device", 128,
                           128, cluster_m=2))
    keys.append(CompileKey("varlen", "bfloat16", "bfloat16", "k", "cooperative", "device", 128,
                           256, 3, cluster_m=2))
    keys.append(CompileKey("varlen", "bfloat16", "bfloat16", "k", "cooperative", "device", 128,
                           256, 3, epi_whole=True, tail_split=True))
    keys.append(CompileKey("varlen", "bfloat16", "float32", "n", "cooperative", "device", 128,
                           256, 3, tail_split=True))
    keys.append(CompileKey("batched", "bfloat16", "bfloat16", "n", "cooperative", "device", 128,
                           256, 3, tail_split=True))
    # grouped_gemm's lists split over their deepest K (each tile's shares divide its own).
    keys.append(CompileKey("general", "bfloat16", "bfloat16", "n", "cooperative", "device", 128,
                           128, tail_split=True))
    keys.append(CompileKey("general", "float16", "float32", "k", "cooperative", "device", 128,
                           64, tail_split=True))
    # ... on ping-pong tiles (each warpgroup joins its own tile's shares) and in 2-CTA
    # clusters (the split's unit is the cluster tile).
    keys.append(CompileKey("varlen", "bfloat16", "bfloat16", "k", "pingpong", "device", 128,
                           192, cluster_n=2, tail_split=True))
    keys.append(CompileKey("general", "float16", "float32", "n", "pingpong", "device", 128,
                           128, tail_split=True))
    keys.append(CompileKey("batched", "bfloat16", "bfloat16", "n", "cooperative", "device", 128,
                           256, 3, cluster_m=2, tail_split=True))
    keys.append(CompileKey("varlen", "bfloat16", "bfloat16", "n", "pingpong", "device", 192,
                           128, cluster_n=2, tail_split=True))
    keys.append(CompileKey("batched", "float16", "float32", "k", "pingpong", "device", 128, 192))
    # The tile family: every tile beyond 128x{64..256} at least once, in every form, both B
    # majors, 16-bit and fp32 output; the 208-accumulator tiles (24/240 registers); ping-pong
    # clusters; 256-row tiles with a cluster and with the tail split.
    def add(form, ab, d, b_major, schedule, tile, **extra):
        keys.append(CompileKey(form, ab, d, b_major, schedule, "device", *tile, **extra))

    add("varlen", "bfloat16", "bfloat16", "n", "pingpong", (128, 160))
    add("general", "bfloat16", "bfloat16", "k", "pingpong", (128, 208))
    add("varlen", "bfloat16", "float32", "n", "pingpong", (128, 208))
    add("batched", "float16", "float16", "n", "pingpong", (64, 192))
    add("varlen", "bfloat16", "bfloat16", "n", "cooperative", (128, 160))
    add("general", "bfloat16", "bfloat16", "n", "cooperative", (128, 224))
    add("batched", "bfloat16", "bfloat16", "k", "cooperative", (256, 128))
    add("varlen", "bfloat16", "bfloat16", "n", "cooperative", (256, 160))
    add("general", "float16", "float16", "k", "cooperative", (256, 192))
    add("varlen", "bfloat16", "bfloat16", "k", "cooperative", (256, 208))
    add("varlen", "bfloat16", "float32", "n", "cooperative", (256, 208), tail_split=True)
    add("varlen", "bfloat16", "bfloat16", "n", "pingpong", (128, 192), cluster_m=2)
    add("general", "bfloat16", "bfloat16", "k", "pingpong", (128, 208), cluster_n=2)
    add("batched", "bfloat16", "bfloat16", "n", "pingpong", (64, 256), cluster_m=2)
    add("varlen", "bfloat16", "bfloat16", "n", "cooperative", (256, 192), cluster_n=2)
    add("general", "bfloat16", "bfloat16", "n", "cooperative", (128, 160), cluster_m=2)
    add("varlen", "bfloat16", "bfloat16", "k", "cooperative", (128, 224), stages=3,
        epi_whole=True, tail_split=True)
    # Five A/B stages where the default epilogue staging holds four (D staged in 3 buffers).
    add("varlen", "bfloat16", "bfloat16", "k", "cooperative", (128, 192), stages=5, cluster_n=2)
    add("general", "bfloat16", "bfloat16", "n", "pingpong", (128, 208), stages=5, cluster_m=2)
    # 192-row ping-pong (three m64 WGMMAs per k-block): the H100 table's most frequent prefill
    # pick, in a 1x2 cluster; an N-major B with fp32 out; gated (fused) in a 2x1 cluster.
    add("varlen", "bfloat16", "bfloat16", "k", "pingpong", (192, 128), cluster_n=2)
    add("general", "bfloat16", "float32", "n", "pingpong", (192, 128))
    add("varlen", "bfloat16", "bfloat16", "k", "pingpong", (192, 128), cluster_m=2, gate="silu",
        gate_layout="concat")
    # The masked form (row counts on the GPU, D clipped per problem): both schedules, a
    # cluster each way.
    # Trimmed A loads (an expert's last tile loads its own rows): 128-, 64- and 256-row tiles,
    # a 2x1 cluster, fp32 out with the tail split, a gated (fused) tile.
    add("varlen", "bfloat16", "bfloat16", "k", "cooperative", (128, 256), stages=3, trim_a=True)
    add("varlen", "bfloat16", "bfloat16", "k", "pingpong", (64, 256), cluster_m=2, trim_a=True)
    add("varlen", "float16", "float32", "n", "cooperative", (256, 128), tail_split=True,
        trim_a=True)
    add("varlen", "bfloat16", "bfloat16", "k", "pingpong", (128, 192), gate="silu",
        gate_layout="concat", trim_a=True)
    # Packed pairs (2x1 clusters pairing consecutive tiles across experts): cooperative with
    # trimmed A, ping-pong 64-row, an N-major B.
    add("varlen", "bfloat16", "bfloat16", "k", "cooperative", (128, 256), cluster_m=2,
        trim_a=True, packed_pairs=True)
    add("varlen", "bfloat16", "bfloat16", "k", "pingpong", (64, 256), cluster_m=2,
        trim_a=True, packed_pairs=True)
    add("varlen", "bfloat16", "bfloat16", "n", "pingpong", (128, 128), cluster_m=2,
        packed_pairs=True)
    # Swapped tiles (the routed rows on the WGMMA's N side, 16 variants of N): both weight
    # majors, fp16 with the peeked waits.
    swap = dict(epi_n=16, trim_a=True, swap_ab=True)
    add("varlen", "bfloat16", "bfloat16", "k", "cooperative", (256, 128), **swap)
    add("varlen", "bfloat16", "bfloat16", "n", "cooperative", (256, 128), **swap)
    add("varlen", "float16", "float16", "k", "cooperative", (256, 128), peek_wait=True, **swap)
    # ... in a 1x2 cluster (the rows of x multicast to two weight-column tiles).
    add("varlen", "bfloat16", "bfloat16", "k", "cooperative", (256, 128), cluster_n=2, **swap)
    add("varlen", "bfloat16", "bfloat16", "n", "cooperative", (256, 128), cluster_n=2, **swap)
    # Swapped tiles with the fused options (swapped_fused.py): the gate-up GEMM's gated
    # epilogue (concat weights), a biased clamped SwiGLU with row weights, the down GEMM's
    # row weights and bias.
    add("varlen", "bfloat16", "bfloat16", "k", "cooperative", (256, 128), gate="silu",
        gate_layout="concat", fast_gate=True, **swap)
    add("varlen", "float16", "float16", "k", "cooperative", (256, 128), gate="clamped_swiglu",
        gate_layout="concat", gate_alpha=1.702, gate_limit=7.0, bias=True, row_scale=True,
        **swap)
    add("varlen", "bfloat16", "bfloat16", "n", "cooperative", (256, 128), bias=True,
        row_scale=True, **swap)
    add("varlen", "bfloat16", "bfloat16", "k", "cooperative", (256, 128), gate="silu",
        gate_layout="concat", fast_gate=True, cluster_n=2, **swap)
    # Peeked stage waits (the next stage's barrier tested a k-tile ahead): both schedules.
    add("varlen", "bfloat16", "bfloat16", "k", "cooperative", (128, 256), cluster_n=2,
        trim_a=True, peek_wait=True)
    add("general", "bfloat16", "float32", "n", "pingpong", (128, 192), peek_wait=True)
    add("masked", "bfloat16", "bfloat16", "k", "pingpong", (64, 128))
    add("masked", "bfloat16", "float32", "n", "cooperative", (128, 256), cluster_m=2)
    add("masked", "float16", "float16", "k", "pingpong", (128, 128), cluster_n=2)
    # The masked layout with the fused options: the varlen kernel on row counts.
    add("varlen", "bfloat16", "bfloat16", "k", "pingpong", (64, 128), gate="silu",
        gate_layout="concat", row_counts=True)
    add("varlen", "bfloat16", "bfloat16", "n", "cooperative", (128, 256), cluster_m=2,
        gate="clamped_swiglu", gate_layout="alternating", gate_alpha=1.702, gate_limit=7.0,
        bias=True, row_scale=True, row_counts=True)
    # The fused MoE kernel (FusedMoeGemmSm90): the layer's gate-up (gather-A, gated epilogue,
    # each gate layout) and down (row weights, bias) launches, on the tiles its rules pick.
    add("varlen", "bfloat16", "bfloat16", "k", "cooperative", (128, 256), gate="silu",
        gate_layout="concat", gather=True)
    add("varlen", "bfloat16", "bfloat16", "n", "pingpong", (64, 192), gate="clamped_swiglu",
        gate_layout="alternating", gate_alpha=1.702, gate_limit=7.0, bias=True, gather=True)
    add("varlen", "bfloat16", "bfloat16", "n", "pingpong", (128, 192), gate="gelu",
        gate_layout="interleaved")
    add("varlen", "bfloat16", "bfloat16", "k", "cooperative", (128, 256), row_scale=True,
        bias=True)
    add("varlen", "bfloat16", "bfloat16", "k", "cooperative", (128, 256), stages=3,
        epi_whole=True, tail_split=True, row_scale=True)
    add("varlen", "bfloat16", "bfloat16", "k", "cooperative", (128, 192), stages=5,
        gate="silu", gate_layout="concat")
    # SiLU and the clamped SwiGLU with the SFU's sigmoid, the default (the gated keys above
    # take the IEEE one of MOE_GEMM_FUSED_FAST_GATE=0).
    add("varlen", "bfloat16", "bfloat16", "k", "cooperative", (128, 256), cluster_m=2,
        gate="silu", gate_layout="concat", fast_gate=True)
    add("varlen", "bfloat16", "bfloat16", "n", "pingpong", (64, 256), gate="clamped_swiglu",
        gate_layout="alternating", gate_alpha=1.702, gate_limit=7.0, bias=True, gather=True,
        fast_gate=True)
    # The clamped SiLU of a swiglu_limit (DeepSeek-V4, GLM-5-Next, HY-V4), concat weights.
    add("varlen", "bfloat16", "bfloat16", "k", "cooperative", (128, 256), gate="clamped_silu",
        gate_layout="concat", gate_limit=10.0, fast_gate=True)
    # Gather-A past 128 rows or 128 accumulator registers: the rows' indices in shared memory.
    add("varlen", "bfloat16", "bfloat16", "k", "pingpong", (128, 192), cluster_m=2, gate="silu",
        gate_layout="concat", gather=True)
    add("varlen", "bfloat16", "bfloat16", "k", "cooperative", (256, 192), cluster_m=2,
        gate="silu", gate_layout="concat", gather=True)
    # Gather-A without the proxy fence before a gathered stage's WGMMAs (MOE_GEMM_GATHER_FENCE=0).
    add("varlen", "bfloat16", "bfloat16", "k", "pingpong", (128, 192), cluster_m=2, gate="silu",
        gate_layout="concat", gather=True, gather_fence=False, fast_gate=True)
    if full:
        # Every listed tile in every form, B majors alternating (the default list above has
        # the rest).
        seen = set(keys)
        tiles = ([("pingpong", t) for t in PINGPONG_TILES]
                 + [("cooperative", t) for t in COOPERATIVE_TILES])
        for i, (schedule, tile) in enumerate(tiles):
            for j, form in enumerate(("general", "varlen", "batched")):
                key = CompileKey(form, "bfloat16", "bfloat16", "nk"[(i + j) % 2], schedule,
                                 "device", *tile)
                if key not in seen:
                    keys.append(key)
        for tile in ((128, 64), (128, 192), (128, 256)):
            keys.append(CompileKey("varlen", "float16", "float32", "k", "cooperative", "host",
                                   *tile))
    from moe_gemm.kernels.sm90.compile_fp8 import fp8_check_variants

    keys.extend(fp8_check_variants())
    return keys


def _key_extras(key) -> str:
    """The CompileKey fields beyond the basic ones, so that no two check lines read alike."""
    extras = []
    if key.stages is not None:
        extras.append(f"stages={key.stages}")
    if (key.cluster_m, key.cluster_n) != (1, 1):
        extras.append(f"cluster={key.cluster_m}x{key.cluster_n}")
    for flag in ("epi_whole", "tail_split", "l2_hints", "trace"):
        if getattr(key, flag):
            extras.append(flag)
    if key.epi_n != 32:
        extras.append(f"epi_n={key.epi_n}")
    if hasattr(key, "scale_mode"):
        extras.append(f"scales={key.scale_mode}")
    if getattr(key, "scale_ahead", 1) != 1:
        extras.append(f"scale_ahead={key.scale_ahead}")
    if getattr(key, "gate", ""):
        extras.append(f"gate={key.gate}/{key.gate_layout}")
    if getattr(key, "gather", False) and not key.gather_fence:
        extras.append("gather_fence=off")
    for flag in ("bias", "row_scale", "gather", "row_counts", "fast_gate", "promote_lag",
                 "smem_scales", "peek_wait", "swap_ab", "skip_empty_half", "packed_pairs"):
        if getattr(key, flag, False):
            extras.append(flag)
    return "".join(" " + e for e in extras)


def check_label(key) -> str:
    """The line `moe-gemm check` prints for a variant (one per key: no two read alike)."""
    return (f"form={key.form} schedule={key.schedule} visitor={key.visitor} "
            f"dtype={key.ab_dtype}->{key.d_dtype} b_major={getattr(key, 'b_major', 'k')} "
            f"tile={key.tile_m}x{key.tile_n}" + _key_extras(key))


def cmd_check(args: argparse.Namespace) -> int:
    import tempfile
    import time

    arch = os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    if arch != "sm_90a":
        # (every variant failed alike under another target, reading as 101 kernel regressions)
        print(f"moe-gemm check: the kernels are built for sm_90a; CUTE_DSL_ARCH is {arch!r} "
              "(unset it, or set it to sm_90a)", file=sys.stderr)
        return 2
    from moe_gemm.capability import cutlass_dsl_problem

    problem = cutlass_dsl_problem()
    if problem:
        print(f"moe-gemm check: cannot compile: {problem}", file=sys.stderr)
        return 2
    from moe_gemm.kernels.sm90.compile_fp8 import compile_any

    keys = check_variants(args.full)
    failures = 0
    with tempfile.TemporaryDirectory(prefix="moe_gemm_check_") as tmp:
        for key in keys:
            label = check_label(key)
            t0 = time.time()
            try:
                kdir = os.path.join(tmp, key.name())
                compiled = compile_any(key, keep_dir=kdir)
                ptx_path = getattr(compiled, "__ptx__", None)
                ptx = open(ptx_path).read() if ptx_path and os.path.exists(ptx_path) else ""
                if not ptx:
                    found = [f for f in os.listdir(kdir) if f.endswith(".ptx")]
                    ptx = open(os.path.join(kdir, found[0])).read() if found else ""
                markers = list(CHECK_MARKERS)
                if key.ab_dtype in FP8_MARKERS:
                    markers.append(FP8_MARKERS[key.ab_dtype])
                    markers.append("fma.rn.f32" if key.scale_mode == "block" else "add.f32")
                missing = [m for m in markers if m not in ptx]
                if not ptx.startswith("//") and ".target sm_90a" not in ptx:
                    missing.append(".target sm_90a")
            except Exception as exc:  # noqa: BLE001 - report every variant
                missing = [f"compile error: {type(exc).__name__}: {exc}"]
            status = "ok" if not missing else "FAIL (" + "; ".join(missing) + ")"
            failures += bool(missing)
            print(f"{status:4s}  {label}  [{time.time() - t0:.1f}s]", flush=True)
    print(f"checked {len(keys)} variants: {len(keys) - failures} ok, {failures} failed")
    return 1 if failures else 0


def cmd_bench(argv: list[str]) -> int:
    # The benchmark harness is not part of the installed library: it lives in the repository's
    # benchmarks/ folder, next to this package in a checkout.
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    if not (root / "benchmarks" / "bench.py").is_file():
        print("moe-gemm bench runs from a checkout of the moe_gemm repository (its benchmarks/ "
              "folder is not installed with the package)", file=sys.stderr)
        return 2
    sys.path.insert(0, str(root))
    # ... and for the processes it starts (`--isolate`'s per-shape runs, the zoo's `--gpus`
    # shards: `python -m benchmarks...`), which from another working directory found no
    # `benchmarks` module and reported every shape failed.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    from benchmarks import bench

    return bench.main(argv)


def cmd_demo(args: argparse.Namespace) -> int:
    import torch

    import moe_gemm

    info = info_dict()
    if info["auto_picks"] is None:  # every op would refuse the environment: say why, once
        refused = info["environment_refused"]
        assert isinstance(refused, dict)
        raise EnvError(refused["MOE_GEMM_DISABLE_CUTE"])
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16
    print(f"moe_gemm demo on {dev} (auto backend: {info['auto_picks']})")
    g = torch.Generator(device=dev).manual_seed(0)
    sizes = [(64, 256, 512), (0, 256, 512), (17, 128, 256), (130, 64, 1024)]
    a = [torch.randn(m, k, generator=g, device=dev).to(dtype) for m, n, k in sizes]
    b = [torch.randn(k, n, generator=g, device=dev).to(dtype) for m, n, k in sizes]
    d = moe_gemm.grouped_gemm(a, b)
    gemm_err = max((_relative_error(di, ai.float() @ bi.float()) for ai, bi, di in zip(a, b, d)),
                   default=0.0)
    print(f"grouped_gemm: {len(sizes)} problems {sizes} -> max error {gemm_err:.2%} of the "
          "largest value (fp32 reference)")
    T, E, K, N = 96, 4, 512, 256
    x = torch.randn(T, K, generator=g, device=dev).to(dtype)
    w = torch.randn(E, N, K, generator=g, device=dev).to(dtype).transpose(1, 2)
    offs = torch.tensor([20, 20, 70, 90], dtype=torch.int32, device=dev)
    y = moe_gemm.grouped_mm(x, w, offs)
    ref = moe_gemm.ops.reference.grouped_mm_ref(x, w, offs)
    mm_err = _relative_error(y[:90], ref[:90])
    tail_zero = bool((y[90:] == 0).all())
    print(f"grouped_mm: T={T} E={E} K={K} N={N} offs={offs.tolist()} -> max error "
          f"{mm_err:.2%} of the largest value; rows past offs[-1] zero: {tail_zero}")
    # bf16 output rounding is at most 2^-8 (0.39%) of a value; past 1% the install computes
    # wrong results
    if max(gemm_err, mm_err) > DEMO_TOLERANCE or not tail_zero:
        print(f"moe-gemm demo: FAILED: results off by more than {DEMO_TOLERANCE:.0%} of the "
              "fp32 reference (or rows past offs[-1] not zero)", file=sys.stderr)
        return 1
    print("ok")
    return 0


DEMO_TOLERANCE = 0.01


def _relative_error(got, want) -> float:
    """max |got - want| over max |want| (0 for empty or all-zero references)."""
    if not want.numel():
        return 0.0
    scale = want.abs().max().item()
    diff = (got.float() - want.float()).abs().max().item()
    return diff / scale if scale else diff


def cmd_tune(argv: list[str]) -> int:
    import importlib

    try:
        tuning_cli = importlib.import_module("moe_gemm.tuning.cli")
    except ModuleNotFoundError as exc:
        # Only the tuning module itself missing is "not available"; a dependency missing inside
        # it is a real error and keeps its traceback.
        if exc.name not in ("moe_gemm.tuning", "moe_gemm.tuning.cli"):
            raise
        print("moe-gemm tune: not available in this installation (the module moe_gemm.tuning "
              "is missing)", file=sys.stderr)
        return 2
    rc = tuning_cli.main(argv)
    return 0 if rc is None else int(rc)


def _formatter(prog: str) -> argparse.HelpFormatter:
    return argparse.HelpFormatter(prog, max_help_position=14, width=100)


def build_parser() -> argparse.ArgumentParser:
    from moe_gemm._version import __version__

    parser = argparse.ArgumentParser(
        prog="moe-gemm",
        description="Grouped GEMMs for Mixture-of-Experts on Hopper GPUs (H100/H200), with a "
        "torch backend everywhere else. `moe-gemm COMMAND --help` for a command's options.",
        formatter_class=_formatter)
    parser.add_argument("--version", action="version", version=f"moe-gemm {__version__}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def command(name: str, help: str, description: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=description,
                              formatter_class=_formatter)

    p_info = command(
        "info", "versions, the GPU (if any) and which backend runs here, and why not the other",
        "Print the versions of moe_gemm, Python, torch and the CuTe DSL, the GPU (if any), and "
        "which backend backend='auto' uses here; for a backend that cannot run, the reason. "
        "Also the MOE_GEMM_* variables set, each one the library would refuse marked with the "
        "reason; exit 1 if there is one.")
    p_info.add_argument("--json", action="store_true", help="print the same as JSON")
    p_info.set_defaults(func=cmd_info)
    p_check = command(
        "check", "compile every kernel variant for sm_90a (no GPU needed) and check the "
        "instructions each one uses",
        "Compile every kernel variant for sm_90a (works without a GPU) and check that each "
        "one's PTX uses wgmma.mma_async, cp.async.bulk.tensor (TMA) and setmaxnreg. Exit 1 if "
        "any fails.")
    p_check.add_argument("--full", action="store_true", help="also every extra tile shape")
    p_check.set_defaults(func=cmd_check)
    p_demo = command(
        "demo", "run a few small grouped matmuls here (the GPU if there is one, else the CPU) "
        "and print their error against a float32 reference: a quick check that the install "
        "works",
        "Run a few small grouped matmuls on the GPU if there is one, else on the CPU: "
        "grouped_gemm on four problems of different sizes (one of them empty) and an MoE "
        "grouped_mm over four experts. Each result is compared with a float32 reference and "
        "the largest error printed, relative to the largest value; exit 1 if it passes 1% "
        "(bf16 rounding is at most 0.39%). Takes seconds.")
    p_demo.set_defaults(func=cmd_demo)
    # Listed for --help; their arguments are parsed by their own modules (see main).
    sub.add_parser("bench", help="time the benchmark suite against other implementations "
                   "(from a checkout; moe-gemm bench --help)", add_help=False)
    sub.add_parser("tune", help="search kernel configurations for your shapes "
                   "(moe-gemm tune --help)", add_help=False)
    return parser


# The exit status of a command that SIGPIPE ended (128 + 13), as `yes | head -1` leaves yes's.
SIGPIPE_EXIT = 141


def main(argv: list[str] | None = None) -> int:
    try:
        rc = _main(argv)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at interpreter exit
        return rc
    except EnvError as exc:
        # A MOE_GEMM_* variable with a value the library refuses: a usage error of the
        # environment, said in one line like a bad option (the message names the variable).
        command = " ".join(["moe-gemm", *(sys.argv[1:] if argv is None else argv)[:1]])
        print(f"{command}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # Whoever read our stdout has gone (`moe-gemm tune --list --zoo | head -1`): stop
        # quietly, as a command that SIGPIPE ends does. stdout now points at /dev/null, so that
        # the interpreter's final flush of what is still buffered cannot raise again (the
        # recipe of the Python docs, "Note on SIGPIPE").
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):  # no real file behind sys.stdout
            pass
        return SIGPIPE_EXIT
    except OSError as exc:
        # Output that cannot be written (`moe-gemm info --json > /dev/full`: ENOSPC; EIO on a
        # lost terminal): one line and exit 1, as `cat` says "write error", not a traceback.
        command = " ".join(["moe-gemm", *(sys.argv[1:] if argv is None else argv)[:1]])
        where = f" ({exc.filename})" if exc.filename else ""
        _quiet_stdout()
        print(f"{command}: {exc.strerror or exc}{where}", file=sys.stderr)
        return 1


def _quiet_stdout() -> None:
    """Flush stdout; where that fails (the error was stdout's own), point it at /dev/null so
    that the interpreter's final flush cannot raise again."""
    try:
        sys.stdout.flush()
        return
    except (OSError, ValueError):
        pass
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


def _refuse_environment() -> None:
    """EnvError (main: one line, exit 2) naming each MOE_GEMM_* variable set to a value the
    library refuses. The library reads a variable only where it acts on it, so
    `MOE_GEMM_TUNED_TABLES=maybe moe-gemm demo` passed on a CPU (no table is read there)
    while `moe-gemm info` flagged the value and every GPU call would refuse it: each command
    but info (which marks them all and exits 1) refuses to start, as for a bad option."""
    if refused := refused_variables():
        raise EnvError("; ".join(refused.values()))


def _asks_help(args: list[str]) -> bool:
    """Whether a command line asks for its help (-h, --help or an abbreviation argparse
    takes), which answers whatever the environment holds, as the other commands' do."""
    for a in args:
        if a == "--":
            return False
        if a == "-h" or (len(a) >= 3 and "--help".startswith(a)):
            return True
    return False


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("bench", "tune"):
        if not _asks_help(argv[1:]):
            _refuse_environment()
        return cmd_bench(argv[1:]) if argv[0] == "bench" else cmd_tune(argv[1:])
    args = build_parser().parse_args(argv)  # (--help and --version answer whatever is set)
    if args.cmd != "info":
        _refuse_environment()
    try:
        return args.func(args)
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
        print(f"moe-gemm {args.cmd}: needs torch, which is not installed here "
              "(scripts/setup.sh installs the right build for this machine)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
