"""Input holes closed at the entry points (issue 19): integer q/k/v, positions that are not a
permutation, checked by the one shared contract (:mod:`pallas_kernels.inputs`) before any work."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtraining_jax.attention.dispatch import attention
from mtraining_jax.attention.mtraining import MTrainingConfig, mtraining_attention
from mtraining_jax.ring.attention import ring_attention
from mtraining_jax.mesh import make_mesh
from mtraining_jax.sparsity import SparsityConfig, estimate_index
from pallas_kernels import api
from pallas_kernels.inputs import check_qkv
from pallas_kernels.reference import dense_attention

S, H, D = 128, 2, 64


def _qkv(dtype=jnp.float32):
    x = jnp.ones((1, S, H, D), dtype)
    return x, x, x


def _entry_points(mesh):
    pos = jnp.arange(S, dtype=jnp.int32)
    return {
        "kernel op": lambda q, k, v: api.block_sparse_attention(q, k, v, impl="xla"),
        # the raw passes with a narrower output / dQ: q's dtype is the one named, not out_dtype / dq_dtype
        "kernel fwd": lambda q, k, v: api.block_sparse_attention_fwd(q, k, v, pos, pos, None, impl="xla",
                                                                     out_dtype=q.dtype),
        "kernel bwd": lambda q, k, v: api.block_sparse_attention_bwd(
            q, k, v, pos, pos, None, q, jnp.zeros((1, H, S)), jnp.zeros((1, H, S)), impl="xla", dq_dtype=q.dtype),
        "reference": lambda q, k, v: dense_attention(q, k, v),
        "dispatch": lambda q, k, v: attention(q, k, v, pos, backend="reference"),
        "dense ring": lambda q, k, v: ring_attention(q, k, v, pos, mesh),
        "sparse ring": lambda q, k, v: mtraining_attention(q, k, v, mesh, MTrainingConfig(
            sparsity=SparsityConfig(vertical_min=1, last_q=16))),
        "estimate": lambda q, k, v: estimate_index(q, k, pos, SparsityConfig(vertical_min=1, last_q=16)),
    }


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_])
def test_non_float_qkv_rejected_everywhere_naming_the_dtype(dtype):
    mesh = make_mesh((1, 1), jax.devices()[:1])
    q, k, v = _qkv(dtype)
    for name, f in _entry_points(mesh).items():
        t0 = time.perf_counter()
        with pytest.raises(ValueError, match=f"floating-point.*{jnp.dtype(dtype).name}"):
            f(q, k, v)
        assert time.perf_counter() - t0 < 1.0, name


def test_float_inputs_still_pass_the_checker():
    for dt in (jnp.bfloat16, jnp.float16, jnp.float32):
        assert check_qkv(*_qkv(dt)) == 1
    q = jnp.ones((1, S, 4, D))
    assert check_qkv(q, jnp.ones((1, 2 * S, 2, D)), jnp.ones((1, 2 * S, 2, D)), same_seq=False) == 2
    with pytest.raises(ValueError, match="disagree on batch, sequence"):
        check_qkv(q, jnp.ones((1, 2 * S, 2, D)), jnp.ones((1, 2 * S, 2, D)))


@pytest.mark.parametrize("positions, missing", [
    (np.zeros(S, np.int32), 1),                                    # all zero
    (np.r_[np.arange(S - 1), S - 2].astype(np.int32), S - 1),      # a duplicate
    (np.arange(1, S + 1, dtype=np.int32), 0),                      # shifted
])
def test_positions_must_be_a_permutation(positions, missing):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=f"permutation of 0..{S - 1}.*position {missing} is missing"):
        attention(q, k, v, jnp.asarray(positions), backend="reference")
    perm = np.random.default_rng(0).permutation(S).astype(np.int32)  # any permutation is accepted
    out = attention(q, k, v, jnp.asarray(perm), backend="reference")
    assert out.shape == q.shape and bool(jnp.all(jnp.isfinite(out)))
    # under jit the positions are traced: the check cannot run, and does not break tracing
    jax.jit(lambda p: attention(q, k, v, p, backend="reference"))(jnp.asarray(perm))
