"""The ring's two exact backward passes (custom VJP of :mod:`.attention`; the side is chosen by
:mod:`.sides`).

Both are FlashAttention-2 style: they reuse the forward's final ``lse`` and ``delta = rowsum(dO *
O)`` and recompute only each step's probabilities.

K/V side (:func:`backward_kv`): queries, ``dO``, ``lse``, ``delta`` and the dQ accumulator stay
home. The forward's steps run in REVERSE order from the chunk of the last forward step (saved as a
residual), so K/V move ``-1`` along each ring; the own chunk is visited last and never travels home
(with ``fuse_backward`` its kernel call is fused with the first). The float32 dK/dV accumulator of
the visited chunk follows it (sent after the step's dK/dV kernels, overlapping its dQ kernel) and
ends at the owner::

    reverse outer step i:  acc --inner -1--> acc --inner -1--> ... acc ─┐
                                                          tot_in ─────┴─(+)─ tot ──outer -1──> step i-1
    step (0, 0):           own + acc + tot = dK/dV of this rank's chunk

Per forward + backward: ``P-1`` K/V hops forward, ``P-2`` backward and ``P-1`` accumulator hops.

Query side (:func:`backward_query`): K, V and dK/dV stay at their owner; the visiting ranks' Q,
dO, lse and delta (one packed buffer) and their dQ accumulator travel ``+1``, over the forward's
(query rank, K/V chunk) pairs; no fused call.

Shapes: ``q [B, Sl, Hq, D]``, ``kv_own [2, B, Sl, Hkv, D]`` (K and V stacked), ``q_pos, k_pos
int32 [Sl]``, ``lse [B, Hq, Sl]`` float32; both return ``(dq, dk, dv)`` with float32 dK/dV. The K/V side's
dQ is in q's dtype: its last kernel call writes it, rounded once from the float32 sum (no float32 dQ buffer
of the whole chunk); the query side's is float32 (summed from the travelling accumulators) unless P = 1.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mtraining_jax.mesh import CP_AXES
from mtraining_jax.ring.config import RingConfig
from mtraining_jax.ring.index_source import can_fuse
from mtraining_jax.ring.steps import (first_visit, group_index, group_kv, group_positions, group_segments,
                                      my_rank, query_rank, shift)
from pallas_kernels.api import attention_delta, block_sparse_attention_bwd

__all__ = ["backward_kv", "backward_query"]


def backward_kv(cfg: RingConfig, q, kv_own, kv_last, q_pos, kpos_all, step_index, out, out_lo, lse, do, segs=None):
    """The backward ring (see module docstring): the forward's steps in reverse order, starting
    from ``kv_last``; ``(out, out_lo)`` is the forward's float32 output as ``split_output`` saves it; returns
    ``(dq, dk, dv)``: dQ in q's dtype (rounded once, by the last step's kernel), dK/dV float32."""
    outer_axis, n_outer = cfg.outer
    inner_axis, n_inner = cfg.inner
    P = cfg.num_ranks
    sl = kv_own.shape[2]
    fuse = cfg.fuse_backward and P > 1 and can_fuse(step_index)
    rank = my_rank(cfg)
    delta = attention_delta(out, do, out_lo)

    last = 1 if fuse else 0  # the step of the last kernel call: its dQ is final, written in q's dtype

    def attend(steps, kvs, dq, dkv_acc):
        seg_kw = group_segments(segs, rank, steps, cfg)
        return block_sparse_attention_bwd(
            q, kvs[0], kvs[1], q_pos, group_positions(kpos_all, rank, steps, cfg), group_index(step_index, steps),
            do, lse, delta, sm_scale=cfg.sm_scale, block_size=cfg.block_size, impl=cfg.impl, stream=cfg.kernel_stream,
            dq_acc=dq, dkv_acc=dkv_acc, dq_dtype=q.dtype if steps[-1] == last else jnp.float32, **seg_kw)

    def moved(x, axis, size, dest_step):
        # the chunk of step 0 is this rank's own: it never travels home, it is already here
        return kv_own if dest_step == 0 else shift(x, axis, size, -1)

    kv, dq, own, tot = kv_last, None, None, None
    for i in reversed(range(n_outer)):
        # chunk of step (i-1, n_inner-1) = the one held now, one node back (posted first: overlaps the inner loop)
        kv_outer = moved(kv, outer_axis, n_outer, i * n_inner - 1) if i > 0 else None
        acc = None  # f32 dK/dV of the chunk held now, summed over the ranks of this node that saw it
        for j in reversed(range(n_inner)):
            s = i * n_inner + j
            if fuse and s == 0:
                break  # computed with step P-1 in the first kernel call
            kv_next = moved(kv, inner_axis, n_inner, s - 1) if j > 0 else None
            if fuse and s == P - 1:
                dq, dk_g, dv_g = attend((0, s), group_kv([kv_own, kv]), dq, None)
                own = (dk_g[:, :sl], dv_g[:, :sl])
                acc = (dk_g[:, sl:], dv_g[:, sl:])
            else:
                dq, dk_s, dv_s = attend((s,), kv, dq, acc)
                acc = (dk_s, dv_s)
            if j > 0:
                acc = tuple(shift(jnp.stack(acc), inner_axis, n_inner, -1))  # travels with its chunk
                kv = kv_next
        if i > 0:
            # acc: this node's sum for the chunk held at step (i, 0); tot: the nodes before us
            tot = acc if tot is None else jax.tree.map(jnp.add, tot, acc)
            tot = tuple(shift(jnp.stack(tot), outer_axis, n_outer, -1))
            kv = kv_outer
    # here every contribution to this rank's own chunk has arrived (own: fused first call)
    parts = [p for p in (own, acc, tot) if p is not None]
    dk, dv = functools.reduce(lambda a, b: jax.tree.map(jnp.add, a, b), parts)
    return dq, dk, dv


def _uint(dtype):
    return {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[jnp.dtype(dtype).itemsize]


def _pack_queries(q, do, lse, delta):
    """Q, dO ``[B, Sl, Hq, D]`` and float32 ``lse``, ``delta`` ``[B, Hq, Sl]`` as ONE flat buffer of
    unsigned integers of q's itemsize (bit-exact through any permute: no float canonicalisation),
    so each hop of the query-side ring is one collective-permute."""
    u = _uint(q.dtype)
    stats = lax.bitcast_convert_type(jnp.stack([lse, delta]).astype(jnp.float32), u)
    parts = [lax.bitcast_convert_type(q, u), lax.bitcast_convert_type(do.astype(q.dtype), u), stats]
    return jnp.concatenate([x.reshape(-1) for x in parts])


def _unpack_queries(buf, q_shape, dtype):
    """Inverse of :func:`_pack_queries`: ``(q, do, lse, delta)``."""
    n = int(np.prod(q_shape))
    B, Sl, Hq, _ = q_shape
    q = lax.bitcast_convert_type(buf[:n].reshape(q_shape), dtype)
    do = lax.bitcast_convert_type(buf[n:2 * n].reshape(q_shape), dtype)
    ratio = 4 // jnp.dtype(dtype).itemsize
    stats = buf[2 * n:].reshape((2, B, Hq, Sl) + ((ratio,) if ratio > 1 else ()))
    stats = lax.bitcast_convert_type(stats, jnp.float32)
    return q, do, stats[0], stats[1]


def backward_query(cfg: RingConfig, q, kv_own, qpos_all, kpos_all, step_index, out, out_lo, lse, do, segs=None):
    """The query-side backward ring (module docstring). At backward step ``s`` kv owner ``r`` holds
    the queries of ``query_rank(r, s)``, i.e. the forward's step-``s`` pair, so the step's index is
    the visiting rank's (``step_index.for_rank(t).step(s)``).

    Order: the own step first (its dQ stays home; the first bundle's hop overlaps it), then the
    forward's other steps in reverse, everything moving ``+1`` along its ring::

        own step:              bundle <-- diagonal hop from (n-1, l-1)   (overlaps the own step)
        reverse outer step i:  bundle --inner +1--> ... ; acc (dQ) --inner +1--> ... acc ─┐
                               bundle at step (i, L-1) --outer +1--> step (i-1, L-1)       │
                                                          tot_in ───────────────────────┴─(+)─ tot ──outer +1──>
        end:                   dQ = own + acc (rest of this node, arrived after step (0, 1)) + tot

    ``P - 1`` bundle hops and ``P - 1`` dQ hops; nothing is sent home. Returns float32 ``(dq, dk, dv)``.
    """
    outer_axis, n_outer = cfg.outer
    inner_axis, n_inner = cfg.inner
    P = cfg.num_ranks
    rank = my_rank(cfg)
    delta = attention_delta(out, do, out_lo)
    k, v = kv_own[0], kv_own[1]
    k_pos = lax.dynamic_index_in_dim(kpos_all, rank, axis=0, keepdims=False)

    def attend(s, parts, dq_acc, dkv_acc, dq_dtype=jnp.float32):
        qq, dd, ll, de = parts
        t = query_rank(rank, s, cfg)
        index = None if step_index is None else step_index.for_rank(t).step(s)
        seg_kw = {} if segs is None else {
            "q_seg": lax.dynamic_index_in_dim(segs[1], t, axis=0, keepdims=False), "k_seg": segs[0]}
        return block_sparse_attention_bwd(
            qq, k, v, lax.dynamic_index_in_dim(qpos_all, t, axis=0, keepdims=False), k_pos, index, dd, ll, de,
            sm_scale=cfg.sm_scale, block_size=cfg.block_size, impl=cfg.impl, stream=cfg.kernel_stream,
            dq_acc=dq_acc, dkv_acc=dkv_acc, dq_dtype=dq_dtype, **seg_kw)

    def unpack(buf):
        return _unpack_queries(buf, q.shape, q.dtype)

    bundle = None
    if P > 1:  # posted before the own step, which it overlaps
        bundle = lax.ppermute(_pack_queries(q, do, lse, delta), CP_AXES,
                              perm=[(r, first_visit(r, cfg)) for r in range(P)])
    dq_own, dk, dv = attend(0, (q, do, lse, delta), None, None, q.dtype if P == 1 else jnp.float32)
    dkv = (dk, dv)
    acc = tot = None
    for i in reversed(range(n_outer)):
        # the bundle of step (i-1, n_inner-1) is the one held now (step (i, n_inner-1)), one node on
        bundle_outer = None
        if i > 0 and (i - 1) * n_inner + n_inner - 1 != 0:
            bundle_outer = shift(bundle, outer_axis, n_outer, +1)
        acc = None  # f32 dQ of the queries held now, summed over the ranks of this node that saw them
        for j in reversed(range(n_inner)):
            s = i * n_inner + j
            if s == 0:
                break  # the own step, done first
            bundle_next = shift(bundle, inner_axis, n_inner, +1) if j > 0 and s - 1 != 0 else None
            acc, dk, dv = attend(s, unpack(bundle), acc, dkv)
            dkv = (dk, dv)
            if j > 0:
                acc = shift(acc, inner_axis, n_inner, +1)  # travels with its queries (home after step (0, 1))
                bundle = bundle_next
        if i > 0:
            # acc: this node's sum for the queries held at step (i, 0); tot: the nodes before us
            tot = acc if tot is None else tot + acc
            tot = shift(tot, outer_axis, n_outer, +1)
            bundle = bundle_outer
    dq = functools.reduce(jnp.add, [p for p in (dq_own, acc, tot) if p is not None])
    return dq, dkv[0], dkv[1]


