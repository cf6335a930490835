"""The pre-filtered exact top-k of the index estimate (:mod:`mtraining_jax.sparsity.topk`): the same
values and indices as ``jax.lax.top_k`` (ties to the lower index) on every kind of score row, through
the pre-filtered path where it applies (checked taken) and the plain one where it does not."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtraining_jax.sparsity import topk


def _rows(kind: str, rows: int, n: int, rng):
    if kind == "decaying":  # a few heavy keys, a long tail (the vertical scores' shape)
        return np.floor(2.0**22 * np.exp(-14 * rng.random((rows, n)))).astype(np.int32)
    if kind == "ties":  # few distinct values: thousands of ties at the k-th score
        return rng.integers(0, 4, (rows, n)).astype(np.int32)
    if kind == "wide":
        return rng.integers(0, 2**31 - 1, (rows, n), dtype=np.int64).astype(np.int32)
    if kind == "zeros":
        return np.zeros((rows, n), np.int32)
    x = rng.integers(0, 50, (rows, n)).astype(np.int32)  # "spikes": plateaus of equal heavy scores
    x[:, rng.integers(0, n, n // 16)] = 7777
    return x


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["decaying", "ties", "wide", "zeros", "spikes"]), st.sampled_from([256, 1024, 4096]),
       st.integers(1, 64), st.integers(0, 2**31 - 1))
def test_top_k_matches_lax_top_k(kind, n, k, seed):
    x = jnp.asarray(_rows(kind, 3, n, np.random.default_rng(seed)))
    cap = max(k, -(-2 * k // 128) * 128)
    v0, i0 = jax.lax.top_k(x, k)
    v1, i1 = jax.jit(lambda x: topk.top_k(x, k, capacity=cap))(x)
    np.testing.assert_array_equal(np.asarray(v1), np.asarray(v0))
    np.testing.assert_array_equal(np.asarray(i1), np.asarray(i0))


@pytest.mark.parametrize("kind, taken", [("decaying", True), ("wide", True), ("ties", False), ("zeros", False)])
def test_the_prefiltered_path_is_the_one_taken_where_it_applies(kind, taken):
    n, k = 8192, 256
    x = jnp.asarray(_rows(kind, 4, n, np.random.default_rng(1)))
    cap = topk.default_capacity(k, n)
    assert cap == 512
    thr, ok = topk.prefilter(x, k, cap)
    assert bool(ok) is taken
    if taken:  # the rung holds the k-th largest score and at most cap candidates
        kth = np.sort(np.asarray(x), axis=-1)[:, -k]
        assert (np.asarray(thr) <= kth).all() and (np.asarray(thr) >= 1).all()
        assert ((np.asarray(x) >= np.asarray(thr)[:, None]).sum(-1) <= cap).all()
    v0, i0 = jax.lax.top_k(x[None], k)  # leading dims kept
    v1, i1 = topk.top_k(x[None], k)
    np.testing.assert_array_equal(np.asarray(v1), np.asarray(v0))
    np.testing.assert_array_equal(np.asarray(i1), np.asarray(i0))


def test_bad_arguments_are_named():
    x = jnp.zeros((2, 64), jnp.int32)
    with pytest.raises(ValueError, match="k=65"):
        topk.top_k(x, 65)
    with pytest.raises(ValueError, match="float32"):
        topk.top_k(x.astype(jnp.float32), 4)
    with pytest.raises(ValueError, match="capacity 4 is below k=8"):
        topk.top_k(x, 8, capacity=4)
    assert topk.top_k(x, 0)[0].shape == (2, 0)
    assert topk.default_capacity(4096, 131072) == 8192 and topk.default_capacity(4096, 16384) is None
