"""MTraining attention: dynamic vertical-slash sparsity on a balanced, hierarchical sparse ring
(MTraining §4, Algorithms 1 and 2).

Inside one ``shard_map`` over the ``(node, local)`` mesh, every rank

1. estimates the global vertical-slash index from the last ``last_q`` queries, identical on every
   rank (:func:`~mtraining_jax.sparsity.estimate.estimate_index_shard`);
2. converts it, one ring step at a time, into the block + column index of its own queries
   (:class:`~mtraining_jax.sparsity.convert.RankStepIndex`);
3. runs the sparse ring (:func:`~mtraining_jax.ring.attention.ring_attention_shard`).

The index is computed from ``stop_gradient`` inputs, saved compact as a residual of the ring's
custom VJP and reused by the backward; it is never differentiated.

Shapes: ``q [B, S, Hq, D]``, ``k, v [B, S, Hkv, D]`` global arrays in the configured layout's order;
``S`` divisible by ``block_size x P`` (block_striped) or with 64-aligned chunks (zigzag, contiguous).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from mtraining_jax.ring.attention import ring_attention_shard
from mtraining_jax.layouts import Layout
from mtraining_jax.mesh import CP_AXES, check_cp_mesh
from mtraining_jax.ring.config import RingOptions
from mtraining_jax.sparsity.config import SparsityConfig
from mtraining_jax.sparsity.convert import RankStepIndex
from mtraining_jax.sparsity.estimate import estimate_index_shard
from mtraining_jax.sparsity.index import VerticalSlashIndex, full_index
from mtraining_jax.sparsity.metrics import imbalance, step_imbalance, worker_imbalance
from pallas_kernels.api import SUPPORTED_HEAD_DIMS
from pallas_kernels.inputs import check_qkv, check_segment_ids

SPARSE_LAYOUTS = ("block_striped", "zigzag", "contiguous")


@dataclasses.dataclass(frozen=True)
class MTrainingConfig:
    """Configuration of :func:`mtraining_attention` (validated on construction).

    Attributes:
      sparsity: budgets, ``last_q``, block size (:class:`SparsityConfig`, per head or global).
      layout: sequence layout of the inputs: ``block_striped`` (MTraining, default), ``zigzag`` or
        ``contiguous`` (for comparison).
      ring: the ring's options (:class:`~mtraining_jax.ring.config.RingOptions`, or a mapping of its
        fields).
      force_full: use the full causal index (every block diagonal) instead of estimating one —
        dense work through the sparse machinery; must equal the dense ring.
    """

    sparsity: SparsityConfig = SparsityConfig()
    layout: str = "block_striped"
    ring: RingOptions = RingOptions()
    force_full: bool = False

    def __post_init__(self):
        if not isinstance(self.sparsity, SparsityConfig):
            raise ValueError(f"sparsity must be a SparsityConfig, got {type(self.sparsity).__name__}")
        if self.layout not in SPARSE_LAYOUTS:
            raise ValueError(f"layout {self.layout!r} is not supported by sparse ring attention; "
                             f"expected one of {SPARSE_LAYOUTS}")
        object.__setattr__(self, "ring", RingOptions.from_mapping(self.ring))
        if not isinstance(self.force_full, (bool, np.bool_)):
            raise ValueError(f"force_full must be a bool, got {self.force_full!r}")

    @property
    def block_size(self) -> int:
        return int(self.sparsity.block_size)

    def make_layout(self, seq_len: int, num_ranks: int) -> Layout:
        """The :class:`Layout` the inputs must be in (stripe = block size)."""
        return Layout(self.layout, seq_len, num_ranks, stripe=self.block_size)


class MTrainingStats(NamedTuple):
    """Per-call load statistics of the executed sparse ring (for logging).

    ``work int64 [P workers, P steps]``: attended slots per (worker, ring step), in the unit of
    :mod:`mtraining_jax.sparsity.metrics` (``block_count * bs^2 + col_count * bs``, summed over batch,
    heads and query blocks). ``index``: the global index (identical on every rank).
    """

    work: jax.Array
    index: VerticalSlashIndex

    def worker_imbalance(self) -> float:
        return worker_imbalance(np.asarray(self.work))

    def step_imbalance(self) -> float:
        return step_imbalance(np.asarray(self.work))


def stats_scalars(work, batch: int, heads: int, seq_len: int, block_size: int) -> dict:
    """Traceable float32 scalars of one call's ``work [P workers, P steps]`` (for training logs).

    * ``work_fraction``: executed kernel slots over those of the full causal block index
      (``B * H * nb (nb + 1) / 2 * bs^2``, ``nb = S / bs``) — 1 for dense work;
    * ``worker_imbalance`` / ``step_imbalance``: as :mod:`mtraining_jax.sparsity.metrics` (over the
      ring steps with work; ``>= 1``).
    """
    w = work.astype(jnp.float32)
    nb = seq_len // block_size
    dense = batch * heads * nb * (nb + 1) / 2 * block_size**2
    return {
        "work_fraction": w.sum() / dense,
        "worker_imbalance": imbalance(w, 0, jnp),
        "step_imbalance": imbalance(w, 1, jnp),
    }


def _check_inputs(q, k, v, mesh, cfg: MTrainingConfig):
    check_qkv(q, k, v)
    if q.shape[3] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim {q.shape[3]} is not supported by the kernels; "
                         f"expected one of {SUPPORTED_HEAD_DIMS}")
    num_nodes, num_local = check_cp_mesh(mesh)
    P = num_nodes * num_local
    layout = cfg.make_layout(q.shape[1], P)  # validates divisibility, naming the values
    cfg.sparsity.check(q.shape[1], q.shape[2], P)
    return num_nodes, num_local, layout


def mtraining_attention(q, k, v, mesh, cfg: MTrainingConfig = MTrainingConfig(), *, positions=None,
                        segment_ids=None, return_stats: bool = False):
    """Sparse ring attention with an online vertical-slash index (see module docstring).

    Args:
      q: ``[B, S, Hq, D]``; k, v: ``[B, S, Hkv, D]``; global arrays in ``cfg.layout`` order.
      mesh: mesh with axes ``("node", "local")`` (optionally ``"data"`` for the batch).
      cfg: :class:`MTrainingConfig`.
      positions: optional ``int [S]`` global positions of the laid-out tokens; when concrete it is
        checked against ``cfg.layout`` (the operator derives positions from the layout statically).
      segment_ids: optional ``int [B, S]`` document of each laid token (packed documents): the
        index is estimated under the document mask (:mod:`~mtraining_jax.sparsity.estimate`),
        tiles across a boundary are dropped and the kernels mask the straddling ones by segment.
      return_stats: also return :class:`MTrainingStats` (work per worker and ring step, the index).

    Returns:
      ``out [B, S, Hq, D]`` in ``q.dtype`` (layout order), and the stats when asked.
    """
    num_nodes, num_local, layout = _check_inputs(q, k, v, mesh, cfg)
    if positions is not None and not isinstance(positions, jax.core.Tracer):
        if not np.array_equal(np.asarray(positions), layout.perm):
            raise ValueError(f"positions do not match the {cfg.layout!r} layout of {q.shape[1]} tokens over "
                             f"{num_nodes * num_local} ranks; lay the tokens out with Layout.permute")
    B, S, Hq, _ = q.shape
    pos_table = layout.positions  # static [P, S/P]
    batch_axis = "data" if "data" in mesh.shape else None
    spec = PartitionSpec(batch_axis, CP_AXES, None, None)
    sparsity, bs = cfg.sparsity, cfg.block_size
    seg_spec = PartitionSpec(batch_axis, CP_AXES)
    segment_ids = check_segment_ids(segment_ids, B, S)

    def body(q_l, k_l, v_l, seg_l):
        rank = jax.lax.axis_index(CP_AXES)
        pos_l = jnp.asarray(pos_table, jnp.int32)[rank]
        if cfg.force_full:
            index = full_index(q_l.shape[0], Hq, S, bs)
        else:
            index = estimate_index_shard(jax.lax.stop_gradient(q_l), jax.lax.stop_gradient(k_l), pos_l,
                                         sparsity, axis_names=CP_AXES, segment_ids=seg_l)
        # one ring step's StepIndex at a time, converted in the forward and again in the backward
        step_index = RankStepIndex(index, rank, layout, num_nodes, num_local, cfg.ring.ring_order, bs,
                                   sparsity.max_cols)
        out, work = ring_attention_shard(q_l, k_l, v_l, pos_l, pos_l, num_nodes=num_nodes, num_local=num_local,
                                         options=cfg.ring, step_index=step_index, sm_scale=sparsity.sm_scale,
                                         block_size=bs, return_work=True, segment_ids=seg_l)  # work: [P steps]
        if batch_axis is not None:
            work = jax.lax.psum(work, batch_axis)
        return out, work[None], index

    idx_spec = VerticalSlashIndex(*(PartitionSpec(batch_axis),) * 4)
    fn = jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec, seg_spec),
                       out_specs=(spec, PartitionSpec(CP_AXES), idx_spec), check_vma=False)
    out, work, index = fn(q, k, v, segment_ids)
    if return_stats:
        return out, MTrainingStats(work, index)
    return out
