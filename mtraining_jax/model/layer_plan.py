"""How the decoder's layers are grouped into ``jax.lax.scan`` s (``ModelConfig.scan_layers=True``).

Every layer has a key, ``(attention backend, remat policy)``; one traced layer body serves every layer
of a scan, so the program holds one copy of the layer per scan, and its compile time grows with their
number.

* :func:`backend_segments`: the maximal runs of consecutive layers with one key; one scan each.
* :func:`layer_blocks`: the same layers as blocks ``(start, repeats, pattern)``. A block of
  ``repeats >= 2`` is a pattern of several runs (``pattern = ((offset, length, key), ...)`` over
  ``period`` layers) repeated back to back, e.g. a dense layer every fourth layer
  (``dense_layers=[0, 4, 8, ...]``: ``(dense, sparse, sparse, sparse) x n``). The model runs it as
  one scan over the repeats whose body runs the pattern's runs, so the program holds each key's body
  once instead of once per run (12 runs -> 2 bodies for Qwen2.5-0.5B with every fourth layer dense).
  Any other run is a block of ``repeats == 1`` with one entry.

The blocks cover the layers in order, each exactly once (property-tested); the model's outputs,
gradients and per-layer statistics do not depend on the grouping (tests/test_layer_plan.py).
"""

from __future__ import annotations

import functools
import itertools


def backend_segments(backends: tuple) -> list[tuple[int, int, object]]:
    """Maximal runs ``(start, stop, backend)`` of consecutive layers sharing a backend (any
    comparable per-layer key, e.g. ``(backend, remat policy)`` pairs)."""
    out, start = [], 0
    for b, grp in itertools.groupby(backends):
        n = len(list(grp))
        out.append((start, start + n, b))
        start += n
    return out


def _pattern(keys: tuple) -> tuple:
    return tuple((a, b - a, k) for a, b, k in backend_segments(keys))


def _best_repeat(keys: tuple, i: int) -> tuple[int, int]:
    """``(period, repeats)`` of the longest back-to-back repetition starting at layer ``i`` of a pattern
    with at least two runs (the shortest period among equally long ones); ``(0, 0)`` when none repeats."""
    best, n_layers = (0, 0), len(keys)
    for period in range(2, (n_layers - i) // 2 + 1):
        unit = keys[i:i + period]
        if len(_pattern(unit)) < 2:
            continue
        reps = 1
        while keys[i + reps * period:i + (reps + 1) * period] == unit:
            reps += 1
        if reps >= 2 and period * reps > best[0] * best[1]:
            best = (period, reps)
    return best


@functools.lru_cache(maxsize=64)
def layer_blocks(keys: tuple) -> tuple:
    """``((start, repeats, pattern), ...)`` covering ``keys`` (one hashable key per layer) in order:
    greedily from the first layer, the longest repetition of a multi-run pattern that starts there
    (:func:`_best_repeat`), else the run of the layer's key up to the next layer where a repetition
    starts or the key changes. ``pattern = ((offset, length, key), ...)`` over one repeat."""
    out, i, n_layers = [], 0, len(keys)
    while i < n_layers:
        period, reps = _best_repeat(keys, i)
        if reps:
            out.append((i, reps, _pattern(keys[i:i + period])))
            i += period * reps
            continue
        j = i + 1
        while j < n_layers and keys[j] == keys[i] and not _best_repeat(keys, j)[1]:
            j += 1
        out.append((i, 1, ((0, j - i, keys[i]),)))
        i = j
    return tuple(out)
