"""Merging partial attention results (``pallas_kernels.merge.merge_partials``) against attention
over the union of keys, float64."""

import chex
import jax.numpy as jnp
import numpy as np

from pallas_kernels.reference import dense_attention
from pallas_kernels.merge import merge_partials


def _partial(q, k, v, keep):
    """Dense partial over the keys where ``keep`` (a [Sk] bool) holds; float64."""
    mask = jnp.broadcast_to(jnp.asarray(keep)[None, :], (q.shape[1], k.shape[1]))
    return dense_attention(q, k, v, mask=mask, causal=False)


def test_merge_partials_equals_attention_over_union():
    rng = np.random.default_rng(6)
    q = rng.standard_normal((2, 8, 4, 16))
    k = rng.standard_normal((2, 12, 2, 16)) * 3.0
    v = rng.standard_normal((2, 12, 2, 16))
    keep_a = rng.random(12) < 0.5
    out_a, lse_a = _partial(q, k, v, keep_a)
    out_b, lse_b = _partial(q, k, v, ~keep_a)
    out, lse = merge_partials(out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = dense_attention(q, k, v, causal=False)
    chex.assert_trees_all_close((out, lse), (ref_out, ref_lse), rtol=1e-12, atol=1e-12)
    out2, lse2 = merge_partials(out_b, lse_b, out_a, lse_a)  # symmetric
    chex.assert_trees_all_close((out2, lse2), (ref_out, ref_lse), rtol=1e-12, atol=1e-12)


def test_merge_partials_minus_inf_sides():
    rng = np.random.default_rng(7)
    out_a = rng.standard_normal((1, 3, 2, 4)).astype(np.float32)
    lse_a = np.array([[[0.5, -np.inf, -np.inf], [1.0, 2.0, -np.inf]]], np.float32)  # [B, H, S]
    zeros = np.zeros_like(out_a)
    ninf = np.full_like(lse_a, -np.inf)
    out, lse = merge_partials(out_a, lse_a, zeros, ninf)  # empty right side: identity
    chex.assert_tree_all_finite(out)
    finite = np.isfinite(lse_a).transpose(0, 2, 1)[..., None]
    np.testing.assert_array_equal(np.asarray(out), np.where(finite, out_a, 0.0))
    np.testing.assert_array_equal(np.asarray(lse), lse_a)
    out, lse = merge_partials(zeros, ninf, zeros, ninf)  # both empty: 0 and -inf, no NaN
    np.testing.assert_array_equal(np.asarray(out), 0.0)
    assert np.all(np.isneginf(np.asarray(lse)))
    assert out.dtype == jnp.float32 and lse.dtype == jnp.float32


def test_merge_partials_large_logits_no_overflow():
    """lse ~ 1000 (exp would overflow float32): weights are taken relative to the max."""
    out_a = np.ones((1, 1, 1, 2), np.float32)
    out_b = -np.ones((1, 1, 1, 2), np.float32)
    lse_a = np.array([[[1000.0]]], np.float32)
    lse_b = np.array([[[1000.0 + np.log(3.0)]]], np.float32)
    out, lse = merge_partials(out_a, lse_a, out_b, lse_b)
    r = np.exp(np.float64(lse_b[0, 0, 0]) - np.float64(lse_a[0, 0, 0]))  # ~3, as stored in float32
    np.testing.assert_allclose(np.asarray(out), (1.0 - r) / (1.0 + r), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), 1000.0 + np.log1p(r), rtol=1e-7)
