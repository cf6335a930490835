"""Training configuration: frozen dataclasses loaded from YAML with validated dotted overrides.

A run is described by one :class:`TrainConfig` with nested sections ``model``, ``data``, ``optim``,
``mesh``, ``checkpoint``, ``eval``, ``logging`` and ``distributed``. ``load_config(path, overrides)``
reads a YAML file, applies ``key=value`` overrides (``optim.lr=3e-4``, ``mesh.shape=[2,4]``; values
are parsed as YAML scalars/lists) and validates every field. Unknown keys and bad values raise
``ValueError`` naming the dotted key and the value.

The model section either points at a model YAML (``model.path: configs/model/tiny.yaml``) or gives
the model fields inline; any other ``model.<field>`` key is merged into the model YAML's fields
(mappings key by key) and checked against the model's own config class when the model is built
(``mtraining-train --print-config`` and ``--plan`` included). ``model.init_from``
(``hf:<dir>`` or ``ckpt:<dir>``) starts the run from pretrained weights (continued pre-training).
A YAML syntax error is one ``ValueError`` naming the file, line and column.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from typing import Any, Mapping, Optional, Sequence, Union

import yaml

from mtraining_jax.train import compile_cache

DATA_SOURCES = ("stdlib", "tokens", "text", "passkey")
DATA_PACKS = ("stream", "documents")
DATA_POSITIONS = ("global", "per_document")
TOKEN_DTYPES = ("uint8", "uint16", "int32", "uint32", "int64")
DEFAULT_MODEL_CLASS = "mtraining_jax.model.qwen2:Qwen2ForCausalLM"
INIT_FROM_KINDS = ("hf", "ckpt")
OPTIM_OFFLOAD = ("none", "opt_state")  # mtraining_jax.train.offload


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """Which model to build.

    Attributes:
      path: model YAML (``configs/model/*.yaml``), resolved relative to the working directory and
        then to the training YAML's folder and its parent; ``None``: all fields are in ``fields``.
      cls: ``"module:Class"`` of the ``nnx.Module`` (contract: ``Class(cfg, rngs=...)``,
        ``__call__(tokens, positions, mesh=None, *, return_stats=False) -> hidden`` (or ``(hidden,
        {name: per-layer array})`` with ``return_stats``), ``lm_head_weight() -> [hidden, vocab]``).
        Its config class is ``Class.config_class`` if defined, else
        ``mtraining_jax.model.config.ModelConfig``.
      fields: model config fields given inline or by ``model.<field>=...`` overrides, merged into
        the YAML's key by key (mappings such as ``ring`` and ``sparsity`` recursively). Example:
        ``model.attention_backend=mtraining``.
      init_from: ``None`` (random initialisation), ``hf:<dir>`` (a Hugging Face Qwen2 checkpoint
        directory) or ``ckpt:<dir>`` (``mtraining-convert`` output, a training run's ``run_dir``,
        its ``checkpoints`` folder or one ``checkpoints/<step>``): the weights only, with a fresh
        optimizer and step 0. Shapes come from this config (RoPE / YaRN settings included) and
        are checked against the checkpoint's. Ignored when ``--resume`` finds a checkpoint.
    """

    path: Optional[str] = None
    cls: str = DEFAULT_MODEL_CLASS
    fields: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    init_from: Optional[str] = None

    def __post_init__(self):
        if ":" not in self.cls:
            raise ValueError(f"model.cls must look like 'package.module:Class', got {self.cls!r}")
        if self.init_from is not None:
            kind, sep, where = self.init_from.partition(":")
            if not sep or kind not in INIT_FROM_KINDS or not where:
                raise ValueError(f"model.init_from must look like 'hf:<dir>' or 'ckpt:<dir>', got {self.init_from!r}")

    @property
    def init_source(self) -> Optional[tuple[str, str]]:
        """``(kind, directory)`` of ``init_from`` (``None`` when unset)."""
        if self.init_from is None:
            return None
        kind, _, where = self.init_from.partition(":")
        return kind, os.path.expanduser(where)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Packed fixed-length sequences (see :mod:`mtraining_jax.train.data`).

    Attributes:
      source: ``stdlib`` (this Python's standard-library sources, no download), ``tokens``
        (``.npy`` or raw binary token file, ``path`` + ``token_dtype``), ``text`` (``.txt`` / ``.jsonl``
        through ``tokenizer``), or ``passkey`` (synthetic passkey-retrieval sequences).
      seq_len: tokens per sequence ``S`` (the model sees ``S`` inputs, labels are the next tokens).
      batch_size: sequences per micro-batch (global, over all processes).
      layout: sequence layout (``mtraining_jax.layouts``) applied in the loader; default (``None``):
        the model's (``model.layout``), which the MTraining attention requires anyway.
      stripe: stripe width of the ``block_striped`` layout; sequence length must divide into
        ``stripe x ranks``; default (``None``): the sparse block size (``model.sparsity.block_size``).
      tokenizer: ``byte`` (256 byte tokens + specials, no download) or a ``tokenizers`` JSON file.
      heldout_percent: share (percent) of files/documents held out for evaluation.
      eval_path: optional separate held-out file (tokens/text sources).
      pack: ``stream`` (attention runs across the documents of a window, the default) or
        ``documents`` (every token carries the segment id of its document, split at ``eos``; no
        token attends across a document boundary and no label crosses one).
      positions: RoPE positions with ``pack: documents``: ``global`` (position in the window) or
        ``per_document`` (restarting at 0 where each document starts in the window).
    """

    source: str = "stdlib"
    path: Optional[str] = None
    eval_path: Optional[str] = None
    token_dtype: str = "uint16"
    tokenizer: str = "byte"
    text_key: str = "text"
    seq_len: int = 8192
    batch_size: int = 1
    layout: Optional[str] = None
    stripe: Optional[int] = None
    heldout_percent: float = 5.0
    seed: int = 0
    pack: str = "stream"
    positions: str = "global"

    def __post_init__(self):
        if self.source not in DATA_SOURCES:
            raise ValueError(f"data.source must be one of {DATA_SOURCES}, got {self.source!r}")
        if self.source in ("tokens", "text") and not self.path:
            raise ValueError(f"data.path is required for data.source={self.source!r}")
        if self.pack not in DATA_PACKS:
            raise ValueError(f"data.pack must be one of {DATA_PACKS}, got {self.pack!r}")
        if self.positions not in DATA_POSITIONS:
            raise ValueError(f"data.positions must be one of {DATA_POSITIONS}, got {self.positions!r}")
        if self.positions == "per_document" and self.pack != "documents":
            raise ValueError("data.positions='per_document' needs data.pack='documents' (got data.pack="
                             f"{self.pack!r})")
        if self.token_dtype not in TOKEN_DTYPES:
            raise ValueError(f"data.token_dtype must be one of {TOKEN_DTYPES}, got {self.token_dtype!r}")
        _positive("data.seq_len", self.seq_len)
        _positive("data.batch_size", self.batch_size)
        if self.stripe is not None:
            _positive("data.stripe", self.stripe)
        if not 0 < self.heldout_percent < 100:
            raise ValueError(f"data.heldout_percent must be in (0, 100), got {self.heldout_percent}")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup then cosine decay to ``lr * min_lr_ratio``, global-norm clipping
    and gradient accumulation over ``grad_accum`` micro-batches per optimizer step.

    ``max_bad_steps``: a step whose loss or gradient is not finite is skipped (parameters and
    optimizer state unchanged, a warning); this many such steps in a row stop the run (exit 1,
    nothing saved after the last good step). 1: stop at the first.

    ``offload``: ``none`` or ``opt_state`` — keep the AdamW moments in the device's
    ``pinned_host`` memory and stream them through the update one layer at a time
    (:mod:`mtraining_jax.train.offload`; same numbers as ``none``); ``offload_stream: false``
    moves the whole state to the device for the update instead of one layer at a time.
    """

    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0
    grad_accum: int = 1
    max_bad_steps: int = 1
    offload: str = "none"
    offload_stream: bool = True

    def __post_init__(self):
        _positive("optim.lr", self.lr)
        _positive("optim.max_bad_steps", self.max_bad_steps)
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.weight_decay < 0:
            raise ValueError(f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        for k in ("b1", "b2"):
            if not 0 <= getattr(self, k) < 1:
                raise ValueError(f"optim.{k} must be in [0, 1), got {getattr(self, k)}")
        _positive("optim.eps", self.eps)
        if self.clip_norm < 0:
            raise ValueError(f"optim.clip_norm must be >= 0 (0 disables), got {self.clip_norm}")
        _positive("optim.grad_accum", self.grad_accum)
        if self.offload not in OPTIM_OFFLOAD:
            raise ValueError(f"optim.offload must be one of {OPTIM_OFFLOAD}, got {self.offload!r}")


@dataclasses.dataclass(frozen=True)
class MSATrainConfig:
    """MiniMax Sparse Attention training schedule (``msa`` layers; MSA paper §3.2).

    ``warmup_steps``: the first steps run dense attention in the ``msa`` layers and train the index
    branch by the KL against the full-sequence main distribution ("Indexer Warmup"). ``kl_coef``:
    lambda in ``L = L_LM + lambda * sum_layers L_KL`` (the KL trains only the index projections; the
    logged ``loss`` stays the LM loss). Logged: ``attn/msa_kl``, ``attn/msa_recall`` (logging steps
    only, NaN on the others), ``attn/work_fraction``, ``msa/warmup``, ``msa/kl_grad_norm``.
    """

    warmup_steps: int = 0
    kl_coef: float = 1.0

    def __post_init__(self):
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"msa.warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")
        if not self.kl_coef >= 0:
            raise ValueError(f"msa.kl_coef must be >= 0, got {self.kl_coef!r}")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh ``(data?, node, local)``.

    Attributes:
      shape: ``[node, local]``; ``None``: one node per process, all its devices on ``local``.
      data: size of the batch-parallel ``data`` axis in front (1: none).
      cpu_devices: when set, the CLI runs on CPU with this many virtual devices IN TOTAL, split
        evenly over the processes of a multi-process launch (``cpu_devices / num_processes`` each;
        set before JAX's backends start).
      fsdp: shard parameters, gradients and optimizer state over all devices (FSDP / ZeRO-3,
        gathered layer by layer; :mod:`mtraining_jax.train.sharding`). ``None`` (default): on when
        the mesh has more than one device; ``false``: replicated on every device.
    """

    shape: Optional[tuple[int, int]] = None
    data: int = 1
    cpu_devices: Optional[int] = None
    fsdp: Optional[bool] = None

    def __post_init__(self):
        if self.shape is not None:
            if len(self.shape) != 2 or any(int(s) != s or s < 1 for s in self.shape):
                raise ValueError(f"mesh.shape must be [node, local] positive integers, got {self.shape!r}")
        _positive("mesh.data", self.data)
        if self.cpu_devices is not None:
            _positive("mesh.cpu_devices", self.cpu_devices)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints under ``<run_dir>/checkpoints`` (or ``dir``) every ``every`` steps (0:
    never), the last ``keep`` kept. ``resume`` (``--resume``): continue from the newest one."""

    dir: Optional[str] = None
    every: int = 100
    keep: int = 3
    async_save: bool = True
    resume: bool = False

    def __post_init__(self):
        if self.every < 0:
            raise ValueError(f"checkpoint.every must be >= 0 (0 disables), got {self.every}")
        _positive("checkpoint.keep", self.keep)


@dataclasses.dataclass(frozen=True)
class LongContextEvalConfig:
    """``eval.long_context``: every ``every`` steps (0: never, the default) and at the last step,
    the evaluation package's needle-in-a-haystack grid (``lengths`` x ``depths``, ``samples``
    passkeys per cell; ``lengths`` empty: ``data.seq_len``) and RULER-style ``tasks``
    (``task_samples`` examples per task and length), scored on whole answers
    (:func:`mtraining_jax.eval.api.evaluate_params`). Lengths are checked against the model's RoPE
    range and the sequence layout when the run starts."""

    every: int = 0
    lengths: tuple[int, ...] = ()
    depths: tuple[float, ...] = (0.0, 0.5, 1.0)
    samples: int = 2
    tasks: tuple[str, ...] = ("multikey", "multivalue", "vartrack")
    task_samples: int = 2
    batch_size: int = 1

    def __post_init__(self):
        for k in ("every", "samples", "task_samples"):
            if getattr(self, k) < 0:
                raise ValueError(f"eval.long_context.{k} must be >= 0, got {getattr(self, k)}")
        _positive("eval.long_context.batch_size", self.batch_size)
        for n in self.lengths:
            _positive("eval.long_context.lengths", n)
        bad = [d for d in self.depths if not 0.0 <= d <= 1.0]
        if bad:
            raise ValueError(f"eval.long_context.depths must lie in [0, 1], got {bad}")
        if self.every and not ((self.depths and self.samples) or (self.tasks and self.task_samples)):
            raise ValueError("eval.long_context.every > 0 needs depths + samples or tasks + task_samples")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Held-out perplexity over ``batches`` batches and passkey answer-token accuracy over
    ``passkey_samples`` sequences of ``data.seq_len`` tokens, every ``every`` steps (0: never);
    ``long_context``: the long-context retrieval evaluation (:class:`LongContextEvalConfig`)."""

    every: int = 100
    batches: int = 2
    passkey_samples: int = 4
    passkey_digits: int = 5
    long_context: LongContextEvalConfig = dataclasses.field(default_factory=LongContextEvalConfig)

    def __post_init__(self):
        for k in ("every", "batches", "passkey_samples"):
            if getattr(self, k) < 0:
                raise ValueError(f"eval.{k} must be >= 0, got {getattr(self, k)}")
        _positive("eval.passkey_digits", self.passkey_digits)


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    """Metrics: JSONL (always), TensorBoard (``tensorboardX`` if installed), a tqdm bar, and a
    loss-curve PNG at the end."""

    every: int = 1
    progress: bool = True
    tensorboard: bool = True
    plot: bool = True

    def __post_init__(self):
        _positive("logging.every", self.every)


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Multi-process launch. ``auto``: call ``jax.distributed.initialize()`` when a cluster
    launcher is detected (SLURM, Open MPI, ``JAX_COORDINATOR_ADDRESS``); explicit values win.
    ``timeout_s``: how long a process waits for all its peers at start-up before it stops with an
    error naming the coordinator."""

    coordinator_address: Optional[str] = None
    num_processes: Optional[int] = None
    process_id: Optional[int] = None
    auto: bool = True
    timeout_s: int = 300

    def __post_init__(self):
        _positive("distributed.timeout_s", self.timeout_s)
        if self.num_processes is not None:
            _positive("distributed.num_processes", self.num_processes)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A training run.

    ``steps``: optimizer steps of the whole run (each ``optim.grad_accum`` micro-batches; the
    learning-rate schedule spans them). ``run_steps``: at most this many steps in this invocation
    (for time-limited jobs that continue with ``--resume``; a checkpoint is written when it stops).
    ``loss_chunk_size``: tokens per chunk of the memory-bounded loss (:mod:`.loss`).
    ``deterministic``: bit-reproducible steps on GPUs (:mod:`.determinism`: XLA's deterministic
    scatter-adds; the kernels use no atomics), at some speed; the same run twice, or on one process
    and on several with the same mesh, then gives the same losses.
    ``compile_cache_dir``: a persistent compilation cache (:mod:`.compile_cache`): a restarted or
    resumed run loads its compiled step from it instead of compiling again; ``null``: none.
    """

    run_dir: str = "runs/default"
    steps: int = 1000
    run_steps: Optional[int] = None
    seed: int = 0
    loss_chunk_size: int = 1024
    deterministic: bool = False
    compile_cache_dir: Optional[str] = None
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    msa: MSATrainConfig = dataclasses.field(default_factory=MSATrainConfig)
    # Folder of the YAML this came from (resolves relative model paths); not a user key.
    config_dir: Optional[str] = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        _positive("steps", self.steps)
        if self.run_steps is not None:
            _positive("run_steps", self.run_steps)
        _positive("loss_chunk_size", self.loss_chunk_size)
        compile_cache.check(self.compile_cache_dir)

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or os.path.join(self.run_dir, "checkpoints")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("config_dir")
        d["model"] = {"path": self.model.path, "cls": self.model.cls, "init_from": self.model.init_from,
                      **dict(self.model.fields)}
        return d


SECTIONS = {
    "data": DataConfig,
    "optim": OptimConfig,
    "mesh": MeshConfig,
    "checkpoint": CheckpointConfig,
    "eval": EvalConfig,
    "logging": LoggingConfig,
    "distributed": DistributedConfig,
    "msa": MSATrainConfig,
}


def _positive(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or (
        isinstance(value, float) and not math.isfinite(value)
    ):
        raise ValueError(f"{name} must be a positive number, got {value!r}")


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check/convert a YAML value to the annotated type ``tp``; ``ValueError`` naming ``key``."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(key, value, a)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(errors[0] if errors else f"{key}: bad value {value!r}")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{key} must be a list, got {value!r}")
        args = typing.get_args(tp)
        elem = args[0]
        return tuple(_coerce(key, v, elem) for v in value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"{key} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ValueError(f"{key} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{key} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ValueError(f"{key} must be a string, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        return value if isinstance(value, tp) else _build_section(key, tp, value)
    return value


def _build_section(name: str, cls, raw: Any):
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ValueError(f"config section {name!r} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ValueError(
            f"unknown config key(s) {', '.join(f'{name}.{k}' for k in unknown)}; "
            f"section {name!r} accepts {sorted(names)}"
        )
    kwargs = {k: _coerce(f"{name}.{k}", v, hints[k]) for k, v in raw.items()}
    return cls(**kwargs)


def config_from_dict(raw: Mapping[str, Any], config_dir: Optional[str] = None) -> TrainConfig:
    """Build and validate a :class:`TrainConfig` from a nested dict (parsed YAML)."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"a training config must be a mapping, got {type(raw).__name__}")
    raw = dict(raw)
    top_fields = {f.name for f in dataclasses.fields(TrainConfig)} - {"config_dir"}
    unknown = sorted(set(raw) - top_fields)
    if unknown:
        raise ValueError(f"unknown config key(s) {unknown}; top-level keys are {sorted(top_fields)}")
    hints = typing.get_type_hints(TrainConfig)
    kwargs: dict[str, Any] = {}
    for k, v in raw.items():
        if k in SECTIONS:
            kwargs[k] = _build_section(k, SECTIONS[k], v)
        elif k == "model":
            m = dict(v or {})
            if not isinstance(v or {}, Mapping):
                raise ValueError(f"config section 'model' must be a mapping, got {v!r}")
            path = m.pop("path", None)
            cls = m.pop("cls", DEFAULT_MODEL_CLASS)
            init_from = m.pop("init_from", None)
            if path is not None and not isinstance(path, str):
                raise ValueError(f"model.path must be a string, got {path!r}")
            if init_from is not None and not isinstance(init_from, str):
                raise ValueError(f"model.init_from must be a string like 'hf:<dir>', got {init_from!r}")
            kwargs[k] = ModelSection(path=path, cls=_coerce("model.cls", cls, str), fields=m, init_from=init_from)
        else:
            kwargs[k] = _coerce(k, v, hints[k])
    return TrainConfig(config_dir=config_dir, **kwargs)


def parse_override(item: str) -> tuple[list[str], Any]:
    """``"optim.lr=3e-4"`` -> ``(["optim", "lr"], 0.0003)`` (value parsed as YAML)."""
    if "=" not in item:
        raise ValueError(f"override {item!r} must look like section.key=value")
    key, text = item.split("=", 1)
    key = key.strip()
    if not key or any(not p for p in key.split(".")):
        raise ValueError(f"override {item!r} has an empty key")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).strip().splitlines()[0]
        context = getattr(e, "context", None)
        mark = getattr(e, "problem_mark", None)
        at = f" at column {mark.column + 1}" if mark is not None else ""
        why = f"{context}: {problem}" if context else problem
        raise ValueError(f"override {key}={text}: cannot parse the value {text!r} as YAML ({why}{at}); "
                         f"quote it or fix the brackets") from None
    # YAML 1.1 does not read "3e-4" as a float; accept it.
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value for c in ".eE") else value
        except ValueError:
            pass
    return key.split("."), value


def apply_overrides(raw: Mapping[str, Any], overrides: Sequence[str]) -> dict:
    """Apply dotted ``key=value`` overrides to a nested dict (validation happens on build)."""
    out = _deepcopy(raw)
    for item in overrides:
        parts, value = parse_override(item)
        node = out
        for p in parts[:-1]:
            nxt = node.get(p)
            if nxt is None:
                nxt = node[p] = {}
            if not isinstance(nxt, dict):
                raise ValueError(f"override {item!r}: {p!r} is not a section")
            node = nxt
        node[parts[-1]] = value
    return out


def _deepcopy(d):
    if isinstance(d, Mapping):
        return {k: _deepcopy(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_deepcopy(v) for v in d]
    return d


def load_config(path: Optional[str], overrides: Sequence[str] = ()) -> TrainConfig:
    """Load a training YAML (``None``: defaults) and apply ``key=value`` overrides."""
    raw: dict = {}
    config_dir = None
    if path is not None:
        raw = read_yaml(path, "config file")
        if not isinstance(raw, Mapping):
            raise ValueError(f"config file {path!r} must hold a mapping of sections, got {type(raw).__name__}")
        config_dir = os.path.dirname(os.path.abspath(path))
    return config_from_dict(apply_overrides(raw, overrides), config_dir=config_dir)


def read_yaml(path: str, what: str = "YAML file") -> Any:
    """Parsed YAML of ``path`` (empty file: ``{}``); a missing file, a directory or a syntax error
    is one ``ValueError`` naming the file (and the line and column of the error)."""
    if os.path.isdir(path):
        raise ValueError(f"{what} {path!r} is a directory, not a YAML file")
    if not os.path.isfile(path):
        raise ValueError(f"{what} {path!r} does not exist")
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else path
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ValueError(f"{what} {where}: YAML syntax error: {problem}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {what} {path!r}: {e}") from None
    return {} if raw is None else raw
