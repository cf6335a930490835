"""The dK/dV block pass's schedules, emulated on CPU: :func:`pallas_kernels.mosaic_index.kv_schedule` (each
KV block's own list; its two-key sort) and :func:`~pallas_kernels.mosaic_index.kv_pair_schedule` (one stream of
a CTA's two KV blocks), checked against each other and their walk against the dense block gradients. The
kernels run on the GPU (``test_kernels_gpu.py``, ``TestMosaicGPU``); their lowering: ``test_mosaic_kernels.py``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _mosaic_cases import BS, doc_segments, mosaic_case
from pallas_kernels import mosaic_index
from pallas_kernels.index_format import apply_segments, step_index_to_mask
from pallas_kernels.reference import dense_attention


def test_kv_schedule_two_key_sort_equals_one_key(monkeypatch):
    """Past ``2**32`` keys the schedule is built by a two-key sort: the same entries and counts."""
    rng = np.random.default_rng(3)
    *_, idx = mosaic_case(rng, 2, 256, 384, 4, 1, 64, True, 4, 20)
    one = mosaic_index.kv_schedule(idx, 384, 1, BS)
    one_text = mosaic_index.kv_schedule.lower(idx, 384, 1, BS).as_text()
    monkeypatch.setattr(mosaic_index, "_ONE_KEY_LIMIT", 0)
    jax.clear_caches()  # else jit reuses the one-key trace and the two-key path never runs
    two = mosaic_index.kv_schedule(idx, 384, 1, BS)
    assert mosaic_index.kv_schedule.lower(idx, 384, 1, BS).as_text() != one_text
    jax.clear_caches()
    n = int(np.asarray(one[1])[..., 1].sum())
    assert n > 0
    np.testing.assert_array_equal(np.asarray(one[1]), np.asarray(two[1]))
    np.testing.assert_array_equal(np.asarray(one[0])[:n], np.asarray(two[0])[:n])


def _kv_lists(entries, counts, b, hk, kb):
    """``(free, masked)``: the entries of :func:`~pallas_kernels.mosaic_index.kv_schedule`'s list of
    KV block ``kb`` (KV head ``hk``, batch ``b``)."""
    nf, na, off = (int(x) for x in counts[b, hk, kb])
    return list(entries[off:off + nf]), list(entries[off + nf:off + na])


@pytest.mark.parametrize("B, S, Sk, H, Hkv, permuted, mb, documents", [
    (1, 256, 256, 2, 2, False, 3, False),   # MHA, causal diagonal
    (2, 256, 384, 4, 1, True, 4, False),    # GQA 4, ring-like positions, Sq != Sk
    (1, 128, 512, 8, 2, True, 6, False),    # GQA 4 with two KV heads, most blocks listed
    (2, 256, 384, 4, 1, True, 4, True),     # packed documents (index narrowed)
])
@pytest.mark.parametrize("two_keys", [False, True])
def test_kv_pair_schedule_walks_are_each_blocks_list(B, S, Sk, H, Hkv, permuted, mb, documents, two_keys,
                                                      monkeypatch):
    """The dK/dV block pass's shared stream (:func:`~pallas_kernels.mosaic_index.kv_pair_schedule`):
    per CTA (KV blocks ``2p``, ``2p + 1``) every tile either block lists exactly once, in the
    :data:`~pallas_kernels.mosaic_index.STREAM_SEGMENTS` group of its two classes, ascending inside a
    group; consumer ``w``'s free / masked segments hold block ``2p + w``'s free / masked list of
    :func:`~pallas_kernels.mosaic_index.kv_schedule`, each tile once (so its walk computes what the
    block's own list does, its tiles summed in segment order). ``two_keys``: the multi-key sort path (index ranges past ``2**32``)."""
    if two_keys:
        monkeypatch.setattr(mosaic_index, "_ONE_KEY_LIMIT", 0)
    jax.clear_caches()
    rng = np.random.default_rng(11 * S + Sk + H)
    *_, qp, kp, idx = mosaic_case(rng, B, S, Sk, H, Hkv, 64, permuted, mb, 20)
    if documents:
        idx = apply_segments(idx, *doc_segments(B, qp, kp), BS)
    entries, counts = (np.asarray(x) for x in mosaic_index.kv_schedule(idx, Sk, Hkv, BS))
    pe, bounds = (np.asarray(x) for x in mosaic_index.kv_pair_schedule(idx, Sk, Hkv, BS))
    jax.clear_caches()
    nkb = Sk // BS
    assert bounds.shape == (B, Hkv, nkb // 2, len(mosaic_index.STREAM_SEGMENTS) + 1)
    assert (np.diff(bounds, axis=-1) >= 0).all()
    flat = bounds.reshape(-1, bounds.shape[-1])
    np.testing.assert_array_equal(flat[1:, 0], flat[:-1, -1])  # CTA lists back to back from 0
    assert flat[0, 0] == 0
    shared = 0
    for b in range(B):
        for hk in range(Hkv):
            for p in range(nkb // 2):
                own = [_kv_lists(entries, counts, b, hk, 2 * p + w) for w in range(2)]
                walks = [([], []), ([], [])]
                union = []
                for s, cls in enumerate(mosaic_index.STREAM_SEGMENTS):
                    seg = list(pe[bounds[b, hk, p, s]:bounds[b, hk, p, s + 1]])
                    assert seg == sorted(seg)
                    union += seg
                    for w in range(2):
                        if cls[w] < 2:
                            walks[w][cls[w]].extend(seg)
                assert len(union) == len(set(union))
                assert set(union) == set(own[0][0] + own[0][1] + own[1][0] + own[1][1])
                for w in range(2):
                    for c in range(2):  # the same tiles, each once (in segment order)
                        assert len(walks[w][c]) == len(own[w][c]) and set(walks[w][c]) == set(own[w][c]), (b, hk, p, w)
                shared += len(own[0][0] + own[0][1] + own[1][0] + own[1][1]) - len(union)
    assert shared > 0  # some tiles are listed by both blocks of a CTA: loaded once


def test_uniform_kv_pair_schedule_equals_the_general_build():
    """``uniform=True`` (every (batch, head) row of the index alike): one KV group's lists, which every
    (batch, KV head) CTA walks: the general build's lists, entry for entry."""
    from pallas_kernels.index_format import full_step_index

    B, H, Hkv, S = 2, 4, 2, 512
    pos = jnp.arange(S, dtype=jnp.int32)
    idx = full_step_index(B, H, S, S, pos, pos, BS)
    e, c = (np.asarray(x) for x in mosaic_index.kv_pair_schedule(idx, S, Hkv, BS))
    eu, cu = (np.asarray(x) for x in mosaic_index.kv_pair_schedule(idx, S, Hkv, BS, uniform=True))
    assert cu.shape == c.shape
    for ix in np.ndindex(*c.shape[:3]):
        for s in range(c.shape[-1] - 1):
            np.testing.assert_array_equal(e[c[ix][s]:c[ix][s + 1]], eu[cu[ix][s]:cu[ix][s + 1]])
    with pytest.raises(ValueError, match="multiple of 128, got 192"):
        mosaic_index.kv_pair_schedule(full_step_index(1, 2, 192, 192, pos[:192], pos[:192], BS), 192, 1, BS)


@pytest.mark.parametrize("B, S, Sk, H, Hkv, permuted, mb, documents", [
    (1, 256, 256, 2, 2, False, 3, False),   # MHA, causal diagonal
    (2, 256, 384, 4, 1, True, 4, False),    # GQA 4, ring-like positions, Sq != Sk
    (1, 128, 256, 8, 2, True, 2, False),    # GQA 4 with two KV heads
    (2, 256, 384, 4, 1, True, 4, True),     # packed documents (index narrowed, segment check)
])
def test_kv_schedule_walk_equals_dense_block_gradients(B, S, Sk, H, Hkv, permuted, mb, documents):
    """The dK/dV block pass's schedule: every (query head, query block) tile that lists a KV
    block exactly once, free tiles first (free: causal-free and no listed column of the row's
    prefix inside); its walk gives the dense gradients of the active blocks' causal pairs minus
    the prefix columns (those are the column pass's), given the full attention's lse / delta.
    With documents, the index is narrowed by ``apply_segments`` and only same-document pairs count."""
    rng = np.random.default_rng(7 * S + Sk + H)
    q, k, v, qp, kp, idx = mosaic_case(rng, B, S, Sk, H, Hkv, 64, permuted, mb, 20)
    segs = doc_segments(B, qp, kp) if documents else None
    seg_kw = {} if segs is None else dict(q_seg=segs[0], k_seg=segs[1])
    if documents:
        idx = apply_segments(idx, *segs, BS)
    scale = 64**-0.5
    allowed = step_index_to_mask(idx, S, Sk, BS)
    out, lse = dense_attention(q, k, v, qp, kp, allowed, sm_scale=scale, **seg_kw)
    do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    delta = jnp.einsum("bshd,bshd->bhs", do, out)
    entries, counts3 = mosaic_index.kv_schedule(idx, Sk, Hkv, BS)
    g, nqb, nkb = H // Hkv, S // BS, Sk // BS
    counts = np.asarray(counts3)[..., :2]
    off = np.asarray(counts3)[..., 2]
    # the lists lie back to back in entries, in (b, hk, kb) order
    np.testing.assert_array_equal(off.reshape(-1), np.concatenate([[0], np.cumsum(counts[..., 1].reshape(-1))[:-1]]))
    sched = np.asarray(mosaic_index.dense_kv_schedule(entries, counts3, g * nqb))
    bidx, bcnt, bcau, ccnt = (np.asarray(x) for x in (idx.block_idx, idx.block_count, idx.block_causal,
                                                      idx.col_count))
    slot = np.asarray(mosaic_index.column_slots(idx, Sk)).reshape(B, H, nkb, BS).min(-1)
    for b in range(B):
        for hk in range(Hkv):
            for kb in range(nkb):
                listing, free = set(), set()
                for j in range(g):
                    h = hk * g + j
                    for i in range(nqb):
                        for t in range(bcnt[b, h, i]):
                            if bidx[b, h, i, t] == kb:
                                listing.add(j * nqb + i)
                                if not bcau[b, h, i, t] and slot[b, h, kb] >= ccnt[b, h, i]:
                                    free.add(j * nqb + i)
                nf, na = counts[b, hk, kb]
                assert set(sched[b, hk, kb, :nf]) == free and nf == len(free)
                assert set(sched[b, hk, kb, :na]) == listing and na == len(listing)
    dk, dv = mosaic_index.emulate_dkv_blocks(q, k, v, qp, kp, idx, do, lse, delta, sm_scale=scale, block_size=BS,
                                             segs=segs)
    blocks = step_index_to_mask(idx._replace(col_count=jnp.zeros_like(idx.col_count)), S, Sk, BS)
    cols = step_index_to_mask(idx._replace(block_count=jnp.zeros_like(idx.block_count)), S, Sk, BS)
    causal = np.asarray(kp)[None, :] <= np.asarray(qp)[:, None]
    if documents:  # [B, 1, Sq, Sk]: and the same document
        causal = causal & (np.asarray(segs[0])[:, None, :, None] == np.asarray(segs[1])[:, None, None, :])
    kh = np.arange(H) // g
    s = np.einsum("bqhd,bkhd->bhqk", np.asarray(q, np.float64), np.asarray(k, np.float64)[:, :, kh]) * scale
    lse64 = np.where(np.isfinite(np.asarray(lse)), np.asarray(lse), 0.0)
    p = np.where(np.asarray(blocks) & ~np.asarray(cols) & causal, np.exp(s - lse64[..., None]), 0.0)
    do64 = np.asarray(do, np.float64)
    dp = np.einsum("bqhd,bkhd->bhqk", do64, np.asarray(v, np.float64)[:, :, kh])
    ds = p * (dp - np.asarray(delta, np.float64)[..., None])
    dv_ref = np.einsum("bhqk,bqhd->bkhd", p, do64).reshape(B, Sk, Hkv, g, 64).sum(3)
    dk_ref = (np.einsum("bhqk,bqhd->bkhd", ds, np.asarray(q, np.float64)) * scale).reshape(B, Sk, Hkv, g, 64).sum(3)
    np.testing.assert_allclose(np.asarray(dv), dv_ref, atol=2e-4)
    np.testing.assert_allclose(np.asarray(dk), dk_ref, atol=2e-4)
