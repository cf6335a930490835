"""Input holes closed at the entry points (issue 19): integer q/k/v, positions that are not a
permutation, checked by the one shared contract (:mod:`pallas_kernels.inputs`) before any work."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtraining_jax.attention.dispatch import attention
from mtraining_jax.attention.mtraining import MTrainingConfig, mtraining_attention
from mtraining_jax.ring.attention import ring_attention
from mtraining_jax.mesh import make_mesh
from mtraining_jax.sparsity import SparsityConfig, estimate_index
from pallas_kernels import api
from pallas_kernels.inputs import check_qkv
from pallas_kernels.reference import dense_attention

S, H, D = 128, 2, 64


def _qkv(dtype=jnp.float32):
    x = jnp.ones((1, S, H, D), dtype)
    return x, x, x


def _entry_points(mesh):
    pos = jnp.arange(S, dtype=jnp.int32)
    stat = jnp.zeros((1, H, S), jnp.float32)
    return {
        "kernel op": lambda q, k, v: api.block_sparse_attention(q, k, v, impl="xla"),
        # the raw passes with a narrower output / dQ: q's dtype is the one named, not out_dtype / dq_dtype
        "kernel fwd": lambda q, k, v: api.block_sparse_attention_fwd(q, k, v, pos, pos, None, impl="xla",
                                                                     out_dtype=q.dtype),
        "kernel bwd": lambda q, k, v: api.block_sparse_attention_bwd(
            q, k, v, pos, pos, None, q, stat, stat, impl="xla", dq_dtype=q.dtype),
        "reference": lambda q, k, v: dense_attention(q, k, v),
        "dispatch": lambda q, k, v: attention(q, k, v, pos, backend="reference"),
        "dense ring": lambda q, k, v: ring_attention(q, k, v, pos, mesh),
        "sparse ring": lambda q, k, v: mtraining_attention(q, k, v, mesh, MTrainingConfig(
            sparsity=SparsityConfig(vertical_min=1, last_q=16))),
        "estimate": lambda q, k, v: estimate_index(q, k, pos, SparsityConfig(vertical_min=1, last_q=16)),
    }


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_])
def test_non_float_qkv_rejected_everywhere_naming_the_dtype(dtype):
    mesh = make_mesh((1, 1), jax.devices()[:1])
    q, k, v = _qkv(dtype)
    for name, f in _entry_points(mesh).items():
        t0 = time.perf_counter()
        with pytest.raises(ValueError, match=f"floating-point.*{jnp.dtype(dtype).name}"):
            f(q, k, v)
        assert time.perf_counter() - t0 < 1.0, name


def test_float_inputs_still_pass_the_checker():
    for dt in (jnp.bfloat16, jnp.float16, jnp.float32):
        assert check_qkv(*_qkv(dt)) == 1
    q = jnp.ones((1, S, 4, D))
    assert check_qkv(q, jnp.ones((1, 2 * S, 2, D)), jnp.ones((1, 2 * S, 2, D)), same_seq=False) == 2
    with pytest.raises(ValueError, match="disagree on batch, sequence"):
        check_qkv(q, jnp.ones((1, 2 * S, 2, D)), jnp.ones((1, 2 * S, 2, D)))


@pytest.mark.parametrize("positions, missing", [
    (np.zeros(S, np.int32), 1),                                    # all zero
    (np.r_[np.arange(S - 1), S - 2].astype(np.int32), S - 1),      # a duplicate
    (np.arange(1, S + 1, dtype=np.int32), 0),                      # shifted
])
def test_positions_must_be_a_permutation(positions, missing):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=f"permutation of 0..{S - 1}.*position {missing} is missing"):
        attention(q, k, v, jnp.asarray(positions), backend="reference")
    perm = np.random.default_rng(0).permutation(S).astype(np.int32)  # any permutation is accepted
    out = attention(q, k, v, jnp.asarray(perm), backend="reference")
    assert out.shape == q.shape and bool(jnp.all(jnp.isfinite(out)))
    # under jit the positions are traced: the check cannot run, and does not break tracing
    jax.jit(lambda p: attention(q, k, v, p, backend="reference"))(jnp.asarray(perm))


def test_mixed_qkv_dtypes_rejected_everywhere_naming_each():
    """A bf16 q against float32 k / v: XLA would promote it, a GPU kernel fails inside its lowering."""
    mesh = make_mesh((1, 1), jax.devices()[:1])
    q, k, v = _qkv(jnp.bfloat16)
    for name, f in _entry_points(mesh).items():
        if name == "estimate":  # takes q and k only (k twice)
            with pytest.raises(ValueError, match="share one dtype; got q bfloat16, k float32"):
                estimate_index(q, k.astype(jnp.float32), jnp.arange(S), SparsityConfig(vertical_min=1, last_q=16))
            continue
        with pytest.raises(ValueError, match="share one dtype; got q bfloat16, k bfloat16, v float32"):
            f(q, k, v.astype(jnp.float32))


def _position_entry_points(mesh):
    """Every entry point that takes positions, called with ``pos`` as the (query) positions."""
    from mtraining_jax.ring.attention import ring_attention_shard

    q, k, v = _qkv()
    ok = jnp.arange(S, dtype=jnp.int32)
    lse = jnp.zeros((1, H, S), jnp.float32)

    def shard(pos):
        body = lambda q, k, v: ring_attention_shard(q, k, v, pos, ok, num_nodes=1, num_local=1)  # noqa: E731
        return jax.shard_map(body, mesh=mesh, in_specs=(jax.P(None, ("node", "local")),) * 3,
                             out_specs=jax.P(None, ("node", "local")), check_vma=False)(q, k, v)

    return {
        "kernel op": lambda pos: api.block_sparse_attention(q, k, v, q_pos=pos, impl="xla"),
        "kernel fwd": lambda pos: api.block_sparse_attention_fwd(q, k, v, pos, ok, None, impl="xla"),
        "kernel bwd": lambda pos: api.block_sparse_attention_bwd(q, k, v, pos, ok, None, q, lse, lse, impl="xla"),
        "reference": lambda pos: dense_attention(q, k, v, pos, ok),
        "dispatch": lambda pos: attention(q, k, v, pos, backend="reference"),
        "dense ring": lambda pos: ring_attention(q, k, v, pos, mesh),
        "ring shard": shard,
    }


@pytest.mark.parametrize("bad, message", [
    (jnp.arange(S, dtype=jnp.float32) * 1.5, "must be integers, got dtype float32"),  # would truncate to wrong tokens
    (jnp.arange(S - 1, dtype=jnp.int32), rf"has shape \({S - 1},\), expected \[S[ql]?\] = \[{S}\]"),
])
def test_bad_positions_rejected_everywhere(bad, message):
    mesh = make_mesh((1, 1), jax.devices()[:1])
    for name, f in _position_entry_points(mesh).items():
        with pytest.raises(ValueError, match=message):
            f(bad)
        # the same entry point with good positions runs (the error is about the positions, not the call)
        out = f(jnp.arange(S, dtype=jnp.int32))
        assert jax.tree.leaves(out)[0].shape[0] == 1, name


@pytest.mark.parametrize("impl", ["xla", "triton", "mosaic"])
@pytest.mark.parametrize("field, message", [
    ("do_shape", r"do must be an array of shape \(1, 128, 2, 64\), got \(1, 128, 1, 64\)"),
    ("do_dtype", "do must be floating-point, got dtype int32"),
    ("lse_transposed", r"lse must be an array of shape \(1, 2, 128\), got \(1, 128, 2\)"),
    ("delta_dtype", "delta must have dtype float32, got bfloat16"),
    ("dq_acc_dtype", "dq_acc must have dtype float32, got bfloat16"),
    ("dkv_acc_one", r"dkv_acc must be 2 float32 array\(s\)"),
    ("acc_dtype", r"acc\[1\] must have dtype float32, got bfloat16"),
])
def test_bad_backward_and_accumulator_operands_named_before_any_backend(impl, field, message):
    """The raw passes' operands (the ring's per-step calls): checked before a backend is chosen, so a
    transposed ``lse`` (which a kernel would read silently) or an integer ``dO`` is named the same on
    every backend (``mosaic`` here is on a CPU: the check comes before its NotImplementedError)."""
    q, k, v = _qkv(jnp.bfloat16)
    pos = jnp.arange(S, dtype=jnp.int32)
    lse = jnp.zeros((1, H, S), jnp.float32)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    bwd = dict(do=q, lse=lse, delta=lse, dq_acc=None, dkv_acc=None)
    if field == "acc_dtype":
        with pytest.raises(ValueError, match=message):
            api.block_sparse_attention_fwd(q, k, v, pos, pos, None, impl=impl, acc=(f32(q), lse.astype(jnp.bfloat16)))
        return
    bwd.update({"do_shape": dict(do=q[:, :, :1]), "do_dtype": dict(do=q.astype(jnp.int32)),
                "lse_transposed": dict(lse=lse.mT),
                "delta_dtype": dict(delta=lse.astype(jnp.bfloat16)), "dq_acc_dtype": dict(dq_acc=q),
                "dkv_acc_one": dict(dkv_acc=(f32(k),))}[field])
    with pytest.raises(ValueError, match=message):
        api.block_sparse_attention_bwd(q, k, v, pos, pos, None, bwd["do"], bwd["lse"], bwd["delta"], impl=impl,
                                       dq_acc=bwd["dq_acc"], dkv_acc=bwd["dkv_acc"])


@pytest.mark.parametrize("which", ["q_idx", "k_idx"])
def test_msa_index_branch_must_be_floating_point(which):
    """MSA's index branch (learned projections): an integer tensor would run as integer dot products."""
    from mtraining_jax.attention.msa import msa_attention

    q, k, v = _qkv()
    idx = {"q_idx": jnp.ones((1, S, H, 16)), "k_idx": jnp.ones((1, S, 16))}
    idx[which] = idx[which].astype(jnp.int32)
    with pytest.raises(ValueError, match=f"{which} must be floating-point, got dtype int32"):
        msa_attention(q, k, v, idx["q_idx"], idx["k_idx"])


@pytest.mark.parametrize("field, dtype", [("block_idx", jnp.float32), ("block_causal", jnp.bool_),
                                          ("col_count", jnp.float32)])
def test_step_index_fields_must_be_integers(field, dtype):
    """A float or bool index field would be cast or misread inside a kernel: named before any backend."""
    from pallas_kernels.testing import random_step_index

    q, k, v = _qkv()
    pos = jnp.arange(S, dtype=jnp.int32)
    idx = random_step_index(np.random.default_rng(0), 1, H, S, S, pos, pos, max_blocks=2, max_cols=8)
    api.block_sparse_attention(q, k, v, index=idx, impl="xla")  # the index as built is accepted
    bad = idx._replace(**{field: getattr(idx, field).astype(dtype)})
    for impl in ("xla", "triton", "mosaic"):
        with pytest.raises(ValueError, match=f"index.{field} must be integers, got dtype {jnp.dtype(dtype).name}"):
            api.block_sparse_attention(q, k, v, index=bad, impl=impl)


def test_a_float32_do_is_read_in_q_dtype_on_every_backend():
    """The Mosaic kernels read dO in q's dtype; the API casts it first, so the XLA twin computes the same."""
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal((1, S, h, D)), jnp.bfloat16) for h in (H, 1, 1))
    pos = jnp.arange(S, dtype=jnp.int32)
    out, lse = api.block_sparse_attention_fwd(q, k, v, pos, pos, None, impl="xla")
    do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    delta = api.attention_delta(out, do)
    grads = [api.block_sparse_attention_bwd(q, k, v, pos, pos, None, d, lse, delta, impl="xla")
             for d in (do, do.astype(jnp.bfloat16))]
    for a, b in zip(*grads):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
