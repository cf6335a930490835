"""Cost model and schedule simulator of the dense and sparse rings (issue 22, item 1).

Given a mesh ``(N nodes, L GPUs per node)``, a ring order, link bandwidths / latencies, the
kernels' throughput on active work and an index density, :func:`simulate` walks the ring's
schedule step by step and predicts, per rank (the block-striped layout balances the work):

* compute per (rank, step): ``3.5 * 4 * D * Hq * pairs / P^2`` FLOP (``pairs`` = the active
  (query, key) pairs of the whole causal sequence, ``density * S (S + 1) / 2``), 1/3.5 of it in the
  forward and 2.5/3.5 in the backward, at ``rate`` TFLOP/s, plus a fixed ``step_overhead`` per
  kernel call in each;
* every collective-permute of one forward + backward, read off the schedule
  (:func:`benchmarks.ring_comm.ring_hops`, the same accounting the compiled HLO is checked
  against): bytes (:func:`benchmarks.ring_comm.hop_bytes`) over the inner (``intra``, NVLink) or
  outer (``inter`` when ``N > 1`` with the hierarchical order, else ``intra``) link;
* overlap as the ring runs it: an inner hop is posted at the start of the step before the one it
  feeds and overlaps that step's compute; an outer hop overlaps the whole inner loop before it
  (hierarchical order); a step starts when its compute is due AND its chunk has arrived, so the
  exposed communication is the waiting time;
* the index estimate once per step (``index_s``, measured, scaled linearly with ``S / P``).

Calibration (:func:`calibrate`) fits ``rate`` per measured family and length on its one-GPU
record and predicts that family's multi-GPU records of the same length; the error is reported in
``benchmarks/comm_model_results.md`` with the predictions for one node of 8 GPUs and 4 nodes x 8
with a 400 Gb/s-class inter-node link (``python -m benchmarks.comm_model --out DIR``).

:func:`backward_bytes` compares the two backward circulations per hop: the K/V side (K, V in the
input dtype + float32 dK, dV travel) and the query side of BurstEngine (Q, dO in the input dtype +
float32 dQ, lse, delta travel): ``(2 Hkv D it + 2 Hkv D 4)`` vs ``(2 Hq D it + Hq D 4 + 2 Hq 4)``
bytes per token — the query side wins only for (near-)MHA. It is the ring's own count
(:func:`mtraining_jax.ring.sides.backward_hop_bytes`, by which ``backward_ring="auto"`` chooses);
:func:`simulate` models either side (``backward_ring``: the query side's hops from
:func:`benchmarks.ring_comm.ring_hops`, its backward visiting the own step first).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import Iterable, Sequence

from benchmarks.ring_comm import exchange_hops, hop_bytes, hop_link, ring_hops
from mtraining_jax.ring.exchange import capacity_tokens, validate_kv_exchange
from mtraining_jax.ring.sides import backward_hop_bytes, resolve_backward_ring

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Link:
    """One direction of a link: ``bandwidth`` bytes/s, ``latency`` s per message."""

    bandwidth: float
    latency: float = 10e-6

    def time(self, nbytes: float) -> float:
        return 0.0 if nbytes <= 0 else self.latency + nbytes / self.bandwidth


#: effective collective-permute bandwidth between two H200s of one node, measured
#: (``sparse_ring_results.jsonl`` ``kv_ppermute_s``: 134 MB K/V chunk in 0.97 ms at 256K / 2 GPUs)
NVLINK_H200 = Link(bandwidth=138 * GB, latency=15e-6)
#: a 400 Gb/s-class inter-node link (InfiniBand NDR / 400 GbE), at 80 % of line rate
IB_400G = Link(bandwidth=0.8 * 400e9 / 8, latency=20e-6)


@dataclasses.dataclass(frozen=True)
class Workload:
    """Attention shape of one layer: ``S`` tokens, ``batch``, heads, head_dim, input itemsize and
    the index ``density`` (active fraction of the causal pairs; 1.0 = the dense ring)."""

    S: int
    density: float
    batch: int = 1
    heads: int = 16
    kv_heads: int = 2
    head_dim: int = 128
    itemsize: int = 2

    @property
    def flops(self) -> float:
        """Forward + backward FLOP of the whole sequence (3.5 x the forward's ``4 D`` per pair)."""
        pairs = self.density * self.S * (self.S + 1) / 2
        return 3.5 * 4 * self.head_dim * self.heads * self.batch * pairs


@dataclasses.dataclass(frozen=True)
class Kernels:
    """Throughput of the ring's kernels on active work (forward + backward), a fixed cost per
    kernel call (launch, index conversion of the step) and the index estimate's time per rank for
    ``index_ref_len`` local tokens (scaled linearly)."""

    rate: float = 360e12
    step_overhead: float = 0.3e-3
    index_s: float = 6.9e-3
    index_ref_len: int = 262144


@dataclasses.dataclass
class Prediction:
    step_s: float
    compute_s: float
    exposed_comm_s: float
    bytes_inner: int
    bytes_outer: int
    steps: int
    backward_ring: str = "kv"

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _links(num_nodes: int, ring_order: str, intra: Link, inter: Link):
    """``{"inner": link, "outer": link}``: the flat ring's one ring crosses nodes when ``N > 1``
    (its slowest hop sets the pace: every hop of a ring step is taken by all ranks at once)."""
    if ring_order == "flat":
        return {"inner": inter if num_nodes > 1 else intra, "outer": inter}
    return {"inner": intra, "outer": inter}


def simulate(w: Workload, num_nodes: int, num_local: int, ring_order: str = "hierarchical", *,
             kernels: Kernels = Kernels(), intra: Link = NVLINK_H200, inter: Link = IB_400G,
             backward_ring: str = "kv", kv_exchange: str = "ring", capacity_fraction: float = 1.0) -> Prediction:
    """Predicted forward + backward time of one attention layer on the ring (module docstring);
    ``backward_ring``: ``"kv"``, ``"query"`` or ``"auto"`` (resolved as the ring resolves it).

    ``kv_exchange="sparse"``: the sparse-aware K/V exchange with a capacity of ``capacity_fraction``
    of the chunk (whole blocks of 64): the forward's ``P - 1`` direct sends depend only on the own
    K/V and the index, so all are posted at the start and queue on their link (inner, or outer when
    the step's pairs cross nodes: ``ring_comm.hop_link``); a step waits for its buffer. The K/V-side
    backward runs on the kept buffers and posts each step's float32 dK/dV back at the step's end
    (queued per link); the pass ends when the last has arrived. With ``backward_ring="query"`` the
    backward is that ring's."""
    if w.S % (num_nodes * num_local):
        raise ValueError(f"S={w.S} does not divide over {num_nodes} x {num_local} ranks")
    if not 0 < w.density <= 1:
        raise ValueError(f"density must be in (0, 1], got {w.density!r}")
    P = num_nodes * num_local
    validate_kv_exchange(kv_exchange)
    side = resolve_backward_ring(backward_ring, heads=w.heads, kv_heads=w.kv_heads, head_dim=w.head_dim,
                                 itemsize=w.itemsize)
    shape = dict(batch=w.batch, chunk_len=w.S // P, kv_heads=w.kv_heads, heads=w.heads, head_dim=w.head_dim,
                 itemsize=w.itemsize)
    links = _links(num_nodes, ring_order, intra, inter)
    n_inner = P if ring_order == "flat" else num_local
    per_step = w.flops / P / P / kernels.rate  # forward + backward of one (rank, step) pair
    step_c = {"forward": per_step / 3.5 + kernels.step_overhead, "backward": per_step * 2.5 / 3.5 + kernels.step_overhead}
    index = kernels.index_s * (w.S / P) / kernels.index_ref_len
    hops = ring_hops(num_nodes, num_local, ring_order, side)
    sent = {"inner": 0, "outer": 0}
    arrive = {}  # (phase, step) -> transfer time of what that step needs, and when it was posted
    for h in hops:
        b = hop_bytes(h, **shape)
        link = hop_link(h, num_nodes, ring_order)
        sent[link] += b
        key = (h.phase, h.step)
        post = "outer" if h.axis == "outer" else "inner"  # the diagonal hop is posted one step ahead
        t, _ = arrive.get(key, (0.0, post))
        arrive[key] = (t + links[link].time(b), post)

    def run(phase: str, order: Sequence[int], t0: float) -> tuple[float, float]:
        """Walk one phase: each step waits for its chunk; inner hops are posted one step ahead,
        outer hops one inner loop ahead. Returns ``(end time, exposed waiting)``."""
        t, exposed, posted = t0, 0.0, {}
        for i, s in enumerate(order):
            # post the hops this step overlaps: the next step's inner hop, the next outer hop
            for j in range(i + 1, len(order)):
                nxt = order[j]
                if (phase, nxt) in arrive and nxt not in posted:
                    dt, axis = arrive[(phase, nxt)]
                    if axis == "inner" and j == i + 1 or axis == "outer" and j <= i + n_inner:
                        posted[nxt] = t + dt
            ready = posted.get(s, t)
            exposed += max(0.0, ready - t)
            t = max(t, ready) + step_c[phase]
        return t, exposed

    if kv_exchange == "sparse" and P > 1:
        cap = capacity_tokens(float(capacity_fraction), w.S // P, 64)
        fwd_end, e1, bwd_end, e2, sent = _exchange_schedule(
            dict(shape, chunk_len=cap), num_nodes, num_local, ring_order, links, step_c, index,
            run if side == "query" else None)
        if side == "query":  # the query ring's backward hops, counted above in `sent` by ring_hops
            sent = {k: sent[k] + sum(hop_bytes(h, **shape) for h in hops
                                     if h.phase == "backward" and hop_link(h, num_nodes, ring_order) == k)
                    for k in sent}
    else:
        fwd_end, e1 = run("forward", list(range(P)), index)
        bwd_order = list(reversed(range(P))) if side == "kv" else [0] + list(reversed(range(1, P)))
        bwd_end, e2 = run("backward", bwd_order, fwd_end)
    return Prediction(step_s=bwd_end, compute_s=P * (step_c["forward"] + step_c["backward"]) + index,
                      exposed_comm_s=e1 + e2,
                      bytes_inner=sent["inner"], bytes_outer=sent["outer"], steps=P, backward_ring=side)


def _exchange_schedule(shape: dict, num_nodes: int, num_local: int, ring_order: str, links: dict, step_c: dict,
                       index: float, run_backward=None):
    """Forward (and K/V-side backward) of the sparse exchange (:func:`simulate`): ``(fwd_end,
    exposed_fwd, bwd_end, exposed_bwd, {"inner": bytes, "outer": bytes})``; ``run_backward``: the
    query ring's backward walker instead."""
    P = num_nodes * num_local
    sent = {"inner": 0, "outer": 0}
    free = {"inner": index, "outer": index}
    arrive = {}
    for h in exchange_hops(num_nodes, num_local, ring_order, "kv"):
        if h.phase != "forward":
            continue
        link, b = hop_link(h, num_nodes, ring_order, num_local), hop_bytes(h, **shape)
        sent[link] += b
        free[link] += links[link].time(b)
        arrive[h.step] = free[link]
    t, e1 = index + step_c["forward"], 0.0  # the own step needs nothing
    for s in range(1, P):
        e1 += max(0.0, arrive[s] - t)
        t = max(t, arrive[s]) + step_c["forward"]
    fwd_end = t
    if run_backward is not None:
        bwd_end, e2 = run_backward("backward", [0] + list(reversed(range(1, P))), fwd_end)
        return fwd_end, e1, bwd_end, e2, sent
    t = fwd_end + step_c["backward"]
    free = {"inner": fwd_end, "outer": fwd_end}
    last = t
    for h in exchange_hops(num_nodes, num_local, ring_order, "kv"):
        if h.phase != "backward":
            continue
        t += step_c["backward"]
        link, b = hop_link(h, num_nodes, ring_order, num_local), hop_bytes(h, **shape)
        sent[link] += b
        free[link] = max(t, free[link]) + links[link].time(b)
        last = max(last, free[link])
    return fwd_end, e1, max(t, last), max(0.0, last - t), sent


def backward_bytes(w: Workload, side: str) -> int:
    """Bytes one rank sends per backward hop of a chunk of ``S / P`` tokens with ``P = 1`` scaled
    out (i.e. per token of the chunk): ``side`` ``"kv"`` (this ring) or ``"query"`` (BurstEngine)."""
    return sum(backward_hop_bytes(side, batch=w.batch, chunk_len=1, heads=w.heads, kv_heads=w.kv_heads,
                                  head_dim=w.head_dim, itemsize=w.itemsize).values())


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


# ------------------------------------------------------------------ calibration on measurements


def _records(paths: Iterable[str]) -> list[dict]:
    out = []
    for p in paths:
        with open(p) as f:
            out += [json.loads(line) for line in f if line.strip()]
    return out


def _mesh(r: dict) -> tuple[int, int]:
    if "mesh" in r and r["mesh"]:
        n, l = (int(x) for x in str(r["mesh"]).split("x"))
        return n, l
    return 1, int(r.get("gpus", 1))


def _fit(one_gpu: dict, index_s: float, step_overhead: float = Kernels().step_overhead) -> Kernels:
    """The kernels' ``rate`` from a one-GPU record (its time minus the index estimate and the two
    kernel calls' fixed overhead); the overhead itself is not fitted (one point per length)."""
    t = one_gpu["sparse_fwdbwd_s"] - index_s * one_gpu["S"] / Kernels().index_ref_len - 2 * step_overhead
    return Kernels(rate=Workload(one_gpu["S"], one_gpu["density"]).flops / t, step_overhead=step_overhead,
                   index_s=index_s)


def calibrate(records: list[dict]) -> list[dict]:
    """Per family (``run`` tag: same code, same machine kind) and length with a one-GPU sparse
    record: fit the rate on it and predict the family's multi-GPU records of that length. Returns
    rows with the relative error (the one-GPU rows are the fits: 0 by construction)."""
    rows = []
    fams = {}
    for r in records:
        if r.get("sparse_fwdbwd_s") and r.get("density") and r.get("mode", "total") == "total":
            fams.setdefault(r.get("run") or "v?", []).append(r)
    for run, rs in sorted(fams.items()):
        seen = set()
        for r in rs:
            one = next((o for o in rs if _mesh(o) == (1, 1) and o["S"] == r["S"]), None)
            n, l = _mesh(r)
            key = (r["S"], n, l, r.get("ring_order", "hierarchical"))
            if one is None or key in seen:
                continue
            seen.add(key)
            idx = one["index_s"] * Kernels().index_ref_len / one["S"] if one.get("index_s") else Kernels().index_s
            k = _fit(one, idx)
            p = simulate(Workload(r["S"], r["density"]), n, l, key[3], kernels=k)
            rows.append(dict(run=run, S=r["S"], mesh=f"{n}x{l}", ring_order=key[3], measured_s=r["sparse_fwdbwd_s"],
                             predicted_s=p.step_s, rel_err=p.step_s / r["sparse_fwdbwd_s"] - 1,
                             fitted_rate_tflops=k.rate / 1e12, exposed_s=p.exposed_comm_s, fitted_on_1gpu=n * l == 1))
    return rows


#: attention shapes of the predictions: the measured GQA model and its multi-head twin (same Hq)
MODELS = {"GQA16/2": dict(heads=16, kv_heads=2), "MHA16": dict(heads=16, kv_heads=16)}


def predictions(kernels: Kernels, dense_rate: float, lengths=(262144, 524288, 1048576),
                meshes=((1, 1), (1, 8), (4, 8)), densities=None, models=MODELS,
                sides=("kv", "query"), exchange_capacities=(1.0, 0.25)) -> list[dict]:
    """Dense and sparse ring at each length and mesh (hierarchical; 4 x 8 over :data:`IB_400G`),
    per attention shape of ``models`` and backward side, and the sparse ring with the sparse-aware
    K/V exchange at each capacity of ``exchange_capacities`` (fraction of a chunk: 1.0 is what the
    synthetic index needs on every layout, ``exchange_rows``; 0.25 an index of few, short slashes)."""
    densities = densities or {262144: 0.0277, 524288: 0.0144, 1048576: 0.0075}
    rows = []
    for S in lengths:
        for n, l in meshes:
            for model, heads in models.items():
                for side in sides:
                    for name, dens, k in (("sparse", densities[S], kernels),
                                          ("dense", 1.0, dataclasses.replace(kernels, rate=dense_rate, index_s=0.0))):
                        p = simulate(Workload(S, dens, **heads), n, l, "hierarchical", kernels=k, backward_ring=side)
                        rows.append(dict(S=S, mesh=f"{n}x{l}", gpus=n * l, model=model, ring=name, density=dens,
                                         auto=resolve_backward_ring("auto", head_dim=128, itemsize=2, **heads),
                                         **p.as_dict()))
                # the sparse ring with the sparse-aware K/V exchange (K/V-side backward) at each capacity
                for cap in exchange_capacities:
                    p = simulate(Workload(S, densities[S], **heads), n, l, "hierarchical", kernels=kernels,
                                 backward_ring="kv", kv_exchange="sparse", capacity_fraction=cap)
                    rows.append(dict(S=S, mesh=f"{n}x{l}", gpus=n * l, model=model, ring=f"exchange@{cap:g}",
                                     density=densities[S], capacity_fraction=cap,
                                     auto=resolve_backward_ring("auto", head_dim=128, itemsize=2, **heads),
                                     **p.as_dict()))
    return rows


def _plot(calib: list[dict], preds: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(18, 4.5))
    multi = [r for r in calib if not r["fitted_on_1gpu"]]
    a.scatter([r["measured_s"] * 1e3 for r in multi], [r["predicted_s"] * 1e3 for r in multi], c="C1", label="multi-GPU")
    one = [r for r in calib if r["fitted_on_1gpu"]]
    a.scatter([r["measured_s"] * 1e3 for r in one], [r["predicted_s"] * 1e3 for r in one], c="C0", marker="x",
              label="1 GPU (fitted)")
    hi = max(max(r["measured_s"], r["predicted_s"]) for r in calib) * 1e3 * 1.1
    a.plot([0, hi], [0, hi], "k--", lw=1)
    a.set_xlabel("measured fwd+bwd ms")
    a.set_ylabel("predicted ms")
    a.set_title("sparse ring: model vs measurement")
    a.legend(fontsize=8)
    for ring, style in (("sparse", "-o"), ("dense", "--s"), ("exchange@1", ":^"), ("exchange@0.25", ":v")):
        for S in sorted({r["S"] for r in preds}):
            rs = sorted((r for r in preds if r["ring"] == ring and r["S"] == S and r.get("model", "GQA16/2") == "GQA16/2"
                         and r["backward_ring"] == "kv"), key=lambda r: r["gpus"])
            b.plot([r["gpus"] for r in rs], [r["step_s"] * 1e3 for r in rs], style, label=f"{ring} {S // 1024}K")
    b.set_xscale("log", base=2)
    b.set_yscale("log")
    b.set_xlabel("GPUs (1, one node of 8, 4 nodes x 8 over 400 Gb/s)")
    b.set_ylabel("predicted fwd+bwd ms per layer")
    b.set_title("predictions (hierarchical, GQA 16/2, K/V-side backward; exchange@c: sparse K/V exchange)", fontsize=9)
    b.legend(fontsize=7, ncol=2)
    lengths = sorted({r["S"] for r in preds})
    for (model, side), style in zip([(m, s_) for m in MODELS for s_ in ("kv", "query")], ("-o", "--o", "-s", "--s")):
        rs = {r["S"]: r for r in preds if r["ring"] == "sparse" and r["mesh"] == "4x8" and r["model"] == model
              and r["backward_ring"] == side}
        if len(rs) == len(lengths):
            c.plot([S // 1024 for S in lengths], [rs[S]["exposed_comm_s"] * 1e3 for S in lengths], style,
                   label=f"{model}, {side}-side backward")
    c.set_xlabel("tokens (K)")
    c.set_ylabel("predicted exposed communication, ms per layer")
    c.set_title("sparse ring on 4 nodes x 8: backward side")
    c.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", nargs="+", default=[os.path.join(here, "sparse_ring_results.jsonl"),
                                                     os.path.join(here, "scaling_results.jsonl")])
    p.add_argument("--rate", type=float, default=360.0, help="sparse kernels' fwd+bwd TFLOP/s for the predictions")
    p.add_argument("--dense-rate", type=float, default=430.0, help="dense ring kernels' fwd+bwd TFLOP/s")
    p.add_argument("--exchange-len", type=int, default=0,
                   help="also model the sparse-aware K/V exchange on the synthetic index of this length (CPU: ~1 min at 64K)")
    p.add_argument("--out", help="folder for comm_model.json and comm_model.png")
    a = p.parse_args(argv)
    calib = calibrate(_records(a.records))
    preds = predictions(Kernels(rate=a.rate * 1e12), a.dense_rate * 1e12)
    for r in calib:
        print(f"{r['run']:>12} {r['S'] // 1024:>5}K {r['mesh']:>4} {r['ring_order']:>12}  measured {r['measured_s'] * 1e3:8.1f} ms"
              f"  predicted {r['predicted_s'] * 1e3:8.1f} ms  ({r['rel_err']:+.0%})")
    for r in preds:
        print(f"{r['ring']:>6} {r['model']:>8} {r['backward_ring']:>5} {r['S'] // 1024:>5}K {r['mesh']:>4}: "
              f"{r['step_s'] * 1e3:9.1f} ms  (exposed comm {r['exposed_comm_s'] * 1e3:.2f} ms, "
              f"{(r['bytes_inner'] + r['bytes_outer']) / 1e6:.0f} MB)")
    w = Workload(262144, 0.0277)
    print("backward bytes per token, GQA 16/2: kv", backward_bytes(w, "kv"), "query", backward_bytes(w, "query"))
    exchange = exchange_rows(a.exchange_len) if a.exchange_len else []
    for r in exchange:
        print(f"exchange {r['S'] // 1024}K {r['mesh']} {r['layout']:>13}: need per pair mean {r['need_mean']:.2f} "
              f"max {r['need_max']:.2f} of a chunk; bytes vs ring {r['fraction']:.3f} (ragged bound "
              f"{r['ideal_fraction']:.3f}) -> {r['choice']}")
        h = r["hot"]
        print(f"   hot blocks (>= 90 % of ranks): {h['hot_blocks']} ({h['hot_tokens_fraction_of_chunk']:.3f} of a chunk); "
              f"capacity {h['capacity']} -> {h['capacity_replicated']} tokens; exchange bytes "
              f"{h['exchange_bytes'] / 1e6:.1f} -> {h['exchange_bytes_replicated'] / 1e6:.1f} MB (ring "
              f"{h['ring_bytes'] / 1e6:.1f}); step imbalance {h['step_imbalance']:.3f} -> "
              f"{h['step_imbalance_replicated']:.3f}; pays: {h['pays']}")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "comm_model.json"), "w") as f:
            json.dump(dict(calibration=calib, predictions=preds, exchange=exchange), f, indent=1)
        _plot(calib, preds, os.path.join(a.out, "comm_model.png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
