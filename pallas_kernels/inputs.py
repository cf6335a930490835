"""The attention inputs' contract, checked in one place by every attention entry point.

``q [B, Sq, Hq, D]``, ``k, v [B, Sk, Hkv, D]``: floating point (an integer tensor would run and
return truncated integers), four axes, ``v.shape == k.shape``, the same batch and head_dim,
``Hq`` a multiple of ``Hkv`` (GQA: query head ``h`` reads KV head ``h // (Hq // Hkv)``), and
``Sq == Sk`` where the caller needs one sequence (self-attention entry points). Errors are
``ValueError`` naming the offending shape or dtype, raised before any tracing work.
"""

from __future__ import annotations

import jax.numpy as jnp


def check_gqa(num_q_heads: int, num_kv_heads: int) -> int:
    """Return the group size ``Hq // Hkv``; ``ValueError`` if it is not an integer."""
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"query heads ({num_q_heads}) must be a positive multiple of KV heads ({num_kv_heads})"
        )
    return num_q_heads // num_kv_heads


def check_qkv(q, k, v, *, same_seq: bool = True) -> int:
    """Check ``q, k, v`` against the contract above; returns the GQA group size."""
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise ValueError(f"expected q [B,Sq,Hq,D] and k = v [B,Sk,Hkv,D]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be a floating-point array (bfloat16, float16, float32 or float64), "
                             f"got dtype {x.dtype}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or (same_seq and q.shape[1] != k.shape[1]):
        what = "batch, sequence or head_dim" if same_seq else "batch or head_dim"
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on {what}")
    return check_gqa(q.shape[2], k.shape[2])


def check_segment_ids(segment_ids, batch: int, seq: int):
    """``None`` or ``segment_ids`` as int32 ``[batch, seq]`` (document ids of packed sequences);
    ``ValueError`` naming the shape or dtype otherwise."""
    if segment_ids is None:
        return None
    segment_ids = jnp.asarray(segment_ids)
    if tuple(segment_ids.shape) != (batch, seq):
        raise ValueError(f"segment_ids must have shape [B, S] = [{batch}, {seq}], got {tuple(segment_ids.shape)}")
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(f"segment_ids must be integers, got dtype {segment_ids.dtype}")
    return segment_ids.astype(jnp.int32)
