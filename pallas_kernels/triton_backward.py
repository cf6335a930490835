"""Pallas (Triton backend) backward kernels of the vertical-slash block-sparse flash attention.

FlashAttention-2 backward (Dao 2023, Alg. 2) on the per-step index of
:mod:`pallas_kernels.index_format`, given the final ``lse`` and ``delta = rowsum(dO * O)``
(``api.attention_delta``). Three passes (:func:`pallas_bwd`, :mod:`pallas_kernels.three_pass`):

1. :func:`dq_pass`: query-stationary like the forward, adding into ``dq`` in place;
2. :func:`dkv_block_pass`: KV-stationary over :func:`transpose_block_index`, one program per (KV
   block, KV head) over the ``g`` query heads of its group (GQA reduced in registers);
3. :func:`dkv_col_pass`: column-stationary, one program per (64-column chunk of the head's list,
   range of at most ``COL_RANGE_BLOCKS`` query blocks) into a ``[B, Hq, MC, D]`` per-slot buffer,
   scatter-added into the KV heads (:func:`~pallas_kernels.three_pass.add_column_grads`).

Packed documents (``segs = (q_seg [B, Sq], k_seg [B, Sk])``, index narrowed by
:func:`~pallas_kernels.index_format.apply_segments`): masked and column tiles add ``k_seg ==
q_seg``. Runs on CUDA GPUs and in interpret mode on CPU (:func:`_add_slots` is the atomic add's
interpret-mode twin). Design notes: ``docs/kernels.md``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._compat import atomic_add, dot, triton_compiler_params
from pallas_kernels.index_format import StepIndex, column_chunk_rows
from pallas_kernels.triton_common import (LOG2E, STATIC, add_seg_operands, col_rows, for_blocks, outside_blocks,
                                          pair_ok, pow2, query_specs, split_seg_refs)
from pallas_kernels.three_pass import add_column_grads, three_pass_bwd
from pallas_kernels.triton_kernels import prepare_index


def _dq_kernel(qpos_ref, kpos_ref, bidx_ref, cnt_ref, cidx_ref, q_ref, k_ref, v_ref, do_ref, lse_ref,
               delta_ref, *refs, qk_scale, scale, bs, cc, accumulate: bool, segs: bool = False):
    seg_refs, refs = split_seg_refs(refs, segs)
    dq_prev_ref, dq_ref = refs if accumulate else (None, refs[0])  # aliased: read before writing
    q = q_ref[...]
    do = do_ref[...]
    qp = qpos_ref[...]
    seg = None if seg_refs is None else (seg_refs[1], seg_refs[0][...])
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
        ok = pair_ok(kpos_ref, rows, qp, seg)
        return tile(rows, dq, ok if valid is None else ok & valid[None, :])

    n_free, n_blk, n_col = cnt_ref[0], cnt_ref[1], cnt_ref[2]
    block_at = lambda j: bidx_ref[j]  # noqa: E731
    dq = jnp.zeros(q.shape, jnp.float32)
    dq = for_blocks(block_at, 0, n_free, bs, tile, dq)
    dq = for_blocks(block_at, n_free, n_blk, bs, masked, dq)

    def col_body(c, dq):
        ids, valid = col_rows(cidx_ref, c, n_col, cc)
        return masked(ids, dq, valid & outside_blocks(ids, bidx_ref[...], n_blk, bs))

    dq = lax.fori_loop(cnt_ref[3] // cc, (n_col + cc - 1) // cc, col_body, dq) * scale  # from column_start
    if accumulate:
        dq = dq + dq_prev_ref[...]
    dq_ref[...] = dq.astype(dq_ref.dtype)


def transpose_block_index(index: StepIndex, sk: int, bs: int):
    """KV-stationary schedule: for every (b, h, KV block), the query blocks that list it.

    Returns ``(tidx int32 [B, H, nKB, MTp], tcnt int32 [B, H, nKB, 2])``: each list holds first
    the ``tcnt[..., 0]`` query blocks whose tile needs no mask, then the masked ones up to
    ``tcnt[..., 1]``, each group sorted by query block (``MTp`` = ``nQB`` padded to a power of
    two).
    """
    B, H, nqb, mb = index.block_idx.shape
    nkb = sk // bs
    mtp = pow2(nqb)
    valid = jnp.arange(mb) < index.block_count[..., None]
    # a row's valid blocks are distinct (the StepIndex contract) and invalid slots go to distinct
    # out-of-range rows (dropped): both scatters below have unique indices, so XLA needs no atomics
    # and does not serialise them under --xla_gpu_deterministic_ops
    kb = jnp.where(valid, jnp.clip(index.block_idx, 0, nkb - 1), nkb + jnp.arange(mb, dtype=jnp.int32))
    b_ix = jnp.arange(B)[:, None, None, None]
    h_ix = jnp.arange(H)[None, :, None, None]
    q_ix = jnp.broadcast_to(jnp.arange(nqb, dtype=jnp.int32)[None, None, :, None], kb.shape)
    masked = index.block_causal != 0
    code = (1 + masked).astype(jnp.int8)
    tiles = jnp.zeros((B, H, nkb, nqb), jnp.int8).at[b_ix, h_ix, kb, q_ix].set(code, mode="drop",
                                                                              unique_indices=True)
    free_map, masked_map = tiles == 1, tiles == 2
    pos_free = jnp.cumsum(free_map, axis=-1, dtype=jnp.int32) - 1  # [B, H, nKB, nQB]
    pos_masked = jnp.cumsum(masked_map, axis=-1, dtype=jnp.int32) - 1
    n_free = pos_free[..., -1] + 1
    tcnt = jnp.stack([n_free, n_free + pos_masked[..., -1] + 1], axis=-1)
    kbc = jnp.minimum(kb, nkb - 1)
    pos = jnp.where(masked, n_free[b_ix, h_ix, kbc] + pos_masked[b_ix, h_ix, kbc, q_ix],
                    pos_free[b_ix, h_ix, kbc, q_ix])
    pos = jnp.where(valid, pos, mtp + q_ix)  # invalid: out of range, distinct (kb is too)
    tidx = jnp.zeros((B, H, nkb, mtp), jnp.int32).at[b_ix, h_ix, kb, pos].set(q_ix, mode="drop", unique_indices=True)
    return tidx, tcnt


COL_RANGE_BLOCKS = 128


def col_row_splits(nqb: int, range_blocks: int = COL_RANGE_BLOCKS) -> int:
    """Query-block ranges of the column pass: ``ceil(nQB / range_blocks)``. A column chunk's program
    walks at most ``range_blocks`` query blocks, so the chunks every row reaches (the attention
    sink's) are not one long serial tail; one range needs no atomics."""
    return max(1, -(-nqb // max(1, range_blocks)))


def _query_rows(rows, q_ref, do_ref, qpos_ref, lse_ref, delta_ref, head=None):
    """Query rows ``rows`` (a slice or gathered ids) for a KV-stationary backward: q, dO,
    positions, log2-domain lse (0 where the row is empty) and delta. ``head``: the query head
    within a group block (refs ``q/do [Sq, g, D]``, ``lse/delta [g, Sq]``), or ``None`` for refs
    of one head (``[Sq, D]``, ``[Sq]``)."""
    if head is None:
        q, do, lse, delta = q_ref[rows, :], do_ref[rows, :], lse_ref[rows], delta_ref[rows]
    else:
        q, do, lse, delta = q_ref[rows, head, :], do_ref[rows, head, :], lse_ref[head, rows], delta_ref[head, rows]
    lse2 = jnp.where(lse == -jnp.inf, 0.0, lse * LOG2E)
    return q, do, qpos_ref[rows], lse2, delta


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


def _dkv_col_kernel(qpos_ref, kpos_ref, cidx_ref, first_ref, end_ref, bidx_ref, nblk_ref, ncol_ref, cstart_ref, q_ref,
                    k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, qk_scale, scale, bs, nqb, splits, interpret,
                    segs=False):
    """One program per (query head and batch, chunk ``c`` of ``bs`` slots of the head's column
    list, range ``r`` of at most ``ceil(nQB / splits)`` query blocks): gather the chunk's K/V rows
    once, walk the range's query blocks that need the chunk (``[first_ref[c], end_ref[c])``:
    :func:`~pallas_kernels.index_format.column_chunk_rows`) from the LAST one down, and store (one
    range) or atomically add (several) the chunk's dK/dV into its slots ``[c*bs:(c+1)*bs]``. Walking down
    keeps the programs of one range on the same query rows at the same time (they share them in L2); ranges
    go heaviest (last) first. A query block whose column walk starts past the chunk (``cstart_ref``: packed
    documents' ``column_start``, the chunk all other documents' columns) is skipped."""
    seg_refs, refs = split_seg_refs(refs, segs)
    dk_ref, dv_ref = refs[-2:]  # with several ranges, refs[:2] are the zero buffers aliased to them
    c = pl.program_id(1)
    rows_per = -(-nqb // splits)
    r = splits - 1 - pl.program_id(2)
    off = pl.multiple_of(c * bs, bs)
    lane = jnp.arange(bs, dtype=jnp.int32)
    ids = cidx_ref[pl.ds(off, bs)]
    k, v, kp = k_ref[ids, :], v_ref[ids, :], kpos_ref[ids]
    ks = None if seg_refs is None else seg_refs[1][ids]
    lo = jnp.maximum(first_ref[c], r * rows_per)
    hi = jnp.minimum(end_ref[c], (r + 1) * rows_per)
    mbp = bidx_ref.shape[0] // nqb

    def query_block(t, carry):
        i = hi - 1 - t
        n_col = ncol_ref[i]

        def tile(carry):
            blocks = bidx_ref[pl.ds(pl.multiple_of(i * mbp, mbp), mbp)]
            keep = ((off + lane) < n_col) & outside_blocks(ids, blocks, nblk_ref[i], bs)
            rows = pl.ds(pl.multiple_of(i * bs, bs), bs)
            q, do, qp, lse2, delta = _query_rows(rows, q_ref, do_ref, qpos_ref, lse_ref, delta_ref)
            ok = keep[:, None] & (kp[:, None] <= qp[None, :])
            if ks is not None:
                ok = ok & (ks[:, None] == seg_refs[0][rows][None, :])
            return _dkv_tile(carry, k, v, ok, qk_scale, q, do, lse2, delta)

        return lax.cond((off < n_col) & (off + bs > cstart_ref[i]), tile, lambda carry: carry, carry)

    def walk():
        zeros = jnp.zeros(k.shape, jnp.float32)
        dk, dv = lax.fori_loop(0, jnp.maximum(hi - lo, 0), query_block, (zeros, zeros))
        return dk * scale, dv

    slots = pl.ds(off, bs)
    if splits == 1:  # this program owns the chunk's slots (masked lanes hold exact zeros)
        dk, dv = walk()
        dk_ref[slots, :] = dk
        dv_ref[slots, :] = dv
    else:  # the other ranges add into the same zero-initialised slots; empty ranges add nothing

        @pl.when(hi > lo)
        def _():
            dk, dv = walk()
            _add_slots(dk_ref, slots, dk, interpret)
            _add_slots(dv_ref, slots, dv, interpret)


def _add_slots(ref, rows, val, interpret: bool):
    """``ref[rows, :] += val``: float32 atomics on the GPU (several programs add into the same
    rows); a plain read-modify-write in interpret mode, where programs run one at a time."""
    if interpret:
        ref[rows, :] = ref[rows, :] + val
    else:
        atomic_add(ref, (rows, slice(None)), val)


def _col_dkv(q, k, v, q_pos, k_pos, index, do, lse, delta, *, sm_scale, bs, params, interpret, col_splits=None,
             segs=None):
    """Pass 3 kernel: the vertical columns' ``(dk, dv) f32 [B, Hq, MCp, D]`` by slot of the head's
    column list, and that list ``col_idx int32 [B, Hq, MCp]`` (local key ids, padding -> 0 with
    exactly zero gradient)."""
    B, sq, H, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g, nqb = H // hkv, sq // bs
    bidx, cnt, cidx = prepare_index(index, sk, bs, bs, segs)
    mbp, mcp = bidx.shape[-1], cidx.shape[-1]
    nch = mcp // bs
    splits = col_splits or col_row_splits(nqb)
    ncol = cnt[..., 2]
    first, end = column_chunk_rows(ncol, nch, bs, cnt[..., 3] if segs is not None else None)
    bh = lambda i: (i // H, i % H)  # noqa: E731  grid axis 0 = batch * heads, head fastest
    per_head = lambda n: pl.BlockSpec((None, None, n), lambda i, c, r: (*bh(i), 0))  # noqa: E731
    full_q = pl.BlockSpec((None, sq, None, d), lambda i, c, r: (i // H, 0, i % H, 0))
    full_kv = pl.BlockSpec((None, sk, None, d), lambda i, c, r: (i // H, 0, (i % H) // g, 0))
    slots = pl.BlockSpec((None, None, mcp, d), lambda i, c, r: (*bh(i), 0, 0))
    args = [q_pos, k_pos, cidx, first, end, bidx.reshape(B, H, nqb * mbp), cnt[..., 1], ncol, cnt[..., 3], q, k, v,
            do, lse, delta]
    in_specs = [pl.BlockSpec((sq,), lambda i, c, r: (0,)), pl.BlockSpec((sk,), lambda i, c, r: (0,)),
                per_head(mcp), per_head(nch), per_head(nch), per_head(nqb * mbp), per_head(nqb), per_head(nqb),
                per_head(nqb),
                full_q, full_kv, full_kv, full_q, per_head(sq), per_head(sq)]
    add_seg_operands(args, in_specs, segs, dict(qseg=pl.BlockSpec((None, sq), lambda i, c, r: (i // H, 0)),
                                                 kseg=pl.BlockSpec((None, sk), lambda i, c, r: (i // H, 0))))
    n_in = len(args)
    if splits > 1:  # ranges add into zero-initialised slots
        zeros = jnp.zeros((B, H, mcp, d), jnp.float32)
        args += [zeros, zeros]
        in_specs += [slots, slots]
    dkc, dvc = pl.pallas_call(
        functools.partial(_dkv_col_kernel, qk_scale=sm_scale * LOG2E, scale=sm_scale, bs=bs, nqb=nqb,
                          splits=splits, interpret=interpret, segs=segs is not None),
        grid=(B * H, nch, splits),
        in_specs=in_specs,
        out_specs=[slots, slots],
        out_shape=[jax.ShapeDtypeStruct((B, H, mcp, d), jnp.float32)] * 2,
        input_output_aliases={n_in: 0, n_in + 1: 1} if splits > 1 else {},
        compiler_params=params,
        interpret=interpret,
        name="block_sparse_bwd_dkv_cols",
    )(*args)
    return dkc, dvc, cidx


def _dkv_kernel(qpos_ref, kpos_ref, tidx_ref, tcnt_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
                *refs, qk_scale, scale, bs, g, segs=False):
    """One program per (KV block, KV head, batch): the ``g`` query heads of the group in turn,
    each over the query blocks that list this KV block (free tiles, then masked ones)."""
    seg_refs, (dk_ref, dv_ref) = split_seg_refs(refs, segs)
    k = k_ref[...]
    v = v_ref[...]
    kp = kpos_ref[...]
    ks = None if seg_refs is None else seg_refs[1][...]

    def head(t, carry):
        def tile(rows, carry, masked=False):
            q, do, qp, lse2, delta = _query_rows(rows, q_ref, do_ref, qpos_ref, lse_ref, delta_ref, head=t)
            ok = (kp[:, None] <= qp[None, :]) if masked else None
            if masked and ks is not None:
                ok = ok & (ks[:, None] == seg_refs[0][rows][None, :])
            return _dkv_tile(carry, k, v, ok, qk_scale, q, do, lse2, delta)

        block_at = lambda j: tidx_ref[t, j]  # noqa: E731
        n_free, n_all = tcnt_ref[t, 0], tcnt_ref[t, 1]
        carry = for_blocks(block_at, 0, n_free, bs, tile, carry)
        return for_blocks(block_at, n_free, n_all, bs, functools.partial(tile, masked=True), carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, g, head, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _bwd_inputs(q, q_pos, k_pos, do, lse, delta):
    return (q_pos.astype(jnp.int32), k_pos.astype(jnp.int32), do.astype(q.dtype), lse.astype(jnp.float32),
            delta.astype(jnp.float32))


@functools.partial(jax.jit, static_argnames=STATIC)
def dq_pass(q, k, v, q_pos, k_pos, index: StepIndex, do, lse, delta, dq_acc=None, *, sm_scale: float,
            block_size: int, col_chunk: int = 64, num_warps: int = 4, num_stages: int = 2, interpret: bool = False,
            segs=None):
    """Backward pass 1: ``dq f32 [B, Sq, Hq, D]``, query-stationary over the forward's schedule;
    added to ``dq_acc`` (same shape, aliased: in place) when one is given. ``segs``: packed
    documents (module docstring)."""
    B, sq, H, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    bs = block_size
    q_pos, k_pos, do, lse, delta = _bwd_inputs(q, q_pos, k_pos, do, lse, delta)
    bidx, cnt, cidx = prepare_index(index, sk, bs, col_chunk, segs)
    sp = query_specs(H, H // hkv, sq, sk, d, bs, bidx.shape[-1], cidx.shape[-1])
    accumulate = dq_acc is not None
    args = [q_pos, k_pos, bidx, cnt, cidx, q, k, v, do, lse, delta]
    in_specs = [sp["qpos"], sp["kpos"], sp["bidx"], sp["cnt"], sp["cidx"],
                sp["q"], sp["kv"], sp["kv"], sp["q"], sp["row"], sp["row"]]
    add_seg_operands(args, in_specs, segs, sp)
    n_in = len(args)
    if accumulate:
        args.append(dq_acc.astype(jnp.float32))
        in_specs.append(sp["q"])
    return pl.pallas_call(
        functools.partial(_dq_kernel, qk_scale=sm_scale * LOG2E, scale=sm_scale, bs=bs, cc=col_chunk,
                          accumulate=accumulate, segs=segs is not None),
        grid=(sq // bs, H, B),
        in_specs=in_specs,
        out_specs=sp["q"],
        out_shape=jax.ShapeDtypeStruct((B, sq, H, d), jnp.float32),
        input_output_aliases={n_in: 0} if accumulate else {},
        compiler_params=triton_compiler_params(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="block_sparse_bwd_dq",
    )(*args)


@functools.partial(jax.jit, static_argnames=STATIC)
def dkv_block_pass(q, k, v, q_pos, k_pos, index: StepIndex, do, lse, delta, *, sm_scale: float,
                   block_size: int, col_chunk: int = 64, num_warps: int = 4, num_stages: int = 2,
                   interpret: bool = False, segs=None):
    """Backward pass 2: ``(dk, dv) f32 [B, Sk, Hkv, D]`` of the active blocks, summed over each
    KV head's group of query heads in the kernel; one program per (KV block, KV head, batch) over
    :func:`transpose_block_index`."""
    del col_chunk
    B, sq, H, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g, bs = H // hkv, block_size
    q_pos, k_pos, do, lse, delta = _bwd_inputs(q, q_pos, k_pos, do, lse, delta)
    tidx, tcnt = transpose_block_index(index, sk, bs)
    mtp = tidx.shape[-1]
    kv_blk = pl.BlockSpec((None, bs, None, d), lambda j, hk, b: (b, j, hk, 0))
    group_q = pl.BlockSpec((None, sq, g, d), lambda j, hk, b: (b, 0, hk, 0))
    group_row = pl.BlockSpec((None, g, sq), lambda j, hk, b: (b, hk, 0))
    args = [q_pos, k_pos, tidx, tcnt, q, k, v, do, lse, delta]
    in_specs = [pl.BlockSpec((sq,), lambda j, hk, b: (0,)), pl.BlockSpec((bs,), lambda j, hk, b: (j,)),
                pl.BlockSpec((None, g, None, mtp), lambda j, hk, b: (b, hk, j, 0)),
                pl.BlockSpec((None, g, None, 2), lambda j, hk, b: (b, hk, j, 0)),
                group_q, kv_blk, kv_blk, group_q, group_row, group_row]
    add_seg_operands(args, in_specs, segs, dict(qseg=pl.BlockSpec((None, sq), lambda j, hk, b: (b, 0)),
                                                 kseg=pl.BlockSpec((None, bs), lambda j, hk, b: (b, j))))
    return pl.pallas_call(
        functools.partial(_dkv_kernel, qk_scale=sm_scale * LOG2E, scale=sm_scale, bs=bs, g=g, segs=segs is not None),
        grid=(sk // bs, hkv, B),
        in_specs=in_specs,
        out_specs=[kv_blk, kv_blk],
        out_shape=[jax.ShapeDtypeStruct((B, sk, hkv, d), jnp.float32)] * 2,
        compiler_params=triton_compiler_params(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="block_sparse_bwd_dkv",
    )(*args)


@functools.partial(jax.jit, static_argnames=STATIC + ("col_splits",))
def dkv_col_pass(q, k, v, q_pos, k_pos, index: StepIndex, do, lse, delta, dk, dv, *, sm_scale: float,
                 block_size: int, col_chunk: int = 64, num_warps: int = 4, num_stages: int = 2,
                 interpret: bool = False, col_splits: int | None = None, segs=None):
    """Backward pass 3: adds the vertical columns' dK/dV into ``dk, dv f32 [B, Sk, Hkv, D]``
    (kernel per list slot, then :func:`add_column_grads`). ``col_splits``: query-block ranges per
    column chunk (default :func:`col_row_splits`; a tuning knob, ``benchmarks/kernels.py
    --col-split-sweep``)."""
    del col_chunk
    q_pos, k_pos, do, lse, delta = _bwd_inputs(q, q_pos, k_pos, do, lse, delta)
    dkc, dvc, cidx = _col_dkv(q, k, v, q_pos, k_pos, index, do, lse, delta, sm_scale=sm_scale, bs=block_size,
                              params=triton_compiler_params(num_warps=num_warps, num_stages=num_stages),
                              interpret=interpret, col_splits=col_splits, segs=segs)
    return add_column_grads(dk, dv, dkc, dvc, cidx, index.col_count)


@functools.partial(jax.jit, static_argnames=STATIC)
def pallas_bwd(q, k, v, q_pos, k_pos, index: StepIndex, do, lse, delta, dq_acc=None, dkv_acc=None, *, segs=None,
               **options):
    """The Triton backward: :func:`pallas_kernels.three_pass.three_pass_bwd` with this module's
    passes (:func:`dkv_block_pass`, :func:`dkv_col_pass`, :func:`dq_pass`); returns f32 ``(dq, dk,
    dv)``. ``options``: ``sm_scale``, ``block_size`` and the tuning options of
    :func:`pallas_kernels.triton_kernels.pallas_fwd`, passed to every pass."""
    return three_pass_bwd(q, k, v, q_pos, k_pos, index, do, lse, delta, dq_acc, dkv_acc, dq_kernel=dq_pass,
                          dkv_kernels=(dkv_block_pass, dkv_col_pass), segs=segs, kernel_options=options)
