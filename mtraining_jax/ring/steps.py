"""Per-step helpers shared by the ring's forward and both backwards: one hop along a ring axis,
this rank's index, the all-gathered positions, and the arguments of one kernel call over the chunks
of one or several ring steps (index, key positions, segment ids, K/V buffer).

Which chunk a rank holds at step ``s`` is :func:`mtraining_jax.ring.schedule.source_rank`;
:func:`query_rank` / :func:`first_visit` are its inverse for the query-side backward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from mtraining_jax.mesh import CP_AXES, LOCAL_AXIS, NODE_AXIS
from mtraining_jax.ring.config import RingConfig
from mtraining_jax.ring.schedule import source_rank
from pallas_kernels.index_format import StepIndex, apply_segments

# ----------------------------------------------------------------------------- communication

def shift(x, axis, size: int, direction: int = 1):
    """Send ``x`` one position along the ring on ``axis`` (rank ``a`` -> ``a + direction mod size``)."""
    if size == 1:
        return x
    return lax.ppermute(x, axis, perm=[(a, (a + direction) % size) for a in range(size)])


def my_rank(cfg: RingConfig):
    return lax.axis_index(NODE_AXIS) * cfg.num_local + lax.axis_index(LOCAL_AXIS)


def gather_positions(k_pos, cfg: RingConfig):
    """``int32 [P, Sl]``: every rank's key positions (node-major), from one all-gather."""
    if cfg.num_ranks == 1:
        return k_pos[None]
    return lax.all_gather(k_pos, CP_AXES, axis=0, tiled=False)


# ----------------------------------------------------------------------------- one kernel call

def group_index(step_index, steps: tuple[int, ...]):
    """The :class:`StepIndex` of one kernel call over the chunks of ring ``steps`` (concatenated in
    that order): a slice of a ``[P]``-stacked index, or converted on demand by an index source
    (:mod:`.index_source`; ``step_index.steps(steps)``, e.g. ``sparsity.convert.RankStepIndex``)."""
    if step_index is None:
        return None
    if isinstance(step_index, StepIndex):
        (s,) = steps
        return jax.tree.map(lambda a: a[s], step_index)
    return step_index.step(steps[0]) if len(steps) == 1 else step_index.steps(steps)


def group_positions(kpos_all, rank, steps: tuple[int, ...], cfg: RingConfig):
    """``int32 [..., len(steps) * Sl]``: key positions ``kpos_all [P, ..., Sl]`` (or segment ids) of
    the chunks held at ``steps``, concatenated."""
    pos = [lax.dynamic_index_in_dim(kpos_all, source_rank(rank, s, cfg.num_nodes, cfg.num_local, cfg.ring_order),
                                    axis=0, keepdims=False) for s in steps]
    return pos[0] if len(pos) == 1 else jnp.concatenate(pos, axis=-1)


def group_segments(segs, rank, steps: tuple[int, ...], cfg: RingConfig) -> dict:
    """Keyword arguments ``q_seg, k_seg`` of the kernel call over the chunks of ``steps`` (``{}``
    without packed documents); ``segs = (q_seg [B, Sl], kseg_all [P, B, Sl])``."""
    if segs is None:
        return {}
    return {"q_seg": segs[0], "k_seg": group_positions(segs[1], rank, steps, cfg)}


def narrow(index_g, seg_kw: dict, block_size: int):
    """The grouped index without the tiles that lie across a document boundary (so the work
    statistics count what the kernels run); unchanged without packed documents."""
    if index_g is None or not seg_kw:
        return index_g
    return apply_segments(index_g, seg_kw["q_seg"], seg_kw["k_seg"], block_size)


def group_kv(chunks):
    """Stacked ``[2, B, Sl, Hkv, D]`` chunks -> one ``[2, B, len * Sl, Hkv, D]`` K/V buffer."""
    return chunks[0] if len(chunks) == 1 else jnp.concatenate(chunks, axis=2)


# ----------------------------------------------------------------------------- query-side ring

def query_rank(rank, step: int, cfg: RingConfig):
    """Rank whose QUERIES kv owner ``rank`` holds at backward ``step`` of the query-side ring: the
    ``t`` with ``source_rank(t, step) == rank`` (flat: ``rank + step``; hierarchical: ``(n + i,
    l + j)``)."""
    P, L = cfg.num_ranks, cfg.num_local
    if cfg.ring_order == "flat":
        return (rank + step) % P
    i, j = step // L, step % L
    n, l = rank // L, rank % L
    return ((n + i) % cfg.num_nodes) * L + (l + j) % L


def first_visit(rank: int, cfg: RingConfig) -> int:
    """Rank that holds ``rank``'s queries at the query-side ring's first non-own step ``P - 1``
    (node and local position one place on: ``(n + 1, l + 1)``; flat: ``rank + 1``)."""
    P, L = cfg.num_ranks, cfg.num_local
    if cfg.ring_order == "flat":
        return (rank + 1) % P
    return ((rank // L + 1) % cfg.num_nodes) * L + (rank % L + 1) % L




# ----------------------------------------------------------------------------- every rank's index

@jax.tree_util.register_pytree_node_class
class StackedStepIndex:
    """A :class:`~.index_source.GlobalIndexSource` over a :class:`StepIndex` with leading ``[P_rank, P_step]``
    axes (every rank's index of every ring step, identical on all ranks), seen from ``rank``: ``step(s)`` is
    ``index[rank, s]``, ``for_rank(t)`` the same source for rank ``t``'s queries (what the
    query-side backward and the sparse K/V exchange need). Leaves: ``index`` and ``rank``."""

    def __init__(self, index: StepIndex, rank):
        self.index, self.rank = index, rank

    @property
    def num_steps(self) -> int:
        return self.index.block_idx.shape[1]

    def step(self, s) -> StepIndex:
        return jax.tree.map(lambda a: a[self.rank, s], self.index)

    def for_rank(self, rank) -> "StackedStepIndex":
        return StackedStepIndex(self.index, rank)

    def tree_flatten(self):
        return (self.index, self.rank), None

    @classmethod
    def tree_unflatten(cls, _, leaves):
        return cls(*leaves)
