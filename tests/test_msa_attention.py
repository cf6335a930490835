"""MSA attention: output and gradients equal the dense reference masked by the selection (GQA,
one device and under shard_map on the block-aligned layouts); warm-up equals dense attention; the
KL value and gradients equal a float64 dense reference, and the main branch (q, k, v) gets zero
gradient from the KL."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtraining_jax.attention.msa import MSAConfig, msa_attention
from mtraining_jax.layouts import Layout
from mtraining_jax.mesh import make_mesh
from mtraining_jax.ring.config import RingOptions
from mtraining_jax.sparsity.msa_select import index_keys, select_blocks, selection_block_map
from pallas_kernels.reference import dense_attention

BS = 64
B, S, HQ, HKV, D, DI = 1, 512, 4, 2, 32, 16
TOPK = 3


def _inputs(seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(ks[0], (B, S, HQ, D))
    k = jax.random.normal(ks[1], (B, S, HKV, D))
    v = jax.random.normal(ks[2], (B, S, HKV, D))
    qi = jax.random.normal(ks[3], (B, S, HKV, DI))
    ki = jax.random.normal(ks[4], (B, S, DI))
    return q, k, v, qi, ki


def _token_mask(qi, ki, top_k=TOPK, pooling="mean"):
    """``bool [B, Hq, S, S]`` (natural order): the selected blocks, causal."""
    sel = select_blocks(qi, index_keys(ki, BS, pooling), jnp.arange(S), block_size=BS, top_k=top_k, pooling=pooling)
    blk = np.asarray(selection_block_map(sel, S // BS))  # [B, G, nQB, nb]
    m = np.repeat(np.repeat(np.repeat(blk, HQ // HKV, 1), BS, 2), BS, 3)
    return jnp.asarray(m & np.tril(np.ones((S, S), bool)))


def _ref_out(q, k, v, mask):
    out, _ = dense_attention(q, k, v, mask=mask)
    return out


def _ref_kl(q, k, qi, ki, blkmask, pooling="mean"):
    """float64-capable dense reference of the block-level KL (mean over B * S * Hkv).
    ``blkmask bool [B, G, S(rows), nb]``: the selected blocks of each row (causal applied here)."""
    dt = q.dtype
    nb = S // BS
    g = HQ // HKV
    pos = jnp.arange(S)
    causal = pos[None, :] <= pos[:, None]
    tokmask = jnp.repeat(blkmask, BS, axis=-1) & causal  # [B, G, S, S]
    s = jnp.einsum("bqrhd,bkrd->brhqk", q.reshape(B, S, HKV, g, D), k) * D**-0.5
    s = jnp.where(tokmask[:, :, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(tokmask[:, :, None], p, 0.0).mean(2)  # [B, G, S, S]
    t = p.reshape(B, HKV, S, nb, BS).sum(-1)  # [B, G, S, nb]
    kbar = ki.reshape(B, nb, BS, DI).mean(2)
    csum = jnp.cumsum(ki.reshape(B, nb, BS, DI), axis=2) / jnp.arange(1, BS + 1, dtype=dt)[None, None, :, None]
    kloc = csum.reshape(B, S, DI)
    z = jnp.einsum("bird,bnd->brin", qi, kbar)
    zl = jnp.einsum("bird,bid->bri", qi, kloc)
    own = (pos // BS)[:, None] == jnp.arange(nb)[None, :]
    z = jnp.where(own[None, None], zl[..., None], z) * DI**-0.5
    if pooling == "max":
        st = jnp.einsum("bird,bjd->brij", qi, ki) * DI**-0.5
        st = jnp.where(causal, st, -jnp.inf)
        z = st.reshape(B, HKV, S, nb, BS).max(-1)
    z = jnp.where(blkmask, z, -jnp.inf)
    logp = jnp.where(blkmask, jax.nn.log_softmax(z, -1), 0.0)
    ok = blkmask & (t > 0)
    kl = jnp.where(ok, t * (jnp.log(jnp.where(ok, t, 1.0)) - logp), 0.0)
    return kl.sum() / (B * S * HKV)


def _row_blocks(qi, ki, top_k=TOPK, full=False, pooling="mean"):
    nb = S // BS
    if full:
        blk = np.tril(np.ones((nb, nb), bool))[None, None].repeat(B, 0).repeat(HKV, 1)
    else:
        sel = select_blocks(qi, index_keys(ki, BS, pooling), jnp.arange(S), block_size=BS, top_k=top_k,
                            pooling=pooling)
        blk = np.asarray(selection_block_map(sel, nb))
    return jnp.asarray(np.repeat(blk, BS, axis=2))  # [B, G, S, nb]


CFG = MSAConfig(top_k=TOPK, ring=RingOptions(impl="xla"), layout="contiguous")


@functools.partial(jax.jit, static_argnames=("warmup",))
def _msa(q, k, v, qi, ki, warmup=False):
    """One-device MSA with :data:`CFG`, jitted (eager shard_map / lax.map is slow on CPU)."""
    return msa_attention(q, k, v, qi, ki, None, CFG, warmup=warmup)


def test_msa_one_device_forward_and_gradients_match_masked_reference():
    q, k, v, qi, ki = _inputs(0)
    mask = _token_mask(qi, ki)
    out, aux = _msa(q, k, v, qi, ki)
    chex.assert_trees_all_close(out, _ref_out(q, k, v, mask), atol=2e-5, rtol=2e-5)
    do = jax.random.normal(jax.random.PRNGKey(9), out.shape)
    f = lambda *a: jnp.sum(msa_attention(*a, qi, ki, None, CFG)[0] * do)  # noqa: E731
    r = lambda *a: jnp.sum(_ref_out(*a, mask) * do)  # noqa: E731
    chex.assert_trees_all_close(jax.jit(jax.grad(f, (0, 1, 2)))(q, k, v), jax.jit(jax.grad(r, (0, 1, 2)))(q, k, v),
                                atol=5e-5, rtol=5e-5)
    nb = S // BS
    want_wf = sum(min(TOPK, i + 1) for i in range(nb)) / (nb * (nb + 1) / 2)
    np.testing.assert_allclose(float(aux.work_fraction), want_wf, rtol=1e-6)
    assert 0.0 < float(aux.recall) <= 1.0 + 1e-6
    # the monitoring-only recall under a traced flag (the trainer's logging steps): same or NaN
    g = jax.jit(lambda m: msa_attention(q, k, v, qi, ki, None, CFG, metrics=m)[1])
    on, off = g(True), g(False)
    np.testing.assert_allclose(float(on.recall), float(aux.recall), rtol=1e-6)
    assert np.isnan(float(off.recall))
    np.testing.assert_allclose([float(off.kl), float(off.work_fraction)], [float(aux.kl), float(aux.work_fraction)],
                               rtol=1e-6)


def test_msa_warmup_is_dense_attention_and_full_support_kl():
    q, k, v, qi, ki = _inputs(1)
    out, aux = _msa(q, k, v, qi, ki, warmup=True)
    chex.assert_trees_all_close(out, dense_attention(q, k, v)[0], atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(float(aux.work_fraction), 1.0)
    np.testing.assert_allclose(float(aux.kl), float(_ref_kl(q, k, qi, ki, _row_blocks(qi, ki, full=True))),
                               rtol=1e-4, atol=1e-6)
    # a traced flag selects the same branches
    f = jax.jit(lambda w: msa_attention(q, k, v, qi, ki, None, CFG, warmup=w))
    o_t, a_t = f(jnp.bool_(True))
    chex.assert_trees_all_close((o_t, a_t.kl), (out, aux.kl), atol=1e-6, rtol=1e-6)
    o_f, a_f = f(jnp.bool_(False))
    chex.assert_trees_all_close(o_f, _msa(q, k, v, qi, ki)[0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("full,pooling", [(False, "mean"), (True, "mean"), (False, "max"), (True, "max")])
def test_msa_kl_value_and_gradients_match_float64_reference(full, pooling):
    q, k, v, qi, ki = _inputs(2)
    blk = _row_blocks(qi, ki, full=full, pooling=pooling)
    cfg = MSAConfig(top_k=TOPK, ring=RingOptions(impl="xla"), layout="contiguous", pooling=pooling)

    def kl_of(q, k, v, qi, ki):
        return msa_attention(q, k, v, qi, ki, None, cfg, warmup=full)[1].kl

    val, grads = jax.jit(jax.value_and_grad(kl_of, argnums=(0, 1, 2, 3, 4)))(q, k, v, qi, ki)
    c = lambda x: jnp.asarray(x, jnp.float64)  # noqa: E731  (x64 is on: tests/conftest.py)
    ref = jax.jit(jax.value_and_grad(lambda *a: _ref_kl(*a, pooling=pooling), argnums=(2, 3)))
    r_val, r_g = ref(c(q), c(k), c(qi), c(ki), blk)
    r_val, r_g = float(r_val), [np.asarray(g) for g in r_g]
    np.testing.assert_allclose(float(val), r_val, rtol=1e-4)
    for got, want in zip(grads[3:], r_g):
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-3, atol=2e-6)
        assert np.abs(want).max() > 0
    for g in grads[:3]:  # the teacher (main branch) gets zero gradient
        assert float(jnp.abs(g).max()) == 0.0


@pytest.mark.parametrize("layout,shape,pooling", [("block_striped", (2, 2), "mean"), ("zigzag", (1, 4), "mean"),
                                                  ("contiguous", (1, 2), "mean"), ("block_striped", (1, 4), "max")])
def test_msa_shard_map_layouts_match_one_device(layout, shape, pooling):
    """Under shard_map (sparse ring, per-step StepIndex), in layout order: output, gradients, KL
    and its index-branch gradients equal the one-device masked reference."""
    q, k, v, qi, ki = _inputs(3)
    P = shape[0] * shape[1]
    mesh = make_mesh(shape, jax.devices()[:P])
    lay = Layout(layout, S, P, stripe=BS)
    cfg = MSAConfig(top_k=TOPK, ring=RingOptions(ring_order="hierarchical", impl="xla"), layout=layout,
                    pooling=pooling)
    one = MSAConfig(top_k=TOPK, ring=RingOptions(impl="xla"), layout="contiguous", pooling=pooling)
    laid = [lay.permute(x) for x in (q, k, v, qi, ki)]
    mask = _token_mask(qi, ki, pooling=pooling)
    do = jax.random.normal(jax.random.PRNGKey(4), q.shape)

    def loss(q, k, v, qi, ki):
        out, aux = msa_attention(q, k, v, qi, ki, mesh, cfg, positions=jnp.asarray(lay.perm))
        return jnp.sum(out * lay.permute(do)) + aux.kl, (out, aux)

    (l, (out, aux)), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(*laid)
    chex.assert_trees_all_close(lay.unpermute(out), _ref_out(q, k, v, mask), atol=2e-5, rtol=2e-5)
    r = lambda *a: jnp.sum(_ref_out(*a, mask) * do)  # noqa: E731
    want = jax.grad(r, (0, 1, 2))(q, k, v)
    chex.assert_trees_all_close(tuple(lay.unpermute(x) for x in g[:3]), want, atol=5e-5, rtol=5e-5)
    _, a1 = jax.jit(lambda *a: msa_attention(*a, None, one))(q, k, v, qi, ki)
    np.testing.assert_allclose(float(aux.kl), float(a1.kl), rtol=1e-5)
    np.testing.assert_allclose(float(aux.work_fraction), float(a1.work_fraction), rtol=1e-6)
    gi = jax.jit(jax.grad(lambda qi, ki: msa_attention(q, k, v, qi, ki, None, one)[1].kl, (0, 1)))(qi, ki)
    chex.assert_trees_all_close(tuple(lay.unpermute(x) for x in g[3:]), gi, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("selection,layout,shape", [("causal", "contiguous", None), ("causal", "zigzag", (1, 4)),
                                                    ("block_mean", "contiguous", None)])
def test_msa_output_before_t_ignores_every_input_from_t_on(selection, layout, shape):
    """Causality of the whole MSA layer: q, k, v and the index queries / keys replaced from position
    ``t`` (inside a query block) on leave every output row before ``t`` bit-identical with the
    default ``selection="causal"``, on one device and under shard_map. ``"block_mean"`` ranks
    candidates with later rows of the block: there the same change moves earlier rows' outputs."""
    q, k, v, qi, ki = _inputs(5)
    late = [jnp.where((jnp.arange(S) >= 200).reshape((1, S) + (1,) * (x.ndim - 2)), y, x)
            for x, y in zip((q, k, v, qi, ki), _inputs(6))]
    cfg = MSAConfig(top_k=TOPK, ring=RingOptions(impl="xla"), layout=layout, selection=selection)
    mesh = None if shape is None else make_mesh(shape, jax.devices()[:shape[0] * shape[1]])
    lay = cfg.make_layout(S, 1 if shape is None else shape[0] * shape[1])
    run = jax.jit(lambda *a: lay.unpermute(msa_attention(*(lay.permute(x) for x in a), mesh, cfg,
                                                         positions=jnp.asarray(lay.perm))[0]))
    a, b = np.asarray(run(q, k, v, qi, ki)), np.asarray(run(*late))
    assert np.abs(a[:, 200:] - b[:, 200:]).max() > 1e-2  # the change reaches the later rows
    if selection == "causal":
        np.testing.assert_array_equal(a[:, :200], b[:, :200])
    else:
        assert np.abs(a[:, :200] - b[:, :200]).max() > 1e-3


def test_msa_config_and_input_errors():
    with pytest.raises(ValueError, match="top_k"):
        MSAConfig(top_k=0)
    with pytest.raises(ValueError, match="block_size"):
        MSAConfig(block_size=128)
    with pytest.raises(ValueError, match="layout"):
        MSAConfig(layout="token_striped")
    with pytest.raises(ValueError, match="selection must be one of .*'first'"):
        MSAConfig(selection="first")
    q, k, v, qi, ki = _inputs(0)
    with pytest.raises(ValueError, match="q_idx"):
        msa_attention(q, k, v, qi[:, :, :1], ki, None, CFG)
    with pytest.raises(ValueError, match="k_idx"):
        msa_attention(q, k, v, qi, ki[..., :3], None, CFG)


def test_kl_teacher_in_half_precision_equals_float32_of_the_same_values():
    """bf16 q / k: the teacher's scores are bf16 products accumulated in float32 (tensor cores on a
    GPU), the same KL as the float32 computation on the same (bf16-rounded) values."""
    from mtraining_jax.attention.msa_kl import msa_kl_sum

    q, k, _, qi, ki = _inputs(5)
    pos = jnp.arange(S)
    sel = select_blocks(qi, index_keys(ki, BS), pos, block_size=BS, top_k=TOPK)
    f = jax.jit(lambda q, k: msa_kl_sum(q, k, pos, qi, index_keys(ki, BS), ki, sel, block_size=BS))
    qb, kb = q.astype(jnp.bfloat16), k.astype(jnp.bfloat16)
    got, want = float(f(qb, kb)), float(f(qb.astype(jnp.float32), kb.astype(jnp.float32)))
    assert want > 0
    np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("chunks", [1, 3, 8])
def test_warmup_kl_groups_equal_the_full_support_kl(chunks):
    """The warm-up KL in query-block groups (each against the key blocks it can see) equals
    :func:`msa_kl_sum` with ``K = nb`` for every block: value and index-branch gradients, any number
    of groups (uneven ones too), local blocks out of order (a zigzag rank)."""
    from mtraining_jax.attention.msa_kl import msa_kl_sum, warmup_kl_sum
    from mtraining_jax.sparsity.msa_select import full_selection

    q, k, v, qi, ki = _inputs(5)
    lay = Layout("zigzag", S, 2, stripe=BS)  # rank 1 of 2: blocks 2, 3, 4, 5 of 8 (the middle)
    table = lay.positions[:, ::BS] // BS
    rows = jnp.asarray(lay.positions[1])
    ql, qil, kil = (jnp.take(x, rows, axis=1) for x in (q, qi, ki))
    kbar = index_keys(ki, BS)

    def full(qil, kbar, kil):
        sup = full_selection(B, HKV, rows, S, BS)
        return msa_kl_sum(ql, k, rows, qil, kbar, kil, sup, block_size=BS)

    def grouped(qil, kbar, kil):
        return warmup_kl_sum(ql, k, rows, qil, kbar, kil, table, rank=jnp.int32(1), block_size=BS, chunks=chunks)

    want, gw = jax.jit(jax.value_and_grad(full, (0, 1, 2)))(qil, kbar, kil)
    got, gg = jax.jit(jax.value_and_grad(grouped, (0, 1, 2)))(qil, kbar, kil)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    assert float(want) > 0
    chex.assert_trees_all_close(gg, gw, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("layout,shape", [("zigzag", (1, 4)), ("block_striped", (2, 2))])
def test_msa_warmup_under_shard_map_matches_the_float64_reference(layout, shape):
    """Warm-up across ranks (each rank's grouped full-support KL): the KL and its index-branch
    gradients equal the one-device float64 dense reference."""
    q, k, v, qi, ki = _inputs(6)
    P = shape[0] * shape[1]
    mesh = make_mesh(shape, jax.devices()[:P])
    lay = Layout(layout, S, P, stripe=BS)
    cfg = MSAConfig(top_k=TOPK, ring=RingOptions(ring_order="hierarchical", impl="xla"), layout=layout)

    def kl(qi, ki):
        laid = [lay.permute(x) for x in (q, k, v, qi, ki)]
        return msa_attention(*laid, mesh, cfg, positions=jnp.asarray(lay.perm), warmup=True)[1].kl

    val, g = jax.jit(jax.value_and_grad(kl, (0, 1)))(qi, ki)
    c = lambda x: jnp.asarray(x, jnp.float64)  # noqa: E731
    r_val, r_g = jax.jit(jax.value_and_grad(_ref_kl, (2, 3)))(c(q), c(k), c(qi), c(ki), _row_blocks(qi, ki, full=True))
    np.testing.assert_allclose(float(val), float(r_val), rtol=1e-4)
    for got, want in zip(g, r_g):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-3, atol=2e-6)
