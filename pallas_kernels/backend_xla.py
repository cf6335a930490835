"""``xla`` backend: the plain ``jax.numpy`` twin (:mod:`pallas_kernels.xla_twin`); any platform, any
dtype, head_dim and block size the API accepts; merges ``acc`` with :func:`merge_partials`."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import xla_twin
from pallas_kernels.merge import merge_partials

NAME = "xla"
NEEDS_INDEX = False  # handles index=None (dense causal) itself


def supports(problem) -> None:
    del problem  # runs everything the API validates


def fwd(q, k, v, q_pos, k_pos, index, acc, *, sm_scale, block_size, segs=None, stream="auto",
        uniform_index=False, out_dtype=jnp.float32):  # noqa: ARG001
    # ``stream`` is the Mosaic kernels' choice (registry.STREAMS); this backend has one schedule;
    # ``uniform_index`` (every row of the index alike) is a hint this backend does not use
    out, lse = xla_twin.xla_fwd(q, k, v, q_pos, k_pos, index, sm_scale=sm_scale, block_size=block_size, segs=segs)
    out, lse = (out, lse) if acc is None else merge_partials(acc[0], acc[1], out, lse)
    return out.astype(out_dtype), lse


def bwd(q, k, v, q_pos, k_pos, index, do, lse, delta, dq_acc, dkv_acc, *, sm_scale, block_size, segs=None,
        stream="auto", dq_dtype=jnp.float32, uniform_index=False):  # noqa: ARG001  (stream, uniform_index: Mosaic's)
    dq, dk, dv = xla_twin.xla_bwd(q, k, v, q_pos, k_pos, index, do, lse, delta, sm_scale=sm_scale,
                                  block_size=block_size, segs=segs)
    dq = (dq if dq_acc is None else dq_acc + dq).astype(dq_dtype)
    if dkv_acc is not None:
        dk, dv = dkv_acc[0] + dk, dkv_acc[1] + dv
    return dq, dk, dv
