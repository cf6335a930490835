"""Global index -> per-rank, per-step StepIndex: mapping every rank's local index back to global
positions reproduces the global vertical-slash mask exactly (each causal pair once, nothing else)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as Ps

from mtraining_jax.layouts import Layout
from mtraining_jax.mesh import CP_AXES, make_mesh
from mtraining_jax.ring.schedule import source_table
from mtraining_jax.sparsity import RankStepIndex, convert_index, convert_step, index_to_mask
from mtraining_jax.sparsity.index import random_index
from pallas_kernels.index_format import causal_flags, chunk_work, step_work

MESHES = [(1, 1), (1, 2), (2, 1), (2, 2), (1, 4), (2, 4), (4, 2), (1, 8)]


def np_step_mask(st, sq, sk, bs):
    """NumPy twin of ``step_index_to_mask``: ``bool [B, H, Sq, Sk]`` before the causal mask (row
    ``i`` uses the prefix ``col_idx[..., :col_count[i]]`` of its head's column list)."""
    bi, bc, _, ci, cc = (np.asarray(a) for a in st)
    B, H, nqb, mb = bi.shape
    nkb = sk // bs
    b_, h_, q_ = np.ogrid[:B, :H, :nqb]
    blk = np.zeros((B, H, nqb, nkb + 1), bool)
    blk[b_[..., None], h_[..., None], q_[..., None], np.where(np.arange(mb) < bc[..., None], bi, nkb)] = True
    col = np.zeros((B, H, nqb, sk + 1), bool)
    col[b_[..., None], h_[..., None], q_[..., None],
        np.where(np.arange(ci.shape[-1]) < cc[..., None], ci[:, :, None, :], sk)] = True
    allowed = np.repeat(blk[..., :nkb], bs, axis=-1) | col[..., :sk]
    return np.repeat(allowed, bs, axis=2)


@functools.lru_cache(None)
def _converter(N, L, order, layout, S, bs, max_cols):
    lay = Layout(layout, S, N * L, stripe=bs)

    def all_ranks(index):
        return jax.vmap(lambda r: convert_index(index, r, lay, num_nodes=N, num_local=L, ring_order=order,
                                                block_size=bs, max_cols=max_cols))(jnp.arange(N * L))
    return lay, jax.jit(all_ranks)


def coverage_counts(index, N, L, order, layout, S, bs, max_cols=None):
    """``int [B, H, S, S]``: how many (rank, step, local entry) cover each global (q, k) pair."""
    lay, f = _converter(N, L, order, layout, S, bs, max_cols)
    si = jax.tree.map(np.asarray, f(index))
    P, sl = N * L, S // (N * L)
    pos, tab = lay.positions, source_table(N, L, order)
    B, H = np.asarray(index.v_count).shape
    cnt = np.zeros((B, H, S, S), np.int32)
    for r in range(P):
        for s in range(P):
            st = [a[r, s] for a in si]
            qp, kp = pos[r], pos[tab[r, s]]
            # structural contract of StepIndex
            bi, bc, bcz, ci, cc = st
            valid = np.arange(bi.shape[-1]) < bc[..., None]  # blocks: distinct, ascending
            assert np.all(np.where(valid[..., 1:] & valid[..., :-1], np.diff(bi, axis=-1) > 0, True))
            # columns: one list per head, distinct, in ascending global position; row prefixes
            used = np.arange(ci.shape[-1]) < cc.max(axis=-1, initial=0)[..., None]
            cpos = np.where(used, kp[np.clip(ci, 0, sl - 1)], -1)
            assert np.all(np.where(used[..., 1:], np.diff(cpos, axis=-1) > 0, True))
            np.testing.assert_array_equal(bcz, np.asarray(causal_flags(qp, kp, jnp.asarray(bi), bs)))
            m = np_step_mask(st, sl, sl, bs) & (kp[None, :] <= qp[:, None])
            cnt[:, :, qp[:, None], kp[None, :]] += m
    return cnt


@settings(max_examples=24, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    mesh=st.sampled_from(MESHES),
    order=st.sampled_from(["flat", "hierarchical"]),
    layout=st.sampled_from(["contiguous", "zigzag", "block_striped"]),
    S=st.sampled_from([512, 1024]),
    bs=st.sampled_from([32, 64]),
)
def test_per_step_indices_tile_the_global_mask_exactly(seed, mesh, order, layout, S, bs):
    N, L = mesh
    if layout == "zigzag" and (S // (2 * N * L)) % bs:
        bs = 32  # zigzag half-chunks must be whole blocks
    index = random_index(seed, 1, 2, S, bs, max_verticals=24, max_slashes=5)
    cnt = coverage_counts(index, N, L, order, layout, S, bs)
    want = np.asarray(index_to_mask(index, S, bs)).astype(np.int32)
    np.testing.assert_array_equal(cnt, want)  # each causal pair of the mask once; nothing else


def test_truncated_columns_are_a_subset():
    S, bs = 1024, 64
    index = random_index(3, 1, 2, S, bs, max_verticals=64, max_slashes=3)
    cnt = coverage_counts(index, 2, 2, "hierarchical", "contiguous", S, bs, max_cols=2)
    want = np.asarray(index_to_mask(index, S, bs)).astype(np.int32)
    assert cnt.max() <= 1 and np.all(cnt <= want)
    assert cnt.sum() < want.sum()


def test_single_device_step_index():
    S, bs = 512, 64
    index = random_index(7, 2, 2, S, bs, max_verticals=16, max_slashes=4)
    f = jax.jit(functools.partial(convert_step, seq_len=S, block_size=bs))
    st = f(index, jnp.arange(S), jnp.arange(S))
    assert st.block_idx.shape == (2, 2, S // bs, 4) and st.col_idx.shape == (2, 2, 16)
    m = np_step_mask(st, S, S, bs) & np.tril(np.ones((S, S), bool))
    np.testing.assert_array_equal(m, np.asarray(index_to_mask(index, S, bs)))


@pytest.mark.parametrize("order", ["flat", "hierarchical"])
def test_convert_inside_shard_map_with_traced_rank(order):
    S, bs, N, L = 1024, 64, 2, 4
    index = random_index(11, 1, 2, S, bs, max_verticals=32, max_slashes=6)
    lay, f = _converter(N, L, order, "block_striped", S, bs, None)
    want = f(index)
    mesh = make_mesh((N, L))

    def body(dummy):
        rank = jax.lax.axis_index(CP_AXES)
        out = convert_index(index, rank, lay, num_nodes=N, num_local=L, ring_order=order, block_size=bs)
        return jax.tree.map(lambda x: x[None], out)

    got = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=Ps(CP_AXES), out_specs=Ps(CP_AXES)))(jnp.zeros(8))
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("order,layout", [("hierarchical", "block_striped"), ("flat", "zigzag")])
def test_rank_step_index_converts_each_step_like_convert_index(order, layout):
    """``RankStepIndex(...).step(s)`` (one step on demand, traced rank and step) == entry ``s`` of
    ``convert_index``, for every rank and step; it flattens to the compact index + rank only."""
    S, bs, N, L = 1024, 64, 2, 2
    index = random_index(5, 1, 2, S, bs, max_verticals=24, max_slashes=5)
    lay, f = _converter(N, L, order, layout, S, bs, None)
    want = f(index)  # [P ranks, P steps, ...]
    src = RankStepIndex(index, jnp.int32(0), lay, N, L, order, bs)
    leaves = jax.tree.leaves(src)
    assert len(leaves) == 5 and sum(x.size for x in leaves) == sum(x.size for x in jax.tree.leaves(index)) + 1

    @jax.jit
    def one(idx, rank, s):
        return RankStepIndex(idx, rank, lay, N, L, order, bs).step(s)

    for r in range(N * L):
        for s in range(N * L):
            got = one(index, jnp.int32(r), jnp.int32(s))
            for a, b in zip(got, want):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b)[r, s])
    with pytest.raises(ValueError, match="layout has 4 ranks, the mesh 1 x 2"):
        RankStepIndex(index, jnp.int32(0), lay, 1, 2, order, bs)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), cap=st.sampled_from([None, 2, 5]), order=st.sampled_from(["hierarchical", "flat"]),
       layout=st.sampled_from(["block_striped", "zigzag", "contiguous"]), rank=st.integers(0, 3),
       steps=st.sampled_from([(0, 3), (0, 1), (2, 1), (3, 0, 1)]))
def test_fused_steps_index_is_the_union_of_its_steps(seed, cap, order, layout, rank, steps):
    """``RankStepIndex.steps(ss)`` (ring steps fused into one kernel call, chunks concatenated in
    that order) allows exactly the union of the steps' own indexes, column caps included (per
    chunk), and ``chunk_work`` splits its work back into each step's ``step_work``."""
    S, bs, N, L = 1024, 64, 2, 2
    sl = S // (N * L)
    index = random_index(seed, 1, 2, S, bs, max_verticals=24, max_slashes=5)
    lay = Layout(layout, S, N * L, stripe=bs)
    src = RankStepIndex(index, jnp.int32(rank), lay, N, L, order, bs, cap)
    fused = src.steps(steps)
    union = np.concatenate([np_step_mask(src.step(s), sl, sl, bs) for s in steps], axis=-1)
    np.testing.assert_array_equal(np_step_mask(fused, sl, len(steps) * sl, bs), union)
    np.testing.assert_array_equal(np.asarray(chunk_work(fused, len(steps) * sl, len(steps), bs)),
                                  [float(step_work(src.step(s), bs)) for s in steps])


def test_convert_bad_inputs():
    S = 1024
    index = random_index(0, 1, 1, S, 64)
    with pytest.raises(ValueError, match="not block-aligned"):
        convert_index(index, 0, Layout("token_striped", S, 4), num_nodes=1, num_local=4)
    with pytest.raises(ValueError, match="not block-aligned"):
        convert_index(index, 0, Layout("block_striped", S, 4, stripe=32), num_nodes=1, num_local=4)
    with pytest.raises(ValueError, match=r"P = 2 x 4 = 8"):
        convert_index(index, 0, Layout("contiguous", S, 4), num_nodes=2, num_local=4)
    with pytest.raises(ValueError, match="ring order"):
        convert_index(index, 0, Layout("contiguous", S, 4), num_nodes=1, num_local=4, ring_order="zig")
