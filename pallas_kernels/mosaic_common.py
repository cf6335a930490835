"""What every Pallas Mosaic GPU kernel of this package shares: the exp2 constants, the register
layouts of a 64-row tile's rows and columns, the SMEM -> register load with that layout (across JAX
versions), the shared-memory transforms of a 64-key tile (swizzle, transpose) and the kernels' names."""

from __future__ import annotations

import functools
import inspect
import math

import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
NEG_INF = float("-inf")


def row_layout():
    """Layout of a per-row vector of a ``[64, n]`` wgmma tile (name differs across JAX versions)."""
    return getattr(plgpu.Layout, "WGMMA_ROW", None) or plgpu.Layout.WGMMA.reduce(1)


def col_layout():
    """Layout of a per-column vector of a ``[64, n]`` wgmma tile."""
    return getattr(plgpu.Layout, "WGMMA_COL", None) or plgpu.Layout.WGMMA.reduce(0)


_LOAD_PARAMS = inspect.signature(plgpu.load).parameters
_LOAD_HAS_OPTIMIZED = "optimized" in _LOAD_PARAMS
# JAX 0.10 takes the index as a required argument; later versions deprecate passing it (index the ref instead)
_LOAD_IDX = () if "idx" in _LOAD_PARAMS and _LOAD_PARAMS["idx"].default is inspect.Parameter.empty else None


def load_smem(ref, layout, optimized: bool = True):
    """The whole of ``ref`` (shared memory) in registers with ``layout``."""
    args = (ref,) if _LOAD_IDX is None else (ref, _LOAD_IDX)
    if _LOAD_HAS_OPTIMIZED and not optimized:
        return plgpu.load(*args, layout=layout, optimized=False)
    return plgpu.load(*args, layout=layout)


def transposed(ref):
    """``ref`` (a 2-D shared-memory tile) viewed transposed, as a ``wgmma`` operand (``ref.transpose``: the
    same lowering as JAX 0.10's ``plgpu.transpose_ref``, which later versions deprecate)."""
    return ref.transpose((1, 0))


def tile_transforms(dtype):
    swizzle = 128
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))


def named(body, name: str):
    """``body`` (a kernel body, e.g. a ``functools.partial``) under ``name``: ``plgpu.kernel`` names the
    compiled kernel after its body (``anonymous`` for a partial), so a profile can tell the passes
    apart (``mosaic_fwd``, ``mosaic_dq``, ``mosaic_dkv_blocks``, ``mosaic_dkv_cols``; every name holds
    ``mosaic``, which ``benchmarks/trace_summary.py`` counts as a Pallas kernel)."""
    fn = functools.partial(body)
    fn.__name__ = name
    return fn
