"""Bad configuration is rejected up front (construction or call entry), naming the value, within a
second: never an all-NaN output, a TypeError from inside a trace, or a late error from the kernels."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtraining_jax.attention.mtraining import MTrainingConfig, mtraining_attention
from mtraining_jax.mesh import make_mesh
from mtraining_jax.sparsity import SparsityConfig, estimate_index
from pallas_kernels.api import block_sparse_attention

BAD_SPARSITY = [
    (dict(sm_scale=float("nan")), "sm_scale"), (dict(sm_scale="x"), "sm_scale"), (dict(sm_scale=True), "sm_scale"),
    (dict(sm_scale=-0.1), "sm_scale"), (dict(sm_scale=float("inf")), "sm_scale"),
    (dict(block_size=48), "block_size=48"), (dict(block_size=256), "block_size=256"),
    (dict(block_size=True), "block_size=True"), (dict(block_size=64.0), "block_size=64.0"),
    (dict(last_q=True), "last_q"), (dict(last_q="64"), "last_q"),
    (dict(vertical_p="x"), "vertical_p"), (dict(vertical_p=True), "vertical_p"), (dict(slash_p=(0.9, "a")), "slash_p"),
    (dict(vertical_max="4096"), "vertical_max"), (dict(vertical_max=4096.0), "vertical_max"),
    (dict(slash_min=True), "slash_min"), (dict(max_cols=True), "max_cols"),
    (dict(vertical_p=(0.9, 0.8), slash_max=(4, 4, 4)), "per-head tuples"), (dict(vertical_p=()), "per-head tuples"),
]


@pytest.mark.parametrize("kwargs,match", BAD_SPARSITY, ids=[str(c[0]) for c in BAD_SPARSITY])
def test_sparsity_config_rejects_on_construction(kwargs, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(")):
        SparsityConfig(**kwargs)


def test_good_sparsity_configs_construct():
    """Valid values in every accepted form (a list, a tuple, a NumPy integer) construct, are held
    normalized (per-head tuples), broadcast per head, and run: the estimate takes the config."""
    c = SparsityConfig(block_size=128, sm_scale=0.125, vertical_p=[0.5, 0.9], slash_max=(8, 16),
                       vertical_max=np.int64(64))
    assert c.vertical_p == (0.5, 0.9) and c.slash_max == (8, 16) and c.slash_p == 0.9
    np.testing.assert_array_equal(c.per_head("vertical_p", 2), [0.5, 0.9])
    np.testing.assert_array_equal(c.per_head("slash_min", 2), [1, 1])  # a scalar: every head
    assert (c.max_verticals(4096), c.max_slashes(4096), c.max_slashes(1024)) == (64, 16, 8)
    c.check(4096, 2)
    with pytest.raises(ValueError, match="vertical_p has 2 per-head entries but there are 3 query heads"):
        c.check(4096, 3)
    S = 1024
    q = jax.random.normal(jax.random.PRNGKey(0), (1, S, 2, 32))
    idx = estimate_index(q, q[:, :, :1], jnp.arange(S), c)
    assert idx.v_idx.shape == (1, 2, 64) and idx.s_idx.shape == (1, 2, 8)  # MS = min(16, S / 128)
    assert np.all(np.asarray(idx.v_count) <= 64) and np.all(np.asarray(idx.s_idx)[..., 0] == 0)


def _fast_error(fn, match):
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=match):
        fn()
    assert time.perf_counter() - t0 < 1.0


def test_call_entry_errors_are_immediate():
    mesh = make_mesh((1, 2), jax.devices()[:2])
    q = jnp.zeros((1, 256, 4, 48), jnp.float32)
    kv = jnp.zeros((1, 256, 2, 48), jnp.float32)
    _fast_error(lambda: mtraining_attention(q, kv, kv, mesh), "head_dim 48")
    _fast_error(lambda: block_sparse_attention(q, kv, kv), "head_dim 48")
    q, kv = q[..., :32], kv[..., :32]
    per_head = MTrainingConfig(sparsity=SparsityConfig(vertical_p=(0.9, 0.9, 0.9)))
    _fast_error(lambda: mtraining_attention(q, kv, kv, mesh, per_head), "3 per-head entries but there are 4")
    _fast_error(lambda: block_sparse_attention(q, kv, kv, sm_scale=float("nan")), "sm_scale")
    _fast_error(lambda: block_sparse_attention(q, kv, kv, block_size=True), "block_size")
