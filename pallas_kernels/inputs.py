"""The attention inputs' contract, checked in one place by every attention entry point.

``q [B, Sq, Hq, D]``, ``k, v [B, Sk, Hkv, D]``: floating point (an integer tensor would run and
return truncated integers), four axes, ``v.shape == k.shape``, the same batch and head_dim,
``Hq`` a multiple of ``Hkv`` (GQA: query head ``h`` reads KV head ``h // (Hq // Hkv)``), one dtype for
all three (a bf16 ``q`` against float32 ``k`` would be promoted by XLA but fails inside a GPU kernel's
lowering), and ``Sq == Sk`` where the caller needs one sequence (self-attention entry points).
Positions are integer ``[S]`` (float positions would be truncated to the wrong tokens), per-row
statistics float32 (:func:`check_array`). Errors are ``ValueError`` naming the offending argument,
shape or dtype, raised before any tracing work.
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
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k and v must share one dtype; got q {q.dtype}, k {k.dtype}, v {v.dtype}")
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
    check_integers("segment_ids", segment_ids.dtype)
    return segment_ids.astype(jnp.int32)


def check_positions(name: str, positions, length: int, dim: str = "S"):
    """``positions`` as an int32 array ``[length]`` (global token positions; ``dim`` names that length in
    the message); ``ValueError`` naming ``name`` when its shape is not ``[length]`` or its dtype not an
    integer one."""
    positions = positions if hasattr(positions, "dtype") else jnp.asarray(positions)
    if tuple(positions.shape) != (length,):
        raise ValueError(f"{name} has shape {tuple(positions.shape)}, expected [{dim}] = [{length}]")
    check_integers(name, positions.dtype)
    return jnp.asarray(positions, jnp.int32)


def check_integers(name: str, dtype) -> None:
    """``ValueError`` naming ``name`` unless ``dtype`` is an integer dtype (bool is not one)."""
    if not (jnp.issubdtype(dtype, jnp.integer) and not jnp.issubdtype(dtype, jnp.bool_)):
        raise ValueError(f"{name} must be integers, got dtype {dtype}")


def check_array(name: str, x, shape, dtype=None) -> None:
    """``ValueError`` naming ``name`` unless ``x`` is an array of ``shape`` and of ``dtype`` (one dtype or a
    tuple of those allowed; ``None``: any floating dtype)."""
    got = getattr(x, "dtype", None)
    if got is None or tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must be an array of shape {tuple(shape)}, got "
                         f"{tuple(x.shape) if got is not None else type(x).__name__}")
    allowed = () if dtype is None else tuple(jnp.dtype(d) for d in (dtype if isinstance(dtype, tuple) else (dtype,)))
    if allowed and jnp.dtype(got) not in allowed:
        raise ValueError(f"{name} must have dtype {' or '.join(d.name for d in allowed)}, got {jnp.dtype(got).name}")
    if not allowed and not jnp.issubdtype(got, jnp.floating):
        raise ValueError(f"{name} must be floating-point, got dtype {jnp.dtype(got).name}")


def stats_dtypes(q) -> tuple:
    """The dtypes a float32 statistic or accumulator (``lse``, ``delta``, ``acc``, ``dq_acc``) of ``q``'s
    attention may have: float32, and float64 where ``q`` is float64 (the references' precision)."""
    return (jnp.float32, jnp.float64) if jnp.dtype(q.dtype) == jnp.float64 else (jnp.float32,)
