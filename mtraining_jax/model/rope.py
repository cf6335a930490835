"""Rotary position embeddings (RoPE) with optional YaRN scaling, matching Hugging Face exactly.

Frequencies (host-side NumPy float32, the same op order as transformers'
``_compute_default_rope_parameters`` / ``_compute_yarn_parameters`` in ``modeling_rope_utils.py``):

* default: ``inv_freq[i] = 1 / theta ** (2i / d)``, ``i < d/2``; attention factor 1.
* YaRN (Peng et al. 2023, arXiv:2309.00071, §3.2 "NTK-by-parts" + §3.4 temperature):
  ``inv_freq = interp * (1 - e) + extrap * e`` with ``extrap = 1 / theta**(2i/d)``,
  ``interp = extrap / factor`` and ``e = 1 - ramp(low, high)[i]`` where
  ``low/high = find_correction_dim(beta_fast/beta_slow)`` over ``original_max_position_embeddings``
  (floored / ceiled when ``truncate`` (default true), clipped to ``[0, d-1]``). The attention factor
  is ``attention_factor`` if given, else ``get_mscale(factor, mscale) / get_mscale(factor,
  mscale_all_dim)`` when both are set, else ``0.1 ln(factor) + 1`` (1 when ``factor <= 1``).

Application (HF ``Qwen2RotaryEmbedding`` + ``apply_rotary_pos_emb``): ``angles = pos * inv_freq``
in float32, ``emb = concat(angles, angles)``, ``cos = cos(emb) * attention_factor`` and likewise
``sin``, cast to the activation dtype; ``x' = x * cos + rotate_half(x) * sin`` with
``rotate_half(x) = concat(-x[d/2:], x[:d/2])``. Positions are global token positions ``[S]``
(after a layout permutation), so RoPE is exact under any sequence layout.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np


def default_inv_freq(head_dim: int, theta: float) -> np.ndarray:
    """``float32 [head_dim // 2]``: ``1 / theta ** (arange(0, d, 2) / d)``."""
    exps = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    return (np.float32(1.0) / (np.float32(theta) ** exps)).astype(np.float32)


def _get_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(scaling: Mapping[str, Any]) -> float:
    """The cos/sin multiplier of YaRN (transformers' ``attention_factor`` logic)."""
    factor = scaling["factor"]
    af = scaling.get("attention_factor")
    if af is not None:
        return float(af)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_get_mscale(factor, mscale) / _get_mscale(factor, mscale_all_dim))
    return float(_get_mscale(factor))


def yarn_inv_freq(head_dim: int, theta: float, scaling: Mapping[str, Any]) -> np.ndarray:
    """``float32 [head_dim // 2]`` YaRN inverse frequencies (see module docstring)."""
    dim = head_dim
    factor = float(scaling["factor"])
    orig = scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1
    truncate = scaling.get("truncate", True)

    def correction_dim(num_rotations):
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers: prevent singularity
    ramp = np.clip(
        (np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1
    ).astype(np.float32)
    extrap_factor = np.float32(1) - ramp
    pos_freqs = np.float32(theta) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
    inv_extrap = np.float32(1.0) / pos_freqs
    inv_interp = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    inv = inv_interp * (np.float32(1) - extrap_factor) + inv_extrap * extrap_factor
    return inv.astype(np.float32)


def rope_parameters(head_dim: int, theta: float, scaling: Mapping[str, Any] | None) -> tuple[np.ndarray, float]:
    """``(inv_freq float32 [head_dim // 2], attention_factor)`` for a config's RoPE."""
    if scaling is None or scaling.get("rope_type", scaling.get("type", "default")) == "default":
        return default_inv_freq(head_dim, theta), 1.0
    if scaling.get("rope_type", scaling.get("type")) != "yarn":
        raise ValueError(f"unsupported rope_scaling type {scaling.get('rope_type')!r}")
    return yarn_inv_freq(head_dim, theta, scaling), yarn_attention_factor(scaling)


def rope_cos_sin(positions, inv_freq: np.ndarray, attention_factor: float, dtype):
    """``cos, sin [..., S, head_dim]`` in ``dtype`` for int positions ``[..., S]`` (float32 math;
    ``[S]`` shared by the batch, or ``[B, S]`` per sequence, e.g. restarting per document)."""
    angles = jnp.asarray(positions).astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    emb = jnp.concatenate([angles, angles], axis=-1)
    cos = jnp.cos(emb) * jnp.float32(attention_factor)
    sin = jnp.sin(emb) * jnp.float32(attention_factor)
    return cos.astype(dtype), sin.astype(dtype)


def apply_rope(x, cos, sin):
    """Rotate ``x [B, S, H, D]`` by ``cos, sin [S, D]`` or ``[B, S, D]`` (HF ``rotate_half`` convention)."""
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    c, s = cos[..., None, :], sin[..., None, :]
    if c.ndim == 3:
        c, s = c[None], s[None]
    return x * c + rot * s
