"""Top-p coverage budgets (MTraining App. B.1 (i) "online budget approximation"; poster ``score_cover``).

The budget of a head is the smallest ``k`` whose ``k`` largest (non-negative, integer) scores cover
a fraction ``p`` of the total mass, ``k = min{ k : sum(top_k(scores)) >= p * total }``, clipped to
the head's ``[min, max]`` caps and the number of candidates; ``total`` is the exact mass when known
(``mass``), else ``sum(scores)``. The lines are ``argtopk(scores, k)`` (ties to the lower
position), sorted ascending. Integer arithmetic only: the result does not depend on the order of
reduction (:mod:`.estimate`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mtraining_jax.sparsity.index import compact_sorted


def coverage_count(sorted_desc, total, p, mass: int | None = None):
    """Smallest ``k`` with ``sum(sorted_desc[..., :k]) >= min(ceil(p * mass), total)``.

    ``sorted_desc int32 [..., M]`` (descending), ``total int32 [...]`` (sum of ALL scores, not only
    the ``M`` kept), ``p float [...]``; ``mass``: the exact mass the scores measure when it is known
    (the floored scores sum to less), else ``total``. With ``mass``, ``ceil(p * mass)`` is computed
    exactly on the host (``p`` must then be concrete). Returns ``int32 [...]`` in ``[1, M + 1]``
    (``M + 1``: the ``M`` largest do not reach the target).
    """
    if mass is None:
        thr = jnp.ceil(p.astype(jnp.float32) * total.astype(jnp.float32)).astype(jnp.int32)
    else:
        thr = jnp.asarray(np.ceil(np.asarray(p, np.float64) * mass).astype(np.int64).clip(0, 2**31 - 1), jnp.int32)
    thr = jnp.minimum(thr, total)  # float rounding / flooring must not ask for > everything
    csum = jnp.cumsum(sorted_desc, axis=-1, dtype=jnp.int32)
    return (csum < thr[..., None]).sum(axis=-1, dtype=jnp.int32) + 1


def top_p_select(scores, p, kmin, kmax, size: int, *, force: int | None = None, pad: int, ids=None,
                 total=None, mass: int | None = None):
    """Select lines by top-p coverage with per-head caps.

    Args:
      scores: ``int32 [B, H, n]`` non-negative scores in natural order (position = line id), or,
        with ``ids``, a subset of the lines that holds every line of the ``size`` best.
      p, kmin, kmax: ``[H]`` per-head coverage target and caps (NumPy or JAX arrays).
      size: static number of slots ``M`` (``<= n``); counts are clipped to it.
      force: a line id that is always selected first (the slash diagonal 0), or ``None``.
      pad: value stored in unused slots.
      ids: ``int32 [B, H, n]`` line ids of ``scores``, ascending along the last axis (so ties are
        still broken towards the lower line id); ``None``: ``arange(n)``.
      total: ``int32 [B, H]`` mass of ALL lines (required with ``ids``; default ``scores.sum(-1)``).
      mass: the exact total the scores measure, if known (:func:`coverage_count`); ``p`` concrete.

    Returns:
      ``(idx int32 [B, H, size] ascending, count int32 [B, H])``.
    """
    n = scores.shape[-1]
    if size > n:
        raise ValueError(f"{size} slots requested but there are only {n} candidate lines")
    if ids is not None and (total is None or force is not None):
        raise ValueError("top_p_select over candidate ids needs their total mass and no forced line")
    scores = scores.astype(jnp.int32)
    total = scores.sum(axis=-1, dtype=jnp.int32) if total is None else total
    order_key = scores if force is None else scores.at[..., force].set(jnp.iinfo(jnp.int32).max)
    _, top = jax.lax.top_k(order_key, size)
    vals = jnp.take_along_axis(scores, top, axis=-1)
    if mass is None:
        k = coverage_count(vals, total, jnp.asarray(p, jnp.float32)[None, :])
    else:
        k = coverage_count(vals, total, np.asarray(p, np.float64)[None, :], mass)
    lo = jnp.asarray(np.minimum(np.asarray(kmin), size), jnp.int32)[None, :]
    hi = jnp.asarray(np.minimum(np.asarray(kmax), size), jnp.int32)[None, :]
    k = jnp.clip(k, lo, hi)
    keep = jnp.arange(size) < k[..., None]
    lines = top if ids is None else jnp.take_along_axis(ids, top, axis=-1)
    idx, count = compact_sorted(keep, lines, size, pad)
    return idx, count
