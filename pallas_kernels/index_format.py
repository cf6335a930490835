"""The per-step block-sparse index: the contract between the sparse-index builder and the kernels.

One ``StepIndex`` describes, for the queries a rank holds and ONE visiting K/V chunk (one ring
step, or the whole sequence on one device), which keys each query block may attend to; queries
and keys are split into blocks of ``block_size`` (default 64) local rows. ``H`` = query heads.

* ``block_idx   int32 [B, H, nQB, MB]``  local KV-block ids; the first ``block_count`` of a row
  are valid, distinct and ascending; the rest is padding (in range, never read as active).
* ``block_count int32 [B, H, nQB]``      ``0 <= count <= MB``.
* ``block_causal int32 [B, H, nQB, MB]`` 1 where the tile holds a non-causal pair (token-level
  mask needed); 0 promises every pair is causal (:func:`causal_flags`).
* ``col_idx     int32 [B, H, MC]``       the vertical columns: ONE list per (batch, head), local
  token ids, distinct, ordered so that each query block's columns are a prefix.
* ``col_count   int32 [B, H, nQB]``      query block ``i`` uses ``col_idx[..., :col_count[i]]``.

Meaning: query ``i`` may attend key ``j`` iff ``(j // bs is an active block of its row or j is in
its column prefix) and k_pos[j] <= q_pos[i]``; a prefix column inside an active block counts once
(kernels skip it in the column phase). ``q_pos [Sq]``, ``k_pos [Sk]``: global positions, shared by
the batch. ``index = None`` everywhere means dense causal attention by position.

Packed documents: segment ids ``q_seg int32 [B, Sq]``, ``k_seg int32 [B, Sk]`` add ``q_seg[b, i]
== k_seg[b, j]``; :func:`apply_segments` narrows the index to them.
"""

from __future__ import annotations

import functools

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.inputs import check_integers

DEFAULT_BLOCK = 64


class StepIndex(NamedTuple):
    """Block + column sparse index for one (query chunk, K/V chunk) pair. See module docstring."""

    block_idx: jax.Array
    block_count: jax.Array
    block_causal: jax.Array
    col_idx: jax.Array
    col_count: jax.Array

    @property
    def max_blocks(self) -> int:
        return self.block_idx.shape[-1]

    @property
    def max_cols(self) -> int:
        return self.col_idx.shape[-1]


def check_step_index(index: StepIndex, batch: int, heads: int, sq: int, sk: int, block_size: int) -> None:
    """Static shape and dtype checks; ``ValueError`` naming the mismatch (a float or bool field would be
    cast or misread inside a kernel)."""
    for name in StepIndex._fields:
        check_integers(f"index.{name}", getattr(index, name).dtype)
    if sq % block_size or sk % block_size:
        raise ValueError(
            f"query length {sq} and key length {sk} must be multiples of the block size {block_size}"
        )
    nqb = sq // block_size
    want = (batch, heads, nqb)
    for name in ("block_count", "col_count"):
        got = getattr(index, name).shape
        if tuple(got) != want:
            raise ValueError(f"index.{name} has shape {tuple(got)}, expected [B, H, nQB] = {want}")
    for name in ("block_idx", "block_causal"):
        got = getattr(index, name).shape
        if tuple(got[:3]) != want or len(got) != 4:
            raise ValueError(f"index.{name} has shape {tuple(got)}, expected [B, H, nQB, M] with [B, H, nQB] = {want}")
    got = index.col_idx.shape
    if tuple(got[:2]) != want[:2] or len(got) != 3:
        raise ValueError(f"index.col_idx has shape {tuple(got)}, expected [B, H, MC] with [B, H] = {want[:2]}")
    if index.block_causal.shape != index.block_idx.shape:
        raise ValueError(
            f"index.block_causal shape {index.block_causal.shape} != block_idx shape {index.block_idx.shape}"
        )
    if index.max_blocks > sk // block_size:
        raise ValueError(f"index has {index.max_blocks} block slots but the KV chunk has only "
                         f"{sk // block_size} blocks")


@functools.partial(jax.jit, static_argnames=("block_size",))
def step_work(index: StepIndex, block_size: int = DEFAULT_BLOCK):
    """Attended kernel slots of an index (float32, summed over everything but a leading step
    axis, if any): ``block_count * bs^2 + col_count * bs`` — the unit of the load metrics."""
    w = index.block_count.astype(jnp.float32) * block_size**2 + index.col_count.astype(jnp.float32) * block_size
    return w.reshape(w.shape[0], -1).sum(axis=1) if w.ndim == 4 else w.sum()


@functools.partial(jax.jit, static_argnames=("sk", "num_chunks", "block_size"))
def chunk_work(index: StepIndex, sk: int, num_chunks: int, block_size: int = DEFAULT_BLOCK):
    """``float32 [num_chunks]``: :func:`step_work` of an index over ``num_chunks`` equal K/V chunks
    concatenated (``sk`` keys; ring steps fused into one kernel call), split by chunk. For the union
    index of ``convert_step(..., num_chunks=C)``, entry ``c`` equals ``step_work`` of chunk ``c``'s
    own step index (a row's column prefix is every held column at or before its last query)."""
    nkb_c, sk_c = sk // block_size // num_chunks, sk // num_chunks
    chunks = jnp.arange(num_chunks)
    valid = jnp.arange(index.max_blocks) < index.block_count[..., None]  # [B, H, nQB, MB]
    blocks = (valid[..., None] & ((index.block_idx // nkb_c)[..., None] == chunks)).sum(axis=(0, 1, 2, 3))
    in_chunk = (index.col_idx // sk_c)[..., None] == chunks  # [B, H, MC, C]
    upto = jnp.pad(jnp.cumsum(in_chunk, axis=2, dtype=jnp.int32), ((0, 0), (0, 0), (1, 0), (0, 0)))
    cols = jnp.take_along_axis(upto, index.col_count[..., None], axis=2).sum(axis=(0, 1, 2))  # [C]
    return blocks.astype(jnp.float32) * block_size**2 + cols.astype(jnp.float32) * block_size


@functools.partial(jax.jit, static_argnames=("block_size",))
def causal_flags(q_pos, k_pos, block_idx, block_size: int = DEFAULT_BLOCK):
    """``int32`` like ``block_idx``: 1 where the tile (query block, KV block) has a non-causal pair."""
    qmin = q_pos.reshape(-1, block_size).min(axis=1)  # [nQB]
    kmax = k_pos.reshape(-1, block_size).max(axis=1)  # [nKB]
    nqb = qmin.shape[0]
    qmin_b = qmin.reshape((1, 1, nqb, 1))
    return (kmax[block_idx] > qmin_b).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("block_size",))
def segment_ranges(seg, block_size: int):
    """``(min, max) int32 [B, n]`` of the segment ids ``seg [B, n * block_size]`` per block."""
    b = seg.reshape(seg.shape[0], -1, block_size)
    return b.min(axis=-1), b.max(axis=-1)


@functools.partial(jax.jit, static_argnames=("block_size",))
def apply_segments(index: StepIndex, q_seg, k_seg, block_size: int = DEFAULT_BLOCK) -> StepIndex:
    """``index`` restricted to packed documents (see module docstring): a tile whose query and key
    segment ranges are disjoint is removed (the active blocks stay sorted, counts shrink), and
    ``block_causal`` becomes 1 where the tile is not inside ONE document (its pairs need the
    token-level check). Columns are left as they are (kernels check them per token). Exact for any
    segment ids; idempotent."""
    B, H, nqb, mb = index.block_idx.shape
    qmin, qmax = segment_ranges(q_seg, block_size)  # [B, nQB]
    kmin, kmax = segment_ranges(k_seg, block_size)  # [B, nKB]
    nkb = kmin.shape[1]
    bidx = jnp.clip(index.block_idx, 0, nkb - 1)
    take = lambda a: jnp.take_along_axis(a[:, None, None, :], bidx.reshape(B, H, nqb * mb)[:, :, None, :],  # noqa: E731
                                         axis=-1).reshape(B, H, nqb, mb)
    tkmin, tkmax = take(kmin), take(kmax)
    qlo, qhi = qmin[:, None, :, None], qmax[:, None, :, None]
    valid = jnp.arange(mb) < index.block_count[..., None]
    keep = valid & (tkmax >= qlo) & (tkmin <= qhi)
    inside = (qlo == qhi) & (tkmin == qlo) & (tkmax == qlo)
    order = jnp.argsort(~keep, axis=-1, stable=True)
    pick = lambda a: jnp.take_along_axis(a, order, axis=-1)  # noqa: E731
    flags = jnp.where(inside, index.block_causal, 1).astype(index.block_causal.dtype)
    return index._replace(block_idx=pick(index.block_idx), block_count=keep.sum(-1).astype(index.block_count.dtype),
                          block_causal=pick(flags))


@functools.partial(jax.jit, static_argnames=("block_size",))
def column_start(index: StepIndex, q_seg, k_seg, block_size: int = DEFAULT_BLOCK):
    """``int32 [B, H, nQB]``: with packed documents, the first slot of each query block's column prefix
    (slots ``[0, col_count)`` of the head's position-sorted list) whose key can share a document with the
    block's queries; ``col_count`` where none can. Every earlier slot's key has a segment id below all of
    the block's (a running maximum of the slots' ids below the block's smallest id), so all its pairs are
    masked and a kernel may start its column walk there, exactly, for any segment ids (with documents
    numbered in position order, as packing gives, it is the first column of the block's first document).
    Without it each query block computes, then masks, every earlier document's verticals (how much:
    ``results/documents/packed_documents.md``)."""
    B, H, nqb, _ = index.block_idx.shape
    sk = k_seg.shape[1]
    qmin, _ = segment_ranges(q_seg.astype(jnp.int32), block_size)  # [B, nQB]
    ids = jnp.clip(index.col_idx, 0, sk - 1).reshape(B, -1)
    kseg = jnp.take_along_axis(k_seg.astype(jnp.int32), ids, axis=1).reshape(index.col_idx.shape)  # [B, H, MC]
    run = jax.lax.cummax(kseg, axis=2)
    first = jax.vmap(jax.vmap(lambda r, m: jnp.searchsorted(r, m, side="left"), in_axes=(0, None)))(run, qmin)
    return jnp.minimum(first, index.col_count).astype(jnp.int32)


def column_chunk_rows(col_count, nchunks: int, block_size: int = DEFAULT_BLOCK, col_start=None):
    """``(first, end) int32 [B, H, nchunks]``: the query blocks a column dK/dV pass walks for chunk ``c``
    (slots ``[c * bs, (c + 1) * bs)`` of the head's column list). A block needs the chunk when its prefix
    reaches it (``col_count [B, H, nQB] > c * bs``) and, with packed documents (``col_start``:
    :func:`column_start`), its column walk starts before the chunk's end; ``first`` is the first such
    block and ``end`` the last plus one (``nQB`` / ``nQB`` if none): the blocks outside need nothing of
    the chunk (a chunk's walk ends with its last document), those between may (masked per pair)."""
    nqb = col_count.shape[-1]
    c = jnp.arange(nchunks, dtype=jnp.int32)
    need = col_count[..., None, :] > (c * block_size)[:, None]  # [B, H, nch, nQB]
    if col_start is not None:
        need = need & (col_start[..., None, :] < ((c + 1) * block_size)[:, None])
    some = need.any(-1)
    first = jnp.where(some, jnp.argmax(need, axis=-1), nqb).astype(jnp.int32)
    end = jnp.where(some, nqb - jnp.argmax(need[..., ::-1], axis=-1), nqb).astype(jnp.int32)
    return first, end


def stable_partition(first, second):
    """Destination slot of every entry when the ``first`` entries move to the front and the ``second``
    ones right after (each group keeps its order), the rest last: a stable partition without a sort.
    Bool ``[..., M]`` in, ``(dst int32 [..., M], n_first [...], n_first + n_second [...])`` out; ``dst``
    is a permutation of each row's ``M`` slots (so a scatter by it has unique indices)."""
    c1 = jnp.cumsum(first, axis=-1, dtype=jnp.int32)
    c2 = jnp.cumsum(second, axis=-1, dtype=jnp.int32)
    c3 = jnp.cumsum(~(first | second), axis=-1, dtype=jnp.int32)
    n1, n2 = c1[..., -1:], c2[..., -1:]
    dst = jnp.where(first, c1 - 1, jnp.where(second, n1 + c2 - 1, n1 + n2 + c3 - 1))
    return dst, n1[..., 0], (n1 + n2)[..., 0]


def scatter_last(x, dst, size: int):
    """``out[..., dst[..., j]] = x[..., j]`` into zeros with last dim ``size >= M``; ``dst`` a permutation
    of each row's slots (:func:`stable_partition`), declared unique (no atomics, nothing serialised
    under deterministic GPU ops)."""
    ix = tuple(i[..., None] for i in jnp.indices(x.shape[:-1], sparse=True))
    return jnp.zeros(x.shape[:-1] + (size,), x.dtype).at[ix + (dst,)].set(x, unique_indices=True)


@functools.partial(jax.jit, static_argnames=("sk", "block_size"))
def row_block_map(index: StepIndex, sk: int, block_size: int = DEFAULT_BLOCK):
    """``bool [B, H, nQB, nKB]``: whether KV block ``j`` is active in query block row ``i``."""
    B, H, nqb, mb = index.block_idx.shape
    nkb = sk // block_size
    valid_b = jnp.arange(mb)[None, None, None, :] < index.block_count[..., None]
    # a row's valid blocks are distinct (the contract); padding goes to distinct out-of-range slots
    # (dropped), so the scatter's indices are unique: no serialising loop under deterministic ops
    bidx = jnp.where(valid_b, index.block_idx, nkb + jnp.arange(mb, dtype=index.block_idx.dtype))
    blk = jnp.zeros((B, H, nqb, nkb), bool)
    return blk.at[
        jnp.arange(B)[:, None, None, None], jnp.arange(H)[None, :, None, None],
        jnp.arange(nqb)[None, None, :, None], bidx
    ].set(True, mode="drop", unique_indices=True)


@functools.partial(jax.jit, static_argnames=("sk", "block_size"))
def row_columns(index: StepIndex, sk: int, block_size: int = DEFAULT_BLOCK):
    """Per query block, the columns its column phase attends: ``(ids int32 [B, H, nQB, MC]``
    (clipped into range), ``valid bool [B, H, nQB, MC])`` — in the row's prefix and not inside
    one of the row's active blocks (those keys belong to the block phase)."""
    nqb = index.block_idx.shape[2]
    mc = index.col_idx.shape[-1]
    ids = jnp.broadcast_to(jnp.clip(index.col_idx, 0, sk - 1)[:, :, None, :], index.col_idx.shape[:2] + (nqb, mc))
    in_prefix = jnp.arange(mc)[None, None, None, :] < index.col_count[..., None]
    in_block = jnp.take_along_axis(row_block_map(index, sk, block_size), ids // block_size, axis=-1)
    return ids.astype(jnp.int32), in_prefix & ~in_block


@functools.partial(jax.jit, static_argnames=("sq", "sk", "block_size"))
def step_index_to_mask(index: StepIndex, sq: int, sk: int, block_size: int = DEFAULT_BLOCK):
    """``bool [B, H, Sq, Sk]``: the (q, k) pairs the index allows, BEFORE the causal mask."""
    B, H, nqb, _ = index.block_idx.shape
    blk_tok = jnp.repeat(row_block_map(index, sk, block_size), block_size, axis=-1)  # [B, H, nQB, Sk]
    ids, valid = row_columns(index, sk, block_size)
    col = jnp.zeros((B, H, nqb, sk + 1), bool)
    col = col.at[
        jnp.arange(B)[:, None, None, None], jnp.arange(H)[None, :, None, None],
        jnp.arange(nqb)[None, None, :, None], jnp.where(valid, ids, sk)
    ].set(True)[..., :sk]
    allowed = jnp.logical_or(blk_tok, col)
    return jnp.repeat(allowed, block_size, axis=2)  # [B, H, Sq, Sk]


@functools.partial(jax.jit, static_argnames=("batch", "heads", "sq", "sk", "block_size"))
def full_step_index(batch: int, heads: int, sq: int, sk: int, q_pos, k_pos,
                    block_size: int = DEFAULT_BLOCK) -> StepIndex:
    """Index with every KV block that has at least one causal pair active (dense causal work)."""
    nqb, nkb = sq // block_size, sk // block_size
    qmax = q_pos.reshape(nqb, block_size).max(axis=1)
    kmin = k_pos.reshape(nkb, block_size).min(axis=1)
    visible = kmin[None, :] <= qmax[:, None]  # [nQB, nKB]
    # visible blocks first, ascending; stable sort on (not visible)
    order = jnp.argsort(jnp.logical_not(visible), axis=1, stable=True).astype(jnp.int32)
    count = visible.sum(axis=1).astype(jnp.int32)
    bidx = jnp.broadcast_to(order, (batch, heads, nqb, nkb))
    bcount = jnp.broadcast_to(count, (batch, heads, nqb))
    flags = causal_flags(q_pos, k_pos, bidx, block_size)
    cidx = jnp.zeros((batch, heads, 1), jnp.int32)
    ccount = jnp.zeros((batch, heads, nqb), jnp.int32)
    return StepIndex(bidx, bcount, flags, cidx, ccount)
