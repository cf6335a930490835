"""Pallas Mosaic GPU (Hopper) backward: the dQ pass and the dK/dV block pass.

Contract of :func:`pallas_kernels.triton_backward.dq_pass` (FlashAttention-2, Dao 2023, Alg. 2 with
the final ``lse`` and ``delta = rowsum(dO * O)``): for every tile the forward attends,
``P = exp(S - lse)``, ``dP = dO V^T``, ``dS = P * (dP - delta)``, ``dQ += scale * dS K``; the result
is added to ``dq_acc`` when given (ring steps). Same CTA structure and tile operands as the forward
(:mod:`pallas_kernels.mosaic_fwd`, :mod:`pallas_kernels.mosaic_index`): two consumer warpgroups,
one 64-row query block each, with ``Q`` and ``dO`` resident in shared memory; one producer
warpgroup TMA-loading K, V and ``info`` tiles. Three ``wgmma`` per tile (``Q K^T``, ``dO V^T``,
``dS K``); the K slot is released after the third, the V slot after the second.

The dK/dV block pass (:func:`mosaic_dkv_blocks`, contract of
:func:`pallas_kernels.triton_backward.dkv_block_pass`) is KV-stationary over
:func:`pallas_kernels.mosaic_index.kv_schedule`: CTA ``(p, hk, b)`` owns KV blocks ``2p`` and
``2p + 1`` of KV head ``hk``; each consumer warpgroup keeps its block's K and V in shared memory
and walks the (query head of the group, query block) tiles that list it, so GQA is reduced in
registers and dK/dV are written once per KV head, without atomics. The producer TMA-loads each
tile's ``Q``, ``dO``, ``(lse, delta)`` and query positions. Four ``wgmma`` per tile: ``S^T = K Q^T``,
``dP^T = V dO^T``, ``dV += P^T dO`` (``P^T`` from registers), ``dK += dS^T Q``. The vertical
columns' dK/dV stay on the Triton column pass (:mod:`pallas_kernels.backend_mosaic`).
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
from pallas_kernels.mosaic_index import kv_schedule, prepare


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


def _dkv_kernel(cnt_ref, sched_ref, qpos_ref, kpos_ref, q_ref, do_ref, rinfo_ref, k_ref, v_ref, dk_ref, dv_ref,
                smems, bars, *, stages: int, g: int, bs: int, nqb: int, qk_scale: float, scale: float):
    kres, vres, q_smem, do_smem, r_smem, qp_smem, kp_smem = smems
    kv_bar, q_bar, do_bar, r_bar, qp_bar, q_free, do_free = bars
    b = lax.axis_index("b")
    hk = lax.axis_index("h")
    pair = lax.axis_index("p")  # the first KV blocks are listed by the most query blocks: heavy first
    wg = lax.axis_index("wg")
    dtype = q_ref.dtype

    def walk(w):
        j = 2 * pair + w
        return j, cnt_ref[b, hk, j, 0], cnt_ref[b, hk, j, 1]

    @pl.when(wg < 2)
    def _consumer():
        plgpu.set_max_registers(232, action="increase")
        w = wg
        j, n_free, n_all = walk(w)
        rows = pl.ds(j * bs, bs)
        plgpu.copy_gmem_to_smem(k_ref.at[b, rows, hk], kres.at[w], kv_bar.at[w])
        plgpu.copy_gmem_to_smem(v_ref.at[b, rows, hk], vres.at[w], kv_bar.at[2 + w])
        plgpu.copy_gmem_to_smem(kpos_ref.at[rows], kp_smem.at[w], kv_bar.at[4 + w])
        for x in range(3):
            plgpu.barrier_wait(kv_bar.at[2 * x + w])
        kpos_b = lax.broadcast_in_dim(_load(kp_smem.at[w], _row_layout()), (bs, bs), [0])
        d = kres.shape[-1]
        zeros = plgpu.layout_cast(jnp.full((bs, d), 0.0, jnp.float32), plgpu.Layout.WGMMA)

        def tile(t, carry, masked: bool):
            dk, dv = carry
            slot = w * stages + lax.rem(t, jnp.int32(stages))
            plgpu.barrier_wait(q_bar.at[slot])

            def kq(acc_ref):
                plgpu.wgmma(acc_ref, kres.at[w], _transposed(q_smem.at[slot]))
                return acc_ref[...]

            st = pl.run_scoped(kq, plgpu.ACC((bs, bs), jnp.float32)) * qk_scale  # [kv, q], log2 domain
            plgpu.barrier_wait(r_bar.at[slot])
            plgpu.barrier_wait(qp_bar.at[slot])
            if masked:
                qpos = lax.broadcast_in_dim(_load(qp_smem.at[slot], _col_layout()), (bs, bs), [1])
                st = jnp.where(kpos_b <= qpos, st, _NEG_INF)
            lse2 = lax.broadcast_in_dim(_load(r_smem.at[slot, 0], _col_layout()), (bs, bs), [1])
            pt = jnp.exp2(st - lse2)
            plgpu.barrier_wait(do_bar.at[slot])

            def vdo(acc_ref):
                plgpu.wgmma(acc_ref, vres.at[w], _transposed(do_smem.at[slot]))
                return acc_ref[...]

            dpt = pl.run_scoped(vdo, plgpu.ACC((bs, bs), jnp.float32))

            def pdo(acc_ref):
                plgpu.wgmma(acc_ref, pt.astype(dtype), do_smem.at[slot])

            dv = pl.run_state(pdo)(plgpu.ACC.init(dv))
            plgpu.barrier_arrive(do_free.at[slot])
            delta = lax.broadcast_in_dim(_load(r_smem.at[slot, 1], _col_layout()), (bs, bs), [1])
            dst = (pt * (dpt - delta)).astype(dtype)

            def dsq(acc_ref):
                plgpu.wgmma(acc_ref, dst, q_smem.at[slot])

            dk = pl.run_state(dsq)(plgpu.ACC.init(dk))
            plgpu.barrier_arrive(q_free.at[slot])
            return dk, dv

        carry = lax.fori_loop(0, n_free, functools.partial(tile, masked=False), (zeros, zeros))
        dk, dv = lax.fori_loop(n_free, n_all, functools.partial(tile, masked=True), carry)
        dk_ref[b, rows, hk] = dk * scale
        dv_ref[b, rows, hk] = dv

    @pl.when(wg == 2)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")
        walks = [walk(w) for w in range(2)]

        @pl.loop(0, jnp.maximum(walks[0][2], walks[1][2]))
        def _(t):
            for w in range(2):
                j, _, n_all = walks[w]

                @pl.when(t < n_all)
                def _():
                    slot = w * stages + lax.rem(t, jnp.int32(stages))
                    e = sched_ref[b, hk, j, t]
                    jq = lax.div(e, jnp.int32(nqb))
                    qb = e - jq * nqb
                    h = hk * g + jq
                    rows = pl.ds(qb * bs, bs)

                    @pl.when(t >= stages)
                    def _():
                        plgpu.barrier_wait(q_free.at[slot])

                    plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], q_smem.at[slot], q_bar.at[slot])
                    plgpu.copy_gmem_to_smem(rinfo_ref.at[b, h, qb], r_smem.at[slot], r_bar.at[slot])
                    plgpu.copy_gmem_to_smem(qpos_ref.at[rows], qp_smem.at[slot], qp_bar.at[slot])

                    @pl.when(t >= stages)
                    def _():
                        plgpu.barrier_wait(do_free.at[slot])

                    plgpu.copy_gmem_to_smem(do_ref.at[b, rows, h], do_smem.at[slot], do_bar.at[slot])


@functools.partial(jax.jit, static_argnames=_STATIC)
def mosaic_dkv_blocks(q, k, v, q_pos, k_pos, index: StepIndex, do, lse, delta, *, sm_scale: float,
                      block_size: int = 64, stages: int = 2):
    """Backward block pass: ``(dk, dv) f32 [B, Sk, Hkv, D]`` of the active blocks (every causal pair
    of each listed block tile), summed over each KV head's group of query heads. ``Sk`` a multiple
    of 128. ``do`` in q's dtype (cast here), ``lse`` / ``delta`` float32 ``[B, Hq, Sq]``."""
    B, sq, H, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    bs = block_size
    nqb, nkb = sq // bs, sk // bs
    sched, counts = kv_schedule(index, sk, hkv, bs)
    lse = lse.astype(jnp.float32)
    lse2 = jnp.where(lse == _NEG_INF, 0.0, lse * LOG2E)
    rinfo = jnp.stack([lse2.reshape(B, H, nqb, bs), delta.astype(jnp.float32).reshape(B, H, nqb, bs)], axis=3)
    kernel = functools.partial(_dkv_kernel, stages=stages, g=H // hkv, bs=bs, nqb=nqb,
                               qk_scale=float(sm_scale) * LOG2E, scale=float(sm_scale))
    tr = _tile_transforms(q.dtype)
    nb = 2 * stages
    scratch = [
        (plgpu.SMEM((2, bs, d), q.dtype, transforms=tr),
         plgpu.SMEM((2, bs, d), q.dtype, transforms=tr),
         plgpu.SMEM((nb, bs, d), q.dtype, transforms=tr),
         plgpu.SMEM((nb, bs, d), q.dtype, transforms=tr),
         plgpu.SMEM((nb, 2, bs), jnp.float32),
         plgpu.SMEM((nb, bs), jnp.int32),
         plgpu.SMEM((2, bs), jnp.int32)),
        (plgpu.Barrier(num_barriers=6), plgpu.Barrier(num_barriers=nb), plgpu.Barrier(num_barriers=nb),
         plgpu.Barrier(num_barriers=nb), plgpu.Barrier(num_barriers=nb), plgpu.Barrier(num_barriers=nb),
         plgpu.Barrier(num_barriers=nb)),
    ]
    out = jax.ShapeDtypeStruct((B, sk, hkv, d), jnp.float32)
    dk, dv = plgpu.kernel(
        kernel,
        out_type=[out, out],
        scratch_types=scratch,
        grid=(nkb // 2, hkv, B),
        grid_names=("p", "h", "b"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(counts, sched, q_pos.astype(jnp.int32), k_pos.astype(jnp.int32), q, do.astype(q.dtype), rinfo, k, v)
    return dk, dv
