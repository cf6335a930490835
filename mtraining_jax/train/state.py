"""Model construction and the training-state pytree.

The NNX model is split once into a static ``graphdef``, its parameters (as a plain nested dict
of arrays — what optax and orbax handle best) and any non-parameter state. Inside ``jit`` the
module is rebuilt from them with :func:`bind`. The training state is the dict
``{"step": int32[], "params": {...}, "opt_state": optax state, "rng": uint32 key data}``,
replicated over the mesh (MTraining keeps full weights on every CP worker; the gradients are
averaged by the sharded loss's transpose).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mtraining_jax.train.config import ModelSection


def import_object(spec: str):
    """``"package.module:Name"`` -> the object."""
    mod, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot import model.cls {spec!r}: {e}") from None


def _resolve_path(path: str, config_dir: str | None) -> str:
    cands = [path]
    if config_dir and not os.path.isabs(path):
        cands += [os.path.join(config_dir, path), os.path.join(os.path.dirname(config_dir), path)]
    for c in cands:
        if os.path.isfile(c):
            return c
    raise ValueError(f"model.path {path!r} not found (looked in {cands})")


def build_model_config(section: ModelSection, config_dir: str | None = None):
    """``(model_class, model_config)`` for the ``model`` section of a training config."""
    cls = import_object(section.cls)
    cfg_cls = getattr(cls, "config_class", None)
    if cfg_cls is None:
        from mtraining_jax.model.config import ModelConfig as cfg_cls
    fields = dict(section.fields)
    try:
        if section.path is not None:
            cfg = cfg_cls.from_yaml(_resolve_path(section.path, config_dir), **fields)
        elif hasattr(cfg_cls, "from_dict"):
            cfg = cfg_cls.from_dict(fields)
        else:
            cfg = cfg_cls(**fields)
    except TypeError as e:  # dataclass constructor: unknown / missing field
        raise ValueError(f"bad model config: {e}") from None
    return cls, cfg


def replicated(mesh: Mesh | None):
    return None if mesh is None else NamedSharding(mesh, P())


@dataclasses.dataclass(frozen=True)
class ModelParts:
    """Static pieces to rebuild the module inside ``jit``."""

    graphdef: Any
    param_template: Any  # nnx.State of ShapeDtypeStructs (structure only)
    rest: Any  # non-parameter nnx.State (usually empty)


def split_model(model_cls, model_cfg, seed: int):
    """Abstract split: ``(ModelParts, init_fn)``; ``init_fn()`` returns the parameter dict."""
    abstract = nnx.eval_shape(lambda: model_cls(model_cfg, rngs=nnx.Rngs(seed)))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)

    def init_fn():
        m = model_cls(model_cfg, rngs=nnx.Rngs(seed))
        _, p, _ = nnx.split(m, nnx.Param, ...)
        return nnx.to_pure_dict(p) if hasattr(nnx, "to_pure_dict") else p.to_pure_dict()

    return ModelParts(graphdef, params, rest), init_fn


def bind(parts: ModelParts, params: dict):
    """Rebuild the NNX module from a parameter dict (usable inside ``jit`` / ``grad``)."""
    state = jax.tree.map(lambda x: x, parts.param_template)  # fresh copy of the template
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(parts.graphdef, state, parts.rest)


def train_state_fn(init_fn, optimizer, mesh: Mesh | None, seed: int):
    """A jitted ``() -> {"step", "params", "opt_state", "rng"}`` building the state directly into
    replicated arrays (every process computes the same values). ``jax.eval_shape`` of it gives
    the restore target without allocating anything."""

    def make():
        params = init_fn()
        return {
            "step": jnp.zeros((), jnp.int32),
            "params": params,
            "opt_state": optimizer.init(params),
            "rng": jax.random.key_data(jax.random.PRNGKey(seed + 1)),
        }

    return jax.jit(make, out_shardings=replicated(mesh))


def abstract_train_state(state_fn, mesh: Mesh | None):
    """``ShapeDtypeStruct`` pytree (replicated shardings) of ``state_fn()``."""
    sh = replicated(mesh)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), jax.eval_shape(state_fn))


def init_train_state(init_fn, optimizer, mesh: Mesh | None, seed: int):
    """Initialised training state (see :func:`train_state_fn`)."""
    return train_state_fn(init_fn, optimizer, mesh, seed)()


def num_params(params) -> int:
    return int(sum(x.size for x in jax.tree.leaves(params)))
