"""The three-pass flash backward both GPU backends run (Triton and Mosaic GPU): the dK/dV block
pass, the dK/dV column pass (its per-slot gradients scatter-added by :func:`add_column_grads`), then
the dQ pass. Each backend supplies its three kernels with the contracts of
:func:`pallas_kernels.triton_backward.dkv_block_pass`, :func:`~pallas_kernels.triton_backward.dkv_col_pass`
and :func:`~pallas_kernels.triton_backward.dq_pass`."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels.index_format import StepIndex


def three_pass_bwd(q, k, v, q_pos, k_pos, index: StepIndex, do, lse, delta, dq_acc=None, dkv_acc=None, *,
                   dq_kernel, dkv_kernels, kernel_options: dict, segs=None):
    """Returns f32 ``(dq, dk, dv)`` of one ring step, added to ``dq_acc`` (in place, in the dQ
    kernel) and ``dkv_acc = (dk, dv)`` when given. Order: dK/dV block pass, column pass (``dkv_acc``
    added in its scatter: in a ring it arrives from the neighbour, and the first kernel does not wait
    for it), then dQ, during which dK/dV travel on.

    ``dkv_kernels = (block pass, column pass)`` (splitting the pairs as the forward does),
    ``dq_kernel``: the backend's passes, each called with ``**kernel_options`` (at least ``sm_scale``
    and ``block_size``) and, for packed documents, ``segs = (q_seg, k_seg)``."""
    args = (q, k, v, q_pos, k_pos, index, do, lse, delta)
    block_pass, col_pass = dkv_kernels
    kw = dict(kernel_options) if segs is None else {**kernel_options, "segs": segs}
    dk, dv = block_pass(*args, **kw)
    if dkv_acc is not None:
        dk, dv = dk + dkv_acc[0], dv + dkv_acc[1]
    dk, dv = col_pass(*args, dk, dv, **kw)
    # the barrier makes "dK/dV before dQ" a data dependence XLA keeps
    dk, dv, q = lax.optimization_barrier((dk, dv, q))
    dq = dq_kernel(q, *args[1:], dq_acc, **kw)
    return dq, dk, dv


def add_column_grads(dk, dv, dkc, dvc, col_idx, col_count):
    """``dk[b, col_idx[b, h, m], h // g] += dkc[b, h, m]`` (and ``dv``) for every query head ``h``
    and list slot ``m`` some query block uses (``m < max_i col_count[b, h, i]``): XLA scatter-adds
    of the column pass's per-slot gradients into ``dk, dv f32 [B, Sk, Hkv, D]``.

    The scatters have unique indices (``unique_indices=True``), so XLA neither serialises them into
    a loop under ``--xla_gpu_deterministic_ops`` nor needs atomics: one scatter per member ``j`` of
    a GQA group (heads ``j, j + g, ...``: one per KV head, and a head's used columns are distinct by
    the :class:`StepIndex` contract); unused (padding) slots go to distinct out-of-range rows and
    are dropped. ``g`` scatters add into each row in a fixed order."""
    B, H, mcp = col_idx.shape
    sk, hkv = dk.shape[1], dk.shape[2]
    g = H // hkv
    used = jnp.arange(mcp, dtype=jnp.int32) < jnp.max(col_count, axis=-1, initial=0)[..., None]
    rows = jnp.where(used, col_idx, sk + jnp.arange(mcp, dtype=jnp.int32))  # out of range: dropped
    b_ix = jnp.arange(B)[:, None, None]
    hk_ix = jnp.arange(hkv)[None, :, None]
    for j in range(g):
        at = (b_ix, rows[:, j::g], hk_ix)
        dk = dk.at[at].add(dkc[:, j::g], mode="drop", unique_indices=True)
        dv = dv.at[at].add(dvc[:, j::g], mode="drop", unique_indices=True)
    return dk, dv
