"""``--warm-start W``: every arm of a seed continues ONE dense run from its step ``W``.

Why: a user extends a model that already retrieves (the MTraining paper continues Qwen2.5-3B, §5.1);
the study's arms otherwise learn retrieval from the copy-pretrained weights under their own attention,
a harder question. With a warm start the seed's dense arm trains steps 1 .. ``W`` of the study's schedule
once (``<work>/seed<s>/warm``; the trainer's slice, ``run_steps=W``, ends in a checkpoint), and each arm
restores that checkpoint (parameters, optimizer state, step, data position: the same schedule and stream)
and trains steps ``W + 1`` .. ``steps`` with its own attention. The arms' rows then differ only in the
attention of the last ``steps - W`` steps; ``tokens`` counts the whole schedule, ``warm_start`` (in every
row) the shared part: ``{"steps": W, "checkpoints", "heldout_curve", "train_loss", "train_time", "seconds",
"reused"}``; the arms' own curves continue the warm start's (:func:`benchmarks.quality_curves.join_warm`: training
time counts the dense prefix as measured, once per arm, so the arms are compared at equal time fairly).

A finished warm start of the same settings (``warm.json``: steps, W, seed, the copy pretraining's
checkpoint, the trainer overrides) is reused, e.g. by the arms of ``--gpu-per-arm``, whose ``--pretrain-only``
child trains it; one of other settings is deleted and trained anew.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import time
from pathlib import Path

from benchmarks.quality_curves import time_curve
from benchmarks.quality_pretrain import checkpoint_steps

RUN_NAME = "warm"


def check_warm_start(warm: int | None, steps: int | None) -> int:
    """``warm`` (``--warm-start``) checked against the arms' ``steps``: 0 for none; ``SystemExit`` naming the bad value."""
    if not warm:
        return 0
    if warm < 0:
        raise SystemExit(f"quality_study: --warm-start must be >= 0, got {warm}")
    if steps is not None and warm >= steps:
        raise SystemExit(f"quality_study: --warm-start {warm} must be below the arms' steps ({steps}): the arms "
                         "continue the dense run after it")
    return int(warm)


def _key(args, seed: int, pretrained: dict | None) -> dict:
    return {"warm": int(args.warm_start), "steps": int(args.steps), "seed": int(seed),
            "pretrain": (pretrained or {}).get("checkpoints"), "train_overrides": list(args.train_overrides),
            "smoke": bool(args.smoke)}


def warm_start(args, corpus: dict, seed: int, pretrained: dict | None, run_variant, evaluate=None) -> dict:
    """Train (or reuse) the seed's dense run to step ``args.warm_start``; returns its ``warm_start`` record,
    with ``--warm-start-eval`` also the evaluator's view of it (``evaluate``: ``quality_study.evaluate_checkpoint``;
    ``eval``, ``heldout_loss``, ``niah_accuracy``, ...: where the arms start)."""
    from mtraining_jax.train.metrics import read_metrics

    work = os.path.dirname(os.path.abspath(corpus["paths"][0]))
    run_dir = os.path.join(work, RUN_NAME)
    ck, key, W = os.path.join(run_dir, "checkpoints"), _key(args, seed, pretrained), int(args.warm_start)
    done = os.path.join(run_dir, "warm.json")
    stored = json.loads(Path(done).read_text()) if os.path.exists(done) else {}
    reuse = stored.get("key") == key and W in checkpoint_steps(ck)
    if reuse:
        record = dict(stored["record"], reused=True)
        print(f"[warm start seed {seed}] reused: dense to step {W} in {ck}", flush=True)
    else:
        if os.path.exists(run_dir):
            shutil.rmtree(run_dir)
        wargs = copy.copy(args)
        wargs.run_steps, wargs.resume = W, False
        print(f"[warm start seed {seed}] dense steps 1 .. {W} of {args.steps}; every arm continues from there",
              flush=True)
        t0 = time.time()
        if run_variant("dense", wargs, corpus, seed, pretrained, run_name=RUN_NAME) is not None or W not in checkpoint_steps(ck):
            raise RuntimeError(f"the warm start of seed {seed} did not stop at step {W} with a checkpoint in {ck}")
        rows = [m for m in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "loss" in m]
        train = [m for m in rows if m.get("split", "train") == "train"]
        record = {"steps": W, "checkpoints": ck, "seconds": time.time() - t0,
                  "heldout_curve": [[int(m["step"]), float(m["loss"])] for m in rows if m.get("split") == "eval"],
                  "train_loss": [[int(m["step"]), float(m["loss"])] for m in train],
                  "train_time": time_curve(train), "reused": False}
    evaluated = getattr(args, "warm_start_eval", False) and evaluate is not None and "eval" not in record
    if evaluated:
        t1 = time.time()
        record.update(evaluate(args, run_dir, W, corpus["paths"][1], f"warm start seed {seed}, dense step {W}"))
        record["eval_seconds"] = time.time() - t1
        print(f"[warm start seed {seed}] at step {W}: held-out loss {record.get('heldout_loss')}, NIAH "
              f"{record.get('niah_accuracy')}", flush=True)
    if evaluated or not reuse:  # written whole (os.replace): the arms of --gpu-per-arm read it at once
        tmp = f"{done}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"key": key, "record": dict(record, reused=False)}, f)
        os.replace(tmp, done)
    return record


def continue_from(warm: dict, run_dir: str) -> None:
    """Put the warm start's checkpoint (step ``warm['steps']``) in ``run_dir/checkpoints`` as the run's
    only one, so the arm's ``--resume`` continues it."""
    if os.path.exists(run_dir):
        shutil.rmtree(run_dir)
    os.makedirs(run_dir)
    src, dst = warm["checkpoints"], os.path.join(run_dir, "checkpoints")
    os.makedirs(dst)
    for name in os.listdir(src):
        if name == str(warm["steps"]) or (not name.isdigit() and os.path.isfile(os.path.join(src, name))):
            (shutil.copytree if os.path.isdir(os.path.join(src, name)) else shutil.copy2)(
                os.path.join(src, name), os.path.join(dst, name))
