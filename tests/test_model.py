"""Qwen2 model: layouts, remat policies, scan vs loop, ring vs reference (dispatch: test_dispatch.py)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtraining_jax.layouts import Layout
from mtraining_jax.mesh import make_mesh
from mtraining_jax.model.config import ModelConfig
from mtraining_jax.model.qwen2 import Qwen2ForCausalLM, backend_segments

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4, num_kv_heads=2,
            rope_theta=1e4, max_position_embeddings=512, initializer_range=0.2)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}


def _model(**kw):
    return Qwen2ForCausalLM(ModelConfig(**{**TINY, **kw}), rngs=nnx.Rngs(0))


def _with_config(model, **changes):
    """The same parameters under a different execution config."""
    graphdef, state = nnx.split(model)
    clone = Qwen2ForCausalLM(model.config.replace(**changes), rngs=nnx.Rngs(1))
    nnx.update(clone, state)
    return clone


def _tokens(b, s, seed=0, vocab=96):
    return jnp.asarray(np.random.RandomState(seed).randint(0, vocab, (b, s)), jnp.int32)


def _loss_and_grads(model, tokens, positions, mesh=None):
    w = jnp.asarray(np.random.RandomState(7).randn(*tokens.shape, model.config.vocab_size), jnp.float32)

    def loss(m):  # non-uniform cotangent on every logit; logits in the compute dtype
        h = m(tokens, positions, mesh=mesh)
        return jnp.sum(jnp.einsum("bsh,hv->bsv", h, m.lm_head_weight().astype(h.dtype)) * w.astype(h.dtype))

    return nnx.jit(nnx.value_and_grad(loss))(model)


# --------------------------------------------------------------------------- model
def test_forward_shapes_dtypes_and_contract():
    m = _model(tie_word_embeddings=False)
    t, pos = _tokens(2, 16), jnp.arange(16, dtype=jnp.int32)
    h = m(t, pos)
    assert h.shape == (2, 16, 32) and h.dtype == jnp.float32
    assert m.lm_head_weight().shape == (32, 96)
    lg = m.logits(t, pos)
    assert lg.shape == (2, 16, 96) and lg.dtype == jnp.float32
    chex.assert_trees_all_close(lg, jnp.einsum("bsh,hv->bsv", h, m.lm_head_weight()), atol=1e-5)
    tied = _model(tie_word_embeddings=True)
    np.testing.assert_array_equal(tied.lm_head_weight(), tied.embed_tokens.embedding[...].T)
    bf = _model(dtype="bfloat16")
    assert bf(t, pos).dtype == jnp.bfloat16
    assert bf.embed_tokens.embedding[...].dtype == jnp.float32
    with pytest.raises(ValueError, match=r"positions must be \[S\] = \[16\]"):
        m(t, pos[:8])


def test_model_is_causal():
    m = _model()
    pos = jnp.arange(24, dtype=jnp.int32)
    t1, t2 = _tokens(1, 24, 0), _tokens(1, 24, 0).at[:, 12:].set(5)
    h1, h2 = m(t1, pos), m(t2, pos)
    np.testing.assert_array_equal(h1[:, :12], h2[:, :12])
    assert float(jnp.abs(h1[:, 12:] - h2[:, 12:]).max()) > 1e-3


@pytest.mark.parametrize("layout", ["zigzag", "block_striped"])
def test_permuted_layout_gives_permuted_output(layout):
    """RoPE and the causal mask use global positions, so the layout is an exact relabelling."""
    m = _model(rope_scaling=YARN, dtype="float64", param_dtype="float64")
    S = 64
    lay = Layout(layout, S, 4, stripe=8)
    t = _tokens(2, S)
    natural = m.logits(t, jnp.arange(S, dtype=jnp.int32))
    laid = m.logits(lay.permute(t), jnp.asarray(lay.perm))
    chex.assert_trees_all_close(lay.unpermute(laid), natural, atol=1e-11, rtol=1e-11)


EXEC_VARIANTS = [
    dict(scan_layers=False, remat="none"),
    dict(scan_layers=True, remat="full"),
    dict(scan_layers=False, remat="save_attn"),
    dict(scan_layers=True, remat="save_attn"),
]


def test_remat_and_scan_variants_identical_outputs_and_gradients():
    base = _model(dtype="float64", param_dtype="float64", scan_layers=True, remat="none", rope_scaling=YARN,
                  num_layers=2)
    t, pos = _tokens(1, 16), jnp.arange(16, dtype=jnp.int32)
    loss0, g0 = _loss_and_grads(base, t, pos)
    for change in EXEC_VARIANTS:
        loss, g = _loss_and_grads(_with_config(base, **change), t, pos)
        tol = 1e-12  # float64 throughout: only summation order may differ
        np.testing.assert_allclose(loss, loss0, rtol=tol, err_msg=str(change))
        chex.assert_trees_all_close(nnx.state(g), nnx.state(g0), atol=tol, rtol=tol)


def test_remat_policies_change_what_is_saved():
    """Residuals kept for the backward pass: none > save_attn (layer input + attention output) > full."""
    base = _model(remat="none")
    t, pos = _tokens(1, 16), jnp.arange(16, dtype=jnp.int32)

    def n_residuals(model):
        graphdef, state = nnx.split(model)
        f = lambda s: nnx.merge(graphdef, s)(t, pos).sum()  # noqa: E731
        _, vjp = jax.vjp(f, state)
        return sum(x.size for x in jax.tree.leaves(vjp) if hasattr(x, "size"))

    sizes = {p: n_residuals(_with_config(base, remat=p)) for p in ("none", "save_attn", "full")}
    assert sizes["none"] > sizes["save_attn"] > sizes["full"], sizes


def test_save_attn_never_recomputes_the_attention_forward():
    """Compiled FLOPs of jit(grad): ``none`` < ``save_attn`` (re-runs projections, norms, MLP) <
    ``full`` (re-runs the whole layer). A checkpoint that saved only the attention output would
    re-run the attention forward to rebuild its residuals, costing as much as ``full``."""
    base = _model(remat="none")
    t, pos = _tokens(1, 64), jnp.arange(64, dtype=jnp.int32)

    def flops(model):
        graphdef, state = nnx.split(model)
        grad = jax.jit(jax.grad(lambda s: nnx.merge(graphdef, s)(t, pos).astype(jnp.float32).sum()))
        cost = grad.lower(state).compile().cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["flops"]

    f = {p: flops(_with_config(base, remat=p)) for p in ("none", "save_attn", "full")}
    assert f["none"] < f["save_attn"] < f["full"], f
    # what full recomputes on top of save_attn is the attention core: at least the two S x S matmuls
    cfg = base.config
    attn_core = 2 * 2 * 64 * 64 * cfg.num_heads * cfg.head_dim * cfg.num_layers / 2  # causal half
    assert f["full"] - f["save_attn"] >= attn_core, (f, attn_core)


def test_backend_segments():
    assert backend_segments(("ring", "ring", "reference", "ring")) == [(0, 2, "ring"), (2, 3, "reference"), (3, 4, "ring")]


# --------------------------------------------------------------------------- ring
@pytest.fixture(scope="module")
def mesh():
    return make_mesh((2, 4))


def _ring_setup(ring_order):
    S, P = 128, 8
    lay = Layout("block_striped", S, P, stripe=8)
    ref_model = _model(rope_scaling=YARN, tie_word_embeddings=False, head_dim=32)  # kernels: head_dim >= 32
    ring_model = _with_config(ref_model, attention_backend="ring", dense_layers=(0,), dense_backend="reference",
                              ring_order=ring_order)
    assert ring_model.config.layer_backends == ("reference", "ring", "ring")
    return lay, ref_model, ring_model, _tokens(2, S, 3)


@pytest.mark.parametrize("ring_order", ["hierarchical", "flat"])
def test_ring_backend_matches_reference_on_8_devices(mesh, ring_order):
    """block_striped layout on a 2x4 mesh: permute, run with the ring, unpermute == reference."""
    lay, ref_model, ring_model, t = _ring_setup(ring_order)
    S = t.shape[1]
    natural = ref_model.logits(t, jnp.arange(S, dtype=jnp.int32))
    pos = jnp.asarray(lay.perm)
    graphdef, state = nnx.split(ring_model)

    @jax.jit
    def run(state, tokens):
        return nnx.merge(graphdef, state).logits(tokens, pos, mesh=mesh)

    ring_logits = lay.unpermute(run(state, lay.permute(t)))
    chex.assert_trees_all_close(ring_logits, natural, atol=1e-5, rtol=0)


def test_ring_backend_gradients_match_reference(mesh):
    """Parameter gradients through the ring's custom VJP == the reference backend's, same layout."""
    lay, ref_model, ring_model, t = _ring_setup("hierarchical")
    t_laid, pos = lay.permute(t), jnp.asarray(lay.perm)
    loss_r, g_r = _loss_and_grads(ref_model, t_laid, pos)
    loss_g, g_g = _loss_and_grads(ring_model, t_laid, pos, mesh=mesh)
    np.testing.assert_allclose(loss_g, loss_r, rtol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(g_g)),
                            jax.tree.leaves(nnx.to_pure_dict(g_r))):
        scale = float(jnp.abs(b).max())
        err = float(jnp.abs(a - b).max())
        assert err <= 1e-5 * scale, (jax.tree_util.keystr(path), err, scale)


# --------------------------------------------------------------------------- mtraining
# 16-token blocks so 128 tokens split over 8 ranks; slash_min = all 8 block diagonals = full causal index.
FULL_SPARSITY = {"block_size": 16, "last_q": 16, "vertical_min": 0, "vertical_max": 4, "slash_min": 8, "slash_max": 8}


@pytest.mark.parametrize("ring_order", ["hierarchical", "flat"])
def test_mtraining_backend_full_index_matches_reference(mesh, ring_order):
    """reference, ring and mtraining (full index) backends give the same logits on a 2x4 mesh."""
    lay, ref_model, ring_model, t = _ring_setup(ring_order)
    lay = Layout("block_striped", t.shape[1], 8, stripe=16)
    sparse_model = _with_config(ref_model, attention_backend="mtraining", dense_layers=(0,),
                                dense_backend="reference", ring_order=ring_order, sparsity=FULL_SPARSITY)
    assert sparse_model.config.layer_backends == ("reference", "mtraining", "mtraining")
    natural = ref_model.logits(t, jnp.arange(t.shape[1], dtype=jnp.int32))
    pos = jnp.asarray(lay.perm)
    graphdef, state = nnx.split(sparse_model)
    run = jax.jit(lambda state, tokens, pos: nnx.merge(graphdef, state).logits(tokens, pos, mesh=mesh))
    chex.assert_trees_all_close(lay.unpermute(run(state, lay.permute(t), pos)), natural, atol=1e-5, rtol=0)
    # tokens in a different layout than the config's: loud NaNs, never a silently wrong mask
    wrong = jnp.asarray(Layout("zigzag", t.shape[1], 8).perm)
    assert bool(jnp.all(jnp.isnan(run(state, t, wrong))))


def test_mtraining_backend_sparse_gradients_flow(mesh):
    """A genuinely sparse index: finite loss and gradients that differ from the dense model's."""
    lay, ref_model, _, t = _ring_setup("hierarchical")
    lay = Layout("block_striped", t.shape[1], 8, stripe=16)
    sparse = dict(FULL_SPARSITY, slash_min=1, slash_max=2, vertical_max=4, slash_p=0.3, vertical_p=0.3)
    sparse_model = _with_config(ref_model, attention_backend="mtraining", sparsity=sparse)
    t_laid, pos = lay.permute(t), jnp.asarray(lay.perm)
    loss_s, g_s = _loss_and_grads(sparse_model, t_laid, pos, mesh=mesh)
    loss_r, g_r = _loss_and_grads(ref_model, t_laid, pos)
    loss_s, loss_r = float(loss_s), float(loss_r)
    assert np.isfinite(loss_s) and loss_s != pytest.approx(loss_r, rel=1e-6)
    leaves = jax.tree.leaves(nnx.to_pure_dict(g_s))
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in leaves)


def test_mtraining_config_errors():
    with pytest.raises(ValueError, match="unknown sparsity keys"):
        ModelConfig(**_TINY_FOR_ERRORS, attention_backend="mtraining", sparsity={"p": 0.9})
    with pytest.raises(ValueError, match="vertical_p"):
        ModelConfig(**_TINY_FOR_ERRORS, attention_backend="mtraining", sparsity={"vertical_p": 1.5})
    with pytest.raises(ValueError, match="token_striped"):
        ModelConfig(**_TINY_FOR_ERRORS, attention_backend="mtraining", layout="token_striped")


_TINY_FOR_ERRORS = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=32)
