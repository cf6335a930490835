"""Exact ring attention over the ``(node, local)`` mesh (MTraining §4.2, Algorithm 2): flat and
hierarchical rings, custom VJP.

The sequence, already permuted into a layout (:mod:`mtraining_jax.layouts`), is sharded
contiguously over ``P = N * L`` ranks, node-major (``rank = node * L + local``). Every rank keeps
its queries; the K/V chunks travel. At step ``s`` a rank attends its queries to the chunk of
:func:`.schedule.source_rank` with the causal mask taken from global positions (so any layout is
exact) through ONE per-step function, :func:`pallas_kernels.api.block_sparse_attention_fwd` /
``_bwd`` (``index=None``: dense causal; a ``StepIndex``: sparse), which merges into the float32
``(out, lse)`` accumulators in place.

Each hop is one collective-permute of one stacked buffer (K and V as ``[2, B, Sl, Hkv, D]``, only
the KV heads), posted before the step's compute; the hierarchical outer (``node``) hop is posted
before the inner loop and overlaps it. Positions and segment ids travel once (``all_gather``)::

    N=2, L=2 hierarchical, chunk held by rank (n,l) at step s (= source_rank):
               s=0    s=1    s=2    s=3
      (0,0)   (0,0)  (0,1) | (1,0)  (1,1)
      (0,1)   (0,1)  (0,0) | (1,1)  (1,0)
      (1,0)   (1,0)  (1,1) | (0,0)  (0,1)
      (1,1)   (1,1)  (1,0) | (0,1)  (0,0)
                 inner ring | outer hop (node chunk of step 0 sent at s=0, used at s=2)

The options (order, backward side, K/V exchange, fused calls, kernel) are explained in
:class:`.config.RingOptions`; the backward passes are :mod:`.backward`, the sparse exchange's
passes :mod:`.exchange_ring`, the shared per-step helpers :mod:`.steps`.

Shapes: ``q [B, Sl, Hq, D]``, ``k, v [B, Sl, Hkv, D]``, ``q_pos, k_pos int32 [Sl]``, ``lse
[B, Hq, Sl]`` float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from pallas_kernels.inputs import check_positions, check_qkv, check_segment_ids
from mtraining_jax.mesh import CP_AXES, LOCAL_AXIS, NODE_AXIS, check_cp_mesh
from mtraining_jax.ring.backward import backward_kv, backward_query
from mtraining_jax.ring.config import RingConfig, RingOptions, dense_block, ring_options
from mtraining_jax.ring.exchange import plan_exchange
from mtraining_jax.ring.exchange_ring import backward_exchange, exchange_guard, forward_exchange
from mtraining_jax.ring.index_source import IndexSource, can_fuse, has_every_rank
from mtraining_jax.ring.sides import resolve_backward_ring
from mtraining_jax.ring.steps import (StackedStepIndex, gather_positions, group_index, group_kv, group_positions,
                                      group_segments, my_rank, narrow, shift)
from pallas_kernels.api import block_sparse_attention_fwd, split_output
from pallas_kernels.index_format import DEFAULT_BLOCK, StepIndex, chunk_work

__all__ = ["RingConfig", "RingOptions", "StackedStepIndex", "ring_attention", "ring_attention_shard"]


# ----------------------------------------------------------------------------- forward

def _forward(cfg: RingConfig, q, kv_own, q_pos, kpos_all, step_index, segs=None, out_dtype=jnp.float32):
    """The forward ring. ``kv_own [2, B, Sl, Hkv, D]`` is this rank's K/V, stacked.

    Returns ``(out [B,Sl,Hq,D] in out_dtype, lse f32 [B,Hq,Sl], work f32 [P], kv_last)`` (the last
    kernel call rounds ``out`` to ``out_dtype``; the earlier ones merge in float32): ``work[s]`` the
    kernel slots of step ``s`` (``index_format.step_work``; 0 when dense) and ``kv_last`` the chunk
    held at the last step, where the backward ring starts."""
    outer_axis, n_outer = cfg.outer
    inner_axis, n_inner = cfg.inner
    P = cfg.num_ranks
    fuse = cfg.fuse_forward and P > 1 and can_fuse(step_index)
    rank = my_rank(cfg)
    kv = kv_last = kv_own
    out = lse = None
    work = []
    held = []  # chunks whose kernel call waits to be fused with the next step's
    for i in range(n_outer):
        kv_outer = shift(kv, outer_axis, n_outer) if i < n_outer - 1 else None
        for j in range(n_inner):
            kv_next = shift(kv, inner_axis, n_inner) if j < n_inner - 1 else None
            s = i * n_inner + j
            if s == P - 1:
                kv_last = kv
            held.append((s, kv))
            if not (fuse and s == 0):
                steps = tuple(t for t, _ in held)
                kvs = group_kv([c for _, c in held])
                held = []
                seg_kw = group_segments(segs, rank, steps, cfg)
                index_g = narrow(group_index(step_index, steps), seg_kw, cfg.block_size)
                sk = kvs.shape[2]
                work.extend([jnp.float32(0)] * len(steps) if index_g is None else
                            list(chunk_work(index_g, sk, len(steps), cfg.block_size)))
                out, lse = block_sparse_attention_fwd(
                    q, kvs[0], kvs[1], q_pos, group_positions(kpos_all, rank, steps, cfg), index_g,
                    sm_scale=cfg.sm_scale, block_size=cfg.block_size, impl=cfg.impl, stream=cfg.kernel_stream,
                    acc=None if out is None else (out, lse), out_dtype=out_dtype if s == P - 1 else jnp.float32,
                    **seg_kw)
            kv = kv_next
        kv = kv_outer
    return out, lse, jnp.stack(work), kv_last


# ----------------------------------------------------------------------------- custom VJP

def _gather_segments(seg, cfg: RingConfig):
    """``None`` or ``(q_seg [B, Sl], kseg_all [P, B, Sl])`` from this rank's ``seg [B, Sl]``."""
    return None if seg is None else (seg, gather_positions(seg, cfg))


def _side(cfg: RingConfig, q, k) -> str:
    """The backward ring's side, ``"auto"`` resolved from the shapes (:mod:`.sides`)."""
    return resolve_backward_ring(cfg.backward_ring, heads=q.shape[2], kv_heads=k.shape[2], head_dim=q.shape[3],
                                 itemsize=jnp.dtype(q.dtype).itemsize)


def _passes_forward(cfg: RingConfig, q, kv_own, q_pos, kpos_all, step_index, segs, out_dtype=jnp.float32):
    """``(out, lse, work, kv_last, ok)`` of the ring's forward or the sparse exchange's (``kv_last``:
    the K/V-side ring's backward start, or the exchange's received chunks; ``ok``: the exchange's
    run-time capacity check). ``out_dtype``: both round their output to it in their last kernel call."""
    if cfg.kv_exchange == "sparse":
        ok = exchange_guard(cfg, step_index, kv_own.shape[2])
        out, lse, work, kept = forward_exchange(cfg, q, kv_own, q_pos, kpos_all, step_index, segs, ok, out_dtype)
        return out, lse, work, kept, ok
    out, lse, work, kv_last = _forward(cfg, q, kv_own, q_pos, kpos_all, step_index, segs, out_dtype)
    return out, lse, work, kv_last, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(cfg: RingConfig, q, k, v, q_pos, k_pos, step_index, seg=None):
    """``(out [B, Sl, Hq, D] in q's dtype, work f32 [P])``; ``work`` is not differentiated."""
    # no backward reads this output (a traced forward alone): the last kernel call rounds it to q's dtype
    out, _, work, _, _ = _passes_forward(cfg, q, jnp.stack([k, v]), q_pos, gather_positions(k_pos, cfg), step_index,
                                         _gather_segments(seg, cfg), out_dtype=q.dtype)
    return out.astype(q.dtype), work


def _ring_fwd(cfg: RingConfig, q, k, v, q_pos, k_pos, step_index, seg=None):
    kpos_all = gather_positions(k_pos, cfg)
    kv_own = jnp.stack([k, v])  # one permute per hop (see module docstring)
    segs = _gather_segments(seg, cfg)
    out, lse, work, kv_last, ok = _passes_forward(cfg, q, kv_own, q_pos, kpos_all, step_index, segs)
    # O is returned in q's dtype; its rounding error is kept beside it as one int4 code per element
    # (split_output), so that delta = rowsum(dO * O) is formed from the float32 O (bf16 gradients at
    # the bf16 floor).
    # An on-demand index source (RankStepIndex) is saved as its compact global index only.
    out, out_lo = split_output(out, q.dtype)
    if _side(cfg, q, k) == "query":
        # the visiting queries' positions instead of the chunk saved from the forward's last step
        kv_last, q_pos = None, gather_positions(q_pos, cfg)
    return (out, work), (q, kv_own, kv_last, q_pos, kpos_all, step_index, out, out_lo, lse, segs, ok)


def _ring_bwd(cfg: RingConfig, res, cotangents):
    do = cotangents[0]  # work carries no gradient
    q, kv_own, kv_last, q_pos, kpos_all, step_index, out, out_lo, lse, segs, ok = res
    if _side(cfg, q, kv_own[0]) == "query":
        dq, dk, dv = backward_query(cfg, q, kv_own, q_pos, kpos_all, step_index, out, out_lo, lse, do, segs)
    elif cfg.kv_exchange == "sparse":
        dq, dk, dv = backward_exchange(cfg, q, kv_own, kv_last, q_pos, kpos_all, step_index, out, out_lo, lse, do, segs,
                                       ok)
    else:
        dq, dk, dv = backward_kv(cfg, q, kv_own, kv_last, q_pos, kpos_all, step_index, out, out_lo, lse, do, segs)
    # positions, segment ids and the sparse index are integer data: zero cotangents (None).
    return dq.astype(q.dtype), dk.astype(kv_own.dtype), dv.astype(kv_own.dtype), None, None, None, None


_ring.defvjp(_ring_fwd, _ring_bwd)


# ----------------------------------------------------------------------------- validation

def _check_step_index(step_index, num_ranks: int) -> None:
    if step_index is None:
        return
    if not isinstance(step_index, StepIndex):
        if isinstance(step_index, IndexSource) and step_index.num_steps == num_ranks:
            return
        raise ValueError(f"step_index must be None, a StepIndex with a leading [P] axis or an index source "
                         f"with .step(s) and num_steps == P = {num_ranks} (ring.index_source.IndexSource); "
                         f"got {type(step_index).__name__}")
    for name, a in step_index._asdict().items():
        if a.ndim < 1 or a.shape[0] != num_ranks:
            raise ValueError(
                f"step_index.{name} has shape {tuple(a.shape)}; expected a leading ring-step axis of "
                f"size P = {num_ranks}")


def _check_axis_sizes(cfg: RingConfig) -> None:
    try:
        sizes = (lax.axis_size(NODE_AXIS), lax.axis_size(LOCAL_AXIS))
    except NameError as e:
        raise ValueError(
            f"ring_attention_shard must run inside shard_map over the mesh axes {CP_AXES} ({e})") from None
    if sizes != (cfg.num_nodes, cfg.num_local):
        raise ValueError(
            f"num_nodes x num_local = {cfg.num_nodes} x {cfg.num_local} does not match the mesh axes "
            f"{CP_AXES} of sizes {sizes[0]} x {sizes[1]}")


# ----------------------------------------------------------------------------- public API

def ring_attention_shard(q, k, v, q_pos, k_pos, *, num_nodes, num_local, options: RingOptions | None = None,
                         step_index=None, sm_scale=None, block_size: int | None = None, return_work: bool = False,
                         segment_ids=None, **ring_kw):
    """Per-rank ring attention body, to be called INSIDE ``shard_map`` over ``("node", "local")``.

    Args:
      q: ``[B, Sl, Hq, D]`` this rank's queries (layout order).
      k, v: ``[B, Sl, Hkv, D]`` this rank's keys/values, ``Hq % Hkv == 0``.
      q_pos, k_pos: ``int32 [Sl]`` this rank's global token positions (for the causal mask).
      num_nodes, num_local: sizes of the ``node`` and ``local`` mesh axes.
      options: the :class:`RingOptions` (default ``RingOptions()``); ``**ring_kw``: any of its fields
        as keywords, replacing those of ``options``.
      step_index: ``None`` (dense causal), a :class:`pallas_kernels.StepIndex` with a leading ``[P]``
        ring-step axis, or an index source (:mod:`mtraining_jax.ring.index_source`, e.g.
        :class:`mtraining_jax.sparsity.RankStepIndex`). Entry ``s``: this rank's queries against the
        chunk of ``schedule.source_rank(rank, s, ...)``, blocks of ``block_size``. Not differentiated.
      sm_scale: softmax scale (default ``D ** -0.5``).
      block_size: kernel block size. ``None``: ``DEFAULT_BLOCK`` (64) with an index, else the largest
        power of two ``<= DEFAULT_BLOCK`` dividing ``Sl``.
      return_work: also return ``work f32 [P]``, the kernel slots of each ring step
        (``index_format.step_work``; zeros for the dense ring).
      segment_ids: ``int32 [B, Sl]`` this rank's segment ids (packed documents: a query attends only
        keys of its own segment), or ``None``.

    Returns:
      ``out [B, Sl, Hq, D]`` in ``q.dtype`` (and ``work``); differentiable in ``q, k, v``.

    Raises:
      TypeError: a keyword that is not a ring option. ValueError: bad shapes, positions or
      ``step_index``; not inside ``shard_map`` over the mesh; ``backward_ring="query"`` with an
      index of this rank's queries only, or ``kv_exchange="sparse"`` without a
      :class:`.index_source.GlobalIndexSource` (the dense ring included).
    """
    opts = ring_options(options, caller="ring_attention_shard()", **ring_kw)
    check_qkv(q, k, v)
    sl = q.shape[1]
    if block_size is None:
        block_size = DEFAULT_BLOCK if step_index is not None else dense_block(sl)
    query_ok = has_every_rank(step_index)
    if opts.backward_ring == "query" and not query_ok:
        raise ValueError(f"backward_ring='query' needs the index of every rank's queries (an index source with "
                         f"for_rank, e.g. RankStepIndex); got {type(step_index).__name__}")
    side = resolve_backward_ring(opts.backward_ring, heads=q.shape[2], kv_heads=k.shape[2], head_dim=q.shape[3],
                                 itemsize=jnp.dtype(q.dtype).itemsize, query_ok=query_ok)
    _check_step_index(step_index, num_nodes * num_local)
    exchange, capacity, guard = plan_exchange(
        opts.kv_exchange, step_index, opts.exchange_capacity, num_ranks=num_nodes * num_local, chunk_len=sl,
        block_size=block_size, batch=q.shape[0], kv_heads=k.shape[2], head_dim=q.shape[3],
        itemsize=jnp.dtype(q.dtype).itemsize, backward_side=side, num_nodes=num_nodes, ring_order=opts.ring_order)
    cfg = RingConfig(num_nodes, num_local, opts.ring_order, sm_scale, opts.impl, block_size, opts.fuse_forward,
                     opts.fuse_backward, side, exchange, capacity, guard, opts.kernel_stream)
    q_pos, k_pos = check_positions("q_pos", q_pos, sl, "Sl"), check_positions("k_pos", k_pos, sl, "Sl")
    _check_axis_sizes(cfg)
    if segment_ids is not None:
        if tuple(segment_ids.shape) != tuple(q.shape[:2]):
            raise ValueError(f"segment_ids has shape {tuple(segment_ids.shape)}, "
                             f"expected [B, Sl] = {list(q.shape[:2])}")
        segment_ids = jnp.asarray(segment_ids, jnp.int32)
    out, work = _ring(cfg, q, k, v, q_pos, k_pos, step_index, segment_ids)
    return (out, work) if return_work else out


def ring_attention(q, k, v, positions, mesh, *, options: RingOptions | None = None, sm_scale=None, segment_ids=None,
                   **ring_kw):
    """Causal GQA ring attention over a ``(node, local)`` mesh on data already in a layout.

    Args:
      q: ``[B, S, Hq, D]``; k, v: ``[B, S, Hkv, D]``, global arrays in LAYOUT order: laid token
        ``i`` has global position ``positions[i]``.
      positions: ``int32 [S]`` (``Layout.perm``).
      mesh: a mesh with axes ``("node", "local")`` (and optionally ``"data"``, which shards batch).
      options: the :class:`RingOptions` (default ``RingOptions()``); ``**ring_kw``: any of its fields
        as keywords, replacing those of ``options``. This ring has no index: ``kv_exchange="sparse"``
        is a ``ValueError``.
      sm_scale: softmax scale (default ``D ** -0.5``).
      segment_ids: ``int [B, S]`` document of each laid token (packed documents), or ``None``.

    Returns:
      ``out [B, S, Hq, D]`` in ``q.dtype``, layout order, sequence sharded over ``("node",
      "local")`` node-major. Works under ``jax.jit``; differentiable (custom VJP ring inside).
    """
    opts = ring_options(options, caller="ring_attention()", **ring_kw)
    num_nodes, num_local = check_cp_mesh(mesh)
    check_qkv(q, k, v)
    B, S = q.shape[:2]
    positions = check_positions("positions", positions, S)
    P = num_nodes * num_local
    if S % P:
        raise ValueError(f"sequence length {S} is not divisible by the number of ranks {P} "
                         f"(mesh node={num_nodes} x local={num_local})")
    batch_axis = None
    if "data" in mesh.shape:
        batch_axis = "data"
        if B % mesh.shape["data"]:
            raise ValueError(f"batch {B} is not divisible by the data axis size {mesh.shape['data']}")
    spec = PartitionSpec(batch_axis, CP_AXES, None, None)
    pos_spec = PartitionSpec(CP_AXES)
    seg_spec = PartitionSpec(batch_axis, CP_AXES)
    segment_ids = check_segment_ids(segment_ids, B, S)

    def body(q_l, k_l, v_l, pos_l, seg_l):
        return ring_attention_shard(q_l, k_l, v_l, pos_l, pos_l, num_nodes=num_nodes, num_local=num_local,
                                    options=opts, sm_scale=sm_scale, segment_ids=seg_l)

    # check_vma=False: the per-step kernels (Pallas calls, scans with fresh zero carries) are not
    # annotated for varying-manual-axes typing; the ring itself is checked by tests, not by types.
    fn = jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec, pos_spec, seg_spec), out_specs=spec,
                       check_vma=False)
    return fn(q, k, v, positions.astype(jnp.int32),
              None if segment_ids is None else segment_ids.astype(jnp.int32))
