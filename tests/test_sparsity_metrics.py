"""Load metrics, sparsity and recall; and the converted index driving the block-sparse attention API
equals the masked dense reference (forward and gradients; per ring step merged by log-sum-exp)."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtraining_jax.attention.mtraining import stats_scalars
from mtraining_jax.layouts import Layout
from mtraining_jax.ring.schedule import source_table
from mtraining_jax.sparsity import SparsityConfig, convert_index, convert_step, estimate_index, index_to_mask
from mtraining_jax.sparsity import masked_reference, metrics
from mtraining_jax.sparsity.index import random_index
from pallas_kernels.api import block_sparse_attention, block_sparse_attention_fwd


@pytest.mark.parametrize("layout, N, L, order", [
    ("block_striped", 2, 4, "hierarchical"), ("zigzag", 1, 8, "flat"), ("contiguous", 2, 2, "flat")])
def test_work_matrix_matches_converted_counts(layout, N, L, order):
    S, bs, P = 2048, 64, N * L
    index = random_index(5, 2, 3, S, bs, max_verticals=40, max_slashes=6)
    lay = Layout(layout, S, P)
    W = metrics.work_matrix(index, lay, num_nodes=N, num_local=L, ring_order=order)
    conv = jax.jit(jax.vmap(lambda r: convert_index(index, r, lay, num_nodes=N, num_local=L, ring_order=order)))
    np.testing.assert_array_equal(W, metrics.step_index_work(conv(jnp.arange(P))))


def test_imbalance_metrics_on_known_matrices():
    assert metrics.worker_imbalance(np.ones((4, 4))) == 1.0 == metrics.step_imbalance(np.ones((4, 4)))
    W = np.array([[4.0, 1.0], [2.0, 1.0]])
    assert metrics.worker_imbalance(W) == pytest.approx((4 / 3 + 1) / 2)
    assert metrics.step_imbalance(W) == pytest.approx((4 / 2.5 + 2 / 1.5) / 2)
    assert metrics.computation_ratio(W) == pytest.approx(8 / (2 * 5))
    assert metrics.computation_ratio(W, comm=3.0) == pytest.approx(8 / (2 * (4 + 3)))


def test_imbalance_skips_ring_steps_without_work():
    # slash-only index on a 1x4 mesh: only step 0 (own chunk) has work. Worker level: the single
    # step with work has max/mean = 100 / 85; the three empty steps are bare hops (not 0/0 = NaN,
    # nor 0 pulling the mean below 1). Step level: every worker's work is all in the one live step
    # -> max/mean = 1 for each worker.
    W = np.array([[100, 0, 0, 0], [90, 0, 0, 0], [80, 0, 0, 0], [70, 0, 0, 0]])
    assert metrics.worker_imbalance(W) == pytest.approx(100 / 85)
    assert metrics.step_imbalance(W) == 1.0
    # a worker idle on a live step counts (that is imbalance); one idle on every live step does not
    W2 = np.array([[4, 2, 0], [0, 2, 0], [0, 0, 0]])
    assert metrics.worker_imbalance(W2) == pytest.approx((4 / (4 / 3) + 2 / (4 / 3)) / 2)
    assert metrics.step_imbalance(W2) == pytest.approx((4 / 3 + 2 / 1) / 2)
    assert metrics.worker_imbalance(np.zeros((2, 2))) == 1.0 == metrics.step_imbalance(np.zeros((2, 2)))
    for W_ in (W, W2):  # the traceable (training-log) scalars agree with the host metrics
        st = jax.jit(stats_scalars, static_argnums=(1, 2, 3, 4))(jnp.asarray(W_), 1, 1, 256, 64)
        assert float(st["worker_imbalance"]) == pytest.approx(metrics.worker_imbalance(W_), rel=1e-6)
        assert float(st["step_imbalance"]) == pytest.approx(metrics.step_imbalance(W_), rel=1e-6)


def test_density_and_recall_match_dense_mask():
    S, bs = 256, 32
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(1, S, 4, 16)) * 2, jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, S, 2, 16)) * 2, jnp.float32)
    index = estimate_index(q, k, jnp.arange(S), SparsityConfig(block_size=bs, vertical_max=32, slash_max=4,
                                                              vertical_min=1))
    m = np.asarray(index_to_mask(index, S, bs))
    np.testing.assert_allclose(metrics.density(index, S, bs), m.sum((2, 3)) / (S * (S + 1) / 2), rtol=1e-12)
    np.testing.assert_allclose(metrics.sparsity(index, S, bs), 1 - m.sum((2, 3)) / (S * (S + 1) / 2))
    full = metrics.mask_recall(q, k, index, bs)
    assert np.all((full > 0) & (full < 1))
    np.testing.assert_allclose(metrics.recall(q, k, index, block_size=bs, chunk=128), full, rtol=1e-5)
    rows = np.arange(S - 64, S)
    part = metrics.recall(q, k, index, rows=rows, block_size=bs)
    assert part.shape == (1, 4) and np.all(part > 0.5)  # the observation window is well covered
    # column_recall: the dense mask restricted to chosen key columns, per head, mean over the rows
    cols = np.array([3, 4, 5, 40, 41, 150])
    kept, mass = metrics.column_recall(q, k, index, rows=rows, cols=cols, block_size=bs, chunk=24)
    z = np.asarray(jnp.repeat(k, 2, axis=2))  # GQA: query head h reads key head h // 2
    logits = np.einsum("bshd,bthd->bhst", np.asarray(q, np.float64), z) / np.sqrt(16)
    t = np.arange(S)
    logits = np.where(t[None, :] <= t[:, None], logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    on = np.zeros(S, bool)
    on[cols] = True
    want_mass = p[:, :, rows][..., on].sum(-1).mean(-1)
    want_kept = np.where(m, p, 0.0)[:, :, rows][..., on].sum(-1).mean(-1)
    np.testing.assert_allclose(mass, want_mass, rtol=1e-5)
    np.testing.assert_allclose(kept, want_kept, rtol=1e-5, atol=1e-12)
    assert np.all(kept <= mass + 1e-12) and np.any(kept < mass - 1e-6)  # some of these columns dropped
    every, total = metrics.column_recall(q, k, index, rows=rows, cols=np.arange(S), block_size=bs)
    np.testing.assert_allclose(every, part, rtol=1e-6)
    np.testing.assert_allclose(total, 1.0, rtol=1e-6)
    with pytest.raises(ValueError, match="cols"):
        metrics.column_recall(q, k, index, rows=rows, cols=np.array([S]), block_size=bs)


def _qkv(S, Hq=4, Hkv=2, D=32, seed=1):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(ks[0], (1, S, Hq, D), jnp.float64)
    k = jax.random.normal(ks[1], (1, S, Hkv, D), jnp.float64)
    v = jax.random.normal(ks[2], (1, S, Hkv, D), jnp.float64)
    do = jax.random.normal(ks[3], (1, S, Hq, D), jnp.float64)  # non-uniform cotangent
    return q, k, v, do


def test_single_device_step_index_drives_the_attention_op():
    S, bs = 256, 32
    q, k, v, do = _qkv(S)
    index = random_index(2, 1, 4, S, bs, max_verticals=12, max_slashes=3)
    st = jax.jit(functools.partial(convert_step, seq_len=S, block_size=bs))(index, jnp.arange(S), jnp.arange(S))

    def loss_op(q, k, v):
        return jnp.sum(block_sparse_attention(q, k, v, index=st, block_size=bs, impl="xla") * do)

    def loss_ref(q, k, v):
        return jnp.sum(masked_reference(q, k, v, index, block_size=bs)[0] * do)

    chex.assert_trees_all_close(jax.value_and_grad(loss_op, (0, 1, 2))(q, k, v),
                                jax.value_and_grad(loss_ref, (0, 1, 2))(q, k, v), rtol=2e-5, atol=2e-5)  # the op accumulates in float32


@pytest.mark.parametrize("layout, order", [("block_striped", "hierarchical"), ("zigzag", "flat")])
def test_ring_steps_merge_to_the_masked_reference(layout, order):
    S, bs, N, L = 512, 32, 2, 2
    P = N * L
    q, k, v, _ = _qkv(S, seed=3)
    index = random_index(9, 1, 4, S, bs, max_verticals=12, max_slashes=4)
    lay = Layout(layout, S, P, stripe=bs)
    out_ref, lse_ref = masked_reference(q, k, v, index, block_size=bs)
    pos, tab = lay.positions, source_table(N, L, order)
    fwd = jax.jit(functools.partial(block_sparse_attention_fwd, block_size=bs, impl="xla"))
    for r in range(P):
        si = convert_index(index, r, lay, num_nodes=N, num_local=L, ring_order=order, block_size=bs)
        outs, lses = [], []
        for s in range(P):
            kp = pos[tab[r, s]]
            o, l = fwd(q[:, pos[r]], k[:, kp], v[:, kp], jnp.asarray(pos[r]), jnp.asarray(kp),
                       jax.tree.map(lambda x: x[s], si))
            outs.append(o)
            lses.append(l)
        lse = jax.nn.logsumexp(jnp.stack(lses), axis=0)  # [B, H, Sq]
        w = jnp.exp(jnp.stack(lses) - lse[None])  # merge weights per step
        out = sum(w[s].transpose(0, 2, 1)[..., None] * outs[s] for s in range(P))
        np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_ref[:, :, pos[r]]), rtol=1e-5)
        np.testing.assert_allclose(np.asarray(out), np.asarray(out_ref[:, pos[r]]), rtol=1e-4, atol=1e-5)
