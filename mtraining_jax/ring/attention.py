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

Which chunk a rank holds at step ``s`` is :func:`mtraining_jax.ring.schedule.source_rank`; the
communication below realises exactly that table (the tests check it against the index plumbing).

Only the KV heads travel (GQA). Everything that travels together is stacked into one buffer (K and
V as ``[2, B, Sl, Hkv, D]``, the float32 dK/dV accumulators likewise), so each ring hop is ONE
collective-permute: with XLA's default of one asynchronous collective in flight, a second permute
posted beside the first is made synchronous and waited for (``benchmarks/sparse_ring_results.md``, v9).
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

Fused kernel calls. With ``fuse_forward`` the forward's first kernel call covers the own chunk
AND the chunk of step 1 (K/V concatenated, the index of both chunks converted at once:
``RankStepIndex.steps``): it waits for the first hop, which overlaps what precedes the ring (the
index estimate in ``mtraining_attention``), and the hop of step 2 overlaps the fused call. On 2 ranks
the whole forward is then one kernel call over this rank's queries, as on one GPU: each call re-reads
the queries and reads and rewrites the float32 accumulators, per-row work that a ring otherwise pays
once per step (``benchmarks/sparse_ring_results.md``, v11).

Backward (custom VJP, FlashAttention-2 style, reusing the forward's final ``lse`` and
``delta = rowsum(dO * O)``; nothing of the forward ring is recomputed beyond the per-step
probabilities a flash backward needs). Queries, ``dO``, ``lse``, ``delta`` and the ``dQ``
accumulator stay home. The backward runs the forward's steps in REVERSE order, starting from the
chunk of the last forward step (saved as a residual: one chunk per rank), so K/V move the other way
(-1 along each ring). The own chunk is the last one visited and never travels home; with
``fuse_backward`` its kernel call is fused with the first one (the saved chunk and the own chunk
are both here from the start). The float32 dK/dV accumulators travel with their chunks and end at
their owner without a send-home. Each step's kernels compute dK/dV before dQ
(``pallas_kernels.triton_backward.pallas_bwd``), so the transfer of the step's dK/dV overlaps the
dQ kernel:

* inner ring: the accumulator ``acc`` of the chunk being visited follows it hop by hop (sent after
  the step's dK/dV kernels, so it overlaps the dQ kernel and the next step);
* end of reverse outer step ``i``: ``acc`` holds node ``n``'s sum for chunk ``(n-i, l)`` (the chunk
  held at step ``(i, 0)``). It is added to ``tot``, that chunk's total over the nodes already
  visited (arrived from node ``n+1``), and ``tot`` is sent one node back, to the rank that sees the
  chunk at step ``(i-1, 0)``; it has the whole inner loop to arrive, like the outer K/V hop, which
  is posted at the start of each reverse outer step;
* at step ``(0, 0)`` the rank holds its own chunk: own contribution + ``acc`` (the rest of its
  node) + ``tot`` (the other nodes) is the chunk's whole dK/dV::

      reverse outer step i:  acc --inner -1--> acc --inner -1--> ... acc ─┐
                                                            tot_in ─────┴─(+)─ tot ──outer -1──> step i-1
      step (0, 0):           own + acc + tot = dK/dV of this rank's chunk

  Per forward + backward: ``P-1`` K/V hops forward, ``P-2`` backward (the hop that would bring the
  own chunk back is not made) and ``P-1`` accumulator hops; on 2 ranks the backward moves one
  float32 dK/dV chunk and nothing else.

Query-side backward (``backward_ring="query"``, BurstEngine; :func:`_backward_query`): the
roles swap — K, V and the float32 dK/dV stay at their owner while the visiting ranks' Q, dO, lse
and delta (one packed buffer) and their float32 dQ accumulator travel ``+1`` along the rings, over
the same (query rank, K/V chunk) pairs as the forward (the own step first, then the forward's steps
in reverse). ``"auto"`` picks the side whose hop moves fewer bytes (:mod:`.sides`): K/V for GQA,
query for MHA. ``P - 1`` buffer hops and ``P - 1`` dQ hops per backward; no fused call.

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

from pallas_kernels.inputs import check_qkv
from mtraining_jax.mesh import CP_AXES, LOCAL_AXIS, NODE_AXIS, check_cp_mesh
from mtraining_jax.ring.schedule import source_rank, validate_ring_order
from mtraining_jax.ring.sides import resolve_backward_ring, validate_backward_ring
from pallas_kernels.api import attention_delta, block_sparse_attention_bwd, block_sparse_attention_fwd, split_output
from pallas_kernels.registry import validate_impl
from pallas_kernels.index_format import DEFAULT_BLOCK, StepIndex, apply_segments, chunk_work

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
      fuse_forward: the forward's first kernel call covers the own chunk AND the chunk of step 1
        (it waits for the first hop, which then overlaps whatever precedes the ring, e.g. the index
        estimate, instead of a kernel call; one call fewer over this rank's queries).
      fuse_backward: the backward's first kernel call covers the chunk saved from the forward's
        last step AND the own chunk (both already here; one call fewer, one hop fewer).
      Fusing needs the index of two chunks at once: it applies to the dense ring and to index
      sources with ``steps`` (``RankStepIndex``), not to a ``[P]``-stacked ``StepIndex``; the
      query-side backward has no fused call (its chunks are other ranks' queries).
      backward_ring: which side circulates in the backward (:data:`.sides.BACKWARD_RINGS`):
        ``"kv"`` (K/V + dK/dV travel), ``"query"`` (Q, dO, lse, delta + dQ travel; BurstEngine) or
        ``"auto"`` (the side with fewer bytes per hop, :func:`.sides.resolve_backward_ring`).
    """

    num_nodes: int
    num_local: int
    ring_order: str = "hierarchical"
    sm_scale: float | None = None
    impl: str = "auto"
    block_size: int = DEFAULT_BLOCK
    fuse_forward: bool = True
    fuse_backward: bool = True
    backward_ring: str = "auto"

    def __post_init__(self):
        for name in ("num_nodes", "num_local", "block_size"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < 1:
                raise ValueError(f"{name} must be a positive integer, got {val!r}")
        for name in ("fuse_forward", "fuse_backward"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        validate_ring_order(self.ring_order)
        validate_impl(self.impl)
        validate_backward_ring(self.backward_ring)

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

def _shift(x, axis, size: int, direction: int = 1):
    """Send ``x`` one position along the ring on ``axis`` (rank ``a`` -> ``a + direction mod size``)."""
    if size == 1:
        return x
    return lax.ppermute(x, axis, perm=[(a, (a + direction) % size) for a in range(size)])


def _my_rank(cfg: RingConfig):
    return lax.axis_index(NODE_AXIS) * cfg.num_local + lax.axis_index(LOCAL_AXIS)


def _gather_positions(k_pos, cfg: RingConfig):
    """``int32 [P, Sl]``: every rank's key positions (node-major), from one all-gather."""
    if cfg.num_ranks == 1:
        return k_pos[None]
    return lax.all_gather(k_pos, CP_AXES, axis=0, tiled=False)


# ----------------------------------------------------------------------------- one kernel call

def _can_fuse(step_index) -> bool:
    """Fused steps need the index of several chunks at once: dense (``None``) or an index source
    with ``steps`` (a ``[P]``-stacked ``StepIndex`` holds one chunk per entry)."""
    return step_index is None or callable(getattr(step_index, "steps", None))


def _group_index(step_index, steps: tuple[int, ...]):
    """The :class:`StepIndex` of one kernel call over the chunks of ring ``steps`` (concatenated in
    that order): a slice of a ``[P]``-stacked index, or converted on demand by an index source
    (``step_index.steps(steps)``, e.g. ``sparsity.convert.RankStepIndex``)."""
    if step_index is None:
        return None
    if isinstance(step_index, StepIndex):
        (s,) = steps
        return jax.tree.map(lambda a: a[s], step_index)
    return step_index.steps(steps)


def _group_positions(kpos_all, rank, steps: tuple[int, ...], cfg: RingConfig):
    """``int32 [..., len(steps) * Sl]``: key positions ``kpos_all [P, ..., Sl]`` (or segment ids) of
    the chunks held at ``steps``, concatenated."""
    pos = [lax.dynamic_index_in_dim(kpos_all, source_rank(rank, s, cfg.num_nodes, cfg.num_local, cfg.ring_order),
                                    axis=0, keepdims=False) for s in steps]
    return pos[0] if len(pos) == 1 else jnp.concatenate(pos, axis=-1)


def _group_segments(segs, rank, steps: tuple[int, ...], cfg: RingConfig) -> dict:
    """Keyword arguments ``q_seg, k_seg`` of the kernel call over the chunks of ``steps`` (``{}``
    without packed documents); ``segs = (q_seg [B, Sl], kseg_all [P, B, Sl])``."""
    if segs is None:
        return {}
    return {"q_seg": segs[0], "k_seg": _group_positions(segs[1], rank, steps, cfg)}


def _narrow(index_g, seg_kw: dict, block_size: int):
    """The grouped index without the tiles that lie across a document boundary (so the work
    statistics count what the kernels run); unchanged without packed documents."""
    if index_g is None or not seg_kw:
        return index_g
    return apply_segments(index_g, seg_kw["q_seg"], seg_kw["k_seg"], block_size)


def _group_kv(chunks):
    """Stacked ``[2, B, Sl, Hkv, D]`` chunks -> one ``[2, B, len * Sl, Hkv, D]`` K/V buffer."""
    return chunks[0] if len(chunks) == 1 else jnp.concatenate(chunks, axis=2)


# ----------------------------------------------------------------------------- forward / backward

def _forward(cfg: RingConfig, q, kv_own, q_pos, kpos_all, step_index, segs=None):
    """The forward ring. ``kv_own [2, B, Sl, Hkv, D]`` is this rank's K/V, stacked.

    Returns ``(out f32 [B,Sl,Hq,D], lse f32 [B,Hq,Sl], work f32 [P], kv_last)``: ``work[s]`` the
    kernel slots of step ``s`` (``index_format.step_work``; 0 when dense) and ``kv_last`` the chunk
    held at the last step, where the backward ring starts."""
    outer_axis, n_outer = cfg.outer
    inner_axis, n_inner = cfg.inner
    P = cfg.num_ranks
    fuse = cfg.fuse_forward and P > 1 and _can_fuse(step_index)
    rank = _my_rank(cfg)
    kv = kv_last = kv_own
    out = lse = None
    work = []
    held = []  # chunks whose kernel call waits to be fused with the next step's
    for i in range(n_outer):
        kv_outer = _shift(kv, outer_axis, n_outer) if i < n_outer - 1 else None
        for j in range(n_inner):
            kv_next = _shift(kv, inner_axis, n_inner) if j < n_inner - 1 else None
            s = i * n_inner + j
            if s == P - 1:
                kv_last = kv
            held.append((s, kv))
            if not (fuse and s == 0):
                steps = tuple(t for t, _ in held)
                kvs = _group_kv([c for _, c in held])
                held = []
                seg_kw = _group_segments(segs, rank, steps, cfg)
                index_g = _narrow(_group_index(step_index, steps), seg_kw, cfg.block_size)
                sk = kvs.shape[2]
                work.extend([jnp.float32(0)] * len(steps) if index_g is None else
                            list(chunk_work(index_g, sk, len(steps), cfg.block_size)))
                out, lse = block_sparse_attention_fwd(
                    q, kvs[0], kvs[1], q_pos, _group_positions(kpos_all, rank, steps, cfg), index_g,
                    sm_scale=cfg.sm_scale, block_size=cfg.block_size, impl=cfg.impl,
                    acc=None if out is None else (out, lse), **seg_kw)
            kv = kv_next
        kv = kv_outer
    return out, lse, jnp.stack(work), kv_last


def _backward(cfg: RingConfig, q, kv_own, kv_last, q_pos, kpos_all, step_index, out, out_lo, lse, do, segs=None):
    """The backward ring (see module docstring): the forward's steps in reverse order, starting
    from ``kv_last``; ``out + out_lo`` is the forward's float32 output (``split_output``); returns
    float32 ``(dq, dk, dv)``."""
    outer_axis, n_outer = cfg.outer
    inner_axis, n_inner = cfg.inner
    P = cfg.num_ranks
    sl = kv_own.shape[2]
    fuse = cfg.fuse_backward and P > 1 and _can_fuse(step_index)
    rank = _my_rank(cfg)
    delta = attention_delta(out, do, out_lo)

    def attend(steps, kvs, dq, dkv_acc):
        seg_kw = _group_segments(segs, rank, steps, cfg)
        return block_sparse_attention_bwd(
            q, kvs[0], kvs[1], q_pos, _group_positions(kpos_all, rank, steps, cfg), _group_index(step_index, steps),
            do, lse, delta, sm_scale=cfg.sm_scale, block_size=cfg.block_size, impl=cfg.impl,
            dq_acc=dq, dkv_acc=dkv_acc, **seg_kw)

    def moved(x, axis, size, dest_step):
        # the chunk of step 0 is this rank's own: it never travels home, it is already here
        return kv_own if dest_step == 0 else _shift(x, axis, size, -1)

    kv, dq, own, tot = kv_last, None, None, None
    for i in reversed(range(n_outer)):
        # chunk of step (i-1, n_inner-1) = the one held now, one node back (posted first: overlaps the inner loop)
        kv_outer = moved(kv, outer_axis, n_outer, i * n_inner - 1) if i > 0 else None
        acc = None  # f32 dK/dV of the chunk held now, summed over the ranks of this node that saw it
        for j in reversed(range(n_inner)):
            s = i * n_inner + j
            if fuse and s == 0:
                break  # computed with step P-1 in the first kernel call
            kv_next = moved(kv, inner_axis, n_inner, s - 1) if j > 0 else None
            if fuse and s == P - 1:
                dq, dk_g, dv_g = attend((0, s), _group_kv([kv_own, kv]), dq, None)
                own = (dk_g[:, :sl], dv_g[:, :sl])
                acc = (dk_g[:, sl:], dv_g[:, sl:])
            else:
                dq, dk_s, dv_s = attend((s,), kv, dq, acc)
                acc = (dk_s, dv_s)
            if j > 0:
                acc = tuple(_shift(jnp.stack(acc), inner_axis, n_inner, -1))  # travels with its chunk
                kv = kv_next
        if i > 0:
            # acc: this node's sum for the chunk held at step (i, 0); tot: the nodes before us
            tot = acc if tot is None else jax.tree.map(jnp.add, tot, acc)
            tot = tuple(_shift(jnp.stack(tot), outer_axis, n_outer, -1))
            kv = kv_outer
    # here every contribution to this rank's own chunk has arrived (own: fused first call)
    parts = [p for p in (own, acc, tot) if p is not None]
    dk, dv = functools.reduce(lambda a, b: jax.tree.map(jnp.add, a, b), parts)
    return dq, dk, dv


# ----------------------------------------------------------------------------- query-side backward

def _query_rank(rank, step: int, cfg: RingConfig):
    """Rank whose QUERIES kv owner ``rank`` holds at backward ``step`` of the query-side ring: the
    ``t`` with ``source_rank(t, step) == rank`` (flat: ``rank + step``; hierarchical: ``(n + i,
    l + j)``)."""
    P, L = cfg.num_ranks, cfg.num_local
    if cfg.ring_order == "flat":
        return (rank + step) % P
    i, j = step // L, step % L
    n, l = rank // L, rank % L
    return ((n + i) % cfg.num_nodes) * L + (l + j) % L


def _first_visit(rank: int, cfg: RingConfig) -> int:
    """Rank that holds ``rank``'s queries at the query-side ring's first non-own step ``P - 1``
    (node and local position one place on: ``(n + 1, l + 1)``; flat: ``rank + 1``)."""
    P, L = cfg.num_ranks, cfg.num_local
    if cfg.ring_order == "flat":
        return (rank + 1) % P
    return ((rank // L + 1) % cfg.num_nodes) * L + (rank % L + 1) % L


def _uint(dtype):
    return {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[jnp.dtype(dtype).itemsize]


def _pack_queries(q, do, lse, delta):
    """Q, dO ``[B, Sl, Hq, D]`` and float32 ``lse``, ``delta`` ``[B, Hq, Sl]`` as ONE flat buffer of
    unsigned integers of q's itemsize (bit-exact through any permute: no float canonicalisation),
    so each hop of the query-side ring is one collective-permute."""
    u = _uint(q.dtype)
    stats = lax.bitcast_convert_type(jnp.stack([lse, delta]).astype(jnp.float32), u)
    parts = [lax.bitcast_convert_type(q, u), lax.bitcast_convert_type(do.astype(q.dtype), u), stats]
    return jnp.concatenate([x.reshape(-1) for x in parts])


def _unpack_queries(buf, q_shape, dtype):
    """Inverse of :func:`_pack_queries`: ``(q, do, lse, delta)``."""
    n = int(np.prod(q_shape))
    B, Sl, Hq, _ = q_shape
    q = lax.bitcast_convert_type(buf[:n].reshape(q_shape), dtype)
    do = lax.bitcast_convert_type(buf[n:2 * n].reshape(q_shape), dtype)
    ratio = 4 // jnp.dtype(dtype).itemsize
    stats = buf[2 * n:].reshape((2, B, Hq, Sl) + ((ratio,) if ratio > 1 else ()))
    stats = lax.bitcast_convert_type(stats, jnp.float32)
    return q, do, stats[0], stats[1]


def _backward_query(cfg: RingConfig, q, kv_own, qpos_all, kpos_all, step_index, out, out_lo, lse, do, segs=None):
    """The query-side backward ring (BurstEngine, paper 004 §3): K, V and the float32 dK/dV
    accumulators stay at their owner; Q, dO, lse and delta (one packed buffer) and the float32 dQ
    accumulator of the queries being visited travel. At backward step ``s`` kv owner ``r`` holds the
    queries of ``_query_rank(r, s)``, i.e. exactly the (query rank, K/V chunk) pairs of the forward's
    step ``s``, so the step's index is the visiting rank's (``step_index.for_rank(t).step(s)``:
    every rank holds the identical global index).

    Order: the own step ``(0, 0)`` first (its dQ stays home; the first bundle's hop overlaps it), then
    the forward's other steps in reverse, as the K/V-side ring, with the roles of queries and K/V
    swapped and everything moving ``+1`` along its ring::

        own step:              bundle <-- diagonal hop from (n-1, l-1)   (overlaps the own step)
        reverse outer step i:  bundle --inner +1--> ... ; acc (dQ) --inner +1--> ... acc ─┐
                               bundle at step (i, L-1) --outer +1--> step (i-1, L-1)       │
                                                          tot_in ───────────────────────┴─(+)─ tot ──outer +1──>
        end:                   dQ = own + acc (rest of this node, arrived after step (0, 1)) + tot

    Per backward: ``P - 1`` bundle hops (one diagonal, the rest inner / outer) and ``P - 1`` dQ hops
    (``N (L - 1)`` inner, ``N - 1`` outer); nothing is sent home. Returns float32 ``(dq, dk, dv)``.
    """
    outer_axis, n_outer = cfg.outer
    inner_axis, n_inner = cfg.inner
    P = cfg.num_ranks
    rank = _my_rank(cfg)
    delta = attention_delta(out, do, out_lo)
    k, v = kv_own[0], kv_own[1]
    k_pos = lax.dynamic_index_in_dim(kpos_all, rank, axis=0, keepdims=False)

    def attend(s, parts, dq_acc, dkv_acc):
        qq, dd, ll, de = parts
        t = _query_rank(rank, s, cfg)
        index = None if step_index is None else step_index.for_rank(t).step(s)
        seg_kw = {} if segs is None else {
            "q_seg": lax.dynamic_index_in_dim(segs[1], t, axis=0, keepdims=False), "k_seg": segs[0]}
        return block_sparse_attention_bwd(
            qq, k, v, lax.dynamic_index_in_dim(qpos_all, t, axis=0, keepdims=False), k_pos, index, dd, ll, de,
            sm_scale=cfg.sm_scale, block_size=cfg.block_size, impl=cfg.impl, dq_acc=dq_acc, dkv_acc=dkv_acc,
            **seg_kw)

    def unpack(buf):
        return _unpack_queries(buf, q.shape, q.dtype)

    bundle = None
    if P > 1:  # posted before the own step, which it overlaps
        bundle = lax.ppermute(_pack_queries(q, do, lse, delta), CP_AXES,
                              perm=[(r, _first_visit(r, cfg)) for r in range(P)])
    dq_own, dk, dv = attend(0, (q, do, lse, delta), None, None)
    dkv = (dk, dv)
    acc = tot = None
    for i in reversed(range(n_outer)):
        # the bundle of step (i-1, n_inner-1) is the one held now (step (i, n_inner-1)), one node on
        bundle_outer = None
        if i > 0 and (i - 1) * n_inner + n_inner - 1 != 0:
            bundle_outer = _shift(bundle, outer_axis, n_outer, +1)
        acc = None  # f32 dQ of the queries held now, summed over the ranks of this node that saw them
        for j in reversed(range(n_inner)):
            s = i * n_inner + j
            if s == 0:
                break  # the own step, done first
            bundle_next = _shift(bundle, inner_axis, n_inner, +1) if j > 0 and s - 1 != 0 else None
            acc, dk, dv = attend(s, unpack(bundle), acc, dkv)
            dkv = (dk, dv)
            if j > 0:
                acc = _shift(acc, inner_axis, n_inner, +1)  # travels with its queries (home after step (0, 1))
                bundle = bundle_next
        if i > 0:
            # acc: this node's sum for the queries held at step (i, 0); tot: the nodes before us
            tot = acc if tot is None else tot + acc
            tot = _shift(tot, outer_axis, n_outer, +1)
            bundle = bundle_outer
    dq = functools.reduce(jnp.add, [p for p in (dq_own, acc, tot) if p is not None])
    return dq, dkv[0], dkv[1]


# ----------------------------------------------------------------------------- custom VJP

def _gather_segments(seg, cfg: RingConfig):
    """``None`` or ``(q_seg [B, Sl], kseg_all [P, B, Sl])`` from this rank's ``seg [B, Sl]``."""
    return None if seg is None else (seg, _gather_positions(seg, cfg))


def _side(cfg: RingConfig, q, k) -> str:
    """The backward ring's side, ``"auto"`` resolved from the shapes (:mod:`.sides`)."""
    return resolve_backward_ring(cfg.backward_ring, heads=q.shape[2], kv_heads=k.shape[2], head_dim=q.shape[3],
                                 itemsize=jnp.dtype(q.dtype).itemsize)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(cfg: RingConfig, q, k, v, q_pos, k_pos, step_index, seg=None):
    """``(out [B, Sl, Hq, D] in q's dtype, work f32 [P])``; ``work`` is not differentiated."""
    out, _, work, _ = _forward(cfg, q, jnp.stack([k, v]), q_pos, _gather_positions(k_pos, cfg), step_index,
                               _gather_segments(seg, cfg))
    return out.astype(q.dtype), work


def _ring_fwd(cfg: RingConfig, q, k, v, q_pos, k_pos, step_index, seg=None):
    kpos_all = _gather_positions(k_pos, cfg)
    kv_own = jnp.stack([k, v])  # one permute per hop (see module docstring)
    segs = _gather_segments(seg, cfg)
    out, lse, work, kv_last = _forward(cfg, q, kv_own, q_pos, kpos_all, step_index, segs)
    # O is returned in q's dtype; its rounding error is kept beside it (split_output) so that
    # delta = rowsum(dO * O) is formed from the float32 O (bf16 gradients at the bf16 floor).
    # An on-demand index source (RankStepIndex) is saved as its compact global index only.
    out, out_lo = split_output(out, q.dtype)
    if _side(cfg, q, k) == "query":
        # the visiting queries' positions instead of the chunk saved from the forward's last step
        kv_last, q_pos = None, _gather_positions(q_pos, cfg)
    return (out, work), (q, kv_own, kv_last, q_pos, kpos_all, step_index, out, out_lo, lse, segs)


def _ring_bwd(cfg: RingConfig, res, cotangents):
    do = cotangents[0]  # work carries no gradient
    q, kv_own, kv_last, q_pos, kpos_all, step_index, out, out_lo, lse, segs = res
    if _side(cfg, q, kv_own[0]) == "query":
        dq, dk, dv = _backward_query(cfg, q, kv_own, q_pos, kpos_all, step_index, out, out_lo, lse, do, segs)
    else:
        dq, dk, dv = _backward(cfg, q, kv_own, kv_last, q_pos, kpos_all, step_index, out, out_lo, lse, do, segs)
    # positions, segment ids and the sparse index are integer data: zero cotangents (None).
    return dq.astype(q.dtype), dk.astype(kv_own.dtype), dv.astype(kv_own.dtype), None, None, None, None


_ring.defvjp(_ring_fwd, _ring_bwd)


# ----------------------------------------------------------------------------- validation

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
                         sm_scale=None, impl="auto", block_size: int | None = None, return_work: bool = False,
                         fuse_forward: bool = True, fuse_backward: bool = True, segment_ids=None,
                         backward_ring: str = "auto"):
    """Per-rank ring attention body, to be called INSIDE ``shard_map`` over ``("node", "local")``.

    Args:
      q: ``[B, Sl, Hq, D]`` this rank's queries (layout order).
      k, v: ``[B, Sl, Hkv, D]`` this rank's keys/values, ``Hq % Hkv == 0``.
      q_pos, k_pos: ``int32 [Sl]`` this rank's global token positions (for the causal mask).
      num_nodes, num_local: sizes of the ``node`` and ``local`` mesh axes.
      ring_order: ``"flat"`` or ``"hierarchical"``.
      step_index: ``None`` (dense causal), a :class:`pallas_kernels.StepIndex` whose arrays have a
        leading ``[P]`` ring-step axis, or an index source converting on demand
        (``step(s) -> StepIndex``, ``steps((s, t)) -> StepIndex`` over those chunks concatenated,
        ``num_steps == P``: :class:`mtraining_jax.sparsity.RankStepIndex`,
        which keeps one step's index alive at a time and only the compact index for the backward).
        Entry ``s`` describes this rank's queries against the chunk it holds at step ``s`` (source
        ``schedule.source_rank(rank, s, ...)``), with blocks of ``block_size`` tokens. Never
        differentiated.
      sm_scale: softmax scale (default ``D ** -0.5``).
      impl: a kernel impl of :data:`pallas_kernels.registry.IMPLS` for the per-step kernels.
      block_size: kernel block size (the ``StepIndex`` block size when one is given). ``None``:
        ``DEFAULT_BLOCK`` (64) with an index; for the dense ring the largest power of two
        ``<= DEFAULT_BLOCK`` dividing ``Sl``.

      return_work: also return ``work f32 [P]``, the kernel slots each ring step attended
        (``index_format.step_work``; zeros for the dense ring), for load statistics.
      fuse_forward, fuse_backward: one kernel call for the first two chunks of the forward / of
        the backward (:class:`RingConfig`).
      segment_ids: ``int32 [B, Sl]`` this rank's segment ids (packed documents: a query attends
        only keys of its own segment; they travel by one all-gather like ``k_pos``), or ``None``.
      backward_ring: ``"auto"`` / ``"kv"`` / ``"query"`` (:mod:`mtraining_jax.ring.sides`): which side
        circulates in the backward. The query side needs every rank's index (an index source with
        ``for_rank``, or none); ``"auto"`` with a ``[P]``-stacked ``StepIndex`` is the K/V side.

    Returns:
      ``out [B, Sl, Hq, D]`` in ``q.dtype`` (and ``work``). Differentiable in ``q, k, v`` (custom
      VJP ring).
    """
    check_qkv(q, k, v)
    sl = q.shape[1]
    if block_size is None:
        block_size = DEFAULT_BLOCK if step_index is not None else _dense_block(sl)
    validate_backward_ring(backward_ring)
    query_ok = step_index is None or callable(getattr(step_index, "for_rank", None))
    if backward_ring == "query" and not query_ok:
        raise ValueError(f"backward_ring='query' needs the index of every rank's queries (an index source with "
                         f"for_rank, e.g. RankStepIndex); got {type(step_index).__name__}")
    side = resolve_backward_ring(backward_ring, heads=q.shape[2], kv_heads=k.shape[2], head_dim=q.shape[3],
                                 itemsize=jnp.dtype(q.dtype).itemsize, query_ok=query_ok)
    cfg = RingConfig(num_nodes, num_local, ring_order, sm_scale, impl, block_size, fuse_forward, fuse_backward, side)
    if tuple(q_pos.shape) != (sl,) or tuple(k_pos.shape) != (sl,):
        raise ValueError(f"q_pos {tuple(q_pos.shape)} and k_pos {tuple(k_pos.shape)} must both be [Sl] = [{sl}]")
    _check_step_index(step_index, cfg.num_ranks)
    _check_axis_sizes(cfg)
    q_pos = jnp.asarray(q_pos, jnp.int32)
    k_pos = jnp.asarray(k_pos, jnp.int32)
    if segment_ids is not None:
        if tuple(segment_ids.shape) != tuple(q.shape[:2]):
            raise ValueError(f"segment_ids has shape {tuple(segment_ids.shape)}, expected [B, Sl] = {list(q.shape[:2])}")
        segment_ids = jnp.asarray(segment_ids, jnp.int32)
    out, work = _ring(cfg, q, k, v, q_pos, k_pos, step_index, segment_ids)
    return (out, work) if return_work else out


def ring_attention(q, k, v, positions, mesh, *, ring_order="hierarchical", sm_scale=None, impl="auto",
                   fuse_forward: bool = True, fuse_backward: bool = True, segment_ids=None,
                   backward_ring: str = "auto"):
    """Causal GQA ring attention over a ``(node, local)`` mesh on data already in a layout.

    Args:
      q: ``[B, S, Hq, D]``; k, v: ``[B, S, Hkv, D]``, global arrays in LAYOUT order: laid token
        ``i`` has global position ``positions[i]``.
      positions: ``int32 [S]`` (``Layout.perm``).
      mesh: a mesh with axes ``("node", "local")`` (and optionally ``"data"``, which shards batch).
      ring_order: ``"hierarchical"`` (default) or ``"flat"``.
      sm_scale: softmax scale (default ``D ** -0.5``).
      impl: per-step kernel impl (:data:`pallas_kernels.registry.IMPLS`).
      fuse_forward, fuse_backward: see :class:`RingConfig`.
      segment_ids: ``int [B, S]`` document of each laid token (packed documents), or ``None``.
      backward_ring: ``"auto"`` (default), ``"kv"`` or ``"query"``: see :class:`RingConfig`.

    Returns:
      ``out [B, S, Hq, D]`` in ``q.dtype``, layout order, sequence sharded over ``("node",
      "local")`` node-major. Works under ``jax.jit``; differentiable (custom VJP ring inside).
    """
    num_nodes, num_local = check_cp_mesh(mesh)
    validate_ring_order(ring_order)
    validate_impl(impl)
    validate_backward_ring(backward_ring)
    check_qkv(q, k, v)
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
    seg_spec = PartitionSpec(batch_axis, CP_AXES)
    if segment_ids is not None:
        segment_ids = jnp.asarray(segment_ids)
        if segment_ids.shape != (B, S) or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise ValueError(f"segment_ids must be integers of shape [B, S] = [{B}, {S}], got "
                             f"{segment_ids.dtype}{list(segment_ids.shape)}")

    def body(q_l, k_l, v_l, pos_l, seg_l):
        return ring_attention_shard(q_l, k_l, v_l, pos_l, pos_l, num_nodes=num_nodes, num_local=num_local,
                                    ring_order=ring_order, sm_scale=sm_scale, impl=impl,
                                    fuse_forward=fuse_forward, fuse_backward=fuse_backward, segment_ids=seg_l,
                                    backward_ring=backward_ring)

    # check_vma=False: the per-step kernels (Pallas calls, scans with fresh zero carries) are not
    # annotated for varying-manual-axes typing; the ring itself is checked by tests, not by types.
    fn = jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec, pos_spec, seg_spec), out_specs=spec,
                       check_vma=False)
    return fn(q, k, v, positions.astype(jnp.int32),
              None if segment_ids is None else segment_ids.astype(jnp.int32))
