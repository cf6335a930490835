"""MSA's KL alignment loss and selection-recall metric, blockwise (never ``[S, S]``).

Paper ``003`` §3.2 "KL Loss" / "Gradient Detach": the index branch is trained to match the main
branch on the selected support, ``KL(sg(P_main) || P_index)``, the teacher averaged over the ``G``
query heads of a KV group. Both distributions are BLOCK-level over a row's selected blocks:

* teacher ``T[i, b] = 1/G sum_{h in group} sum_{j in block b, j <= i} softmax_h(q_i . k_j * scale)``
  over the causally visible tokens of the selected blocks, from ``stop_gradient(q, k)``;
* student ``P_idx[i, b] = softmax_b(z_ib)`` with the selection's block logits
  (:func:`~mtraining_jax.sparsity.msa_select.index_block_logits`; for the row's own block under
  ``pooling="mean"``, the mean of its index keys up to ``i``);
* loss ``= sum_i sum_groups KL(T || P_idx)``; callers divide by ``B * S * Hkv``.

Gradients reach ``q_idx``, ``kbar`` and the local index keys only. A ``lax.map`` over the local
query blocks keeps live memory at one block's ``[B, Hq, bs, K * bs]`` scores. In warm-up the
support is every causal block (:func:`~mtraining_jax.sparsity.msa_select.full_selection`).

Shapes: ``q [B, Sq, Hq, D]`` local queries, ``k_all [B, S, Hkv, D]`` ALL keys in natural order,
``q_pos int [Sq]`` (block-aligned global positions), ``q_idx [B, Sq, Hkv, d]``, ``kbar [B, nb, d]``,
``k_idx_local [B, Sq, d]``, support an :class:`~mtraining_jax.sparsity.msa_select.MSASelection`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mtraining_jax.sparsity.msa_select import MSASelection, full_selection, map_batch, selection_block_map


def _blocks(x, nqb, bs):
    """``[B, nqb * bs, ...]`` -> ``[nqb, B, bs, ...]``."""
    return jnp.moveaxis(x.reshape(x.shape[0], nqb, bs, *x.shape[2:]), 1, 0)


def _main_scores(qb, keys, scale):
    """``float32 [B, G, g, bs, L]`` main-branch logits of ``qb [B, bs, G, g, D]`` against
    ``keys [B, G, L, D]``. Half-precision inputs (bf16 / f16, the model's compute dtype) multiply
    in that dtype with float32 accumulation — the products are exact in float32, as in the
    attention kernels — on the tensor cores; float32 inputs use ``precision="highest"``."""
    half = qb.dtype == keys.dtype and qb.dtype in (jnp.bfloat16, jnp.float16)
    if half:
        s = jnp.einsum("bqrgd,brld->brgql", qb, keys, preferred_element_type=jnp.float32)
    else:
        s = jnp.einsum("bqrgd,brld->brgql", qb.astype(jnp.float32), keys.astype(jnp.float32), precision="highest")
    return s * scale


def _teacher_mass(qb, k_all, tok, tok_ok, qpos, scale):
    """``float32 [B, Hkv, bs, L]`` group-averaged main-branch probabilities of the gathered keys
    ``tok [B, Hkv, L]`` (global ids) for the query block ``qb [B, bs, Hq, D]``."""
    B, bs, Hq, D = qb.shape
    G = tok.shape[1]
    g = Hq // G
    ksel = k_all[jnp.arange(B)[:, None, None], tok, jnp.arange(G)[None, :, None]]  # [B, G, L, D]
    s = _main_scores(qb.reshape(B, bs, G, g, D), ksel, scale)
    ok = tok_ok[:, :, None, None, :] & (tok[:, :, None, None, :] <= qpos[None, None, None, :, None])
    s = jnp.where(ok, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    p = p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)
    return p.mean(axis=2)


def _visible(ids, slot_ok, qbid, bs):
    """``bool [B, G, 1, bs(query), K, bs(key)]``: key ``j`` of selected block ``ids[..., k]`` is
    causally visible to row ``r`` of query block ``qbid`` (whole earlier blocks, the local block up
    to the diagonal, nothing later) and the slot is valid."""
    r = jnp.arange(bs)
    diag = (r[None, :] <= r[:, None])[None, None, None, :, None, :]
    before = (ids < qbid)[:, :, None, None, :, None]
    local = (ids == qbid)[:, :, None, None, :, None]
    return slot_ok[:, :, None, None, :, None] & (before | (local & diag))


def _teacher_block_mass(qb, kblk, visible, scale):
    """``float32 [B, G, bs, K]``: the group-averaged main-branch softmax over the visible keys of
    the selected blocks, summed per block (the teacher ``T``), for ``qb [B, bs, Hq, D]`` and the
    selected blocks' keys ``kblk [B, G, K, bs, D]``. Two passes over the ``[B, Hq, bs, K, bs]``
    scores (a per-block max, then per-block sums of exponentials); the normalisation and the
    group average run on the ``[.., K]`` block sums."""
    B, bs, Hq, D = qb.shape
    G, K = kblk.shape[1], kblk.shape[2]
    s = _main_scores(qb.reshape(B, bs, G, Hq // G, D), kblk.reshape(B, G, K * bs, D), scale)
    s = jnp.where(visible, s.reshape(B, G, Hq // G, bs, K, bs), -jnp.inf)
    mb = jnp.max(s, axis=-1)  # [B, G, g, bs, K]; -inf for an empty (invalid / later) block
    eb = jnp.exp(s - jnp.where(jnp.isfinite(mb), mb, 0.0)[..., None]).sum(-1)
    m = jnp.max(mb, axis=-1, keepdims=True)  # finite: the local block's diagonal is always visible
    w = eb * jnp.exp(mb - m)
    return (w / jnp.maximum(w.sum(-1, keepdims=True), 1e-30)).mean(axis=2)


def _local_prefix_mean(kib):
    """``[B, bs, d]``: for each row, the mean of the block's index keys up to and including it."""
    c = jnp.cumsum(kib.astype(jnp.float32), axis=1)
    return c / jnp.arange(1, kib.shape[1] + 1, dtype=jnp.float32)[None, :, None]


def msa_kl_sum(q, k_all, q_pos, q_idx, kbar, k_idx_local, support: MSASelection, *, block_size: int = 64,
               sm_scale: float | None = None, pooling: str = "mean"):
    """``float32`` scalar: ``sum_{b, i, group} KL(T_i || P_idx_i)`` over the local rows (module
    docstring). Differentiable in ``q_idx``, ``kbar``, ``k_idx_local``; zero gradient to q, k.

    Work per local query block: the main-branch scores of its ``Hq x bs`` rows against the
    ``K x bs`` keys of its selected blocks (as the sparse attention forward), gathered block-wise;
    ``pooling="max"`` adds the index scores against the same ``K x bs`` index keys only (never the
    whole sequence's: no ``[rows, S]`` intermediates or residuals)."""
    q, k_all = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k_all)
    B, Sq, Hq, D = q.shape
    bs = block_size
    nqb = Sq // bs
    S, G = k_all.shape[1], k_all.shape[2]
    nb = S // bs
    d = q_idx.shape[-1]
    scale = D**-0.5 if sm_scale is None else sm_scale
    K = support.block_idx.shape[-1]
    qpos = jnp.asarray(q_pos, jnp.int32)
    k_blk = jnp.moveaxis(k_all.reshape(B, nb, bs, G, D), 3, 1)  # [B, G, nb, bs, D]: one copy, block gathers
    bi, gi = jnp.arange(B)[:, None, None], jnp.arange(G)[None, :, None]
    ki_blk = kbar.reshape(B, nb, bs, d) if pooling == "max" else None  # every token's index key

    def one(xs):
        qb, qib, kib, qp, ids, cnt = xs  # ids [B, G, K], cnt [B, G]
        qbid = qp[0] // bs
        slot_ok = jnp.arange(K) < cnt[..., None]  # [B, G, K]
        safe = jnp.clip(ids, 0, nb - 1)
        vis = _visible(safe, slot_ok, qbid, bs)
        t = _teacher_block_mass(qb, k_blk[bi, gi, safe], vis, scale)  # [B, G, bs, K]
        if pooling == "max":
            kis = ki_blk[bi, safe].astype(jnp.float32)  # [B, G, K, bs, d]
            zt = jnp.einsum("bqgd,bgkjd->bgqkj", qib.astype(jnp.float32), kis, precision="highest") * d**-0.5
            z = jnp.max(jnp.where(vis[:, :, 0], zt, -jnp.inf), axis=-1)  # [B, G, bs, K]
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
    per_block = 4 * B * (2 * Hq * bs * K * bs + G * K * bs * D)  # scores (+ exponentials), gathered keys
    if pooling == "max":
        per_block += 8 * B * G * bs * K * bs  # token-level index scores of the selected blocks
    return jax.lax.map(one, xs, batch_size=map_batch(nqb, per_block)).sum()


WARMUP_CHUNKS = 4  # query-block groups of the warm-up KL: ~(C+1)/(2C) of the full-support work


def warmup_kl_sum(q, k_all, q_pos, q_idx, kbar, k_idx_local, q_blocks, *, rank=None, block_size: int = 64,
                  sm_scale: float | None = None, pooling: str = "mean", chunks: int = WARMUP_CHUNKS):
    """:func:`msa_kl_sum` over the warm-up's full causal support
    (:func:`~mtraining_jax.sparsity.msa_select.full_selection`), in ``chunks`` groups of local query
    blocks ordered by global block id, each against only the ``K_c`` key blocks its latest block can
    see: about ``(chunks + 1) / (2 chunks)`` of the ``[rows, nb * bs]`` score work that ``K = nb`` for
    every block costs (half the work is later, masked blocks). The same sum (up to float order).

    ``q_blocks``: static ``int [ranks, nqb]`` global block id of each rank's local query blocks
    (``layout.positions[:, ::bs] // bs``); ``rank``: this rank (traced under ``shard_map``; ``None``:
    row 0, one device). Other arguments as :func:`msa_kl_sum`."""
    table = np.asarray(q_blocks, np.int64)
    bs, S = block_size, k_all.shape[1]
    order = np.argsort(table, axis=1, kind="stable")  # each rank's local blocks, earliest first
    srt = np.take_along_axis(table, order, axis=1)
    r = 0 if rank is None else rank
    total = jnp.zeros((), jnp.float32)
    for part in np.array_split(np.arange(table.shape[1]), min(chunks, table.shape[1])):
        K = int(srt[:, part[-1]].max()) + 1  # every rank's chunk lies before block K
        blocks = jnp.asarray(order[:, part], jnp.int32)[r]  # [m] local block numbers of this chunk
        rows = (blocks[:, None] * bs + jnp.arange(bs, dtype=jnp.int32)[None, :]).reshape(-1)
        pick = lambda x: jnp.take(x, rows, axis=1)  # noqa: E731
        pos = jnp.take(jnp.asarray(q_pos, jnp.int32), rows)
        sup = full_selection(q.shape[0], k_all.shape[2], pos, S, bs, max_blocks=K)
        total = total + msa_kl_sum(pick(q), k_all, pos, pick(q_idx), kbar, pick(k_idx_local), sup, block_size=bs,
                                   sm_scale=sm_scale, pooling=pooling)
    return total


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
    return total, selection_recall_rows(B, G, Sq, block_size=bs, num_blocks=num_blocks)


def selection_recall_rows(batch: int, groups: int, local_len: int, *, block_size: int = 64, num_blocks: int = 1) -> int:
    """The ``rows`` that :func:`selection_recall_sum` returns (static)."""
    return batch * groups * min(num_blocks, local_len // block_size) * block_size


__all__ = ["msa_kl_sum", "selection_recall_rows", "selection_recall_sum", "warmup_kl_sum"]
