"""Load and quality metrics of a vertical-slash index under sparse ring attention (MTraining §3.3, Table 3).

Work unit: the kernels execute ``bs x bs`` tiles for active blocks and ``bs``-row column strips for
verticals, so one query block against one visiting chunk costs

    work = block_count * bs^2 + col_count * bs      (attended (q, k) slots the kernel computes),

summed over the rank's query blocks, the batch and the heads (masked slots of computed tiles
included). ``W[r, s]``: the work of worker ``r`` at ring step ``s``.

* worker-level imbalance: ``mean_s( max_r W[r, s] / mean_r W[r, s] )`` (Fig. 7);
* step-level imbalance: ``mean_r( max_s W[r, s] / mean_s W[r, s] )``; both over the steps with
  work only, ``>= 1`` (:func:`imbalance`);
* computation ratio: ``sum_{r,s} W[r, s] / (P * sum_s T_s)``, ``T_s = max(max_r W[r, s], C_s)``
  with ``C_s`` the step's K/V transfer in work units: a cost-model analogue of Table 3's
  "Comp. Ratio".

Quality: ``density`` / ``sparsity`` over the causal pairs of the global mask, ``recall`` = the
full causal softmax mass that the index keeps, averaged over query rows, and ``column_recall`` =
the same restricted to chosen key columns (a needle's span, for the rows that answer it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.reference import attention_logits
from mtraining_jax.layouts import Layout
from mtraining_jax.ring.schedule import source_table
from mtraining_jax.sparsity.convert import check_block_aligned
from mtraining_jax.sparsity.index import VerticalSlashIndex
from mtraining_jax.sparsity.masks import index_to_mask
from mtraining_jax.sparsity.positions import check_positions


def _host_index(index: VerticalSlashIndex):
    return [np.asarray(a) for a in index]


def pair_work(index: VerticalSlashIndex, layout, block_size: int = 64) -> np.ndarray:
    """``int64 [P, P]``: work of rank ``r``'s queries against rank ``o``'s keys (host NumPy).

    Equals the total of the converted per-step counts (tested); ``O(B*H*(nb*MS + MV*P))`` time, so it
    runs at 512K tokens on a CPU.
    """
    positions = np.asarray(layout.positions if isinstance(layout, Layout) else layout)
    if positions.ndim != 2:
        raise ValueError(f"layout positions have shape {positions.shape}, expected [P, S/P]")
    check_positions(positions, positions.size, name="layout positions")
    check_block_aligned(positions, block_size, "layout")
    P, sl = positions.shape
    S, bs = positions.size, block_size
    nb = S // bs
    owner = np.empty(nb, np.int64)
    owner[positions[:, ::bs] // bs] = np.arange(P)[:, None]
    # suffix[r, g] = number of global query blocks >= g owned by rank r
    onehot = np.zeros((P, nb + 1), np.int64)
    onehot[owner, np.arange(nb)] = 1
    suffix = np.cumsum(onehot[:, ::-1], axis=1)[:, ::-1]
    v_idx, v_count, s_idx, s_count = _host_index(index)
    B, H = v_count.shape
    M = np.zeros((P, P), np.int64)
    g = np.arange(nb)
    for b in range(B):
        for h in range(H):
            ds = s_idx[b, h, : s_count[b, h]]
            # tiles: query block g vs key block g - d
            qg, dd = np.meshgrid(g, ds, indexing="ij")
            ok = qg - dd >= 0
            np.add.at(M, (owner[qg[ok]], owner[(qg - dd)[ok]]), bs * bs)
            # columns: every query block g >= v // bs runs vertical v in its column phase (the
            # kernels mask, but still compute, the rows where v lies inside an active block)
            vb = v_idx[b, h, : v_count[b, h]] // bs
            np.add.at(M.T, owner[vb], bs * suffix[:, vb].T)
    return M


def work_matrix(index: VerticalSlashIndex, layout, *, num_nodes: int, num_local: int,
                ring_order: str = "hierarchical", block_size: int = 64) -> np.ndarray:
    """``int64 [P workers, P steps]``: ``W[r, s] = pair_work[r, source_rank(r, s)]``."""
    M = pair_work(index, layout, block_size)
    tab = source_table(num_nodes, num_local, ring_order)
    if M.shape[0] != tab.shape[0]:
        raise ValueError(f"layout has {M.shape[0]} ranks but the mesh {num_nodes} x {num_local} has {tab.shape[0]}")
    return np.take_along_axis(M, tab.astype(np.int64), axis=1)


def step_index_work(step_index, block_size: int = 64) -> np.ndarray:
    """Work per leading step entry of a converted index (``[..., P steps, B, H, nQB]`` counts)."""
    bc = np.asarray(step_index.block_count, np.int64)
    cc = np.asarray(step_index.col_count, np.int64)
    w = bc * block_size**2 + cc * block_size
    return w.sum(axis=(-1, -2, -3))


def imbalance(W, axis: int, xp=np):
    """Mean max/mean ratio of ``W [P workers, P steps]`` across ``axis``, over steps WITH work.

    ``axis=0``: worker-level (ratio across the workers of a step, averaged over the steps);
    ``axis=1``: step-level (ratio across the steps of a worker, averaged over the workers).
    A ring step where no worker has work (e.g. a slash-only index whose band never reaches a
    distant chunk) is a hop with no compute: it is left out of both, as is a worker with no work
    on the remaining steps (its max/mean would be 0/0). The result is ``>= 1`` (1 = balanced, or
    no work at all). ``xp``: ``numpy`` (host, float64) or ``jax.numpy`` (traceable, float32).
    """
    W = xp.asarray(W, xp.float64 if xp is np else xp.float32)
    W = xp.where(W.sum(axis=0, keepdims=True) > 0, W, xp.nan)  # empty steps -> excluded
    n = xp.sum(~xp.isnan(W), axis=axis)
    tot = xp.nansum(W, axis=axis)
    mx = xp.max(xp.where(xp.isnan(W), 0.0, W), axis=axis)
    live = tot > 0  # groups (steps / workers) with work
    ratio = xp.where(live, mx * n / xp.where(live, tot, 1.0), 0.0)
    count = xp.sum(live)
    return xp.where(count > 0, xp.sum(ratio) / xp.maximum(count, 1), 1.0)


def worker_imbalance(W) -> float:
    """Mean over the steps with work of max/mean over workers (:func:`imbalance`, ``axis=0``)."""
    return float(imbalance(W, 0))


def step_imbalance(W) -> float:
    """Mean over the workers of max/mean over the steps with work (:func:`imbalance`, ``axis=1``)."""
    return float(imbalance(W, 1))


def computation_ratio(W, comm=0.0) -> float:
    """Busy fraction under step barriers: ``sum W / (P * sum_s max(max_r W[:, s], comm_s))``."""
    W = np.asarray(W, np.float64)
    T = np.maximum(W.max(axis=0), np.broadcast_to(np.asarray(comm, np.float64), W.shape[1:]))
    return float(W.sum() / (W.shape[0] * T.sum()))


def density(index: VerticalSlashIndex, seq_len: int, block_size: int = 64) -> np.ndarray:
    """``float64 [B, H]``: attended causal (q, k) pairs / all causal pairs (host, closed form)."""
    v_idx, v_count, s_idx, s_count = _host_index(index)
    bs, S = block_size, seq_len
    nb = S // bs
    B, H = v_count.shape
    out = np.zeros((B, H))
    for b in range(B):
        for h in range(H):
            diag = np.zeros(nb, bool)
            diag[s_idx[b, h, : s_count[b, h]]] = True
            d = np.nonzero(diag)[0]
            pairs = np.where(d == 0, nb * bs * (bs + 1) // 2, (nb - d) * bs * bs).sum()
            v = v_idx[b, h, : v_count[b, h]]
            vb = v // bs
            own = np.where(diag[0], 0, (vb + 1) * bs - v)  # queries of its own block, q >= v
            free = np.concatenate([[0], np.cumsum(~diag[1:])])  # free[j] = #inactive d in 1..j
            pairs += own.sum() + bs * free[nb - 1 - vb].sum()
            out[b, h] = pairs / (S * (S + 1) / 2)
    return out


def sparsity(index: VerticalSlashIndex, seq_len: int, block_size: int = 64) -> np.ndarray:
    """``1 - density``."""
    return 1.0 - density(index, seq_len, block_size)


def recall(q, k, index: VerticalSlashIndex, *, rows=None, block_size: int = 64, sm_scale=None,
           chunk: int = 64, segment_ids=None):
    """``float64 [B, H]``: mean over query rows of the full causal softmax mass kept by the index.

    ``q [B, S, Hq, D]``, ``k [B, S, Hkv, D]`` in natural order. ``rows``: global query positions to
    average over (default all); processed ``chunk`` rows at a time (``chunk x S`` logits per head).
    ``segment_ids int [B, S]`` (packed documents): the softmax and the kept pairs are those of the
    causal document mask (a query attends its own document only).
    """
    return _row_mass(q, k, index, rows, None, block_size, sm_scale, chunk, segment_ids)[0]


def column_recall(q, k, index: VerticalSlashIndex, *, rows, cols, block_size: int = 64, sm_scale=None,
                  chunk: int = 64):
    """``(kept, mass)``, both ``float64 [B, H]``: for the query ``rows``, the mean softmax mass on the key
    positions ``cols`` (e.g. a needle's span, for the rows that answer it) and the part of it the index
    keeps; ``kept / mass`` is the index's recall of those columns. Shapes and order as :func:`recall`."""
    return _row_mass(q, k, index, rows, cols, block_size, sm_scale, chunk, None)


def _row_mass(q, k, index, rows, cols, block_size, sm_scale, chunk, segment_ids):
    """``(kept, total)`` float64 ``[B, H]``, each the mean over ``rows`` (default all) of the causal softmax
    mass on ``cols`` (default every key) that the index keeps / in all."""
    S = k.shape[1]
    if rows is not None:
        check_positions(rows, S, name="rows", permutation=False, shape=(np.size(rows),))
    if cols is not None:
        check_positions(cols, S, name="cols", permutation=False, shape=(np.size(cols),))
    rows = np.arange(S) if rows is None else np.asarray(rows)
    colm = jnp.ones(S, bool) if cols is None else jnp.zeros(S, bool).at[jnp.asarray(cols)].set(True)
    vmask = jnp.zeros(index.v_idx.shape[:2] + (S + 1,), bool)
    B, H, mv = index.v_idx.shape
    valid = jnp.arange(mv) < index.v_count[..., None]
    vmask = vmask.at[jnp.arange(B)[:, None, None], jnp.arange(H)[None, :, None],
                     jnp.where(valid, index.v_idx, S)].set(True)[..., :S]
    nb = S // block_size
    ms = index.s_idx.shape[-1]
    svalid = jnp.arange(ms) < index.s_count[..., None]
    diag = jnp.zeros((B, H, nb + 1), bool).at[jnp.arange(B)[:, None, None], jnp.arange(H)[None, :, None],
                                            jnp.where(svalid, index.s_idx, nb)].set(True)[..., :nb]
    seg = None if segment_ids is None else jnp.asarray(segment_ids)
    total = 0.0
    for i in range(0, len(rows), chunk):
        r = rows[i: i + chunk]
        total = total + np.asarray(_kept_mass(q[:, r], jnp.asarray(r), k, vmask, diag, colm, seg, sm_scale,
                                              block_size), np.float64)
    return total[0] / len(rows), total[1] / len(rows)


@functools.partial(jax.jit, static_argnums=(7, 8))
def _kept_mass(qr, rpos, k, vmask, diag, colm, seg, sm_scale, block_size):
    """``[2, B, H]``: the rows' softmax mass on the columns ``colm`` that the index keeps, and in all (summed
    over the rows); compiled once per shape, not per call."""
    S, nb = k.shape[1], diag.shape[-1]
    z = attention_logits(qr, k, sm_scale)  # [B, H, R, S]
    kp = jnp.arange(S)
    causal = kp[None, :] <= rpos[:, None]
    if seg is not None:  # [B, 1, R, S]
        causal = causal & (seg[:, rpos][:, :, None] == seg[:, None, :])[:, None]
    z = jnp.where(causal, z, -jnp.inf)
    p = jnp.where(colm, jax.nn.softmax(z, axis=-1), 0.0)
    d = rpos[:, None] // block_size - kp[None, :] // block_size
    allowed = (diag[:, :, jnp.clip(d, 0, nb - 1)] | vmask[:, :, None, :]) & causal
    return jnp.stack([jnp.where(allowed, p, 0.0).sum((-1, -2)), p.sum((-1, -2))])


def mask_recall(q, k, index: VerticalSlashIndex, block_size: int = 64):
    """Same as :func:`recall` over all rows via the dense mask (small ``S``; used to test it)."""
    S = q.shape[1]
    z = attention_logits(q, k)
    t = jnp.arange(S)
    z = jnp.where(t[None, :] <= t[:, None], z, -jnp.inf)
    p = jax.nn.softmax(z, axis=-1)
    return np.asarray(jnp.where(index_to_mask(index, S, block_size), p, 0.0).sum(-1).mean(-1), np.float64)
