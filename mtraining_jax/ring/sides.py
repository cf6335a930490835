"""Which side circulates in the ring's backward (``backward_ring``, :class:`.config.RingOptions`)
and what one hop of each costs.

``"kv"``: K, V and the float32 dK/dV accumulators travel; ``"query"`` (BurstEngine, paper 004 §3):
Q, ``dO``, ``lse``, ``delta`` and the float32 dQ accumulator travel; ``"auto"``: the side whose hop
moves fewer bytes (:func:`backward_hop_bytes`, the one byte count, also used by the cost model):
the query side for multi-head attention, the K/V side for GQA. The passes are :mod:`.backward`.
"""

from __future__ import annotations

BACKWARD_RINGS = ("auto", "kv", "query")
BACKWARD_SIDES = ("kv", "query")  # what "auto" resolves to


def validate_backward_ring(side: str) -> None:
    if side not in BACKWARD_RINGS:
        raise ValueError(f"unknown backward_ring {side!r}; expected one of {BACKWARD_RINGS}")


def backward_hop_bytes(side: str, *, batch: int, chunk_len: int, heads: int, kv_heads: int, head_dim: int,
                       itemsize: int) -> dict[str, int]:
    """Bytes one rank sends in one backward hop of a chunk of ``chunk_len`` tokens, per buffer:

    * ``"kv"``: ``{"kv": 2 B Sl Hkv D itemsize, "dkv": 2 B Sl Hkv D 4}``;
    * ``"query"``: ``{"q": B Sl Hq (2 D itemsize + 2 * 4), "dq": B Sl Hq D 4}`` (Q and dO in the
      input dtype and float32 ``lse``, ``delta`` in one buffer; the float32 dQ accumulator).
    """
    if side == "kv":
        n = batch * chunk_len * kv_heads * head_dim
        return {"kv": 2 * n * itemsize, "dkv": 2 * n * 4}
    if side == "query":
        rows = batch * chunk_len * heads
        return {"q": rows * (2 * head_dim * itemsize + 2 * 4), "dq": rows * head_dim * 4}
    raise ValueError(f"side must be one of {BACKWARD_SIDES}, got {side!r}")


def resolve_backward_ring(side: str, *, heads: int, kv_heads: int, head_dim: int, itemsize: int,
                          query_ok: bool = True) -> str:
    """``"kv"`` or ``"query"``: ``side`` itself, or for ``"auto"`` the side whose hop (one traveling
    buffer + its accumulator) is smaller per token; ties and ``query_ok=False`` (an index that only
    describes this rank's own queries) give ``"kv"``."""
    validate_backward_ring(side)
    if side != "auto":
        return side
    shape = dict(batch=1, chunk_len=1, heads=heads, kv_heads=kv_heads, head_dim=head_dim, itemsize=itemsize)
    q = sum(backward_hop_bytes("query", **shape).values())
    kv = sum(backward_hop_bytes("kv", **shape).values())
    return "query" if query_ok and q < kv else "kv"
