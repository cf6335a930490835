"""Tables and plots of ``benchmarks/kernels.py``'s rows: the comparison table and bar chart, the
per-pass table and chart (``--passes``), the index-family chart (TFLOP/s and Mosaic / Triton per family
and density), and the reader of saved ``--json`` / JSONL results (``--plot-from``)."""

from __future__ import annotations

import json


def _pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, title: str, path: str, dpi: int) -> None:
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)

def passes_table(rows):
    out = ["| seq | index | pass | impl | ms (min-max) | TFLOP/s | compile s |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['seq']} | {r['index']} | {r['pass_']} | {_pass_label(r)} | {r['ms']:.2f} "
                   f"({r['spread_ms'][0]:.2f}-{r['spread_ms'][1]:.2f}) | {r['tflops']:.0f} | "
                   f"{r.get('compile_s', float('nan')):.1f} |")
    return "\n".join(out)


def _pass_label(r) -> str:
    """A pass row's bar label: its impl, or for a Mosaic column-pass row its walk (``col_walk``: rows
    before run 26 call the masked walk ``mosaic``, later ones the free walk); ``, loads only`` for a
    ``--loads-only`` row of the kernel without its math (:mod:`benchmarks.pass_floors`); a row's
    ``build`` (an A/B of two commits' kernels, one process each) after it."""
    lab = f"mosaic, {r['col_walk']} walk" if r.get("col_walk") and r["impl"] != "triton" else r["impl"]
    lab += ", loads only" if r.get("variant") == "load_only" else ""
    return lab + (f", {r['build']}" if r.get("build") else "")


def plot_passes(rows, path):
    """Bar chart of :func:`passes` rows: ms per pass (min-max bars, labelled with active TFLOP/s), one
    panel per index, one bar per row in the rows' order (an A/B's repeated entries side by side), one
    colour per impl (or column-pass walk)."""
    plt = _pyplot()

    indices = list(dict.fromkeys((r["seq"], r["index"]) for r in rows))
    order = list(dict.fromkeys(r["pass_"] for r in rows))
    colours = {lab: f"C{i}" for i, lab in enumerate(dict.fromkeys(_pass_label(r) for r in rows))}
    fig, axes = plt.subplots(1, len(indices), figsize=(5.5 * len(indices), 4), squeeze=False)
    for ax, (seq, name) in zip(axes[0], indices):
        seen = set()
        for i, p in enumerate(order):
            got = [r for r in rows if (r["seq"], r["index"], r["pass_"]) == (seq, name, p)]
            w = 0.8 / max(len(got), 1)
            for j, r in enumerate(got):
                lab = _pass_label(r)
                b = ax.bar(i - 0.4 + (j + 0.5) * w, r["ms"], w, color=colours[lab], label=None if lab in seen else lab,
                           yerr=[[r["ms"] - r["spread_ms"][0]], [r["spread_ms"][1] - r["ms"]]], capsize=2)[0]
                seen.add(lab)
                ax.annotate(f"{r['tflops']:.0f}", (b.get_x() + b.get_width() / 2, b.get_height()),
                            ha="center", va="bottom", fontsize=6)
        ax.set_xticks(range(len(order)), order)
        ax.set_ylabel("ms (label: active TFLOP/s)")
        ax.set_title(f"{seq // 1024}K tokens, index {name}", fontsize=9)
        ax.legend(fontsize=7)
    _save(fig, "kernel passes alone, min-max bars", path, dpi=110)


def table(rows):
    cud = {r["seq"]: r for r in rows if r["name"] == "cudnn"}
    out = ["| seq | impl | sparsity | fwd ms | fwd TFLOP/s | fwd x cuDNN | fwd+bwd ms | fwd+bwd TFLOP/s "
           "| fwd+bwd x cuDNN |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = cud[r["seq"]]
        fb = "-" if r["fb_ms"] is None else f"{r['fb_ms']:.2f}"
        fbt = "-" if r["fb_ms"] is None else f"{r['fb_tflops']:.0f}"
        fbx = "-" if r["fb_ms"] is None else f"{c['fb_ms'] / r['fb_ms']:.2f}"
        out.append(f"| {r['seq']} | {r['name']} | {r['sparsity']:.3f} | {r['fwd_ms']:.2f} | {r['fwd_tflops']:.0f} | "
                   f"{c['fwd_ms'] / r['fwd_ms']:.2f} | {fb} | {fbt} | {fbx} |")
    return "\n".join(out)


def plot(rows, path):
    """Bar chart of active TFLOP/s per impl and index (forward, forward+backward), cuDNN dense as a line."""
    plt = _pyplot()

    seqs = sorted({r["seq"] for r in rows})
    fig, axes = plt.subplots(len(seqs), 2, figsize=(12, 3.6 * len(seqs)), squeeze=False)
    for ax_row, S in zip(axes, seqs):
        rs = [r for r in rows if r["seq"] == S and r["name"] != "cudnn"]
        cud = next(r for r in rows if r["seq"] == S and r["name"] == "cudnn")
        for ax, key, title in [(ax_row[0], "fwd_tflops", "forward"), (ax_row[1], "fb_tflops", "forward+backward")]:
            names = [r["name"] for r in rs]
            vals = [r[key] or 0 for r in rs]
            colors = ["tab:orange" if n.startswith("auto") else "tab:blue" if n.startswith("triton") else "tab:gray"
                      for n in names]
            ax.bar(range(len(rs)), vals, color=colors)
            ax.axhline(cud[key], color="k", ls="--", lw=1, label=f"cuDNN dense {cud[key]:.0f}")
            ax.set_xticks(range(len(rs)), names, rotation=45, ha="right", fontsize=8)
            ax.set_ylabel("active TFLOP/s")
            ax.set_title(f"{S // 1024}K tokens, {title}")
            ax.legend(fontsize=8)
    _save(fig, "block-sparse attention kernels (orange: auto = the registry's choice on Hopper)", path, dpi=80)


def plot_families(rows, path):
    """Forward+backward active TFLOP/s (left) and Mosaic / Triton speed-up (right) per index family
    and density (rows with ``family``; cuDNN dense as a line). Several rows of one (family, density, impl):
    repeated calls (``round``) or runs plotted together: the bar is their median, the whisker spans every
    row's fastest to slowest repeat (the speed-up: each (run, round)'s ratio, their median and range)."""
    import statistics

    plt = _pyplot()

    cud = [r for r in rows if r["family"] == "dense"]
    cases: dict = {}
    for r in rows:
        if r["family"] != "dense":
            impl = "triton" if r["name"].startswith("triton") else "mosaic"
            cases.setdefault((r["family"], round(r["density"], 2)), {}).setdefault(impl, []).append(r)
    keys = sorted(cases)

    def tflops(rs):  # median, and the whisker's low / high ends (the same work over the slowest / fastest repeat)
        vals = [r["fb_tflops"] for r in rs]
        ends = [r["fb_tflops"] * r["fb_ms"] / t for r in rs for t in (r.get("fb_spread_ms") or [r["fb_ms"]] * 2)]
        med = statistics.median(vals)
        return med, med - min(ends), max(ends) - med

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [2, 1]})
    x = range(len(keys))
    for off, impl, color in [(-0.2, "triton", "tab:blue"), (0.2, "mosaic", "tab:orange")]:
        got = [tflops(cases[k][impl]) if impl in cases[k] else (0.0, 0.0, 0.0) for k in keys]
        ax.bar([i + off for i in x], [g[0] for g in got], width=0.4, color=color, label=impl,
               yerr=[[g[1] for g in got], [g[2] for g in got]], capsize=2)
    if cud:
        line = statistics.median(r["fb_tflops"] for r in cud)
        ax.axhline(line, color="k", ls="--", lw=1, label=f"cuDNN dense {line:.0f}")
    ax.set_xticks(list(x), [f"{f}\n{d:.0%}" for f, d in keys], fontsize=8)
    ax.set_ylabel("fwd+bwd active TFLOP/s")
    ax.legend(fontsize=8)
    both = [k for k in keys if len(cases[k]) == 2]
    ratios = []
    for k in both:  # paired per (run, round); where none pair up, every Triton row over every Mosaic row
        call = lambda r: (r.get("run"), r.get("round"))  # noqa: E731
        tri, mos = cases[k]["triton"], {call(r): r for r in cases[k]["mosaic"]}
        ratios.append([t["fb_ms"] / mos[call(t)]["fb_ms"] for t in tri if call(t) in mos]
                      or [t["fb_ms"] / m["fb_ms"] for t in tri for m in cases[k]["mosaic"]])
    meds = [statistics.median(v) for v in ratios]
    ax2.bar(range(len(both)), meds, color="tab:orange",
            yerr=[[m - min(v) for m, v in zip(meds, ratios)], [max(v) - m for m, v in zip(meds, ratios)]], capsize=2)
    ax2.axhline(1.2, color="k", ls="--", lw=1, label="target 1.2x")
    ax2.set_xticks(range(len(both)), [f"{f} {d:.0%}" for f, d in both], fontsize=8, rotation=60, ha="right")
    ax2.set_ylabel("Mosaic speed-up over Triton (fwd+bwd)")
    ax2.legend(fontsize=8)
    S = rows[0].get("S") or rows[0].get("seq")
    _save(fig, f"block-sparse kernels by index family, {S // 1024}K tokens "
                 f"({rows[-1].get('device', '')}, commit {rows[-1].get('commit', '?')[:7]})", path, dpi=80)


def load_rows(paths, runs=()) -> list[dict]:
    """Result rows of ``--json`` files (``{"meta", "rows"}`` or a list of ``--passes`` rows) and of
    JSONL files (one row per line, ``run`` naming its campaign); ``runs``: keep only those runs."""
    rows = []
    for path in paths:
        with open(path) as f:
            if path.endswith(".jsonl"):
                rows += [json.loads(line) for line in f if line.strip()]
            else:
                d = json.load(f)
                rows += d if isinstance(d, list) else d["rows"]
    return [r for r in rows if not runs or r.get("run") in runs]
