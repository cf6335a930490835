"""Pallas Mosaic GPU (Hopper) backward: the two dK/dV passes.

Contracts of :mod:`pallas_kernels.triton_backward` (FlashAttention-2, Dao 2023, Alg. 2, from the
final ``lse`` and ``delta = rowsum(dO * O)``):

* :func:`mosaic_dkv_blocks` (:func:`~pallas_kernels.triton_backward.dkv_block_pass`):
  KV-stationary; CTA ``(p, hk, b)`` owns KV blocks ``2p``, ``2p + 1`` of KV head ``hk``, one per
  consumer, each walking its block's Q/dO tiles (:func:`pallas_kernels.mosaic_index.kv_schedule`) or
  both one stream of their union (``stream="shared"``,
  :func:`pallas_kernels.mosaic_index.kv_pair_schedule`); GQA reduced in registers, no atomics.
* :func:`mosaic_dkv_cols` (:func:`~pallas_kernels.triton_backward.dkv_col_pass`): the same consumer
  on the gathered column tiles, one per-slot buffer per query-block range
  (:func:`pallas_kernels.mosaic_index.column_ranges`), summed and scattered by XLA; CTA ``(p, h, br)``
  owns chunks ``2p``, ``2p + 1`` of query head ``h``, each consumer walking its own Q/dO tiles or
  (``col_walk="shared"``) both one stream of the union of their query blocks.

The two passes split the pairs as the forward does. Packed documents: masked tiles add
``k_seg == q_seg``. The dQ pass: :mod:`pallas_kernels.mosaic_dq`. Design notes: ``docs/kernels.md``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic_precompile
from pallas_kernels.index_format import StepIndex, column_start
from pallas_kernels.mosaic_common import (LOG2E, NEG_INF, col_layout, load_smem, named, row_layout, tile_transforms,
                                          transposed)
from pallas_kernels.mosaic_stream import (block_loops, block_step_kind, check_walk, column_pair_loops, column_pair_walk,
                                          column_tile_kind, resolve_stream)
from pallas_kernels.mosaic_index import (STREAM_SEGMENTS, column_free_range, column_ids, column_operands,
                                         column_ranges, column_slots, kv_pair_schedule, kv_schedule,
                                         uniform_kv_schedule)
from pallas_kernels.three_pass import add_column_grads

_STATIC = ("sm_scale", "block_size", "stages")


def _dkv_slot(w, t, stages: int, shared: bool):
    """Ring slot of tile ``t`` of consumer ``w`` in a dK/dV pass: ``stages`` slots per consumer, or
    (``shared``: one stream both consumers walk) ``2 * stages`` slots of one ring."""
    if shared:
        return lax.rem(t, jnp.int32(2 * stages))
    return w * stages + lax.rem(t, jnp.int32(stages))


def _dkv_pass_tile(slot, bars, per_tile_aux: bool) -> None:
    """A dK/dV consumer's barrier protocol for a tile it does not compute: wait for the slot's copies
    (Q, the row infos, the KV rows' aux when ``per_tile_aux``, dO), then free it."""
    q_bar, do_bar, r_bar, qi_bar, ka_bar, q_free, do_free = bars
    for bar in (q_bar, r_bar, qi_bar) + ((ka_bar,) if per_tile_aux else ()) + (do_bar,):
        plgpu.barrier_wait(bar.at[slot])
    plgpu.barrier_arrive(do_free.at[slot])
    plgpu.barrier_arrive(q_free.at[slot])


def _dkv_consumer(w, loops, kres, vres, kpos_b, kaux_b, smems, bars, *, stages: int, bs: int,
                  qk_scale: float, scale: float, dtype, kseg_smem=None, shared: bool = False):
    """One consumer warpgroup's KV-stationary walk (both dK/dV passes): K, V of its 64 rows
    resident in ``kres/vres[w]``; tile ``t`` in slot :func:`_dkv_slot`; ``loops`` the walk as a list
    ``[(lo, hi, kind)]`` in tile order, ``kind`` 0 free, 1 masked, 2 not this consumer's (``shared``
    only: wait for the slot's copies, free it; one body compiled per entry: the block pass free tiles,
    then masked ones, or the shared stream's segment loops; the column pass masked ones, then, with
    ``col_walk="free"``, free ones), or a tuple ``(n, kind)``: one loop over tiles ``[0, n)`` with the
    body chosen per tile by ``kind(t)`` (one copy of each body); masked tiles keeping ``pos[kv] <= q_pos[q]
    and aux[kv] >= thr[q]`` with the KV rows' ``kpos_b`` and ``kaux_b`` (``None``: a per-tile aux vector in
    ``ka_smem``, row ``w`` of the slot's two when ``shared``). Packed documents: ``kseg_smem [bs]`` holds the KV rows'
    segment ids, the tile's ``qinfo`` row 2 the queries'; masked pairs must match. Returns the float32
    ``(dk * scale, dv)`` of the rows in the wgmma layout."""
    q_smem, do_smem, r_smem, qi_smem, ka_smem = smems
    q_bar, do_bar, r_bar, qi_bar, ka_bar, q_free, do_free = bars

    def skip(t, carry):  # a tile of the other consumer's block: same waits and arrivals, no math
        _dkv_pass_tile(_dkv_slot(w, t, stages, shared), bars, kaux_b is None)
        return carry

    def tile(t, carry, masked: bool):
        dk, dv = carry
        slot = _dkv_slot(w, t, stages, shared)
        plgpu.barrier_wait(q_bar.at[slot])

        def kq(acc_ref):
            plgpu.wgmma(acc_ref, kres.at[w], transposed(q_smem.at[slot]))
            return acc_ref[...]

        st = pl.run_scoped(kq, plgpu.ACC((bs, bs), jnp.float32)) * qk_scale  # [kv, q], log2 domain
        plgpu.barrier_wait(r_bar.at[slot])
        plgpu.barrier_wait(qi_bar.at[slot])
        if kaux_b is None:
            plgpu.barrier_wait(ka_bar.at[slot])
        plgpu.barrier_wait(do_bar.at[slot])

        def vdo(acc_ref):  # P^T is computed while the dP^T wgmma runs
            plgpu.wgmma(acc_ref, vres.at[w], transposed(do_smem.at[slot]))
            sm = st
            if masked:
                qpos = lax.broadcast_in_dim(load_smem(qi_smem.at[slot, 0], col_layout()), (bs, bs), [1])
                thr = lax.broadcast_in_dim(load_smem(qi_smem.at[slot, 1], col_layout()), (bs, bs), [1])
                aux = kaux_b if kaux_b is not None else lax.broadcast_in_dim(
                    load_smem(ka_smem.at[(slot, w) if shared else slot], row_layout()), (bs, bs), [0])
                ok = (kpos_b <= qpos) & (aux >= thr)
                if kseg_smem is not None:
                    qseg = lax.broadcast_in_dim(load_smem(qi_smem.at[slot, 2], col_layout()), (bs, bs), [1])
                    ok = ok & (lax.broadcast_in_dim(load_smem(kseg_smem, row_layout()), (bs, bs), [0]) == qseg)
                sm = jnp.where(ok, sm, NEG_INF)
            lse2 = lax.broadcast_in_dim(load_smem(r_smem.at[slot, 0], col_layout()), (bs, bs), [1])
            return acc_ref[...], jnp.exp2(sm - lse2)

        dpt, pt = pl.run_scoped(vdo, plgpu.ACC((bs, bs), jnp.float32))

        def dvdk(refs):  # dS^T is computed while the dV wgmma runs
            dv_ref, dk_ref = refs
            plgpu.wgmma(dv_ref, pt.astype(dtype), do_smem.at[slot])
            delta = lax.broadcast_in_dim(load_smem(r_smem.at[slot, 1], col_layout()), (bs, bs), [1])
            plgpu.wgmma(dk_ref, (pt * (dpt - delta)).astype(dtype), q_smem.at[slot])

        dv, dk = pl.run_state(dvdk)((plgpu.ACC.init(dv), plgpu.ACC.init(dk)))
        plgpu.barrier_arrive(do_free.at[slot])
        plgpu.barrier_arrive(q_free.at[slot])
        return dk, dv

    d = kres.shape[-1]
    zeros = plgpu.layout_cast(jnp.full((bs, d), 0.0, jnp.float32), plgpu.Layout.WGMMA)
    carry = (zeros, zeros)
    if isinstance(loops, tuple):  # (n, kind(t)): one loop choosing the body per tile
        n, kind_of = loops
        bodies = (functools.partial(tile, masked=False), functools.partial(tile, masked=True), skip)
        carry = lax.fori_loop(0, n, lambda t, c: lax.switch(kind_of(t), [functools.partial(f, t) for f in bodies], c),
                              carry)
    else:
        for lo, hi, kind in loops:
            carry = lax.fori_loop(lo, hi, skip if kind == 2 else functools.partial(tile, masked=kind == 1), carry)
    dk, dv = carry
    return dk * scale, dv


def _dkv_producer(walks, b, stages: int, bs: int, q_ref, do_ref, rinfo_ref, qinfo_ref, kslot_ref, smems, bars,
                  shared: bool = False):
    """The producer of both dK/dV passes: ``walks[w] = (n_tiles, at)`` per consumer (``shared``: one
    walk both consumers read) with ``at(t) = (query head, query block, KV rows' aux index or None)``;
    per tile it TMA-loads ``Q``, ``(lse2, delta)``, ``(q_pos, thr)``, the KV rows' aux vector (when
    given: ``kslot_ref.at[b, h, rows]``) and ``dO``, after the slot was freed (by its consumer, or
    both)."""
    q_smem, do_smem, r_smem, qi_smem, ka_smem = smems
    q_bar, do_bar, r_bar, qi_bar, ka_bar, q_free, do_free = bars
    ring = 2 * stages if shared else stages

    @pl.loop(0, walks[0][0] if shared else jnp.maximum(walks[0][0], walks[1][0]))
    def _(t):
        for w in range(len(walks)):
            n_all, at = walks[w]

            @pl.when(t < n_all)
            def _():
                slot = _dkv_slot(w, t, stages, shared)
                h, qb, krows = at(t)
                rows = pl.ds(qb * bs, bs)

                @pl.when(t >= ring)
                def _():
                    plgpu.barrier_wait(q_free.at[slot])

                plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], q_smem.at[slot], q_bar.at[slot])
                plgpu.copy_gmem_to_smem(rinfo_ref.at[b, h, qb], r_smem.at[slot], r_bar.at[slot])
                plgpu.copy_gmem_to_smem(qinfo_ref.at[b, h, qb], qi_smem.at[slot], qi_bar.at[slot])
                if krows is not None:
                    plgpu.copy_gmem_to_smem(kslot_ref.at[b, h, krows], ka_smem.at[slot], ka_bar.at[slot])

                @pl.when(t >= ring)
                def _():
                    plgpu.barrier_wait(do_free.at[slot])

                plgpu.copy_gmem_to_smem(do_ref.at[b, rows, h], do_smem.at[slot], do_bar.at[slot])


def _resident(w, copies, bars):
    """Consumer ``w``'s resident operands of a dK/dV pass: TMA-copy each ``(gmem, smem)`` pair ``x``
    on barrier ``2 * x + w``, then wait for all of them."""
    for x, (src, dst) in enumerate(copies):
        plgpu.copy_gmem_to_smem(src, dst, bars.at[2 * x + w])
    for x in range(len(copies)):
        plgpu.barrier_wait(bars.at[2 * x + w])


def _dkv_blocks_kernel(cnt_ref, sched_ref, kpos_ref, kslot_ref, q_ref, do_ref, rinfo_ref, qinfo_ref, k_ref, v_ref,
                       *refs, stages: int, g: int, bs: int, nqb: int, qk_scale: float, scale: float,
                       segs: bool = False, shared: bool = False, walk: str = "switch"):
    """CTA ``(p, hk, b)``: KV blocks ``2p + w`` of KV head ``hk``, one per consumer ``w``. Own lists
    (``cnt_ref`` = :func:`~pallas_kernels.mosaic_index.kv_schedule`'s counts, ``kslot_ref [B, H, Sk]``)
    or ``shared`` (``cnt_ref`` = :func:`~pallas_kernels.mosaic_index.kv_pair_schedule`'s bounds, one
    stream both consumers walk, by segment loops or, ``walk="switch"``, one loop choosing the body per
    tile; ``kslot_ref [B, H, nKB // 2, 2, bs]``)."""
    kseg_ref, (dk_ref, dv_ref, smems, bars) = (refs[0], refs[1:]) if segs else (None, refs)
    kres, vres, kp_smem, *tile_smems = smems
    kv_bar, *tile_bars = bars
    b = lax.axis_index("b")
    hk = lax.axis_index("h")
    pair = lax.axis_index("p")  # the first KV blocks are listed by the most query blocks: heavy first
    wg = lax.axis_index("wg")

    def own_walk(w):
        j = 2 * pair + w
        return j, cnt_ref[b, hk, j, 0], cnt_ref[b, hk, j, 1]

    @pl.when(wg < 2)
    def _consumer():
        plgpu.set_max_registers(232, action="increase")
        w = wg
        j = 2 * pair + w
        if shared:
            base = cnt_ref[b, hk, pair, 0]
            bounds = [cnt_ref[b, hk, pair, s] - base for s in range(len(STREAM_SEGMENTS) + 1)]
            loops = ((bounds[-1], lambda t: block_step_kind(t, w, bounds)) if walk == "switch"
                     else block_loops(w, bounds))
        else:
            _, n_free, n_all = own_walk(w)
            loops = [(0, n_free, 0), (n_free, n_all, 1)]
        rows = pl.ds(j * bs, bs)
        copies = [(k_ref.at[b, rows, hk], kres.at[w]), (v_ref.at[b, rows, hk], vres.at[w]),
                  (kpos_ref.at[rows], kp_smem.at[w])]
        if segs:
            copies.append((kseg_ref.at[b, rows], kp_smem.at[2 + w]))
        _resident(w, copies, kv_bar)
        kpos_b = lax.broadcast_in_dim(load_smem(kp_smem.at[w], row_layout()), (bs, bs), [0])
        dk, dv = _dkv_consumer(w, loops, kres, vres, kpos_b, None, tile_smems, tile_bars, stages=stages, bs=bs,
                               qk_scale=qk_scale, scale=scale, dtype=q_ref.dtype,
                               kseg_smem=kp_smem.at[2 + w] if segs else None, shared=shared)
        dk_ref[b, rows, hk] = dk
        dv_ref[b, rows, hk] = dv

    @pl.when(wg == 2)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")

        def at(base, krows):
            def f(t):
                e = sched_ref[base + t]
                jq = lax.div(e, jnp.int32(nqb))
                return hk * g + jq, e - jq * nqb, krows
            return f

        if shared:
            base = cnt_ref[b, hk, pair, 0]
            walks = [(cnt_ref[b, hk, pair, len(STREAM_SEGMENTS)] - base, at(base, pair))]
        else:
            walks = [(own_walk(w)[2], at(cnt_ref[b, hk, own_walk(w)[0], 2], pl.ds(own_walk(w)[0] * bs, bs)))
                     for w in range(2)]
        _dkv_producer(walks, b, stages, bs, q_ref, do_ref, rinfo_ref, qinfo_ref, kslot_ref, tile_smems, tile_bars,
                      shared)


#: the column dK/dV pass's tile walks (:func:`mosaic_dkv_cols`)
COL_WALKS = ("masked", "free", "shared")
DEFAULT_COL_WALK = "free"  # results/kernels/kernels.md run 26


def _dkv_cols_kernel(first_ref, end_ref, *refs, stages: int, bs: int, nranges: int, range_blocks: int,
                     qk_scale: float, scale: float, segs: bool = False, free_tiles: bool = False,
                     shared: bool = False, walk_kind: str = "loops"):
    (flo_ref, fhi_ref), refs = (refs[:2], refs[2:]) if free_tiles else ((None, None), refs)
    cinfo_ref, q_ref, do_ref, rinfo_ref, qinfo_ref, kc_ref, vc_ref, dk_ref, dv_ref, smems, bars = refs
    kres, vres, ci_smem, *tile_smems = smems
    kv_bar, *tile_bars = bars
    br = lax.axis_index("br")
    b = lax.div(br, jnp.int32(nranges))
    r = br - b * nranges
    h = lax.axis_index("h")
    pair = lax.axis_index("p")
    wg = lax.axis_index("wg")

    def bounds(w):
        """Chunk ``2p + w``'s query blocks in range ``r``: its walk ``[lo, hi)`` and the free blocks
        ``[f_lo, f_hi)`` inside it (:func:`~pallas_kernels.mosaic_index.column_free_range`)."""
        c = 2 * pair + w
        lo = jnp.maximum(first_ref[b, h, c], r * range_blocks)
        hi = jnp.maximum(jnp.minimum(end_ref[b, h, c], (r + 1) * range_blocks), lo)
        f_lo = f_hi = lo
        if free_tiles:
            f_lo = jnp.clip(flo_ref[b, h, c], lo, hi)
            f_hi = jnp.clip(fhi_ref[b, h, c], f_lo, hi)
        return lo, hi, f_lo, f_hi

    def walk(w):
        """Consumer ``w``'s walk ``(n, loops, at)``: tile ``t`` at query block ``at(t)``. Own stream: the
        free blocks first, then the masked ones before and after them (no free ones: ascending), as
        ``(lo, hi, kind)`` loops; ``shared``: both chunks' blocks ascending
        (:func:`~pallas_kernels.mosaic_stream.column_pair_walk`), as five segment loops (``walk_kind``
        ``"loops"``: not its walk, masked, free, masked, not its walk) or one loop choosing each tile's body
        (``"switch"``)."""
        if shared:
            (lo0, hi0, _, _), (lo1, hi1, _, _) = bounds(0), bounds(1)
            n, at, tile_of = column_pair_walk(lo0, hi0, lo1, hi1)
            mine = bounds(w)  # read once, before the loop (not per tile)
            if walk_kind == "switch":
                return n, (n, lambda t: column_tile_kind(at(t), *mine)), at
            return n, column_pair_loops(n, tile_of, *mine), at
        lo, hi, f_lo, f_hi = bounds(w)
        n_free, before = f_hi - f_lo, f_lo - lo

        def at(t):
            u = t - n_free
            return jnp.where(t < n_free, f_lo + t, jnp.where(u < before, lo + u, f_hi + u - before))

        return hi - lo, ([(0, n_free, 0), (n_free, hi - lo, 1)] if free_tiles else [(0, hi - lo, 1)]), at

    @pl.when(wg < 2)
    def _consumer():
        plgpu.set_max_registers(232, action="increase")
        w = wg
        c = 2 * pair + w
        rows = pl.ds(c * bs, bs)
        _resident(w, [(kc_ref.at[b, h, rows], kres.at[w]), (vc_ref.at[b, h, rows], vres.at[w]),
                      (cinfo_ref.at[b, h, c], ci_smem.at[w])], kv_bar)
        kpos_b = lax.broadcast_in_dim(load_smem(ci_smem.at[w, 0], row_layout()), (bs, bs), [0])
        kaux_b = lax.broadcast_in_dim(load_smem(ci_smem.at[w, 1], row_layout()), (bs, bs), [0])
        dk, dv = _dkv_consumer(w, walk(w)[1], kres, vres, kpos_b, kaux_b, tile_smems, tile_bars,
                               stages=stages, bs=bs, qk_scale=qk_scale, scale=scale, dtype=q_ref.dtype,
                               kseg_smem=ci_smem.at[w, 2] if segs else None, shared=shared)
        dk_ref[r, b, h, rows] = dk
        dv_ref[r, b, h, rows] = dv

    @pl.when(wg == 2)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")

        def tile_at(at):
            return lambda t: (h, at(t), None)

        walks = [(walk(w)[0], tile_at(walk(w)[2])) for w in range(1 if shared else 2)]
        _dkv_producer(walks, b, stages, bs, q_ref, do_ref, rinfo_ref, qinfo_ref, None, tile_smems, tile_bars,
                      shared)


def _row_infos(q_pos, lse, delta, thr, bs: int, q_seg=None):
    """Per (batch, query head, query block) tile operands of the dK/dV passes: ``rinfo f32
    [B, H, nQB, 2, bs]`` = (log2-domain lse, 0 where the row is empty; delta) and ``qinfo int32
    [B, H, nQB, 2, bs]`` = (query positions; the tile's threshold ``thr [B, H, nQB]``), with the
    queries' segment ids ``q_seg [B, Sq]`` as a third row when given (``[B, H, nQB, 3, bs]``)."""
    B, H, sq = lse.shape
    nqb = sq // bs
    lse = lse.astype(jnp.float32)
    lse2 = jnp.where(lse == NEG_INF, 0.0, lse * LOG2E)
    rinfo = jnp.stack([lse2.reshape(B, H, nqb, bs), delta.astype(jnp.float32).reshape(B, H, nqb, bs)], axis=3)
    qpos = jnp.broadcast_to(q_pos.astype(jnp.int32).reshape(1, 1, nqb, bs), (B, H, nqb, bs))
    thr = jnp.broadcast_to(thr.astype(jnp.int32)[..., None], (B, H, nqb, bs))
    rows = [qpos, thr]
    if q_seg is not None:
        rows.append(jnp.broadcast_to(q_seg.astype(jnp.int32).reshape(B, 1, nqb, bs), (B, H, nqb, bs)))
    return rinfo, jnp.stack(rows, axis=3)


def _dkv_scratch(dtype, bs: int, d: int, stages: int, kv_info, segs: bool = False, resident: int = 3,
                 shared: bool = False):
    """Shared memory of both dK/dV passes: resident K/V of the two consumers, their KV rows' info
    ``kv_info``, and ``2 * stages`` slots of the per-tile operands (``qinfo`` with the segment row when
    ``segs``; the KV rows' aux of both consumers when ``shared``); barriers likewise (two per
    ``resident`` copy, :func:`_resident`; a ``shared`` slot is freed by both consumers)."""
    tr = tile_transforms(dtype)
    nb = 2 * stages
    smem = (plgpu.SMEM((2, bs, d), dtype, transforms=tr), plgpu.SMEM((2, bs, d), dtype, transforms=tr), kv_info,
            plgpu.SMEM((nb, bs, d), dtype, transforms=tr), plgpu.SMEM((nb, bs, d), dtype, transforms=tr),
            plgpu.SMEM((nb, 2, bs), jnp.float32), plgpu.SMEM((nb, 2 + segs, bs), jnp.int32),
            plgpu.SMEM((nb, 2, bs) if shared else (nb, bs), jnp.int32))
    frees = 2 if shared else 1
    bars = ((plgpu.Barrier(num_barriers=2 * resident),) + tuple(plgpu.Barrier(num_barriers=nb) for _ in range(5))
            + tuple(plgpu.Barrier(num_arrivals=frees, num_barriers=nb) for _ in range(2)))
    return [smem, bars]


def _launch(kernel, out_type, scratch, grid, grid_names, *args):
    mosaic_precompile.start()  # compiled as soon as lowered (issue 34: compile time)
    return plgpu.kernel(kernel, out_type=out_type, scratch_types=scratch, grid=grid, grid_names=grid_names,
                        num_threads=3, thread_name="wg",
                        compiler_params=plgpu.CompilerParams(approx_math=True))(*args)


#: the dK/dV block pass's streams (:func:`mosaic_dkv_blocks`; ``"auto"`` resolves to one of them)
DKV_STREAMS = ("split", "shared")
#: the dK/dV block pass's walk of the shared stream where not told (:data:`~pallas_kernels.mosaic_stream.WALKS`)
DKV_SHARED_WALK = "switch"


@functools.partial(jax.jit, static_argnames=_STATIC + ("uniform", "stream", "walk"))
def mosaic_dkv_blocks(q, k, v, q_pos, k_pos, index: StepIndex, do, lse, delta, *, sm_scale: float,
                      block_size: int = 64, stages: int = 2, segs=None, uniform: bool = False, stream: str = "auto",
                      walk: str | None = None):
    """Backward block pass: ``(dk, dv) f32 [B, Sk, Hkv, D]`` of the active blocks' pairs (causal,
    minus the listed columns of each row's prefix: :func:`mosaic_dkv_cols` has those), summed over
    each KV head's group of query heads. ``Sk`` a multiple of 128; ``do`` in q's dtype (cast here),
    ``lse`` / ``delta`` float32 ``[B, Hq, Sq]``; ``segs``: packed documents (module docstring);
    ``uniform``: every (batch, head) row of ``index`` alike, its schedule built for one row.
    ``stream`` (:data:`pallas_kernels.registry.STREAMS`): what a CTA's two consumers (KV blocks
    ``2p``, ``2p + 1``) read: ``"split"``, each its block's own Q/dO tiles
    (:func:`~pallas_kernels.mosaic_index.kv_schedule`, ``stages`` slots each); ``"shared"``, one
    stream of the tiles either block lists, a tile both list loaded once
    (:func:`~pallas_kernels.mosaic_index.kv_pair_schedule`, one ring of ``2 * stages`` slots; exact,
    slower than ``"split"`` on every index measured: the backend does not take it);
    ``"auto"``: :func:`~pallas_kernels.mosaic_stream.resolve_stream` (``"dkv"``); no ``"index"`` here (a
    per-call choice between the two would pick the shared stream where it is 1.15x slower, on a band:
    results/kernels/kernels.md run 34). ``walk``
    (:data:`~pallas_kernels.mosaic_stream.WALKS`): the shared stream's consumers walk its segment
    loops (7, :data:`~pallas_kernels.mosaic_stream.SHARED_PLAN`) or one loop choosing the free /
    masked / skip body per tile (default :data:`DKV_SHARED_WALK`); the split stream always walks two loops
    (a ``walk`` given with it is an error). The same result every way, its tiles summed in another order."""
    B, sq, H, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    bs = block_size
    sg = segs is not None
    stream = resolve_stream(stream, "dkv", uniform)
    if stream not in DKV_STREAMS:
        raise ValueError(f"the dK/dV block pass's stream must be one of {DKV_STREAMS + ('auto',)}, got {stream!r}")
    if walk is not None and stream != "shared":
        raise ValueError(f"walk={walk!r} chooses how the shared stream is walked; the {stream!r} stream has none")
    walk = DKV_SHARED_WALK if walk is None else walk
    check_walk(walk)
    rinfo, qinfo = _row_infos(q_pos, lse, delta, index.col_count, bs, segs[0] if sg else None)
    slots = column_slots(index, sk)
    args = [q, do.astype(q.dtype), rinfo, qinfo, k, v] + ([segs[1].astype(jnp.int32)] if sg else [])

    def launch(shared, sched, counts):
        kernel = functools.partial(_dkv_blocks_kernel, stages=stages, g=H // hkv, bs=bs, nqb=sq // bs,
                                   qk_scale=float(sm_scale) * LOG2E, scale=float(sm_scale), segs=sg, shared=shared,
                                   walk=walk)
        out = jax.ShapeDtypeStruct((B, sk, hkv, d), jnp.float32)
        scratch = _dkv_scratch(q.dtype, bs, d, stages, plgpu.SMEM((2 + 2 * sg, bs), jnp.int32), sg,
                               resident=3 + sg, shared=shared)
        kslot = slots.reshape(B, H, sk // (2 * bs), 2, bs) if shared else slots
        return tuple(_launch(named(kernel, "mosaic_dkv_blocks"), [out, out], scratch, (sk // bs // 2, hkv, B),
                             ("p", "h", "b"), counts, sched, k_pos.astype(jnp.int32), kslot, *args))

    if stream == "shared":
        return launch(True, *kv_pair_schedule(index, sk, hkv, bs, uniform))
    return launch(False, *(uniform_kv_schedule if uniform else kv_schedule)(index, sk, hkv, bs))


@functools.partial(jax.jit, static_argnames=_STATIC + ("range_blocks", "col_walk", "walk"))
def mosaic_dkv_cols(q, k, v, q_pos, k_pos, index: StepIndex, do, lse, delta, dk, dv, *, sm_scale: float,
                    block_size: int = 64, stages: int = 2, range_blocks: int = 512, segs=None,
                    col_walk: str = DEFAULT_COL_WALK, walk: str | None = None):
    """Backward column pass: adds the listed columns' dK/dV (every row's prefix columns, causal)
    into ``dk, dv f32 [B, Sk, Hkv, D]``; ranges of at most ``range_blocks`` query blocks per column
    chunk, summed in XLA, then one scatter-add by list slot
    (:func:`pallas_kernels.triton_backward.add_column_grads`). Each chunk walks the query blocks of
    :func:`~pallas_kernels.mosaic_index.column_ranges` (with packed documents, those whose
    ``column_start`` is before the chunk's end: not the later documents). ``col_walk``
    (:data:`COL_WALKS`): ``"free"`` (the default) skips the mask on each chunk's query blocks of
    :func:`~pallas_kernels.mosaic_index.column_free_range` (all of their pairs kept; walked first, a
    second tile body); ``"masked"`` masks every tile (one body, less to compile). Timed against each
    other in one process: results/kernels/kernels.md run 26. ``"shared"``: the free walk's bodies on
    ONE Q/dO stream per CTA: its consumers' chunks ``2p``, ``2p + 1`` (one query head) walk the union
    of their query blocks ascending (:func:`~pallas_kernels.mosaic_stream.column_pair_walk`), a block
    both need loaded once, a consumer passing the other's blocks without math; ``walk``
    (:data:`~pallas_kernels.mosaic_stream.WALKS`, the shared walk only: an error with another): five segment
    loops per consumer (``"loops"``, the default: as fast as the switch or faster on every index, results
    run 39) or one loop choosing each tile's body (``"switch"``). The same result every way, tiles summed in
    another order."""
    if col_walk not in COL_WALKS:
        raise ValueError(f"col_walk must be one of {COL_WALKS}, got {col_walk!r}")
    if walk is not None and col_walk != "shared":
        raise ValueError(f"walk={walk!r} chooses how col_walk='shared' is walked; col_walk={col_walk!r} has none")
    walk = "loops" if walk is None else walk
    check_walk(walk)
    free_tiles = col_walk in ("free", "shared")
    shared = col_walk == "shared"
    B, sq, H, d = q.shape
    sk = k.shape[1]
    bs = block_size
    sg = segs is not None
    kc, vc, c_info = column_operands(index, k, v, k_pos, bs, segs=segs)
    mcp = kc.shape[2]
    nch = mcp // bs
    start = column_start(index, segs[0], segs[1], bs) if sg else None
    first, end, nranges = column_ranges(index.col_count, nch, bs, range_blocks, start)
    rinfo, qinfo = _row_infos(q_pos, lse, delta, 1 - index.col_count, bs, segs[0] if sg else None)
    free = list(column_free_range(c_info, index.col_count, q_pos, bs, first, end, segs[0] if sg else None)
                ) if free_tiles else []
    kernel = functools.partial(_dkv_cols_kernel, stages=stages, bs=bs, nranges=nranges,
                               range_blocks=range_blocks, qk_scale=float(sm_scale) * LOG2E, scale=float(sm_scale),
                               segs=sg, free_tiles=free_tiles, shared=shared, walk_kind=walk)
    out = jax.ShapeDtypeStruct((nranges, B, H, mcp, d), jnp.float32)
    scratch = _dkv_scratch(q.dtype, bs, d, stages, plgpu.SMEM((2, 2 + sg, bs), jnp.int32), sg, shared=shared)
    dkc, dvc = _launch(named(kernel, "mosaic_dkv_cols"), [out, out], scratch, (nch // 2, H, B * nranges),
                       ("p", "h", "br"), first, end, *free, c_info, q, do.astype(q.dtype), rinfo, qinfo, kc, vc)
    return add_column_grads(dk, dv, dkc.sum(0), dvc.sum(0), column_ids(index, sk, mcp), index.col_count)
