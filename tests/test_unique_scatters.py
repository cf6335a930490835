"""The library's ``unique_indices=True`` scatters checked when they run (``tests/_unique_scatters.py``):
repeated indices there are a silent wrong answer on a GPU and a right one on the CPU.

* The checker can fail: repeated declared indices are reported (jit and eager, per batch element
  under vmap, a unique gather's transpose, in scan / checkpoint / custom_vjp / shard_map); distinct
  ones, repeats only among dropped out-of-range slots and undeclared scatters are not.
* The library, run for real: a tiny training step (Triton kernels in interpret mode; dense K/V ring
  on 1 x 2 devices, sparse exchange + query-side backward ring on 2 x 2), Mosaic's index preparation
  and streams, the column dK/dV scatter with GQA, MSA under shard_map, and the index build through
  every kernel's index preparation for random uneven per-head budgets: no violation AND the expected
  sites checked (a test fails if the patch stops applying).
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec as Ps

from mtraining_jax.layouts import Layout
from mtraining_jax.ring.schedule import source_rank
from pallas_kernels import index_format, mosaic_index, triton_backward, triton_kernels
from pallas_kernels.testing import random_step_index
from pallas_kernels.three_pass import add_column_grads
from _unique_scatters import checked_unique_scatters, colliding_starts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BS = 64
INDEX_SITES = {"index.py:compact_in_order", "convert.py:_convert_step", "budgets.py:top_p_select"}
TRITON_SITES = {"triton_kernels.py:prepare_index", "triton_backward.py:transpose_block_index",
                "three_pass.py:add_column_grads"}
MOSAIC_SITES = {"mosaic_index.py:prepare", "mosaic_index.py:pair_stream", "mosaic_index.py:split_stream"}


def _checked(fn, *args):
    with checked_unique_scatters() as r:
        jax.block_until_ready(fn(*args))
    assert r.errors == []
    return r


def _assert_clean(r, sites, minimum):
    """No violation, no failed check, every site in ``sites`` checked, ``minimum`` checks in all."""
    assert r.errors == []
    assert r.violations == [], "\n".join(map(str, r.violations[:5]))
    got = r.sites()
    assert set(sites) <= set(got), f"never checked: {set(sites) - set(got)}; checked {dict(got)}"
    assert len(r.checked) >= minimum, dict(got)


def _dups(r):
    return [v.duplicates for v in r.violations]


add_u = lambda x, i: x.at[i].add(1.0, unique_indices=True)  # noqa: E731


@pytest.mark.parametrize("fn, i, want", [
    (add_u, [1, 1], [[(1,)]]),
    (add_u, [1, 2], []),
    (lambda x, i: x.at[i].add(1.0, mode="drop", unique_indices=True), [1, 9, 9, -20, -20], []),  # dropped repeats
    (lambda x, i: x.at[i].add(1.0, mode="clip", unique_indices=True), [7, 9], [[(7,)]]),  # clamped onto one slot
    (lambda x, i: x.at[i].set(2.0, unique_indices=True), [3, 3], [[(3,)]]),
    (lambda x, i: x.at[i].add(1.0), [1, 1], None),  # not declared: not checked
])
def test_repeated_declared_indices_are_reported(fn, i, want):
    for f in (jax.jit(fn), fn):  # traced and eager
        r = _checked(f, jnp.zeros(8), jnp.array(i))
        assert len(r.checked) == (0 if want is None else 1) and _dups(r) == (want or [])
    rows = jax.jit(lambda x, i: x.at[i].add(jnp.ones(3), unique_indices=True))  # a window along dim 1
    r = _checked(rows, jnp.zeros((4, 3)), jnp.array([2, 2]))
    assert _dups(r) == [[(2, ":")]] and r.violations[0].where.startswith("tests/test_unique_scatters.py")


def test_windows_overlap_and_batch_dims_in_the_coordinates():
    win = jax.lax.ScatterDimensionNumbers((1,), (), (0,))  # windows of 2 along the scattered dim
    check = lambda i, mode: colliding_starts(np.array(i)[:, None], (8,), (2, 2), win, mode)  # noqa: E731
    assert (check([0, 1], "promise_in_bounds"), check([0, 2], "clip"), check([0, 7], "drop")) == ([(0,)], [], [])
    batched = jax.lax.ScatterDimensionNumbers((), (1,), (1,), (0,), (0,))  # vmap: operand dim 0 = indices dim 0
    assert colliding_starts(np.array([[[3], [4]], [[3], [5]]]), (2, 8), (2, 2), batched, "clip") == []
    assert colliding_starts(np.array([[[3], [4]], [[5], [5]]]), (2, 8), (2, 2), batched, "clip") == [(1, 5)]


def test_vmap_and_shard_map_check_each_batch_element_and_device():
    f = jax.jit(jax.vmap(add_u))
    assert _checked(f, jnp.zeros((2, 8)), jnp.array([[1, 2], [1, 2]])).violations == []  # repeats across elements
    assert _dups(_checked(f, jnp.zeros((2, 8)), jnp.array([[1, 2], [3, 3]]))) == [[(1, 3)]]
    shared = jax.jit(jax.vmap(add_u, in_axes=(0, None)))  # one index list for every element
    assert _dups(_checked(shared, jnp.zeros((2, 8)), jnp.array([3, 3]))) == [[(":", 3)]]
    mesh = Mesh(np.array(jax.devices()[:8]), ("d",))
    put = lambda a: jax.device_put(a, NamedSharding(mesh, Ps("d")))  # noqa: E731
    f = jax.jit(jax.shard_map(lambda x, i: add_u(x, i[0]), mesh=mesh, in_specs=(Ps("d"), Ps("d")), out_specs=Ps("d")))
    r = _checked(f, put(jnp.zeros(64)), put(jnp.array([[0, 1]] * 3 + [[2, 2]] + [[0, 1]] * 4)))
    assert len(r.checked) == 8 and _dups(r) == [[(2,)]]  # device 3's shard


@jax.custom_vjp
def _through(x, i):
    return x


_through.defvjp(lambda x, i: (x, i), lambda i, g: (g.at[i].add(1.0, unique_indices=True), None))


@pytest.mark.parametrize("fn, runs", [
    (jax.grad(lambda x, i: x.at[i].get(unique_indices=True).sum()), 1),  # a unique gather's transpose
    (lambda x, i: jax.lax.scan(lambda c, j: (add_u(c, i + j), None), x, jnp.arange(2))[0], 2),
    (jax.grad(lambda x, i: jax.checkpoint(lambda y: y.at[i].get(unique_indices=True) ** 2)(x).sum()), 1),
    (jax.grad(lambda x, i: _through(x, i).sum()), 1),  # custom_vjp backward
], ids=["grad", "scan", "checkpoint", "custom_vjp"])
def test_transformed_and_nested_scatters_are_checked(fn, runs):
    assert _dups(_checked(jax.jit(fn), jnp.zeros(8), jnp.array([3, 3]))) == [[(3 + j,)] for j in range(runs)]
    assert _checked(jax.jit(fn), jnp.zeros(8), jnp.array([3, 5])).violations == []


def test_the_patch_is_undone_and_programs_are_retraced():
    f, i = jax.jit(add_u), jnp.array([1, 1])
    f(jnp.zeros(8), i)  # traced before: must run with the check inside
    with checked_unique_scatters() as r:
        jax.block_until_ready(f(jnp.zeros(8), i))
    assert len(r.violations) == 1
    assert not any("bind" in vars(p) for p in (jax.lax.scatter_p, jax.lax.scatter_add_p))
    jax.block_until_ready(f(jnp.zeros(8), i))  # traced with the check: dropped on exit
    jax.effects_barrier()
    assert len(r.checked) == 1


# --- the library under the checker ---


def _training_loss(overrides):
    """``(loss(params, batch), params, batch)`` of configs/tiny_cpu.yaml (one MTraining layer on 512
    tokens, Triton kernels in interpret mode): initial parameters, random tokens in the layout."""
    from mtraining_jax.train.config import load_config
    from mtraining_jax.train.data import Batch
    from mtraining_jax.train.loop import build_mesh, run_layout
    from mtraining_jax.train.state import build_model_config, split_model
    from mtraining_jax.train.step import make_loss_fn

    path = os.path.join(ROOT, "configs", "tiny_cpu.yaml")
    cfg = load_config(path, ["data.seq_len=512", "model.max_position_embeddings=512", "model.num_layers=1",
                             "model.dense_layers=[]", "loss_chunk_size=256", "model.ring.impl=triton", *overrides])
    model_cls, model_cfg = build_model_config(cfg.model, os.path.dirname(path))
    parts, init = split_model(model_cls, model_cfg, cfg.seed)
    mesh = build_mesh(cfg.mesh)
    perm = run_layout(cfg, model_cfg, mesh.shape["node"] * mesh.shape["local"]).perm
    tok = np.random.default_rng(0).integers(0, 259, (1, 513))
    batch = Batch(jnp.asarray(tok[:, :-1][:, perm], jnp.int32), jnp.asarray(tok[:, 1:][:, perm], jnp.int32),
                  jnp.ones((1, 512), jnp.float32), jnp.asarray(perm, jnp.int32))
    loss_fn = make_loss_fn(parts, mesh, cfg.loss_chunk_size)
    return (lambda p, b: loss_fn(p, b)[0]), init(), batch


@pytest.mark.parametrize("ring, sites, minimum", [
    (["mesh.shape=[1,2]"], INDEX_SITES | TRITON_SITES | {"estimate.py:_last_queries"}, 30),  # 54 ran
    (["mesh.shape=[2,2]", "model.ring.kv_exchange=sparse", "model.ring.backward_ring=query"],
     INDEX_SITES | TRITON_SITES | {"estimate.py:_last_queries", "exchange.py:needed_tokens"}, 200),  # 420 ran
], ids=["dense-ring-1x2", "sparse-exchange-query-backward-2x2"])
def test_training_step_triton_interpret(ring, sites, minimum):
    loss, params, batch = _training_loss(ring)
    with checked_unique_scatters() as r:
        value, grads = jax.jit(jax.value_and_grad(loss))(params, batch)
    assert abs(float(value) / 512 - np.log(512)) < 0.3  # initial loss per token ~ ln(vocab)
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
    _assert_clean(r, sites, minimum)


def _mosaic_prep(idx, q_pos, k_pos, segs=None):
    k = jnp.zeros((idx.block_idx.shape[0], k_pos.shape[0], 2, 64), jnp.bfloat16)
    ops = mosaic_index.prepare(idx, k, k, k_pos, BS, q_pos, segs)
    return ops, mosaic_index.pair_stream(ops, 2), mosaic_index.split_stream(ops)


@pytest.mark.parametrize("segments", [False, True])
def test_mosaic_index_preparation_and_streams(segments):
    """tests/test_deterministic_scatters.py's Mosaic case, run: each pair's shared stream holds
    every block either row lists exactly once."""
    pos = jnp.arange(512, dtype=jnp.int32)
    idx = random_step_index(np.random.default_rng(0), 1, 4, 512, 512, pos, pos, max_blocks=5, max_cols=90)
    with checked_unique_scatters() as r:
        ops, pair, _ = jax.jit(_mosaic_prep)(idx, pos, pos, (pos[None] // 150,) * 2 if segments else None)
    _assert_clean(r, MOSAIC_SITES, 10)  # 18 ran
    blocks, n, stream = np.asarray(ops.block_idx[0]), np.asarray(ops.counts[0, ..., 1]), np.asarray(pair.block_idx[0])
    for h, p in np.ndindex(stream.shape[:2]):
        want = set(blocks[h, 2 * p, :n[h, 2 * p]]) | set(blocks[h, 2 * p + 1, :n[h, 2 * p + 1]])
        assert sorted(stream[h, p][stream[h, p] != mosaic_index.NULL_BLOCK]) == sorted(want)


@pytest.mark.parametrize("hkv", [2, 1])  # 2 and 4 query heads per KV head
def test_column_grads_with_gqa(hkv):
    rng = np.random.default_rng(hkv)
    B, H, sk, D, mcp = 2, 4, 256, 8, 64
    pos = jnp.arange(sk, dtype=jnp.int32)
    idx = random_step_index(rng, B, H, sk, sk, pos, pos, max_blocks=2, max_cols=40, p_empty=0.0)
    cidx = jnp.pad(idx.col_idx, [(0, 0), (0, 0), (0, mcp - 40)])
    dk, dv = (jnp.asarray(rng.normal(size=(B, sk, hkv, D)), jnp.float32) for _ in range(2))
    dkc, dvc = (jnp.asarray(rng.normal(size=(B, H, mcp, D)), jnp.float32) for _ in range(2))
    with checked_unique_scatters() as r:
        got = jax.jit(add_column_grads)(dk, dv, dkc, dvc, cidx, idx.col_count)
    _assert_clean(r, {"three_pass.py:add_column_grads"}, 2 * (H // hkv))
    want, used = [np.array(dk), np.array(dv)], np.asarray(idx.col_count).max(-1)
    for b, h in np.ndindex(B, H):
        for w, c in zip(want, (dkc, dvc)):
            np.add.at(w[b], (np.asarray(cidx[b, h, :used[b, h]]), h * hkv // H), np.asarray(c[b, h, :used[b, h]]))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6, atol=1e-6)
    # a head listing one column twice breaks the index contract: the checker sees it at this site
    with checked_unique_scatters() as r:
        jax.jit(add_column_grads)(dk, dv, dkc, dvc, cidx.at[0, 0, 1].set(cidx[0, 0, 0]), idx.col_count.at[0, 0].set(2))
    assert r.violations and all(v.where.startswith("pallas_kernels/three_pass.py") for v in r.violations)


def test_msa_selection_forward_and_backward_under_shard_map():
    from mtraining_jax.attention.msa import MSAConfig, msa_attention
    from mtraining_jax.mesh import make_mesh
    from mtraining_jax.ring.config import RingOptions

    lay = Layout("block_striped", 512, 4, stripe=BS)
    shapes = [(1, 512, 4, 32), (1, 512, 2, 32), (1, 512, 2, 32), (1, 512, 2, 16), (1, 512, 16)]  # q k v q_idx k_idx
    keys = jax.random.split(jax.random.key(0), 5)
    args = [lay.permute(jax.random.normal(key, s, jnp.float32)) for key, s in zip(keys, shapes)]
    cfg = MSAConfig(top_k=3, ring=RingOptions(ring_order="hierarchical", impl="xla"), layout="block_striped")

    def loss(*a):
        out, aux = msa_attention(*a, make_mesh((2, 2), jax.devices()[:4]), cfg, positions=jnp.asarray(lay.perm))
        return jnp.sum(out) + aux.kl

    with checked_unique_scatters() as r:
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*args)
    assert all(np.isfinite(g).all() for g in grads) and float(jnp.abs(grads[4]).max()) > 0  # the KL reaches k_idx
    _assert_clean(r, {"msa.py:body", "msa_select.py:selection_step_index", "index_format.py:row_block_map"}, 30)


def _kernel_prep(st_, q_pos, k_pos):
    """Every kernel's index preparation of one converted step index: the XLA twin's row map,
    Triton's forward / transpose / column scatter, Mosaic's operands and both streams."""
    sk = k_pos.shape[0]
    _, _, cidx = triton_kernels.prepare_index(st_, sk, BS, BS)
    dk, dkc = jnp.zeros((1, sk, 2, 8)), jnp.ones((1, 4, cidx.shape[-1], 8))
    return (index_format.row_block_map(st_, sk, BS), triton_backward.transpose_block_index(st_, sk, BS),
            add_column_grads(dk, dk, dkc, dkc, cidx, st_.col_count), _mosaic_prep(st_, q_pos, k_pos))


@settings(max_examples=5, deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate))  # no shrinking
@given(data=st.data())
def test_index_build_for_uneven_per_head_budgets(data):
    """estimate -> per-step conversion (one step, or all fused) -> kernel preparation on every rank,
    per-head budgets drawn up to every column / every diagonal, packed documents or one stream."""
    from mtraining_jax.sparsity import SparsityConfig, estimate_index
    from mtraining_jax.sparsity.convert import RankStepIndex

    S, H, nb = 512, 4, 512 // BS
    ints = lambda lo, hi: tuple(data.draw(st.lists(st.integers(lo, hi), min_size=H, max_size=H)))  # noqa: E731
    p = lambda: tuple(data.draw(st.lists(st.floats(0.05, 1.0), min_size=H, max_size=H)))  # noqa: E731
    vmin, smin = ints(0, S), ints(1, nb)
    docs = sorted(data.draw(st.sets(st.integers(1, S - 1), max_size=4)))
    cfg = SparsityConfig(vertical_p=p(), slash_p=p(), vertical_min=vmin, slash_min=smin,
                         vertical_max=tuple(data.draw(st.integers(a, S)) for a in vmin),
                         slash_max=tuple(data.draw(st.integers(a, nb)) for a in smin),
                         last_q=data.draw(st.sampled_from([16, 64, S])),
                         window="per_document" if docs else "sequence", window_blocks=data.draw(st.integers(1, nb)))
    N, L, layout = data.draw(st.sampled_from([(1, 1, "contiguous"), (1, 2, "zigzag"), (2, 2, "block_striped"),
                                              (1, 4, "block_striped")]))
    steps = tuple(range(N * L)) if data.draw(st.booleans()) else (data.draw(st.integers(0, N * L - 1)),)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    q = jnp.asarray(rng.normal(size=(1, S, H, 16)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, S, 2, 16)), jnp.float32).at[:, rng.integers(0, S, 3)].mul(5.0)
    seg = jnp.asarray(np.searchsorted(docs, np.arange(S), side="right")[None], jnp.int32) if docs else None
    lay = Layout(layout, S, N * L, stripe=BS)
    pos = jnp.asarray(lay.positions, jnp.int32)
    with checked_unique_scatters() as r:
        index = estimate_index(q, k, jnp.arange(S), cfg, segment_ids=seg)
        prep = jax.jit(_kernel_prep)
        for rank in range(N * L):
            k_pos = jnp.concatenate([pos[int(source_rank(rank, s, N, L, "hierarchical"))] for s in steps])
            rsi = RankStepIndex(index, jnp.int32(rank), lay, N, L, "hierarchical", BS)
            jax.block_until_ready(prep(rsi.steps(steps), pos[rank], k_pos))
    window = "estimate.py:_window_queries" if docs else "estimate.py:_last_queries"
    sites = TRITON_SITES | MOSAIC_SITES | INDEX_SITES | {"index_format.py:row_block_map", window,
                                                         "estimate.py:_diagonal_sums"}
    if not cfg.max_verticals(S):  # no column slots: no column list to compact
        sites -= {"index.py:compact_in_order"}
    _assert_clean(r, sites, 10 * N * L)
