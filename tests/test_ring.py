"""Ring attention (flat + hierarchical) against the dense float64 reference on the natural sequence.

Every check is forward output AND q/k/v gradients under a random non-uniform cotangent, measured as
``norm(x - ref) / norm(ref)``. The ring is jitted once per (mesh, order, dtype, shapes, impl) with
the layout positions as a traced argument, so all four layouts reuse one compilation.

``_RingSuite`` holds the cases; subclasses pick the per-step kernel backend
(``pallas_kernels.registry.BACKENDS``) and their cases: the XLA twin (every mesh, order, layout),
the Triton kernels in interpret mode on CPU (two tiny cases: interpret mode is slow) and compiled
on a GPU (``@pytest.mark.gpu``: ``pytest -m gpu tests/test_ring.py``).
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

from pallas_kernels.reference import dense_attention
from mtraining_jax.ring.attention import RingConfig, StackedStepIndex, ring_attention, ring_attention_shard
from mtraining_jax.layouts import LAYOUTS, Layout
from mtraining_jax.mesh import CP_AXES, make_mesh, sequence_sharding
from mtraining_jax.ring.schedule import RING_ORDERS, source_rank
from pallas_kernels import registry
from pallas_kernels.index_format import StepIndex, causal_flags, full_step_index, step_index_to_mask
from _observed import observed

MESHES = ((1, 1), (1, 8), (2, 4), (4, 2))
STRIPE = 16  # block_striped stripe for these small tests (the layout's default is 64)
# ~3x the largest error observed on CPU (XLA twin and Triton interpret, every case; the reference is
# float64 of the same values): bfloat16 out 1.56e-3, dq/dk/dv 1.67e-3 (the bf16 rounding of the
# results); float32 out 1.7e-7, dq/dk/dv 3.9e-7
TOL = {"float32": 1.2e-6, "bfloat16": 5e-3}


def _mesh(shape, data: int = 1) -> Mesh:
    n = shape[0] * shape[1] * data
    return make_mesh(shape, jax.devices()[:n], data=data)


def _rel(x, ref) -> float:
    x = np.asarray(x, np.float64)
    ref = np.asarray(ref, np.float64)
    return observed(float(np.linalg.norm(x - ref) / np.linalg.norm(ref)))


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
def _ring_vg(mesh_shape, order, fuse=(True, True), impl="xla", backward_ring="auto"):
    mesh = _mesh(mesh_shape)

    def loss(q, k, v, positions, cot):
        out = ring_attention(q, k, v, positions, mesh, ring_order=order, fuse_forward=fuse[0], fuse_backward=fuse[1],
                             impl=impl, backward_ring=backward_ring)
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
                 fuse=(True, True), impl="xla", tol=TOL, backward_ring="auto"):
    dt = jnp.dtype(dtype)
    q, k, v, cot = _inputs(seed, B, S, Hq, Hkv, D, dt)
    ref_out, ref_grads = _reference(q, k, v, cot)
    fn = _ring_vg(mesh_shape, order, fuse, impl, backward_ring)
    P = mesh_shape[0] * mesh_shape[1]
    for name in layouts:
        lay = Layout(name, S, P, stripe=STRIPE)
        args = [jnp.asarray(lay.permute(x), dt) for x in (q, k, v)]
        (_, out), grads = fn(*args, jnp.asarray(lay.perm), jnp.asarray(lay.permute(cot), jnp.float32))
        _check_against_reference(out, grads, lay, ref_out, ref_grads, dt, tol[dtype],
                                 f"{name} mesh={mesh_shape} order={order} {dtype} Hq/Hkv={Hq}/{Hkv} D={D} fuse={fuse} "
                                 f"impl={impl} backward_ring={backward_ring}")


def _case_id(case) -> str:
    mesh_shape, order, *rest = case
    extra = rest[-1] if rest and isinstance(rest[-1], dict) else {}
    return f"{mesh_shape[0]}x{mesh_shape[1]}-{order}" + "".join(f"-{k}={v}" for k, v in extra.items())


def pytest_generate_tests(metafunc):
    """``ring_case`` / ``step_case``: the cases of the suite subclass being collected."""
    for name, attr in (("ring_case", "RING_CASES"), ("step_case", "STEP_CASES"), ("exchange_case", "EXCHANGE_CASES")):
        if name in metafunc.fixturenames:
            cases = getattr(metafunc.cls, attr)
            metafunc.parametrize(name, cases, ids=[_case_id(c) for c in cases])


# (mesh, order, layouts, keywords of _run_layouts)
_XLA_RING_CASES = (
    # full layout x mesh x order product, float32, GQA 4, head_dim 64, S = 256
    [(m, o, LAYOUTS, {}) for m in MESHES for o in RING_ORDERS]
    # GQA ratio 1, head_dim 128 and bfloat16 crossed over a subset of meshes, orders and layouts
    + [(m, o, lays, dict(Hq=Hq, Hkv=Hkv, D=D, dtype=dt, seed=1, B=2 if Hq == 2 else 1)) for m, o, lays, Hq, Hkv, D, dt in [
        ((2, 4), "hierarchical", ("zigzag", "block_striped"), 2, 2, 128, "float32"),
        ((4, 2), "flat", ("contiguous", "token_striped"), 2, 2, 128, "float32"),
        ((4, 2), "hierarchical", LAYOUTS, 4, 1, 64, "bfloat16"),
        ((2, 4), "flat", ("zigzag", "block_striped"), 4, 1, 64, "bfloat16"),
        ((1, 8), "hierarchical", ("block_striped", "contiguous"), 2, 2, 128, "bfloat16"),
        ((8, 1), "hierarchical", ("zigzag",), 4, 1, 64, "float32"),  # outer ring only
    ]]
    # forward / backward with the first two chunks in one kernel call or not: same attention
    + [(m, o, ("block_striped", "zigzag"), dict(fuse=f)) for m, o, f in [
        ((1, 2), "hierarchical", (True, True)),  # P = 2: one kernel call per pass
        ((2, 1), "hierarchical", (False, True)),  # outer ring only: the fused call feeds the outer totals
        ((1, 2), "flat", (False, False)),
        ((2, 4), "hierarchical", (True, False)),
        ((4, 2), "hierarchical", (False, False)),
        ((2, 4), "flat", (False, True)),
        ((8, 1), "hierarchical", (True, True)),
    ]]
    # the query-side backward ring (Q, dO, lse, delta + dQ travel; K/V stay): every mesh, order and
    # layout, and GQA 1 (where "auto" picks it), bfloat16, outer-only and two-rank rings
    + [(m, o, LAYOUTS, dict(backward_ring="query")) for m in MESHES[1:] for o in RING_ORDERS]
    + [(m, o, lays, dict(kw, backward_ring=side)) for m, o, lays, side, kw in [
        ((2, 4), "hierarchical", ("zigzag", "block_striped"), "auto", dict(Hq=2, Hkv=2, D=128, B=2)),
        ((4, 2), "flat", ("zigzag",), "query", dict(dtype="bfloat16", seed=1)),
        ((8, 1), "hierarchical", ("zigzag", "contiguous"), "query", {}),
        ((1, 2), "flat", ("block_striped",), "query", {}),
        ((2, 1), "hierarchical", ("block_striped",), "query", {}),
        ((1, 1), "hierarchical", ("contiguous",), "query", {}),
    ]]
)


class _RingSuite:
    """Dense ring and ``step_index`` plumbing against the float64 reference with kernel ``impl``."""

    impl = "xla"
    tol = TOL
    RING_CASES = _XLA_RING_CASES
    # (mesh, order, layout) of the random sparse StepIndex test; the full-index test runs the first
    STEP_CASES = [((2, 4), "hierarchical", "block_striped"), ((4, 2), "flat", "zigzag")]
    STEP_SHAPES = dict(B=1, S=256, Hq=4, Hkv=1, D=64, bs=16)  # the shapes of the float32 layout tests
    STEP_DTYPE = "float32"  # q/k/v of the step-index tests (the Mosaic kernels take bf16 / f16 only)
    # (mesh, order, layouts, (kv_exchange, exchange_capacity, backward_ring)) of the sparse exchange
    # each mesh: two layouts per order, all four layouts over its two orders
    EXCHANGE_CASES = [(m, o, LAYOUTS[:2] if o == "flat" else LAYOUTS[2:], dict(kv_exchange="auto" if m == (4, 2) else "sparse", exchange_capacity=0.5,
                                           backward_ring="query" if (m, o) == ((2, 4), "flat") else "kv"))
                      for m in MESHES[1:] for o in RING_ORDERS]
    EXCHANGE_SHAPES = dict(B=1, S=512, Hq=2, Hkv=1, D=32, bs=16)

    def test_every_kernel_call_is_the_suite_backend(self, kernel_selections):
        """The suite really runs its backend: every per-step kernel the ring traces, forward and
        backward, is selected as ``impl`` (a ring that dropped ``impl`` on some path, e.g. the
        backward, would fall back to "auto", i.e. the XLA twin on CPU, and pass the numerics)."""
        seen = kernel_selections
        mesh_shape, order, layouts, kw = self.RING_CASES[0]
        B, S, Hq, Hkv, D = (kw.get(n, d) for n, d in (("B", 1), ("S", 256), ("Hq", 4), ("Hkv", 1), ("D", 64)))
        dt = jnp.dtype(kw.get("dtype", "float32"))
        mesh = _mesh(mesh_shape)

        def loss(q, k, v, positions):  # a fresh function: traced now, whatever other tests traced
            out = ring_attention(q, k, v, positions, mesh, ring_order=order, impl=self.impl,
                                 backward_ring=kw.get("backward_ring", "auto"))
            return jnp.sum(out.astype(jnp.float32))

        x = lambda h: jax.ShapeDtypeStruct((B, S, h, D), dt)  # noqa: E731
        pos = jax.ShapeDtypeStruct((S,), jnp.int32)
        jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(x(Hq), x(Hkv), x(Hkv), pos)
        assert {d for d, _ in seen} == {"fwd", "bwd"}, seen
        assert {n for _, n in seen} == {registry.validate_impl(self.impl)}, seen

    def test_ring_matches_reference(self, ring_case):
        mesh_shape, order, layouts, kw = ring_case
        _run_layouts(mesh_shape, order, layouts, impl=self.impl, tol=self.tol, **kw)

    def test_step_index_random_sparse_matches_masked_reference(self, step_case):
        """Random block + column indices per (rank, step): the sparse ring equals dense attention with
        the union mask, so entry s of the index is applied to exactly the chunk source_rank says."""
        mesh_shape, order, layout_name = step_case
        make = functools.partial(_random_step_index, max_cols=5, empty_rows=True)
        lay, (q, k, v, cot), mask, out, grads = _run_step_index(mesh_shape, order, layout_name, make, 4, self.impl,
                                                                dtype=self.STEP_DTYPE, **self.STEP_SHAPES)
        assert 0 < mask.mean() < 1  # the mask is really sparse
        # rows with no allowed key at any step: exactly zero output and dq (merge of all -inf partials)
        bs = self.STEP_SHAPES["bs"]
        np.testing.assert_array_equal(np.asarray(out)[0, :bs, 0], 0.0)
        np.testing.assert_array_equal(np.asarray(grads[0])[0, :bs, 0], 0.0)
        ref_out, ref_grads = _reference(q, k, v, cot, mask)
        _check_against_reference(out, grads, lay, ref_out, ref_grads, jnp.dtype(self.STEP_DTYPE),
                                 self.tol[self.STEP_DTYPE], f"random StepIndex {order} impl={self.impl}")

    def test_sparse_exchange_matches_masked_reference(self, exchange_case):
        """kv_exchange="sparse" (each rank receives only the K/V tokens its index needs, dK/dV of
        those sent back) with a configured capacity: equal to dense attention under the union mask
        of a random index whose need fits the capacity at most steps and is the whole chunk at every
        third (those steps take the guarded whole-chunk path), every layout."""
        mesh_shape, order, layouts, exchange = exchange_case
        make = functools.partial(_random_step_index, max_cols=3, empty_rows=True, pool=1)
        dt = self.STEP_DTYPE
        for layout_name in layouts:
            lay, (q, k, v, cot), mask, out, grads = _run_step_index(
                mesh_shape, order, layout_name, make, 7, self.impl, dtype=dt, exchange=tuple(sorted(exchange.items())),
                **self.EXCHANGE_SHAPES)
            ref_out, ref_grads = _reference(q, k, v, cot, mask)
            _check_against_reference(out, grads, lay, ref_out, ref_grads, jnp.dtype(dt), self.tol[dt],
                                     f"sparse exchange {exchange} {layout_name} mesh={mesh_shape} {order} impl={self.impl}")

    def test_step_index_full_equals_dense_ring(self):
        """full_step_index for each step's (q_pos, visiting k_pos) reproduces the dense ring exactly."""
        mesh_shape, order, _ = self.STEP_CASES[0]
        make = lambda rng, *a: _full_step_index(*a, max_cols=5)  # noqa: E731
        dt = self.STEP_DTYPE
        lay, (q, k, v, cot), mask, out, grads = _run_step_index(mesh_shape, order, "token_striped", make, 5,
                                                                self.impl, dtype=dt, **self.STEP_SHAPES)
        (_, dense_out), dense_grads = _ring_vg(mesh_shape, order, (True, True), self.impl)(
            *[jnp.asarray(lay.permute(x), dt) for x in (q, k, v)], jnp.asarray(lay.perm),
            jnp.asarray(lay.permute(cot), jnp.float32))
        for a, b in zip((out, *grads), (dense_out, *dense_grads)):
            assert _rel(a, b) <= self.tol[dt], _rel(a, b)  # observed: CPU float32 3.8e-7, GPU (Triton, Mosaic) 0
        ref_out, ref_grads = _reference(q, k, v, cot)
        _check_against_reference(out, grads, lay, ref_out, ref_grads, jnp.dtype(dt), self.tol[dt],
                                 f"full index impl={self.impl}")


class TestXlaTwin(_RingSuite):
    impl = "xla"


class TestTritonInterpret(_RingSuite):
    """Interpret mode is slow: two rings of two ranks (one per ring axis), S = 128 (one 64-block per
    chunk), and the step-index tests on two ranks with 32-blocks."""

    impl = "triton"
    RING_CASES = [((1, 2), "hierarchical", ("zigzag",), dict(S=128, Hq=2, Hkv=1, D=32)),
                  ((2, 1), "hierarchical", ("block_striped",), dict(S=128, Hq=2, Hkv=1, D=32, fuse=(False, False))),
                  ((1, 2), "flat", ("block_striped",), dict(S=128, Hq=2, Hkv=1, D=32, backward_ring="query"))]
    STEP_CASES = [((1, 2), "flat", "zigzag")]
    STEP_SHAPES = dict(B=1, S=128, Hq=2, Hkv=1, D=32, bs=32)
    # the exchange adds no kernel code (gathers, permutes, the same per-step kernels): the XLA twin covers it
    test_sparse_exchange_matches_masked_reference = None


@pytest.mark.gpu
class TestTritonGPU(_RingSuite):
    """Compiled Triton kernels on one GPU (a ring of one rank; the multi-rank schedule is the same
    code as on CPU). Float32 runs TF32 tensor-core dots: looser float32 tolerance."""

    impl = "triton"
    # ~3x the largest error observed on an H100 (2026-11-26): float32 (TF32 dots) out 3.8e-4, dq/dk/dv
    # 5.9e-4; bfloat16 out 2.1e-3, dq/dk/dv 2.4e-3
    tol = {"float32": 2e-3, "bfloat16": 7e-3}
    RING_CASES = [((1, 1), "hierarchical", ("zigzag",), dict(S=4096, Hq=8, Hkv=2, D=128, dtype=dt, backward_ring=b))
                  for dt in ("float32", "bfloat16") for b in ("kv", "query")]
    STEP_CASES = [((1, 1), "hierarchical", "block_striped")]
    STEP_SHAPES = dict(B=1, S=1024, Hq=4, Hkv=1, D=64, bs=64)
    test_sparse_exchange_matches_masked_reference = None  # one rank: nothing to exchange (it is the ring)


@pytest.mark.gpu
class TestMosaicGPU(TestTritonGPU):
    """Compiled Mosaic GPU kernels (Hopper) on one GPU: bf16 only (what the kernels take), the
    step-index tests at 64-token blocks on a 1024-token chunk (Sq a multiple of 128)."""

    impl = "mosaic"
    tol = {"float32": 2e-3, "bfloat16": 1.5e-2}  # observed on an H100 (2026-11-26): bf16 out 3.3e-3, grads 5.1e-3
    RING_CASES = [((1, 1), "hierarchical", ("zigzag",), dict(S=4096, Hq=8, Hkv=2, D=128, dtype="bfloat16"))]
    STEP_DTYPE = "bfloat16"

    @pytest.mark.parametrize("stream", ["index", "shared", "split"])
    def test_step_index_random_sparse_every_kernel_stream(self, stream):
        """``kernel_stream`` other than the default ``auto`` (``model.ring.kernel_stream``): the ring
        passes it to the Mosaic forward and dQ kernels (``index``: both passes chosen per call; a fixed
        stream: one kernel each) and the result is still dense attention under the index's union mask."""
        mesh_shape, order, layout_name = self.STEP_CASES[0]
        make = functools.partial(_random_step_index, max_cols=5, empty_rows=True)
        lay, (q, k, v, cot), mask, out, grads = _run_step_index(mesh_shape, order, layout_name, make, 4, self.impl,
                                                                dtype=self.STEP_DTYPE, stream=stream,
                                                                **self.STEP_SHAPES)
        assert 0 < mask.mean() < 1
        ref_out, ref_grads = _reference(q, k, v, cot, mask)
        _check_against_reference(out, grads, lay, ref_out, ref_grads, jnp.dtype(self.STEP_DTYPE),
                                 self.tol[self.STEP_DTYPE], f"random StepIndex stream={stream} impl={self.impl}")


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


# --------------------------------------------------------------------------- step_index plumbing

def _random_step_index(rng, P, B, H, sl, bs, q_pos, k_pos, max_cols, empty_rows, pool=None):
    """Random valid StepIndex with leading ``[P_rank, P_step]`` axes; ``q_pos [P, Sl]``,
    ``k_pos [P, P, Sl]``. With ``empty_rows``, query block 0 of rank 0, head 0 gets nothing.
    ``pool``: rows of (rank, step) pick their blocks among ``pool`` random KV blocks of that pair
    (every block at steps ``step % 3 == 0``): a sparse-exchange need below the whole chunk at
    most steps and the whole chunk at some."""
    nqb = nkb = sl // bs
    bidx = np.zeros((P, P, B, H, nqb, nkb), np.int32)
    bcnt = np.zeros((P, P, B, H, nqb), np.int32)
    cidx = np.zeros((P, P, B, H, max_cols), np.int32)
    ccnt = np.zeros((P, P, B, H, nqb), np.int32)
    for head in np.ndindex(P, P, B, H):  # one shared column list per head, some inside active blocks
        n = int(rng.integers(0, max_cols + 1))
        cidx[head][:n] = rng.choice(sl, size=n, replace=False)
        ccnt[head] = rng.integers(0, n + 1, size=nqb)
    pools = {(r, t): np.arange(nkb) if pool is None or t % 3 == 0 else rng.choice(nkb, pool, replace=False)
             for r in range(P) for t in range(P)}
    for row in np.ndindex(P, P, B, H, nqb):
        avail = pools[row[:2]]
        blocks = np.sort(rng.choice(avail, size=rng.integers(0, len(avail) + 1), replace=False))
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


def _sparse_ring(mesh_shape, order, bs, impl, exchange=None, stream="auto"):
    """``ring(q, k, v, pos, idx) -> out`` over the mesh with a step index. ``exchange``: ``None`` (each
    rank gets its own ``[P_step]`` index) or keyword items of ``ring_attention_shard`` (``kv_exchange``,
    ...): every rank gets the whole ``[P_rank, P_step]`` index as a ``StackedStepIndex`` (the exchange
    converts the receiver's index). ``stream``: ``RingOptions.kernel_stream``."""
    mesh = _mesh(mesh_shape)
    nodes, local = mesh_shape
    spec = PartitionSpec(None, CP_AXES, None, None)
    pspec = PartitionSpec(CP_AXES)

    def body(q, k, v, pos, idx):
        if exchange is None:
            idx, kw = jax.tree.map(lambda a: a[0], idx), {}  # [1, P_step, ...] -> [P_step, ...]
        else:
            idx = StackedStepIndex(idx, jax.lax.axis_index(CP_AXES))
            kw = dict(exchange)
        return ring_attention_shard(q, k, v, pos, pos, num_nodes=nodes, num_local=local, ring_order=order,
                                    step_index=idx, block_size=bs, impl=impl, kernel_stream=stream, **kw)

    return jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec, pspec, pspec if exchange is None else
                                                    PartitionSpec()), out_specs=spec, check_vma=False)


@functools.lru_cache(maxsize=None)
def _sparse_ring_vg(mesh_shape, order, bs, impl, exchange=None, stream="auto"):
    """Value and gradient of ``sum(out * cot)`` through :func:`_sparse_ring` (same arguments)."""
    ring = _sparse_ring(mesh_shape, order, bs, impl, exchange, stream)

    def loss(q, k, v, pos, idx, cot):
        out = ring(q, k, v, pos, idx)
        return jnp.sum(out.astype(jnp.float32) * cot), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def _run_step_index(mesh_shape, order, layout_name, make_index, seed, impl, *, B, S, Hq, Hkv, D, bs,
                    dtype=jnp.float32, exchange=None, stream="auto"):
    nodes, local = mesh_shape
    P = nodes * local
    sl = S // P
    lay = Layout(layout_name, S, P, stripe=STRIPE)
    src = np.asarray(source_rank(np.arange(P)[:, None], np.arange(P)[None, :], nodes, local, order))
    kpos = lay.positions[src]  # [P_rank, P_step, Sl]: the chunk rank r holds at step s
    index = make_index(np.random.default_rng(seed), P, B, Hq, sl, bs, lay.positions, kpos)
    mask_nat = _laid_mask(index, sl, bs, src)[:, :, lay.inverse][:, :, :, lay.inverse]
    q, k, v, cot = _inputs(seed, B, S, Hq, Hkv, D, jnp.float32)
    fn = _sparse_ring_vg(mesh_shape, order, bs, impl, exchange, stream)
    args = [jnp.asarray(lay.permute(x), dtype) for x in (q, k, v)]
    (_, out), grads = fn(*args, jnp.asarray(lay.perm), index, jnp.asarray(lay.permute(cot), jnp.float32))
    return lay, (q, k, v, cot), mask_nat, out, grads


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
    with pytest.raises(ValueError, match="unknown backward_ring 'dq'"):
        RingConfig(2, 4, "flat", backward_ring="dq")
    with pytest.raises(ValueError, match="unknown backward_ring 'both'"):
        ring_attention(*_small(), _mesh((2, 4)), backward_ring="both")


def test_bad_positions_and_shapes():
    q, k, v, pos = _small()
    with pytest.raises(ValueError, match=r"positions has shape \(63,\)"):
        ring_attention(q, k, v, pos[:63], _mesh((2, 4)))
    with pytest.raises(ValueError, match="positions must be integers"):
        ring_attention(q, k, v, pos.astype(jnp.float32), _mesh((2, 4)))
    with pytest.raises(ValueError, match=r"and k = v \[B,Sk,Hkv,D\]"):
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
    stacked = jax.tree.map(lambda a: jnp.stack([a] * 8), idx)  # this rank's queries only

    def body_query(q, k, v, p):
        return ring_attention_shard(q, k, v, p, p, num_nodes=2, num_local=4, ring_order="flat", step_index=stacked,
                                    backward_ring="query")

    with pytest.raises(ValueError, match="backward_ring='query' needs the index of every rank's queries"):
        jax.shard_map(body_query, mesh=mesh, in_specs=(spec, spec, spec, PartitionSpec(CP_AXES)), out_specs=spec,
                      check_vma=False)(*_small())


def test_layout_errors_surface_before_the_ring():
    with pytest.raises(ValueError, match="unknown layout 'spiral'"):
        Layout("spiral", 128, 8)
    with pytest.raises(ValueError, match=r"sequence length 96 is not divisible by stripe x ranks = 16 x 8"):
        Layout("block_striped", 96, 8, stripe=16)
