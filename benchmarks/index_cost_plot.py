"""What a denser index costs at 128K: the Qwen2.5-0.5B training step on one GPU with the default index, with
``last_q=1024`` and with ``last_q=1024 vertical_min=1024 slash_max=256`` (the settings whose recall the quality
study measured on trained models), beside the all-cuDNN step (``benchmarks/train_throughput.py`` rows of one run);
and the index estimate's own time per layer against its observation window ``last_q`` beside dense cuDNN
attention of the same shape (``benchmarks/estimate_cost.py`` rows).

    python benchmarks/index_cost_plot.py --run s33-index-settings-128k --estimate-run s33-estimate-cost \\
      --out results/quality/quality_index_cost.png
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script: the repo root
from benchmarks.kernels_report import load_rows  # noqa: E402

THROUGHPUT = os.path.join(ROOT, "results", "training", "train_throughput.jsonl")
ESTIMATE = os.path.join(ROOT, "results", "quality", "estimate_cost.jsonl")


def _rows(path: str, run: str) -> list:
    """The rows of JSONL ``path`` from campaign ``run``."""
    return load_rows([path], (run,))


def steps(rows) -> list:
    """``[(label, step_ms, x_cudnn, work_fraction)]``: cuDNN first, then each MTraining row labelled by its
    ``model.sparsity`` overrides ("defaults" without any). ``ValueError`` without a cuDNN row."""
    dense = [r for r in rows if r["backend"] == "cudnn"]
    if not dense:
        raise ValueError("no cuDNN row in the run: nothing to compare the steps with")
    base = dense[0]["step_ms"]
    out = [("all cuDNN", base, 1.0, 1.0)]
    for r in rows:
        if r["backend"] != "mtraining":
            continue
        sets = [o.rpartition(".")[2] for o in r.get("overrides", []) if o.startswith("model.sparsity.")]
        out.append((" ".join(sets) or "defaults", r["step_ms"], base / r["step_ms"], r.get("work_fraction")))
    return out


def estimates(rows) -> dict:
    """``{S: {"last_q": [...], "ms": [...], "cudnn_fwd": ms, "cudnn_fwd_bwd": ms}}`` from estimate_cost rows."""
    out = {}
    for r in rows:
        e = out.setdefault(r["S"], {"last_q": [], "ms": []})
        if r["fn"] == "estimate_index":
            e["last_q"].append(r["last_q"])
            e["ms"].append(r["ms"])
        else:
            e[r["fn"]] = r["ms"]
    return out


def plot(step_rows, est, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [s[0] for s in step_rows]
    a.barh(range(len(step_rows)), [s[1] / 1000 for s in step_rows], color=["grey"] + ["C0"] * (len(step_rows) - 1))
    for i, (_, ms, x, work) in enumerate(step_rows):
        extra = "" if i == 0 else f", work {work:.3f} of dense"
        a.annotate(f"{ms / 1000:.2f} s ({x:.2f}x cuDNN{extra})", (ms / 1000, i), xytext=(4, -3),
                   textcoords="offset points", fontsize=8)
    a.set_yticks(range(len(step_rows)), [lab.replace(" v", "\nv") for lab in labels], fontsize=8)
    a.invert_yaxis()
    a.set_xlim(0, max(s[1] for s in step_rows) / 1000 * 1.9)
    a.set_xlabel("training step, s (Qwen2.5-0.5B shape, 128K, one GPU; lower is better)")
    for S in sorted(est):
        e = est[S]
        b.plot(e["last_q"], e["ms"], "o-", label=f"index estimate, S = {S // 1024}K")
        for key, style in (("cudnn_fwd", ":"), ("cudnn_fwd_bwd", "--")):
            if key in e:
                b.axhline(e[key], ls=style, lw=0.8, color=b.lines[-1].get_color(),
                          label=f"cuDNN {'fwd' if key == 'cudnn_fwd' else 'fwd+bwd'}, {S // 1024}K")
    b.set_xscale("log", base=2)
    b.set_yscale("log")
    b.set_xlabel("observation window last_q (query rows)")
    b.set_ylabel("ms per layer (16 / 2 heads, d128)")
    b.legend(fontsize=7)
    fig.suptitle("What a denser index costs: the step, and the estimate's own time", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="train_throughput.jsonl run tag")
    p.add_argument("--estimate-run", required=True, help="estimate_cost.jsonl run tag")
    p.add_argument("--throughput", default=THROUGHPUT)
    p.add_argument("--estimate", default=ESTIMATE)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    try:
        step_rows = steps(_rows(a.throughput, a.run))
        est = estimates(_rows(a.estimate, a.estimate_run))
        if not est:
            raise ValueError(f"estimate run {a.estimate_run!r}: no rows")
    except ValueError as e:
        print(f"index_cost_plot: run {a.run!r}: {e}", file=sys.stderr)
        return 1
    for label, ms, x, work in step_rows:
        print(f"{label:45s} {ms:8.1f} ms  {x:5.2f}x cuDNN  work {work}")
    print(plot(step_rows, est, a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
