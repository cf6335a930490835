"""Copy pretraining before the quality study's arms (``pretrain`` in ``configs/quality/study.yaml``).

Why: the 76M study model trained from scratch on 32K windows at lr 1e-3 never learns retrieval (NIAH 0
in every run), while on short windows of random bytes with spans copied to random later places
(:func:`benchmarks.quality_corpus.induction_windows`) it learns to copy by content at lr 3e-4 (4 of 4
seeds; ``results/quality/quality.md``). Copying by content is the first half of any lookup. So the
study can start every arm of a seed from the same copy-pretrained weights (the curriculum of the
issue: short copy windows first, then the 32K retrieval mix).

Per seed: the dense arm's model (``configs/quality/dense.yaml`` + the study's ``train`` overrides)
trained ``steps`` steps on ``batch`` induction windows of ``seq_len`` bytes at ``lr`` (cosine
schedule, ``warmup_steps``), in ``<work>/seed<s>/pretrain``. A finished pretraining of the same
settings (``pretrain.json`` there: the spec, seed and model overrides) is reused; a stopped one
(SIGTERM, time limit) resumes from its newest checkpoint; one of other settings is deleted and
trained anew. The arms then load its weights
(``model.init_from=ckpt:``, fresh optimizer); rows carry ``pretrain`` (settings, held-out curve,
checkpoint, seconds).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

PRETRAIN_DEFAULTS = {"steps": 0, "seq_len": 256, "batch": 256, "lr": 3.0e-4, "warmup_steps": 50,
                     "windows": 300000, "alphabet": 256}
CKPT_EVERY = 500  # a stopped pretraining loses at most this many steps


def check_pretrain(spec: dict, where: str) -> dict:
    """``spec`` over :data:`PRETRAIN_DEFAULTS`, validated: a ``ValueError`` naming ``where`` and the bad value."""
    out = dict(PRETRAIN_DEFAULTS)
    if spec is None:
        return out
    if not isinstance(spec, dict) or set(spec) - set(out):
        raise ValueError(f"{where}: pretrain must be a mapping of {sorted(out)}, got {spec!r}")
    out.update(spec)
    for k in ("steps", "seq_len", "batch", "warmup_steps", "windows"):
        v = out[k]
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if k in ("steps", "warmup_steps") else 1):
            raise ValueError(f"{where}: pretrain.{k} must be a {'non-negative' if k in ('steps', 'warmup_steps') else 'positive'} "
                             f"integer, got {v!r}")
    if out["seq_len"] < 128:
        raise ValueError(f"{where}: pretrain.seq_len must be >= 128 (copied spans are up to 32 tokens), "
                         f"got {out['seq_len']}")
    lr = out["lr"]
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
        raise ValueError(f"{where}: pretrain.lr must be a positive number, got {lr!r}")
    out["lr"] = float(lr)
    if out["alphabet"] not in (26, 256):
        raise ValueError(f"{where}: pretrain.alphabet must be 26 or 256, got {out['alphabet']!r}")
    return out


def _checkpoints(ck: str) -> list:
    return sorted(int(n) for n in os.listdir(ck) if n.isdigit()) if os.path.isdir(ck) else []


def pretrain_overrides(spec: dict, run_dir: str, paths, seed: int) -> list:
    """Trainer overrides of one seed's copy pretraining (after the arm's model overrides)."""
    S, steps = spec["seq_len"], spec["steps"]
    return [f"run_dir={run_dir}", f"data.path={paths[0]}", f"data.eval_path={paths[1]}", f"data.seq_len={S}",
            f"data.batch_size={spec['batch']}", f"steps={steps}", f"optim.lr={spec['lr']}",
            f"optim.warmup_steps={min(spec['warmup_steps'], max(steps - 1, 0))}", "optim.grad_accum=1",
            f"loss_chunk_size={S}", f"checkpoint.every={min(CKPT_EVERY, steps)}", "checkpoint.keep=2",
            "checkpoint.async_save=false", f"eval.every={max(steps // 8, 1)}", "eval.batches=2",
            f"seed={int(seed)}", f"data.seed={int(seed)}", "model.init_from=null", "logging.progress=false"]


def pretrain(spec: dict, seed_dir: str, seed: int, arm_overrides=(), config: str | None = None) -> dict | None:
    """Copy-pretrain one seed (module docstring); ``None`` when ``spec['steps']`` is 0.
    ``arm_overrides``: the dense arm's model overrides (the study's ``train`` list, ``--smoke`` sizes).
    Returns ``{"checkpoints", "steps", "seconds", "heldout_curve", "heldout_loss", "reused", **spec}``, or
    ``{"stopped": True, "step", "checkpoints"}`` when a stop signal ended it early (it resumes next time)."""
    if not spec["steps"]:
        return None
    from benchmarks.quality_corpus import build_induction_corpus
    from mtraining_jax.train.config import load_config
    from mtraining_jax.train.loop import run
    from mtraining_jax.train.metrics import read_metrics

    work = os.path.join(seed_dir, "pretrain")
    run_dir = os.path.join(work, "run")
    ck = os.path.join(run_dir, "checkpoints")
    t0 = time.time()
    key = {"spec": spec, "seed": int(seed), "model_overrides": [o for o in arm_overrides
                                                                 if not o.startswith("model.init_from=")]}
    key_path = os.path.join(work, "pretrain.json")
    old = json.loads(Path(key_path).read_text()) if os.path.exists(key_path) else None
    if old is not None and old != json.loads(json.dumps(key)):  # other settings: start again, never reuse
        print(f"[pretrain seed {seed}] {work} holds a pretraining with other settings ({old}); training anew",
              flush=True)
        shutil.rmtree(work)
    have = _checkpoints(ck)
    reused = bool(have) and have[-1] >= spec["steps"]
    if not reused:
        paths = (os.path.join(work, "train_tokens.npy"), os.path.join(work, "heldout_tokens.npy"))
        if not (have and all(os.path.exists(p) for p in paths)):  # same seed, same windows: built once
            info = build_induction_corpus(work, spec["seq_len"], spec["windows"], seed, spec["alphabet"],
                                          held_windows=max(64, 2 * spec["batch"] + 2))
            paths = info["paths"]
        with open(key_path, "w") as f:
            json.dump(key, f)
        over = key["model_overrides"] + pretrain_overrides(spec, run_dir, paths, seed)
        if have:
            over.append("checkpoint.resume=true")
        cfg = load_config(config or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                 "configs", "quality", "dense.yaml"), over)
        print(f"[pretrain seed {seed}] {spec['steps']} steps of {spec['batch']} x {spec['seq_len']} copy windows at "
              f"lr {spec['lr']:g}" + (f", resumed from step {have[-1]}" if have else ""), flush=True)
        result = run(cfg, overwrite=not have)
        if result.final_step < spec["steps"]:  # stopped (SIGTERM, time limit): the next call resumes it
            print(f"[pretrain seed {seed}] stopped at step {result.final_step} of {spec['steps']}; the next "
                  f"call resumes it from {ck}", flush=True)
            return {"stopped": True, "step": int(result.final_step), "checkpoints": ck}
    rows = read_metrics(os.path.join(run_dir, "metrics.jsonl")) if os.path.exists(
        os.path.join(run_dir, "metrics.jsonl")) else []
    curve = [[int(m["step"]), float(m["loss"])] for m in rows if m.get("split") == "eval" and "loss" in m]
    out = dict(spec, seed=int(seed), checkpoints=ck, seconds=time.time() - t0, heldout_curve=curve,
               heldout_loss=curve[-1][1] if curve else None, reused=reused)
    print(f"[pretrain seed {seed}] {'reused' if reused else 'trained'}: held-out loss "
          f"{out['heldout_loss'] if out['heldout_loss'] is not None else float('nan'):.4f} "
          f"({out['seconds']:.0f}s) -> {ck}", flush=True)
    return json.loads(json.dumps(out))
