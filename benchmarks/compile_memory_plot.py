"""The training step's compiled peak by dense-layer placement (``benchmarks/compile_memory.py`` rows, Qwen2.5-0.5B
shape at 128K, one GPU): each series is a set of runs' rows of one variant, against the all-cuDNN step and issue
34's 1.05x target.

    python benchmarks/compile_memory_plot.py \\
      --series "own gradient buffer per run (before 9397c14)=s34-compile-memory-structure,s35-compile-memory-placements:mt" \\
      --series "one shared gradient buffer (custom VJP, 9397c14)=s37-shared-weight-gradient:mt" \\
      --series "the same, custom JVP (committed; 1c1907d)=s38-compile-memory-custom-jvp:mt" \\
      --series "repeats as separate scans (mt-flatrepeats; 4d6174b)=s38-flat-repeats:mt-flatrepeats" \\
      --out results/training/compile_memory_placements.png

``--times RUN[,RUN...]``: instead, each process's lowering and XLA compile seconds in those runs, in run order
(stacked bars coloured by variant), against issue 34's 20 s compile target:

    python benchmarks/compile_memory_plot.py --times s43-compile-precompile \
      --out results/training/compile_times_precompile.png

``--rows`` may name ``train_throughput.jsonl`` instead: its rows' ``compile_s`` is the trainer's lower + compile in
one number (no lowering bar), coloured by each row's ``variant``:

    python benchmarks/compile_memory_plot.py --rows results/training/train_throughput.jsonl \
      --times s59-kernel-stream-split-ab --out results/training/compile_times_kernel_stream.png
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script: the repo root
from benchmarks.kernels_report import load_rows  # noqa: E402

ROWS = os.path.join(ROOT, "results", "training", "compile_memory.jsonl")
TARGET = 1.05
COMPILE_TARGET_S = 20.0


def placement(row) -> str | None:
    """The row's ``model.dense_layers`` override (``"[0,1]"``), ``None`` if another override changes the
    program (``model.dense_backend=ring``, ...) or there is none."""
    sets = [o for o in row.get("overrides", []) if o.startswith("model.dense_layers=")]
    other = [o for o in row.get("overrides", []) if o.startswith("model.dense_backend=") and not o.endswith("cudnn")]
    return None if other or not sets else sets[-1].partition("=")[2]


def parse_series(text: str) -> tuple[str, tuple, str]:
    """``"LABEL=RUN[,RUN...]:VARIANT"`` -> ``(label, runs, variant)``; ``ValueError`` naming the text."""
    label, eq, rest = text.partition("=")
    runs, colon, variant = rest.rpartition(":")
    if not (eq and colon and label and runs and variant):
        raise ValueError(f"--series {text!r}: expected LABEL=RUN[,RUN...]:VARIANT")
    return label, tuple(runs.split(",")), variant


def peaks(rows, runs, variant) -> dict:
    """``{placement: peak GiB}`` of ``variant``'s rows in ``runs`` (a later run's row wins)."""
    out = {}
    for r in rows:
        if r.get("run") in runs and r["variant"] == variant and "error" not in r and placement(r) is not None:
            out[placement(r)] = r["peak_gib"]
    return out


def cudnn_peak(rows, runs) -> float:
    """The all-cuDNN step's peak (GiB) from ``runs``; ``ValueError`` if none of them has a ``cudnn`` row."""
    got = [r["peak_gib"] for r in rows if r.get("run") in runs and r["variant"] == "cudnn" and "error" not in r]
    if not got:
        raise ValueError(f"no cudnn row in runs {sorted(set(runs))}: nothing to compare the peaks with")
    return got[-1]


def plot(series, base: float, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({k for _, p in series for k in p}, key=lambda k: (k.count(","), k))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(series)
    for j, (label, p) in enumerate(series):
        xs = [i + (j - (len(series) - 1) / 2) * width for i, k in enumerate(keys) if k in p]
        ys = [p[k] for k in keys if k in p]
        ax.bar(xs, ys, width, label=label)
        for x, y in zip(xs, ys):
            ax.annotate(f"{y / base:.3f}x", (x, y), xytext=(0, 2), textcoords="offset points", ha="center",
                        fontsize=7)
    ax.axhline(base, color="grey", lw=1, label=f"all cuDNN ({base:.2f} GiB)")
    ax.axhline(base * TARGET, color="red", ls="--", lw=1, label=f"issue 34 target ({TARGET}x)")
    ax.set_xticks(range(len(keys)), [f"dense {k}" if k != "[]" else "every layer\nsparse" for k in keys], fontsize=8)
    ax.set_ylim(base * 0.9, max(max(p.values()) for _, p in series) * 1.03)
    ax.set_ylabel("compiled peak, GiB (lower is better)")
    ax.set_title("Training step at 128K, Qwen2.5-0.5B shape, one H200: peak by dense-layer placement")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def times(rows, runs) -> list:
    """``[(variant, lower_s, compile_s)]`` of every process (row) in ``runs``, in file order (``lower_s`` 0 for a
    trainer row, whose ``compile_s`` holds both); ``ValueError`` naming the runs if none has a row."""
    got = [(r["variant"], r.get("lower_s") or 0.0, r["compile_s"]) for r in rows
           if r.get("run") in runs and r.get("error") is None]
    if not got:
        raise ValueError(f"no rows in runs {sorted(set(runs))}")
    return got


def plot_times(procs, title: str, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = list(dict.fromkeys(v for v, _, _ in procs))
    colors = {v: plt.get_cmap("tab10")(i) for i, v in enumerate(variants)}
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for i, (v, lo, co) in enumerate(procs):
        ax.bar(i, co, color=colors[v], label=v if v not in [p[0] for p in procs[:i]] else None)
        ax.bar(i, lo, bottom=co, color=colors[v], alpha=0.35)
        ax.annotate(f"{co:.1f}", (i, co), xytext=(0, -10), textcoords="offset points", ha="center", fontsize=8,
                    color="white")
    one = all(lo == 0 for _, lo, _ in procs)  # trainer rows: lower + compile in one number
    ax.axhline(COMPILE_TARGET_S, color="red", ls="--", lw=1,
               label=f"issue 34: {'step' if one else 'XLA'} compile <= {COMPILE_TARGET_S:g} s")
    ax.set_xticks(range(len(procs)), [str(i + 1) for i in range(len(procs))], fontsize=8)
    ax.set_ylim(0, max(lo + co for _, lo, co in procs) * 1.3)
    ax.set_xlabel("process, in run order (" + ("lower + compile, seconds written in)" if one else
                                                "full colour: XLA compile, its seconds written in; pale above: lowering)"))
    ax.set_ylabel("seconds (lower is better)")
    ax.set_title(f"{title}: {'lower + compile' if one else 'lowering and XLA compile'}")
    ax.legend(fontsize=8, loc="upper left", ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--series", action="append", metavar="LABEL=RUN[,RUN...]:VARIANT")
    p.add_argument("--times", metavar="RUN[,RUN...]", help="plot each process's lowering / compile seconds instead")
    p.add_argument("--rows", default=ROWS)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if a.times:
        runs = tuple(a.times.split(","))
        try:
            rows = load_rows([a.rows])
            procs = times(rows, runs)
        except ValueError as e:
            print(f"compile_memory_plot: {e}", file=sys.stderr)
            return 1
        devices = sorted({r["device"] for r in rows if r.get("run") in runs and r.get("device")})
        print(plot_times(procs, f"Training step at 128K, Qwen2.5-0.5B shape, {', '.join(devices) or 'one GPU'}", a.out))
        return 0
    if not a.series:
        p.error("--series or --times is required")
    try:
        specs = [parse_series(s) for s in a.series]
        rows = load_rows([a.rows])
        base = cudnn_peak(rows, tuple(r for _, runs, _ in specs for r in runs))
        series = [(label, peaks(rows, runs, variant)) for label, runs, variant in specs]
        empty = [label for label, p in series if not p]
        if empty:
            raise ValueError(f"no rows for series {empty}")
    except ValueError as e:
        print(f"compile_memory_plot: {e}", file=sys.stderr)
        return 1
    print(plot(series, base, a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
