"""The multi-seed quality study's protocol (``configs/quality/study.yaml``) and how its command line
resolves: seeds, steps, each seed's and the study's trainer overrides. Used by
``benchmarks/quality_study.py`` (which documents the study)."""

from __future__ import annotations

import json

from benchmarks.quality_corpus import EXTRA_SHARE, TRAIN_TASKS
from benchmarks.quality_pretrain import PRETRAIN_DEFAULTS, check_pretrain

# backends that read a trained model with full causal attention in every layer (eval.cross_eval / --cross-eval)
DENSE_READ_BACKENDS = ("cudnn", "reference", "ring")

STUDY_DEFAULTS = {"token_budget": None, "retrieval": {"mix": 0.5, "keys": 0, "share": EXTRA_SHARE, "fresh": False,
                                                      "copy_share": 0.0, "made_up_keys": True, "tasks": {t: 1.0 for t in TRAIN_TASKS}},
                  "eval": {"haystack": "filler", "recall_p": 0.9, "cross_eval": None, "cross_eval_loss_only": True},
                  "train": [],  # trainer overrides of every arm (``KEY=VALUE``), before ``--set``
                  "pretrain": PRETRAIN_DEFAULTS,  # copy pretraining per seed (benchmarks/quality_pretrain.py)
                  "warm_start": 0}  # every arm continues one dense run from this step (benchmarks/quality_warm.py)


def load_study(path: str) -> dict:
    """The study protocol (``configs/quality/study.yaml``) over :data:`STUDY_DEFAULTS`; unknown
    keys and bad values are a ``ValueError`` naming the file."""
    from mtraining_jax.train.config import read_yaml

    raw = read_yaml(path, "study config") if path else {}
    out = json.loads(json.dumps(STUDY_DEFAULTS))
    for k, v in raw.items():
        if k not in out:
            raise ValueError(f"study config {path!r}: unknown key {k!r} (expected {sorted(out)})")
        if isinstance(out[k], dict):
            if not isinstance(v, dict) or set(v) - set(out[k]):
                raise ValueError(f"study config {path!r}: {k} must be a mapping of {sorted(out[k])}, got {v!r}")
            out[k].update(v)
        else:
            out[k] = v
    r = out["retrieval"]
    if isinstance(r["tasks"], (list, tuple)):
        r["tasks"] = {t: 1.0 for t in r["tasks"]}
    bad = [t for t in r["tasks"] if t not in TRAIN_TASKS]
    if bad or not r["tasks"] or any(float(w) < 0 for w in r["tasks"].values()) or sum(r["tasks"].values()) <= 0:
        raise ValueError(f"study config {path!r}: retrieval.tasks must weight some of {TRAIN_TASKS}, got {r['tasks']!r}")
    if not 0.0 <= float(r["mix"]) <= 1.0 or int(r["keys"]) < 0:
        raise ValueError(f"study config {path!r}: retrieval.mix must lie in [0, 1] and keys be >= 0, got {r!r}")
    if isinstance(r["share"], bool) or not isinstance(r["share"], (int, float)) or not 0.0 < r["share"] <= 1.0:
        raise ValueError(f"study config {path!r}: retrieval.share must be a number in (0, 1], got {r['share']!r}")
    if isinstance(r["copy_share"], bool) or not isinstance(r["copy_share"], (int, float)) \
            or not 0.0 <= r["copy_share"] < 1.0:
        raise ValueError(f"study config {path!r}: retrieval.copy_share must be a number in [0, 1), "
                         f"got {r['copy_share']!r}")
    for flag in ("fresh", "made_up_keys"):
        if not isinstance(r[flag], bool):
            raise ValueError(f"study config {path!r}: retrieval.{flag} must be true or false, got {r[flag]!r}")
    if out["eval"]["haystack"] not in ("filler", "heldout"):
        raise ValueError(f"study config {path!r}: eval.haystack must be filler or heldout")
    ce = out["eval"]["cross_eval"]
    if ce is not None and ce not in DENSE_READ_BACKENDS:
        raise ValueError(f"study config {path!r}: eval.cross_eval must be null or one of {DENSE_READ_BACKENDS}, "
                         f"got {ce!r}")
    if not isinstance(out["eval"]["cross_eval_loss_only"], bool):
        raise ValueError(f"study config {path!r}: eval.cross_eval_loss_only must be true or false, "
                         f"got {out['eval']['cross_eval_loss_only']!r}")
    if out["token_budget"] is not None and int(out["token_budget"]) <= 0:
        raise ValueError(f"study config {path!r}: token_budget must be positive")
    ws = out["warm_start"]
    if isinstance(ws, bool) or not isinstance(ws, int) or ws < 0:
        raise ValueError(f"study config {path!r}: warm_start must be an integer >= 0 (0: none), got {ws!r}")
    out["train"] = train_overrides(out["train"], f"study config {path!r}: train")
    out["pretrain"] = check_pretrain(out["pretrain"], f"study config {path!r}")
    return out


def resolve_seeds(args, default: int = 0) -> list:
    """``--seeds`` / ``--num-seeds`` / ``--seed`` (one at most) as a list of distinct seeds."""
    given = [x for x in (args.seeds, args.num_seeds, args.seed) if x is not None]
    if len(given) > 1:
        raise SystemExit("quality_study: give one of --seeds, --num-seeds, --seed")
    if args.seeds is not None:
        seeds = [int(s) for s in args.seeds]
    elif args.num_seeds is not None:
        if args.num_seeds < 1:
            raise SystemExit("quality_study: --num-seeds must be >= 1")
        seeds = list(range(args.num_seeds))
    elif args.seed is not None:
        seeds = [int(args.seed)]
    else:
        seeds = [int(default)]
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"quality_study: --seeds repeats a seed: {seeds}")
    return seeds


def resolve_steps(args, base, study: dict) -> int:
    """The steps of every arm: ``--steps``, else ``--tokens``, else (not ``--smoke``) the study's
    ``token_budget``, else the config's; a budget must be a whole number of steps."""
    per_step = base.data.seq_len * base.data.batch_size * base.optim.grad_accum
    if args.steps and args.tokens:
        raise SystemExit("quality_study: give --steps or --tokens, not both")
    if args.steps:
        return int(args.steps)
    budget = args.tokens or (None if args.smoke else study["token_budget"])
    if budget is None:
        return int(base.steps)
    if budget % per_step:
        raise SystemExit(f"quality_study: the token budget {budget} is not a whole number of steps of "
                         f"{per_step} tokens (seq_len x batch x accum)")
    return int(budget // per_step)


def seed_overrides(seed: int) -> list:
    """The training-config overrides of one seed: initialisation AND data order."""
    return [f"seed={int(seed)}", f"data.seed={int(seed)}"]


# what the study sets itself per arm and seed (the pairing of the arms rests on them)
STUDY_OWNED = ("run_dir", "data.path", "data.eval_path", "seed", "data.seed", "steps", "run_steps",
               "checkpoint.every", "checkpoint.resume")


def train_overrides(items, what: str = "--set") -> list:
    """``items`` (the study's ``train`` list, or ``--set`` values) checked as trainer overrides
    ``KEY=VALUE`` that every arm takes (e.g. ``optim.lr=3e-4``, ``model.init_from=ckpt:DIR``); a
    key the study sets itself (:data:`STUDY_OWNED`) is a ``ValueError``: use the study's flags."""
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"{what}: a list of KEY=VALUE trainer overrides, got {items!r}")
    out = []
    for item in items:
        key, sep, _ = item.partition("=") if isinstance(item, str) else ("", "", "")
        if not sep or not key.strip():
            raise ValueError(f"{what}: expected KEY=VALUE (a trainer override), got {item!r}")
        if key.strip() in STUDY_OWNED:
            raise ValueError(f"{what}: {key.strip()!r} is set by the study per arm and seed (use its flags), "
                             f"got {item!r}")
        out.append(item.strip())
    return out


def merge_overrides(*lists) -> list:
    """The trainer overrides ``KEY=VALUE`` of several lists in order, one per key: a later value of a
    key replaces the earlier one in its place (the study's ``train`` list, then ``--set``), so a row
    records what the arms ran with, whichever way it was asked for."""
    out: dict[str, str] = {}
    for items in lists:
        for item in items:
            key = item.partition("=")[0].strip()
            out[key] = item
    return list(out.values())
