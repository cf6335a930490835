"""Public entry points of the block-sparse (vertical-slash) flash attention.

Shapes: ``q [B, Sq, Hq, D]``, ``k, v [B, Sk, Hkv, D]`` (GQA: ``Hq % Hkv == 0``), positions
``q_pos int32 [Sq]``, ``k_pos int32 [Sk]`` (global, after the layout permutation), ``index`` a
:class:`~pallas_kernels.index_format.StepIndex` or ``None`` (dense causal by position).

* :func:`block_sparse_attention_fwd` -> ``(out f32 [B, Sq, Hq, D], lse f32 [B, Hq, Sq])`` — one
  partial result a ring step can merge (rows with no allowed key: out 0, lse -inf).
* :func:`block_sparse_attention_bwd` -> ``(dq, dk, dv)`` in float32 for one step, given the
  FINAL (merged) ``lse`` and ``delta = rowsum(dO * O)`` of the full attention (flash backward).
* :func:`block_sparse_attention` — single-device op with ``custom_vjp`` (output in q's dtype).

``impl``: ``"auto"`` (Pallas on GPU, XLA twin elsewhere), ``"pallas"``, ``"xla"``.

NOTE (foundation stage): the XLA path below materialises ``[B, Hq, Sq, Sk]`` scores per call; it is
exact and serves tests and the ring until the block-gather XLA twin and the Pallas kernels land
behind this same signature.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.index_format import DEFAULT_BLOCK, StepIndex, check_step_index, step_index_to_mask

IMPLS = ("auto", "pallas", "xla")


def attention_delta(out, do):
    """``delta f32 [B, Hq, Sq] = rowsum(dO * O)`` (computed once per attention, FlashAttention-2)."""
    return jnp.einsum("bqhd,bqhd->bhq", out.astype(jnp.float32), do.astype(jnp.float32))


def _check(q, k, v, q_pos, k_pos, index, block_size):
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise ValueError(f"expected q [B,Sq,Hq,D], k=v [B,Sk,Hkv,D]; got {q.shape}, {k.shape}, {v.shape}")
    B, Sq, Hq, D = q.shape
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"q {q.shape} and k {k.shape} disagree on batch or head_dim")
    if Hq % k.shape[2]:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({k.shape[2]})")
    if q_pos.shape != (Sq,) or k_pos.shape != (k.shape[1],):
        raise ValueError(f"q_pos {q_pos.shape} / k_pos {k_pos.shape} must be [Sq]={Sq} / [Sk]={k.shape[1]}")
    if index is not None:
        check_step_index(index, B, Hq, Sq, k.shape[1], block_size)


def _allowed(q, k, q_pos, k_pos, index, block_size):
    causal = (k_pos[None, :] <= q_pos[:, None])[None, None]
    if index is None:
        return causal
    return jnp.logical_and(causal, step_index_to_mask(index, q.shape[1], k.shape[1], block_size))


def _scores(q, k, sm_scale):
    from mtraining_jax.attention.reference import attention_logits  # lazy: avoid import cycle

    return attention_logits(q, k, sm_scale)


def block_sparse_attention_fwd(q, k, v, q_pos, k_pos, index: StepIndex | None = None, *, sm_scale=None,
                               block_size: int = DEFAULT_BLOCK, impl: str = "auto"):
    """Forward for one (query chunk, K/V chunk) pair; see module docstring."""
    _check(q, k, v, q_pos, k_pos, index, block_size)
    B, Sq, Hq, D = q.shape
    Hkv = k.shape[2]
    s = _scores(q, k, sm_scale)
    m = _allowed(q, k, q_pos, k_pos, index, block_size)
    s = jnp.where(jnp.broadcast_to(m, s.shape), s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None])
    p = p.reshape(B, Hkv, Hq // Hkv, Sq, -1)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p, v.astype(p.dtype), precision="highest")
    return out.reshape(B, Sq, Hq, D).astype(jnp.float32), lse.astype(jnp.float32)


def block_sparse_attention_bwd(q, k, v, q_pos, k_pos, index, do, lse, delta, *, sm_scale=None,
                               block_size: int = DEFAULT_BLOCK, impl: str = "auto"):
    """Backward for one pair given the final ``lse`` and ``delta``; returns f32 ``(dq, dk, dv)``."""
    _check(q, k, v, q_pos, k_pos, index, block_size)
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    g = Hq // Hkv
    scale = D**-0.5 if sm_scale is None else sm_scale
    s = _scores(q, k, sm_scale)
    m = jnp.broadcast_to(_allowed(q, k, q_pos, k_pos, index, block_size), s.shape)
    safe_lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
    p = jnp.where(m, jnp.exp(s - safe_lse[..., None]), 0.0)  # [B, Hq, Sq, Sk]
    f32 = p.dtype
    do5 = do.astype(f32).reshape(B, Sq, Hkv, g, D)
    p5 = p.reshape(B, Hkv, g, Sq, Sk)
    dv = jnp.einsum("bhgqk,bqhgd->bkhd", p5, do5, precision="highest")
    dp = jnp.einsum("bqhgd,bkhd->bhgqk", do5, v.astype(f32), precision="highest")
    ds = p5 * (dp - delta.reshape(B, Hkv, g, Sq)[..., None]) * scale
    dq = jnp.einsum("bhgqk,bkhd->bqhgd", ds, k.astype(f32), precision="highest").reshape(B, Sq, Hq, D)
    dk = jnp.einsum("bhgqk,bqhgd->bkhd", ds, q.astype(f32).reshape(B, Sq, Hkv, g, D), precision="highest")
    return dq.astype(jnp.float32), dk.astype(jnp.float32), dv.astype(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _op(q, k, v, q_pos, k_pos, index, sm_scale, block_size, impl):
    out, _ = block_sparse_attention_fwd(q, k, v, q_pos, k_pos, index, sm_scale=sm_scale,
                                        block_size=block_size, impl=impl)
    return out.astype(q.dtype)


def _op_fwd(q, k, v, q_pos, k_pos, index, sm_scale, block_size, impl):
    out, lse = block_sparse_attention_fwd(q, k, v, q_pos, k_pos, index, sm_scale=sm_scale,
                                          block_size=block_size, impl=impl)
    out_c = out.astype(q.dtype)
    return out_c, (q, k, v, q_pos, k_pos, index, out_c, lse)


def _op_bwd(sm_scale, block_size, impl, res, do):
    q, k, v, q_pos, k_pos, index, out, lse = res
    delta = attention_delta(out, do)
    dq, dk, dv = block_sparse_attention_bwd(q, k, v, q_pos, k_pos, index, do, lse, delta,
                                            sm_scale=sm_scale, block_size=block_size, impl=impl)
    zeros_like_int = lambda x: None if x is None else jax.tree.map(  # noqa: E731
        lambda a: jnp.zeros(a.shape, jax.dtypes.float0), x)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
            zeros_like_int(q_pos), zeros_like_int(k_pos), zeros_like_int(index))


_op.defvjp(_op_fwd, _op_bwd)


def block_sparse_attention(q, k, v, q_pos=None, k_pos=None, index: StepIndex | None = None, *, sm_scale=None,
                           block_size: int = DEFAULT_BLOCK, impl: str = "auto"):
    """Single-device block-sparse attention with ``custom_vjp``; ``out`` in ``q.dtype``."""
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS}")
    q_pos = jnp.arange(q.shape[1], dtype=jnp.int32) if q_pos is None else jnp.asarray(q_pos, jnp.int32)
    k_pos = jnp.arange(k.shape[1], dtype=jnp.int32) if k_pos is None else jnp.asarray(k_pos, jnp.int32)
    return _op(q, k, v, q_pos, k_pos, index, sm_scale, block_size, impl)
