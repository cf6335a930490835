"""Global vertical-slash index -> per-rank, per-ring-step :class:`~pallas_kernels.index_format.StepIndex`.

MTraining poster, "convert_index(i_v, i_s, j)": every rank turns the identical global index into
the block + column index of its own queries against the K/V chunk it holds at each ring step.

Layouts must be block-aligned (every local run of ``block_size`` rows is one whole global block:
``contiguous``, ``zigzag`` with chunks a multiple of 64, ``block_striped`` with stripe a multiple of
the block). For local query block ``i`` (global ``QB_i``) and KV block ``j`` of the visiting chunk
(global ``KB_j``):

* active KV blocks: ``{ j : QB_i - KB_j = d >= 0, d a slash }`` (sorted);
* columns: ONE list per head, the verticals held by the chunk as local token ids in ascending
  global position; query block ``i`` uses the prefix with ``v <= max(q_pos of block i)``; the
  kernels skip those inside the row's active blocks
  (:func:`~pallas_kernels.index_format.row_columns`).

Every causal pair of the global mask is covered exactly once over all (rank, step), nothing else.

Static sizes: ``MB = min(MS, nKB)`` (exact); ``MC = cfg.max_cols or min(MV, S/P)`` (``None`` is
exact; a smaller ``MC`` keeps the lowest-position columns). One step's index takes ``4 * B * H *
(nQB * (2*MB + 1) + MC)`` bytes (``nQB = S / (P * bs)``). :func:`convert_index` materialises all
``P`` steps; :class:`RankStepIndex` converts one at a time (forward and again in the backward).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from mtraining_jax.layouts import Layout
from mtraining_jax.ring.schedule import source_rank, validate_ring_order
from mtraining_jax.sparsity.index import VerticalSlashIndex, compact_in_order, compact_sorted
from mtraining_jax.sparsity.positions import check_positions, concrete as _concrete
from pallas_kernels.index_format import StepIndex, causal_flags


def check_block_aligned(positions, block_size: int, what: str = "layout") -> None:
    """``ValueError`` unless every run of ``block_size`` rows is one whole aligned global block."""
    pos = np.asarray(positions)
    if pos.shape[-1] % block_size:
        raise ValueError(f"{what}: {pos.shape[-1]} rows per rank is not a multiple of block_size={block_size}")
    blk = pos.reshape(-1, block_size)
    ok = (blk[:, 0] % block_size == 0) & np.all(blk == blk[:, :1] + np.arange(block_size), axis=1)
    if not ok.all():
        raise ValueError(
            f"{what} is not block-aligned for block_size={block_size}: local block of positions "
            f"{blk[~ok][0][:4].tolist()}... is not one whole global block (token_striped, or a zigzag "
            f"chunk / stripe that is not a multiple of the block, cannot carry a block-sparse index)")


def convert_step(index: VerticalSlashIndex, q_pos, k_pos, *, seq_len: int, block_size: int = 64,
                 max_cols: int | None = None, num_chunks: int = 1) -> StepIndex:
    """StepIndex of queries at ``q_pos [Sq]`` against keys at ``k_pos [Sk]`` (global positions).

    Works with traced positions (inside ``shard_map`` / ``vmap``); concrete positions are checked
    (distinct, in ``0..seq_len-1``, block-aligned: ``ValueError`` naming the bad value).
    Single device: ``convert_step(index, arange(S), arange(S), seq_len=S)``.
    Arrays: blocks ``[B, H, nQB, MB]``, columns ``[B, H, MC]``, counts ``[B, H, nQB]``.

    ``num_chunks > 1``: ``k_pos`` is ``num_chunks`` equal K/V chunks concatenated (ring steps fused
    into one kernel call). The column cap applies to each chunk, so the result allows exactly the
    union of the chunks' own step indexes (same ``MC`` per chunk, up to ``MV`` in all).
    """
    bs = block_size
    sk = k_pos.shape[0]
    if num_chunks < 1 or sk % (num_chunks * bs):
        raise ValueError(f"k_pos length {sk} is not {num_chunks} chunk(s) of whole {bs}-token blocks")
    if seq_len % bs:
        raise ValueError(f"seq_len={seq_len} is not a multiple of block_size={bs}")
    for name, p in (("q_pos", q_pos), ("k_pos", k_pos)):
        check_positions(p, seq_len, name=name, permutation=False, shape=(p.shape[0],))
        c = _concrete(p)
        if c is not None:
            check_block_aligned(c, bs, name)
        elif p.shape[0] % bs:
            raise ValueError(f"{name} length {p.shape[0]} is not a multiple of block_size={bs}")
    return _convert_step(index, jnp.asarray(q_pos, jnp.int32), jnp.asarray(k_pos, jnp.int32), seq_len=seq_len,
                         block_size=bs, max_cols=max_cols, num_chunks=num_chunks)


@functools.partial(jax.jit, static_argnames=("seq_len", "block_size", "max_cols", "num_chunks"))
def _convert_step(index: VerticalSlashIndex, q_pos, k_pos, *, seq_len: int, block_size: int,
                  max_cols: int | None, num_chunks: int) -> StepIndex:
    bs = block_size
    sq, sk = q_pos.shape[0], k_pos.shape[0]
    nqb, nkb, nb = sq // bs, sk // bs, seq_len // bs
    B, H, mv = index.v_idx.shape
    QB = q_pos.reshape(nqb, bs)[:, 0] // bs
    KB = k_pos.reshape(nkb, bs)[:, 0] // bs
    qmax = q_pos.reshape(nqb, bs).max(axis=1)

    # --- active blocks (slashes): per query block, the <= MS candidate KV blocks QB - d ---
    # KB is distinct (distinct, block-aligned positions): a unique-index scatter
    blockmap = jnp.full((nb + 1,), -1, jnp.int32).at[KB].set(jnp.arange(nkb, dtype=jnp.int32), unique_indices=True)
    ms = index.max_slashes
    s_ok = jnp.arange(ms) < index.s_count[..., None]  # [B, H, MS]
    kb = QB[None, None, :, None] - index.s_idx[:, :, None, :]  # [B, H, nQB, MS] global KV block
    cand = jnp.where(s_ok[:, :, None, :] & (kb >= 0), blockmap[jnp.clip(kb, 0, nb)], -1)
    mb = min(ms, nkb)
    block_idx, block_count = compact_sorted(cand >= 0, cand, mb, pad=0)
    block_count = jnp.minimum(block_count, mb)  # never binds: <= s_count <= MS per query block
    block_causal = causal_flags(q_pos, k_pos, block_idx, bs)

    # --- vertical columns held by the visiting chunk: one list per head, in position order ---
    # v_idx is ascending by global position, so a stable compaction of the held entries keeps that
    # order and every query block's causal columns (position <= its last query) are a prefix.
    sk_c = sk // num_chunks
    mc_c = min(mv, sk_c) if max_cols is None else min(max_cols, mv, sk_c)  # cap per chunk
    mc = min(mv, num_chunks * mc_c)
    valid = jnp.arange(mv) < index.v_count[..., None]
    v = jnp.where(valid, index.v_idx, 0)
    lb = blockmap[jnp.where(valid, v // bs, nb)]  # [B, H, MV], -1: not in this chunk
    held = valid & (lb >= 0)
    if num_chunks > 1:  # keep the first mc_c held columns (by position) of EACH chunk
        in_chunk = held[..., None] & ((lb // (nkb // num_chunks))[..., None] == jnp.arange(num_chunks))
        rank_in_chunk = jnp.cumsum(in_chunk, axis=-2, dtype=jnp.int32) - 1  # [B, H, MV, C]
        held = jnp.any(in_chunk & (rank_in_chunk < mc_c), axis=-1)
    col_idx, n_held = compact_in_order(held, lb * bs + v % bs, mc, pad=0)
    held_pos, _ = compact_in_order(held, v, mc, pad=seq_len)  # ascending; padding sorts last
    col_count = jax.vmap(jax.vmap(lambda p: jnp.searchsorted(p, qmax, side="right")))(held_pos)
    col_count = jnp.minimum(col_count, jnp.minimum(n_held, mc)[..., None]).astype(jnp.int32)
    return StepIndex(block_idx, block_count, block_causal, col_idx, col_count)


def convert_index(index: VerticalSlashIndex, rank, layout, *, num_nodes: int, num_local: int,
                  ring_order: str = "hierarchical", block_size: int = 64,
                  max_cols: int | None = None) -> StepIndex:
    """All ring steps of one rank: StepIndex arrays with a leading ``[P]`` step axis.

    Args:
      index: the global index (identical on all ranks).
      rank: this rank, node-major (``jax.lax.axis_index(("node", "local"))`` inside shard_map, or an int).
      layout: a :class:`~mtraining_jax.layouts.Layout` or its ``positions`` array ``[P, S/P]``.
      num_nodes, num_local: the ``(node, local)`` mesh shape; ``P = num_nodes * num_local``.
      ring_order: ``"flat"`` or ``"hierarchical"`` (:func:`~mtraining_jax.ring.schedule.source_rank`).

    Entry ``s`` is this rank's queries vs the chunk of ``source_rank(rank, s)``.
    """
    validate_ring_order(ring_order)
    positions = np.asarray(layout.positions if isinstance(layout, Layout) else layout)
    P = num_nodes * num_local
    if positions.ndim != 2 or positions.shape[0] != P:
        raise ValueError(f"layout positions have shape {positions.shape}, expected [P, S/P] with "
                         f"P = {num_nodes} x {num_local} = {P}")
    check_positions(positions, positions.size, name="layout positions")
    check_block_aligned(positions, block_size, "layout")
    pos = jnp.asarray(positions, jnp.int32)
    q_pos = pos[rank]
    src = source_rank(rank, jnp.arange(P), num_nodes, num_local, ring_order)
    return jax.vmap(lambda kp: convert_step(index, q_pos, kp, seq_len=positions.size,
                                            block_size=block_size, max_cols=max_cols))(pos[src])


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class RankStepIndex:
    """One rank's per-ring-step index, converted on demand: ``step(s)`` is entry ``s`` of
    :func:`convert_index` (same arguments), computed alone.

    A ring that calls ``step(s)`` inside its loop holds one step's :class:`StepIndex` at a time,
    and a ``custom_vjp`` that saves this object keeps only the compact global index for its
    backward (which converts each step again). Leaves: ``index`` and ``rank`` (traced inside
    ``shard_map``); the layout, mesh shape, ring order, block size and column cap are static.
    """

    index: VerticalSlashIndex
    rank: jax.Array
    layout: Layout
    num_nodes: int
    num_local: int
    ring_order: str = "hierarchical"
    block_size: int = 64
    max_cols: int | None = None

    def __post_init__(self):
        validate_ring_order(self.ring_order)
        if self.layout.num_ranks != self.num_nodes * self.num_local:
            raise ValueError(f"layout has {self.layout.num_ranks} ranks, the mesh {self.num_nodes} x {self.num_local}")
        check_block_aligned(self.layout.positions, self.block_size, "layout")

    @property
    def num_steps(self) -> int:
        return self.num_nodes * self.num_local

    def for_rank(self, rank) -> "RankStepIndex":
        """The same index source for the queries of ``rank`` (every rank holds the identical global
        index, so any rank can convert any (query rank, K/V chunk) pair: the query-side backward ring)."""
        return self.tree_unflatten(self.tree_flatten()[1], (self.index, rank))

    def step(self, s) -> StepIndex:
        """:class:`StepIndex` of this rank's queries vs the chunk it holds at ring step ``s``."""
        return self.steps((s,))

    def steps(self, steps) -> StepIndex:
        """:class:`StepIndex` of this rank's queries vs the chunks it holds at ring ``steps`` (static
        ints), concatenated in that order: several ring steps fused into one kernel call. It allows
        exactly the union of ``step(s)`` over ``steps`` (``convert_step``'s ``num_chunks``)."""
        pos = jnp.asarray(self.layout.positions, jnp.int32)
        k_pos = jnp.concatenate([pos[source_rank(self.rank, s, self.num_nodes, self.num_local, self.ring_order)]
                                 for s in steps])
        return convert_step(self.index, pos[self.rank], k_pos, seq_len=self.layout.seq_len,
                            block_size=self.block_size, max_cols=self.max_cols, num_chunks=len(steps))

    def tree_flatten(self):
        static = (self.layout, self.num_nodes, self.num_local, self.ring_order, self.block_size, self.max_cols)
        return (self.index, self.rank), static

    @classmethod
    def tree_unflatten(cls, static, leaves):
        obj = object.__new__(cls)  # leaves may be tracers or placeholders: skip __post_init__'s checks
        for name, val in zip(("index", "rank", "layout", "num_nodes", "num_local", "ring_order", "block_size",
                              "max_cols"), (*leaves, *static)):
            object.__setattr__(obj, name, val)
        return obj
