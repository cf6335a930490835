"""The NIAH grids (needle depth x context length) of a quality run's rows, one panel per (training attention,
inference attention): each arm's own read and, where the rows carry them, the cross reads (``--sparse-read``
on the dense arm, ``--cross-eval cudnn --no-cross-eval-loss-only`` on the MTraining arm; see
``benchmarks/quality_niah.py``). A panel is the mean over the chosen seeds that have that read (its title
says which, and the passkeys per cell).

    python benchmarks/quality_niah_plot.py --run s25-copy-doubling-32k-seed-2-cross-reads --seeds 2 \\
      --out results/quality/quality_s25_niah.png

``--run RUN:ARM[+ARM]`` takes only those arms of a run (e.g. one run's dense arm beside another run's
MTraining arm). An arm trained with its own ``model.dense_layers`` override is a panel of its own, labelled
with those layers.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script: the repo root
from benchmarks.quality_gap_plot import rows_parser  # noqa: E402
from benchmarks.quality_niah import read_eval  # noqa: E402
from benchmarks.quality_seeds import read_rows  # noqa: E402

ARMS = ("dense", "mtraining")


def dense_layers(row) -> str:
    """The row's ``model.dense_layers`` trainer override (``""`` when it has none)."""
    sets = [o.partition("=")[2] for o in row.get("train_overrides") or () if o.startswith("model.dense_layers=")]
    return sets[-1].strip("[]").replace(" ", "") if sets else ""


def grids(rows, runs, seeds=None) -> list:
    """``[(label, niah)]`` for :func:`mtraining_jax.eval.plots.niah_heatmaps`: per (trained, read) the
    accuracy grid averaged over the rows of ``runs`` (``RUN`` or ``RUN:ARM[+ARM]``; and ``seeds``, if given)
    that have that read, in the order dense/dense, dense/mtraining, mtraining/dense, mtraining/mtraining; an
    arm trained with a ``model.dense_layers`` override is its own panel (:func:`dense_layers`). A
    ``ValueError`` names an unknown arm, runs with no NIAH grid or grids of different lengths / depths."""
    import numpy as np

    keep = {}
    for item in runs:
        run, _, arms = item.partition(":")
        names = set(arms.split("+")) if arms else set(ARMS)
        if names - set(ARMS):
            raise ValueError(f"run {item!r}: unknown arm(s) {sorted(names - set(ARMS))}; arms are {list(ARMS)}")
        keep.setdefault(run, set()).update(names)
    picked = [r for r in rows if r.get("arm") in keep.get(r.get("run"), ()) and r.get("arm") in ARMS
              and (seeds is None or r.get("seed") in seeds)]
    out, shape = [], None
    for arm, layers in sorted({(r["arm"], dense_layers(r)) for r in picked}, key=lambda t: (ARMS.index(t[0]), t[1])):
        for read in ARMS:
            got = [(r["seed"], ev["niah"]) for r in picked
                   if r["arm"] == arm and dense_layers(r) == layers and (ev := read_eval(r, read)) and ev.get("niah")]
            if not got:
                continue
            axes = [(tuple(n["lengths"]), tuple(n["depths"])) for _, n in got]
            if len(set(axes)) > 1 or (shape is not None and axes[0] != shape):
                raise ValueError(f"runs {', '.join(runs)}: NIAH grids over different lengths / depths: {sorted(set(axes))}")
            shape = axes[0]
            n0 = got[0][1]
            acc = np.mean([np.asarray(n["accuracy"], float) for _, n in got], axis=0)
            seeds_s = ", ".join(str(s) for s, _ in sorted(got, key=lambda t: t[0]))
            trained = f"{arm}\n(dense layers {layers})" if layers else arm
            out.append((f"trained {trained}, read {read}\nseed{'s' if len(got) > 1 else ''} {seeds_s}",
                        dict(n0, accuracy=acc.tolist(), samples=sum(n["samples"] for _, n in got))))
    if not out:
        raise ValueError(f"runs {', '.join(runs)}" + (f", seeds {sorted(seeds)}" if seeds else "")
                         + ": no row with a NIAH grid")
    return out


def main(argv=None) -> int:
    ap = rows_parser(__doc__.split("\n")[0])
    ap.add_argument("--run", action="append", required=True, help="a run tag (repeat for several)")
    ap.add_argument("--seeds", type=lambda s: {int(x) for x in s.split(",")}, default=None,
                    help="comma-separated seeds (default: every seed of the runs)")
    ap.add_argument("--out", required=True, help="PNG path")
    a = ap.parse_args(argv)
    try:
        panels = grids(read_rows(a.rows.split(",")), a.run, a.seeds)
    except ValueError as e:
        print(f"quality_niah_plot: {e}", file=sys.stderr)
        return 1
    from mtraining_jax.eval.plots import niah_heatmaps

    for label, n in panels:
        flat = [v for row in n["accuracy"] for v in row]
        print(f"{label.replace(chr(10), ', ')}: NIAH {sum(flat) / len(flat):.3f} ({n['samples']} passkeys per cell)")
    print(niah_heatmaps(panels, a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
