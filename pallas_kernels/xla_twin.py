"""XLA twin of the block-sparse flash-attention kernels: the same math in plain ``jax.numpy``
(CPU training, tests).

For every query block the keys it may see are its ``MB`` active KV blocks followed by the ``MC``
gathered columns of the head's list; the twin gathers those ``L = MB * bs + MC`` rows of K/V and
takes an exact softmax over them, masked by count, by position (``k_pos <= q_pos``), by the column
rules of :mod:`pallas_kernels.index_format` and, for packed documents, by segment. A ``lax.scan``
over the query blocks keeps live memory ``O(B * Hq * bs * L)``, never ``[Sq, Sk]``.

Shapes as :mod:`pallas_kernels.api`. Forward: ``out f32``, natural-log ``lse f32`` (out 0, lse
-inf for an empty row). Backward: FlashAttention-2 (Dao 2023, Alg. 2) from the final ``lse`` and
``delta``; dK/dV of a KV head summed over its group.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.index_format import StepIndex, row_columns


def _compute_dtype(dtype):
    return jnp.promote_types(dtype, jnp.float32)


def _per_block_index(index: StepIndex, sk: int, bs: int):
    """Token ids ``int32 [nQB, B, H, L]`` and validity ``bool`` of the rows each query block reads:
    its ``MB`` active blocks, then the ``MC`` slots of the shared column list (valid in the row's
    prefix and outside its active blocks, :func:`~pallas_kernels.index_format.row_columns`)."""
    B, H, nqb, mb = index.block_idx.shape
    bvalid = jnp.arange(mb)[None, None, None, :] < index.block_count[..., None]
    bidx = jnp.clip(jnp.where(bvalid, index.block_idx, 0), 0, sk // bs - 1)
    tok = (bidx[..., None] * bs + jnp.arange(bs)).reshape(B, H, nqb, mb * bs)
    tvalid = jnp.repeat(bvalid, bs, axis=-1)
    cidx, cvalid = row_columns(index, sk, bs)
    ids = jnp.concatenate([tok, cidx], axis=-1).astype(jnp.int32)
    valid = jnp.concatenate([tvalid, cvalid], axis=-1)
    return jnp.moveaxis(ids, 2, 0), jnp.moveaxis(valid, 2, 0)


def _dense_per_block_index(B, H, sq, sk, q_pos, k_pos, bs):
    """``index=None``: every KV block whose min position is <= the query block's max position."""
    from pallas_kernels.index_format import full_step_index

    return full_step_index(B, H, sq, sk, q_pos, k_pos, bs)


def _setup(q, k, q_pos, k_pos, index, sm_scale, bs):
    """Shapes, compute dtype, scale and the per-query-block row ids shared by forward and backward."""
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    if index is None:
        index = _dense_per_block_index(B, H, Sq, Sk, q_pos, k_pos, bs)
    ids, valid = _per_block_index(index, Sk, bs)
    scale = D**-0.5 if sm_scale is None else sm_scale
    return B, Sq, H, D, H // Hkv, Sq // bs, _compute_dtype(q.dtype), scale, ids, valid


def _gather_rows(x, ids, g):
    """``x [B, Sk, Hkv, D]``, ``ids [B, H, L]`` -> ``[B, H, L, D]`` rows of KV head ``h // g``."""
    B, _, Hkv, _ = x.shape
    H = ids.shape[1]
    b = jnp.arange(B)[:, None, None]
    hk = (jnp.arange(H) // g)[None, :, None]
    return x[b, ids, hk]


def _block_scores(qb, kb, ok, scale, dt):
    s = jnp.einsum("bqhd,bhld->bhql", qb.astype(dt), kb.astype(dt), precision="highest") * scale
    return jnp.where(ok, s, -jnp.inf)


def _mask(ids, valid, qpb, k_pos, qsb=None, k_seg=None):
    """``bool [B, H, bs, L]``: row valid and key position <= query position (and, given the query
    block's segments ``qsb [B, bs]`` and ``k_seg [B, Sk]``, key segment == query segment)."""
    ok = valid[:, :, None, :] & (k_pos[ids][:, :, None, :] <= qpb[None, None, :, None])
    if qsb is None:
        return ok
    ks = jnp.take_along_axis(k_seg[:, None, :], ids.reshape(ids.shape[0], -1)[:, None, :], axis=-1)
    return ok & (ks.reshape(ids.shape)[:, :, None, :] == qsb[:, None, :, None])


def _seg_blocks(segs, B, nqb, bs):
    """``(q_seg blocks [nQB, B, bs] or None, k_seg or None)``."""
    if segs is None:
        return None, None
    return jnp.moveaxis(segs[0].reshape(B, nqb, bs), 1, 0), segs[1]


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_size"))
def xla_fwd(q, k, v, q_pos, k_pos, index: StepIndex | None, *, sm_scale, block_size: int, segs=None):
    """Forward of one (query chunk, KV chunk) pair; see module docstring."""
    bs = block_size
    B, Sq, H, D, g, nqb, dt, scale, ids, valid = _setup(q, k, q_pos, k_pos, index, sm_scale, bs)
    qblocks = jnp.moveaxis(q.reshape(B, nqb, bs, H, D), 1, 0)
    qpos_b = q_pos.reshape(nqb, bs)
    qseg_b, k_seg = _seg_blocks(segs, B, nqb, bs)

    def one_block(_, xs):
        qb, qpb, idb, vb, qsb = xs
        ok = _mask(idb, vb, qpb, k_pos, qsb, k_seg)
        s = _block_scores(qb, _gather_rows(k, idb, g), ok, scale, dt)
        m = jnp.max(s, axis=-1, keepdims=True)
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        p = jnp.exp(s - m)
        l = p.sum(-1, keepdims=True)
        o = jnp.einsum("bhql,bhld->bqhd", p, _gather_rows(v, idb, g).astype(dt), precision="highest")
        o = o / jnp.where(l == 0, 1.0, l).transpose(0, 2, 1, 3)
        lse = jnp.where(l[..., 0] == 0, -jnp.inf, m[..., 0] + jnp.log(jnp.where(l[..., 0] == 0, 1.0, l[..., 0])))
        return None, (o.astype(jnp.float32), lse.astype(jnp.float32))

    _, (o, lse) = jax.lax.scan(one_block, None, (qblocks, qpos_b, ids, valid, qseg_b))
    out = jnp.moveaxis(o, 0, 1).reshape(B, Sq, H, D)
    lse = jnp.moveaxis(lse, 0, 2).reshape(B, H, Sq)
    return out, lse


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_size"))
def xla_bwd(q, k, v, q_pos, k_pos, index: StepIndex | None, do, lse, delta, *, sm_scale, block_size: int,
            segs=None):
    """Backward of one pair given the final ``lse``/``delta``: f32 ``(dq, dk, dv)``."""
    bs = block_size
    B, Sq, H, D, g, nqb, dt, scale, ids, valid = _setup(q, k, q_pos, k_pos, index, sm_scale, bs)
    qseg_b, k_seg = _seg_blocks(segs, B, nqb, bs)
    blk = lambda x: jnp.moveaxis(x.reshape(B, nqb, bs, H, D), 1, 0)  # noqa: E731
    row = lambda x: jnp.moveaxis(x.reshape(B, H, nqb, bs), 2, 0)  # noqa: E731
    safe_lse = jnp.where(jnp.isfinite(lse), lse, 0.0).astype(dt)
    b_ix = jnp.arange(B)[:, None, None]
    hk_ix = (jnp.arange(H) // g)[None, :, None]

    def one_block(carry, xs):
        dk, dv = carry
        qb, dob, qpb, lb, db, idb, vb, qsb = xs
        ok = _mask(idb, vb, qpb, k_pos, qsb, k_seg)
        kb = _gather_rows(k, idb, g).astype(dt)
        vvb = _gather_rows(v, idb, g).astype(dt)
        s = _block_scores(qb, kb, ok, scale, dt)
        p = jnp.exp(s - lb[..., None])  # exact 0 where masked
        dob = dob.astype(dt)
        dv_rows = jnp.einsum("bhql,bqhd->bhld", p, dob, precision="highest")
        dp = jnp.einsum("bqhd,bhld->bhql", dob, vvb, precision="highest")
        ds = p * (dp - db[..., None]) * scale
        dqb = jnp.einsum("bhql,bhld->bqhd", ds, kb, precision="highest")
        dk_rows = jnp.einsum("bhql,bqhd->bhld", ds, qb.astype(dt), precision="highest")
        dk = dk.at[b_ix, idb, hk_ix].add(dk_rows)
        dv = dv.at[b_ix, idb, hk_ix].add(dv_rows)
        return (dk, dv), dqb.astype(jnp.float32)

    zeros = jnp.zeros(k.shape[:3] + (D,), dt)
    (dk, dv), dq = jax.lax.scan(
        one_block, (zeros, zeros),
        (blk(q), blk(do), q_pos.reshape(nqb, bs), row(safe_lse), row(delta.astype(dt)), ids, valid, qseg_b))
    dq = jnp.moveaxis(dq, 0, 1).reshape(B, Sq, H, D)
    return dq, dk.astype(jnp.float32), dv.astype(jnp.float32)
