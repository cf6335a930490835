"""Ring attention (flat + hierarchical) against the dense float64 reference on the natural sequence.

Every check is forward output AND q/k/v gradients under a random non-uniform cotangent, measured as
``norm(x - ref) / norm(ref)``. The ring is jitted once per (mesh, order, dtype, shapes) with the
layout positions as a traced argument, so all four layouts reuse one compilation.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

from mtraining_jax.attention.reference import dense_attention
from mtraining_jax.attention.ring import RingConfig, ring_attention, ring_attention_shard
from mtraining_jax.layouts import LAYOUTS, Layout
from mtraining_jax.mesh import CP_AXES, make_mesh, sequence_sharding
from mtraining_jax.ring_schedule import RING_ORDERS, source_rank
from pallas_kernels.index_format import StepIndex, causal_flags, full_step_index, step_index_to_mask

MESHES = ((1, 1), (1, 8), (2, 4), (4, 2))
STRIPE = 16  # block_striped stripe for these small tests (the layout's default is 64)
TOL = {"float32": 1e-5, "bfloat16": 2e-2}


def _mesh(shape, data: int = 1) -> Mesh:
    n = shape[0] * shape[1] * data
    return make_mesh(shape, jax.devices()[:n], data=data)


def _rel(x, ref) -> float:
    x = np.asarray(x, np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def _inputs(seed, B, S, Hq, Hkv, D, dtype):
    """Natural-order q, k, v, cotangent, rounded to ``dtype`` (returned as float64 NumPy)."""
    rng = np.random.default_rng(seed)
    shapes = [(B, S, Hq, D), (B, S, Hkv, D), (B, S, Hkv, D), (B, S, Hq, D)]
    # non-uniform cotangent: random signs and magnitudes per element
    xs = [rng.standard_normal(s) * (1.0 + 2.0 * rng.random(s)) if i == 3 else rng.standard_normal(s)
          for i, s in enumerate(shapes)]
    return [np.asarray(jnp.asarray(x, dtype).astype(jnp.float64)) for x in xs]


def _ref_loss(q, k, v, cot, mask):
    out, _ = dense_attention(q, k, v, mask=mask)
    return jnp.sum(out * cot), out


_ref_vg = jax.jit(jax.value_and_grad(_ref_loss, argnums=(0, 1, 2), has_aux=True))


def _reference(q, k, v, cot, mask=None):
    (_, out), grads = _ref_vg(q, k, v, cot, mask)
    return np.asarray(out), [np.asarray(g) for g in grads]


@functools.lru_cache(maxsize=None)
def _ring_vg(mesh_shape, order, fuse=(True, True)):
    mesh = _mesh(mesh_shape)

    def loss(q, k, v, positions, cot):
        out = ring_attention(q, k, v, positions, mesh, ring_order=order, fuse_forward=fuse[0], fuse_backward=fuse[1])
        return jnp.sum(out.astype(jnp.float32) * cot), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def _check_against_reference(out, grads, layout, ref_out, ref_grads, dtype, tol, what):
    q_shape = ref_out.shape
    chex.assert_shape(out, q_shape)
    chex.assert_type(out, dtype)
    chex.assert_tree_all_finite((out, grads))
    errs = {"out": _rel(layout.unpermute(np.asarray(out, np.float64)), ref_out)}
    for name, g, rg in zip("qkv", grads, ref_grads):
        chex.assert_shape(g, rg.shape)
        chex.assert_type(g, dtype)
        errs["d" + name] = _rel(layout.unpermute(np.asarray(g, np.float64)), rg)
    bad = {k: e for k, e in errs.items() if not e <= tol}
    assert not bad, f"{what}: relative errors {bad} exceed {tol} (all: {errs})"


def _run_layouts(mesh_shape, order, layouts, *, B=1, S=256, Hq=4, Hkv=1, D=64, dtype="float32", seed=0,
                 fuse=(True, True)):
    dt = jnp.dtype(dtype)
    q, k, v, cot = _inputs(seed, B, S, Hq, Hkv, D, dt)
    ref_out, ref_grads = _reference(q, k, v, cot)
    fn = _ring_vg(mesh_shape, order, fuse)
    P = mesh_shape[0] * mesh_shape[1]
    for name in layouts:
        lay = Layout(name, S, P, stripe=STRIPE)
        args = [jnp.asarray(lay.permute(x), dt) for x in (q, k, v)]
        (_, out), grads = fn(*args, jnp.asarray(lay.perm), jnp.asarray(lay.permute(cot), jnp.float32))
        _check_against_reference(out, grads, lay, ref_out, ref_grads, dt, TOL[dtype],
                                 f"{name} mesh={mesh_shape} order={order} {dtype} Hq/Hkv={Hq}/{Hkv} D={D} fuse={fuse}")


# --------------------------------------------------------------------------- dense ring vs reference

@pytest.mark.parametrize("order", RING_ORDERS)
@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_ring_float32_all_layouts(mesh_shape, order):
    """Full layout x mesh x order product, float32, GQA 4, head_dim 64, S = 256."""
    _run_layouts(mesh_shape, order, LAYOUTS)


@pytest.mark.parametrize(
    "mesh_shape,order,layouts,Hq,Hkv,D,dtype",
    [
        ((2, 4), "hierarchical", ("zigzag", "block_striped"), 2, 2, 128, "float32"),
        ((4, 2), "flat", ("contiguous", "token_striped"), 2, 2, 128, "float32"),
        ((4, 2), "hierarchical", LAYOUTS, 4, 1, 64, "bfloat16"),
        ((2, 4), "flat", ("zigzag", "block_striped"), 4, 1, 64, "bfloat16"),
        ((1, 8), "hierarchical", ("block_striped", "contiguous"), 2, 2, 128, "bfloat16"),
        ((8, 1), "hierarchical", ("zigzag",), 4, 1, 64, "float32"),  # outer ring only
    ],
)
def test_ring_gqa_headdim_dtype(mesh_shape, order, layouts, Hq, Hkv, D, dtype):
    """GQA ratio 1, head_dim 128 and bfloat16 crossed over a subset of meshes, orders and layouts."""
    _run_layouts(mesh_shape, order, layouts, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype, seed=1, B=2 if Hq == 2 else 1)


@pytest.mark.parametrize(
    "mesh_shape,order,fuse",
    [
        ((1, 2), "hierarchical", (True, True)),  # P = 2: one kernel call per pass
        ((2, 1), "hierarchical", (False, True)),  # outer ring only: the fused call feeds the outer totals
        ((1, 2), "flat", (False, False)),
        ((2, 4), "hierarchical", (True, False)),
        ((4, 2), "hierarchical", (False, False)),
        ((2, 4), "flat", (False, True)),
        ((8, 1), "hierarchical", (True, True)),
    ],
    ids=str,
)
def test_ring_fused_and_unfused_steps(mesh_shape, order, fuse):
    """Forward / backward with the first two chunks in one kernel call or not: same attention."""
    _run_layouts(mesh_shape, order, ("block_striped", "zigzag"), fuse=fuse)


def test_ring_under_jit_keeps_sequence_sharding_and_data_axis():
    """Inputs sharded over (data, node, local) inside jit; output keeps that sharding."""
    mesh = _mesh((2, 2), data=2)
    B, S, Hq, Hkv, D = 2, 64, 4, 2, 32
    q, k, v, cot = _inputs(2, B, S, Hq, Hkv, D, jnp.float32)
    ref_out, ref_grads = _reference(q, k, v, cot)
    lay = Layout("zigzag", S, 4)
    shard = sequence_sharding(mesh)
    args = [jax.device_put(jnp.asarray(lay.permute(x), jnp.float32), shard) for x in (q, k, v)]

    @jax.jit
    def f(q, k, v, c):
        def loss(q, k, v):
            out = ring_attention(q, k, v, lay.perm, mesh, ring_order="hierarchical")
            return jnp.sum(out * c), out

        return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)

    (_, out), grads = f(*args, jnp.asarray(lay.permute(cot), jnp.float32))
    assert out.sharding.is_equivalent_to(shard, 4), out.sharding
    assert grads[1].sharding.is_equivalent_to(shard, 4), grads[1].sharding
    _check_against_reference(out, grads, lay, ref_out, ref_grads, jnp.float32, TOL["float32"], "data axis")


def _expected_permutes(nodes, local, order):
    """Collective-permutes of one forward + backward ring (see the ring module docstring)."""
    n_out, n_in = (1, nodes * local) if order == "flat" else (nodes, local)
    kv_hops = (n_out - 1) + n_out * (n_in - 1)  # outer + inner K/V hops of the forward
    # the backward runs the steps in reverse from the saved last chunk: every hop but the one that
    # would bring the own chunk back; the inner acc and the outer totals travel stacked, no send home
    acc_hops = n_out * (n_in - 1) + (n_out - 1)
    return kv_hops + (kv_hops - 1) + acc_hops


@pytest.mark.parametrize("order", RING_ORDERS)
@pytest.mark.parametrize("fuse", [(False, False), (True, True)])
def test_backward_recirculates_kv_instead_of_keeping_forward_chunks(order, fuse):
    """In one jit of forward + backward, XLA must not merge the backward's K/V permutes into the
    forward's (that would keep all P visiting chunks alive): count the permutes in compiled HLO."""
    mesh = _mesh((2, 2))
    q, k, v, pos = jnp.zeros((1, 64, 2, 32)), jnp.zeros((1, 64, 1, 32)), jnp.zeros((1, 64, 1, 32)), jnp.arange(64)
    loss = lambda q, k, v: jnp.sum(ring_attention(q, k, v, pos, mesh, ring_order=order,  # noqa: E731
                                                  fuse_forward=fuse[0], fuse_backward=fuse[1]))
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile().as_text()
    count = hlo.count("collective-permute(") + hlo.count("collective-permute-start(")
    assert count == _expected_permutes(2, 2, order), (count, _expected_permutes(2, 2, order))


# --------------------------------------------------------------------------- step_index plumbing

def _random_step_index(rng, P, B, H, sl, bs, q_pos, k_pos, max_cols, empty_rows):
    """Random valid StepIndex with leading ``[P_rank, P_step]`` axes; ``q_pos [P, Sl]``,
    ``k_pos [P, P, Sl]``. With ``empty_rows``, query block 0 of rank 0, head 0 gets nothing."""
    nqb = nkb = sl // bs
    bidx = np.zeros((P, P, B, H, nqb, nkb), np.int32)
    bcnt = np.zeros((P, P, B, H, nqb), np.int32)
    cidx = np.zeros((P, P, B, H, max_cols), np.int32)
    ccnt = np.zeros((P, P, B, H, nqb), np.int32)
    for head in np.ndindex(P, P, B, H):  # one shared column list per head, some inside active blocks
        n = int(rng.integers(0, max_cols + 1))
        cidx[head][:n] = rng.choice(sl, size=n, replace=False)
        ccnt[head] = rng.integers(0, n + 1, size=nqb)
    for row in np.ndindex(P, P, B, H, nqb):
        blocks = np.sort(rng.choice(nkb, size=rng.integers(0, nkb + 1), replace=False))
        bidx[row][: len(blocks)] = blocks
        bcnt[row] = len(blocks)
    if empty_rows:
        bcnt[0, :, 0, 0, 0] = 0
        ccnt[0, :, 0, 0, 0] = 0
    flags = jax.vmap(jax.vmap(functools.partial(causal_flags, block_size=bs), (None, 0, 0)), (0, 0, 0))(
        jnp.asarray(q_pos), jnp.asarray(k_pos), jnp.asarray(bidx))
    return StepIndex(jnp.asarray(bidx), jnp.asarray(bcnt), flags, jnp.asarray(cidx), jnp.asarray(ccnt))


def _full_step_index(P, B, H, sl, bs, q_pos, k_pos, max_cols):
    """full_step_index for every (rank, step): leading ``[P_rank, P_step]`` axes; the (empty) column
    list is padded to ``max_cols`` so the compiled sparse ring is shared with the random test."""
    one = functools.partial(full_step_index, B, H, sl, sl, block_size=bs)
    ix = jax.vmap(jax.vmap(one, (None, 0)), (0, 0))(jnp.asarray(q_pos), jnp.asarray(k_pos))
    pad = [(0, 0)] * (ix.col_idx.ndim - 1) + [(0, max_cols - ix.col_idx.shape[-1])]
    return ix._replace(col_idx=jnp.pad(ix.col_idx, pad))


def _laid_mask(index, sl, bs, src):
    """Global ``bool [B, H, S, S]`` mask in layout order from the ``[P_rank, P_step]`` index."""
    m = np.asarray(jax.vmap(jax.vmap(lambda ix: step_index_to_mask(ix, sl, sl, bs)))(index))
    P = m.shape[0]
    B, H = m.shape[2:4]
    out = np.zeros((B, H, P * sl, P * sl), bool)
    for r in range(P):
        for s in range(P):
            c = int(src[r, s])
            out[:, :, r * sl:(r + 1) * sl, c * sl:(c + 1) * sl] = m[r, s]
    return out


@functools.lru_cache(maxsize=None)
def _sparse_ring_vg(mesh_shape, order, bs):
    mesh = _mesh(mesh_shape)
    nodes, local = mesh_shape
    spec = PartitionSpec(None, CP_AXES, None, None)
    pspec = PartitionSpec(CP_AXES)

    def body(q, k, v, pos, idx):
        idx = jax.tree.map(lambda a: a[0], idx)  # [1, P_step, ...] -> [P_step, ...]
        return ring_attention_shard(q, k, v, pos, pos, num_nodes=nodes, num_local=local, ring_order=order,
                                    step_index=idx, block_size=bs)

    ring = jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec, pspec, pspec), out_specs=spec,
                         check_vma=False)

    def loss(q, k, v, pos, idx, cot):
        out = ring(q, k, v, pos, idx)
        return jnp.sum(out * cot), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def _run_step_index(mesh_shape, order, layout_name, make_index, seed):
    nodes, local = mesh_shape
    P = nodes * local
    B, S, Hq, Hkv, D, bs = 1, 256, 4, 1, 64, 16  # the shapes of the float32 layout tests
    sl = S // P
    lay = Layout(layout_name, S, P, stripe=STRIPE)
    src = np.asarray(source_rank(np.arange(P)[:, None], np.arange(P)[None, :], nodes, local, order))
    kpos = lay.positions[src]  # [P_rank, P_step, Sl]: the chunk rank r holds at step s
    index = make_index(np.random.default_rng(seed), P, B, Hq, sl, bs, lay.positions, kpos)
    mask_nat = _laid_mask(index, sl, bs, src)[:, :, lay.inverse][:, :, :, lay.inverse]
    q, k, v, cot = _inputs(seed, B, S, Hq, Hkv, D, jnp.float32)
    fn = _sparse_ring_vg(mesh_shape, order, bs)
    args = [jnp.asarray(lay.permute(x), jnp.float32) for x in (q, k, v)]
    (_, out), grads = fn(*args, jnp.asarray(lay.perm), index, jnp.asarray(lay.permute(cot), jnp.float32))
    return lay, (q, k, v, cot), mask_nat, out, grads


@pytest.mark.parametrize("mesh_shape,order,layout_name",
                         [((2, 4), "hierarchical", "block_striped"), ((4, 2), "flat", "zigzag")])
def test_step_index_random_sparse_matches_masked_reference(mesh_shape, order, layout_name):
    """Random block + column indices per (rank, step): the sparse ring equals dense attention with the
    union mask, so entry s of the index is applied to exactly the chunk source_rank says."""
    make = functools.partial(_random_step_index, max_cols=5, empty_rows=True)
    lay, (q, k, v, cot), mask, out, grads = _run_step_index(mesh_shape, order, layout_name, make, seed=4)
    assert 0 < mask.mean() < 1  # the mask is really sparse
    # rows with no allowed key at any step: exactly zero output and dq (merge of all -inf partials)
    np.testing.assert_array_equal(np.asarray(out)[0, :16, 0], 0.0)
    np.testing.assert_array_equal(np.asarray(grads[0])[0, :16, 0], 0.0)
    ref_out, ref_grads = _reference(q, k, v, cot, mask)
    _check_against_reference(out, grads, lay, ref_out, ref_grads, jnp.float32, TOL["float32"],
                             f"random StepIndex {order}")


def test_step_index_full_equals_dense_ring():
    """full_step_index for each step's (q_pos, visiting k_pos) reproduces the dense ring exactly."""
    make = lambda rng, *a: _full_step_index(*a, max_cols=5)  # noqa: E731
    lay, (q, k, v, cot), mask, out, grads = _run_step_index((2, 4), "hierarchical", "token_striped", make, seed=5)
    (_, dense_out), dense_grads = _ring_vg((2, 4), "hierarchical")(
        *[jnp.asarray(lay.permute(x), jnp.float32) for x in (q, k, v)], jnp.asarray(lay.perm),
        jnp.asarray(lay.permute(cot), jnp.float32))
    for a, b in zip((out, *grads), (dense_out, *dense_grads)):
        assert _rel(a, b) <= 1e-6, _rel(a, b)
    ref_out, ref_grads = _reference(q, k, v, cot)
    _check_against_reference(out, grads, lay, ref_out, ref_grads, jnp.float32, TOL["float32"], "full index")


# --------------------------------------------------------------------------- bad input

def _small(S=64, Hq=4, Hkv=2, D=32):
    return (jnp.zeros((1, S, Hq, D)), jnp.zeros((1, S, Hkv, D)), jnp.zeros((1, S, Hkv, D)),
            jnp.arange(S, dtype=jnp.int32))


def test_bad_sequence_length():
    q, k, v, pos = _small(S=60)
    with pytest.raises(ValueError, match="sequence length 60 .* ranks 8"):
        ring_attention(q, k, v, pos, _mesh((2, 4)))


def test_bad_gqa_heads():
    q, k, v, pos = _small(Hq=6, Hkv=4)
    with pytest.raises(ValueError, match=r"query heads \(6\) .* KV heads \(4\)"):
        ring_attention(q, k, v, pos, _mesh((2, 4)))


def test_bad_mesh_axes():
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "local"))
    with pytest.raises(ValueError, match=r"missing \['node'\]"):
        ring_attention(*_small(), mesh)


def test_bad_ring_order_and_impl():
    with pytest.raises(ValueError, match="unknown ring order 'spiral'"):
        ring_attention(*_small(), _mesh((2, 4)), ring_order="spiral")
    with pytest.raises(ValueError, match="unknown impl 'cuda'"):
        ring_attention(*_small(), _mesh((2, 4)), impl="cuda")
    with pytest.raises(ValueError, match="unknown ring order 'ring'"):
        RingConfig(2, 4, "ring")
    with pytest.raises(ValueError, match="num_local must be a positive integer, got 0"):
        RingConfig(2, 0, "flat")


def test_bad_positions_and_shapes():
    q, k, v, pos = _small()
    with pytest.raises(ValueError, match=r"positions has shape \(63,\)"):
        ring_attention(q, k, v, pos[:63], _mesh((2, 4)))
    with pytest.raises(ValueError, match="positions must be integers"):
        ring_attention(q, k, v, pos.astype(jnp.float32), _mesh((2, 4)))
    with pytest.raises(ValueError, match="k and v shapes differ"):
        ring_attention(q, k, v[:, :, :1], pos, _mesh((2, 4)))
    with pytest.raises(ValueError, match="batch 1 is not divisible by the data axis size 2"):
        ring_attention(q, k, v, pos, _mesh((2, 2), data=2))


def test_shard_body_outside_shard_map_and_wrong_sizes():
    q, k, v, pos = _small(S=16)
    with pytest.raises(ValueError, match="inside shard_map"):
        ring_attention_shard(q, k, v, pos, pos, num_nodes=1, num_local=1, ring_order="flat")
    mesh = _mesh((2, 4))
    spec = PartitionSpec(None, CP_AXES, None, None)

    def body(q, k, v, p):
        return ring_attention_shard(q, k, v, p, p, num_nodes=4, num_local=2, ring_order="flat")

    with pytest.raises(ValueError, match="num_nodes x num_local = 4 x 2 does not match"):
        jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec, PartitionSpec(CP_AXES)), out_specs=spec,
                      check_vma=False)(*_small())
    idx = full_step_index(1, 4, 8, 8, jnp.arange(8), jnp.arange(8), 8)
    bad = jax.tree.map(lambda a: jnp.stack([a] * 3), idx)  # 3 steps, P = 8

    def body_idx(q, k, v, p):
        return ring_attention_shard(q, k, v, p, p, num_nodes=2, num_local=4, ring_order="flat", step_index=bad)

    with pytest.raises(ValueError, match="leading ring-step axis of size P = 8"):
        jax.shard_map(body_idx, mesh=mesh, in_specs=(spec, spec, spec, PartitionSpec(CP_AXES)), out_specs=spec,
                      check_vma=False)(*_small())


def test_layout_errors_surface_before_the_ring():
    with pytest.raises(ValueError, match="unknown layout 'spiral'"):
        Layout("spiral", 128, 8)
    with pytest.raises(ValueError, match=r"sequence length 96 is not divisible by stripe x ranks = 16 x 8"):
        Layout("block_striped", 96, 8, stripe=16)
