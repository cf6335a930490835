"""Dense vs MTraining (vs MSA) quality study: train the variants of configs/quality/ from scratch
(same seed, data, data order, steps), evaluate each in-process, and write a few small files.

    python benchmarks/quality_study.py --out results/quality               # GPU: dense + mtraining, one call
    python benchmarks/quality_study.py --out results/q --variant mtraining # one variant per call
    python benchmarks/quality_study.py --out results/q --variant msa       # MiniMax Sparse Attention
    python benchmarks/quality_study.py --out /tmp/q --smoke                # CPU toy sizes (CI)

MSA variant (``configs/quality/msa.yaml``): layers 1-11 MSA (top-16 of 64-token blocks, d_idx 64,
mean-pooled block keys), ``msa.kl_coef`` 1 (``--msa-kl-coef``), and an indexer warm-up of
``--msa-warmup-fraction`` of the run's steps (default 0.1, i.e. 50 of 500 steps). Why 0.1: the
paper (MSA §4, App. "Indexer Warmup") warms up for 40B tokens of its 400B-token continued
pretraining (10 %) and of its 3T-token pretraining from scratch (1.3 %), and motivates the warm-up
by the main branch's attention entropy collapsing "in the first few hundred steps"; in a 500-step
run from scratch 1.3 % would be 6 steps, far inside that phase, so the CPT ratio is used.

Data: this Python's standard-library sources (byte tokens, 5 % of files held out by path hash).
A fraction ``--retrieval-mix`` of the 32K training windows carries one synthetic retrieval task
(:mod:`mtraining_jax.eval.tasks`: passkey, multi-key, multi-value, variable tracking) embedded in
that window's code, so a small model trained for minutes can learn long-range retrieval at all;
the evaluation's examples come from a different seed. The held-out stream is plain code.

Evaluation per variant (:func:`mtraining_jax.eval.api.evaluate_params`): NIAH grid, RULER-style
tasks, held-out loss by position, index recall per layer and head at p = 0.9 / 0.5 on the trained
model's q/k (and on the untrained initialisation for contrast).

Outputs in ``--out`` (at most 6 files): ``quality.jsonl`` (one record per variant, appended as
soon as the variant is done: loss curve, held-out losses, timings, work fraction, every eval
result), ``quality.md`` (side-by-side table, both variants), ``loss_curves.png``,
``quality_niah.png``, ``quality_position_loss.png``, ``quality_recall.png``. A failing section
is recorded as an error and the study goes on. Run dirs (no checkpoints) go to ``--work``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUALITY = os.path.join(ROOT, "configs", "quality")
VARIANTS = ("dense", "mtraining", "msa")
GROUPS = {"both": ("dense", "mtraining"), "all": VARIANTS}  # --variant names of several variants
TRAIN_TASKS = ("passkey", "multikey", "multivalue", "vartrack")
SMOKE = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=2", "model.num_heads=2",
         "model.num_kv_heads=1", "model.dtype=float32", "data.seq_len=512", "steps=2", "optim.warmup_steps=1",
         "eval.every=2", "eval.batches=1", "loss_chunk_size=512", "mesh.shape=[1,2]", "logging.progress=false"]
SMOKE_BACKENDS = {"dense": ["model.attention_backend=ring"], "mtraining": ["model.dense_backend=ring"],
                  "msa": ["model.dense_backend=ring", "model.msa.top_k=3", "model.msa.index_dim=8"]}
MSA_WARMUP_FRACTION = 0.1  # of the run's steps (module docstring)


def build_corpus(work: str, seq_len: int, windows: int, mix: float, seed: int):
    """``(train.npy, heldout.npy)``: ``windows`` training windows of ``seq_len`` stdlib tokens, a
    fraction ``mix`` of them holding a retrieval task built into their own code; plain held-out."""
    import numpy as np

    from mtraining_jax.eval.tasks import GENERATORS
    from mtraining_jax.train.data import stdlib_streams
    from mtraining_jax.train.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    train, held = stdlib_streams(tok)
    n = min(windows, len(train) // seq_len)
    blocks = np.asarray(train[:n * seq_len], np.int32).reshape(n, seq_len).copy()
    rng = np.random.default_rng([seed, 20240518])
    for w in np.nonzero(rng.random(n) < mix)[0]:
        task = TRAIN_TASKS[int(rng.integers(len(TRAIN_TASKS)))]
        blocks[w] = GENERATORS[task](tok, seq_len - 1, float(rng.uniform()), rng, stream=blocks[w]).tokens
    os.makedirs(work, exist_ok=True)
    paths = os.path.join(work, "train_tokens.npy"), os.path.join(work, "heldout_tokens.npy")
    np.save(paths[0], blocks.reshape(-1).astype(np.uint16))
    np.save(paths[1], np.asarray(held, np.uint16))
    return paths, int(n)


def eval_spec(smoke: bool, seq_len: int, recall_ps=(0.9, 0.5)):
    from mtraining_jax.eval.api import EvalSpec

    recall_ps = tuple(recall_ps)
    if smoke:
        return EvalSpec(lengths=(seq_len,), depths=(0.0, 1.0), samples=1, ruler_tasks=("multikey",),
                        ruler_samples=1, ppl_windows=2, ppl_buckets=4, recall_ps=recall_ps, recall_rows=16)
    lengths = tuple(n for n in (4096, 8192, 16384, 32768) if n <= seq_len)
    return EvalSpec(lengths=lengths, depths=(0.0, 0.25, 0.5, 0.75, 1.0), samples=4,
                    ruler_tasks=("multikey", "multivalue", "vartrack"), ruler_samples=4, ppl_windows=8,
                    ppl_buckets=16, recall_ps=recall_ps, recall_rows=512)


def run_variant(name: str, args, corpus) -> dict:
    """Train and evaluate one variant; every section's failure is recorded, not raised."""
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

    over = [f"run_dir={os.path.join(args.work, name)}", f"data.path={corpus[0]}", f"data.eval_path={corpus[1]}"]
    if args.smoke:
        over += SMOKE + SMOKE_BACKENDS[name]
    if args.steps:
        over.append(f"steps={args.steps}")
    if args.seed is not None:
        over.append(f"seed={args.seed}")
    if name == "msa":
        steps = args.steps or load_config(os.path.join(QUALITY, "msa.yaml"), over).steps
        over.append(f"msa.warmup_steps={msa_warmup_steps(steps, args.msa_warmup_fraction)}")
        if args.msa_kl_coef is not None:
            over.append(f"msa.kl_coef={args.msa_kl_coef}")
    cfg = load_config(os.path.join(QUALITY, f"{name}.yaml"), over)
    rec = {"variant": name, "steps": cfg.steps, "seq_len": cfg.data.seq_len, "retrieval_mix": args.retrieval_mix,
           "seed": cfg.seed}
    t0 = time.time()
    result = run(cfg)
    rec["train_seconds"] = time.time() - t0
    rows = [m for m in read_metrics(os.path.join(cfg.run_dir, "metrics.jsonl")) if "loss" in m]
    train_rows = [m for m in rows if m.get("split", "train") == "train"]
    rec["train_loss"] = [[int(m["step"]), float(m["loss"])] for m in train_rows]
    rec["heldout_loss"] = [[int(e["step"]), float(e["loss"])] for e in result.eval_metrics if "loss" in e]
    tps = [m["tokens_per_s"] for m in train_rows[len(train_rows) // 4:] if "tokens_per_s" in m]
    rec["tokens_per_s"] = float(np.median(tps)) if tps else None
    wf = [m["attn/work_fraction"] for m in train_rows if "attn/work_fraction" in m]
    rec["work_fraction"] = float(np.mean(wf)) if wf else 1.0
    if name == "msa":
        rec["msa"] = msa_summary(cfg, train_rows)
    print(f"[{name}] trained {cfg.steps} steps in {rec['train_seconds']:.0f}s, last loss "
          f"{rec['train_loss'][-1][1] if rec['train_loss'] else float('nan'):.4f}", flush=True)
    _, model_cfg = build_model_config(cfg.model, cfg.config_dir)
    if name == "msa":
        rec["msa"]["config"] = dict(model_cfg.msa or {})
    mesh, tok = build_mesh(cfg.mesh), load_tokenizer(cfg.data.tokenizer)
    held = np.asarray(token_file_stream(corpus[1]))
    spec = eval_spec(args.smoke, cfg.data.seq_len, args.recall_ps)
    t0 = time.time()
    try:
        rec["eval"] = evaluate_params(model_cfg, result.params, tok, spec, mesh=mesh, heldout=held, label=name)
    except Exception as e:  # keep the training record
        traceback.print_exc()
        rec["eval_error"] = f"{type(e).__name__}: {e}"
    try:
        S = spec.perplexity_len
        init = split_model(Qwen2ForCausalLM, model_cfg, cfg.seed)[1]()
        rec["recall_untrained"] = index_recall(model_cfg, init, held[None, :S], spec.recall_ps, mesh, spec.recall_rows)
    except Exception as e:
        traceback.print_exc()
        rec["recall_untrained_error"] = f"{type(e).__name__}: {e}"
    if args.cross_eval and set(model_cfg.layer_backends) != {args.cross_eval}:
        try:
            rec["cross_eval"] = cross_eval(model_cfg, result.params, tok, spec, mesh, held, args.cross_eval,
                                           retrieval=not args.cross_eval_loss_only)
        except Exception as e:
            traceback.print_exc()
            rec["cross_eval_error"] = f"{type(e).__name__}: {e}"
    if args.recall_budgets:
        try:
            rec["recall_budgets"] = budget_sweep(model_cfg, result.params, held[None, :spec.perplexity_len], mesh,
                                                 args.recall_budgets, spec.recall_rows)
        except Exception as e:
            traceback.print_exc()
            rec["recall_budgets_error"] = f"{type(e).__name__}: {e}"
    rec["eval_seconds"] = time.time() - t0
    print(f"[{name}] evaluated in {rec['eval_seconds']:.0f}s", flush=True)
    return rec


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


def parse_budgets(text: str) -> list:
    """``"vertical_max=8192,slash_max=128;last_q=256"`` -> ``[{"vertical_max": 8192, ...}, {...}]``
    (``;`` between budgets, ``,`` between fields; an empty budget is the model's own)."""
    out = []
    for part in text.split(";"):
        b = {}
        for kv in filter(None, (t.strip() for t in part.split(","))):
            k, sep, v = kv.partition("=")
            if not sep:
                raise argparse.ArgumentTypeError(f"budget field {kv!r} is not NAME=VALUE")
            try:
                b[k.strip()] = float(v) if "." in v else int(v)
            except ValueError:
                raise argparse.ArgumentTypeError(f"budget field {kv!r}: {v!r} is not a number") from None
        out.append(b)
    return out


def cross_eval(model_cfg, params, tok, spec, mesh, held, backend: str, retrieval: bool = True) -> dict:
    """The trained parameters evaluated with ``backend`` attention in EVERY layer (e.g. a model
    trained with sparse attention, read with dense attention): held-out loss by position and the
    retrieval sections of ``spec`` unless ``retrieval=False``. Shows whether what the model learned
    holds without the sparse pattern (whose index is estimated from the window's last queries)."""
    import dataclasses

    from mtraining_jax.eval.api import evaluate_params

    cfg = dataclasses.replace(model_cfg, attention_backends=(backend,) * model_cfg.num_layers)
    spec = dataclasses.replace(spec, recall_ps=(), ppl_len=spec.perplexity_len,
                               **({} if retrieval else {"lengths": ()}))
    res = evaluate_params(cfg, params, tok, spec, mesh=mesh, heldout=held, label=f"as {backend}", progress=False)
    out = {"backend": backend, "eval": res}
    print(f"  read with {backend} attention in every layer: held-out loss "
          f"{res['perplexity']['mean_loss']:.4f}", flush=True)
    return out


def budget_sweep(model_cfg, params, window, mesh, budgets, rows: int, p: float = 0.9) -> list:
    """Index recall / density at top-p ``p`` under each budget (SparsityConfig overrides) on the
    trained model's q/k of one held-out ``window [1, S]`` (q/k captured once)."""
    from mtraining_jax.eval.recall import index_recall, layer_qk

    qs, ks, _ = layer_qk(model_cfg, params, window, mesh)
    out = []
    for b in budgets:
        r = index_recall(model_cfg, None, None, (p,), num_rows=rows, qk=(qs, ks), budgets=b)
        key = f"{p:g}"
        out.append({"budget": b, "p": p, "mean_recall": r["mean_recall"][key], "min_recall": r["min_recall"][key],
                    "mean_density": r["mean_density"][key],
                    "layer_recall": [float(sum(h) / len(h)) for h in r["recall"][key]],
                    "layer_density": [float(sum(h) / len(h)) for h in r["density"][key]]})
        print(f"  recall p={p:g} {b or 'model budgets'}: mean {out[-1]['mean_recall']:.3f} "
              f"min {out[-1]['min_recall']:.3f} density {out[-1]['mean_density']:.3f}", flush=True)
    return out


def cross_table(recs) -> str:
    """Markdown: each variant's held-out loss with its own attention and read with another."""
    rows = [r for r in recs if "cross_eval" in r and "eval" in r]
    if not rows:
        return ""
    lines = ["| variant | own attention: held-out loss | read with | held-out loss | difference |", "|---|---|---|---|---|"]
    for r in rows:
        own = r["eval"]["perplexity"]["mean_loss"]
        other = r["cross_eval"]["eval"]["perplexity"]["mean_loss"]
        lines.append(f"| {r['variant']} | {own:.4f} | {r['cross_eval']['backend']} (every layer) | {other:.4f} "
                     f"| {other - own:+.4f} |")
    return "\n".join(lines) + "\n"


def budget_table(recs) -> str:
    """Markdown: the recall budget sweep of each variant."""
    lines = ["| variant | budget (SparsityConfig overrides) | p | mean recall | min head | mean density |",
             "|---|---|---|---|---|---|"]
    for r in recs:
        for b in r.get("recall_budgets", []):
            name = ", ".join(f"{k}={v}" for k, v in b["budget"].items()) or "model's own"
            lines.append(f"| {r['variant']} | {name} | {b['p']:g} | {b['mean_recall']:.3f} | {b['min_recall']:.3f} "
                         f"| {b['mean_density']:.3f} |")
    return "\n".join(lines) + "\n" if len(lines) > 2 else ""


def training_table(recs) -> str:
    """Markdown: training-side numbers per variant."""
    lines = ["| variant | steps | train s | tokens/s | work fraction | final train loss | held-out loss (trainer) "
             "| untrained recall p=0.9 |", "|---|---|---|---|---|---|---|---|"]
    for r in recs:
        last = r["train_loss"][-1][1] if r["train_loss"] else float("nan")
        held = r["heldout_loss"][-1][1] if r["heldout_loss"] else float("nan")
        ur = r.get("recall_untrained", {}).get("mean_recall", {}).get("0.9", float("nan"))
        tps = r["tokens_per_s"] or float("nan")
        lines.append(f"| {r['variant']} | {r['steps']} | {r['train_seconds']:.0f} | {tps:.0f} | {r['work_fraction']:.3f} "
                     f"| {last:.4f} | {held:.4f} | {ur:.3f} |")
    return "\n".join(lines) + "\n"


def msa_table(recs) -> str:
    """Markdown: the MSA variant's schedule and its index-branch metrics over the sparse steps' last half."""
    rows = [r for r in recs if "msa" in r]
    if not rows:
        return ""
    fmt = lambda v, f: "—" if v is None else format(v, f)  # noqa: E731
    lines = ["| variant | warm-up steps | KL coef | KL (sparse, last half) | KL grad norm (last step) "
             "| recall of main mass (sparse, last half) | work fraction (sparse) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        m = r["msa"]
        gn = m["kl_grad_norm"][-1][1] if m["kl_grad_norm"] else None
        lines.append(f"| {r['variant']} | {m['warmup_steps']} | {m['kl_coef']:g} | {fmt(m['kl_sparse_mean'], '.4f')} "
                     f"| {fmt(gn, '.3e')} | {fmt(m['recall_sparse_mean'], '.3f')} "
                     f"| {fmt(m['work_fraction_sparse_mean'], '.3f')} |")
    return "\n".join(lines) + "\n"


def write_report(recs, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mtraining_jax.eval.compare import compare_results

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for r in recs:
        if r["train_loss"]:
            s, l = zip(*r["train_loss"])
            ax.plot(s, l, label=f"{r['variant']} train", lw=1)
        if r["heldout_loss"]:
            s, l = zip(*r["heldout_loss"])
            ax.plot(s, l, "o--", label=f"{r['variant']} held-out", ms=4)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "loss_curves.png"), dpi=110)
    plt.close(fig)
    runs = [(r["variant"], r["eval"]) for r in recs if "eval" in r]
    if runs:
        compare_results(runs, out, prefix="quality", sections=("niah", "perplexity", "recall"))
    with open(os.path.join(out, "quality.md"), "a" if runs else "w") as f:
        f.write("\n" + training_table(recs) + "\n" + msa_table(recs) + "\n" + cross_table(recs) + "\n"
                + budget_table(recs))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for the (<= 6) result files")
    p.add_argument("--variant", choices=tuple(GROUPS) + VARIANTS, default="both",
                   help="both: dense + mtraining; all: dense + mtraining + msa")
    p.add_argument("--msa-warmup-fraction", type=float, default=MSA_WARMUP_FRACTION,
                   help="msa variant: indexer warm-up (dense attention + full-support KL) as a fraction of the steps")
    p.add_argument("--msa-kl-coef", type=float, help="msa variant: KL coefficient (default: configs/quality/msa.yaml)")
    p.add_argument("--work", default=os.path.join("runs", "quality"), help="run dirs and the token files")
    p.add_argument("--steps", type=int, help="override the configs' steps")
    p.add_argument("--retrieval-mix", type=float, default=0.5, help="fraction of training windows with a task")
    p.add_argument("--smoke", action="store_true", help="CPU toy sizes (2 virtual devices)")
    p.add_argument("--seed", type=int, help="model initialisation seed of both variants (default: the configs')")
    p.add_argument("--recall-ps", type=lambda t: [float(x) for x in t.split(",") if x], default=[0.9, 0.5],
                   help="top-p budgets of the index recall (comma-separated; a budget sweep)")
    p.add_argument("--cross-eval", metavar="BACKEND",
                   help="also evaluate each trained model with this attention backend in every layer "
                        "(e.g. cudnn: the sparse-trained model read with dense attention)")
    p.add_argument("--cross-eval-loss-only", action="store_true", help="--cross-eval: held-out loss only")
    p.add_argument("--recall-budgets", type=parse_budgets, default=[],
                   help="index budgets of a recall sweep at p = 0.9 on the trained model, ';'-separated, each "
                        "','-separated SparsityConfig fields, e.g. ';vertical_max=16384,slash_max=256;last_q=256' "
                        "(an empty entry: the model's own budgets)")
    args = p.parse_args(argv)
    if args.smoke:
        from mtraining_jax.train.cli import _setup_platform

        _setup_platform(2)
    import numpy as np  # noqa: F401

    from mtraining_jax.train.config import load_config

    os.makedirs(args.out, exist_ok=True)
    base = load_config(os.path.join(QUALITY, "dense.yaml"), SMOKE if args.smoke else [])
    steps = args.steps or base.steps
    windows = max(2 * steps * base.data.batch_size, 16) + 8
    t0 = time.time()
    corpus, n = build_corpus(args.work, base.data.seq_len, windows, args.retrieval_mix, base.data.seed)
    print(f"corpus: {n} windows of {base.data.seq_len} tokens ({time.time() - t0:.0f}s)", flush=True)
    recs = []
    names = GROUPS.get(args.variant, (args.variant,))
    for name in names:
        try:
            rec = run_variant(name, args, corpus)
        except Exception as e:
            traceback.print_exc()
            rec = {"variant": name, "error": f"{type(e).__name__}: {e}"}
        with open(os.path.join(args.out, "quality.jsonl"), "a") as f:
            f.write(json.dumps(rec) + "\n")
        if "error" not in rec:
            recs.append(rec)
    if recs:
        write_report(recs, args.out)
    print(open(os.path.join(args.out, "quality.md")).read() if recs else "no variant finished")
    return 0 if len(recs) == len(names) else 1


if __name__ == "__main__":
    sys.exit(main())
