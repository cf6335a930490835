"""``triton`` backend: Pallas Triton kernels (:mod:`pallas_kernels.triton_kernels`,
:mod:`pallas_kernels.triton_backward`). Any CUDA GPU; elsewhere they run in interpret mode (slow:
tests only). Supports head_dim 32/64/128/256, block sizes 16/32/64/128, any float dtype and packed
documents (segment ids: the token-level check only on tiles that straddle a boundary)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import triton_backward, triton_kernels

NAME = "triton"
NEEDS_INDEX = True


def supports(problem) -> None:
    if problem.platform not in ("gpu", "cpu"):
        raise NotImplementedError(f"Pallas Triton runs on CUDA GPUs (or interpreted on CPU), not {problem.platform}")


def _interpret() -> bool:
    return jax.default_backend() != "gpu"


def fwd(q, k, v, q_pos, k_pos, index, acc, *, sm_scale, block_size, segs=None, stream="auto",
        uniform_index=False, out_dtype=jnp.float32):  # noqa: ARG001
    # ``stream`` is the Mosaic kernels' choice (registry.STREAMS); this backend has one schedule;
    # ``uniform_index`` (every row of the index alike) is a hint this backend does not use
    return triton_kernels.pallas_fwd(q, k, v, q_pos, k_pos, index, acc, sm_scale=sm_scale, block_size=block_size,
                                     interpret=_interpret(), segs=segs, out_dtype=jnp.dtype(out_dtype))


def bwd(q, k, v, q_pos, k_pos, index, do, lse, delta, dq_acc, dkv_acc, *, sm_scale, block_size, segs=None,
        stream="auto", dq_dtype=jnp.float32, uniform_index=False):  # noqa: ARG001  (stream, uniform_index: Mosaic's)
    dq, dk, dv = triton_backward.pallas_bwd(q, k, v, q_pos, k_pos, index, do, lse, delta, dq_acc, dkv_acc,
                                            sm_scale=sm_scale, block_size=block_size, interpret=_interpret(), segs=segs)
    return dq.astype(dq_dtype), dk, dv
