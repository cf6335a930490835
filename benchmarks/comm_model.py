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

The ring as the current code runs it (issue 33, item 4): :func:`simulate_fused` walks the fused ring
(the first forward call covers steps 0 and 1, the first backward call steps P-1 and 0) with the
per-rank costs the traces of the 4-GPU H100 runs show beyond the kernels' active work
(:class:`RingCosts`): a kernel cost per query row and call (each call re-reads the queries and the
float32 accumulators: ``P - 1`` calls of ``S / P`` rows per pass, so it does not shrink with ``P``),
XLA work per local token (index estimate, loss, conversions) and per ring step beyond the first (the
step's index conversion, concatenations, accumulator adds, small kernels: part fixed, part per chunk
row), a host term per timed call and the synchronous permutes of the compiled program. Calibration
(:func:`calibrate_traced`): every family's one-GPU traced record gives its rate, per-token and host
terms; the per-call and per-step terms come from the components (kernels, XLA) of ONE multi-GPU
trace (default v14 1x4); every other multi-GPU record is held out and its error reported
(``results/ring/comm_model.md``, "Current code"), with predictions for one node of 8 GPUs and
4 nodes x 8 over a 400 Gb/s-class link at 512K and 1M and an error band (:func:`traced_predictions`).
``python -m benchmarks.comm_model --out DIR`` defaults to the run ``v14`` of
``results/ring/ring.jsonl``; older, untraced families (``--earlier-records``) keep the earlier rule:
:func:`calibrate` fits ``rate`` per measured family and length on its one-GPU record (with a fixed
``step_overhead`` per kernel call) and predicts that family's multi-GPU records of the same length.

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
import re
from typing import Iterable, Sequence

import numpy as np

from benchmarks.ring_comm import Hop, exchange_hops, hop_bytes, hop_link, ring_hops
from benchmarks.trace_summary import COMM
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
#: (``results/ring/ring.jsonl`` ``kv_ppermute_s``: 134 MB K/V chunk in 0.97 ms at 256K / 2 GPUs)
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


#: every ring measurement (sparse_ring / scaling / multi-process runs; ``run`` tags the campaign). It is
#: read from the repository checkout (an editable install or ``PYTHONPATH=.``), not packaged: from a
#: wheel install pass ``--records`` / ``--earlier-records``.
RING_RECORDS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results", "ring",
                            "ring.jsonl")


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


# ------------------------------------------------------------------ the fused ring with per-step costs (issue 33)

#: effective collective-permute bandwidth between two H100s of one node (NVLink), measured: the 134 MB
#: K/V chunk of a 4-rank ring in 1.25 ms (v12a) and 1.15 ms (v12), ``kv_ppermute_s`` of the 1x4 records of
#: runs ``v12a`` / ``v12`` of ``results/ring/ring.jsonl`` (an isolated, timed permute: its dispatch is inside)
NVLINK_H100 = Link(bandwidth=112 * GB, latency=15e-6)

#: the ring's attention kernels in a trace summary (``benchmarks/trace_summary.py`` ``top``, by name; the
#: Triton / Pallas kernels of the earlier code are named ``block_sparse_*``)
KERNEL_NAMES = re.compile(r"mosaic|pallas|triton|block_sparse", re.IGNORECASE)
#: the index estimate's XLA kernels in a trace summary (by the source file of their HLO instruction)
INDEX_SRC = "estimate.py"
#: a per-step XLA kernel taking at least this long (ms per launch, at the fitted chunk) is counted as
#: moving chunk-sized arrays (K/V, dK/dV, accumulators: tens of MB at 128K-token chunks) and scaled with
#: the chunk; shorter ones (sorts and searches over the index, small copies, launch-bound kernels) are fixed
ROW_KERNEL_MS = 0.1
#: the backward's share of a step's kernel work (FLOP: 2.5 of 3.5) and the dQ kernel's share of the
#: backward (3 of its 7 matmuls: the dK/dV kernels recompute S and dP, then form dV and dK)
BWD_SHARE, DQ_SHARE = 2.5 / 3.5, 3 / 7
#: how the per-step XLA cost scales with the chunk (:meth:`RingCosts.with_form`): ``split`` as fitted
#: (part fixed, part per chunk row), all ``fixed``, all per ``chunk`` row
STEP_FORMS = ("split", "fixed", "chunk")
#: ``fuse`` field of a record -> (fuse_forward, fuse_backward)
FUSE_FLAGS = {"both": (True, True), "backward": (False, True), "forward": (True, False), "none": (False, False)}


@dataclasses.dataclass(frozen=True)
class RingCosts:
    """Per-rank costs of one sparse ring layer (forward + backward) beyond communication, as fitted on
    traced records (:func:`fit_costs`): the kernels' ``rate`` on active work (FLOP/s); their cost per
    query row and kernel call (``call_row_s``: each call re-reads the queries and reads / rewrites the
    float32 accumulators); XLA work per local token, once per layer, split into the index estimate
    (``index_token_s``, before the ring) and the rest (``xla_token_s``: loss, delta, conversions); XLA
    work per ring step beyond the first (``step_fixed_s + step_row_s * chunk rows``: the step's index
    conversion, concatenations, accumulator adds and stacks, copies, small kernels); ``host_s`` per
    timed call (dispatch, sync, idle gaps), ``host_multi_s`` instead on more than one GPU when set (a
    two-length fit measures it on the multi-GPU records: :func:`fit_two_lengths`); ``call_fixed_s``: a
    per-call cost that does not scale with the rows (launch, pipeline fill, the last wave; also from a
    two-length fit); ``sync_hops``: collective-permutes the compiled program runs synchronously (each
    exposes one K/V hop)."""

    rate: float
    call_row_s: float = 0.0
    index_token_s: float = 0.0
    xla_token_s: float = 0.0
    step_fixed_s: float = 0.0
    step_row_s: float = 0.0
    host_s: float = 0.0
    sync_hops: int = 0
    call_fixed_s: float = 0.0
    host_multi_s: float | None = None

    def step_xla(self, rows: float) -> float:
        """XLA seconds of one ring step beyond the first, for chunks of ``rows`` tokens."""
        return self.step_fixed_s + self.step_row_s * rows

    def call(self, rows: float) -> float:
        """Seconds of one kernel call's per-call cost (forward + backward) on ``rows`` query rows."""
        return self.call_fixed_s + self.call_row_s * rows

    def host(self, ranks: int) -> float:
        """The host term of a layer on ``ranks`` GPUs."""
        return self.host_s if ranks == 1 or self.host_multi_s is None else self.host_multi_s

    def with_form(self, form: str, rows_ref: float) -> "RingCosts":
        """The same per-step cost at chunks of ``rows_ref`` tokens, scaled with the chunk as ``form``
        (:data:`STEP_FORMS`)."""
        if form not in STEP_FORMS:
            raise ValueError(f"form must be one of {STEP_FORMS}, got {form!r}")
        total = self.step_xla(rows_ref)
        if form == "fixed":
            return dataclasses.replace(self, step_fixed_s=total, step_row_s=0.0)
        if form == "chunk":
            return dataclasses.replace(self, step_fixed_s=0.0, step_row_s=total / rows_ref)
        return self


@dataclasses.dataclass
class FusedPrediction:
    """:func:`simulate_fused`: the layer's time and its parts (seconds per rank); ``calls``: kernel
    calls per pass."""

    step_s: float
    kernel_s: float
    call_s: float
    index_s: float
    xla_token_s: float
    xla_step_s: float
    exposed_comm_s: float
    host_s: float
    bytes_inner: int
    bytes_outer: int
    steps: int
    calls: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def n_calls(P: int, fuse: bool) -> int:
    """Kernel calls of one pass of a ``P``-rank ring: the fused first call covers two steps."""
    return 1 if P == 1 else P - 1 if fuse else P


def simulate_fused(w: Workload, num_nodes: int, num_local: int, ring_order: str = "hierarchical", *,
                   costs: RingCosts, intra: Link = NVLINK_H100, inter: Link = IB_400G, fuse_forward: bool = True,
                   fuse_backward: bool = True) -> FusedPrediction:
    """Forward + backward of one sparse ring layer as the current code runs it (fused first calls,
    K/V-side backward, the ring's K/V circulation), with the per-step costs of :class:`RingCosts`.

    Per rank: the index estimate (``index_token_s * S/P``) comes first; the first K/V hop is posted at
    time 0 and overlaps it. Each kernel call of a pass first runs its step's XLA work (``step_xla / 2``
    per pass and step beyond the first; it needs no chunk), then waits for its chunk's K/V hop (posted
    one step ahead on the inner ring, one inner loop ahead on the outer ring, as :func:`simulate`),
    then runs its kernels (``flops / P^2 / rate`` per step plus ``costs.call(S/P)`` per call, 1:2.5
    forward : backward). A backward call runs its dQ kernel, then waits for the float32 dK/dV hop of
    its chunk, posted when the call holding the previous step ended, then runs its dK/dV kernels; the
    dK/dV of the own chunk (fused into the first backward call) comes home after the last call and
    overlaps the remaining XLA work (``xla_token_s * S/P``). Synchronous permutes add a K/V hop each;
    ``costs.host(P)`` is added once. The exposed communication is the waiting."""
    if w.S % (num_nodes * num_local):
        raise ValueError(f"S={w.S} does not divide over {num_nodes} x {num_local} ranks")
    if not 0 < w.density <= 1:
        raise ValueError(f"density must be in (0, 1], got {w.density!r}")
    P = num_nodes * num_local
    rows = w.S // P
    shape = dict(batch=w.batch, chunk_len=rows, kv_heads=w.kv_heads, heads=w.heads, head_dim=w.head_dim,
                 itemsize=w.itemsize)
    links = _links(num_nodes, ring_order, intra, inter)
    n_inner = P if ring_order == "flat" else num_local
    work = w.flops / P / P / costs.rate  # kernels of one (rank, step), forward + backward
    call = costs.call(rows)  # per kernel call, forward + backward
    prep = costs.step_xla(rows) / 2  # per pass and step beyond the first
    index, post = costs.index_token_s * rows, costs.xla_token_s * rows
    hop_t, sent = {}, {"inner": 0, "outer": 0}
    for h in ring_hops(num_nodes, num_local, ring_order, "kv"):
        b = hop_bytes(h, **shape)
        link = hop_link(h, num_nodes, ring_order)
        sent[link] += b
        hop_t[(h.phase, h.step, h.what)] = (links[link].time(b), h.axis)

    def groups(fuse: bool, order: list[int]) -> list[list[int]]:
        return [order[:2]] + [[s] for s in order[2:]] if fuse and P > 1 else [[s] for s in order]

    def preps(gs: list, fuse: bool) -> list[float]:
        return [prep] * len(gs) if fuse and P > 1 else [0.0] + [prep] * (len(gs) - 1)

    def posted(where: dict, start: dict, s: int, ahead: int) -> float:
        """When the K/V hop delivering step ``s`` is posted: at the start of the call holding step
        ``ahead`` (one inner step or one inner loop away); at time 0 (before the index estimate) when
        that call holds ``s`` too (the fused first forward call)."""
        src = where[ahead]
        return 0.0 if src == where[s] else start[src]

    exposed = 0.0
    # forward: steps 0, 1, ..., P-1
    fg = groups(fuse_forward, list(range(P)))
    fwhere = {s: i for i, g in enumerate(fg) for s in g}
    start, t = {}, index
    for i, (g, pr) in enumerate(zip(fg, preps(fg, fuse_forward))):
        start[i] = t
        ready = t + pr
        for s in g:
            if ("forward", s, "kv") in hop_t:
                dt, axis = hop_t[("forward", s, "kv")]
                ready = max(ready, posted(fwhere, start, s, s - (1 if axis != "outer" else n_inner)) + dt)
        exposed += ready - (t + pr)
        t = ready + (work * len(g) + call) * (1 - BWD_SHARE)
    # backward: steps P-1, ..., 0 (the fused first call: P-1 and the own step 0)
    bg = groups(fuse_backward, [P - 1, 0] + list(range(P - 2, 0, -1)) if fuse_backward and P > 1
                else list(range(P - 1, -1, -1)))
    bwhere = {s: i for i, g in enumerate(bg) for s in g}
    bstart, bend, late = {}, {}, []
    for i, (g, pr) in enumerate(zip(bg, preps(bg, fuse_backward))):
        bstart[i] = t
        ready = t + pr
        for s in g:
            if ("backward", s, "kv") in hop_t:
                dt, axis = hop_t[("backward", s, "kv")]
                ready = max(ready, posted(bwhere, bstart, s, s + (1 if axis != "outer" else n_inner)) + dt)
        exposed += ready - (t + pr)
        t = ready + (work * len(g) + call) * BWD_SHARE * DQ_SHARE
        ready = t
        for s in g:
            if ("backward", s, "dkv") in hop_t and bwhere[s + 1] < i:
                ready = max(ready, bend[bwhere[s + 1]] + hop_t[("backward", s, "dkv")][0])
        exposed += ready - t
        t = ready + (work * len(g) + call) * BWD_SHARE * (1 - DQ_SHARE)
        bend[i] = t
    for s in range(P - 1):  # dK/dV for a call that ran before (or is) the call producing it: needed at the end
        if bwhere[s + 1] >= bwhere[s]:
            late.append(bend[bwhere[s + 1]] + hop_t[("backward", s, "dkv")][0])
    end = t + post
    if late and max(late) > end:
        exposed += max(late) - end
        end = max(late)
    if P > 1 and costs.sync_hops:
        sync = costs.sync_hops * links["inner"].time(hop_bytes(Hop("forward", 1, "inner", "kv"), **shape))
        exposed += sync
        end += sync
    nf, nb = len(fg), len(bg)
    host = costs.host(P)
    return FusedPrediction(step_s=end + host, kernel_s=work * P,
                           call_s=call * (nf * (1 - BWD_SHARE) + nb * BWD_SHARE), index_s=index, xla_token_s=post,
                           xla_step_s=sum(preps(fg, fuse_forward)) + sum(preps(bg, fuse_backward)),
                           exposed_comm_s=exposed, host_s=host, bytes_inner=sent["inner"],
                           bytes_outer=sent["outer"], steps=P, calls=max(nf, nb))


def trace_components(rec: dict) -> dict:
    """Mean over the traced devices of a record's ``sparse_trace`` (``benchmarks/trace_summary.py``),
    in ms: ``kernels`` (the ring's attention kernels, :data:`KERNEL_NAMES`), ``compute`` (every
    non-communication kernel), ``xla`` = compute - kernels, ``index`` (XLA kernels from
    :data:`INDEX_SRC`), ``exposed`` (communication with no compute running), ``idle``, ``span``; and
    ``ops``: ``{(op, first source frame): (ms, launches)}`` of the XLA kernels listed (the summary lists
    the top 60 kernel names)."""
    devs = [d for d in (rec.get("sparse_trace") or {}).values() if d.get("kernels")]
    if not devs:
        raise ValueError(f"record {rec.get('run')} {rec.get('mesh')} has no traced device")
    n = len(devs)
    out = {k: 0.0 for k in ("kernels", "compute", "index", "exposed", "idle", "span")}
    ops: dict = {}
    for d in devs:
        out["compute"] += d["compute_ms"] / n
        out["exposed"] += d.get("exposed_comm_ms", 0.0) / n
        out["idle"] += d.get("idle_ms", 0.0) / n
        out["span"] += d["span_ms"] / n
        for t in d.get("top", []):
            if KERNEL_NAMES.search(t["name"]):
                out["kernels"] += t["ms"] / n
                continue
            if COMM.search(t["name"]):
                continue
            if INDEX_SRC in t.get("src", ""):
                out["index"] += t["ms"] / n
            key = (t["op"].split("/")[-1] if t.get("op") else t["name"].rstrip("_0123456789"),
                   t.get("src", "").split(" < ")[0])
            ms, cnt = ops.get(key, (0.0, 0.0))
            ops[key] = (ms + t["ms"] / n, cnt + t["count"] / n)
    out["xla"] = out["compute"] - out["kernels"]
    out["devices"] = n
    out["ops"] = ops
    return out


def _fuse(rec: dict) -> tuple[bool, bool]:
    return FUSE_FLAGS[rec.get("fuse") or "none"]  # records before the fused calls (v11) have no "fuse"


def fit_step_terms(one: dict, multi: dict, row_kernel_ms: float = ROW_KERNEL_MS) -> dict:
    """The per-call and per-step terms from ONE multi-GPU trace and the one-GPU trace of its family
    (same length): kernels ``K_P = W / P + k (m / P)`` with ``K_1 = W + k`` (``m``: kernel calls per
    pass, weighted 1:2.5 forward : backward) gives the per-call cost ``k`` per ``S`` rows; XLA
    ``X_P = X_1 / P + (P - 1) x`` gives the per-step cost ``x``; its chunk-scaled part is the extra time
    (over ``1/P`` of the one-GPU trace, matched by op and source line) of the per-step kernels taking
    ``>= row_kernel_ms`` per launch, the rest is fixed. Returns the terms (seconds) and the inputs (ms)."""
    if one["S"] != multi["S"]:
        raise ValueError(f"one-GPU record at S={one['S']} and the multi-GPU one at S={multi['S']}")
    n, l = _mesh(multi)
    P, S = n * l, multi["S"]
    ff, fb = _fuse(multi)
    m = (n_calls(P, ff) + 2.5 * n_calls(P, fb)) / 3.5
    if m <= 1:
        raise ValueError(f"{multi.get('mesh')}: {P} ranks make one kernel call per pass, as one GPU: the "
                         "per-call cost is not identifiable from this record")
    c1, cp = trace_components(one), trace_components(multi)
    k = (cp["kernels"] - c1["kernels"] / P) / ((m - 1) / P)
    extra = cp["xla"] - c1["xla"] / P
    x = extra / (P - 1)
    row_part = 0.0
    for key, (ms, cnt) in cp["ops"].items():
        e = ms - c1["ops"].get(key, (0.0, 0.0))[0] / P
        if e > 0 and cnt and ms / cnt >= row_kernel_ms:
            row_part += e
    rho = min(max(row_part / extra, 0.0), 1.0) if extra > 0 else 0.0
    rows = S // P
    return dict(run=multi.get("run"), mesh=f"{n}x{l}", ring_order=multi.get("ring_order", "hierarchical"), S=S,
                P=P, rows=rows, calls_weighted=m, kernels_1gpu_ms=c1["kernels"], kernels_ms=cp["kernels"],
                xla_1gpu_ms=c1["xla"], xla_ms=cp["xla"], per_call_ms_at_S=k, xla_extra_ms=extra,
                row_part_ms=row_part, row_fraction=rho, call_row_s=k * 1e-3 / S, step_s=x * 1e-3,
                step_fixed_s=(1 - rho) * x * 1e-3, step_row_s=rho * x * 1e-3 / rows)


def fit_costs(one: dict, terms: dict, sync_hops: int = 0) -> RingCosts:
    """:class:`RingCosts` of a family from its one-GPU traced record and the per-call / per-step
    ``terms`` (:func:`fit_step_terms`): the kernels' trace time minus the per-call cost of one call
    per pass gives the rate; XLA time is split into the index estimate and the rest per token; the
    host term is the measured time minus the trace's compute and exposed time."""
    if _mesh(one) != (1, 1):
        raise ValueError(f"fit_costs needs a one-GPU record, got mesh {one.get('mesh')}")
    c = trace_components(one)
    S = one["S"]
    call_fixed_s = terms.get("call_fixed_s", 0.0)
    work_ms = c["kernels"] - (call_fixed_s + terms["call_row_s"] * S) * 1e3
    if work_ms <= 0:
        raise ValueError("the per-call cost exceeds the one-GPU kernels' time")
    return RingCosts(rate=Workload(S, one["density"]).flops / (work_ms * 1e-3), call_row_s=terms["call_row_s"],
                     index_token_s=c["index"] * 1e-3 / S, xla_token_s=(c["xla"] - c["index"]) * 1e-3 / S,
                     step_fixed_s=terms["step_fixed_s"], step_row_s=terms["step_row_s"],
                     host_s=measured_host_s(one), sync_hops=int(sync_hops), call_fixed_s=call_fixed_s,
                     host_multi_s=terms.get("host_multi_s"))


def measured_host_s(rec: dict) -> float:
    """A traced record's host term: its measured time minus the trace's compute and exposed time."""
    c = trace_components(rec)
    return rec["sparse_fwdbwd_s"] - (c["compute"] + c["exposed"]) * 1e-3


def fit_two_lengths(pairs) -> dict:
    """Per-call, per-step and multi-GPU host terms from traced ``(one-GPU, multi-GPU)`` record pairs at
    TWO lengths (same mesh family, e.g. 1x4 at 256K and 512K), solved exactly instead of assumed:

    * kernels: ``K_P - K_1 / P = c0 (m - 1/P) + c1 (S/P) (m - 1)`` per length (``m`` calls per pass,
      weighted 1 : 2.5 forward : backward; each call costs ``c0 + c1 * rows``) -> ``call_fixed_s = c0``,
      ``call_row_s = c1``;
    * XLA per ring step beyond the first: ``(X_P - X_1 / P) / (P - 1) = x0 + x1 * S/P`` per length ->
      ``step_fixed_s``, ``step_row_s``;
    * host term on more than one GPU: the mean of the multi-GPU records' measured host terms
      (:func:`measured_host_s`), ``host_multi_s``.

    Returns the terms (seconds), with the inputs (ms) per pair under ``pairs``."""
    if len(pairs) != 2:
        raise ValueError(f"fit_two_lengths needs two (one-GPU, multi-GPU) pairs, got {len(pairs)}")
    A, b_call, X, b_step, inputs = [], [], [], [], []
    for one, multi in pairs:
        t = fit_step_terms(one, multi)
        P, S, m = t["P"], t["S"], t["calls_weighted"]
        A.append([m - 1 / P, (S / P) * (m - 1)])
        b_call.append((t["kernels_ms"] - t["kernels_1gpu_ms"] / P) * 1e-3)
        X.append([1.0, S / P])
        b_step.append(t["step_s"])
        inputs.append(dict(t, measured_host_ms=measured_host_s(multi) * 1e3))
    if inputs[0]["S"] == inputs[1]["S"]:
        raise ValueError(f"the two pairs are at the same length S={inputs[0]['S']}: the terms are not identifiable")
    c0, c1 = np.linalg.solve(np.array(A), np.array(b_call))
    x0, x1 = np.linalg.solve(np.array(X), np.array(b_step))
    host = float(np.mean([p["measured_host_ms"] for p in inputs])) * 1e-3
    first = inputs[0]
    return dict(run=first["run"], mesh=first["mesh"], ring_order=first["ring_order"], S=first["S"], P=first["P"],
                rows=first["rows"], form="two lengths", call_fixed_s=float(c0), call_row_s=float(c1),
                step_fixed_s=float(x0), step_row_s=float(x1), step_s=float(x0 + x1 * first["rows"]),
                row_fraction=float(x1 * first["rows"] / (x0 + x1 * first["rows"])) if x0 + x1 * first["rows"] else 0.0,
                per_call_ms_at_S=float(c0 + c1 * first["S"]) * 1e3, host_multi_s=host, pairs=inputs,
                fits=[(p["run"], p["mesh"], p["ring_order"], p["S"]) for p in inputs])


#: the record whose trace gives the per-call and per-step terms: (run, mesh, ring order)
FIT_RECORD = ("v14", "1x4", "hierarchical", "524288")


def _traced(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("sparse_trace") and r.get("sparse_fwdbwd_s") and r.get("density")
            and r.get("mode", "total") == "total" and (r.get("kv_exchange") or "ring") == "ring"
            and (r.get("backward_ring") or "auto") in ("auto", "kv")]


def _find(records, run, mesh, order="hierarchical", S=None):
    return next((r for r in records if r.get("run") == run and "%dx%d" % _mesh(r) == mesh
                 and r.get("ring_order", "hierarchical") == order and (S is None or r["S"] == S)), None)


def calibrate_traced(records: list[dict], fit: tuple = FIT_RECORD, intra: Link = NVLINK_H100,
                     inter: Link | None = None) -> tuple[list[dict], dict, dict]:
    """The traced families (records with ``sparse_trace``; ``run`` tag = same code and machine):
    per-call / per-step terms from the ``fit`` record (``(run, mesh, order[, S])``; :func:`fit_step_terms`,
    with its family's one-GPU record of that length) or, given a list of two such records at two
    lengths, from both (:func:`fit_two_lengths`: per-call and per-step terms with a fixed and a per-row
    part, and a multi-GPU host term); every family's other costs from its own one-GPU record
    (:func:`fit_costs`), each record predicted with :func:`simulate_fused` (its own count of
    synchronous permutes from the compiled HLO; ``inter`` defaults to ``intra``: the measured meshes are
    one host), also with every per-step form (``forms``). Returns ``(rows, terms, {run: RingCosts})``; a
    row's ``role``: ``"fit: 1 GPU"``, ``"fit: per-step terms"`` or ``"held out"``."""
    traced = _traced(records)
    fits = list(fit) if fit and isinstance(fit[0], (tuple, list)) else [fit]
    pairs = []
    for f in fits:
        run, mesh, order, fit_S = (tuple(f) + (None,))[:4]
        multi = _find(traced, run, mesh, order, S=int(fit_S) if fit_S else None)
        if multi is None:
            raise ValueError(f"no traced record {run} {mesh} {order} to fit the per-step terms on")
        one_fit = _find(traced, run, "1x1", S=multi["S"])
        if one_fit is None:
            raise ValueError(f"no one-GPU traced record of {run} at S={multi['S']}")
        pairs.append((one_fit, multi))
    terms = fit_step_terms(*pairs[0]) if len(pairs) == 1 else fit_two_lengths(pairs)
    fitted = [m for _, m in pairs]
    rows, costs = [], {}
    for r in sorted(traced, key=lambda r: (r["run"], r["S"], _mesh(r)[0] * _mesh(r)[1], _mesh(r),
                                           r.get("ring_order", ""))):
        one = _find(traced, r["run"], "1x1", S=r["S"])
        if one is None:
            continue
        n, l = _mesh(r)
        c = fit_costs(one, terms, sync_hops=r.get("hlo_collective_permute_sync") or 0)
        costs.setdefault(r["run"], dataclasses.replace(c, sync_hops=0))
        ff, fb = _fuse(r)
        p = simulate_fused(Workload(r["S"], r["density"]), n, l, r.get("ring_order", "hierarchical"), costs=c,
                           intra=intra, inter=inter or intra, fuse_forward=ff, fuse_backward=fb)
        forms = {f: simulate_fused(Workload(r["S"], r["density"]), n, l, r.get("ring_order", "hierarchical"),
                                   costs=c.with_form(f, terms["rows"]), intra=intra, inter=inter or intra,
                                   fuse_forward=ff, fuse_backward=fb).step_s for f in STEP_FORMS}
        m = trace_components(r)
        role = "fit: 1 GPU" if n * l == 1 else "fit: per-step terms" if any(r is m for m in fitted) else "held out"
        rows.append(dict(run=r["run"], commit=r.get("commit"), device=r.get("device"), S=r["S"], mesh=f"{n}x{l}",
                         ring_order=r.get("ring_order", "hierarchical"), role=role, measured_s=r["sparse_fwdbwd_s"],
                         predicted_s=p.step_s, rel_err=p.step_s / r["sparse_fwdbwd_s"] - 1,
                         sync_hops=c.sync_hops, predicted=p.as_dict(), forms=forms,
                         measured_trace_ms={k: m[k] for k in ("kernels", "xla", "index", "exposed", "idle", "span")},
                         measured_host_ms=measured_host_s(r) * 1e3,
                         worker_imbalance=r.get("worker_imbalance"), step_imbalance=r.get("step_imbalance")))
    return rows, terms, costs


def held_out_error(rows: list[dict]) -> dict:
    """Relative error of the held-out rows: ``lo`` (most negative, <= 0), ``hi`` (most positive,
    >= 0), ``max_abs``, ``n``."""
    errs = [r["rel_err"] for r in rows if r["role"] == "held out"]
    if not errs:
        return dict(lo=0.0, hi=0.0, max_abs=0.0, n=0)
    return dict(lo=min(0.0, min(errs)), hi=max(0.0, max(errs)), max_abs=max(abs(e) for e in errs), n=len(errs))


#: meshes of the traced predictions: (nodes, local, order); up to 8 GPUs on one host (NVLink both ways)
TRACED_MESHES = ((1, 1, "hierarchical"), (1, 4, "hierarchical"), (1, 8, "hierarchical"), (2, 4, "hierarchical"),
                 (2, 4, "flat"), (4, 8, "hierarchical"), (4, 8, "flat"))
#: index density of the synthetic inputs: measured at 512K (v12), 1M extrapolated (halves per doubling:
#: 0.0554 / 0.0277 / 0.0144 at 128K / 256K / 512K)
DENSITIES = {524288: 0.01444, 1048576: 0.0075}


def traced_predictions(costs: RingCosts, rows_ref: int, err: dict, lengths=(524288, 1048576),
                       meshes=TRACED_MESHES, densities=None, intra: Link = NVLINK_H100, inter: Link = IB_400G,
                       dense_rate: float | None = None, gpus_per_host: int = 8, measured_S: int | None = None,
                       length_err: float = 0.0) -> list[dict]:
    """The sparse ring at each length and mesh with ``costs`` (meshes of up to ``gpus_per_host`` GPUs
    on one host: ``intra`` on both axes; larger ones ``inter`` between nodes); the central value uses
    the fitted per-step split, ``forms`` every form of :data:`STEP_FORMS` (same per-step cost at chunks
    of ``rows_ref`` tokens), and the band is ``[min over forms / (1 + err.hi), max over forms / (1 +
    err.lo)]``: the range the measurement would fall in if the model erred as on the held-out records;
    at a length other than ``measured_S`` the band is widened by ``length_err`` either way (the error of
    the same fit carried to another length, :func:`main`'s check on an earlier family). With
    ``dense_rate`` also the dense ring (:func:`simulate`, its kernels at that rate, no per-call cost)."""
    densities = {**DENSITIES, **(densities or {})}
    out = []
    for S in lengths:
        w = Workload(S, densities[S])
        for n, l, order in meshes:
            link = intra if n * l <= gpus_per_host else inter
            sim = {f: simulate_fused(w, n, l, order, costs=costs.with_form(f, rows_ref), intra=intra, inter=link)
                   for f in STEP_FORMS}
            p = sim["split"]
            vals = [q.step_s for q in sim.values()]
            le = length_err if measured_S and S != measured_S else 0.0
            out.append(dict(S=S, mesh=f"{n}x{l}", gpus=n * l, ring_order=order, ring="sparse", density=densities[S],
                            inter="NVLink" if link is intra else "400G", **p.as_dict(),
                            forms={f: q.step_s for f, q in sim.items()},
                            band_lo_s=min(vals) / (1 + err["hi"]) / (1 + le),
                            band_hi_s=max(vals) / (1 + err["lo"]) / (1 - le)))
            if dense_rate:
                k = Kernels(rate=dense_rate, step_overhead=0.0, index_s=0.0)
                d = simulate(Workload(S, 1.0), n, l, order, kernels=k, intra=intra, inter=link)
                out.append(dict(S=S, mesh=f"{n}x{l}", gpus=n * l, ring_order=order, ring="dense", density=1.0,
                                inter="NVLink" if link is intra else "400G", step_s=d.step_s,
                                exposed_comm_s=d.exposed_comm_s, bytes_inner=d.bytes_inner, bytes_outer=d.bytes_outer,
                                steps=d.steps))
    return out


def fit_dense_rate(records: list[dict], run: str) -> tuple[float, dict] | tuple[None, None]:
    """The dense ring kernels' rate from the family's multi-GPU dense record with the most GPUs (the
    dense ring is compute-bound: ``flops / P / time``), and that record."""
    rs = [r for r in records if r.get("run") == run and r.get("dense_fwdbwd_s")]
    if not rs:
        return None, None
    r = max(rs, key=lambda r: _mesh(r)[0] * _mesh(r)[1])
    n, l = _mesh(r)
    return Workload(r["S"], 1.0).flops / (n * l) / r["dense_fwdbwd_s"], r


def markdown_current(result: dict) -> str:
    """The "current code" tables of ``results/ring/comm_model.md`` from :func:`main`'s JSON."""
    lines = ["| family | S | mesh | role | measured ms | predicted ms | error | kernels ms (trace / model) | "
             "XLA ms (trace / model) | exposed comm ms (trace / model) | host ms (measured / model) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["calibration"]:
        p, m = r["predicted"], r["measured_trace_ms"]
        xla_model = (p["index_s"] + p["xla_token_s"] + p["xla_step_s"]) * 1e3
        lines.append(f"| {r['run']} | {r['S'] // 1024}K | {r['mesh']} {r['ring_order']} | {r['role']} | "
                     f"{r['measured_s'] * 1e3:.1f} | {r['predicted_s'] * 1e3:.1f} | {r['rel_err']:+.1%} | "
                     f"{m['kernels']:.1f} / {(p['kernel_s'] + p['call_s']) * 1e3:.1f} | "
                     f"{m['xla']:.1f} / {xla_model:.1f} | "
                     f"{m['exposed']:.2f} / {p['exposed_comm_s'] * 1e3:.2f} | {r['measured_host_ms']:.1f} / "
                     f"{p['host_s'] * 1e3:.1f} |")
    lines += ["", "| S | mesh | inter-node | sparse ms (band) | forms: split / fixed / chunk | kernels + per-call | "
              "XLA per token | XLA per step | exposed comm | host | dense ms | bytes per rank, inner / outer |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    dense = {(r["S"], r["mesh"], r["ring_order"]): r for r in result["predictions"] if r["ring"] == "dense"}
    for r in result["predictions"]:
        if r["ring"] != "sparse":
            continue
        d = dense.get((r["S"], r["mesh"], r["ring_order"]))
        f = r["forms"]
        dense_ms = f"{d['step_s'] * 1e3:.0f}" if d else "-"
        lines.append(f"| {r['S'] // 1024}K | {r['mesh']} {r['ring_order']} | {r['inter'] if r['gpus'] > 1 else '-'} | "
                     f"**{r['step_s'] * 1e3:.1f}** ({r['band_lo_s'] * 1e3:.1f}-{r['band_hi_s'] * 1e3:.1f}) | "
                     f"{f['split'] * 1e3:.1f} / {f['fixed'] * 1e3:.1f} / {f['chunk'] * 1e3:.1f} | "
                     f"{(r['kernel_s'] + r['call_s']) * 1e3:.1f} | {(r['index_s'] + r['xla_token_s']) * 1e3:.1f} | "
                     f"{r['xla_step_s'] * 1e3:.1f} | {r['exposed_comm_s'] * 1e3:.2f} | {r['host_s'] * 1e3:.1f} | "
                     f"{dense_ms} | ")
        lines[-1] += f"{r['bytes_inner'] / 1e6:.0f} / {r['bytes_outer'] / 1e6:.0f} MB |"
    return "\n".join(lines) + "\n"


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


def _plot_traced(result: dict, path: str) -> None:
    """comm_model.png: the traced calibration (measured vs predicted), the predictions over GPUs with
    their bands, and the predicted parts of the layer's time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(19, 5))
    cols = {"fit: 1 GPU": "C0", "fit: per-step terms": "C2", "held out": "C1"}
    rows = result["calibration"]
    labels = [f"{r['run']} {r['S'] // 1024}K\n{r['mesh']}{' flat' if r['ring_order'] == 'flat' else ''}" for r in rows]
    errs = [r["rel_err"] * 100 for r in rows]
    lim = max(12.0, min(30.0, max(abs(e) for e in errs) + 4))
    a.bar(range(len(rows)), errs, color=[cols[r["role"]] for r in rows])
    a.set_xticks(range(len(rows)), labels, fontsize=7)
    for x, (e, r) in enumerate(zip(errs, rows)):
        y = max(-lim + 1, min(lim - 3, e))  # a bar beyond the axis gets its label inside
        a.text(x, y + (0.3 if e >= 0 else -0.9), f"{e:+.1f}%\n{r['measured_s'] * 1e3:.0f} ms", ha="center",
               fontsize=7, va="bottom" if e >= 0 else "top")
    for y in (-10, 10):
        a.axhline(y, color="k", ls="--", lw=1)
    a.axhline(0, color="k", lw=0.5)
    for role, col in cols.items():
        a.bar([0], [0], color=col, label=role)
    a.set_ylim(-lim, lim)
    a.set_ylabel("predicted / measured - 1, %")
    a.set_title("sparse ring on H100: model error per record (target +-10 %)", fontsize=10)
    a.legend(fontsize=7, loc="lower left")
    preds = [r for r in result["predictions"] if r["ring"] == "sparse" and r["ring_order"] == "hierarchical"]
    for S, col in zip(sorted({r["S"] for r in preds}), ("C0", "C3")):
        rs = sorted((r for r in preds if r["S"] == S and r["mesh"] != "2x4"), key=lambda r: r["gpus"])
        g = [r["gpus"] for r in rs]
        y = [r["step_s"] * 1e3 for r in rs]
        b.plot(g, y, "-o", c=col, label=f"sparse {S // 1024}K, predicted (band)")
        b.fill_between(g, [r["band_lo_s"] * 1e3 for r in rs], [r["band_hi_s"] * 1e3 for r in rs], color=col, alpha=0.15)
        meas = [r for r in rows if r["S"] == S and r["run"] == result["model"]["current"]]
        if meas:
            b.scatter([int(m["mesh"][0]) * int(m["mesh"][2]) for m in meas], [m["measured_s"] * 1e3 for m in meas],
                      marker="*", s=120, c=col, zorder=3, label=f"measured {S // 1024}K ({result['model']['current']})")
    b.set_xscale("log", base=2)
    b.set_yscale("log")
    b.set_xticks([1, 4, 8, 32])
    b.set_xticklabels(["1", "4", "8\n(1 node)", "32\n(4 x 8, 400G)"])
    b.set_ylabel("fwd+bwd ms per layer")
    b.set_title("predictions, current code (hierarchical; band: per-step forms x held-out error)", fontsize=9)
    b.legend(fontsize=7)
    parts = (("kernel_s", "kernels: active work"), ("call_s", "kernels: per call"), ("index_s", "XLA: index estimate"),
             ("xla_token_s", "XLA: per token, rest"), ("xla_step_s", "XLA: per ring step"),
             ("exposed_comm_s", "exposed comm"), ("host_s", "host"))
    sel = [r for r in preds if r["mesh"] in ("1x4", "1x8", "4x8")]
    sel.sort(key=lambda r: (r["S"], r["gpus"]))
    labels = [f"{r['S'] // 1024}K\n{r['mesh']}" for r in sel]
    bottom = [0.0] * len(sel)
    for (key, lab), col in zip(parts, ("C0", "C9", "C2", "C8", "C3", "C1", "C7")):
        v = [r[key] * 1e3 for r in sel]
        c.bar(labels, v, bottom=bottom, label=lab, color=col)
        bottom = [x + y for x, y in zip(bottom, v)]
    c.set_ylabel("predicted ms per layer (central)")
    c.set_title("where the time goes (hierarchical)", fontsize=10)
    c.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", nargs="+", default=[RING_RECORDS],
                   help="measurements (default: the repository's results/ring/ring.jsonl); families traced on the "
                        "--fit record's device (with a traced one-GPU record) get the per-step model (issue 33), "
                        "the others the earlier rate-only rule")
    p.add_argument("--runs", default="v14",
                   help="comma-separated run tags: only these rows of --records ('' = every row)")
    p.add_argument("--earlier-records", nargs="*", default=[RING_RECORDS],
                   help="older, untraced measurements: calibrated with the earlier rule (section 'earlier'); "
                        "rows of the families --records calibrates are left out")
    p.add_argument("--fit", default=":".join(FIT_RECORD),
                   help="RUN:MESH:ORDER[:S] of the traced record that gives the per-call and per-step terms, or two "
                        "such records at two lengths, comma-separated (fixed + per-row terms, multi-GPU host term)")
    p.add_argument("--current", default="v14",
                   help="family (run tag) whose one-GPU record gives the predictions' costs")
    p.add_argument("--check", default="x4c:1x4:hierarchical:524288",
                   help="RUN:MESH:ORDER:S of an earlier traced family to calibrate the same way on its own records "
                        "(H200 link; '' to skip): the model's structure on other code, hardware and lengths")
    p.add_argument("--rate", type=float, default=360.0, help="earlier model: sparse kernels' fwd+bwd TFLOP/s")
    p.add_argument("--dense-rate", type=float, default=430.0, help="earlier model: dense ring kernels' fwd+bwd TFLOP/s")
    p.add_argument("--exchange-len", type=int, default=0,
                   help="also model the sparse-aware K/V exchange on the synthetic index of this length (CPU: ~1 min at 64K)")
    p.add_argument("--out", help="folder for comm_model.json, comm_model.png and comm_model_current.md")
    a = p.parse_args(argv)
    runs = {x for x in a.runs.split(",") if x}
    records = [r for r in _records(a.records) if not runs or r.get("run") in runs]
    fits = [tuple(f.split(":")) for f in a.fit.split(",") if f]
    fit = fits[0] if len(fits) == 1 else fits
    traced = _traced(records)
    ref = _find(traced, *fits[0][:3], S=int(fits[0][3]) if len(fits[0]) > 3 else None)
    if ref is None and traced:
        print(f"no traced record {a.fit} among --records: the earlier rule only")
    # the per-step model covers the families traced on the fit record's device; the rest: the earlier rule
    traced = [r for r in traced if ref is not None and r.get("device") == ref.get("device")]
    result: dict = {}
    fams = {r["run"] for r in traced}
    earlier = [r for r in records + _records(a.earlier_records or []) if r.get("run") not in fams]
    length_err = 0.0
    if a.check:
        spec = a.check.split(":")
        fam = [r for r in earlier if r.get("run") == spec[0]]
        if _traced(fam):
            rows_c, terms_c, _ = calibrate_traced(fam, tuple(spec), intra=NVLINK_H200)
            result["earlier_traced_check"] = dict(fit=spec, terms=terms_c, calibration=rows_c,
                                                  held_out_error=held_out_error(rows_c))
            for r in rows_c:
                print(f"check {r['run']:>5} {r['S'] // 1024:>5}K {r['mesh']:>4} {r['ring_order']:>12} {r['role']:>20}: "
                      f"measured {r['measured_s'] * 1e3:7.1f} ms  predicted {r['predicted_s'] * 1e3:7.1f} ms  "
                      f"({r['rel_err']:+.1%}; fixed {r['forms']['fixed'] / r['measured_s'] - 1:+.1%}, "
                      f"chunk {r['forms']['chunk'] / r['measured_s'] - 1:+.1%})")
            other = [r for r in rows_c if r["S"] != terms_c["S"] and r["mesh"] != "1x1"]
            length_err = max((abs(r["rel_err"]) for r in other), default=0.0)
            result["earlier_traced_check"]["length_err"] = length_err
    if traced:
        calib, terms, costs = calibrate_traced(traced, fit)
        err = held_out_error(calib)
        current = a.current if a.current in costs else max(costs, key=lambda k: max(
            r.get("date", "") for r in traced if r["run"] == k))
        sync = max((r.get("hlo_collective_permute_sync") or 0 for r in traced if r["run"] == current), default=0)
        dense_rate, dense_rec = fit_dense_rate(records, current)
        c = dataclasses.replace(costs[current], sync_hops=sync)
        preds = traced_predictions(c, terms["rows"], err, dense_rate=dense_rate, measured_S=terms["S"],
                                   length_err=length_err)
        cur = [r for r in traced if r["run"] == current]
        result.update(model=dict(
            fit_record=dict(zip(("run", "mesh", "ring_order"), fits[0])),
            fit_records=[dict(zip(("run", "mesh", "ring_order", "S"), f)) for f in fits], terms=terms, current=current,
            current_commit=sorted({r.get("commit") for r in cur})[0], current_device=cur[0].get("device"),
            costs={k: dataclasses.asdict(v) for k, v in costs.items()}, prediction_costs=dataclasses.asdict(c),
            held_out_error=err, length_err=length_err, forms=list(STEP_FORMS), row_kernel_ms=ROW_KERNEL_MS,
            links=dict(intra=dataclasses.asdict(NVLINK_H100), inter=dataclasses.asdict(IB_400G)),
            dense_rate_tflops=dense_rate / 1e12 if dense_rate else None,
            dense_fit=(dict(run=current, mesh=dense_rec["mesh"], measured_s=dense_rec["dense_fwdbwd_s"])
                       if dense_rec else None),
            measured_kv_ppermute_s={f"{r['run']} {r['mesh']} {r.get('ring_order')}": r["kv_ppermute_s"]
                                    for r in traced if r.get("kv_ppermute_s")}),
            calibration=calib, predictions=preds)
        print(f"per-step terms from {terms['run']} {terms['mesh']}: per call {terms['per_call_ms_at_S']:.2f} ms per "
              f"{terms['S'] // 1024}K rows; per step {terms['step_s'] * 1e3:.2f} ms at {terms['rows'] // 1024}K-token "
              f"chunks ({terms['row_fraction']:.0%} chunk-scaled)")
        for r in calib:
            print(f"{r['run']:>6} {r['S'] // 1024:>5}K {r['mesh']:>4} {r['ring_order']:>12} {r['role']:>20}: measured "
                  f"{r['measured_s'] * 1e3:7.1f} ms  predicted {r['predicted_s'] * 1e3:7.1f} ms  ({r['rel_err']:+.1%})")
        print(f"held-out error {err['lo']:+.1%} .. {err['hi']:+.1%} over {err['n']} records")
        for r in preds:
            if r["ring"] == "sparse":
                print(f"sparse {r['S'] // 1024:>5}K {r['mesh']:>4} {r['ring_order']:>12} ({r['inter']}): "
                      f"{r['step_s'] * 1e3:7.1f} ms  band {r['band_lo_s'] * 1e3:.1f}-{r['band_hi_s'] * 1e3:.1f}  "
                      f"(per-step XLA {r['xla_step_s'] * 1e3:.1f}, exposed comm {r['exposed_comm_s'] * 1e3:.2f})")
            else:
                print(f" dense {r['S'] // 1024:>5}K {r['mesh']:>4} {r['ring_order']:>12}: {r['step_s'] * 1e3:9.1f} ms")
    # the earlier rule (rate fitted per family and length, fixed 0.3 ms per kernel call) on the other families
    calib_old = calibrate(earlier)
    preds_old = predictions(Kernels(rate=a.rate * 1e12), a.dense_rate * 1e12)
    result["earlier"] = dict(calibration=calib_old, predictions=preds_old)
    for r in calib_old if not traced else []:
        print(f"{r['run']:>12} {r['S'] // 1024:>5}K {r['mesh']:>4} {r['ring_order']:>12}  measured {r['measured_s'] * 1e3:8.1f} ms"
              f"  predicted {r['predicted_s'] * 1e3:8.1f} ms  ({r['rel_err']:+.0%})")
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
    result["exchange"] = exchange
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "comm_model.json"), "w") as f:
            json.dump(result, f, indent=1)
        if traced:
            _plot_traced(result, os.path.join(a.out, "comm_model.png"))
            with open(os.path.join(a.out, "comm_model_current.md"), "w") as f:
                f.write(markdown_current(result))
        else:
            _plot(calib_old, preds_old, os.path.join(a.out, "comm_model.png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
