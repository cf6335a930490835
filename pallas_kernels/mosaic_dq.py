"""Pallas Mosaic GPU (Hopper) backward: the dQ pass.

Contract of :func:`pallas_kernels.triton_backward.dq_pass` (FlashAttention-2, Dao 2023, Alg. 2, from
the final ``lse`` and ``delta = rowsum(dO * O)``): :func:`mosaic_dq` adds ``dQ = scale * dS K`` over
the tiles the forward attends, added to ``dq_acc`` when given; the forward's CTA structure and K/V
stream (:mod:`pallas_kernels.mosaic_stream`), three ``wgmma`` per step. Packed documents: masked
tiles add ``k_seg == q_seg``. The dK/dV passes: :mod:`pallas_kernels.mosaic_dkv`. Design notes:
``docs/kernels.md``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.index_format import StepIndex
from pallas_kernels.mosaic_common import (LOG2E, NEG_INF, load_smem, row_layout, tile_transforms,
                                          transposed)
from pallas_kernels.mosaic_stream import (consumer_row, mask_scores, query_kernel, query_pair_ids, run_stream,
                                          stream_barriers, stream_producer, stream_smem, stream_walk, walk_stream)

def _kernel(cnt_ref, bnd_ref, sidx_ref, qpos_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, kc_ref, vc_ref,
            kinfo_ref, cinfo_ref, null_ref, *refs, accumulate: bool, slots: int, halves: int, g: int, bs: int,
            qk_scale: float, scale: float, npairs: int, segs: bool = False, walk: str = "loops",
            split: bool = False):
    *ins, dq_ref, smems, bars = refs
    qseg_ref, ins = (ins[0], ins[1:]) if segs else (None, ins)
    dqacc_ref = ins[0] if accumulate else None
    q_smem, do_smem, k_smem, v_smem, info_smem, qpos_smem, lse_smem, delta_smem = smems
    q_bar, row_bar, k_bar, v_bar, i_bar, k_free, v_free = bars
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
        plgpu.copy_gmem_to_smem(do_ref.at[b, rows, h], do_smem.at[w], q_bar.at[2 + w])
        plgpu.copy_gmem_to_smem(qpos_ref.at[rows], qpos_smem.at[w], row_bar.at[w])
        plgpu.copy_gmem_to_smem(lse_ref.at[b, h, rows], lse_smem.at[w], row_bar.at[2 + w])
        plgpu.copy_gmem_to_smem(delta_ref.at[b, h, rows], delta_smem.at[w], row_bar.at[4 + w])
        if segs:
            plgpu.copy_gmem_to_smem(qseg_ref.at[b, rows], qpos_smem.at[2 + w], row_bar.at[6 + w])
        for j in range(3 + segs):
            plgpu.barrier_wait(row_bar.at[2 * j + w])
        plgpu.barrier_wait(q_bar.at[w])
        plgpu.barrier_wait(q_bar.at[2 + w])
        qpos = load_smem(qpos_smem.at[w], row_layout())
        lse = load_smem(lse_smem.at[w], row_layout())
        lse2 = jnp.where(lse == NEG_INF, 0.0, lse * LOG2E)
        delta = load_smem(delta_smem.at[w], row_layout())
        # per-row vectors broadcast to a step's keys: kv, and (split stream) the consumer's half
        rows_b = {n: tuple(lax.broadcast_in_dim(x, (bs, n), [0]) for x in (qpos, lse2, delta))
                  for n in ({kv, bs} if split else {kv})}
        d = q_smem.shape[-1]
        dq = plgpu.layout_cast(jnp.full((bs, d), 0.0, jnp.float32), plgpu.Layout.WGMMA)

        def wait_next_k(t):
            @pl.when(t + 1 < total)
            def _():
                plgpu.barrier_wait(k_bar.at[lax.rem(t + 1, jnp.int32(slots))])

        def mask(s, slot, masked: bool, thr, keys=()):  # -inf where the key is not this row's
            if not masked:
                return s
            return mask_scores(s, info_smem, slot, thr, rows_b[s.shape[1]][0], qpos_smem.at[2 + w] if segs else None,
                               keys)

        def tile(t, dq, masked: bool, thr, own: bool = False):
            # own: only this consumer's half of the step (split stream's block steps: 64 keys)
            slot = lax.rem(t, jnp.int32(slots))  # its K: waited for under the last dS K
            n = bs if own else kv
            keys = (pl.ds(pl.multiple_of(w * bs, bs), bs),) if own else ()
            k_tile, v_tile = k_smem.at[(slot, *keys)], v_smem.at[(slot, *keys)]
            _, lse2_b, delta_b = rows_b[n]

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem.at[w], transposed(k_tile))
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((bs, n), jnp.float32))  # unscaled: qk_scale folds into the FMA
            plgpu.barrier_wait(i_bar.at[slot])
            plgpu.barrier_wait(v_bar.at[slot])

            def dov(acc_ref):  # P is computed while the dP wgmma runs
                plgpu.wgmma(acc_ref, do_smem.at[w], transposed(v_tile))
                return acc_ref[...], jnp.exp2(mask(s, slot, masked, thr, keys) * qk_scale - lse2_b)

            dp, p = pl.run_scoped(dov, plgpu.ACC((bs, n), jnp.float32))
            plgpu.barrier_arrive(v_free.at[slot])
            ds = (p * (dp - delta_b)).astype(dtype)

            def dsk(acc_ref):
                plgpu.wgmma(acc_ref, ds, k_tile)
                wait_next_k(t)  # the next step's K, while this dS K runs

            dq = pl.run_state(dsk)(plgpu.ACC.init(dq))
            plgpu.barrier_arrive(k_free.at[slot])
            return dq

        def skip(t, dq):  # not this row's step: same waits and arrivals, no math
            slot = lax.rem(t, jnp.int32(slots))
            plgpu.barrier_wait(i_bar.at[slot])
            plgpu.barrier_wait(v_bar.at[slot])
            plgpu.barrier_arrive(v_free.at[slot])
            wait_next_k(t)
            plgpu.barrier_arrive(k_free.at[slot])
            return dq

        @pl.when(total > 0)
        def _():  # the first step's K (each later one is waited for under the dS K before it)
            plgpu.barrier_wait(k_bar.at[0])

        dq = walk_stream(w, bounds, n_union, total, row, tile, skip, dq, walk, split)
        dq = dq * scale
        if accumulate:
            dq = dq + load_smem(dqacc_ref.at[b, rows, h], plgpu.Layout.WGMMA, optimized=False)
        dq_ref[b, rows, h] = dq.astype(dq_ref.dtype)  # rounded once, from the float32 sum

    @pl.when(wg == 2)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")
        stream_producer(b, h, lax.div(h, jnp.array(g, h.dtype)), pair, bs, halves, slots, n_union, total, col0,
                        sidx_ref, k_ref, v_ref, kc_ref, vc_ref, kinfo_ref, cinfo_ref, null_ref, k_smem, v_smem,
                        info_smem, k_bar, v_bar, i_bar, k_free, v_free)



@functools.partial(jax.jit, static_argnames=("sm_scale", "block_size", "slots", "kv_step", "walk", "stream",
                                             "out_dtype", "uniform"))
def mosaic_dq(q, k, v, q_pos, k_pos, index: StepIndex, do, lse, delta, dq_acc=None, *, sm_scale: float,
              block_size: int = 64, slots: int | None = None, kv_step: int = 64, segs=None, walk: str = "loops",
              stream: str = "auto", out_dtype=jnp.float32, uniform: bool = False):
    """``dq [B, Sq, Hq, D]`` of one (query chunk, K/V chunk) pair, plus ``dq_acc`` when given, in
    ``out_dtype`` (float32; the last ring step may ask for q's dtype: the float32 sum is rounded once,
    in the kernel, and no float32 copy of dq is written).
    ``do`` in q's dtype (cast here), ``lse`` / ``delta`` float32 ``[B, Hq, Sq]``; ``segs``: packed
    documents (module docstring); ``kv_step`` / ``slots`` / ``walk`` / ``stream`` as in
    :func:`~pallas_kernels.mosaic_fwd.mosaic_fwd` (``stream="split"`` needs ``kv_step=128``;
    ``"index"`` walks its shared branch with segment loops in 64-key steps: one loop is 5-12 % slower
    in the dQ, results/kernels/kernels.md run 13; the default ``"auto"`` is the split stream in 128-key
    steps on a listed index, ``"shared"`` on a uniform one,
    :data:`pallas_kernels.mosaic_stream.AUTO_STREAM`); ``uniform`` as in the forward."""
    B, sq, H, d = q.shape
    bs = block_size
    nqb = sq // bs
    accumulate = dq_acc is not None
    sg = segs is not None

    def launch(ops, walk_ops, null_info, halves, slots, kv_step, walk, split):
        kernel = functools.partial(_kernel, accumulate=accumulate, slots=slots, halves=halves, g=H // k.shape[2],
                                   bs=bs, qk_scale=float(sm_scale) * LOG2E, scale=float(sm_scale), npairs=nqb // 2,
                                   segs=sg, walk=walk, split=split)
        tr = tile_transforms(q.dtype)
        scratch = [
            (plgpu.SMEM((2, bs, d), q.dtype, transforms=tr),
             plgpu.SMEM((2, bs, d), q.dtype, transforms=tr),
             *stream_smem(slots, kv_step, d, q.dtype, sg),
             plgpu.SMEM((2 + 2 * sg, bs), jnp.int32),
             plgpu.SMEM((2, bs), jnp.float32),
             plgpu.SMEM((2, bs), jnp.float32)),
            (plgpu.Barrier(num_barriers=4), plgpu.Barrier(num_barriers=6 + 2 * sg),
             *stream_barriers(slots, halves, sg)),
        ]
        args = [ops.counts, walk_ops.bounds, walk_ops.block_idx, q_pos.astype(jnp.int32), q, do.astype(q.dtype),
                lse.astype(jnp.float32), delta.astype(jnp.float32), k, v, ops.kc, ops.vc, ops.k_info, ops.c_info,
                null_info]
        if sg:
            args.append(segs[0].astype(jnp.int32))
        if accumulate:
            args.append(dq_acc.astype(jnp.float32))
        return query_kernel(kernel, "mosaic_dq", jax.ShapeDtypeStruct((B, sq, H, d), out_dtype), scratch, args,
                            nqb // 2, H, B)

    return run_stream(launch, index, k, v, q_pos, k_pos, bs, segs, kv_step, slots, walk, stream, uniform, "dq")
