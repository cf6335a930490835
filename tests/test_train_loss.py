"""Chunked (memory-bounded) cross-entropy equals the plain loss: value and gradients."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtraining_jax.mesh import make_mesh, sequence_sharding
from mtraining_jax.train.loss import chunked_cross_entropy, cross_entropy_reference, sharded_cross_entropy


def _inputs(B=2, S=40, H=16, V=97, dtype=jnp.float64, seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    h = jax.random.normal(k[0], (B, S, H), dtype)
    w = jax.random.normal(k[1], (H, V), dtype) * 0.5
    y = jax.random.randint(k[2], (B, S), 0, V)
    m = (jax.random.uniform(k[3], (B, S)) > 0.3).astype(dtype)
    return h, w, y, m


def _weighted(fn):
    # A non-uniform cotangent on the loss (and a zero one on the count) via a scale.
    def f(h, w, y, m):
        loss, corr = fn(h, w, y, m)[:2]
        return 1.7 * loss, corr
    return f


@pytest.mark.parametrize("chunk", [3, 16, 80])
def test_chunked_matches_plain_value_and_grads(chunk):
    h, w, y, m = _inputs()
    ref = _weighted(cross_entropy_reference)
    got = _weighted(lambda *a: chunked_cross_entropy(*a, chunk_size=chunk))
    (lr, cr), (lg, cg) = ref(h, w, y, m), got(h, w, y, m)
    chex.assert_trees_all_close(lg, lr, rtol=1e-12, atol=1e-10)
    assert float(cg) == float(cr) and float(cr) > 0
    gr = jax.grad(lambda h, w: ref(h, w, y, m)[0], argnums=(0, 1))(h, w)
    gg = jax.grad(lambda h, w: got(h, w, y, m)[0], argnums=(0, 1))(h, w)
    chex.assert_trees_all_close(gg, gr, rtol=1e-10, atol=1e-12)
    # masked tokens get exactly zero hidden gradient
    assert float(jnp.abs(gg[0][m == 0]).max()) == 0.0


def test_chunked_float32_and_bfloat16_hidden():
    h, w, y, m = _inputs(dtype=jnp.float32)
    lr, _ = cross_entropy_reference(h, w, y, m)
    lg, _ = chunked_cross_entropy(h, w, y, m, chunk_size=16)
    np.testing.assert_allclose(lg, lr, rtol=1e-5)
    lb, _ = chunked_cross_entropy(h.astype(jnp.bfloat16), w, y, m, chunk_size=16)
    assert lb.dtype == jnp.float32
    np.testing.assert_allclose(lb, lr, rtol=3e-2)
    gb = jax.grad(lambda h: chunked_cross_entropy(h, w, y, m, 16)[0])(h.astype(jnp.bfloat16))
    assert gb.dtype == jnp.bfloat16


def test_bfloat16_gradients_scale_by_the_exact_cotangent():
    """The gradients come from the forward's pass (unit cotangent) and are scaled in the backward:
    the scale is applied in float32 (1.7 is not a bfloat16 number), dW keeps the weight's dtype."""
    h, w, y, m = _inputs(dtype=jnp.float32, seed=5)
    hb = h.astype(jnp.bfloat16)
    ref = jax.grad(lambda h, w: 1.7 * cross_entropy_reference(h, w, y, m)[0], argnums=(0, 1))(hb.astype(jnp.float32), w)
    got = jax.grad(lambda h, w: 1.7 * chunked_cross_entropy(h, w, y, m, 16)[0], argnums=(0, 1))(hb, w)
    assert got[0].dtype == jnp.bfloat16 and got[1].dtype == jnp.float32
    for g, r in zip(got, ref):
        err = float(jnp.abs(g.astype(jnp.float32) - r).max()) / float(jnp.abs(r).max())
        assert err < 2e-2, err  # bf16 hidden and dz
        # no bias in scale: 1.7 rounded to bfloat16 (1.703125) would put these at 1.0019-1.0020
        proj = float(jnp.sum(g.astype(jnp.float32) * r)) / float(jnp.sum(r * r))
        assert abs(proj - 1.0) < 6e-4, proj


def test_confident_tokens_keep_their_small_gradients_in_bfloat16():
    """A token predicted with ``p = 1 - eps`` has ``dz[y] = -eps``: with bf16 hidden states its
    ``dh`` row and its label's ``dW`` column stay within bf16 precision of the float64 reference
    per token (``exp(z - lse)`` in float32 loses ``ulp(z)`` of ``eps``: up to 9 % here; rounding
    ``m / s`` to bf16 against an exact 1 would leave ``2^-9``, i.e. 100 % at eps = 1e-3)."""
    h, w, _, _ = _inputs(B=1, S=96, H=16, V=97, dtype=jnp.float32, seed=7)
    hb = h.astype(jnp.bfloat16)
    w = w * 10.0
    z = hb.astype(jnp.float64) @ w.astype(jnp.bfloat16).astype(jnp.float64)
    y = jnp.argmax(z, axis=-1)  # confident and correct
    eps = 1.0 - jnp.max(jax.nn.softmax(z, axis=-1), axis=-1)[0]
    m = jnp.ones(y.shape, jnp.float32)
    ref = jax.grad(lambda h, w: cross_entropy_reference(h, w, y, m)[0], argnums=(0, 1))(
        hb.astype(jnp.float64), w.astype(jnp.bfloat16).astype(jnp.float64))
    got = jax.grad(lambda h, w: chunked_cross_entropy(h, w, y, m, 16)[0], argnums=(0, 1))(hb, w)
    sel = np.nonzero((eps > 1e-5) & (eps < 1e-2))[0]
    assert len(sel) >= 10, np.asarray(eps)
    dh, dh_ref = np.asarray(got[0][0], np.float64), np.asarray(ref[0][0])
    row_err = np.linalg.norm(dh - dh_ref, axis=-1) / np.linalg.norm(dh_ref, axis=-1)
    assert row_err[sel].max() < 1.5e-2, row_err[sel]
    # the label columns of dW: each a sum over the tokens of that label, all confident ones
    cols = np.unique(np.asarray(y[0])[sel])
    dw, dw_ref = np.asarray(got[1], np.float64)[:, cols], np.asarray(ref[1])[:, cols]
    col_err = np.linalg.norm(dw - dw_ref, axis=0) / np.linalg.norm(dw_ref, axis=0)
    assert col_err.max() < 1.5e-2, col_err


def test_a_tied_maximum_counts_as_correct():
    """``num_correct``: the label's logit is the row's maximum; on an exact tie with another logit it counts."""
    h = jnp.ones((1, 4, 2), jnp.float32)
    w = jnp.array([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]], jnp.float32)  # logits (1, 1, 0) for every token
    y = jnp.array([[0, 1, 2, 1]])
    m = jnp.array([[1.0, 1.0, 1.0, 0.0]])
    _, corr = chunked_cross_entropy(h, w, y, m, chunk_size=3)
    assert float(corr) == 2.0  # labels 0 and 1 tie for the maximum; label 2 does not; the 4th is masked


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_one_pass_max_and_sum_exp_on_extreme_rows(dtype):
    """The loss's single-pass ``(max, sum exp(z - max))`` equals the two-pass values on rows with
    logits far apart (1e4), all equal, a lone maximum, huge negative values and finfo's extremes:
    no overflow, no NaN from the identity, the maximum exact."""
    from mtraining_jax.train.loss import _max_and_sum_exp

    big = float(jnp.finfo(dtype).max) / 4
    rows = np.array([
        [0.0, 1e4, -1e4, 3.0, 2.0, -5.0, 1e4 - 1, 0.5],
        [7.0] * 8,
        [-1e30, -1e30, -1e30, 55.0, -1e30, -1e30, -1e30, -1e30],
        [-big, -big, -3.0, -big, -big, -big, -big, -big],
        [big, 0.0, -big, 1.0, 2.0, 3.0, 4.0, 5.0],
        np.linspace(-40, 40, 8),
    ])
    z = jnp.asarray(rows, dtype)
    m, s = jax.jit(_max_and_sum_exp)(z)
    ref_m = np.max(rows, axis=-1)
    ref_s = np.sum(np.exp(rows - ref_m[:, None]), axis=-1)
    np.testing.assert_array_equal(np.asarray(m), ref_m.astype(dtype))
    np.testing.assert_allclose(np.asarray(s), ref_s, rtol=4 * float(jnp.finfo(dtype).eps))
    # wide rows in many orders: the same as logsumexp
    zz = jax.random.normal(jax.random.PRNGKey(1), (5, 3001), dtype) * 30
    m2, s2 = _max_and_sum_exp(zz)
    chex.assert_trees_all_close(m2 + jnp.log(s2), jax.nn.logsumexp(zz, axis=-1),
                                rtol=20 * float(jnp.finfo(dtype).eps))


def test_sharded_matches_plain_on_mesh():
    mesh = make_mesh((2, 4))
    h, w, y, m = _inputs(B=2, S=64, dtype=jnp.float64, seed=3)
    hs = jax.device_put(h, sequence_sharding(mesh, 1, 3))
    ys = jax.device_put(y, sequence_sharding(mesh, 1, 2))
    ms = jax.device_put(m, sequence_sharding(mesh, 1, 2))

    def f(h, w):
        loss, corr, cnt = sharded_cross_entropy(h, w, ys, ms, mesh, chunk_size=3)
        return 0.3 * loss, (corr, cnt)

    (l, (c, n)), g = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(hs, w)
    (lr, cr), gr = jax.value_and_grad(lambda h, w: (0.3 * cross_entropy_reference(h, w, y, m)[0],
                                                     cross_entropy_reference(h, w, y, m)[1]),
                                      argnums=(0, 1), has_aux=True)(h, w)
    chex.assert_trees_all_close(l, lr, rtol=1e-12)
    assert float(c) == float(cr) and float(n) == float(m.sum())
    chex.assert_trees_all_close(g, gr, rtol=1e-10, atol=1e-12)


def test_bad_shapes_rejected():
    h, w, y, m = _inputs()
    with pytest.raises(ValueError, match="weight must be"):
        chunked_cross_entropy(h, w.T, y, m)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_cross_entropy(h, w, y, m, chunk_size=0)
    with pytest.raises(ValueError, match="labels"):
        chunked_cross_entropy(h, w, y[:, :-1], m)


def test_sparse_attention_metrics_reach_the_step_metrics():
    """The mtraining layers' work fraction and imbalance come out of the layer scan as attn/* metrics."""
    from flax import nnx

    from mtraining_jax.layouts import Layout
    from mtraining_jax.mesh import make_mesh
    from mtraining_jax.model.config import ModelConfig
    from mtraining_jax.model.qwen2 import Qwen2ForCausalLM
    from mtraining_jax.train.step import forward_with_metrics

    base = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=2, num_kv_heads=1,
                head_dim=32, sparsity={"block_size": 16, "last_q": 16, "vertical_min": 0, "vertical_max": 4,
                                       "slash_max": 2, "slash_p": 0.5, "vertical_p": 0.5})
    mesh, S = make_mesh((2, 4)), 256
    lay = Layout("block_striped", S, 8, stripe=16)
    tokens = lay.permute(jax.random.randint(jax.random.PRNGKey(0), (1, S), 0, 64))
    pos = jnp.asarray(lay.perm)
    sparse = Qwen2ForCausalLM(ModelConfig(**base, attention_backend="mtraining", dense_layers=(0,)), rngs=nnx.Rngs(0))
    h, metrics = jax.jit(lambda t: forward_with_metrics(sparse, t, pos, mesh=mesh))(tokens)
    assert set(metrics) == {"attn/work_fraction", "attn/worker_imbalance", "attn/step_imbalance"}
    assert 0.0 < float(metrics["attn/work_fraction"]) < 1.0  # genuinely sparse, less than dense causal work
    assert float(metrics["attn/worker_imbalance"]) >= 1.0 and float(metrics["attn/step_imbalance"]) >= 1.0
    _, stats = sparse(tokens, pos, mesh=mesh, return_stats=True)
    assert stats["work_fraction"].shape == (2,)  # one entry per mtraining layer (layer 0 is dense)
    dense = Qwen2ForCausalLM(ModelConfig(**base, attention_backend="reference"), rngs=nnx.Rngs(0))
    assert forward_with_metrics(dense, tokens, pos)[1] == {}
