"""The fused-backward timings (branch ``fused-bwd``'s ``benchmarks/fused_backward.py --json``; committed as
``results/kernels/fused_v*.json``) as a chart: per backward variant its median time with the min-max of its
repeats, one colour per file (each file one run on one machine, its ``three_pass`` the baseline of that run).

    python benchmarks/fused_backward_plot.py results/kernels/fused_v21.json results/kernels/fused_v22.json \\
      --case full_32k --out results/kernels/fused_v21_v22.png
"""

from __future__ import annotations

import argparse
import json
import os


def variants(rows, case: str) -> list:
    """``[(mode, median_ms, (min_ms, max_ms))]`` of the row of ``case`` (``three_pass`` first), from its
    ``<mode>_ms`` / ``<mode>_spread`` fields. A ``ValueError`` names a missing case."""
    for r in rows:
        if r.get("case") == case:
            break
    else:
        raise ValueError(f"no row of case {case!r} (cases: {sorted({r.get('case') for r in rows})})")
    out = [(k[:-3], float(r[k]), tuple(map(float, r[k[:-3] + "_spread"]))) for k in r
           if k.endswith("_ms") and f"{k[:-3]}_spread" in r]
    return sorted(out, key=lambda t: t[0] != "three_pass")


def plot(runs, path: str, title: str) -> str:
    """``runs``: ``[(label, variants(...))]``; a horizontal bar per (run, variant), the min-max as its error bar
    and the three passes' median of each run as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = sum(len(v) for _, v in runs)
    fig, ax = plt.subplots(figsize=(8, 0.32 * n + 1.8))
    y, ticks, labels = 0, [], []
    for i, (label, vs) in enumerate(runs):
        colour = f"C{i}"
        for mode, med, (lo, hi) in vs:
            ax.barh(y, med, xerr=[[med - lo], [hi - med]], color=colour, alpha=0.75, capsize=2,
                    label=label if mode == vs[0][0] else None)
            ax.text(hi + 0.2, y, f"{med:.2f}", va="center", fontsize=7)
            ticks.append(y)
            labels.append(mode)
            y += 1
        base = dict((m, md) for m, md, _ in vs).get("three_pass")
        if base is not None:
            ax.axvline(base, color=colour, ls="--", lw=0.8)
        y += 0.5
    ax.set_yticks(ticks, labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("backward time, ms (median, min-max of the repeats)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", help="fused_backward.py --json files, one run each")
    ap.add_argument("--case", default="full_32k", help="the row's case (full_32k, model_L1, ...)")
    ap.add_argument("--out", required=True, help="PNG path")
    a = ap.parse_args(argv)
    runs = []
    for f in a.files:
        rows = json.load(open(f))
        dev = rows[0].get("device", "?") if rows else "?"
        runs.append((f"{os.path.basename(f)} ({dev}, {str(rows[0].get('commit', '?'))[:7]})", variants(rows, a.case)))
    print(plot(runs, a.out, f"one-pass / fused backwards vs the three passes, case {a.case}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
