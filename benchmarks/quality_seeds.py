"""Statistics of the multi-seed quality study (``benchmarks/quality_study.py``): the rows of a run read
per (arm, seed) (``select_runs``: of chosen runs and arms), paired differences arm - dense and between
the sparse arms per seed with a two-sided Student-t interval over the seeds (no scipy), the loss at
equal training time, the markdown comparison (``seeds.md``: with the NIAH pass counts and the training x
inference reads of :mod:`benchmarks.quality_niah`) and its plot (``loss_vs_tokens.png``). Pure functions
of the JSONL rows; nothing here trains or evaluates; the interval arithmetic is
:mod:`benchmarks.quality_stats`'s."""

from __future__ import annotations

import json
import os
import statistics

from benchmarks.quality_niah import needle_lines, niah_pooled_lines, train_infer_lines
from benchmarks.quality_stats import paired_interval, verdict

VARIANTS = ("dense", "mtraining", "msa")  # the arms, in report order


def heldout_curve_of(r) -> list:
    """The trainer's held-out curve (``heldout_loss`` held it in records before the multi-seed study)."""
    c = r.get("heldout_curve")
    return c if c is not None else (r["heldout_loss"] if isinstance(r.get("heldout_loss"), list) else [])


def read_rows(paths) -> list:
    """The rows of the JSONL ``paths`` that belong to the multi-seed study (they carry ``arm``)."""
    rows = []
    for p in paths:
        if not os.path.isfile(p):
            continue
        with open(p) as f:
            for line in f:
                line = line.strip()
                if line:
                    r = json.loads(line)
                    if "arm" in r:
                        rows.append(r)
    return rows


def select_runs(rows, spec: str) -> list:
    """The rows of the runs named in ``spec``: comma-separated ``RUN`` (every arm of that ``run`` tag) or
    ``RUN:ARM[+ARM]`` (only those arms, e.g. a run that also holds an arm trained with a setting since
    replaced). Raises ``ValueError`` naming an unknown arm or a run no row carries."""
    keep = {}
    for item in filter(None, (t.strip() for t in spec.split(","))):
        run, _, arms = item.partition(":")
        names = set(arms.split("+")) if arms else set(VARIANTS)
        bad = sorted(names - set(VARIANTS))
        if bad:
            raise ValueError(f"--runs {item!r}: unknown arm(s) {bad}; arms are {list(VARIANTS)}")
        keep.setdefault(run, set()).update(names)
    missing = sorted(set(keep) - {r.get("run") for r in rows})
    if missing:
        raise ValueError(f"--runs: no row carries run tag(s) {missing}")
    return [r for r in rows if r.get("arm") in keep.get(r.get("run"), ())]


def _value_at_time(curve, times, T):
    """``curve [[step, value]]`` read at training time ``T`` (linear in time between its points;
    its last value at or after its end; ``None`` before its first point)."""
    import numpy as np

    tmap = {int(s): float(t) for s, t in times}
    pts = [(tmap[int(s)], float(v)) for s, v in curve if int(s) in tmap]
    if not pts or T < pts[0][0] - 1e-9:
        return None
    ts, vs = zip(*pts)
    return float(np.interp(T, ts, vs))


def _train_loss_at_time(r, T, share: float = 0.05):
    """Mean train loss over the last ``share`` of the run's steps done by training time ``T``."""
    tmap = {int(s): float(t) for s, t in r.get("train_time") or []}
    done = [float(l) for s, l in r["train_loss"] if int(s) in tmap and tmap[int(s)] <= T + 1e-9]
    if not done:
        return None
    k = max(1, int(round(share * r["steps"])))
    return statistics.fmean(done[-k:])


PAIRED = (("heldout_loss", "held-out loss @ {S}, evaluator (nats/byte)"),
          ("trainer_heldout_final", "held-out loss, trainer's eval, final"),
          ("heldout_dense_read", "held-out loss @ {S}, the arm's parameters read with dense attention in every layer"),
          ("heldout_equal_time", "held-out loss, trainer's eval, at equal training time"),
          ("train_loss_equal_time", "train loss (last 5 % of steps) at equal training time"),
          ("niah_accuracy", "NIAH passkey accuracy (whole answer)"),
          ("niah_token_accuracy", "NIAH answer-token accuracy"),
          ("recall", "index recall p = 0.9 (mean over heads)"))


def dense_read_loss(r):
    """The evaluator's held-out loss of a row's parameters read with dense attention in every layer: the
    cross-evaluation's (``eval.cross_eval``) for a sparse arm, the row's own for the dense arm, else None."""
    ce = r.get("cross_eval") or {}
    try:
        return float(ce["eval"]["perplexity"]["mean_loss"])
    except (KeyError, TypeError):
        return r.get("heldout_loss") if r.get("arm") == "dense" else None


def reread_settings(rows) -> list:
    """The settings (``--reread``, joined by spaces) of every read in ``rows``' ``rereads``, in first-seen order."""
    out = []
    for r in rows:
        for rr in r.get("rereads") or []:
            key = " ".join(rr.get("overrides") or [])
            if key and key not in out:
                out.append(key)
    return out


def reread_metrics(rows) -> list:
    """:data:`PAIRED`'s ``(key, label)`` pairs for the reads of ``rows``' ``rereads``: held-out loss and NIAH per
    setting, keys ``heldout_reread:SETTINGS`` / ``niah_reread:SETTINGS`` (the values :func:`reread_values` gives)."""
    return [m for st in reread_settings(rows) for m in (
        (f"heldout_reread:{st}", f"held-out loss @ {{S}}, the arm's parameters read with its attention under {st}"),
        (f"niah_reread:{st}", f"NIAH passkey accuracy, the arm's parameters read with its attention under {st}"))]


def reread_values(r, settings) -> dict:
    """``{metric key: value}`` of :func:`reread_metrics` for one row: a sparse row's reads (held-out loss, NIAH
    accuracy; None for a read it lacks or that failed); for the dense arm its own values under every setting (the
    baseline of the pairing)."""
    out = {}
    reads = {" ".join(rr.get("overrides") or []): rr for rr in r.get("rereads") or []}
    for st in settings:
        if r.get("arm") == "dense":
            out[f"heldout_reread:{st}"], out[f"niah_reread:{st}"] = r.get("heldout_loss"), r.get("niah_accuracy")
            continue
        loss = niah = None
        try:
            ev = reads[st]["eval"]
            loss = float(ev["perplexity"]["mean_loss"])
            xs = [x for row in ev["niah"]["accuracy"] for x in row]
            niah = sum(xs) / len(xs)
        except (KeyError, TypeError, ZeroDivisionError):
            pass
        out[f"heldout_reread:{st}"], out[f"niah_reread:{st}"] = loss, niah
    return out


def reread_lines(rows) -> list:
    """Markdown: per sparse row and read of its ``rereads`` (``--reread``), the settings and the index recall /
    density at p = 0.9 of its own read and of the reread (what the other settings cost and buy), and the held-out
    loss and NIAH accuracy of both reads; a read that failed is listed with its error."""
    out = []
    for r in rows:
        for rr in r.get("rereads") or []:
            st = " ".join(rr.get("overrides") or [])
            if rr.get("error"):
                out.append(f"| {r['arm']} | {r['seed']} | {st} | | failed: {rr['error']} |")
                continue
            try:
                own, new = r["eval"]["recall"], rr["eval"]["recall"]
                p = "0.9" if "0.9" in new["mean_recall"] else next(iter(new["mean_recall"]))
                cells = [own["mean_recall"][p], own["mean_density"][p], new["mean_recall"][p], new["mean_density"][p]]
            except (KeyError, TypeError, StopIteration):
                continue
            wins = [(x.get("mean_window_recall") or {}).get(p) for x in (own, new)]
            wins = [f", on the window's rows {w:.3f}" if w is not None else "" for w in wins]
            v = reread_values(r, [st])
            loss = _num(v[f"heldout_reread:{st}"], ".4f")
            niah = _num(v[f"niah_reread:{st}"], ".3f")
            out.append(f"| {r['arm']} | {r['seed']} | {st} | p = {p}: recall {cells[0]:.3f}{wins[0]}, density "
                       f"{cells[1]:.3f}; loss {_num(r.get('heldout_loss'), '.4f')}, NIAH "
                       f"{_num(r.get('niah_accuracy'), '.3f')} | recall {cells[2]:.3f}{wins[1]}, density {cells[3]:.3f}; "
                       f"loss {loss}, NIAH {niah} |")
    if not out:
        return []
    return ["", "Reread (`--reread`): the arm's parameters, its attention under other settings; the index's "
            "recall and density (the kernels' work) at the trained model's q/k, held-out loss and NIAH accuracy:", "",
            "| arm | seed | settings | own read | reread |", "|---|---|---|---|---|"] + out + reread_window_lines(rows)


def window_difference(a, b) -> dict:
    """:func:`paired_interval` of evaluation ``a``'s held-out loss minus ``b``'s, paired window by window (the same
    held-out windows): the evaluation's sampling on one trained model, not training's spread over seeds."""
    wa, wb = a["perplexity"]["window_loss"], b["perplexity"]["window_loss"]
    if len(wa) != len(wb):
        raise ValueError(f"{len(wa)} held-out windows against {len(wb)}")
    return paired_interval([x - y for x, y in zip(wa, wb)])


def reread_window_lines(rows) -> list:
    """Markdown: each read of a sparse row's ``rereads`` against its own read, held-out loss paired over the held-out
    windows (mean and 95 % t-interval), and the share of what reading densely (``cross_eval``) gains that the read
    recovers: how much of the sparse read's cost each index setting buys back on that model."""
    out = []
    for r in rows:
        for rr in r.get("rereads") or []:
            try:
                iv = window_difference(rr["eval"], r["eval"])
            except (KeyError, TypeError, ValueError):
                continue
            share = "—"
            try:
                dense = window_difference(r["cross_eval"]["eval"], r["eval"])
                share = f"{iv['mean'] / dense['mean']:.2f} (dense read {dense['mean']:+.4f})" if dense["mean"] else "—"
            except (KeyError, TypeError, ValueError):
                pass
            ci = f"[{iv['lo']:+.4f}, {iv['hi']:+.4f}]" if iv["lo"] is not None else "—"
            out.append(f"| {r['arm']} | {r['seed']} | {' '.join(rr['overrides'])} | {iv['n']} | {iv['mean']:+.4f} {ci} "
                       f"| {share} |")
    if not out:
        return []
    return ["", "Each reread's held-out loss minus the own read's, paired over the held-out windows (mean, 95 % "
            "t-interval over windows: the evaluation's sampling on that one model), and the share of the dense read's "
            "gain (its parameters read with dense attention in every layer) that the reread recovers:", "",
            "| arm | seed | settings | windows | reread − own read [95 %] | share of the dense read's gain |",
            "|---|---|---|---|---|---|"] + out


def _num(x, f: str) -> str:
    return "—" if x is None else format(x, f)


def dense_read_by_position(rows) -> list:
    """Per sparse row with a cross-evaluation by position: ``(arm, seed, edges, gaps)``, ``gaps[i]`` = the
    parameters' held-out loss read with dense attention minus their own read, in position bucket ``i``
    (``edges`` its token boundaries). A gap that grows with position says the model is read out of the
    distribution it was trained in (it attends to its pattern's keys only); a gap at every position,
    the first bucket included, says it gains through its pattern. The last row of each (arm, seed)."""
    last = {}
    for r in rows:
        if not r.get("error") and r.get("arm") != "dense":
            last[(r["arm"], r["seed"])] = r
    out = []
    for (arm, seed), r in sorted(last.items(), key=lambda kv: (VARIANTS.index(kv[0][0]), kv[0][1])):
        try:
            own, read = r["eval"]["perplexity"], r["cross_eval"]["eval"]["perplexity"]
            gaps = [float(b) - float(a) for a, b in zip(own["loss"], read["loss"], strict=True)]
        except (KeyError, TypeError, ValueError):
            continue
        out.append((arm, seed, list(own.get("bucket_edges") or []), gaps))
    return out


def seed_values(rows) -> tuple:
    """``(values {(arm, seed): {metric: value}}, notes)``: the last row of each (arm, seed), its
    metrics, and the equal-time values at each seed's fastest arm's training time."""
    last, notes = {}, []
    for r in rows:
        if r.get("error"):
            notes.append(f"{r['arm']} seed {r.get('seed')}: failed ({r['error']})")
            continue
        key = (r["arm"], r["seed"])
        if key in last:
            notes.append(f"{r['arm']} seed {r['seed']}: several rows, the last one is used")
        why = r.get("eval_error") or r.get("eval_skipped")
        if why:  # trained; the evaluator's columns are empty, the trainer's curves are not
            notes.append(f"{r['arm']} seed {r['seed']}: not evaluated ({why}); only the trainer's columns and curves")
        last[key] = r
    vals, settings = {}, reread_settings(last.values())
    for (arm, seed), r in last.items():
        curve = heldout_curve_of(r)
        vals[(arm, seed)] = {"heldout_loss": r.get("heldout_loss"), "niah_accuracy": r.get("niah_accuracy"),
                             "niah_token_accuracy": r.get("niah_token_accuracy"), "recall": r.get("recall"),
                             "trainer_heldout_final": curve[-1][1] if curve else None,
                             "heldout_dense_read": dense_read_loss(r),
                             "tokens": r.get("tokens"), "tokens_per_s": r.get("tokens_per_s"),
                             "train_compute_seconds": r.get("train_compute_seconds"),
                             "corpus_sha": r.get("corpus_sha"), "device": r.get("device"),
                             "warm_start": (r.get("warm_start") or {}).get("steps"), **reread_values(r, settings)}
    for seed in sorted({s for _, s in last}):
        arms = [a for a, s in last if s == seed]
        totals = [last[(a, seed)]["train_time"][-1][1] for a in arms if last[(a, seed)].get("train_time")]
        T = min(totals) if totals else None
        for a in arms:
            r, v = last[(a, seed)], vals[(a, seed)]
            v["equal_time"] = T
            ok = T is not None and r.get("train_time")
            v["heldout_equal_time"] = _value_at_time(heldout_curve_of(r), r["train_time"], T) if ok else None
            v["train_loss_equal_time"] = _train_loss_at_time(r, T) if ok else None
        overrides = {json.dumps(last[(a, seed)].get("train_overrides") or []) for a in arms}
        if len(overrides) > 1:  # e.g. a dense baseline at another learning rate (--baseline-run)
            notes.append(f"seed {seed}: the arms differ in trainer overrides ("
                         + "; ".join(f"{a}: {last[(a, seed)].get('train_overrides') or 'none'}" for a in arms)
                         + "): the differences compare these settings too")
        warm = {vals[(a, seed)]["warm_start"] for a in arms}
        if warm != {None} and len(warm) == 1:
            there = [(last[(a, seed)]["warm_start"].get("niah_accuracy"), last[(a, seed)]["warm_start"].get("heldout_loss"))
                     for a in arms]
            there = next(((n, h) for n, h in there if n is not None), None)
            notes.append(f"seed {seed}: every arm continues one dense run from its step {warm.pop()} (--warm-start): "
                         "the arms differ in the attention of the later steps only"
                         + (f"; there NIAH {there[0]:.3f}, held-out loss {there[1]:.4f}" if there else ""))
        for k in ("tokens", "corpus_sha", "warm_start", "device"):
            got = {vals[(a, seed)][k] for a in arms}
            if len(got) > 1:
                notes.append(f"seed {seed}: the arms differ in {k} ({sorted(map(str, got))})"
                             + ("; this seed is left out of the paired differences" if k != "device" else
                                "; equal-time values compare different devices"))
                if k != "device":
                    for a in arms:
                        vals[(a, seed)]["unpaired"] = True
    return vals, notes


def paired_differences(vals, arm: str, metric: str, base: str = "dense") -> dict:
    """:func:`paired_interval` of ``arm - base`` over the seeds both have (and whose data match)."""
    seeds = sorted(s for a, s in vals if a == arm and (base, s) in vals)
    pairs = [(s, vals[(arm, s)].get(metric), vals[(base, s)].get(metric)) for s in seeds
             if not vals[(arm, s)].get("unpaired")]
    pairs = [(s, x, y) for s, x, y in pairs if x is not None and y is not None]
    iv = paired_interval([x - y for _, x, y in pairs])
    iv["seeds"] = [s for s, _, _ in pairs]
    return iv


def relative_difference(vals, arm: str, metric: str = "heldout_loss", base: str = "dense") -> dict:
    """:func:`paired_interval` of the per-seed relative differences ``(arm - base) / base`` in percent
    (the issue's "within X % of dense, 95 % interval [a, b]"), over the seeds both have."""
    iv = paired_differences(vals, arm, metric, base)
    rel = [100.0 * d / vals[(base, s)][metric] for s, d in zip(iv["seeds"], iv["diffs"])]
    out = paired_interval(rel)
    out["seeds"] = iv["seeds"]
    return out


def relative_lines(vals, arms, S, tokens) -> list:
    """One sentence per sparse arm: its held-out loss relative to dense with the 95 % interval, and
    whether it meets "within +-1 %, interval inside +-2 %"."""
    out = []
    for a in arms:
        if a == "dense":
            continue
        for metric, what in (("heldout_loss", f"held-out loss @ {S}"),
                             ("trainer_heldout_final", "trainer's held-out loss, final")):
            iv = relative_difference(vals, a, metric)
            if not iv["n"]:
                continue
            if iv["lo"] is None:
                out.append(f"* {a}: {what} {iv['mean']:+.2f} % of dense's at {tokens} tokens (one seed: no interval).")
                continue
            within = abs(iv["mean"]) <= 1.0 and -2.0 <= iv["lo"] and iv["hi"] <= 2.0
            out.append(f"* {a}: {what} {iv['mean']:+.2f} % of dense's at {tokens} tokens, 95 % interval "
                       f"[{iv['lo']:+.2f} %, {iv['hi']:+.2f} %] over {iv['n']} seeds; within +-1 % with the interval "
                       f"inside +-2 %: {'yes' if within else 'no'}.")
    return out


def sparse_pair_lines(vals, arms, S) -> list:
    """Markdown rows pairing the sparse arms with each other (``b − a`` for ``a`` before ``b`` in
    :data:`VARIANTS`): held-out loss, absolute and relative to ``a``, over the seeds both have; [] when
    fewer than two sparse arms share a seed."""
    sparse = [a for a in arms if a != "dense"]
    out = []
    for i, a in enumerate(sparse):
        for b in sparse[i + 1:]:
            iv = paired_differences(vals, b, "heldout_loss", base=a)
            if not iv["n"]:
                continue
            rel = relative_difference(vals, b, base=a)
            for what, x, f in (("", iv, "+.4g"), (f" relative to {a} (%)", rel, "+.2f")):
                ci = f"[{x['lo']:{f}}, {x['hi']:{f}}]" if x["lo"] is not None else "—"
                per = ", ".join(f"s{s}: {d:{f}}" for s, d in zip(x["seeds"], x["diffs"]))
                out.append(f"| held-out loss @ {S}, evaluator{what} | {b} − {a} | {x['n']} | {x['mean']:{f}} | {ci} "
                           f"| {per} | {verdict(x, a)} |")
    if out:
        out = ["", "The sparse arms paired with each other (per seed, same data and order), 95 % t-interval:", "",
               "| metric | pair | n | mean | 95 % interval | per seed | verdict |", "|---|---|---|---|---|---|---|"] + out
    return out


def seed_report_md(rows, protocol: dict | None = None) -> str:
    """Markdown of the multi-seed comparison of ``rows``."""
    vals, notes = seed_values(rows)
    arms = [a for a in VARIANTS if any(k[0] == a for k in vals)]
    fmt = lambda v, f=".4f": "—" if v is None else format(v, f)  # noqa: E731
    lines = ["# Multi-seed quality study", ""]
    ref = next((r for r in reversed(rows) if not r.get("error")), rows[-1] if rows else {})
    S = ref.get("seq_len") or "S"
    budget = sorted({v["tokens"] for v in vals.values() if v.get("tokens")})
    lines.append(f"Token budget per arm and seed: {', '.join(f'{b:,}' for b in budget) or '—'} tokens "
                 f"({ref.get('steps')} steps of {ref.get('tokens_per_step')} tokens); retrieval in the training mix "
                 f"{json.dumps(ref.get('retrieval'))}; evaluation haystack {ref.get('eval_haystack')}; "
                 f"devices {sorted({str(v.get('device')) for v in vals.values()})}; commits "
                 f"{sorted({str(r.get('commit')) for r in rows})}.")
    if protocol:
        lines.append(f"Protocol: {json.dumps(protocol)}")
    lines += ["", "Per arm (mean ± s.d. over seeds; s.d. needs two seeds):", "",
              f"| arm | seeds | held-out loss @ {S} | trainer's held-out, final | NIAH accuracy | index recall p=0.9 "
              "| tokens/s | training s (compile excluded) |", "|---|---|---|---|---|---|---|---|"]

    def ms(a, k, f=".4f"):
        xs = [v[k] for (b, _), v in sorted(vals.items()) if b == a and v.get(k) is not None]
        if not xs:
            return "—"
        return format(statistics.fmean(xs), f) + (f" ± {statistics.stdev(xs):{f}}" if len(xs) > 1 else "")

    for a in arms:
        seeds = sorted(s for b, s in vals if b == a)
        lines.append(f"| {a} | {', '.join(map(str, seeds))} | {ms(a, 'heldout_loss')} | {ms(a, 'trainer_heldout_final')} "
                     f"| {ms(a, 'niah_accuracy', '.3f')} | {ms(a, 'recall', '.3f')} | {ms(a, 'tokens_per_s', ',.0f')} "
                     f"| {ms(a, 'train_compute_seconds', '.1f')} |")
    lines += ["", "Paired differences arm − dense (per seed, same data and order), mean and 95 % t-interval over "
              "seeds (t_{0.975, n−1}):", "",
              "| metric | arm − dense | n | mean | 95 % interval | per seed | verdict |", "|---|---|---|---|---|---|---|"]
    for a in arms:
        if a == "dense":
            continue
        for k, what in (*PAIRED, *reread_metrics(rows)):
            iv = paired_differences(vals, a, k)
            if not iv["n"]:
                continue
            ci = f"[{iv['lo']:+.4g}, {iv['hi']:+.4g}]" if iv["lo"] is not None else "—"
            per = ", ".join(f"s{s}: {d:+.4g}" for s, d in zip(iv["seeds"], iv["diffs"]))
            lines.append(f"| {what.format(S=S)} | {a} − dense | {iv['n']} | {iv['mean']:+.4g} | {ci} | {per} "
                         f"| {verdict(iv)} |")
    lines += sparse_pair_lines(vals, arms, S)
    lines += niah_pooled_lines(rows, arms)
    lines += train_infer_lines(rows)
    lines += needle_lines(rows, arms)
    lines += reread_lines(rows)
    rel = relative_lines(vals, arms, S, ", ".join(f"{b:,}" for b in budget) or "—")
    if rel:
        lines += ["", "Held-out loss (the evaluator's, then the trainer's) relative to dense, per seed (arm − dense) / "
                  "dense, mean and 95 % t-interval:", ""] + rel
    times = {s: v.get("equal_time") for (_, s), v in sorted(vals.items())}
    lines += ["", "Equal training time: each seed's arms are read at its fastest arm's training time (seconds, "
              "compile excluded): " + ", ".join(f"seed {s}: {fmt(t, '.1f')}" for s, t in sorted(times.items()))
              + ". A slower arm's value there comes from its fixed-budget run (learning rate not yet decayed)."]
    by_pos = dense_read_by_position(rows)
    if by_pos:
        lines += ["", "Dense read minus own read by position (the same parameters; rises with position: read out of "
                  "distribution; the same at every position, the first bucket included: a gain through the pattern):",
                  "", "| arm | seed | first bucket | middle | last bucket | every bucket |", "|---|---|---|---|---|---|"]
        for arm, seed, edges, g in by_pos:
            span = (lambda i: f" ({edges[i]}-{edges[i + 1]})" if len(edges) == len(g) + 1 else "")  # noqa: E731
            lines.append(f"| {arm} | {seed} | {g[0]:+.3f}{span(0)} | {g[len(g) // 2]:+.3f} | {g[-1]:+.3f}{span(len(g) - 1)} "
                         f"| {', '.join(f'{x:+.3f}' for x in g)} |")
    if notes:
        lines += ["", "Notes:"] + [f"* {n}" for n in notes]
    return "\n".join(lines) + "\n"


def plot_seeds(rows, path: str, smooth: int = 10) -> str:
    """Loss vs training tokens (mean over seeds, band min-max) and held-out loss vs training seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    vals, _ = seed_values(rows)
    last = {}
    for r in rows:
        if not r.get("error"):
            last[(r["arm"], r["seed"])] = r
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"dense": "C0", "mtraining": "C1", "msa": "C2"}
    zoom = None
    for a in VARIANTS:
        rs = [r for (b, _), r in sorted(last.items()) if b == a and r.get("train_loss")]
        if not rs:
            continue
        n = min(len(r["train_loss"]) for r in rs)
        k = max(1, min(smooth, n))
        ys = []
        for r in rs:
            y = np.asarray([l for _, l in r["train_loss"][:n]], float)
            ys.append(np.convolve(y, np.ones(k) / k, mode="valid"))
        ys = np.stack(ys)
        x = np.asarray([s for s, _ in rs[0]["train_loss"][:n]], float)[k - 1:] * rs[0]["tokens_per_step"] / 1e6
        ax.plot(x, ys.mean(0), color=colors[a], lw=1.2, label=f"{a} train ({len(rs)} seeds, mean; band min-max)")
        ax.fill_between(x, ys.min(0), ys.max(0), color=colors[a], alpha=0.25, lw=0)
        if len(x) > 10:  # the last 40 % of the budget, where the arms' differences are
            if zoom is None:
                zoom = ax.inset_axes([0.42, 0.42, 0.55, 0.4])
            tail = x >= 0.6 * x[-1]
            zoom.plot(x[tail], ys.mean(0)[tail], color=colors[a], lw=1)
            zoom.fill_between(x[tail], ys.min(0)[tail], ys.max(0)[tail], color=colors[a], alpha=0.25, lw=0)
        cs = [heldout_curve_of(r) for r in rs if heldout_curve_of(r)]
        if cs:
            m = min(len(c) for c in cs)
            hv = np.asarray([[v for _, v in c[:m]] for c in cs])
            hx = np.asarray([s for s, _ in cs[0][:m]], float) * rs[0]["tokens_per_step"] / 1e6
            err = np.clip([hv.mean(0) - hv.min(0), hv.max(0) - hv.mean(0)], 0, None)  # rounding: never < 0
            ax.errorbar(hx, hv.mean(0), yerr=err, fmt="o--",
                        color=colors[a], ms=3, lw=0.8, capsize=2, label=f"{a} held-out (trainer)")
        for r in rs:
            c, tm = heldout_curve_of(r), {int(s): t for s, t in r.get("train_time") or []}
            pts = [(tm[int(s)], v) for s, v in c if int(s) in tm]
            if pts:
                bx.plot(*zip(*pts), "o-", color=colors[a], ms=2, lw=0.8, alpha=0.8,
                        label=a if r is rs[0] else None)
    for s in sorted({s for _, s in vals}):
        T = next((v.get("equal_time") for (b, t), v in vals.items() if t == s), None)
        if T:
            bx.axvline(T, color="grey", lw=0.6, ls=":")
    ax.set_xlabel("training tokens (M)")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_title("loss vs tokens", fontsize=9)
    bx.set_xlabel("training seconds (compile excluded)")
    bx.set_ylabel("held-out loss, trainer's eval")
    bx.set_title("held-out loss vs time, one line per seed (dotted: equal-time points)", fontsize=9)
    for a_ in (ax, bx):
        a_.grid(alpha=0.3)
        a_.legend(fontsize=7, loc="upper right" if zoom is None or a_ is bx else "lower left")
    if zoom is not None:
        zoom.grid(alpha=0.3)
        zoom.tick_params(labelsize=6)
        zoom.set_title("last 40 % of the tokens", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_seed_report(rows, out: str, protocol: dict | None = None) -> str:
    """``seeds.md`` and ``loss_vs_tokens.png`` in ``out`` from ``rows``; returns the markdown."""
    os.makedirs(out, exist_ok=True)
    md = seed_report_md(rows, protocol)
    with open(os.path.join(out, "seeds.md"), "w") as f:
        f.write(md)
    if any(r.get("train_loss") for r in rows):
        plot_seeds(rows, os.path.join(out, "loss_vs_tokens.png"))
    return md
