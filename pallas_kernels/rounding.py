"""Rounding to a storage dtype that every compiled program keeps.

XLA drops an ``f32 -> bf16 -> f32`` convert pair when excess precision is allowed
(``--xla_allow_excess_precision``, on by default; XLA:GPU removes such pairs, XLA:CPU keeps them), so
``x.astype(bf16).astype(f32)`` may be ``x`` itself inside one program. ``lax.reduce_precision`` is
kept: code whose result depends on the rounded value (a rounding error, an index that must be the
same in every program) rounds through :func:`storage_round`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def storage_round(x, dtype=None):
    """``f32``: ``x`` rounded to ``dtype`` (default ``x.dtype``) and held in float32, the rounding kept
    by XLA in every program. float32 and wider: ``x`` as float32. f16 values below the smallest normal
    (``2^-14``) round to zero (``reduce_precision`` flushes that format's subnormals); bf16 keeps
    float32's range, subnormals included."""
    dt = jnp.dtype(x.dtype if dtype is None else dtype)
    x32 = jnp.asarray(x).astype(jnp.float32)
    if not jnp.issubdtype(dt, jnp.floating) or dt.itemsize >= 4:
        return x32
    fi = jnp.finfo(dt)
    return jax.lax.reduce_precision(x32, exponent_bits=int(fi.nexp), mantissa_bits=int(fi.nmant))
