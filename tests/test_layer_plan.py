"""Layer grouping into scans (:mod:`mtraining_jax.model.layer_plan`): the blocks cover every layer once and
in order; a repeated pattern of runs is traced once; outputs, gradients and per-layer statistics do not
depend on the grouping."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend.core import jaxprs_in_params
from hypothesis import given, settings
from hypothesis import strategies as st

from mtraining_jax.mesh import make_mesh
from mtraining_jax.model import qwen2
from mtraining_jax.model.config import ModelConfig
from mtraining_jax.model.layer_plan import backend_segments, layer_blocks

D, S = "cudnn", "mtraining"


def _expand(blocks):
    keys = []
    for start, reps, pattern in blocks:
        assert start == len(keys)
        for _ in range(reps):
            for offset, length, key in pattern:
                assert offset == sum(n for _, n, _ in pattern[:pattern.index((offset, length, key))])
                keys += [key] * length
    return tuple(keys)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=40))
def test_blocks_cover_the_layers_in_order(keys):
    keys = tuple(keys)
    blocks = layer_blocks(keys)
    assert _expand(blocks) == keys
    for _, reps, pattern in blocks:
        assert reps >= 1 and all(length >= 1 for _, length, _ in pattern)
        if reps > 1:  # only patterns of several runs repeat; a single run is one scan already
            assert len(pattern) >= 2
        else:
            assert len(pattern) == 1
    # never more scans than the runs would need
    assert sum(len(p) for _, _, p in blocks) <= len(backend_segments(keys))


def test_blocks_of_common_recipes():
    every_fourth = (D, S, S, S) * 6  # Qwen2.5-0.5B, dense_layers [0, 4, ..., 20]
    assert layer_blocks(every_fourth) == ((0, 6, ((0, 1, D), (1, 3, S))),)
    first_two = (D, D) + (S,) * 22  # configs/qwen2.5-0.5b-128k.yaml: no repetition, the two runs
    assert layer_blocks(first_two) == ((0, 1, ((0, 2, D),)), (2, 1, ((0, 22, S),)))
    head = (D, S, S, S) * 3 + (S,) * 12  # dense_layers [0, 4, 8] of 24
    assert layer_blocks(head) == ((0, 3, ((0, 1, D), (1, 3, S))), (12, 1, ((0, 12, S),)))
    assert layer_blocks((S,) * 5) == ((0, 1, ((0, 5, S),)),)


TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_heads=4, num_kv_heads=2,
            rope_theta=1e4, max_position_embeddings=512, initializer_range=0.2)


def _segments_only(keys):
    return tuple((a, 1, ((0, b - a, k),)) for a, b, k in backend_segments(keys))


def _loss_grads_and_eqns(cfg, tokens, positions, state=None, mesh=None):
    model = qwen2.Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0))
    if state is not None:
        nnx.update(model, state)
    graphdef, state = nnx.split(model)
    w = jnp.asarray(np.random.RandomState(7).randn(*tokens.shape, cfg.vocab_size), jnp.float32)

    def loss(st_):
        m = nnx.merge(graphdef, st_)
        h, stats = m(tokens, positions, mesh=mesh, return_stats=True)
        logits = jnp.einsum("bsh,hv->bsv", h, m.lm_head_weight().astype(h.dtype))
        return jnp.sum(logits * w.astype(h.dtype)), stats

    f = jax.value_and_grad(loss, has_aux=True)
    jaxpr = jax.make_jaxpr(f)(state)

    def count(jx):
        n = 0
        for e in jx.eqns:
            n += e.primitive.name == "dot_general"
            for sub in jaxprs_in_params(e.params):
                n += count(sub)
        return n

    (value, stats), grads = jax.jit(f)(state)
    return value, stats, grads, count(jaxpr.jaxpr), state


def test_repeated_pattern_is_traced_once_and_exact(monkeypatch):
    """Six layers alternating two remat policies (the keys (reference, save_attn), (reference, full)):
    one scan over three repeats holds each body once, a third of the matmuls of one scan per run, and
    gives the loss and gradients of the run-by-run scans and of the unrolled loop to 1e-12 in float64."""
    cfg = ModelConfig(**TINY, num_layers=6, dtype="float64", param_dtype="float64", remat="selective",
                      remat_save_layers=(0, 2, 4))
    keys = tuple(zip(cfg.layer_backends, cfg.layer_remats))
    assert layer_blocks(keys)[0][1] == 3
    t, pos = jnp.asarray(np.random.RandomState(0).randint(0, 96, (1, 16)), jnp.int32), jnp.arange(16, dtype=jnp.int32)
    v, _, g, n_blocks, state = _loss_grads_and_eqns(cfg, t, pos)
    v_loop, _, g_loop, _, _ = _loss_grads_and_eqns(cfg.replace(scan_layers=False), t, pos, state)
    monkeypatch.setattr(qwen2, "layer_blocks", _segments_only)
    v_seg, _, g_seg, n_segments, _ = _loss_grads_and_eqns(cfg, t, pos, state)
    assert 3 * n_blocks <= n_segments + 20, (n_blocks, n_segments)  # + the embedding / head matmuls
    for other, g_other in ((v_seg, g_seg), (v_loop, g_loop)):
        np.testing.assert_allclose(v, other, rtol=1e-12)
        chex.assert_trees_all_close(g, g_other, atol=1e-12, rtol=1e-12)


@pytest.mark.slow(seconds=20)
def test_sparse_layer_statistics_keep_layer_order(monkeypatch):
    """(dense, MTraining, MTraining) x 2 (dense_layers (0, 3)) on a 1x2 mesh, float64: the per-layer work
    fractions and imbalances come out in layer order ([repeats, 2] flattened), equal to the unrolled loop's,
    and so do the loss and gradients."""
    cfg = ModelConfig(**TINY, num_layers=6, head_dim=32, attention_backend="mtraining", attention_impl="xla",
                      dtype="float64", param_dtype="float64",
                      dense_layers=(0, 3), dense_backend="reference", layout="block_striped",
                      sparsity=dict(block_size=16, last_q=16, vertical_min=0, vertical_max=4, slash_max=2,
                                    vertical_p=0.5, slash_p=0.5))
    assert layer_blocks(tuple(zip(cfg.layer_backends, cfg.layer_remats)))[0][1] == 2
    mesh = make_mesh((1, 2), jax.devices()[:2])
    n = 128
    from mtraining_jax.attention.mtraining import MTrainingConfig
    from mtraining_jax.sparsity.config import SparsityConfig

    lay = MTrainingConfig(sparsity=SparsityConfig(**cfg.sparsity)).make_layout(n, 2)
    tokens = lay.permute(jnp.asarray(np.random.RandomState(3).randint(0, 96, (1, n)), jnp.int32))
    pos = jnp.asarray(lay.perm)
    v, stats, g, _, state = _loss_grads_and_eqns(cfg, tokens, pos, mesh=mesh)
    v_loop, stats_loop, g_loop, _, _ = _loss_grads_and_eqns(cfg.replace(scan_layers=False), tokens, pos, state, mesh)
    assert stats and all(s.shape == (4,) for s in stats.values())
    chex.assert_trees_all_close(stats, stats_loop, atol=1e-12)
    assert len(set(np.asarray(stats["work_fraction"]).tolist())) == 4  # four different layers: the order is tested
    np.testing.assert_allclose(v, v_loop, rtol=1e-10)
    chex.assert_trees_all_close(g, g_loop, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("remat, dense_layers", [("save_attn", (0,)), ("full", (0, 3)), ("selective", ())])
def test_runs_read_their_layers_without_copying_the_weights(remat, dense_layers):
    """A run that is not the whole stack (one dense layer, then the rest; a pattern repeated twice) reads
    its layers from the stacked weights: no weight of any layer is among the residuals the backward keeps
    (a slice ``stacked[a:b]`` was: 1.3 GiB of float32 weights in the Qwen2.5-0.5B step at 128K)."""
    from jax._src.ad_checkpoint import saved_residuals

    cfg = ModelConfig(**TINY, num_layers=6, remat=remat, dense_layers=dense_layers, attention_backend="reference",
                      dense_backend="cudnn", **({"remat_save_layers": (0, 2, 4)} if remat == "selective" else {}))
    keys = tuple(zip(cfg.layer_backends, cfg.layer_remats))
    assert len(layer_blocks(keys)[0][2]) >= 2 or len(layer_blocks(keys)) >= 2  # at least one partial run
    model = qwen2.Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    weight_shapes = {tuple(x.shape[1:]) for x in jax.tree.leaves(nnx.split(model.layers)[1]) if x.ndim == 3}
    assert (32, 48) in weight_shapes
    t, pos = jnp.zeros((1, 24), jnp.int32), jnp.arange(24, dtype=jnp.int32)
    loss = lambda st: nnx.merge(graphdef, st)(t, pos).sum()  # noqa: E731
    res = saved_residuals(loss, state)
    kept = [(a.shape, src) for a, src in res if a.ndim >= 2 and tuple(a.shape[-2:]) in weight_shapes
            and not src.startswith("from the argument")]
    assert not kept, kept


def test_runs_share_one_weight_gradient_buffer():
    """Partial runs (two dense layers, then the rest; a dense layer every fourth) add their layers' weight
    gradients to one buffer: the compiled step's temporary memory stays within a quarter of the stacked
    weights of the one-run program's (a run accumulating its own ``[n_layers, ...]`` gradient from zeros,
    summed at the end, held one more full float32 copy per run: 1.8 GiB of the Qwen2.5-0.5B step's peak),
    with the unrolled loop's gradients."""
    cfg = ModelConfig(vocab_size=128, hidden_size=256, intermediate_size=1024, num_heads=4, num_kv_heads=2,
                      num_layers=8, remat="save_attn", attention_backend="reference", dense_backend="cudnn",
                      param_dtype="float32", dtype="float32")
    t, pos = jnp.asarray(np.random.RandomState(0).randint(0, 128, (1, 32)), jnp.int32), jnp.arange(32, dtype=jnp.int32)
    state0 = nnx.split(qwen2.Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0)))[1]
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(state0["layers"]))
    temp = {}
    for dense in ((), (0, 1), (0, 4)):
        c = cfg.replace(dense_layers=dense)
        graphdef = nnx.split(qwen2.Qwen2ForCausalLM(c, rngs=nnx.Rngs(0)))[0]
        loss = lambda st, g=graphdef: nnx.merge(g, st)(t, pos).astype(jnp.float32).std()  # noqa: E731
        step = jax.jit(jax.value_and_grad(loss))
        temp[dense] = step.lower(state0).compile().memory_analysis().temp_size_in_bytes
        if dense:
            blocks = layer_blocks(tuple(zip(c.layer_backends, c.layer_remats)))
            assert len(blocks) >= 2 or blocks[0][1] >= 2  # partial runs: several blocks, or a repeated pattern
            unrolled = c.replace(scan_layers=False)
            g_loop = nnx.split(qwen2.Qwen2ForCausalLM(unrolled, rngs=nnx.Rngs(0)))[0]
            ref = jax.value_and_grad(lambda st: nnx.merge(g_loop, st)(t, pos).astype(jnp.float32).std())
            want = jax.jit(ref)(state0)
            chex.assert_trees_all_close(step(state0), want, atol=2e-6, rtol=1e-4)
    for dense in ((0, 1), (0, 4)):
        assert temp[dense] <= temp[()] + weight_bytes / 4, (dense, temp, weight_bytes)
