"""A calibrated time model of one kernel config on a grouped-GEMM shape (pure arithmetic).

The tuned tables (moe_gemm.ops.tuned) answer the shapes that were measured. For a shape that
no table holds (a new model's projections), the lookup asks this model which of the measured
configs is fastest, with parameters fitted to the tuner's timings on that device
(moe_gemm.tuning.fit). It is a roofline over what the persistent kernel does:

- tiles: routed rows per expert are known on the host only as a total, so the model assumes
  the T rows spread over the experts that get any (expected under uniform routing) and that
  each active expert pads half a cluster tile of rows on average (at least one tile);
- waves: cluster tiles over the resident clusters (nsm / cluster size); a partial last wave
  costs a whole wave, or about half of one with the tail split;
- compute: every wave runs one tile per CTA: 2 * tile_m * tile_n * K FLOPs at the device's
  measured dense-mm rate per SM times the config's efficiency `eff`, plus a fixed `tile_us`
  per tile (epilogue, pipeline fill);
- memory: the compulsory bytes (activations and output once, each active expert's weights
  once) times the config's `mem` factor at the measured copy bandwidth;
- time = max(compute, memory) + LAUNCH_US.

`eff`, `tile_us` and `mem` are per config (schedule, tile, cluster, stages, ...); the ceilings
come from the same tuning run. Nothing here touches a GPU, torch or the DSL.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moe_gemm.kernels.sm90.constants import TILE_K

# Launch latency and the scheduler warp's first search, seen by every call (H100/H200: a
# persistent kernel's empty launch takes ~4 us from the stream's point of view).
LAUNCH_US = 4.0


@dataclass(frozen=True)
class Shape:
    """What the host knows about a call: form, E (problems), N, K, total rows, SM count."""

    form: str  # "varlen" | "batched" | "general"
    E: int
    N: int
    K: int
    rows: int  # varlen: T; batched and general: sum of M over problems
    nsm: int
    in_bytes: int = 2
    out_bytes: int = 2


@dataclass(frozen=True)
class Params:
    """A config's fitted constants (see the module docstring)."""

    eff: float  # fraction of the dense-mm rate one tile's mainloop reaches
    tile_us: float  # fixed cost per tile and CTA
    mem: float  # DRAM bytes moved / compulsory bytes


@dataclass(frozen=True)
class Terms:
    """The model's pieces for one (config, shape): time = max(compute, memory) + launch,
    compute = waves * (flop_us / eff + tile_us), memory = mem * bytes_us."""

    waves: float
    flop_us: float  # one tile's FLOPs at the full per-SM rate, in us
    bytes_us: float  # compulsory bytes at the copy bandwidth, in us

    def time_us(self, p: Params) -> float:
        compute = self.waves * (self.flop_us / p.eff + p.tile_us)
        return max(compute, self.bytes_us * p.mem) + LAUNCH_US


def active_experts(E: int, rows: int) -> float:
    """Expected experts with at least one of `rows` rows under uniform routing."""
    if E <= 0 or rows <= 0:
        return 0.0
    return E * (1.0 - (1.0 - 1.0 / E) ** rows)


def terms(cfg: dict, s: Shape, mm_flops_per_s: float, copy_bytes_per_s: float) -> Terms:
    """The model's terms for config fields `cfg` (tile_m, tile_n, cluster_m, cluster_n,
    tail_split; GemmConfig names) on shape `s` with the device's measured ceilings."""
    tm, tn = int(cfg["tile_m"]), int(cfg["tile_n"])
    cm, cn = int(cfg.get("cluster_m") or 1), int(cfg.get("cluster_n") or 1)
    um, un = tm * cm, tn * cn
    if s.form == "varlen":
        active = active_experts(s.E, s.rows)
        per_active = s.rows / active if active else 0.0
    else:
        active = float(s.E) if s.rows > 0 else 0.0
        per_active = s.rows / max(1, s.E)
    if active == 0.0 or s.N <= 0:
        return Terms(0.0, 0.0, 0.0)
    if s.form == "varlen":
        # Each active expert pads about half a unit of rows (at least one whole unit).
        units_m = max(active, s.rows / um + active / 2.0)
    else:
        units_m = active * math.ceil(per_active / um)
    units = units_m * math.ceil(s.N / un)
    clusters = max(1, s.nsm // (cm * cn))
    full = math.floor(units / clusters)
    rem = units - full * clusters
    tail = 0.0
    if rem > 1e-9:
        tail = 1.0
        if cfg.get("tail_split") and rem <= clusters / 2 and s.K >= 16 * TILE_K:
            tail = 0.55  # two half-K units plus the partial-tile hand-off
    waves = full + tail
    k_eff = max(s.K, TILE_K)
    flop_us = 2.0 * tm * tn * k_eff / (mm_flops_per_s / s.nsm) * 1e6
    nbytes = (s.rows * s.K * s.in_bytes + active * s.N * s.K * s.in_bytes
              + s.rows * s.N * s.out_bytes)
    return Terms(waves, flop_us, nbytes / copy_bytes_per_s * 1e6)


def predict_us(cfg: dict, p: Params, s: Shape, mm_flops_per_s: float,
               copy_bytes_per_s: float) -> float:
    """Predicted time in us of config `cfg` with fitted `p` on shape `s`."""
    return terms(cfg, s, mm_flops_per_s, copy_bytes_per_s).time_us(p)
