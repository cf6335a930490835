"""Vertical-slash block-sparse flash attention: Pallas Mosaic GPU (Hopper) and Triton kernels, their XLA
twin, the dense float32 reference, and the per-step index format they share (:mod:`pallas_kernels.api`
chooses the backend through :mod:`pallas_kernels.registry`)."""

from pallas_kernels.api import (
    attention_delta,
    block_sparse_attention,
    block_sparse_attention_bwd,
    block_sparse_attention_fwd,
)
from pallas_kernels.index_format import StepIndex, causal_flags, full_step_index, step_index_to_mask

__all__ = [
    "StepIndex", "attention_delta", "block_sparse_attention", "block_sparse_attention_bwd",
    "block_sparse_attention_fwd", "causal_flags", "full_step_index", "step_index_to_mask",
]
