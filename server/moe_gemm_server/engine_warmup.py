"""The Engine's warm-up: which row counts and shapes to run before a weight set is served.

A CuTe DSL compile takes seconds, so every kernel configuration a weight set can reach is run
once before the set becomes visible (see engine.py's docstring). This module holds that part
of the Engine as a mixin: the row-count ladder (from the heuristics, or `warmup_rows`), the
optional start-time tuning, the per-set kernel report and the ad-hoc grouped_gemm warm-up.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from moe_gemm.config import GemmConfig
from moe_gemm.ops.tuned import enabled as tables_on

from .fp8_weights import fp8_warm_choices

if TYPE_CHECKING:
    from .engine import WeightSet

# Records keep the engine's logger name (what operators filter on).
log = logging.getLogger("moe_gemm_server.engine")

# Row counts each weight set is warmed at when the heuristics cannot be asked (see
# Engine.warmup_rows_for); with the cute backend the ladder comes from the heuristics. On the
# CPU the torch backend compiles nothing: one tiny run proves the weights work.
DEFAULT_WARMUP_ROWS_CUDA = (1, 64, 512, 4096)
DEFAULT_WARMUP_ROWS_CPU = (1,)
# Rows per expert tune_weights tunes at (times E): decode to prefill, a factor of 8 apart.
TUNE_ROWS_PER_EXPERT = (1 / 8, 1, 8, 64, 512)
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
# Representative ad-hoc problem shapes (M, N, K): together they reach every tile / schedule /
# stage choice of heuristics.choose_general (short and long K, narrow and wide N, few and
# many rows); only the first shape per distinct choice is run.
_GEMM_WARMUP_SHAPES = tuple(
    (m, n, k) for m in (1, 64, 65, 128) for n in (64, 192, 256) for k in (64, 1024, 1088, 4096)
)


class WarmUpMixin:
    """Engine's warm-up, tuning and kernel-report methods (Engine inherits them).

    They use the Engine's settings (device, config, backend, warmup_rows, max_rows, tune),
    its registry (weight_sets) and its launches (grouped_mm_many, grouped_gemm_many) under
    `_warming()`, which sends them to the warm-up stream without the launch lock.
    """

    device: torch.device
    config: GemmConfig
    backend: str
    warmup_rows: tuple[int, ...] | None
    max_rows: int
    tune: bool
    _warmed_gemm: set[torch.dtype]

    def warm_up(self, ws: WeightSet | None = None) -> None:
        """Run every configuration that will be served, so none compiles on a request.

        With `ws`, that set at each of `warmup_rows` and with both output dtypes a request can
        ask for (the set's own dtype, and float32 for float32 activations). Without, every
        resident set plus the ad-hoc grouped_gemm path for bf16, fp16 and fp32.
        """
        if ws is None:
            for one in self.weight_sets():
                self.warm_up(one)
            self.warm_up_grouped_gemm()
            return
        act = ws.act_dtype
        out_dtypes = [act] + ([torch.float32] if act != torch.float32 else [])
        if self.tune and self.backend == "cute" and ws.scale is None and tables_on():
            self.tune_weights(ws)
        with self._warming():
            for T in self.warmup_rows_for(ws):
                # values do not matter for a compile; built on the device, no host round trip
                counts = _spread(T, ws.E)
                for out_dtype in out_dtypes:
                    # an FP8 set's activations come in the output dtype and are quantized
                    x = torch.ones(T, ws.K, dtype=act if ws.scale is None else out_dtype,
                                   device=self.device)
                    if self.device.type == "cuda":  # filled on this stream; used on ours
                        torch.cuda.current_stream(self.device).synchronize()
                    self.grouped_mm_many(ws, [(x, counts)], out_dtype=out_dtype)

    def warmup_rows_for(self, ws: WeightSet) -> tuple[int, ...]:
        """The row counts `warm_up(ws)` runs: one per kernel configuration the heuristics
        pick for T = 1 .. max_rows (probing T around powers of two and of T / E, where the
        heuristics' thresholds lie), or `warmup_rows` when given."""
        if self.warmup_rows is not None:
            return self.warmup_rows
        if self.backend != "cute":
            return DEFAULT_WARMUP_ROWS_CPU
        try:
            from moe_gemm.capability import sm_count
            from moe_gemm.ops.heuristics import choose_varlen

            nsm = sm_count(self.device)
            # thresholds are on rows per expert (T / E): probe at and just past each power
            # of two of it, and at plain powers of two of T
            bits = range(self.max_rows.bit_length())
            cands = {1 << i for i in bits} | {(1 << i) + 1 for i in bits}
            cands |= {ws.E << i for i in bits} | {(ws.E << i) + ws.E for i in bits}
            cands = {t for t in cands if 0 < t <= self.max_rows} | {self.max_rows}
            if ws.scale is not None:
                return fp8_warm_choices(ws, self.config, sorted(cands))[0]
            first: dict[object, int] = {}
            name = self._device_name()
            for T in sorted(cands):
                c = choose_varlen(self.config, T, ws.E, ws.N, ws.K, nsm, device=name,
                                  dtype=_DTYPE_NAMES.get(ws.dtype, "bfloat16"), swap_ok=True)
                key = (c.schedule, c.visitor, c.tile_m, c.tile_n, c.stages, c.l2_hints,
                       c.epi_whole, c.cluster_m, c.cluster_n, c.tail_split, c.swap_ab)
                first.setdefault(key, T)
            return tuple(sorted(first.values()))
        except Exception:  # noqa: BLE001 - heuristics API changed: fall back to a fixed ladder
            log.warning("could not enumerate kernel choices; warming a fixed row ladder",
                        exc_info=True)
            return DEFAULT_WARMUP_ROWS_CUDA

    def _device_name(self) -> str | None:
        """The GPU's name (what tuned tables are keyed by), None on the CPU."""
        if self.device.type != "cuda":
            return None
        from moe_gemm.capability import device_name

        return device_name(self.device)

    def tune_rows_for(self, ws: WeightSet) -> tuple[int, ...]:
        """Row counts tune_weights tunes: E x TUNE_ROWS_PER_EXPERT, within max_rows. Steps of
        8x leave every row count within 1.5 buckets of a tuned one (the tables answer up to 2
        buckets away)."""
        rows = {max(1, int(ws.E * r)) for r in TUNE_ROWS_PER_EXPERT}
        return tuple(sorted(t for t in rows if t <= self.max_rows))

    def tune_weights(self, ws: WeightSet) -> None:
        """Tune `ws`'s shapes once each (online autotune, disk-cached), evenly routed."""
        from moe_gemm.tuning import online

        layout = "ENK" if ws.w.stride(1) == 1 else "EKN"
        for T in self.tune_rows_for(ws):
            counts = [int(c) for c in _spread(T, ws.E).tolist()]
            t0 = time.monotonic()
            online.tune_once(self.device, ws.E, ws.N, ws.K, T, counts, dtype=ws.dtype,
                             layout=layout)
            log.info("weight set %r: tuned %d rows in %.1fs", ws.name, T, time.monotonic() - t0)

    def kernel_report(self, ws: WeightSet) -> tuple[dict[str, object], ...]:
        """For each warmed row count: the kernel config it runs and where that came from."""
        if self.backend != "cute":
            return ()
        if ws.scale is not None:
            return fp8_warm_choices(ws, self.config, self.warmup_rows_for(ws))[1]
        try:
            from moe_gemm.capability import sm_count
            from moe_gemm.ops.heuristics import choice_source, choose_varlen, tuned_hit
            from moe_gemm.tuning.space import fields_of, name_of

            nsm, name = sm_count(self.device), self._device_name()
            dtype = _DTYPE_NAMES.get(ws.dtype, "bfloat16")
            report = []
            for T in self.warmup_rows_for(ws):
                if T <= 0:
                    continue
                c = choose_varlen(self.config, T, ws.E, ws.N, ws.K, nsm, device=name,
                                  dtype=dtype, swap_ok=True)
                hit = tuned_hit("varlen", self.config, nsm, device=name, dtype=dtype,
                                shape=(T, ws.E, ws.N, ws.K))
                report.append({"rows": T, "config": name_of(fields_of(c, "varlen")),
                               "source": choice_source(hit, c)})
            return tuple(report)
        except Exception:  # noqa: BLE001 - a report must never fail a weight upload
            log.warning("could not report the kernel choices of %r", ws.name, exc_info=True)
            return ()

    def _gemm_warmup_shapes(self) -> list[tuple[int, int, int]]:
        if self.backend != "cute":
            return [(1, 64, 64), (128, 64, 64)]
        try:
            from moe_gemm.capability import sm_count
            from moe_gemm.ops.heuristics import choose_general

            nsm = sm_count(self.device)
            first: dict[object, tuple[int, int, int]] = {}
            for shape in _GEMM_WARMUP_SHAPES:
                c = choose_general(self.config, (shape,), nsm)
                key = (c.schedule, c.visitor, c.tile_m, c.tile_n, c.stages, c.l2_hints,
                       c.epi_whole, c.cluster_m, c.cluster_n, c.tail_split)
                first.setdefault(key, shape)
            return list(first.values())
        except Exception:  # noqa: BLE001
            log.warning("could not enumerate grouped_gemm choices; warming fixed shapes",
                        exc_info=True)
            return [(1, 256, 64), (128, 256, 1088), (128, 256, 4096), (128, 128, 64)]

    def warm_up_grouped_gemm(
        self, dtypes: Sequence[torch.dtype] = (torch.bfloat16, torch.float16, torch.float32)
    ) -> None:
        """Run the ad-hoc grouped GEMM once per dtype and per kernel configuration reachable
        from representative shapes (row-major operands, as the server receives them)."""
        gen = torch.Generator(device="cpu").manual_seed(0)
        shapes = self._gemm_warmup_shapes()
        with self._warming():
            for dtype in dtypes:
                if dtype in self._warmed_gemm:
                    continue
                for m, n, k in shapes:
                    a = [torch.randn(m, k, generator=gen).to(dtype)]
                    b = [torch.randn(k, n, generator=gen).to(dtype)]
                    self.grouped_gemm_many([(a, b)])
                self._warmed_gemm.add(dtype)



def _spread(T: int, E: int) -> torch.Tensor:
    """[E] int64 counts summing to T, as even as possible (warm-up routing)."""
    counts = torch.full((E,), T // E, dtype=torch.int64)
    counts[: T % E] += 1
    return counts
