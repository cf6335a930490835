"""Mosaic GPU kernels: their tile operands (CPU), their lowering for CUDA (CPU), results (GPU).

The kernels do not run on CPU (why: :mod:`pallas_kernels.backend_mosaic`), so on CPU we check
(1) that :func:`mosaic_index.prepare` plus the kernel's tile walk, emulated in ``jax.numpy``,
equals the masked dense reference — the index logic the kernel executes — and (2) that the kernel
lowers to Mosaic GPU for CUDA (catches API drift across JAX versions). The dK/dV block pass's
schedules: ``test_mosaic_kv_schedule.py``. The kernel itself runs in the GPU-marked suite of
``test_kernels_gpu.py`` (``TestMosaicGPU``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _mosaic_cases import BS, doc_segments, mosaic_case
from pallas_kernels.reference import dense_attention
from pallas_kernels import mosaic_index
from pallas_kernels.index_format import apply_segments, step_index_to_mask
from pallas_kernels.testing import lowering_inputs


@pytest.mark.parametrize("B, S, Sk, H, Hkv, permuted, mb, mc", [
    (1, 256, 256, 2, 2, False, 3, 70),    # a column list longer than one tile, ragged tail
    (2, 256, 384, 4, 1, True, 4, 12),     # GQA 4, ring-like positions, Sq != Sk
    (1, 128, 256, 8, 1, True, 2, 130),    # GQA 8, three column tiles
    (1, 512, 512, 2, 1, False, 2, 200),   # causal columns: later rows get free column tiles
])
def test_prepared_tile_walk_equals_masked_reference(B, S, Sk, H, Hkv, permuted, mb, mc):
    rng = np.random.default_rng(S + Sk + H)
    q, k, v, qp, kp, idx = mosaic_case(rng, B, S, Sk, H, Hkv, 64, permuted, mb, mc)
    ops = mosaic_index.prepare(idx, k, v, kp, BS, qp)
    n_free, n_blk = np.asarray(ops.counts[..., 0]), np.asarray(ops.counts[..., 1])
    assert np.all(n_free <= n_blk) and np.array_equal(n_blk, np.asarray(idx.block_count))
    # free column tiles: whole tile inside the row's prefix and causal for every query of the block
    ncol, n_cfree = np.asarray(ops.counts[..., 2]), np.asarray(ops.counts[..., 3])
    cpos = np.asarray(ops.c_info[..., 0, :])  # [B, H, nCT, bs]
    qmin = np.asarray(qp).reshape(-1, BS).min(-1)
    for b, h, i in np.ndindex(*ncol.shape):
        assert (n_cfree[b, h, i] + 1) * BS > ncol[b, h, i] or cpos[b, h, n_cfree[b, h, i]].max() > qmin[i]
        for c in range(n_cfree[b, h, i]):
            assert (c + 1) * BS <= ncol[b, h, i] and cpos[b, h, c].max() <= qmin[i]
    out, lse = mosaic_index.emulate_fwd(q, ops, k, v, qp, sm_scale=64**-0.5, block_size=BS)
    ref_out, ref_lse = dense_attention(q, k, v, qp, kp, step_index_to_mask(idx, S, Sk, BS))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=2e-5)
    fin = np.isfinite(np.asarray(ref_lse))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), fin)
    np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(ref_lse)[fin], atol=2e-5)


def test_shared_plan_walks_every_segment_once_per_consumer_in_order():
    """``SHARED_PLAN``: for each consumer, its loops (the plan's entries it has) are its runs of equal
    class over ``STREAM_SEGMENTS``, in stream order, covering every segment once with its class; the
    plan is as short as the longer consumer's run list allows (7: consumer 1 alternates)."""
    from pallas_kernels.mosaic_index import STREAM_SEGMENTS
    from pallas_kernels.mosaic_stream import SHARED_PLAN

    assert len(SHARED_PLAN) == 7
    for w in (0, 1):
        runs = [p[1 + w] for p in SHARED_PLAN if p[1 + w] is not None]
        assert all(p[0] == p[1 + w][0] for p in SHARED_PLAN if p[1 + w] is not None)
        segs = [s for _, first, last in runs for s in range(first, last + 1)]
        assert segs == list(range(len(STREAM_SEGMENTS)))
        assert all(STREAM_SEGMENTS[s][w] == kind for kind, first, last in runs for s in range(first, last + 1))
        assert all(a[0] != b[0] for a, b in zip(runs, runs[1:]))  # maximal runs


@pytest.mark.parametrize("halves, stream", [(1, "shared"), (2, "shared"), (2, "split")])
@pytest.mark.parametrize("B, S, Sk, H, Hkv, permuted, mb, mc, documents", [
    (1, 256, 256, 2, 2, False, 3, 70, False),    # ragged column tail, odd groups (NULL halves)
    (2, 256, 384, 4, 1, True, 4, 12, False),     # GQA 4, ring-like positions, Sq != Sk
    (1, 512, 512, 2, 1, False, 6, 200, False),   # causal columns: free column steps
    (1, 512, 512, 2, 1, False, 5, 90, True),     # packed documents
    (1, 1024, 1024, 2, 1, False, 0, 300, "sorted"),  # documents, position-ordered columns: walks start late
])
def test_stream_walk_equals_masked_reference(halves, stream, B, S, Sk, H, Hkv, permuted, mb, mc, documents):
    """The query-side kernels' CTA stream (``pair_stream`` + the consumers' loop bounds of
    ``mosaic_fwd``), walked step by step in numpy as each consumer does: every step in exactly one
    of its loops (and classified the same by ``step_kind``, the one-loop walk), free steps unmasked, masked steps by the ``info`` rule (a NULL half all masked),
    skipped steps not used. Softmax over the keys gathered that way equals the masked reference.
    ``stream="split"`` (``split_stream``): a block step's half ``w`` is consumer ``w``'s own tile,
    the only half it uses; column steps as in the shared stream. With documents and position-ordered
    columns (``"sorted"``) the CTAs' column steps start at their rows' ``column_start`` (later
    documents' rows skip the earlier documents' columns): a start one step too late drops columns the
    reference keeps."""
    from pallas_kernels.mosaic_stream import consumer_row as _consumer_row
    from pallas_kernels.mosaic_stream import step_kind as _step_kind
    from pallas_kernels.mosaic_stream import stream_segments as _stream_segments
    from pallas_kernels.mosaic_stream import stream_walk as _stream_walk
    from pallas_kernels.mosaic_index import NULL_BLOCK, POS_PAD, pair_stream, split_stream

    from pallas_kernels.testing import vertical_slash_index

    rng = np.random.default_rng(S + mb + halves)
    q, k, v, qp, kp, idx = mosaic_case(rng, B, S, Sk, H, Hkv, 64, permuted, max(mb, 1), mc)
    if documents == "sorted":
        idx = vertical_slash_index(rng, B, H, S, 0.8, block_size=BS, far_slashes=1, max_cols=mc)
    segs = (qp[None].repeat(B, 0) // 150, kp[None].repeat(B, 0) // 150) if documents else None
    if documents:
        idx = apply_segments(idx, *segs, BS)
    ops = mosaic_index.prepare(idx, k, v, kp, BS, qp, segs)
    st = split_stream(ops) if stream == "split" else pair_stream(ops, halves)
    cnt, bnd, sidx = (np.asarray(x) for x in (ops.counts, st.bounds, st.block_idx))
    kinfo, cinfo = np.asarray(ops.k_info), np.asarray(ops.c_info)
    kf, vf = np.asarray(k, np.float64), np.asarray(v, np.float64)
    kcf, vcf = np.asarray(ops.kc, np.float64), np.asarray(ops.vc, np.float64)
    qf, qpos = np.asarray(q, np.float64), np.asarray(qp)
    ref_out, _ = dense_attention(q, k, v, qp, kp, step_index_to_mask(idx, S, Sk, BS),
                                 q_seg=segs[0] if documents else None, k_seg=segs[1] if documents else None)
    g = H // Hkv
    out = np.zeros(qf.shape)
    skipped_cols = 0
    for b, h, p in np.ndindex(B, H, S // (2 * BS)):
        bounds, n_union, total, rows_w, col0 = _stream_walk(bnd, cnt, b, h, p, BS, halves)
        total, n_union, col0 = int(total), int(n_union), int(col0)
        for w in range(2):
            row = _consumer_row(w, rows_w)
            i, ncol = int(row[0]), int(row[1])
            loops = [(int(lo), int(hi), kind, col)
                     for lo, hi, kind, col in _stream_segments(w, bounds, n_union, total, row, stream == "split")]
            skipped_cols += sum(hi - lo for lo, hi, kind, col in loops[-4:-3]) + col0  # before the row's start
            seen = sorted(t for lo, hi, _, _ in loops for t in range(lo, hi))
            assert seen == list(range(total))  # every step once, in some loop
            # the one-loop walk (walk="switch") classifies every step as these loops do
            want_kind, want_col = np.full(total, -1), np.zeros(total, bool)
            for lo, hi, kind, col in loops:
                want_kind[lo:hi], want_col[lo:hi] = kind, col
            got_kind, got_col = _step_kind(np.arange(total), w, bounds, n_union, row)
            np.testing.assert_array_equal(np.asarray(got_kind), want_kind)
            np.testing.assert_array_equal(np.asarray(got_col), want_col)
            keys, vals, keep = [], [], []
            rq = slice(i * BS, (i + 1) * BS)
            for lo, hi, kind, col in loops:
                for t in range(lo, hi):
                    for hf in range(halves):
                        if t < n_union:
                            if stream == "split" and hf != w:
                                continue  # the other consumer's tile
                            kb = sidx[b, h, p, t, hf]
                            kr = kf[b, max(kb, 0) * BS:(max(kb, 0) + 1) * BS, h // g]
                            vr = vf[b, max(kb, 0) * BS:(max(kb, 0) + 1) * BS, h // g]
                            info = kinfo[b, h, max(kb, 0)] if kb != NULL_BLOCK else np.full_like(kinfo[0, 0, 0], POS_PAD)
                            assert kb != NULL_BLOCK or kind != 0  # a NULL half is never in a free step
                            assert stream != "split" or (kb == NULL_BLOCK) == (kind == 2)  # own tile iff walked
                        else:
                            c = (t - n_union + col0) * halves + hf
                            kr, vr, info = kcf[b, h, c * BS:(c + 1) * BS], vcf[b, h, c * BS:(c + 1) * BS], cinfo[b, h, c]
                        if kind == 2:
                            continue
                        ok = np.ones((BS, BS), bool)
                        if kind == 1:
                            thr = 1 - ncol if col else ncol
                            ok = (info[0][None, :] <= qpos[rq][:, None]) & (info[1][None, :] >= thr)
                            if documents:
                                ok &= info[2][None, :] == np.asarray(segs[0])[b, rq][:, None]
                        keys.append(kr), vals.append(vr), keep.append(ok)
            if not keys:
                continue
            s_ = qf[b, rq, h] @ np.concatenate(keys).T * 64 ** -0.5
            s_ = np.where(np.concatenate(keep, axis=1), s_, -np.inf)
            m = s_.max(1, keepdims=True)
            pr = np.exp(s_ - np.where(np.isfinite(m), m, 0))
            l = pr.sum(1, keepdims=True)
            out[b, rq, h] = (pr @ np.concatenate(vals)) / np.where(l == 0, 1, l)
    np.testing.assert_allclose(out, np.asarray(ref_out, np.float64), atol=2e-5)
    if documents == "sorted":  # column steps left out: later documents' rows start past earlier ones'
        assert skipped_cols > S // (2 * BS), skipped_cols
    elif not documents:
        assert skipped_cols == 0


def test_position_ordered_columns_get_free_column_tiles():
    """Column lists in position order (as the index builds them): every row's leading column tiles
    are mask-free, and the walk with them equals the masked reference."""
    from pallas_kernels.testing import vertical_slash_index

    rng = np.random.default_rng(5)
    S, H = 1024, 2
    idx = vertical_slash_index(rng, 1, H, S, 0.8, block_size=BS, far_slashes=1, max_cols=300)
    pos = jnp.arange(S, dtype=jnp.int32)
    q = jnp.asarray(rng.standard_normal((1, S, H, 64)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, S, 1, 64)), jnp.float32)
    ops = mosaic_index.prepare(idx, k, k, pos, BS, pos)
    n_cfree = np.asarray(ops.counts[..., 3])
    assert n_cfree.max() >= 3 and n_cfree.sum() > 0.5 * (np.asarray(idx.col_count) // BS).sum()
    out, _ = mosaic_index.emulate_fwd(q, ops, k, k, pos, sm_scale=0.125, block_size=BS)
    ref, _ = dense_attention(q, k, k, pos, pos, step_index_to_mask(idx, S, S, BS), sm_scale=0.125)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5)


def test_free_tiles_hold_no_listed_prefix_column():
    """A tile is free only if causal-free AND none of its keys is a column of the row's prefix
    (those keys belong to the column phase and must be masked out of the block tile)."""
    rng = np.random.default_rng(1)
    q, k, v, qp, kp, idx = mosaic_case(rng, 1, 256, 256, 2, 2, 64, False, 4, 40)
    ops = mosaic_index.prepare(idx, k, v, kp, BS)
    slot = np.asarray(mosaic_index.column_slots(idx, 256)).reshape(1, 2, 4, BS).min(-1)
    bidx, cnt = np.asarray(ops.block_idx), np.asarray(ops.counts)
    for h in range(2):
        for i in range(4):
            for j in range(cnt[0, h, i, 0]):
                assert slot[0, h, bidx[0, h, i, j]] >= cnt[0, h, i, 2]


@pytest.mark.parametrize("B, S, Sk, H, Hkv, permuted, mc", [
    (1, 256, 256, 2, 2, False, 70),   # column list over two tiles, documents inside blocks
    (2, 256, 384, 4, 1, True, 12),    # GQA 4, ring-like positions, per-row documents
])
def test_prepared_tile_walk_with_documents(B, S, Sk, H, Hkv, permuted, mc):
    """Packed documents: the index narrowed by ``apply_segments``, ``prepare`` with segment ids
    (third ``info`` row) and the walk masking only its masked tiles by segment equals the reference
    under (index mask AND document mask)."""
    rng = np.random.default_rng(S + Sk + H + 1)
    q, k, v, qp, kp, idx = mosaic_case(rng, B, S, Sk, H, Hkv, 64, permuted, 4, mc)
    segs = doc_segments(B, qp, kp)
    ops = mosaic_index.prepare(apply_segments(idx, *segs, BS), k, v, kp, BS, qp, segs)
    assert ops.k_info.shape[3] == 3 and ops.c_info.shape[3] == 3
    out, lse = mosaic_index.emulate_fwd(q, ops, k, v, qp, sm_scale=64**-0.5, block_size=BS, q_seg=segs[0])
    ref_out, ref_lse = dense_attention(q, k, v, qp, kp, step_index_to_mask(idx, S, Sk, BS), q_seg=segs[0],
                                       k_seg=segs[1])
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=2e-5)
    fin = np.isfinite(np.asarray(ref_lse))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), fin)
    np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(ref_lse)[fin], atol=2e-5)


def test_free_column_tiles_with_documents_lie_in_one_document():
    """Position-ordered columns with documents: a column tile is free only when its columns and
    the query block are in one document; the walk (free tiles unmasked) equals the reference."""
    from pallas_kernels.testing import vertical_slash_index

    rng = np.random.default_rng(6)
    S, H = 1024, 2
    idx = vertical_slash_index(rng, 1, H, S, 0.8, block_size=BS, far_slashes=1, max_cols=300)
    pos = jnp.arange(S, dtype=jnp.int32)
    segs = doc_segments(1, pos, pos, ends=(700, 2 * S))  # free column tiles in the first document only
    q = jnp.asarray(rng.standard_normal((1, S, H, 64)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, S, 1, 64)), jnp.float32)
    narrowed = apply_segments(idx, *segs, BS)
    ops = mosaic_index.prepare(narrowed, k, k, pos, BS, pos, segs)
    plain = mosaic_index.prepare(narrowed, k, k, pos, BS, pos)
    n_cfree = np.asarray(ops.counts[..., 3])
    assert n_cfree.max() >= 1 and n_cfree.sum() < np.asarray(plain.counts[..., 3]).sum()
    cseg, qseg = np.asarray(ops.c_info[0, :, :, 2]), np.asarray(segs[0]).reshape(-1, BS)
    for h, i in np.ndindex(H, S // BS):
        for c in range(n_cfree[0, h, i]):
            assert set(cseg[h, c]) == set(qseg[i]) and len(set(qseg[i])) == 1
    out, _ = mosaic_index.emulate_fwd(q, ops, k, k, pos, sm_scale=0.125, block_size=BS, q_seg=segs[0])
    ref, _ = dense_attention(q, k, k, pos, pos, step_index_to_mask(idx, S, S, BS), sm_scale=0.125,
                             q_seg=segs[0], k_seg=segs[1])
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5)


def _column_tile_keep(c_info, col_count, q_pos, q_seg, b, h, c, i):
    """``bool [64, 64]``: the pairs of column chunk ``c`` and query block ``i`` the column dK/dV pass's
    mask keeps (the kernel's rule: ``pos <= q_pos``, list slot ``< col_count``, same document)."""
    cpos, slot = c_info[b, h, c, 0][:, None], -c_info[b, h, c, 1][:, None]
    qp = q_pos[i * BS:(i + 1) * BS][None, :]
    keep = (cpos <= qp) & (slot < col_count[b, h, i])
    if q_seg is not None:
        keep &= c_info[b, h, c, 2][:, None] == q_seg[b, i * BS:(i + 1) * BS][None, :]
    return keep


def _column_tile_keeps_all(c_info, col_count, q_pos, q_seg, b, h, c, i):
    return bool(_column_tile_keep(c_info, col_count, q_pos, q_seg, b, h, c, i).all())


@pytest.mark.parametrize("kind, documents", [("random", False), ("random", True), ("vs", False), ("vs", True)])
def test_column_pass_walk_and_free_tiles(kind, documents):
    """The column dK/dV pass's walk of each chunk: :func:`mosaic_index.column_ranges`' ``[first, end)``
    holds every query block that keeps a pair of the chunk (the blocks outside keep none: with packed
    documents, whole later documents, whose ``column_start`` is past the chunk); in
    :func:`mosaic_index.column_free_range`'s ``[lo, hi)`` every block keeps every pair (so the pass may
    skip the mask there), and it is maximal: the walked blocks just before and after it do not. On
    position-ordered columns most of the walk is free, with documents too, and documents cut the walk."""
    from pallas_kernels.index_format import column_start
    from pallas_kernels.testing import vertical_slash_index

    rng = np.random.default_rng(11 + documents)
    if kind == "random":  # random column order, non-monotone prefixes, ring-like positions
        q, k, v, qp, kp, idx = mosaic_case(rng, 2, 256, 384, 4, 1, 64, True, 3, 150)
    else:
        S = 2048
        qp = kp = jnp.arange(S, dtype=jnp.int32)
        idx = vertical_slash_index(rng, 2, 2, S, 0.9, block_size=BS, far_slashes=1, max_cols=300)
        k = jnp.asarray(rng.standard_normal((2, S, 1, 64)), jnp.float32)
        v = k
    segs = doc_segments(2, qp, kp, ends=(700, 1500, 1 << 20)) if documents else None
    if documents:
        idx = apply_segments(idx, *segs, BS)
    _, _, c_info = mosaic_index.column_operands(idx, k, v, kp, BS, segs=segs)
    nch = c_info.shape[2]
    start = column_start(idx, *segs, BS) if documents else None
    first, end, _ = mosaic_index.column_ranges(idx.col_count, nch, BS, 512, start)
    flo, fhi = (np.asarray(x) for x in mosaic_index.column_free_range(
        c_info, idx.col_count, qp, BS, first, end, segs[0] if documents else None))
    first, end = np.asarray(first), np.asarray(end)
    c_info, ccount, qpos = np.asarray(c_info), np.asarray(idx.col_count), np.asarray(qp)
    qseg = np.asarray(segs[0]) if documents else None
    B, H = c_info.shape[:2]
    nqb = ccount.shape[-1]
    assert flo.shape == (B, H, nch) and (first <= end).all() and (end <= nqb).all()
    for b, h, c in np.ndindex(B, H, nch):
        lo, hi, f0, f1 = (int(x[b, h, c]) for x in (first, end, flo, fhi))
        assert lo <= f0 <= f1 <= max(hi, lo)
        kept = [_column_tile_keep(c_info, ccount, qpos, qseg, b, h, c, i).any() for i in range(nqb)]
        assert not any(kept[:lo]) and not any(kept[hi:]), (b, h, c, lo, hi)
        assert all(_column_tile_keeps_all(c_info, ccount, qpos, qseg, b, h, c, i) for i in range(f0, f1))
        if f1 > f0:  # maximal: the walked neighbours need the mask
            assert f0 == lo or not _column_tile_keeps_all(c_info, ccount, qpos, qseg, b, h, c, f0 - 1)
            assert f1 == hi or not any(_column_tile_keeps_all(c_info, ccount, qpos, qseg, b, h, c, i)
                                       for i in range(f1, hi))
    if kind == "vs":  # position-ordered columns: full chunks free past their last column (with documents:
        # to their document's end, in chunks inside one document; most chunks here straddle two)
        full = np.arange(1, nch + 1) * BS <= ccount.max(-1)[..., None]
        walked, free = (end - first)[full].sum(), (fhi - flo)[full].sum()
        assert free > (0.15 if documents else 0.5) * walked, (free, walked)
        if documents:  # each chunk's walk ends with its last document (3 here): about half the plain walk
            plain = np.asarray(mosaic_index.column_ranges(idx.col_count, nch, BS, 512)[0])
            assert walked < 0.6 * (nqb - plain)[full].sum(), walked


@pytest.mark.parametrize("merge, documents", [(False, False), (True, False), (False, True), (True, True)])
def test_mosaic_kernels_lower_for_cuda(merge, documents):
    """Forward (with / without the ring merge) and dQ pass (with / without ``dq_acc``), and with
    packed documents (segment ids: the third ``info`` row and the queries' ids)."""
    from pallas_kernels.mosaic_dq import mosaic_dq
    from pallas_kernels.mosaic_fwd import mosaic_fwd

    B, S, H, q, k, pos, idx = lowering_inputs(2)
    D = q.shape[-1]
    segs = (pos[None] // 100, pos[None] // 100) if documents else None
    acc = (jnp.zeros((B, S, H, D)), jnp.zeros((B, H, S))) if merge else None
    f = jax.jit(lambda q, k, v, idx, acc, segs: mosaic_fwd(q, k, v, pos, pos, idx, acc, sm_scale=0.1, segs=segs))
    text = f.trace(q, k, k, idx, acc, segs).lower(lowering_platforms=("cuda",)).as_text()
    # each pass is named (a profile tells them apart); an unnamed body would lower as "anonymous"
    assert "mosaic_gpu" in text and "mosaic_fwd" in text and "anonymous" not in text
    # the forward's default stream="auto" ("index"): a conditional between the split and the shared kernels
    assert text.count("stablehlo.case") == 1 and text.count("custom_call @mosaic_gpu") == 2, \
        "the forward's stream='auto' lowers both kernels under one conditional"
    lse = jnp.zeros((B, H, S))
    dq_acc = jnp.zeros(q.shape) if merge else None
    g = jax.jit(lambda q, k, v, idx, do, lse, delta, acc, segs: mosaic_dq(q, k, v, pos, pos, idx, do, lse, delta, acc,
                                                                         sm_scale=0.1, segs=segs))
    text = g.trace(q, k, k, idx, q, lse, lse, dq_acc, segs).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "mosaic_dq" in text and "anonymous" not in text
    # a ring's last dQ in q's dtype: the kernels' result is bf16 (rounded in the epilogue), no float32 dQ
    g16 = jax.jit(lambda q, k, v, idx, do, lse, delta, acc, segs: mosaic_dq(
        q, k, v, pos, pos, idx, do, lse, delta, acc, sm_scale=0.1, segs=segs, out_dtype=jnp.bfloat16))
    t16 = g16.trace(q, k, k, idx, q, lse, lse, dq_acc, segs).lower(lowering_platforms=("cuda",)).as_text()
    dq_type = f"tensor<{B}x{S}x{H}x{D}x"
    calls = [line for line in t16.splitlines() if "custom_call @mosaic_gpu" in line]
    assert len(calls) == 1 and all(f"-> {dq_type}bf16>" in line for line in calls), calls  # "auto": split
    assert all(f"-> {dq_type}f32>" in line for line in text.splitlines() if "custom_call @mosaic_gpu" in line)
    # a final forward output in q's dtype (the op's forward alone): both streams' kernels write bf16
    f16 = jax.jit(lambda q, k, v, idx, acc, segs: mosaic_fwd(q, k, v, pos, pos, idx, acc, sm_scale=0.1, segs=segs,
                                                             out_dtype=jnp.bfloat16))
    t16 = f16.trace(q, k, k, idx, acc, segs).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in t16.splitlines() if "custom_call @mosaic_gpu" in line]
    assert len(calls) == 2 and all(f"-> ({dq_type}bf16>" in line for line in calls), calls
    if not merge and not documents:  # the other step width of each query-side kernel
        sizes = {}
        f = jax.jit(lambda q, k, v, idx: mosaic_fwd(q, k, v, pos, pos, idx, sm_scale=0.1, kv_step=64))
        assert "mosaic_gpu" in f.trace(q, k, k, idx).lower(lowering_platforms=("cuda",)).as_text()
        g = jax.jit(lambda q, k, v, idx, do, lse, delta: mosaic_dq(q, k, v, pos, pos, idx, do, lse, delta,
                                                                   sm_scale=0.1, kv_step=128))
        assert "mosaic_gpu" in g.trace(q, k, k, idx, q, lse, lse).lower(lowering_platforms=("cuda",)).as_text()
        # the one-loop walk: the step bodies once each (a smaller program), the pass still named
        for walk in ("loops", "switch"):
            f = jax.jit(lambda q, k, v, idx, walk=walk: mosaic_fwd(q, k, v, pos, pos, idx, sm_scale=0.1, walk=walk,
                                                                  stream="shared"))
            g = jax.jit(lambda q, k, v, idx, do, lse, delta, walk=walk: mosaic_dq(
                q, k, v, pos, pos, idx, do, lse, delta, sm_scale=0.1, walk=walk, stream="shared"))
            sizes[walk] = [len(f.trace(q, k, k, idx).lower(lowering_platforms=("cuda",)).as_text()),
                           len(g.trace(q, k, k, idx, q, lse, lse).lower(lowering_platforms=("cuda",)).as_text())]
        assert all(a < 0.6 * b for a, b in zip(sizes["switch"], sizes["loops"])), sizes
        # the segment loops merged per consumer (mosaic_stream.SHARED_PLAN: 7 block loops, not 14)
        assert all(b < 2.6 * a for a, b in zip(sizes["switch"], sizes["loops"])), sizes
        # separate streams (each consumer its own half of every block step), with either walk
        for walk in ("loops", "switch"):
            f = jax.jit(lambda q, k, v, idx, walk=walk: mosaic_fwd(q, k, v, pos, pos, idx, sm_scale=0.1, walk=walk,
                                                                  stream="split"))
            tf = f.trace(q, k, k, idx).lower(lowering_platforms=("cuda",)).as_text()
            g = jax.jit(lambda q, k, v, idx, do, lse, delta, walk=walk: mosaic_dq(
                q, k, v, pos, pos, idx, do, lse, delta, sm_scale=0.1, walk=walk, stream="split", kv_step=128))
            tg = g.trace(q, k, k, idx, q, lse, lse).lower(lowering_platforms=("cuda",)).as_text()
            assert "mosaic_fwd" in tf and "mosaic_dq" in tg
            if walk == "loops":  # its own counts' three block loops, not the shared stream's segment loops
                g = jax.jit(lambda q, k, v, idx, do, lse, delta: mosaic_dq(
                    q, k, v, pos, pos, idx, do, lse, delta, sm_scale=0.1, stream="shared", walk="loops", kv_step=128))
                shared_dq = len(g.trace(q, k, k, idx, q, lse, lse).lower(lowering_platforms=("cuda",)).as_text())
                assert len(tf) < 0.6 * sizes["loops"][0] and len(tg) < 0.6 * shared_dq, (len(tf), len(tg), sizes, shared_dq)
        with pytest.raises(ValueError, match="stream='split' needs kv_step=128"):
            mosaic_dq(q, k, k, pos, pos, idx, q, lse, lse, sm_scale=0.1, stream="split")
        with pytest.raises(ValueError, match="stream must be one of"):
            mosaic_fwd(q, k, k, pos, pos, idx, sm_scale=0.1, stream="union")
        with pytest.raises(ValueError, match="walk must be one of"):
            mosaic_fwd(q, k, k, pos, pos, idx, sm_scale=0.1, walk="segments")
        with pytest.raises(ValueError, match="kv_step must be 64 or 128, got 96"):
            mosaic_fwd(q, k, k, pos, pos, idx, sm_scale=0.1, kv_step=96)
    if not merge:  # the dK/dV block pass has no accumulator variant
        from pallas_kernels.mosaic_dkv import mosaic_dkv_blocks

        f = jax.jit(lambda q, k, v, idx, do, lse, delta, segs: mosaic_dkv_blocks(
            q, k, v, pos, pos, idx, do, lse, delta, sm_scale=0.1, segs=segs))
        blocks = f.trace(q, k, k, idx, q, lse, lse, segs).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in blocks and "mosaic_dkv_blocks" in blocks and "anonymous" not in blocks
        # the shared Q/dO stream (kv_pair_schedule): one switching loop about the split pass's size,
        # its segment loops (SHARED_PLAN: 7) about twice that (0.39 M / 0.80 M characters, 2026-12-06)
        shared = {}
        for walk in ("switch", "loops"):
            f = jax.jit(lambda q, k, v, idx, do, lse, delta, segs, walk=walk: mosaic_dkv_blocks(
                q, k, v, pos, pos, idx, do, lse, delta, sm_scale=0.1, segs=segs, stream="shared", walk=walk))
            shared[walk] = len(f.trace(q, k, k, idx, q, lse, lse, segs).lower(lowering_platforms=("cuda",)).as_text())
        assert 0.9 * len(blocks) < shared["switch"] < 1.15 * len(blocks) < 1.6 * shared["switch"] < shared["loops"], (
            shared, len(blocks))
        with pytest.raises(ValueError, match="walk must be one of"):
            mosaic_dkv_blocks(q, k, k, pos, pos, idx, q, lse, lse, sm_scale=0.1, stream="shared", walk="zigzag")
        # a walk for a stream without one is refused, not ignored (the split stream; "auto" resolves to it)
        for stream in ("split", "auto"):
            with pytest.raises(ValueError, match="walk='loops' chooses how the shared stream is walked; the 'split'"):
                mosaic_dkv_blocks(q, k, k, pos, pos, idx, q, lse, lse, sm_scale=0.1, stream=stream, walk="loops")
        # no per-call choice of stream in the dK/dV block pass (the shared one is slower everywhere, run 34)
        with pytest.raises(ValueError, match="the dK/dV block pass's stream must be one of .* got 'index'"):
            mosaic_dkv_blocks(q, k, k, pos, pos, idx, q, lse, lse, sm_scale=0.1, stream="index")
        from pallas_kernels.mosaic_dkv import mosaic_dkv_cols

        z = jnp.zeros(k.shape, jnp.float32)
        f = jax.jit(lambda q, k, v, idx, do, lse, delta, segs: mosaic_dkv_cols(
            q, k, v, pos, pos, idx, do, lse, delta, z, z, sm_scale=0.1, range_blocks=2, segs=segs,
            col_walk="masked"))
        text = f.trace(q, k, k, idx, q, lse, lse, segs).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text and "mosaic_dkv_cols" in text and "anonymous" not in text
        # col_walk="masked" has no free tiles, so one tile body (the block pass: free and masked):
        # 0.29 M characters against 0.38 M (with the empty free loop, 2026-12-04: the same size)
        assert len(text) < 0.85 * len(blocks), (len(text), len(blocks))
        # col_walk="free": free tiles first (column_free_range), then masked ones: a
        # second tile body, about the block pass's size (0.39 M characters against 0.38 M; masked: 0.29 M)
        f = jax.jit(lambda q, k, v, idx, do, lse, delta, segs: mosaic_dkv_cols(
            q, k, v, pos, pos, idx, do, lse, delta, z, z, sm_scale=0.1, range_blocks=2, segs=segs, col_walk="free"))
        free = f.trace(q, k, k, idx, q, lse, lse, segs).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_dkv_cols" in free and 0.9 * len(blocks) < len(free) < 1.1 * len(blocks), (len(free), len(blocks))
        # col_walk="shared" over both chunks' walk: five segment loops (walk="loops"), or the same two bodies and a
        # skip body in one switching loop ("switch": the free walk's size)
        col_shared = {}
        for walk in ("loops", "switch"):
            f = jax.jit(lambda q, k, v, idx, do, lse, delta, segs, walk=walk: mosaic_dkv_cols(
                q, k, v, pos, pos, idx, do, lse, delta, z, z, sm_scale=0.1, range_blocks=2, segs=segs,
                col_walk="shared", walk=walk))
            col_shared[walk] = len(f.trace(q, k, k, idx, q, lse, lse, segs).lower(lowering_platforms=("cuda",)).as_text())
        # (2026-12-07: free 0.40 M characters; shared 0.51 M with loops, 0.40 M with switch)
        assert 0.95 * len(free) < col_shared["switch"] < 1.1 * len(free) < col_shared["loops"] < 1.5 * len(free), (
            col_shared, len(free))
        with pytest.raises(ValueError, match="walk must be one of"):
            mosaic_dkv_cols(q, k, k, pos, pos, idx, q, lse, lse, z, z, sm_scale=0.1, col_walk="shared", walk="zigzag")
        with pytest.raises(ValueError, match="col_walk must be one of .* got 'loose'"):
            mosaic_dkv_cols(q, k, k, pos, pos, idx, q, lse, lse, z, z, sm_scale=0.1, col_walk="loose")
        for col_walk in ("free", "masked"):  # a walk only for the shared one: refused, not ignored
            with pytest.raises(ValueError, match=f"walk='switch' chooses how col_walk='shared' is walked; "
                                                 f"col_walk='{col_walk}' has none"):
                mosaic_dkv_cols(q, k, k, pos, pos, idx, q, lse, lse, z, z, sm_scale=0.1, col_walk=col_walk,
                                walk="switch")



def test_early_compile_program_carries_each_lowered_kernel():
    """``mosaic_precompile``: every Mosaic kernel lowered is reported once (its hash is the SHA-256 of its
    module, as Mosaic GPU keys its compile cache), and the one-custom-call program the worker compiles
    carries the kernel's own ``kernel_hash`` / ``module`` attributes, so compiling it fills the cache entry
    the real program's thunk looks up (the GPU run: ``TestMosaicGPU.test_kernels_compile_early``)."""
    import hashlib
    import re

    from pallas_kernels import mosaic_precompile as mp
    from pallas_kernels.mosaic_fwd import mosaic_fwd

    B, S, H, q, k, pos, idx = lowering_inputs(5)
    seen = []
    # a scale no other test lowers: a kernel new to this process
    f = jax.jit(lambda q, k, idx: mosaic_fwd(q, k, k, pos, pos, idx, sm_scale=0.0123457, stream="split",
                                             walk="loops", kv_step=128))
    assert mp.watch(lambda h, m: seen.append((h, m)))
    try:
        text = f.trace(q, k, idx).lower(lowering_platforms=("cuda",)).as_text()
        assert len(seen) == 1
        f.trace(q, k, idx).lower(lowering_platforms=("cuda",))  # known now: not reported again
        assert len(seen) == 1
    finally:
        mp.watch(None)
    h, module = seen[0]
    assert hashlib.sha256(module).digest() == h and len(module) > 10_000
    early = mp.kernel_program(h, module).trace().lower(lowering_platforms=("cuda",)).as_text()

    def attrs(t):
        calls = re.findall(r'custom_call @(\w+)\(.*?kernel_hash = ("[^"]*"), module = ("[^"]*")', t)
        assert len(calls) == 1, len(calls)
        return calls[0]

    assert attrs(early) == attrs(text) and attrs(early)[0] == mp.TARGET


def test_early_compile_only_on_a_gpu(monkeypatch):
    """On this CPU host :func:`start` stays off (no kernel compiles here); ``MTRAINING_MOSAIC_PRECOMPILE``
    switches it off anywhere."""
    from pallas_kernels import mosaic_precompile as mp

    assert mp.start() is False and mp.stats()["active"] is False and mp.stats()["compiled"] == 0
    assert mp.enabled_by_env()
    for off in ("0", "off", "False"):
        monkeypatch.setenv(mp.ENV, off)
        assert not mp.enabled_by_env()
    monkeypatch.setenv(mp.ENV, "1")
    assert mp.enabled_by_env()
