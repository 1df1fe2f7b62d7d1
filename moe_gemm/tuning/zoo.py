"""The model zoo: the routed-expert GEMMs of public MoE models, and a routing model.

Each model contributes two grouped GEMMs per MoE layer, both `grouped_mm(x, w, offs)`:
- gate_up: x (T, hidden) @ w (E, hidden, 2 * intermediate): the fused gate and up projections;
- down: x (T, intermediate) @ w (E, intermediate, hidden).
T = tokens * top_k routed rows. The weights are laid out as the public checkpoints store them
once loaded by transformers: "ENK" keeps each expert's weight as (N, K), K contiguous (Mixtral,
Qwen, DeepSeek, Kimi, OLMoE, GLM: gate_up_proj (E, 2I, H), down_proj (E, H, I)), passed as the
transposed view w_t.transpose(1, 2); "EKN" stores (K, N), N contiguous (gpt-oss and Llama 4:
gate_up_proj (E, H, 2I), down_proj (E, I, H)).

The configs are the models' config.json values (hidden_size, moe_intermediate_size or
intermediate_size, the routed expert count, experts per token). Shared experts are dense
GEMMs, not part of the grouped call, and are left out.

Routing (`topk_counts`): each expert gets a popularity exp(sigma * z), z standard normal
(seeded), and every token picks top_k distinct experts by weighted sampling without
replacement. sigma = 0.5 puts the busiest of 256 experts at ~3-4x the mean load at prefill
sizes and ~2x among 8, the range reported for trained routers with load balancing; decode
batches leave most experts empty. The streams are ones their makers keep stable, so a seed
routes the same everywhere: `random.Random` for the popularity and top-1 tokens, numpy's
frozen legacy generator (seeded with the same stream's state) for a top-1 routing of more
than DRAW_AT_ONCE_TOKENS tokens (one multinomial) and for every top-k > 1 routing (arrays of
TOPK_BLOCK_TOKENS tokens at a time). Top-k > 1 routings were drawn token by token in Python
before (~0.4 us a pick: 2^22 top-8 tokens over 384 experts took 14 s, 1 s in arrays; at the
int32 row limit, 2^28 tokens, ~15 minutes against 62 s); that gave the same distribution but
other counts for a seed, which the results of 2026-11-30 and earlier on the zoo's routings
hold (a zoo case records its counts).
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from dataclasses import dataclass

import numpy as np

ROUTING_SIGMA = 0.5
# Above this many top-1 tokens the counts are one multinomial draw: token by token, 2^31 rows
# took about an hour (`moe-gemm tune --shapes E,N,K,2147483647 --list` printed nothing for
# that long). 2^20 tokens still take well under a second, and no shape routed so far came
# near it, so every count drawn before stays the same.
DRAW_AT_ONCE_TOKENS = 1 << 20
# Tokens a top-k > 1 routing draws per array: bounds the temporaries (4 MB of uniforms at
# top-8). It orders the generator's stream (the repeats of one block are drawn again before the
# next block), so a seed's counts depend on it: changing it changes every top-k draw.
TOPK_BLOCK_TOKENS = 1 << 16
# Bins per expert of the guide table that starts each categorical search (Chen and Asau):
# np.searchsorted over the 384-entry CDF took ~60 ns a pick, two thirds of the whole draw;
# with ~16 bins an expert nearly every pick ends in the bin it starts from.
GUIDE_BINS_PER_EXPERT = 16
# Tokens per call, decode to prefill (the routed rows are tokens * top_k).
TOKENS = (1, 16, 128, 512, 2048, 8192, 32768)
# The subset the zoo benchmark runs by default, which the tuner also takes first at every token
# count: 8 to 256 experts, top-1 to top-8, both weight layouts, decode and prefill; with QuACK's
# autotuner as a peer (10-40 s per case) it fits about nine minutes on an H100.
DEFAULT_MODELS = ("Mixtral-8x7B", "Qwen3-30B-A3B", "DeepSeek-V3", "gpt-oss-120b",
                  "Llama-4-Scout")
DEFAULT_TOKENS = (16, 2048)


@dataclass(frozen=True)
class Projection:
    """One grouped GEMM of a model: E experts, (N, K) per expert."""

    model: str
    proj: str  # "gate_up" | "down"
    E: int
    N: int
    K: int
    top_k: int
    layout: str  # "ENK" | "EKN"

    def rows(self, tokens: int) -> int:
        return tokens * self.top_k

    @property
    def label(self) -> str:
        return f"{self.model}/{self.proj}"


@dataclass(frozen=True)
class MoEModel:
    name: str
    hf_id: str
    experts: int  # routed experts in one MoE layer (on one rank for a shard)
    top_k: int
    hidden: int
    intermediate: int  # per expert
    layout: str = "ENK"
    note: str = ""
    fp8_id: str = ""  # the published FP8 checkpoint ("" where none is published)

    def projections(self) -> tuple[Projection, Projection]:
        return (Projection(self.name, "gate_up", self.experts, 2 * self.intermediate,
                           self.hidden, self.top_k, self.layout),
                Projection(self.name, "down", self.experts, self.hidden, self.intermediate,
                           self.top_k, self.layout))


MODELS: tuple[MoEModel, ...] = (
    MoEModel("Mixtral-8x7B", "mistralai/Mixtral-8x7B-v0.1", 8, 2, 4096, 14336),
    MoEModel("Mixtral-8x22B", "mistralai/Mixtral-8x22B-v0.1", 8, 2, 6144, 16384),
    MoEModel("Qwen2-57B-A14B", "Qwen/Qwen2-57B-A14B", 64, 8, 3584, 2560),
    MoEModel("Qwen3-30B-A3B", "Qwen/Qwen3-30B-A3B", 128, 8, 2048, 768,
             fp8_id="Qwen/Qwen3-30B-A3B-FP8"),
    MoEModel("Qwen3-235B-A22B", "Qwen/Qwen3-235B-A22B", 128, 8, 4096, 1536,
             fp8_id="Qwen/Qwen3-235B-A22B-FP8"),
    MoEModel("DeepSeek-V3", "deepseek-ai/DeepSeek-V3", 256, 8, 7168, 2048,
             fp8_id="deepseek-ai/DeepSeek-V3"),
    MoEModel("DeepSeek-V3-EP8", "deepseek-ai/DeepSeek-V3", 32, 8, 7168, 2048,
             note="one rank of 8-way expert parallelism: 32 of the 256 experts; tokens are "
             "per rank, and the all-to-all brings the rank tokens * top_k rows on average",
             fp8_id="deepseek-ai/DeepSeek-V3"),
    MoEModel("Kimi-K2", "moonshotai/Kimi-K2-Instruct", 384, 8, 7168, 2048,
             fp8_id="moonshotai/Kimi-K2-Instruct"),
    MoEModel("gpt-oss-20b", "openai/gpt-oss-20b", 32, 4, 2880, 2880, "EKN"),
    MoEModel("gpt-oss-120b", "openai/gpt-oss-120b", 128, 4, 2880, 2880, "EKN"),
    MoEModel("Llama-4-Scout", "meta-llama/Llama-4-Scout-17B-16E", 16, 1, 5120, 8192, "EKN"),
    MoEModel("Llama-4-Maverick", "meta-llama/Llama-4-Maverick-17B-128E", 128, 1, 5120, 8192,
             "EKN"),
    MoEModel("OLMoE-1B-7B", "allenai/OLMoE-1B-7B-0924", 64, 8, 2048, 1024),
    MoEModel("GLM-4.5", "zai-org/GLM-4.5", 160, 8, 5120, 1536, fp8_id="zai-org/GLM-4.5-FP8"),
    MoEModel("GLM-4.5-Air", "zai-org/GLM-4.5-Air", 128, 8, 4096, 1408,
             fp8_id="zai-org/GLM-4.5-Air-FP8"),
)
# Models the shipped tables were never tuned on, from their config.json values: `--models
# held-out` (the zoo benchmark, the tuner) runs them to measure how the config choice does on
# shapes it has not seen (the tables' nearest timed shapes, the rules and the whole-wave fit).
# No (E, N, K) of theirs is in a shipped table's entries or samples
# (tests/tuning/test_tables.py): DeepSeek-V2 (GLM-4.5's experts at top-6) and dots.llm1
# (GLM-4.5-Air's) are left out for that reason. 8 to 512 experts, top-1 to top-10, N from
# 1024 to 65536, K from 512 to 32768.
HELD_OUT: tuple[MoEModel, ...] = (
    MoEModel("DBRX", "databricks/dbrx-instruct", 16, 4, 6144, 10752),
    MoEModel("Phi-3.5-MoE", "microsoft/Phi-3.5-MoE-instruct", 16, 2, 4096, 6400),
    MoEModel("Grok-1", "xai-org/grok-1", 8, 2, 6144, 32768),
    MoEModel("Arctic", "Snowflake/snowflake-arctic-instruct", 128, 2, 7168, 4864),
    MoEModel("DeepSeek-V2-Lite", "deepseek-ai/DeepSeek-V2-Lite", 64, 6, 2048, 1408),
    MoEModel("Qwen1.5-MoE-A2.7B", "Qwen/Qwen1.5-MoE-A2.7B", 60, 4, 2048, 1408),
    MoEModel("Jamba-v0.1", "ai21labs/Jamba-v0.1", 16, 2, 4096, 14336),
    MoEModel("MiniMax-Text-01", "MiniMaxAI/MiniMax-Text-01", 32, 2, 6144, 9216),
    MoEModel("Hunyuan-Large", "tencent/Tencent-Hunyuan-Large", 16, 1, 6400, 18304),
    MoEModel("Qwen3-Coder-480B-A35B", "Qwen/Qwen3-Coder-480B-A35B-Instruct", 160, 8, 6144,
             2560),
    MoEModel("ERNIE-4.5-300B-A47B", "baidu/ERNIE-4.5-300B-A47B-PT", 64, 8, 8192, 3584),
    MoEModel("ERNIE-4.5-21B-A3B", "baidu/ERNIE-4.5-21B-A3B-PT", 64, 6, 2560, 1536),
    MoEModel("Granite-3.0-3B-A800M", "ibm-granite/granite-3.0-3b-a800m-instruct", 40, 8, 1536,
             512),
    MoEModel("Qwen3-Next-80B-A3B", "Qwen/Qwen3-Next-80B-A3B-Instruct", 512, 10, 2048, 512),
    MoEModel("MiniMax-M2", "MiniMaxAI/MiniMax-M2", 256, 8, 3072, 1536),
)
BY_NAME = {m.name: m for m in MODELS + HELD_OUT}
# The models that ship FP8 checkpoints (those with an fp8_id; DeepSeek-V3 and Kimi-K2 are
# published in FP8, with 128x128 weight blocks), in the order an FP8 run takes them.
FP8_MODELS = ("DeepSeek-V3", "DeepSeek-V3-EP8", "Kimi-K2", "Qwen3-30B-A3B", "Qwen3-235B-A22B",
              "GLM-4.5", "GLM-4.5-Air")


def select_models(spec: str | None) -> list[MoEModel]:
    """Models named in a comma-separated list ('all' or None: every zoo model, DEFAULT_MODELS
    first; 'default': DEFAULT_MODELS; 'held-out': HELD_OUT, which 'all' leaves out);
    case-insensitive. Raises ValueError naming the unknown ones and the known names (an
    empty spec names none: it is refused, not read as 'all')."""
    if spec is None or spec.strip().lower() == "all":
        return sorted(MODELS, key=lambda m: m.name not in DEFAULT_MODELS)
    if spec.strip().lower() == "default":
        return [BY_NAME[n] for n in DEFAULT_MODELS]
    if spec.strip().lower() == "held-out":
        return list(HELD_OUT)
    lower = {name.lower(): model for name, model in BY_NAME.items()}
    picked, unknown = [], []
    names = [s.strip() for s in spec.split(",")]
    if any(names) and "" in names:  # (a stray or trailing comma: not a list it spells)
        raise ValueError(f"an empty model name in {spec!r} (a stray ','?); known: "
                         + ", ".join(BY_NAME) + " ('all', 'default', 'held-out')")
    for name in filter(None, names):
        model = lower.get(name.lower())
        if model is None:
            unknown.append(name)
        elif model not in picked:
            picked.append(model)
    if unknown or not picked:
        raise ValueError(f"unknown model(s) {', '.join(unknown) or '(none)'}; known: "
                         + ", ".join(BY_NAME)
                         + " ('all', 'default', 'held-out')")
    return picked


def parse_tokens(spec: str | None, default: tuple[int, ...]) -> list[int]:
    """Token counts from '16,2048' ('all': TOKENS; None: default). ValueError when bad."""
    if spec is None:
        return list(default)
    if spec.strip().lower() == "all":
        return list(TOKENS)
    try:
        values = [int(v) for v in spec.split(",")]  # ('' of a stray comma: refused)
    except ValueError:
        raise ValueError(f"tokens must be comma-separated positive integers; got {spec!r}"
                         ) from None
    if not values or min(values) <= 0:
        raise ValueError(f"tokens must be comma-separated positive integers; got {spec!r}")
    return list(dict.fromkeys(values))


def popularity(experts: int, sigma: float, seed: int) -> list[float]:
    """Per-expert routing weights exp(sigma * z), z ~ N(0, 1) from random.Random(seed)."""
    rng = random.Random(seed)
    return [math.exp(sigma * rng.gauss(0.0, 1.0)) for _ in range(experts)]


def topk_counts(experts: int, tokens: int, top_k: int, seed: int,
                sigma: float = ROUTING_SIGMA) -> list[int]:
    """Rows per expert when `tokens` tokens each pick `top_k` distinct experts.

    Args:
        experts: E > 0.
        tokens: tokens >= 0.
        top_k: 1 <= top_k <= E.
        seed: any int; the same seed gives the same counts on every machine.
        sigma: spread of the log-normal expert popularity (0: uniform).

    Returns:
        E non-negative ints summing to tokens * top_k, none above `tokens`.
    """
    if experts <= 0:
        raise ValueError(f"experts must be positive; got {experts}")
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0; got {tokens}")
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be between 1 and experts ({experts}); got {top_k}")
    if tokens * top_k > 2**31 - 1:
        # 10**14 tokens (`--tokens`) would draw for hours before anything is printed, for
        # rows no kernel takes (offs are int32).
        raise ValueError(f"tokens x top_k = {tokens} x {top_k} routed rows; at most "
                         f"{2**31 - 1} (offs are int32)")
    if sigma < 0 or not math.isfinite(sigma):
        raise ValueError(f"sigma must be a finite number >= 0; got {sigma}")
    weights = popularity(experts, sigma, seed)
    total = sum(weights)
    shares = [w / total for w in weights]
    cdf = list(itertools.accumulate(shares))
    rng = random.Random(seed * 7919 + 1)
    if top_k > 1:
        return _distinct_counts(_legacy_numpy(rng), cdf, tokens, top_k)
    if tokens > DRAW_AT_ONCE_TOKENS:
        # Top-1 tokens pick independently, so the counts are exactly multinomial.
        return [int(c) for c in _legacy_numpy(rng).multinomial(tokens, shares)]
    counts = [0] * experts
    for _ in range(tokens):
        counts[min(bisect.bisect_right(cdf, rng.random()), experts - 1)] += 1
    return counts


def _legacy_numpy(rng: random.Random) -> np.random.RandomState:
    """numpy's legacy MT19937 generator (its stream is frozen) started from `rng`'s state, so
    that the seed still decides what it draws (any int: RandomState itself takes 0..2^32-1)."""
    _, internal, _ = rng.getstate()  # 624 state words, then the position in them
    gen = np.random.RandomState()
    gen.set_state(("MT19937", np.array(internal[:-1], dtype=np.uint32), internal[-1]))
    return gen


def _distinct_counts(gen: np.random.RandomState, cdf: list[float], tokens: int,
                     top_k: int) -> list[int]:
    """Rows per expert when each token takes `top_k` distinct experts (`_distinct_picks`),
    TOPK_BLOCK_TOKENS tokens at a time."""
    table = _CategoricalTable(np.asarray(cdf))
    counts = np.zeros(len(cdf), dtype=np.int64)
    for start in range(0, tokens, TOPK_BLOCK_TOKENS):
        picks = _distinct_picks(gen, table, min(TOPK_BLOCK_TOKENS, tokens - start), top_k)
        counts += np.bincount(picks.ravel(), minlength=len(cdf))
    return counts.tolist()


def _distinct_picks(gen: np.random.RandomState, table: _CategoricalTable, tokens: int,
                    top_k: int) -> np.ndarray:
    """(tokens, top_k) experts, distinct in each row: per token, the first `top_k` distinct
    experts of a stream of independent picks, i.e. weighted sampling without replacement, as
    drawing a token's picks one by one and rejecting repeats does, in arrays. A repeated pick
    is drawn again until its token's picks differ; as only the set of a token's experts
    counts, redrawing the later of two equal picks is the same as rejecting it in the stream."""
    picks = table.draw(gen, (tokens, top_k))
    ordered = np.sort(picks, axis=1)
    # ~9% of top-8 tokens over 384 experts hold a repeat at sigma 0.5: only those rows are
    # searched for which picks repeat (a sort finds the rows ~3x faster than that search),
    # and each round only the rows still holding one.
    rows = np.flatnonzero((ordered[:, 1:] == ordered[:, :-1]).any(axis=1))
    again = _repeats(picks[rows])
    while rows.size:
        redo = picks[rows]
        redo[again] = table.draw(gen, int(again.sum()))
        picks[rows] = redo
        again = _repeats(redo)
        left = again.any(axis=1)
        rows, again = rows[left], again[left]
    return picks


def _repeats(picks: np.ndarray) -> np.ndarray:
    """(tokens, top_k) bool: True where a pick equals an earlier pick of its token."""
    again = np.zeros(picks.shape, dtype=bool)
    for j in range(1, picks.shape[1]):
        again[:, j] = (picks[:, :j] == picks[:, j:j + 1]).any(axis=1)
    return again


class _CategoricalTable:
    """Picks from a CDF as `min(bisect_right(cdf, u), E - 1)` gives them for uniform u (the
    token-by-token draw's rule; the last CDF value may round below 1), through a guide table:
    per bin [b / B, (b + 1) / B) of [0, 1), the count of CDF values <= b / B, where the search
    for a u in that bin starts. B is a power of two, so u * B and b / B are exact."""

    def __init__(self, cdf: np.ndarray) -> None:
        self.cdf = cdf
        bins = 1 << math.ceil(math.log2(GUIDE_BINS_PER_EXPERT * len(cdf)))
        self.start = np.minimum(np.searchsorted(cdf, np.arange(bins) / bins, side="right"),
                                len(cdf) - 1)

    def draw(self, gen: np.random.RandomState, size: int | tuple[int, int]) -> np.ndarray:
        """Picks (int64 expert indices) of `size`, from `gen`'s uniforms."""
        u = gen.random_sample(size)
        pick = self.start[(u * len(self.start)).astype(np.int64)]
        flat_u, flat_pick = u.reshape(-1), pick.reshape(-1)
        last = len(self.cdf) - 1
        # Step past the CDF values <= u that the bin holds beyond its start: a few percent of
        # the picks, so after the first test only those are looked at again.
        at = np.flatnonzero((flat_pick < last) & (self.cdf[flat_pick] <= flat_u))
        while at.size:
            flat_pick[at] += 1
            at = at[(flat_pick[at] < last) & (self.cdf[flat_pick[at]] <= flat_u[at])]
        return pick


def default_kernel_key(E: int, N: int, K: int, rows: int, layout: str, device: str | None,
                       nsm: int = 132):
    """The CompileKey our default (no config) launches for a bf16 zoo projection of `rows`
    routed rows on a GPU named `device` (its tuned table, else the rules): what the zoo
    benchmark and `scripts/precompile.py --set zoo` compile ahead."""
    import torch

    from moe_gemm.config import GemmConfig
    from moe_gemm.ops.heuristics import choose_varlen
    from moe_gemm.ops.launch_kernel import _compile_key

    choice = choose_varlen(GemmConfig(), rows, E, N, K, nsm, device=device, swap_ok=True)
    return _compile_key("varlen", torch.bfloat16, torch.bfloat16,
                        "k" if layout == "ENK" else "n", choice, False)
