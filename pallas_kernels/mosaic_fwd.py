"""Pallas Mosaic GPU (Hopper: wgmma + TMA, warp-specialised) block-sparse flash-attention forward.

Contract of :func:`pallas_kernels.triton_kernels.pallas_fwd` (causal by global position on the
per-step :class:`~pallas_kernels.index_format.StepIndex`; empty rows give out 0 / lse -inf; given
``acc`` the result is merged into the earlier ring steps' float32 ``(out, lse)``), on the tiles of
:mod:`pallas_kernels.mosaic_index`.

One CTA ``(p, h, b)`` = query blocks ``2p`` and ``2p + 1`` of head ``h`` (from the last: heavy
causal rows first) = two consumer warpgroups (one query block each: ``wgmma`` from shared memory,
online softmax in float32, turns on the tensor cores FlashAttention-3 style) and one producer
warpgroup that TMA-loads the CTA's ONE stream of K/V steps (:mod:`pallas_kernels.mosaic_stream`)
into a ring of ``slots`` shared-memory slots: by default the union of the two rows' tiles
(:func:`pallas_kernels.mosaic_index.pair_stream`), or with ``stream="split"`` each consumer's own tiles
in one half of every 128-key step (:func:`pallas_kernels.mosaic_index.split_stream`). Packed documents: masked
tiles add ``seg == q_seg``.

Supported: bf16 / f16, head_dim 64 or 128, block size 64, ``Sq`` a multiple of 128, compute
capability 9.x (:mod:`pallas_kernels.backend_mosaic`). Design notes: ``docs/kernels.md``.
"""

from __future__ import annotations

import functools
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.index_format import StepIndex
from pallas_kernels.mosaic_common import (LOG2E, LN2, NEG_INF, load_smem, row_layout, tile_transforms,
                                          transposed)
from pallas_kernels.mosaic_stream import (consumer_row, mask_scores, query_kernel, query_pair_ids, run_stream,
                                          stream_barriers, stream_producer, stream_smem, stream_walk, walk_stream)


def _online_softmax(carry, s, masked: bool, scale: float):
    """One online-softmax step on raw scores ``s [64, n]`` (``-inf`` = masked) whose log2-domain
    value is ``s * scale`` (``scale > 0``: the maximum is taken before scaling and the scale folds
    into the exponent's FMA). Returns ``(p, alpha, m_new, l_new)`` for ``acc = acc * alpha + p @ V``,
    with ``m`` in the log2 domain."""
    m, l = carry
    m_new = jnp.maximum(m, s.max(axis=1) * scale)
    m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new) if masked else m_new
    alpha = jnp.exp2(m - m_safe)
    p = jnp.exp2(s * scale - lax.broadcast_in_dim(m_safe, s.shape, [0]))
    l_new = l * alpha + p.sum(axis=1)
    return p, alpha, m_new, l_new


def _finish(acc, m, l, merge_prev):
    """Normalise (or merge with the earlier steps' ``(out_prev, lse_prev)``): ``(out, lse)``."""
    nonempty = l > 0.0
    l_safe = jnp.where(nonempty, l, 1.0)
    lse2 = jnp.where(nonempty, m + jnp.log(l_safe) * LOG2E, NEG_INF)
    if merge_prev is None:
        out = acc * lax.broadcast_in_dim(1.0 / l_safe, acc.shape, [0])
        return out, lse2 * LN2
    out_prev, lse_prev = merge_prev
    lp = lse_prev * LOG2E
    mm = jnp.maximum(lp, lse2)
    mm = jnp.where(mm == NEG_INF, 0.0, mm)
    wp = jnp.exp2(lp - mm)
    wn = jnp.where(nonempty, jnp.exp2(m - mm), 0.0)
    den = wp + wn * l
    empty = den == 0.0
    inv = 1.0 / jnp.where(empty, 1.0, den)
    out = (out_prev * lax.broadcast_in_dim(wp * inv, acc.shape, [0])
           + acc * lax.broadcast_in_dim(wn * inv, acc.shape, [0]))
    lse = jnp.where(empty, NEG_INF, (mm + jnp.log(jnp.where(empty, 1.0, den)) * LOG2E) * LN2)
    return out, lse


def _kernel(cnt_ref, bnd_ref, sidx_ref, qpos_ref, q_ref, k_ref, v_ref, kc_ref, vc_ref, kinfo_ref, cinfo_ref,
            null_ref, *refs, merge: bool, slots: int, halves: int, g: int, bs: int, qk_scale: float, npairs: int,
            segs: bool = False, walk: str = "loops", split: bool = False):
    *ins, out_ref, lse_ref, smems, bars = refs
    qseg_ref, ins = (ins[0], ins[1:]) if segs else (None, ins)
    oprev_ref, lprev_ref = ins if merge else (None, None)
    q_smem, k_smem, v_smem, info_smem, row_smem, lse_smem = smems
    q_bar, row_bar, k_bar, v_bar, i_bar, k_free, v_free, sched_bar = bars
    b, h, pair, wg = query_pair_ids(npairs)
    dtype = q_ref.dtype
    bounds, n_union, total, rows_w, col0 = stream_walk(bnd_ref, cnt_ref, b, h, pair, bs, halves)
    kv = bs * halves  # keys per step

    @pl.when(wg < 2)
    def _consumer():
        plgpu.set_max_registers(232, action="increase")
        w = wg
        i = 2 * pair + w
        row = consumer_row(w, rows_w)
        rows = pl.ds(i * bs, bs)
        plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], q_smem.at[w], q_bar.at[w])
        plgpu.copy_gmem_to_smem(qpos_ref.at[rows], row_smem.at[w], row_bar.at[w])
        if merge:
            plgpu.copy_gmem_to_smem(lprev_ref.at[b, h, rows], lse_smem.at[w], row_bar.at[2 + w])
        if segs:
            plgpu.copy_gmem_to_smem(qseg_ref.at[b, rows], row_smem.at[2 + w], row_bar.at[4 + w])
        plgpu.barrier_wait(q_bar.at[w])
        plgpu.barrier_wait(row_bar.at[w])
        if segs:
            plgpu.barrier_wait(row_bar.at[4 + w])
        qpos = load_smem(row_smem.at[w], row_layout())
        qpos_b = lax.broadcast_in_dim(qpos, (bs, kv), [0])
        qpos_h = lax.broadcast_in_dim(qpos, (bs, bs), [0]) if split else None
        d = q_smem.shape[-1]
        acc = plgpu.layout_cast(jnp.full((bs, d), 0.0, jnp.float32), plgpu.Layout.WGMMA)
        m = plgpu.layout_cast(jnp.full((bs,), NEG_INF, jnp.float32), row_layout())
        l = plgpu.layout_cast(jnp.full((bs,), 0.0, jnp.float32), row_layout())

        def schedule():  # both consumers' turn-taking (FlashAttention-3 "ping-pong")
            plgpu.barrier_arrive(sched_bar)
            plgpu.barrier_wait(sched_bar)

        def wait_next_k(t):
            @pl.when(t + 1 < total)
            def _():
                plgpu.barrier_wait(k_bar.at[lax.rem(t + 1, jnp.int32(slots))])

        def mask(s, slot, masked: bool, thr, keys=()):  # -inf where the key is not this row's
            if not masked:
                return s
            return mask_scores(s, info_smem, slot, thr, qpos_b if s.shape[1] == kv else qpos_h,
                               row_smem.at[2 + w] if segs else None, keys)

        def softmax_turn(carry, s, masked: bool, slot):
            # one online-softmax step on this consumer's scores, then the turn: the tensor cores are
            # taken once the other consumer's softmax is done and this step's V has arrived
            acc, m, l = carry
            p, alpha, m, l = _online_softmax((m, l), s, masked, qk_scale)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            p16 = p.astype(dtype)
            # the softmax's results are complete before the turn passes (as in JAX's attention_mgpu)
            acc, l, m, p16 = lax.optimization_barrier((acc, l, m, p16))
            plgpu.barrier_arrive(sched_bar)  # softmax done
            plgpu.barrier_wait(v_bar.at[slot])
            plgpu.barrier_wait(sched_bar)  # the tensor cores are ours
            return p16, acc, m, l

        def tile(t, carry, masked: bool, thr, own: bool = False):
            # own: only this consumer's half of the step (split stream's block steps: 64 keys)
            acc, m, l = carry
            slot = lax.rem(t, jnp.int32(slots))  # its K: waited for under the last P V
            n = bs if own else kv
            keys = (pl.ds(pl.multiple_of(w * bs, bs), bs),) if own else ()
            k_tile, v_tile = k_smem.at[(slot, *keys)], v_smem.at[(slot, *keys)]

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem.at[w], transposed(k_tile))
                schedule()  # the other consumer's softmax runs under this wgmma
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((bs, n), jnp.float32))  # unscaled: qk_scale folds into FMAs
            plgpu.barrier_wait(i_bar.at[slot])
            s = mask(s, slot, masked, thr, keys)
            plgpu.barrier_arrive(k_free.at[slot])
            p16, acc, m, l = softmax_turn((acc, m, l), s, masked, slot)

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p16, v_tile)
                wait_next_k(t)  # the next tile's K, while this P V runs

            acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m, l

        def skip(t, carry):  # not this row's tile: same waits, arrivals and turns, no math
            slot = lax.rem(t, jnp.int32(slots))
            schedule()
            plgpu.barrier_wait(i_bar.at[slot])
            plgpu.barrier_arrive(k_free.at[slot])
            plgpu.barrier_arrive(sched_bar)
            plgpu.barrier_wait(v_bar.at[slot])
            plgpu.barrier_wait(sched_bar)
            wait_next_k(t)
            plgpu.barrier_arrive(v_free.at[slot])
            return carry

        carry = (acc, m, l)

        @pl.when(total > 0)
        def _():  # the first tile's K (each later one is waited for under the P V before it)
            plgpu.barrier_wait(k_bar.at[0])

        pl.when(w == 1)(schedule)  # consumer 0 goes first
        carry = walk_stream(w, bounds, n_union, total, row, tile, skip, carry, walk, split)
        pl.when(w == 0)(schedule)
        acc, m, l = carry
        prev = None
        if merge:
            plgpu.barrier_wait(row_bar.at[2 + w])
            prev = (load_smem(oprev_ref.at[b, rows, h], plgpu.Layout.WGMMA, optimized=False),
                    load_smem(lse_smem.at[w], row_layout()))
        out, lse = _finish(acc, m, l, prev)
        out_ref[b, rows, h] = out.astype(out_ref.dtype)  # rounded once, from the float32 result
        lse_smem.at[w][...] = lse
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(lse_smem.at[w], lse_ref.at[b, h, rows])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")
        hk = lax.div(h, jnp.array(g, h.dtype))

        stream_producer(b, h, hk, pair, bs, halves, slots, n_union, total, col0, sidx_ref, k_ref, v_ref, kc_ref,
                        vc_ref, kinfo_ref, cinfo_ref, null_ref, k_smem, v_smem, info_smem, k_bar, v_bar, i_bar, k_free,
                        v_free)


_STATIC = ("sm_scale", "block_size", "slots", "kv_step", "walk", "stream", "uniform", "out_dtype")


@functools.partial(jax.jit, static_argnames=_STATIC)
def mosaic_fwd(q, k, v, q_pos, k_pos, index: StepIndex, acc=None, *, sm_scale: float, block_size: int = 64,
               slots: int | None = None, kv_step: int = 128, segs=None, walk: str = "switch",
               stream: str = "auto", uniform: bool = False, out_dtype=jnp.float32):
    """Forward kernel; shapes as in :mod:`pallas_kernels.api`. Returns ``(out [B, Sq, Hq, D] in
    out_dtype, lse f32 [B, Hq, Sq])``, merged with ``acc = (out_prev, lse_prev)`` when given; a
    narrower ``out_dtype`` than float32 rounds the float32 result once, in the epilogue (no float32
    output written). ``segs = (q_seg
    [B, Sq], k_seg [B, Sk])``: packed documents, ``index`` narrowed by ``apply_segments``.
    ``kv_step``: keys per step (64 or 128: two 64-key tiles of the stream in one softmax step);
    ``slots``: depth of the CTA's shared K/V ring (default: as many as fit, 2-4); ``walk``: how the
    consumers walk the stream (:data:`pallas_kernels.mosaic_stream.WALKS`); ``stream``: what the CTA's
    two consumers share (:data:`pallas_kernels.mosaic_stream.STREAMS`: ``"shared"``, the union of their
    tiles, ``"split"``, each its own tiles in one half of every 128-key step, or ``"index"``, one of
    the two chosen per call from the index by :func:`pallas_kernels.mosaic_stream.run_stream`, whose
    split branch always takes 128-key steps and segment loops; ``walk`` / ``kv_step`` apply to its
    shared branch; ``"auto"``: ``"index"`` on a listed index, ``"shared"`` on a uniform one,
    :func:`pallas_kernels.mosaic_stream.resolve_stream`); ``uniform``: every (batch, head) row of
    ``index`` is the same, its operands are built once (:func:`pallas_kernels.mosaic_stream.stream_operands`)."""
    B, sq, H, d = q.shape
    bs = block_size
    nqb = sq // bs
    merge = acc is not None
    sg = segs is not None

    def launch(ops, walk_ops, null_info, halves, slots, kv_step, walk, split):
        kernel = functools.partial(_kernel, merge=merge, slots=slots, halves=halves, g=H // k.shape[2], bs=bs,
                                   qk_scale=float(sm_scale) * LOG2E, npairs=nqb // 2, segs=sg, walk=walk,
                                   split=split)
        tr = tile_transforms(q.dtype)
        scratch = [
            (plgpu.SMEM((2, bs, d), q.dtype, transforms=tr),
             *stream_smem(slots, kv_step, d, q.dtype, sg),
             plgpu.SMEM((2 + 2 * sg, bs), jnp.int32),
             plgpu.SMEM((2, bs), jnp.float32)),
            (plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=4 + 2 * sg),
             *stream_barriers(slots, halves, sg),
             plgpu.Barrier(num_arrivals=2)),
        ]
        args = [ops.counts, walk_ops.bounds, walk_ops.block_idx, q_pos.astype(jnp.int32), q, k, v, ops.kc, ops.vc,
                ops.k_info, ops.c_info, null_info]
        if sg:
            args.append(segs[0].astype(jnp.int32))
        if merge:
            args += [acc[0].astype(jnp.float32), acc[1].astype(jnp.float32)]
        out_type = [jax.ShapeDtypeStruct((B, sq, H, d), out_dtype), jax.ShapeDtypeStruct((B, H, sq), jnp.float32)]
        return tuple(query_kernel(kernel, "mosaic_fwd", out_type, scratch, args, nqb // 2, H, B))

    return run_stream(launch, index, k, v, q_pos, k_pos, bs, segs, kv_step, slots, walk, stream, uniform, "fwd")
