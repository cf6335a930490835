"""Attention paths: dense reference, ring (flat / hierarchical), and the MTraining sparse ring."""

from mtraining_jax.attention.reference import dense_attention

__all__ = ["dense_attention"]
