"""Attention dispatch (``mtraining_jax.attention.dispatch.attention``): backends agree, errors name the value."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtraining_jax.attention.dispatch import attention
from pallas_kernels.reference import dense_attention
from mtraining_jax.layouts import Layout


def _qkv(seed=0, b=2, s=32, hq=4, hkv=2, d=8, dtype=jnp.float32):
    r = np.random.RandomState(seed)
    return tuple(jnp.asarray(r.randn(b, s, h, d), dtype) for h in (hq, hkv, hkv))


def test_dispatch_reference_and_cudnn_agree_in_natural_order():
    q, k, v = _qkv()
    pos = jnp.arange(32, dtype=jnp.int32)
    ref = attention(q, k, v, pos, backend="reference")
    out = attention(q, k, v, pos, backend="cudnn")
    assert ref.dtype == q.dtype and ref.shape == q.shape
    chex.assert_trees_all_close(out, ref, atol=1e-5, rtol=1e-5)
    out_jit = jax.jit(lambda q, k, v, p: attention(q, k, v, p, backend="cudnn"))(q, k, v, pos)
    chex.assert_trees_all_close(out_jit, ref, atol=1e-5, rtol=1e-5)


def test_dispatch_reference_is_dense_attention_by_position():
    q, k, v = _qkv(1)
    perm = Layout("zigzag", 32, 4).perm
    out = attention(q, k, v, perm, backend="reference", sm_scale=0.3)
    ref, _ = dense_attention(q, k, v, perm, perm, sm_scale=0.3)
    chex.assert_trees_all_close(out, ref, atol=0, rtol=0)


def test_dispatch_cudnn_rejects_permuted_positions():
    q, k, v = _qkv()
    perm = Layout("zigzag", 32, 4).perm
    with pytest.raises(ValueError, match=r"arange\(S\).*positions\[4\] = 28, expected 4"):
        attention(q, k, v, perm, backend="cudnn")
    # traced positions cannot be checked at trace time: the result is poisoned instead
    out = jax.jit(lambda p: attention(q, k, v, p, backend="cudnn"))(jnp.asarray(perm))
    assert bool(jnp.all(jnp.isnan(out)))


def test_dispatch_errors():
    q, k, v = _qkv()
    pos = jnp.arange(32, dtype=jnp.int32)
    with pytest.raises(ValueError, match="'flash'"):
        attention(q, k, v, pos, backend="flash")
    with pytest.raises(ValueError, match="mesh"):
        attention(q, k, v, pos, backend="mtraining")
    with pytest.raises(ValueError, match="mesh"):
        attention(q, k, v, pos, backend="ring")
    with pytest.raises(ValueError, match=r"\[S\] = \[32\]"):
        attention(q, k, v, pos[:16], backend="reference")
    with pytest.raises(ValueError, match="multiple of KV heads"):
        attention(q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2), pos, backend="reference")
