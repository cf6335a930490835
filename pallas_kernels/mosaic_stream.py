"""The K/V tile stream the query-side Mosaic kernels (forward and dQ) walk: one stream per CTA shared
by its two consumer warpgroups (:func:`pallas_kernels.mosaic_index.pair_stream`), its producer
(TMA loads of K, V and ``info`` tiles into a ring of slots), the consumers' walk over its segments
(free / masked / not in the row's walk, then the column tiles), and the operands, shared memory and
barriers it needs."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic_precompile, registry
from pallas_kernels.index_format import StepIndex
from pallas_kernels.mosaic_common import NEG_INF, col_layout, load_smem, named, row_layout, tile_transforms
from pallas_kernels.mosaic_index import (NULL_BLOCK, POS_PAD, STREAM_SEGMENTS, PairStream, column_tiles, pair_stream,
                                         prepare, split_stream)

def query_pair_ids(npairs: int):
    """``(b, h, pair, wg)`` of a query-side kernel's CTA (forward, dQ): pairs of query blocks are
    walked from the last, since causal rows get heavier with position (heavy CTAs start first)."""
    return lax.axis_index("b"), lax.axis_index("h"), npairs - 1 - lax.axis_index("p"), lax.axis_index("wg")


def segment_ok(info_smem, slot, qseg_smem, bs: int, kv: int | None = None, keys=None):
    """``bool [64, kv]`` of a masked tile with packed documents: the tile's keys (segment row 2 of
    its ``info``; ``keys``: a slice of the step's keys) lie in the document of the consumer's query
    rows (``qseg_smem [bs]``)."""
    kv = kv or bs
    ref = info_smem.at[slot, 2] if keys is None else info_smem.at[slot, 2, keys]
    kseg = lax.broadcast_in_dim(load_smem(ref, col_layout()), (bs, kv), [1])
    qseg = lax.broadcast_in_dim(load_smem(qseg_smem, row_layout()), (bs, kv), [0])
    return kseg == qseg


def mask_scores(s, info_smem, slot, thr, qpos, qseg_smem=None, keys=()):
    """Scores ``s [64, n]`` of a masked step with ``-inf`` where a key is not the row's: after the query
    (``qpos``: the rows' positions broadcast to ``[64, n]``), ``aux < thr`` (rows 0 / 1 of the step's
    ``info``), or (``qseg_smem``: packed documents) in another document (:func:`segment_ok`); ``keys``: a
    slice of the step's keys."""
    bs, n = s.shape
    pos = lax.broadcast_in_dim(load_smem(info_smem.at[(slot, 0, *keys)], col_layout()), (bs, n), [1])
    aux = lax.broadcast_in_dim(load_smem(info_smem.at[(slot, 1, *keys)], col_layout()), (bs, n), [1])
    ok = (pos <= qpos) & (aux >= thr)
    if qseg_smem is not None:
        ok = ok & segment_ok(info_smem, slot, qseg_smem, bs, n, *keys)
    return jnp.where(ok, s, NEG_INF)


def stream_walk(bnd_ref, cnt_ref, b, h, pair, bs: int, halves: int = 1):
    """The CTA's shared tile stream (:func:`pallas_kernels.mosaic_index.pair_stream`): ``(bounds,
    n_union, total, rows, col0)`` with ``bounds`` the 9 segment starts of the union's block tiles,
    ``n_union`` their number of steps, ``total`` the stream length in steps (block steps, then the
    column steps ``[col0, max(n_col_steps))`` of the head's column tiles), ``col0`` the first column
    step either row walks (the smaller :func:`~pallas_kernels.index_format.column_start` step of the
    rows with column work: with packed documents the earlier steps are other documents' columns) and
    ``rows[w] = (query block, col_count, col_hi, col_free_hi, n_free_blocks, n_blocks, col_lo)``: the
    row's column steps ``[col_lo, col_hi)`` counted from ``col0`` (steps before ``col_lo`` are skipped,
    ``[col_lo, col_free_hi)`` need no mask); a step is ``halves`` tiles of 64 keys."""
    bounds = [bnd_ref[b, h, pair, s] for s in range(len(STREAM_SEGMENTS) + 1)]
    span = jnp.int32(bs * halves)
    cols = []
    for w in range(2):
        i = 2 * pair + w
        ncol = cnt_ref[b, h, i, 2]
        cols.append((i, ncol, lax.div(ncol + span - 1, span), lax.div(cnt_ref[b, h, i, 3], jnp.int32(halves)),
                     lax.div(cnt_ref[b, h, i, 4], span)))
    n_steps = jnp.maximum(cols[0][2], cols[1][2])
    col0 = n_steps  # no column work: no column steps
    for _, _, nct, _, start in cols:
        col0 = jnp.minimum(col0, jnp.where(start < nct, start, n_steps))
    rows = []
    for w, (i, ncol, nct, ncf, start) in enumerate(cols):
        lo = jnp.maximum(start - col0, 0)
        hi = jnp.maximum(nct - col0, lo)
        rows.append((i, ncol, hi, jnp.minimum(lo + ncf, hi), cnt_ref[b, h, i, 0], cnt_ref[b, h, i, 1], lo))
    n_union = bounds[-1]
    return bounds, n_union, n_union + n_steps - col0, rows, col0


def _runs(kinds) -> list:
    """``[(kind, first, last)]``: the runs of equal ``kinds`` (a consumer's class per segment)."""
    runs = []
    for s, c in enumerate(kinds):
        if runs and runs[-1][0] == c:
            runs[-1] = (c, runs[-1][1], s)
        else:
            runs.append((c, s, s))
    return runs


def _shared_plan() -> tuple:
    """The shared stream's block loops for both consumers (static): ``((kind, run of consumer 0 or
    None, run of consumer 1 or None), ...)``, a shortest common supersequence of the two consumers'
    runs of equal class over :data:`STREAM_SEGMENTS` (consecutive segments of one class are one
    loop): 7 loops where one per segment and consumer took 14."""
    a, b = (_runs([seg[w] for seg in STREAM_SEGMENTS]) for w in (0, 1))
    n, m = len(a), len(b)
    L = [[0] * (m + 1) for _ in range(n + 1)]  # L[i][j]: shortest supersequence of a[i:], b[j:]
    for i in range(n, -1, -1):
        for j in range(m, -1, -1):
            if i == n or j == m:
                L[i][j] = (n - i) + (m - j)
            elif a[i][0] == b[j][0]:
                L[i][j] = 1 + L[i + 1][j + 1]
            else:
                L[i][j] = 1 + min(L[i + 1][j], L[i][j + 1])
    plan, i, j = [], 0, 0
    while i < n or j < m:
        if i < n and j < m and a[i][0] == b[j][0]:
            plan.append((a[i][0], a[i], b[j]))
            i, j = i + 1, j + 1
        elif j == m or (i < n and L[i + 1][j] <= L[i][j + 1]):
            plan.append((a[i][0], a[i], None))
            i += 1
        else:
            plan.append((b[j][0], None, b[j]))
            j += 1
    return tuple(plan)


SHARED_PLAN = _shared_plan()


def stream_segments(w, bounds, n_union, total, row, split: bool = False):
    """Consumer ``w``'s walk of the stream as ``(lo, hi, kind, col)`` loops in stream order, every step
    of ``[0, total)`` in one; ``kind`` 0 free, 1 masked, 2 skipped (not in its row's walk); ``col``: a
    column tile (threshold ``1 - col_count``, else ``col_count``). The shared stream's block steps: the
    loops of :data:`SHARED_PLAN`, each a run of segments of one class for a consumer (empty for a
    consumer whose walk has no run there). ``split``
    (:func:`~pallas_kernels.mosaic_index.split_stream`): block step ``t``'s own half is the row's
    ``t``-th tile, so the consumer's block steps are three loops from its own counts (free, masked,
    past its list). The column steps (:func:`stream_walk`'s ``rows``): skipped before the row's start,
    free, masked, skipped past its prefix: 7 loops in all (shared stream: 11)."""
    hi_c, free_c, lo_c = row[2], row[3], row[6]
    cols = [(n_union, n_union + lo_c, 2, True), (n_union + lo_c, n_union + free_c, 0, True),
            (n_union + free_c, n_union + hi_c, 1, True), (n_union + hi_c, total, 2, True)]
    if split:
        n_free, n_blk = row[4], row[5]
        return [(0, n_free, 0, False), (n_free, n_blk, 1, False), (n_blk, n_union, 2, False)] + cols
    return [(lo, hi, kind, False) for lo, hi, kind in block_loops(w, bounds)] + cols


def block_loops(w, bounds):
    """Consumer ``w``'s walk of a stream grouped in :data:`STREAM_SEGMENTS` (segment ``s`` = steps
    ``[bounds[s], bounds[s + 1])``) as ``(lo, hi, kind)`` loops in stream order: the loops of
    :data:`SHARED_PLAN`, each a run of segments of one class for the consumer (``kind`` 0 free,
    1 masked, 2 not in its walk; empty for a consumer with no run there). Used by the query-side
    shared stream and the dK/dV block pass's (:func:`pallas_kernels.mosaic_index.kv_pair_schedule`)."""
    loops = []
    for kind, r0, r1 in SHARED_PLAN:
        lo0, hi0 = (bounds[r0[1]], bounds[r0[2] + 1]) if r0 else (0, 0)
        lo1, hi1 = (bounds[r1[1]], bounds[r1[2] + 1]) if r1 else (0, 0)
        if r0 == r1:  # the same segments for both consumers
            loops.append((lo0, hi0, kind))
        else:
            loops.append((jnp.where(w == 0, lo0, lo1), jnp.where(w == 0, hi0, hi1), kind))
    return loops


#: how a consumer walks the stream: ``"loops"``, one loop per segment of :func:`stream_segments` (each its
#: own copy of the step body: 11 on the shared stream, 7 on the split one, two of them the small skip body);
#: ``"switch"``, one loop whose body picks the free / masked / skip step per tile (:func:`step_kind`): one
#: copy of each body, a smaller program
WALKS = ("loops", "switch")


#: what a CTA's two consumers share: ``"shared"``, the union of their rows' block tiles
#: (:func:`pallas_kernels.mosaic_index.pair_stream`; a tile both rows list is loaded once and used by
#: both); ``"split"``, each its own tiles in one half of every 128-key step
#: (:func:`pallas_kernels.mosaic_index.split_stream`; both consumers busy on every step); ``"index"``,
#: one of the two per call, chosen on the device from the index (:func:`prefer_split`; both kernels
#: are compiled); ``"auto"``, one of those three per pass (:func:`resolve_stream`)
STREAMS = registry.STREAMS

#: what ``"auto"`` resolves to per pass on a listed index (:func:`resolve_stream`). The
#: forward chooses per call: the split stream is 1.09-1.15x the shared one where adjacent query
#: blocks share few tiles and 0.91x where they share most (results/kernels/kernels.md run 13). The dQ
#: takes the split stream: 1.03-1.06x the shared one on every layer and budget of a trained model's
#: index (run 16) and on spread / mixed slashes (1.05-1.09x), tied on verticals, 0.94x only on a pure
#: local band (run 13), and one dQ kernel instead of two in the compiled step. The dK/dV block pass
#: (``"dkv"``: its two consumers' KV blocks' own Q/dO lists, ``"split"``, or their union,
#: ``"shared"``, :func:`pallas_kernels.mosaic_index.kv_pair_schedule`) keeps its own lists: the
#: shared one is exact but 1.03-1.36x slower on every index measured, though its loads alone take
#: 0.53 (band) to 0.97 (mixed) of the split stream's, 1.03 on spread (run 34: its consumers wait on
#: each other's slots; ``benchmarks/kernels.py --passes ... --dkv-streams split,shared``).
AUTO_STREAM = {"fwd": "index", "dq": "split", "dkv": "split"}
#: ``"auto"`` on the uniform full index (``index=None``): the shared stream in the query-side passes
#: (:func:`resolve_stream`), the dK/dV block pass as on a listed index
UNIFORM_STREAM = {"fwd": "shared", "dq": "shared", "dkv": "split"}

#: ``"index"`` takes the split stream when the shared stream carries more than this share of the
#: tiles its two rows compute (:func:`stream_per_work`): 0.5 when the rows list the same tiles, 1.0
#: when they share none. Run 13 (results/kernels/kernels.md, H200): band (0.51) and vert (0.54) are
#: as fast or faster shared; spread and mixed (0.86) faster split.
SPLIT_ABOVE = 0.7


#: the split stream's walk where the caller does not name one (``"auto"``, ``"index"``, the backend's
#: ``"split"``): its segment loops (run 13: one loop with ``lax.switch`` is slower on it)
SPLIT_WALK = "loops"


def check_walk(walk) -> None:
    if walk not in WALKS:
        raise ValueError(f"walk must be one of {WALKS}, got {walk!r}")


def parse_stream_walk(spec: str, streams, walked=("shared",)) -> tuple:
    """``"<stream>"`` or ``"<stream>:<walk>"`` (a benchmark option's value) -> ``(stream, walk or None)``.
    ``ValueError`` naming ``spec`` unless ``stream`` is one of ``streams`` and ``walk`` one of
    :data:`WALKS`, given only for a stream of ``walked`` (the streams whose consumers' walk is a choice)."""
    stream, colon, walk = str(spec).partition(":")
    if stream not in streams or (colon and (walk not in WALKS or stream not in walked)):
        raise ValueError(f"{spec!r} is not STREAM or STREAM:WALK with STREAM one of {tuple(streams)} and WALK one "
                         f"of {WALKS} (a walk only for {tuple(walked)})")
    return stream, (walk if colon else None)


def step_kind(t, w, bounds, n_union, row):
    """``(kind, col)`` of stream step ``t`` for consumer ``w``, as :func:`stream_segments`' loops
    classify it: ``kind`` 0 free, 1 masked, 2 skipped; ``col`` a column step. Scalar integer
    arithmetic on the walk's bounds (works on traced and on numpy values)."""
    kind = block_step_kind(t, w, bounds)
    hi_c, free_c, lo_c = row[2], row[3], row[6]
    u = t - n_union
    col = t >= n_union
    col_kind = jnp.where(u < lo_c, 2, jnp.where(u < free_c, 0, jnp.where(u < hi_c, 1, 2)))
    return jnp.where(col, col_kind, kind).astype(jnp.int32), col


def block_step_kind(t, w, bounds):
    """Consumer ``w``'s class (0 free, 1 masked, 2 not in its walk) of step ``t`` of a stream grouped in
    :data:`STREAM_SEGMENTS` (``bounds``: the 9 segment starts; 2 past the last)."""
    kind = 2
    for s, (c0, c1) in enumerate(STREAM_SEGMENTS):
        c = c0 if c0 == c1 else jnp.where(w == 0, c0, c1)
        kind = jnp.where((t >= bounds[s]) & (t < bounds[s + 1]), c, kind)
    return kind


def column_pair_walk(lo0, hi0, lo1, hi1):
    """One walk of the query blocks two column chunks need (the column dK/dV pass's
    ``col_walk="shared"``: a CTA's two consumers on one Q/dO stream): the union of ``[lo0, hi0)`` and
    ``[lo1, hi1)`` in ascending order, each block once, an empty walk ignored and a gap between
    disjoint walks skipped. Returns ``(n, at, tile_of)``: ``n`` tiles, tile ``t < n`` at query block
    ``at(t)``; ``tile_of(qb)``, the tile of a block of either walk, or of either walk's end (clipped to
    ``[0, n]``: each walk's blocks are tiles ``[tile_of(lo), tile_of(hi))``). Integer arithmetic on
    scalars (traced in a kernel, or numpy)."""
    e0, e1 = hi0 > lo0, hi1 > lo1
    a0, b0 = jnp.where(e0, lo0, lo1), jnp.where(e0, hi0, hi1)  # an empty walk takes the other's bounds
    a1, b1 = jnp.where(e1, lo1, a0), jnp.where(e1, hi1, b0)
    s = jnp.minimum(a0, a1)
    e_first = jnp.where(a0 <= a1, b0, b1)  # end of the walk that starts first
    gap = jnp.maximum(jnp.maximum(a0, a1) - e_first, 0)
    n = jnp.maximum(b0, b1) - s - gap

    def at(t):
        return s + t + jnp.where(t >= e_first - s, gap, 0)

    def tile_of(qb):
        return jnp.clip(qb - s - jnp.where(qb > e_first, gap, 0), 0, n)

    return n, at, tile_of


def column_pair_loops(n, tile_of, lo, hi, f_lo, f_hi):
    """One consumer's segment loops over the shared column walk (``col_walk="shared"``,
    ``walk="loops"``): ``[(start, stop, kind)]`` covering tiles ``[0, n)`` in order, ``kind`` as
    :func:`column_tile_kind` (2 not its walk, 1 masked, 0 free): skip, masked, free, masked, skip, from
    its walk ``[lo, hi)`` with free blocks ``[f_lo, f_hi)`` inside it and ``tile_of`` of
    :func:`column_pair_walk`. Every tile is in exactly one loop: a consumer walking more or fewer
    tiles than the producer loads would wait forever."""
    i_lo, i_flo, i_fhi, i_hi = (tile_of(x) for x in (lo, f_lo, f_hi, hi))
    return [(0, i_lo, 2), (i_lo, i_flo, 1), (i_flo, i_fhi, 0), (i_fhi, i_hi, 1), (i_hi, n, 2)]


def column_tile_kind(qb, lo, hi, f_lo, f_hi):
    """A column chunk's class of query block ``qb`` (0 free, 1 masked, 2 not in its walk ``[lo, hi)``;
    free: inside ``[f_lo, f_hi)``, :func:`~pallas_kernels.mosaic_index.column_free_range`)."""
    inside = (qb >= lo) & (qb < hi)
    return jnp.where(inside, jnp.where((qb >= f_lo) & (qb < f_hi), 0, 1), 2).astype(jnp.int32)


def walk_stream(w, bounds, n_union, total, row, tile, skip, carry, walk: str = "loops", split: bool = False):
    """Run consumer ``w``'s walk over the CTA's stream (:func:`stream_segments`).
    ``tile(t, carry, masked, thr, own=...)``, ``skip(t, carry)``; ``walk`` (:data:`WALKS`): segment
    loops, or one loop choosing the body per step. ``split``
    (:func:`pallas_kernels.mosaic_index.split_stream`): the block steps are ``own=True`` (the
    consumer's half of the step), the column steps shared as always."""
    check_walk(walk)
    ncol = row[1]
    if walk == "switch":
        def step(t, carry):
            kind, col = step_kind(t, w, bounds, n_union, row)
            thr = jnp.where(col, 1 - ncol, ncol)
            bodies = [lambda c: tile(t, c, masked=False, thr=None), lambda c: tile(t, c, masked=True, thr=thr),
                      lambda c: skip(t, c)]
            if split:  # block steps (0, 1): the consumer's own half; column steps (2, 3): both; skip 4
                own = [lambda c: tile(t, c, masked=False, thr=None, own=True),
                       lambda c: tile(t, c, masked=True, thr=thr, own=True)]
                which = jnp.where(kind == 2, 4, kind + 2 * col.astype(jnp.int32))
                return lax.switch(which, own + bodies, carry)
            return lax.switch(kind, bodies, carry)

        return lax.fori_loop(0, total, step, carry)
    for lo, hi, kind, col in stream_segments(w, bounds, n_union, total, row, split):
        if kind == 2:
            body = skip
        else:
            body = functools.partial(tile, masked=kind == 1, thr=(1 - ncol if col else ncol) if kind else None)
            if split and not col:
                body = functools.partial(body, own=True)
        carry = lax.fori_loop(lo, hi, body, carry)
    return carry


def consumer_row(w, rows_w):
    """Consumer ``w``'s row of :func:`stream_walk` (``(query block, col_count, col_hi, col_free_hi,
    n_free_blocks, n_blocks, col_lo)``)."""
    return tuple(jnp.where(w == 0, a, c) for a, c in zip(rows_w[0], rows_w[1]))


def stream_producer(b, h, hk, pair, bs, halves, slots, n_union, total, col0, sidx_ref, k_ref, v_ref, kc_ref,
                    vc_ref, kinfo_ref, cinfo_ref, null_ref, k_smem, v_smem, info_smem, k_bar, v_bar, i_bar, k_free,
                    v_free):
    """The producer warpgroup of the query-side kernels (forward, dQ): for step ``t`` of the CTA's
    stream, wait until both consumers freed slot ``t % slots`` (from ``t >= slots`` on), then
    TMA-load the step's K (+ ``info``) and V halves: block ``sidx[.., t, half]`` of ``k/v`` (a NULL
    half loads block 0 with the all-masked ``null`` info) for the union's block steps, then the column
    tiles of ``kc/vc`` from column step ``col0`` on (:func:`stream_walk`)."""
    rows_i = info_smem.shape[1]

    def load(t, ref_blk, ref_col, info, dst, bar):
        for hf in range(halves):
            half = dst.at[pl.ds(hf * bs, bs)] if halves > 1 else dst

            def info_copy(src, hf=hf):
                if halves == 1:
                    plgpu.copy_gmem_to_smem(src, info[0], info[1])
                else:  # one 64-key row at a time into the slot's [rows, 128] info tile
                    for r in range(rows_i):
                        plgpu.copy_gmem_to_smem(src.at[r], info[0].at[r, pl.ds(hf * bs, bs)], info[1])

            @pl.when(t < n_union)
            def _(hf=hf, half=half, info_copy=info_copy):
                kb = sidx_ref[b, h, pair, t, hf]
                plgpu.copy_gmem_to_smem(ref_blk.at[b, pl.ds(jnp.maximum(kb, 0) * bs, bs), hk], half, bar)
                if info is not None:
                    pl.when(kb >= 0)(lambda: info_copy(kinfo_ref.at[b, h, jnp.maximum(kb, 0)]))
                    pl.when(kb < 0)(lambda: info_copy(null_ref))

            @pl.when(t >= n_union)
            def _(hf=hf, half=half, info_copy=info_copy):
                c = (t - n_union + col0) * halves + hf
                plgpu.copy_gmem_to_smem(ref_col.at[b, h, pl.ds(c * bs, bs)], half, bar)
                if info is not None:
                    info_copy(cinfo_ref.at[b, h, c])

    @pl.loop(0, total)
    def _(t):
        slot = lax.rem(t, jnp.int32(slots))

        @pl.when(t >= slots)
        def _():
            plgpu.barrier_wait(k_free.at[slot])

        load(t, k_ref, kc_ref, (info_smem.at[slot], i_bar.at[slot]), k_smem.at[slot], k_bar.at[slot])

        @pl.when(t >= slots)
        def _():
            plgpu.barrier_wait(v_free.at[slot])

        load(t, v_ref, vc_ref, None, v_smem.at[slot], v_bar.at[slot])


def stream_per_work(ops, shared, halves: int):
    """Tiles the shared stream carries per tile its two rows compute, over the whole call (block
    tiles; ``shared`` = :func:`~pallas_kernels.mosaic_index.pair_stream` ``(ops, halves)``): 0.5
    when adjacent query blocks list the same tiles, 1.0 when they share none (a float32 scalar;
    ``benchmarks/consumer_pairing.py``'s ``stream_per_work``)."""
    if halves == 1:
        carried = shared.bounds[..., -1].astype(jnp.float32).sum()
    else:  # the real halves of the union's steps (a group's odd leftover pairs with a NULL half)
        steps = jnp.arange(shared.block_idx.shape[-2], dtype=jnp.int32)
        real = (shared.block_idx != NULL_BLOCK) & (steps[:, None] < shared.bounds[..., -1:, None])
        carried = real.astype(jnp.float32).sum()
    work = ops.counts[..., 1].astype(jnp.float32).sum()
    return carried / jnp.maximum(work, 1.0)


def prefer_split(ops, shared, halves: int):
    """Whether ``stream="index"`` takes the split stream (:data:`SPLIT_ABOVE`); a traced bool."""
    return stream_per_work(ops, shared, halves) > SPLIT_ABOVE


def resolve_stream(stream: str, kernel: str, uniform: bool = False) -> str:
    """The stream a pass (``kernel``: ``"fwd"``, ``"dq"`` or ``"dkv"``, the dK/dV block pass) walks
    for ``stream`` (:data:`STREAMS`): ``"auto"`` is :data:`AUTO_STREAM`'s choice on a listed index and
    :data:`UNIFORM_STREAM`'s on the uniform full index (there every row lists the same tiles up to its
    diagonal, so the query-side shared stream carries about half a tile per tile of work and
    ``"index"`` would choose it: ``tests/test_mosaic_streams.py``); the others are themselves."""
    if stream not in STREAMS:
        raise ValueError(f"stream must be one of {STREAMS}, got {stream!r}")
    if kernel not in AUTO_STREAM:
        raise ValueError(f"kernel must be one of {tuple(AUTO_STREAM)}, got {kernel!r}")
    if stream != "auto":
        return stream
    return (UNIFORM_STREAM if uniform else AUTO_STREAM)[kernel]


def run_stream(launch, index: StepIndex, k, v, q_pos, k_pos, bs: int, segs, kv_step: int, slots: int | None,
               walk: str, stream: str, uniform: bool = False, kernel: str = "fwd"):
    """Build a query-side kernel's stream operands and call ``launch(ops, walk_ops, null_info, halves,
    slots, kv_step, walk, split)`` (the kernel ``kernel``, ``"fwd"`` or ``"dq"``; ``stream="auto"``
    resolved by :func:`resolve_stream`). ``stream="index"``: the operands once, then a ``lax.cond`` on
    :func:`prefer_split` between the split stream (128-key steps, segment loops) and the shared one
    (``kv_step``, ``walk``): both kernels are compiled, one runs. The split stream resolved from
    ``"auto"`` takes 128-key steps and segment loops (a fixed ``"split"`` needs ``kv_step=128``).
    ``uniform``: as in :func:`stream_operands`."""
    check_walk(walk)
    auto, stream = stream == "auto", resolve_stream(stream, kernel, uniform)
    if stream == "split" and auto:
        kv_step, walk = 2 * bs, SPLIT_WALK
    if stream != "index":
        ops, walk_ops, null_info, halves, slots = stream_operands(index, k, v, q_pos, k_pos, bs, segs, kv_step,
                                                                 slots, stream, uniform)
        return launch(ops, walk_ops, null_info, halves, slots, kv_step, walk, stream == "split")
    ops, shared, null_info, halves, shared_slots = stream_operands(index, k, v, q_pos, k_pos, bs, segs, kv_step,
                                                                  slots, "shared", uniform)
    split_slots = check_slots(slots, 2 * bs, k.shape[-1])
    return lax.cond(prefer_split(ops, shared, halves),
                    lambda: launch(ops, split_stream(ops), null_info, 2, split_slots, 2 * bs, SPLIT_WALK, True),
                    lambda: launch(ops, shared, null_info, halves, shared_slots, kv_step, walk, False))


def query_kernel(kernel, name: str, out_type, scratch, args, npairs: int, heads: int, batch: int):
    """Launch a query-side kernel (forward, dQ): one CTA per (query-block pair, head, batch), three
    warpgroups (two consumers, one producer), named ``name`` in profiles; compiled as soon as lowered
    (:mod:`pallas_kernels.mosaic_precompile`)."""
    mosaic_precompile.start()
    return plgpu.kernel(named(kernel, name), out_type=out_type, scratch_types=scratch, grid=(npairs, heads, batch),
                        grid_names=("p", "h", "b"), num_threads=3, thread_name="wg",
                        compiler_params=plgpu.CompilerParams(approx_math=True))(*args)


def check_slots(slots, kv_step: int, d: int) -> int:
    """``slots`` of the stream's shared-memory ring, defaulting to what fits beside the resident
    query tiles (4 at ``kv_step * head_dim <= 8192``, else 2)."""
    if slots is None:
        slots = 4 if kv_step * d <= 64 * 128 else 2
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 2:
        raise ValueError(f"slots must be an int >= 2, got {slots!r}")
    return slots


def stream_operands(index: StepIndex, k, v, q_pos, k_pos, bs: int, segs, kv_step: int, slots: int | None,
                    stream: str = "shared", uniform: bool = False):
    """``(ops, stream, null_info, halves, slots)`` of a query-side kernel (forward, dQ) walking the
    CTA's stream (``stream``: :data:`STREAMS`) in steps of ``kv_step`` keys; ``slots`` defaults to
    what fits beside the resident query tiles (4 at ``kv_step * head_dim <= 8192``, else 2).
    ``uniform``: every (batch, head) row of ``index`` is the same (the full index the API builds for
    ``index=None``, no packed documents): the index's operands and stream are built for the first
    row and broadcast (the same values; the stream's two sorts are what a dense ring step's operands
    cost, ``results/kernels/kernels.md`` run 17), the column tiles per head as always."""
    if kv_step not in (bs, 2 * bs):
        raise ValueError(f"kv_step must be {bs} or {2 * bs}, got {kv_step!r}")
    if stream not in ("shared", "split"):
        raise ValueError(f"stream must be 'shared' or 'split' here ('index', 'auto': run_stream), got {stream!r}")
    if stream == "split" and kv_step != 2 * bs:
        raise ValueError(f"stream='split' needs kv_step={2 * bs} (one {bs}-key half per consumer), got {kv_step!r}")
    halves = kv_step // bs
    slots = check_slots(slots, kv_step, k.shape[-1])
    null_info = jnp.full((2 + (segs is not None), bs), POS_PAD, jnp.int32)
    walk = (lambda ops: split_stream(ops)) if stream == "split" else (lambda ops: pair_stream(ops, halves))
    if not uniform or segs is not None:
        ops = prepare(index, k, v, k_pos, bs, q_pos, segs)
        return ops, walk(ops), null_info, halves, slots
    B, H = index.block_idx.shape[:2]
    row = prepare(jax.tree.map(lambda x: x[:1, :1], index), k[:1, :, :1], v[:1, :, :1], k_pos, bs, q_pos)
    wide = lambda x: jnp.broadcast_to(x, (B, H) + x.shape[2:])  # noqa: E731
    kc, vc = column_tiles(index, k, v, bs)
    ops = row._replace(counts=wide(row.counts), block_idx=wide(row.block_idx), k_info=wide(row.k_info), kc=kc, vc=vc,
                       c_info=wide(row.c_info))
    return ops, PairStream(*map(wide, walk(row))), null_info, halves, slots


def stream_smem(slots: int, kv_step: int, d: int, dtype, segs: bool):
    """Shared memory of the stream's ring: K, V ``[slots, kv_step, d]`` and ``info``."""
    tr = tile_transforms(dtype)
    return (plgpu.SMEM((slots, kv_step, d), dtype, transforms=tr),
            plgpu.SMEM((slots, kv_step, d), dtype, transforms=tr),
            plgpu.SMEM((slots, 2 + segs, kv_step), jnp.int32))


def stream_barriers(slots: int, halves: int, segs: bool):
    """Barriers of the stream's ring: K, V, ``info`` loaded (one arrival per TMA copy), K and V
    freed (one arrival per consumer)."""
    return (plgpu.Barrier(num_arrivals=halves, num_barriers=slots),
            plgpu.Barrier(num_arrivals=halves, num_barriers=slots),
            plgpu.Barrier(num_arrivals=1 if halves == 1 else halves * (2 + segs), num_barriers=slots),
            plgpu.Barrier(num_arrivals=2, num_barriers=slots), plgpu.Barrier(num_arrivals=2, num_barriers=slots))
