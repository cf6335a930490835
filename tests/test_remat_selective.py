"""Selective checkpointing (``remat: selective``, issue 20): which layers keep their attention
residuals, gradients equal to ``remat: none``, and the compiled memory of ``jit(grad)`` and of the
training step ordered ``none > save_attn > selective > full``."""

import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtraining_jax.model.config import ModelConfig
from mtraining_jax.model.qwen2 import Qwen2ForCausalLM
from mtraining_jax.train.config import load_config
from mtraining_jax.train.plan import memory_plan

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
            rope_theta=1e4, max_position_embeddings=512, initializer_range=0.2)
CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "tiny_cpu.yaml")


def _cfg(**kw):
    return ModelConfig(**{**TINY, **kw})


def test_saved_layers_rule_and_validation():
    assert _cfg(remat="selective").layer_remats == ("save_attn", "save_attn", "full", "full")  # 0.5; all dense
    sparse = dict(remat="selective", attention_backend="mtraining", layout="contiguous")
    assert _cfg(**sparse).layer_remats == ("save_attn", "save_attn", "full", "full")  # contiguous: few scans
    assert _cfg(remat="selective", remat_save_fraction=0.0).layer_remats == ("full",) * 4
    assert _cfg(remat="selective", remat_save_fraction=1.0).layer_remats == ("save_attn",) * 4
    # dense-attention layers first (the costliest attention forward to recompute), then by index
    mixed = _cfg(remat="selective", remat_save_fraction=0.5, attention_backends=("mtraining", "ring", "mtraining", "ring"),
                 layout="contiguous")
    assert mixed.remat_saved_layers == (1, 3)
    assert _cfg(**sparse, remat_save_fraction=0.25, num_layers=8).remat_saved_layers == (0, 1)
    assert _cfg(remat="selective", remat_save_fraction=0.75, dense_layers=(2,), attention_backend="mtraining",
                layout="contiguous").remat_saved_layers == (0, 1, 2)  # dense 2 first, then sparse in order
    explicit = _cfg(remat="selective", remat_save_layers=[3, 1])
    assert explicit.remat_saved_layers == (1, 3) and explicit.layer_remat(0) == "full"
    assert ModelConfig.from_dict(explicit.to_dict()) == explicit and explicit.to_dict()["remat_save_layers"] == [3, 1]
    assert _cfg(remat="save_attn").remat_saved_layers == () and _cfg(remat="full").layer_remats == ("full",) * 4
    with pytest.raises(ValueError, match=r"remat_save_layers \[4\] out of range for num_layers=4"):
        _cfg(remat="selective", remat_save_layers=[0, 4])
    with pytest.raises(ValueError, match="remat_save_layers is set .* but remat is 'full'"):
        _cfg(remat="full", remat_save_layers=[0])
    with pytest.raises(ValueError, match="remat_save_fraction must be a number in \\[0, 1\\], got 1.5"):
        _cfg(remat="selective", remat_save_fraction=1.5)
    with pytest.raises(ValueError, match="remat must be one of"):
        _cfg(remat="sequence")


def _loss_and_grads(model, tokens, positions):
    w = jnp.asarray(np.random.RandomState(7).randn(*tokens.shape, model.config.vocab_size), model.config.dtype)

    def loss(m):
        h = m(tokens, positions)
        return jnp.sum(jnp.einsum("bsh,hv->bsv", h, m.lm_head_weight().astype(h.dtype)) * w)

    return nnx.jit(nnx.value_and_grad(loss))(model)


def _with_config(model, **changes):
    _, state = nnx.split(model)
    clone = Qwen2ForCausalLM(model.config.replace(**changes), rngs=nnx.Rngs(1))
    nnx.update(clone, state)
    return clone


@pytest.mark.parametrize("scan_layers", [True, False])
def test_selective_gradients_equal_no_remat(scan_layers):
    base = Qwen2ForCausalLM(_cfg(dtype="float64", param_dtype="float64", scan_layers=scan_layers), rngs=nnx.Rngs(0))
    t = jnp.asarray(np.random.RandomState(0).randint(0, 96, (1, 32)), jnp.int32)
    pos = jnp.arange(32, dtype=jnp.int32)
    loss0, g0 = _loss_and_grads(base, t, pos)
    # scan: 3 runs (full, save_attn x2, full) -> 3 scans over parameter slices
    change = dict(remat="selective", remat_save_layers=(1, 2) if scan_layers else (0, 3))
    loss, g = _loss_and_grads(_with_config(base, **change), t, pos)
    np.testing.assert_allclose(loss, loss0, rtol=1e-12)
    chex.assert_trees_all_close(nnx.state(g), nnx.state(g0), atol=1e-12, rtol=1e-12)


def _grad_temp_bytes(cfg, S=64):
    model = Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    t = jnp.zeros((1, S), jnp.int32)
    pos = jnp.arange(S, dtype=jnp.int32)
    grad = jax.jit(jax.grad(lambda s: nnx.merge(graphdef, s)(t, pos).astype(jnp.float32).sum()))
    return grad.lower(state).compile().memory_analysis().temp_size_in_bytes


def test_selective_extremes_compile_to_full_and_save_attn():
    """Saving no layer / every layer is exactly ``full`` / ``save_attn`` (one scan, same program)."""
    two = dict(num_layers=2)
    assert (_grad_temp_bytes(_cfg(remat="selective", remat_save_fraction=0.0, **two))
            == _grad_temp_bytes(_cfg(remat="full", **two)))
    assert (_grad_temp_bytes(_cfg(remat="selective", remat_save_fraction=1.0, **two))
            == _grad_temp_bytes(_cfg(remat="save_attn", **two)))


def test_train_step_temp_bytes_ordering():
    """The compiled training step (``--plan``'s memory analysis, one device, 4 layers, 512
    tokens): XLA's temporaries shrink from ``none`` to ``save_attn`` to ``selective`` (2 of 4
    layers save_attn) to ``full``."""
    S = 512
    base = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=4", "model.num_heads=4",
            "model.num_kv_heads=2", "model.attention_backend=reference", "model.dense_layers=[]",
            "model.layout=contiguous", f"model.max_position_embeddings={S}", f"data.seq_len={S}",
            "data.layout=contiguous", "mesh.shape=[1,1]", "eval.every=0", "eval.passkey_samples=0"]
    plans = {r: memory_plan(load_config(CONFIG, base + [f"model.remat={r}"]))
             for r in ("none", "save_attn", "selective", "full")}
    temp = {r: p.temp for r, p in plans.items()}
    assert temp["none"] > temp["save_attn"] > temp["selective"] > temp["full"], temp
    # selective sits between full and save_attn roughly in proportion to the saved layers (2 of 4)
    mid = (temp["save_attn"] + temp["full"]) / 2
    assert abs(temp["selective"] - mid) < 0.25 * (temp["save_attn"] - temp["full"]), temp
    assert plans["selective"].saved_layers == 2 and "remat=selective (2/4 layers save_attn)" in plans["selective"].table()
