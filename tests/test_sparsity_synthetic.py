"""Synthetic vertical-slash attention generator: deterministic, subset-consistent, structured."""

import jax.numpy as jnp
import numpy as np
import pytest

from mtraining_jax.sparsity import SparsityConfig, estimate_index
from mtraining_jax.sparsity import metrics
from mtraining_jax.sparsity.synthetic import SyntheticAttention, heavy_positions, rope, synthetic_qk

CFG = SyntheticAttention(seq_len=1024, num_q_heads=2, num_kv_heads=1, head_dim=32, num_outliers=8, seed=3)


def test_deterministic_and_query_subsets_agree():
    q1, k1 = synthetic_qk(CFG)
    q2, k2 = synthetic_qk(CFG)
    np.testing.assert_array_equal(np.asarray(q1), np.asarray(q2))
    np.testing.assert_array_equal(np.asarray(k1), np.asarray(k2))
    rows = np.array([5, 700, 1023])
    qs, _ = synthetic_qk(CFG, query_positions=rows)
    np.testing.assert_allclose(np.asarray(qs), np.asarray(q1[:, rows]), rtol=1e-6, atol=1e-6)
    q3, _ = synthetic_qk(SyntheticAttention(**{**CFG.__dict__, "seed": 4}))
    assert not np.allclose(np.asarray(q1), np.asarray(q3))


def test_rope_is_relative():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(1, 2, 1, 16)), jnp.float32)
    a = rope(x, np.array([3, 10]), 1e4)
    b = rope(x, np.array([103, 110]), 1e4)
    np.testing.assert_allclose(float((a[0, 0, 0] * a[0, 1, 0]).sum()), float((b[0, 0, 0] * b[0, 1, 0]).sum()),
                               rtol=1e-4)


def test_estimate_finds_the_sink_and_heavy_keys_and_p_controls_sparsity():
    q, k = synthetic_qk(CFG)
    S = CFG.seq_len
    sp, rec = [], []
    for p in (0.5, 0.8, 0.95):
        idx = estimate_index(q, k, jnp.arange(S), SparsityConfig(vertical_p=p, slash_p=p, vertical_min=0,
                                                                slash_max=16))
        sp.append(metrics.sparsity(idx, S).mean())
        rec.append(metrics.recall(q, k, idx, rows=np.arange(0, S, 7)).mean())
        if p == 0.95:
            v = np.asarray(idx.v_idx)[0, :, : int(idx.v_count.min())]
            heavy = heavy_positions(CFG)
            assert all(0 in row for row in v)  # the attention sink is a vertical in every head
            sel = np.concatenate([r[:c] for r, c in zip(np.asarray(idx.v_idx)[0], np.asarray(idx.v_count)[0])])
            # heavy keys are strongly over-represented among the chosen verticals
            assert np.isin(sel, heavy).mean() > 20 * len(heavy) / S
    assert sp[0] > sp[1] > sp[2] and rec[0] < rec[1] < rec[2]


def test_bad_generator_values():
    with pytest.raises(ValueError, match="head_dim"):
        SyntheticAttention(head_dim=15)
    with pytest.raises(ValueError, match="num_q_heads=3"):
        SyntheticAttention(num_q_heads=3, num_kv_heads=2)
