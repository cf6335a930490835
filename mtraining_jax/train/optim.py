"""Optimizer: AdamW with linear warmup + cosine decay, global-norm clipping, weight-decay mask.

Schedule (``t`` = optimizer step from 0, ``W`` = warmup steps, ``T`` = total steps, ``r`` =
``min_lr_ratio``)::

    lr(t) = lr * (t + 1) / W                                    for t < W
    lr(t) = lr * (r + (1 - r) * (1 + cos(pi * u)) / 2),   u = min(1, (t - W) / max(1, T - W))

so the first step already moves (no zero-lr step) and the last reaches ``r * lr``. Weight decay
applies to matrices only (``kernel``, ``embedding``, ``lm_head``), not to biases or norm weights
(layer-stacked parameters have an extra leading axis, so the rule is by name, not by ``ndim``).
The optimizer state lives in the parameters' dtype: float32 master weights give float32 Adam
moments (MTraining App. C: bf16 compute, fp32 optimizer state).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

DECAYED_NAMES = ("kernel", "embedding", "lm_head")


def lr_schedule(lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float):
    """The schedule above as an ``optax.Schedule`` (a function of the int step)."""
    W, T, r = int(warmup_steps), int(total_steps), float(min_lr_ratio)

    def schedule(t):
        t = jnp.asarray(t, jnp.float32)
        warm = lr * (t + 1.0) / max(W, 1)
        u = jnp.clip((t - W) / max(1, T - W), 0.0, 1.0)
        cos = lr * (r + (1.0 - r) * 0.5 * (1.0 + jnp.cos(jnp.pi * u)))
        return jnp.where(t < W, warm, cos)

    return schedule


def decay_mask(params):
    """Pytree of bools: True for leaves whose key path names a matrix (see module docstring)."""

    def is_decayed(path, _):
        names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        return any(n in DECAYED_NAMES for n in names)

    return jax.tree_util.tree_map_with_path(is_decayed, params)


def build_adamw(cfg, schedule):
    """The AdamW part of the optimizer (no clipping) for an :class:`OptimConfig`."""
    return optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask)


def build_optimizer(cfg, total_steps: int):
    """``(optax.GradientTransformation, schedule)`` for an :class:`OptimConfig`:
    ``chain(clip_by_global_norm, adamw)`` (no clip when ``clip_norm == 0``)."""
    schedule = lr_schedule(cfg.lr, cfg.warmup_steps, total_steps, cfg.min_lr_ratio)
    parts = []
    if cfg.clip_norm > 0:
        parts.append(optax.clip_by_global_norm(cfg.clip_norm))
    parts.append(build_adamw(cfg, schedule))
    return optax.chain(*parts), schedule
