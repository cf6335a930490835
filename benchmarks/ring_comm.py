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

The query-side backward (``backward_ring="query"``, :mod:`mtraining_jax.ring.sides`) holds at
backward step ``s`` the queries of the rank ``t`` with ``source_table[t, s] == rank`` and moves
them ``+1`` along the rings: one packed buffer ``q`` (Q, dO in the input dtype, float32 lse and
delta) per transition (``P-1``: the first, into step ``P-1``, is a ``diagonal`` hop from the rank
``(n-1, l-1)``, overlapping the own step) and one float32 dQ accumulator ``dq`` per transition
(``P-1``: inner hops within an outer step, one outer hop of the node's running total per outer
step). :func:`ring_hops` checks every one against the table.

The sparse-aware K/V exchange (``kv_exchange="sparse"``, :mod:`mtraining_jax.ring.exchange`) sends at
every step ``s >= 1`` one compact K/V buffer ``[2, B, capacity, Hkv, D]`` straight from the chunk's
owner to its holder (axis ``direct``, pairs ``(table[r, s], r)``) in the forward (kept for the
backward), and in the backward one compact float32 dK/dV buffer back (``direct``, holder to owner):
:func:`exchange_hops`, with ``chunk_len = capacity`` in :func:`hop_bytes`. A direct hop uses the
outer (inter-node) link when any of its pairs crosses nodes.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from mtraining_jax.ring.schedule import source_table, validate_ring_order
from mtraining_jax.ring.sides import BACKWARD_SIDES, backward_hop_bytes

__all__ = ["Hop", "ring_hops", "exchange_hops", "hop_bytes", "hop_pairs", "hop_link", "ring_bytes",
           "exchange_link_bytes", "transfer_units"]


class Hop(NamedTuple):
    """One collective-permute of one rank: ``phase`` ``"forward"`` / ``"backward"``; ``step``: the
    ring step whose chunk it delivers; ``axis`` ``"inner"`` / ``"outer"`` / ``"diagonal"`` (the
    query side's first hop, node and local one place on) / ``"direct"`` (the sparse exchange: owner
    to holder, dK/dV back); ``what`` ``"kv"`` (K/V in the input
    dtype), ``"dkv"`` (float32 dK/dV), ``"q"`` (Q, dO, lse, delta) or ``"dq"`` (float32 dQ)."""

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


def _query_hops(table, num_nodes: int, num_local: int, ring_order: str) -> list[Hop]:
    """The query-side backward's hops (module docstring), each checked against the table: the
    receiver holds at the hop's step the queries the sender held at the step before (the own step
    0 for the diagonal hop)."""
    P = table.shape[0]
    n_inner, inner, outer = _rings(num_nodes, num_local, ring_order)
    qtable = np.argsort(table, axis=0)  # qtable[r, s] = t with table[t, s] == r
    hops, prev = [], {}
    if P > 1:
        hops.append(Hop("backward", P - 1, "diagonal", "q"))
        prev[hops[-1]] = 0
    n_outer = P // n_inner
    for i in reversed(range(n_outer)):
        if i > 0 and i * n_inner - 1 != 0:
            hops.append(Hop("backward", i * n_inner - 1, "outer", "q"))
            prev[hops[-1]] = i * n_inner - 1 + n_inner
        for j in reversed(range(1, n_inner)):
            s = i * n_inner + j
            for what in (("q", "dq") if s - 1 else ("dq",)):
                hops.append(Hop("backward", s - 1, "inner", what))
                prev[hops[-1]] = s
        if i > 0:
            hops.append(Hop("backward", (i - 1) * n_inner, "outer", "dq"))
            prev[hops[-1]] = i * n_inner
    for h in hops:
        for src, dst in hop_pairs(h, num_nodes, num_local, ring_order):
            if qtable[dst, h.step] != qtable[src, prev[h]]:
                raise AssertionError(f"{h}: rank {dst} would not hold the queries {src} sends")
    return hops


def ring_hops(num_nodes: int, num_local: int, ring_order: str, backward_ring: str = "kv") -> list[Hop]:
    """Every collective-permute one rank makes in one forward + backward of the ring (module
    docstring), in execution order within each phase; ``backward_ring``: ``"kv"`` or ``"query"``
    (a resolved side, :data:`mtraining_jax.ring.sides.BACKWARD_SIDES`)."""
    validate_ring_order(ring_order)
    if backward_ring not in BACKWARD_SIDES:
        raise ValueError(f"backward_ring must be one of {BACKWARD_SIDES}, got {backward_ring!r}")
    for name, v in (("num_nodes", num_nodes), ("num_local", num_local)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    table = source_table(num_nodes, num_local, ring_order)
    P = table.shape[0]
    if not np.array_equal(table[:, 0], np.arange(P)):
        raise AssertionError("step 0 of the schedule must be every rank's own chunk")
    n_inner, inner, outer = _rings(num_nodes, num_local, ring_order)
    hops = [Hop("forward", s, _axis(table, s, s - 1, n_inner, inner, outer, -1), "kv") for s in range(1, P)]
    if backward_ring == "query":
        return hops + _query_hops(table, num_nodes, num_local, ring_order)
    for s in reversed(range(P - 1)):
        axis = _axis(table, s, s + 1, n_inner, inner, outer, +1)
        if s > 0:
            hops.append(Hop("backward", s, axis, "kv"))
        hops.append(Hop("backward", s, axis, "dkv"))
    return hops


def hop_bytes(hop: Hop, *, batch: int, chunk_len: int, kv_heads: int, head_dim: int, itemsize: int,
              heads: int | None = None) -> int:
    """Bytes one rank sends in ``hop``: ``[2, batch, chunk_len, kv_heads, head_dim]`` of ``itemsize``
    (K/V in the input dtype) or of 4 bytes (float32 dK/dV); the query side's buffers over ``heads``
    query heads (:func:`mtraining_jax.ring.sides.backward_hop_bytes`, the count the ring chooses by)."""
    side = "query" if hop.what in ("q", "dq") else "kv"
    if side == "query" and heads is None:
        raise ValueError(f"{hop}: the query side's bytes need heads")
    return backward_hop_bytes(side, batch=batch, chunk_len=chunk_len, heads=heads or kv_heads, kv_heads=kv_heads,
                              head_dim=head_dim, itemsize=itemsize)[hop.what]


def exchange_hops(num_nodes: int, num_local: int, ring_order: str, backward_ring: str = "kv") -> list[Hop]:
    """Every collective-permute one rank makes in one forward + backward with the sparse K/V
    exchange (module docstring): ``P - 1`` direct K/V sends forward; with the K/V-side backward
    ``P - 1`` direct dK/dV returns, with the query side that ring's hops (:func:`ring_hops`)."""
    hops = ring_hops(num_nodes, num_local, ring_order, backward_ring)  # validates
    P = num_nodes * num_local
    fwd = [Hop("forward", s, "direct", "kv") for s in range(1, P)]
    if backward_ring == "query":
        return fwd + [h for h in hops if h.phase == "backward"]
    return fwd + [Hop("backward", s, "direct", "dkv") for s in range(1, P)]


def hop_pairs(hop: Hop, num_nodes: int, num_local: int, ring_order: str) -> frozenset:
    """``(source, target)`` ranks of ``hop`` over all ranks (node-major): forward hops and the query
    side's go one place along their ring (``diagonal``: node and local one place on), the K/V
    side's backward hops one place back."""
    _, inner, outer = _rings(num_nodes, num_local, ring_order)
    if hop.axis == "direct":  # owner -> holder of step hop.step (dK/dV: back to the owner)
        table = source_table(num_nodes, num_local, ring_order)
        pairs = [(int(table[r, hop.step]), r) for r in range(num_nodes * num_local)]
        return frozenset((b, a) for a, b in pairs) if hop.what == "dkv" else frozenset(pairs)
    d = 1 if hop.phase == "forward" or hop.what in ("q", "dq") else -1
    if hop.axis == "diagonal":
        return frozenset((r, outer(inner(r, d), d)) for r in range(num_nodes * num_local))
    step = inner if hop.axis == "inner" else outer
    return frozenset((r, step(r, d)) for r in range(num_nodes * num_local))


def hop_link(hop: Hop, num_nodes: int, ring_order: str, num_local: int | None = None) -> str:
    """``"inner"`` or ``"outer"``: the link class ``hop`` uses (the diagonal hop crosses nodes when
    the hierarchical ring has an outer ring; a direct hop when one of its pairs does, which needs
    ``num_local``)."""
    if hop.axis == "direct":
        if num_local is None:
            raise ValueError(f"{hop}: the link of a direct hop needs num_local")
        return "outer" if any(a // num_local != b // num_local
                              for a, b in hop_pairs(hop, num_nodes, num_local, ring_order)) else "inner"
    if hop.axis != "diagonal":
        return hop.axis
    return "outer" if ring_order == "hierarchical" and num_nodes > 1 else "inner"


def ring_bytes(num_nodes: int, num_local: int, ring_order: str, backward_ring: str = "kv", **shape) -> dict[str, int]:
    """``{"inner": bytes, "outer": bytes}`` one rank sends per forward + backward (``shape``: the
    keywords of :func:`hop_bytes`)."""
    out = {"inner": 0, "outer": 0}
    for hop in ring_hops(num_nodes, num_local, ring_order, backward_ring):
        out[hop_link(hop, num_nodes, ring_order)] += hop_bytes(hop, **shape)
    return out


def exchange_link_bytes(num_nodes: int, num_local: int, ring_order: str, backward_ring: str = "kv", *,
                        capacity: int, **shape) -> dict[str, int]:
    """``{"inner": bytes, "outer": bytes}`` one rank sends per forward + backward with the sparse
    exchange: its direct hops carry ``capacity`` tokens, the query-side backward's hops whole chunks
    (``shape``: the keywords of :func:`hop_bytes`, ``chunk_len`` the chunk)."""
    out = {"inner": 0, "outer": 0}
    for hop in exchange_hops(num_nodes, num_local, ring_order, backward_ring):
        n = dict(shape, chunk_len=capacity) if hop.axis == "direct" else shape
        out[hop_link(hop, num_nodes, ring_order, num_local)] += hop_bytes(hop, **n)
    return out


def transfer_units(num_nodes: int, num_local: int, ring_order: str, itemsize: int = 2, backward_ring: str = "kv",
                   heads_per_kv: int = 1, head_dim: int = 1) -> tuple[float, float]:
    """``(inner, outer)`` traffic per rank and forward + backward in units of one K/V buffer of
    ``itemsize`` bytes per element (bf16 by default, where a float32 dK/dV hop counts 2); the query
    side's buffers scale with ``heads_per_kv`` (``Hq / Hkv``) and, through lse / delta, ``head_dim``."""
    b = ring_bytes(num_nodes, num_local, ring_order, backward_ring, batch=1, chunk_len=1, kv_heads=1,
                   heads=heads_per_kv, head_dim=head_dim, itemsize=itemsize)
    unit = 2 * head_dim * itemsize
    return b["inner"] / unit, b["outer"] / unit
