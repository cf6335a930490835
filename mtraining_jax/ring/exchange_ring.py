"""The forward and K/V-side backward passes of the sparse K/V exchange (what is sent and why it
is exact: :mod:`.exchange`).

Schedule (the ring's (query rank, K/V chunk) pairs, :func:`.schedule.source_rank`)::

    forward:   own step; for s in 1..P-1:
                 owner r sends kv_own[tokens needed by t = query_rank(r, s)]  --direct-->  t
                 t attends its queries to the compact chunk and keeps it (a VJP residual)
    backward:  own step; for s in 1..P-1:
                 t runs the step's backward on the compact chunk it kept
                 t sends the compact float32 dK/dV --direct back--> r, which scatter-adds them

Each send is one collective-permute over ``("node", "local")``. The received buffers are kept for
the backward (``(P - 1) * capacity`` tokens of K/V per rank) instead of being sent again. With a
guarded capacity, ``ok[s - 1]`` says every rank's need at step ``s`` fits; where it does not, the
step sends the whole chunk (``lax.cond``, alike on every rank) in both passes. No fused calls.

Shapes as :mod:`.backward`; ``kpos_all int32 [P, Sl]``; ``step_index`` an index source with
``step`` and ``for_rank``.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from mtraining_jax.mesh import CP_AXES
from mtraining_jax.ring.config import RingConfig
from mtraining_jax.ring.exchange import compact_index, needed_tokens
from mtraining_jax.ring.schedule import source_rank
from mtraining_jax.ring.steps import my_rank, narrow, query_rank
from pallas_kernels.api import attention_delta, block_sparse_attention_bwd, block_sparse_attention_fwd
from pallas_kernels.index_format import chunk_work

__all__ = ["exchange_guard", "forward_exchange", "backward_exchange"]


def _pairs(cfg: RingConfig, s: int, back: bool = False):
    """(source, target) ranks of step ``s``'s send: owner -> holder (``back``: holder -> owner)."""
    pairs = [(r, int(query_rank(r, s, cfg))) for r in range(cfg.num_ranks)]
    return [(b, a) for a, b in pairs] if back else pairs


def _send(x, cfg: RingConfig, s: int, back: bool = False):
    return lax.ppermute(x, CP_AXES, perm=_pairs(cfg, s, back))


def exchange_guard(cfg: RingConfig, step_index, sl: int):
    """``bool [P - 1]`` (or ``None`` when the capacity is exact): step ``s``'s need fits the
    capacity on every rank (this rank's needs, then one all-reduce max over the ring's ranks)."""
    if not cfg.exchange_guard or cfg.num_ranks == 1:
        return None
    need = jnp.stack([needed_tokens(step_index.step(s), sl, cfg.block_size, cfg.block_size)[1]
                      for s in range(1, cfg.num_ranks)])
    return lax.pmax(need, CP_AXES) <= cfg.exchange_capacity


class _Step:
    """The pieces of step ``s`` on this rank: the chunk's source, the receiver of this rank's
    chunk, and (lazily, inside a branch) the compact index, positions and segments."""

    def __init__(self, cfg: RingConfig, step_index, kpos_all, segs, rank, s: int, sl: int):
        self.cfg, self.step_index, self.kpos_all, self.segs, self.s, self.sl = cfg, step_index, kpos_all, segs, s, sl
        self.src = source_rank(rank, s, cfg.num_nodes, cfg.num_local, cfg.ring_order)
        self.dest = query_rank(rank, s, cfg)
        self.index = step_index.step(s)

    def send_tokens(self):
        """Tokens of this rank's chunk that the holder at this step needs."""
        return needed_tokens(self.step_index.for_rank(self.dest).step(self.s), self.sl, self.cfg.block_size,
                             self.cfg.exchange_capacity)[0]

    def kernel_args(self, compact: bool):
        """``(k_pos, index, seg_kw)`` of the kernel call on the compact (or whole) chunk."""
        kpos = lax.dynamic_index_in_dim(self.kpos_all, self.src, axis=0, keepdims=False)
        kseg = None if self.segs is None else lax.dynamic_index_in_dim(self.segs[1], self.src, axis=0, keepdims=False)
        index = self.index
        if compact:
            cap, bs = self.cfg.exchange_capacity, self.cfg.block_size
            tok, _, cof = needed_tokens(index, self.sl, bs, cap)
            index = compact_index(index, cof, cap, bs)
            kpos = kpos[tok]
            kseg = None if kseg is None else kseg[:, tok]
        seg_kw = {} if kseg is None else {"q_seg": self.segs[0], "k_seg": kseg}
        return kpos, narrow(index, seg_kw, self.cfg.block_size), seg_kw


def _branches(ok, s: int, sparse, full, *operands):
    return sparse(*operands) if ok is None else lax.cond(ok[s - 1], sparse, full, *operands)


def forward_exchange(cfg: RingConfig, q, kv_own, q_pos, kpos_all, step_index, segs=None, ok=None,
                     out_dtype=jnp.float32):
    """The forward with the sparse exchange; returns ``(out, lse f32, work f32 [P], kept)`` as the
    ring's forward (``out`` float32, rounded to ``out_dtype`` by the last kernel call; ``work[s]``: the
    step's kernel slots) and ``kept [P - 1, 2, B, capacity, Hkv, D]`` the compact chunks received
    (zeros at steps that took the whole chunk)."""
    P, bs, sl = cfg.num_ranks, cfg.block_size, kv_own.shape[2]
    rank = my_rank(cfg)
    own = _Step(cfg, step_index, kpos_all, segs, rank, 0, sl)
    kpos, index, seg_kw = own.kernel_args(False)
    out, lse = block_sparse_attention_fwd(q, kv_own[0], kv_own[1], q_pos, kpos, index, sm_scale=cfg.sm_scale,
                                          block_size=bs, impl=cfg.impl, stream=cfg.kernel_stream,
                                          out_dtype=out_dtype if P == 1 else jnp.float32, **seg_kw)
    work, kept = [chunk_work(index, sl, 1, bs)[0]], []
    cap_shape = kv_own.shape[:2] + (cfg.exchange_capacity,) + kv_own.shape[3:]
    for s in range(1, P):
        st = _Step(cfg, step_index, kpos_all, segs, rank, s, sl)

        def run(compact, out, lse, st=st, s=s):
            kv = _send(kv_own[:, :, st.send_tokens()] if compact else kv_own, cfg, s)
            kpos, index, seg_kw = st.kernel_args(compact)
            o, l = block_sparse_attention_fwd(q, kv[0], kv[1], q_pos, kpos, index, sm_scale=cfg.sm_scale,
                                              block_size=bs, impl=cfg.impl, stream=cfg.kernel_stream,
                                              acc=(out, lse), out_dtype=out_dtype if s == P - 1 else jnp.float32,
                                              **seg_kw)
            return o, l, chunk_work(index, kv.shape[2], 1, bs)[0], kv if compact else jnp.zeros(cap_shape, kv.dtype)

        out, lse, w, kv_s = _branches(ok, s, lambda o, l: run(True, o, l), lambda o, l: run(False, o, l), out, lse)
        work.append(w)
        kept.append(kv_s)
    return out, lse, jnp.stack(work), (jnp.stack(kept) if kept else None)


def backward_exchange(cfg: RingConfig, q, kv_own, kept, q_pos, kpos_all, step_index, out, out_lo, lse, do, segs=None,
                      ok=None):
    """The K/V-side backward with the sparse exchange (module docstring) on the chunks ``kept``
    from the forward; ``(dq, dk, dv)``: dQ in q's dtype (rounded once, by the last step's kernel), dK/dV
    float32."""
    P, bs, sl = cfg.num_ranks, cfg.block_size, kv_own.shape[2]
    rank = my_rank(cfg)
    delta = attention_delta(out, do, out_lo)

    def bwd(kv, kpos, index, seg_kw, dq, last):  # last: the final dQ, written in q's dtype
        return block_sparse_attention_bwd(q, kv[0], kv[1], q_pos, kpos, index, do, lse, delta, sm_scale=cfg.sm_scale,
                                          block_size=bs, impl=cfg.impl, stream=cfg.kernel_stream,
                                          dq_acc=dq, dq_dtype=q.dtype if last else jnp.float32, **seg_kw)

    own = _Step(cfg, step_index, kpos_all, segs, rank, 0, sl)
    dq, dk, dv = bwd(kv_own, *own.kernel_args(False), None, P == 1)
    dkv = jnp.stack([dk, dv])
    for s in range(1, P):
        st = _Step(cfg, step_index, kpos_all, segs, rank, s, sl)

        def run(compact, dq, dkv, st=st, s=s):
            tok = st.send_tokens() if compact else None
            kv = kept[s - 1] if compact else _send(kv_own, cfg, s)
            dq, dk_s, dv_s = bwd(kv, *st.kernel_args(compact), dq, s == P - 1)
            back = _send(jnp.stack([dk_s, dv_s]), cfg, s, back=True)
            return dq, (dkv.at[:, :, tok].add(back) if compact else dkv + back)

        dq, dkv = _branches(ok, s, lambda a, b: run(True, a, b), lambda a, b: run(False, a, b), dq, dkv)
    return dq, dkv[0], dkv[1]
