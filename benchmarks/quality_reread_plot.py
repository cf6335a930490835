"""What a denser index buys back on a sparse-trained model: the held-out loss of one set of trained
parameters read with its own attention, with each ``--reread`` setting (``benchmarks/quality_study.py``) and
with dense attention in every layer, against the index's density at p = 0.9 (the share of key blocks the
kernels compute), the dense-trained model of the same seed as a line. Error bars: 95 % t-interval of the
difference to the own read, paired over the held-out windows (the evaluation's sampling on that model).

    python benchmarks/quality_reread_plot.py --run s32-warm-start-400-seed-3 \\
      --out results/quality/quality_s32_reread.png
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script: the repo root
from benchmarks.quality_gap_plot import run_plot_args  # noqa: E402
from benchmarks.quality_seeds import window_difference  # noqa: E402


def points(rows, run: str, arm: str = "mtraining") -> list:
    """``[(seed, label, density, loss, half_width, dense_arm_loss)]`` for every row of ``run``'s ``arm`` that has
    ``rereads``: its own read, each reread and its dense read (density 1); ``half_width`` is the 95 % interval's
    half width of the difference to the own read (0 for the own read). ``ValueError`` when there is none."""
    dense = {r["seed"]: r.get("heldout_loss") for r in rows if r.get("run") == run and r.get("arm") == "dense"}
    out = []
    for r in rows:
        if r.get("run") != run or r.get("arm") != arm or not r.get("rereads"):
            continue
        own, base = r["eval"], float(r["eval"]["perplexity"]["mean_loss"])
        reads = [(" ".join(o.rpartition(".")[2] for o in rr["overrides"]), rr["eval"]) for rr in r["rereads"]
                 if not rr.get("error")]
        out.append((r["seed"], "own read (defaults)", own["recall"]["mean_density"]["0.9"], base, 0.0, dense.get(r["seed"])))
        for label, ev in reads:
            iv = window_difference(ev, own)
            out.append((r["seed"], label, ev["recall"]["mean_density"]["0.9"], base + iv["mean"],
                        (iv["hi"] - iv["mean"]) if iv["hi"] is not None else 0.0, dense.get(r["seed"])))
        if r.get("cross_eval"):
            iv = window_difference(r["cross_eval"]["eval"], own)
            out.append((r["seed"], "dense attention", 1.0, base + iv["mean"],
                        (iv["hi"] - iv["mean"]) if iv["hi"] is not None else 0.0, dense.get(r["seed"])))
    if not out:
        raise ValueError(f"run {run!r}: no {arm} row with rereads")
    return out


def plot(pts, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for seed in sorted({p[0] for p in pts}):
        mine = sorted((p for p in pts if p[0] == seed), key=lambda p: p[2])
        ax.errorbar([p[2] for p in mine], [p[3] for p in mine], yerr=[p[4] for p in mine], marker="o", capsize=3,
                    label=f"MTraining-trained, seed {seed}")
        for p in mine:
            ax.annotate(p[1], (p[2], p[3]), textcoords="offset points", xytext=(6, 4), fontsize=7)
        if mine[0][5] is not None:
            ax.axhline(mine[0][5], ls="--", color="gray", label=f"dense-trained, seed {seed}")
    ax.set_xscale("log")
    ax.set_xlabel("index density at p = 0.9 (share of key blocks computed; dense = 1)")
    ax.set_ylabel("held-out loss @ 32K (nats/byte)")
    ax.set_title("The same trained parameters read with denser indices", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    a, pts = run_plot_args(__doc__.split("\n")[0], "MTraining rereads", points, argv)
    if pts is None:
        return 1
    for seed, label, dens, loss, hw, dense in pts:
        print(f"seed {seed}: {label}: density {dens:.3f}, held-out {loss:.4f} ± {hw:.4f}"
              + (f" (dense-trained {dense:.4f})" if dense is not None else ""))
    print(plot(pts, a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
