"""Writing results: JSON (atomically) and the suite's PNG chart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.suite import DEFAULT_NAME

# The one writer of results (strict JSON: NaN and inf as null), shared with `moe-gemm tune`.
from moe_gemm.tuning.argcheck import out_argument
from moe_gemm.tuning.table_io import write_json

__all__ = ["out_argument", "out_path_argument", "plot_png", "write_json"]


def plot_png(doc: dict[str, Any], path: Path) -> str | None:
    """Bar chart: fraction of the roofline floor per shape, ours (default) vs each peer.

    Returns None when written, else why not (matplotlib missing, nothing to plot).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no PNG"
    shapes = [s for s in doc.get("shapes", {}) if any(
        r["shape"] == s and r.get("fraction_of_floor") for r in doc["results"])]
    names: list[str] = []
    for r in doc["results"]:
        if (r.get("default") or r.get("peer")) and r.get("fraction_of_floor"):
            if r["impl"] not in names:
                names.append(r["impl"])
    if not shapes or not names:
        return "nothing measured: no PNG"
    names.sort(key=lambda n: n != DEFAULT_NAME)
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(max(8.0, 1.5 * len(shapes)), 4.8))
    colors = plt.get_cmap("tab10")
    for j, name in enumerate(names):
        xs, hs, labels = [], [], []
        for i, s in enumerate(shapes):
            r = next((r for r in doc["results"] if r["shape"] == s and r["impl"] == name
                      and r.get("fraction_of_floor")), None)
            if r is not None:
                xs.append(i + (j - (len(names) - 1) / 2) * width)
                hs.append(r["fraction_of_floor"])
                labels.append(f"{r['ms'] * 1e3:.0f}")
        color = "black" if name == DEFAULT_NAME else colors(j % 10)
        bars = ax.bar(xs, hs, width, label=name, color=color)
        for b, text in zip(bars, labels):
            ax.text(b.get_x() + b.get_width() / 2, b.get_height(), text, ha="center",
                    va="bottom", fontsize=5, rotation=90)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.axhline(0.95, color="gray", lw=0.8, ls="--")
    ax.set_xticks(range(len(shapes)))
    ax.set_xticklabels(shapes, rotation=15)
    ax.set_ylabel("roofline floor / time (higher is better)")
    ax.set_title(f"moe_gemm vs peers: {doc.get('device')}, {doc.get('date')} (labels: us)",
                 fontsize=9)
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.15))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def out_path_argument(text: str) -> Path:
    """out_argument, as a Path."""
    return Path(out_argument(text))
