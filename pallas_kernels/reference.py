"""Dense float32 reference attention: the ground truth every attention path is checked against.

Shapes: ``q [B, Sq, Hq, D]``, ``k, v [B, Sk, Hkv, D]`` with ``Hq % Hkv == 0`` (GQA, contiguous head
groups: query head ``h`` reads KV head ``h // (Hq // Hkv)``). Returns ``out [B, Sq, Hq, D]`` and
``lse [B, Hq, Sq]``, both float32 (or float64 when the inputs are float64 and x64 is enabled).

Masking: causal by *global position* (``k_pos <= q_pos``; positions default to ``arange``), and-ed
with an optional boolean ``mask`` broadcastable to ``[B, Hq, Sq, Sk]`` and, for packed documents,
with the block-diagonal document mask ``q_seg[b, i] == k_seg[b, j]`` (``q_seg int [B, Sq]``,
``k_seg int [B, Sk]``, :func:`segment_mask`). A fully masked row gives
``out = 0`` and ``lse = -inf`` (never NaN), the convention the ring merge relies on.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.inputs import check_gqa, check_positions, check_qkv


def attention_logits(q, k, sm_scale=None):
    """``[B, Hq, Sq, Sk]`` scaled logits in float32 (float64 if inputs are), GQA-aware."""
    B, Sq, Hq, D = q.shape
    Hkv = k.shape[2]
    g = check_gqa(Hq, Hkv)
    dt = jnp.promote_types(q.dtype, jnp.float32)
    scale = D**-0.5 if sm_scale is None else sm_scale
    qg = q.astype(dt).reshape(B, Sq, Hkv, g, D)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k.astype(dt), precision="highest")
    return s.reshape(B, Hq, Sq, k.shape[1]) * scale


def attention_mask(q_pos, k_pos, mask=None, causal: bool = True):
    """Boolean mask ``[..., Sq, Sk]``: causal by position and-ed with ``mask``."""
    m = None
    if causal:
        m = k_pos[None, :] <= q_pos[:, None]
    if mask is not None:
        m = mask if m is None else jnp.logical_and(m, mask)
    return m


def segment_mask(q_seg, k_seg):
    """``bool [B, 1, Sq, Sk]``: query ``i`` and key ``j`` of sequence ``b`` lie in the same document
    (``q_seg [B, Sq]``, ``k_seg [B, Sk]`` integer segment ids)."""
    q_seg, k_seg = jnp.asarray(q_seg), jnp.asarray(k_seg)
    if q_seg.ndim != 2 or k_seg.ndim != 2 or q_seg.shape[0] != k_seg.shape[0]:
        raise ValueError(f"segment ids must be q_seg [B, Sq] and k_seg [B, Sk]; got {q_seg.shape}, {k_seg.shape}")
    return (q_seg[:, :, None] == k_seg[:, None, :])[:, None]


def dense_attention(q, k, v, q_pos=None, k_pos=None, mask=None, *, causal: bool = True, sm_scale=None,
                    q_seg=None, k_seg=None):
    """Dense attention in float32. See module docstring for shapes and masking. Inputs are checked
    here; the math is one compiled program (a call outside ``jit`` compiles once per shape)."""
    check_qkv(q, k, v, same_seq=False)
    B, Sq = q.shape[:2]
    Sk = k.shape[1]
    q_pos = None if q_pos is None else check_positions("q_pos", q_pos, Sq, "Sq")
    k_pos = None if k_pos is None else check_positions("k_pos", k_pos, Sk, "Sk")
    if (q_seg is None) != (k_seg is None):
        raise ValueError("give both q_seg and k_seg (packed documents) or neither")
    if q_seg is not None:
        seg = jax.eval_shape(segment_mask, q_seg, k_seg)  # its own shape errors first
        if seg.shape[0] != B or seg.shape[2:] != (Sq, Sk):
            raise ValueError(f"q_seg / k_seg must be [B, Sq] = [{B}, {Sq}] / [B, Sk] = [{B}, {Sk}]; got "
                             f"{jnp.shape(q_seg)}, {jnp.shape(k_seg)}")
    return _dense_attention(q, k, v, q_pos, k_pos, mask, q_seg, k_seg, sm_scale, causal=causal)


@functools.partial(jax.jit, static_argnames=("causal",))
def _dense_attention(q, k, v, q_pos, k_pos, mask, q_seg, k_seg, sm_scale, *, causal: bool):
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    q_pos = jnp.arange(Sq) if q_pos is None else jnp.asarray(q_pos)
    k_pos = jnp.arange(Sk) if k_pos is None else jnp.asarray(k_pos)
    s = attention_logits(q, k, sm_scale)
    if q_seg is not None:
        seg = segment_mask(q_seg, k_seg)
        mask = seg if mask is None else jnp.logical_and(mask, seg)
    m = attention_mask(q_pos, k_pos, mask, causal)
    if m is not None:
        s = jnp.where(jnp.broadcast_to(m, s.shape), s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)  # -inf on fully masked rows
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    p = jnp.exp(s - safe[..., None])  # exact zeros where masked
    g = Hq // Hkv
    p = p.reshape(B, Hkv, g, Sq, Sk)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p, v.astype(p.dtype), precision="highest")
    return out.reshape(B, Sq, Hq, D), lse
