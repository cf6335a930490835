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

**Stages** (``pretrain.stages``, ``--pretrain-stages 4096x16:500,...``): a copy curriculum. Each later
stage trains on copy windows of its own length (``seq_len`` x ``batch``, ``steps``; copies up to a window
apart), starting from the previous stage's weights (fresh optimizer, the first stage's ``lr``,
``warmup_steps`` and ``alphabet`` unless it sets its own), in ``pretrain/stage<i>``; the arms load the
last stage; a stage is reused when it and every stage before it have the same settings. Rows:
``pretrain.stage_results`` (each later stage's held-out curve and seconds). Why: the
256-byte copy model does not find its copies at 32K (NIAH 0 after copy pretraining, quality.md s16).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

PRETRAIN_DEFAULTS = {"steps": 0, "seq_len": 256, "batch": 256, "lr": 3.0e-4, "warmup_steps": 50,
                     "windows": 300000, "alphabet": 256, "stages": []}
STAGE_KEYS = ("steps", "seq_len", "batch", "lr", "warmup_steps", "windows")  # a later stage's own settings
CKPT_EVERY = 500  # a stopped pretraining loses at most this many steps


def _check_fields(out: dict, where: str, prefix: str) -> None:
    for k in ("steps", "seq_len", "batch", "warmup_steps", "windows"):
        v = out[k]
        low = 0 if k in ("steps", "warmup_steps") else 1
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{where}: {prefix}{k} must be a {'non-negative' if low == 0 else 'positive'} "
                             f"integer, got {v!r}")
    if out["seq_len"] < 128:
        raise ValueError(f"{where}: {prefix}seq_len must be >= 128 (copied spans are up to 32 tokens), "
                         f"got {out['seq_len']}")
    lr = out["lr"]
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
        raise ValueError(f"{where}: {prefix}lr must be a positive number, got {lr!r}")
    out["lr"] = float(lr)


def check_pretrain(spec: dict, where: str) -> dict:
    """``spec`` over :data:`PRETRAIN_DEFAULTS`, validated: a ``ValueError`` naming ``where`` and the bad value.
    Each of ``stages`` is completed from the first stage (``lr``, ``warmup_steps``; ``windows`` defaults to
    ``steps * batch + 1``: each window seen once, and one more for the token past a window the last
    label needs, so that a one-step stage still has a whole batch)."""
    out = dict(PRETRAIN_DEFAULTS)
    if spec is None:
        return out
    if not isinstance(spec, dict) or set(spec) - set(out):
        raise ValueError(f"{where}: pretrain must be a mapping of {sorted(out)}, got {spec!r}")
    out.update(spec)
    _check_fields(out, where, "pretrain.")
    if out["alphabet"] not in (26, 256):
        raise ValueError(f"{where}: pretrain.alphabet must be 26 or 256, got {out['alphabet']!r}")
    stages = out["stages"]
    if not isinstance(stages, (list, tuple)):
        raise ValueError(f"{where}: pretrain.stages must be a list of mappings, got {stages!r}")
    done = []
    for i, st in enumerate(stages, 2):
        if not isinstance(st, dict) or set(st) - set(STAGE_KEYS) or not {"steps", "seq_len", "batch"} <= set(st):
            raise ValueError(f"{where}: pretrain.stages[{i - 2}] must be a mapping with steps, seq_len, batch "
                             f"(optional lr, warmup_steps, windows), got {st!r}")
        steps = st["steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"{where}: pretrain.stages[{i - 2}].steps must be an integer >= 1, got {steps!r}")
        full = {"lr": out["lr"], "warmup_steps": out["warmup_steps"], **st}
        full.setdefault("windows", steps * full["batch"] + 1 if isinstance(full["batch"], int) else None)
        _check_fields(full, where, f"pretrain.stages[{i - 2}].")
        done.append(full)
    out["stages"] = done
    return out


def parse_stages(text: str) -> list:
    """``"4096x16:500,32768x2:100"`` -> ``[{"seq_len": 4096, "batch": 16, "steps": 500}, ...]``; ``""`` -> ``[]``."""
    out = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        try:
            shape, steps = item.split(":")
            S, B = shape.lower().split("x")
            out.append({"seq_len": int(S), "batch": int(B), "steps": int(steps)})
        except ValueError:
            raise ValueError(f"--pretrain-stages: expected SEQxBATCH:STEPS items separated by commas "
                             f"(e.g. 4096x16:500), got {item!r}") from None
    return out


def checkpoint_steps(ck: str) -> list:
    """The step folders in the trainer's checkpoint folder ``ck``, ascending (none when it is absent)."""
    return sorted(int(n) for n in os.listdir(ck) if n.isdigit()) if os.path.isdir(ck) else []


def pretrain_overrides(spec: dict, run_dir: str, paths, seed: int) -> list:
    """Trainer overrides of one seed's copy pretraining stage (after the arm's model overrides)."""
    S, steps = spec["seq_len"], spec["steps"]
    return [f"run_dir={run_dir}", f"data.path={paths[0]}", f"data.eval_path={paths[1]}", f"data.seq_len={S}",
            f"data.batch_size={spec['batch']}", f"steps={steps}", f"optim.lr={spec['lr']}",
            f"optim.warmup_steps={min(spec['warmup_steps'], max(steps - 1, 0))}", "optim.grad_accum=1",
            f"loss_chunk_size={S}", f"checkpoint.every={min(CKPT_EVERY, steps)}", "checkpoint.keep=2",
            "checkpoint.async_save=false", f"eval.every={max(steps // 8, 1)}", "eval.batches=2",
            f"seed={int(seed)}", f"data.seed={int(seed)}", "model.init_from=null", "logging.progress=false"]


def _stage(spec: dict, work: str, seed: int, model_overrides: list, config: str, alphabet: int, label: str,
           init_from: str | None = None) -> dict:
    """Train, resume or reuse one stage in ``work``: ``{"checkpoints", "heldout_curve", "heldout_loss",
    "reused", "seconds", ...}``, or ``{"stopped": True, "step", "checkpoints"}`` when a stop signal ended it."""
    from benchmarks.quality_corpus import build_induction_corpus
    from mtraining_jax.train.config import load_config
    from mtraining_jax.train.loop import run
    from mtraining_jax.train.metrics import read_metrics

    run_dir = os.path.join(work, "run")
    ck = os.path.join(run_dir, "checkpoints")
    t0 = time.time()
    have = checkpoint_steps(ck)
    reused = bool(have) and have[-1] >= spec["steps"]
    if not reused:
        paths = (os.path.join(work, "train_tokens.npy"), os.path.join(work, "heldout_tokens.npy"))
        if not (have and all(os.path.exists(p) for p in paths)):  # same seed, same windows: built once
            paths = build_induction_corpus(work, spec["seq_len"], spec["windows"], seed, alphabet,
                                           held_windows=max(64, 2 * spec["batch"] + 2))["paths"]
        over = model_overrides + pretrain_overrides(spec, run_dir, paths, seed)
        if init_from:  # a later stage: the previous stage's weights, a fresh optimizer
            over.append(f"model.init_from=ckpt:{init_from}")
        if have:
            over.append("checkpoint.resume=true")
        print(f"[pretrain {label}] {spec['steps']} steps of {spec['batch']} x {spec['seq_len']} copy windows at "
              f"lr {spec['lr']:g}" + (f", resumed from step {have[-1]}" if have else "")
              + (f", from {init_from}" if init_from and not have else ""), flush=True)
        result = run(load_config(config, over), overwrite=not have)
        if result.final_step < spec["steps"]:  # stopped (SIGTERM, time limit): the next call resumes it
            print(f"[pretrain {label}] stopped at step {result.final_step} of {spec['steps']}; the next "
                  f"call resumes it from {ck}", flush=True)
            return {"stopped": True, "step": int(result.final_step), "checkpoints": ck}
    metrics = os.path.join(run_dir, "metrics.jsonl")
    rows = read_metrics(metrics) if os.path.exists(metrics) else []
    curve = [[int(m["step"]), float(m["loss"])] for m in rows if m.get("split") == "eval" and "loss" in m]
    out = {"checkpoints": ck, "seconds": time.time() - t0, "heldout_curve": curve,
           "heldout_loss": curve[-1][1] if curve else None, "reused": reused}
    print(f"[pretrain {label}] {'reused' if reused else 'trained'}: held-out loss "
          f"{out['heldout_loss'] if out['heldout_loss'] is not None else float('nan'):.4f} "
          f"({out['seconds']:.0f}s) -> {ck}", flush=True)
    return out


def _claim(work: str, key: dict, label: str) -> None:
    """Make ``work`` hold a stage of these settings (``pretrain.json``): one of other settings is deleted,
    never reused. A later stage's settings include every earlier stage's, so it is trained anew after them."""
    path = os.path.join(work, "pretrain.json")
    old = json.loads(Path(path).read_text()) if os.path.exists(path) else None
    new = json.loads(json.dumps(key))
    if old is not None and old != new:
        print(f"[pretrain {label}] {work} holds a pretraining with other settings ({old}); training anew", flush=True)
        shutil.rmtree(work)
    os.makedirs(work, exist_ok=True)
    if old != new:  # written only when new, and whole (os.replace): the arms of a seed may reuse it at once
        tmp = f"{path}.{os.getpid()}.tmp"  # (--gpu-per-arm)
        with open(tmp, "w") as f:
            json.dump(key, f)
        os.replace(tmp, path)


def pretrain(spec: dict, seed_dir: str, seed: int, arm_overrides=(), config: str | None = None) -> dict | None:
    """Copy-pretrain one seed (module docstring); ``None`` when ``spec['steps']`` is 0.
    ``arm_overrides``: the dense arm's model overrides (the study's ``train`` list, ``--smoke`` sizes).
    Returns ``{"checkpoints" (the last stage's), "steps", "seconds", "heldout_curve", "heldout_loss",
    "reused" (the first stage's), "stage_results" (each later stage's, with its own "reused"), **spec}``,
    or ``{"stopped": True, "step", "checkpoints"}``
    when a stop signal ended a stage early (it resumes next time)."""
    if not spec["steps"]:
        return None
    work = os.path.join(seed_dir, "pretrain")
    t0 = time.time()
    over = [o for o in arm_overrides if not o.startswith("model.init_from=")]
    chain = [{k: v for k, v in spec.items() if k != "stages"}]  # stage 1's settings, then each later stage's
    _claim(work, {"spec": chain[0], "seed": int(seed), "model_overrides": over}, f"seed {seed}")
    config = config or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                                    "quality", "dense.yaml")
    first = _stage(spec, work, seed, over, config, spec["alphabet"], f"seed {seed}")
    if first.get("stopped"):
        return first
    ck, later = first["checkpoints"], []
    for i, st in enumerate(spec["stages"], 2):
        chain.append(st)  # a stage is reused only after the same earlier stages
        _claim(os.path.join(work, f"stage{i}"), {"chain": chain, "seed": int(seed), "model_overrides": over},
               f"seed {seed} stage {i}")
        res = _stage(st, os.path.join(work, f"stage{i}"), seed, over, config, spec["alphabet"],
                     f"seed {seed} stage {i}", init_from=ck)
        if res.get("stopped"):
            return res
        ck = res["checkpoints"]
        later.append(dict(st, **res))
    out = dict(spec, seed=int(seed), checkpoints=ck, seconds=time.time() - t0, heldout_curve=first["heldout_curve"],
               heldout_loss=first["heldout_loss"], reused=first["reused"], stage_results=later)
    return json.loads(json.dumps(out))


def add_pretrain_args(p) -> None:
    """The study's copy pretraining flags (``quality_study.py``)."""
    p.add_argument("--pretrain-steps", type=int, metavar="N",
                   help="copy pretraining steps per seed before the arms (study: pretrain.steps; 0: none; "
                        "benchmarks/quality_pretrain.py)")
    p.add_argument("--pretrain-stages", metavar="SEQxBATCH:STEPS,...", help="later copy stages, each from the "
                   "previous one's weights, e.g. 4096x16:500 (study: pretrain.stages; '' for none)")
    p.add_argument("--pretrain-seed", type=int, metavar="S", help="every seed's arms start from seed S's copy "
                   "pretraining (one pretrained model; the seeds vary the fine-tuning data and order)")
    p.add_argument("--pretrain-only", action="store_true", help="the copy pretraining alone, no arms: one row per "
                   "seed in OUT/pretrain.jsonl (arm 'pretrain'; curricula compared before any arm trains)")


def resolve_pretrain(args, study_spec: dict) -> dict:
    """The study's ``pretrain`` with the flags applied and checked; ``SystemExit`` naming the bad value."""
    spec = dict(study_spec)
    try:
        if args.pretrain_steps is not None:
            spec["steps"] = args.pretrain_steps
        if args.pretrain_stages is not None:
            spec["stages"] = parse_stages(args.pretrain_stages)
        spec = check_pretrain(spec, "--pretrain-steps / --pretrain-stages")
    except ValueError as e:
        raise SystemExit(f"quality_study: {e}")
    if spec["steps"] and any(o.startswith("model.init_from=") for o in args.train_overrides):
        raise SystemExit("quality_study: copy pretraining (pretrain.steps / --pretrain-steps "
                         f"{spec['steps']}) gives the arms their initial weights; drop model.init_from "
                         "from the trainer overrides or set the pretraining steps to 0")
    if args.pretrain_only and not spec["steps"]:
        raise SystemExit("quality_study: --pretrain-only needs a copy pretraining "
                         "(pretrain.steps / --pretrain-steps > 0)")
    if args.pretrain_seed is not None and args.gpu_per_seed:  # the children would pretrain one folder at once
        raise SystemExit("quality_study: --pretrain-seed runs the seeds one after another (no --gpu-per-seed)")
    return spec
