"""What `moe-gemm tune` reads from --shapes, --zoo and --configs: the shapes to tune (routed
by the zoo's seeded top-k draw) and the configs it can run, each refused with a ValueError
naming the bad item before any GPU work."""

from __future__ import annotations

from moe_gemm.ops.support import MAX_PROBLEMS
from moe_gemm.tuning import zoo

DEFAULT_TOKENS = (16, 2048, 8192, 128, 512, 1, 32768)
INT32_MAX = 2**31 - 1


def parse_shape_items(items: list[str], form: str, layout: str, dtype: str, out_dtype: str,
                      seed: int) -> list:
    """TuneShapes from --shapes items (ValueError naming the bad item)."""
    from moe_gemm.tuning.tuner import TuneShape

    shapes = []
    seen: set[tuple] = set()  # (a shape given twice was tuned twice, the second run kept)
    for item in items:
        if any(not v.strip() for v in item.split(",")):
            # ("8,,128,128,16" dropped the empty field and read E=8 N=128 K=128 rows=16)
            raise ValueError(f"--shapes {item!r}: an empty field; expected E,N,K,ROWS[,ROWS...]")
        try:
            nums = [int(v) for v in item.split(",")]
        except ValueError:
            raise ValueError(f"--shapes {item!r}: expected E,N,K,ROWS[,ROWS...] integers"
                             ) from None
        if len(nums) < 4 or min(nums) <= 0:
            raise ValueError(f"--shapes {item!r}: expected E,N,K,ROWS[,ROWS...], all > 0")
        if max(nums) > INT32_MAX:
            # No kernel takes such a shape (offs are int32). (Up to it, the routing of a
            # --shapes item is one multinomial draw: zoo.DRAW_AT_ONCE_TOKENS.)
            raise ValueError(f"--shapes {item!r}: expected E,N,K,ROWS[,ROWS...], each from 1 "
                             f"to {INT32_MAX}")
        E, N, K = nums[:3]
        if E > MAX_PROBLEMS:
            # (the routing of a larger E was built as E-long lists before anything checked
            # it: minutes and gigabytes, then a MemoryError)
            raise ValueError(f"--shapes {item!r}: E (the expert count) must be at most "
                             f"{MAX_PROBLEMS}, the kernels' problem count")
        for rows in nums[3:]:
            if (E, N, K, rows) in seen:
                continue
            total = rows * E if form == "batched" else rows
            if max(E * N * K * 2, total * K * 2, total * N * 4) >= 2**63:
                # (torch refuses a tensor of 2^63 bytes or more: the run stopped on it in a
                # traceback, after the ceilings and the compiles)
                raise ValueError(f"--shapes {item!r}: an operand of E={E} N={N} K={K} "
                                 f"ROWS={rows} takes 2^63 bytes or more, past what a tensor "
                                 "can hold")
            seen.add((E, N, K, rows))
            if form == "batched":
                shapes.append(TuneShape("batched", E, N, K, rows * E, dtype=dtype,
                                        out_dtype=out_dtype, layout=layout,
                                        label=f"E={E} N={N} K={K} M={rows}"))
                continue
            counts = tuple(zoo.topk_counts(E, rows, 1, seed))
            shapes.append(TuneShape(form, E, N, K, rows, counts, dtype, out_dtype, layout,
                                    f"E={E} N={N} K={K}"))
    return shapes


def config_problem(text: str, fields: dict, form: str, dtype: str = "bfloat16",
                   out_dtype: str | None = None) -> None:
    """ValueError when a --configs name cannot run on any shape of `form` with these operand
    and output dtypes (a tile, cluster or stage count GemmConfig refuses, an option of another
    form or output dtype, stages that do not fit in shared memory), so that the A/B refuses it
    at once instead of reporting it as an error on every shape after the GPU work started."""
    from moe_gemm.ops.tuned import form_problem, normalize, stages_fit
    from moe_gemm.tuning.space import config_of

    out_dtype = out_dtype or dtype
    try:
        config_of(fields)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"config {text!r}: {exc}") from None
    # (With out_dtype: 'ew' on an fp32 output passed here and failed on every shape.)
    why = form_problem(fields, form, out_dtype)
    if why is not None:
        raise ValueError(f"config {text!r}: {why}")
    if not stages_fit(normalize(fields), dtype, out_dtype):
        # The kernel's own limit (constants.config_stage_limit), which GemmConfig's 2-12
        # does not know: e.g. 's8' on cooperative 128x256.
        raise ValueError(f"config {text!r}: {fields['stages']} A/B stages do not fit in "
                         f"shared memory beside the {out_dtype} epilogue")


def zoo_shapes(models: str | None, tokens: str | None, dtype: str, out_dtype: str,
               seed: int) -> list:
    """The zoo's projections, token count by token count (priority order)."""
    from moe_gemm.tuning.tuner import TuneShape

    picked = zoo.select_models(models)
    shapes = []
    for t in zoo.parse_tokens(tokens, DEFAULT_TOKENS):
        for m in picked:
            counts = tuple(zoo.topk_counts(m.experts, t, m.top_k, seed))
            for p in m.projections():
                shapes.append(TuneShape("varlen", p.E, p.N, p.K, p.rows(t), counts, dtype,
                                        out_dtype, p.layout, f"{p.label} tokens={t}"))
    return shapes
