"""Numerical fidelity of the index estimate: top-p coverage within the stated resolution of a float64
Algorithm 1 at long lengths (mtraining_jax.sparsity.estimate's bound), and an index that does not
depend on how the program was compiled (eager / separate jits; on the GPU also impl pallas vs xla)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtraining_jax.attention.mtraining import MTrainingConfig, mtraining_attention
from mtraining_jax.mesh import make_mesh
from mtraining_jax.ring.config import RingOptions
from mtraining_jax.sparsity import SparsityConfig, estimate_index

EPS = 1e-6  # float32 logits / exp / division vs float64 (these inputs), as a fraction of the mass


def _long_inputs(S, D=64, seed=0):
    rng = np.random.default_rng(seed)  # diffuse heads: a long tail of tiny probabilities
    q = (rng.standard_normal((1, S, 1, D)) * 3.0).astype(np.float32)
    k = rng.standard_normal((1, S, 1, D)).astype(np.float32)
    return q, k


def _float64_masses(q, k, lq, bs):
    """Float64 Algorithm 1: per-key column mass and per-diagonal mass of the last ``lq`` rows."""
    S, D = q.shape[1], q.shape[3]
    qp = np.arange(S - lq, S)
    z = q[0, -lq:, 0].astype(np.float64) @ k[0, :, 0].astype(np.float64).T / np.sqrt(D)
    z[np.arange(S)[None, :] > qp[:, None]] = -np.inf
    a = np.exp(z - z.max(1, keepdims=True))
    a /= a.sum(1, keepdims=True)
    diag = np.zeros(S // bs)
    for r in range(lq):
        d = qp[r] // bs - np.arange(qp[r] + 1) // bs
        diag += np.bincount(d, weights=a[r, : qp[r] + 1], minlength=S // bs)
    return a.sum(0), diag


def _check_coverage(mass, sel, lq, p, F):
    """The module's bound: covers p (up to EPS), and without its weakest line falls short of
    ``p + (k + 1) 2^-F / last_q`` (the flooring of the k selected scores)."""
    cov = mass[sel].sum() / lq
    k = len(sel)
    assert cov >= p - EPS, f"coverage {cov:.6f} < p = {p} with {k} lines"
    assert (mass[sel].sum() - mass[sel].min()) / lq < p + (k + 1) * 2.0**-F / lq + EPS, (cov, k)


def test_top_p_coverage_at_one_million_tokens():
    S, lq, bs, p = 2**20, 16, 64, 0.9
    q, k = _long_inputs(S)
    cfg = SparsityConfig(last_q=lq, vertical_p=p, slash_p=p, vertical_min=1, vertical_max=S, slash_max=S // bs)
    idx = jax.tree.map(np.asarray, jax.jit(estimate_index, static_argnums=3)(q, k, jnp.arange(S), cfg))
    col, diag = _float64_masses(q, k, lq, bs)
    F = cfg.score_bits
    v_sel = idx.v_idx[0, 0, : idx.v_count[0, 0]]
    s_sel = idx.s_idx[0, 0, : idx.s_count[0, 0]]
    assert 1000 < len(v_sel) < S and 10 < len(s_sel) < S // bs  # caps not binding: top-p decides
    _check_coverage(col, v_sel, lq, p, F)
    _check_coverage(diag, s_sel, lq, p, F)


# ------------------------------------------------------------------ index independent of compilation

def _qk(B, S, Hq, Hkv, D, seed=0):
    kq, kk = jax.random.split(jax.random.PRNGKey(seed))
    q = jax.random.normal(kq, (B, S, Hq, D), jnp.float32) * 2.0
    k = jax.random.normal(kk, (B, S, Hkv, D), jnp.float32) * 2.0
    return q, k


def _same(a, b):
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _estimates_across_programs(q, k, cfg):
    """The index of the same q/k from: one jit, a second jit, a larger jitted program, eager."""
    S = q.shape[1]
    est = functools.partial(estimate_index, positions=jnp.arange(S), cfg=cfg)
    a = jax.jit(est)(q, k)
    b = jax.jit(lambda q, k: est(q, k))(q, k)
    c, _ = jax.jit(lambda q, k: (est(q, k), jnp.einsum("bshd,bshd->bh", q[:, :, :k.shape[2]], k)))(q, k)
    with jax.disable_jit():
        d = est(q, k)
    return a, b, c, d


def test_index_identical_across_jits_and_eager():
    q, k = _qk(1, 512, 2, 1, 64)
    a, *others = _estimates_across_programs(q, k, SparsityConfig(vertical_p=0.8, slash_p=0.8, vertical_max=128))
    for o in others:
        _same(a, o)


@pytest.mark.gpu
def test_index_identical_across_impls_and_jits_on_gpu():
    """16K tokens, B=2, 12/4 heads, p=0.8: the same index from every kernel impl (Triton, XLA, and
    on Hopper the Mosaic forward) inside mtraining_attention, from separate jits of the estimate
    and eagerly. bf16 q/k/v (the Mosaic kernels take no float32: with float32 inputs "auto" would
    be Triton and the Mosaic program never built); casts inside the program:
    ``test_index_programs.py``."""
    from pallas_kernels import registry

    q, k = (x.astype(jnp.bfloat16) for x in _qk(2, 16384, 12, 4, 128))
    v = k[..., ::-1]
    assert registry.resolve("auto", "fwd", q, 64, q.shape[1]) == "mosaic", "needs a Hopper GPU"
    cfg = SparsityConfig(vertical_p=0.8, slash_p=0.8)
    mesh = make_mesh((1, 1), jax.devices()[:1])
    idx = {}
    for impl in ("pallas", "xla", "auto"):
        mc = MTrainingConfig(sparsity=cfg, ring=RingOptions(impl=impl))
        lay = mc.make_layout(q.shape[1], 1)
        _, st = jax.jit(lambda q, k, v: mtraining_attention(q, k, v, mesh, mc, return_stats=True))(
            lay.permute(q), lay.permute(k), lay.permute(v))
        idx[impl] = st.index
    _same(idx["pallas"], idx["xla"])
    _same(idx["pallas"], idx["auto"])
    for o in _estimates_across_programs(q, k, cfg):
        _same(idx["pallas"], o)
