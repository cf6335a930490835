"""Where a training step's GPU time goes: the traced step of ``benchmarks/train_throughput.py --profile`` rows,
each kernel's time put in one category by its source (``profile.by_source``, :mod:`benchmarks.trace_summary`),
one stacked bar per row.

    python benchmarks/step_breakdown_plot.py --runs s44-before-allsparse,s44-loss-allsparse \\
      --out results/training/step_breakdown_loss.png

Categories (:data:`CATEGORIES`, first match wins): the sparse-attention kernels (``pallas``), cuBLAS / cuDNN and
copies (``library``: the projections', MLP's and LM head's matmuls), the loss, the index estimate, the rest of the
sparse-attention path's XLA work, and the model's other XLA work (norms, SwiGLU, RoPE, optimizer).
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script: the repo root
from benchmarks.kernels_report import load_rows  # noqa: E402

ROWS = os.path.join(ROOT, "results", "training", "train_throughput.jsonl")

#: (category, source-file prefixes): a ``by_source`` entry is ``pallas``, ``library``, ``communication`` or
#: ``file.py:N``; the first category whose prefix matches its file takes it
CATEGORIES = (
    ("sparse-attention kernels", ("pallas",)),
    ("matmuls, copies (library)", ("library",)),
    ("communication", ("communication",)),
    ("loss", ("loss.py",)),
    ("index estimate", ("estimate.py",)),
    ("sparse path, other XLA", ("attention.py", "mosaic_index.py", "index.py", "index_format.py", "budgets.py",
                                "convert.py", "dispatch.py", "mosaic_stream.py", "mtraining.py", "steps.py")),
    ("model and optimizer, other XLA", ("",)),
)


def categorize(by_source) -> dict:
    """``{category: ms}`` of one profile's ``by_source`` list (every category present, zeros included)."""
    out = {name: 0.0 for name, _ in CATEGORIES}
    for entry in by_source:
        file = entry["source"].split(":")[0]
        for name, prefixes in CATEGORIES:
            if any(file.startswith(p) for p in prefixes):
                out[name] += entry["ms"]
                break
    return out


def profiled(rows, runs) -> list[dict]:
    """The rows of ``runs`` that carry a profile, in file order; ``ValueError`` naming a run without one."""
    out = [r for r in rows if r.get("run") in runs and r.get("profile")]
    missing = [run for run in runs if not any(r["run"] == run for r in out)]
    if missing:
        raise ValueError(f"no profiled row in runs {missing}")
    return out


def label(row) -> str:
    return f"{row['run']}\n{row['backend']}, {row['commit'][:7]}\nstep {row['step_ms']:.0f} ms"


def plot(rows, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2.6 + 2.2 * len(rows), 5.0))
    bottoms = [0.0] * len(rows)
    parts = [categorize(r["profile"]["by_source"]) for r in rows]
    for name, _ in CATEGORIES:
        vals = [p[name] for p in parts]
        bars = ax.bar(range(len(rows)), vals, bottom=bottoms, label=name)
        for i, (v, b) in enumerate(zip(vals, bottoms)):
            if v >= 25:
                ax.text(i, b + v / 2, f"{v:.0f}", ha="center", va="center", fontsize=8)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
        del bars
    ax.set_xticks(range(len(rows)), [label(r) for r in rows], fontsize=8)
    ax.set_ylabel("GPU kernel time in one traced step (ms)")
    ax.set_title("128K training step, Qwen2.5-0.5B shape, one H200")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=ROWS, help="train_throughput JSONL (default: the committed results)")
    ap.add_argument("--runs", required=True, help="comma-separated run tags whose profiled rows to plot")
    ap.add_argument("--out", required=True, help="PNG path")
    args = ap.parse_args(argv)
    rows = profiled(load_rows([args.rows]), args.runs.split(","))
    for r in rows:
        print(r["run"], {k: round(v, 1) for k, v in categorize(r["profile"]["by_source"]).items()})
    plot(rows, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
