"""Find and load a model to evaluate: a training run, one of its checkpoints, a converter output
directory, or a Hugging Face Qwen2 directory.

Our checkpoints (``mtraining-convert`` output, ``<run_dir>``, ``<run_dir>/checkpoints``,
``<run_dir>/checkpoints/<step>``) are found, shape-checked and read by
:mod:`mtraining_jax.model.checkpoint` (the one loader the trainer and the converter use too); a
directory with ``config.json`` and no ``params/`` is a Hugging Face Qwen2 checkpoint
(:mod:`mtraining_jax.model.hf_io`). What this module adds for evaluation: the run's training config
(its tokenizer, trained length and held-out data), the tokenizer choice, and :func:`check_context`.
Every failure is a :class:`CheckpointError` (a ``ValueError``) with one line naming the path.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from mtraining_jax.model.config import ModelConfig


class CheckpointError(ValueError):
    """A missing or incompatible checkpoint (one-line message naming the path)."""


@dataclasses.dataclass
class LoadedModel:
    """A model ready to evaluate.

    ``config``: the :class:`ModelConfig` (with any execution overrides applied); ``params``: the
    nested parameter dict (``nnx.to_pure_dict`` layout, layers stacked); ``tokenizer``: the run's
    tokenizer spec (``"byte"`` or a ``tokenizers`` JSON path); ``train_seq_len``: sequence length the
    run trained at (``None`` when unknown); ``source``: a description (``"run runs/x step 120"``);
    ``train_config``: the run's :class:`TrainConfig` (``None`` outside a training run).
    """

    config: ModelConfig
    params: Any
    tokenizer: str
    train_seq_len: int | None
    source: str
    train_config: Any = None


def _train_config(ref) -> tuple[Any, Path | None]:
    """The training config of the run holding ``ref`` (``<run_dir>/config.yaml`` above
    ``checkpoints/<step>/state``) and its run dir; ``(None, None)`` for a converter output."""
    from mtraining_jax.train.config import load_config

    if ref.step is None:
        return None, None
    run_dir = ref.params_dir.parent.parent.parent
    if not (run_dir / "config.yaml").is_file():
        return None, None
    try:
        return load_config(str(run_dir / "config.yaml")), run_dir
    except ValueError as e:
        raise CheckpointError(f"{run_dir / 'config.yaml'}: {e}") from None


def load_for_eval(path: str | os.PathLike, tokenizer: str | None = None, **overrides) -> LoadedModel:
    """Load the model at ``path`` (see module docstring). ``overrides`` are :class:`ModelConfig`
    execution fields (``attention_backend``, ``dense_layers``, ``dtype``, ``attention_impl`` ...);
    ``tokenizer`` overrides the run's (converter and HF checkpoints default to ``"byte"``)."""
    from mtraining_jax.model.checkpoint import load_model_params

    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint path {str(path)!r} does not exist")
    try:
        if (p / "config.json").is_file() and not (p / "params").is_dir():
            from mtraining_jax.model.hf_io import load_hf_checkpoint, model_params

            cfg, model = load_hf_checkpoint(p, **overrides)
            return LoadedModel(cfg, model_params(model), tokenizer or "byte", None, f"Hugging Face {p}")
        ref, cfg, params = load_model_params(p, **overrides)
    except CheckpointError:
        raise
    except FileNotFoundError as e:
        hint = " or a Hugging Face Qwen2 dir (config.json)" if str(e).startswith("no model checkpoint") else ""
        raise CheckpointError(f"{e}{hint}") from None
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"cannot load {p}: {e}") from None
    tcfg, run_dir = _train_config(ref)
    if tcfg is None:
        where = f"checkpoint {p}" if ref.step is None else f"checkpoint {ref.params_dir.parent} (step {ref.step})"
        return LoadedModel(cfg, params, tokenizer or "byte", None, where)
    return LoadedModel(cfg, params, tokenizer or tcfg.data.tokenizer, tcfg.data.seq_len,
                       f"run {run_dir} step {ref.step}", tcfg)


def check_context(cfg: ModelConfig, seq_len: int) -> None:
    """``ValueError`` unless the model's RoPE (and YaRN scaling) covers ``seq_len`` positions."""
    if seq_len > cfg.max_position_embeddings:
        rs = cfg.rope_scaling
        how = (f"YaRN factor {rs.get('factor')} over {rs.get('original_max_position_embeddings')}"
               if rs else "no rope_scaling")
        raise ValueError(f"context length {seq_len} exceeds the model's max_position_embeddings="
                         f"{cfg.max_position_embeddings} ({how}); evaluate at most "
                         f"{cfg.max_position_embeddings} tokens or load with a rope_scaling that covers it")
