"""What ``deterministic: true`` costs in step time: the quality study's arms (``configs/quality/dense.yaml``,
``mtraining.yaml``: the 76M model at 32K on one GPU) trained a few steps with and without XLA's deterministic
GPU ops (:mod:`mtraining_jax.train.determinism`), one run after another on the same GPU. Why: the flag makes two
pretrainings of a seed bit-identical (``benchmarks/pretrain_determinism.py``), but the study compares its arms at
equal training time, so a flag that slows one arm more than the other would move that comparison.

    MTRAINING_COMMIT=<sha> python benchmarks/determinism_cost.py --out $OUT/dc --steps 40 --repeats 3
    python benchmarks/determinism_cost.py --out DIR --from-metrics M --device "NVIDIA H200" --jax 0.11.2
                            # rows from runs already made (M/<arm>-<false|true>.jsonl; with --repeats N,
                            # M/<arm>-<false|true>-r<k>.jsonl) on that device

``--repeats N``: the four runs N times, the flag's order reversed in every other repeat (drift of the GPU's
clocks or of the host does not favour one setting); every row carries its ``repeat``, each repeat's
deterministic row its slowdown within that repeat, and the slowdown's median and range over the repeats are
printed.

Data: the trainer's ``stdlib`` source (no files to build). One row per (arm, deterministic) in
``--out/determinism_cost.jsonl``: ``arm``, ``deterministic``, ``steps_timed`` (steps after ``--skip``, the
compile and warm-up excluded), ``step_s_median`` / ``_min`` / ``_max``, ``final_loss``, ``slowdown`` (median over
the same arm's non-deterministic median; on the ``true`` row), and ``commit``, ``date``, ``device``, ``jax``,
``command``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script: the repo root
ARMS = ("mtraining", "dense")
FLAGS = (False, True)


def summarise(records: list, skip: int) -> dict:
    """A run's ``metrics.jsonl`` records: the training step times after step ``skip`` (median, min, max) and
    the last training loss."""
    train = [r for r in records if r.get("split", "train") == "train"]
    times = [float(r["step_time"]) for r in train if r.get("step", 0) > skip and r.get("step_time")]
    if not times:
        raise ValueError(f"no training step after step {skip} logged a step_time")
    loss = [float(r["loss"]) for r in train if isinstance(r.get("loss"), (int, float))]
    return {"steps_timed": len(times), "step_s_median": statistics.median(times), "step_s_min": min(times),
            "step_s_max": max(times), "final_loss": loss[-1] if loss else None}


def rows(metrics: dict, skip: int) -> list:
    """``{(arm, deterministic): records}`` -> one row per run; the deterministic row carries its arm's
    ``slowdown`` when that arm's other run is there."""
    out = []
    for (arm, det), records in sorted(metrics.items(), key=lambda kv: (ARMS.index(kv[0][0]), kv[0][1])):
        row = {"arm": arm, "deterministic": det, **summarise(records, skip)}
        base = metrics.get((arm, False))
        if det and base is not None:
            row["slowdown"] = row["step_s_median"] / summarise(base, skip)["step_s_median"]
        out.append(row)
    return out


def read_metrics(path: str) -> list:
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def trainer_args(arm: str, det: bool, steps: int, run_dir: str, smoke: bool) -> tuple[str, list]:
    """The config and overrides of one run: the arm's quality config on the ``stdlib`` source, or (``smoke``)
    the CPU toy config with the arm's backend (``ring``: dense)."""
    config = os.path.join(ROOT, "configs", "tiny_cpu.yaml" if smoke else f"quality/{arm}.yaml")
    sets = [f"steps={steps}", f"run_dir={run_dir}", f"deterministic={str(det).lower()}", "eval.every=0",
            "logging.progress=false", "checkpoint.every=0"]
    sets += [f"model.attention_backend={'mtraining' if arm == 'mtraining' else 'ring'}"] if smoke else [
        "data.source=stdlib", "data.path=null", "data.eval_path=null"]
    return config, sets


def train(arm: str, det: bool, steps: int, run_dir: str, log: str, timeout: float, smoke: bool) -> int | str:
    """One trainer run (:func:`trainer_args`) in its own process; its exit code or ``"timeout"``."""
    config, sets = trainer_args(arm, det, steps, run_dir, smoke)
    cmd = [sys.executable, "-m", "mtraining_jax.train.cli", "--config", config, "--overwrite"] + sets
    try:
        return subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=ROOT), stdout=open(log, "w"),
                              stderr=subprocess.STDOUT, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        return "timeout"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=40, help="training steps of each run (default 40)")
    p.add_argument("--skip", type=int, default=10, help="steps not timed: compile and warm-up (default 10)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds each run may take")
    p.add_argument("--from-metrics", metavar="DIR", help="no training: rows from DIR/<arm>-<false|true>.jsonl")
    p.add_argument("--device", help="with --from-metrics: the GPU the runs were made on (required)")
    p.add_argument("--jax", help="with --from-metrics: the JAX version they ran (required)")
    p.add_argument("--smoke", action="store_true", help="configs/tiny_cpu.yaml (the test's size)")
    p.add_argument("--repeats", type=int, default=1, help="the four runs this many times, the flag's order "
                   "alternating (default 1)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        raise SystemExit(f"determinism_cost: --repeats must be >= 1, got {args.repeats}")
    if args.skip < 0 or args.steps <= args.skip:
        raise SystemExit(f"determinism_cost: --skip must be >= 0 (got {args.skip}) and --steps above it "
                         f"(got {args.steps})")
    given = bool(args.device and args.jax) if args.from_metrics else not (args.device or args.jax)
    if not given:
        raise SystemExit("determinism_cost: --from-metrics needs --device and --jax (where the runs were made), "
                         f"and they need it (got --from-metrics {args.from_metrics!r}, --device {args.device!r}, "
                         f"--jax {args.jax!r})")
    from benchmarks.quality_study import provenance_row

    os.makedirs(args.out, exist_ok=True)
    per_repeat = []
    for rep in range(args.repeats):
        metrics = {}
        for arm in ARMS:
            for det in FLAGS if rep % 2 == 0 else FLAGS[::-1]:
                name = f"{arm}-{str(det).lower()}" + (f"-r{rep}" if args.repeats > 1 else "")
                if args.from_metrics:
                    path = os.path.join(args.from_metrics, f"{name}.jsonl")
                else:
                    run_dir = os.path.join(args.out, name)
                    rc = train(arm, det, args.steps, run_dir, os.path.join(args.out, f"{name}.log"), args.timeout,
                               args.smoke)
                    print(f"{name}: exit {rc}", flush=True)
                    path = os.path.join(run_dir, "metrics.jsonl")
                records = read_metrics(path)
                if records:
                    metrics[(arm, det)] = records
                else:
                    print(f"{name}: no metrics at {path}", flush=True)
        per_repeat.append(metrics)
    # only now this process starts JAX (the rows' jax / device): on a GPU it would hold memory the runs need
    import jax  # noqa: F401

    slowdowns = {arm: [] for arm in ARMS}
    with open(os.path.join(args.out, "determinism_cost.jsonl"), "a") as f:
        for rep, metrics in enumerate(per_repeat):
            for row in rows(metrics, args.skip):
                row["repeat"] = rep
                row.update(provenance_row(argv))
                if args.from_metrics:  # this process only read the runs' metrics
                    row.update(device=args.device, jax=args.jax)
                f.write(json.dumps(row) + "\n")
                if "slowdown" in row:
                    slowdowns[row["arm"]].append(row["slowdown"])
                print(f"repeat {rep}: {row['arm']} deterministic={row['deterministic']}: median step "
                      f"{row['step_s_median']:.4f} s over {row['steps_timed']} steps"
                      + (f", {row['slowdown']:.2f}x" if "slowdown" in row else ""), flush=True)
    for arm, xs in slowdowns.items():
        if len(xs) > 1:
            print(f"{arm}: deterministic=true slowdown over {len(xs)} repeats: median {statistics.median(xs):.2f}x, "
                  f"range {min(xs):.2f}-{max(xs):.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
