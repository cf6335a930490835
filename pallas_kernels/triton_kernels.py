"""Pallas (Triton backend) kernels for vertical-slash block-sparse flash attention.

One program per (64-query block ``i``, query head ``h``, batch ``b``); query head ``h`` reads KV
head ``h // g`` in place (GQA without repeating K/V). MTraining Algorithm 1 (paper Sec. 3):

* forward: loop over the ``block_count`` active KV blocks (contiguous ``bs``-row tiles; the
  token-level causal mask by global position is applied only where ``block_causal`` is set),
  then over the vertical columns in chunks of ``col_chunk`` gathered rows (``k_ref[ids, :]``),
  masked by count and by position. Online softmax in float32 with ``exp2`` and a
  ``log2(e)``-prescaled scale (FlashAttention-2, Dao 2023, Alg. 1); writes ``out`` (f32) and the
  natural-log ``lse`` so ring steps can be merged. Rows with no allowed key: out 0, lse -inf.
* backward (one fused pass, same query-stationary schedule): recompute ``P = exp2(S*c - lse2)``,
  accumulate ``dQ`` in registers, and add each tile's ``dK = dS^T Q`` / ``dV = P^T dO`` into
  float32 dK/dV with ``atomic_add`` (GQA heads of a group add into the same KV head).
  ``delta = rowsum(dO * O)`` is an input (computed once by ``api.attention_delta``).

In interpret mode (CPU tests) the scatter of gathered column rows falls back to a row-by-row
read-modify-write (Pallas' interpreter cannot discharge a masked/gather atomic).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._compat import atomic_add, dot, triton_compiler_params
from pallas_kernels.index_format import StepIndex

LOG2E = math.log2(math.e)
DKV_MODES = ("kv_stationary", "atomic_cols", "atomic")
LN2 = math.log(2.0)


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def prepare_index(index: StepIndex, sk: int, bs: int, col_chunk: int):
    """Kernel-ready index arrays: pads clipped in range, slots padded to a power of two / chunk.

    Returns ``(block_idx [B,H,nQB,MBp], block_causal [B,H,nQB,MBp], counts [B,H,nQB,2],
    col_idx [B,H,nQB,MCp])`` int32 with ``counts[..., 0] = block_count``, ``[..., 1] = col_count``.
    """
    mb, mc = index.max_blocks, index.max_cols
    mbp = _pow2(mb)
    mcp = max(col_chunk, _pow2(-(-mc // col_chunk) * col_chunk))
    bvalid = jnp.arange(mb) < index.block_count[..., None]
    bidx = jnp.clip(jnp.where(bvalid, index.block_idx, 0), 0, sk // bs - 1).astype(jnp.int32)
    bcaus = jnp.where(bvalid, index.block_causal, 1).astype(jnp.int32)
    cvalid = jnp.arange(mc) < index.col_count[..., None]
    cidx = jnp.clip(jnp.where(cvalid, index.col_idx, 0), 0, sk - 1).astype(jnp.int32)
    pad = lambda x, n: jnp.pad(x, [(0, 0)] * 3 + [(0, n - x.shape[-1])])  # noqa: E731
    counts = jnp.stack([index.block_count, index.col_count], axis=-1).astype(jnp.int32)
    return pad(bidx, mbp), pad(bcaus, mbp), counts, pad(cidx, mcp)


def _tile_scores(q, k, ok, qk_scale):
    """``[bs, n]`` log2-domain scores, ``-inf`` where not ``ok``."""
    s = dot(q, k, trans_b=True) * qk_scale
    return jnp.where(ok, s, -jnp.inf)


def _softmax_update(carry, s, v):
    acc, m, l = carry
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m - m_safe)
    p = jnp.exp2(s - m_safe[:, None])
    l = l * alpha + jnp.sum(p, axis=1)
    acc = acc * alpha[:, None] + dot(p.astype(v.dtype), v)
    return acc, m_new, l


def _load_block(j, k_ref, v_ref, kpos_ref, bidx_ref, bcaus_ref, qp, bs):
    """K/V rows of the ``j``-th active KV block and its mask (causal only where flagged)."""
    start = pl.multiple_of(bidx_ref[j] * bs, bs)
    kp = kpos_ref[pl.ds(start, bs)]
    ok = (kp[None, :] <= qp[:, None]) | (bcaus_ref[j] == 0)
    return start, k_ref[pl.ds(start, bs), :], v_ref[pl.ds(start, bs), :], ok


def _load_cols(c, k_ref, v_ref, kpos_ref, cidx_ref, ncols, qp, cc):
    """K/V rows of the ``c``-th chunk of ``cc`` vertical columns (gathered) and its mask."""
    off = pl.multiple_of(c * cc, cc)
    ids = cidx_ref[pl.ds(off, cc)]
    kp = kpos_ref[ids]
    ok = ((off + jnp.arange(cc, dtype=jnp.int32)) < ncols)[None, :] & (kp[None, :] <= qp[:, None])
    return ids, k_ref[ids, :], v_ref[ids, :], ok


def _load_query_rows(start, n, q_ref, do_ref, qpos_ref, lse_ref, delta_ref):
    """``n`` query rows from ``start`` for a KV-stationary backward: q, dO, positions, log2-domain
    lse (0 where the row is empty) and delta."""
    lse = lse_ref[pl.ds(start, n)]
    lse2 = jnp.where(lse == -jnp.inf, 0.0, lse * LOG2E)
    return (q_ref[pl.ds(start, n), :], do_ref[pl.ds(start, n), :], qpos_ref[pl.ds(start, n)], lse2,
            delta_ref[pl.ds(start, n)])


def _fwd_kernel(qpos_ref, kpos_ref, bidx_ref, bcaus_ref, cnt_ref, cidx_ref, q_ref, k_ref, v_ref,
                o_ref, lse_ref, *, qk_scale, bs, cc):
    q = q_ref[...]
    qp = qpos_ref[...]
    d = q.shape[-1]
    carry = (jnp.zeros((bs, d), jnp.float32), jnp.full((bs,), -jnp.inf, jnp.float32),
             jnp.zeros((bs,), jnp.float32))

    def block_body(j, carry):
        _, k, v, ok = _load_block(j, k_ref, v_ref, kpos_ref, bidx_ref, bcaus_ref, qp, bs)
        return _softmax_update(carry, _tile_scores(q, k, ok, qk_scale), v)

    carry = lax.fori_loop(0, cnt_ref[0], block_body, carry)
    ncols = cnt_ref[1]

    def col_body(c, carry):
        _, k, v, ok = _load_cols(c, k_ref, v_ref, kpos_ref, cidx_ref, ncols, qp, cc)
        return _softmax_update(carry, _tile_scores(q, k, ok, qk_scale), v)

    acc, m, l = lax.fori_loop(0, (ncols + cc - 1) // cc, col_body, carry)
    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, -jnp.inf, (m + jnp.log2(l_safe)) * LN2)


def _specs(B, H, g, sq, sk, d, bs, mbp, mcp):
    qspec = pl.BlockSpec((None, bs, None, d), lambda i, h, b: (b, i, h, 0))
    kvspec = pl.BlockSpec((None, sk, None, d), lambda i, h, b: (b, 0, h // g, 0))
    return dict(
        qpos=pl.BlockSpec((bs,), lambda i, h, b: (i,)),
        kpos=pl.BlockSpec((sk,), lambda i, h, b: (0,)),
        bidx=pl.BlockSpec((None, None, None, mbp), lambda i, h, b: (b, h, i, 0)),
        cnt=pl.BlockSpec((None, None, None, 2), lambda i, h, b: (b, h, i, 0)),
        cidx=pl.BlockSpec((None, None, None, mcp), lambda i, h, b: (b, h, i, 0)),
        q=qspec, kv=kvspec,
        row=pl.BlockSpec((None, None, bs), lambda i, h, b: (b, h, i)),
    )


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_size", "col_chunk", "num_warps",
                                             "num_stages", "interpret"))
def pallas_fwd(q, k, v, q_pos, k_pos, index: StepIndex, *, sm_scale: float, block_size: int,
               col_chunk: int = 64, num_warps: int = 4, num_stages: int = 2, interpret: bool = False):
    """Forward kernel; shapes as in :mod:`pallas_kernels.api`. Returns ``(out f32, lse f32)``."""
    B, sq, H, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    bs = block_size
    bidx, bcaus, cnt, cidx = prepare_index(index, sk, bs, col_chunk)
    sp = _specs(B, H, H // hkv, sq, sk, d, bs, bidx.shape[-1], cidx.shape[-1])
    kernel = functools.partial(_fwd_kernel, qk_scale=sm_scale * LOG2E, bs=bs, cc=col_chunk)
    out, lse = pl.pallas_call(
        kernel,
        grid=(sq // bs, H, B),
        in_specs=[sp["qpos"], sp["kpos"], sp["bidx"], sp["bidx"], sp["cnt"], sp["cidx"],
                  sp["q"], sp["kv"], sp["kv"]],
        out_specs=[sp["q"], sp["row"]],
        out_shape=[jax.ShapeDtypeStruct((B, sq, H, d), jnp.float32),
                   jax.ShapeDtypeStruct((B, H, sq), jnp.float32)],
        compiler_params=triton_compiler_params(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="block_sparse_fwd",
    )(q_pos.astype(jnp.int32), k_pos.astype(jnp.int32), bidx, bcaus, cnt, cidx, q, k, v)
    return out, lse


def _add_rows(ref, ids, val, interpret: bool):
    """``ref[ids[r], :] += val[r]`` for every r (duplicates accumulate)."""
    if not interpret:
        atomic_add(ref, (ids, slice(None)), val)
        return

    def body(r, _):
        row = ids[r]  # interpret mode: plain jnp values
        ref[pl.ds(row, 1), :] = ref[pl.ds(row, 1), :] + lax.dynamic_slice_in_dim(val, r, 1, 0)
        return 0

    lax.fori_loop(0, ids.shape[0], body, 0)


def _add_tile(ref, start, n, val, interpret: bool):
    if not interpret:
        atomic_add(ref, (pl.ds(start, n), slice(None)), val)
    else:
        ref[pl.ds(start, n), :] = ref[pl.ds(start, n), :] + val


def _dq_kernel(qpos_ref, kpos_ref, bidx_ref, bcaus_ref, cnt_ref, cidx_ref, q_ref, k_ref, v_ref,
               do_ref, lse_ref, delta_ref, dk_in, dv_in, dq_ref, dk_ref, dv_ref, *, qk_scale,
               scale, bs, cc, interpret, block_dkv, col_dkv):
    del dk_in, dv_in  # aliased to dk_ref / dv_ref (zero-initialised accumulators)
    q = q_ref[...]
    do = do_ref[...]
    qp = qpos_ref[...]
    lse = lse_ref[...]
    lse2 = jnp.where(lse == -jnp.inf, 0.0, lse * LOG2E)
    delta = delta_ref[...]
    d = q.shape[-1]

    def tile(dq, k, v, ok, with_dkv=True):
        s = _tile_scores(q, k, ok, qk_scale)
        p = jnp.exp2(s - lse2[:, None])  # exact 0 where masked
        dp = dot(do, v, trans_b=True)
        ds = p * (dp - delta[:, None])
        dq = dq + dot(ds.astype(k.dtype), k)
        if not with_dkv:
            return dq, None, None
        dv_t = dot(p.astype(do.dtype), do, trans_a=True)
        dk_t = dot(ds.astype(q.dtype), q, trans_a=True) * scale
        return dq, dk_t, dv_t

    def block_body(j, dq):
        start, k, v, ok = _load_block(j, k_ref, v_ref, kpos_ref, bidx_ref, bcaus_ref, qp, bs)
        dq, dk_t, dv_t = tile(dq, k, v, ok, block_dkv)
        if block_dkv:
            _add_tile(dk_ref, start, bs, dk_t, interpret)
            _add_tile(dv_ref, start, bs, dv_t, interpret)
        return dq

    dq = lax.fori_loop(0, cnt_ref[0], block_body, jnp.zeros((bs, d), jnp.float32))
    ncols = cnt_ref[1]

    def col_body(c, dq):
        ids, k, v, ok = _load_cols(c, k_ref, v_ref, kpos_ref, cidx_ref, ncols, qp, cc)
        dq, dk_t, dv_t = tile(dq, k, v, ok, col_dkv)
        if col_dkv:
            _add_rows(dk_ref, ids, dk_t, interpret)
            _add_rows(dv_ref, ids, dv_t, interpret)
        return dq

    dq = lax.fori_loop(0, (ncols + cc - 1) // cc, col_body, dq)
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def transpose_block_index(index: StepIndex, sk: int, bs: int):
    """KV-stationary schedule: for every (b, h, KV block), the query blocks that list it.

    Returns ``(tidx int32 [B, H, nKB, MTp], tcnt int32 [B, H, nKB, 1])`` with entries
    ``2 * query_block + block_causal`` sorted by query block (``MTp`` = ``nQB`` padded to a
    power of two). Built with one scatter of the ``B*H*nQB*MB`` entries into a dense
    ``[B, H, nKB, nQB]`` int8 map, a cumsum for the list positions and one scatter into the lists.
    """
    B, H, nqb, mb = index.block_idx.shape
    nkb = sk // bs
    mtp = _pow2(nqb)
    valid = jnp.arange(mb) < index.block_count[..., None]
    kb = jnp.where(valid, jnp.clip(index.block_idx, 0, nkb - 1), nkb)  # invalid -> spill row
    b_ix = jnp.arange(B)[:, None, None, None]
    h_ix = jnp.arange(H)[None, :, None, None]
    q_ix = jnp.broadcast_to(jnp.arange(nqb, dtype=jnp.int32)[None, None, :, None], kb.shape)
    act = jnp.zeros((B, H, nkb + 1, nqb), jnp.int8).at[b_ix, h_ix, kb, q_ix].set(1)[:, :, :nkb]
    pos_all = jnp.cumsum(act, axis=-1, dtype=jnp.int32) - 1  # [B, H, nKB, nQB]
    tcnt = act.sum(-1, dtype=jnp.int32)[..., None]
    pos = pos_all[b_ix, h_ix, jnp.minimum(kb, nkb - 1), q_ix]
    pos = jnp.where(valid, pos, mtp)  # invalid -> spill column
    entry = 2 * q_ix + (index.block_causal != 0).astype(jnp.int32)
    tidx = jnp.zeros((B, H, nkb + 1, mtp + 1), jnp.int32).at[b_ix, h_ix, kb, pos].set(entry)
    return tidx[:, :, :nkb, :mtp], tcnt


def transpose_col_index(index: StepIndex, sk: int, chunk: int):
    """Column-stationary schedule for the vertical columns of each (b, h).

    The distinct columns of a head, sorted, are cut into chunks of ``chunk``. Returns
    ``uniq int32 [B, H, U]`` (distinct columns, 0-padded), ``nuniq int32 [B, H, 1]``, and per chunk
    the query blocks listing any of its columns: ``lq, lw0, lw1 int32 [B, H, nCh, nQBp]`` (query
    block and the two 32-bit words of its membership mask over the chunk) with ``lcnt [B, H, nCh, 1]``.
    ``U = min(Sk, nQB * MC)`` rounded up to ``chunk``. Memory is ``O(B H nCh nQB)`` int32 (dense
    membership words, then one scatter of the ``B*H*nQB*MC`` entries into each list).
    """
    B, H, nqb, mc = index.col_idx.shape
    nqbp = _pow2(nqb)
    ucap = -(-min(sk, nqb * mc) // chunk) * chunk
    nch = ucap // chunk
    valid = jnp.arange(mc) < index.col_count[..., None]
    cols = jnp.where(valid, jnp.clip(index.col_idx, 0, sk - 1), sk)
    b3, h3 = jnp.arange(B)[:, None, None], jnp.arange(H)[None, :, None]
    b4, h4 = b3[..., None], h3[..., None]
    present = jnp.zeros((B, H, sk + 1), bool).at[b4, h4, cols].set(True)[..., :sk]
    rank = jnp.cumsum(present, axis=-1, dtype=jnp.int32) - 1
    nuniq = present.sum(-1, dtype=jnp.int32)[..., None]
    tok = jnp.broadcast_to(jnp.arange(sk, dtype=jnp.int32), (B, H, sk))
    uniq = jnp.zeros((B, H, ucap + 1), jnp.int32).at[b3, h3, jnp.where(present, rank, ucap)].set(tok)[..., :ucap]
    u = rank[b4, h4, jnp.minimum(cols, sk - 1)]
    ch = jnp.where(valid, u // chunk, nch)
    bit = u % chunk
    one = jnp.int32(1)
    w0 = jnp.where(bit < 32, jnp.left_shift(one, jnp.minimum(bit, 31)), 0).astype(jnp.int32)
    w1 = jnp.where(bit >= 32, jnp.left_shift(one, jnp.maximum(bit - 32, 0)), 0).astype(jnp.int32)
    q4 = jnp.broadcast_to(jnp.arange(nqb, dtype=jnp.int32)[None, None, :, None], cols.shape)
    # distinct columns of one row set distinct bits, so add == bitwise or
    m0 = jnp.zeros((B, H, nch + 1, nqb), jnp.int32).at[b4, h4, ch, q4].add(w0)[:, :, :nch]
    m1 = jnp.zeros((B, H, nch + 1, nqb), jnp.int32).at[b4, h4, ch, q4].add(w1)[:, :, :nch]
    act = (m0 | m1) != 0
    pos = jnp.cumsum(act, axis=-1, dtype=jnp.int32) - 1
    lcnt = act.sum(-1, dtype=jnp.int32)[..., None]
    # one scatter per list from the B*H*nQB*MC entries (entries of one (row, chunk) agree)
    chc = jnp.minimum(ch, nch - 1)
    dst = jnp.where(valid, pos[b4, h4, chc, q4], nqbp)
    at = lambda x: x[b4, h4, chc, q4]  # noqa: E731

    def put(x):
        lists = jnp.zeros((B, H, nch + 1, nqbp + 1), jnp.int32).at[b4, h4, ch, dst].set(x)
        return lists[:, :, :nch, :nqbp]

    return uniq, nuniq, put(q4), put(at(m0)), put(at(m1)), lcnt


def _dkv_col_kernel(qpos_ref, kpos_ref, uniq_ref, nuniq_ref, lq_ref, lw0_ref, lw1_ref, lcnt_ref, q_ref, k_ref,
                    v_ref, do_ref, lse_ref, delta_ref, dk_in, dv_in, dk_ref, dv_ref, *, qk_scale, scale, cc,
                    interpret):
    del dk_in, dv_in  # aliased to dk_ref / dv_ref (the block pass's per-head dK/dV)
    ids = uniq_ref[...]
    n_valid = nuniq_ref[0] - pl.program_id(0) * cc
    k = k_ref[ids, :]
    v = v_ref[ids, :]
    kp = kpos_ref[ids]
    lane = jnp.arange(cc, dtype=jnp.int32)
    d = k.shape[-1]

    def body(j, carry):
        dk, dv = carry
        start = pl.multiple_of(lq_ref[j] * cc, cc)
        w = jnp.where(lane < 32, lw0_ref[j], lw1_ref[j])
        member = jnp.bitwise_and(jnp.right_shift(w, lane % 32), 1) != 0
        q, do, qp, lse2, delta = _load_query_rows(start, cc, q_ref, do_ref, qpos_ref, lse_ref, delta_ref)
        ok = member[:, None] & (kp[:, None] <= qp[None, :])
        st = jnp.where(ok, dot(k, q, trans_b=True) * qk_scale, -jnp.inf)
        pt = jnp.exp2(st - lse2[None, :])
        dv = dv + dot(pt.astype(do.dtype), do)
        dst = pt * (dot(v, do, trans_b=True) - delta[None, :])
        dk = dk + dot(dst.astype(q.dtype), q)
        return dk, dv

    zeros = jnp.zeros((cc, d), jnp.float32)
    dk, dv = lax.fori_loop(0, lcnt_ref[0], body, (zeros, zeros))
    _store_rows_add(dk_ref, ids, dk * scale, lane < n_valid, n_valid, interpret)
    _store_rows_add(dv_ref, ids, dv, lane < n_valid, n_valid, interpret)


def _store_rows_add(ref, ids, val, mask, n_valid, interpret):
    """``ref[ids[r], :] += val[r]`` for the first ``n_valid`` (distinct) rows."""
    if not interpret:
        view = ref.at[ids, :]
        old = plgpu.load(view, mask=mask[:, None], other=0.0)
        plgpu.store(view, old + val, mask=mask[:, None])
        return

    def body(r, _):
        row = ids[r]
        ref[pl.ds(row, 1), :] = ref[pl.ds(row, 1), :] + lax.dynamic_slice_in_dim(val, r, 1, 0)
        return 0

    lax.fori_loop(0, jnp.clip(n_valid, 0, ids.shape[0]), body, 0)


def _col_dkv(q, k, v, q_pos, k_pos, index, do, lse, delta, dk_h, dv_h, *, sm_scale, bs, params, interpret):
    """Pass 3: adds the vertical columns' dK/dV into the per-head ``dk_h, dv_h [B, Sk, H, D]``."""
    B, sq, H, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = H // hkv
    uniq, nuniq, lq, lw0, lw1, lcnt = transpose_col_index(index, sk, bs)
    nch, nqbp = lq.shape[2], lq.shape[3]
    lst = pl.BlockSpec((None, None, None, nqbp), lambda c, h, b: (b, h, c, 0))
    full_q = pl.BlockSpec((None, sq, None, d), lambda c, h, b: (b, 0, h, 0))
    full_kv = pl.BlockSpec((None, sk, None, d), lambda c, h, b: (b, 0, h // g, 0))
    full_row = pl.BlockSpec((None, None, sq), lambda c, h, b: (b, h, 0))
    full_out = pl.BlockSpec((None, sk, None, d), lambda c, h, b: (b, 0, h, 0))
    return pl.pallas_call(
        functools.partial(_dkv_col_kernel, qk_scale=sm_scale * LOG2E, scale=sm_scale, cc=bs,
                          interpret=interpret),
        grid=(nch, H, B),
        in_specs=[pl.BlockSpec((sq,), lambda c, h, b: (0,)), pl.BlockSpec((sk,), lambda c, h, b: (0,)),
                  pl.BlockSpec((None, None, bs), lambda c, h, b: (b, h, c)),
                  pl.BlockSpec((None, None, 1), lambda c, h, b: (b, h, 0)),
                  lst, lst, lst, pl.BlockSpec((None, None, None, 1), lambda c, h, b: (b, h, c, 0)),
                  full_q, full_kv, full_kv, full_q, full_row, full_row, full_out, full_out],
        out_specs=[full_out, full_out],
        out_shape=[jax.ShapeDtypeStruct((B, sk, H, d), jnp.float32)] * 2,
        input_output_aliases={14: 0, 15: 1},
        compiler_params=params,
        interpret=interpret,
        name="block_sparse_bwd_dkv_cols",
    )(q_pos, k_pos, uniq, nuniq, lq, lw0, lw1, lcnt, q, k, v, do, lse, delta, dk_h, dv_h)


def _dkv_kernel(qpos_ref, kpos_ref, tidx_ref, tcnt_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
                dk_ref, dv_ref, *, qk_scale, scale, bs):
    k = k_ref[...]
    v = v_ref[...]
    kp = kpos_ref[...]
    d = k.shape[-1]

    def body(j, carry):
        dk, dv = carry
        e = tidx_ref[j]
        start = pl.multiple_of((e // 2) * bs, bs)
        q, do, qp, lse2, delta = _load_query_rows(start, bs, q_ref, do_ref, qpos_ref, lse_ref, delta_ref)
        ok = (kp[:, None] <= qp[None, :]) | (e % 2 == 0)
        st = jnp.where(ok, dot(k, q, trans_b=True) * qk_scale, -jnp.inf)  # [kv, q]
        pt = jnp.exp2(st - lse2[None, :])
        dv = dv + dot(pt.astype(do.dtype), do)
        dpt = dot(v, do, trans_b=True)
        dst = pt * (dpt - delta[None, :])
        dk = dk + dot(dst.astype(q.dtype), q)
        return dk, dv

    zeros = jnp.zeros((bs, d), jnp.float32)
    dk, dv = lax.fori_loop(0, tcnt_ref[0], body, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_size", "col_chunk", "num_warps",
                                             "num_stages", "interpret", "dkv"))
def pallas_bwd(q, k, v, q_pos, k_pos, index: StepIndex, do, lse, delta, *, sm_scale: float,
               block_size: int, col_chunk: int = 64, num_warps: int = 4, num_stages: int = 2,
               interpret: bool = False, dkv: str = "kv_stationary"):
    """Backward kernels; returns f32 ``(dq, dk, dv)``.

    ``dkv="kv_stationary"`` (default): pass 1 (query-stationary) computes dQ; pass 2 (one program
    per (KV block, query head, batch)) walks the transposed block schedule and writes per-query-head
    dK/dV; pass 3 (one program per chunk of 64 distinct vertical columns of a head) walks the query
    blocks that list any of them and adds into those rows; heads are summed per GQA group last.
    ``dkv="atomic_cols"``: as above but the columns' dK/dV are added with atomics in pass 1
    instead of a column-stationary pass 3. ``dkv="atomic"``: one fused pass, every tile's dK/dV
    added with float32 atomics. See benchmarks/KERNEL_NOTES.md for the measurements.
    """
    if dkv not in DKV_MODES:
        raise ValueError(f"dkv={dkv!r}; expected one of {DKV_MODES}")
    B, sq, H, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g, bs = H // hkv, block_size
    bidx, bcaus, cnt, cidx = prepare_index(index, sk, bs, col_chunk)
    sp = _specs(B, H, g, sq, sk, d, bs, bidx.shape[-1], cidx.shape[-1])
    params = triton_compiler_params(num_warps=num_warps, num_stages=num_stages)
    kernel = functools.partial(_dq_kernel, qk_scale=sm_scale * LOG2E, scale=sm_scale, bs=bs,
                               cc=col_chunk, interpret=interpret, block_dkv=(dkv == "atomic"),
                               col_dkv=(dkv != "kv_stationary"))
    zeros = jnp.zeros((B, sk, hkv, d), jnp.float32)
    do = do.astype(q.dtype)
    lse = lse.astype(jnp.float32)
    delta = delta.astype(jnp.float32)
    q_pos, k_pos = q_pos.astype(jnp.int32), k_pos.astype(jnp.int32)
    dq, dk, dv = pl.pallas_call(
        kernel,
        grid=(sq // bs, H, B),
        in_specs=[sp["qpos"], sp["kpos"], sp["bidx"], sp["bidx"], sp["cnt"], sp["cidx"],
                  sp["q"], sp["kv"], sp["kv"], sp["q"], sp["row"], sp["row"], sp["kv"], sp["kv"]],
        out_specs=[sp["q"], sp["kv"], sp["kv"]],
        out_shape=[jax.ShapeDtypeStruct((B, sq, H, d), jnp.float32),
                   jax.ShapeDtypeStruct((B, sk, hkv, d), jnp.float32),
                   jax.ShapeDtypeStruct((B, sk, hkv, d), jnp.float32)],
        input_output_aliases={12: 1, 13: 2},
        compiler_params=params,
        interpret=interpret,
        name="block_sparse_bwd_dq",
    )(q_pos, k_pos, bidx, bcaus, cnt, cidx, q, k, v, do, lse, delta, zeros, zeros)
    if dkv == "atomic":
        return dq, dk, dv

    tidx, tcnt = transpose_block_index(index, sk, bs)
    mtp = tidx.shape[-1]
    kv_blk = pl.BlockSpec((None, bs, None, d), lambda j, h, b: (b, j, h // g, 0))
    head_out = pl.BlockSpec((None, bs, None, d), lambda j, h, b: (b, j, h, 0))
    full_q = pl.BlockSpec((None, sq, None, d), lambda j, h, b: (b, 0, h, 0))
    full_row = pl.BlockSpec((None, None, sq), lambda j, h, b: (b, h, 0))
    dk_h, dv_h = pl.pallas_call(
        functools.partial(_dkv_kernel, qk_scale=sm_scale * LOG2E, scale=sm_scale, bs=bs),
        grid=(sk // bs, H, B),
        in_specs=[pl.BlockSpec((sq,), lambda j, h, b: (0,)), pl.BlockSpec((bs,), lambda j, h, b: (j,)),
                  pl.BlockSpec((None, None, None, mtp), lambda j, h, b: (b, h, j, 0)),
                  pl.BlockSpec((None, None, None, 1), lambda j, h, b: (b, h, j, 0)),
                  full_q, kv_blk, kv_blk, full_q, full_row, full_row],
        out_specs=[head_out, head_out],
        out_shape=[jax.ShapeDtypeStruct((B, sk, H, d), jnp.float32)] * 2,
        compiler_params=params,
        interpret=interpret,
        name="block_sparse_bwd_dkv",
    )(q_pos, k_pos, tidx, tcnt, q, k, v, do, lse, delta)
    if dkv == "kv_stationary":
        dk_h, dv_h = _col_dkv(q, k, v, q_pos, k_pos, index, do, lse, delta, dk_h, dv_h, sm_scale=sm_scale,
                              bs=bs, params=params, interpret=interpret)
    dk = dk + dk_h.reshape(B, sk, hkv, g, d).sum(axis=3)
    dv = dv + dv_h.reshape(B, sk, hkv, g, d).sum(axis=3)
    return dq, dk, dv
