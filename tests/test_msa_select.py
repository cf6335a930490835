"""MSA block selection: top-k vs a float64 NumPy reference, the selection's StepIndex equals the
selected-block mask on one device and, mapped back over every rank and ring step, on every
block-aligned layout and mesh (each selected causal pair exactly once)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtraining_jax.layouts import Layout
from mtraining_jax.ring.schedule import source_table
from mtraining_jax.sparsity.msa_select import (SELECTIONS, MSARankStepIndex, block_summaries, full_selection, index_keys,
                                               row_topk_union, select_blocks, selection_block_map,
                                               selection_step_index)
from pallas_kernels.index_format import step_index_to_mask

BS = 16  # small blocks keep the CPU tests fast; the math is block-size agnostic


def np_select(q_idx, k_idx, bs, top_k, pooling="mean", selection="causal"):
    """float64 reference of scheme (b): ``bool [B, G, nQB, nb]``; ``selection="causal"`` ranks with
    each query block's first row, ``"block_mean"`` with the mean of its rows' softmaxes."""
    rows = 1 if selection == "causal" else bs
    q = np.asarray(q_idx, np.float64)
    k = np.asarray(k_idx, np.float64)
    B, S, G, d = q.shape
    nb = S // bs
    kbar = k.reshape(B, nb, bs, d).mean(2)
    out = np.zeros((B, G, nb, nb), bool)
    for b in range(B):
        for g in range(G):
            for qb in range(nb):
                out[b, g, qb, qb] = True
                if qb == 0:
                    continue
                qr = q[b, qb * bs:qb * bs + rows, g]
                if pooling == "mean":
                    s = qr @ kbar[b, :qb].T / np.sqrt(d)  # [rows, qb]
                else:
                    s = (qr @ k[b, :qb * bs].T / np.sqrt(d)).reshape(rows, qb, bs).max(-1)
                p = np.exp(s - s.max(1, keepdims=True))
                p /= p.sum(1, keepdims=True)
                agg = p.mean(0)
                keep = np.argsort(-agg, kind="stable")[: top_k - 1]
                out[b, g, qb, keep] = True
    return out


def _inputs(seed, B=2, S=256, G=2, d=8):
    kq, kk = jax.random.split(jax.random.PRNGKey(seed))
    return jax.random.normal(kq, (B, S, G, d)), jax.random.normal(kk, (B, S, d))


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**16), top_k=st.integers(1, 6), pooling=st.sampled_from(["mean", "max"]),
       selection=st.sampled_from(SELECTIONS))
def test_select_blocks_matches_float64_reference(seed, top_k, pooling, selection):
    q_idx, k_idx = _inputs(seed)
    S = q_idx.shape[1]
    sel = select_blocks(q_idx, index_keys(k_idx, BS, pooling), jnp.arange(S), block_size=BS, top_k=top_k,
                        pooling=pooling, selection=selection)
    got = np.asarray(selection_block_map(sel, S // BS))
    want = np_select(q_idx, k_idx, BS, top_k, pooling, selection)
    np.testing.assert_array_equal(got, want)
    ids, cnt = np.asarray(sel.block_idx), np.asarray(sel.block_count)
    nqb = S // BS
    np.testing.assert_array_equal(cnt, np.minimum(top_k, np.arange(nqb) + 1)[None, None].repeat(2, 0).repeat(2, 1))
    for row, c in zip(ids.reshape(-1, ids.shape[-1]), cnt.reshape(-1)):
        assert np.all(np.diff(row[:c]) > 0)


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**16), t=st.integers(1, 255), pooling=st.sampled_from(["mean", "max"]))
def test_causal_selection_reads_no_later_token(seed, t, pooling):
    """Index queries and keys from position ``t`` on replaced: with ``selection="causal"`` the
    blocks selected for every query block holding a row ``< t`` are unchanged (no output before
    ``t`` can depend on a token at or after ``t``). ``"block_mean"`` reads later rows of the block:
    the same change moves its selection (the look-ahead this option documents)."""
    q_idx, k_idx = _inputs(seed)
    S = q_idx.shape[1]
    q2, k2 = _inputs(seed + 1)
    late = (jnp.arange(S) >= t)[None, :, None]
    q2, k2 = jnp.where(late[..., None], q2, q_idx), jnp.where(late, k2, k_idx)
    first = -(-t // BS)  # query blocks 0 .. first-1 hold a row < t

    def blocks(qi, ki, selection):
        sel = select_blocks(qi, index_keys(ki, BS, pooling), jnp.arange(S), block_size=BS, top_k=4,
                            pooling=pooling, selection=selection)
        return np.asarray(selection_block_map(sel, S // BS))[:, :, :first]

    np.testing.assert_array_equal(blocks(q2, k2, "causal"), blocks(q_idx, k_idx, "causal"))


def test_block_mean_selection_looks_ahead():
    """The positive control of :func:`test_causal_selection_reads_no_later_token`: changing only the
    LAST row of every query block changes ``"block_mean"``'s selection of some block."""
    q_idx, k_idx = _inputs(11)
    S = q_idx.shape[1]
    last = (jnp.arange(S) % BS == BS - 1)[None, :, None, None]
    q2 = jnp.where(last, 8.0 * _inputs(12)[0], q_idx)
    sel = {}
    for selection in SELECTIONS:
        a, b = (np.asarray(selection_block_map(select_blocks(qi, block_summaries(k_idx, BS), jnp.arange(S),
                                                             block_size=BS, top_k=3, selection=selection), S // BS))
                for qi in (q_idx, q2))
        sel[selection] = (a != b).any()
    assert sel == {"causal": False, "block_mean": True}


def test_selection_step_index_single_device_mask():
    q_idx, k_idx = _inputs(3)
    B, S, G, _ = q_idx.shape
    H = 4
    pos = jnp.arange(S)
    sel = select_blocks(q_idx, block_summaries(k_idx, BS), pos, block_size=BS, top_k=3)
    idx = selection_step_index(sel, pos, pos, num_heads=H, seq_len=S, block_size=BS)
    got = np.asarray(step_index_to_mask(idx, S, S, BS))
    blk = np.asarray(selection_block_map(sel, S // BS))  # [B, G, nQB, nb]
    want = np.repeat(np.repeat(np.repeat(blk, H // G, axis=1), BS, axis=2), BS, axis=3)
    np.testing.assert_array_equal(got, want)
    assert int(np.asarray(idx.block_count).max()) == 3


@pytest.mark.parametrize("layout,P,nodes", [("block_striped", 4, 2), ("zigzag", 4, 1), ("contiguous", 2, 1),
                                            ("block_striped", 8, 4)])
def test_rank_step_index_covers_selection_once(layout, P, nodes):
    """Every rank's per-step index mapped back to global positions: the union over ranks and steps
    is the selected-block mask (the local queries' selection) and no pair is covered twice."""
    S, H, G = 256, 4, 2
    q_idx, k_idx = _inputs(5, S=S)
    lay = Layout(layout, S, P, stripe=BS)
    pos = lay.positions  # [P, S/P]
    sel_full = select_blocks(q_idx, block_summaries(k_idx, BS), jnp.arange(S), block_size=BS, top_k=4)
    want = np.asarray(selection_block_map(sel_full, S // BS))
    want = np.repeat(np.repeat(np.repeat(want, H // G, 1), BS, 2), BS, 3)  # [B, H, S, S] global
    cover = np.zeros(want.shape, np.int32)
    nl = P // nodes
    src = source_table(nodes, nl, "hierarchical")
    for r in range(P):
        qb = pos[r].reshape(-1, BS)[:, 0] // BS
        sel_r = jax.tree.map(lambda a: a[:, :, qb], sel_full)  # the rank's own query blocks
        rsi = MSARankStepIndex(sel_r, jnp.int32(r), lay, nodes, nl, "hierarchical", BS, num_heads=H)
        for s in range(P):
            kp = pos[src[r, s]]
            m = np.asarray(step_index_to_mask(rsi.step(s), len(pos[r]), len(kp), BS))
            cover[:, :, pos[r][:, None], kp[None, :]] += m
        fused = np.asarray(step_index_to_mask(rsi.steps((0, 1)), len(pos[r]), 2 * len(pos[r]), BS))
        both = np.concatenate([np.asarray(step_index_to_mask(rsi.step(s), len(pos[r]), len(pos[r]), BS))
                               for s in (0, 1)], axis=-1)
        np.testing.assert_array_equal(fused, both)
    causal = np.tril(np.ones((S, S), bool))
    np.testing.assert_array_equal(cover * causal, (want & causal).astype(np.int32))


def test_full_selection_is_every_causal_block():
    S = 128
    sel = full_selection(1, 2, jnp.arange(S), S, BS)
    blk = np.asarray(selection_block_map(sel, S // BS))
    np.testing.assert_array_equal(blk[0, 0], np.tril(np.ones((S // BS, S // BS), bool)))


def test_row_topk_union_contains_block_choice_local_and_bounds():
    q_idx, k_idx = _inputs(7)
    S = q_idx.shape[1]
    kbar = block_summaries(k_idx, BS)
    row_sel, union = row_topk_union(q_idx, kbar, jnp.arange(S), block_size=BS, top_k=3)
    row_sel, union = np.asarray(row_sel), np.asarray(union)
    nqb = S // BS
    assert row_sel.sum(-1).max() <= 3
    for i in range(S):  # local block always in
        assert row_sel[:, :, i, i // BS].all()
    assert (union >= np.minimum(3, np.arange(nqb) + 1)).all() and (union <= np.arange(nqb) + 1).all()


def test_select_blocks_rejects_bad_top_k_and_pooling():
    q_idx, k_idx = _inputs(0)
    with pytest.raises(ValueError, match="top_k"):
        select_blocks(q_idx, block_summaries(k_idx, BS), jnp.arange(q_idx.shape[1]), block_size=BS, top_k=0)
    with pytest.raises(ValueError, match="pooling"):
        index_keys(k_idx, BS, "sum")
    with pytest.raises(ValueError, match="selection must be one of .*'rows'"):
        select_blocks(q_idx, block_summaries(k_idx, BS), jnp.arange(q_idx.shape[1]), block_size=BS, selection="rows")
