"""The ring cost model's sparse-aware K/V exchange (:mod:`benchmarks.comm_model`, issue 22 item 2): what
each rank needs of each chunk (:func:`exchange_need`), the bytes it moves (:func:`exchange_bytes`), hot-block
replication (:func:`hot_blocks`) and the table over meshes and layouts (:func:`exchange_rows`)."""

from __future__ import annotations


import numpy as np



# ------------------------------------------------------------------ sparse-aware K/V exchange (item 2)


def _need_sets(index, positions, block_size: int):
    """Per query rank ``r``: ``blk [P, nb]`` the global KV blocks its slashes hit, ``cols[r]`` the
    vertical columns (global positions, causal for one of its queries) outside those blocks, and
    ``owner [nb]`` the rank holding each global block; united over batch and heads."""
    import numpy as np

    v_idx, v_count, s_idx, s_count = (np.asarray(x) for x in index)
    pos = np.asarray(positions)
    P, sl = pos.shape
    bs = block_size
    nb = pos.size // bs
    owner = np.empty(nb, np.int64)  # global block -> rank holding it
    qblocks = pos.reshape(P, sl // bs, bs)[:, :, 0] // bs  # [P, nQB]
    for r in range(P):
        owner[qblocks[r]] = r
    qmax = pos.max(axis=1)
    B, H, _ = s_idx.shape
    blk = np.zeros((P, nb), bool)
    cols_all = []
    for r in range(P):
        cols = []
        for b in range(B):
            for h in range(H):
                d = s_idx[b, h, :s_count[b, h]]
                kb = (qblocks[r][:, None] - d[None, :]).ravel()
                blk[r, kb[kb >= 0]] = True
                v = v_idx[b, h, :v_count[b, h]]
                cols.append(v[v <= qmax[r]])
        cols = np.unique(np.concatenate(cols)) if cols else np.zeros(0, np.int64)
        cols_all.append(cols[~blk[r, cols // bs]])
    return blk, cols_all, owner


def exchange_need(index, positions, block_size: int, kv_heads: int, exclude_blocks=None) -> "np.ndarray":
    """``int [P, P]``: tokens of rank ``a``'s K/V chunk that rank ``r``'s queries need,
    ``need[r, a]`` (the blocks its slashes hit + the vertical columns outside those blocks, causal
    for at least one of its queries), united over batch and heads as the exchange sends them (one
    token list per pair: the kernels take one ``k_pos`` per chunk; ``mtraining_jax.ring.exchange``).
    ``kv_heads`` is kept for the callers (the union does not depend on it); ``exclude_blocks``
    (``bool [nb]`` over global blocks): blocks every rank holds already (hot-block replication),
    not counted.

    ``index``: a :class:`~mtraining_jax.sparsity.index.VerticalSlashIndex` (NumPy or JAX arrays);
    ``positions``: the layout's ``int [P, S/P]`` global positions (block-aligned)."""
    import numpy as np

    blk, cols, owner = _need_sets(index, positions, block_size)
    P = blk.shape[0]
    keep = np.ones(blk.shape[1], bool) if exclude_blocks is None else ~np.asarray(exclude_blocks, bool)
    need = np.zeros((P, P), np.int64)
    for r in range(P):
        c = cols[r][keep[cols[r] // block_size]]
        need[r] = (np.bincount(owner[blk[r] & keep], minlength=P) * block_size
                   + np.bincount(owner[c // block_size], minlength=P))
    return need


def hot_blocks(index, positions, block_size: int, num_nodes: int, num_local: int, ring_order: str = "hierarchical",
               *, share: float = 0.9, kv_heads: int = 2, head_dim: int = 128, itemsize: int = 2,
               batch: int = 1) -> dict:
    """Hot-block replication (issue 22, item 4), modelled on an index: the global KV blocks that at
    least ``share`` of the other ranks need (attention sinks, first tokens, dense columns) would be
    all-gathered once per layer and kept resident, their float32 dK/dV reduced to the owners once,
    and left out of the exchange's per-step capacity.

    Returns the hot block count, the exchange's exact capacity (tokens) without / with replication,
    its bytes per rank (:func:`exchange_bytes` with the reduced ``need``, plus the replication's
    ``hot * bs * (P - 1) / P`` tokens of K/V in and float32 dK/dV out), the ring's bytes, and the
    exchange's per-step padding (``step_imbalance``: mean over steps of the step's max need / mean
    need over ranks — the waste of one capacity for all pairs) without / with."""
    import numpy as np

    from mtraining_jax.ring.schedule import source_table

    blk, cols, owner = _need_sets(index, positions, block_size)
    P, nb = blk.shape
    sl = np.asarray(positions).shape[1]
    touch = blk.copy()  # blocks a rank needs anything of: its slash blocks and its columns' blocks
    for r in range(P):
        touch[r, cols[r] // block_size] = True
    others = touch & (owner[None, :] != np.arange(P)[:, None])
    hot = others.sum(axis=0) >= share * (P - 1)
    table = source_table(num_nodes, num_local, ring_order)
    shape = dict(chunk_len=sl, block_size=block_size, kv_heads=kv_heads, head_dim=head_dim, itemsize=itemsize,
                 batch=batch)

    def imbalance(need):
        per = [np.array([need[r, table[r, s]] for r in range(P)]) for s in range(1, P)]
        return float(np.mean([p.max() / max(p.mean(), 1e-9) for p in per]))

    base_need = exchange_need(index, positions, block_size, kv_heads)
    hot_need = exchange_need(index, positions, block_size, kv_heads, exclude_blocks=hot)
    base = exchange_bytes(base_need, num_nodes, num_local, ring_order, **shape)
    red = exchange_bytes(hot_need, num_nodes, num_local, ring_order, **shape)
    per_token = 2 * batch * kv_heads * head_dim * (itemsize + 4)
    replicate = int(hot.sum()) * block_size * (P - 1) / P * per_token
    return {"hot_blocks": int(hot.sum()), "hot_tokens_fraction_of_chunk": hot.sum() * block_size / sl,
            "capacity": base["capacity"], "capacity_replicated": red["capacity"],
            "exchange_bytes": base["exchange"], "exchange_bytes_replicated": red["exchange"] + replicate,
            "ring_bytes": base["full"], "step_imbalance": imbalance(base_need),
            "step_imbalance_replicated": imbalance(hot_need),
            "pays": red["exchange"] + replicate < min(base["exchange"], base["full"])}


def exchange_bytes(need, num_nodes: int, num_local: int, ring_order: str, *, chunk_len: int, block_size: int,
                   kv_heads: int, head_dim: int, itemsize: int, batch: int = 1) -> dict:
    """Bytes per rank of the sparse-aware exchange as built (``kv_exchange="sparse"``) against the
    K/V-side ring, for the index whose pair needs are ``need`` (:func:`exchange_need`).

    The exchange has one static capacity per layer call: the max need over every pair ``(r, a != r)``,
    rounded up to whole blocks (:func:`mtraining_jax.ring.exchange.host_capacity`); per step ``s >= 1``
    it sends every rank a compact K/V buffer of that capacity straight from the chunk's owner (kept
    for the backward) and returns its float32 dK/dV (:func:`mtraining_jax.ring.exchange.exchange_bytes`).
    Returns ``{"exchange": bytes, "full": bytes, "fraction", "capacity": tokens, "capacity_fraction",
    "outer_exchange", "outer_full", "choice": "exchange" | "ring"}`` (the choice of
    ``kv_exchange="auto"``: fewer bytes and no more between nodes) and ``ideal_fraction``: every pair
    sending exactly its own need (a ragged exchange, no static capacity), the bound no uniform-shape
    permute reaches."""
    import numpy as np

    from mtraining_jax.ring.exchange import capacity_tokens, exchange_bytes as ring_exchange_bytes
    from mtraining_jax.ring.exchange import resolve_kv_exchange, ring_kv_bytes
    from mtraining_jax.ring.schedule import source_table

    table = source_table(num_nodes, num_local, ring_order)
    P = table.shape[0]
    off = ~np.eye(P, dtype=bool)
    cap = capacity_tokens(max(int(need[off].max()) if P > 1 else 1, 1), chunk_len, block_size)
    shape = dict(batch=batch, kv_heads=kv_heads, head_dim=head_dim, itemsize=itemsize, num_nodes=num_nodes,
                 ring_order=ring_order)
    ex = ring_exchange_bytes(P, capacity=cap, **shape)
    full = ring_kv_bytes(P, chunk_len=chunk_len, **shape)
    per_token = 2 * batch * kv_heads * head_dim * (itemsize + 4)
    ideal = sum(np.mean([need[r, table[r, s]] for r in range(P)]) * per_token for s in range(1, P))
    tot_ex, tot_full = sum(ex.values()), sum(full.values())
    choice = resolve_kv_exchange("auto", num_ranks=P, chunk_len=chunk_len, capacity=cap, **shape)
    return {"exchange": tot_ex, "full": tot_full, "fraction": tot_ex / tot_full if tot_full else 0.0,
            "capacity": cap, "capacity_fraction": cap / chunk_len, "outer_exchange": ex["outer"],
            "outer_full": full["outer"], "choice": "exchange" if choice == "sparse" else "ring",
            "ideal_fraction": ideal / tot_full if tot_full else 0.0}


def exchange_rows(S: int, meshes=((1, 8), (4, 8)), layouts=("block_striped", "zigzag", "contiguous"),
                  block_size: int = 64) -> list[dict]:
    """:func:`exchange_bytes` for the index the sparse ring estimates on the synthetic inputs of
    ``benchmarks/sparse_ring.py`` (16/2 heads, head_dim 128, default :class:`SparsityConfig`) at
    ``S`` tokens, per mesh and layout (hierarchical order, bf16)."""
    import jax.numpy as jnp
    import numpy as np

    from mtraining_jax.layouts import Layout
    from mtraining_jax.sparsity import SparsityConfig, estimate_index
    from mtraining_jax.sparsity.metrics import density
    from mtraining_jax.sparsity.synthetic import SyntheticAttention, synthetic_qk

    q, k = synthetic_qk(SyntheticAttention(seq_len=S, num_q_heads=16, num_kv_heads=2, head_dim=128, num_outliers=64))
    index = estimate_index(q, k, jnp.arange(S, dtype=jnp.int32), SparsityConfig(block_size=block_size))
    dens = float(np.mean(density(index, S)))
    rows = []
    for n, l in meshes:
        for lay in layouts:
            pos = Layout(lay, S, n * l, stripe=block_size).positions
            need = exchange_need(index, pos, block_size, 2)
            off = need[~np.eye(n * l, dtype=bool)] / (S // (n * l))
            r = exchange_bytes(need, n, l, "hierarchical", chunk_len=S // (n * l), block_size=block_size, kv_heads=2,
                               head_dim=128, itemsize=2)
            hb = hot_blocks(index, pos, block_size, n, l)
            rows.append(dict(S=S, mesh=f"{n}x{l}", layout=lay, density=dens, need_mean=float(off.mean()),
                             need_max=float(off.max()), **r, hot=hb))
    return rows
