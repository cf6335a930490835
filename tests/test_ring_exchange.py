"""The index math of the sparse-aware K/V exchange (``mtraining_jax/ring/exchange.py``): which tokens
a step needs, the compact index over them, the capacity and the ring-vs-exchange choice. The
exchange against the masked reference is in ``tests/test_ring.py`` (the ring suite), its bytes
against the compiled HLO in ``tests/test_ring_comm.py``."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtraining_jax.ring import exchange
from mtraining_jax.ring.attention import RingConfig
from pallas_kernels.index_format import StepIndex, step_index_to_mask


def _index(seed, B, H, nqb, nkb, bs, max_cols, pool):
    """Random valid StepIndex (rows pick blocks among ``pool`` of the chunk's blocks)."""
    rng = np.random.default_rng(seed)
    sk = nkb * bs
    blocks = rng.choice(nkb, size=pool, replace=False)
    bidx = np.zeros((B, H, nqb, nkb), np.int32)
    bcnt = np.zeros((B, H, nqb), np.int32)
    for row in np.ndindex(B, H, nqb):
        b = np.sort(rng.choice(blocks, size=rng.integers(0, pool + 1), replace=False))
        bidx[row][:len(b)] = b
        bcnt[row] = len(b)
    cidx = np.zeros((B, H, max_cols), np.int32)
    ccnt = np.zeros((B, H, nqb), np.int32)
    for head in np.ndindex(B, H):
        n = int(rng.integers(0, min(max_cols, sk) + 1))
        cidx[head][:n] = rng.choice(sk, size=n, replace=False)
        ccnt[head] = rng.integers(0, n + 1, size=nqb)
    flags = rng.integers(0, 2, size=bidx.shape).astype(np.int32)
    return StepIndex(*(jnp.asarray(x) for x in (bidx, bcnt, flags, cidx, ccnt)))


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), nkb=st.integers(1, 6), bs=st.sampled_from([2, 4]),
       max_cols=st.integers(1, 6), data=st.data())
def test_compact_index_allows_exactly_the_same_pairs(seed, nkb, bs, max_cols, data):
    """The needed tokens are the blocks the rows touch (whole, first, ascending) and the columns
    outside them; the compact index over those tokens allows exactly the pairs the index allows,
    and nothing outside them is needed."""
    pool = data.draw(st.integers(1, nkb))
    B, H, nqb = 2, 2, 3
    sk = nkb * bs
    index = _index(seed, B, H, nqb, nkb, bs, max_cols, pool)
    full = np.asarray(step_index_to_mask(index, nqb * bs, sk, bs))
    tokens, count, compact_of = (np.asarray(x) for x in exchange.needed_tokens(index, sk, bs, sk))
    count = int(count)
    assert sorted(tokens) == list(range(sk)) and np.array_equal(compact_of[tokens], np.arange(sk))
    used = full.any(axis=(0, 1, 2))
    assert set(np.flatnonzero(used)) <= set(tokens[:count])  # every allowed key is sent
    valid = np.arange(index.max_blocks) < np.asarray(index.block_count)[..., None]
    blocks = np.unique(np.asarray(index.block_idx)[valid])
    head = np.concatenate([np.arange(b * bs, (b + 1) * bs) for b in blocks]) if len(blocks) else np.zeros(0, int)
    assert np.array_equal(tokens[:len(head)], head)  # needed blocks first, whole and ascending
    cols = tokens[len(head):count]
    assert np.all(np.diff(cols) > 0) and not np.isin(cols // bs, blocks).any()
    cap = -(-max(count, 1) // bs) * bs
    tok_c, _, cof_c = exchange.needed_tokens(index, sk, bs, cap)
    compact = exchange.compact_index(index, cof_c, cap, bs)
    got = np.asarray(step_index_to_mask(compact, nqb * bs, cap, bs))
    np.testing.assert_array_equal(got, full[..., np.asarray(tok_c)])
    np.testing.assert_array_equal(np.asarray(compact.block_causal),
                                  np.asarray(index.block_causal)[..., :compact.max_blocks])


def test_capacity_and_choice():
    assert exchange.capacity_tokens(0.3, 256, 64) == 128  # 77 tokens -> two blocks
    assert exchange.capacity_tokens(1, 256, 64) == 64
    assert exchange.capacity_tokens(1000, 256, 64) == 256
    shape = dict(num_ranks=8, chunk_len=1024, batch=1, kv_heads=2, head_dim=128, itemsize=2)
    # one node: fewer bytes even at the whole chunk (K/V kept for the backward, not resent), but
    # nothing left out: the ring; part of the chunk: the exchange
    assert exchange.resolve_kv_exchange("auto", capacity=1024, **shape) == "ring"
    assert exchange.resolve_kv_exchange("auto", capacity=960, **shape) == "sparse"
    assert exchange.resolve_kv_exchange("auto", capacity=512, exchange_ok=False, **shape) == "ring"
    assert exchange.resolve_kv_exchange("ring", capacity=64, **shape) == "ring"
    # 2 x 4 hierarchical: the exchange's steps s >= 4 cross nodes (4 sends) where the ring sends 1 chunk
    two = dict(shape, num_nodes=2, ring_order="hierarchical")
    assert exchange.resolve_kv_exchange("auto", capacity=1024, **two) == "ring"
    assert exchange.resolve_kv_exchange("auto", capacity=128, **two) == "sparse"
    n = 2 * 1 * 512 * 2 * 128
    kw = dict(batch=1, kv_heads=2, head_dim=128, itemsize=2)
    assert exchange.exchange_bytes(8, capacity=512, **kw) == {"inner": 7 * n * (2 + 4), "outer": 0}
    assert exchange.exchange_bytes(8, capacity=512, num_nodes=2, ring_order="hierarchical", **kw) == {
        "inner": 3 * n * 6, "outer": 4 * n * 6}


@pytest.mark.parametrize("mesh_shape, order", [((1, 8), "flat"), ((2, 4), "hierarchical"), ((4, 2), "hierarchical"),
                                               ((3, 1), "hierarchical"), ((2, 4), "flat"), ((1, 1), "flat")])
def test_ring_bytes_agree_with_the_schedule_accounting(mesh_shape, order):
    """The ring module's byte count (what "auto" compares) equals benchmarks/ring_comm's, which the
    compiled HLO is checked against; per link for the hierarchical ring."""
    from benchmarks import ring_comm

    N, L = mesh_shape
    shape = dict(batch=2, chunk_len=64, kv_heads=2, head_dim=32, itemsize=2)
    got = exchange.ring_kv_bytes(N * L, num_nodes=N, ring_order=order, **shape)
    want = ring_comm.ring_bytes(N, L, order, **shape)
    assert sum(got.values()) == sum(want.values())
    if order == "hierarchical":
        assert got == want
    cap = dict(shape, capacity=32)
    del cap["chunk_len"]
    got = exchange.exchange_bytes(N * L, num_nodes=N, ring_order=order, **cap)
    want = ring_comm.exchange_link_bytes(N, L, order, chunk_len=64, **cap)
    assert sum(got.values()) == sum(want.values())
    if order == "hierarchical" or N == 1:
        assert got == want


def test_bad_exchange_values_are_named():
    with pytest.raises(ValueError, match="unknown kv_exchange 'all'"):
        exchange.validate_kv_exchange("all")
    with pytest.raises(ValueError, match="unknown kv_exchange 'all'"):
        RingConfig(2, 4, "flat", kv_exchange="all")
    with pytest.raises(ValueError, match="needs a positive exchange_capacity"):
        RingConfig(2, 4, "flat", kv_exchange="sparse")
    with pytest.raises(ValueError, match="multiple of block_size=64, got 100"):
        RingConfig(2, 4, "flat", kv_exchange="sparse", exchange_capacity=100)
    with pytest.raises(ValueError, match=r"fraction must be in \(0, 1\], got 1.5"):
        exchange.capacity_tokens(1.5, 256, 64)
    with pytest.raises(ValueError, match="token count or a fraction"):
        exchange.capacity_tokens("half", 256, 64)
    kw = dict(num_ranks=8, chunk_len=256, block_size=64, batch=1, kv_heads=1, head_dim=32, itemsize=4)
    with pytest.raises(ValueError, match="kv_exchange='sparse' needs the index of every rank's queries"):
        exchange.plan_exchange("sparse", None, 0.5, **kw)
    assert exchange.plan_exchange("auto", None, None, **kw) == ("ring", 0, False)
    with pytest.raises(ValueError, match="unknown kv_exchange 'both'"):
        exchange.plan_exchange("both", None, None, **kw)
