"""MSA's KL alignment loss and selection-recall metric, blockwise (never ``[S, S]``).

Paper ``003`` §3.2 "KL Loss" / "Gradient Detach": the index branch is trained to match the main
branch on the selected support, ``KL(sg(P_main) || P_index)``, with the teacher the main-branch
softmax averaged (at the probability level) over the ``G`` query heads of a KV group. Here both
distributions are BLOCK-level over the selected blocks of a query row:

* teacher ``T[i, b] = 1/G sum_{h in group} sum_{j in block b, j <= i} softmax_h(q_i . k_j * scale)``,
  the softmax over the causally visible tokens of the selected blocks (exactly the main branch's
  sparse attention distribution, summed per block) — computed from ``stop_gradient(q, k)``;
* student ``P_idx[i, b] = softmax_b(z_ib)`` over the same blocks, with the selection's block logits
  (:func:`~mtraining_jax.sparsity.msa_select.index_block_logits`): ``pooling="mean"``:
  ``z_ib = q_idx_i . kbar_b / sqrt(d_idx)``, ``kbar_b`` the mean-pooled index key of block ``b``
  and, for the row's own (local, partly visible) block, the mean of its index keys up to and
  including ``i`` (causal); ``pooling="max"``: ``z_ib = max_{j in b, j <= i} q_idx_i . k_idx_j / sqrt(d_idx)``;
* loss ``= sum_i sum_groups KL(T || P_idx)``; callers divide by ``B * S * Hkv`` (the paper's mean
  over positions and groups).

Gradients reach ``q_idx``, ``kbar`` and the local index keys only (the teacher is detached). The
loop runs over the local 64-row query blocks (``lax.map``): live memory is one query block's
``[B, Hq, bs, K * bs]`` scores. During warm-up the support is every causal block
(:func:`~mtraining_jax.sparsity.msa_select.full_selection`): the full-sequence main distribution.

Shapes: ``q [B, Sq, Hq, D]`` local queries, ``k_all [B, S, Hkv, D]`` ALL keys in natural order,
``q_pos int [Sq]`` (block-aligned global positions), ``q_idx [B, Sq, Hkv, d]``, ``kbar [B, nb, d]``,
``k_idx_local [B, Sq, d]``, support an :class:`~mtraining_jax.sparsity.msa_select.MSASelection`
of the local query blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mtraining_jax.sparsity.msa_select import MSASelection, index_block_logits, map_batch, selection_block_map


def _blocks(x, nqb, bs):
    """``[B, nqb * bs, ...]`` -> ``[nqb, B, bs, ...]``."""
    return jnp.moveaxis(x.reshape(x.shape[0], nqb, bs, *x.shape[2:]), 1, 0)


def _teacher_mass(qb, k_all, tok, tok_ok, qpos, scale):
    """``float32 [B, Hkv, bs, L]`` group-averaged main-branch probabilities of the gathered keys
    ``tok [B, Hkv, L]`` (global ids) for the query block ``qb [B, bs, Hq, D]``."""
    B, bs, Hq, D = qb.shape
    G = tok.shape[1]
    g = Hq // G
    ksel = k_all[jnp.arange(B)[:, None, None], tok, jnp.arange(G)[None, :, None]]  # [B, G, L, D]
    s = jnp.einsum("bqrgd,brld->brgql", qb.reshape(B, bs, G, g, D).astype(jnp.float32),
                   ksel.astype(jnp.float32), precision="highest") * scale
    ok = tok_ok[:, :, None, None, :] & (tok[:, :, None, None, :] <= qpos[None, None, None, :, None])
    s = jnp.where(ok, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    p = p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)
    return p.mean(axis=2)


def _local_prefix_mean(kib):
    """``[B, bs, d]``: for each row, the mean of the block's index keys up to and including it."""
    c = jnp.cumsum(kib.astype(jnp.float32), axis=1)
    return c / jnp.arange(1, kib.shape[1] + 1, dtype=jnp.float32)[None, :, None]


def msa_kl_sum(q, k_all, q_pos, q_idx, kbar, k_idx_local, support: MSASelection, *, block_size: int = 64,
               sm_scale: float | None = None, pooling: str = "mean"):
    """``float32`` scalar: ``sum_{b, i, group} KL(T_i || P_idx_i)`` over the local rows (module
    docstring). Differentiable in ``q_idx``, ``kbar``, ``k_idx_local``; zero gradient to q, k."""
    q, k_all = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k_all)
    B, Sq, Hq, D = q.shape
    bs = block_size
    nqb = Sq // bs
    S = k_all.shape[1]
    nb = S // bs
    d = q_idx.shape[-1]
    scale = D**-0.5 if sm_scale is None else sm_scale
    K = support.block_idx.shape[-1]
    qpos = jnp.asarray(q_pos, jnp.int32)

    def one(xs):
        qb, qib, kib, qp, ids, cnt = xs  # ids [B, G, K], cnt [B, G]
        qbid = qp[0] // bs
        slot_ok = jnp.arange(K) < cnt[..., None]  # [B, G, K]
        safe = jnp.clip(ids, 0, nb - 1)
        tok = (safe[..., None] * bs + jnp.arange(bs)).reshape(B, ids.shape[1], K * bs)
        t = _teacher_mass(qb, k_all, tok, jnp.repeat(slot_ok, bs, axis=-1), qp, scale)  # [B, G, bs, K*bs]
        t = t.reshape(t.shape[:3] + (K, bs)).sum(-1)  # [B, G, bs, K]
        if pooling == "max":
            zfull = index_block_logits(qib, kbar, "max", qp, bs)  # [B, G, bs, nb], causal
            z = jnp.take_along_axis(zfull, jnp.broadcast_to(safe[:, :, None, :], zfull.shape[:3] + (K,)), axis=-1)
        else:
            kb = jnp.take_along_axis(kbar[:, None, :, :], safe[..., None], axis=2)  # [B, G, K, d]
            z = jnp.einsum("bqgd,bgkd->bgqk", qib.astype(jnp.float32), kb, precision="highest")
            zloc = jnp.einsum("bqgd,bqd->bgq", qib.astype(jnp.float32), _local_prefix_mean(kib),
                              precision="highest")
            is_local = (ids == qbid)[:, :, None, :]
            z = jnp.where(is_local, zloc[..., None], z) * d**-0.5
        ok = slot_ok[:, :, None, :]
        logp = jax.nn.log_softmax(jnp.where(ok, z, -jnp.inf), axis=-1)
        logp = jnp.where(ok, logp, 0.0)
        pos_t = ok & (t > 0)
        kl = jnp.where(pos_t, t * (jnp.log(jnp.where(pos_t, t, 1.0)) - logp), 0.0)
        return kl.sum()

    xs = (_blocks(q, nqb, bs), _blocks(q_idx, nqb, bs), _blocks(k_idx_local, nqb, bs), qpos.reshape(nqb, bs),
          jnp.moveaxis(support.block_idx, 2, 0), jnp.moveaxis(support.block_count, 2, 0))
    per_block = 4 * B * (3 * Hq * bs * K * bs + 2 * k_all.shape[2] * K * bs * D)  # scores, probs, gathered keys
    if pooling == "max":
        per_block += 8 * B * q_idx.shape[2] * bs * S  # token-level index scores
    return jax.lax.map(one, xs, batch_size=map_batch(nqb, per_block)).sum()


def selection_recall_sum(q, k_all, q_pos, sel: MSASelection, *, block_size: int = 64, sm_scale=None,
                         num_blocks: int = 1):
    """``(recall_sum, rows)``: the FULL causal main-branch attention mass (group-averaged) that
    falls in the selected blocks, summed over the last ``num_blocks`` local query blocks' rows,
    batches and groups (divide by ``rows``). No gradient. Cost: ``num_blocks`` query blocks
    against all ``S`` keys."""
    q, k_all = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k_all)
    B, Sq, Hq, D = q.shape
    bs = block_size
    S = k_all.shape[1]
    nb = S // bs
    G = k_all.shape[2]
    scale = D**-0.5 if sm_scale is None else sm_scale
    nqb = Sq // bs
    num_blocks = min(num_blocks, nqb)
    total = jnp.zeros((), jnp.float32)
    tok = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, G, S))
    chosen = selection_block_map(sel, nb)  # [B, G, nQB, nb]
    qpos = jnp.asarray(q_pos, jnp.int32)
    for i in range(nqb - num_blocks, nqb):
        qp = qpos[i * bs:(i + 1) * bs]
        mass = _teacher_mass(q[:, i * bs:(i + 1) * bs], k_all, tok, jnp.ones((B, G, S), bool), qp, scale)
        mass = mass.reshape(B, G, bs, nb, bs).sum(-1)  # [B, G, bs, nb]
        total = total + jnp.where(chosen[:, :, i, None, :], mass, 0.0).sum()
    return total, B * G * num_blocks * bs


__all__ = ["msa_kl_sum", "selection_recall_sum"]
