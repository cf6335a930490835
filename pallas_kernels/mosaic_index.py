"""Kernel-ready operands of the Mosaic GPU kernels, built from a :class:`StepIndex` in plain XLA.

TMA copies rectangular tiles, so every tile a Mosaic kernel walks is 64 contiguous rows:

* **block tiles**: the row's active KV blocks, the *free* ones first (every pair causal,
  ``block_causal == 0``, and none of its keys a listed column of the row's prefix: no mask);
* **column tiles**: the head's ONE column list, its K/V rows gathered once per step into
  ``kc, vc [B, H, MCp, D]`` (``MCp`` = ``MC`` rounded up to 64); row ``i`` uses the first
  ``ceil(col_count[i] / 64)``.

A key that is both a listed prefix column and inside an active block counts once, in the column
phase. With ``slot[j]`` the key's place in the column list (large when unlisted), both tile kinds
share ONE mask rule on a per-tile ``info [2, 64]`` int32 pair ``(pos, aux)``::

    keep key t  <=>  pos[t] <= q_pos[row]  and  aux[t] >= thr
    block tile:  pos = k_pos,  aux = slot,   thr = col_count[i]      (drop listed prefix columns)
    column tile: pos = k_pos of the column (INT32_MAX on padding),
                 aux = -(list slot),         thr = 1 - col_count[i]  (keep slots < col_count[i])

The dK/dV passes split the pairs the same way: the block pass walks the transposed schedule
(:func:`kv_schedule`) with the rule's rows and columns swapped; the column pass is
column-stationary over ranges of query blocks (:func:`column_ranges`).

Packed documents (``segs = (q_seg [B, Sq], k_seg [B, Sk])``, index narrowed by
:func:`~pallas_kernels.index_format.apply_segments`): ``info`` gets a third row, the keys' segment
ids, and masked tiles also require ``seg[t] == q_seg[row]``; free tiles lie inside one document.
Design notes: ``docs/kernels.md``.
"""

from __future__ import annotations

import functools

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.index_format import StepIndex, column_chunk_rows, column_start, scatter_last, stable_partition

UNLISTED = 1 << 30  # slot of a key that is not in the column list (>= every col_count)
POS_PAD = jnp.iinfo(jnp.int32).max  # position of a padding column: never causal


class MosaicOperands(NamedTuple):
    """Operands of the Mosaic forward/backward kernels (see module docstring)."""

    counts: jax.Array  # int32 [B, H, nQB, 5]: (n_free, n_blocks, col_count, n_free_col_tiles, col_start) per row
    block_idx: jax.Array  # int32 [B, H, nQB, MB]: active KV blocks, free ones first, padding in range
    k_info: jax.Array  # int32 [B, H, nKB, 2, bs]: (k_pos, column slot) per key of each KV block (+ k_seg)
    kc: jax.Array  # [B, H, MCp, D]: K rows of the head's column list (zeros in padding)
    vc: jax.Array  # [B, H, MCp, D]: V rows likewise
    c_info: jax.Array  # int32 [B, H, MCp // bs, 2, bs]: (column position, -slot) per column tile (+ k_seg)


@functools.partial(jax.jit, static_argnames=("sk",))
def column_slots(index: StepIndex, sk: int):
    """``int32 [B, H, Sk]``: for each key, its smallest slot in the head's column list, or
    :data:`UNLISTED`."""
    B, H, mc = index.col_idx.shape
    ids = jnp.clip(index.col_idx, 0, sk - 1)
    b = jnp.arange(B)[:, None, None]
    h = jnp.arange(H)[None, :, None]
    slots = jnp.broadcast_to(jnp.arange(mc, dtype=jnp.int32), (B, H, mc))
    return jnp.full((B, H, sk), UNLISTED, jnp.int32).at[b, h, ids].min(slots)


def column_ids(index: StepIndex, sk: int, mcp: int):
    """``int32 [B, H, MCp]``: the column list clipped to ``[0, Sk)``, padded with key 0 to ``MCp``."""
    return jnp.pad(jnp.clip(index.col_idx, 0, sk - 1), [(0, 0), (0, 0), (0, mcp - index.max_cols)])


def column_tiles(index: StepIndex, k, v, block_size: int):
    """``(kc, vc) [B, H, MCp, D]``: each query head's listed columns of ``k, v [B, Sk, Hkv, D]`` (its KV
    head's), zero on padding; ``MCp`` = ``max_cols`` rounded up to pairs of 64-key tiles (the column
    dK/dV pass's CTAs)."""
    B, H = index.col_idx.shape[:2]
    bs, mc = block_size, index.max_cols
    mcp = -(-max(mc, 1) // (2 * bs)) * 2 * bs
    cidx = column_ids(index, k.shape[1], mcp)
    real = (jnp.arange(mcp) < mc)[None, None, :, None]
    b_ix = jnp.arange(B)[:, None, None]
    hk_ix = (jnp.arange(H) // (H // k.shape[2]))[None, :, None]
    return (jnp.where(real, k[b_ix, cidx, hk_ix], 0).astype(k.dtype),
            jnp.where(real, v[b_ix, cidx, hk_ix], 0).astype(v.dtype))


def _column_info(index: StepIndex, k_pos, bs: int, mcp: int, segs=None):
    """``(cpos [B, H, MCp], cseg [B, H, MCp] or None, c_info int32 [B, H, MCp // bs, 2 (+1), bs])`` of the
    column tiles: the listed columns' positions (``POS_PAD`` on padding), their segment ids (-1 on
    padding) and the info tiles ``(pos, -slot[, seg])``."""
    B, H = index.col_idx.shape[:2]
    cidx = column_ids(index, k_pos.shape[0], mcp)
    s = jnp.arange(mcp, dtype=jnp.int32)
    real = s < index.max_cols
    cpos = jnp.where(real, k_pos.astype(jnp.int32)[cidx], POS_PAD)
    c_rows = [cpos.reshape(B, H, mcp // bs, bs),
              jnp.broadcast_to(-s.reshape(1, 1, mcp // bs, bs), (B, H, mcp // bs, bs))]
    cseg = None
    if segs is not None:
        cseg = jnp.where(real, segs[1].astype(jnp.int32)[jnp.arange(B)[:, None, None], cidx], -1)
        c_rows.append(cseg.reshape(B, H, mcp // bs, bs))
    return cpos, cseg, jnp.stack(c_rows, axis=3).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("block_size",))
def column_operands(index: StepIndex, k, v, k_pos, block_size: int, segs=None):
    """``(kc, vc, c_info)`` of :func:`prepare` alone: what the column dK/dV pass walks (no block tiles)."""
    kc, vc = column_tiles(index, k, v, block_size)
    return kc, vc, _column_info(index, k_pos, block_size, kc.shape[2], segs)[2]


@functools.partial(jax.jit, static_argnames=("block_size",))
def prepare(index: StepIndex, k, v, k_pos, block_size: int, q_pos=None, segs=None) -> MosaicOperands:
    """Build :class:`MosaicOperands` for ``k, v [B, Sk, Hkv, D]`` and query heads ``H`` of ``index``.
    With ``q_pos [Sq]``, each row's leading column tiles that need no mask (every column inside the
    row's prefix and causal for every query of the block) are counted (``counts[..., 3]``) so the
    kernels skip their mask; without, that count is 0. With ``segs = (q_seg [B, Sq], k_seg
    [B, Sk])`` (packed documents, ``index`` narrowed by ``apply_segments``), ``k_info`` and
    ``c_info`` are ``[..., 3, bs]`` with the keys' segment ids as third row (-1 on padding columns),
    a free column tile must also lie, with the query block, inside one document, and ``counts[..., 4]``
    is the row's :func:`~pallas_kernels.index_format.column_start` (its column walk may start at that
    slot's tile: every earlier slot is another document's column; 0 without documents; with documents
    a row with free column tiles starts at 0)."""
    bs = block_size
    B, H, nqb, mb = index.block_idx.shape
    sk = k.shape[1]
    nkb = sk // bs

    slot = column_slots(index, sk)  # [B, H, Sk]
    first_slot = slot.reshape(B, H, nkb, bs).min(axis=-1)  # [B, H, nKB]
    valid = jnp.arange(mb) < index.block_count[..., None]
    bidx = jnp.clip(jnp.where(valid, index.block_idx, 0), 0, nkb - 1).astype(jnp.int32)
    tile_slot = jnp.take_along_axis(first_slot, bidx.reshape(B, H, nqb * mb), axis=2).reshape(bidx.shape)
    has_col = tile_slot < index.col_count[..., None]
    free = valid & (index.block_causal == 0) & ~has_col
    dst, n_free, n_blk = stable_partition(free, valid & ~free)
    bidx = scatter_last(bidx, dst, mb)
    counts = jnp.stack([n_free, n_blk, index.col_count.astype(jnp.int32)], axis=-1)

    kpos_t = jnp.broadcast_to(k_pos.astype(jnp.int32).reshape(1, 1, nkb, bs), (B, H, nkb, bs))
    info_rows = [kpos_t, slot.reshape(B, H, nkb, bs)]
    if segs is not None:
        kseg = segs[1].astype(jnp.int32)
        info_rows.append(jnp.broadcast_to(kseg.reshape(B, 1, nkb, bs), (B, H, nkb, bs)))
    k_info = jnp.stack(info_rows, axis=3)

    kc, vc = column_tiles(index, k, v, bs)
    mcp = kc.shape[2]
    cpos, cseg, c_info = _column_info(index, k_pos, bs, mcp, segs)
    n_cfree = jnp.zeros_like(n_free)
    if q_pos is not None:
        nct = mcp // bs
        tile_max = cpos.reshape(B, H, nct, bs).max(-1)  # padding columns: POS_PAD, never free
        q_min = q_pos.astype(jnp.int32).reshape(nqb, bs).min(-1)
        whole = (jnp.arange(1, nct + 1, dtype=jnp.int32) * bs) <= index.col_count[..., None]  # [B,H,nQB,nCT]
        free_c = whole & (tile_max[:, :, None, :] <= q_min[None, None, :, None])
        if segs is not None:  # and one document: the tile's columns and the query block
            ct = cseg.reshape(B, H, nct, bs)
            qs = segs[0].astype(jnp.int32).reshape(B, nqb, bs)
            one = (qs.min(-1) == qs.max(-1))[:, None, :, None] & (ct.min(-1) == ct.max(-1))[:, :, None, :]
            free_c = free_c & one & (ct.min(-1)[:, :, None, :] == qs.min(-1)[:, None, :, None])
        n_cfree = jnp.cumprod(free_c.astype(jnp.int32), axis=-1).sum(-1, dtype=jnp.int32)
    start = jnp.zeros_like(n_free) if segs is None else column_start(index, segs[0], segs[1], bs)
    counts = jnp.concatenate([counts, n_cfree[..., None], start[..., None]], axis=-1)
    return MosaicOperands(counts.astype(jnp.int32), bidx, k_info, kc, vc, c_info)


# The query-side kernels' CTA owns query blocks 2p and 2p + 1 and walks ONE stream of K/V steps shared
# by its two consumers: the union of the two rows' block tiles, then the column tiles both rows use
# (the longer prefix). Per consumer a step is free (F), masked (M) or skipped (S, not in its row's
# walk); the union's block tiles are grouped by that pair of classes, in this order:
STREAM_SEGMENTS = ((0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (1, 2), (2, 0), (2, 1))
# A step of two tiles (128 keys) pairs two tiles of one group; a group's odd last tile is paired with
# a NULL tile (every key masked) and its step joins the group where both classes are M or S:
_LEFTOVER = (3, 3, 3, 3, 5, 5, 7, 7)
NULL_BLOCK = -1  # block id of a NULL half: the kernels load block 0 with an info tile at POS_PAD


class PairStream(NamedTuple):
    """The block steps of each CTA (query blocks ``2p, 2p + 1``) of the query-side kernels."""

    block_idx: jax.Array  # int32 [B, H, nQB // 2, L, halves]: KV block of each half of step t (NULL_BLOCK)
    bounds: jax.Array  # int32 [B, H, nQB // 2, 9]: segment s of STREAM_SEGMENTS is steps [bounds[s], bounds[s + 1])


def _next(x, fill):
    """``x`` shifted one place left along its last axis (``fill`` last)."""
    return jnp.concatenate([x[..., 1:], jnp.full_like(x[..., :1], fill)], axis=-1)


def _union_segments(real, same_next, tag, cls):
    """Merge two class-tagged lists sorted into one by tile (last axis): entry ``i`` is list ``tag[i]``'s
    (0 or 1) tile of class ``cls[i]`` (0 free, 1 masked), ``same_next[i]``: entry ``i + 1`` is the same
    tile (list 1's). Returns each entry's :data:`STREAM_SEGMENTS` group of its tile's class pair (2:
    not in that list), ``len(STREAM_SEGMENTS)`` for padding (``~real``) and for list 1's copy of a tile
    both lists hold (dropped: list 0's entry carries the pair)."""
    nseg = len(STREAM_SEGMENTS)
    dup = jnp.concatenate([jnp.zeros_like(same_next[..., :1]), same_next[..., :-1]], axis=-1)
    c0 = jnp.where(tag == 0, cls, 2)
    c1 = jnp.where(tag == 1, cls, jnp.where(same_next, _next(cls, 2), 2))
    seg_of = jnp.full((9,), nseg, jnp.int32)
    for s, (a, c) in enumerate(STREAM_SEGMENTS):
        seg_of = seg_of.at[3 * a + c].set(s)
    return jnp.where(real & ~dup, seg_of[3 * c0 + c1], nseg)


@functools.partial(jax.jit, static_argnames=("halves",))
def pair_stream(ops: MosaicOperands, halves: int = 1) -> PairStream:
    """Merge the block walks of query blocks ``2p`` and ``2p + 1`` (:class:`MosaicOperands`
    ``block_idx`` / ``counts``) into one stream of steps of ``halves`` tiles (1: 64 keys, 2: 128
    keys) per CTA: every KV block either row lists appears once, grouped by its (row ``2p`` class,
    row ``2p + 1`` class) in :data:`STREAM_SEGMENTS` order, ascending block id inside a group; with
    two halves a group's odd last tile is paired with a :data:`NULL_BLOCK` half and that step is
    counted in group ``_LEFTOVER[group]`` (a free tile there is masked: the same keys survive). A
    row's walk over the stream (its F and M tiles) is the same multiset of blocks as its own list."""
    if halves not in (1, 2):
        raise ValueError(f"halves must be 1 or 2, got {halves!r}")
    B, H, nqb, mb = ops.block_idx.shape
    npair, nseg = nqb // 2, len(STREAM_SEGMENTS)
    big = jnp.int32(1 << 30)
    j = jnp.arange(mb, dtype=jnp.int32)
    n_free, n_blk = ops.counts[..., 0:1], ops.counts[..., 1:2]
    cls = jnp.where(j < n_free, 0, jnp.where(j < n_blk, 1, 2)).astype(jnp.int32)  # [B, H, nQB, MB]
    kb = jnp.where(cls < 2, ops.block_idx, big)
    kb = kb.reshape(B, H, npair, 2 * mb)  # row 2p's list, then row 2p + 1's
    cls = cls.reshape(B, H, npair, 2 * mb)
    tag = jnp.broadcast_to((jnp.arange(2 * mb, dtype=jnp.int32) >= mb).astype(jnp.int32), kb.shape)
    kb, tag, cls = jax.lax.sort((kb, tag, cls), dimension=3, num_keys=2)
    real = kb < big
    seg = _union_segments(real, real & (_next(kb, -1) == kb), tag, cls)
    seg, kb = jax.lax.sort((seg, kb), dimension=3, num_keys=2)
    starts = (seg[..., None] < jnp.arange(nseg + 1, dtype=jnp.int32)).sum(-2, dtype=jnp.int32)  # [..., 9]
    if halves == 1:
        return PairStream(jnp.where(kb < big, kb, 0)[..., None].astype(jnp.int32), starts)
    n = starts[..., 1:] - starts[..., :-1]  # tiles per group [..., 8]
    odd = n % 2
    into = (jnp.asarray(_LEFTOVER, jnp.int32)[:, None]  # [src, dst]
            == jnp.arange(nseg, dtype=jnp.int32)[None, :]).astype(jnp.int32)
    steps = n // 2 + odd @ into  # steps per group
    sbound = jnp.concatenate([jnp.zeros_like(steps[..., :1]), jnp.cumsum(steps, -1, dtype=jnp.int32)], -1)
    # leftover of group s: after group target(s)'s paired steps and the earlier groups' leftovers
    lower = (jnp.arange(nseg)[:, None] < jnp.arange(nseg)[None, :]).astype(jnp.int32)
    prior = jnp.einsum("...a,ab,ad->...bd", odd, lower, into)  # [..., src, dst]
    tgt = np.asarray(_LEFTOVER)
    left_step = sbound[..., tgt] + (n // 2)[..., tgt] + prior[..., np.arange(nseg), tgt]
    segc = jnp.minimum(seg, nseg - 1)
    r = jnp.arange(2 * mb, dtype=jnp.int32) - jnp.take_along_axis(starts, segc, -1)
    n_e = jnp.take_along_axis(n, segc, -1)
    paired = r < n_e - n_e % 2
    step = jnp.where(paired, jnp.take_along_axis(sbound, segc, -1) + r // 2, jnp.take_along_axis(left_step, segc, -1))
    half = jnp.where(paired, r % 2, 0)
    L = mb + 8  # steps: at most ceil(2 MB / 2) + one leftover per group
    # dropped entries -> distinct out-of-range steps; kept ones have distinct (step, half): the
    # scatter's indices are unique (no atomics, no serialising loop under deterministic GPU ops)
    step = jnp.where(seg < nseg, step, L + jnp.arange(2 * mb, dtype=jnp.int32))
    out = jnp.full((B, H, npair, L, 2), NULL_BLOCK, jnp.int32)
    ix = [jnp.arange(x)[(slice(None),) + (None,) * (3 - d)] for d, x in enumerate((B, H, npair))]
    out = out.at[ix[0], ix[1], ix[2], step, half].set(kb, mode="drop", unique_indices=True)
    return PairStream(out, sbound)


@jax.jit
def split_stream(ops: MosaicOperands) -> PairStream:
    """Separate streams of query blocks ``2p`` and ``2p + 1`` in one ring of 128-key steps: half ``w``
    of step ``t`` is row ``2p + w``'s ``t``-th block tile (its free ones first, then its masked ones;
    :data:`NULL_BLOCK` past its list), so each consumer computes 64 keys of its own per step and both
    use every step while both have tiles (the shared stream pairs only tiles both rows list:
    ``benchmarks/consumer_pairing.py``). A step's class pair (row ``2p``'s class of its half, row
    ``2p + 1``'s of its) only grows along the stream, which is :data:`STREAM_SEGMENTS`' order: the
    same ``bounds`` describe the walk (``halves`` is 2)."""
    B, H, nqb, mb = ops.block_idx.shape
    npair, nseg = nqb // 2, len(STREAM_SEGMENTS)
    rows = ops.block_idx.reshape(B, H, npair, 2, mb)
    n_free = ops.counts[..., 0].reshape(B, H, npair, 2, 1)
    n_blk = ops.counts[..., 1].reshape(B, H, npair, 2, 1)
    t = jnp.arange(mb, dtype=jnp.int32)
    cls = jnp.where(t < n_free, 0, jnp.where(t < n_blk, 1, 2)).astype(jnp.int32)  # [B, H, P, 2, MB]
    halves = jnp.where(cls < 2, rows, NULL_BLOCK).astype(jnp.int32)
    seg_of = jnp.full((9,), nseg, jnp.int32)
    for g, (a, c) in enumerate(STREAM_SEGMENTS):
        seg_of = seg_of.at[3 * a + c].set(g)
    seg = seg_of[3 * cls[..., 0, :] + cls[..., 1, :]]  # [B, H, P, MB]; (2, 2) past both lists: nseg
    bounds = (seg[..., None] < jnp.arange(nseg + 1, dtype=jnp.int32)).sum(-2, dtype=jnp.int32)
    return PairStream(jnp.moveaxis(halves, 3, -1), bounds)


#: largest key range sorted as one uint32 key (above it: a two-key sort; tests lower it)
_ONE_KEY_LIMIT = 2**32


def _sort_keys(keys, sizes):
    """Sort by the integer ``keys`` (each in ``[0, size)``, most significant first) and return them
    sorted: one uint32 key (the radix sort path) when the combined range fits
    (:data:`_ONE_KEY_LIMIT`), else a multi-key sort."""
    total = 1
    for n in sizes:
        total *= n
    if total <= _ONE_KEY_LIMIT:
        key = jnp.zeros(keys[0].shape, jnp.uint32)
        for x, n in zip(keys, sizes):
            key = key * jnp.uint32(n) + x.astype(jnp.uint32)
        key = lax.sort(key)
        out = []
        for n in sizes[::-1]:
            out.append((key % jnp.uint32(n)).astype(jnp.int32))
            key = key // jnp.uint32(n)
        return out[::-1]
    return list(lax.sort(tuple(x.astype(jnp.int32) for x in keys), num_keys=len(keys)))


def _kv_tiles(index: StepIndex, sk: int, hkv: int, bs: int):
    """Each entry ``[B, H, nQB, MB]`` of ``index`` as a tile of the KV-stationary dK/dV block pass:
    ``(valid, list, masked, e)``: a listed entry; its KV list ``(b * Hkv + hk) * nKB + kb``; its class
    (0 free: every pair causal and no listed column of the row's prefix in the block; 1 masked); its
    place ``e = j * nQB + qb`` in the list's (query head of the group, query block) order."""
    B, H, nqb, mb = index.block_idx.shape
    nkb, g = sk // bs, H // hkv
    valid = jnp.arange(mb) < index.block_count[..., None]
    kb = jnp.clip(index.block_idx, 0, nkb - 1)
    b_ix = jnp.arange(B)[:, None, None, None]
    h_ix = jnp.arange(H)[None, :, None, None]
    first_slot = column_slots(index, sk).reshape(B, H, nkb, bs).min(axis=-1)
    has_col = first_slot[b_ix, h_ix, kb] < index.col_count[..., None]
    masked = ((index.block_causal != 0) | has_col).astype(jnp.int32)
    lst = (b_ix * hkv + h_ix // g) * nkb + kb
    e = jnp.broadcast_to((h_ix % g) * nqb + jnp.arange(nqb)[None, None, :, None], kb.shape)
    return valid, lst, masked, e


@functools.partial(jax.jit, static_argnames=("sk", "hkv", "block_size"))
def kv_schedule(index: StepIndex, sk: int, hkv: int, block_size: int):
    """KV-stationary schedule of the dK/dV block pass, one list per (batch, KV head, KV block) over
    the ``g = H // hkv`` query heads of the group, stored compactly (CSR): its size is the index's
    ``B * H * nQB * MB`` entries, not the ``B * H * nKB * nQB`` tile map.

    Returns ``(entries int32 [B * H * nQB * MB], counts int32 [B, Hkv, nKB, 3])``: the list of
    ``(b, hk, kb)`` is ``entries[off : off + n_all]`` with ``(n_free, n_all, off) = counts[b, hk,
    kb]``; entry ``e = j * nQB + qb`` is query block ``qb`` of query head ``hk * g + j``; the first
    ``n_free`` entries are free tiles (every pair causal and no listed column of the row's prefix in
    the block: no mask), then the masked ones, each group in (head, query block) order; entries past
    the last list are padding (in range)."""
    B, H, nqb, _ = index.block_idx.shape
    nkb, g = sk // block_size, H // hkv
    valid, lst, masked, e = _kv_tiles(index, sk, hkv, block_size)
    nrows = B * hkv * nkb
    row = jnp.where(valid, lst * 2 + masked, 2 * nrows).reshape(-1)  # (list, class); padding sorts last
    e = e.reshape(-1)
    L = g * nqb
    _, entries = _sort_keys((row, e), (2 * nrows + 1, L))
    per = jnp.zeros((2 * nrows + 1,), jnp.int32).at[row].add(1)[:2 * nrows].reshape(nrows, 2)
    n_free, n_all = per[:, 0], per[:, 0] + per[:, 1]
    off = jnp.cumsum(n_all) - n_all
    counts = jnp.stack([n_free, n_all, off], axis=-1).astype(jnp.int32).reshape(B, hkv, nkb, 3)
    return entries, counts


@functools.partial(jax.jit, static_argnames=("sk", "hkv", "block_size", "uniform"))
def kv_pair_schedule(index: StepIndex, sk: int, hkv: int, block_size: int, uniform: bool = False):
    """The dK/dV block pass's shared Q/dO stream: for the CTA owning KV blocks ``2p`` and ``2p + 1``
    of KV head ``hk``, ONE list of the tiles either block's :func:`kv_schedule` list holds (a
    (query head, query block) tile both list is loaded once and used by both consumers), grouped by
    the pair of classes (block ``2p``'s, block ``2p + 1``'s: free 0, masked 1, absent 2) in
    :data:`STREAM_SEGMENTS` order, each group in (query head, query block) order. A consumer's walk
    over it (its free and masked tiles) holds its block's list of :func:`kv_schedule`, each tile once
    (in segment order).

    Returns ``(entries int32 [B * H * nQB * MB], bounds int32 [B, Hkv, nKB // 2, 9])``: segment ``s``
    of CTA ``(b, hk, p)`` is ``entries[bounds[..., s] : bounds[..., s + 1]]``, entries as in
    :func:`kv_schedule` (``e = j * nQB + qb``); entries past the last list are padding. ``Sk`` a
    multiple of ``2 * block_size``. ``uniform``: every (batch, head) row of ``index`` alike (the
    full index for ``index=None``): the lists of one KV group are built and every (batch, KV head)
    points at them."""
    bs = block_size
    B, H, nqb, mb = index.block_idx.shape
    nkb, g = sk // bs, H // hkv
    if nkb % 2:
        raise ValueError(f"kv_pair_schedule needs Sk a multiple of {2 * bs}, got {sk}")
    if uniform:
        entries, bounds = kv_pair_schedule(jax.tree.map(lambda x: x[:1, :g], index), sk, 1, bs)
        return entries, jnp.broadcast_to(bounds, (B, hkv) + bounds.shape[2:])
    nseg, npair = len(STREAM_SEGMENTS), nkb // 2
    nrows, L = B * hkv * npair, g * nqb
    valid, lst, masked, e = _kv_tiles(index, sk, hkv, bs)
    # lst = (b * Hkv + hk) * nKB + kb with nKB even: the CTA is lst // 2, the consumer lst % 2
    cta = jnp.where(valid, lst // 2, nrows).reshape(-1)  # padding sorts last
    cta, e, w, masked = _sort_keys((cta, e.reshape(-1), (lst % 2).reshape(-1), masked.reshape(-1)),
                                   (nrows + 1, L, 2, 2))
    real = cta < nrows
    seg = _union_segments(real, real & (_next(cta, -1) == cta) & (_next(e, -1) == e), w, masked)
    cta = jnp.where(seg < nseg, cta, nrows)
    per = jnp.zeros((nrows * nseg + 1,), jnp.int32).at[jnp.where(seg < nseg, cta * nseg + seg, nrows * nseg)].add(1)
    cta, seg, e = _sort_keys((cta, seg, e), (nrows + 1, nseg + 1, L))
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(per[:-1], dtype=jnp.int32)])
    at = jnp.arange(nrows, dtype=jnp.int32)[:, None] * nseg + jnp.arange(nseg + 1, dtype=jnp.int32)[None, :]
    return e.astype(jnp.int32), starts[at].reshape(B, hkv, npair, nseg + 1)


@functools.partial(jax.jit, static_argnames=("sk", "hkv", "block_size"))
def uniform_kv_schedule(index: StepIndex, sk: int, hkv: int, block_size: int):
    """:func:`kv_schedule` of an index whose every (batch, head) row is the same (the full index the API
    builds for ``index=None``): the lists are built for one row and every (batch, KV head) pair of a KV
    block points at one shared list, ``g * nQB`` slots per KV block (not the index's ``B * H * nQB * MB``
    entries and their sort). Same ``(n_free, n_all)`` and the same lists, entry for entry."""
    B, H, nqb, _ = index.block_idx.shape
    g, nkb, L = H // hkv, sk // block_size, (H // hkv) * nqb
    one, c1 = kv_schedule(jax.tree.map(lambda x: x[:1, :1], index), sk, 1, block_size)
    nf, na, off = (c1[0, 0, :, i][:, None] for i in range(3))  # [nKB, 1]: one query head's lists
    t = jnp.arange(L, dtype=jnp.int32)[None, :]
    free = t < g * nf  # the g heads' free tiles, head after head, then their masked ones
    u = t - g * nf
    nm = jnp.maximum(na - nf, 1)
    j = jnp.where(free, t // jnp.maximum(nf, 1), u // nm)
    src = jnp.where(free, off + t % jnp.maximum(nf, 1), off + nf + u % nm)
    entries = jnp.where(t < g * na, j * nqb + one[jnp.clip(src, 0, one.shape[0] - 1)], 0).reshape(-1)
    counts = jnp.concatenate([g * nf, g * na, jnp.arange(nkb, dtype=jnp.int32)[:, None] * L], axis=-1)
    return entries.astype(jnp.int32), jnp.broadcast_to(counts.astype(jnp.int32), (B, hkv, nkb, 3))


@functools.partial(jax.jit, static_argnames=("length",))
def dense_kv_schedule(entries, counts, length: int):
    """``int32 [B, Hkv, nKB, length]``: each list of :func:`kv_schedule` padded to ``length`` (the
    emulation's and tests' view; entries past a list's end are arbitrary)."""
    t = jnp.arange(length, dtype=jnp.int32)
    return entries[jnp.minimum(counts[..., 2:3] + t, entries.shape[0] - 1)]


def column_ranges(col_count, nchunks: int, bs: int, range_blocks: int, col_start=None):
    """Query-block walk of the column dK/dV pass: ``(first, end) int32 [B, H, nchunks]``
    (:func:`~pallas_kernels.index_format.column_chunk_rows`: the blocks that need chunk ``c``; with
    packed documents, ``col_start``, not the later documents) and the number of ranges ``R = ceil(nQB /
    range_blocks)``. Range ``r`` of a chunk walks query blocks ``[max(first, r * range_blocks), min(end,
    (r + 1) * range_blocks))``; the blocks between that do not need the chunk are walked masked (all
    their pairs dropped)."""
    first, end = column_chunk_rows(col_count, nchunks, bs, col_start)
    return first, end, max(1, -(-col_count.shape[-1] // range_blocks))


def column_free_range(c_info, col_count, q_pos, bs: int, first, end, q_seg=None):
    """``(lo, hi) int32 [B, H, nchunks]``: query blocks ``[lo, hi)`` inside chunk ``c``'s walk ``[first,
    end)`` (:func:`column_ranges`) where the column dK/dV pass needs no mask for that chunk (the tiles
    of ``c_info [B, H, nchunks, 2 (+1), bs]``, :func:`column_operands`): for each of those blocks all
    64 columns are in the row's prefix (``col_count >= (c + 1) * bs``, so no padding either) and at or
    before every query of the block (``q_pos [Sq]``), and with packed documents (``q_seg [B, Sq]``)
    the chunk and the block lie in one document. ``hi`` is the last such block of the walk plus one,
    ``lo`` the block after the last one before ``hi`` that needs the mask (``lo = hi = first`` if no
    block is free): exact for any ``col_count`` and ``q_pos`` order. Without documents it is the walk's
    suffix past the chunk's last column; with documents the part of the chunk's document after it (the
    block straddling the document's end is masked)."""
    B, H, nch = c_info.shape[:3]
    nqb = col_count.shape[-1]
    qmin = q_pos.astype(jnp.int32).reshape(nqb, bs).min(-1)  # [nQB]
    ends = (jnp.arange(nch, dtype=jnp.int32) + 1) * bs
    free = (col_count[..., None, :] >= ends[:, None]) & (c_info[:, :, :, 0].max(-1)[..., None] <= qmin)
    if q_seg is not None:  # [B, H, nch, nQB] &= one document for both
        cseg = c_info[:, :, :, 2]
        qs = q_seg.astype(jnp.int32).reshape(B, nqb, bs)
        one_c = (cseg.min(-1) == cseg.max(-1))[..., None]
        one_q = (qs.min(-1) == qs.max(-1))[:, None, None, :]
        free = free & one_c & one_q & (cseg[..., 0][..., None] == qs[:, None, None, :, 0])
    blk = jnp.arange(nqb, dtype=jnp.int32)
    walked = (blk >= first[..., None]) & (blk < end[..., None])
    free = free & walked

    def last_plus_one(x, fallback):  # 1 + the last True of x [..., nQB], else fallback
        return jnp.where(x.any(-1), nqb - jnp.argmax(x[..., ::-1], axis=-1), fallback).astype(jnp.int32)

    hi = last_plus_one(free, first)
    lo = last_plus_one(walked & ~free & (blk < hi[..., None]), first)
    return jnp.minimum(lo, hi), hi


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_size"))
def emulate_dkv_blocks(q, k, v, q_pos, k_pos, index: StepIndex, do, lse, delta, *, sm_scale: float,
                       block_size: int, segs=None):
    """The dK/dV block pass's walk over :func:`kv_schedule` in plain ``jax.numpy`` (float32): for
    every listed tile, ``dV += P^T dO`` and ``dK += scale * dS^T Q``; masked tiles keep the causal
    pairs whose key is not a listed column of the row's prefix. Returns ``(dk, dv) f32
    [B, Sk, Hkv, D]`` (for testing the schedule on any machine). ``segs = (q_seg, k_seg)``: packed
    documents (``index`` narrowed by ``apply_segments``), masked tiles also keep same-document pairs
    only."""
    bs = block_size
    B, sq, H, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    nqb, nkb, g = sq // bs, sk // bs, H // hkv
    f32 = jnp.float32
    entries, counts = kv_schedule(index, sk, hkv, bs)
    L = g * nqb
    sched = dense_kv_schedule(entries, counts, L)
    qb = sched % nqb
    t = jnp.arange(L)
    used = t < counts[..., 1:2]
    masked = t >= counts[..., 0:1]
    b_ix = jnp.arange(B)[:, None, None, None]
    hq = jnp.arange(hkv)[None, :, None, None] * g + sched // nqb
    qt = q.astype(f32).reshape(B, nqb, bs, H, d)[b_ix, qb, :, hq]  # [B, Hkv, nKB, L, bs, D]
    dot = do.astype(f32).reshape(B, nqb, bs, H, d)[b_ix, qb, :, hq]
    lse_t = lse.reshape(B, H, nqb, bs)[b_ix, hq, qb]  # [B, Hkv, nKB, L, bs]
    delta_t = delta.reshape(B, H, nqb, bs)[b_ix, hq, qb]
    qpos_t = q_pos.reshape(nqb, bs)[qb]
    thr_t = index.col_count[b_ix, hq, qb][..., None, None]  # [B, Hkv, nKB, L, 1, 1]
    slot_t = column_slots(index, sk).reshape(B, H, nkb, bs)[b_ix, hq, jnp.arange(nkb)[None, None, :, None]]
    kt = k.astype(f32).reshape(B, nkb, bs, hkv, d).transpose(0, 3, 1, 2, 4)  # [B, Hkv, nKB, bs, D]
    vt = v.astype(f32).reshape(B, nkb, bs, hkv, d).transpose(0, 3, 1, 2, 4)
    kpos_t = k_pos.reshape(nkb, bs)[None, None, :, None, :, None]  # [.., kv, q]
    s = jnp.einsum("bhnkd,bhnlqd->bhnlkq", kt, qt) * sm_scale
    keep = (kpos_t <= qpos_t[..., None, :]) & (slot_t[..., :, None] >= thr_t)
    if segs is not None:
        qseg_t = segs[0].astype(jnp.int32).reshape(B, nqb, bs)[b_ix, qb]  # [B, Hkv, nKB, L, bs]
        kseg_t = segs[1].astype(jnp.int32).reshape(B, 1, nkb, 1, bs)
        keep = keep & (kseg_t[..., :, None] == qseg_t[..., None, :])
    ok = used[..., None, None] & (~masked[..., None, None] | keep)
    lse_safe = jnp.where(jnp.isfinite(lse_t), lse_t, 0.0)[..., None, :]
    p = jnp.where(ok, jnp.exp(s - lse_safe), 0.0)
    dv = jnp.einsum("bhnlkq,bhnlqd->bhnkd", p, dot)
    dp = jnp.einsum("bhnkd,bhnlqd->bhnlkq", vt, dot)
    ds = p * (dp - delta_t[..., None, :])
    dk = jnp.einsum("bhnlkq,bhnlqd->bhnkd", ds, qt) * sm_scale
    back = lambda x: x.transpose(0, 2, 3, 1, 4).reshape(B, sk, hkv, d)  # noqa: E731
    return back(dk), back(dv)


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_size"))
def emulate_fwd(q, ops: MosaicOperands, k, v, q_pos, *, sm_scale: float, block_size: int, q_seg=None):
    """The Mosaic forward's tile walk in plain ``jax.numpy`` (float32, exact softmax): what the
    kernel computes from :class:`MosaicOperands`, for testing :func:`prepare` on any machine.
    ``q_seg [B, Sq]``: packed documents (operands prepared with ``segs``; masked tiles also check
    the keys' segment row of ``info``). Returns ``(out f32 [B, Sq, H, D], lse f32 [B, H, Sq])``."""
    bs = block_size
    B, sq, H, d = q.shape
    g = H // k.shape[2]
    nqb, mb = ops.block_idx.shape[2], ops.block_idx.shape[3]
    nct = ops.kc.shape[2] // bs
    f32 = jnp.float32
    qb = q.astype(f32).reshape(B, nqb, bs, H, d)
    kb = k.astype(f32).reshape(B, -1, bs, k.shape[2], d)  # [B, nKB, bs, Hkv, D]
    vb = v.astype(f32).reshape(B, -1, bs, k.shape[2], d)
    hk = jnp.arange(H) // g
    # block tiles: [B, H, nQB, MB, bs, D]
    kt = kb[jnp.arange(B)[:, None, None, None], ops.block_idx, :, hk[None, :, None, None]]
    vt = vb[jnp.arange(B)[:, None, None, None], ops.block_idx, :, hk[None, :, None, None]]
    info_b = ops.k_info[jnp.arange(B)[:, None, None, None], jnp.arange(H)[None, :, None, None],
                        ops.block_idx]  # [B, H, nQB, MB, 2, bs]
    n_free, n_blk, ncol = ops.counts[..., 0], ops.counts[..., 1], ops.counts[..., 2]
    j = jnp.arange(mb)
    qpos = q_pos.reshape(nqb, bs)[None, None, :, :, None, None]  # [1,1,nQB,bs,1,1]
    causal_b = info_b[:, :, :, None, :, 0, :] <= qpos  # [B,H,nQB,bs,MB,bs]
    aux_ok_b = info_b[:, :, :, None, :, 1, :] >= ncol[..., None, None, None]
    masked_b = (j >= n_free[..., None])[:, :, :, None, :, None]
    if q_seg is not None:  # [B, 1, nQB, bs, 1, 1] vs the keys' segment row
        qs = q_seg.astype(jnp.int32).reshape(B, 1, nqb, bs, 1, 1)
        aux_ok_b = aux_ok_b & (info_b[:, :, :, None, :, 2, :] == qs)
    ok_b = (j < n_blk[..., None])[:, :, :, None, :, None] & (~masked_b | (causal_b & aux_ok_b))
    s_b = jnp.einsum("bnqhd,bhnjkd->bhnqjk", qb, kt) * sm_scale
    s_b = jnp.where(ok_b, s_b, -jnp.inf).reshape(B, H, nqb, bs, mb * bs)
    # column tiles: [B, H, nCT, bs, D]
    kct = ops.kc.astype(f32).reshape(B, H, nct, bs, d)
    vct = ops.vc.astype(f32).reshape(B, H, nct, bs, d)
    c = jnp.arange(nct)
    ntile = (ncol + bs - 1) // bs
    first = ops.counts[..., 4] // bs  # column_start's tile: the walk starts there
    in_walk = ((c >= first[..., None]) & (c < ntile[..., None]))[:, :, :, None, :, None]  # [B,H,nQB,1,nCT,1]
    cpos = ops.c_info[:, :, None, None, :, 0, :]  # [B,H,1,1,nCT,bs]
    caux = ops.c_info[:, :, None, None, :, 1, :]
    ok_c = (cpos <= qpos[..., 0, :][..., None]) & (caux >= (1 - ncol)[..., None, None, None])
    if q_seg is not None:
        ok_c = ok_c & (ops.c_info[:, :, None, None, :, 2, :] == qs[..., 0, :][..., None])
    free_c = (c >= 0) & (c < ops.counts[..., 3][..., None])  # the walk's mask-free column tiles
    ok_c = in_walk & (free_c[:, :, :, None, :, None] | ok_c)
    s_c = jnp.einsum("bnqhd,bhckd->bhnqck", qb, kct) * sm_scale
    s_c = jnp.where(ok_c, s_c, -jnp.inf).reshape(B, H, nqb, bs, nct * bs)
    s = jnp.concatenate([s_b, s_c], axis=-1)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    l = p.sum(-1)
    vall = jnp.concatenate([vt.reshape(B, H, nqb, mb * bs, d),
                            jnp.broadcast_to(vct.reshape(B, H, 1, nct * bs, d), (B, H, nqb, nct * bs, d))], axis=3)
    o = jnp.einsum("bhnqk,bhnkd->bhnqd", p, vall) / jnp.where(l == 0, 1.0, l)[..., None]
    lse = jnp.where(l == 0, -jnp.inf, m[..., 0] + jnp.log(jnp.where(l == 0, 1.0, l)))
    out = jnp.transpose(o, (0, 2, 3, 1, 4)).reshape(B, sq, H, d)
    return out, lse.reshape(B, H, sq)
