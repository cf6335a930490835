"""Exact ring attention over the ``(node, local)`` mesh: flat and hierarchical rings, custom VJP.

The sequence, already permuted into a layout (``mtraining_jax.layouts``), is sharded contiguously
over ``P = N * L`` ranks, node-major (``rank = node * L + local``). Every rank keeps its queries
and sends its K/V chunk around a ring; at each step it attends its queries to the visiting chunk
with the causal mask taken from *global positions* (so any layout is exact) and merges the partial
``(out, lse)`` into float32 accumulators (:func:`pallas_kernels.merge.merge_partials`). The per-step
block computation is ONE function, :func:`pallas_kernels.api.block_sparse_attention_fwd` /
``_bwd`` (``index=None``: dense causal; a ``StepIndex``: the MTraining sparse ring), which takes
the accumulators (``acc``; ``dq_acc``, ``dkv_acc``) and, on the Pallas path, updates them in place
inside its kernels, so no ring step makes an extra pass over the float32 ``[Sl, Hq, D]`` state.

Which chunk a rank holds at step ``s`` is :func:`mtraining_jax.ring_schedule.source_rank`; the
communication below realises exactly that table (the tests check it against the index plumbing).

Only the KV heads travel (GQA). Everything that travels together is stacked into one buffer (K and
V as ``[2, B, Sl, Hkv, D]``, the float32 dK/dV accumulators likewise), so each ring hop is ONE
collective-permute: with XLA's default of one asynchronous collective in flight, a second permute
posted beside the first is made synchronous and waited for (measured on 2 H200s: 0.25 ms exposed
per hop for K and V sent separately, none stacked; ``benchmarks/sparse_ring_results.md``, v9).
Positions are not sent per step: one ``all_gather`` of the tiny
``k_pos [Sl]`` at the start gives every chunk's positions, indexed by ``source_rank``.

Forward schedule (MTraining §4.2, Algorithm 2). Both orders are the same two-level loop; the flat
ring is one outer step whose inner ring spans all ranks::

    flat:          inner axis ("node","local") of size P, outer size 1
    hierarchical:  inner axis "local" of size L,          outer axis "node" of size N

    for i in 0..N_out-1:                        # outer step
        if i < N_out-1: kv_o = send(kv, outer +1)     # posted BEFORE the inner loop: overlaps it
        for j in 0..N_in-1:                     # inner step, s = i * N_in + j
            if j < N_in-1: kv_n = send(kv, inner +1)  # posted before this step's compute
            out, lse = merge(out, lse, attend(q, kv, step s))
            kv = kv_n
        kv = kv_o

    N=2, L=2 hierarchical, chunk held by rank (n,l) at step s (= source_rank):
               s=0    s=1    s=2    s=3
      (0,0)   (0,0)  (0,1) | (1,0)  (1,1)
      (0,1)   (0,1)  (0,0) | (1,1)  (1,0)
      (1,0)   (1,0)  (1,1) | (0,0)  (0,1)
      (1,1)   (1,1)  (1,0) | (0,1)  (0,0)
                 inner ring | outer hop (node chunk of step 0 sent at s=0, used at s=2)

Backward (custom VJP, FlashAttention-2 style, reusing the forward's final ``lse`` and
``delta = rowsum(dO * O)``; nothing of the forward ring is recomputed beyond the per-step
probabilities a flash backward needs). Queries, ``dO``, ``lse``, ``delta`` and the ``dQ``
accumulator stay home; K/V circulate again on the same schedule (stacked as one ``[V, K]`` buffer,
which the forward never sends, so XLA cannot merge these permutes with the forward's and keep every
visiting chunk alive in between) and float32 dK/dV accumulators travel with them. Each step's
kernels compute dK/dV before dQ (``pallas_kernels.triton_backward.pallas_bwd``), so the transfer of
the step's dK/dV (to the neighbour, or home after the last step) overlaps the dQ kernel:

* inner ring: the accumulator ``acc`` of the chunk being visited follows it hop by hop (sent after
  the step's compute, so it overlaps the next step's compute);
* end of outer step ``i``: ``acc`` holds the node-level sum for chunk ``((n-i), (l+1))`` (the chunk
  this rank saw last). It is added to ``tot``, the running total of that same chunk that arrived
  from node ``n-1``, and ``tot`` is sent one node along (outer +1). It lands on the rank that sees
  that chunk *last* in outer step ``i+1``, so it has the whole inner loop to arrive, like the
  forward's outer K/V hop;
* after the last step ``tot`` for the chunk this rank held at step ``P-1`` is complete and one
  permute ``rank -> source_rank(rank, P-1)`` brings it home (flat: +1; hierarchical: +1 node and
  +1 local at once), already rounded to K/V's dtype (the owner adds nothing to it; for bf16 this
  halves the one transfer no compute can hide)::

      outer step i:  acc --inner--> acc --inner--> ... acc ─┐
                                                    tot_in ─┴─(+)─ tot ──outer +1──> next outer step
      after the last outer step:                             tot ──home permute──> owner of the chunk

All shapes: ``q [B, Sl, Hq, D]``, ``k, v [B, Sl, Hkv, D]``, ``q_pos, k_pos int32 [Sl]``, ``lse
[B, Hq, Sl]`` float32.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from mtraining_jax.attention.reference import check_gqa
from mtraining_jax.mesh import CP_AXES, LOCAL_AXIS, NODE_AXIS, check_cp_mesh
from mtraining_jax.ring_schedule import source_rank, validate_ring_order
from pallas_kernels.api import IMPLS, attention_delta, block_sparse_attention_bwd, block_sparse_attention_fwd
from pallas_kernels.index_format import DEFAULT_BLOCK, StepIndex, step_work

__all__ = ["RingConfig", "ring_attention", "ring_attention_shard"]


@dataclasses.dataclass(frozen=True)
class RingConfig:
    """Static description of one ring (hashable: it is the custom VJP's non-differentiable arg).

    Attributes:
      num_nodes: ``N``, size of the ``node`` mesh axis.
      num_local: ``L``, size of the ``local`` mesh axis.
      ring_order: ``"flat"`` or ``"hierarchical"`` (see module docstring).
      sm_scale: softmax scale; ``None`` means ``head_dim ** -0.5``.
      impl: per-step kernel implementation passed to ``pallas_kernels.api``.
      block_size: block size of the per-step ``StepIndex`` (when one is given).
    """

    num_nodes: int
    num_local: int
    ring_order: str = "hierarchical"
    sm_scale: float | None = None
    impl: str = "auto"
    block_size: int = DEFAULT_BLOCK

    def __post_init__(self):
        for name in ("num_nodes", "num_local", "block_size"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < 1:
                raise ValueError(f"{name} must be a positive integer, got {val!r}")
        validate_ring_order(self.ring_order)
        if self.impl not in IMPLS:
            raise ValueError(f"unknown impl {self.impl!r}; expected one of {IMPLS}")

    @property
    def num_ranks(self) -> int:
        return self.num_nodes * self.num_local

    @property
    def outer(self) -> tuple[str | tuple[str, ...], int]:
        """``(axis, size)`` of the outer ring (size 1: no outer ring)."""
        if self.ring_order == "flat":
            return CP_AXES, 1
        return NODE_AXIS, self.num_nodes

    @property
    def inner(self) -> tuple[str | tuple[str, ...], int]:
        """``(axis, size)`` of the inner ring."""
        if self.ring_order == "flat":
            return CP_AXES, self.num_ranks
        return LOCAL_AXIS, self.num_local


# ----------------------------------------------------------------------------- communication

def _shift(x, axis, size: int):
    """Send ``x`` one position along the ring on ``axis`` (rank ``a`` -> ``a + 1 mod size``)."""
    if size == 1:
        return x
    return lax.ppermute(x, axis, perm=[(a, (a + 1) % size) for a in range(size)])


def _send_home(x, cfg: RingConfig):
    """Send what this rank holds at the last ring step to the owner of that chunk."""
    P = cfg.num_ranks
    if P == 1:
        return x
    last = P - 1
    perm = [(r, int(source_rank(r, last, cfg.num_nodes, cfg.num_local, cfg.ring_order))) for r in range(P)]
    return lax.ppermute(x, CP_AXES, perm=perm)


def _my_rank(cfg: RingConfig):
    return lax.axis_index(NODE_AXIS) * cfg.num_local + lax.axis_index(LOCAL_AXIS)


def _gather_positions(k_pos, cfg: RingConfig):
    """``int32 [P, Sl]``: every rank's key positions (node-major), from one all-gather."""
    if cfg.num_ranks == 1:
        return k_pos[None]
    return lax.all_gather(k_pos, CP_AXES, axis=0, tiled=False)


def _step_positions(kpos_all, rank, step: int, cfg: RingConfig):
    src = source_rank(rank, step, cfg.num_nodes, cfg.num_local, cfg.ring_order)
    return lax.dynamic_index_in_dim(kpos_all, src, axis=0, keepdims=False)


def _step_index(step_index, step: int):
    """Step ``step``'s :class:`StepIndex`: a slice of a ``[P]``-stacked index, or converted on
    demand by an index source (``step_index.step(s)``, e.g. ``sparsity.convert.RankStepIndex``)."""
    if step_index is None:
        return None
    if isinstance(step_index, StepIndex):
        return jax.tree.map(lambda a: a[step], step_index)
    return step_index.step(step)


# ----------------------------------------------------------------------------- forward / backward

def _forward(cfg: RingConfig, q, k, v, q_pos, kpos_all, step_index):
    """The forward ring; returns ``(out f32 [B,Sl,Hq,D], lse f32 [B,Hq,Sl], work f32 [P])`` with
    ``work[s]`` the kernel slots step ``s`` attended (``index_format.step_work``; 0 when dense)."""
    outer_axis, n_outer = cfg.outer
    inner_axis, n_inner = cfg.inner
    rank = _my_rank(cfg)
    kv = jnp.stack([k, v])  # one permute per hop (see module docstring)
    out = lse = None
    work = []
    for i in range(n_outer):
        kv_outer = _shift(kv, outer_axis, n_outer) if i < n_outer - 1 else None
        for j in range(n_inner):
            kv_next = _shift(kv, inner_axis, n_inner) if j < n_inner - 1 else None
            s = i * n_inner + j
            index_s = _step_index(step_index, s)
            work.append(jnp.float32(0) if index_s is None else step_work(index_s, cfg.block_size))
            out, lse = block_sparse_attention_fwd(
                q, kv[0], kv[1], q_pos, _step_positions(kpos_all, rank, s, cfg), index_s,
                sm_scale=cfg.sm_scale, block_size=cfg.block_size, impl=cfg.impl,
                acc=None if out is None else (out, lse))
            kv = kv_next
        kv = kv_outer
    return out, lse, jnp.stack(work)


def _backward(cfg: RingConfig, q, k, v, q_pos, kpos_all, step_index, out, lse, do):
    """The backward ring (see module docstring); returns ``dq`` float32 and ``dk, dv`` in k's dtype
    (accumulated in float32 on the way)."""
    outer_axis, n_outer = cfg.outer
    inner_axis, n_inner = cfg.inner
    rank = _my_rank(cfg)
    delta = attention_delta(out, do)
    # V first: the backward circulates a different buffer than the forward's [K, V], so when both
    # run in one jit XLA cannot CSE the backward's permutes into the forward's. CSE would keep all
    # P visiting chunks alive from forward to backward (the whole sequence's K/V on every rank),
    # which is what a ring exists to avoid. (An optimization_barrier does not stop it on CPU.)
    vk = jnp.stack([v, k])
    dq = None
    tot = None  # running dK/dV total of the chunk this rank will see last in the current outer step
    for i in range(n_outer):
        vk_outer = _shift(vk, outer_axis, n_outer) if i < n_outer - 1 else None
        acc = None
        for j in range(n_inner):
            vk_next = _shift(vk, inner_axis, n_inner) if j < n_inner - 1 else None
            s = i * n_inner + j
            dq, dk_s, dv_s = block_sparse_attention_bwd(
                q, vk[1], vk[0], q_pos, _step_positions(kpos_all, rank, s, cfg), _step_index(step_index, s),
                do, lse, delta, sm_scale=cfg.sm_scale, block_size=cfg.block_size, impl=cfg.impl,
                dq_acc=dq, dkv_acc=acc)
            acc = (dk_s, dv_s)  # float32, this step's chunk's dK/dV summed over the ranks it visited
            if j < n_inner - 1:
                acc = tuple(_shift(jnp.stack(acc), inner_axis, n_inner))  # travels with its chunk
                vk = vk_next
        tot = acc if tot is None else jax.tree.map(jnp.add, tot, acc)
        if i < n_outer - 1:
            tot = tuple(_shift(jnp.stack(tot), outer_axis, n_outer))
            vk = vk_outer
    # The owner adds nothing after this, so rounding to K/V's dtype before the transfer gives the
    # same bits as after it, and halves the one transfer no compute is left to hide (bf16).
    dkv = _send_home(jnp.stack(tot).astype(k.dtype), cfg)
    return dq, dkv[0], dkv[1]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(cfg: RingConfig, q, k, v, q_pos, k_pos, step_index):
    """``(out [B, Sl, Hq, D] in q's dtype, work f32 [P])``; ``work`` is not differentiated."""
    out, _, work = _forward(cfg, q, k, v, q_pos, _gather_positions(k_pos, cfg), step_index)
    return out.astype(q.dtype), work


def _ring_fwd(cfg: RingConfig, q, k, v, q_pos, k_pos, step_index):
    kpos_all = _gather_positions(k_pos, cfg)
    out, lse, work = _forward(cfg, q, k, v, q_pos, kpos_all, step_index)
    out = out.astype(q.dtype)
    # O is kept in q's dtype (as FlashAttention does); delta = rowsum(dO * O) is formed from it.
    # An on-demand index source (RankStepIndex) is saved as its compact global index only.
    return (out, work), (q, k, v, q_pos, kpos_all, step_index, out, lse)


def _ring_bwd(cfg: RingConfig, res, cotangents):
    do = cotangents[0]  # work carries no gradient
    q, k, v, q_pos, kpos_all, step_index, out, lse = res
    dq, dk, dv = _backward(cfg, q, k, v, q_pos, kpos_all, step_index, out, lse, do)
    # positions and the sparse index are integer data: zero cotangents (None).
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


_ring.defvjp(_ring_fwd, _ring_bwd)


# ----------------------------------------------------------------------------- validation

def _check_qkv(q, k, v) -> None:
    if q.ndim != 4 or k.ndim != 4:
        raise ValueError(f"q and k must be [batch, seq, heads, head_dim]; got q {q.shape}, k {k.shape}")
    if v.shape != k.shape:
        raise ValueError(f"k and v shapes differ: {k.shape} vs {v.shape}")
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {q.shape} and k {k.shape} must agree on batch, seq and head_dim")
    check_gqa(q.shape[2], k.shape[2])


def _dense_block(sl: int) -> int:
    """Largest power of two ``<= DEFAULT_BLOCK`` dividing ``sl`` (tile size of the dense ring)."""
    b = DEFAULT_BLOCK
    while b > 1 and sl % b:
        b //= 2
    return b


def _check_step_index(step_index, num_ranks: int) -> None:
    if step_index is None:
        return
    if not isinstance(step_index, StepIndex):
        if callable(getattr(step_index, "step", None)) and getattr(step_index, "num_steps", None) == num_ranks:
            return
        raise ValueError(f"step_index must be None, a StepIndex with a leading [P] axis or an index source "
                         f"with .step(s) and num_steps == P = {num_ranks}; got {type(step_index).__name__}")
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

def ring_attention_shard(q, k, v, q_pos, k_pos, *, num_nodes, num_local, ring_order, step_index=None,
                         sm_scale=None, impl="auto", block_size: int | None = None, return_work: bool = False):
    """Per-rank ring attention body, to be called INSIDE ``shard_map`` over ``("node", "local")``.

    Args:
      q: ``[B, Sl, Hq, D]`` this rank's queries (layout order).
      k, v: ``[B, Sl, Hkv, D]`` this rank's keys/values, ``Hq % Hkv == 0``.
      q_pos, k_pos: ``int32 [Sl]`` this rank's global token positions (for the causal mask).
      num_nodes, num_local: sizes of the ``node`` and ``local`` mesh axes.
      ring_order: ``"flat"`` or ``"hierarchical"``.
      step_index: ``None`` (dense causal), a :class:`pallas_kernels.StepIndex` whose arrays have a
        leading ``[P]`` ring-step axis, or an index source converting one step on demand
        (``step(s) -> StepIndex``, ``num_steps == P``: :class:`mtraining_jax.sparsity.RankStepIndex`,
        which keeps one step's index alive at a time and only the compact index for the backward).
        Entry ``s`` describes this rank's queries against the chunk it holds at step ``s`` (source
        ``ring_schedule.source_rank(rank, s, ...)``), with blocks of ``block_size`` tokens. Never
        differentiated.
      sm_scale: softmax scale (default ``D ** -0.5``).
      impl: ``"auto"``, ``"pallas"`` or ``"xla"`` for the per-step kernels.
      block_size: kernel block size (the ``StepIndex`` block size when one is given). ``None``:
        ``DEFAULT_BLOCK`` (64) with an index; for the dense ring the largest power of two
        ``<= DEFAULT_BLOCK`` dividing ``Sl``.

      return_work: also return ``work f32 [P]``, the kernel slots each ring step attended
        (``index_format.step_work``; zeros for the dense ring), for load statistics.

    Returns:
      ``out [B, Sl, Hq, D]`` in ``q.dtype`` (and ``work``). Differentiable in ``q, k, v`` (custom
      VJP ring).
    """
    _check_qkv(q, k, v)
    sl = q.shape[1]
    if block_size is None:
        block_size = DEFAULT_BLOCK if step_index is not None else _dense_block(sl)
    cfg = RingConfig(num_nodes, num_local, ring_order, sm_scale, impl, block_size)
    if tuple(q_pos.shape) != (sl,) or tuple(k_pos.shape) != (sl,):
        raise ValueError(f"q_pos {tuple(q_pos.shape)} and k_pos {tuple(k_pos.shape)} must both be [Sl] = [{sl}]")
    _check_step_index(step_index, cfg.num_ranks)
    _check_axis_sizes(cfg)
    q_pos = jnp.asarray(q_pos, jnp.int32)
    k_pos = jnp.asarray(k_pos, jnp.int32)
    out, work = _ring(cfg, q, k, v, q_pos, k_pos, step_index)
    return (out, work) if return_work else out


def ring_attention(q, k, v, positions, mesh, *, ring_order="hierarchical", sm_scale=None, impl="auto"):
    """Causal GQA ring attention over a ``(node, local)`` mesh on data already in a layout.

    Args:
      q: ``[B, S, Hq, D]``; k, v: ``[B, S, Hkv, D]``, global arrays in LAYOUT order: laid token
        ``i`` has global position ``positions[i]``.
      positions: ``int32 [S]`` (``Layout.perm``).
      mesh: a mesh with axes ``("node", "local")`` (and optionally ``"data"``, which shards batch).
      ring_order: ``"hierarchical"`` (default) or ``"flat"``.
      sm_scale: softmax scale (default ``D ** -0.5``).
      impl: per-step kernel implementation (``"auto"``, ``"pallas"``, ``"xla"``).

    Returns:
      ``out [B, S, Hq, D]`` in ``q.dtype``, layout order, sequence sharded over ``("node",
      "local")`` node-major. Works under ``jax.jit``; differentiable (custom VJP ring inside).
    """
    num_nodes, num_local = check_cp_mesh(mesh)
    validate_ring_order(ring_order)
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS}")
    _check_qkv(q, k, v)
    B, S = q.shape[:2]
    positions = jnp.asarray(positions)
    if positions.shape != (S,):
        raise ValueError(f"positions has shape {tuple(positions.shape)}, expected [S] = [{S}]")
    if not jnp.issubdtype(positions.dtype, jnp.integer):
        raise ValueError(f"positions must be integers, got dtype {positions.dtype}")
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

    def body(q_l, k_l, v_l, pos_l):
        return ring_attention_shard(q_l, k_l, v_l, pos_l, pos_l, num_nodes=num_nodes, num_local=num_local,
                                    ring_order=ring_order, sm_scale=sm_scale, impl=impl)

    # check_vma=False: the per-step kernels (Pallas calls, scans with fresh zero carries) are not
    # annotated for varying-manual-axes typing; the ring itself is checked by tests, not by types.
    fn = jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec, pos_spec), out_specs=spec,
                       check_vma=False)
    return fn(q, k, v, positions.astype(jnp.int32))
