"""Every target of issue 34 measured on this machine in one command, in rounds, then checked
(:mod:`benchmarks.kernel_targets`):

    python -m benchmarks.kernel_targets_run --out OUT --rounds 2 --budget 560 [--steps fam5,fam2,full32,train]

Each round runs the steps in order, each in a fresh process from this tree: ``fam5`` / ``fam2`` the index
families at 128K and 5 % / 2 % density (cuDNN, Triton and Mosaic in one process; ``fam5`` also the trained model's
layer-1 index), ``full32`` the full causal index at 32K, ``train`` the every-layer-sparse training step then the
all-cuDNN one (Qwen2.5-0.5B shape, 128K). After each step its rows go to ``OUT/rows.jsonl`` (``run`` the step's
name, ``round``) and ``OUT/targets.md`` is rewritten with the verdicts so far, so a run stopped from outside keeps
what finished. With ``--budget`` a step starts only if it still fits: its longest earlier run, or its
:data:`STEPS` estimate before the first. The steps' raw outputs stay under ``--work``. Set ``MTRAINING_COMMIT``
where the tree travels without its ``.git`` (the rows' provenance), and run it from the tree's root. Meant for a
GPU: the sizes are the targets' own.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Callable, Optional

from benchmarks import kernel_targets
from benchmarks.kernels_report import load_rows

MODEL_INDEX = "results/kernels/model_index_mt_s0_128k.npz"
_FAMILIES = ["--seqs", "131072", "--families", "spread,mixed,vert,band", "--mha-max", "0", "--dense-max", "0",
             "--reps", "5"]
TRAIN = ["--config", "configs/qwen2.5-0.5b-128k.yaml", "--seq-lens", "131072", "--warmup", "1", "--steps", "3",
         "--set", "model.dense_layers=[]"]
# name -> (the processes' arguments after `python -m`, seconds one run took on an H100, for the budget's first run)
STEPS: dict[str, tuple[list[list[str]], float]] = {
    "fam5": ([["benchmarks.kernels", *_FAMILIES, "--sparsities", "0.95", "--model-index", MODEL_INDEX,
               "--model-layers", "1"]], 150.0),
    "fam2": ([["benchmarks.kernels", *_FAMILIES, "--sparsities", "0.98"]], 110.0),
    "full32": ([["benchmarks.kernels", "--seqs", "32768", "--sparsities", "0.95", "--families", "band",
                 "--dense-max", "32768", "--mha-max", "0", "--reps", "7", "--impls", "auto"]], 45.0),
    "train": ([["benchmarks.train_throughput", *TRAIN, "--backends", b] for b in ("mtraining", "cudnn")], 90.0),
}


def step_rows(argv: list[str], work: str, timeout: Optional[float]) -> list[dict]:
    """Run ``python -m ARGV`` here with its output under ``work`` (the kernels' ``--json`` file, the trainer's
    ``--out`` folder); its rows, or ``[]`` if it failed or ran past ``timeout`` (its output is streamed as it runs)."""
    os.makedirs(work, exist_ok=True)
    kernels = argv[0] == "benchmarks.kernels"
    out = os.path.join(work, "rows.json") if kernels else work
    cmd = [sys.executable, "-m", *argv, "--json" if kernels else "--out", out]
    try:
        rc = subprocess.run(cmd, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        print(f"[kernel_targets_run] {' '.join(argv[:1])} ran past {timeout:.0f} s: its rows are lost", flush=True)
        return []
    path = out if kernels else os.path.join(out, "train_throughput.jsonl")
    if rc != 0 or not os.path.exists(path):
        print(f"[kernel_targets_run] {' '.join(cmd)} exited {rc}", flush=True)
        return []
    return load_rows([path])


def run(out: str, work: str, rounds: int, steps: list[str], budget: float = 0.0,
        runner: Callable[[list[str], str, Optional[float]], list[dict]] = step_rows,
        clock: Callable[[], float] = time.monotonic) -> list[dict]:
    """The rounds (see the module docstring); returns every row written. ``runner(argv, work_dir, timeout)``
    runs one process and returns its rows (a test swaps it)."""
    unknown = [s for s in steps if s not in STEPS]
    if unknown or not steps:
        raise ValueError(f"--steps: unknown {unknown}; expected some of {list(STEPS)}")
    if rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {rounds}")
    os.makedirs(out, exist_ok=True)
    start, longest, rows = clock(), {}, []
    open(os.path.join(out, "rows.jsonl"), "w").close()
    for rnd in range(1, rounds + 1):
        for name in steps:
            argvs, estimate = STEPS[name]
            left = budget - (clock() - start) if budget else None
            need = longest.get(name, estimate)
            if left is not None and need > left:
                print(f"[kernel_targets_run] round {rnd} {name}: needs ~{need:.0f} s, {left:.0f} s left: skipped",
                      flush=True)
                continue
            t0, got = clock(), []
            for i, argv in enumerate(argvs):
                remaining = budget - (clock() - start) if budget else None
                got += runner(argv, os.path.join(work, f"r{rnd}_{name}_{i}"), remaining)
            longest[name] = max(longest.get(name, 0.0), clock() - t0)
            got = [dict(r, run=name, round=rnd, table="families" if "fwd_ms" in r else "train") for r in got]
            rows += got
            with open(os.path.join(out, "rows.jsonl"), "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in got)
            report(rows, out)
            print(f"[kernel_targets_run] round {rnd} {name}: {len(got)} rows in {clock() - t0:.0f} s", flush=True)
    return rows


def report(rows, out: str) -> str:
    """``OUT/targets.md``: :func:`benchmarks.kernel_targets.table` over ``rows`` (empty if no target is in them)."""
    checked = kernel_targets.check([r for r in rows if "fwd_ms" in r or "backend" in r])
    text = kernel_targets.table(checked) if checked else "(no target measured yet)"
    with open(os.path.join(out, "targets.md"), "w") as f:
        f.write(text + "\n")
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for rows.jsonl and targets.md")
    ap.add_argument("--work", default="", help="folder for the steps' raw outputs (default: a temporary one)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, of {list(STEPS)}")
    ap.add_argument("--budget", type=float, default=0.0, help="seconds for all rounds (0: no limit)")
    a = ap.parse_args(argv)
    try:
        rows = run(a.out, a.work or tempfile.mkdtemp(prefix="kernel_targets_run."), a.rounds,
                   [s for s in a.steps.split(",") if s], a.budget)
    except ValueError as e:
        ap.error(str(e))
    print(report(rows, a.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
