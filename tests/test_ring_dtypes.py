"""Which ring kernel calls ask for q's dtype: the forward's last call when nothing reads its output back
in float32 (the ring traced without gradients, dense and sparse-exchange rings), the backward's call after
which nothing is added to dQ; every other call float32. Counted by spying on the kernel entry point each
ring module imported; the outputs / gradients are the dense reference's (``test_ring.py``'s helpers)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtraining_jax.layouts import Layout
from mtraining_jax.ring.attention import ring_attention
from mtraining_jax.ring.schedule import source_rank
from test_ring import (STRIPE, TOL, _check_against_reference, _inputs, _mesh, _random_step_index, _reference, _rel,
                       _ring_vg, _sparse_ring, _sparse_ring_vg)


def _dtype_calls(monkeypatch, modules, fn_name: str, kwarg: str) -> list:
    """The calls of ``fn_name`` (as each of ``modules`` imported it), in trace order: ``"b"`` for one whose
    ``kwarg`` asks for bfloat16, ``"f"`` for float32 (its default)."""
    calls = []
    for mod in modules:
        def call(*a, real=getattr(mod, fn_name), **kw):
            calls.append("b" if jnp.dtype(kw.get(kwarg, jnp.float32)) == jnp.bfloat16 else "f")
            return real(*a, **kw)
        monkeypatch.setattr(mod, fn_name, call)
    return calls


@pytest.mark.parametrize("mesh_shape, order, fuse, side, expect", [
    ((1, 1), "flat", True, "kv", "b"),  # one rank: the own step's dQ is final
    ((2, 2), "hierarchical", False, "kv", "fffb"),  # every step a call, the last (own chunk) writes bf16
    ((2, 2), "hierarchical", True, "kv", "ffb"),  # steps 0 and P-1 in the first call: the last call is step 1
    ((1, 2), "flat", True, "kv", "b"),  # the fused call is the only call
    ((1, 1), "flat", True, "query", "b"),
    ((1, 4), "flat", True, "query", "ffff"),  # dQ summed from travelling accumulators: float32 until the end
])
def test_only_the_last_backward_call_writes_dq_in_q_dtype(monkeypatch, mesh_shape, order, fuse, side, expect):
    """The backward's kernel calls in trace order: the call after which nothing is added to dQ asks for
    q's dtype (the Mosaic dQ kernel then writes no float32 dQ buffer), every earlier one for float32;
    the gradients stay those of the dense reference (bfloat16)."""
    from mtraining_jax.ring import backward, exchange_ring

    calls = _dtype_calls(monkeypatch, (backward, exchange_ring), "block_sparse_attention_bwd", "dq_dtype")
    dt, S = jnp.bfloat16, 128
    q, k, v, cot = _inputs(3, 1, S, 4, 2, 32, dt)
    ref_out, ref_grads = _reference(q, k, v, cot)
    fn = _ring_vg.__wrapped__(mesh_shape, order, (fuse, fuse), "xla", side)  # a fresh trace
    lay = Layout("zigzag", S, mesh_shape[0] * mesh_shape[1], stripe=STRIPE)
    (_, out), grads = fn(*[jnp.asarray(lay.permute(x), dt) for x in (q, k, v)], jnp.asarray(lay.perm),
                         jnp.asarray(lay.permute(cot), jnp.float32))
    assert "".join(calls) == expect
    _check_against_reference(out, grads, lay, ref_out, ref_grads, dt, TOL["bfloat16"], f"{mesh_shape} {side}")

@pytest.mark.parametrize("mesh_shape, order, fuse, expect", [
    ((1, 1), "flat", True, "b"),  # one rank: the own step is the only call
    ((2, 2), "hierarchical", False, "fffb"),  # every step a call, the last rounds to bf16
    ((2, 2), "hierarchical", True, "ffb"),  # steps 0 and 1 fused in the first call
])
def test_only_the_last_forward_call_of_a_forward_alone_writes_out_in_q_dtype(monkeypatch, mesh_shape, order, fuse,
                                                                              expect):
    """The forward ring's kernel calls in trace order: traced alone (no backward reads ``out``), the last
    call asks for q's dtype (the kernels round in their epilogue, no float32 output written), every
    earlier one for float32 (merged into); traced for gradients every call is float32 (the residual's
    float32 output). The output is the dense reference's, and the same both ways."""
    from mtraining_jax.ring import attention

    calls = _dtype_calls(monkeypatch, (attention,), "block_sparse_attention_fwd", "out_dtype")
    dt, S = jnp.bfloat16, 128
    q, k, v, cot = _inputs(4, 1, S, 4, 2, 32, dt)
    ref_out, _ = _reference(q, k, v, cot)
    mesh = _mesh(mesh_shape)
    lay = Layout("zigzag", S, mesh_shape[0] * mesh_shape[1], stripe=STRIPE)
    args = [jnp.asarray(lay.permute(x), dt) for x in (q, k, v)] + [jnp.asarray(lay.perm)]
    fwd = jax.jit(lambda q, k, v, p: ring_attention(q, k, v, p, mesh, ring_order=order, fuse_forward=fuse,
                                                    impl="xla"))
    out = fwd(*args)
    assert "".join(calls) == expect
    calls.clear()
    (_, out_vg), _ = _ring_vg.__wrapped__(mesh_shape, order, (fuse, fuse), "xla")(
        *args, jnp.asarray(lay.permute(cot), jnp.float32))
    assert "".join(calls) == "f" * len(expect)
    chex.assert_type(out, dt)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out_vg))
    assert _rel(lay.unpermute(np.asarray(out, np.float64)), ref_out) <= TOL["bfloat16"]


def test_the_sparse_exchange_forward_alone_writes_out_in_q_dtype_in_its_last_call(monkeypatch):
    """The sparse exchange's forward (the own chunk, then each step's compact or whole chunk under a
    guard): traced alone, only the last step's calls (both guard branches) ask for q's dtype; traced for
    gradients none does; the outputs are the same."""
    from mtraining_jax.ring import exchange_ring

    calls = _dtype_calls(monkeypatch, (exchange_ring,), "block_sparse_attention_fwd", "out_dtype")
    mesh_shape, order, bs, dt = (1, 4), "flat", 16, jnp.bfloat16
    exchange = tuple(sorted(dict(kv_exchange="sparse", exchange_capacity=0.5).items()))
    P, B, S, Hq, Hkv, D = 4, 1, 512, 2, 1, 32
    lay = Layout("zigzag", S, P, stripe=STRIPE)
    src = np.asarray(source_rank(np.arange(P)[:, None], np.arange(P)[None, :], 1, P, order))
    index = _random_step_index(np.random.default_rng(7), P, B, Hq, S // P, bs, lay.positions, lay.positions[src],
                               max_cols=3, empty_rows=True, pool=1)
    q, k, v, cot = _inputs(7, B, S, Hq, Hkv, D, jnp.float32)
    args = [jnp.asarray(lay.permute(x), dt) for x in (q, k, v)] + [jnp.asarray(lay.perm), index]
    out = jax.jit(_sparse_ring(mesh_shape, order, bs, "xla", exchange))(*args)
    # own chunk, then steps 1..3 each traced in both guard branches (compact, whole)
    assert "".join(calls) == "f" + "ff" * (P - 2) + "bb"
    calls.clear()
    (_, out_vg), _ = _sparse_ring_vg.__wrapped__(mesh_shape, order, bs, "xla", exchange)(
        *args, jnp.asarray(lay.permute(cot), jnp.float32))
    assert set(calls) == {"f"}
    chex.assert_type(out, dt)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out_vg))
