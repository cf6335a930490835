"""Can this repo's trainer teach a SMALL model to copy key-value answers from context (CPU)?

Trains through ``mtraining_jax.train.cli.main`` (``--config configs/quality/dense.yaml`` + overrides) on a
``benchmarks.quality_corpus.build_corpus`` corpus in which every window carries retrieval lookups, saves
checkpoints every ``--ckpt-every`` steps, then scores every checkpoint on HELD-OUT lookups of the same
format (teacher-forced argmax over the answer digits):

* ``pairs``: held-out code windows built by the same ``retrieval_window`` (other seed, held-out code),
  every extra pair's answer in "What is the special magic number for KEY? The special magic number
  for KEY is: 123456." plus the window's task answer at the end;
* ``multikey``: ``mtraining_jax.eval.tasks.make_example("multikey", ...)`` (the evaluation's examples;
  4 needles, one asked), held-out code haystack.

    /tmp/venv/bin/python benchmarks/copy_learnability.py --work /tmp/copy1 --steps 1500 --ckpt-every 300
    /tmp/venv/bin/python benchmarks/copy_learnability.py --work /tmp/copy1 --eval-only     # re-score

``--repeat``: the sanity experiment instead (windows = a random byte string repeated twice; the loss on
the second half must go to ~0 if labels/positions/mask are right).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from benchmarks.quality_corpus import build_induction_corpus, induction_windows  # noqa: E402,F401

DIGITS = set(range(ord("0"), ord("9") + 1))


def build_repeat_corpus(work, S, windows, seed):
    """Windows of S tokens: a random lowercase string of S/2 bytes, then the same again."""
    rng = np.random.default_rng(seed)
    h = S // 2
    first = rng.integers(ord("a"), ord("z") + 1, size=(windows, h))
    blocks = np.concatenate([first, first], 1).astype(np.uint16)
    os.makedirs(work, exist_ok=True)
    paths = os.path.join(work, "train_tokens.npy"), os.path.join(work, "heldout_tokens.npy")
    np.save(paths[0], blocks.reshape(-1))
    first = np.random.default_rng(seed + 1).integers(ord("a"), ord("z") + 1, size=(64, h))
    np.save(paths[1], np.concatenate([first, first], 1).astype(np.uint16).reshape(-1))
    return {"paths": paths, "windows": windows}


def induction_score(predict, S, seed, alphabet=26):
    """Accuracy / nll on the copied tokens of held-out induction windows (and on the rest)."""
    toks, mask = induction_windows(S + 1, 16, np.random.default_rng([seed, 4242]), alphabet=alphabet)
    pred, nll = predict(toks[:, :-1], toks[:, 1:])
    m = mask[:, 1:]
    return {"copied_acc": float((pred == toks[:, 1:])[m].mean()), "copied_nll": float(nll[m].mean()),
            "other_nll": float(nll[~m].mean())}


def overrides(a, paths):
    return [f"run_dir={os.path.join(a.work, 'run')}", f"data.path={paths[0]}", f"data.eval_path={paths[1]}",
            f"model.hidden_size={a.hidden}", f"model.intermediate_size={4 * a.hidden}",
            f"model.num_layers={a.layers}", f"model.num_heads={a.heads}", f"model.num_kv_heads={a.kv_heads}",
            "model.dtype=float32", "model.attention_backend=" + a.backend, f"model.max_position_embeddings={a.seq_len}",
            f"data.seq_len={a.seq_len}", f"data.batch_size={a.batch}", f"steps={a.steps}",
            f"optim.lr={a.lr}", "optim.warmup_steps=50", f"loss_chunk_size={a.seq_len}", "mesh.shape=[1,1]",
            f"checkpoint.every={a.ckpt_every}", "checkpoint.keep=100", "checkpoint.async_save=false",
            "eval.every=100", "eval.batches=2", "logging.every=10", "logging.progress=false",
            f"seed={a.seed}", f"data.seed={a.seed}"]


def digit_positions(toks):
    """Label positions t (into toks[:-1]) whose target toks[t+1] is an answer digit of a lookup:
    the 6 digits after every 'The special magic number for KEY is: ' that follows a question '?',
    and the digits after the final question of the task. Returns list of lists (one per answer)."""
    text = bytes(int(t) if t < 256 else 0 for t in toks).decode("latin-1")
    answers = []
    for m in re.finditer(r"\? The special magic numbers? for \w+ (?:is|are): ?([0-9]+)", text):
        s = m.start(1)
        answers.append([s + i - 1 for i in range(len(m.group(1)))])
    for m in re.finditer(r"What is the pass key\? The pass key is ([0-9]+)", text):
        s = m.start(1)
        answers.append([s + i - 1 for i in range(len(m.group(1)))])
    return answers


def heldout_pairs(tok, S, n, seed, task_weights, keys, share, held):
    from benchmarks.quality_corpus import retrieval_window

    rng = np.random.default_rng([seed, 777])
    names = list(task_weights)
    out = []
    for _ in range(n):
        at = int(rng.integers(0, len(held) - S - 1))
        task = names[int(rng.integers(len(names)))]
        w, _ = retrieval_window(tok, S + 1, task, rng, np.asarray(held[at:at + S + 1]).astype(np.int32), keys, share)
        out.append(np.asarray(w, np.int32))
    return out


def score(predict, wins, batch=8):
    """(whole-answer accuracy, per-digit accuracy, n answers, mean answer-digit nll)."""
    whole, dig, nlls = [], [], []
    for i in range(0, len(wins), batch):
        chunk = np.stack(wins[i:i + batch])
        pred, nll = predict(chunk[:, :-1], chunk[:, 1:])
        for b, w in enumerate(chunk):
            for pos in digit_positions(w):
                pos = [p for p in pos if p < len(w) - 1]
                hit = pred[b, pos] == w[1:][pos]
                whole.append(bool(hit.all()))
                dig += list(hit)
                nlls += list(nll[b, pos])
    return float(np.mean(whole)), float(np.mean(dig)), len(whole), float(np.mean(nlls))


def repeat_score(predict, held, S):
    wins = np.asarray(held[: (len(held) // S) * S]).reshape(-1, S)[:16]
    wins = np.concatenate([wins, wins[:, :1]], 1).astype(np.int32)  # S+1 (last label = next window start)
    pred, nll = predict(wins[:, :-1], wins[:, 1:])
    h = S // 2
    sl = slice(h, S - 1)
    return {"first_half_nll": float(nll[:, :h - 1].mean()), "second_half_nll": float(nll[:, sl].mean()),
            "second_half_acc": float((pred[:, sl] == wins[:, 1:][:, sl]).mean())}


def evaluate(a):
    import jax

    from mtraining_jax.eval.checkpoints import load_for_eval
    from mtraining_jax.eval.predictor import ModelPredictor
    from mtraining_jax.eval.tasks import make_example
    from mtraining_jax.model.qwen2 import Qwen2ForCausalLM
    from mtraining_jax.train.data import token_file_stream
    from mtraining_jax.train.metrics import read_metrics
    from mtraining_jax.train.state import split_model
    from mtraining_jax.train.tokenizer import ByteTokenizer

    run_dir = os.path.join(a.work, "run")
    ck = os.path.join(run_dir, "checkpoints")
    steps = sorted(int(n) for n in os.listdir(ck) if n.isdigit())
    held = np.asarray(token_file_stream(os.path.join(a.work, "heldout_tokens.npy")))
    tok, S = ByteTokenizer(), a.seq_len
    rows = [m for m in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "loss" in m]
    tr = {int(m["step"]): float(m["loss"]) for m in rows if m.get("split", "train") == "train"}
    ev = {int(m["step"]): float(m["loss"]) for m in rows if m.get("split") == "eval"}
    if not (a.repeat or a.induction):
        tw = json.loads(a.tasks)
        pairs = heldout_pairs(tok, S, a.eval_windows, a.seed + 1000, tw, a.keys, a.share, held)
        mk = [make_example("multikey", tok, S, float(d), 4242, c, s, stream=held).tokens
              for c, d in enumerate(np.linspace(0, 1, 5)) for s in range(a.eval_windows // 5)]
    results = []
    from benchmarks._driver import provenance

    prov = provenance()  # on every row of copy_eval.json
    first = load_for_eval(os.path.join(ck, str(steps[0])))
    from mtraining_jax.train.loop import build_mesh

    pr = ModelPredictor(first.config, first.params, mesh=build_mesh(first.train_config.mesh))
    # step 0: the random initialisation, unless the run started from other weights (model.init_from)
    init = [] if first.train_config.model.init_from else [(0, split_model(Qwen2ForCausalLM, first.config, a.seed)[1]())]
    for step, params in init + [(s, None) for s in steps]:
        if params is None:
            params = load_for_eval(os.path.join(ck, str(step))).params
        pr.set_params(jax.device_get(params))
        r = {"step": step, "train_loss": tr.get(step), "heldout_loss": ev.get(step)}
        if a.induction:
            r.update(induction_score(pr, S, a.seed, a.alphabet))
        elif a.repeat:
            r.update(repeat_score(pr, held, S))
        else:
            r["pairs_whole"], r["pairs_digit"], r["pairs_n"], r["pairs_digit_nll"] = score(pr, pairs)
            r["multikey_whole"], r["multikey_digit"], r["multikey_n"], r["multikey_digit_nll"] = score(pr, mk)
        results.append({**r, **prov})
        print(json.dumps(r), flush=True)
    with open(os.path.join(a.work, "copy_eval.json"), "w") as f:
        json.dump(results, f, indent=1)
    return results


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--work", required=True)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--ckpt-every", type=int, default=300)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--windows", type=int, help="training windows built (default steps x batch: no window repeats)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--keys", type=int, default=8)
    p.add_argument("--share", type=float, default=0.6)
    p.add_argument("--copy-share", type=float, default=0.0)
    p.add_argument("--tasks", default='{"passkey": 1.0}')
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="ring")
    p.add_argument("--eval-windows", type=int, default=40)
    p.add_argument("--eval-only", action="store_true")
    p.add_argument("--repeat", action="store_true", help="sanity: random string repeated twice")
    p.add_argument("--induction", action="store_true",
                   help="random strings with spans copied to random later places (content-based copying)")
    p.add_argument("--alphabet", type=int, choices=(26, 256), default=26, help="--induction: letters or bytes")
    p.add_argument("--extra", nargs="*", default=[], help="more trainer overrides")
    a = p.parse_args()
    if not a.eval_only:
        t0 = time.time()
        if a.induction:
            info = build_induction_corpus(a.work, a.seq_len, a.windows or a.steps * a.batch, a.seed, a.alphabet,
                                          held_windows=max(64, 2 * a.batch + 2))
        elif a.repeat:
            info = build_repeat_corpus(a.work, a.seq_len, a.steps * a.batch, a.seed)
        else:
            from benchmarks.quality_corpus import build_corpus

            info = build_corpus(a.work, a.seq_len, a.steps * a.batch, 1.0, a.seed, keys=a.keys,
                                task_weights=json.loads(a.tasks), share=a.share, fresh=True, copy_share=a.copy_share)
        print("corpus", {k: v for k, v in info.items() if k != "paths"}, f"{time.time() - t0:.0f}s", flush=True)
        from mtraining_jax.train.cli import main as train_main

        t0 = time.time()
        rc = train_main(["--config", os.path.join(ROOT, "configs/quality/dense.yaml"), "--overwrite",
                         *overrides(a, info["paths"]), *a.extra])
        print(f"trainer rc={rc} wall {time.time() - t0:.0f}s", flush=True)
        if rc:
            return rc
    t0 = time.time()
    evaluate(a)
    print(f"eval wall {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
