"""The index estimate's Pallas Triton window passes per tiling beside the XLA estimate
(``benchmarks/window_tiles.py`` rows), and what the step A/Bs of the same session measured
(``benchmarks/ab_trees.py`` rows of ``benchmarks/train_throughput.py``): one figure.

    python benchmarks/window_tiles_plot.py --tiles-runs s46-window-tiles-a,s46-window-tiles-b \\
      --ab-runs s46-arms-ab,s46-est-tiling-ab --out results/quality/quality_window_tiles.png
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script: the repo root
from benchmarks.ab_trees import compare  # noqa: E402
from benchmarks.kernels_report import load_rows  # noqa: E402

ESTIMATE = os.path.join(ROOT, "results", "quality", "estimate_cost.jsonl")
THROUGHPUT = os.path.join(ROOT, "results", "training", "train_throughput.jsonl")
PASSES = ("row_max", "exp_digit_sums", "column_digit_sums")


def tilings(rows) -> dict:
    """``{run: {"xla": ms, tiling: {fn: ms}}}`` from window_tiles rows (tilings that failed to compile,
    rows with ``error``, left out). ``ValueError`` if a run has no XLA row."""
    out: dict = {}
    for r in rows:
        if "error" in r:
            continue
        d = out.setdefault(r["run"], {})
        if r["impl"] == "xla":
            d["xla"] = r["ms"]
        else:
            d.setdefault(r["tiling"], {})[r["fn"]] = r["ms"]
    for run, d in out.items():
        if "xla" not in d:
            raise ValueError(f"run {run!r} has no XLA estimate row to compare the tilings with")
    return out


def step_deltas(rows) -> list:
    """``[(label, mean, low, high)]``: each arm's step minus main's (ms, paired over rounds) per run."""
    out = []
    for run in sorted({r["run"] for r in rows}):
        rr = [r for r in rows if r["run"] == run]
        arms = ["main"] + sorted({r["ab_arm"] for r in rr} - {"main"})
        for c in compare(rr, arms, "step_ms", ()):
            iv = c["diff"]
            out.append((f"{c['arm']} ({run})", iv["mean"], iv["lo"], iv["hi"]))
    return out


def plot(tiles: dict, deltas: list, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]})
    labels, y = [], 0
    for run, d in tiles.items():
        for t, fns in d.items():
            if t == "xla":
                continue
            left = 0.0
            for i, fn in enumerate(PASSES):
                a.barh(y, fns.get(fn, 0.0), left=left, color=f"C{i}", label=fn if y == 0 else None)
                left += fns.get(fn, 0.0)
            if "estimate" in fns:
                a.plot(fns["estimate"], y, "kD", ms=5, label="whole estimate (kernels)" if y == 0 else None)
            labels.append(f"{t}  [{run.rsplit('-', 1)[-1]}]")
            y += 1
        a.axvline(d["xla"], color="grey", ls="--", lw=1, label=f"XLA estimate ({run.rsplit('-', 1)[-1]})")
    a.set_yticks(range(len(labels)), labels, fontsize=7)
    a.invert_yaxis()
    a.set_xlabel("ms per layer (128K, 14/2 heads, d64, last_q 64); tiling KEY_TILE:KEY_CHUNK:WARPS:STAGES")
    a.legend(fontsize=7, loc="lower right")
    yy = range(len(deltas))
    b.errorbar([m for _, m, _, _ in deltas], yy, xerr=[[m - lo for _, m, lo, _ in deltas],
                                                       [hi - m for _, m, _, hi in deltas]], fmt="o", capsize=3)
    b.axvline(0, color="grey", lw=0.8)
    b.set_yticks(list(yy), [lab for lab, *_ in deltas], fontsize=7)
    b.invert_yaxis()
    b.set_xlabel("training step: arm - main, ms (mean, 95 % paired interval)")
    fig.suptitle("The index estimate's window kernels per tiling, and the step A/Bs (one H200)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiles-runs", required=True, help="comma-separated estimate_cost.jsonl run tags")
    p.add_argument("--ab-runs", required=True, help="comma-separated train_throughput.jsonl run tags (ab_trees rows)")
    p.add_argument("--estimate", default=ESTIMATE)
    p.add_argument("--throughput", default=THROUGHPUT)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    try:
        tiles = tilings(load_rows([a.estimate], tuple(a.tiles_runs.split(","))))
        deltas = step_deltas(load_rows([a.throughput], tuple(a.ab_runs.split(","))))
        if not tiles or not deltas:
            raise ValueError("no rows for the runs given")
    except ValueError as e:
        print(f"window_tiles_plot: {e}", file=sys.stderr)
        return 1
    for run, d in tiles.items():
        best = min((t for t in d if t != "xla"), key=lambda t: d[t].get("estimate", float("inf")))
        print(f"{run}: XLA {d['xla']:.2f} ms, best tiling {best} {d[best]['estimate']:.2f} ms")
    for label, m, lo, hi in deltas:
        print(f"{label:40s} {m:+7.1f} ms [{lo:+.1f}, {hi:+.1f}]")
    print(plot(tiles, deltas, a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
