"""benchmarks/deterministic_scatters.py: which scatters XLA's deterministic GPU mode serialises
(not unique, and not an associative combiner), and that a sparse training step has none of them but
the embedding's gradient (token ids repeat; the dense trainer has it too): every scatter the index
build, the kernels' index preparation and the backward's column gradients make declares unique
indices or combines with max."""

import jax
import jax.numpy as jnp
import pytest

from benchmarks.deterministic_scatters import main, serialised, serialised_scatters, step_scatters

TINY = "configs/tiny_cpu.yaml"
GPU_PROGRAM = ["model.dtype=bfloat16", "model.ring.impl=triton"]  # the kernels' path, traced as on a GPU


def _flags(fn, *args):
    found = []

    def walk(jx):
        for eqn in jx.eqns:
            if eqn.primitive.name.startswith("scatter"):
                found.append((eqn.primitive.name, serialised(eqn)))
            for p in eqn.params.values():
                if hasattr(p, "jaxpr") and hasattr(p.jaxpr, "eqns"):
                    walk(p.jaxpr)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


@pytest.mark.parametrize("fn, want", [
    (lambda x, i: x.at[i].add(1.0), [("scatter-add", True)]),  # float add, indices may repeat
    (lambda x, i: x.at[i].add(1.0, unique_indices=True), [("scatter-add", False)]),
    (lambda x, i: x.astype(jnp.int32).at[i].add(1), [("scatter-add", False)]),  # integer add: associative
    (lambda x, i: x.at[i].set(2.0), [("scatter", True)]),  # overwrite: the winner is unordered
    (lambda x, i: x.at[i].set(2.0, unique_indices=True), [("scatter", False)]),
    (lambda x, i: (x > 0).at[i].max(True), [("scatter-max", False)]),
    (lambda x, i: x.at[i].min(0.0), [("scatter-min", False)]),
    (lambda x, i: x.at[i].multiply(2.0), [("scatter-mul", True)]),
])
def test_serialised_follows_xlas_rule(fn, want):
    assert _flags(fn, jnp.zeros(8), jnp.array([1, 1, 3])) == want


def test_groups_count_nested_jaxprs():
    def f(x, i):
        y = jax.lax.scan(lambda c, _: (c.at[i].add(1.0), None), x, None, length=3)[0]
        return jax.jit(lambda y: y.at[i].set(0.0))(y)

    got = serialised_scatters(jax.make_jaxpr(f)(jnp.zeros(8), jnp.array([1, 1, 3])))
    assert sorted((g["primitive"], g["count"], g["shape"]) for g in got) == [("scatter", 1, [8]),
                                                                            ("scatter-add", 1, [8])]


def _only_the_embedding(groups, vocab=512, hidden=128):
    assert [(g["primitive"], g["shape"], g["count"]) for g in groups] == [("scatter-add", [vocab, hidden], 1)]


def test_sparse_ring_training_step_serialises_only_the_embedding_gradient():
    """tiny_cpu (2 x 4 mesh, MTraining in layers 1-3, the dense ring in layer 0), both K/V
    exchanges and backward rings."""
    _only_the_embedding(step_scatters(TINY, GPU_PROGRAM))
    _only_the_embedding(step_scatters(TINY, GPU_PROGRAM + ["model.ring.kv_exchange=sparse",
                                                          "model.ring.backward_ring=query"]))


def test_single_device_study_step_serialises_only_the_embedding_gradient():
    _only_the_embedding(step_scatters("configs/quality/mtraining.yaml",
                                      ["data.seq_len=2048", "model.ring.impl=triton"]), hidden=768)


@pytest.mark.parametrize("segments", [False, True])
def test_mosaic_index_preparation_has_no_serialised_scatter(segments):
    """The Mosaic kernels cannot be traced on a CPU (the training step tests above take the Triton
    path); their index preparation and both streams are plain JAX and are checked here."""
    import numpy as np

    from pallas_kernels import mosaic_index
    from pallas_kernels.testing import random_step_index

    rng = np.random.default_rng(0)
    S, B, H, Hkv, D = 512, 1, 4, 2, 64
    pos = jnp.arange(S, dtype=jnp.int32)
    idx = random_step_index(rng, B, H, S, S, pos, pos, max_blocks=5, max_cols=90)
    k = jnp.zeros((B, S, Hkv, D), jnp.bfloat16)
    segs = (pos[None] // 150, pos[None] // 150) if segments else None

    def build(idx, k, segs):
        ops = mosaic_index.prepare(idx, k, k, pos, 64, pos, segs)
        return ops, mosaic_index.pair_stream(ops, 2), mosaic_index.split_stream(ops)

    assert serialised_scatters(jax.make_jaxpr(build)(idx, k, segs)) == []


def test_msa_step_keeps_the_indexer_gather_transpose():
    """Known and left: MSA's indexer loss gathers selected block keys with clipped (repeating)
    ids; its gradient is a float scatter-add the deterministic mode serialises. Declaring that gather
    unique does not help: it runs under the ``lax.map`` over query blocks (vmapped in batches), and
    JAX drops ``unique_indices`` when it batches a gather from an unbatched operand (two query blocks
    may select one block); a one-hot matmul instead would add 2·K·nb·d FLOPs per query block and
    group (estimated ~2 % of the sparse attention at 128K, not measured)."""
    got = step_scatters("configs/tiny_cpu_msa.yaml", GPU_PROGRAM)
    assert sorted((g["primitive"], g["dtype"], len(g["shape"])) for g in got) == [
        ("scatter-add", "bfloat16", 2), ("scatter-add", "float32", 4)]


def test_main_prints_each_group_and_the_count(capsys):
    assert main(["--config", TINY] + sum((["--set", s] for s in GPU_PROGRAM), [])) == 0
    out = capsys.readouterr().out
    assert "scatter-add (512, 128) bfloat16" in out
    assert "1 serialised scatter(s) in the training gradient" in out
