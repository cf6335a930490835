"""The ``msa`` backend in the model: config validation, index-branch parameters, warm-up equals the
dense model, the KL reaches only the index branch and the LM loss never does, remat policies
agree, and HF export / import keeps the index branch in its own file."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtraining_jax.model.config import ModelConfig
from mtraining_jax.model.hf_io import (MSA_INDEX_FILE, load_hf_checkpoint, model_params, read_hf_tensors,
                                       save_hf_checkpoint)
from mtraining_jax.model.qwen2 import Qwen2ForCausalLM

S = 256


def _cfg(**kw):
    base = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=32, attention_backend="msa", dense_layers=(0,), dense_backend="reference",
                layout="contiguous", msa={"index_dim": 16, "top_k": 2}, attention_impl="xla")
    base.update(kw)
    return ModelConfig(**base)


def test_config_validation_and_param_count():
    cfg = _cfg()
    assert cfg.layer_backends == ("reference", "msa") and cfg.has_msa and cfg.msa_index_dim == 16
    assert cfg.msa_config().top_k == 2 and cfg.msa_config().block_size == 64
    assert cfg.msa_config().selection == "causal" and _cfg(msa={"selection": "block_mean"}).msa_config().selection \
        == "block_mean"
    m = Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0))
    n = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(model_params(m)))
    assert n == cfg.num_params()
    attn = model_params(m)["layers"]["self_attn"]
    assert attn["index_q"]["kernel"].shape == (2, 64, 2 * 16) and attn["index_k"]["kernel"].shape == (2, 64, 16)
    assert "index_q" not in model_params(Qwen2ForCausalLM(_cfg(attention_backend="reference", msa=None),
                                                          rngs=nnx.Rngs(0)))["layers"]["self_attn"]
    assert ModelConfig(**{**_cfg().to_dict(), "msa": None}).msa_index_dim == 64  # paper-free default
    for bad, match in (({"index_dim": 0}, "index_dim"), ({"top_k": 0}, "top_k"), ({"block_size": 128}, "block_size"),
                       ({"topk": 3}, "unknown msa keys"), ({"pooling": "sum"}, "pooling"),
                       ({"selection": "rows"}, "selection must be one of")):
        with pytest.raises(ValueError, match=match):
            _cfg(msa=bad)
    with pytest.raises(ValueError, match="layout"):
        _cfg(layout="token_striped")
    with pytest.raises(ValueError, match=r"msa and mtraining layers in one model are not supported .*'mtraining', 'msa'"):
        _cfg(attention_backends=("mtraining", "msa"))


def _tokens():
    return jax.random.randint(jax.random.PRNGKey(1), (1, S), 0, 64)


def test_warmup_equals_dense_model_and_remat_agrees():
    cfg = _cfg()
    m = Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0))
    tok, pos = _tokens(), jnp.arange(S)
    run = nnx.jit(lambda m, w: m(tok, pos, return_stats=True, msa_warmup=w))
    h_w, st_w = run(m, True)
    m.config = cfg.replace(attention_backend="reference")  # same parameters, every layer dense
    np.testing.assert_allclose(np.asarray(h_w), np.asarray(nnx.jit(lambda m: m(tok, pos))(m)), atol=2e-5)
    m.config = cfg
    np.testing.assert_allclose(np.asarray(st_w["work_fraction"]), [1.0])
    h_s, st_s = run(m, False)
    assert float(st_s["work_fraction"][0]) < 1.0 and float(st_s["msa_kl"][0]) > 0
    m.config = cfg.replace(remat="save_attn")
    h_r, st_r = nnx.jit(lambda m: m(tok, pos, return_stats=True))(m)
    np.testing.assert_allclose(np.asarray(h_r), np.asarray(h_s), atol=1e-6)


@pytest.mark.parametrize("selection", ["causal", "block_mean"])
def test_sparse_msa_model_is_causal_with_the_default_selection(selection):
    """Tokens from position 150 on changed (a 64-row query block holds rows 128-191): the logits
    before 150 are bit-identical with ``selection="causal"``; with ``"block_mean"`` the block's
    earlier rows see the change through the selection (both layers sparse, top-2 of 4 blocks)."""
    m = Qwen2ForCausalLM(_cfg(dense_layers=(), msa={"index_dim": 16, "top_k": 2, "selection": selection}),
                         rngs=nnx.Rngs(0))
    pos = jnp.arange(S)
    t1 = _tokens()
    t2 = t1.at[:, 150:].set(jax.random.randint(jax.random.PRNGKey(7), (1, S - 150), 0, 64))
    run = nnx.jit(lambda m, t: m.logits(t, pos))
    a, b = np.asarray(run(m, t1)), np.asarray(run(m, t2))
    assert np.abs(a[:, 150:] - b[:, 150:]).max() > 1e-3
    if selection == "causal":
        np.testing.assert_array_equal(a[:, :150], b[:, :150])
    else:
        assert np.abs(a[:, 128:150] - b[:, 128:150]).max() > 1e-6


def test_kl_gradient_reaches_only_the_index_branch():
    cfg = _cfg()
    m = Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0))
    tok, pos = _tokens(), jnp.arange(S)
    gdef, params = nnx.split(m, nnx.Param)

    def kl(p):
        return jnp.sum(nnx.merge(gdef, p)(tok, pos, return_stats=True)[1]["msa_kl"])

    def lm(p):
        return jnp.sum(nnx.merge(gdef, p)(tok, pos) ** 2)

    for fn, index_only in ((kl, True), (lm, False)):
        g = nnx.to_pure_dict(jax.jit(jax.grad(fn))(params))
        flat = {"/".join(str(getattr(k, "key", k)) for k in path): float(jnp.abs(a).max())
                for path, a in jax.tree_util.tree_leaves_with_path(g)}
        idx = {k: v for k, v in flat.items() if "index_" in k}
        rest = {k: v for k, v in flat.items() if "index_" not in k}
        if index_only:
            assert all(v == 0.0 for v in rest.values()), {k: v for k, v in rest.items() if v}
            assert idx["layers/self_attn/index_q/kernel"] > 0 and idx["layers/self_attn/index_k/kernel"] > 0
        else:
            assert all(v == 0.0 for v in idx.values()) and max(rest.values()) > 0


def test_hf_export_keeps_the_index_branch_separate(tmp_path):
    cfg = _cfg()
    m = Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(3))
    files = save_hf_checkpoint(m, tmp_path / "ck")
    assert (tmp_path / "ck" / MSA_INDEX_FILE) in files
    assert not any("index_" in n for n in read_hf_tensors(tmp_path / "ck"))
    over = dict(attention_backend="msa", dense_layers=(0,), dense_backend="reference", layout="contiguous",
                msa={"index_dim": 16, "top_k": 2}, attention_impl="xla")
    cfg2, m2 = load_hf_checkpoint(tmp_path / "ck", **over)
    a, b = model_params(m), model_params(m2)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)
    # without the side file (a plain dense checkpoint): main weights load, the index is initialised
    (tmp_path / "ck" / MSA_INDEX_FILE).unlink()
    _, m3 = load_hf_checkpoint(tmp_path / "ck", **over)
    c = model_params(m3)
    np.testing.assert_array_equal(np.asarray(c["layers"]["self_attn"]["q_proj"]["kernel"]),
                                  np.asarray(a["layers"]["self_attn"]["q_proj"]["kernel"]))
    iq = np.asarray(c["layers"]["self_attn"]["index_q"]["kernel"])
    assert iq.shape == (2, 64, 32) and abs(iq.std() - cfg.initializer_range) < 0.005
    # a dense model ignores / does not write the index file
    _, m4 = load_hf_checkpoint(tmp_path / "ck")
    save_hf_checkpoint(m4, tmp_path / "dense")
    assert not (tmp_path / "dense" / MSA_INDEX_FILE).exists()


def test_train_step_logs_the_kl_gradient_norm_of_the_index_branch():
    """``msa/kl_grad_norm`` equals ``|| d(kl_coef * sum_layers KL) / d(index params) ||`` computed
    directly with ``jax.grad`` on the model's KL statistics (a sparse step; the warm-up's KL takes
    the same path with the full support)."""
    import optax

    from mtraining_jax.train.config import MSATrainConfig
    from mtraining_jax.train.data import Batch
    from mtraining_jax.train.state import bind, split_model
    from mtraining_jax.train.step import index_branch_grad_norm, make_train_step

    cfg = _cfg(num_layers=3, dense_layers=(0,))  # two msa layers
    parts, init_fn = split_model(Qwen2ForCausalLM, cfg, 0)
    params = init_fn()
    tok, pos = _tokens(), jnp.arange(S)
    coef, warmup_steps = 0.5, 0

    def kl_term(p):
        return coef * jnp.sum(bind(parts, p)(tok, pos, return_stats=True, msa_warmup=warmup_steps > 0)[1]["msa_kl"])

    g = jax.jit(jax.grad(kl_term))(params)
    flat = jax.tree_util.tree_leaves_with_path(g)
    idx = [a for path, a in flat if any(getattr(k, "key", None) in ("index_q", "index_k") for k in path)]
    assert len(idx) == 2
    want = float(np.sqrt(sum(float(jnp.sum(jnp.square(a))) for a in idx)))
    assert want > 0 and float(index_branch_grad_norm(g)) == pytest.approx(want, rel=1e-6)

    opt = optax.sgd(0.0)
    step = make_train_step(parts, opt, lambda s: 0.0, None, 64, msa=MSATrainConfig(warmup_steps, coef))
    state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": opt.init(params),
             "rng": jnp.zeros((2,), jnp.uint32)}
    labels = jnp.roll(tok, -1, axis=1)
    batch = Batch(tok[None], labels[None], jnp.ones((1, 1, S), jnp.float32), pos)
    _, metrics = step(state, batch)
    assert float(metrics["msa/warmup"]) == float(warmup_steps > 0)
    assert float(metrics["msa/kl_grad_norm"]) == pytest.approx(want, rel=1e-4)
