"""Pallas (Triton backend) forward kernel of vertical-slash block-sparse flash attention, and what
both directions share (:func:`prepare_index`, block / column loops, query-stationary BlockSpecs).

:func:`pallas_fwd`: one program per (64-query block, query head, batch), heaviest rows first; query
head ``h`` reads KV head ``h // g`` in place. It walks the row's free tiles (``block_causal == 0``)
with no mask, then its masked tiles (causal mask by global position), then its prefix of the head's
column list in gathered chunks of ``col_chunk`` (masked by count, position and where a column lies
in an active block of the row, :func:`~pallas_kernels.triton_common.outside_blocks`). Packed documents
(``segs``, index narrowed by :func:`~pallas_kernels.index_format.apply_segments`): masked tiles and
columns add ``k_seg == q_seg`` (:func:`~pallas_kernels.triton_common.pair_ok`). Online softmax in float32
with ``exp2`` (FlashAttention-2, Dao 2023, Alg. 1); rows with no allowed key get out 0, lse -inf; given
``acc`` it merges into it in place (:func:`_merge_rows`). The backward is :mod:`pallas_kernels.triton_backward`.

Runs on CUDA GPUs and in interpret mode on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._compat import dot, triton_compiler_params
from pallas_kernels.index_format import StepIndex, column_start, scatter_last, stable_partition
from pallas_kernels.triton_common import (LN2, LOG2E, STATIC, add_seg_operands, col_rows, for_blocks, outside_blocks,
                                          pair_ok, pow2, query_specs, split_seg_refs)


def prepare_index(index: StepIndex, sk: int, bs: int, col_chunk: int, segs=None):
    """Kernel-ready index: each row's active blocks reordered free-first, slots padded.

    Returns ``(block_idx int32 [B,H,nQB,MBp], counts int32 [B,H,nQB,4], col_idx int32 [B,H,MCp])``:
    ``block_idx`` holds first the ``counts[..., 0]`` blocks whose tile needs no mask
    (``block_causal == 0``), then the masked ones up to ``counts[..., 1]`` (= ``block_count``),
    each group in index order; ``counts[..., 2] = col_count`` (the row's prefix of the head's
    column list ``col_idx``), ``counts[..., 3]`` the slot its column walk may start from: with packed
    documents (``segs = (q_seg, k_seg)``) :func:`~pallas_kernels.index_format.column_start` (the earlier
    slots are other documents' columns), else 0. Padding is in range (block 0 / token 0) and never read
    as active; ``MBp`` is a power of two, ``MCp`` a multiple of ``col_chunk``.
    """
    mb, mc = index.max_blocks, index.max_cols
    mbp = pow2(mb)
    mcp = max(col_chunk, pow2(-(-mc // col_chunk) * col_chunk))
    valid = jnp.arange(mb) < index.block_count[..., None]
    free = valid & (index.block_causal == 0)
    dst, n_free, n_blk = stable_partition(free, valid & ~free)
    bidx = scatter_last(jnp.clip(jnp.where(valid, index.block_idx, 0), 0, sk // bs - 1).astype(jnp.int32),
                         dst, mbp)
    cidx = jnp.pad(jnp.clip(index.col_idx, 0, sk - 1).astype(jnp.int32), [(0, 0), (0, 0), (0, mcp - mc)])
    start = (jnp.zeros_like(n_free) if segs is None
             else column_start(index, segs[0], segs[1], bs))
    counts = jnp.stack([n_free, n_blk, index.col_count.astype(jnp.int32), start], axis=-1).astype(jnp.int32)
    return bidx, counts, cidx


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


def _merge_rows(acc, m, l, out_prev, lse_prev):
    """Merge this step's online-softmax state (``acc [bq, D]``, log2-domain running max ``m`` and
    sum ``l``; ``acc / l`` is its output) with earlier steps' normalised ``out_prev`` and natural
    ``lse_prev`` over disjoint keys. With ``M = max(lse2_prev, m + log2 l)`` (log2 domain):
    ``out = (2^(lse2_prev - M) out_prev + 2^(m - M) acc) / den``, ``den = 2^(lse2_prev - M) +
    2^(m - M) l``, ``lse = (M + log2 den) ln 2``; a row empty on both sides stays out 0, lse -inf."""
    lp = lse_prev * LOG2E  # -inf stays -inf
    new = jnp.where(l > 0.0, m + jnp.log2(jnp.where(l > 0.0, l, 1.0)), -jnp.inf)
    mm = jnp.maximum(lp, new)
    mm = jnp.where(mm == -jnp.inf, 0.0, mm)
    wp = jnp.exp2(lp - mm)  # 0 where lse_prev = -inf
    wn = jnp.where(l > 0.0, jnp.exp2(m - mm), 0.0)
    den = wp + wn * l
    empty = den == 0.0
    den_safe = jnp.where(empty, 1.0, den)
    out = (wp[:, None] * out_prev + wn[:, None] * acc) / den_safe[:, None]
    return out, jnp.where(empty, -jnp.inf, (mm + jnp.log2(den_safe)) * LN2)


def _fwd_kernel(qpos_ref, kpos_ref, bidx_ref, cnt_ref, cidx_ref, q_ref, k_ref, v_ref, *refs, qk_scale, bs, cc,
                merge: bool, segs: bool = False):
    seg_refs, refs = split_seg_refs(refs, segs)
    if merge:  # out_prev / lse_prev are aliased to o_ref / lse_ref: read before writing
        oprev_ref, lprev_ref, o_ref, lse_ref = refs
    else:
        o_ref, lse_ref = refs
    q = q_ref[...]
    qp = qpos_ref[...]
    seg = None if seg_refs is None else (seg_refs[1], seg_refs[0][...])
    carry = (jnp.zeros((bs, q.shape[-1]), jnp.float32), jnp.full((bs,), -jnp.inf, jnp.float32),
             jnp.zeros((bs,), jnp.float32))

    def free(rows, carry):
        s = dot(q, k_ref[rows, :], trans_b=True) * qk_scale
        return _softmax_update(carry, s, v_ref[rows, :], masked=False)

    def masked(rows, carry, valid=None):
        ok = pair_ok(kpos_ref, rows, qp, seg)
        ok = ok if valid is None else ok & valid[None, :]
        s = jnp.where(ok, dot(q, k_ref[rows, :], trans_b=True) * qk_scale, -jnp.inf)
        return _softmax_update(carry, s, v_ref[rows, :], masked=True)

    def col_body(c, carry):
        ids, valid = col_rows(cidx_ref, c, n_col, cc)
        return masked(ids, carry, valid & outside_blocks(ids, bidx_ref[...], n_blk, bs))

    n_free, n_blk, n_col = cnt_ref[0], cnt_ref[1], cnt_ref[2]
    block_at = lambda j: bidx_ref[j]  # noqa: E731
    carry = for_blocks(block_at, 0, n_free, bs, free, carry)
    carry = for_blocks(block_at, n_free, n_blk, bs, masked, carry)
    carry = lax.fori_loop(cnt_ref[3] // cc, (n_col + cc - 1) // cc, col_body, carry)  # from column_start
    acc, m, l = carry
    if merge:
        out, lse = _merge_rows(acc, m, l, oprev_ref[...], lprev_ref[...])
    else:
        empty = l == 0.0
        l_safe = jnp.where(empty, 1.0, l)
        out = acc / l_safe[:, None]
        lse = jnp.where(empty, -jnp.inf, (m + jnp.log2(l_safe)) * LN2)
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = lse


@functools.partial(jax.jit, static_argnames=STATIC + ("out_dtype",))
def pallas_fwd(q, k, v, q_pos, k_pos, index: StepIndex, acc=None, *, sm_scale: float, block_size: int,
               col_chunk: int = 64, num_warps: int = 4, num_stages: int = 2, interpret: bool = False, segs=None,
               out_dtype=jnp.float32):
    """Forward kernel; shapes as in :mod:`pallas_kernels.api`. Returns ``(out, lse f32)``, ``out`` in
    ``out_dtype`` (float32 by default; a narrower one: the float32 result rounded once, here);
    with ``acc = (out_prev f32 [B, Sq, Hq, D], lse_prev f32 [B, Hq, Sq])`` (earlier ring steps,
    disjoint keys) the result is merged into them, in place (their buffers are aliased; a float32
    ``out_dtype`` only).
    ``segs = (q_seg int32 [B, Sq], k_seg int32 [B, Sk])``: packed documents, ``index`` already
    narrowed by :func:`~pallas_kernels.index_format.apply_segments` (its free tiles lie inside one
    document)."""
    B, sq, H, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    bs = block_size
    bidx, cnt, cidx = prepare_index(index, sk, bs, col_chunk, segs)
    sp = query_specs(H, H // hkv, sq, sk, d, bs, bidx.shape[-1], cidx.shape[-1])
    merge = acc is not None
    kernel = functools.partial(_fwd_kernel, qk_scale=sm_scale * LOG2E, bs=bs, cc=col_chunk, merge=merge,
                               segs=segs is not None)
    args = [q_pos.astype(jnp.int32), k_pos.astype(jnp.int32), bidx, cnt, cidx, q, k, v]
    in_specs = [sp["qpos"], sp["kpos"], sp["bidx"], sp["cnt"], sp["cidx"], sp["q"], sp["kv"], sp["kv"]]
    add_seg_operands(args, in_specs, segs, sp)
    n_in = len(args)
    aliases = {}
    if merge:
        args += [acc[0].astype(jnp.float32), acc[1].astype(jnp.float32)]
        in_specs += [sp["q"], sp["row"]]
        aliases = {n_in: 0, n_in + 1: 1} if jnp.dtype(out_dtype) == jnp.float32 else {n_in + 1: 1}
    return pl.pallas_call(
        kernel,
        grid=(sq // bs, H, B),
        in_specs=in_specs,
        out_specs=[sp["q"], sp["row"]],
        out_shape=[jax.ShapeDtypeStruct((B, sq, H, d), out_dtype),
                   jax.ShapeDtypeStruct((B, H, sq), jnp.float32)],
        input_output_aliases=aliases,
        compiler_params=triton_compiler_params(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="block_sparse_fwd",
    )(*args)
