"""bf16 gradients at the bf16 floor: relative error vs a float64 reference no worse than 1.2x that of
``jax.nn.dot_product_attention`` on the same bf16 inputs (single-device op, dense ring, MTraining
sparse ring; XLA twin kernels). Fails when ``delta = rowsum(dO * O)`` is formed from the output
rounded to bf16 instead of the float32 output (about 2x worse)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtraining_jax.attention.mtraining import MTrainingConfig, mtraining_attention
from pallas_kernels.reference import dense_attention
from mtraining_jax.ring.attention import ring_attention
from mtraining_jax.ring.config import RingOptions
from mtraining_jax.layouts import Layout
from mtraining_jax.mesh import make_mesh
from mtraining_jax.sparsity import SparsityConfig, estimate_index, index_to_mask
from pallas_kernels.api import block_sparse_attention

RATIO = 1.2


def _inputs(B, S, Hq, Hkv, D, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    # keys share a mean direction (as LLM keys do): its share of dQ cancels in the exact gradient,
    # so an error in delta shows there undamped
    q = jax.random.normal(ks[0], (B, S, Hq, D), jnp.float32).astype(jnp.bfloat16)
    k = (jax.random.normal(ks[1], (B, S, Hkv, D), jnp.float32) + 2.0).astype(jnp.bfloat16)
    v = jax.random.normal(ks[2], (B, S, Hkv, D), jnp.float32).astype(jnp.bfloat16)
    cot = jax.random.normal(ks[3], (B, S, Hq, D), jnp.float32)
    return q, k, v, cot


def _grads(fn, q, k, v, cot):
    # forward and backward as separate programs, so the residuals are materialised in their saved
    # dtype (as across a training step's remat boundary; one fused program may keep excess precision)
    out, pullback = jax.vjp(jax.jit(fn), q, k, v)
    return jax.jit(pullback)(cot.astype(out.dtype))


def _rel(g, ref):
    g, ref = np.asarray(g, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(g - ref) / np.linalg.norm(ref))


def _check(fn, q, k, v, cot, mask=None):
    """Gradient errors of ``fn`` vs float64 within RATIO x those of jax.nn.dot_product_attention."""
    f64 = lambda x: x.astype(jnp.float64)  # noqa: E731
    ref = _grads(lambda q, k, v: dense_attention(q, k, v, mask=mask)[0], f64(q), f64(k), f64(v), f64(cot))
    g = q.shape[2] // k.shape[2]
    base_mask = None if mask is None else jnp.broadcast_to(mask, (q.shape[0], q.shape[2]) + mask.shape[-2:])
    base = _grads(lambda q, k, v: jax.nn.dot_product_attention(
        q, jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2), mask=base_mask, is_causal=mask is None,
        implementation="xla"), q, k, v, cot)
    got = _grads(fn, q, k, v, cot)
    for name, a, b, r in zip("qkv", got, base, ref):
        assert a.dtype == jnp.bfloat16
        err, err_base = _rel(a, r), _rel(b, r)
        assert err <= RATIO * err_base, f"d{name}: {err:.3e} vs dot_product_attention {err_base:.3e}"


def test_single_device_op_bf16_gradients():
    q, k, v, cot = _inputs(1, 512, 6, 2, 64)
    _check(lambda q, k, v: block_sparse_attention(q, k, v, impl="xla"), q, k, v, cot)


def test_dense_ring_bf16_gradients():
    B, S, P = 1, 512, 4
    q, k, v, cot = _inputs(B, S, 4, 2, 64, seed=1)
    mesh = make_mesh((2, 2), jax.devices()[:P])
    lay = Layout("zigzag", S, P)

    def fn(q, k, v):
        out = ring_attention(lay.permute(q), lay.permute(k), lay.permute(v), jnp.asarray(lay.perm), mesh, impl="xla")
        return lay.unpermute(out)

    _check(fn, q, k, v, cot)


def test_sparse_ring_bf16_gradients():
    B, S, P = 1, 512, 4
    q, k, v, cot = _inputs(B, S, 4, 2, 64, seed=2)
    sp = SparsityConfig(vertical_p=0.8, slash_p=0.8, vertical_min=8, vertical_max=64, slash_max=8)
    cfg = MTrainingConfig(sparsity=sp, ring=RingOptions(impl="xla"))
    mesh = make_mesh((1, P), jax.devices()[:P])
    lay = cfg.make_layout(S, P)
    index = estimate_index(lay.permute(q), lay.permute(k), jnp.asarray(lay.perm), sp)  # the ring's index
    mask = index_to_mask(index, S, sp.block_size)

    def fn(q, k, v):
        return lay.unpermute(mtraining_attention(lay.permute(q), lay.permute(k), lay.permute(v), mesh, cfg))

    _check(fn, q, k, v, cot, mask=mask)
