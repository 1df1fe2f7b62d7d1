"""The shapes of `moe-gemm bench --suite off-grid`: inputs nobody tuned for.

The zoo measures real models at the token counts the tables were tuned on; the default also
has to hold where a user's shape lands between and beyond them. These cases sit off that grid
on purpose, each for a reason the description names: one expert or a thousand, N or K at the
16-byte minimum or far past a tile, K that is no multiple of the 64-wide k-tile, routing so
skewed that most experts are empty, one row per expert, fp16 and fp32, the (E, K, N) weight
layout at odd sizes, and the list form with problems of unrelated sizes (M, N or K of 0
among them). Every size keeps rows 16-byte aligned (TMA's rule; a smaller size is not valid
input for the peers' kernels either).

The smoke set has the same names at sizes a CPU runs in seconds.
"""

from __future__ import annotations

import random

from benchmarks.suite import ShapeSpec, Size


def _mixed_problems(count: int, seed: int, low: int, high: int) -> tuple[Size, ...]:
    """`count` problems of unrelated sizes, each of M, N, K a multiple of 8 in [low, high]
    drawn log-uniformly (seeded: the same list on every machine)."""
    rng = random.Random(seed)

    def draw() -> int:
        v = int(round(low * (high / low) ** rng.random()))
        return max(low, v // 8 * 8)

    return tuple((draw(), draw(), draw()) for _ in range(count))


def _with_empties(problems: tuple[Size, ...]) -> tuple[Size, ...]:
    """The list with an M = 0 problem (an empty result) and a K = 0 one (a result of zeros)
    spliced in among the others."""
    m0 = (0, problems[0][1], problems[0][2])
    k0 = (problems[1][0], problems[1][1], 0)
    return problems[:3] + (m0,) + problems[3:6] + (k0,) + problems[6:]


def off_grid_suite() -> list[ShapeSpec]:
    mixed = _mixed_problems(40, seed=7, low=16, high=3072)
    return [
        ShapeSpec("og-e1", "varlen", "bf16",
                  "E=1 (a dense layer through the grouped op), 3000 rows, N=1000, K=1536",
                  experts=1, rows=3000, n=1000, k=1536),
        ShapeSpec("og-e3-odd", "varlen", "bf16",
                  "E=3, 777 rows uniform, N=2056, K=520 (no size a tile multiple)",
                  experts=3, rows=777, n=2056, k=520, zipf_s=0.0),
        ShapeSpec("og-k64", "varlen", "bf16",
                  "E=64, 8192 rows Zipf, N=4096, K=64 (one k-tile: output-bound)",
                  experts=64, rows=8192, n=4096, k=64),
        ShapeSpec("og-k96", "varlen", "bf16",
                  "E=16, 4096 rows Zipf, N=1536, K=96 (K ends inside a k-tile)",
                  experts=16, rows=4096, n=1536, k=96),
        ShapeSpec("og-n64", "varlen", "bf16",
                  "E=32, 16384 rows Zipf, N=64, K=4096 (narrow output: x-read-bound)",
                  experts=32, rows=16384, n=64, k=4096),
        ShapeSpec("og-n72", "varlen", "bf16",
                  "E=40, 5000 rows Zipf, N=72, K=2048 (N just past 64)",
                  experts=40, rows=5000, n=72, k=2048),
        ShapeSpec("og-e1024", "varlen", "bf16",
                  "E=1024, 4096 rows Zipf (most experts tiny or empty), N=256, K=1024",
                  experts=1024, rows=4096, n=256, k=1024),
        ShapeSpec("og-e512-dec", "varlen", "bf16",
                  "E=512, 64 rows Zipf (decode on many experts), N=1024, K=2048",
                  experts=512, rows=64, n=1024, k=2048),
        ShapeSpec("og-hot", "varlen", "bf16",
                  "E=128, 32768 rows Zipf s=2 (a few experts take most rows), N=2048, K=2048",
                  experts=128, rows=32768, n=2048, k=2048, zipf_s=2.0),
        ShapeSpec("og-long-k", "varlen", "bf16",
                  "E=8, 1024 rows uniform, N=512, K=32768",
                  experts=8, rows=1024, n=512, k=32768, zipf_s=0.0),
        ShapeSpec("og-wide-n", "varlen", "bf16",
                  "E=4, 2048 rows uniform, N=32768, K=1024",
                  experts=4, rows=2048, n=32768, k=1024, zipf_s=0.0),
        ShapeSpec("og-1row-each", "varlen", "bf16",
                  "E=8, one row per expert, N=4096, K=4096",
                  experts=8, rows=8, n=4096, k=4096, fixed_counts=(1,) * 8),
        ShapeSpec("og-1-token", "varlen", "bf16",
                  "E=64, a single routed row, N=2048, K=7168",
                  experts=64, rows=1, n=2048, k=7168),
        ShapeSpec("og-mid", "varlen", "bf16",
                  "E=60, 12000 rows Zipf, N=1408, K=2048",
                  experts=60, rows=12000, n=1408, k=2048),
        ShapeSpec("og-ekn-odd", "varlen", "bf16",
                  "E=24, 6000 rows Zipf, N=2880, K=2880, weights (E, K, N)",
                  experts=24, rows=6000, n=2880, k=2880, layout="EKN"),
        ShapeSpec("og-fp16", "varlen", "fp16",
                  "E=32, 8192 rows Zipf, N=3072, K=1536, fp16",
                  experts=32, rows=8192, n=3072, k=1536),
        ShapeSpec("og-fp32", "varlen", "fp32",
                  "E=16, 2048 rows Zipf, N=1024, K=1024, fp32 in and out",
                  experts=16, rows=2048, n=1024, k=1024),
        ShapeSpec("og-odd-all", "varlen", "bf16",
                  "E=7, 1234 rows Zipf, N=1112, K=1160",
                  experts=7, rows=1234, n=1112, k=1160),
        ShapeSpec("og-list-mix", "general", "bf16",
                  "42 problems of unrelated sizes (M, N, K multiples of 8 in 16-3072, "
                  "log-uniform, seeded), one M=0 and one K=0 among them",
                  problems=_with_empties(mixed)),
        ShapeSpec("og-list-tiny", "general", "bf16",
                  "128 x (M=48, N=256, K=256): many tiny problems",
                  problems=((48, 256, 256),) * 128),
        ShapeSpec("og-list-big1", "general", "bf16",
                  "one 4096^3 problem and 31 of (64, 128, 128)",
                  problems=((4096, 4096, 4096),) + ((64, 128, 128),) * 31),
        ShapeSpec("og-bmm-longk", "general", "bf16",
                  "8 x (M=128, N=512, K=32768): few tiles of long K (the 3-D form)",
                  problems=((128, 512, 32768),) * 8),
        ShapeSpec("og-list-longk", "general", "bf16",
                  "4 problems of N 1024-2048, K 8192-16384, M 64-384: few tiles of long K",
                  problems=((256, 1024, 16384), (128, 1024, 16384), (384, 1024, 8192),
                            (64, 2048, 16384))),
        ShapeSpec("og-bmm-decode", "general", "bf16",
                  "8 x (M=1, N=4096, K=4096): one row per problem (the 3-D form)",
                  problems=((1, 4096, 4096),) * 8),
    ]


def off_grid_smoke_suite() -> list[ShapeSpec]:
    """The same names at CPU sizes (the harness, not the kernel)."""
    mixed = _mixed_problems(10, seed=7, low=8, high=64)
    return [
        ShapeSpec("og-e1", "varlen", "bf16", "smoke", experts=1, rows=30, n=40, k=48),
        ShapeSpec("og-e3-odd", "varlen", "bf16", "smoke", experts=3, rows=17, n=24, k=40,
                  zipf_s=0.0),
        ShapeSpec("og-k96", "varlen", "bf16", "smoke", experts=4, rows=64, n=32, k=96),
        ShapeSpec("og-e1024", "varlen", "bf16", "smoke", experts=64, rows=40, n=16, k=32),
        ShapeSpec("og-1row-each", "varlen", "bf16", "smoke", experts=4, rows=4, n=32, k=32,
                  fixed_counts=(1,) * 4),
        ShapeSpec("og-ekn-odd", "varlen", "bf16", "smoke", experts=3, rows=50, n=24, k=40,
                  layout="EKN"),
        ShapeSpec("og-fp32", "varlen", "fp32", "smoke", experts=4, rows=32, n=16, k=16),
        ShapeSpec("og-list-mix", "general", "bf16", "smoke",
                  problems=_with_empties(mixed)),
    ]
