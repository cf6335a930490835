"""Index math of the kernels: padding/preparation and the transposed (KV-stationary) schedules."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import triton_kernels as tk
from pallas_kernels.index_format import step_index_to_mask
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
    tidx, tcnt = tk.transpose_block_index(index, sk, BS)
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
def test_transpose_col_index_reproduces_column_mask(seed):
    nqb, nkb, heads = 6, 5, 2
    index, sq, sk = _index(seed, nqb, nkb, heads, 40, mb=2)
    chunk = BS
    uniq, nuniq, w0, w1 = (np.asarray(x) for x in tk.transpose_col_index(index, sk, chunk))
    assert w0.shape[2:] == (tk._pow2(-(-sk // chunk)), tk._pow2(nqb))
    # rebuild the [H, nQB, Sk] column membership from the distinct columns and the words
    got = np.zeros((heads, nqb, sk), bool)
    for h in range(heads):
        u = uniq[0, h, : nuniq[0, h, 0]]
        assert np.all(np.diff(u) > 0)
        for c in range(w0.shape[2]):
            for i in range(w0.shape[3]):
                words = (int(w0[0, h, c, i]) & 0xFFFFFFFF) | ((int(w1[0, h, c, i]) & 0xFFFFFFFF) << 32)
                for lane in range(chunk):
                    if words >> lane & 1:
                        got[h, i, u[c * chunk + lane]] = True
    cols_only = index._replace(block_count=jnp.zeros_like(index.block_count))
    want = np.asarray(step_index_to_mask(cols_only, sq, sk, BS))[0][:, ::BS]
    np.testing.assert_array_equal(got, want)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_prepare_index_puts_free_blocks_first_pads_and_clips(seed):
    index, sq, sk = _index(seed, 3, 5, 2, 7)
    bidx, cnt, cidx = (np.asarray(x) for x in tk.prepare_index(index, sk, BS, col_chunk=BS))
    assert bidx.shape[-1] == tk._pow2(index.max_blocks)
    assert cidx.shape[-1] % BS == 0
    assert int(bidx.max()) < sk // BS and int(cidx.max()) < sk
    src, bcnt, caus = (np.asarray(x) for x in (index.block_idx, index.block_count, index.block_causal))
    for h in range(2):
        for i in range(3):
            n = bcnt[0, h, i]
            blocks, flags = src[0, h, i, :n], caus[0, h, i, :n]
            want = blocks[flags == 0].tolist() + blocks[flags != 0].tolist()
            assert cnt[0, h, i].tolist() == [int((flags == 0).sum()), n, int(index.col_count[0, h, i])]
            assert bidx[0, h, i, :n].tolist() == want
