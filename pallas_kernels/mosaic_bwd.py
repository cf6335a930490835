"""Pallas Mosaic GPU (Hopper) backward, dQ pass: query-stationary over the forward's tile walk.

Contract of :func:`pallas_kernels.triton_backward.dq_pass` (FlashAttention-2, Dao 2023, Alg. 2 with
the final ``lse`` and ``delta = rowsum(dO * O)``): for every tile the forward attends,
``P = exp(S - lse)``, ``dP = dO V^T``, ``dS = P * (dP - delta)``, ``dQ += scale * dS K``; the result
is added to ``dq_acc`` when given (ring steps). Same CTA structure and tile operands as the forward
(:mod:`pallas_kernels.mosaic_fwd`, :mod:`pallas_kernels.mosaic_index`): two consumer warpgroups,
one 64-row query block each, with ``Q`` and ``dO`` resident in shared memory; one producer
warpgroup TMA-loading K, V and ``info`` tiles. Three ``wgmma`` per tile (``Q K^T``, ``dO V^T``,
``dS K``); the K slot is released after the third, the V slot after the second.
The dK/dV passes stay on the Triton kernels (:mod:`pallas_kernels.backend_mosaic`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.index_format import StepIndex
from pallas_kernels.mosaic_fwd import (LOG2E, _NEG_INF, _col_layout, _load, _producer_loop, _row_layout,
                                       _tile_transforms, _transposed)
from pallas_kernels.mosaic_index import prepare


def _kernel(cnt_ref, bidx_ref, qpos_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, kc_ref, vc_ref,
            kinfo_ref, cinfo_ref, *refs, accumulate: bool, stages: int, g: int, bs: int, qk_scale: float,
            scale: float, npairs: int):
    *ins, dq_ref, smems, bars = refs
    dqacc_ref = ins[0] if accumulate else None
    q_smem, do_smem, k_smem, v_smem, info_smem, qpos_smem, lse_smem, delta_smem = smems
    q_bar, row_bar, k_bar, v_bar, i_bar, k_free, v_free = bars
    b = lax.axis_index("b")
    h = lax.axis_index("h")
    pair = npairs - 1 - lax.axis_index("p")
    wg = lax.axis_index("wg")
    dtype = q_ref.dtype

    def row_counts(w):
        i = 2 * pair + w
        n_free, n_blk, ncol = cnt_ref[b, h, i, 0], cnt_ref[b, h, i, 1], cnt_ref[b, h, i, 2]
        return i, n_free, n_blk, ncol, n_blk + lax.div(ncol + jnp.int32(bs - 1), jnp.int32(bs))

    @pl.when(wg < 2)
    def _consumer():
        plgpu.set_max_registers(232, action="increase")
        w = wg
        i, n_free, n_blk, ncol, ntiles = row_counts(w)
        rows = pl.ds(i * bs, bs)
        plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], q_smem.at[w], q_bar.at[w])
        plgpu.copy_gmem_to_smem(do_ref.at[b, rows, h], do_smem.at[w], q_bar.at[2 + w])
        plgpu.copy_gmem_to_smem(qpos_ref.at[rows], qpos_smem.at[w], row_bar.at[w])
        plgpu.copy_gmem_to_smem(lse_ref.at[b, h, rows], lse_smem.at[w], row_bar.at[2 + w])
        plgpu.copy_gmem_to_smem(delta_ref.at[b, h, rows], delta_smem.at[w], row_bar.at[4 + w])
        for j in range(3):
            plgpu.barrier_wait(row_bar.at[2 * j + w])
        plgpu.barrier_wait(q_bar.at[w])
        plgpu.barrier_wait(q_bar.at[2 + w])
        qpos_b = lax.broadcast_in_dim(_load(qpos_smem.at[w], _row_layout()), (bs, bs), [0])
        lse = _load(lse_smem.at[w], _row_layout())
        lse2_b = lax.broadcast_in_dim(jnp.where(lse == _NEG_INF, 0.0, lse * LOG2E), (bs, bs), [0])
        delta_b = lax.broadcast_in_dim(_load(delta_smem.at[w], _row_layout()), (bs, bs), [0])
        d = q_smem.shape[-1]
        dq = plgpu.layout_cast(jnp.full((bs, d), 0.0, jnp.float32), plgpu.Layout.WGMMA)

        def tile(t, dq, masked: bool, thr):
            slot = w * stages + lax.rem(t, jnp.int32(stages))
            plgpu.barrier_wait(k_bar.at[slot])

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem.at[w], _transposed(k_smem.at[slot]))
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((bs, bs), jnp.float32)) * qk_scale
            plgpu.barrier_wait(i_bar.at[slot])
            if masked:
                pos = lax.broadcast_in_dim(_load(info_smem.at[slot, 0], _col_layout()), (bs, bs), [1])
                aux = lax.broadcast_in_dim(_load(info_smem.at[slot, 1], _col_layout()), (bs, bs), [1])
                s = jnp.where((pos <= qpos_b) & (aux >= thr), s, _NEG_INF)
            p = jnp.exp2(s - lse2_b)
            plgpu.barrier_wait(v_bar.at[slot])

            def dov(acc_ref):
                plgpu.wgmma(acc_ref, do_smem.at[w], _transposed(v_smem.at[slot]))
                return acc_ref[...]

            dp = pl.run_scoped(dov, plgpu.ACC((bs, bs), jnp.float32))
            plgpu.barrier_arrive(v_free.at[slot])
            ds = (p * (dp - delta_b)).astype(dtype)

            def dsk(acc_ref):
                plgpu.wgmma(acc_ref, ds, k_smem.at[slot])

            dq = pl.run_state(dsk)(plgpu.ACC.init(dq))
            plgpu.barrier_arrive(k_free.at[slot])
            return dq

        dq = lax.fori_loop(0, n_free, functools.partial(tile, masked=False, thr=None), dq)
        dq = lax.fori_loop(n_free, n_blk, functools.partial(tile, masked=True, thr=ncol), dq)
        dq = lax.fori_loop(n_blk, ntiles, functools.partial(tile, masked=True, thr=1 - ncol), dq)
        dq = dq * scale
        if accumulate:
            dq = dq + _load(dqacc_ref.at[b, rows, h], plgpu.Layout.WGMMA, optimized=False)
        dq_ref[b, rows, h] = dq

    @pl.when(wg == 2)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")
        _producer_loop([row_counts(w) for w in range(2)], b, h, lax.div(h, jnp.array(g, h.dtype)), bs, stages,
                       bidx_ref, k_ref, v_ref, kc_ref, vc_ref, kinfo_ref, cinfo_ref,
                       k_smem, v_smem, info_smem, k_bar, v_bar, i_bar, k_free, v_free)


_STATIC = ("sm_scale", "block_size", "stages")


@functools.partial(jax.jit, static_argnames=_STATIC)
def mosaic_dq(q, k, v, q_pos, k_pos, index: StepIndex, do, lse, delta, dq_acc=None, *, sm_scale: float,
              block_size: int = 64, stages: int = 2):
    """``dq f32 [B, Sq, Hq, D]`` of one (query chunk, K/V chunk) pair, plus ``dq_acc`` when given.
    ``do`` in q's dtype (cast here), ``lse`` / ``delta`` float32 ``[B, Hq, Sq]``."""
    B, sq, H, d = q.shape
    bs = block_size
    nqb = sq // bs
    ops = prepare(index, k, v, k_pos, bs)
    accumulate = dq_acc is not None
    kernel = functools.partial(_kernel, accumulate=accumulate, stages=stages, g=H // k.shape[2], bs=bs,
                               qk_scale=float(sm_scale) * LOG2E, scale=float(sm_scale), npairs=nqb // 2)
    tr = _tile_transforms(q.dtype)
    scratch = [
        (plgpu.SMEM((2, bs, d), q.dtype, transforms=tr),
         plgpu.SMEM((2, bs, d), q.dtype, transforms=tr),
         plgpu.SMEM((2 * stages, bs, d), q.dtype, transforms=tr),
         plgpu.SMEM((2 * stages, bs, d), q.dtype, transforms=tr),
         plgpu.SMEM((2 * stages, 2, bs), jnp.int32),
         plgpu.SMEM((2, bs), jnp.int32),
         plgpu.SMEM((2, bs), jnp.float32),
         plgpu.SMEM((2, bs), jnp.float32)),
        (plgpu.Barrier(num_barriers=4), plgpu.Barrier(num_barriers=6),
         plgpu.Barrier(num_barriers=2 * stages), plgpu.Barrier(num_barriers=2 * stages),
         plgpu.Barrier(num_barriers=2 * stages),
         plgpu.Barrier(num_barriers=2 * stages), plgpu.Barrier(num_barriers=2 * stages)),
    ]
    args = [ops.counts, ops.block_idx, q_pos.astype(jnp.int32), q, do.astype(q.dtype), lse.astype(jnp.float32),
            delta.astype(jnp.float32), k, v, ops.kc, ops.vc, ops.k_info, ops.c_info]
    if accumulate:
        args.append(dq_acc.astype(jnp.float32))
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((B, sq, H, d), jnp.float32),
        scratch_types=scratch,
        grid=(nqb // 2, H, B),
        grid_names=("p", "h", "b"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(*args)
