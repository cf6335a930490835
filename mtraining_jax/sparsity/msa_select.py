"""MiniMax Sparse Attention (MSA) block selection: index-branch scores -> top-k KV blocks -> ``StepIndex``.

MSA (paper ``003``, §3.1 "Index Branch"): one index query head per GQA group ``q_idx [B, S, Hkv,
d_idx]`` and ONE shared index key head ``k_idx [B, S, d_idx]`` score KV blocks; each query block
keeps its group's top-``k`` blocks, the local (diagonal) block always included, causal.

Choices (the paper's differ):

* Block scores (``pooling``): ``"mean"`` (default): ``q_idx . kbar[b] / sqrt(d_idx)`` with
  ``kbar[b]`` the mean-pooled index keys (one all-gather of ``[B, nb, d_idx]``; scoring
  ``[rows, nb]``); ``"max"``, the paper's: ``max_{j in b, j <= i} q_idx_i . k_idx_j / sqrt(d_idx)``
  (every token's index key all-gathered; scoring ``[rows, S]``).
* Block size 64 (paper: 128): one selected block is one kernel tile.
* Per query block, not per query row: the kernels' ``StepIndex`` holds one block list per 64-row
  query block and head; the top ``k - 1`` candidates plus the local block are kept, so work is
  exactly ``k * 64^2`` per query block and the kernels are unchanged. Which rows rank the
  candidates (``selection``, :data:`SELECTIONS`):

  - ``"causal"`` (default): the block's FIRST row's index softmax over the candidate blocks. Every
    row of the block lies at or after that row, so no row's output depends on a later token.
  - ``"block_mean"``: the mean over the block's 64 rows of each row's index softmax. Row ``i``'s
    selection then reads the index queries of up to 63 LATER rows of its block, a look-ahead the
    language-model loss can exploit and autoregressive decoding cannot reproduce; kept to
    reproduce the earlier study rows (``results/quality/quality.md`` says which).
* Candidates of query block ``QB``: the blocks ``< QB`` and the forced local block; no score reads a
  key after the block's first query. The selection is computed under ``stop_gradient``.

Shapes: :class:`MSASelection` holds GLOBAL block ids per (batch, KV group, local query block);
``q_pos [Sq]`` are the global positions of the block-aligned local queries.
:func:`selection_step_index` / :class:`MSARankStepIndex` turn it into the kernels'
:class:`~pallas_kernels.index_format.StepIndex` for one visiting K/V chunk (query heads repeated
over their group, no vertical columns).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mtraining_jax.ring.schedule import source_rank
from mtraining_jax.sparsity.convert import RankStepIndex
from mtraining_jax.sparsity.index import compact_sorted
from mtraining_jax.sparsity.positions import check_positions
from pallas_kernels.index_format import StepIndex, causal_flags


class MSASelection(NamedTuple):
    """Selected KV blocks per (batch, KV group, local query block).

    * ``block_idx int32 [B, Hkv, nQB, K]`` global KV block ids; the first ``block_count`` sorted
      ascending and distinct, always holding the query block's own (local) block; padding ``nb``.
    * ``block_count int32 [B, Hkv, nQB]``, ``1 <= count <= K``.
    """

    block_idx: jax.Array
    block_count: jax.Array


MAP_BYTES = 256 * 1024**2  # live temporaries per batched lax.map chunk over query blocks


def map_batch(n: int, bytes_per_item: int) -> int | None:
    """``batch_size`` for ``lax.map`` over ``n`` query blocks whose temporaries take
    ``bytes_per_item`` each: as many per chunk as fit :data:`MAP_BYTES` (fewer, larger kernels on
    a GPU instead of one tiny step per 64-row block); ``None`` (sequential) when one does not fit."""
    b = min(n, MAP_BYTES // max(1, bytes_per_item))
    return b if b > 1 else None


POOLINGS: tuple[str, ...] = ("mean", "max")
SELECTIONS: tuple[str, ...] = ("causal", "block_mean")  # which rows of a query block rank its candidates


def validate_pooling(pooling) -> str:
    if pooling not in POOLINGS:
        raise ValueError(f"msa pooling must be one of {POOLINGS}, got {pooling!r}")
    return pooling


def validate_selection(selection) -> str:
    if selection not in SELECTIONS:
        raise ValueError(f"msa selection must be one of {SELECTIONS}, got {selection!r}")
    return selection


def index_keys(k_idx, block_size: int = 64, pooling: str = "mean"):
    """What a rank contributes to the all-gathered index keys of its local rows ``k_idx [B, Sl, d]``:
    ``"mean"``: :func:`block_summaries` ``[B, Sl / bs, d]``; ``"max"``: the keys, float32."""
    validate_pooling(pooling)
    return block_summaries(k_idx, block_size) if pooling == "mean" else k_idx.astype(jnp.float32)


def block_summaries(k_idx, block_size: int = 64):
    """``float32 [B, n, d]``: the mean of ``k_idx [B, n * block_size, d]`` over each run of
    ``block_size`` rows (a block-aligned layout's local rows give whole global blocks)."""
    B, S, d = k_idx.shape
    if S % block_size:
        raise ValueError(f"sequence length {S} is not a multiple of block_size={block_size}")
    return k_idx.astype(jnp.float32).reshape(B, S // block_size, block_size, d).mean(axis=2)


def block_ids(q_pos, block_size: int = 64):
    """``int32 [n]``: global block id of each local run of ``block_size`` positions."""
    return (jnp.asarray(q_pos, jnp.int32).reshape(-1, block_size)[:, 0] // block_size).astype(jnp.int32)


def index_block_logits(q_idx_blk, keys, pooling: str = "mean", q_pos_blk=None, block_size: int = 64):
    """``float32 [B, Hkv, bs, nb]`` block logits of one query block ``q_idx_blk [B, bs, Hkv, d]``.

    ``"mean"``: ``keys`` are the block summaries ``[B, nb, d]``; logit ``q_idx . kbar / sqrt(d)``.
    ``"max"``: ``keys`` are all index keys ``[B, S, d]`` in natural order; logit
    ``max_{j in b, j <= q_pos} q_idx . k_j / sqrt(d)`` (``-inf`` for a block with no visible key;
    ``q_pos_blk [bs]`` the rows' global positions)."""
    d = q_idx_blk.shape[-1]
    s = jnp.einsum("bqgd,bnd->bgqn", q_idx_blk.astype(jnp.float32), keys.astype(jnp.float32),
                   precision="highest") * d**-0.5
    if pooling == "mean":
        return s
    S = keys.shape[1]
    s = jnp.where(jnp.arange(S)[None, :] <= q_pos_blk[:, None], s, -jnp.inf)
    return s.reshape(s.shape[:3] + (S // block_size, block_size)).max(-1)


def _candidate_probs(logits, qb):
    """Per-row index softmax over the candidate blocks ``< qb`` (``[..., nb]``; 0 elsewhere; rows
    with no candidate are all 0)."""
    nb = logits.shape[-1]
    cand = jnp.arange(nb) < qb
    s = jnp.where(cand, logits, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    return p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)


def _topk_with_local(score, qb, k: int):
    """``(ids [..., k] sorted ascending padded with nb, count)``: ``qb`` plus the top ``k - 1`` of
    ``score [..., nb]`` over the candidates ``< qb``."""
    nb = score.shape[-1]
    ar = jnp.arange(nb)
    key = jnp.where(ar < qb, score, -jnp.inf)
    key = jnp.where(ar == qb, jnp.inf, key)  # the local block always wins a slot
    k = min(k, nb)
    vals, ids = jax.lax.top_k(key, k)
    return compact_sorted(vals > -jnp.inf, ids, k, pad=nb)


def select_blocks(q_idx, kbar, q_pos, *, block_size: int = 64, top_k: int = 16, pooling: str = "mean",
                  selection: str = "causal") -> MSASelection:
    """Scheme (b) selection of the local queries (see module docstring), under ``stop_gradient``.

    Args:
      q_idx: ``[B, Sq, Hkv, d]`` index queries of the local (block-aligned) rows.
      kbar: the whole sequence's index keys in natural order as :func:`index_keys` gives them for
        ``pooling``: block summaries ``float32 [B, nb, d]`` (``"mean"``) or keys ``[B, S, d]`` (``"max"``).
      q_pos: ``int [Sq]`` global positions of the local rows.
      top_k: blocks per query block and group, the local block included (``>= 1``).
      selection: ``"causal"`` (the block's first row ranks) or ``"block_mean"`` (all its rows; a
        look-ahead), :data:`SELECTIONS`.
    """
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    validate_pooling(pooling)
    rows = 1 if validate_selection(selection) == "causal" else block_size
    q_idx, kbar = jax.lax.stop_gradient(q_idx), jax.lax.stop_gradient(kbar)
    B, Sq, G, d = q_idx.shape
    seq_len = kbar.shape[1] * (block_size if pooling == "mean" else 1)
    check_positions(q_pos, seq_len, name="q_pos", permutation=False, shape=(Sq,))
    nqb = Sq // block_size
    qbs = block_ids(q_pos, block_size)
    qblk = jnp.moveaxis(q_idx.reshape(B, nqb, block_size, G, d), 1, 0)
    qpb = jnp.asarray(q_pos, jnp.int32).reshape(nqb, block_size)

    def one(xs):
        qi, qb, qp = xs
        z = index_block_logits(qi[:, :rows], kbar, pooling, qp[:rows], block_size)
        agg = _candidate_probs(z, qb).mean(axis=2)  # [B, G, nb]
        return _topk_with_local(agg, qb, top_k)

    ids, cnt = jax.lax.map(one, (qblk, qbs, qpb), batch_size=map_batch(nqb, 8 * B * G * rows * kbar.shape[1]))
    return MSASelection(jnp.moveaxis(ids, 0, 2), jnp.moveaxis(cnt, 0, 2))


def row_topk_union(q_idx, kbar, q_pos, *, block_size: int = 64, top_k: int = 16):
    """Scheme (a), for measurement: each ROW's own top ``k - 1`` candidate blocks plus its local
    block. Returns ``(row_sel bool [B, Hkv, Sq, nb], union_count int32 [B, Hkv, nQB])`` (the union
    over a query block's rows is what a kernel with a per-row mask would have to execute)."""
    B, Sq, G, d = q_idx.shape
    nqb = Sq // block_size
    nb = kbar.shape[1]
    check_positions(q_pos, nb * block_size, name="q_pos", permutation=False, shape=(Sq,))
    qbs = block_ids(q_pos, block_size)
    qblk = jnp.moveaxis(q_idx.reshape(B, nqb, block_size, G, d), 1, 0)

    def one(xs):
        qi, qb = xs
        ids, cnt = _topk_with_local(index_block_logits(qi, kbar), qb, top_k)  # [B, G, bs, K]
        valid = jnp.arange(ids.shape[-1]) < cnt[..., None]
        sel = jnp.zeros(ids.shape[:-1] + (nb + 1,), bool)
        lead = jnp.indices(ids.shape[:-1], sparse=True)
        sel = sel.at[(*[a[..., None] for a in lead], jnp.where(valid, ids, nb))].max(True)[..., :nb]  # deterministic
        return sel, sel.any(axis=2).sum(-1).astype(jnp.int32)

    sel, union = jax.lax.map(one, (qblk, qbs))  # [nQB, B, G, bs, nb], [nQB, B, G]
    sel = jnp.moveaxis(sel, 0, 2).reshape(B, G, Sq, nb)
    return sel, jnp.moveaxis(union, 0, 2)


def full_selection(batch: int, groups: int, q_pos, seq_len: int, block_size: int = 64,
                   max_blocks: int | None = None) -> MSASelection:
    """Every causal block of every local query block (``K = nb``): the warm-up's full support.
    ``max_blocks``: ``K`` slots only (blocks ``0 .. K-1``), for query blocks that all lie before
    global block ``K`` (the caller guarantees it: a later block would lose its causal blocks >= K)."""
    check_positions(q_pos, seq_len, name="q_pos", permutation=False, shape=(np.shape(q_pos)[0],))
    nb = seq_len // block_size
    qbs = block_ids(q_pos, block_size)
    ar = jnp.arange(nb if max_blocks is None else max_blocks, dtype=jnp.int32)
    ids = jnp.where(ar[None, :] <= qbs[:, None], ar[None, :], nb)
    ids = jnp.broadcast_to(ids, (batch, groups) + ids.shape)
    cnt = jnp.broadcast_to(qbs + 1, (batch, groups, qbs.shape[0])).astype(jnp.int32)
    return MSASelection(ids.astype(jnp.int32), cnt)


def selection_block_map(sel: MSASelection, num_blocks: int):
    """``bool [B, Hkv, nQB, nb]``: whether global block ``j`` is selected for that query block."""
    K = sel.block_idx.shape[-1]
    valid = jnp.arange(K) < sel.block_count[..., None]
    ids = jnp.where(valid, sel.block_idx, num_blocks)
    out = jnp.zeros(sel.block_idx.shape[:-1] + (num_blocks + 1,), bool)
    lead = jnp.indices(sel.block_idx.shape[:-1], sparse=True)
    return out.at[(*[a[..., None] for a in lead], ids)].max(True)[..., :num_blocks]  # max: deterministic


def selection_step_index(sel: MSASelection, q_pos, k_pos, *, num_heads: int, seq_len: int,
                         block_size: int = 64) -> StepIndex:
    """:class:`StepIndex` of the local queries at ``q_pos [Sq]`` against the keys at ``k_pos [Sk]``
    (global positions, block-aligned; several ring chunks may be concatenated): the selected
    blocks held by that chunk, as local block ids (sorted), query heads ``h`` reading group
    ``h // (num_heads // Hkv)``'s selection, no columns. Works with traced positions."""
    bs = block_size
    B, G, nqb, K = sel.block_idx.shape
    if num_heads % G:
        raise ValueError(f"num_heads={num_heads} is not a multiple of the selection's {G} KV groups")
    for name, p in (("q_pos", q_pos), ("k_pos", k_pos)):
        check_positions(p, seq_len, name=name, permutation=False, shape=(np.shape(p)[0],))
    nb, nkb = seq_len // bs, k_pos.shape[0] // bs
    k_pos = jnp.asarray(k_pos, jnp.int32)
    blockmap = jnp.full((nb + 1,), -1, jnp.int32).at[block_ids(k_pos, bs)].set(  # distinct blocks
        jnp.arange(nkb, dtype=jnp.int32), unique_indices=True)
    valid = jnp.arange(K) < sel.block_count[..., None]
    cand = jnp.where(valid, blockmap[jnp.clip(sel.block_idx, 0, nb)], -1)
    mb = min(K, nkb)
    bidx, cnt = compact_sorted(cand >= 0, cand, mb, pad=0)
    cnt = jnp.minimum(cnt, mb)
    g = num_heads // G
    bidx, cnt = jnp.repeat(bidx, g, axis=1), jnp.repeat(cnt, g, axis=1)
    flags = causal_flags(jnp.asarray(q_pos, jnp.int32), k_pos, bidx, bs)
    return StepIndex(bidx, cnt, flags, jnp.zeros((B, num_heads, 1), jnp.int32),
                     jnp.zeros((B, num_heads, nqb), jnp.int32))


def selection_work(sel: MSASelection, num_heads: int, block_size: int = 64):
    """Kernel slots of a selection over all its query heads (``sum count * bs^2``, float32)."""
    g = num_heads // sel.block_idx.shape[1]
    return sel.block_count.astype(jnp.float32).sum() * g * block_size**2


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class MSARankStepIndex(RankStepIndex):
    """One rank's MSA index source for the sparse ring (the protocol of
    :class:`~mtraining_jax.sparsity.convert.RankStepIndex`, whose layout / schedule handling it
    inherits: ``step(s)`` / ``steps(steps)`` / ``num_steps``), holding an :class:`MSASelection` as
    its ``index`` and converting one ring step (or a fused group of steps) at a time with
    :func:`selection_step_index`. ``num_heads``: query heads (the selection is per KV group)."""

    num_heads: int = 0

    def steps(self, steps) -> StepIndex:
        pos = jnp.asarray(self.layout.positions, jnp.int32)
        k_pos = jnp.concatenate([pos[source_rank(self.rank, s, self.num_nodes, self.num_local, self.ring_order)]
                                 for s in steps])
        return selection_step_index(self.index, pos[self.rank], k_pos, num_heads=self.num_heads,
                                    seq_len=self.layout.seq_len, block_size=self.block_size)

    def tree_flatten(self):
        leaves, static = super().tree_flatten()
        return leaves, (*static, self.num_heads)

    @classmethod
    def tree_unflatten(cls, static, leaves):
        obj = super().tree_unflatten(static[:-1], leaves)
        object.__setattr__(obj, "num_heads", static[-1])
        return obj


def layout_block_order(positions, block_size: int = 64) -> np.ndarray:
    """``int [nb]``: for a block-aligned layout's ``positions [P, S/P]`` (host), the global block id
    of each block in all-gather order (rank-major)."""
    pos = np.asarray(positions)
    check_positions(pos, pos.size, name="layout positions")
    return (pos.reshape(-1, block_size)[:, 0] // block_size).astype(np.int32)
