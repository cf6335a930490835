"""Sanity of the dense reference that every attention path is checked against."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.reference import check_gqa, dense_attention


def _numpy_attention(q, k, v, q_pos, k_pos, mask, sm_scale):
    """Loop-by-head float64 NumPy softmax attention; returns ``out [B,Sq,Hq,D]``, ``lse [B,Hq,Sq]``."""
    B, Sq, Hq, D = q.shape
    g = Hq // k.shape[2]
    out = np.zeros((B, Sq, Hq, D))
    lse = np.full((B, Hq, Sq), -np.inf)
    for b in range(B):
        for h in range(Hq):
            s = q[b, :, h] @ k[b, :, h // g].T * sm_scale  # [Sq, Sk]
            allowed = (k_pos[None, :] <= q_pos[:, None]) & mask[b, h]
            for i in range(Sq):
                if not allowed[i].any():
                    continue
                row = s[i][allowed[i]]
                m = row.max()
                e = np.exp(row - m)
                lse[b, h, i] = m + np.log(e.sum())
                out[b, i, h] = (e / e.sum()) @ v[b, :, h // g][allowed[i]]
    return out, lse


@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (4, 1), (6, 2)])
def test_matches_float64_numpy_softmax(Hq, Hkv):
    rng = np.random.default_rng(Hq * 10 + Hkv)
    B, Sq, Sk, D = 2, 12, 16, 8
    q = rng.standard_normal((B, Sq, Hq, D)) * 2.0
    k = rng.standard_normal((B, Sk, Hkv, D))
    v = rng.standard_normal((B, Sk, Hkv, D))
    q_pos = rng.permutation(32)[:Sq]  # arbitrary global positions, not sorted
    k_pos = rng.permutation(32)[:Sk]
    mask = rng.random((B, Hq, Sq, Sk)) < 0.7
    out, lse = dense_attention(q, k, v, q_pos, k_pos, mask, sm_scale=0.3)
    ref_out, ref_lse = _numpy_attention(q, k, v, q_pos, k_pos, mask, 0.3)
    assert out.dtype == jnp.float64 and lse.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(out), ref_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(np.asarray(lse)[fin], ref_lse[fin], rtol=1e-12)


def test_fully_masked_rows_zero_out_minus_inf_lse_no_nan():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 6, 2, 8)).astype(np.float32)
    k = rng.standard_normal((1, 6, 1, 8)).astype(np.float32)
    v = rng.standard_normal((1, 6, 1, 8)).astype(np.float32)
    q_pos = np.arange(6)
    k_pos = np.arange(6) + 3  # queries 0, 1, 2 precede every key
    out, lse = dense_attention(q, k, v, q_pos, k_pos)
    assert out.dtype == jnp.float32 and lse.dtype == jnp.float32
    chex.assert_tree_all_finite(out)
    np.testing.assert_array_equal(np.asarray(out)[0, :3], 0.0)
    assert np.all(np.isneginf(np.asarray(lse)[0, :, :3]))
    assert np.all(np.isfinite(np.asarray(lse)[0, :, 3:]))
    cot = rng.standard_normal(out.shape).astype(np.float32)
    loss = lambda q, k, v: jnp.sum(dense_attention(q, k, v, q_pos, k_pos)[0] * cot)  # noqa: E731
    grads = jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)
    chex.assert_tree_all_finite(grads)
    np.testing.assert_array_equal(np.asarray(grads[0])[0, :3], 0.0)  # masked queries get no gradient


def test_gqa_head_grouping_is_contiguous():
    """Query head h reads KV head h // (Hq // Hkv): equal to MHA with KV heads repeated in place."""
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 10, 6, 4))
    k = rng.standard_normal((1, 10, 2, 4))
    v = rng.standard_normal((1, 10, 2, 4))
    out, lse = dense_attention(q, k, v)
    out_mha, lse_mha = dense_attention(q, np.repeat(k, 3, axis=2), np.repeat(v, 3, axis=2))
    chex.assert_trees_all_close((out, lse), (out_mha, lse_mha), rtol=1e-13, atol=1e-13)


def test_default_scale_and_non_causal():
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 5, 2, 16))
    k = rng.standard_normal((1, 7, 2, 16))
    v = rng.standard_normal((1, 7, 2, 16))
    out, lse = dense_attention(q, k, v, causal=False)
    ref_out, ref_lse = _numpy_attention(q, k, v, np.full(5, 10), np.arange(7), np.ones((1, 2, 5, 7), bool), 0.25)
    np.testing.assert_allclose(np.asarray(out), ref_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.asarray(lse), ref_lse, rtol=1e-12)


def test_bad_heads_and_shapes():
    with pytest.raises(ValueError, match=r"query heads \(6\) must be a positive multiple of KV heads \(4\)"):
        check_gqa(6, 4)
    with pytest.raises(ValueError, match=r"KV heads \(0\)"):
        check_gqa(4, 0)
    assert check_gqa(8, 2) == 4
    q = np.zeros((1, 4, 4, 8))
    with pytest.raises(ValueError, match=r"and k = v \[B,Sk,Hkv,D\]"):
        dense_attention(q, np.zeros((1, 4, 2, 8)), np.zeros((1, 4, 1, 8)))
