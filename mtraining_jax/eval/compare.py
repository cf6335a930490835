"""Side-by-side comparison of evaluation results (``mtraining-eval --compare RUN_A RUN_B``).

Inputs are results dicts (``results.json`` of :func:`~mtraining_jax.eval.api.evaluate_params`).
:func:`summary` flattens one into named scalars; :func:`markdown_table` puts several side by
side (with the difference to the first run); :func:`compare_results` writes the table and the
overlaid / side-by-side plots into a folder.
"""

from __future__ import annotations

import json
import os

import numpy as np

from mtraining_jax.eval.api import RESULTS


def load_results(path: str) -> dict:
    """A ``results.json`` (or a folder holding one); ``ValueError`` naming the path otherwise."""
    f = os.path.join(path, RESULTS) if os.path.isdir(path) else path
    if not os.path.isfile(f):
        raise ValueError(f"no evaluation results at {path!r} (expected {RESULTS}; run mtraining-eval on "
                         f"the checkpoint first)")
    with open(f) as fh:
        return json.load(fh)


def summary(res: dict) -> dict:
    """Named scalars of one result (insertion order = table order)."""
    out = {}
    if "perplexity" in res:
        r = res["perplexity"]
        out[f"held-out loss @ {r['seq_len']}"] = r["mean_loss"]
        w = r.get("window_loss", [])
        if len(w) > 1:
            out["held-out loss std error over windows"] = float(np.std(w, ddof=1) / np.sqrt(len(w)))
        out["loss, last position bucket"] = r["loss"][-1]
    if "niah" in res:
        r = res["niah"]
        a = np.asarray(r["accuracy"])
        out[f"NIAH {r['task']} accuracy (mean of grid)"] = float(a.mean())
        for j, n in enumerate(r["lengths"]):
            out[f"NIAH accuracy @ {n}"] = float(a[:, j].mean())
    if "ruler" in res:
        r = res["ruler"]
        for t, v in r["tasks"].items():
            out[f"RULER {t} (mean over lengths)"] = float(np.mean(v["accuracy"]))
    if "recall" in res:
        r = res["recall"]
        for p in r["mean_recall"]:
            out[f"index recall p={p} (mean / min head)"] = (r["mean_recall"][p], r["min_recall"][p])
            out[f"index density p={p}"] = r["mean_density"][p]
            if p in (r.get("mean_window_recall") or {}):
                out[f"index recall p={p} on its window's rows"] = r["mean_window_recall"][p]
            if p in (r.get("mean_vertical_capped") or {}):
                out[f"index p={p}: share of heads whose vertical / slash cap binds"] = (
                    r["mean_vertical_capped"][p], r["mean_slash_capped"][p])
                out[f"index p={p}: verticals / slashes the window asks for (uncapped)"] = (
                    r["mean_vertical_needed"][p], r["mean_slash_needed"][p])
    return out


def _fmt(v) -> str:
    if isinstance(v, (tuple, list)):
        return " / ".join(_fmt(x) for x in v)
    return f"{v:.4f}" if isinstance(v, float) else str(v)


def markdown_table(runs) -> str:
    """Markdown table of :func:`summary` for ``[(label, results), ...]`` plus ``B - A`` columns."""
    sums = [(label, summary(r)) for label, r in runs]
    keys = list(dict.fromkeys(k for _, s in sums for k in s))
    head = ["metric"] + [label for label, _ in sums] + [f"{label} - {sums[0][0]}" for label, _ in sums[1:]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k in keys:
        vals = [s.get(k) for _, s in sums]
        diffs = []
        for v in vals[1:]:
            a = vals[0]
            if isinstance(v, float) and isinstance(a, float):
                diffs.append(f"{v - a:+.4f}")
            elif isinstance(v, tuple) and isinstance(a, tuple):
                diffs.append(" / ".join(f"{x - y:+.4f}" for x, y in zip(v, a)))
            else:
                diffs.append("")
        lines.append("| " + " | ".join([k] + ["" if v is None else _fmt(v) for v in vals] + diffs) + " |")
    return "\n".join(lines) + "\n"


def compare_results(runs, out_dir: str, prefix: str = "compare",
                    sections=("niah", "perplexity", "ruler", "recall")) -> list[str]:
    """Write ``<prefix>.md`` and the side-by-side PNGs of those ``sections`` every run has."""
    from mtraining_jax.eval import plots

    os.makedirs(out_dir, exist_ok=True)
    files = [os.path.join(out_dir, f"{prefix}.md")]
    with open(files[0], "w") as f:
        f.write(markdown_table(runs))
    have = lambda k: k in sections and all(k in r for _, r in runs)  # noqa: E731
    if have("niah"):
        files.append(plots.niah_heatmaps([(l, r["niah"]) for l, r in runs],
                                         os.path.join(out_dir, f"{prefix}_niah.png")))
    if have("perplexity"):
        files.append(plots.position_curves([(l, r["perplexity"]) for l, r in runs],
                                           os.path.join(out_dir, f"{prefix}_position_loss.png")))
    if have("ruler"):
        files.append(plots.ruler_bars([(l, r["ruler"]) for l, r in runs], os.path.join(out_dir, f"{prefix}_ruler.png")))
    if have("recall"):
        p = f"{runs[0][1]['recall']['p'][0]:g}"
        files.append(plots.recall_maps([(l, r["recall"]) for l, r in runs],
                                       os.path.join(out_dir, f"{prefix}_recall.png"), p))
    return files
