"""What the ring sends, derived from its schedule (:mod:`mtraining_jax.ring.schedule`).

The ring (``mtraining_jax/ring/attention.py``) holds at step ``s`` the K/V chunk of
``source_table(N, L, order)[rank, s]``; every change of that chunk between consecutive steps is
one collective-permute of the stacked K/V buffer ``[2, B, S/P, Hkv, D]`` along the ring axis it
came over. :func:`ring_hops` reads those changes off the table:

* forward, steps ``1 .. P-1``: the chunk of step ``s`` is the one the inner-ring predecessor held
  at ``s - 1`` (an ``inner`` hop) or, at the start of an outer step, the one the outer-ring
  predecessor held at ``s - n_inner`` (an ``outer`` hop);
* backward, the forward's steps in reverse (``P-2 .. 0``), chunks moving the other way (from the
  successors). Each transition also moves one float32 dK/dV accumulator ``[2, B, S/P, Hkv, D]``
  along its axis (inner: the visited chunk's partial sum; outer: the running total of the nodes
  already visited), and moves the K/V chunk too except into step 0 (the own chunk, never sent).

Per forward + backward and rank: ``P-1`` K/V hops forward, ``P-2`` backward and ``P-1`` dK/dV
hops (none on one rank). The flat order is one ring of ``P`` (all hops ``inner``); hierarchical
has an inner ring of ``L`` (``local``) and an outer ring of ``N`` (``node``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from mtraining_jax.ring.schedule import source_table, validate_ring_order

__all__ = ["Hop", "ring_hops", "hop_bytes", "hop_pairs", "ring_bytes", "transfer_units"]


class Hop(NamedTuple):
    """One collective-permute of one rank: ``phase`` ``"forward"`` / ``"backward"``; ``step``: the
    ring step whose chunk it delivers; ``axis`` ``"inner"`` / ``"outer"``; ``what`` ``"kv"`` (K/V
    in the input dtype) or ``"dkv"`` (float32 dK/dV)."""

    phase: str
    step: int
    axis: str
    what: str


def _rings(num_nodes: int, num_local: int, ring_order: str):
    """``(n_inner, inner_neighbour(rank, d), outer_neighbour(rank, d))``: rank ``d`` places along."""
    P = num_nodes * num_local
    if ring_order == "flat":
        return P, (lambda r, d: (r + d) % P), (lambda r, d: r)
    L, N = num_local, num_nodes
    return (L, (lambda r, d: r // L * L + (r % L + d) % L),
            (lambda r, d: ((r // L + d) % N) * L + r % L))


def _axis(table, step: int, prev: int, n_inner: int, inner, outer, d: int) -> str:
    """The ring axis over which every rank's chunk of ``step`` arrives from its neighbour ``d``
    places along (held there at ``prev``, or at ``step + d * n_inner`` over the outer ring)."""
    ranks = np.arange(table.shape[0])
    want = table[:, step]
    if all(table[inner(r, d), prev] == want[r] for r in ranks):
        return "inner"
    far = step + d * n_inner
    if 0 <= far < table.shape[1] and all(table[outer(r, d), far] == want[r] for r in ranks):
        return "outer"
    raise AssertionError(f"step {step}: the schedule is not a ring (no neighbour holds the chunk)")


def ring_hops(num_nodes: int, num_local: int, ring_order: str) -> list[Hop]:
    """Every collective-permute one rank makes in one forward + backward of the ring (module
    docstring), in execution order within each phase."""
    validate_ring_order(ring_order)
    for name, v in (("num_nodes", num_nodes), ("num_local", num_local)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    table = source_table(num_nodes, num_local, ring_order)
    P = table.shape[0]
    if not np.array_equal(table[:, 0], np.arange(P)):
        raise AssertionError("step 0 of the schedule must be every rank's own chunk")
    n_inner, inner, outer = _rings(num_nodes, num_local, ring_order)
    hops = [Hop("forward", s, _axis(table, s, s - 1, n_inner, inner, outer, -1), "kv") for s in range(1, P)]
    for s in reversed(range(P - 1)):
        axis = _axis(table, s, s + 1, n_inner, inner, outer, +1)
        if s > 0:
            hops.append(Hop("backward", s, axis, "kv"))
        hops.append(Hop("backward", s, axis, "dkv"))
    return hops


def hop_bytes(hop: Hop, *, batch: int, chunk_len: int, kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Bytes one rank sends in ``hop``: ``[2, batch, chunk_len, kv_heads, head_dim]`` of ``itemsize``
    (K/V in the input dtype) or of 4 bytes (float32 dK/dV)."""
    return 2 * batch * chunk_len * kv_heads * head_dim * (4 if hop.what == "dkv" else itemsize)


def hop_pairs(hop: Hop, num_nodes: int, num_local: int, ring_order: str) -> frozenset:
    """``(source, target)`` ranks of ``hop`` over all ranks (node-major): forward hops go one place
    along their ring, backward hops one place back."""
    _, inner, outer = _rings(num_nodes, num_local, ring_order)
    step = inner if hop.axis == "inner" else outer
    d = 1 if hop.phase == "forward" else -1
    return frozenset((r, step(r, d)) for r in range(num_nodes * num_local))


def ring_bytes(num_nodes: int, num_local: int, ring_order: str, **shape) -> dict[str, int]:
    """``{"inner": bytes, "outer": bytes}`` one rank sends per forward + backward (``shape``: the
    keywords of :func:`hop_bytes`)."""
    out = {"inner": 0, "outer": 0}
    for hop in ring_hops(num_nodes, num_local, ring_order):
        out[hop.axis] += hop_bytes(hop, **shape)
    return out


def transfer_units(num_nodes: int, num_local: int, ring_order: str, itemsize: int = 2) -> tuple[float, float]:
    """``(inner, outer)`` traffic per rank and forward + backward in units of one K/V buffer of
    ``itemsize`` bytes per element (bf16 by default, where a float32 dK/dV hop counts 2)."""
    b = ring_bytes(num_nodes, num_local, ring_order, batch=1, chunk_len=1, kv_heads=1, head_dim=1, itemsize=itemsize)
    unit = 2 * itemsize
    return b["inner"] / unit, b["outer"] / unit
