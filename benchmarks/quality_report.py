"""The single-call report of the quality study: ``quality.md`` tables (training, MSA, cross-evaluation,
recall budgets), ``loss_curves.png`` and the side-by-side evaluation plots. The statistics over seeds
are :mod:`benchmarks.quality_seeds`; training and evaluation :mod:`benchmarks.quality_study`."""

from __future__ import annotations

import os

from benchmarks.quality_seeds import heldout_curve_of


def cross_table(recs) -> str:
    """Markdown: each variant's held-out loss with its own attention and read with another."""
    rows = [r for r in recs if "cross_eval" in r and "eval" in r]
    if not rows:
        return ""
    multi = len({r.get("seed") for r in recs}) > 1
    lines = ["| variant | own attention: held-out loss | read with | held-out loss | difference |", "|---|---|---|---|---|"]
    for r in rows:
        own = r["eval"]["perplexity"]["mean_loss"]
        other = r["cross_eval"]["eval"]["perplexity"]["mean_loss"]
        lines.append(f"| {_label(r, multi)} | {own:.4f} | {r['cross_eval']['backend']} (every layer) | {other:.4f} "
                     f"| {other - own:+.4f} |")
    return "\n".join(lines) + "\n"


def budget_table(recs) -> str:
    """Markdown: the recall budget sweep of each variant."""
    lines = ["| variant | budget (SparsityConfig overrides) | p | mean recall | min head | mean density | window's "
             "recall | heads vertical-capped | heads slash-capped |", "|---|---|---|---|---|---|---|---|---|"]
    multi = len({r.get("seed") for r in recs}) > 1
    for r in recs:
        for b in r.get("recall_budgets", []):
            name = ", ".join(f"{k}={v}" for k, v in b["budget"].items()) or "model's own"
            caps = " | ".join(f"{b['mean_' + k]:.3f}" if "mean_" + k in b else "—"
                              for k in ("window_recall", "vertical_capped", "slash_capped"))
            lines.append(f"| {_label(r, multi)} | {name} | {b['p']:g} | {b['mean_recall']:.3f} | {b['min_recall']:.3f} "
                         f"| {b['mean_density']:.3f} | {caps} |")
    return "\n".join(lines) + "\n" if len(lines) > 2 else ""


def _label(r, multi: bool) -> str:
    return f"{r['variant']} s{r.get('seed')}" if multi else r["variant"]


def training_table(recs) -> str:
    """Markdown: training-side numbers per run."""
    multi = len({r.get("seed") for r in recs}) > 1
    lines = ["| variant | steps | train s | tokens/s | work fraction | final train loss | held-out loss (trainer) "
             "| untrained recall p=0.9 |", "|---|---|---|---|---|---|---|---|"]
    for r in recs:
        last = r["train_loss"][-1][1] if r["train_loss"] else float("nan")
        held = heldout_curve_of(r)[-1][1] if heldout_curve_of(r) else float("nan")
        ur = r.get("recall_untrained", {}).get("mean_recall", {}).get("0.9", float("nan"))
        tps = r["tokens_per_s"] or float("nan")
        lines.append(f"| {_label(r, multi)} | {r['steps']} | {r['train_seconds']:.0f} | {tps:.0f} "
                     f"| {r['work_fraction']:.3f} | {last:.4f} | {held:.4f} | {ur:.3f} |")
    return "\n".join(lines) + "\n"


def msa_table(recs) -> str:
    """Markdown: the MSA variant's schedule and its index-branch metrics over the sparse steps' last half."""
    rows = [r for r in recs if "msa" in r]
    if not rows:
        return ""
    fmt = lambda v, f: "—" if v is None else format(v, f)  # noqa: E731
    lines = ["| variant | warm-up steps | KL coef | KL (sparse, last half) | KL grad norm (last step) "
             "| recall of main mass (sparse, last half) | work fraction (sparse) |", "|---|---|---|---|---|---|---|"]
    multi = len({r.get("seed") for r in recs}) > 1
    for r in rows:
        m = r["msa"]
        gn = m["kl_grad_norm"][-1][1] if m["kl_grad_norm"] else None
        lines.append(f"| {_label(r, multi)} | {m['warmup_steps']} | {m['kl_coef']:g} | {fmt(m['kl_sparse_mean'], '.4f')} "
                     f"| {fmt(gn, '.3e')} | {fmt(m['recall_sparse_mean'], '.3f')} "
                     f"| {fmt(m['work_fraction_sparse_mean'], '.3f')} |")
    return "\n".join(lines) + "\n"


def write_report(recs, out: str) -> None:
    """The single-call files: ``loss_curves.png``, ``quality.md`` and the side-by-side eval plots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mtraining_jax.eval.compare import compare_results

    multi = len({r.get("seed") for r in recs}) > 1
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for r in recs:
        if r["train_loss"]:
            s, l = zip(*r["train_loss"])
            ax.plot(s, l, label=f"{_label(r, multi)} train", lw=1)
        if heldout_curve_of(r):
            s, l = zip(*heldout_curve_of(r))
            ax.plot(s, l, "o--", label=f"{_label(r, multi)} held-out", ms=4)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "loss_curves.png"), dpi=110)
    plt.close(fig)
    runs = [(_label(r, multi), r["eval"]) for r in recs if "eval" in r]
    if runs:
        compare_results(runs, out, prefix="quality", sections=("niah", "perplexity", "recall"))
    with open(os.path.join(out, "quality.md"), "a" if runs else "w") as f:
        f.write("\n" + training_table(recs) + "\n" + msa_table(recs) + "\n" + cross_table(recs) + "\n"
                + budget_table(recs))
