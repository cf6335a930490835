"""Online estimation of the vertical-slash index (MTraining Algorithm 1; poster "distributed
sparse indexing"): :func:`estimate_index` (one device), :func:`estimate_index_shard` (inside
``shard_map``).

Per batch element and query head:

1. take the ``last_q`` queries with the largest global positions ``S - last_q .. S - 1``;
2. ``A_hat = softmax(Q_last K^T * scale + causal mask)`` over the whole sequence;
3. vertical score of key ``k`` = column sum ``sum_q A_hat[q, k]`` (App. B.1 (ii)); slash score of
   block diagonal ``d`` = sum of ``A_hat[q, k]`` over ``q // bs - k // bs = d``;
4. budgets by top-p coverage with per-head caps (:mod:`.budgets`); diagonal 0 is always kept.

The window lies at the END of the sequence, so in training every earlier row's attention support
is chosen from later queries (the paper's design): the loss of row ``i`` depends on tokens after
``i`` through which lines are kept, though never through attended values. The quality study
measures whether a trained model exploits that by reading its parameters with dense attention
(``eval.cross_eval``; ``results/quality/quality.md``). MSA's selection has a causal default instead
(:mod:`.msa_select`).

Bit-identical across layouts, meshes and programs (forward, backward, remat, evaluation; any
kernel impl, fusion or dot algorithm): the inputs are rounded to their storage dtype
(:func:`pallas_kernels.rounding.storage_round`), the logits are exact integer sums
(:func:`.exact_logits.window_logits`), and after the row max every reduction over keys sums integer fixed-point
digits (:func:`_digits`, :func:`fixed_point_bits`). So every rank ends with the same index without a
broadcast.

Top-p threshold: ``ceil(p * last_q * 2^F)`` of the exact total mass (``F = cfg.score_bits``): the
selected lines cover ``p`` and are minimal to within ``(k + 1) 2^-F / last_q`` of coverage, up to
the float32 error of the logits and ``exp``.

Packed documents (``segment_ids [B, S]``): the window is masked to same-document pairs (the
attention the kernels run). ``cfg.window = "per_document"``: the window is every document's own
last ``last_q`` queries (:func:`_document_window`), and the threshold comes from the floored total.

Cost per head: ``last_q x S`` logits (``last_q / S`` of dense), as one bf16 matmul of ``J^2`` times
the flops (:func:`.exact_logits.window_logits`). ``cfg.estimate_impl``: the XLA path writes that matmul's ``J``
partial products to memory and reads them back per pass; ``"triton"`` computes the same integers
tile by tile in three Pallas Triton passes that never store the logits
(:mod:`pallas_kernels.window_scores`, :func:`_kernel_column_sums`), for either window (the
per-document window's scattered rows carry their positions into the kernels, all at once).
"""

from __future__ import annotations

from typing import Callable, Sequence

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.inputs import check_qkv
from pallas_kernels import window_scores
from pallas_kernels.rounding import storage_round
from pallas_kernels.window_scores import fixed_point_digits as _digits
from mtraining_jax.sparsity.budgets import top_p_select
from mtraining_jax.sparsity.exact_logits import Digits, digit_plan, operand_digits, window_logits
from mtraining_jax.sparsity.config import SparsityConfig
from mtraining_jax.sparsity.index import VerticalSlashIndex
from mtraining_jax.sparsity.positions import check_positions

_E_DIGITS = (7, 8, 8, 8, 8, 8)  # digit widths of exp(z - m) in (0, 1] for the softmax denominator


def _check_inputs(q, k, positions, cfg, num_ranks, name="positions"):
    if not isinstance(cfg, SparsityConfig):
        raise ValueError(f"cfg must be a SparsityConfig, got {type(cfg).__name__}")
    check_qkv(q, k, k)
    S = q.shape[1] * num_ranks
    # the whole sequence on one device: a permutation; one rank's rows: distinct positions in 0..S-1
    check_positions(positions, S, name=name, permutation=num_ranks == 1, shape=(q.shape[1],))
    cfg.check(S, q.shape[2], num_ranks)
    digit_plan(q.shape[3])  # a head_dim the exact logits can take
    if cfg.estimate_impl == "triton":
        try:
            window_scores.supports(cfg.window_rows_at(S), q.shape[1], q.shape[3])
        except NotImplementedError as e:
            raise ValueError(f"estimate_impl='triton': {e}") from None


def estimate_impl(cfg: SparsityConfig, keys: int, head_dim: int, varying: bool = False, rows: int | None = None) -> str:
    """The implementation ``cfg.estimate_impl`` resolves to for ``keys`` local keys and a window of
    ``rows`` rows (``cfg.window_rows_at(S)``; ``None``: the bound ``cfg.window_rows``): ``"auto"`` is
    ``"triton"`` on a GPU where :func:`pallas_kernels.window_scores.supports` the problem and the
    inputs are not ``varying`` (inside a ``shard_map`` with ``check_vma=True``), else ``"xla"``; for
    either window (the per-document one scores only its rows' own documents' key tiles there:
    ``results/documents/packed_documents.md``)."""
    if cfg.estimate_impl != "auto":
        return cfg.estimate_impl
    if jax.default_backend() != "gpu" or varying:
        return "xla"
    try:
        window_scores.supports(cfg.window_rows if rows is None else rows, keys, head_dim)
    except NotImplementedError:
        return "xla"
    return "triton"


def _window_sources(q_pos, seq_len: int, last_q: int):
    """``int32 [last_q]``: the local row holding global position ``S - last_q + i``, or ``Sl`` (this
    rank holds none). Only the row indices are scattered (distinct slots: rows before the window go to
    distinct out-of-range slots and are dropped), not the rows."""
    sl = q_pos.shape[0]
    slot = q_pos - (seq_len - last_q)
    slot = jnp.where(slot >= 0, slot, last_q + jnp.arange(sl, dtype=slot.dtype))
    return jnp.full((last_q,), sl, jnp.int32).at[slot].set(jnp.arange(sl, dtype=jnp.int32), mode="drop",
                                                            unique_indices=True)


def _window_gather(x, src):
    """``(rows [B, last_q, ...] of x [B, Sl, ...] at src, held bool [last_q])``."""
    sl = x.shape[1]
    return jnp.take(x, jnp.minimum(src, sl - 1), axis=1), src < sl


def _last_queries(q, q_pos, seq_len: int, last_q: int, reduce_sum: Callable):
    """``[B, last_q, Hq, D]`` float32: the queries at global positions ``S - last_q ..`` in natural order.

    Each rank gathers the rows it holds (zero elsewhere, and a zero of either sign as ``+0``); the
    ``reduce_sum`` (a ``psum``) adds exactly one non-zero contribution per slot, so the result is
    exact and the same on every mesh."""
    rows, held = _window_gather(q, _window_sources(q_pos, seq_len, last_q))
    rows = rows.astype(jnp.float32)
    return reduce_sum(jnp.where(held[None, :, None, None] & (rows != 0), rows, np.float32(0.0)))


def fixed_point_bits(cfg: SparsityConfig) -> tuple[int, int]:
    """``(F, G)``: probabilities are truncated to ``F + G`` fraction bits and held as two integer
    digits (``F`` and ``G`` bits); line scores are their exact sums floored to ``2^-F``.

    ``F = cfg.score_bits`` keeps a head's total mass ``last_q * 2^F <= 2^29`` in int32; ``G`` keeps
    the low digits' sum over one slash diagonal (``<= last_q * block_size`` terms) below ``2^30``."""
    F = cfg.score_bits
    G = max(0, 30 - math.ceil(math.log2(cfg.window_rows * cfg.block_size)))
    return F, G


def _last_segments(seg, k_pos, seq_len: int, last_q: int, reduce_sum: Callable):
    """``int32 [B, last_q]``: segment ids of the window queries (exact, as :func:`_last_queries`)."""
    ids, held = _window_gather(seg.astype(jnp.int32), _window_sources(k_pos, seq_len, last_q))
    return reduce_sum(jnp.where(held[None, :], ids, 0))


def _document_window(seg, k_pos, seq_len: int, cfg: SparsityConfig, reduce_sum):
    """Per-document observation window: ``(blocks int32 [B, W], rows bool [B, W * bs], row_seg
    int32 [B, W * bs])`` with ``W = min(cfg.window_blocks, nb)``: the last ``W`` query blocks
    holding one of a document's last ``last_q`` tokens (a document = a run of equal ids in
    position order; ``-1`` pads), which of their rows are such tokens, and the rows' ids. The
    global ids by position come from one exact integer ``psum`` of ``[B, S]``."""
    bs, lq = cfg.block_size, cfg.last_q
    B = seg.shape[0]
    nb = seq_len // bs
    W = min(cfg.window_blocks, nb)
    nat = reduce_sum(jnp.zeros((B, seq_len), jnp.int32).at[:, k_pos].add(seg.astype(jnp.int32)))
    t = jnp.arange(seq_len, dtype=jnp.int32)
    last = jnp.concatenate([nat[:, 1:] != nat[:, :-1], jnp.ones((B, 1), bool)], axis=1)  # a run's last token
    end = jax.lax.cummin(jnp.where(last, t, seq_len), axis=1, reverse=True)  # [B, S]
    in_win = t > end - lq
    has = in_win.reshape(B, nb, bs).any(-1)[:, ::-1]  # [B, nb], last block first
    rev = jax.vmap(lambda h: jnp.nonzero(h, size=W, fill_value=nb)[0])(has)
    blocks = jnp.where(rev < nb, nb - 1 - rev, -1).astype(jnp.int32)  # [B, W], descending, -1 = none
    tok = jnp.clip(blocks, 0)[:, :, None] * bs + jnp.arange(bs, dtype=jnp.int32)  # [B, W, bs]
    b_ix = jnp.arange(B)[:, None, None]
    rows = (blocks[:, :, None] >= 0) & in_win[b_ix, tok]
    return blocks, rows.reshape(B, W * bs), nat[b_ix, tok].reshape(B, W * bs)


def _window_queries(q, k_pos, blocks, seq_len: int, bs: int, reduce_sum):
    """``[B, W * bs, Hq, D]``: the queries of the window ``blocks [B, W]`` (exact: each slot gets
    exactly one rank's row)."""
    B, W = blocks.shape
    nb = seq_len // bs
    b_ix = jnp.arange(B)[:, None]
    # unique-index scatters (distinct blocks and positions; the rest to distinct dropped slots): no
    # serialising loop under --xla_gpu_deterministic_ops
    w_ix = jnp.arange(W, dtype=jnp.int32)
    slot_of = jnp.full((B, nb), W, jnp.int32).at[b_ix, jnp.where(blocks >= 0, blocks, nb + w_ix)].set(
        jnp.broadcast_to(w_ix, (B, W)), mode="drop", unique_indices=True)
    sb = slot_of[:, k_pos // bs]  # [B, S_local]
    slot = jnp.where(sb < W, sb * bs + k_pos % bs, W * bs + jnp.arange(k_pos.shape[0], dtype=jnp.int32))
    buf = jnp.zeros((B, W * bs) + q.shape[2:], jnp.float32)
    return reduce_sum(buf.at[b_ix, slot].add(q.astype(jnp.float32), mode="drop", unique_indices=True))


def _scale(head_dim: int, cfg: SparsityConfig):
    return np.float32(head_dim ** -0.5 if cfg.sm_scale is None else cfg.sm_scale)


def _denominator(sums):
    """The softmax denominators from the integer sums of the six digits of ``e`` (``_E_DIGITS``:
    ``e`` truncated to ``2^-47``, each digit summed over ``S <= 2^23`` keys in int32 without
    overflow, digit 0 <= 2^7, the others < 2^8), combined in a fixed order, integers first: the same
    bits on every rank."""
    denom, shift = jnp.float32(0.0), 0
    for w, part in zip(_E_DIGITS, sums):
        shift += w
        denom = denom + part.astype(jnp.float32) * np.float32(2.0**-shift)
    return denom


def _row_digits(q_rows, k, causal, cfg: SparsityConfig, reduce_sum, reduce_max, padded: bool = False):
    """Fixed-point digits ``(hi, lo) int32 [B, Hq, R, S_local]`` of the window rows' exact softmax
    probabilities (:func:`fixed_point_bits`) under ``causal`` (``[R, Sk]`` or ``[B, 1, R, Sk]``);
    ``q_rows`` float32 ``[B, R, Hq, D]``, ``k`` the keys' :func:`.exact_logits.operand_digits`; ``padded``: some
    rows may see no key at all (they get zeros)."""
    F, G = fixed_point_bits(cfg)
    z = window_logits(q_rows, k)  # [B, Hq, R, Sk], unscaled
    z = jnp.where(causal, z, -jnp.inf)
    m = reduce_max(z.max(axis=-1))  # exact in any order
    if padded:  # a padding row sees no key: keep it finite (it adds nothing)
        m = jnp.where(jnp.isfinite(m), m, 0.0)
    scale = _scale(q_rows.shape[-1], cfg)
    # the scale after the subtraction: (z - m) * scale has no multiply-add a compiler could contract
    e = jnp.where(causal, jnp.exp((z - m[..., None]) * scale), 0.0)  # (0, 1]; the row max contributes 1
    denom = _denominator([reduce_sum(d.sum(axis=-1, dtype=jnp.int32)) for d in _digits(e, _E_DIGITS)])
    if padded:
        denom = jnp.where(denom > 0, denom, 1.0)
    a = e / denom[..., None]  # <= 1 (denom >= the row max's exact 1)
    return _digits(a, (F, G))  # a = (hi + lo 2^-G) 2^-F + (< 2^-(F+G))


#: most bytes one chunk of window rows may hold in the estimate's float32 logits (the ``J`` partial
#: dot products of :func:`.exact_logits.window_logits`, ``[B, Hq, rows, J, S_local]``): at 128K, 14 heads and
#: ``last_q`` 64 the whole window would be 1.3 GiB of transients beside the training step's
#: residuals; rows are exact and independent, so chunking them changes no bit (:func:`window_row_chunk`)
ROW_CHUNK_BYTES = 256 * 2**20


def window_row_chunk(batch: int, heads: int, keys: int, head_dim: int, last_q: int, block_size: int) -> int:
    """Rows of the observation window the estimate scores at once: ``last_q`` when its logits fit
    :data:`ROW_CHUNK_BYTES`, else the largest power of two dividing ``gcd(last_q, block_size)``
    whose chunk fits (at least 1), so no chunk straddles a query block."""
    _, J = digit_plan(head_dim)
    per_row = batch * heads * keys * J * 4
    if last_q * per_row <= ROW_CHUNK_BYTES:
        return last_q
    g = math.gcd(last_q, block_size)
    rc = g & -g  # the largest power of two dividing both
    while rc > 1 and rc * per_row > ROW_CHUNK_BYTES:
        rc //= 2
    return rc


def _diagonal_sums(cols, g, k_pos, nb: int, bs: int):
    """``int32 [2, B, Hq, nb]``: the slash sums of window blocks' column sums. ``cols int32 [2, B, Hq,
    W, S_local]``: the (hi, lo) column sums of the window rows in query block ``g [B, W]`` (``< 0``:
    none) at the local keys of global positions ``k_pos [S_local]``; diagonal ``d`` sums the keys of
    block ``g - d`` (``d >= 0``) over the ``W`` blocks. Integer sums, so the same bits either way:
    where the local keys come in whole blocks (``bs`` consecutive keys one block, as every layout
    lays them), per-block sums gathered by diagonal (no scatter); otherwise one scatter-add of every
    key, whose ``B Hq W S_local`` updates land on ``nb`` slots each (atomic contention on a GPU)."""
    sk = k_pos.shape[0]
    kblk = k_pos // bs
    lead = cols.shape[:4]

    def by_key(cols, g):
        b_ix, h_ix = jnp.arange(lead[1])[:, None, None, None], jnp.arange(lead[2])[None, :, None, None]
        d = g[:, :, None] - kblk[None, None, :]  # [B, W, Sk]: each window block's diagonal per key
        d = jnp.where(d >= 0, d, nb)  # no mass (a later key, or no block: g < 0): a spill slot
        zero = (k_pos[0] * 0).astype(jnp.int32)  # varies over the mesh axes like ``cols``
        out = (jnp.zeros(lead[:3] + (nb + 1,), jnp.int32) + zero).at[:, b_ix, h_ix, d[:, None]].add(cols)
        return out[..., :nb]

    if sk % bs:
        return by_key(cols, g)
    n = sk // bs
    kb = kblk.reshape(n, bs)

    def by_block(cols, g):
        per = cols.reshape(lead + (n, bs)).sum(axis=-1, dtype=jnp.int32)  # [2, B, Hq, W, n]
        per = jnp.concatenate([per, jnp.zeros_like(per[..., :1])], axis=-1)  # slot n: no key
        # global block -> its local slot (distinct: bs distinct positions of one block are the block)
        slot = jnp.full((nb,), n, jnp.int32).at[kb[:, 0]].set(jnp.arange(n, dtype=jnp.int32), unique_indices=True)
        j = g[:, :, None] - jnp.arange(nb, dtype=jnp.int32)  # [B, W, nb]: diagonal d's key block
        loc = jnp.where(j >= 0, slot[jnp.clip(j, 0, nb - 1)], n)  # g < 0 (no block): every j < 0
        loc = jnp.broadcast_to(loc[None, :, None], lead + (nb,))
        return jnp.take_along_axis(per, loc, axis=-1).sum(axis=3, dtype=jnp.int32)

    return jax.lax.cond(jnp.all(kb == kb[:, :1]), by_block, by_key, cols, g)


def _local_scores(q, k, k_pos, seq_len: int, cfg: SparsityConfig, reduce_sum, reduce_max, seg=None):
    """Integer vertical scores ``[B, Hq, S_local]`` (local key order) and slash scores ``[B, Hq, nb]``,
    in units of ``2^-F`` of attention probability (:func:`fixed_point_bits`); ``seg [B, S_local]``
    restricts the window to same-document pairs (and with ``cfg.window = "per_document"`` makes
    it the documents' own last queries, :func:`_document_scores`). The window's rows are scored
    :func:`window_row_chunk` at a time (a ``lax.scan`` when more than one chunk): the digit sums are
    integers, so the result does not depend on the chunking."""
    if seg is not None and cfg.window == "per_document":
        return _document_scores(q, k, k_pos, seq_len, cfg, reduce_sum, reduce_max, seg)
    bs, lq = cfg.block_size, cfg.last_q
    nb = seq_len // bs
    _, G = fixed_point_bits(cfg)
    B, _, Hq, D = q.shape
    q_last = _last_queries(q, k_pos, seq_len, lq, reduce_sum)  # q and k share the layout
    last_seg = None if seg is None else _last_segments(seg, k_pos, seq_len, lq, reduce_sum)  # [B, Lq]
    k = operand_digits(k)
    rc = window_row_chunk(B, Hq, k_pos.shape[0], D, lq, bs)

    def digits(pos, qc, sc):
        """``(hi, lo) int32 [B, Hq, rows, Sk]`` of the window rows ``qc`` at global positions ``pos``
        (``sc``: their document ids, or ``None``)."""
        causal = k_pos[None, :] <= pos[:, None]  # [rows, Sk]
        if sc is not None:  # [B, 1, rows, Sk]: and the same document
            causal = (causal & (sc[:, :, None] == seg[:, None, :]))[:, None]
        return _row_digits(qc, k, causal, cfg, reduce_sum, reduce_max)

    def colsums(hi, lo, rows=slice(None)):
        return jnp.stack([x[:, :, rows].sum(axis=2, dtype=jnp.int32) for x in (hi, lo)])  # [2, B, Hq, Sk]

    first = seq_len - lq
    g0, g1 = first // bs, (seq_len - 1) // bs  # the window's (static) query blocks
    # Triton: the logits never in memory (pallas_kernels.window_scores)
    if estimate_impl(cfg, k_pos.shape[0], D, bool(_varying_axes(k_pos)), lq) == "triton":
        per_block = _kernel_block_sums(q_last, k, k_pos, last_seg, seg, seq_len, cfg, reduce_sum, reduce_max)
        per_block = jnp.stack([per_block[g] for g in range(g0, g1 + 1)])  # [blocks, 2, B, Hq, Sk]
        cols = per_block.sum(axis=0, dtype=jnp.int32)
    elif rc == lq:  # the whole window at once; its rows may span query blocks
        qp = np.arange(first, seq_len)
        hi, lo = digits(jnp.asarray(qp, jnp.int32), q_last, last_seg)
        cols = colsums(hi, lo)
        per_block = jnp.stack([colsums(hi, lo, slice(max(g * bs, first) - first, min((g + 1) * bs, seq_len) - first))
                               for g in range(g0, g1 + 1)])  # [blocks, 2, B, Hq, Sk]
    else:  # rc rows at a time, each chunk inside one query block
        n = lq // rc
        per_chunk = lambda x: jnp.moveaxis(x.reshape((B, n, rc) + x.shape[2:]), 1, 0)  # noqa: E731

        def body(per_block, xs):  # column sums per window query block (the slash sums after the scan)
            c, qc, sc = xs
            base = jnp.int32(first) + c * rc
            colsum = colsums(*digits(base + jnp.arange(rc, dtype=jnp.int32), qc, sc))
            return per_block.at[base // bs - g0].add(colsum), None

        zero = (k_pos[0] * 0).astype(jnp.int32)  # varies over the mesh axes like the body's results
        init = jnp.zeros((g1 - g0 + 1, 2, B, Hq, k_pos.shape[0]), jnp.int32) + zero
        xs = (jnp.arange(n, dtype=jnp.int32), per_chunk(q_last), None if seg is None else per_chunk(last_seg))
        per_block, _ = jax.lax.scan(body, init, xs)
        cols = per_block.sum(axis=0, dtype=jnp.int32)
    vert = cols[0] + (cols[1] >> G)  # [B, Hq, Sk]
    g = jnp.broadcast_to(jnp.arange(g0, g1 + 1, dtype=jnp.int32), (B, g1 - g0 + 1))
    slash = reduce_sum(_diagonal_sums(jnp.moveaxis(per_block, 0, 3), g, k_pos, nb, bs))
    return vert, slash[0] + (slash[1] >> G)


def _varying_axes(x) -> frozenset:
    """The mesh axes ``x`` varies over inside a ``shard_map`` with ``check_vma=True`` (empty
    otherwise; ``manual_axis_type`` in JAX 0.10, ``vma`` in later versions)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def _kernel_column_sums(q_rows, k: "Digits", k_pos, ops_kw: dict, cfg: SparsityConfig, reduce_sum, reduce_max,
                        first: int | None):
    """``(hi, lo) int32 [B, Hq, R // tr, S_local]`` and ``tr``: per row tile of ``tr`` window rows, the
    column sums of the rows' probability digits, from the Pallas Triton kernels
    (:mod:`pallas_kernels.window_scores`; interpret mode off a GPU), the row statistics reduced over
    the mesh between the three passes: the integers of :func:`_row_digits` where the platform's
    ``exp`` agrees (always in interpret mode), padding rows (no visible key) zero as there.
    ``ops_kw``: the document ids / row positions of :class:`~pallas_kernels.window_scores.WindowOperands`."""
    if _varying_axes(k_pos):
        raise ValueError(f"estimate_impl='triton' inside jax.shard_map needs check_vma=False (its Pallas calls "
                         f"declare no varying mesh axes; the inputs vary over {sorted(_varying_axes(k_pos))}); the "
                         f"library's own shard_maps set it")
    F, G = fixed_point_bits(cfg)
    D = q_rows.shape[-1]
    w, _ = digit_plan(D)
    qd = operand_digits(q_rows)
    ops = window_scores.WindowOperands(qd.digits, qd.row_scale, k.digits, k.row_scale, k_pos, **ops_kw)
    kw = dict(first=first, w=w, block_size=cfg.block_size, interpret=jax.default_backend() != "gpu")
    m = reduce_max(window_scores.row_max(ops, **kw))  # [B, Hq, R]
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # a padding row sees no key: keep it finite (it adds nothing)
    scale = _scale(D, cfg)
    sums = reduce_sum(window_scores.exp_digit_sums(ops, m, scale=scale, widths=_E_DIGITS, **kw))
    denom = _denominator(list(sums))
    denom = jnp.where(denom > 0, denom, 1.0)
    hi, lo = window_scores.column_digit_sums(ops, m, denom, scale=scale, widths=(F, G), **kw)
    return hi, lo, window_scores.row_tile(q_rows.shape[1], cfg.block_size)


def _kernel_block_sums(q_last, k: "Digits", k_pos, last_seg, seg, seq_len: int, cfg: SparsityConfig, reduce_sum,
                       reduce_max) -> dict:
    """``{g: int32 [2, B, Hq, S_local]}``: the (hi, lo) column sums of the sequence window's rows in
    query block ``g`` (:func:`_kernel_column_sums`)."""
    bs, lq = cfg.block_size, cfg.last_q
    first = seq_len - lq
    segs = dict(q_seg=last_seg, k_seg=None if last_seg is None else seg)
    hi, lo, tr = _kernel_column_sums(q_last, k, k_pos, segs, cfg, reduce_sum, reduce_max, first)
    per_block: dict = {}
    for t in range(lq // tr):  # static: each row tile lies in one query block
        g = (first + t * tr) // bs
        part = jnp.stack([hi[:, :, t], lo[:, :, t]])
        per_block[g] = part if g not in per_block else per_block[g] + part
    return per_block


def _document_scores(q, k, k_pos, seq_len: int, cfg: SparsityConfig, reduce_sum, reduce_max, seg):
    """:func:`_local_scores` over the per-document window (:func:`_document_window`), one window
    block of ``bs`` rows at a time (a ``lax.scan``: the live logits stay ``[B, Hq, bs, S_local]``
    whatever ``window_blocks``); the digit sums are accumulated as integers, so the result does not
    depend on the chunking."""
    bs = cfg.block_size
    nb = seq_len // bs
    _, G = fixed_point_bits(cfg)
    blocks, row_ok, row_seg = _document_window(seg, k_pos, seq_len, cfg, reduce_sum)
    B, W = blocks.shape
    H = q.shape[2]
    q_win = _window_queries(q, k_pos, blocks, seq_len, bs, reduce_sum)  # [B, W * bs, Hq, D]
    k = operand_digits(k)  # once, outside the scan
    per_block = lambda x: jnp.moveaxis(x.reshape((B, W, bs) + x.shape[2:]), 1, 0)  # noqa: E731
    if estimate_impl(cfg, k_pos.shape[0], q.shape[3], bool(_varying_axes(k_pos)), W * bs) == "triton":
        # every window row at once, its global position (-1: a padding row) an operand of the kernels
        pos = jnp.maximum(blocks, 0)[:, :, None] * bs + jnp.arange(bs, dtype=jnp.int32)  # [B, W, bs]
        q_pos = jnp.where(row_ok, pos.reshape(B, W * bs), -1)
        hi, lo, tr = _kernel_column_sums(q_win, k, k_pos, dict(q_seg=row_seg, k_seg=seg, q_pos=q_pos), cfg,
                                         reduce_sum, reduce_max, None)
        sk = hi.shape[-1]
        cols = jnp.stack([x.reshape(B, H, W, bs // tr, sk).sum(axis=3, dtype=jnp.int32) for x in (hi, lo)])
        v = cols.sum(axis=3, dtype=jnp.int32)  # [2, B, Hq, Sk]
        slash = reduce_sum(_diagonal_sums(cols, blocks, k_pos, nb, bs))
        return v[0] + (v[1] >> G), slash[0] + (slash[1] >> G)

    def block(carry, xs):
        v_hi, v_lo, slash = carry
        qb, ok, rs, blk = xs  # [B, bs, Hq, D], [B, bs], [B, bs], [B]
        pos = jnp.maximum(blk, 0)[:, None] * bs + jnp.arange(bs, dtype=jnp.int32)  # [B, bs]
        causal = (k_pos[None, None, :] <= pos[:, :, None]) & ok[:, :, None] & (rs[:, :, None] == seg[:, None, :])
        hi, lo = _row_digits(qb, k, causal[:, None], cfg, reduce_sum, reduce_max, padded=True)
        colsum = jnp.stack([hi.sum(axis=2, dtype=jnp.int32), lo.sum(axis=2, dtype=jnp.int32)])  # [2, B, Hq, Sk]
        slash = slash + _diagonal_sums(colsum[:, :, :, None], blk[:, None], k_pos, nb, bs)
        return (v_hi + colsum[0], v_lo + colsum[1], slash), None

    # zeros derived from the local positions: inside shard_map they vary over the mesh axes like
    # the carry the body returns (scan needs equal types)
    zero = (k_pos[0] * 0).astype(jnp.int32)
    zeros = jnp.zeros((B, H, k.digits.shape[1]), jnp.int32) + zero
    init = (zeros, zeros, jnp.zeros((2, B, H, nb), jnp.int32) + zero)
    (v_hi, v_lo, slash), _ = jax.lax.scan(block, init, (per_block(q_win), per_block(row_ok), per_block(row_seg),
                                                        jnp.moveaxis(blocks, 1, 0)))
    slash = reduce_sum(slash)
    return v_hi + (v_lo >> G), slash[0] + (slash[1] >> G)


def _select(vert, slash, cfg: SparsityConfig, seq_len: int, ids=None, total=None) -> VerticalSlashIndex:
    """Top-p selection of verticals (``vert [B, H, S]`` in natural order, or candidates with
    position ``ids`` and the total mass ``total``) and slashes (``slash [B, H, nb]``)."""
    H = vert.shape[1]
    nb = seq_len // cfg.block_size
    ph = lambda n: cfg.per_head(n, H)  # noqa: E731
    # every window row sums to one: the exact total of either (per-document windows: data-dependent
    # number of rows, so the floored total)
    mass = cfg.last_q * 2**cfg.score_bits if cfg.window == "sequence" else None
    v_idx, v_count = top_p_select(vert, ph("vertical_p"), ph("vertical_min"), ph("vertical_max"),
                                  cfg.max_verticals(seq_len), pad=seq_len, ids=ids, total=total, mass=mass)
    s_idx, s_count = top_p_select(slash, ph("slash_p"), ph("slash_min"), ph("slash_max"),
                                  cfg.max_slashes(seq_len), force=0, pad=nb, mass=mass)
    return VerticalSlashIndex(v_idx, v_count, s_idx, s_count)


def estimate_index(q, k, positions, cfg: SparsityConfig = SparsityConfig(), segment_ids=None) -> VerticalSlashIndex:
    """Single-device estimate.

    Args:
      q: ``[B, S, Hq, D]``, k: ``[B, S, Hkv, D]`` (GQA), both in the same (any) layout order.
      positions: ``int [S]`` global position of each row, a permutation of ``0..S-1`` (checked
        when concrete: ``ValueError`` naming a missing, repeated or out-of-range position).
      cfg: budgets (static).
      segment_ids: ``int [B, S]`` documents of the rows (packed documents), or ``None``.

    Returns:
      :class:`VerticalSlashIndex` with ``MV = cfg.max_verticals(S)``, ``MS = cfg.max_slashes(S)``.
    """
    _check_inputs(q, k, positions, cfg, 1)
    return _estimate_index(q, k, jnp.asarray(positions, jnp.int32), segment_ids, cfg=cfg)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _estimate_index(q, k, positions, segment_ids, *, cfg: SparsityConfig) -> VerticalSlashIndex:
    S = q.shape[1]
    ident = lambda x: x  # noqa: E731
    vert, slash = _local_scores(storage_round(q), storage_round(k), positions, S, cfg, ident, ident, segment_ids)
    vert_nat = jnp.zeros_like(vert).at[:, :, positions].set(vert)
    return _select(vert_nat, slash, cfg, S)


def _axis_size(axis_names) -> int:
    size = 1
    for a in axis_names:
        size *= jax.lax.axis_size(a)
    return int(size)


def estimate_index_shard(q, k, q_pos, cfg: SparsityConfig = SparsityConfig(),
                         axis_names: str | Sequence[str] = ("node", "local"), segment_ids=None) -> VerticalSlashIndex:
    """Distributed estimate, called INSIDE ``shard_map`` over ``axis_names``.

    Args:
      q: local ``[B, S/P, Hq, D]``, k: local ``[B, S/P, Hkv, D]`` of any layout.
      q_pos: ``int [S/P]`` global positions of the local rows (shared by q and k): distinct, in
        ``0..S-1`` (checked when concrete).
      segment_ids: local ``int [B, S/P]`` documents of the rows (packed documents), or ``None``.

    Communication: a ``psum`` of the ``last_q`` query rows, a ``pmax`` and integer ``psum`` s of
    ``[B, Hq, last_q]`` row statistics, of the ``[B, Hq, S/bs]`` slash scores and of the vertical
    totals, and an ``all_gather`` of each rank's ``MV`` best vertical candidates (every line of the
    global ``MV`` best is among its rank's ``MV`` best).

    Returns the same :class:`VerticalSlashIndex` on every rank, bit-identical to
    :func:`estimate_index` on the gathered sequence.
    """
    axis_names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
    P = _axis_size(axis_names)
    _check_inputs(q, k, q_pos, cfg, P, name="q_pos")
    q_pos = jnp.asarray(q_pos, jnp.int32)
    S = q.shape[1] * P
    psum = lambda x: jax.lax.psum(x, axis_names)  # noqa: E731
    pmax = lambda x: jax.lax.pmax(x, axis_names)  # noqa: E731
    vert, slash = _local_scores(storage_round(q), storage_round(k), q_pos, S, cfg, psum, pmax, segment_ids)
    order = jnp.argsort(q_pos)  # local keys in position order: top_k's ties fall to lower positions
    size = min(cfg.max_verticals(S), q.shape[1])
    vals, top = jax.lax.top_k(vert[..., order], size)  # [B, Hq, size]
    pos = q_pos[order][top]
    B, H = vert.shape[:2]
    gather = lambda x: jnp.moveaxis(jax.lax.all_gather(x, axis_names), 0, 2).reshape(B, H, P * size)  # noqa: E731
    vals, pos = gather(vals), gather(pos)
    by_pos = jnp.argsort(pos, axis=-1)
    vals, pos = jnp.take_along_axis(vals, by_pos, axis=-1), jnp.take_along_axis(pos, by_pos, axis=-1)
    total = psum(vert.sum(axis=-1, dtype=jnp.int32))
    return _select(vals, slash, cfg, S, ids=pos, total=total)
