"""mtraining_jax.eval: scoring (right answers 1, wrong 0), task generation, the sharded predictor
and the q/k capture against the model's own forward, index recall."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special
from flax import nnx

from mtraining_jax.eval.perplexity import position_loss
from mtraining_jax.eval.predictor import ModelPredictor, head_predictions
from mtraining_jax.eval.recall import index_recall, layer_qk, needle_recall
from mtraining_jax.eval.retrieval import niah_grid, ruler_suite
from mtraining_jax.eval.scoring import score_examples
from mtraining_jax.eval.tasks import TASKS, make_example
from mtraining_jax.mesh import make_mesh
from mtraining_jax.model.config import ModelConfig
from mtraining_jax.model.hf_io import model_params
from mtraining_jax.model.qwen2 import Qwen2ForCausalLM
from mtraining_jax.train.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1,
            max_position_embeddings=4096)


def oracle(inputs, labels):
    """Knows every next token."""
    return np.asarray(labels), np.zeros(np.shape(labels), np.float32)


def clueless(inputs, labels):
    """Always predicts a wrong token."""
    return (np.asarray(labels) + 1) % 259, np.ones(np.shape(labels), np.float32)


def first_digit_only(inputs, labels):
    """Right everywhere except the last answer token of each sequence."""
    p = np.asarray(labels).copy()
    p[:, -1] = (p[:, -1] + 1) % 259
    return p, np.zeros(p.shape, np.float32)


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig(**TINY, attention_backend="ring")
    return cfg, model_params(Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0)))


def test_scoring_right_answers_one_wrong_answers_zero():
    lengths, depths = [256, 512], [0.0, 0.5, 1.0]
    good = niah_grid(oracle, TOK, lengths, depths, samples=2)
    bad = niah_grid(clueless, TOK, lengths, depths, samples=2)
    assert np.array_equal(good["accuracy"], np.ones((3, 2))) and np.array_equal(bad["accuracy"], np.zeros((3, 2)))
    assert np.array_equal(bad["token_accuracy"], np.zeros((3, 2)))
    assert np.array_equal(good["correct"], np.ones((3, 2, 2))) and np.array_equal(bad["correct"], np.zeros((3, 2, 2)))

    def some(inputs, labels):  # right on the examples whose input tokens sum to an even number: mixed cells
        return (oracle if int(np.asarray(inputs)[0].sum()) % 2 == 0 else clueless)(inputs, labels)

    mixed = niah_grid(some, TOK, lengths, depths, samples=3)
    for i, d in enumerate(depths):  # per sample, in order: the pairing of two models' grids rests on it
        for j, S in enumerate(lengths):
            want = [int(make_example("passkey", TOK, S, d, 0, i, s).tokens[:-1].sum()) % 2 == 0 for s in range(3)]
            assert mixed["correct"][i][j] == [int(w) for w in want]
            assert mixed["accuracy"][i][j] == pytest.approx(np.mean(want))
    assert 0 < np.mean(mixed["correct"]) < 1  # both kinds of sample occur
    ex = [make_example("passkey", TOK, 256, 0.5, 0, 0, s) for s in range(3)]
    exact, tok = score_examples(first_digit_only, ex, batch_size=2)
    n = ex[0].answer.sum()  # " 12345" = 6 answer tokens, the last one wrong: not an exact match
    np.testing.assert_array_equal(exact, 0.0)
    np.testing.assert_allclose(tok, (n - 1) / n)
    r = ruler_suite(oracle, TOK, [512], ["multikey", "multivalue", "vartrack"], samples=2)
    assert all(v["accuracy"] == [1.0] for v in r["tasks"].values())
    r = ruler_suite(clueless, TOK, [512], ["multikey", "multivalue", "vartrack"], samples=2)
    assert all(v["accuracy"] == [0.0] for v in r["tasks"].values())


@pytest.mark.parametrize("task", TASKS)
def test_tasks_deterministic_with_answer_at_the_end(task):
    a = make_example(task, TOK, 1024, 0.3, seed=7, cell=1, sample=2)
    b = make_example(task, TOK, 1024, 0.3, seed=7, cell=1, sample=2)
    c = make_example(task, TOK, 1024, 0.3, seed=8, cell=1, sample=2)
    assert a.tokens.shape == (1025,) and a.answer.shape == (1024,)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert not np.array_equal(a.tokens, c.tokens)
    ans = TOK.decode(a.tokens[1:][a.answer])
    assert ans.strip() == a.text and a.answer[-1] and a.answer.sum() == len(ans)
    text = TOK.decode(a.tokens)
    if task == "multivalue":  # all values, in order of appearance
        vals = a.text.split(", ")
        assert len(vals) == 4 and [text.index(f"is: {v}.") for v in vals] == sorted(text.index(f"is: {v}.") for v in vals)
    if task == "vartrack":  # the chain: first var holds the value, each next copies the previous
        names = a.text.split()
        assert all(f"VAR {names[i]} = VAR {names[i - 1]}." in text for i in range(1, len(names)))


def test_needle_depth():
    for depth, lo, hi in ((0.0, 0, 0.05), (1.0, 0.85, 0.95)):
        e = make_example("passkey", TOK, 2048, depth, 0, 0, 0)
        at = TOK.decode(e.tokens).index("The pass key is") / 2049
        assert lo <= at <= hi, (depth, at)
    with pytest.raises(ValueError, match="context length 64 is too short"):
        make_example("multikey", TOK, 64, 0.5, 0, 0, 0)
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        make_example("nope", TOK, 64, 0.5, 0, 0, 0)


def test_head_predictions_chunked_vocab():
    rng = np.random.default_rng(0)
    h, w = rng.normal(size=(2, 5, 8)), rng.normal(size=(8, 37))
    y = rng.integers(0, 37, size=(2, 5))
    pred, nll = head_predictions(h, w, y, vocab_chunk=10)  # 4 chunks, the last one padded
    z = h @ w
    np.testing.assert_array_equal(pred, z.argmax(-1))
    np.testing.assert_allclose(nll, scipy.special.logsumexp(z, -1) - np.take_along_axis(z, y[..., None], -1)[..., 0],
                               rtol=1e-5, atol=1e-5)


def test_sharded_predictor_matches_single_device_logits(tiny):
    cfg, params = tiny
    x = np.random.default_rng(1).integers(0, 259, size=(2, 1025)).astype(np.int32)
    predict = ModelPredictor(cfg, params, make_mesh((2, 4)), vocab_chunk=128)
    pred, nll = predict(x[:, :-1], x[:, 1:])
    ref = Qwen2ForCausalLM(cfg.replace(attention_backend="reference"), rngs=nnx.Rngs(0))
    z = np.asarray(ref.logits(x[:, :-1], np.arange(1024)), np.float64)
    np.testing.assert_array_equal(pred, z.argmax(-1))
    want = scipy.special.logsumexp(z, -1) - np.take_along_axis(z, x[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(nll, want, rtol=2e-4, atol=2e-4)
    pl = position_loss(predict, x[0], 512, 1, num_buckets=4)
    assert pl["windows"] == 1 and pl["tokens"] == 512 and len(pl["loss"]) == 4
    np.testing.assert_allclose(pl["mean_loss"], want[0, :512].mean(), rtol=1e-4)  # window 0 = x[0, :513]
    np.testing.assert_allclose(pl["loss"][0], want[0, :128].mean(), rtol=1e-4)


def test_layer_qk_and_index_recall(tiny):
    cfg, params = tiny  # dense ring on a 2x4 mesh: the captured forward must equal the reference model's
    x = np.random.default_rng(2).integers(0, 259, size=(1, 512)).astype(np.int32)
    qs, ks, h = layer_qk(cfg, params, x, make_mesh((2, 4)))
    ref = Qwen2ForCausalLM(cfg.replace(attention_backend="reference"), rngs=nnx.Rngs(0))
    np.testing.assert_allclose(np.asarray(h), np.asarray(ref(x, np.arange(512))), rtol=2e-4, atol=2e-4)
    assert len(qs) == 2 and qs[0].shape == (1, 512, 2, 32) and ks[0].shape == (1, 512, 1, 32)
    sp = cfg.replace(sparsity=dict(vertical_max=64, slash_max=4))
    r = index_recall(sp, None, None, (1.0, 0.3), num_rows=64, qk=(qs, ks))
    assert np.asarray(r["recall"]["0.3"]).shape == (2, 2) and r["backends"] == ["ring", "ring"]
    hi, lo = np.asarray(r["recall"]["1"]), np.asarray(r["recall"]["0.3"])
    assert np.all((lo > 0) & (hi <= 1 + 1e-6)) and np.all(hi >= lo - 1e-9)  # larger top-p keeps more mass
    assert np.all(np.asarray(r["density"]["1"]) >= np.asarray(r["density"]["0.3"]))
    assert r["mean_recall"]["0.3"] < r["mean_recall"]["1"] and r["mean_density"]["0.3"] < r["mean_density"]["1"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_window_recall_covers_p_unless_a_cap_binds(seed):
    """The recall on the estimate's own window (its last ``last_q`` rows) is at least ``p`` when no cap binds
    (top-p coverage of the window's mass, mean over its rows), and 1 at ``p = 1``; with caps that bind it
    falls below ``p``; on the other rows it can be anything (the window's pattern may not hold there). Which
    cap binds is reported from the uncapped index's counts.
    Queries and keys share a few directions so that attention is peaked (vertical / slash structure)."""
    rng = np.random.default_rng(seed)
    S, D = 512, 32
    base = rng.normal(size=(4, D))
    q = (base[rng.integers(0, 4, S)] * 2 + rng.normal(size=(S, D)) * 0.7)[None, :, None, :]
    k = (base[rng.integers(0, 4, S)] * 2 + rng.normal(size=(S, D)) * 0.7)[None, :, None, :]
    qk = ([jnp.asarray(q, jnp.float32)], [jnp.asarray(k, jnp.float32)])
    cfg = ModelConfig(**dict(TINY, num_layers=1, num_heads=1, num_kv_heads=1, hidden_size=32), attention_backend="ring")
    free = cfg.replace(sparsity=dict(vertical_max=S, vertical_min=0, slash_max=S // 64, last_q=64))
    r = index_recall(free, None, None, (1.0, 0.9, 0.5, 0.2), num_rows=128, qk=qk)
    win = r["mean_window_recall"]
    assert abs(win["1"] - 1) < 1e-6 and np.asarray(r["window_recall"]["0.5"]).shape == (1, 1)
    for p in ("0.9", "0.5", "0.2"):
        assert win[p] >= float(p) - 2e-3, (p, win[p])  # the estimate's coverage, up to its rounding of q / k
    assert win["0.2"] <= win["0.5"] <= win["0.9"] + 1e-9
    for p in ("1", "0.9", "0.5", "0.2"):  # no cap binds; uncapped counts grow with p, all keys / diagonals at p = 1
        assert r["mean_vertical_capped"][p] == r["mean_slash_capped"][p] == 0
    need_v, need_s = r["mean_vertical_needed"], r["mean_slash_needed"]
    assert 0 < need_v["0.2"] < need_v["0.5"] < need_v["0.9"] < need_v["1"] <= S and need_s["1"] == S // 64
    assert 1 <= need_s["0.2"] <= need_s["0.5"] <= need_s["0.9"] <= S // 64
    capped = cfg.replace(sparsity=dict(vertical_max=8, slash_max=1, vertical_min=0, last_q=64))
    rc = index_recall(capped, None, None, (0.9,), num_rows=128, qk=qk)
    assert rc["mean_window_recall"]["0.9"] < 0.9 and rc["mean_density"]["0.9"] < r["mean_density"]["0.9"]
    assert rc["mean_vertical_capped"]["0.9"] == rc["mean_slash_capped"]["0.9"] == 1  # both caps bind ...
    assert rc["mean_vertical_needed"]["0.9"] == need_v["0.9"]  # ... and the uncapped counts do not depend on them
    slash_only = index_recall(cfg.replace(sparsity=dict(vertical_max=S, slash_max=1, vertical_min=0, last_q=64)),
                              None, None, (0.9,), num_rows=128, qk=qk)  # only the slash cap binds: the window
    assert (slash_only["mean_vertical_capped"]["0.9"], slash_only["mean_slash_capped"]["0.9"]) == (0, 1)
    assert slash_only["mean_window_recall"]["0.9"] >= 0.9 - 2e-3  # ... is still covered through the verticals
    docs = cfg.replace(sparsity=dict(window="per_document", last_q=64))
    assert "window_recall" not in index_recall(docs, None, None, (0.9,), num_rows=64, qk=qk)


def test_needle_recall_is_the_index_recall_of_the_needle_for_the_answer_rows(tiny):
    """The NIAH grid's first examples through the model: the mass the answer's query rows put on the needle's key
    occurrences and the part of it the index keeps, per example; everything kept when the budget keeps every
    column; the same numbers as column_recall on that example's q/k."""
    import jax.numpy as jnp

    from mtraining_jax.eval.recall import _estimate, sparsity_for
    from mtraining_jax.sparsity.metrics import column_recall

    cfg, params = tiny
    sp = cfg.replace(attention_backend="reference", sparsity=dict(vertical_max=16, slash_max=2, vertical_min=1, last_q=64))
    r = needle_recall(sp, params, TOK, [512], [0.0, 0.5], samples=2, p=0.5)
    assert r["layers"] == [0, 1] and np.asarray(r["kept"]).shape == (2, 1, 2) == np.asarray(r["mass"]).shape
    kept, mass = np.asarray(r["kept"]), np.asarray(r["mass"])
    assert np.all((kept >= 0) & (kept <= 1 + 1e-9)) and np.all((mass > 0) & (mass < 1))
    assert kept.min() < 0.999  # this budget drops some of the needle
    # one example by hand: the needle = both occurrences of the answer's tokens before the question
    ex = make_example("passkey", TOK, 512, 0.5, 0, 1, 1)
    rows = np.nonzero(ex.answer)[0]
    text = TOK.encode(" " + ex.text)
    starts = [t for t in range(rows[0] - len(text)) if np.array_equal(ex.tokens[t:t + len(text)], text)]
    assert len(starts) == 2  # "The pass key is K. Remember it. K is the pass key."
    cols = np.concatenate([np.arange(t, t + len(text)) for t in starts])
    qs, ks, _ = layer_qk(sp, params, ex.tokens[None, :512])
    spc = sparsity_for(sp, 0.5)
    km = [column_recall(q, k, _estimate(q, k, jnp.arange(512), spc), rows=rows, cols=cols, block_size=spc.block_size)
          for q, k in zip(qs, ks)]
    np.testing.assert_allclose(kept[1, 0, 1], sum(k.sum() for k, _ in km) / sum(m.sum() for _, m in km), rtol=1e-5)
    np.testing.assert_allclose(mass[1, 0, 1], sum(m.sum() for _, m in km) / (2 * qs[0].shape[2]), rtol=1e-5)
    # a budget that keeps every column keeps the whole needle; one layer only; a layer the model lacks
    full = needle_recall(sp, params, TOK, [512], [0.5], samples=1, layers=[1],
                         budgets={"vertical_min": 512, "vertical_max": 512})
    assert full["layers"] == [1] and abs(full["mean_kept"] - 1) < 1e-6 and np.allclose(full["layer_kept"], 1)
    with pytest.raises(ValueError, match="layers \\[2\\] must be"):
        needle_recall(sp, params, TOK, [512], [0.5], samples=1, layers=[2])


def test_layer_qk_compiles_once_per_config_and_token_shape(tiny):
    """Recall and needle recall call ``layer_qk`` in loops (per length, per p): the program is built once per
    (config, mesh) and jit compiles it once per token shape; new parameters of the same shapes reuse it."""
    from mtraining_jax.eval.recall import _qk_program

    cfg, params = tiny
    sp = cfg.replace(attention_backend="reference", sparsity=dict(vertical_max=16, slash_max=2, vertical_min=1, last_q=64))
    x = np.asarray(jax.random.randint(jax.random.PRNGKey(3), (1, 256), 0, cfg.vocab_size), np.int32)
    q1, _, _ = layer_qk(sp, params, x)
    prog = _qk_program(sp, None)
    n = prog._cache_size()
    params2 = jax.tree.map(lambda t: t * 0.5, params)
    q2, _, _ = layer_qk(sp, params2, x)
    layer_qk(sp, params, x[:, ::-1].copy())
    assert _qk_program(sp, None) is prog and prog._cache_size() == n  # same shapes: no new compile
    assert not np.allclose(np.asarray(q1[-1]), np.asarray(q2[-1]))  # the new parameters were used
    layer_qk(sp, params, x[:, :128])
    assert prog._cache_size() == n + 1  # a new token shape: one more
