"""Which rank's K/V chunk each rank sees at each ring step (flat and hierarchical orders).

Shared by the ring (:mod:`.attention`) and the per-step index conversion
(:mod:`mtraining_jax.sparsity.convert`) so both agree on the visit order. Ranks are node-major,
``rank = node * L + local`` on an ``(N, L)`` mesh, ``P = N * L``.

* ``flat``: one ring over all P ranks; at step ``s`` rank ``r`` holds the chunk of ``(r - s) mod P``.
* ``hierarchical`` (MTraining Algorithm 2): step ``s = i * L + j`` (outer step ``i`` over nodes,
  inner step ``j`` over local devices); rank ``(n, l)`` holds the chunk of
  ``((n - i) mod N, (l - j) mod L)``.
"""

from __future__ import annotations

import numpy as np

RING_ORDERS = ("flat", "hierarchical")


def validate_ring_order(order: str) -> None:
    if order not in RING_ORDERS:
        raise ValueError(f"unknown ring order {order!r}; expected one of {RING_ORDERS}")


def source_rank(rank, step, num_nodes: int, num_local: int, order: str):
    """Rank whose K/V chunk ``rank`` holds at ring ``step`` (works on ints, NumPy or JAX arrays)."""
    validate_ring_order(order)
    P = num_nodes * num_local
    if order == "flat":
        return (rank - step) % P
    n, l = rank // num_local, rank % num_local
    i, j = step // num_local, step % num_local
    return ((n - i) % num_nodes) * num_local + (l - j) % num_local


def source_table(num_nodes: int, num_local: int, order: str) -> np.ndarray:
    """``int32 [P, P]``: ``table[rank, step]`` = source rank (each row is a permutation)."""
    P = num_nodes * num_local
    r = np.arange(P)[:, None]
    s = np.arange(P)[None, :]
    return np.asarray(source_rank(r, s, num_nodes, num_local, order), dtype=np.int32)
