"""The ring's communication accounting (benchmarks/ring_comm.py, derived from ring_schedule) against
the collective-permutes in the compiled HLO of a forward + backward ring on 8 virtual devices."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import pytest

from benchmarks import hlo, ring_comm
from mtraining_jax.attention.ring import ring_attention
from mtraining_jax.mesh import make_mesh


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


def test_bad_mesh_is_named():
    with pytest.raises(ValueError, match="num_local must be a positive integer, got 0"):
        ring_comm.ring_hops(2, 0, "flat")
    with pytest.raises(ValueError, match="'ring'"):
        ring_comm.ring_hops(2, 2, "ring")


def test_accounting_matches_the_compiled_ring():
    """Every collective-permute of jit(grad(ring_attention)) on a (2, 4) hierarchical mesh is one
    predicted hop: same count, bytes per device and (source, target) devices. float32 inputs: XLA:CPU
    sends bf16 K/V as float32, so only float32 makes the predicted bytes those of a GPU."""
    N, L, order = 2, 4, "hierarchical"
    mesh = make_mesh((N, L), jax.devices()[:N * L])
    B, Sl, Hq, Hkv, D = 1, 16, 2, 1, 32
    S = Sl * N * L
    q = jnp.zeros((B, S, Hq, D), jnp.float32)
    kv = jnp.zeros((B, S, Hkv, D), jnp.float32)

    def loss(q, k, v):
        return ring_attention(q, k, v, jnp.arange(S), mesh, ring_order=order, impl="xla").sum()

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile().as_text()
    got = collections.Counter(hlo.permutes(text))
    shape = dict(batch=B, chunk_len=Sl, kv_heads=Hkv, head_dim=D, itemsize=4)
    hops = ring_comm.ring_hops(N, L, order)
    want = collections.Counter(hlo.Permute(ring_comm.hop_bytes(h, **shape), ring_comm.hop_pairs(h, N, L, order))
                               for h in hops)
    assert len(hops) == 7 + 6 + 7 and sum(got.values()) == 20
    assert got == want
    assert hlo.op_counts(text)["collective-permute"] + hlo.op_counts(text)["collective-permute-start"] == 20
    assert sum(p.nbytes for p in got.elements()) == sum(ring_comm.ring_bytes(N, L, order, **shape).values())
