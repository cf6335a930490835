"""MiniMax Sparse Attention (MSA, paper ``003``) on the project's sparse ring and block-sparse kernels.

Inside one ``shard_map`` over the ``(node, local)`` mesh (``mesh=None``: one device), every rank

1. all-gathers the index keys (block means, or every token's for ``pooling="max"``);
2. selects, per local query block and KV group, the top-``k`` blocks with the local block forced,
   ranked by the block's first row by default so that no output reads a later token
   (:mod:`~mtraining_jax.sparsity.msa_select`, where the choices are explained);
3. runs the sparse ring (:func:`~mtraining_jax.ring.attention.ring_attention_shard`), its per-step
   index converted on demand (:class:`~mtraining_jax.sparsity.msa_select.MSARankStepIndex`);
4. computes the KL alignment loss against the detached main branch
   (:mod:`~mtraining_jax.attention.msa_kl`) and the selection-recall metric.

Warm-up (paper §3.2 "Indexer Warmup"): ``warmup=True`` runs the dense causal ring and the KL over
every causal block (:func:`~mtraining_jax.attention.msa_kl.warmup_kl_sum`: query blocks in groups, each
against the key blocks it can see); a traced bool selects with ``lax.cond``.

``q_idx [B, S, Hkv, d_idx]`` and ``k_idx [B, S, d_idx]`` come from ``stop_gradient(x)`` (paper Eq.
msa-detach), so the KL trains only the index projections; ``q, k, v`` get the attention gradient.

Shapes: ``q [B, S, Hq, D]``, ``k, v [B, S, Hkv, D]``, global arrays in ``cfg.layout`` order
(``S`` divisible by ``block_size x P`` for block_striped). Packed documents are not supported.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from mtraining_jax.attention.msa_kl import msa_kl_sum, selection_recall_rows, selection_recall_sum, warmup_kl_sum
from mtraining_jax.attention.mtraining import SPARSE_LAYOUTS
from mtraining_jax.layouts import Layout
from mtraining_jax.mesh import CP_AXES, check_cp_mesh
from mtraining_jax.ring.attention import ring_attention_shard
from mtraining_jax.ring.config import RingOptions
from mtraining_jax.sparsity.msa_select import (MSARankStepIndex, index_keys, layout_block_order,
                                               select_blocks, selection_work, validate_pooling,
                                               validate_selection)
from pallas_kernels.api import SUPPORTED_HEAD_DIMS
from pallas_kernels.inputs import check_qkv

MSA_BLOCK = 64


@dataclasses.dataclass(frozen=True)
class MSAConfig:
    """Configuration of :func:`msa_attention` (validated on construction).

    Attributes:
      top_k: KV blocks per query block and KV group, the forced local block included (paper: 16).
      block_size: 64 (the kernels' tile; the paper's 128 would need two tiles per block).
      layout, ring: as :class:`~mtraining_jax.attention.mtraining.MTrainingConfig`. The selection
        describes each rank's own queries only (:class:`_OwnQueries`): ``ring.backward_ring="query"``
        and ``ring.kv_exchange="sparse"`` are a ``ValueError``; ``"auto"`` gives the K/V side and the ring.
      sm_scale: main-branch softmax scale (default ``D ** -0.5``).
      recall_blocks: local query blocks per rank scored against the full causal attention for the
        recall metric (each costs one query block x ``S`` keys).
      pooling: block scores from mean-pooled index keys (``"mean"``) or max-pooled token scores
        (``"max"``, the paper's); :mod:`~mtraining_jax.sparsity.msa_select`.
      selection: which rows of a query block rank its candidate blocks: ``"causal"`` (its first row;
        no output reads a later token) or ``"block_mean"`` (all 64 rows: a look-ahead of up to 63
        tokens, kept to reproduce earlier runs); :mod:`~mtraining_jax.sparsity.msa_select`.
    """

    top_k: int = 16
    block_size: int = MSA_BLOCK
    layout: str = "block_striped"
    ring: RingOptions = RingOptions()
    sm_scale: float | None = None
    recall_blocks: int = 1
    pooling: str = "mean"
    selection: str = "causal"

    def __post_init__(self):
        validate_pooling(self.pooling)
        validate_selection(self.selection)
        for name in ("top_k", "recall_blocks"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ValueError(f"msa {name} must be an integer >= 1, got {v!r}")
        if self.block_size != MSA_BLOCK:
            raise ValueError(f"msa block_size must be {MSA_BLOCK} (the kernels' tile), got {self.block_size!r}")
        if self.layout not in SPARSE_LAYOUTS:
            raise ValueError(f"msa layout {self.layout!r} is not block-aligned; expected one of {SPARSE_LAYOUTS}")
        object.__setattr__(self, "ring", RingOptions.from_mapping(self.ring))
        for key, value in (("backward_ring", "query"), ("kv_exchange", "sparse")):
            if getattr(self.ring, key) == value:
                raise ValueError(f"msa ring.{key}={value!r} needs every rank's index, but the MSA selection covers "
                                 f"each rank's own queries only; use 'auto' (the K/V side / the ring for msa)")
        if self.sm_scale is not None and not (isinstance(self.sm_scale, (int, float)) and self.sm_scale > 0):
            raise ValueError(f"msa sm_scale must be a positive number or None, got {self.sm_scale!r}")

    def make_layout(self, seq_len: int, num_ranks: int) -> Layout:
        return Layout(self.layout, seq_len, num_ranks, stripe=self.block_size)


class MSAAux(NamedTuple):
    """Per-call outputs besides the attention: ``kl`` (float32 scalar, mean over ``B * S * Hkv``;
    differentiable in the index branch), ``work_fraction`` (executed kernel slots over the dense
    causal ones; 1 in warm-up), ``recall`` (main-branch full attention mass inside the selection,
    on the sampled rows; NaN where not computed: ``metrics=False``)."""

    kl: jax.Array
    work_fraction: jax.Array
    recall: jax.Array


@jax.tree_util.register_pytree_node_class
class _OwnQueries:
    """An index source that describes this rank's queries only (an
    :class:`~mtraining_jax.ring.index_source.IndexSource` with ``steps``, without ``for_rank``):
    MSA's selection is computed per rank from its local queries, so the ``for_rank`` that
    :class:`~mtraining_jax.sparsity.msa_select.MSARankStepIndex` inherits from ``RankStepIndex``
    (whose index is global) would give another rank's step index from THIS rank's selection."""

    def __init__(self, source):
        self.source = source

    @property
    def num_steps(self) -> int:
        return self.source.num_steps

    def step(self, s):
        return self.source.step(s)

    def steps(self, steps):
        return self.source.steps(steps)

    def tree_flatten(self):
        return (self.source,), None

    @classmethod
    def tree_unflatten(cls, _, leaves):
        return cls(*leaves)


def _one_device_mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:1]).reshape(1, 1), CP_AXES)


def _check(q, k, v, q_idx, k_idx, cfg):
    check_qkv(q, k, v)
    B, S, Hq, D = q.shape
    Hkv = k.shape[2]
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim {D} is not supported by the kernels; expected one of {SUPPORTED_HEAD_DIMS}")
    if q_idx.ndim != 4 or tuple(q_idx.shape[:3]) != (B, S, Hkv):
        raise ValueError(f"q_idx must be [B, S, Hkv, d_idx] with [B, S, Hkv] = {[B, S, Hkv]}, got {q_idx.shape}")
    if tuple(k_idx.shape) != (B, S, q_idx.shape[3]):
        raise ValueError(f"k_idx must be [B, S, d_idx] = {[B, S, q_idx.shape[3]]}, got {k_idx.shape}")
    for name, x in (("q_idx", q_idx), ("k_idx", k_idx)):  # the index branch's learned projections
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be floating-point, got dtype {x.dtype}")


def msa_attention(q, k, v, q_idx, k_idx, mesh: Mesh | None = None, cfg: MSAConfig = MSAConfig(), *,
                  positions=None, warmup=False, metrics=True):
    """MSA attention (see module docstring). Returns ``(out [B, S, Hq, D] in q.dtype, MSAAux)``.

    ``positions``: optional ``int [S]``; when concrete it must equal the layout's permutation.
    ``warmup``: Python bool (static) or traced bool (``lax.cond``).
    ``metrics``: Python bool or traced bool: compute the monitoring-only recall metric (a
    ``lax.cond`` when traced: the trainer passes its logging steps); otherwise ``aux.recall`` is
    NaN. The KL (a loss) and the work fraction (from the selection counts) are always computed."""
    _check(q, k, v, q_idx, k_idx, cfg)
    mesh = _one_device_mesh() if mesh is None else mesh
    num_nodes, num_local = check_cp_mesh(mesh)
    P = num_nodes * num_local
    B, S, Hq, D = q.shape
    Hkv = k.shape[2]
    bs = cfg.block_size
    layout = cfg.make_layout(S, P)
    if S % (bs * P):
        raise ValueError(f"sequence length {S} must be a multiple of block_size x ranks = {bs} x {P}")
    if positions is not None and not isinstance(positions, jax.core.Tracer):
        if not np.array_equal(np.asarray(positions), layout.perm):
            raise ValueError(f"positions do not match the {cfg.layout!r} layout of {S} tokens over {P} ranks")
    pos_table = layout.positions
    inv_blocks = np.argsort(layout_block_order(pos_table, bs))  # all-gather (rank-major) -> natural
    inv_tokens = np.argsort(pos_table.reshape(-1))
    batch_axis = "data" if "data" in mesh.shape else None
    spec = PartitionSpec(batch_axis, CP_AXES)
    nb = S // bs
    dense_slots = B * Hq * nb * (nb + 1) / 2 * bs**2

    def body(dense, q_l, k_l, v_l, qi_l, ki_l, flag=None):
        rank = jax.lax.axis_index(CP_AXES)
        pos_l = jnp.asarray(pos_table, jnp.int32)[rank]
        inv = inv_blocks if cfg.pooling == "mean" else inv_tokens
        kbar = jax.lax.all_gather(index_keys(ki_l, bs, cfg.pooling), CP_AXES, axis=1, tiled=True)
        kbar = kbar.at[:, inv].get(unique_indices=True)  # a permutation: its transpose needs no atomics
        sel = select_blocks(qi_l, kbar, pos_l, block_size=bs, top_k=cfg.top_k, pooling=cfg.pooling,
                            selection=cfg.selection)
        if dense:
            out = ring_attention_shard(q_l, k_l, v_l, pos_l, pos_l, num_nodes=num_nodes, num_local=num_local,
                                       options=cfg.ring.for_dense(), sm_scale=cfg.sm_scale, block_size=bs)
            work = jnp.float32(dense_slots) / P
        else:
            src = _OwnQueries(MSARankStepIndex(sel, rank, layout, num_nodes, num_local, cfg.ring.ring_order, bs,
                                               num_heads=Hq))
            out = ring_attention_shard(q_l, k_l, v_l, pos_l, pos_l, num_nodes=num_nodes, num_local=num_local,
                                       options=cfg.ring, step_index=src, sm_scale=cfg.sm_scale, block_size=bs)
            work = selection_work(sel, Hq, bs)
        k_all = jax.lax.all_gather(jax.lax.stop_gradient(k_l), CP_AXES, axis=1, tiled=True)[:, inv_tokens]
        if dense:  # the full causal support, in query-block groups that skip the later (masked) blocks
            kl = warmup_kl_sum(q_l, k_all, pos_l, qi_l, kbar, ki_l, pos_table[:, ::bs] // bs, rank=rank,
                               block_size=bs, sm_scale=cfg.sm_scale, pooling=cfg.pooling)
        else:
            kl = msa_kl_sum(q_l, k_all, pos_l, qi_l, kbar, ki_l, sel, block_size=bs, sm_scale=cfg.sm_scale,
                            pooling=cfg.pooling)
        rows = selection_recall_rows(q_l.shape[0], Hkv, q_l.shape[1], block_size=bs, num_blocks=cfg.recall_blocks)

        def recall():
            return selection_recall_sum(q_l, k_all, pos_l, sel, block_size=bs, sm_scale=cfg.sm_scale,
                                        num_blocks=cfg.recall_blocks)[0]

        if flag is None:
            rec = recall() if metrics else jnp.float32(jnp.nan)
        else:
            rec = jax.lax.cond(flag, recall, lambda: jnp.float32(jnp.nan))
        axes = CP_AXES if batch_axis is None else (batch_axis,) + CP_AXES
        kl, work, rec = (jax.lax.psum(x, axes) for x in (kl, work, rec))
        nrows = rows * P * (1 if batch_axis is None else mesh.shape[batch_axis])
        return out, MSAAux(kl / (B * S * Hkv), work / dense_slots, rec / nrows)

    traced_flag = not isinstance(metrics, (bool, np.bool_))

    def run(dense):
        in_specs = (PartitionSpec(batch_axis, CP_AXES, None, None),) * 4 + (PartitionSpec(batch_axis, CP_AXES, None),)
        args = (q, k, v, q_idx, k_idx)
        if traced_flag:  # the flag enters the shard_map as a replicated operand
            in_specs, args = in_specs + (PartitionSpec(),), args + (jnp.asarray(metrics, bool),)
        fn = jax.shard_map(lambda *a: body(dense, *a), mesh=mesh, in_specs=in_specs,
                           out_specs=(PartitionSpec(batch_axis, CP_AXES, None, None), MSAAux(*(PartitionSpec(),) * 3)),
                           check_vma=False)
        return fn(*args)

    del spec
    if isinstance(warmup, (bool, np.bool_)):
        out, aux = run(bool(warmup))
    else:
        out, aux = jax.lax.cond(warmup, lambda: run(True), lambda: run(False))
    return out.astype(q.dtype), aux
