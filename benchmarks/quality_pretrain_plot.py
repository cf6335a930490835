"""The copy pretraining's held-out curves (``benchmarks/quality_pretrain.py``), stage after stage, against the
tokens it trained on: one line per run, each later stage (``pretrain.stages``) continuing where the one
before it ended, and the chance loss of the copy windows' alphabet. Rows come from
``results/quality/quality.jsonl``; a run's pretraining is read from its first row that has one (every arm of
a seed carries the same).

    python benchmarks/quality_pretrain_plot.py --run s16-copy-pretrained-seed0 --run s21-copy-curriculum-dense \\
      --out results/quality/quality_s21_pretrain.png
"""

from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script: the repo root
from benchmarks.quality_gap_plot import rows_parser, save_figure  # noqa: E402
from benchmarks.quality_seeds import read_rows  # noqa: E402


def stage_curves(rows, run: str) -> list:
    """``[(label, [(tokens, held-out loss)])]`` of ``run``'s copy pretraining (``RUN`` or ``RUN@SEED``: that
    seed's; a run of several seeds without one: its first row's), one entry per stage; the tokens count from
    the start of stage 1 (``seq_len * batch`` per step). A ``ValueError`` names a run without one."""
    tag, _, seed = run.partition("@")
    for r in rows:
        p = r.get("pretrain") or {}
        if r.get("run") == tag and seed in ("", str(r.get("seed"))) and p.get("steps") and p.get("heldout_curve"):
            break
    else:
        raise ValueError(f"run {run!r}: no row with a copy pretraining and its held-out curve")
    out, start = [], 0
    for i, st in enumerate([p] + list(p.get("stage_results") or []), 1):
        per_step = st["seq_len"] * st["batch"]
        curve = [(start + int(step) * per_step, float(loss)) for step, loss in st["heldout_curve"]]
        out.append((f"stage {i}: {st['seq_len']} x {st['batch']}, {st['steps']} steps", curve))
        start += st["steps"] * per_step
    return out


def plot(runs, curves, alphabet: int, path: str) -> str:
    """``curves[i]`` = :func:`stage_curves` of ``runs[i]`` -> a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 4.5))
    for i, (run, stages) in enumerate(zip(runs, curves)):
        for j, (label, c) in enumerate(stages):
            ax.plot([t / 1e6 for t, _ in c], [v for _, v in c], "o-" if j else "-", color=f"C{i}", ms=3,
                    lw=1.2, alpha=1.0 if j == 0 else 0.7, label=f"{run}, {label}")
    ax.axhline(math.log(alphabet), color="grey", lw=0.8, ls="--", label=f"chance, ln {alphabet}")
    ax.set_xlabel("pretraining tokens (millions)")
    ax.set_ylabel("held-out loss on copy windows (nats/byte)")
    ax.set_title("copy pretraining, stage after stage", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: the curves fill the axes
    return save_figure(fig, path)


def main(argv=None) -> int:
    ap = rows_parser(__doc__.split("\n")[0])
    ap.add_argument("--run", action="append", required=True,
                    help="a run tag, RUN@SEED for one seed's pretraining (repeat for several)")
    ap.add_argument("--out", required=True, help="PNG path")
    a = ap.parse_args(argv)
    rows = read_rows(a.rows.split(","))
    try:
        curves = [stage_curves(rows, run) for run in a.run]
    except ValueError as e:
        print(f"quality_pretrain_plot: {e}", file=sys.stderr)
        return 1
    alphabet = next((r["pretrain"].get("alphabet", 256) for r in rows if r.get("run") == a.run[0].partition("@")[0]
                     and r.get("pretrain")), 256)
    for run, stages in zip(a.run, curves):
        for label, c in stages:
            print(f"{run}, {label}: held-out {c[0][1]:.4f} -> {c[-1][1]:.4f}")
    print(plot(a.run, curves, alphabet, a.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
