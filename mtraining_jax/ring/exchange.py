"""Sparse-aware K/V exchange (``kv_exchange="sparse"``, :class:`.config.RingOptions`): what each
rank needs of a visiting chunk, the compact index over what it receives, the choice between the
exchange and the ring, and the bytes each moves.

At every ring step ``s >= 1`` the owner of a chunk sends the rank that would hold it
(``schedule.source_rank``) only the tokens that rank's index touches: the KV blocks of its active
tiles plus its vertical columns outside them. Every rank holds the identical global index, so
sender and receiver derive the same token list (:func:`needed_tokens`) with no extra messages.
The passes are :mod:`.exchange_ring`.

Static shapes: one ``capacity`` (tokens, a multiple of the block size) per layer call: exact (the
max need over (rank, step), :func:`host_capacity`, when the index is concrete) or configured (a
fraction of the chunk), then guarded at run time: a step whose need exceeds it on any rank sends
the whole chunk (exact either way). The token set is the union over batch and heads, laid out as
``[needed blocks ascending | needed columns ascending | padding]`` (:func:`compact_index`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from mtraining_jax.ring.index_source import has_every_rank
from pallas_kernels.index_format import StepIndex

KV_EXCHANGES = ("auto", "ring", "sparse")
KV_EXCHANGE_CHOICES = ("ring", "sparse")  # what "auto" resolves to
#: capacity (fraction of the chunk) when none is given and the index is traced
DEFAULT_CAPACITY_FRACTION = 0.5

__all__ = ["KV_EXCHANGES", "validate_kv_exchange", "needed_tokens", "compact_index", "capacity_tokens",
           "host_capacity", "exchange_bytes", "ring_kv_bytes", "resolve_kv_exchange", "plan_exchange"]


def validate_kv_exchange(mode: str) -> None:
    if mode not in KV_EXCHANGES:
        raise ValueError(f"unknown kv_exchange {mode!r}; expected one of {KV_EXCHANGES}")


def needed_tokens(index: StepIndex, sk: int, block_size: int, capacity: int):
    """The tokens of a visiting chunk of ``sk`` keys that ``index`` touches.

    Returns ``(tokens int32 [capacity], count int32 [], compact_of int32 [sk])``: ``tokens`` the
    chunk-local ids laid out as ``[needed blocks ascending (whole blocks) | needed columns outside
    them ascending | unneeded tokens]`` (the first ``capacity``), ``count`` the number of needed
    tokens (the exchange is exact iff ``count <= capacity``) and ``compact_of[t]`` the place of
    token ``t`` in that order. A pure function of the index: sender and receiver agree."""
    bs = block_size
    nkb = sk // bs
    valid = jnp.arange(index.max_blocks) < index.block_count[..., None]
    # max, not set: the same block / column listed by many rows; a max-scatter is deterministic
    blk = jnp.zeros((nkb,), bool).at[jnp.where(valid, index.block_idx, nkb).reshape(-1)].max(True, mode="drop")
    ncols = index.col_count.max(axis=-1, initial=0)  # [B, H]: the longest prefix of each list
    cvalid = jnp.arange(index.max_cols) < ncols[..., None]
    col = jnp.zeros((sk,), bool).at[jnp.where(cvalid, index.col_idx, sk).reshape(-1)].max(True, mode="drop")
    in_blk = jnp.repeat(blk, bs)
    col = col & ~in_blk
    t = jnp.arange(sk, dtype=jnp.int32)
    key = jnp.where(in_blk, t, jnp.where(col, sk + t, 2 * sk + t))
    order = jnp.argsort(key).astype(jnp.int32)
    compact_of = jnp.zeros((sk,), jnp.int32).at[order].set(t, unique_indices=True)  # order: a permutation
    count = (in_blk.sum() + col.sum()).astype(jnp.int32)
    return order[:capacity], count, compact_of


def compact_index(index: StepIndex, compact_of, capacity: int, block_size: int) -> StepIndex:
    """``index`` over the compact chunk of :func:`needed_tokens` (``capacity`` keys): block ids
    and column ids renumbered (order kept, so rows stay ascending and column prefixes stay
    prefixes; padding entries clipped into range) and the block slots cut to the compact chunk's
    blocks (a row's active blocks are needed blocks, so they fit when the need does); the causal
    flags are kept (the same tokens, whole blocks)."""
    nb = capacity // block_size
    mb = min(nb, index.max_blocks)  # a row holds at most the needed blocks, all within the capacity
    blocks = jnp.clip(compact_of[index.block_idx[..., :mb] * block_size] // block_size, 0, nb - 1)
    cols = jnp.clip(compact_of[index.col_idx], 0, capacity - 1)
    return index._replace(block_idx=blocks.astype(jnp.int32), block_count=jnp.minimum(index.block_count, mb),
                          block_causal=index.block_causal[..., :mb], col_idx=cols.astype(jnp.int32))


def capacity_tokens(capacity, chunk_len: int, block_size: int) -> int:
    """Static capacity in tokens: ``capacity`` an int (tokens) or a float in ``(0, 1]`` (fraction
    of the chunk), rounded up to whole blocks and at most the chunk."""
    if isinstance(capacity, bool) or not isinstance(capacity, (int, float)):
        raise ValueError(f"exchange_capacity must be a token count or a fraction in (0, 1], got {capacity!r}")
    if isinstance(capacity, float):
        if not 0 < capacity <= 1:
            raise ValueError(f"exchange_capacity as a fraction must be in (0, 1], got {capacity!r}")
        capacity = math.ceil(capacity * chunk_len)
    if capacity < 1:
        raise ValueError(f"exchange_capacity must be positive, got {capacity!r}")
    return min(chunk_len, -(-capacity // block_size) * block_size)


def host_capacity(step_index, num_ranks: int, chunk_len: int, block_size: int) -> int | None:
    """The exact capacity (max need over every (rank, step >= 1), whole blocks, at least one block)
    computed on the host when ``step_index`` (a :class:`~.index_source.GlobalIndexSource`) holds a
    concrete global index; ``None`` when they are traced (then a configured capacity is guarded at run time)."""
    leaves = jax.tree.leaves(step_index.index)
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
        return None

    def counts(r):
        src = step_index.for_rank(r)
        return jnp.stack([needed_tokens(src.step(s), chunk_len, block_size, block_size)[1]
                          for s in range(1, num_ranks)])

    with jax.ensure_compile_time_eval():  # evaluated now, also inside a jit / shard_map trace
        need = int(jax.vmap(counts)(jnp.arange(num_ranks, dtype=jnp.int32)).max())
    return capacity_tokens(max(need, 1), chunk_len, block_size)


def ring_kv_bytes(num_ranks: int, *, batch: int, chunk_len: int, kv_heads: int, head_dim: int, itemsize: int,
                  backward: bool = True, num_nodes: int = 1, ring_order: str = "flat") -> dict[str, int]:
    """``{"inner": bytes, "outer": bytes}`` one rank sends on the K/V-side ring per forward (+
    backward): ``P - 1`` K/V hops forward, ``P - 2`` K/V and ``P - 1`` float32 dK/dV hops backward;
    ``outer`` (between nodes) are the hierarchical ring's node hops (``N - 1`` K/V forward, ``N - 1``
    dK/dV and ``N - 1`` K/V backward, one fewer K/V when a node holds one rank), and the flat ring's
    hops when it spans several nodes (as ``benchmarks/ring_comm.py`` counts per hop)."""
    n = 2 * batch * chunk_len * kv_heads * head_dim
    P, N = num_ranks, num_nodes
    total = (P - 1) * n * itemsize + ((max(P - 2, 0) * n * itemsize + (P - 1) * n * 4) if backward else 0)
    if N == 1:
        return {"inner": total, "outer": 0}
    if ring_order == "flat":
        return {"inner": 0, "outer": total}
    kv_back = N - 1 - (1 if P == N else 0)  # L = 1: the last backward hop would bring the own chunk
    outer = (N - 1) * n * itemsize + ((kv_back * n * itemsize + (N - 1) * n * 4) if backward else 0)
    return {"inner": total - outer, "outer": outer}


def exchange_bytes(num_ranks: int, *, batch: int, capacity: int, kv_heads: int, head_dim: int, itemsize: int,
                   backward: bool = True, num_nodes: int = 1, ring_order: str = "flat") -> dict[str, int]:
    """``{"inner": bytes, "outer": bytes}`` one rank sends with the sparse exchange per forward (+
    K/V-side backward): ``P - 1`` compact K/V buffers ``[2, B, capacity, Hkv, D]`` forward (kept for
    the backward) and ``P - 1`` float32 dK/dV buffers of that shape back to their owners; a step's
    sends are ``outer`` when one of its (owner, holder) pairs lies on two nodes (hierarchical: steps
    ``s >= L``; flat on several nodes: every step)."""
    n = 2 * batch * capacity * kv_heads * head_dim
    per_step = n * itemsize + (n * 4 if backward else 0)
    P, N = num_ranks, num_nodes
    cross = 0 if N == 1 else (P - 1 if ring_order == "flat" else P - P // N)
    return {"inner": (P - 1 - cross) * per_step, "outer": cross * per_step}


def resolve_kv_exchange(mode: str, *, num_ranks: int, chunk_len: int, capacity: int, batch: int, kv_heads: int,
                        head_dim: int, itemsize: int, backward_side: str = "kv", exchange_ok: bool = True,
                        num_nodes: int = 1, ring_order: str = "flat") -> str:
    """``"ring"`` or ``"sparse"``: ``mode`` itself, or for ``"auto"`` the exchange when it leaves out
    part of each chunk (``capacity < chunk_len``) and sends fewer bytes in total AND no more between
    nodes than the ring per forward + backward (with the query-side backward only the forward's K/V
    count); ties, one rank and ``exchange_ok=False`` give ``"ring"``."""
    validate_kv_exchange(mode)
    if mode != "auto":
        return mode
    if not exchange_ok or num_ranks == 1 or capacity >= chunk_len:
        return "ring"
    shape = dict(batch=batch, kv_heads=kv_heads, head_dim=head_dim, itemsize=itemsize, backward=backward_side == "kv",
                 num_nodes=num_nodes, ring_order=ring_order)
    sparse = exchange_bytes(num_ranks, capacity=capacity, **shape)
    ring = ring_kv_bytes(num_ranks, chunk_len=chunk_len, **shape)
    fewer = sum(sparse.values()) < sum(ring.values()) and sparse["outer"] <= ring["outer"]
    return "sparse" if fewer else "ring"


def plan_exchange(mode: str, step_index, capacity, *, num_ranks: int, chunk_len: int, block_size: int, batch: int,
                  kv_heads: int, head_dim: int, itemsize: int, backward_side: str = "kv", num_nodes: int = 1,
                  ring_order: str = "flat") -> tuple[str, int, bool]:
    """``(choice, capacity_tokens, guard)`` of one layer call: ``choice`` ``"ring"`` / ``"sparse"``
    (``mode`` resolved by :func:`resolve_kv_exchange`), the static capacity (0 for the ring) and
    whether it must be checked at run time.

    ``capacity``: ``None`` — exact from the index on the host (:func:`host_capacity`) when it is
    concrete, else :data:`DEFAULT_CAPACITY_FRACTION` of the chunk, guarded; an int (tokens) or a
    fraction in ``(0, 1]`` — that, guarded. The exchange needs every rank's index (``step_index``
    with ``for_rank``): ``"sparse"`` without one is a ``ValueError``, ``"auto"`` then gives the ring;
    on one rank there is nothing to exchange (the ring)."""
    validate_kv_exchange(mode)
    if capacity is not None:
        capacity_tokens(capacity, chunk_len, block_size)  # validate up front
    if mode == "ring":
        return "ring", 0, False
    exchange_ok = step_index is not None and has_every_rank(step_index)
    if mode == "sparse" and not exchange_ok:
        raise ValueError(f"kv_exchange='sparse' needs the index of every rank's queries (an index source with "
                         f"for_rank, e.g. RankStepIndex); got {type(step_index).__name__}")
    if not exchange_ok or num_ranks == 1:
        return "ring", 0, False
    if capacity is None:
        cap = host_capacity(step_index, num_ranks, chunk_len, block_size)
        guard = cap is None
        cap = capacity_tokens(DEFAULT_CAPACITY_FRACTION, chunk_len, block_size) if guard else cap
    else:
        cap, guard = capacity_tokens(capacity, chunk_len, block_size), True
    choice = resolve_kv_exchange(mode, num_ranks=num_ranks, chunk_len=chunk_len, capacity=cap, batch=batch,
                                 kv_heads=kv_heads, head_dim=head_dim, itemsize=itemsize, backward_side=backward_side,
                                 num_nodes=num_nodes, ring_order=ring_order)
    return (choice, cap, guard) if choice == "sparse" else ("ring", 0, False)
