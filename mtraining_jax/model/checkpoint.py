"""Our model checkpoint format: ``<dir>/model.yaml`` (the :class:`ModelConfig`) and
``<dir>/params/`` (an Orbax ``StandardCheckpointer`` directory holding the nested parameter dict
``nnx.to_pure_dict(nnx.state(model, nnx.Param))``, layers stacked on a leading axis).

Orbax (not ``.npz``) because it stores bfloat16 natively, writes and restores sharded arrays
without gathering them on one host, and is what the training checkpoints use, so a converted
Hugging Face model can seed a training run directly (restore with a sharded abstract target).
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
import jax.numpy as jnp

from mtraining_jax.model.config import ModelConfig
from mtraining_jax.model.hf_io import model_from_params, model_params
from mtraining_jax.model.qwen2 import Qwen2ForCausalLM, abstract_model

CONFIG_NAME = "model.yaml"
PARAMS_NAME = "params"


def save_model_checkpoint(model: Qwen2ForCausalLM, path: str | os.PathLike, *, force: bool = False) -> Path:
    """Write ``model`` to ``path`` (created; an existing checkpoint there needs ``force``)."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    path.mkdir(parents=True, exist_ok=True)
    model.config.to_yaml(path / CONFIG_NAME)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(path / PARAMS_NAME, model_params(model), force=force)
    ckptr.wait_until_finished()
    return path


def load_model_checkpoint(path: str | os.PathLike, **overrides) -> tuple[ModelConfig, Qwen2ForCausalLM]:
    """Read a checkpoint written by :func:`save_model_checkpoint`; ``overrides`` set execution
    fields of the config (backend, remat, dtypes; a new ``param_dtype`` converts the weights)."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    cfg_file, params_dir = path / CONFIG_NAME, path / PARAMS_NAME
    for f in (cfg_file, params_dir):
        if not f.exists():
            raise FileNotFoundError(f"model checkpoint file not found: {f}")
    stored = ModelConfig.from_yaml(cfg_file)
    cfg = stored.replace(**overrides) if overrides else stored
    target = model_params(abstract_model(stored))
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), target)
    params = ocp.StandardCheckpointer().restore(params_dir, target)
    params = jax.tree.map(lambda a: jnp.asarray(a, cfg.param_dtype), params)
    return cfg, model_from_params(cfg, params)
