"""Where a training step's GPU time goes: the traced step of ``benchmarks/train_throughput.py --profile`` rows,
each kernel's time put in one category by its source (``profile.by_source``, :mod:`benchmarks.trace_summary`),
one stacked bar per row (an all-cuDNN row's attention kernels by name, from ``profile.top``).

    python benchmarks/step_breakdown_plot.py --runs s44-before-allsparse,s44-loss-allsparse \\
      --out results/training/step_breakdown_loss.png

Categories (:data:`CATEGORIES`, first match wins): the sparse-attention kernels (``pallas``), cuBLAS / cuDNN and
copies (``library``: the projections', MLP's and LM head's matmuls), the loss, the index estimate, the rest of the
sparse-attention path's XLA work, and the model's other XLA work (norms, SwiGLU, RoPE, optimizer).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script: the repo root
from benchmarks.kernels_report import load_rows  # noqa: E402

ROWS = os.path.join(ROOT, "results", "training", "train_throughput.jsonl")

#: (category, source-file prefixes): a ``by_source`` entry is ``pallas``, ``library``, ``communication`` or
#: ``file.py:N``; the first category whose prefix matches its file takes it
CATEGORIES = (
    ("sparse-attention kernels", ("pallas",)),
    ("cuDNN attention kernels", ()),  # taken out of "library" by kernel name (:data:`CUDNN_ATTENTION`)
    ("matmuls, copies (library)", ("library",)),
    ("communication", ("communication",)),
    ("loss", ("loss.py",)),
    ("index estimate", ("estimate.py",)),
    ("sparse path, other XLA", ("attention.py", "mosaic_index.py", "index.py", "index_format.py", "budgets.py",
                                "convert.py", "dispatch.py", "mosaic_stream.py", "mtraining.py", "steps.py")),
    ("model and optimizer, other XLA", ("",)),
)


#: names of cuDNN's attention kernels (fused flash forward / backward and their helpers)
CUDNN_ATTENTION = re.compile(r"cudnn|fmha|sdpa", re.IGNORECASE)


def categorize(by_source, top=None) -> dict:
    """``{category: ms}`` of one profile's ``by_source`` list (every category present, zeros included);
    ``top`` (the profile's per-kernel list): its cuDNN attention kernels without a JAX source line are
    moved from "library" to "cuDNN attention kernels" (they are listed there only while among the
    profile's ``top`` names)."""
    out = {name: 0.0 for name, _ in CATEGORIES}
    for entry in by_source:
        file = entry["source"].split(":")[0]
        for name, prefixes in CATEGORIES:
            if any(file.startswith(p) for p in prefixes):
                out[name] += entry["ms"]
                break
    cudnn = sum(t["ms"] for t in top or () if not t.get("src") and CUDNN_ATTENTION.search(t["name"]))
    out["cuDNN attention kernels"] += cudnn
    out["matmuls, copies (library)"] -= cudnn
    return out


def _parts(row) -> dict:
    return categorize(row["profile"]["by_source"], row["profile"].get("top"))


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
    parts = [_parts(r) for r in rows]
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
    devices = sorted({str(r.get("device") or r.get("device_kind") or "?") for r in rows})
    ax.set_title("128K training step, Qwen2.5-0.5B shape, " + " / ".join(devices), fontsize=10)
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
        print(r["run"], r["backend"], {k: round(v, 1) for k, v in _parts(r).items()})
    plot(rows, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
