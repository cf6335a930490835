"""Plots of evaluation results (matplotlib, Agg): NIAH heatmaps, loss-by-position curves, RULER
bars and per-layer/head recall maps. Each function takes one or more ``(label, result)`` pairs, so
the same code draws a single run and a side-by-side comparison. Returns the PNG path.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def _save(fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def niah_heatmaps(runs, path: str) -> str:
    """Accuracy heatmaps (depth x context length), one panel per ``(label, niah_result)``."""
    fig, axes = plt.subplots(1, len(runs), figsize=(4.6 * len(runs) + 0.8, 3.6), squeeze=False,
                             gridspec_kw={"wspace": 0.25})
    im = None
    for ax, (label, r) in zip(axes[0], runs):
        a = np.asarray(r["accuracy"])
        im = ax.imshow(a, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(r["lengths"])), [f"{n // 1024}K" if n >= 1024 else str(n) for n in r["lengths"]])
        ax.set_yticks(range(len(r["depths"])), [f"{d:.0%}" for d in r["depths"]])
        for (i, j), v in np.ndenumerate(a):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
        ax.set_xlabel("context length")
        if ax is axes[0][0]:  # the panels share their rows: one label, none over the panel to the left
            ax.set_ylabel("needle depth")
        ax.set_title(f"{label}: {r['task']} (n={r['samples']}/cell)", fontsize=9)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="accuracy")
    fig.savefig(path, dpi=110, bbox_inches="tight")  # the colorbar spans the panels: no tight_layout
    plt.close(fig)
    return path


def position_curves(runs, path: str) -> str:
    """Mean loss per position bucket, one line per ``(label, perplexity_result)``."""
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for label, r in runs:
        e = np.asarray(r["bucket_edges"])
        ax.plot((e[:-1] + e[1:]) / 2, r["loss"], marker="o", ms=3, label=f"{label} (mean {r['mean_loss']:.3f})")
    ax.set_xlabel("token position")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("held-out loss by position", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def ruler_bars(runs, path: str) -> str:
    """Grouped bars: accuracy per (task, length), one colour per run."""
    fig, ax = plt.subplots(figsize=(7, 3.6))
    names = [f"{t}@{n}" for t in runs[0][1]["tasks"] for n in runs[0][1]["lengths"]]
    x = np.arange(len(names))
    w = 0.8 / len(runs)
    for i, (label, r) in enumerate(runs):
        vals = [a for t in r["tasks"].values() for a in t["accuracy"]]
        ax.bar(x + i * w - 0.4 + w / 2, vals, w, label=label)
    ax.set_xticks(x, names, rotation=45, ha="right", fontsize=7)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("exact-match accuracy")
    ax.legend(fontsize=8)
    return _save(fig, path)


def recall_maps(runs, path: str, p: str = "0.9") -> str:
    """Recall per (layer, head) at top-p ``p``, one panel per ``(label, recall_result)``."""
    fig, axes = plt.subplots(1, len(runs), figsize=(4 * len(runs) + 0.8, 3.4), squeeze=False)
    im = None
    for ax, (label, r) in zip(axes[0], runs):
        a = np.asarray(r["recall"][p])
        im = ax.imshow(a, vmin=min(0.5, float(a.min())), vmax=1, cmap="viridis", aspect="auto")
        ax.set_xlabel("query head")
        ax.set_ylabel("layer")
        ax.set_title(f"{label}: recall at p={p} (mean {r['mean_recall'][p]:.3f})", fontsize=9)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
