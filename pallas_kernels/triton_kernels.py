"""Pallas (Triton backend) kernels for vertical-slash block-sparse flash attention.

MTraining Algorithm 1 (paper Sec. 3) on the per-step index of :mod:`pallas_kernels.index_format`.
Query head ``h`` reads KV head ``h // g`` in place (GQA without repeating K/V).

* **forward** (:func:`pallas_fwd`): one program per (64-query block ``i``, query head ``h``,
  batch ``b``). The active KV blocks come in two groups (:func:`prepare_index`): first the *free*
  tiles (``block_causal == 0``: every pair causal), computed with no mask at all, then the few
  tiles that need the token-level causal mask by global position; then the row's prefix of the
  head's column list in chunks of ``col_chunk`` gathered rows (``k_ref[ids, :]``), masked by count,
  by position and where a column lies in one of the row's active blocks (:func:`_outside_blocks`). Online
  softmax in float32 with ``exp2`` and a ``log2(e)``-prescaled scale (FlashAttention-2, Dao 2023,
  Alg. 1). Writes ``out`` (f32) and the natural-log ``lse`` so ring steps can be merged; rows with
  no allowed key get out 0, lse -inf.
* **backward** (:func:`pallas_bwd`), three passes (measurements and the alternatives tried in
  ``benchmarks/KERNEL_NOTES.md``): (1) :func:`dq_pass`, query-stationary like the forward;
  (2) :func:`dkv_block_pass`, KV-stationary over the transposed schedule
  (:func:`transpose_block_index`: for every KV block the query blocks listing it, free ones first);
  (3) :func:`dkv_col_pass`, column-stationary: chunks of 64 columns of the head's shared list,
  gathered once, against the query blocks of one segment whose prefix reaches the chunk, added
  into the rows with float32 atomics (one add per chunk and segment). Passes 2-3 write per-query-
  head dK/dV, summed per GQA group at the end. ``delta = rowsum(dO * O)`` is an input
  (``api.attention_delta``).

The same source runs on the GPU and in interpret mode on CPU (tests); only the atomic row add
has an interpret-mode twin (:func:`_add_rows`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._compat import atomic_add, dot, triton_compiler_params
from pallas_kernels.index_format import StepIndex

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _partition_slots(first, second):
    """Destination slot of every entry when the ``first`` entries are moved to the front and the
    ``second`` ones right after (each group keeps its order), the rest last. Bool ``[..., M]`` in,
    ``(dst int32 [..., M], n_first [...], n_both [...])`` out — a stable partition without a sort."""
    c1 = jnp.cumsum(first, axis=-1, dtype=jnp.int32)
    c2 = jnp.cumsum(second, axis=-1, dtype=jnp.int32)
    rest = jnp.logical_not(first | second)
    c3 = jnp.cumsum(rest, axis=-1, dtype=jnp.int32)
    n1, n2 = c1[..., -1:], c2[..., -1:]
    dst = jnp.where(first, c1 - 1, jnp.where(second, n1 + c2 - 1, n1 + n2 + c3 - 1))
    return dst, n1[..., 0], (n1 + n2)[..., 0]


def _scatter_last(x, dst, size):
    """``out[..., dst[..., j]] = x[..., j]`` into a zero array with last dim ``size``."""
    ix = jnp.indices(x.shape[:-1], sparse=True)
    ix = tuple(i[..., None] for i in ix)
    return jnp.zeros(x.shape[:-1] + (size,), x.dtype).at[ix + (dst,)].set(x)


def prepare_index(index: StepIndex, sk: int, bs: int, col_chunk: int):
    """Kernel-ready index: each row's active blocks reordered free-first, slots padded.

    Returns ``(block_idx int32 [B,H,nQB,MBp], counts int32 [B,H,nQB,3], col_idx int32 [B,H,MCp])``:
    ``block_idx`` holds first the ``counts[..., 0]`` blocks whose tile needs no mask
    (``block_causal == 0``), then the masked ones up to ``counts[..., 1]`` (= ``block_count``),
    each group in index order; ``counts[..., 2] = col_count`` (the row's prefix of the head's
    column list ``col_idx``). Padding is in range (block 0 / token 0) and never read as active;
    ``MBp`` is a power of two, ``MCp`` a multiple of ``col_chunk``.
    """
    mb, mc = index.max_blocks, index.max_cols
    mbp = _pow2(mb)
    mcp = max(col_chunk, _pow2(-(-mc // col_chunk) * col_chunk))
    valid = jnp.arange(mb) < index.block_count[..., None]
    free = valid & (index.block_causal == 0)
    dst, n_free, n_blk = _partition_slots(free, valid & ~free)
    bidx = _scatter_last(jnp.clip(jnp.where(valid, index.block_idx, 0), 0, sk // bs - 1).astype(jnp.int32),
                         dst, mbp)
    cidx = jnp.pad(jnp.clip(index.col_idx, 0, sk - 1).astype(jnp.int32), [(0, 0), (0, 0), (0, mcp - mc)])
    counts = jnp.stack([n_free, n_blk, index.col_count.astype(jnp.int32)], axis=-1).astype(jnp.int32)
    return bidx, counts, cidx


def _block_rows(idx_ref, j, bs: int):
    """Contiguous rows of the block ``idx_ref[j]``."""
    return pl.ds(pl.multiple_of(idx_ref[j] * bs, bs), bs)


def _for_blocks(idx_ref, lo, hi, bs: int, body, carry):
    """``carry = body(rows, carry)`` over the blocks ``idx_ref[lo:hi]``, one ``bs``-row tile each."""
    return lax.fori_loop(lo, hi, lambda j, c: body(_block_rows(idx_ref, j, bs), c), carry)


def _col_rows(cidx_ref, c, ncols, cc):
    """Gathered row ids of the ``c``-th chunk of ``cc`` vertical columns and their validity."""
    off = pl.multiple_of(c * cc, cc)
    return cidx_ref[pl.ds(off, cc)], (off + jnp.arange(cc, dtype=jnp.int32)) < ncols


def _outside_blocks(ids, blocks, n_blk, bs: int):
    """``bool [cc]``: the column ``ids`` whose block is NOT among the row's active ``blocks[:n_blk]``
    (a column inside an active block is that block's key: the column phase must skip it)."""
    live = jnp.arange(blocks.shape[0], dtype=jnp.int32) < n_blk
    hit = ((ids // bs)[:, None] == blocks[None, :]) & live[None, :]
    return jnp.max(hit.astype(jnp.int32), axis=1) == 0


def _softmax_update(carry, s, v, masked: bool):
    """Online-softmax step with log2-domain scores ``s [bq, n]`` (``-inf`` = masked)."""
    acc, m, l = carry
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    # an unmasked tile has finite scores, so m_new is finite; a masked one may leave a row at -inf
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
    alpha = jnp.exp2(m - m_safe)
    p = jnp.exp2(s - m_safe[:, None])
    l = l * alpha + jnp.sum(p, axis=1)
    acc = acc * alpha[:, None] + dot(p.astype(v.dtype), v)
    return acc, m_new, l


def _fwd_kernel(qpos_ref, kpos_ref, bidx_ref, cnt_ref, cidx_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *,
                qk_scale, bs, cc):
    q = q_ref[...]
    qp = qpos_ref[...]
    carry = (jnp.zeros((bs, q.shape[-1]), jnp.float32), jnp.full((bs,), -jnp.inf, jnp.float32),
             jnp.zeros((bs,), jnp.float32))

    def free(rows, carry):
        s = dot(q, k_ref[rows, :], trans_b=True) * qk_scale
        return _softmax_update(carry, s, v_ref[rows, :], masked=False)

    def masked(rows, carry, valid=None):
        ok = kpos_ref[rows][None, :] <= qp[:, None]
        ok = ok if valid is None else ok & valid[None, :]
        s = jnp.where(ok, dot(q, k_ref[rows, :], trans_b=True) * qk_scale, -jnp.inf)
        return _softmax_update(carry, s, v_ref[rows, :], masked=True)

    def col_body(c, carry):
        ids, valid = _col_rows(cidx_ref, c, n_col, cc)
        return masked(ids, carry, valid & _outside_blocks(ids, bidx_ref[...], n_blk, bs))

    n_free, n_blk, n_col = cnt_ref[0], cnt_ref[1], cnt_ref[2]
    carry = _for_blocks(bidx_ref, 0, n_free, bs, free, carry)
    carry = _for_blocks(bidx_ref, n_free, n_blk, bs, masked, carry)
    carry = lax.fori_loop(0, (n_col + cc - 1) // cc, col_body, carry)
    acc, m, l = carry
    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, -jnp.inf, (m + jnp.log2(l_safe)) * LN2)


def _query_specs(H, g, sk, d, bs, mbp, mcp):
    """BlockSpecs of the query-stationary passes (grid ``(nQB, H, B)``)."""
    return dict(
        qpos=pl.BlockSpec((bs,), lambda i, h, b: (i,)),
        kpos=pl.BlockSpec((sk,), lambda i, h, b: (0,)),
        bidx=pl.BlockSpec((None, None, None, mbp), lambda i, h, b: (b, h, i, 0)),
        cnt=pl.BlockSpec((None, None, None, 3), lambda i, h, b: (b, h, i, 0)),
        cidx=pl.BlockSpec((None, None, mcp), lambda i, h, b: (b, h, 0)),
        q=pl.BlockSpec((None, bs, None, d), lambda i, h, b: (b, i, h, 0)),
        kv=pl.BlockSpec((None, sk, None, d), lambda i, h, b: (b, 0, h // g, 0)),
        row=pl.BlockSpec((None, None, bs), lambda i, h, b: (b, h, i)),
    )


_STATIC = ("sm_scale", "block_size", "col_chunk", "num_warps", "num_stages", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
def pallas_fwd(q, k, v, q_pos, k_pos, index: StepIndex, *, sm_scale: float, block_size: int,
               col_chunk: int = 64, num_warps: int = 4, num_stages: int = 2, interpret: bool = False):
    """Forward kernel; shapes as in :mod:`pallas_kernels.api`. Returns ``(out f32, lse f32)``."""
    B, sq, H, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    bs = block_size
    bidx, cnt, cidx = prepare_index(index, sk, bs, col_chunk)
    sp = _query_specs(H, H // hkv, sk, d, bs, bidx.shape[-1], cidx.shape[-1])
    kernel = functools.partial(_fwd_kernel, qk_scale=sm_scale * LOG2E, bs=bs, cc=col_chunk)
    return pl.pallas_call(
        kernel,
        grid=(sq // bs, H, B),
        in_specs=[sp["qpos"], sp["kpos"], sp["bidx"], sp["cnt"], sp["cidx"], sp["q"], sp["kv"], sp["kv"]],
        out_specs=[sp["q"], sp["row"]],
        out_shape=[jax.ShapeDtypeStruct((B, sq, H, d), jnp.float32),
                   jax.ShapeDtypeStruct((B, H, sq), jnp.float32)],
        compiler_params=triton_compiler_params(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="block_sparse_fwd",
    )(q_pos.astype(jnp.int32), k_pos.astype(jnp.int32), bidx, cnt, cidx, q, k, v)


def _dq_kernel(qpos_ref, kpos_ref, bidx_ref, cnt_ref, cidx_ref, q_ref, k_ref, v_ref, do_ref, lse_ref,
               delta_ref, dq_ref, *, qk_scale, scale, bs, cc):
    q = q_ref[...]
    do = do_ref[...]
    qp = qpos_ref[...]
    lse = lse_ref[...]
    lse2 = jnp.where(lse == -jnp.inf, 0.0, lse * LOG2E)
    delta = delta_ref[...]

    def tile(rows, dq, ok=None):
        k = k_ref[rows, :]
        s = dot(q, k, trans_b=True) * qk_scale
        if ok is not None:
            s = jnp.where(ok, s, -jnp.inf)
        p = jnp.exp2(s - lse2[:, None])  # exact 0 where masked
        ds = p * (dot(do, v_ref[rows, :], trans_b=True) - delta[:, None])
        return dq + dot(ds.astype(k.dtype), k)

    def masked(rows, dq, valid=None):
        ok = kpos_ref[rows][None, :] <= qp[:, None]
        return tile(rows, dq, ok if valid is None else ok & valid[None, :])

    n_free, n_blk, n_col = cnt_ref[0], cnt_ref[1], cnt_ref[2]
    dq = jnp.zeros(q.shape, jnp.float32)
    dq = _for_blocks(bidx_ref, 0, n_free, bs, tile, dq)
    dq = _for_blocks(bidx_ref, n_free, n_blk, bs, masked, dq)

    def col_body(c, dq):
        ids, valid = _col_rows(cidx_ref, c, n_col, cc)
        return masked(ids, dq, valid & _outside_blocks(ids, bidx_ref[...], n_blk, bs))

    dq = lax.fori_loop(0, (n_col + cc - 1) // cc, col_body, dq)
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def transpose_block_index(index: StepIndex, sk: int, bs: int):
    """KV-stationary schedule: for every (b, h, KV block), the query blocks that list it.

    Returns ``(tidx int32 [B, H, nKB, MTp], tcnt int32 [B, H, nKB, 2])``: each list holds first
    the ``tcnt[..., 0]`` query blocks whose tile needs no mask, then the masked ones up to
    ``tcnt[..., 1]``, each group sorted by query block (``MTp`` = ``nQB`` padded to a power of
    two). Built from a dense ``[B, H, nKB, nQB]`` int8 map of the tiles (1 free, 2 masked) with a
    cumsum per group for the list positions and one scatter of the ``B*H*nQB*MB`` entries.
    """
    B, H, nqb, mb = index.block_idx.shape
    nkb = sk // bs
    mtp = _pow2(nqb)
    valid = jnp.arange(mb) < index.block_count[..., None]
    kb = jnp.where(valid, jnp.clip(index.block_idx, 0, nkb - 1), nkb)  # invalid -> spill row
    b_ix = jnp.arange(B)[:, None, None, None]
    h_ix = jnp.arange(H)[None, :, None, None]
    q_ix = jnp.broadcast_to(jnp.arange(nqb, dtype=jnp.int32)[None, None, :, None], kb.shape)
    masked = index.block_causal != 0
    code = (1 + masked).astype(jnp.int8)
    tiles = jnp.zeros((B, H, nkb + 1, nqb), jnp.int8).at[b_ix, h_ix, kb, q_ix].set(code)[:, :, :nkb]
    free_map, masked_map = tiles == 1, tiles == 2
    pos_free = jnp.cumsum(free_map, axis=-1, dtype=jnp.int32) - 1  # [B, H, nKB, nQB]
    pos_masked = jnp.cumsum(masked_map, axis=-1, dtype=jnp.int32) - 1
    n_free = pos_free[..., -1] + 1
    tcnt = jnp.stack([n_free, n_free + pos_masked[..., -1] + 1], axis=-1)
    kbc = jnp.minimum(kb, nkb - 1)
    pos = jnp.where(masked, n_free[b_ix, h_ix, kbc] + pos_masked[b_ix, h_ix, kbc, q_ix],
                    pos_free[b_ix, h_ix, kbc, q_ix])
    pos = jnp.where(valid, pos, mtp)  # invalid -> spill column
    tidx = jnp.zeros((B, H, nkb + 1, mtp + 1), jnp.int32).at[b_ix, h_ix, kb, pos].set(q_ix)
    return tidx[:, :, :nkb, :mtp], tcnt


def col_segment_blocks(nqb: int, heads_x_batch: int) -> int:
    """Query blocks per program of the column pass (a power of two, at most 64): about 512
    programs, enough to fill an H100/H200 (longer segments, i.e. fewer programs and fewer atomic
    adds, measured slower: see KERNEL_NOTES.md)."""
    return max(1, min(64, _pow2(max(1, nqb * heads_x_batch // 512))))


def _query_rows(rows, q_ref, do_ref, qpos_ref, lse_ref, delta_ref):
    """Query rows ``rows`` (a slice or gathered ids) for a KV-stationary backward: q, dO,
    positions, log2-domain lse (0 where the row is empty) and delta."""
    lse = lse_ref[rows]
    lse2 = jnp.where(lse == -jnp.inf, 0.0, lse * LOG2E)
    return q_ref[rows, :], do_ref[rows, :], qpos_ref[rows], lse2, delta_ref[rows]


def _dkv_tile(carry, k, v, ok, qk_scale, q, do, lse2, delta):
    """Adds one ``[kv, q]`` tile's ``dV += P^T dO`` and (unscaled) ``dK += dS^T Q``."""
    dk, dv = carry
    st = dot(k, q, trans_b=True) * qk_scale  # [kv, q]
    if ok is not None:
        st = jnp.where(ok, st, -jnp.inf)
    pt = jnp.exp2(st - lse2[None, :])
    dv = dv + dot(pt.astype(do.dtype), do)
    dst = pt * (dot(v, do, trans_b=True) - delta[None, :])
    return dk + dot(dst.astype(q.dtype), q), dv


def _dkv_col_kernel(qpos_ref, kpos_ref, cidx_ref, segmax_ref, bidx_ref, nblk_ref, ncol_ref, q_ref, k_ref, v_ref,
                    do_ref, lse_ref, delta_ref, dk_in, dv_in, dk_ref, dv_ref, *, qk_scale, scale, bs, seg, nqb,
                    mbp, interpret):
    """One program per (segment of ``seg`` query blocks, query head, batch): for every chunk of
    ``bs`` columns of the head's list that some row of the segment uses, gather their K/V rows
    once, walk the segment's rows whose prefix reaches the chunk, and add the chunk's dK/dV into
    the per-head outputs."""
    del dk_in, dv_in  # aliased to dk_ref / dv_ref (the block pass's per-head dK/dV)
    lane = jnp.arange(bs, dtype=jnp.int32)
    lo = pl.program_id(0) * seg
    hi = jnp.minimum(lo + seg, nqb)

    def chunk_body(c, carry_through):
        off = pl.multiple_of(c * bs, bs)
        ids = cidx_ref[pl.ds(off, bs)]
        k, v, kp = k_ref[ids, :], v_ref[ids, :], kpos_ref[ids]

        def query_block(i, carry):
            n_col = ncol_ref[i]

            def tile(carry):
                blocks = bidx_ref[pl.ds(pl.multiple_of(i * mbp, mbp), mbp)]
                keep = ((off + lane) < n_col) & _outside_blocks(ids, blocks, nblk_ref[i], bs)
                rows = pl.ds(pl.multiple_of(i * bs, bs), bs)
                q, do, qp, lse2, delta = _query_rows(rows, q_ref, do_ref, qpos_ref, lse_ref, delta_ref)
                ok = keep[:, None] & (kp[:, None] <= qp[None, :])
                return _dkv_tile(carry, k, v, ok, qk_scale, q, do, lse2, delta)

            return lax.cond(off < n_col, tile, lambda carry: carry, carry)

        zeros = jnp.zeros(k.shape, jnp.float32)
        dk, dv = lax.fori_loop(lo, hi, query_block, (zeros, zeros))
        # other segments add into the same rows: atomics on the GPU; masked lanes add exact zeros
        _add_rows(dk_ref, ids, dk * scale, interpret)
        _add_rows(dv_ref, ids, dv, interpret)
        return carry_through  # a loop value: Triton cannot yield a literal

    lax.fori_loop(0, (segmax_ref[0] + bs - 1) // bs, chunk_body, jnp.int32(0))


def _add_rows(ref, ids, val, interpret: bool):
    """``ref[ids[r], :] += val[r]`` for every ``r`` (duplicates accumulate): float32 atomics on
    the GPU; a row-by-row read-modify-write in interpret mode (programs run one at a time there,
    and Pallas' interpreter cannot discharge a gather-indexed atomic)."""
    if not interpret:
        atomic_add(ref, (ids, slice(None)), val)
        return

    def body(r, _):
        row = ids[r]
        ref[pl.ds(row, 1), :] = ref[pl.ds(row, 1), :] + lax.dynamic_slice_in_dim(val, r, 1, 0)
        return 0

    lax.fori_loop(0, ids.shape[0], body, 0)


def _col_dkv(q, k, v, q_pos, k_pos, index, do, lse, delta, dk_h, dv_h, *, sm_scale, bs, params, interpret,
             col_segment=None):
    """Pass 3: adds the vertical columns' dK/dV into the per-head ``dk_h, dv_h [B, Sk, H, D]``."""
    B, sq, H, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g, nqb = H // hkv, sq // bs
    bidx, cnt, cidx = prepare_index(index, sk, bs, bs)
    mbp = bidx.shape[-1]
    seg = col_segment or col_segment_blocks(nqb, H * B)
    nseg = -(-nqb // seg)
    ncol = cnt[..., 2]
    segmax = jnp.pad(ncol, [(0, 0), (0, 0), (0, nseg * seg - nqb)]).reshape(B, H, nseg, seg).max(-1)
    per_head = lambda n: pl.BlockSpec((None, None, n), lambda s, h, b: (b, h, 0))  # noqa: E731
    full_q = pl.BlockSpec((None, sq, None, d), lambda s, h, b: (b, 0, h, 0))
    full_kv = pl.BlockSpec((None, sk, None, d), lambda s, h, b: (b, 0, h // g, 0))
    full_out = pl.BlockSpec((None, sk, None, d), lambda s, h, b: (b, 0, h, 0))
    return pl.pallas_call(
        functools.partial(_dkv_col_kernel, qk_scale=sm_scale * LOG2E, scale=sm_scale, bs=bs, seg=seg, nqb=nqb,
                          mbp=mbp, interpret=interpret),
        grid=(nseg, H, B),
        in_specs=[pl.BlockSpec((sq,), lambda s, h, b: (0,)), pl.BlockSpec((sk,), lambda s, h, b: (0,)),
                  per_head(cidx.shape[-1]), pl.BlockSpec((None, None, 1), lambda s, h, b: (b, h, s)),
                  per_head(nqb * mbp), per_head(nqb), per_head(nqb),
                  full_q, full_kv, full_kv, full_q, per_head(sq), per_head(sq), full_out, full_out],
        out_specs=[full_out, full_out],
        out_shape=[jax.ShapeDtypeStruct((B, sk, H, d), jnp.float32)] * 2,
        input_output_aliases={13: 0, 14: 1},
        compiler_params=params,
        interpret=interpret,
        name="block_sparse_bwd_dkv_cols",
    )(q_pos, k_pos, cidx, segmax, bidx.reshape(B, H, nqb * mbp), cnt[..., 1], ncol, q, k, v, do, lse, delta,
      dk_h, dv_h)


def _dkv_kernel(qpos_ref, kpos_ref, tidx_ref, tcnt_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
                dk_ref, dv_ref, *, qk_scale, scale, bs):
    k = k_ref[...]
    v = v_ref[...]
    kp = kpos_ref[...]

    def tile(rows, carry, masked=False):
        q, do, qp, lse2, delta = _query_rows(rows, q_ref, do_ref, qpos_ref, lse_ref, delta_ref)
        ok = (kp[:, None] <= qp[None, :]) if masked else None
        return _dkv_tile(carry, k, v, ok, qk_scale, q, do, lse2, delta)

    zeros = jnp.zeros(k.shape, jnp.float32)
    n_free, n_all = tcnt_ref[0], tcnt_ref[1]
    carry = _for_blocks(tidx_ref, 0, n_free, bs, tile, (zeros, zeros))
    dk, dv = _for_blocks(tidx_ref, n_free, n_all, bs, functools.partial(tile, masked=True), carry)
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _bwd_inputs(q, q_pos, k_pos, do, lse, delta):
    return (q_pos.astype(jnp.int32), k_pos.astype(jnp.int32), do.astype(q.dtype), lse.astype(jnp.float32),
            delta.astype(jnp.float32))


@functools.partial(jax.jit, static_argnames=_STATIC)
def dq_pass(q, k, v, q_pos, k_pos, index: StepIndex, do, lse, delta, *, sm_scale: float, block_size: int,
            col_chunk: int = 64, num_warps: int = 4, num_stages: int = 2, interpret: bool = False):
    """Backward pass 1: ``dq f32 [B, Sq, Hq, D]``, query-stationary over the forward's schedule."""
    B, sq, H, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    bs = block_size
    q_pos, k_pos, do, lse, delta = _bwd_inputs(q, q_pos, k_pos, do, lse, delta)
    bidx, cnt, cidx = prepare_index(index, sk, bs, col_chunk)
    sp = _query_specs(H, H // hkv, sk, d, bs, bidx.shape[-1], cidx.shape[-1])
    return pl.pallas_call(
        functools.partial(_dq_kernel, qk_scale=sm_scale * LOG2E, scale=sm_scale, bs=bs, cc=col_chunk),
        grid=(sq // bs, H, B),
        in_specs=[sp["qpos"], sp["kpos"], sp["bidx"], sp["cnt"], sp["cidx"],
                  sp["q"], sp["kv"], sp["kv"], sp["q"], sp["row"], sp["row"]],
        out_specs=sp["q"],
        out_shape=jax.ShapeDtypeStruct((B, sq, H, d), jnp.float32),
        compiler_params=triton_compiler_params(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="block_sparse_bwd_dq",
    )(q_pos, k_pos, bidx, cnt, cidx, q, k, v, do, lse, delta)


@functools.partial(jax.jit, static_argnames=_STATIC)
def dkv_block_pass(q, k, v, q_pos, k_pos, index: StepIndex, do, lse, delta, *, sm_scale: float,
                   block_size: int, col_chunk: int = 64, num_warps: int = 4, num_stages: int = 2,
                   interpret: bool = False):
    """Backward pass 2: per-query-head ``(dk_h, dv_h) f32 [B, Sk, Hq, D]`` of the active blocks,
    one program per (KV block, query head, batch) over :func:`transpose_block_index`."""
    del col_chunk
    B, sq, H, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g, bs = H // hkv, block_size
    q_pos, k_pos, do, lse, delta = _bwd_inputs(q, q_pos, k_pos, do, lse, delta)
    tidx, tcnt = transpose_block_index(index, sk, bs)
    mtp = tidx.shape[-1]
    kv_blk = pl.BlockSpec((None, bs, None, d), lambda j, h, b: (b, j, h // g, 0))
    head_out = pl.BlockSpec((None, bs, None, d), lambda j, h, b: (b, j, h, 0))
    full_q = pl.BlockSpec((None, sq, None, d), lambda j, h, b: (b, 0, h, 0))
    full_row = pl.BlockSpec((None, None, sq), lambda j, h, b: (b, h, 0))
    return pl.pallas_call(
        functools.partial(_dkv_kernel, qk_scale=sm_scale * LOG2E, scale=sm_scale, bs=bs),
        grid=(sk // bs, H, B),
        in_specs=[pl.BlockSpec((sq,), lambda j, h, b: (0,)), pl.BlockSpec((bs,), lambda j, h, b: (j,)),
                  pl.BlockSpec((None, None, None, mtp), lambda j, h, b: (b, h, j, 0)),
                  pl.BlockSpec((None, None, None, 2), lambda j, h, b: (b, h, j, 0)),
                  full_q, kv_blk, kv_blk, full_q, full_row, full_row],
        out_specs=[head_out, head_out],
        out_shape=[jax.ShapeDtypeStruct((B, sk, H, d), jnp.float32)] * 2,
        compiler_params=triton_compiler_params(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="block_sparse_bwd_dkv",
    )(q_pos, k_pos, tidx, tcnt, q, k, v, do, lse, delta)


@functools.partial(jax.jit, static_argnames=_STATIC + ("col_segment",))
def dkv_col_pass(q, k, v, q_pos, k_pos, index: StepIndex, do, lse, delta, dk_h, dv_h, *, sm_scale: float,
                 block_size: int, col_chunk: int = 64, num_warps: int = 4, num_stages: int = 2,
                 interpret: bool = False, col_segment: int | None = None):
    """Backward pass 3: adds the vertical columns' dK/dV into the per-head ``dk_h, dv_h``.
    ``col_segment``: query blocks per program (default :func:`col_segment_blocks`; a tuning knob)."""
    del col_chunk
    q_pos, k_pos, do, lse, delta = _bwd_inputs(q, q_pos, k_pos, do, lse, delta)
    return _col_dkv(q, k, v, q_pos, k_pos, index, do, lse, delta, dk_h, dv_h, sm_scale=sm_scale,
                    bs=block_size, params=triton_compiler_params(num_warps=num_warps, num_stages=num_stages),
                    interpret=interpret, col_segment=col_segment)


@functools.partial(jax.jit, static_argnames=_STATIC)
def pallas_bwd(q, k, v, q_pos, k_pos, index: StepIndex, do, lse, delta, **options):
    """Backward kernels (module docstring: three passes); returns f32 ``(dq, dk, dv)``.
    ``options``: ``sm_scale``, ``block_size`` and the tuning options of :func:`pallas_fwd`."""
    B, sk, hkv, d = k.shape
    g = q.shape[2] // hkv
    args = (q, k, v, q_pos, k_pos, index, do, lse, delta)
    dq = dq_pass(*args, **options)
    dk_h, dv_h = dkv_col_pass(*args, *dkv_block_pass(*args, **options), **options)
    dk = dk_h.reshape(B, sk, hkv, g, d).sum(axis=3)
    dv = dv_h.reshape(B, sk, hkv, g, d).sum(axis=3)
    return dq, dk, dv
