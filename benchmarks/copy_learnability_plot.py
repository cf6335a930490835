"""Plot of the GPU content-copying probes: the ``gpu-*`` rows of ``results/quality/copy_learnability.jsonl``
(written by ``benchmarks/copy_learnability.py --induction``; each row carries its command).

Left: held-out nll of the copied tokens (the rows that scored checkpoints). Right: the trainer's held-out
loss over all tokens (every row that has it; the only curve of runs whose checkpoints were not scored).
Training tokens come from each row's command (``--seq-len`` x ``--batch``); a run continued from another
(tags ending ``-a``, ``-b``, ``-c``: each slice restarts its step count) is drawn as one curve.

    python benchmarks/copy_learnability_plot.py   # -> results/quality/copy_learnability_induction.png
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS = os.path.join(ROOT, "results", "quality", "copy_learnability.jsonl")
CHANCE = 5.545  # ln 256: a byte guessed uniformly
DEFAULTS = {"--seq-len": 512, "--batch": 8}  # benchmarks/copy_learnability.py's


def tokens_per_step(command: str) -> int:
    """``--seq-len`` x ``--batch`` of a copy_learnability command (its defaults where absent)."""
    vals = {}
    for flag, default in DEFAULTS.items():
        m = re.search(rf"{flag}[ =](\d+)", command or "")
        vals[flag] = int(m.group(1)) if m else default
    return vals["--seq-len"] * vals["--batch"]


def curves(rows, key: str, prefix: str = "gpu-") -> dict:
    """``{label: [(tokens in millions, value)]}`` of the rows whose ``run`` starts with ``prefix`` and
    that have ``key``; slices ``<label>-a``, ``-b``, ... are chained in order into ``<label>``."""
    runs: dict = {}
    for r in rows:
        run = r.get("run") or ""
        if run.startswith(prefix):
            runs.setdefault(run, []).append(r)
    out, ends = {}, {}
    for run in sorted(runs, key=lambda t: (re.sub(r"-[a-z]$", "", t), t)):
        m = re.fullmatch(r"(.*)-([a-z])", run)
        label = (m.group(1) if m else run)[len(prefix):]
        per = tokens_per_step(runs[run][0].get("command", ""))
        start = ends.get(label, 0.0) if m and m.group(2) != "a" else 0.0
        pts = sorted((start + r["step"] * per / 1e6, r[key]) for r in runs[run] if r.get(key) is not None
                     and not (start and r["step"] == 0))
        last = max((start + r["step"] * per / 1e6 for r in runs[run]), default=start)
        ends[label] = last
        if pts:
            out.setdefault(label, []).extend(pts)
    return out


def plot(rows, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
    panels = ((axes[0], "copied_nll", "held-out nll of copied tokens"),
              (axes[1], "heldout_loss", "trainer's held-out loss, all tokens"))
    labels = sorted({label for _, key, _ in panels for label in curves(rows, key)})
    color = {label: plt.cm.tab10(i % 10) for i, label in enumerate(labels)}  # one colour per run, both panels
    for ax, key, what in panels:
        for label, pts in curves(rows, key).items():
            x, y = zip(*pts)
            seeded = re.search(r"-seed\d+$", label)
            ax.plot(x, y, marker="." if seeded else "o", ms=3 if seeded else 4, lw=1 if seeded else 1.6, label=label,
                    color=color[label])
        ax.axhline(CHANCE, color="grey", ls=":", label="chance (ln 256)")
        ax.set_xlabel("training tokens (M)")
        ax.set_ylabel(what)
        ax.legend(fontsize=7)
    dev = sorted({r.get("device", "").split(" (")[0] for r in rows if (r.get("run") or "").startswith("gpu-")})
    fig.suptitle(f"Content-based copying (induction windows, 256 bytes); {', '.join(dev)}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default=ROWS)
    p.add_argument("--out", default=os.path.join(os.path.dirname(ROWS), "copy_learnability_induction.png"))
    a = p.parse_args(argv)
    with open(a.rows) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    print(plot(rows, a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
