"""The attention backends a model layer can use (the one list every config, CLI and dispatcher
validates against; what each does: :mod:`mtraining_jax.attention.dispatch`)."""

from __future__ import annotations

BACKENDS: tuple[str, ...] = ("reference", "cudnn", "ring", "mtraining", "msa")
SPARSE_BACKENDS: tuple[str, ...] = ("mtraining", "msa")  # dense counterpart: "ring"


def validate_backend(name, key: str = "attention backend") -> str:
    """``name`` if it is a backend, else ``ValueError`` naming ``key`` and the value."""
    if name not in BACKENDS:
        raise ValueError(f"{key} must be one of {BACKENDS}, got {name!r}")
    return name
