"""The vertical-slash index is a function of the bf16 VALUES of q/k alone (issue 35): the same bits
in every program that builds it (forward, forward + backward, a rematerialized forward, any kernel
impl, the estimate alone, op-by-op), with q/k/v given in float32 and cast to bf16 INSIDE the
program as a model's projections do.

Two mechanisms (:mod:`mtraining_jax.sparsity.estimate`), each tested on its own here:

* the inputs are rounded to their storage dtype with ``reduce_precision``, which XLA keeps in the
  optimized program (a convert pair ``f32 -> bf16 -> f32`` may be dropped under excess precision:
  on an H100 that changed 19,001 index entries between programs);
* the logits are exact integer sums of digit products, so their bits do not depend on the
  summation order (dot algorithm, tiling) — checked by reordering the contraction.

The GPU test (``pytest -m gpu``) repeats the program comparison at 16K and 128K tokens with the
XLA, Triton and Mosaic kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtraining_jax.attention.mtraining import MTrainingConfig, mtraining_attention
from mtraining_jax.mesh import make_mesh
from mtraining_jax.ring.config import RingOptions
from mtraining_jax.sparsity import SparsityConfig, estimate_index
from mtraining_jax.sparsity.exact_logits import digit_plan, operand_digits, window_logits
from pallas_kernels.rounding import storage_round
from mtraining_jax.sparsity.synthetic import SyntheticAttention, synthetic_qk

BF16 = jnp.bfloat16
CFG = SparsityConfig(vertical_p=0.8, slash_p=0.8, vertical_min=4, vertical_max=512, slash_max=16)


def _inputs(seed, B, S, HQ, HKV, D):
    """float32 q/k with vertical-slash structure (:mod:`~mtraining_jax.sparsity.synthetic`: a
    sink, heavy keys, RoPE), random v and cotangent."""
    qs, ks = zip(*(synthetic_qk(SyntheticAttention(seq_len=S, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D,
                                                   seed=seed + b)) for b in range(B)))
    kv, kc = jax.random.split(jax.random.PRNGKey(seed))
    v = jax.random.normal(kv, (B, S, HKV, D), jnp.float32)
    cot = jax.random.normal(kc, (B, S, HQ, D), jnp.float32)
    return jnp.concatenate(qs), jnp.concatenate(ks), v, cot


def _index_programs(mesh, impls, cfg, cot, remat_impls=()):
    """``{name: f(q, k, v) -> VerticalSlashIndex}``: jitted programs that cast float32 q/k/v to
    bf16 inside and return the index they built (inputs in the layout of ``cfg``)."""

    def attn(impl):
        mcfg = MTrainingConfig(sparsity=cfg, ring=RingOptions(impl=impl))
        return lambda q, k, v: mtraining_attention(q.astype(BF16), k.astype(BF16), v.astype(BF16), mesh, mcfg,
                                                   return_stats=True)

    def grad_program(f):
        def loss(q, k, v):
            out, stats = f(q, k, v)
            return jnp.sum(out.astype(jnp.float32) * cot), stats.index

        return jax.jit(lambda q, k, v: jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)[1])

    progs = {}
    for impl in impls:
        progs[f"{impl} forward"] = jax.jit(lambda q, k, v, f=attn(impl): f(q, k, v)[1].index)
        progs[f"{impl} forward+backward"] = grad_program(attn(impl))
    for impl in remat_impls:
        progs[f"{impl} remat forward+backward"] = grad_program(
            jax.checkpoint(attn(impl), policy=jax.checkpoint_policies.nothing_saveable))
    return progs


def _assert_same_index(got: dict, ref):
    for name, idx in got.items():
        for field, a, b in zip(ref._fields, idx, ref):
            a, b = np.asarray(a), np.asarray(b)
            n = int((a != b).sum())
            assert n == 0, f"{name}: {field} differs from the reference index in {n} entries"


# --------------------------------------------------------------------------------------------- CPU
def test_index_is_bit_identical_in_every_program():
    """Eight programs (the estimate op by op, the estimate jitted, forward / forward+backward with
    the XLA twin and with the Triton kernels in interpret mode, a ``jax.checkpoint`` recompute) and
    three more with the estimate's Triton window kernels (``estimate_impl="triton"``, interpret mode)
    on a two-rank mesh: every field of every index equal, bit for bit."""
    B, S, HQ, HKV, D = 1, 1024, 4, 2, 64
    q, k, v, cot = _inputs(0, B, S, HQ, HKV, D)
    mesh = make_mesh((1, 2), jax.devices()[:2])
    lay = MTrainingConfig(sparsity=CFG).make_layout(S, 2)
    lq, lk, lv, lcot = (lay.permute(x) for x in (q, k, v, cot))
    pos = jnp.asarray(lay.perm)
    with jax.disable_jit():  # op by op: no fusion at all
        ref = estimate_index(q.astype(BF16), k.astype(BF16), jnp.arange(S), CFG)
    got = {"estimate, jitted, laid out": jax.jit(lambda a, b: estimate_index(a.astype(BF16), b.astype(BF16), pos,
                                                                             CFG))(lq, lk)}
    progs = _index_programs(mesh, ["xla", "triton"], CFG, lcot, remat_impls=["xla"])
    assert len(progs) == 5
    got.update({name: f(lq, lk, lv) for name, f in progs.items()})
    # the estimate's window kernels (interpret mode) inside the attention's shard_map: the same integers
    kcfg = dataclasses.replace(CFG, estimate_impl="triton")
    kprogs = _index_programs(mesh, ["xla"], kcfg, lcot, remat_impls=["xla"])
    got.update({f"{name}, estimate_impl=triton": f(lq, lk, lv) for name, f in kprogs.items()})
    _assert_same_index(got, ref)
    # a genuinely sparse index, and the comparison can fail: the index of the float32 values
    # (what a program whose casts XLA dropped would see without the storage rounding) differs
    counts = np.asarray(ref.v_count)
    assert 4 <= counts.min() and counts.max() < 512 and len(set(counts.ravel().tolist())) > 1
    f32 = estimate_index(q, k, jnp.arange(S), CFG)
    assert sum(int((np.asarray(a) != np.asarray(b)).sum()) for a, b in zip(f32, ref)) > 0


@pytest.mark.parametrize("S", [16384, pytest.param(131072, marks=pytest.mark.slow(seconds=31))])
def test_index_is_bit_identical_in_every_program_at_length(S):
    """The issue's lengths on the CPU: the estimate op by op, jitted, jitted on laid-out inputs, inside
    a differentiated program that also uses the bf16 q/k, and inside its ``jax.checkpoint`` recompute
    (q/k cast to bf16 inside each): every field equal, bit for bit. (The attention programs of the
    test above at these lengths run on the GPU: ``test_index_is_bit_identical_across_gpu_programs``.)"""
    q, k, _, _ = _inputs(1, 1, S, 2, 1, 64)
    pos = jnp.arange(S, dtype=jnp.int32)
    with jax.disable_jit():
        ref = estimate_index(q.astype(BF16), k.astype(BF16), pos, CFG)

    def inner(a, b):  # the index beside other uses of the same bf16 values (fusion can change)
        qb, kb = a.astype(BF16), b.astype(BF16)
        loss = jnp.sum(qb.astype(jnp.float32) ** 2) + jnp.sum(jnp.tanh(kb.astype(jnp.float32)))
        return loss, estimate_index(qb, kb, pos, CFG)

    lay = MTrainingConfig(sparsity=CFG).make_layout(S, 4)
    lpos = jnp.asarray(lay.perm)
    remat = jax.checkpoint(inner, policy=jax.checkpoint_policies.nothing_saveable)
    got = {
        "jitted": jax.jit(lambda a, b: estimate_index(a.astype(BF16), b.astype(BF16), pos, CFG))(q, k),
        "jitted, laid out": jax.jit(lambda a, b: estimate_index(a.astype(BF16), b.astype(BF16), lpos, CFG))(
            lay.permute(q), lay.permute(k)),
        "in a gradient": jax.jit(jax.grad(inner, argnums=(0, 1), has_aux=True))(q, k)[1],
        "in a remat gradient": jax.jit(jax.grad(remat, argnums=(0, 1), has_aux=True))(q, k)[1],
    }
    _assert_same_index(got, ref)
    assert 4 <= int(np.asarray(ref.v_count).min())  # a real index (here at vertical_max, 512 of S keys)
    f32 = estimate_index(q, k, pos, CFG)  # the comparison can fail: the float32 values' index differs
    assert sum(int((np.asarray(a) != np.asarray(b)).sum()) for a, b in zip(f32, ref)) > 0


def test_reduce_precision_survives_in_the_optimized_program():
    """The storage rounding is in the COMPILED forward+backward program (XLA did not elide it):
    bf16 ``reduce-precision`` ops (8 exponent, 7 mantissa bits) on the whole q and the whole k."""
    B, S, HQ, HKV, D = 1, 512, 4, 2, 64
    q, k, v, cot = _inputs(1, B, S, HQ, HKV, D)
    mesh = make_mesh((1, 1), jax.devices()[:1])
    prog = _index_programs(mesh, ["xla"], CFG, cot)["xla forward+backward"]
    hlo = prog.lower(q, k, v).compile().as_text()
    ops = re.findall(r"= f32\[([\d,]+)\][^\n]*? reduce-precision\([^\n]*exponent_bits=8, mantissa_bits=7", hlo)
    assert set(ops) == {f"{B},{S},{HKV},{D}", f"{B},{S},{HQ},{D}"}, ops  # (fusions may duplicate one)
    # and the estimate on float32 inputs has none (nothing to round)
    f32 = jax.jit(lambda a, b: estimate_index(a, b, jnp.arange(S), CFG)).lower(q, k).compile().as_text()
    assert "reduce-precision" not in f32


def test_storage_round_is_the_dtype_conversion():
    """What the estimate sees of a bf16 input is the same whether XLA kept the cast or handed over
    the float32 values it was given: ``storage_round`` of the bf16 values and of the float32
    values both give the bits of ``astype(bf16)`` (round to nearest even, ties, subnormals,
    overflow to inf). float16: the same except that f16 subnormals (``|x| < 2^-14``) read as zero
    (``reduce-precision`` flushes them), and values within ``2^-25`` below ``2^-14`` may differ."""
    from jax import lax

    rng = np.random.default_rng(0)
    x = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = x[np.isfinite(x)]
    ties = (np.arange(1, 4096, dtype=np.uint32) << 16 | 0x8000).view(np.float32)  # exact bf16 ties
    near = np.float32(2.0**-14) * np.linspace(0.5, 2, 3001, dtype=np.float32)  # around f16's smallest normal
    x = np.concatenate([x, ties, -ties, near, -near, [0.0, -0.0, 1e-40, 3.4e38, 65520.0, 6e-8]]).astype(np.float32)
    xj = jnp.asarray(x)
    for dt in (BF16, jnp.float16):
        cast = np.asarray(xj.astype(dt).astype(jnp.float32))
        kept = np.asarray(jax.jit(lambda a, dt=dt: storage_round(lax.convert_element_type(a, dt)))(xj))
        fi = jnp.finfo(dt)
        dropped = np.asarray(jax.jit(lambda a, fi=fi: lax.reduce_precision(a, exponent_bits=int(fi.nexp),
                                                                           mantissa_bits=int(fi.nmant)))(xj))
        if dt == BF16:
            np.testing.assert_array_equal(kept.view(np.uint32), cast.view(np.uint32))
            np.testing.assert_array_equal(dropped.view(np.uint32), cast.view(np.uint32))
        else:
            want = np.where(np.abs(cast) < 2.0**-14, np.copysign(np.float32(0), cast), cast)
            np.testing.assert_array_equal(kept.view(np.uint32), want.view(np.uint32))
            edge = (np.abs(x) >= 2.0**-14 - 2.0**-25) & (np.abs(x) < 2.0**-14)
            np.testing.assert_array_equal(dropped[~edge].view(np.uint32), want[~edge].view(np.uint32))


@pytest.mark.parametrize("D", [64, 128])
def test_logits_do_not_depend_on_the_summation_order(D):
    """The estimate's logits are exact integer sums: reordering the contraction (a permutation of
    head_dim in q and k, which changes the dot's summation order) leaves every bit unchanged, and
    they equal the float64 dot within float32's own error."""
    rng = np.random.default_rng(D)
    B, R, HQ, HKV, S = 1, 64, 4, 2, 512
    q = jnp.asarray(rng.standard_normal((B, R, HQ, D)) * np.exp(rng.standard_normal((B, R, HQ, 1))), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, S, HKV, D)) * np.exp(rng.standard_normal((B, S, HKV, 1))), jnp.float32)
    k = k.at[:, 5, :, 3].set(1e-30)  # an element far below its row's scale
    f = jax.jit(lambda a, b: window_logits(a, operand_digits(b)))
    z = np.asarray(f(q, k))
    for seed in range(3):
        p = np.random.default_rng(seed).permutation(D)
        np.testing.assert_array_equal(np.asarray(f(q[..., p], k[..., p])), z)
    ref = np.einsum("bqhgd,bkhd->bhgqk", np.asarray(q, np.float64).reshape(B, R, HKV, HQ // HKV, D),
                    np.asarray(k, np.float64)).reshape(B, HQ, R, S)
    qmax = np.abs(np.asarray(q, np.float64)).max(-1)  # [B, R, HQ]
    kmax = np.abs(np.asarray(k, np.float64)).max(-1)  # [B, S, HKV]
    bound = 3 * D * 2.0**-23 * qmax.transpose(0, 2, 1)[..., None] * np.repeat(kmax.transpose(0, 2, 1), 2, 1)[:, :, None]
    assert np.all(np.abs(z - ref) <= bound + 2.0**-23 * np.abs(ref))
    w, J = digit_plan(D)
    assert (w, J) == (8, 3) and J * D * 4 ** (w - 1) <= 2**24  # every level sum exact in float32


@pytest.mark.slow(seconds=24)
def test_remat_backward_uses_the_forward_index():
    """A tiny model with MTraining attention: gradients under ``remat: full`` (the backward
    recomputes the forward, the index included) equal those without remat to 4e-6 in float32.
    The check can fail: a slightly different index (one vertical fewer per head) moves them by
    far more."""
    from mtraining_jax.model.config import ModelConfig
    from mtraining_jax.model.qwen2 import Qwen2ForCausalLM

    S = 512
    tiny = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=64, rope_theta=1e4, max_position_embeddings=S, initializer_range=0.5,
                attention_backend="mtraining", attention_impl="xla", layout="block_striped",
                sparsity=dict(vertical_p=0.8, slash_p=0.8, vertical_min=4, vertical_max=32, slash_max=4))
    mesh = make_mesh((1, 2), jax.devices()[:2])
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 96, (1, S)), jnp.int32)
    w = jnp.asarray(np.random.RandomState(1).randn(1, S, 96), jnp.float32)
    base = Qwen2ForCausalLM(ModelConfig(**tiny), rngs=nnx.Rngs(0))
    _, state = nnx.split(base)
    lay = MTrainingConfig(sparsity=SparsityConfig(**tiny["sparsity"])).make_layout(S, 2)
    t_laid, pos = lay.permute(tokens), jnp.asarray(lay.perm)

    def grads(**changes):
        m = Qwen2ForCausalLM(ModelConfig(**{**tiny, **changes}), rngs=nnx.Rngs(1))
        nnx.update(m, state)

        def loss(m):
            h = m(t_laid, pos, mesh=mesh)
            return jnp.sum(jnp.einsum("bsh,hv->bsv", h, m.lm_head_weight()) * w)

        g = nnx.jit(nnx.grad(loss))(m)
        return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(nnx.to_pure_dict(g))])

    g_none = grads(remat="none")
    g_full = grads(remat="full")
    rel = lambda a, b: np.linalg.norm(a - b) / np.linalg.norm(b)  # noqa: E731
    assert rel(g_full, g_none) <= 4e-6, rel(g_full, g_none)  # float32 sums in another order: ~1.3e-6
    other = grads(remat="none", sparsity=dict(tiny["sparsity"], vertical_max=31))  # one column fewer per head
    assert rel(other, g_none) > 1e-4, rel(other, g_none)


# --------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("estimate_impl", ["xla", "triton"])
@pytest.mark.parametrize("data", ["synthetic", "normal"])
@pytest.mark.parametrize("B, S", [(2, 16384), (1, 131072)])
def test_index_is_bit_identical_across_gpu_programs(B, S, data, estimate_impl):
    """Issue 35's case on one GPU: 12/4 heads, d64, vertical_p = slash_p = 0.8, float32 q/k/v cast
    to bf16 inside each program. The XLA, Triton and Mosaic programs, forward and forward +
    backward, a remat recompute and the estimate alone build the same index, bit for bit.
    ``normal``: i.i.d. normal q/k (diffuse attention, the caps bind: many near-tied lines at the
    budget's edge, where a bf16-vs-float32 difference shows first). Both estimate paths
    (``estimate_impl``), each against itself."""
    HQ, HKV, D = 12, 4, 64
    cfg = SparsityConfig(vertical_p=0.8, slash_p=0.8, estimate_impl=estimate_impl)
    q, k, v, cot = _inputs(35, B, S, HQ, HKV, D)
    if data == "normal":
        kq, kk = jax.random.split(jax.random.PRNGKey(36))
        q = jax.random.normal(kq, q.shape, jnp.float32) * 2.0
        k = jax.random.normal(kk, k.shape, jnp.float32) * 2.0
    mesh = make_mesh((1, 1), jax.devices()[:1])
    ref = jax.jit(functools.partial(estimate_index, cfg=cfg))(q.astype(BF16), k.astype(BF16), jnp.arange(S))
    got = {"estimate, cast inside": jax.jit(lambda a, b: estimate_index(a.astype(BF16), b.astype(BF16),
                                                                        jnp.arange(S), cfg))(q, k)}
    for name, f in _index_programs(mesh, ["xla", "triton", "mosaic"], cfg, cot, remat_impls=["mosaic"]).items():
        got[name] = jax.block_until_ready(f(q, k, v))
    _assert_same_index(got, ref)
