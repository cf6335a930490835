"""Exact ``top_k`` of non-negative integer scores through a pre-filter (the index estimate's vertical
candidates: ``k = vertical_max`` of ``S`` local keys, :mod:`.estimate`, :mod:`.budgets`).

``jax.lax.top_k(x, k)`` with ``k`` in the thousands sorts every row whole on a GPU (XLA rewrites it
into a sort of ``(value, index)`` pairs). :func:`top_k` gives the same values and indices (ties to
the lower index) from a sort of at most ``capacity`` candidates per row:

1. a ladder of thresholds ``t_j = floor(max * 2^(-j / STEPS_PER_OCTAVE))``, ``j < RUNGS``, and the
   count of each row's scores ``>= t_j`` (one reduction); the first rung whose count reaches ``k``
   refined by ``SUBSTEPS`` even steps up towards the rung above (a second reduction): the highest
   threshold ``t`` with ``k`` scores at or above it;
2. every score at or above the row's ``k``-th largest is at or above ``t`` (``k`` scores are), so the
   candidates ``x >= t`` hold the whole answer;
3. the candidates compacted in index order (a cumulative sum and a scatter), ``lax.top_k`` of them,
   their indices mapped back: equal values keep their index order, so ties still fall to the lower
   index.

Where some row has more than ``capacity`` candidates (many equal scores, or no rung with ``k``
scores above zero) the whole call is ``lax.top_k(x, k)`` instead (one ``lax.cond``): exact either way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

#: threshold rungs per factor of two, rungs in all (down to ``max * 2^-16``), and the even steps
#: that refine the chosen rung
STEPS_PER_OCTAVE, RUNGS, SUBSTEPS = 4, 64, 16


def default_capacity(k: int, n: int) -> int | None:
    """Candidates per row of the pre-filtered path: ``2 k`` rounded up to a multiple of 128, or
    ``None`` (plain ``lax.top_k``) where that is not well below the row length ``n``."""
    cap = -(-2 * k // 128) * 128
    return cap if 4 * cap <= n else None


def top_k(x, k: int, *, capacity: int | None = -1):
    """``(values, indices)`` of ``jax.lax.top_k(x, k)`` for ``x`` int32 ``[..., n]`` with every
    entry ``>= 0`` (not checked: a negative entry may be dropped from the candidates).

    ``capacity``: candidates kept per row (``-1``: :func:`default_capacity`; ``None``: no pre-filter).
    """
    n = x.shape[-1]
    if not 0 <= k <= n:
        raise ValueError(f"top_k needs 0 <= k <= n = {n}, got k={k}")
    if x.dtype != jnp.int32:
        raise ValueError(f"top_k takes int32 scores, got {x.dtype}")
    cap = default_capacity(k, n) if capacity == -1 else capacity
    if cap is None or cap >= n or k == 0:
        return jax.lax.top_k(x, k)
    if cap < k:
        raise ValueError(f"top_k capacity {cap} is below k={k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, n)
    thr, ok = prefilter(x2, k, cap)

    def filtered(x2):
        rows = x2.shape[0]
        keep = x2 >= thr[:, None]
        slot = jnp.cumsum(keep.astype(jnp.int32), axis=-1) - 1
        slot = jnp.where(keep, slot, cap + jnp.arange(n, dtype=jnp.int32))  # dropped: distinct, out of range
        r = jnp.arange(rows, dtype=jnp.int32)[:, None]
        vals = jnp.full((rows, cap), -1, jnp.int32).at[r, slot].set(x2, mode="drop", unique_indices=True)
        ids = jnp.zeros((rows, cap), jnp.int32).at[r, slot].set(
            jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (rows, n)), mode="drop", unique_indices=True)
        v, i = jax.lax.top_k(vals, k)  # >= k real candidates, all >= 1 > the -1 padding
        return v, jnp.take_along_axis(ids, i, axis=-1)

    v, i = jax.lax.cond(ok, filtered, lambda x2: tuple(jax.lax.top_k(x2, k)), x2)
    return v.reshape(lead + (k,)), i.reshape(lead + (k,))


def _counts(x2, t):
    """``int32 [rows, m]``: per row, the scores at or above each of its thresholds ``t [rows, m]``
    (one fused reduction over the rows)."""
    return jnp.sum((x2[:, :, None] >= t[:, None, :]).astype(jnp.int32), axis=1)


def prefilter(x2, k: int, cap: int):
    """``(threshold int32 [rows], ok bool [])`` for ``x2 int32 [rows, n]``: each row's highest
    threshold with ``k`` scores at or above it, from the ladder's rungs and then :data:`SUBSTEPS`
    even steps between that rung and the one above (module docstring); ``ok`` where every row's
    threshold is positive and has at most ``cap`` scores at or above it (the pre-filtered path
    applies)."""
    ladder = jnp.asarray(2.0 ** (-np.arange(RUNGS) / STEPS_PER_OCTAVE), jnp.float32)
    top = jnp.max(x2, axis=-1).astype(jnp.float32)
    # floor in float32 then int: non-increasing along the ladder, each rung at most the row max
    t = jnp.floor(top[:, None] * ladder[None, :]).astype(jnp.int32)  # [rows, RUNGS]
    first = jnp.argmax(_counts(x2, t) >= k, axis=-1)  # the first rung with k scores (0 if none: not ok)
    lo = jnp.take_along_axis(t, first[:, None], axis=-1)  # [rows, 1]
    hi = jnp.take_along_axis(t, jnp.maximum(first - 1, 0)[:, None], axis=-1)  # fewer than k at or above
    frac = jnp.asarray(np.arange(SUBSTEPS) / SUBSTEPS, jnp.float32)
    c = lo + jnp.floor((hi - lo).astype(jnp.float32) * frac[None, :]).astype(jnp.int32)  # lo <= c <= hi
    cnt = _counts(x2, c)
    enough = cnt >= k  # true at c = lo where the rung has k; counts fall as c rises
    thr = jnp.max(jnp.where(enough, c, -1), axis=-1)
    have = jnp.min(jnp.where(enough, cnt, jnp.iinfo(jnp.int32).max), axis=-1)
    return thr, jnp.all((have >= k) & (have <= cap) & (thr >= 1))
