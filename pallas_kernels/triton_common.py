"""What the Pallas Triton kernels of this package share (forward and the three backward passes):
the exp2 constants, the walk over a row's active KV blocks, the column rows of a chunk, the causal /
segment test of a (query, key) pair, the query-side block specs and the packed-documents operands,
and the static argument names of the jitted entry points."""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

LOG2E = math.log2(math.e)


LN2 = math.log(2.0)


def pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def for_blocks(block_at, lo, hi, bs: int, body, carry):
    """``carry = body(rows, carry)`` over the blocks ``block_at(j)`` (a block id read from the
    index) for ``j`` in ``[lo, hi)``, one tile of ``bs`` contiguous rows each."""

    def step(j, c):
        return body(pl.ds(pl.multiple_of(block_at(j) * bs, bs), bs), c)

    return lax.fori_loop(lo, hi, step, carry)


def col_rows(cidx_ref, c, ncols, cc):
    """Gathered row ids of the ``c``-th chunk of ``cc`` vertical columns and their validity."""
    off = pl.multiple_of(c * cc, cc)
    return cidx_ref[pl.ds(off, cc)], (off + jnp.arange(cc, dtype=jnp.int32)) < ncols


def outside_blocks(ids, blocks, n_blk, bs: int):
    """``bool [cc]``: the column ``ids`` whose block is NOT among the row's active ``blocks[:n_blk]``
    (a column inside an active block is that block's key: the column phase must skip it)."""
    live = jnp.arange(blocks.shape[0], dtype=jnp.int32) < n_blk
    hit = ((ids // bs)[:, None] == blocks[None, :]) & live[None, :]
    return jnp.max(hit.astype(jnp.int32), axis=1) == 0


def pair_ok(kpos_ref, rows, qp, seg=None):
    """``bool [bq, n]``: the pairs of the query rows (positions ``qp [bq]``) and the key ``rows``
    that are causal by global position and, given ``seg = (kseg_ref, q_seg [bq])`` (packed
    documents), in the same document."""
    ok = kpos_ref[rows][None, :] <= qp[:, None]
    if seg is not None:
        kseg_ref, qs = seg
        ok = ok & (kseg_ref[rows][None, :] == qs[:, None])
    return ok


def split_seg_refs(refs, segs: bool):
    """``(seg refs (q_seg, k_seg) or None, the other refs)`` of a kernel whose operands after the
    fixed ones start with the two segment-id refs when ``segs``."""
    return (refs[:2], refs[2:]) if segs else (None, refs)


def query_specs(H, g, sq, sk, d, bs, mbp, mcp):
    """BlockSpecs of the query-stationary passes, grid ``(nQB, H, B)``: program ``i`` takes query
    block ``nQB - 1 - i`` (heaviest causal rows first, so the last wave is the light rows)."""
    nqb = sq // bs
    r = lambda i: nqb - 1 - i  # noqa: E731
    return dict(
        qpos=pl.BlockSpec((bs,), lambda i, h, b: (r(i),)),
        kpos=pl.BlockSpec((sk,), lambda i, h, b: (0,)),
        bidx=pl.BlockSpec((None, None, None, mbp), lambda i, h, b: (b, h, r(i), 0)),
        cnt=pl.BlockSpec((None, None, None, 4), lambda i, h, b: (b, h, r(i), 0)),
        cidx=pl.BlockSpec((None, None, mcp), lambda i, h, b: (b, h, 0)),
        q=pl.BlockSpec((None, bs, None, d), lambda i, h, b: (b, r(i), h, 0)),
        kv=pl.BlockSpec((None, sk, None, d), lambda i, h, b: (b, 0, h // g, 0)),
        row=pl.BlockSpec((None, None, bs), lambda i, h, b: (b, h, r(i))),
        qseg=pl.BlockSpec((None, bs), lambda i, h, b: (b, r(i))),
        kseg=pl.BlockSpec((None, sk), lambda i, h, b: (b, 0)),
    )


def add_seg_operands(args, in_specs, segs, specs):
    """Append the segment ids ``segs = (q_seg, k_seg)`` (or nothing for ``None``) to a kernel's
    operands with the ``qseg`` / ``kseg`` BlockSpecs of ``specs``."""
    if segs is not None:
        args += [segs[0].astype(jnp.int32), segs[1].astype(jnp.int32)]
        in_specs += [specs["qseg"], specs["kseg"]]


STATIC = ("sm_scale", "block_size", "col_chunk", "num_warps", "num_stages", "interpret")
