"""Is a seed's training bit-reproducible on this GPU? Four copy pretrainings of one seed at once on one GPU
(the quality study's first stage, ``quality_study.py --pretrain-only``): two with ``--set deterministic=true``
(XLA's deterministic GPU ops, :mod:`mtraining_jax.train.determinism`), two without; their per-step training
losses are compared bit for bit. Why: two calls of the study on the same seed pretrained to different models
(``results/quality/quality.md``, runs s24 / s27 / s28), which changes what the arms start from.

    MTRAINING_COMMIT=<sha> python benchmarks/pretrain_determinism.py --out $OUT/det --steps 100

One row per pair in ``--out/determinism.jsonl``: ``pair``, ``deterministic`` (of each run), ``steps``
compared, ``identical``, ``first_diff_step``, ``max_abs_diff``, the losses at steps 1 / 2 / last, and
``commit``, ``date``, ``device``, ``jax``, ``command``. The pretraining batch is ``--batch`` (64: four runs
fit one H200 at ``--mem-fraction`` 0.2 each; the study's 256 needs ~33 GiB per run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script: the repo root
RUNS = (("det1", True), ("det2", True), ("nd1", False), ("nd2", False))
PAIRS = (("det1", "det2"), ("nd1", "nd2"), ("det1", "nd1"))


def compare(a: list, b: list) -> dict:
    """Two runs' ``[[step, loss], ...]``: over the steps both logged, whether every loss is the same float,
    the first step where they differ, and the largest absolute difference."""
    x, y = dict(map(tuple, a)), dict(map(tuple, b))
    steps = sorted(set(x) & set(y))
    if not steps:
        raise ValueError("the two runs logged no common step")
    diff = [s for s in steps if x[s] != y[s]]
    return {"steps": len(steps), "identical": not diff, "first_diff_step": diff[0] if diff else None,
            "max_abs_diff": max(abs(x[s] - y[s]) for s in steps),
            "losses": {str(s): [x[s], y[s]] for s in sorted({steps[0], steps[min(1, len(steps) - 1)], steps[-1]})}}


def losses(run_dir: str) -> list:
    """The training losses ``[[step, loss]]`` of a ``--pretrain-only`` run's first stage."""
    path = os.path.join(run_dir, "seed0", "pretrain", "run", "metrics.jsonl")
    rows = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    return [[int(m["step"]), float(m["loss"])] for m in rows if "loss" in m and m.get("split", "train") == "train"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=100, help="pretraining steps of each run (default 100)")
    p.add_argument("--batch", type=int, default=64, help="pretraining batch (default 64)")
    p.add_argument("--mem-fraction", type=float, default=0.2, help="each run's XLA_PYTHON_CLIENT_MEM_FRACTION")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds each run may take")
    p.add_argument("--smoke", action="store_true", help="the study's CPU toy model (the test's size)")
    args = p.parse_args(argv)
    if args.steps < 2 or args.batch < 1 or not 0.0 < args.mem_fraction * len(RUNS) <= 1.0:
        raise SystemExit(f"pretrain_determinism: --steps must be >= 2 (got {args.steps}), --batch >= 1 (got "
                         f"{args.batch}) and --mem-fraction in (0, {1 / len(RUNS):g}] (got {args.mem_fraction})")
    from benchmarks.quality_protocol import load_study
    from benchmarks.quality_study import STUDY, provenance_row

    os.makedirs(args.out, exist_ok=True)
    study = load_study(STUDY)
    study["pretrain"].update(batch=args.batch, stages=[])
    study_path = os.path.join(args.out, "study.json")  # JSON is YAML: the study's protocol, smaller batch
    with open(study_path, "w") as f:
        json.dump(study, f)
    env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION=str(args.mem_fraction), PYTHONPATH=ROOT)
    procs = {}
    for name, det in RUNS:
        cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "quality_study.py"), "--out", os.path.join(args.out, name),
               "--work", os.path.join(args.out, f"work_{name}"), "--pretrain-only", "--seeds", "0", "--variant", "dense",
               "--pretrain-steps", str(args.steps), "--study", study_path] + (["--set", "deterministic=true"] if det else []) + (["--smoke"] if args.smoke else [])
        procs[name] = subprocess.Popen(cmd, env=env, stdout=open(os.path.join(args.out, f"{name}.log"), "w"),
                                       stderr=subprocess.STDOUT)
        print(f"started {name} (deterministic={det})", flush=True)
    for name, proc in procs.items():
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "timeout"
        print(f"{name}: exit {rc}", flush=True)
    import jax  # noqa: F401  (the rows' jax / device)

    curves = {name: losses(os.path.join(args.out, f"work_{name}")) for name, _ in RUNS}
    det = dict(RUNS)
    with open(os.path.join(args.out, "determinism.jsonl"), "a") as f:
        for a, b in PAIRS:
            if not curves[a] or not curves[b]:
                print(f"{a} vs {b}: a run logged no loss (see {args.out}/{a}.log, {b}.log)", flush=True)
                continue
            row = {"pair": f"{a}-{b}", "deterministic": [det[a], det[b]], **compare(curves[a], curves[b]),
                   "pretrain_batch": args.batch, "pretrain_steps": args.steps, "runs_at_once": len(RUNS),
                   **provenance_row(argv)}
            f.write(json.dumps(row) + "\n")
            print(f"{a} vs {b}: {'identical' if row['identical'] else 'differ from step %d' % row['first_diff_step']} "
                  f"over {row['steps']} steps (max |diff| {row['max_abs_diff']:.3g})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
