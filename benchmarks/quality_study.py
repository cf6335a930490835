"""Dense vs MTraining vs MSA quality study: train the arms of configs/quality/ from scratch on
identical data, evaluate each in-process, over several seeds, and compare the arms as paired
differences (arm - dense, per seed) with a 95 % t-interval over the seeds.

    # the multi-seed evidence on a 4-GPU machine: one call per arm, its 4 seeds at once (one GPU each)
    for arm in dense mtraining msa; do
      python benchmarks/quality_study.py --out $OUT/q --work /tmp/quality --variant $arm --num-seeds 4 --gpu-per-seed
    done
    python benchmarks/quality_study.py --out $OUT/q --report-only           # the comparison again from quality.jsonl
    python benchmarks/quality_study.py --out $OUT/q --report-only a.jsonl b.jsonl   # ... from rows of other calls
    python benchmarks/quality_study.py --out $OUT/q --seeds 0 1 --variant all       # sequentially, one process
    python benchmarks/quality_study.py --out /tmp/q --smoke                 # CPU toy sizes (CI)
    python benchmarks/quality_study.py --out $OUT/q --variant both --seeds 0 --pretrain-steps 4000

Protocol (``configs/quality/study.yaml``; printed first and recorded in every row):

* **token budget**: ``token_budget`` training tokens per arm and seed, the same for every arm
  (``--tokens`` / ``--steps`` override; the steps are ``budget / (seq_len * batch * accum)`` exactly);
* **seeds**: seed ``s`` sets the model initialisation (``seed``), the data order (``data.seed``: the
  loader's per-epoch permutation) and the training corpus' retrieval examples; every arm of seed
  ``s`` trains on the identical token file in the identical order (``corpus_sha`` in the rows),
  and seeds differ in all three. ``--seeds 0 1 2`` / ``--num-seeds N`` (0 .. N-1) / ``--seed S``;
* **retrieval in the training mix**: a fraction ``retrieval.mix`` (``--retrieval-mix``) of the 32K
  training windows carries one synthetic task at its end (:mod:`mtraining_jax.eval.tasks`: passkey,
  multi-key, multi-value, variable tracking, drawn with ``retrieval.tasks`` weights) plus up to
  ``retrieval.keys`` (``--retrieval-keys``) extra key-value pairs, each a needle ``"The special magic
  number for <word> is: <n>."`` at a random depth and its question + answer at a random later point
  of the same window (the evaluation's multi-key format), so every retrieval window trains a dozen
  lookups at distances across the whole window instead of one; the extra text is capped at a
  quarter of the window. All of it is embedded in that window's own code; the evaluation's examples
  come from other seeds; the held-out stream (loss) is plain code, the same for every arm and seed;
* **evaluation** (:func:`mtraining_jax.eval.api.evaluate_params`, each model with its own attention
  backends): NIAH grid and RULER-style tasks on a ``eval.haystack`` haystack (held-out code by
  default, the training haystack's kind), held-out loss at 32K over 8 windows, loss by position,
  index recall per layer and head at p = 0.9 / 0.5 on the trained model's q/k (and on the untrained
  initialisation for contrast); each sparse arm's held-out loss again with dense attention in every
  layer (``eval.cross_eval``, ``--cross-eval``; the index comes from later tokens) and, with
  ``--sparse-read``, the dense arm's parameters read with the MTraining arm's attention (row key
  ``sparse_read``): with ``--no-cross-eval-loss-only`` the 2 x 2 of training x inference attention of
  the MTraining paper's Table 1, with the NIAH grid in every cell; with ``--needle-recall`` how much of
  the answer's attention to the NIAH needle the index keeps (row key ``needle_recall``); with
  ``--reread 'KEY=VALUE ...'`` (repeatable, one read each) the MTraining arm's parameters read again with its
  attention under those settings (e.g. denser indices), with each index's recall and density (row key
  ``rereads``, a list);
* **trainer overrides of every arm**: the study's ``train`` list (``optim.lr=3e-4``), then ``--set
  KEY=VALUE`` (repeatable; a key given again replaces the earlier value; e.g. ``optim.lr=1e-3``,
  ``model.init_from=ckpt:DIR/seed{seed}`` for arms that start from a pretrained checkpoint,
  ``{seed}`` replaced by each seed); what the study sets per arm and seed (run dir, data, seeds,
  steps) is refused. ``deterministic=true`` also asks XLA for deterministic GPU ops before JAX starts
  (the pretraining and every arm run in the one process, so both are affected; the rows' ``train_overrides``
  say so): a seed's copy pretraining is then the same in every call of one commit (not yet measured on a
  GPU; autotuning may still pick other kernels in another compile, ``--xla_gpu_autotune_level=0`` rules it out).
* **copy pretraining** (``pretrain``, ``--pretrain-steps N``, ``--pretrain-stages``, ``--pretrain-seed S``; 0 steps by
  default): each seed first trains the
  dense arm's model on short windows of random bytes with spans copied to later places
  (:mod:`benchmarks.quality_pretrain`), and every arm of that seed starts from those weights (rows:
  ``pretrain``). A finished pretraining is reused by later calls and a stopped one resumed;
  ``--pretrain-only`` stops there (rows ``arm: pretrain`` in ``--out/pretrain.jsonl``).
* **warm start** (``--warm-start W``; the study's ``warm_start``, none in ``study.yaml``, 400 in
  ``study_warm.yaml``): every arm of a seed continues one dense run from
  its step ``W`` (parameters, optimizer, schedule, data position; :mod:`benchmarks.quality_warm`), so the
  arms differ only in the attention of the later steps: the question of a model that already retrieves.

One JSONL row per (arm, seed) in ``--out/quality.jsonl``, appended as soon as it is known: ``arm``
(dense / mtraining / msa), ``seed``, ``steps``, ``tokens``, ``heldout_loss`` (the evaluator's
held-out loss at 32K), ``niah_accuracy`` (mean whole-answer accuracy of the NIAH grid), ``recall``
(mean index recall at p = 0.9), ``commit``, ``date``, ``device``, ``jax``, ``command``; besides them
the training curves (``train_loss``, ``heldout_curve`` = the trainer's held-out loss every
``eval.every`` steps, ``train_time`` = cumulative training seconds per step, the compile-bearing
first step counted at the median step time; with a warm start the curves begin with its steps and time,
as measured, the same for every arm), timings and every evaluation result.

Comparison (``seeds.md``, ``loss_vs_tokens.png``; rewritten from ALL rows of ``quality.jsonl`` after
every call, or by ``--report-only``): per arm mean and s.d. over seeds; per metric the paired
differences arm - dense per seed, their mean and the 95 % t-interval over seeds (``t_{0.975, n-1}``);
"no difference established" unless the interval excludes 0. Besides the final loss, the loss at
equal training time: each seed's arms read at the fastest arm's total training time (the trainer's
held-out loss interpolated in time, and the train loss averaged over the last 5 % of steps). A
slower arm's equal-time value comes from its fixed-budget run, whose learning rate has not decayed
yet at that time, so it understates what a run planned for that time would reach. The plot: loss
against training tokens (mean over seeds, band = min-max over seeds) and against training seconds.

``--gpu-per-seed`` launches one process per seed with ``CUDA_VISIBLE_DEVICES=<gpu>`` (``--gpus``,
default 0 .. seeds-1; more seeds than GPUs run in waves); each child writes ``--out/seed<s>/``
(its rows, its single-run report, ``log_<variant>.txt``) and the parent appends the new rows to
``--out/quality.jsonl`` and writes the comparison. ``--gpu-per-arm`` (``--gpus`` required) splits
further: one process per seed for its copy pretraining, then one per (seed, arm) on whichever GPU
is free, each writing ``--out/seed<s>/<arm>/`` (:mod:`benchmarks.quality_launch`).

MSA arm (``configs/quality/msa.yaml``): layers 1-11 MSA (top-16 of 64-token blocks, d_idx 64,
mean-pooled block keys), ``msa.kl_coef`` 1 (``--msa-kl-coef``), and an indexer warm-up of
``--msa-warmup-fraction`` of the run's steps (default 0.1, i.e. 50 of 500 steps). Why 0.1: the
paper (MSA §4, App. "Indexer Warmup") warms up for 40B tokens of its 400B-token continued
pretraining (10 %) and of its 3T-token pretraining from scratch (1.3 %), and motivates the warm-up
by the main branch's attention entropy collapsing "in the first few hundred steps"; in a 500-step
run from scratch 1.3 % would be 6 steps, far inside that phase, so the CPT ratio is used.

Data: this Python's standard-library sources (byte tokens, 5 % of files held out by path hash).

Single-call outputs in ``--out`` besides the rows: ``quality.md`` (side-by-side table of the call's
runs), ``loss_curves.png``, ``quality_niah.png``, ``quality_position_loss.png``,
``quality_recall.png``. A failing section is recorded as an error and the study goes on. Run dirs
(no checkpoints) and the token files go to ``--work/seed<s>/``.

A protocol longer than one device call runs in slices on one machine (``--work`` on a disk that
persists between the calls): ``--run-steps N`` trains at most N steps of each arm's schedule, writes a
checkpoint and stops (no evaluation, no row); each later call passes ``--resume`` (and ``--run-steps``
again until the last slice), which continues every arm from its checkpoint; the call that reaches the
last step evaluates and writes the row as one uninterrupted run would. The schedule (warm-up, decay,
the MSA warm-up) is the whole run's in every slice; the first step of each slice, which compiles, counts
as the median step in the training-time curve (``quality_invocations.json`` in the run dir records
where the slices started).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

from benchmarks.quality_corpus import build_corpus  # the training corpus
from benchmarks.quality_pretrain import checkpoint_steps, pretrain  # copy pretraining
from benchmarks.quality_warm import check_warm_start, continue_from, warm_start  # --warm-start
from benchmarks.quality_curves import join_warm, time_curve  # a run's curves
from benchmarks.quality_protocol import load_study, resolve_seeds, resolve_steps, seed_overrides  # the protocol
from benchmarks.quality_report import write_report  # the single-call report
from benchmarks.quality_launch import launch_per_arm, launch_per_seed  # one process per seed / arm
from benchmarks.quality_probes import (arm_model_config, budget_sweep, cross_eval, needle_probe, probe, reread,
                                       sparse_read)
from benchmarks.quality_seeds import read_rows, select_runs, write_seed_report  # the statistics over seeds
from benchmarks.quality_args import GROUPS, QUALITY, ROOT, STUDY, parser, resolve_flags  # noqa: F401  (flags; re-exported)

REQUIRED = ("arm", "seed", "steps", "tokens", "heldout_loss", "niah_accuracy", "recall", "commit", "date",
            "device", "jax", "command")  # every JSONL row carries these (None where not measured)
SMOKE = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=2", "model.num_heads=2",
         "model.num_kv_heads=1", "model.dtype=float32", "data.seq_len=512", "steps=2", "optim.warmup_steps=1",
         "eval.every=2", "eval.batches=1", "loss_chunk_size=512", "mesh.shape=[1,2]", "logging.progress=false"]
SMOKE_BACKENDS = {"dense": ["model.attention_backend=ring"], "mtraining": ["model.dense_backend=ring"],
                  "msa": ["model.dense_backend=ring", "model.msa.top_k=3", "model.msa.index_dim=8"]}


# ----------------------------------------------------------------------------------- protocol


def eval_spec(smoke: bool, seq_len: int, recall_ps=(0.9, 0.5), haystack: str = "filler"):
    from mtraining_jax.eval.api import EvalSpec

    recall_ps = tuple(recall_ps)
    if smoke:
        return EvalSpec(lengths=(seq_len,), depths=(0.0, 1.0), samples=1, ruler_tasks=("multikey",),
                        ruler_samples=1, ppl_windows=2, ppl_buckets=4, recall_ps=recall_ps, recall_rows=16,
                        haystack=haystack)
    lengths = tuple(n for n in (4096, 8192, 16384, 32768) if n <= seq_len)
    return EvalSpec(lengths=lengths, depths=(0.0, 0.25, 0.5, 0.75, 1.0), samples=4,
                    ruler_tasks=("multikey", "multivalue", "vartrack"), ruler_samples=4, ppl_windows=8,
                    ppl_buckets=16, recall_ps=recall_ps, recall_rows=512, haystack=haystack)


# ----------------------------------------------------------------------------------- one run


def eval_scalars(ev: dict, recall_p: float) -> dict:
    """The row's scalars of one evaluation result (``None`` where the section is missing)."""
    import numpy as np

    out = {"heldout_loss": None, "heldout_loss_se": None, "niah_accuracy": None, "niah_token_accuracy": None,
           "ruler_accuracy": {}, "recall": None, "recall_p": recall_p}
    if "perplexity" in ev:
        w = ev["perplexity"].get("window_loss", [])
        out["heldout_loss"] = float(ev["perplexity"]["mean_loss"])
        out["heldout_loss_se"] = float(np.std(w, ddof=1) / np.sqrt(len(w))) if len(w) > 1 else None
    if "niah" in ev:
        out["niah_accuracy"] = float(np.mean(ev["niah"]["accuracy"]))
        out["niah_token_accuracy"] = float(np.mean(ev["niah"]["token_accuracy"]))
    if "ruler" in ev:
        out["ruler_accuracy"] = {t: float(np.mean(v["accuracy"])) for t, v in ev["ruler"]["tasks"].items()}
    if "recall" in ev:
        out["recall"] = ev["recall"]["mean_recall"].get(f"{recall_p:g}")
    return out


def provenance_row(argv=None) -> dict:
    """``commit``, ``date``, ``command``, ``jax``, ``device`` (:func:`benchmarks._driver.provenance`);
    a child of ``--gpu-per-seed`` records its parent's command (``child_command``: its own)."""
    try:
        from benchmarks._driver import provenance
    except ImportError:  # run as a script without PYTHONPATH
        sys.path.insert(0, ROOT)
        from benchmarks._driver import provenance
    row = {"jax": None, "device": None, **provenance(argv)}
    parent = os.environ.get("MTRAINING_STUDY_COMMAND")
    if parent:
        row["child_command"], row["command"] = row["command"], parent
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
        row["cuda_visible_devices"] = os.environ["CUDA_VISIBLE_DEVICES"]
    return row


def retrieval_settings(args) -> dict:
    """The training mix's retrieval settings as a row records them."""
    return {"mix": args.retrieval_mix, "keys": args.retrieval_keys, "share": args.retrieval_share,
            "fresh": args.fresh_retrieval, "copy_share": args.copy_share, "made_up_keys": args.made_up_keys,
            "tasks": args.retrieval_tasks}


def base_row(name: str, seed, args) -> dict:
    """A row with every :data:`REQUIRED` field (``None`` until measured) and the study settings."""
    row = dict.fromkeys(REQUIRED)
    row.update(arm=name, variant=name, seed=seed, retrieval_mix=args.retrieval_mix, retrieval=retrieval_settings(args),
               eval_haystack=args.eval_haystack, train_overrides=getattr(args, "train_overrides", []))
    return row


def _slices(run_dir: str, start: int | None = None) -> list:
    """The first steps of the run's slices (``quality_invocations.json``), with ``start`` appended
    (and written) when given."""
    path = os.path.join(run_dir, "quality_invocations.json")
    starts = json.loads(Path(path).read_text()) if os.path.exists(path) else []
    if start is not None:
        starts = [s for s in starts if s < start] + [start]
        with open(path, "w") as f:
            json.dump(starts, f)
    return starts


def evaluate_checkpoint(args, run_dir: str, step: int, heldout_path: str, label: str) -> dict:
    """The evaluator (NIAH, RULER, held-out loss, recall at ``args.recall_p``) on the parameters of
    ``run_dir``'s checkpoint ``step`` with the run's own attention: ``{"eval", **eval_scalars}``; with
    ``--recall-budgets`` also their sweep (``recall_budgets``, taken first: cheap, and printed before the
    longer evaluation)."""
    import numpy as np

    from mtraining_jax.eval.api import evaluate_params
    from mtraining_jax.model.checkpoint import load_model_params
    from mtraining_jax.train.config import load_config
    from mtraining_jax.train.data import token_file_stream
    from mtraining_jax.train.loop import build_mesh
    from mtraining_jax.train.tokenizer import load_tokenizer

    cfg = load_config(os.path.join(run_dir, "config.yaml"))
    _, model_cfg, params = load_model_params(os.path.join(run_dir, "checkpoints", str(step)))
    spec = eval_spec(args.smoke, cfg.data.seq_len, args.recall_ps, args.eval_haystack)
    mesh, held, out = build_mesh(cfg.mesh), np.asarray(token_file_stream(heldout_path)), {}
    if getattr(args, "recall_budgets", None):
        print(f"[{label}] recall budgets:", flush=True)
        probe(out, "recall_budgets", lambda: budget_sweep(model_cfg, params, held[None, :spec.perplexity_len], mesh,
                                                          args.recall_budgets, spec.recall_rows))
    ev = evaluate_params(model_cfg, params, load_tokenizer(cfg.data.tokenizer), spec, mesh=mesh, heldout=held,
                         label=label)
    return {"eval": ev, **eval_scalars(ev, args.recall_p if args.recall_p in args.recall_ps else args.recall_ps[0]),
            **out}


def run_variant(name: str, args, corpus, seed=None, pretrained: dict | None = None, warm: dict | None = None,
                run_name: str | None = None) -> dict | None:
    """Train and evaluate one arm of one seed; every section's failure is recorded, not raised.
    ``corpus``: :func:`build_corpus` (or the old ``(train, heldout)`` paths). ``pretrained``: the
    seed's copy pretraining (:func:`benchmarks.quality_pretrain.pretrain`): the arm starts from its
    weights. ``warm``: the seed's warm start (:mod:`benchmarks.quality_warm`): the arm continues it.
    ``run_name``: the run folder's name (default ``name``). ``None`` when this call trained a slice
    that ends before the schedule does (``--run-steps``: module docstring)."""
    import numpy as np

    from mtraining_jax.eval.api import evaluate_params
    from mtraining_jax.eval.recall import index_recall
    from mtraining_jax.model.qwen2 import Qwen2ForCausalLM
    from mtraining_jax.train.config import load_config
    from mtraining_jax.train.data import token_file_stream
    from mtraining_jax.train.loop import build_mesh, run
    from mtraining_jax.train.metrics import read_metrics
    from mtraining_jax.train.state import build_model_config, split_model
    from mtraining_jax.train.tokenizer import load_tokenizer

    info = corpus if isinstance(corpus, dict) else {"paths": tuple(corpus)}
    paths = info["paths"]
    work = os.path.dirname(os.path.abspath(paths[0]))
    run_dir = os.path.join(work, run_name or name)
    over = [f"run_dir={run_dir}", f"data.path={paths[0]}", f"data.eval_path={paths[1]}"]
    if args.smoke:
        over += SMOKE + SMOKE_BACKENDS[name]
    if args.steps:
        over.append(f"steps={args.steps}")
    if seed is not None:
        over += seed_overrides(seed)
    over += [o.replace("{seed}", str(seed)) for o in getattr(args, "train_overrides", [])]  # study `train`, --set
    if pretrained:
        over.append(f"model.init_from=ckpt:{pretrained['checkpoints']}")
    sliced = bool(getattr(args, "run_steps", None) or getattr(args, "resume", False) or warm)
    ckdir = os.path.join(run_dir, "checkpoints")  # the configs' checkpoint folder (checkpoint.dir unset)
    held = checkpoint_steps(ckdir)
    if warm and not (getattr(args, "resume", False) and held and held[-1] > warm["steps"]):
        continue_from(warm, run_dir)  # a resumed slice past the warm start keeps its own progress
        held = [warm["steps"]]
    resume = sliced and (getattr(args, "resume", False) or bool(warm)) and bool(held)
    if sliced:  # a checkpoint where a slice stops (and at the end): the next slice continues from it
        over.append(f"checkpoint.every={args.steps or load_config(os.path.join(QUALITY, f'{name}.yaml'), over).steps}")
    if getattr(args, "run_steps", None):
        over.append(f"run_steps={args.run_steps}")
    if resume:
        over.append("checkpoint.resume=true")
    if name == "msa":
        steps = args.steps or load_config(os.path.join(QUALITY, "msa.yaml"), over).steps
        over.append(f"msa.warmup_steps={msa_warmup_steps(steps, args.msa_warmup_fraction)}")
        if args.msa_kl_coef is not None:
            over.append(f"msa.kl_coef={args.msa_kl_coef}")
    cfg = load_config(os.path.join(QUALITY, f"{name}.yaml"), over)
    rec = base_row(name, cfg.seed, args)
    rec["pretrain"] = pretrained
    rec["warm_start"] = warm
    per_step = cfg.data.seq_len * cfg.data.batch_size * cfg.optim.grad_accum
    rec.update(steps=cfg.steps, tokens=cfg.steps * per_step, tokens_per_step=per_step, seq_len=cfg.data.seq_len,
               data_seed=cfg.data.seed, corpus_sha=info.get("sha"),
               corpus={k: v for k, v in info.items() if k != "paths"})
    t0 = time.time()
    result = run(cfg, overwrite=not resume)  # the study's run dirs are scratch: a new run replaces them
    rec["train_seconds"] = time.time() - t0
    starts = _slices(cfg.run_dir, result.train_losses[0][0] if result.train_losses else None) if sliced else []
    if result.final_step < cfg.steps:
        print(f"[{name} seed {cfg.seed}] trained to step {result.final_step} of {cfg.steps} (a slice: "
              f"{rec['train_seconds']:.0f}s); continue with --resume", flush=True)
        return None
    rec["slices"] = starts or None
    rows = [m for m in read_metrics(os.path.join(cfg.run_dir, "metrics.jsonl")) if "loss" in m]
    train_rows = [m for m in rows if m.get("split", "train") == "train"]
    rec["train_loss"] = [[int(m["step"]), float(m["loss"])] for m in train_rows]
    # from the metrics file, not result.eval_metrics: a resumed run's earlier slices are in the file only
    rec["heldout_curve"] = [[int(m["step"]), float(m["loss"])] for m in rows if m.get("split") == "eval"]
    rec["train_time"] = time_curve(train_rows, compile_steps=starts[1:], start=warm["steps"] if warm else 0)
    if warm:  # the dense prefix every arm of the seed shares: its measured time, loss and held-out curves
        join_warm(rec, warm, rec["train_time"])
    rec["train_compute_seconds"] = rec["train_time"][-1][1] if rec["train_time"] else None
    tps = [m["tokens_per_s"] for m in train_rows[len(train_rows) // 4:] if "tokens_per_s" in m]
    rec["tokens_per_s"] = float(np.median(tps)) if tps else None
    wf = [m["attn/work_fraction"] for m in train_rows if "attn/work_fraction" in m]
    rec["work_fraction"] = float(np.mean(wf)) if wf else 1.0
    if name == "msa":
        rec["msa"] = msa_summary(cfg, train_rows)
    print(f"[{name} seed {cfg.seed}] trained {cfg.steps} steps ({rec['tokens']} tokens) in "
          f"{rec['train_seconds']:.0f}s, last loss "
          f"{rec['train_loss'][-1][1] if rec['train_loss'] else float('nan'):.4f}", flush=True)
    _, model_cfg = build_model_config(cfg.model, cfg.config_dir)
    if name == "msa":
        rec["msa"]["config"] = dict(model_cfg.msa or {})
    if args.no_eval:  # the trainer's held-out curve is the comparison (quality_seeds: trainer_heldout_final)
        rec.update(eval_skipped="--no-eval: the trainer's held-out curve only", **provenance_row(args.argv))
        return rec
    mesh, tok = build_mesh(cfg.mesh), load_tokenizer(cfg.data.tokenizer)
    held = np.asarray(token_file_stream(paths[1]))
    spec = eval_spec(args.smoke, cfg.data.seq_len, args.recall_ps, args.eval_haystack)
    recall_p = args.recall_p if args.recall_p in args.recall_ps else args.recall_ps[0]
    t0 = time.time()
    try:
        rec["eval"] = evaluate_params(model_cfg, result.params, tok, spec, mesh=mesh, heldout=held,
                                      label=f"{name} seed {cfg.seed}")
        rec.update(eval_scalars(rec["eval"], recall_p))
    except Exception as e:  # keep the training record
        traceback.print_exc()
        rec["eval_error"] = f"{type(e).__name__}: {e}"
    S = spec.perplexity_len
    if not args.no_untrained_recall:
        probe(rec, "recall_untrained", lambda: index_recall(
            model_cfg, split_model(Qwen2ForCausalLM, model_cfg, cfg.seed)[1](), held[None, :S], spec.recall_ps, mesh,
            spec.recall_rows))
    if args.cross_eval and set(model_cfg.layer_backends) != {args.cross_eval}:
        probe(rec, "cross_eval", lambda: cross_eval(model_cfg, result.params, tok, spec, mesh, held, args.cross_eval,
                                                    retrieval=not args.cross_eval_loss_only))
    mt_over = [o for o in over if o not in SMOKE_BACKENDS[name]] + (SMOKE_BACKENDS["mtraining"] * args.smoke)
    mt_yaml = os.path.join(QUALITY, "mtraining.yaml")  # the MTraining arm's config: its attention, its layers
    if args.sparse_read and name == "dense":  # the dense-trained parameters read with the MTraining arm's attention
        probe(rec, "sparse_read", lambda: sparse_read(mt_yaml, mt_over, result.params, tok, spec, mesh, held))
    if args.reread and name == "mtraining":  # its parameters, its attention with other settings, one read each
        rec["rereads"] = []
        for overrides in args.reread:
            one = {}
            probe(one, "read", lambda o=overrides: reread(mt_yaml, mt_over, o, result.params, tok, spec, mesh, held))
            rec["rereads"].append(one.get("read") or {"overrides": list(overrides), "error": one["read_error"]})
    if args.needle_recall:  # over the MTraining arm's sparse layers, for every arm
        probe(rec, "needle_recall", lambda: needle_probe(model_cfg, result.params, tok, spec, mesh, held, [
            i for i, b in enumerate(arm_model_config(mt_yaml, mt_over).layer_backends) if b == "mtraining"]))
    if args.recall_budgets:
        probe(rec, "recall_budgets", lambda: budget_sweep(model_cfg, result.params, held[None, :S], mesh,
                                                          args.recall_budgets, spec.recall_rows))
    rec["eval_seconds"] = time.time() - t0
    rec.update(provenance_row(args.argv))
    print(f"[{name} seed {cfg.seed}] evaluated in {rec['eval_seconds']:.0f}s: held-out loss "
          f"{_fmt(rec['heldout_loss'], '.4f')}, NIAH {_fmt(rec['niah_accuracy'], '.3f')}, "
          f"recall {_fmt(rec['recall'], '.3f')}", flush=True)
    return rec


def _fmt(v, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def msa_warmup_steps(steps: int, fraction: float) -> int:
    """Indexer warm-up steps: ``round(fraction * steps)``, at least 1 when ``fraction > 0``."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"--msa-warmup-fraction must be in [0, 1), got {fraction}")
    return max(1, round(fraction * steps)) if fraction > 0 else 0


def msa_summary(cfg, train_rows) -> dict:
    """The MSA variant's schedule and its training metrics: KL (mean over the MSA layers), its
    gradient norm, recall of the main branch's mass and work fraction, per step and averaged
    over the sparse steps' last half."""
    import numpy as np

    keys = {"kl": "attn/msa_kl", "kl_grad_norm": "msa/kl_grad_norm", "recall": "attn/msa_recall",
            "work_fraction": "attn/work_fraction", "warmup": "msa/warmup"}
    out = {"warmup_steps": cfg.msa.warmup_steps, "kl_coef": cfg.msa.kl_coef}
    for k, key in keys.items():
        out[k] = [[int(m["step"]), float(m[key])] for m in train_rows if isinstance(m.get(key), float)]
    sparse = [m for m in train_rows if m.get("msa/warmup") == 0.0]
    for k in ("kl", "recall", "work_fraction"):
        vals = [float(m[keys[k]]) for m in sparse[len(sparse) // 2:] if isinstance(m.get(keys[k]), float)]
        out[f"{k}_sparse_mean"] = float(np.mean(vals)) if vals else None
    return out


# ----------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    args = parser(__doc__.split("\n\n")[0]).parse_args(argv)
    args.argv = argv
    if args.report_only is not None:
        rows = read_rows(args.report_only or [os.path.join(args.out, "quality.jsonl")])
        if args.runs:
            try:
                rows = select_runs(rows, args.runs)
            except ValueError as e:
                print(f"quality_study: {e}", file=sys.stderr)
                return 1
        if args.baseline_run:
            rows = [r for r in rows if r.get("arm") != "dense" or r.get("run") == args.baseline_run]
        if not rows:
            print("no rows of the multi-seed study (rows with 'arm'"
                  + (f", run in {args.runs!r}" if args.runs else "") + ") found", file=sys.stderr)
            return 1
        print(write_seed_report(rows, args.out))
        return 0
    study = load_study(args.study)
    resolve_flags(args, study)
    if args.gpu_per_seed or args.gpu_per_arm:
        if args.smoke:
            raise SystemExit("quality_study: --gpu-per-seed / --gpu-per-arm are for GPU machines "
                             "(--smoke runs on the CPU)")
        launch_argv = list(sys.argv[1:] if argv is None else argv)
        if args.gpu_per_arm:
            return launch_per_arm(args, launch_argv, resolve_seeds(args), GROUPS.get(args.variant, (args.variant,)))
        return launch_per_seed(args, launch_argv, resolve_seeds(args))
    if args.smoke:
        from mtraining_jax.train.cli import setup_platform

        setup_platform(2)
    from mtraining_jax.train.config import load_config

    os.makedirs(args.out, exist_ok=True)
    base = load_config(os.path.join(QUALITY, "dense.yaml"), SMOKE if args.smoke else [])
    seeds = resolve_seeds(args, base.seed)
    args.steps = resolve_steps(args, base, study)
    args.warm_start = check_warm_start(args.warm_start, args.steps)
    per_step = base.data.seq_len * base.data.batch_size * base.optim.grad_accum
    names = GROUPS.get(args.variant, (args.variant,))
    protocol = {"token_budget": args.steps * per_step, "steps": args.steps, "tokens_per_step": per_step,
                "arms": list(names), "seeds": seeds, "retrieval": retrieval_settings(args),
                "eval_haystack": args.eval_haystack, "train_overrides": args.train_overrides,
                "pretrain": dict(args.pretrain, seed=args.pretrain_seed) if args.pretrain["steps"] else None,
                "warm_start": args.warm_start or None}
    print(f"protocol: token budget {args.steps * per_step:,} tokens per arm and seed = {args.steps} steps x "
          f"{per_step} tokens; arms {', '.join(names)}; seeds {seeds} (each: init, data order, corpus); "
          f"retrieval mix {args.retrieval_mix:g}, up to {args.retrieval_keys} extra pairs per window in at most "
          f"{args.retrieval_share:g} of it, {'fresh' if args.fresh_retrieval else 'the same'} examples each epoch; "
          f"eval haystack {args.eval_haystack}; trainer overrides {args.train_overrides or 'none'}", flush=True)
    windows = max(2 * args.steps * base.data.batch_size * base.optim.grad_accum, 16) + 8
    recs, failed, sliced = [], 0, 0
    for seed in seeds:
        t0 = time.time()
        corpus = build_corpus(os.path.join(args.work, f"seed{seed}"), base.data.seq_len, windows, args.retrieval_mix,
                              seed, args.retrieval_keys, args.retrieval_tasks, args.retrieval_share, args.fresh_retrieval,
                              args.copy_share, args.made_up_keys)
        print(f"corpus of seed {seed}: {corpus['windows']} windows of {base.data.seq_len} tokens, "
              f"{corpus['retrieval_windows']} with retrieval ({corpus['pairs_per_window']:.1f} extra pairs each), "
              f"sha {corpus['sha']} ({time.time() - t0:.0f}s)", flush=True)
        stage, warm = "copy pretraining", None
        try:  # the seed's copy pretraining (none unless pretrain.steps > 0) and warm start, shared by its arms
            arm = (SMOKE + SMOKE_BACKENDS["dense"]) if args.smoke else []
            ps = seed if args.pretrain_seed is None else args.pretrain_seed
            pre = pretrain(args.pretrain, os.path.join(args.work, f"seed{ps}"), ps,
                           arm + [o.replace("{seed}", str(ps)) for o in args.train_overrides])
            stage = "warm start"
            if args.warm_start and not (pre and pre.get("stopped")):
                warm = warm_start(args, corpus, seed, pre, run_variant, evaluate_checkpoint)
        except Exception as e:
            traceback.print_exc()
            for name in names:
                rec = base_row(name, seed, args)
                rec.update(error=f"{stage}: {type(e).__name__}: {e}", **provenance_row(argv))
                with open(os.path.join(args.out, "quality.jsonl"), "a") as f:
                    f.write(json.dumps(rec) + "\n")
                failed += 1
            continue
        if pre and pre.get("stopped"):  # like a slice (--run-steps): the arms wait for the next call
            sliced += len(names)
            continue
        if args.pretrain_only:  # its curves alone (benchmarks/quality_pretrain_plot.py --rows OUT/pretrain.jsonl)
            with open(os.path.join(args.out, "pretrain.jsonl"), "a") as f:
                f.write(json.dumps(dict(arm="pretrain", seed=seed, pretrain=pre, warm_start=warm,
                                        **provenance_row(argv))) + "\n")
            continue
        for name in names:
            try:
                rec = run_variant(name, args, corpus, seed, pre, warm)
            except Exception as e:
                traceback.print_exc()
                rec = base_row(name, seed, args)
                rec.update(error=f"{type(e).__name__}: {e}", **provenance_row(argv))
                failed += 1
            if rec is None:  # a slice that ends before the schedule: nothing to report yet
                sliced += 1
                continue
            with open(os.path.join(args.out, "quality.jsonl"), "a") as f:
                f.write(json.dumps(rec) + "\n")
            if "error" not in rec:
                recs.append(rec)
    if recs:
        write_report(recs, args.out)
        print(open(os.path.join(args.out, "quality.md")).read())
    elif args.pretrain_only:
        print(f"copy pretraining rows: {os.path.join(args.out, 'pretrain.jsonl')}")
    elif sliced:
        print(f"{sliced} arm(s) stopped at the end of a slice (--run-steps): continue with --resume")
    else:
        print("no variant finished")
    if not args.child and os.path.exists(os.path.join(args.out, "quality.jsonl")):
        rows = read_rows([os.path.join(args.out, "quality.jsonl")])
        if rows:
            print(write_seed_report(rows, args.out, protocol))
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
