"""Vertical-slash index estimation: against a float64 NumPy model, layout invariance, and the sharded
estimate equal (bit for bit) to the single-device one on 8 CPU devices (meshes 1x8 and 2x4)."""

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
from mtraining_jax.sparsity import SparsityConfig, estimate_index, estimate_index_shard

B, S, HQ, HKV, D = 2, 1024, 4, 2, 16
CFG = SparsityConfig(vertical_min=4, vertical_max=64, slash_max=8, vertical_p=(0.5, 0.7, 0.9, 0.95))


@functools.lru_cache(None)
def _inputs():
    kq, kk = jax.random.split(jax.random.PRNGKey(0))
    q = jax.random.normal(kq, (B, S, HQ, D)) * 2.0
    k = jax.random.normal(kk, (B, S, HKV, D)) * 2.0
    return q.astype(jnp.float32), k.astype(jnp.float32)


@functools.lru_cache(None)
def _single():
    q, k = _inputs()
    return jax.jit(functools.partial(estimate_index, cfg=CFG))(q, k, jnp.arange(S))


def _model_scores(q, k, cfg):
    """Float64 Algorithm 1 statistics: vertical [B, H, S] and slash [B, H, nb] attention mass."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    g = q.shape[2] // k.shape[2]
    kk = np.repeat(k, g, axis=2)
    qp = np.arange(S - cfg.last_q, S)
    z = np.einsum("bqhd,bkhd->bhqk", q[:, qp], kk) / np.sqrt(q.shape[-1])
    z = np.where(np.arange(S)[None, :] <= qp[:, None], z, -np.inf)
    a = np.exp(z - z.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    vert = a.sum(2)
    d = qp[:, None] // cfg.block_size - np.arange(S)[None, :] // cfg.block_size
    nb = S // cfg.block_size
    slash = np.stack([np.where(d == j, a, 0).sum((2, 3)) for j in range(nb)], -1)
    return vert, slash


def _check_top_p(scores, idx, count, p, lo, hi, forced=None, tol=1e-5):
    sel = np.asarray(idx)[:count]
    assert np.all(np.diff(sel) > 0)
    total = scores.sum()
    free = sel if forced is None else sel[sel != forced]
    rest = np.setdiff1d(np.arange(len(scores)), sel)
    if len(free) and len(rest):
        assert scores[free].min() >= scores[rest].max() - tol  # argtopk (up to fixed-point resolution)
    mass = scores[sel].sum()
    if count < hi:
        assert mass >= p * total - tol  # covers p unless capped
    if count > max(lo, 1):
        assert mass - scores[free].min() < p * total + tol  # minimal


def test_estimate_matches_float64_algorithm_1():
    q, k = _inputs()
    idx = jax.tree.map(np.asarray, _single())
    vert, slash = _model_scores(q, k, CFG)
    assert idx.v_idx.shape == (B, HQ, 64) and idx.s_idx.shape == (B, HQ, 8)
    for b in range(B):
        for h in range(HQ):
            _check_top_p(vert[b, h], idx.v_idx[b, h], idx.v_count[b, h], CFG.vertical_p[h], 4, 64)
            _check_top_p(slash[b, h], idx.s_idx[b, h], idx.s_count[b, h], 0.9, 1, 8, forced=0)
            assert idx.s_idx[b, h, 0] == 0
            assert np.all(idx.v_idx[b, h, idx.v_count[b, h]:] == S)  # padding
    assert len(set(np.asarray(idx.v_count).ravel().tolist())) > 1  # per-head p changes the budget


@pytest.mark.parametrize("layout", ["zigzag", "token_striped", "block_striped"])
def test_estimate_is_layout_invariant(layout):
    q, k = _inputs()
    lay = Layout(layout, S, 8)
    got = estimate_index(lay.permute(q), lay.permute(k), lay.perm, CFG)
    for a, b in zip(got, _single()):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("mesh_shape", [(1, 8), (2, 4)])
def test_sharded_estimate_equals_single_device(mesh_shape):
    q, k = _inputs()
    ref = _single()
    mesh = make_mesh(mesh_shape)
    seq = Ps(None, CP_AXES)

    def body(ql, kl, pos):
        return jax.tree.map(lambda x: x[None], estimate_index_shard(ql, kl, pos, CFG, CP_AXES))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(seq, seq, Ps(CP_AXES)), out_specs=Ps(CP_AXES)))
    for layout in ("contiguous", "zigzag", "token_striped", "block_striped"):
        lay = Layout(layout, S, 8)
        out = f(lay.permute(q), lay.permute(k), jnp.asarray(lay.perm))
        for a, b in zip(out, ref):  # every rank holds the identical, single-device index
            np.testing.assert_array_equal(np.asarray(a), np.broadcast_to(np.asarray(b)[None], a.shape))


def test_estimate_bad_inputs():
    q, k = _inputs()
    with pytest.raises(ValueError, match="positions"):
        estimate_index(q, k, jnp.arange(S - 1), CFG)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        estimate_index(q[:, :, :3], k, jnp.arange(S), CFG)
    with pytest.raises(ValueError, match="last_q=2048"):
        estimate_index(q, k, jnp.arange(S), SparsityConfig(last_q=2048))
    with pytest.raises(ValueError, match="block_size=96"):
        estimate_index(q, k, jnp.arange(S), SparsityConfig(block_size=96))
    with pytest.raises(ValueError, match="SparsityConfig"):
        estimate_index(q, k, jnp.arange(S), {"last_q": 64})


def test_positions_are_checked_up_front():
    """Every public entry of the sparsity package that takes positions rejects a set that is not
    one (issue 35: all-zero positions used to give an index silently), naming the bad value."""
    from mtraining_jax.layouts import Layout
    from mtraining_jax.sparsity import convert_index, convert_step
    from mtraining_jax.sparsity.metrics import pair_work, recall
    from mtraining_jax.sparsity.msa_select import full_selection, layout_block_order, select_blocks
    from mtraining_jax.sparsity.synthetic import SyntheticAttention, synthetic_qk

    q, k = _inputs()
    with pytest.raises(ValueError, match=r"position 0 appears twice \(positions\[0\] and positions\[1\]\)"):
        estimate_index(q, k, jnp.zeros(S, jnp.int32), CFG)
    with pytest.raises(ValueError, match=rf"positions\[5\] = {S} is not a position of a {S}-token sequence"):
        estimate_index(q, k, jnp.arange(S).at[5].set(S), CFG)
    with pytest.raises(ValueError, match="positions must be integers, got dtype float32"):
        estimate_index(q, k, jnp.arange(S, dtype=jnp.float32), CFG)
    with pytest.raises(ValueError, match="q_pos"):  # one rank's rows: distinct, in range
        estimate_index_shard(q[:, :512], k[:, :512], np.r_[0:511, 0], CFG, axis_names=())
    # a traced permutation cannot be inspected: accepted, and the same index as the concrete one
    got = jax.jit(lambda p: estimate_index(q, k, p, CFG))(jnp.arange(S))
    for a, b in zip(got, _single()):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    index = _single()
    lay = Layout("block_striped", S, 4)
    with pytest.raises(ValueError, match=r"layout positions\[3, 255\] = 1024 is not a position of a 1024-token"):
        convert_index(index, 0, lay.positions + 1, num_nodes=1, num_local=4)
    bad = lay.positions.copy()
    bad[1, 0] = bad[0, 0]
    with pytest.raises(ValueError, match=r"layout positions must be distinct.*position 0 appears twice"):
        pair_work(index, bad)
    with pytest.raises(ValueError, match=r"k_pos\[3\] = 2048 is not a position of a 1024-token sequence"):
        convert_step(index, jnp.arange(64), jnp.arange(64).at[3].set(2048), seq_len=S)
    with pytest.raises(ValueError, match="layout positions must be distinct"):
        layout_block_order(np.zeros((2, 64), np.int32))
    with pytest.raises(ValueError, match="q_pos.* is not a position"):
        full_selection(1, 2, jnp.arange(64) + S, S)
    with pytest.raises(ValueError, match="q_pos must be distinct"):
        select_blocks(jnp.zeros((1, 128, 2, 8)), jnp.zeros((1, S // 64, 8)), jnp.zeros(128, jnp.int32))
    with pytest.raises(ValueError, match="rows must be distinct"):
        recall(q, k, index, rows=[S - 1, S - 1])
    with pytest.raises(ValueError, match=r"query_positions\[0\] = -1"):
        synthetic_qk(SyntheticAttention(seq_len=256), query_positions=[-1, 3])


def test_window_row_chunk_choice(monkeypatch):
    from mtraining_jax.sparsity import estimate as est

    assert est.window_row_chunk(1, 14, 131072, 64, 64, 64) == 8  # 1.3 GiB of logits at once -> 8 rows
    assert est.window_row_chunk(1, 14, 4096, 64, 64, 64) == 64  # fits: one chunk
    assert est.window_row_chunk(1, 14, 2**23, 64, 96, 64) == 1  # never below one row
    monkeypatch.setattr(est, "ROW_CHUNK_BYTES", 1)
    assert est.window_row_chunk(1, 4, 1024, 16, 96, 64) == 1
    monkeypatch.setattr(est, "ROW_CHUNK_BYTES", 2**21)  # 42 rows of 48 KiB fit
    assert est.window_row_chunk(1, 4, 1024, 16, 96, 64) == 32  # a power of two dividing gcd(96, 64)


@pytest.mark.parametrize("last_q, segments", [(64, False), (96, True), (128, False)])
def test_chunked_window_rows_change_no_bit(monkeypatch, last_q, segments):
    """Scoring the observation window a few rows at a time (``ROW_CHUNK_BYTES`` small; a scan over
    chunks) gives the index of scoring it at once, bit for bit: single device, packed documents,
    a window spanning query blocks, and the sharded estimate on a 2x4 mesh."""
    from mtraining_jax.sparsity import estimate as est

    q, k = _inputs()
    cfg = SparsityConfig(vertical_min=4, vertical_max=64, slash_max=8, vertical_p=(0.5, 0.7, 0.9, 0.95),
                         last_q=last_q)
    seg = jnp.asarray(np.repeat(np.arange(4), S // 4)[None].repeat(B, 0)) if segments else None
    lay = Layout("zigzag", S, 8)
    mesh = make_mesh((2, 4))
    seq = Ps(None, CP_AXES)

    def sharded(ql, kl, pos, sl):
        return jax.tree.map(lambda x: x[None], estimate_index_shard(ql, kl, pos, cfg, CP_AXES, segment_ids=sl))

    def run():
        jax.clear_caches()
        one = estimate_index(q, k, jnp.arange(S), cfg, segment_ids=seg)
        f = jax.jit(jax.shard_map(sharded, mesh=mesh, in_specs=(seq, seq, Ps(CP_AXES), seq if segments else None),
                                  out_specs=Ps(CP_AXES)))
        many = f(lay.permute(q), lay.permute(k), jnp.asarray(lay.perm),
                 lay.permute(seg[..., None])[..., 0] if segments else None)
        return jax.tree.map(np.asarray, one), jax.tree.map(np.asarray, many)

    whole = run()
    assert est.window_row_chunk(B, HQ, S, D, last_q, cfg.block_size) == last_q
    monkeypatch.setattr(est, "ROW_CHUNK_BYTES", 3 * B * HQ * S * 4 * 16)  # 16 rows of logits per chunk
    assert est.window_row_chunk(B, HQ, S, D, last_q, cfg.block_size) == 16
    chunked = run()
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(chunked)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(chunked[1], chunked[0]):  # and the sharded index equals the single-device one
        np.testing.assert_array_equal(a, np.broadcast_to(b[None], a.shape))


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_diagonal_sums_equal_a_per_key_count(data):
    """``estimate._diagonal_sums`` (the slash scores from window blocks' column sums) against a NumPy
    loop over keys: one rank's keys in whole blocks of any order (every layout; its gather path) or
    single keys in any order (its scatter path), window blocks in any query block or none (-1)."""
    from mtraining_jax.sparsity import estimate as est

    bs = data.draw(st.sampled_from([1, 2, 4]), label="bs")
    nb = data.draw(st.integers(1, 6), label="nb")
    whole = data.draw(st.booleans(), label="whole_blocks")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    if whole:  # some of the blocks, each block's keys in order
        n = data.draw(st.integers(1, nb), label="blocks")
        k_pos = (rng.permutation(nb)[:n, None] * bs + np.arange(bs)).reshape(-1)
    else:
        k_pos = rng.permutation(nb * bs)[: data.draw(st.integers(1, nb * bs), label="keys")]
    B, H, W = 2, 3, data.draw(st.integers(1, 4), label="W")
    g = rng.integers(-1, nb, (B, W)).astype(np.int32)
    cols = rng.integers(0, 2**20, (2, B, H, W, k_pos.size)).astype(np.int32)
    want = np.zeros((2, B, H, nb), np.int64)
    for b, w, i in np.ndindex(B, W, k_pos.size):
        d = g[b, w] - k_pos[i] // bs
        if g[b, w] >= 0 and d >= 0:
            want[:, b, :, d] += cols[:, b, :, w, i]
    got = jax.jit(est._diagonal_sums, static_argnums=(3, 4))(jnp.asarray(cols), jnp.asarray(g),
                                                             jnp.asarray(k_pos, jnp.int32), nb, bs)
    np.testing.assert_array_equal(np.asarray(got), want)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([1, 2, 4]), st.sampled_from([16, 64]))
def test_window_rows_are_gathered_exactly_on_every_split(seed, ranks, last_q):
    """Each rank's window rows (zero where it holds none) add up to the rows at positions
    ``S - last_q ..``, and a zero of either sign comes out as ``+0`` (what the sum of one rank's
    row and the others' zeros gives), on one rank as on several; the same for document ids."""
    from mtraining_jax.sparsity.estimate import _last_queries, _last_segments

    rng = np.random.default_rng(seed)
    S, H, D = 256, 3, 4
    q = rng.normal(size=(2, S, H, D)).astype(np.float32)
    q[:, rng.integers(0, S, 40), :, rng.integers(0, D)] = -0.0
    pos = rng.permutation(S).astype(np.int32)
    seg = rng.integers(0, 9, (2, S)).astype(np.int32)
    sl = S // ranks
    parts = [_last_queries(jnp.asarray(q[:, r * sl:(r + 1) * sl]), jnp.asarray(pos[r * sl:(r + 1) * sl]), S, last_q,
                           lambda x: x) for r in range(ranks)]
    got = np.asarray(functools.reduce(lambda a, b: a + b, parts) if ranks > 1 else parts[0])
    want = np.zeros((2, last_q, H, D), np.float32)
    for i, p in enumerate(pos):
        if p >= S - last_q:
            want[:, p - (S - last_q)] = q[:, i] + np.float32(0.0)  # -0.0 + 0.0 = +0.0
    np.testing.assert_array_equal(got, want)
    assert not np.signbit(got[got == 0]).any()
    ids = sum(np.asarray(_last_segments(jnp.asarray(seg[:, r * sl:(r + 1) * sl]), jnp.asarray(pos[r * sl:(r + 1) * sl]),
                                        S, last_q, lambda x: x)) for r in range(ranks))
    want_ids = np.zeros((2, last_q), np.int32)
    for i, p in enumerate(pos):
        if p >= S - last_q:
            want_ids[:, p - (S - last_q)] = seg[:, i]
    np.testing.assert_array_equal(ids, want_ids)
