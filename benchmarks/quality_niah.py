"""NIAH pass counts and the cross reads of the quality study (``benchmarks/quality_study.py``): each
arm's whole-answer hits pooled over seeds' passkeys with score intervals, arm - dense paired by passkey
where the rows carry per-sample outcomes, and the 2 x 2 of training x inference attention (the
MTraining paper's Table 1) from the ``--sparse-read`` / ``--cross-eval`` reads, and the index's recall of
the needle for the answer's rows (``--needle-recall``). Pure functions of the
JSONL rows; :mod:`benchmarks.quality_seeds` puts their lines into ``seeds.md``."""

from __future__ import annotations

import statistics

from benchmarks.quality_stats import (
    newcombe_paired,
    newcombe_unpaired,
    paired_interval,
    wilson,
)


def grid_outcomes(g) -> tuple:
    """``(right, total, per_sample)`` of a NIAH grid (``eval.niah``): the whole-answer hits, the examples,
    and the per-sample 0/1 outcomes in grid order (``correct``; ``None`` in rows from before it was
    recorded, whose counts come from ``accuracy x samples``). ``None`` for no grid."""
    if not g:
        return None
    if g.get("correct") is not None:
        flat = [int(x) for cell_row in g["correct"] for cell in cell_row for x in cell]
        return sum(flat), len(flat), flat
    acc = [a for row in g["accuracy"] for a in row]
    return round(sum(acc) * g["samples"]), len(acc) * int(g["samples"]), None


def niah_outcomes(r) -> tuple:
    """:func:`grid_outcomes` of a row's own evaluation (``None`` without one)."""
    return grid_outcomes(((r.get("eval") or {}) if isinstance(r, dict) else {}).get("niah"))


def niah_difference(pairs) -> tuple:
    """``(D, lo, hi, how)``: NIAH accuracy of the first grid minus the second's, pooled over ``pairs``
    ``[(outcomes_a, outcomes_b)]`` (:func:`grid_outcomes`), with a 95 % interval paired by passkey where
    every pair carries per-sample outcomes of the same grid (:func:`newcombe_paired`), else unpaired."""
    if all(x[2] is not None and y[2] is not None and len(x[2]) == len(y[2]) for x, y in pairs):
        z = [(u, v) for x, y in pairs for u, v in zip(x[2], y[2], strict=True)]
        cnt = [sum(1 for u, v in z if (u, v) == k) for k in ((1, 1), (1, 0), (0, 1), (0, 0))]
        return (*newcombe_paired(*cnt), f"paired by passkey ({cnt[1]} right only in the first, {cnt[2]} only in "
                                        "the second)")
    return (*newcombe_unpaired(sum(x[0] for x, _ in pairs), sum(x[1] for x, _ in pairs),
                               sum(y[0] for _, y in pairs), sum(y[1] for _, y in pairs)),
            "unpaired (rows without per-passkey outcomes)")


def _last_rows(rows) -> dict:
    last = {}
    for r in rows:
        if not r.get("error"):
            last[(r["arm"], r["seed"])] = r
    return last


def niah_pooled_lines(rows, arms, tol: float = 0.05) -> list:
    """Markdown: each arm's NIAH whole-answer hits pooled over its seeds with a Wilson interval, and each
    sparse arm minus dense over the seeds both have (:func:`niah_difference`). These intervals are the
    evaluation's sampling of passkeys on THESE trained models; the variation between training seeds is
    the t-interval's."""
    last = {k: r for k, r in _last_rows(rows).items() if niah_outcomes(r) is not None}
    if not last:
        return []
    out = ["", "NIAH over the passkeys of these trained models (pooled over seeds; a Wilson / Newcombe 95 % interval "
           "of the evaluation's sampling only, not of training seeds):", "",
           "| arm | seeds | right / passkeys | accuracy | 95 % interval |", "|---|---|---|---|---|"]
    for a in arms:
        rs = [niah_outcomes(r) for (b, _), r in sorted(last.items()) if b == a]
        if rs:
            k, n = sum(x[0] for x in rs), sum(x[1] for x in rs)
            lo, hi = wilson(k, n)
            seeds = ", ".join(str(s) for b, s in sorted(last) if b == a)
            out.append(f"| {a} | {seeds} | {k} / {n} | {k / n:.3f} | [{lo:.3f}, {hi:.3f}] |")
    for a in arms:
        seeds = sorted(s for b, s in last if b == a and ("dense", s) in last) if a != "dense" else []
        if not seeds:
            continue
        D, lo, hi, how = niah_difference([(niah_outcomes(last[(a, s)]), niah_outcomes(last[("dense", s)]))
                                          for s in seeds])
        inside = -tol <= lo and hi <= tol
        out.append(f"\n* {a} − dense, seeds {', '.join(map(str, seeds))}: {D:+.3f}, 95 % interval [{lo:+.3f}, {hi:+.3f}], "
                   f"{how.replace('the first', a).replace('the second', 'dense')}; "
                   f"{'excludes 0' if lo > 0 or hi < 0 else 'includes 0'}; within ±{tol:g} of dense with the "
                   f"interval inside: {'yes' if inside else 'no'}.")
    return out


def needle_lines(rows, arms) -> list:
    """Markdown of the rows' ``needle_recall`` (``--needle-recall``): per arm, how much of the answer's attention
    to the needle the index keeps (mean over seeds of the mass-weighted share), and per passkey (pooled over
    seeds) for the passkeys the arm's own read answered right and those it missed (``eval.niah.correct``)."""
    last = {k: r for k, r in _last_rows(rows).items() if r.get("needle_recall")}
    if not last:
        return []
    out = ["", "Needle recall: of the attention the answer's query rows pay to the needle, the part the index keeps "
           "(mass-weighted over the MTraining arm's sparse layers and every head; per passkey, its first "
           "samples of each NIAH cell):", "",
           "| arm | seeds | kept, mean over seeds | passkeys answered right: mean kept (n) | missed: mean kept (n) "
           "| lowest |", "|---|---|---|---|---|---|"]
    for a in arms:
        rs = [(s, r) for (b, s), r in sorted(last.items()) if b == a]
        if not rs:
            continue
        right, missed, every = [], [], []
        for _, r in rs:
            nr, grid = r["needle_recall"], (r.get("eval") or {}).get("niah") or {}
            ok = grid.get("correct")
            for i, row in enumerate(nr["kept"]):
                for j, cell in enumerate(row):
                    for k, x in enumerate(cell):
                        every.append(x)
                        if ok is not None:  # the grid's cell of the same depth and length, the same sample
                            jj = grid["lengths"].index(nr["lengths"][j])
                            (right if ok[i][jj][k] else missed).append(x)

        def m(xs):
            return f"{statistics.fmean(xs):.3f} ({len(xs)})" if xs else "—"

        means = [r["needle_recall"]["mean_kept"] for _, r in rs]
        out.append(f"| {a} | {', '.join(str(s) for s, _ in rs)} | {statistics.fmean(means):.3f} | {m(right)} "
                   f"| {m(missed)} | {min(every):.3f} |")
    return out


def read_eval(r, read: str):
    """The evaluation of a row's parameters read with dense attention (``read="dense"``: the dense arm's
    own, the MTraining arm's ``cross_eval``) or with the MTraining arm's attention (``"mtraining"``: that
    arm's own, the dense arm's ``sparse_read``); ``None`` where that read was not made."""
    if r.get("arm") == read:
        return r.get("eval")
    key = {("mtraining", "dense"): "cross_eval", ("dense", "mtraining"): "sparse_read"}.get((r.get("arm"), read))
    return (r.get(key) or {}).get("eval") if key else None


def train_infer_lines(rows) -> list:
    """Markdown: the 2 x 2 of training attention x inference attention (the MTraining paper's Table 1)
    where the rows carry the cross reads (``--sparse-read`` on the dense arm, ``--cross-eval`` on the
    MTraining arm), and the two effects apart: inference (the dense-trained parameters read sparsely
    minus densely) and training (the parameters of both arms read densely), each per seed with the
    t-interval over seeds and, for NIAH, pooled over passkeys (:func:`niah_difference`)."""
    last = _last_rows(rows)
    cells = {}
    for (arm, seed), r in last.items():
        if arm in ("dense", "mtraining"):
            for read in ("dense", "mtraining"):
                ev = read_eval(r, read)
                if ev and (ev.get("perplexity") or {}).get("mean_loss") is not None:
                    cells[(arm, read, seed)] = ev
    if not any(a != rd for a, rd, _ in cells):
        return []

    def col(arm, read, f):
        xs = [f(ev) for (a, rd, _), ev in sorted(cells.items()) if (a, rd) == (arm, read) and f(ev) is not None]
        if not xs:
            return "—"
        return f"{statistics.fmean(xs):.4f}" + (f" ± {statistics.stdev(xs):.4f}" if len(xs) > 1 else "") + f" (n={len(xs)})"

    out = ["", "Training attention x inference attention (the MTraining paper's Table 1; held-out loss / NIAH, mean "
           "± s.d. over seeds):", "", "| trained with | read dense: held-out | read dense: NIAH | read with MTraining's "
           "attention: held-out | read with MTraining's attention: NIAH |", "|---|---|---|---|---|"]
    for arm in ("dense", "mtraining"):
        out.append(f"| {arm} | {col(arm, 'dense', _loss)} | {col(arm, 'dense', _niah)} | {col(arm, 'mtraining', _loss)} "
                   f"| {col(arm, 'mtraining', _niah)} |")
    out += ["", "| effect | what is compared (per seed) | held-out loss, mean [95 % t-interval] | NIAH, mean [95 % "
            "t-interval] | NIAH pooled over passkeys [95 %] |", "|---|---|---|---|---|"]
    for what, (a1, r1), (a2, r2) in (("inference", ("dense", "mtraining"), ("dense", "dense")),
                                     ("training", ("mtraining", "dense"), ("dense", "dense")),
                                     ("both", ("mtraining", "mtraining"), ("dense", "dense"))):
        seeds = sorted(s for a, rd, s in cells if (a, rd) == (a1, r1) and (a2, r2, s) in cells)
        if not seeds:
            continue
        pair = [(cells[(a1, r1, s)], cells[(a2, r2, s)]) for s in seeds]

        grids = [(grid_outcomes(x.get("niah")), grid_outcomes(y.get("niah"))) for x, y in pair]
        pooled = "—"
        if all(g[0] and g[1] for g in grids):
            D, lo, hi, how = niah_difference(grids)
            pooled = f"{D:+.3f} [{lo:+.3f}, {hi:+.3f}], {how.split(' (')[0]}"
        out.append(f"| {what} | trained {a1} read {r1} − trained {a2} read {r2}, seeds {', '.join(map(str, seeds))} "
                   f"| {_diff(pair, _loss, '+.4f')} | {_diff(pair, _niah, '+.3f')} | {pooled} |")
    return out


def _loss(ev):
    return float(ev["perplexity"]["mean_loss"])


def _niah(ev):
    return statistics.fmean(a for row in ev["niah"]["accuracy"] for a in row) if "niah" in ev else None


def _diff(pair, f, fmt: str) -> str:
    """``f(x) - f(y)`` over the per-seed ``pair`` s: mean and 95 % t-interval."""
    d = [f(x) - f(y) for x, y in pair if f(x) is not None and f(y) is not None]
    if not d:
        return "—"
    i = paired_interval(d)
    return format(i["mean"], fmt) + (f" [{i['lo']:{fmt}}, {i['hi']:{fmt}}]" if i["lo"] is not None else " (one seed)")
