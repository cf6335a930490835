"""Which index budget index recall 0.9 needs on trained models: each arm's recall at p = 0.9 against the
index's density for every budget of ``--recall-budgets`` (``benchmarks/quality_study.py``; the q/k of one
held-out window captured once, :func:`benchmarks.quality_probes.budget_sweep`), and the recall of each layer
under each budget. Recall is the share of each sampled query row's attention mass its index keeps (mean over
layers and heads); density the share of the causal area the kernels compute.

    python benchmarks/quality_budget_plot.py --run s39-warm-start-400-seed-5 \\
      --out results/quality/quality_s39_budgets.png
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script: the repo root
from benchmarks.quality_gap_plot import run_plot_args, save_figure  # noqa: E402


def budget_label(budget: dict) -> str:
    """``{"vertical_max": 32768}`` -> ``"vertical_max=32768"``; ``{}`` -> ``"defaults"``."""
    return " ".join(f"{k}={v}" for k, v in budget.items()) or "defaults"


def sweeps(rows, run: str) -> dict:
    """``{(arm, seed): [entry, ...]}``: the budget sweep of every row of ``run`` that has one, each entry a
    :func:`~benchmarks.quality_probes.budget_sweep` row plus its ``label``; a warm start's sweep (``--warm-start-eval``:
    the dense run where the arms start) as arm ``"dense step W"``. ``ValueError`` when there is none."""
    out = {}
    for r in rows:
        if r.get("run") != run:
            continue
        warm = r.get("warm_start") or {}
        found = [(r["arm"], r.get("recall_budgets")), (f"dense step {warm.get('steps')}", warm.get("recall_budgets"))]
        for arm, sweep in found:
            if sweep:
                out[(arm, r["seed"])] = [dict(b, label=budget_label(b["budget"])) for b in sweep]
    if not out:
        raise ValueError(f"run {run!r}: no row with recall_budgets")
    return out


def plot(sw: dict, path: str, target: float = 0.9) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.6))
    annotated = set()
    styles = {"dense": "--", "mtraining": "-", "msa": ":"}  # a warm start ("dense step W"): dash-dot
    for (arm, seed), entries in sorted(sw.items()):
        who = f"the warm start ({arm})" if arm.startswith("dense step") else f"{arm}-trained"
        ax.plot([e["mean_density"] for e in entries], [e["mean_recall"] for e in entries], styles.get(arm, "-."),
                marker="o", label=f"{who}, seed {seed}")
        for e in entries:  # each budget named once (the models' points of a budget lie close together)
            if e["label"] not in annotated:
                annotated.add(e["label"])
                ax.annotate(e["label"].replace(" ", "\n"), (e["mean_density"], e["mean_recall"]),
                            textcoords="offset points", xytext=(5, -10), fontsize=6)
    ax.axhline(target, color="gray", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("index density at p = 0.9 (share of the causal area computed)")
    ax.set_ylabel("index recall at p = 0.9 (mean over layers, heads)")
    ax.set_title("Recall against density, one point per budget", fontsize=10)
    ax.legend(fontsize=8)
    colors, named = plt.rcParams["axes.prop_cycle"].by_key()["color"], set()
    for (arm, seed), entries in sorted(sw.items()):
        for i, e in enumerate(entries):  # colour = budget, line style = arm
            bx.plot(range(len(e["layer_recall"])), e["layer_recall"], styles.get(arm, "-."), marker=".",
                    color=colors[i % len(colors)], label=None if e["label"] in named else e["label"])
            named.add(e["label"])
    bx.axhline(target, color="gray", lw=0.8)
    bx.set_xlabel("layer\n(solid: MTraining-trained, dashed: dense-trained, dash-dot: the warm start)")
    bx.set_ylabel("index recall at p = 0.9 (mean over heads)")
    bx.set_title("By layer", fontsize=10)
    bx.legend(fontsize=7)
    return save_figure(fig, path)


def main(argv=None) -> int:
    a, sw = run_plot_args(__doc__.split("\n")[0], "recall_budgets", sweeps, argv)
    if sw is None:
        return 1
    for (arm, seed), entries in sorted(sw.items()):
        for e in entries:
            extra = "".join(f", {n} {e['mean_' + n]:.3f}" for n in ("window_recall", "vertical_capped", "slash_capped")
                            if "mean_" + n in e)
            print(f"{arm} seed {seed}: {e['label']}: recall {e['mean_recall']:.3f} (min head {e['min_recall']:.3f}), "
                  f"density {e['mean_density']:.3f}{extra}")
    print(plot(sw, a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
