"""The gap between two arms' held-out curves (the trainer's eval) across protocols: each ``--pair``
names a run and the arm pair whose per-step difference is drawn, for the seeds both arms of that run
have. Rows come from ``results/quality/quality.jsonl`` (``benchmarks/quality_study.py``); the runs may
differ in protocol (e.g. from scratch vs after copy pretraining), which a seed report
(``quality_study.py --report-only``) cannot put side by side because it pairs by (arm, seed).

    python benchmarks/quality_gap_plot.py \\
      --pair "from scratch=s11-dense-lr3e-4-4-seeds+s13-mtraining-lr3e-4-3-seeds+s14-lr3e-4-mtraining-seed3-msa-seed0:mtraining-dense" \\
      --pair "copy-pretrained=s16-copy-pretrained-seed0:mtraining-dense" \\
      --out results/quality/quality_s16_gap.png

Left: both arms' held-out curves per pair and seed. Right: arm − base per step (the steps both have).
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script: the repository root, so that `benchmarks` imports as the package
from benchmarks.quality_seeds import VARIANTS, heldout_curve_of, read_rows  # noqa: E402

ROWS = os.path.join(ROOT, "results", "quality", "quality.jsonl")


def parse_pair(spec: str) -> tuple:
    """``LABEL=RUN[+RUN]:ARM-BASE`` -> ``(label, runs, arm, base)``; a malformed spec or an unknown arm is
    a ``ValueError`` naming it."""
    label, eq, rest = spec.partition("=")
    runs, colon, arms = rest.rpartition(":")
    arm, dash, base = arms.partition("-")
    if not (eq and label and colon and runs and dash):
        raise ValueError(f"--pair {spec!r}: expected LABEL=RUN[+RUN]:ARM-BASE, e.g. 'a=s16-x:mtraining-dense'")
    for a in (arm, base):
        if a not in VARIANTS:
            raise ValueError(f"--pair {spec!r}: unknown arm {a!r} (one of {', '.join(VARIANTS)})")
    return label, runs.split("+"), arm, base


def gaps(rows, runs, arm: str, base: str, seeds=None) -> dict:
    """``{seed: (arm curve, base curve, [(step, arm - base)])}`` of the rows of ``runs`` (the last row of an
    (arm, seed) wins, as in the seed report); only seeds that both arms have with a held-out curve."""
    last = {}
    for r in rows:
        if r.get("run") in runs and r.get("arm") in (arm, base) and not r.get("error"):
            last[(r["arm"], r["seed"])] = heldout_curve_of(r)
    out = {}
    for (a, s), c in sorted(last.items()):
        b = last.get((base, s))
        if a != arm or not c or not b or (seeds is not None and s not in seeds):
            continue
        bv = {int(k): v for k, v in b}
        out[s] = (c, b, [(int(k), v - bv[int(k)]) for k, v in c if int(k) in bv])
    if not out:
        raise ValueError(f"runs {'+'.join(runs)}: no seed has held-out curves of both {arm} and {base}"
                         + (f" among seeds {sorted(seeds)}" if seeds is not None else ""))
    return out


def save_figure(fig, path: str) -> str:
    """Lay out, write (PNG at ``path``) and close a matplotlib figure of the quality plots."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def rows_parser(description: str):
    """An ``ArgumentParser`` with the quality plots' ``--rows`` flag (JSONL files, default :data:`ROWS`)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--rows", default=ROWS, help="quality JSONL rows (comma-separated files)")
    return ap


def run_plot_args(description: str, rows_of: str, select, argv=None):
    """The plots of one run's rows: ``--rows``, ``--run`` (a run tag whose rows carry ``rows_of``) and ``--out``
    (PNG path) parsed, and ``select(rows, run)`` of the rows read. ``(args, None)`` after printing the
    ``ValueError`` / ``KeyError`` of a run without them."""
    ap = rows_parser(description)
    ap.add_argument("--run", required=True, help=f"a run tag whose rows carry {rows_of}")
    ap.add_argument("--out", required=True, help="PNG path")
    a = ap.parse_args(argv)
    try:
        return a, select(read_rows(a.rows.split(",")), a.run)
    except (ValueError, KeyError) as e:
        prog = os.path.splitext(os.path.basename(select.__globals__["__file__"]))[0]
        print(f"{prog}: {e}", file=sys.stderr)
        return a, None


def plot(pairs, path: str) -> str:
    """``pairs``: ``[(label, arm, base, gaps(...))]`` -> the two-panel PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (label, arm, base, g) in enumerate(pairs):
        seeds = ("seeds " if len(g) > 1 else "seed ") + ", ".join(map(str, g))
        for j, (s, (c, b, d)) in enumerate(g.items()):  # one colour per pair; the legend names its seeds once
            col, first = f"C{i}", j == 0
            ax.plot(*zip(*c), "-", color=col, lw=1.2, alpha=0.8, label=f"{label}: {arm} ({seeds})" if first else None)
            ax.plot(*zip(*b), "--", color=col, lw=1.0, alpha=0.8, label=f"{label}: {base}" if first else None)
            bx.plot(*zip(*d), "o-", color=col, ms=2, lw=1.0, alpha=0.8, label=f"{label}, {seeds}" if first else None)
    bx.axhline(0, color="grey", lw=0.8)
    ax.set_ylabel("held-out loss, trainer's eval (nats/byte)")
    bx.set_ylabel(f"{pairs[0][1]} − {pairs[0][2]}" if len({(p[1], p[2]) for p in pairs}) == 1 else "arm − base")
    for a_ in (ax, bx):
        a_.set_xlabel("training step")
        a_.grid(alpha=0.3)
        a_.legend(fontsize=7)
    ax.set_title("held-out curves (solid: arm, dashed: base)", fontsize=9)
    bx.set_title("held-out gap per step", fontsize=9)
    return save_figure(fig, path)


def main(argv=None) -> int:
    ap = rows_parser(__doc__.split("\n")[0])
    ap.add_argument("--pair", action="append", required=True, metavar="LABEL=RUN[+RUN]:ARM-BASE")
    ap.add_argument("--seeds", default="", help="comma-separated seeds (default: every seed both arms have)")
    ap.add_argument("--out", required=True, help="PNG path")
    a = ap.parse_args(argv)
    try:
        seeds = {int(x) for x in a.seeds.split(",") if x.strip()} or None
    except ValueError:
        print(f"quality_gap_plot: --seeds {a.seeds!r}: expected comma-separated integers", file=sys.stderr)
        return 1
    rows = read_rows(a.rows.split(","))
    try:
        pairs = []
        for spec in a.pair:
            label, runs, arm, base = parse_pair(spec)
            pairs.append((label, arm, base, gaps(rows, runs, arm, base, seeds)))
    except ValueError as e:
        print(f"quality_gap_plot: {e}", file=sys.stderr)
        return 1
    for label, arm, base, g in pairs:
        for s, (_, _, d) in g.items():
            print(f"{label}, seed {s}: {arm} - {base} at step {d[-1][0]}: {d[-1][1]:+.4f}")
    print(plot(pairs, a.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
