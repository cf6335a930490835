"""Attention paths: the backends a layer dispatches to and the MTraining sparse ring (the dense ring
is :mod:`mtraining_jax.ring`)."""

from pallas_kernels.reference import dense_attention

__all__ = ["dense_attention"]
