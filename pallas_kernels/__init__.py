"""Vertical-slash block-sparse flash attention: Pallas (Triton) GPU kernels and their XLA twin."""

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
