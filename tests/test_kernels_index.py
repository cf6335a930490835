"""Index math of the kernels: padding/preparation and the transposed (KV-stationary) schedules."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import triton_backward as tb
from pallas_kernels import triton_common
from pallas_kernels import triton_kernels as tk
from pallas_kernels.index_format import row_columns, scatter_last, stable_partition
from pallas_kernels.testing import random_step_index

BS = 16  # index math is block-size agnostic; small blocks keep the examples cheap


def _index(seed, nqb, nkb, heads, max_cols, mb=None):
    rng = np.random.default_rng(seed)
    sq, sk = nqb * BS, nkb * BS
    perm = rng.permutation(sq + sk).astype(np.int32)
    q_pos, k_pos = jnp.asarray(np.sort(perm[:sq])), jnp.asarray(np.sort(perm[sq:]))
    mb = int(rng.integers(1, nkb + 1)) if mb is None else mb
    index = random_step_index(rng, 1, heads, sq, sk, q_pos, k_pos, max_blocks=mb, max_cols=max_cols,
                              block_size=BS)
    return index, sq, sk


# Shapes are fixed per test (one XLA compilation each); hypothesis draws the index contents.
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_transpose_block_index_lists_exactly_the_active_tiles(seed):
    nqb, nkb, heads = 6, 5, 2
    index, sq, sk = _index(seed, nqb, nkb, heads, 4, mb=4)
    tidx, tcnt = tb.transpose_block_index(index, sk, BS)
    tidx, tcnt = np.asarray(tidx), np.asarray(tcnt)
    bidx, bcnt, bcaus = (np.asarray(x) for x in (index.block_idx, index.block_count, index.block_causal))
    for h in range(heads):
        want = {}
        for i in range(nqb):
            for j in range(bcnt[0, h, i]):
                want.setdefault(int(bidx[0, h, i, j]), []).append(2 * i + int(bcaus[0, h, i, j]))
        for kb in range(nkb):
            entries = want.get(kb, [])
            free = sorted(e // 2 for e in entries if e % 2 == 0)
            masked = sorted(e // 2 for e in entries if e % 2 == 1)
            assert tcnt[0, h, kb].tolist() == [len(free), len(entries)], (h, kb)
            assert tidx[0, h, kb, : len(entries)].tolist() == free + masked, (h, kb)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_row_columns_are_the_prefix_outside_active_blocks(seed):
    """The column phase of row ``i``: slots ``< col_count[i]`` of the head's shared list whose block
    is not active in the row — both the XLA helper and the kernels' in-register test."""
    nqb, nkb, heads = 6, 5, 2
    index, sq, sk = _index(seed, nqb, nkb, heads, 40, mb=3)
    ids, valid = (np.asarray(x) for x in row_columns(index, sk, BS))
    bidx, bcnt, cidx, ccnt = (np.asarray(x) for x in (index.block_idx, index.block_count, index.col_idx,
                                                         index.col_count))
    for h in range(heads):
        for i in range(nqb):
            active = set(bidx[0, h, i, : bcnt[0, h, i]].tolist())
            want = [m < ccnt[0, h, i] and cidx[0, h, m] // BS not in active for m in range(cidx.shape[-1])]
            assert valid[0, h, i].tolist() == want, (h, i)
            assert ids[0, h, i].tolist() == cidx[0, h].tolist()
            blocks = jnp.asarray(np.r_[bidx[0, h, i], np.zeros(8 - bidx.shape[-1], np.int32)])  # padded slots
            got = triton_common.outside_blocks(jnp.asarray(cidx[0, h]), blocks, int(bcnt[0, h, i]), BS)
            assert np.asarray(got).tolist() == [cidx[0, h, m] // BS not in active for m in range(cidx.shape[-1])]


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_prepare_index_puts_free_blocks_first_pads_and_clips(seed):
    index, sq, sk = _index(seed, 3, 5, 2, 7)
    bidx, cnt, cidx = (np.asarray(x) for x in tk.prepare_index(index, sk, BS, col_chunk=BS))
    assert bidx.shape[-1] == triton_common.pow2(index.max_blocks)
    assert cidx.shape[-1] % BS == 0 and cidx.shape[:2] == (1, 2)
    np.testing.assert_array_equal(cidx[..., : index.max_cols], np.asarray(index.col_idx))
    assert int(bidx.max()) < sk // BS and int(cidx.max()) < sk
    src, bcnt, caus = (np.asarray(x) for x in (index.block_idx, index.block_count, index.block_causal))
    for h in range(2):
        for i in range(3):
            n = bcnt[0, h, i]
            blocks, flags = src[0, h, i, :n], caus[0, h, i, :n]
            want = blocks[flags == 0].tolist() + blocks[flags != 0].tolist()
            assert cnt[0, h, i].tolist() == [int((flags == 0).sum()), n, int(index.col_count[0, h, i]), 0]
            assert bidx[0, h, i, :n].tolist() == want


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), nchunks=st.integers(1, 6), documents=st.booleans())
def test_column_chunk_rows_are_the_blocks_that_need_the_chunk(seed, nchunks, documents):
    """``column_chunk_rows``: ``first`` / ``end`` are the first and last-plus-one query block whose prefix
    reaches chunk ``c`` (``col_count > c * bs``) and, given column starts, whose start is before the chunk's
    end (``nQB`` / ``nQB`` if none); any order of counts and starts."""
    from pallas_kernels.index_format import column_chunk_rows

    rng = np.random.default_rng(seed)
    counts = rng.integers(0, nchunks * BS + 1, size=(2, 3, 9)).astype(np.int32)  # any order, not sorted
    starts = np.minimum(rng.integers(0, nchunks * BS + 1, size=counts.shape), counts).astype(np.int32)
    first, end = (np.asarray(x) for x in column_chunk_rows(jnp.asarray(counts), nchunks, BS,
                                                            jnp.asarray(starts) if documents else None))
    for idx in np.ndindex(counts.shape[:2]):
        for c in range(nchunks):
            need = counts[idx] > c * BS
            if documents:
                need &= starts[idx] < (c + 1) * BS
            rows = np.nonzero(need)[0]
            want = (rows[0], rows[-1] + 1) if rows.size else (counts.shape[-1], counts.shape[-1])
            assert (first[idx + (c,)], end[idx + (c,)]) == want


def test_col_row_splits_bound_the_range_length():
    assert tb.col_row_splits(4096) == 4096 // tb.COL_RANGE_BLOCKS
    assert tb.col_row_splits(tb.COL_RANGE_BLOCKS) == 1  # one range: no atomics
    assert tb.col_row_splits(5) == 1
    for nqb in (1, 7, 16, 100, 129, 5000):
        for rb in (1, 16, 128):
            sp = tb.col_row_splits(nqb, rb)
            assert -(-nqb // sp) <= rb and (sp - 1) * rb < nqb


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_add_column_grads_adds_used_slots_and_drops_padding(seed):
    """Slot ``m`` of head ``h`` is added into KV head ``h // g`` at row ``col_idx`` iff some query
    block uses it (``m < max col_count``); padding slots (pointing at row 0) add nothing, whatever
    values they hold."""
    rng = np.random.default_rng(seed)
    B, H, hkv, mcp, sk, d, nqb = 2, 4, 2, 8, 12, 3, 5
    col_idx = np.stack([[rng.permutation(sk)[:mcp] for _ in range(H)] for _ in range(B)]).astype(np.int32)
    col_count = rng.integers(0, mcp + 1, size=(B, H, nqb)).astype(np.int32)
    used = col_count.max(-1)
    col_idx[np.arange(mcp)[None, None, :] >= used[..., None]] = 0  # padding, as the builder makes it
    dkc, dvc = rng.normal(size=(2, B, H, mcp, d)).astype(np.float32)  # padding slots hold junk too
    dk0, dv0 = rng.normal(size=(2, B, sk, hkv, d)).astype(np.float32)
    want_k, want_v = dk0.copy(), dv0.copy()
    for b, h in np.ndindex(B, H):
        for m in range(used[b, h]):
            want_k[b, col_idx[b, h, m], h // (H // hkv)] += dkc[b, h, m]
            want_v[b, col_idx[b, h, m], h // (H // hkv)] += dvc[b, h, m]
    got_k, got_v = tb.add_column_grads(*(jnp.asarray(x) for x in (dk0, dv0, dkc, dvc, col_idx, col_count)))
    np.testing.assert_allclose(np.asarray(got_k), want_k, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got_v), want_v, rtol=1e-6, atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(flags=st.lists(st.integers(0, 2), min_size=1, max_size=12))
def test_stable_partition_is_a_permutation_that_keeps_each_group_in_order(flags):
    f = np.asarray(flags)
    dst, n1, n12 = (np.asarray(x) for x in stable_partition(jnp.asarray(f == 0), jnp.asarray(f == 1)))
    assert sorted(dst.tolist()) == list(range(len(f)))  # a permutation: unique scatter indices
    assert (int(n1), int(n12)) == (int((f == 0).sum()), int((f <= 1).sum()))
    x = np.arange(len(f), dtype=np.int32) + 1
    out = np.asarray(scatter_last(jnp.asarray(x), jnp.asarray(dst), len(f) + 3))
    want = np.concatenate([x[f == 0], x[f == 1], x[f == 2], np.zeros(3, np.int32)])
    np.testing.assert_array_equal(out, want)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), ndocs=st.integers(1, 6), shuffled=st.booleans())
def test_column_start_skips_only_other_documents_columns(seed, ndocs, shuffled):
    """``column_start``: every slot of a row's column prefix before it holds a key of another document than
    every query of the block (so skipping those slots is exact), for any segment ids (``shuffled``: ids not
    in position order); with documents numbered in position order and the columns in position order (as
    ``convert_step`` lists them) it skips exactly the keys of the documents before the block's first one;
    and ``prepare_index`` passes it to the column walks."""
    from pallas_kernels.index_format import apply_segments, column_start

    index, sq, sk = _index(seed, 6, 8, 2, 9)
    rng = np.random.default_rng(seed)
    n = sq + sk  # documents are runs of global positions (a ring step's chunks take their positions' ids)
    cuts = np.sort(rng.choice(np.arange(1, n), size=ndocs - 1, replace=False))
    ids = np.searchsorted(cuts, np.arange(n), side="right").astype(np.int32)
    if shuffled:
        ids = rng.permutation(ndocs).astype(np.int32)[ids]
    perm = np.random.default_rng(seed).permutation(n)  # _index's positions
    q_pos, k_pos = np.sort(perm[:sq]), np.sort(perm[sq:])
    qseg, kseg = ids[q_pos], ids[k_pos]
    segs = (jnp.asarray(qseg[None]), jnp.asarray(kseg[None]))
    index = apply_segments(index, *segs, BS)
    got = np.asarray(column_start(index, *segs, BS))
    cc, ci = np.asarray(index.col_count), np.asarray(index.col_idx)
    for h in range(2):
        for b in range(sq // BS):
            qs = set(qseg[b * BS:(b + 1) * BS].tolist())
            ks = [int(kseg[ci[0, h, s]]) for s in range(cc[0, h, b])]
            start = got[0, h, b]
            assert 0 <= start <= cc[0, h, b]
            assert not qs & set(ks[:start]), (h, b, start)  # exact: only other documents' keys skipped
            if not shuffled and ks == sorted(ks):
                assert start == sum(x < min(qs) for x in ks)  # ... and all of the earlier documents' keys
    _, cnt, _ = tk.prepare_index(index, sk, BS, col_chunk=BS, segs=segs)
    np.testing.assert_array_equal(np.asarray(cnt)[..., 3], got)
