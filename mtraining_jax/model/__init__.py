"""Qwen2.5-style Flax NNX model, RoPE/YaRN, Hugging Face checkpoint import/export."""

from mtraining_jax.model.config import ModelConfig
from mtraining_jax.model.qwen2 import Qwen2ForCausalLM

__all__ = ["ModelConfig", "Qwen2ForCausalLM"]
