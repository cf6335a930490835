"""Attention dispatch (``mtraining_jax.attention.dispatch.attention``): backends agree, errors name the value."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtraining_jax.attention.dispatch import attention
from pallas_kernels.reference import dense_attention
from mtraining_jax.layouts import Layout


def _qkv(seed=0, b=2, s=32, hq=4, hkv=2, d=8, dtype=jnp.float32):
    r = np.random.RandomState(seed)
    return tuple(jnp.asarray(r.randn(b, s, h, d), dtype) for h in (hq, hkv, hkv))


def test_dispatch_reference_and_cudnn_agree_in_natural_order():
    q, k, v = _qkv()
    pos = jnp.arange(32, dtype=jnp.int32)
    ref = attention(q, k, v, pos, backend="reference")
    out = attention(q, k, v, pos, backend="cudnn")
    assert ref.dtype == q.dtype and ref.shape == q.shape
    chex.assert_trees_all_close(out, ref, atol=1e-5, rtol=1e-5)
    out_jit = jax.jit(lambda q, k, v, p: attention(q, k, v, p, backend="cudnn"))(q, k, v, pos)
    chex.assert_trees_all_close(out_jit, ref, atol=1e-5, rtol=1e-5)


def test_dispatch_reference_is_dense_attention_by_position():
    q, k, v = _qkv(1)
    perm = Layout("zigzag", 32, 4).perm
    out = attention(q, k, v, perm, backend="reference", sm_scale=0.3)
    ref, _ = dense_attention(q, k, v, perm, perm, sm_scale=0.3)
    chex.assert_trees_all_close(out, ref, atol=0, rtol=0)


def test_dispatch_cudnn_rejects_permuted_positions():
    q, k, v = _qkv()
    perm = Layout("zigzag", 32, 4).perm
    with pytest.raises(ValueError, match=r"arange\(S\).*positions\[4\] = 28, expected 4"):
        attention(q, k, v, perm, backend="cudnn")
    # traced positions cannot be checked at trace time: the result is poisoned instead
    out = jax.jit(lambda p: attention(q, k, v, p, backend="cudnn"))(jnp.asarray(perm))
    assert bool(jnp.all(jnp.isnan(out)))


def test_dispatch_errors():
    q, k, v = _qkv()
    pos = jnp.arange(32, dtype=jnp.int32)
    with pytest.raises(ValueError, match="'flash'"):
        attention(q, k, v, pos, backend="flash")
    with pytest.raises(ValueError, match="mesh"):
        attention(q, k, v, pos, backend="mtraining")
    with pytest.raises(ValueError, match="mesh"):
        attention(q, k, v, pos, backend="ring")
    with pytest.raises(ValueError, match=r"\[S\] = \[32\]"):
        attention(q, k, v, pos[:16], backend="reference")
    with pytest.raises(ValueError, match="multiple of KV heads"):
        attention(q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2), pos, backend="reference")


def test_traced_position_check_keeps_one_output_array(tmp_path):
    """Traced positions are checked by poisoning ``v``: the layer saves q and ONE output-sized array for
    the backward (a ``where`` on the output kept a second one per layer: 0.22 GiB at 128K, 0.5B shape),
    a right layout gives the reference's output, and a wrong one still makes every output row NaN."""
    from jax._src.ad_checkpoint import saved_residuals

    from mtraining_jax.attention.mtraining import MTrainingConfig
    from mtraining_jax.mesh import make_mesh
    from mtraining_jax.sparsity.config import SparsityConfig

    q, k, v = _qkv(3, b=1, s=64, d=32)
    cfg = MTrainingConfig(sparsity=SparsityConfig(block_size=16, last_q=16, vertical_min=0, vertical_max=4,
                                                  slash_min=8, slash_max=8))
    kw = {"mtraining": dict(mesh=make_mesh((1, 1), jax.devices()[:1]), mtraining=cfg), "cudnn": {}}
    for backend, n_out in (("mtraining", 2), ("cudnn", 0)):  # mtraining: q and the output; cudnn on CPU: XLA's
        perm = np.asarray(cfg.make_layout(64, 1).perm) if backend == "mtraining" else np.arange(64)
        f = lambda q, k, v, p: attention(q, k, v, p, backend=backend, **kw[backend]).sum()  # noqa: E731
        res = saved_residuals(f, q, k, v, jnp.asarray(perm, jnp.int32))
        shaped = [src for aval, src in res if aval.shape == q.shape]
        assert len(shaped) == n_out, (backend, shaped)
        run = jax.jit(lambda p: attention(q, k, v, p, backend=backend, **kw[backend]))
        chex.assert_trees_all_close(run(jnp.asarray(perm, jnp.int32)),
                                    attention(q, k, v, jnp.asarray(perm, jnp.int32), backend="reference"),
                                    atol=1e-5, rtol=1e-5)
        wrong = jnp.asarray(Layout("zigzag", 64, 4).perm, jnp.int32)
        out = run(wrong)
        assert bool(jnp.all(jnp.isnan(out))), backend
        # the query gradient is NaN too (the values' own gradient is the where's: zero)
        dq = jax.jit(jax.grad(lambda q, p: attention(q, k, v, p, backend=backend, **kw[backend]).sum()))(q, wrong)
        assert bool(jnp.all(jnp.isnan(dq))), backend
