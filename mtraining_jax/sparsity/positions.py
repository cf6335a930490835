"""Checks of the global positions every public entry of :mod:`mtraining_jax.sparsity` takes.

A position array says where each (laid-out) token sits in the sequence. The whole sequence's
positions must be a permutation of ``0..S-1``; one rank's (or one ring chunk's) positions must be
distinct positions in ``0..S-1``. Integer dtype and shape are checked always; the values when the
array is concrete (a traced array inside ``jit`` / ``shard_map`` cannot be inspected: the caller
that builds it checks it, e.g. :func:`~mtraining_jax.attention.mtraining.mtraining_attention`
builds it from a checked :class:`~mtraining_jax.layouts.Layout`). Errors are ``ValueError`` naming
the offending value, raised before any tracing work — the same contract as the attention
entries (:mod:`mtraining_jax.attention.dispatch`).
"""

from __future__ import annotations

import jax
import numpy as np

from pallas_kernels.inputs import check_integers


def concrete(x):
    """``np.ndarray`` of ``x``, or ``None`` when ``x`` is traced."""
    if isinstance(x, jax.core.Tracer):
        return None
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _check_dtype(positions, name: str) -> None:
    dtype = getattr(positions, "dtype", None)
    check_integers(name, np.asarray(positions).dtype if dtype is None else dtype)


def check_positions(positions, seq_len: int, *, name: str = "positions", permutation: bool = True,
                    shape: tuple | None = None) -> None:
    """``ValueError`` unless ``positions`` are integer positions in ``0..seq_len-1``.

    ``permutation=True``: the whole sequence (any shape, e.g. a layout's ``[P, S/P]``), every
    position exactly once. ``permutation=False``: a subset (one rank's rows), distinct and in
    range. ``shape``: the shape it must have. Values are checked when concrete.
    """
    got = tuple(np.shape(positions))
    if shape is not None and got != tuple(shape):
        raise ValueError(f"{name} has shape {got}, expected {list(shape)}")
    _check_dtype(positions, name)
    pos = concrete(positions)
    if pos is None:
        return
    flat = pos.reshape(-1).astype(np.int64)
    bad = np.nonzero((flat < 0) | (flat >= seq_len))[0]
    if bad.size:
        i = np.unravel_index(int(bad[0]), pos.shape)
        where = ", ".join(map(str, i))
        raise ValueError(f"{name}[{where}] = {int(flat[bad[0]])} is not a position of a {seq_len}-token sequence "
                         f"(0..{seq_len - 1})")
    order = np.argsort(flat, kind="stable")
    srt = flat[order]
    dup = np.nonzero(srt[1:] == srt[:-1])[0]
    if dup.size:
        v = int(srt[dup[0]])
        first, second = (np.unravel_index(int(order[j]), pos.shape) for j in (dup[0], dup[0] + 1))
        fmt = lambda ix: ", ".join(map(str, ix))  # noqa: E731
        raise ValueError(f"{name} must be distinct positions (each token's place in the sequence); position {v} "
                         f"appears twice ({name}[{fmt(first)}] and {name}[{fmt(second)}])")
    if permutation and flat.size != seq_len:  # distinct and in range, so only the count can be off
        missing = np.setdiff1d(np.arange(seq_len), flat)
        raise ValueError(f"{name} must be a permutation of 0..{seq_len - 1} (each token's place in the sequence); "
                         f"position {int(missing[0])} is missing")
