"""``mosaic`` backend: Pallas Mosaic GPU kernels for Hopper (forward :mod:`pallas_kernels.mosaic_fwd`,
backward :func:`pallas_kernels.three_pass.three_pass_bwd` with :mod:`pallas_kernels.mosaic_dq` and
:mod:`pallas_kernels.mosaic_dkv`).

Supports: compute capability 9.x (wgmma, TMA); bf16 / f16; head_dim 64 or 128; block size 64;
``Sq`` a multiple of 128; packed documents. When ``Sk`` is not a multiple of 128 the two dK/dV
passes are Triton's.

No CPU run (JAX 0.10.2): ``plgpu.kernel(..., interpret=True)`` takes Pallas's generic HLO
interpreter, which rejects these kernels' warpgroup ``run_scoped`` ("does not support collective
axes"); Mosaic GPU's own interpreter (``interpret=InterpretGPUParams()``, private in
``jax._src.pallas.mosaic_gpu.interpret``) runs simple ``wgmma`` kernels but not ``pl.run_state``,
``plgpu.load`` or a transposed shared-memory ``wgmma`` operand, which these kernels use. So they
run on the GPU only (``tests/test_kernels_gpu.py``, ``-m gpu``); on CPU ``tests/test_mosaic_kernels.py``
checks their tile walks and their lowering for CUDA, ``tests/test_mosaic_streams.py`` the stream each
pass takes.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

NAME = "mosaic"
NEEDS_INDEX = True
HEAD_DIMS = (64, 128)
DTYPES = ("bfloat16", "float16")


def supports(problem) -> None:
    cc = problem.compute_capability
    if problem.platform != "gpu" or cc is None or not str(cc).startswith("9"):
        raise NotImplementedError(f"needs a Hopper GPU (compute capability 9.x), got platform "
                                  f"{problem.platform!r} capability {cc!r}")
    if problem.dtype not in DTYPES:
        raise NotImplementedError(f"dtype {problem.dtype} (supported: {DTYPES})")
    if problem.head_dim not in HEAD_DIMS:
        raise NotImplementedError(f"head_dim {problem.head_dim} (supported: {HEAD_DIMS})")
    if problem.block_size != 64:
        raise NotImplementedError(f"block_size {problem.block_size} (supported: 64)")
    if problem.sq % 128:
        raise NotImplementedError(f"query length {problem.sq} is not a multiple of 128")


def _stream_options(stream: str) -> dict:
    """The forward / dQ kernel options of a ``stream`` choice: ``"split"`` as ``"index"`` and
    ``"auto"`` run it (128-key steps, one loop per segment: what kernels.md run 13 measured fastest
    on it); ``"auto"`` is resolved per pass by the kernels (:func:`pallas_kernels.mosaic_stream.resolve_stream`)."""
    if stream != "split":
        return {"stream": stream}
    from pallas_kernels.mosaic_stream import SPLIT_WALK  # imports Mosaic GPU only when used

    return {"stream": "split", "kv_step": 128, "walk": SPLIT_WALK}


def fwd(q, k, v, q_pos, k_pos, index, acc, *, sm_scale, block_size, segs=None, stream="auto",
        uniform_index=False, out_dtype=jnp.float32):
    """``uniform_index``: every (batch, head) row of ``index`` is the same (the API's full index for
    ``index=None``): the forward / dQ operands and the dK/dV schedule are built once and broadcast."""
    from pallas_kernels.mosaic_fwd import mosaic_fwd  # imports Mosaic GPU only when used

    return mosaic_fwd(q, k, v, q_pos, k_pos, index, acc, sm_scale=sm_scale, block_size=block_size, segs=segs,
                      uniform=uniform_index, out_dtype=jnp.dtype(out_dtype), **_stream_options(stream))


def bwd(q, k, v, q_pos, k_pos, index, do, lse, delta, dq_acc, dkv_acc, *, sm_scale, block_size, segs=None,
        stream="auto", dq_dtype=jnp.float32, uniform_index=False):
    from pallas_kernels import triton_backward
    from pallas_kernels.mosaic_dkv import mosaic_dkv_blocks, mosaic_dkv_cols
    from pallas_kernels.mosaic_dq import mosaic_dq
    from pallas_kernels.three_pass import three_pass_bwd

    opts = dict(sm_scale=sm_scale, block_size=block_size)
    if k.shape[1] % 128 == 0:
        # the dK/dV block pass on its own lists (stream "split"): its shared stream is exact but slower on
        # every index measured (results/kernels/kernels.md run 34), so `stream` does not reach it
        dkv = (functools.partial(mosaic_dkv_blocks, uniform=uniform_index), mosaic_dkv_cols)
    else:  # the Triton dK/dV passes (their own tuning defaults)
        dkv = (triton_backward.dkv_block_pass, triton_backward.dkv_col_pass)
    dq = functools.partial(mosaic_dq, out_dtype=jnp.dtype(dq_dtype), uniform=uniform_index,
                           **_stream_options(stream))
    return three_pass_bwd(q, k, v, q_pos, k_pos, index, do, lse, delta, dq_acc, dkv_acc, dq_kernel=dq,
                          dkv_kernels=dkv, kernel_options=opts, segs=segs)
