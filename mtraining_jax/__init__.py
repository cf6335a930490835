"""mtraining-jax: MTraining dynamic sparse attention and sparse ring attention in JAX + Pallas.

The package's top-level names load lazily (PEP 562), so ``import mtraining_jax.train.signals`` (the
console scripts' first step: SIGTERM / SIGINT handlers) does not wait for JAX to import."""

import importlib

__all__ = ["LAYOUTS", "Layout", "make_mesh"]
__version__ = "0.1.0"

_LAZY = {"LAYOUTS": "mtraining_jax.layouts", "Layout": "mtraining_jax.layouts", "make_mesh": "mtraining_jax.mesh"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mtraining_jax' has no attribute {name!r}")
