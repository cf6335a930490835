"""Small shims over JAX-version differences in the Pallas Triton API (JAX 0.10.x vs 0.11.x)."""

from __future__ import annotations

from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# ``pl.dot`` moved to ``plgpu.dot`` (Triton-only, supports trans_a / trans_b) in newer JAX.
dot = getattr(plgpu, "dot", None) or pl.dot


def triton_compiler_params(num_warps: int | None = None, num_stages: int | None = None):
    """``plgpu.CompilerParams`` (newer JAX) or ``plgpu.TritonCompilerParams`` (older JAX)."""
    cls = getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams")
    return cls(num_warps=num_warps, num_stages=num_stages)


def atomic_add(ref, idx, val):
    """``plgpu.atomic_add`` (Triton ``tt.atomic_rmw fadd``); idx as for a ref load."""
    return plgpu.atomic_add(ref, idx, val)
