"""SparsityConfig validation and top-p coverage budgets (MTraining App. B.1)."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtraining_jax.sparsity import SparsityConfig, estimate_index, index_to_mask
from mtraining_jax.sparsity.budgets import coverage_count, top_p_select


@pytest.mark.parametrize("kw, bad", [
    (dict(vertical_p=0.0), "vertical_p"), (dict(slash_p=1.5), "slash_p"),
    (dict(vertical_p=(0.9, -0.1)), "vertical_p"), (dict(vertical_min=128, vertical_max=64), "vertical_max=64"),
    (dict(slash_min=0), "slash_min"), (dict(slash_min=(1, 3), slash_max=(2, 2)), "slash_max=(2, 2)"),
    (dict(last_q=0), "last_q"), (dict(block_size=0), "block_size"), (dict(max_cols=0), "max_cols"),
])
def test_config_rejects_bad_values(kw, bad):
    with pytest.raises(ValueError, match=bad.replace("(", r"\(").replace(")", r"\)")):
        SparsityConfig(**kw)


def test_config_checks_problem():
    cfg = SparsityConfig(last_q=128)
    with pytest.raises(ValueError, match="last_q=128"):
        cfg.check(64, 2)
    with pytest.raises(ValueError, match="block_size=64"):
        SparsityConfig().check(64 * 12, 2, num_ranks=8)  # 96 tokens per rank
    with pytest.raises(ValueError, match="3 per-head entries"):
        SparsityConfig(vertical_p=(0.5, 0.6, 0.7)).check(1024, 4)
    cfg = SparsityConfig(vertical_p=[0.5, 0.6], slash_max=np.array([3, 4]))
    assert cfg.per_head("vertical_p", 2).tolist() == [0.5, 0.6]
    assert cfg.per_head("slash_max", 2).tolist() == [3, 4]
    assert cfg.max_slashes(64 * 2) == 2 and cfg.max_verticals(100) == 100
    hash(cfg)  # frozen and hashable: usable as a static jit argument


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 1000), min_size=1, max_size=40), st.floats(1e-6, 1.0))
def test_coverage_count_is_the_smallest_covering_prefix(scores, p):
    s = np.sort(np.asarray(scores, np.int32))[::-1]
    total = int(s.sum())
    k = int(coverage_count(jnp.asarray(s)[None], jnp.asarray([total], jnp.int32), jnp.asarray([p]))[0])
    thr = min(int(np.ceil(np.float32(p) * np.float32(total))), total)
    csum = np.cumsum(s)
    assert csum[k - 1] >= thr
    assert k == 1 or csum[k - 2] < thr


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(2, 40))
def test_top_p_select_respects_per_head_caps(seed, n):
    rng = np.random.default_rng(seed)
    H, size = 4, min(n, 12)
    scores = rng.integers(0, 1000, (2, H, n)).astype(np.int32)
    p = rng.uniform(0.01, 1.0, H)
    kmin = rng.integers(1, size + 1, H)
    kmax = np.minimum(kmin + rng.integers(0, 5, H), size)
    idx, cnt = top_p_select(jnp.asarray(scores), p, kmin, kmax, size, force=0, pad=n)
    idx, cnt = np.asarray(idx), np.asarray(cnt)
    for b in range(2):
        for h in range(H):
            c = cnt[b, h]
            assert kmin[h] <= c <= kmax[h]
            sel = idx[b, h, :c]
            assert sel[0] == 0 and np.all(np.diff(sel) > 0)  # forced line kept, sorted, distinct
            assert np.all(idx[b, h, c:] == n)
            rest = np.setdiff1d(np.arange(1, n), sel)
            if len(rest) and c > 1:  # the chosen non-forced lines are the top-scoring ones
                assert scores[b, h, sel[1:]].min() >= scores[b, h, rest].max()


def _qk(S=256, Hq=2, Hkv=1, D=16, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(1, S, Hq, D)) * scale, jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, S, Hkv, D)) * scale, jnp.float32)
    return q, k


def test_p_one_gives_the_full_causal_mask():
    S, bs = 256, 16
    q, k = _qk(S)
    cfg = SparsityConfig(block_size=bs, last_q=16, vertical_p=1.0, slash_p=1.0, vertical_max=S, slash_max=S // bs)
    idx = estimate_index(q, k, jnp.arange(S), cfg)
    assert np.asarray(idx.s_count).min() == S // bs  # every diagonal carries mass
    m = np.asarray(index_to_mask(idx, S, bs))
    np.testing.assert_array_equal(m, np.broadcast_to(np.tril(np.ones((S, S), bool)), m.shape))


def test_tiny_p_keeps_only_the_diagonal_block():
    S, bs = 256, 16
    q, k = _qk(S, scale=2.0)
    cfg = SparsityConfig(block_size=bs, last_q=16, vertical_p=1e-6, slash_p=1e-6, vertical_min=0)
    idx = estimate_index(q, k, jnp.arange(S), cfg)
    np.testing.assert_array_equal(np.asarray(idx.s_count), 1)
    np.testing.assert_array_equal(np.asarray(idx.s_idx)[..., 0], 0)
    np.testing.assert_array_equal(np.asarray(idx.v_count), 1)  # one line already covers a tiny p
    m = np.asarray(index_to_mask(idx, S, bs))
    assert m[..., np.arange(S), np.arange(S)].all()  # no empty row


def test_per_head_caps_bind_at_p_one():
    S, bs = 256, 16
    q, k = _qk(S, Hq=4, Hkv=2)
    cfg = SparsityConfig(block_size=bs, last_q=32, vertical_p=1.0, slash_p=(1.0, 1.0, 1.0, 1e-6),
                         vertical_min=0, vertical_max=(8, 16, 4, 32), slash_min=(1, 1, 1, 2),
                         slash_max=(1, 2, 3, 4))
    idx = estimate_index(q, k, jnp.arange(S), cfg)
    assert idx.v_idx.shape[-1] == 32 and idx.s_idx.shape[-1] == 4
    np.testing.assert_array_equal(np.asarray(idx.v_count)[0], [8, 16, 4, 32])
    np.testing.assert_array_equal(np.asarray(idx.s_count)[0], [1, 2, 3, 2])  # head 3: tiny p, min 2
