"""mtraining-jax: MTraining dynamic sparse attention and sparse ring attention in JAX + Pallas."""

from mtraining_jax.layouts import LAYOUTS, Layout
from mtraining_jax.mesh import make_mesh

__all__ = ["LAYOUTS", "Layout", "make_mesh"]
__version__ = "0.1.0"
