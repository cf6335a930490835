"""The ring cost model's schedule simulators (:mod:`benchmarks.comm_model`): links, workload, the
earlier rate-only :func:`simulate` and the fused ring as the current code runs it, :func:`simulate_fused`,
with its per-rank :class:`RingCosts`."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from benchmarks.ring_comm import Hop, exchange_hops, hop_bytes, hop_link, ring_hops
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


# ------------------------------------------------------------------ the fused ring with per-step costs (issue 33)

#: effective collective-permute bandwidth between two H100s of one node (NVLink), measured: the 134 MB
#: K/V chunk of a 4-rank ring in 1.25 ms (v12a) and 1.15 ms (v12), ``kv_ppermute_s`` of the 1x4 records of
#: runs ``v12a`` / ``v12`` of ``results/ring/ring.jsonl`` (an isolated, timed permute: its dispatch is inside)
NVLINK_H100 = Link(bandwidth=112 * GB, latency=15e-6)

#: the backward's share of a step's kernel work (FLOP: 2.5 of 3.5) and the dQ kernel's share of the
#: backward (3 of its 7 matmuls: the dK/dV kernels recompute S and dP, then form dV and dK)
BWD_SHARE, DQ_SHARE = 2.5 / 3.5, 3 / 7
#: how the per-step XLA cost scales with the chunk (:meth:`RingCosts.with_form`): ``split`` as fitted
#: (part fixed, part per chunk row), all ``fixed``, all per ``chunk`` row
STEP_FORMS = ("split", "fixed", "chunk")


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
