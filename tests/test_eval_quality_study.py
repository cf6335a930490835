"""benchmarks/quality_study.py: the multi-seed protocol (seeds set initialisation, data order and
corpus; token budget; retrieval in the training mix), the report of committed runs (the statistics
themselves: test_quality_seeds.py; the launchers: test_quality_launch.py), and --smoke runs at toy size on
CPU that train and evaluate the arms and write their result files (the GPU study is the same code at
configs/quality sizes)."""

import json
import os
import re
from types import SimpleNamespace

import jax
import numpy as np
import pytest
import yaml

from benchmarks import quality_corpus, quality_protocol, quality_study

pytestmark = pytest.mark.usefixtures("jax_compilation_cache")  # the arms and seeds share compiled steps


@pytest.mark.slow(seconds=29)
def test_quality_study_msa_smoke(tmp_path):
    """The MSA variant: warm-up steps from --msa-warmup-fraction, the KL coefficient override, its
    index-branch metrics per step and the MSA table; evaluated with its own (msa) layers."""
    out = str(tmp_path / "out")
    rc = quality_study.main(["--out", out, "--work", str(tmp_path / "work"), "--smoke", "--variant", "msa",
                             "--steps", "3", "--msa-warmup-fraction", "0.34", "--msa-kl-coef", "0.5", "--recall-ps", "0.9"])
    assert rc == 0
    (rec,) = [json.loads(line) for line in open(os.path.join(out, "quality.jsonl"))]
    m = rec["msa"]
    assert m["warmup_steps"] == 1 and m["kl_coef"] == 0.5 and m["config"]["top_k"] == 3
    assert [w for _, w in m["warmup"]] == [1.0, 0.0, 0.0]
    assert [w for _, w in m["work_fraction"]][0] == 1.0 and 0 < m["work_fraction_sparse_mean"] < 1
    assert all(v > 0 for _, v in m["kl"]) and all(v > 0 for _, v in m["kl_grad_norm"])
    assert 0 < m["recall_sparse_mean"] <= 1
    assert rec["eval"]["model"]["backends"] == ["ring", "msa"] and np.isfinite(rec["eval"]["perplexity"]["mean_loss"])
    # the study's default cross-read (eval.cross_eval: cudnn; ring at --smoke sizes): dense attention in every layer
    assert rec["cross_eval"]["backend"] == "ring" and rec["cross_eval"]["eval"]["model"]["backends"] == ["ring", "ring"]
    assert np.isfinite(rec["cross_eval"]["eval"]["perplexity"]["mean_loss"])
    md = open(os.path.join(out, "quality.md")).read()
    assert "| msa | 1 | 0.5 |" in md
    assert quality_study.msa_warmup_steps(500, 0.1) == 50 and quality_study.msa_warmup_steps(500, 0.0) == 0


# ----------------------------------------------------------------------------------- multi-seed study


def test_seed_sets_initialisation_data_order_and_corpus(tmp_path):
    """The study's seed reaches the model initialisation (``seed``), the loader's order (``data.seed``)
    and the corpus' retrieval examples; the same seed reproduces all three."""
    from mtraining_jax.model.qwen2 import Qwen2ForCausalLM
    from mtraining_jax.train import data as data_lib
    from mtraining_jax.train.config import load_config
    from mtraining_jax.train.state import build_model_config, split_model
    from mtraining_jax.train.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    corpora = {s: quality_corpus.build_corpus(str(tmp_path / f"s{s}"), 512, 24, 1.0, s, 16) for s in (0, 1)}
    again = quality_corpus.build_corpus(str(tmp_path / "again"), 512, 24, 1.0, 0, 16)
    assert again["sha"] == corpora[0]["sha"] != corpora[1]["sha"]
    stream = data_lib.token_file_stream(corpora[0]["paths"][0])

    def first(seed):
        over = quality_study.SMOKE + [f"data.path={corpora[0]['paths'][0]}"] + quality_study.seed_overrides(seed)
        cfg = load_config(os.path.join(quality_study.QUALITY, "dense.yaml"), over)
        assert cfg.seed == cfg.data.seed == seed
        batch = next(data_lib.build_train_loader(cfg.data, tok, None, stream, accum=None))
        _, model_cfg = build_model_config(cfg.model, cfg.config_dir)
        init = split_model(Qwen2ForCausalLM, model_cfg, cfg.seed)[1]()
        return np.asarray(batch.tokens), np.concatenate([np.ravel(x) for x in jax.tree.leaves(init)])

    (b0, p0), (b1, p1), (b0b, p0b) = first(0), first(1), first(0)
    assert not np.array_equal(b0, b1) and not np.array_equal(p0, p1)  # both differ between seeds
    assert np.array_equal(b0, b0b) and np.array_equal(p0, p0b)  # and repeat for one seed


END = {"passkey": r"What is the pass key\? The pass key is \d{5}$", "multikey": r"special magic number for \w+ is: \d{6}$",
       "multivalue": r"numbers for \w+ are: \d{6}(, \d{6}){3}$", "vartrack": r"Answer: they are( [A-Z]{5}){5}$"}


def test_retrieval_window_formats():
    """A retrieval window: the task's example at the end, the extra key-value pairs (needle before its
    question, the evaluation's multi-key wording) inside, the window's length kept; keys=0 is the
    first study's single example."""
    from mtraining_jax.eval import tasks
    from mtraining_jax.train.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    code = np.resize(tok.encode("def f(x):\n    return x + 1\n"), 8192).astype(np.int32)
    for task in quality_corpus.TRAIN_TASKS:
        toks, pairs = quality_corpus.retrieval_window(tok, 8192, task, np.random.default_rng(3), code, 8)
        assert len(toks) == 8192 and pairs == 8
        text = tok.decode(toks)
        qs = list(re.finditer(r"What is the special magic number for (\w+)\? The special magic number for \1 is: "
                              r"(\d{6})\. ", text))
        assert len(qs) == pairs
        for m in qs:  # each extra question after its needle, with the needle's number
            assert text.find(f" The special magic number for {m[1]} is: {m[2]}. ") < m.start(), (task, m[1])
        assert re.search(END[task], text), (task, text[-120:])  # the task's own question and answer last
    few, pairs = quality_corpus.retrieval_window(tok, 1024, "passkey", np.random.default_rng(0), code[:1024], 16)
    assert len(few) == 1024 and 0 < pairs < 16  # at most a quarter of the window
    old, _ = quality_corpus.retrieval_window(tok, 1024, "vartrack", np.random.default_rng(5), code[:1024], 0)
    rng = np.random.default_rng(5)
    assert np.array_equal(old, tasks.vartrack(tok, 1023, float(rng.uniform()), rng, stream=code[:1024]).tokens)


def test_retrieval_keys_beyond_the_word_list():
    """More extra pairs than the evaluation has words: made-up keys fill the rest (the word list alone
    capped a window at 20 pairs whatever ``keys`` asked for), every key distinct and answered with
    its own needle's number; ``share`` caps them."""
    from mtraining_jax.eval import tasks
    from mtraining_jax.train.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    code = np.resize(tok.encode("def f(x):\n    return x + 1\n"), 32768).astype(np.int32)
    toks, pairs = quality_corpus.retrieval_window(tok, 32768, "passkey", np.random.default_rng(1), code, 120, 0.6)
    assert pairs == 120 > len(tasks.WORDS)
    text = tok.decode(toks)
    needles = dict(re.findall(r" The special magic number for (\w+) is: (\d{6})\. ", text))
    answers = re.findall(r"What is the special magic number for (\w+)\? The special magic number for \1 is: (\d{6})\. ", text)
    assert len(answers) == 120 and len({k for k, _ in answers}) == 120
    assert all(needles[k] == v for k, v in answers)
    names = quality_corpus.key_names(np.random.default_rng(0), ["apple", "river"], 30)
    assert names[:2] == ["apple", "river"] and len(set(names)) == 30
    _, capped = quality_corpus.retrieval_window(tok, 32768, "passkey", np.random.default_rng(1), code, 120, 0.25)
    assert 0 < capped < 120 and capped * 140 <= 0.25 * 32768
    short = code[:512]
    for task in quality_corpus.TRAIN_TASKS:  # a short window: the pairs yield the task its room
        toks, _ = quality_corpus.retrieval_window(tok, 512, task, np.random.default_rng(2), short, 40, 0.6)
        assert len(toks) == 512 and re.search(END[task], tok.decode(toks)), task


def test_words_only_keys_rebuild_the_s8_corpora():
    """``made_up_keys=False`` (``--no-made-up-keys``): the extra keys come from the evaluation's words
    only and no made-up name is drawn, so the random stream (every later number, depth and task) is
    the one the s8 study's corpora were built from; with made-up keys the same seed diverges."""
    from mtraining_jax.eval import tasks
    from mtraining_jax.train.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    code = np.resize(tok.encode("def f(x):\n    return x + 1\n"), 32768).astype(np.int32)
    rng = np.random.default_rng(0)
    assert quality_corpus.key_names(rng, ["apple", "river"], 30, made_up=False) == ["apple", "river"]
    assert rng.bit_generator.state == np.random.default_rng(0).bit_generator.state  # nothing drawn
    words, pairs = quality_corpus.retrieval_window(tok, 32768, "passkey", np.random.default_rng(3), code, 48,
                                                   made_up_keys=False)
    keys = set(re.findall(r"What is the special magic number for (\w+)\?", tok.decode(words)))
    assert pairs == len(keys) and 15 <= pairs <= len(tasks.WORDS) and keys <= set(tasks.WORDS)
    made_up, more = quality_corpus.retrieval_window(tok, 32768, "passkey", np.random.default_rng(3), code, 48)
    assert more == 48 and not np.array_equal(words, made_up)


def test_fresh_retrieval_repeats_the_code_with_new_examples(tmp_path, monkeypatch):
    """``fresh``: more windows than the code holds, each repetition of a code window with retrieval
    examples of its own; without it the corpus stops at the code's windows."""
    from mtraining_jax.train import data as data_lib
    from mtraining_jax.train.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    code = np.resize(tok.encode("import os\nprint(os.sep)\n"), 4 * 2048).astype(np.int32)
    monkeypatch.setattr(data_lib, "stdlib_streams", lambda t: (code, code[:4096]))
    fresh = quality_corpus.build_corpus(str(tmp_path / "f"), 2048, 10, 1.0, 0, 4, fresh=True)
    stale = quality_corpus.build_corpus(str(tmp_path / "s"), 2048, 10, 1.0, 0, 4)
    assert (fresh["windows"], fresh["code_windows"], stale["windows"]) == (10, 4, 4)
    w = np.load(fresh["paths"][0]).reshape(10, 2048)
    assert len({w[i].tobytes() for i in range(10)}) == 10  # no two windows alike
    nums = [set(re.findall(r"is: (\d{6})\.", tok.decode(w[i]))) for i in (0, 4, 8)]  # one code window, 3 passes
    assert nums[0] and not (nums[0] & nums[1]) and not (nums[1] & nums[2])


def test_study_protocol(tmp_path):
    study = quality_study.load_study(quality_study.STUDY)
    assert study["token_budget"] % 32768 == 0 and study["retrieval"]["keys"] > 0
    assert set(study["retrieval"]["tasks"]) <= set(quality_corpus.TRAIN_TASKS)
    # the protocol of record (runs s8-s14): 800 steps of 32K, 48 extra keys from the eval's words, lr 3e-4
    assert (study["token_budget"], study["retrieval"]["keys"], study["retrieval"]["made_up_keys"]) == (26214400, 48, False)
    assert study["train"] == ["optim.lr=3e-4"]
    assert quality_protocol.merge_overrides(study["train"], ["optim.lr=1e-3", "model.remat=full", "optim.lr=2e-4"]) == [
        "optim.lr=2e-4", "model.remat=full"]
    # every sparse arm is also read with dense attention (its index comes from later tokens), loss only
    assert study["eval"]["cross_eval"] == "cudnn" and study["eval"]["cross_eval_loss_only"] is True
    bad = tmp_path / "bad.yaml"
    for text, msg in (("token_budget: 100\nretrieval: {mixx: 1}\n", "retrieval"),
                      ("retrieval: {made_up_keys: 'no'}\n", "retrieval.made_up_keys must be true or false, got 'no'"),
                      ("eval: {cross_eval: mtraining}\n", "eval.cross_eval must be null or one of .*got 'mtraining'"),
                      ("eval: {cross_eval: null, cross_eval_loss_only: 1}\n",
                       "eval.cross_eval_loss_only must be true or false, got 1")):
        bad.write_text(text)
        with pytest.raises(ValueError, match=msg):
            quality_study.load_study(str(bad))
    with pytest.raises(SystemExit):  # argparse names the choices
        quality_study.main(["--out", str(tmp_path), "--cross-eval", "msa"])
    for bad, msg in (("sparsity.last_q=1", "expected model.KEY=VALUE"), ("model.sparsity.last_q=many", "last_q"),
                     ("model.sparsity.nope=1", "nope")):  # stopped before any training, naming the item
        with pytest.raises(SystemExit, match=msg):
            quality_study.main(["--out", str(tmp_path), "--smoke", "--reread", bad])
    for bad, msg in (("", "expected one or more"), ("model.sparsity.last_q=64 sparsity.slash_max=8", "'sparsity.slash_max=8'")):
        with pytest.raises(SystemExit, match=msg):
            quality_study.main(["--out", str(tmp_path), "--smoke", "--reread", "model.sparsity.last_q=128", "--reread", bad])
    with pytest.raises(SystemExit, match="given twice"):
        quality_study.main(["--out", str(tmp_path), "--smoke", "--reread", "model.sparsity.last_q=128",
                            "--reread", " model.sparsity.last_q=128 "])

    args = SimpleNamespace(steps=None, tokens=None, smoke=False)
    base = SimpleNamespace(steps=160, data=SimpleNamespace(seq_len=32768, batch_size=1), optim=SimpleNamespace(grad_accum=1))
    assert quality_study.resolve_steps(args, base, study) == study["token_budget"] // 32768
    assert quality_study.resolve_steps(SimpleNamespace(steps=None, tokens=None, smoke=True), base, study) == 160
    args.tokens = 32768 * 3 + 1
    with pytest.raises(SystemExit, match="whole number"):
        quality_study.resolve_steps(args, base, study)


@pytest.mark.slow(seconds=70)
def test_quality_study_seeds_smoke(tmp_path):
    """2 seeds x 2 arms at toy size, one process: one row per (arm, seed) with every required field,
    the arms of a seed on the same data, the seeds on different data, order and initialisation, the
    comparison over seeds and its plot; the recall budget sweep and the read-with-dense-attention
    evaluation on the MTraining model; the dense model read with MTraining's attention (--sparse-read)."""
    out, work = str(tmp_path / "out"), tmp_path / "work"
    rc = quality_study.main(["--out", out, "--work", str(work), "--smoke", "--variant", "both", "--seeds", "0", "1",
                             "--recall-budgets", ";vertical_max=512,slash_max=8;vertical_min=512,last_q=128",
                             "--cross-eval", "reference", "--cross-eval-loss-only", "--sparse-read",
                             "--needle-recall", "--reread", "model.sparsity.last_q=128",
                             "--reread", "model.sparsity.last_q=64 model.sparsity.vertical_max=64 model.sparsity.slash_max=4"])
    assert rc == 0
    rows = [json.loads(line) for line in open(os.path.join(out, "quality.jsonl"))]
    assert [(r["arm"], r["seed"]) for r in rows] == [("dense", 0), ("mtraining", 0), ("dense", 1), ("mtraining", 1)]
    for r in rows:
        missing = [k for k in quality_study.REQUIRED if r.get(k) is None]
        assert not missing, (r["arm"], r["seed"], missing)
        assert r["steps"] == 2 and r["tokens"] == 2 * 512 and r["data_seed"] == r["seed"]
        assert np.isfinite(r["heldout_loss"]) and 0 <= r["niah_accuracy"] <= 1 and 0 < r["recall"] <= 1
        assert r["device"] == "cpu" and r["jax"] == jax.__version__ and "--seeds 0 1" in r["command"]
        assert len(r["train_time"]) == 2 and r["train_time"][1][1] > r["train_time"][0][1] > 0
        saved = yaml.safe_load(open(work / f"seed{r['seed']}" / r["arm"] / "config.yaml"))
        assert saved["seed"] == saved["data"]["seed"] == r["seed"]  # the run's initialisation and data order
    by = {(r["arm"], r["seed"]): r for r in rows}
    assert by[("dense", 0)]["corpus_sha"] == by[("mtraining", 0)]["corpus_sha"] != by[("dense", 1)]["corpus_sha"]
    assert by[("dense", 0)]["train_loss"][0][1] != by[("dense", 1)]["train_loss"][0][1]
    md = open(os.path.join(out, "seeds.md")).read()
    assert "| held-out loss @ 512, evaluator (nats/byte) | mtraining − dense | 2 |" in md
    assert "Token budget per arm and seed: 1,024 tokens" in md
    rel = 100 * np.mean([(by[("mtraining", s)]["heldout_loss"] - by[("dense", s)]["heldout_loss"])
                         / by[("dense", s)]["heldout_loss"] for s in (0, 1)])
    assert f"* mtraining: held-out loss @ 512 {rel:+.2f} % of dense's at 1,024 tokens, 95 % interval" in md
    assert os.path.getsize(os.path.join(out, "loss_vs_tokens.png")) > 10_000
    os.remove(os.path.join(out, "seeds.md"))
    assert quality_study.main(["--out", out, "--report-only"]) == 0
    again = open(os.path.join(out, "seeds.md")).read()
    assert [x for x in again.splitlines() if "− dense" in x] == [x for x in md.splitlines() if "− dense" in x]

    rec = by[("mtraining", 0)]
    assert rec["eval"]["model"]["backends"] == ["ring", "mtraining"]
    # the trainer's held-out loss and the evaluator's loss by position agree on the same first window
    held = rec["eval"]["perplexity"]
    assert abs(rec["heldout_curve"][-1][1] - sum(held["window_loss"][:1])) < 1e-3
    assert rec["heldout_loss"] == held["mean_loss"] and rec["recall"] == rec["eval"]["recall"]["mean_recall"]["0.9"]
    assert set(rec["recall_untrained"]["mean_recall"]) == {"0.9", "0.5"}
    # the budget sweep: the model's own budgets equal the evaluation's p = 0.9 recall; a budget that
    # keeps every column (vertical_min = vertical_max = S) recalls everything
    own, wide, full = rec["recall_budgets"]
    assert own["budget"] == {} and abs(own["mean_recall"] - rec["eval"]["recall"]["mean_recall"]["0.9"]) < 1e-6
    assert wide["budget"] == {"vertical_max": 512, "slash_max": 8}
    assert wide["mean_recall"] >= own["mean_recall"] - 1e-6 and wide["mean_density"] >= own["mean_density"] - 1e-6
    assert full["mean_recall"] > 0.999 and full["mean_density"] > 0.999 and len(full["layer_recall"]) == 2
    # ... with which cap binds: keeping every column leaves no vertical cap to bind
    assert full["mean_vertical_capped"] == 0 and len(full["layer_slash_capped"]) == 2
    assert own["mean_vertical_capped"] == rec["eval"]["recall"]["mean_vertical_capped"]["0.9"]
    assert own["mean_window_recall"] == rec["eval"]["recall"]["mean_window_recall"]["0.9"]
    # read with dense attention in every layer: a genuine second evaluation of the same parameters
    cross = rec["cross_eval"]
    assert cross["backend"] == "reference" and cross["eval"]["model"]["backends"] == ["reference", "reference"]
    own_loss, dense_loss = held["mean_loss"], cross["eval"]["perplexity"]["mean_loss"]
    # at this size the model's own index keeps every block (density 1, above), so the sparse and the dense
    # read are the same function: equal up to rounding (bit-equal is possible, so no inequality is asserted)
    assert own["mean_density"] > 0.999 and np.isfinite(dense_loss) and abs(dense_loss - own_loss) < 1e-6 * own_loss
    # ... paired in the comparison: each seed's sparse-trained parameters read densely minus the dense arm
    seeds_md = open(os.path.join(out, "seeds.md")).read()
    per = [by[("mtraining", s)]["cross_eval"]["eval"]["perplexity"]["mean_loss"] - by[("dense", s)]["heldout_loss"]
           for s in (0, 1)]
    line = [x for x in seeds_md.splitlines() if "read with dense attention in every layer | mtraining − dense" in x]
    assert len(line) == 1 and "| 2 |" in line[0], line
    got = [float(x.split(": ")[1]) for x in line[0].split(" | ")[5].split(", ")]  # "s0: d0, s1: d1"
    np.testing.assert_allclose(got, per, atol=1e-6)
    # the dense arm's parameters read with the MTraining arm's attention: the same index rule (density 1 at
    # this size), so the dense arm's own loss up to rounding; the 2 x 2 of training x inference in seeds.md
    for s in (0, 1):
        sr = by[("dense", s)]["sparse_read"]
        assert sr["config"] == "mtraining.yaml" and sr["backends"] == ["ring", "mtraining"] == sr["eval"]["model"]["backends"]
        assert abs(sr["eval"]["perplexity"]["mean_loss"] - by[("dense", s)]["heldout_loss"]) < 1e-5
        assert "niah" in sr["eval"] and "sparse_read" not in by[("mtraining", s)]
        assert len(by[("dense", s)]["eval"]["niah"]["correct"][0][0]) == 1  # per-passkey outcomes for the pairing
    assert "| inference | trained dense read mtraining − trained dense read dense, seeds 0, 1 |" in seeds_md
    # the needle recall of every arm over the MTraining arm's sparse layer (layer 1 of the smoke model): the
    # index keeps every block at this size, so all of the answer's attention to the needle
    for r in rows:
        nr = r["needle_recall"]
        assert nr["layers"] == [1] and np.asarray(nr["kept"]).shape == (2, 1, 1) and abs(nr["mean_kept"] - 1) < 1e-6
    assert "| mtraining | 0, 1 | 1.000 |" in seeds_md
    # --reread, two reads of the MTraining parameters: last_q=128 keeps every block at this size, so the same loss
    # up to rounding; last_q=64 with small budgets keeps fewer (its density below 1, its loss another); each read
    # with its own recall / density; both paired with dense in seeds.md
    sparse = "model.sparsity.last_q=64 model.sparsity.vertical_max=64 model.sparsity.slash_max=4"
    for s in (0, 1):
        (rr, r2), mt = by[("mtraining", s)]["rereads"], by[("mtraining", s)]
        assert rr["overrides"] == ["model.sparsity.last_q=128"] and rr["backends"] == ["ring", "mtraining"]
        assert abs(rr["eval"]["perplexity"]["mean_loss"] - mt["heldout_loss"]) < 1e-5 * mt["heldout_loss"]
        assert rr["eval"]["recall"]["mean_density"]["0.9"] > 0.999 and "niah" in rr["eval"]
        assert r2["overrides"] == sparse.split() and r2["eval"]["recall"]["mean_density"]["0.9"] < 0.99
        assert abs(r2["eval"]["perplexity"]["mean_loss"] - mt["heldout_loss"]) > 1e-4 and "niah" in r2["eval"]
        assert "rereads" not in by[("dense", s)]
    for st in ("model.sparsity.last_q=128", sparse):
        line = [x for x in seeds_md.splitlines() if f"under {st} | mtraining − dense | 2 |" in x]
        assert len(line) == 2, line  # held-out loss and NIAH
        d = [by[("mtraining", s)]["rereads"][0 if st.endswith("128") else 1]["eval"]["perplexity"]["mean_loss"]
             - by[("dense", s)]["heldout_loss"] for s in (0, 1)]
        assert f"| {(d[0] + d[1]) / 2:+.4g} |" in line[0], (line[0], d)  # the paired mean of the reads' losses
    assert "| mtraining | 1 | model.sparsity.last_q=128 | p = 0.9: recall " in seeds_md
    assert f"| mtraining | 0 | {sparse} | p = 0.9: recall " in seeds_md
    # the recall on each read's own observation window: all of it where every block is kept, below p where the
    # caps bind (64 verticals and 4 slash diagonals of 512 keys)
    w0, w = (rr["eval"]["recall"]["mean_window_recall"]["0.9"] for rr in by[("mtraining", 0)]["rereads"])
    assert w0 > 0.999 and 0 < w < 0.9 and f"on the window's rows {w:.3f}, density" in seeds_md
    # each read against the own read, window by window, and the share of the dense read's gain it recovers
    mt = by[("mtraining", 1)]
    win = [a - b for a, b in zip(mt["rereads"][1]["eval"]["perplexity"]["window_loss"],
                                 mt["eval"]["perplexity"]["window_loss"])]
    gain = np.mean(mt["cross_eval"]["eval"]["perplexity"]["window_loss"]) - mt["heldout_loss"]
    assert len(win) >= 2 and abs(np.mean(win)) > 1e-4
    row = [x for x in seeds_md.splitlines() if x.startswith(f"| mtraining | 1 | {sparse} | {len(win)} | ")]
    assert len(row) == 1 and f"| {np.mean(win):+.4f} [" in row[0] and f"| {np.mean(win) / gain:.2f} (dense read " in row[0]
    assert "| training | trained mtraining read dense − trained dense read dense, seeds 0, 1 |" in seeds_md
    files = sorted(os.listdir(out))
    assert files == ["loss_curves.png", "loss_vs_tokens.png", "quality.jsonl", "quality.md", "quality_niah.png",
                     "quality_position_loss.png", "quality_recall.png", "seeds.md"]
    md = open(os.path.join(out, "quality.md")).read()
    assert "| metric | dense s0 | mtraining s0 | dense s1 | mtraining s1 |" in md and "| mtraining s0 | 2 |" in md
    assert "| mtraining s0 | vertical_min=512, last_q=128 | 0.9 |" in md
    assert "| mtraining s0 | " in md and "| reference (every layer) |" in md


def test_committed_four_seed_run_reports_what_the_results_say(tmp_path):
    """The committed rows of run s8-800-steps-4-seeds, re-reported: the numbers results/quality/quality.md
    quotes (paired difference, its interval, the relative line) come out of the rows."""
    rows = os.path.join(os.path.dirname(__file__), "..", "results", "quality", "quality.jsonl")
    assert quality_study.main(["--out", str(tmp_path), "--report-only", rows, "--runs", "s8-800-steps-4-seeds"]) == 0
    md = open(tmp_path / "seeds.md").read()
    assert ("| held-out loss @ 32768, evaluator (nats/byte) | mtraining − dense | 4 | -0.1187 | [-0.2249, -0.01257] |"
            in md)
    assert "-8.28 % of dense's at 26,214,400 tokens, 95 % interval [-15.24 %, -1.32 %] over 4 seeds" in md
    assert "Notes:" not in md  # every seed paired on the same corpus, one row per (arm, seed)
    assert quality_study.main(["--out", str(tmp_path), "--report-only", rows, "--runs", "no-such-run"]) == 1
    # the MSA arm (run s10, seeds 0-2 on s8's corpora) against s8's dense seeds
    assert quality_study.main(["--out", str(tmp_path), "--report-only", rows, "--runs",
                               "s8-800-steps-4-seeds,s10-msa-800-steps-3-seeds"]) == 0
    md = open(tmp_path / "seeds.md").read()
    assert "| held-out loss @ 32768, evaluator (nats/byte) | msa − dense | 3 | -0.08128 | [-0.2625, +0.09993] |" in md
    assert "-5.58 % of dense's at 26,214,400 tokens, 95 % interval [-17.47 %, +6.30 %] over 3 seeds" in md
    assert "equal-time values compare different devices" in md  # s8 on H100s, s10 on H200s
    # run s11: the dense arm again at lr 3e-4 (s8's corpora), the baseline of s8's MTraining seeds
    assert quality_study.main(["--out", str(tmp_path), "--report-only", rows, "--runs",
                               "s8-800-steps-4-seeds,s11-dense-lr3e-4-4-seeds",
                               "--baseline-run", "s11-dense-lr3e-4-4-seeds"]) == 0
    md = open(tmp_path / "seeds.md").read()
    assert "-3.56 % of dense's at 26,214,400 tokens, 95 % interval [-10.89 %, +3.78 %] over 4 seeds" in md
    assert "the arms differ in trainer overrides (mtraining: none; dense: ['optim.lr=3e-4'])" in md
    # run s13: MTraining at lr 3e-4 (seeds 0-2), like for like with s11's dense arm (same corpora, lr, device type)
    assert quality_study.main(["--out", str(tmp_path), "--report-only", rows, "--runs",
                               "s11-dense-lr3e-4-4-seeds,s13-mtraining-lr3e-4-3-seeds"]) == 0
    md = open(tmp_path / "seeds.md").read()
    assert ("| held-out loss @ 32768, evaluator (nats/byte) | mtraining − dense | 3 | -0.1598 | [-0.2766, -0.043] |"
            in md)
    assert "-11.58 % of dense's at 26,214,400 tokens, 95 % interval [-18.90 %, -4.27 %] over 3 seeds" in md
    assert "differ in trainer overrides" not in md and "different devices" not in md
    # run s14: MTraining seed 3 (four seeds with s13) and MSA seed 0 at lr 3e-4, both also read densely
    assert quality_study.main(["--out", str(tmp_path), "--report-only", rows, "--runs",
                               "s11-dense-lr3e-4-4-seeds,s13-mtraining-lr3e-4-3-seeds,"
                               "s14-lr3e-4-mtraining-seed3-msa-seed0"]) == 0
    md = open(tmp_path / "seeds.md").read()
    assert ("| held-out loss @ 32768, evaluator (nats/byte) | mtraining − dense | 4 | -0.1601 | [-0.2212, -0.09902] |"
            in md)
    assert "-11.88 % of dense's at 26,214,400 tokens, 95 % interval [-15.82 %, -7.94 %] over 4 seeds" in md
    assert "read with dense attention in every layer | mtraining − dense | 1 | -0.1569 |" in md
    assert "read with dense attention in every layer | msa − dense | 1 | -0.006566 |" in md
    assert "msa: held-out loss @ 32768 -9.57 % of dense's at 26,214,400 tokens (one seed: no interval)" in md
    # the dense read's gap by position: flat for MTraining, rising for MSA (read out of distribution)
    assert "| mtraining | 3 | -0.000 (0-2048) | +0.006 | +0.007 (30720-32768) |" in md
    assert "| msa | 0 | +0.006 (0-2048) | +0.125 | +0.297 (30720-32768) |" in md
    # run s15: MSA with the causal selection, seeds 0-2 at lr 3e-4; s14's block_mean MSA row left out by RUN:ARM
    assert quality_study.main(["--out", str(tmp_path), "--report-only", rows, "--runs",
                               "s11-dense-lr3e-4-4-seeds,s13-mtraining-lr3e-4-3-seeds,"
                               "s14-lr3e-4-mtraining-seed3-msa-seed0:mtraining,s15-msa-causal-lr3e-4-3-seeds"]) == 0
    md = open(tmp_path / "seeds.md").read()
    assert "Notes:" not in md  # one row per (arm, seed): s14's MSA seed 0 is not read
    assert "| msa | 0, 1, 2 | 1.2746 ± 0.0066 |" in md
    assert ("| held-out loss @ 32768, evaluator (nats/byte) | msa − dense | 3 | -0.09612 | [-0.2133, +0.02107] |"
            in md)
    assert "-6.93 % of dense's at 26,214,400 tokens, 95 % interval [-14.75 %, +0.89 %] over 3 seeds" in md
    assert "| held-out loss @ 32768, evaluator | msa − mtraining | 3 | +0.06367 | [+0.04142, +0.08592] |" in md
    assert "| msa − mtraining | 3 | +5.26 | [+3.30, +7.22] |" in md and "higher than mtraining (interval excludes 0)" in md
    assert "held-out loss, trainer's eval, at equal training time | msa − dense | 3 | +0.7526 |" in md
    assert "| msa | 1 | -0.000 (0-2048) | +0.052 | +0.138 (30720-32768) |" in md  # causal: still rising
    for bad in ("s15-msa-causal-lr3e-4-3-seeds:sparse", "s15-msa-causal-lr3e-4-3-seed"):
        assert quality_study.main(["--out", str(tmp_path), "--report-only", rows, "--runs", bad]) == 1


def test_quality_study_runs_in_slices_and_resumes(tmp_path):
    """A protocol longer than one device call: ``--run-steps 2`` of a 4-step schedule stops each arm
    with a checkpoint and writes no row; ``--resume`` continues from it, and the row then covers the
    whole schedule (steps 1-4 logged once each, both slices recorded, the trainer's step 3 following
    step 2's checkpoint: the same loss as a run that was never stopped)."""
    out, work = str(tmp_path / "out"), str(tmp_path / "work")
    common = ["--out", out, "--work", work, "--smoke", "--variant", "dense", "--steps", "4", "--recall-ps", "0.9",
              "--no-untrained-recall"]
    assert quality_study.main(common + ["--run-steps", "2"]) == 0
    assert not os.path.exists(os.path.join(out, "quality.jsonl"))
    run_dir = os.path.join(work, "seed0", "dense")
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["2", "model.yaml"]
    assert quality_study.main(common + ["--resume"]) == 0
    (row,) = [json.loads(line) for line in open(os.path.join(out, "quality.jsonl"))]
    assert row["steps"] == 4 and [s for s, _ in row["train_loss"]] == [1, 2, 3, 4]
    assert row["slices"] == [1, 3] and np.isfinite(row["heldout_loss"])
    assert [s for s, _ in row["train_time"]] == [1, 2, 3, 4]
    # the same arm in one go, in another work folder: identical losses at every step
    assert quality_study.main(["--out", str(tmp_path / "one"), "--work", str(tmp_path / "w1"), "--smoke", "--variant",
                               "dense", "--steps", "4", "--recall-ps", "0.9", "--no-untrained-recall"]) == 0
    (one,) = [json.loads(line) for line in open(tmp_path / "one" / "quality.jsonl")]
    np.testing.assert_allclose([v for _, v in row["train_loss"]], [v for _, v in one["train_loss"]], rtol=1e-6)
    assert one.get("slices") is None
    assert [s for s, _ in row["heldout_curve"]] == [s for s, _ in one["heldout_curve"]] == [2, 4]
    np.testing.assert_allclose([v for _, v in row["heldout_curve"]], [v for _, v in one["heldout_curve"]], rtol=1e-6)


def test_with_repeats_copies_earlier_spans(tmp_path, monkeypatch):
    """``copy_share``: about that share of each window's code becomes copies of its own earlier spans
    (every changed position equals a token earlier in the window at a fixed offset); 0 keeps the corpus."""
    from mtraining_jax.train import data as data_lib

    rng = np.random.default_rng(0)
    code = np.arange(32768, dtype=np.int32)  # token = its position: a copy shows where it came from
    out = quality_corpus.with_repeats(code, 0.25, np.random.default_rng(1))
    changed = np.nonzero(out != code)[0]
    assert 0.15 < len(changed) / len(code) < 0.3
    assert np.all(out[changed] < changed)  # copied from earlier in the window
    runs = np.diff(out[changed]) == 1  # in spans: consecutive copied tokens mostly consecutive sources
    assert runs.mean() > 0.9
    np.testing.assert_array_equal(quality_corpus.with_repeats(code, 0.0, rng), code)
    stream = np.resize(rng.integers(0, 200, 4096), 4 * 2048).astype(np.int32)
    monkeypatch.setattr(data_lib, "stdlib_streams", lambda t: (stream, stream[:4096]))
    plain = quality_corpus.build_corpus(str(tmp_path / "a"), 2048, 4, 1.0, 0, 4)
    again = quality_corpus.build_corpus(str(tmp_path / "b"), 2048, 4, 1.0, 0, 4, copy_share=0.0)
    copied = quality_corpus.build_corpus(str(tmp_path / "c"), 2048, 4, 1.0, 0, 4, copy_share=0.3)
    assert plain["sha"] == again["sha"] != copied["sha"]


def test_trainer_overrides_reach_every_arm_and_the_rows(tmp_path, monkeypatch):
    """The study's ``train`` list, then ``--set``, reach every arm's training config and every row;
    what the study sets per arm and seed, and anything not ``KEY=VALUE``, is refused up front."""
    from mtraining_jax.train import loop

    seen = []

    def fake_run(cfg, overwrite=True):  # the config is what matters: stop before training
        seen.append(cfg)
        raise RuntimeError("stop here")

    monkeypatch.setattr(loop, "run", fake_run)
    study = tmp_path / "study.yaml"
    study.write_text("train: [optim.min_lr_ratio=0.5]\n")
    common = ["--out", str(tmp_path / "o"), "--work", str(tmp_path / "w"), "--smoke", "--study", str(study)]
    assert quality_study.main(common + ["--variant", "both", "--seeds", "3", "--set", "optim.lr=3e-4",
                                        "--set", "logging.every={seed}"]) == 1  # both arms stopped
    assert [(c.optim.lr, c.optim.min_lr_ratio) for c in seen] == [(3e-4, 0.5), (3e-4, 0.5)]
    assert {c.logging.every for c in seen} == {3}  # {seed}: each seed
    rows = [json.loads(line) for line in open(tmp_path / "o" / "quality.jsonl")]
    assert [r["arm"] for r in rows] == ["dense", "mtraining"]
    assert all(r["train_overrides"] == ["optim.min_lr_ratio=0.5", "optim.lr=3e-4", "logging.every={seed}"]
               for r in rows)
    for bad, msg in (("seed=3", "'seed' is set by the study"), ("optim.lr", "expected KEY=VALUE")):
        with pytest.raises(SystemExit, match=msg):
            quality_study.main(common + ["--set", bad])
    study.write_text("train: optim.lr=1e-4\n")
    with pytest.raises(ValueError, match="train: a list of KEY=VALUE"):
        quality_study.load_study(str(study))


@pytest.mark.slow(seconds=30)
def test_copy_pretraining_gives_every_arm_its_weights(tmp_path):
    """``pretrain`` (study.yaml / --pretrain-steps): each seed is copy-pretrained once, its arms start from
    those weights (their first loss differs from a random start), a second call reuses the finished
    pretraining (the same losses), other settings train it anew, and model.init_from beside it is refused."""
    from benchmarks.quality_pretrain import check_pretrain

    study = tmp_path / "study.yaml"
    study.write_text("retrieval: {mix: 1.0, keys: 4}\neval: {haystack: heldout}\n"
                     "pretrain: {steps: 3, seq_len: 128, batch: 4, windows: 32, warmup_steps: 1}\n")
    work = str(tmp_path / "work")

    def arm(out, *extra):
        assert quality_study.main(["--out", str(tmp_path / out), "--work", work, "--smoke", "--variant", "dense",
                                   "--study", str(study), "--recall-ps", "0.9", "--no-untrained-recall", *extra]) == 0
        (row,) = [json.loads(line) for line in open(tmp_path / out / "quality.jsonl")]
        return row

    first = arm("a")
    pre = first["pretrain"]
    ck = os.path.join(work, "seed0", "pretrain", "run", "checkpoints")
    assert pre["steps"] == 3 and pre["checkpoints"] == ck and not pre["reused"] and pre["lr"] == 3e-4
    assert [s for s, _ in pre["heldout_curve"]] == [1, 2, 3] and sorted(os.listdir(ck)) == ["3", "model.yaml"]
    again = arm("b")
    assert again["pretrain"]["reused"] and again["pretrain"]["heldout_curve"] == pre["heldout_curve"]
    np.testing.assert_allclose([v for _, v in again["train_loss"]], [v for _, v in first["train_loss"]], rtol=1e-6)
    scratch = arm("c", "--pretrain-steps", "0")
    assert scratch["pretrain"] is None
    assert abs(scratch["train_loss"][0][1] - first["train_loss"][0][1]) > 1e-4  # random init vs pretrained
    longer = arm("d", "--pretrain-steps", "4")  # other settings: trained anew, the old run deleted
    assert not longer["pretrain"]["reused"] and sorted(os.listdir(ck)) == ["4", "model.yaml"]
    with pytest.raises(SystemExit, match="drop model.init_from"):
        quality_study.main(["--out", str(tmp_path / "e"), "--work", work, "--smoke", "--study", str(study),
                            "--set", "model.init_from=ckpt:/x"])
    with pytest.raises(SystemExit, match="pretrain.steps must be a non-negative integer, got -1"):
        quality_study.main(["--out", str(tmp_path / "e"), "--smoke", "--pretrain-steps", "-1"])
    for bad, msg in (({"lr": "3e-4"}, "pretrain.lr must be a positive number, got '3e-4'"),
                     ({"seq_len": 64}, "pretrain.seq_len must be >= 128"), ({"batchsize": 4}, "must be a mapping of")):
        with pytest.raises(ValueError, match=re.escape(msg)):
            check_pretrain(bad, "study")


@pytest.mark.slow(seconds=30)
def test_copy_curriculum_stages_and_one_pretraining_for_every_seed(tmp_path):
    """``pretrain.stages`` / ``--pretrain-stages``: a later copy stage trains on its own window length from
    the previous stage's weights and the arms load the last stage; ``--pretrain-seed 0`` gives every seed
    that one pretraining (no folder of its own); ``--no-eval`` rows keep the trainer's curves only."""
    from benchmarks.quality_pretrain import check_pretrain, parse_stages
    from mtraining_jax.train.config import read_yaml

    study = tmp_path / "study.yaml"
    study.write_text("retrieval: {mix: 1.0, keys: 4}\neval: {haystack: heldout}\n"
                     "pretrain: {steps: 2, seq_len: 128, batch: 4, windows: 16, warmup_steps: 1}\n")
    work, out = str(tmp_path / "work"), tmp_path / "out"
    assert quality_study.main(["--out", str(out), "--work", work, "--smoke", "--variant", "dense", "--study", str(study),
                               "--seeds", "0", "1", "--steps", "2", "--pretrain-seed", "0", "--pretrain-stages",
                               "256x2:2", "--no-eval", "--no-untrained-recall", "--recall-ps", "0.9"]) == 0
    rows = [json.loads(line) for line in open(out / "quality.jsonl")]
    assert [r["seed"] for r in rows] == [0, 1]
    stage2 = os.path.join(work, "seed0", "pretrain", "stage2", "run")
    for r in rows:
        pre = r["pretrain"]
        assert pre["seed"] == 0 and pre["checkpoints"] == os.path.join(stage2, "checkpoints")
        (st,) = pre["stage_results"]
        assert (st["seq_len"], st["batch"], st["steps"], st["windows"]) == (256, 2, 2, 5)
        assert [s for s, _ in st["heldout_curve"]] == [1, 2] and st["lr"] == pre["lr"] == 3e-4
        assert r["eval_skipped"] and r["heldout_loss"] is None and r["heldout_curve"] and r["corpus_sha"]
    assert not rows[0]["pretrain"]["reused"] and rows[1]["pretrain"]["reused"]
    assert not os.path.exists(os.path.join(work, "seed1", "pretrain"))  # seed 1 fine-tunes seed 0's model
    # the second stage started from the first one's checkpoint, on its own 256-token windows
    cfg = read_yaml(os.path.join(stage2, "config.yaml"))
    assert cfg["model"]["init_from"] == "ckpt:" + os.path.join(work, "seed0", "pretrain", "run", "checkpoints")
    assert cfg["data"]["seq_len"] == 256
    # another second stage: the first stage is reused, the second trained anew from it
    assert quality_study.main(["--out", str(tmp_path / "out2"), "--work", work, "--smoke", "--variant", "dense",
                               "--study", str(study), "--seeds", "0", "--steps", "2", "--pretrain-stages", "256x2:3",
                               "--no-eval", "--no-untrained-recall", "--recall-ps", "0.9"]) == 0
    (row,) = [json.loads(line) for line in open(tmp_path / "out2" / "quality.jsonl")]
    (st,) = row["pretrain"]["stage_results"]
    assert row["pretrain"]["reused"] and not st["reused"] and [s for s, _ in st["heldout_curve"]] == [1, 2, 3]
    assert row["pretrain"]["heldout_curve"] == rows[0]["pretrain"]["heldout_curve"]
    # bad curricula are named up front
    with pytest.raises(ValueError, match=re.escape("expected SEQxBATCH:STEPS items separated by commas "
                                                   "(e.g. 4096x16:500), got '4096x16'")):
        parse_stages("4096x16")
    for stages, msg in (([{"seq_len": 64, "batch": 2, "steps": 1}], "pretrain.stages[0].seq_len must be >= 128"),
                        ([{"steps": 1}], "pretrain.stages[0] must be a mapping with steps, seq_len, batch"),
                        ([{"seq_len": 256, "batch": 2, "steps": 0}], "pretrain.stages[0].steps must be an integer >= 1, got 0"),
                        ("256x2:2", "pretrain.stages must be a list of mappings")):
        with pytest.raises(ValueError, match=re.escape(msg)):
            check_pretrain({"steps": 1, "stages": stages}, "study")
    with pytest.raises(SystemExit, match="--pretrain-seed runs the seeds one after another"):
        quality_study.main(["--out", str(tmp_path / "e"), "--pretrain-seed", "0", "--gpu-per-seed", "--seeds", "0", "1"])
    # --pretrain-only: the curriculum's curves alone, one row per seed, no arm trained; the first stage reused;
    # a one-step stage has its batch (its windows default to steps x batch + 1: a window's last label needs one
    # token past it)
    out3 = tmp_path / "out3"
    assert quality_study.main(["--out", str(out3), "--work", work, "--smoke", "--study", str(study), "--seeds", "0",
                               "--pretrain-stages", "256x2:2,512x2:1", "--pretrain-only"]) == 0
    (row,) = [json.loads(line) for line in open(out3 / "pretrain.jsonl")]
    assert row["arm"] == "pretrain" and row["seed"] == 0 and row["command"] and not (out3 / "quality.jsonl").exists()
    assert row["pretrain"]["reused"] and [s["seq_len"] for s in row["pretrain"]["stage_results"]] == [256, 512]
    from benchmarks.quality_pretrain_plot import stage_curves
    rows = [dict(row, run="c")]
    s1, s2, s3 = 2 * 128 * 4, 2 * 256 * 2, 1 * 512 * 2  # tokens of each stage (steps x window x batch)
    assert [c[-1][0] for _, c in stage_curves(rows, "c")] == [s1, s1 + s2, s1 + s2 + s3]
    with pytest.raises(SystemExit, match="--pretrain-only needs a copy pretraining"):
        quality_study.main(["--out", str(tmp_path / "e"), "--smoke", "--pretrain-steps", "0", "--pretrain-only"])
