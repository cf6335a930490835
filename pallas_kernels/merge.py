"""Merging two partial attention results ``(out, lse)`` over disjoint key sets (online softmax).

If ``out_a, lse_a`` is softmax attention of a query row over key set ``A`` (``out_a`` normalised
over ``A``, ``lse_a = log sum_{k in A} exp(s_k)``) and likewise ``out_b, lse_b`` over a disjoint
``B``, attention over ``A ∪ B`` is (FlashAttention online softmax; ring attention, tutorial 002 §2;
MTraining Algorithm 2 ``merge_out_and_lse``)::

    lse = log(exp(lse_a) + exp(lse_b)) = m + log(exp(lse_a - m) + exp(lse_b - m)),  m = max(lse_a, lse_b)
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

A row with no allowed key has ``out = 0, lse = -inf``. Both sides ``-inf`` give ``out = 0,
lse = -inf`` (never NaN): every exponent is taken against a finite stand-in for ``-inf``.

Shapes: ``out [B, S, H, D]``, ``lse [B, H, S]``. Everything is computed in float32 (float64 if the
inputs are float64).
"""

from __future__ import annotations

import jax.numpy as jnp


def merge_partials(out_a, lse_a, out_b, lse_b):
    """Merge two partial results; returns ``(out, lse)`` in float32 (see module docstring).

    ``out_*`` ``[B, S, H, D]``; ``lse_*`` ``[B, H, S]`` with ``-inf`` marking rows with no key.
    """
    dt = jnp.promote_types(jnp.promote_types(out_a.dtype, out_b.dtype), jnp.float32)
    lse_a = lse_a.astype(dt)
    lse_b = lse_b.astype(dt)
    m = jnp.maximum(lse_a, lse_b)
    finite = jnp.isfinite(m)
    m_safe = jnp.where(finite, m, 0.0)
    # exp(-inf - finite) = 0 exactly, so a -inf side contributes nothing; if both sides are -inf
    # the row keeps lse = -inf and both weights are forced to 0.
    wa = jnp.where(finite, jnp.exp(lse_a - m_safe), 0.0)
    wb = jnp.where(finite, jnp.exp(lse_b - m_safe), 0.0)
    total = wa + wb  # in [1, 2] on finite rows
    lse = jnp.where(finite, m_safe + jnp.log(jnp.where(finite, total, 1.0)), -jnp.inf)
    inv = jnp.where(finite, 1.0 / jnp.where(finite, total, 1.0), 0.0)
    ca = jnp.swapaxes(wa * inv, 1, 2)[..., None]  # [B, S, H, 1]
    cb = jnp.swapaxes(wb * inv, 1, 2)[..., None]
    out = ca * out_a.astype(dt) + cb * out_b.astype(dt)
    return out, lse
