"""The ring's communication accounting (benchmarks/ring_comm.py, derived from ring.schedule) against
the collective-permutes in the compiled HLO of a forward + backward ring on 8 virtual devices."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from benchmarks import hlo, ring_comm
from mtraining_jax.ring import exchange
from mtraining_jax.ring.attention import StackedStepIndex, ring_attention, ring_attention_shard
from mtraining_jax.mesh import CP_AXES, make_mesh
from pallas_kernels.index_format import StepIndex


@pytest.mark.parametrize("mesh_shape, order, inner, outer", [
    ((1, 1), "hierarchical", 0, 0),
    ((1, 2), "flat", 1 + 2, 0),  # on 2 ranks the backward moves one float32 dK/dV and nothing else
    ((2, 1), "hierarchical", 0, 1 + 2),
    ((1, 8), "flat", 7 + 6 + 7 * 2, 0),  # P-1 K/V forward, P-2 backward, P-1 dK/dV (2 units each)
    ((2, 4), "flat", 7 + 6 + 7 * 2, 0),  # flat: one ring over all ranks
    ((2, 4), "hierarchical", 6 + 5 + 6 * 2, 1 + 1 + 1 * 2),
    ((3, 1), "hierarchical", 0, 2 + 1 + 2 * 2),  # the outer hop back to step 0 is skipped
])
def test_transfer_units(mesh_shape, order, inner, outer):
    assert ring_comm.transfer_units(*mesh_shape, order) == (inner, outer)


@pytest.mark.parametrize("mesh_shape, order, inner, outer", [
    ((1, 1), "hierarchical", 0, 0),
    ((1, 2), "flat", 1 + 1 + 1, 0),  # K/V forward, the visiting queries, their dQ home
    ((2, 4), "flat", 7 + 7 + 7, 0),
    # forward 6 inner + 1 outer; queries: 1 diagonal (crosses nodes) + 5 inner + 1 outer; dQ 6 inner + 1 outer
    ((2, 4), "hierarchical", 6 + 5 + 6, 1 + 2 + 1),
    ((3, 1), "hierarchical", 0, 2 + 2 + 2),
])
def test_query_side_hop_counts(mesh_shape, order, inner, outer):
    hops = ring_comm.ring_hops(*mesh_shape, order, "query")
    links = collections.Counter(ring_comm.hop_link(h, mesh_shape[0], order) for h in hops)
    assert (links["inner"], links["outer"]) == (inner, outer)
    P = mesh_shape[0] * mesh_shape[1]
    assert collections.Counter(h.what for h in hops if h.phase == "backward") == (
        {"q": P - 1, "dq": P - 1} if P > 1 else {})


def test_transfer_units_of_the_query_side():
    """1 x 2: one K/V hop forward (1 unit), one packed query buffer (Hq/Hkv = 8 times Q + dO + lse,
    delta: 8 (2 D 2 + 8) / (2 D 2)) and one float32 dQ (8 D 4 / (2 D 2) = 8) backward."""
    inner, outer = ring_comm.transfer_units(1, 2, "flat", backward_ring="query", heads_per_kv=8, head_dim=128)
    assert outer == 0 and inner == pytest.approx(1 + 8 * (2 * 128 * 2 + 8) / (2 * 128 * 2) + 8)
    assert ring_comm.transfer_units(1, 2, "flat", head_dim=128) == ring_comm.transfer_units(1, 2, "flat") == (3, 0)


def test_backward_bytes_choose_the_side():
    """The one byte count: GQA 16/2 bf16 head_dim 128 sends 3,072 vs 16,512 bytes per token and hop,
    so "auto" keeps the K/V side; multi-head attention turns it around."""
    from mtraining_jax.ring.sides import backward_hop_bytes, resolve_backward_ring
    shape = dict(batch=1, chunk_len=1, heads=16, kv_heads=2, head_dim=128, itemsize=2)
    assert sum(backward_hop_bytes("kv", **shape).values()) == 3072
    assert sum(backward_hop_bytes("query", **shape).values()) == 16512
    kw = dict(head_dim=128, itemsize=2)
    assert resolve_backward_ring("auto", heads=16, kv_heads=2, **kw) == "kv"
    assert resolve_backward_ring("auto", heads=16, kv_heads=16, **kw) == "query"
    assert resolve_backward_ring("auto", heads=16, kv_heads=16, query_ok=False, **kw) == "kv"
    assert resolve_backward_ring("query", heads=16, kv_heads=2, **kw) == "query"
    with pytest.raises(ValueError, match="'sideways'"):
        resolve_backward_ring("sideways", heads=16, kv_heads=2, **kw)


def test_bad_mesh_is_named():
    with pytest.raises(ValueError, match="num_local must be a positive integer, got 0"):
        ring_comm.ring_hops(2, 0, "flat")
    with pytest.raises(ValueError, match="'ring'"):
        ring_comm.ring_hops(2, 2, "ring")


@pytest.mark.parametrize("mesh_shape, order, fuse, side", [
    ((2, 4), "hierarchical", (True, True), "kv"),
    ((2, 2), "hierarchical", (False, False), "kv"),
    ((2, 2), "flat", (False, False), "kv"),
    ((2, 4), "hierarchical", (True, True), "query"),
    ((4, 2), "flat", (True, True), "query"),
    ((1, 2), "hierarchical", (True, True), "query"),
], ids=str)
def test_accounting_matches_the_compiled_ring(mesh_shape, order, fuse, side):
    """Every collective-permute of jit(grad(ring_attention)) is one predicted hop: same count, bytes
    per device and (source, target) devices. So XLA did not merge the backward's K/V permutes into
    the forward's (that would keep all P visiting chunks alive), and fusing kernel calls moves
    nothing more. float32 inputs: XLA:CPU sends bf16 K/V as float32, so only float32 makes the
    predicted bytes those of a GPU."""
    (N, L), P = mesh_shape, mesh_shape[0] * mesh_shape[1]
    mesh = make_mesh((N, L), jax.devices()[:N * L])
    B, Sl, Hq, Hkv, D = 1, 16, 2, 1, 32
    S = Sl * N * L
    q = jnp.zeros((B, S, Hq, D), jnp.float32)
    kv = jnp.zeros((B, S, Hkv, D), jnp.float32)

    def loss(q, k, v):
        return ring_attention(q, k, v, jnp.arange(S), mesh, ring_order=order, impl="xla", fuse_forward=fuse[0],
                              fuse_backward=fuse[1], backward_ring=side).sum()

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile().as_text()
    got = collections.Counter(hlo.permutes(text))
    shape = dict(batch=B, chunk_len=Sl, kv_heads=Hkv, heads=Hq, head_dim=D, itemsize=4)
    hops = ring_comm.ring_hops(N, L, order, side)
    want = collections.Counter(hlo.Permute(ring_comm.hop_bytes(h, **shape), ring_comm.hop_pairs(h, N, L, order))
                               for h in hops)
    # K/V forward, then K/V backward + dK/dV, or the visiting queries + their dQ
    n = (P - 1) + ((P - 2) + (P - 1) if side == "kv" else 2 * (P - 1))
    assert len(hops) == n and sum(got.values()) == n
    assert got == want
    assert hlo.op_counts(text)["collective-permute"] + hlo.op_counts(text)["collective-permute-start"] == n
    assert sum(p.nbytes for p in got.elements()) == sum(ring_comm.ring_bytes(N, L, order, side, **shape).values())


def test_one_rank_query_side_is_the_same_program():
    """P = 1: both backward sides are the own step alone: the compiled fwd + bwd has the same flops,
    bytes accessed and instructions (so the option costs nothing where there is no ring)."""
    mesh = make_mesh((1, 1), jax.devices()[:1])
    S = 256
    q, kv = jnp.zeros((1, S, 4, 32)), jnp.zeros((1, S, 2, 32))

    def program(side):
        f = lambda q, k, v: ring_attention(q, k, v, jnp.arange(S), mesh, impl="xla", backward_ring=side).sum()  # noqa: E731
        c = jax.jit(jax.grad(f, argnums=(0, 1, 2))).lower(q, kv, kv).compile()
        ca = c.cost_analysis()
        ca = ca[0] if isinstance(ca, list) else ca
        return ca["flops"], ca["bytes accessed"], hlo.op_counts(c.as_text())

    assert program("kv") == program("query")


def _exchange_index(P, Hq, sl, bs):
    """A ``[P_rank, P_step]`` StepIndex where every row attends KV block 0 of the visiting chunk
    and one column of block 1: each step needs ``bs + 1`` tokens (two blocks of capacity)."""
    nqb = nkb = sl // bs
    shape = (P, P, 1, Hq, nqb)
    bidx = np.zeros(shape + (nkb,), np.int32)
    cidx = np.full((P, P, 1, Hq, 1), bs + 1, np.int32)
    return StepIndex(jnp.asarray(bidx), jnp.ones(shape, jnp.int32), jnp.ones(shape + (nkb,), jnp.int32),
                     jnp.asarray(cidx), jnp.ones(shape, jnp.int32))


@pytest.mark.parametrize("mesh_shape, order, side", [
    ((2, 4), "hierarchical", "kv"),
    ((2, 2), "flat", "query"),
], ids=str)
def test_sparse_exchange_accounting_matches_the_compiled_ring(mesh_shape, order, side):
    """kv_exchange="sparse" with a concrete index: the capacity is exact (host-computed, no run-time
    guard), every collective-permute is one predicted direct hop (bytes of the capacity, pairs
    owner -> holder and back), their sum is the byte count "auto" chooses by
    (``ring.exchange.exchange_bytes``), and the result equals the ring's."""
    (N, L), P = mesh_shape, mesh_shape[0] * mesh_shape[1]
    mesh = make_mesh((N, L), jax.devices()[:P])
    B, Sl, Hq, Hkv, D, bs = 1, 64, 2, 1, 32, 16
    S = Sl * P
    index = _exchange_index(P, Hq, Sl, bs)
    spec, pspec = PartitionSpec(None, CP_AXES, None, None), PartitionSpec(CP_AXES)

    def loss(mode):
        def body(q, k, v, pos):
            idx = StackedStepIndex(index, jax.lax.axis_index(CP_AXES))  # closed over: concrete
            return ring_attention_shard(q, k, v, pos, pos, num_nodes=N, num_local=L, ring_order=order, step_index=idx,
                                        block_size=bs, impl="xla", backward_ring=side, kv_exchange=mode)

        ring = jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec, pspec), out_specs=spec, check_vma=False)
        return lambda q, k, v, c: jnp.sum(ring(q, k, v, jnp.arange(S)) * c)

    rng = np.random.default_rng(0)
    q, k, v, c = (jnp.asarray(rng.standard_normal(s), jnp.float32)
                  for s in ((B, S, Hq, D), (B, S, Hkv, D), (B, S, Hkv, D), (B, S, Hq, D)))
    fn = jax.jit(jax.value_and_grad(loss("sparse"), argnums=(0, 1, 2)))
    text = fn.lower(q, k, v, c).compile().as_text()
    got = collections.Counter(hlo.permutes(text))
    cap = 2 * bs
    shape = dict(batch=B, chunk_len=Sl, kv_heads=Hkv, heads=Hq, head_dim=D, itemsize=4)
    hops = ring_comm.exchange_hops(N, L, order, side)
    want = collections.Counter(
        hlo.Permute(ring_comm.hop_bytes(h, **dict(shape, chunk_len=cap if h.axis == "direct" else Sl)),
                    ring_comm.hop_pairs(h, N, L, order)) for h in hops)
    assert got == want
    ring_fn = jax.jit(jax.value_and_grad(loss("ring"), argnums=(0, 1, 2)))
    ring_text = ring_fn.lower(q, k, v, c).compile().as_text()
    # exact capacity: no run-time guard (the loss's sum is the one all-reduce of both programs)
    assert hlo.op_counts(text)["all-reduce"] == hlo.op_counts(ring_text)["all-reduce"]
    total = sum(ring_comm.exchange_link_bytes(N, L, order, side, capacity=cap, **shape).values())
    assert sum(p.nbytes for p in got.elements()) == total
    if side == "kv":
        assert ring_comm.exchange_link_bytes(N, L, order, side, capacity=cap, **shape) == exchange.exchange_bytes(
            P, batch=B, capacity=cap, kv_heads=Hkv, head_dim=D, itemsize=4, num_nodes=N, ring_order=order)
    (val, grads), (ref_val, ref_grads) = fn(q, k, v, c), ring_fn(q, k, v, c)
    np.testing.assert_allclose(val, ref_val, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)


def test_one_rank_sparse_exchange_is_the_same_program():
    """P = 1: nothing to exchange; kv_exchange="sparse" compiles to the ring's program (same flops,
    bytes accessed and instructions), so the option costs nothing on one GPU."""
    mesh = make_mesh((1, 1), jax.devices()[:1])
    S, bs = 128, 16
    index = _exchange_index(1, 2, S, bs)
    spec, pspec = PartitionSpec(None, CP_AXES, None, None), PartitionSpec(CP_AXES)
    q, kv = jnp.zeros((1, S, 2, 32)), jnp.zeros((1, S, 1, 32))

    def program(mode):
        def body(q, k, v, pos):
            idx = StackedStepIndex(index, jax.lax.axis_index(CP_AXES))
            return ring_attention_shard(q, k, v, pos, pos, num_nodes=1, num_local=1, ring_order="hierarchical",
                                        step_index=idx, block_size=bs, impl="xla", kv_exchange=mode)

        ring = jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec, pspec), out_specs=spec, check_vma=False)
        f = lambda q, k, v: ring(q, k, v, jnp.arange(S)).sum()  # noqa: E731
        c = jax.jit(jax.grad(f, argnums=(0, 1, 2))).lower(q, kv, kv).compile()
        ca = c.cost_analysis()
        ca = ca[0] if isinstance(ca, list) else ca
        return ca["flops"], ca["bytes accessed"], hlo.op_counts(c.as_text())

    assert program("sparse") == program("ring")
