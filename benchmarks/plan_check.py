"""``mtraining-train --plan`` against the peak of a real ``mtraining-train`` run (issue 35).

For each case (a set of config overrides) two separate processes run, exactly as a user would:

1. ``python -m mtraining_jax.apps.train --config CONFIG OVERRIDES --plan``: the predicted per-device
   peak is read from its ``peak (compiled step ...)`` line;
2. ``python -m mtraining_jax.apps.train --config CONFIG OVERRIDES steps=N ...``: the trainer's own
   ``peak_gib`` in ``metrics.jsonl`` (the allocator's ``peak_bytes_in_use`` since the process
   started: initialisation, data, every step) — largest over the logged steps.

Rows (``OUT/plan_check.jsonl``): ``case``, ``overrides``, ``plan_gib``, ``run_peak_gib``,
``plan_error`` (``plan / run - 1``), ``tokens_per_s`` (median of the steps after the first),
``commit``, ``date``, ``device``, ``jax``, ``command``. On a CPU the trainer reports no peak
(``run_peak_gib`` None): a GPU measurement.

    python -m benchmarks.plan_check --out $OUT --case 0.5b-128k-save_attn:optim.grad_accum=1 \\
        --case 0.5b-128k-selective+offload:optim.grad_accum=1,model.remat=selective,optim.offload=opt_state
    python -m benchmarks.plan_check --report results/memory/plan_check.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from typing import Optional, Sequence

from benchmarks._driver import provenance
from benchmarks.train_throughput import DEFAULT_CONFIG, REPO

PLAN_LINE = re.compile(r"peak \(compiled step[^)]*\)\s+([0-9.]+) (GiB|MiB)")


def parse_plan_peak(text: str) -> Optional[float]:
    """The predicted peak in GiB from ``--plan``'s output, or ``None`` when the line is missing."""
    m = PLAN_LINE.search(text)
    if m is None:
        return None
    return float(m.group(1)) / (1024 if m.group(2) == "MiB" else 1)


def parse_case(text: str) -> tuple[str, list[str]]:
    """``"NAME:key=v,key2=v2"`` -> ``("NAME", ["key=v", "key2=v2"])``; ``ValueError`` naming a bad one."""
    name, sep, rest = text.partition(":")
    sets = [s for s in rest.split(",") if s] if sep else []
    if not name or any("=" not in s for s in sets):
        raise ValueError(f"--case must be NAME or NAME:key=value,key=value, got {text!r}")
    return name, sets


def _train(config: str, sets: Sequence[str], extra: Sequence[str], timeout: float) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "mtraining_jax.apps.train", "--config", config, *sets, *extra]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_PYTHON_CLIENT_PREALLOCATE", None)  # the parent's own setting (below), not the user's default
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    except subprocess.TimeoutExpired:
        return 124, f"timeout after {timeout:.0f} s"
    return p.returncode, p.stdout + p.stderr


def one_case(config: str, name: str, sets: Sequence[str], steps: int, timeout: float) -> dict:
    row = {"case": name, "config": os.path.relpath(config, REPO), "overrides": list(sets), "steps": steps}
    rc, out = _train(config, sets, ["--plan"], timeout)
    row["plan_gib"] = parse_plan_peak(out)
    if row["plan_gib"] is None:
        row["error"] = f"--plan exited {rc} without a peak line: " + " | ".join(out.strip().splitlines()[-5:])
        return row
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = os.path.join(tmp, "run")
        rc, out = _train(config, sets, [f"steps={steps}", f"run_dir={run_dir}", "logging.every=1", "eval.every=0",
                                        "checkpoint.every=0"], timeout)
        path = os.path.join(run_dir, "metrics.jsonl")
        recs = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    train = [r for r in recs if r.get("split") == "train"]
    if rc != 0 or not train:
        row["error"] = f"training exited {rc}: " + " | ".join(out.strip().splitlines()[-5:])
        return row
    peaks = [r["peak_gib"] for r in train if isinstance(r.get("peak_gib"), float)]
    row["run_peak_gib"] = max(peaks) if peaks else None
    row["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in train[1:] or train)
    row["losses"] = [r["loss"] for r in train]
    if row["run_peak_gib"]:
        row["plan_error"] = row["plan_gib"] / row["run_peak_gib"] - 1
    return row


def format_table(rows: Sequence[dict]) -> str:
    lines = ["| case | overrides | plan GiB | run peak GiB | plan error | tokens/s |", "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        f = lambda k, spec: "" if r.get(k) is None else format(r[k], spec)  # noqa: E731
        lines.append(f"| {r['case']} | {' '.join(r['overrides'])} | {f('plan_gib', '.2f')} | {f('run_peak_gib', '.2f')} "
                     f"| {f('plan_error', '+.1%')} | {f('tokens_per_s', ',.0f')} |"
                     + (f" {r['error'][:200]}" if r.get("error") else ""))
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=DEFAULT_CONFIG)
    p.add_argument("--case", action="append", default=[], help="NAME[:key=value,key=value] (repeatable)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300, help="seconds per process")
    p.add_argument("--out", help="folder for plan_check.jsonl / plan_check.md")
    p.add_argument("--report", help="print the table of a plan_check.jsonl")
    args = p.parse_args(argv)
    if args.report:
        print(format_table([json.loads(line) for line in open(args.report) if line.strip()]))
        return 0
    try:
        cases = [parse_case(c) for c in args.case]
    except ValueError as e:
        p.error(str(e))
    if not cases:
        p.error("give at least one --case")
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # this process only names the device: take no memory
    import jax  # for the provenance's device / jax fields

    jax.devices()
    rows = []
    for name, sets in cases:
        print(f"case {name}: {' '.join(sets)}", flush=True)
        row = {**one_case(args.config, name, sets, args.steps, args.timeout), **provenance(argv)}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "plan_check.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
