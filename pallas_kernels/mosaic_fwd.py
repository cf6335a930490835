"""Pallas Mosaic GPU (Hopper: wgmma + TMA, warp-specialised) block-sparse flash-attention forward.

Same contract as :func:`pallas_kernels.triton_kernels.pallas_fwd` (MTraining Algorithm 1 on the
per-step :class:`~pallas_kernels.index_format.StepIndex`; causal by global position; empty rows
give out 0 / lse -inf; given ``acc`` the result is merged into the earlier ring steps' float32
``(out, lse)``), on the tiles of :mod:`pallas_kernels.mosaic_index`.

Structure (FlashAttention-3 style, one CTA = 3 warpgroups):

* CTA ``(p, h, b)`` owns query blocks ``2p`` and ``2p + 1`` of head ``h`` (pairs walked from the
  last: causal rows get heavier with position, so the heavy ones start first);
* warpgroups 0 and 1 are consumers, one 64-row query block each, with its own tile walk:
  free block tiles (no mask), masked block tiles, free column tiles (whole tile in the row's prefix
  and causal), then masked column tiles; ``S = q K^T`` by ``wgmma``
  from shared memory, online softmax in float32 (``exp2``, log2-domain running max), ``P V`` by
  ``wgmma`` with ``P`` from registers; the two take turns on the tensor cores (a shared
  "schedule" barrier, FlashAttention-3's ping-pong): one's softmax runs under the other's
  ``wgmma``, and the one whose walk ends first keeps taking turns until the other's ends;
* warpgroup 2 is the producer: it TMA-loads each consumer's K, V and ``info`` tiles, at offsets
  read from the index at run time, into a ``stages``-deep ring of shared-memory slots per consumer,
  and waits on the consumer's "slot free" barriers before reusing a slot.

Packed documents (``segs``, index narrowed by ``apply_segments``): ``info`` tiles carry the keys'
segment ids as a third row and each consumer TMA-loads its 64 queries' segment ids; masked tiles
add ``seg == q_seg`` to their mask, free tiles (inside one document) stay mask-free.

``out`` (float32) is written from registers straight to global memory (each quad of threads
stores 32 contiguous bytes), ``lse`` through shared memory and TMA.
Supported: bf16 / f16 inputs, head_dim 64 or 128, block size 64, ``Sq`` a multiple of 128,
compute capability 9.x (see :mod:`pallas_kernels.backend_mosaic`).
"""

from __future__ import annotations

import functools
import inspect
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.index_format import StepIndex
from pallas_kernels.mosaic_index import MosaicOperands, prepare

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
_NEG_INF = float("-inf")


def _row_layout():
    """Layout of a per-row vector of a ``[64, n]`` wgmma tile (name differs across JAX versions)."""
    return getattr(plgpu.Layout, "WGMMA_ROW", None) or plgpu.Layout.WGMMA.reduce(1)


def _col_layout():
    """Layout of a per-column vector of a ``[64, n]`` wgmma tile."""
    return getattr(plgpu.Layout, "WGMMA_COL", None) or plgpu.Layout.WGMMA.reduce(0)


_LOAD_HAS_OPTIMIZED = "optimized" in inspect.signature(plgpu.load).parameters


def _load(ref, layout, optimized: bool = True):
    if _LOAD_HAS_OPTIMIZED and not optimized:
        return plgpu.load(ref, (), layout=layout, optimized=False)
    return plgpu.load(ref, (), layout=layout)


def _transposed(ref):
    fn = getattr(plgpu, "transpose_ref", None)
    return fn(ref, (1, 0)) if fn is not None else ref.transpose((1, 0))


def _tile_transforms(dtype):
    swizzle = 128
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))


def _online_softmax(carry, s, masked: bool, scale: float):
    """One online-softmax step on raw scores ``s [64, n]`` (``-inf`` = masked) whose log2-domain
    value is ``s * scale`` (``scale > 0``: the maximum is taken before scaling and the scale folds
    into the exponent's FMA). Returns ``(p, alpha, m_new, l_new)`` for ``acc = acc * alpha + p @ V``,
    with ``m`` in the log2 domain."""
    m, l = carry
    m_new = jnp.maximum(m, s.max(axis=1) * scale)
    m_safe = jnp.where(m_new == _NEG_INF, 0.0, m_new) if masked else m_new
    alpha = jnp.exp2(m - m_safe)
    p = jnp.exp2(s * scale - lax.broadcast_in_dim(m_safe, s.shape, [0]))
    l_new = l * alpha + p.sum(axis=1)
    return p, alpha, m_new, l_new


def _finish(acc, m, l, merge_prev):
    """Normalise (or merge with the earlier steps' ``(out_prev, lse_prev)``): ``(out, lse)``."""
    nonempty = l > 0.0
    l_safe = jnp.where(nonempty, l, 1.0)
    lse2 = jnp.where(nonempty, m + jnp.log(l_safe) * LOG2E, _NEG_INF)
    if merge_prev is None:
        out = acc * lax.broadcast_in_dim(1.0 / l_safe, acc.shape, [0])
        return out, lse2 * LN2
    out_prev, lse_prev = merge_prev
    lp = lse_prev * LOG2E
    mm = jnp.maximum(lp, lse2)
    mm = jnp.where(mm == _NEG_INF, 0.0, mm)
    wp = jnp.exp2(lp - mm)
    wn = jnp.where(nonempty, jnp.exp2(m - mm), 0.0)
    den = wp + wn * l
    empty = den == 0.0
    inv = 1.0 / jnp.where(empty, 1.0, den)
    out = (out_prev * lax.broadcast_in_dim(wp * inv, acc.shape, [0])
           + acc * lax.broadcast_in_dim(wn * inv, acc.shape, [0]))
    lse = jnp.where(empty, _NEG_INF, (mm + jnp.log(jnp.where(empty, 1.0, den)) * LOG2E) * LN2)
    return out, lse


def _query_pair_ids(npairs: int):
    """``(b, h, pair, wg)`` of a query-side kernel's CTA (forward, dQ): pairs of query blocks are
    walked from the last, since causal rows get heavier with position (heavy CTAs start first)."""
    return lax.axis_index("b"), lax.axis_index("h"), npairs - 1 - lax.axis_index("p"), lax.axis_index("wg")


def _row_walk(cnt_ref, b, h, pair, bs: int):
    """``walk(w)``: consumer ``w``'s query block ``i`` and its walk ``(i, n_free, n_blocks, col_count,
    n_tiles, n_free_col_tiles)`` from :class:`~pallas_kernels.mosaic_index.MosaicOperands` ``counts``."""

    def walk(w):
        i = 2 * pair + w
        n_free, n_blk, ncol = cnt_ref[b, h, i, 0], cnt_ref[b, h, i, 1], cnt_ref[b, h, i, 2]
        return i, n_free, n_blk, ncol, n_blk + lax.div(ncol + jnp.int32(bs - 1), jnp.int32(bs)), cnt_ref[b, h, i, 3]

    return walk


def _segment_ok(info_smem, slot, qseg_smem, bs: int):
    """``bool [64, bs]`` of a masked tile with packed documents: the tile's keys (segment row 2 of
    its ``info``) lie in the document of the consumer's query rows (``qseg_smem [bs]``)."""
    kseg = lax.broadcast_in_dim(_load(info_smem.at[slot, 2], _col_layout()), (bs, bs), [1])
    qseg = lax.broadcast_in_dim(_load(qseg_smem, _row_layout()), (bs, bs), [0])
    return kseg == qseg


def _kernel(cnt_ref, bidx_ref, qpos_ref, q_ref, k_ref, v_ref, kc_ref, vc_ref, kinfo_ref, cinfo_ref, *refs,
            merge: bool, stages: int, g: int, bs: int, qk_scale: float, npairs: int, segs: bool = False):
    *ins, out_ref, lse_ref, smems, bars = refs
    qseg_ref, ins = (ins[0], ins[1:]) if segs else (None, ins)
    oprev_ref, lprev_ref = ins if merge else (None, None)
    q_smem, k_smem, v_smem, info_smem, row_smem, lse_smem = smems
    q_bar, row_bar, k_bar, v_bar, i_bar, k_free, v_free, sched_bar = bars
    b, h, pair, wg = _query_pair_ids(npairs)
    dtype = q_ref.dtype
    row_counts = _row_walk(cnt_ref, b, h, pair, bs)

    @pl.when(wg < 2)
    def _consumer():
        plgpu.set_max_registers(232, action="increase")
        w = wg
        i, n_free, n_blk, ncol, ntiles, n_cfree = row_counts(w)
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
        qpos = _load(row_smem.at[w], _row_layout())
        qpos_b = lax.broadcast_in_dim(qpos, (bs, bs), [0])
        d = q_smem.shape[-1]
        acc = plgpu.layout_cast(jnp.full((bs, d), 0.0, jnp.float32), plgpu.Layout.WGMMA)
        m = plgpu.layout_cast(jnp.full((bs,), _NEG_INF, jnp.float32), _row_layout())
        l = plgpu.layout_cast(jnp.full((bs,), 0.0, jnp.float32), _row_layout())

        def schedule():  # both consumers' turn-taking (FlashAttention-3 "ping-pong")
            plgpu.barrier_arrive(sched_bar)
            plgpu.barrier_wait(sched_bar)

        def tile(t, carry, masked: bool, thr):
            acc, m, l = carry
            slot = w * stages + lax.rem(t, jnp.int32(stages))  # its K: waited for under the last P V

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem.at[w], _transposed(k_smem.at[slot]))
                schedule()  # the other consumer's softmax runs under this wgmma
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((bs, bs), jnp.float32))  # unscaled: qk_scale folds into FMAs
            plgpu.barrier_wait(i_bar.at[slot])
            if masked:
                pos = lax.broadcast_in_dim(_load(info_smem.at[slot, 0], _col_layout()), (bs, bs), [1])
                aux = lax.broadcast_in_dim(_load(info_smem.at[slot, 1], _col_layout()), (bs, bs), [1])
                ok = (pos <= qpos_b) & (aux >= thr)
                if segs:
                    ok = ok & _segment_ok(info_smem, slot, row_smem.at[2 + w], bs)
                s = jnp.where(ok, s, _NEG_INF)
            plgpu.barrier_arrive(k_free.at[slot])
            p, alpha, m, l = _online_softmax((m, l), s, masked, qk_scale)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            p16 = p.astype(dtype)
            # the softmax's results are complete before the turn passes (as in JAX's attention_mgpu)
            acc, l, m, p16 = lax.optimization_barrier((acc, l, m, p16))
            plgpu.barrier_arrive(sched_bar)  # softmax done
            plgpu.barrier_wait(v_bar.at[slot])
            plgpu.barrier_wait(sched_bar)  # the tensor cores are ours

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p16, v_smem.at[slot])

                @pl.when(t + 1 < ntiles)
                def _():  # wait for the next tile's K while this P V runs
                    plgpu.barrier_wait(k_bar.at[w * stages + lax.rem(t + 1, jnp.int32(stages))])

            acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m, l

        carry = (acc, m, l)

        @pl.when(ntiles > 0)
        def _():  # the first tile's K (each later one is waited for under the P V before it)
            plgpu.barrier_wait(k_bar.at[w * stages])

        pl.when(w == 1)(schedule)  # consumer 0 goes first
        carry = lax.fori_loop(0, n_free, functools.partial(tile, masked=False, thr=None), carry)
        carry = lax.fori_loop(n_free, n_blk, functools.partial(tile, masked=True, thr=ncol), carry)
        carry = lax.fori_loop(n_blk, n_blk + n_cfree, functools.partial(tile, masked=False, thr=None), carry)
        carry = lax.fori_loop(n_blk + n_cfree, ntiles, functools.partial(tile, masked=True, thr=1 - ncol), carry)

        @pl.loop(ntiles, jnp.maximum(ntiles, row_counts(1 - w)[4]))
        def _(t):  # keep the turn-taking in step while the other consumer's walk is longer
            schedule()
            schedule()

        pl.when(w == 0)(schedule)
        acc, m, l = carry
        prev = None
        if merge:
            plgpu.barrier_wait(row_bar.at[2 + w])
            prev = (_load(oprev_ref.at[b, rows, h], plgpu.Layout.WGMMA, optimized=False),
                    _load(lse_smem.at[w], _row_layout()))
        out, lse = _finish(acc, m, l, prev)
        out_ref[b, rows, h] = out
        lse_smem.at[w][...] = lse
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(lse_smem.at[w], lse_ref.at[b, h, rows])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")
        _producer_loop([row_counts(w) for w in range(2)], b, h, lax.div(h, jnp.array(g, h.dtype)), bs, stages,
                       bidx_ref, k_ref, v_ref, kc_ref, vc_ref, kinfo_ref, cinfo_ref,
                       k_smem, v_smem, info_smem, k_bar, v_bar, i_bar, k_free, v_free)


def _producer_loop(walks, b, h, hk, bs, stages, bidx_ref, k_ref, v_ref, kc_ref, vc_ref, kinfo_ref, cinfo_ref,
                   k_smem, v_smem, info_smem, k_bar, v_bar, i_bar, k_free, v_free):
    """The producer warpgroup's loop, shared by the forward and the dQ pass: for tile ``t`` of each
    consumer ``w`` (``walks[w] = (query block, n_free, n_blocks, col_count, n_tiles, n_free_col_tiles)``), wait until the
    consumer has freed slot ``w * stages + t % stages`` (from ``t >= stages`` on), then TMA-load the
    tile's K (+ its ``info``) and V: block ``bidx[t]`` of ``k/v`` for ``t < n_blocks``, else column tile
    ``t - n_blocks`` of ``kc/vc``."""

    def load(t, i, n_blk, ref_blk, ref_col, info, dst, bar):
        @pl.when(t < n_blk)
        def _():
            kb = bidx_ref[b, h, i, t]
            plgpu.copy_gmem_to_smem(ref_blk.at[b, pl.ds(kb * bs, bs), hk], dst, bar)
            if info is not None:
                plgpu.copy_gmem_to_smem(kinfo_ref.at[b, h, kb], info[0], info[1])

        @pl.when(t >= n_blk)
        def _():
            c = t - n_blk
            plgpu.copy_gmem_to_smem(ref_col.at[b, h, pl.ds(c * bs, bs)], dst, bar)
            if info is not None:
                plgpu.copy_gmem_to_smem(cinfo_ref.at[b, h, c], info[0], info[1])

    @pl.loop(0, jnp.maximum(walks[0][4], walks[1][4]))
    def _(t):
        for w in range(2):
            i, _, n_blk, _, ntiles, _ = walks[w]

            @pl.when(t < ntiles)
            def _():
                slot = w * stages + lax.rem(t, jnp.int32(stages))

                @pl.when(t >= stages)
                def _():
                    plgpu.barrier_wait(k_free.at[slot])

                load(t, i, n_blk, k_ref, kc_ref, (info_smem.at[slot], i_bar.at[slot]), k_smem.at[slot], k_bar.at[slot])

                @pl.when(t >= stages)
                def _():
                    plgpu.barrier_wait(v_free.at[slot])

                load(t, i, n_blk, v_ref, vc_ref, None, v_smem.at[slot], v_bar.at[slot])


_STATIC = ("sm_scale", "block_size", "stages")


@functools.partial(jax.jit, static_argnames=_STATIC)
def mosaic_fwd(q, k, v, q_pos, k_pos, index: StepIndex, acc=None, *, sm_scale: float, block_size: int = 64,
               stages: int = 2, segs=None):
    """Forward kernel; shapes as in :mod:`pallas_kernels.api`. Returns ``(out f32 [B, Sq, Hq, D],
    lse f32 [B, Hq, Sq])``, merged with ``acc = (out_prev, lse_prev)`` when given. ``segs = (q_seg
    [B, Sq], k_seg [B, Sk])``: packed documents, ``index`` narrowed by ``apply_segments``."""
    B, sq, H, d = q.shape
    bs = block_size
    nqb = sq // bs
    ops: MosaicOperands = prepare(index, k, v, k_pos, bs, q_pos, segs)
    merge = acc is not None
    sg = segs is not None
    kernel = functools.partial(_kernel, merge=merge, stages=stages, g=H // k.shape[2], bs=bs,
                               qk_scale=float(sm_scale) * LOG2E, npairs=nqb // 2, segs=sg)
    tr = _tile_transforms(q.dtype)
    scratch = [
        (plgpu.SMEM((2, bs, d), q.dtype, transforms=tr),
         plgpu.SMEM((2 * stages, bs, d), q.dtype, transforms=tr),
         plgpu.SMEM((2 * stages, bs, d), q.dtype, transforms=tr),
         plgpu.SMEM((2 * stages, 2 + sg, bs), jnp.int32),
         plgpu.SMEM((2 + 2 * sg, bs), jnp.int32),
         plgpu.SMEM((2, bs), jnp.float32)),
        (plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=4 + 2 * sg),
         plgpu.Barrier(num_barriers=2 * stages), plgpu.Barrier(num_barriers=2 * stages),
         plgpu.Barrier(num_barriers=2 * stages),
         plgpu.Barrier(num_barriers=2 * stages), plgpu.Barrier(num_barriers=2 * stages),
         plgpu.Barrier(num_arrivals=2)),
    ]
    args = [ops.counts, ops.block_idx, q_pos.astype(jnp.int32), q, k, v, ops.kc, ops.vc, ops.k_info, ops.c_info]
    if sg:
        args.append(segs[0].astype(jnp.int32))
    if merge:
        args += [acc[0].astype(jnp.float32), acc[1].astype(jnp.float32)]
    out, lse = plgpu.kernel(
        kernel,
        out_type=[jax.ShapeDtypeStruct((B, sq, H, d), jnp.float32), jax.ShapeDtypeStruct((B, H, sq), jnp.float32)],
        scratch_types=scratch,
        grid=(nqb // 2, H, B),
        grid_names=("p", "h", "b"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(*args)
    return out, lse
