"""The flags of ``benchmarks/quality_study.py`` (what each means: that module's docstring) and their
resolution against the study protocol (``configs/quality/study.yaml``): a flag left unset takes the
study's value; values out of range stop the call with a message naming them."""

from __future__ import annotations

import argparse
import os

from benchmarks.quality_launch import add_launch_args
from benchmarks.quality_pretrain import add_pretrain_args, resolve_pretrain
from benchmarks.quality_probes import arm_model_config, parse_budgets
from benchmarks.quality_protocol import DENSE_READ_BACKENDS, merge_overrides, train_overrides
from benchmarks.quality_seeds import VARIANTS
from benchmarks.quality_warm import check_warm_start

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUALITY = os.path.join(ROOT, "configs", "quality")
STUDY = os.path.join(QUALITY, "study.yaml")
GROUPS = {"both": ("dense", "mtraining"), "all": VARIANTS}  # --variant names of several variants
MSA_WARMUP_FRACTION = 0.1  # of the run's steps (quality_study's docstring)


def parser(description: str) -> argparse.ArgumentParser:
    """The study's ``ArgumentParser``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", required=True, help="folder of the rows (quality.jsonl), the comparison and the plots")
    p.add_argument("--variant", choices=tuple(GROUPS) + VARIANTS, default="both",
                   help="the arm(s): both = dense + mtraining; all = dense + mtraining + msa")
    p.add_argument("--seeds", type=int, nargs="+", help="seeds (each: initialisation, data order, corpus)")
    p.add_argument("--num-seeds", type=int, help="seeds 0 .. N-1")
    p.add_argument("--seed", type=int, help="one seed (initialisation AND data order; default: the configs')")
    add_launch_args(p)  # --gpu-per-seed, --gpu-per-arm, --gpus
    p.add_argument("--study", default=STUDY, help="the study protocol (token budget, retrieval mix, eval haystack)")
    p.add_argument("--tokens", type=int, help="training tokens per arm and seed (default: the study's token_budget)")
    p.add_argument("--steps", type=int, help="steps per arm and seed instead of --tokens")
    p.add_argument("--retrieval-mix", type=float, help="fraction of training windows with retrieval (study: retrieval.mix)")
    p.add_argument("--retrieval-keys", type=int, help="extra key-value pairs per retrieval window (study: retrieval.keys)")
    p.add_argument("--retrieval-share", type=float,
                   help="most of a retrieval window the extra pairs may take (study: retrieval.share)")
    p.add_argument("--copy-share", type=float, help="share of every window's code overwritten by repeats of its "
                   "own earlier spans (study: retrieval.copy_share; quality_corpus.with_repeats)")
    p.add_argument("--fresh-retrieval", action=argparse.BooleanOptionalAction, default=None,
                   help="new retrieval examples on every pass over the code (study: retrieval.fresh)")
    p.add_argument("--made-up-keys", action=argparse.BooleanOptionalAction, default=None, help="keys beyond the "
                   "eval's 20 words (study: retrieval.made_up_keys; --no-made-up-keys: the s8 study's corpora)")
    p.add_argument("--eval-haystack", choices=("filler", "heldout"), help="NIAH/RULER haystack (study: eval.haystack)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a trainer override of every arm "
                   "after the study's `train` list, e.g. optim.lr=3e-4 or model.init_from=ckpt:DIR/seed{seed} ({seed}: "
                   "each seed; repeatable)")
    p.add_argument("--warm-start", type=int, default=None, metavar="W", help="every arm of a seed continues one dense "
                   "run from its step W (parameters, optimizer, schedule, data position): the arms differ only in "
                   "the attention of the last steps - W steps (benchmarks/quality_warm.py; 0: none; default: the "
                   "study's warm_start, none with --smoke)")
    p.add_argument("--warm-start-eval", action="store_true", help="also evaluate the warm start's checkpoint (NIAH, "
                   "RULER, held-out loss at step W: where the arms start; rows: warm_start.eval)")
    p.add_argument("--report-only", nargs="*", metavar="JSONL",
                   help="no training: the comparison of the rows of these files (default: --out/quality.jsonl)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # a --gpu-per-seed child
    add_pretrain_args(p)
    p.add_argument("--baseline-run", metavar="RUN",
                   help="with --report-only: the dense rows of this `run` tag only (e.g. a dense baseline trained "
                        "with other settings, compared with the sparse arms of --runs; the report notes it)")
    p.add_argument("--runs", help="with --report-only: comma-separated `run` tags, only the rows of these runs "
                   "(e.g. s8-800-steps-4-seeds of results/quality/quality.jsonl); RUN:ARM[+ARM] keeps only those "
                   "arms of a run")
    p.add_argument("--msa-warmup-fraction", type=float, default=MSA_WARMUP_FRACTION,
                   help="msa variant: indexer warm-up (dense attention + full-support KL) as a fraction of the steps")
    p.add_argument("--msa-kl-coef", type=float, help="msa variant: KL coefficient (default: configs/quality/msa.yaml)")
    p.add_argument("--work", default=os.path.join("runs", "quality"), help="run dirs and token files (per seed)")
    p.add_argument("--smoke", action="store_true", help="CPU toy sizes (2 virtual devices)")
    p.add_argument("--recall-ps", type=lambda t: [float(x) for x in t.split(",") if x], default=[0.9, 0.5],
                   help="top-p budgets of the index recall (comma-separated; a budget sweep)")
    p.add_argument("--no-untrained-recall", action="store_true", help="skip the untrained initialisation's recall")
    p.add_argument("--no-eval", action="store_true", help="no evaluator after training: the rows carry the trainer's "
                   "curves (held-out every eval.every steps), compared as `trainer_heldout_final`")
    p.add_argument("--run-steps", type=int, help="train at most this many steps of each arm's schedule in this call, "
                   "then stop with a checkpoint (no evaluation, no row); continue with --resume (module docstring)")
    p.add_argument("--resume", action="store_true",
                   help="continue each arm's run dir from its checkpoint (an arm without one starts from step 0)")
    p.add_argument("--cross-eval", metavar="BACKEND", choices=DENSE_READ_BACKENDS + ("none",),
                   help="also evaluate each sparse-trained model with this dense attention backend in every layer "
                        "(default: the study's eval.cross_eval, cudnn; none: skip; --smoke reads with ring)")
    p.add_argument("--cross-eval-loss-only", action=argparse.BooleanOptionalAction, default=None,
                   help="--cross-eval: held-out loss only (default: the study's eval.cross_eval_loss_only)")
    p.add_argument("--sparse-read", action="store_true", help="also evaluate the dense arm's parameters with the "
                   "MTraining arm's attention (with --no-cross-eval-loss-only: both arms read both ways)")
    p.add_argument("--reread", action="append", default=[], type=str.split, metavar="'KEY=VALUE [KEY=VALUE ...]'",
                   help="also read the MTraining arm's trained parameters with its attention under these trainer "
                        "overrides (whitespace-separated, one read; repeat the flag for more reads, e.g. --reread "
                        "model.sparsity.last_q=1024 --reread 'model.sparsity.last_q=1024 model.sparsity.slash_max=256'): "
                        "held-out loss, NIAH and the index recall / density of each read (rows: rereads), paired with "
                        "dense in seeds.md")
    p.add_argument("--needle-recall", action="store_true", help="also measure how much of the NIAH answer's attention "
                   "to the needle the index keeps (the first 2 passkeys of each cell; the MTraining arm's sparse layers)")
    p.add_argument("--recall-budgets", type=parse_budgets, default=[],
                   help="index budgets of a recall sweep at p = 0.9 on the trained model, ';'-separated, each "
                        "','-separated SparsityConfig fields, e.g. ';vertical_max=16384,slash_max=256;last_q=256' "
                        "(an empty entry: the model's own budgets)")
    return p


def request_determinism(overrides) -> None:
    """``deterministic=true`` among the trainer overrides: XLA's deterministic GPU ops for this process
    (the copy pretraining runs in it, then every arm), set before anything starts JAX's GPU backend
    (:mod:`mtraining_jax.train.determinism`; the trainer refuses the override without it). A value other
    than true / false stops the call naming it."""
    from mtraining_jax.train import determinism
    from mtraining_jax.train.config import parse_override

    for item in overrides:
        key, value = parse_override(item)
        if key == ["deterministic"]:
            if not isinstance(value, bool):
                raise SystemExit(f"quality_study: deterministic must be true or false, got {item!r}")
            determinism.request(value)


def check_reread(reads) -> None:
    """``--reread``: each read a non-empty list of ``KEY=VALUE`` trainer overrides under ``model.`` that the
    MTraining arm's config takes (checked by building its model config now, before any training), no read
    given twice; ``SystemExit`` naming the bad item otherwise."""
    seen = set()
    for overrides in reads:
        if not overrides:
            raise SystemExit("quality_study: --reread '': expected one or more model.KEY=VALUE")
        for item in overrides:
            if "=" not in item or not item.startswith("model."):
                raise SystemExit(f"quality_study: --reread {item!r}: expected model.KEY=VALUE (an attention setting "
                                 "of the MTraining arm's model, e.g. model.sparsity.last_q=1024)")
        if " ".join(overrides) in seen:
            raise SystemExit(f"quality_study: --reread {' '.join(overrides)!r} given twice")
        seen.add(" ".join(overrides))
        try:
            arm_model_config(os.path.join(QUALITY, "mtraining.yaml"), list(overrides))
        except (ValueError, TypeError, KeyError) as e:
            raise SystemExit(f"quality_study: --reread {' '.join(overrides)}: {e}")


def resolve_flags(args, study: dict) -> None:
    """Fill ``args`` from the ``study`` protocol where a flag was not given (retrieval mix / keys / share /
    fresh / copy share / made-up keys, eval haystack, cross read, recall p, copy pretraining) and merge the
    trainer overrides; ``SystemExit`` naming a value out of range."""
    for flag, key in (("retrieval_mix", "mix"), ("retrieval_keys", "keys"), ("retrieval_share", "share"),
                      ("fresh_retrieval", "fresh"), ("copy_share", "copy_share"), ("made_up_keys", "made_up_keys")):
        if getattr(args, flag) is None:  # the flag unset: the study's value
            setattr(args, flag, study["retrieval"][key])
    args.retrieval_tasks = {t: float(w) for t, w in study["retrieval"]["tasks"].items()}
    if not 0.0 <= args.copy_share < 1.0:
        raise SystemExit(f"quality_study: --copy-share must lie in [0, 1), got {args.copy_share}")
    args.eval_haystack = args.eval_haystack or study["eval"]["haystack"]
    try:
        args.train_overrides = merge_overrides(study["train"], train_overrides(args.set))
    except ValueError as e:
        raise SystemExit(f"quality_study: {e}")
    request_determinism(args.train_overrides)
    check_reread(args.reread)
    args.recall_p = float(study["eval"]["recall_p"])
    if args.cross_eval is None:
        args.cross_eval = study["eval"]["cross_eval"]
    args.cross_eval = None if args.cross_eval == "none" else args.cross_eval
    if args.smoke and args.cross_eval == "cudnn":  # no cuDNN on CPU: the smoke arms' dense backend
        args.cross_eval = "ring"
    if args.cross_eval_loss_only is None:
        args.cross_eval_loss_only = study["eval"]["cross_eval_loss_only"]
    args.pretrain = resolve_pretrain(args, study["pretrain"])
    if args.warm_start is None:  # the study's (a --smoke run has a few steps: none)
        args.warm_start = 0 if args.smoke else study["warm_start"]
    check_warm_start(args.warm_start, args.steps)
    if args.warm_start and args.gpu_per_arm and not args.pretrain["steps"]:  # its --pretrain-only child trains it
        raise SystemExit(f"quality_study: --warm-start {args.warm_start} with --gpu-per-arm needs copy pretraining "
                         "(--pretrain-steps > 0): the arms would train one warm start at once")
    if not 0.0 <= args.retrieval_mix <= 1.0 or args.retrieval_keys < 0 or not 0.0 < args.retrieval_share <= 1.0:
        raise SystemExit(f"quality_study: --retrieval-mix must lie in [0, 1] (got {args.retrieval_mix}), --retrieval-keys "
                         f"be >= 0 (got {args.retrieval_keys}) and --retrieval-share in (0, 1] (got {args.retrieval_share})")
    if args.run_steps is not None and args.run_steps < 1:
        raise SystemExit(f"quality_study: --run-steps must be >= 1, got {args.run_steps}")
