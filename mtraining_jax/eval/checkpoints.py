"""Find and load a model to evaluate: a training run, one of its checkpoints, a converter output
directory, or a Hugging Face Qwen2 directory.

Accepted ``path`` forms (checked in this order):

* ``<dir>/model.yaml`` + ``<dir>/params/`` — :mod:`mtraining_jax.model.checkpoint` (``mtraining-convert``);
* ``<dir>/config.json`` — a Hugging Face Qwen2 checkpoint (:mod:`mtraining_jax.model.hf_io`);
* ``<run_dir>`` with ``config.yaml`` + ``checkpoints/<step>/`` — the newest step;
* ``<run_dir>/checkpoints/<step>`` — that step (the run's ``config.yaml`` two levels up).

A training run's model config is rebuilt from its ``config.yaml`` (``model.path`` resolved against
the run dir, the working directory, ``./configs`` and the repository's ``configs/``). Every failure
is a :class:`CheckpointError` (a ``ValueError``) with one line naming the path and what is missing.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import numpy as np

from mtraining_jax.model.config import ModelConfig

_REPO_CONFIGS = Path(__file__).resolve().parents[2] / "configs"


class CheckpointError(ValueError):
    """A missing or incompatible checkpoint (one-line message naming the path)."""


@dataclasses.dataclass
class LoadedModel:
    """A model ready to evaluate.

    ``config``: the :class:`ModelConfig` (with any execution overrides applied); ``params``: the
    nested parameter dict (``nnx.to_pure_dict`` layout, layers stacked); ``tokenizer``: the run's
    tokenizer spec (``"byte"`` or a ``tokenizers`` JSON path); ``train_seq_len``: sequence length the
    run trained at (``None`` when unknown); ``source``: a description (``"run runs/x step 120"``).
    """

    config: ModelConfig
    params: Any
    tokenizer: str
    train_seq_len: int | None
    source: str
    train_config: Any = None


def _model_config_from_run(train_cfg, run_dir: Path):
    from mtraining_jax.train.state import build_model_config

    errors = []
    for cdir in (str(run_dir), os.getcwd(), os.path.join(os.getcwd(), "configs"), str(_REPO_CONFIGS)):
        try:
            return build_model_config(train_cfg.model, os.path.join(cdir, "_"))[1]
        except ValueError as e:
            errors.append(str(e))
    raise CheckpointError(f"cannot rebuild the model config of run {run_dir}: {errors[-1]}")


def _find_run(path: Path):
    """``(run_dir, step_dir or None)`` when ``path`` is a run dir or one of its step dirs."""
    if (path / "config.yaml").is_file() and (path / "checkpoints").is_dir():
        return path, None
    if path.parent.name == "checkpoints" and (path.parent.parent / "config.yaml").is_file():
        return path.parent.parent, path
    return None, None


def _load_run(run_dir: Path, step_dir: Path | None, overrides: dict) -> LoadedModel:
    from mtraining_jax.train.checkpoint import Checkpointer
    from mtraining_jax.train.config import load_config

    try:
        tcfg = load_config(str(run_dir / "config.yaml"))
    except ValueError as e:
        raise CheckpointError(f"{run_dir / 'config.yaml'}: {e}") from None
    cfg = _model_config_from_run(tcfg, run_dir)
    ckpt_dir = run_dir / "checkpoints" if step_dir is None else step_dir.parent
    ck = Checkpointer(str(ckpt_dir), keep=1000, async_save=False)
    try:
        steps = ck.all_steps()
        if step_dir is None:
            if not steps:
                raise CheckpointError(f"run {run_dir} has no finished checkpoint under {ckpt_dir}")
            step = steps[-1]
        else:
            try:
                step = int(step_dir.name)
            except ValueError:
                raise CheckpointError(f"{step_dir} is not a checkpoint step folder (expected checkpoints/<step>)") from None
            if step not in steps:
                raise CheckpointError(f"checkpoint step {step} of {run_dir} is missing or unfinished "
                                      f"(finished steps: {steps})")
        state, _, _ = ck.restore(step)
    finally:
        ck.close()
    params = state["params"]
    _check_params(cfg, params, f"run {run_dir} step {step}")
    if overrides:
        cfg = cfg.replace(**overrides)
    return LoadedModel(cfg, params, tcfg.data.tokenizer, tcfg.data.seq_len, f"run {run_dir} step {step}", tcfg)


def _check_params(cfg: ModelConfig, params, where: str) -> None:
    """Every parameter shape must match ``cfg`` (``CheckpointError`` listing the differences)."""
    import jax

    from mtraining_jax.model.hf_io import model_params
    from mtraining_jax.model.qwen2 import abstract_model

    want = jax.tree_util.tree_flatten_with_path(model_params(abstract_model(cfg)))[0]
    got = {jax.tree_util.keystr(k): tuple(getattr(v, "shape", np.shape(v)))
           for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    bad = []
    for k, v in want:
        ks = jax.tree_util.keystr(k)
        if ks not in got:
            bad.append(f"{ks} missing")
        elif tuple(got[ks]) != tuple(v.shape):
            bad.append(f"{ks} has shape {tuple(got[ks])}, config needs {tuple(v.shape)}")
    if bad:
        raise CheckpointError(f"{where} does not match its model config: " + "; ".join(bad[:6])
                              + (f" (+{len(bad) - 6} more)" if len(bad) > 6 else ""))


def load_for_eval(path: str | os.PathLike, tokenizer: str | None = None, **overrides) -> LoadedModel:
    """Load the model at ``path`` (see module docstring). ``overrides`` are :class:`ModelConfig`
    execution fields (``attention_backend``, ``dense_layers``, ``dtype``, ``attention_impl`` ...);
    ``tokenizer`` overrides the run's (converter and HF checkpoints default to ``"byte"``)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint path {str(path)!r} does not exist")
    try:
        if (p / "model.yaml").is_file():
            import orbax.checkpoint as ocp

            from mtraining_jax.model.checkpoint import load_model_checkpoint
            from mtraining_jax.model.hf_io import model_params

            if (p / "params").is_dir():  # shapes from the metadata first: no half-failed async restore
                meta = ocp.StandardCheckpointer().metadata(p / "params")
                _check_params(ModelConfig.from_yaml(p / "model.yaml"), getattr(meta, "item_metadata", meta),
                              f"checkpoint {p}")
            cfg, model = load_model_checkpoint(p, **overrides)
            return LoadedModel(cfg, model_params(model), tokenizer or "byte", None, f"checkpoint {p}")
        if (p / "config.json").is_file():
            from mtraining_jax.model.hf_io import load_hf_checkpoint, model_params

            cfg, model = load_hf_checkpoint(p, **overrides)
            return LoadedModel(cfg, model_params(model), tokenizer or "byte", None, f"Hugging Face {p}")
    except (FileNotFoundError, ValueError, TypeError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"cannot load {p}: {e}") from None
    run_dir, step_dir = _find_run(p)
    if run_dir is None:
        raise CheckpointError(
            f"{str(path)!r} is not a checkpoint: expected a run dir (config.yaml + checkpoints/), "
            f"a run's checkpoints/<step>, a converter output (model.yaml + params/) or a Hugging Face "
            f"dir (config.json)")
    loaded = _load_run(run_dir, step_dir, overrides)
    if tokenizer:
        loaded.tokenizer = tokenizer
    return loaded


def check_context(cfg: ModelConfig, seq_len: int) -> None:
    """``ValueError`` unless the model's RoPE (and YaRN scaling) covers ``seq_len`` positions."""
    if seq_len > cfg.max_position_embeddings:
        rs = cfg.rope_scaling
        how = (f"YaRN factor {rs.get('factor')} over {rs.get('original_max_position_embeddings')}"
               if rs else "no rope_scaling")
        raise ValueError(f"context length {seq_len} exceeds the model's max_position_embeddings="
                         f"{cfg.max_position_embeddings} ({how}); evaluate at most "
                         f"{cfg.max_position_embeddings} tokens or load with a rope_scaling that covers it")
