"""Hugging Face ``transformers`` Qwen2 checkpoints <-> :class:`Qwen2ForCausalLM` parameters.

A checkpoint directory holds ``config.json`` and ``model.safetensors`` or the shards listed in
``model.safetensors.index.json``; tensors are read and written with the ``safetensors`` NumPy API
(torch is never imported). Name mapping (HF ``weight [out, in]`` is transposed to ``kernel [in,
out]``; per-layer tensors stacked on a leading ``[num_layers]`` axis)::

  model.embed_tokens.weight              [V, H]   embed_tokens/embedding       [V, H]
  model.layers.{i}.input_layernorm.weight [H]     layers/input_layernorm/weight [L, H]
  model.layers.{i}.self_attn.q_proj.weight/bias   layers/self_attn/q_proj/kernel [L, H, Hq*D] / bias
  ... k_proj, v_proj (with bias), o_proj (no bias), post_attention_layernorm,
  ... mlp.gate_proj / up_proj / down_proj (no bias)
  model.norm.weight                      [H]      norm/weight                  [H]
  lm_head.weight                         [V, H]   lm_head                      [H, V]  (untied only)

MSA index branch (not part of Qwen2): saved beside the checkpoint in ``msa_index.safetensors``
(:data:`MSA_INDEX_FILE`) as ``model.layers.{i}.self_attn.index_q.weight [Hkv * d_idx, H]`` and
``...index_k.weight [d_idx, H]``, with the model's MSA settings (:data:`MSA_SETTINGS`) as JSON
metadata; :func:`load_hf_checkpoint` applies them (a file without them is refused unless the
overrides name the ``msa`` layers). Loading into a model with ``msa`` layers without that file
initialises the branch as a fresh model's (``normal(0, initializer_range)``, seed 0).

Errors: a missing file is a ``FileNotFoundError`` naming it; an unsupported ``model_type`` /
``architectures`` a ``ValueError``; missing, unexpected or mis-shaped tensors are listed together
in one :class:`CheckpointMismatchError` (a ``ValueError``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from mtraining_jax.model.config import ModelConfig, check_hf_architecture
from mtraining_jax.model.qwen2 import Qwen2ForCausalLM, abstract_model

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MSA_INDEX_FILE = "msa_index.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3  # transformers' default max_shard_size="5GB"
_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float64": np.float64}

# (HF suffix under model.layers.{i}., our path under layers/, transpose)
_LAYER_TENSORS: tuple[tuple[str, tuple[str, ...], bool], ...] = (
    ("input_layernorm.weight", ("input_layernorm", "weight"), False),
    ("post_attention_layernorm.weight", ("post_attention_layernorm", "weight"), False),
    ("self_attn.q_proj.weight", ("self_attn", "q_proj", "kernel"), True),
    ("self_attn.q_proj.bias", ("self_attn", "q_proj", "bias"), False),
    ("self_attn.k_proj.weight", ("self_attn", "k_proj", "kernel"), True),
    ("self_attn.k_proj.bias", ("self_attn", "k_proj", "bias"), False),
    ("self_attn.v_proj.weight", ("self_attn", "v_proj", "kernel"), True),
    ("self_attn.v_proj.bias", ("self_attn", "v_proj", "bias"), False),
    ("self_attn.o_proj.weight", ("self_attn", "o_proj", "kernel"), True),
    ("mlp.gate_proj.weight", ("mlp", "gate_proj", "kernel"), True),
    ("mlp.up_proj.weight", ("mlp", "up_proj", "kernel"), True),
    ("mlp.down_proj.weight", ("mlp", "down_proj", "kernel"), True),
)


class CheckpointMismatchError(ValueError):
    """Checkpoint tensors do not match the config: lists every missing, unexpected and
    mis-shaped tensor (attributes of the same names)."""

    def __init__(self, missing, unexpected, mis_shaped, where: str = ""):
        self.missing, self.unexpected, self.mis_shaped = list(missing), list(unexpected), list(mis_shaped)
        parts = []
        if self.missing:
            parts.append(f"missing tensors {self.missing}")
        if self.unexpected:
            parts.append(f"unexpected tensors {self.unexpected}")
        if self.mis_shaped:
            parts.append(
                "mis-shaped tensors "
                + ", ".join(f"{n}: got {tuple(g)}, expected {tuple(e)}" for n, g, e in self.mis_shaped)
            )
        super().__init__(f"checkpoint{' ' + where if where else ''} does not match the config: " + "; ".join(parts))


# --------------------------------------------------------------------------- shapes and names
def hf_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Expected HF tensor names and shapes for ``cfg`` (``lm_head.weight`` only when untied)."""
    h, d, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    qd, kd = cfg.num_heads * d, cfg.num_kv_heads * d
    per_layer = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (qd, h),
        "self_attn.q_proj.bias": (qd,),
        "self_attn.k_proj.weight": (kd, h),
        "self_attn.k_proj.bias": (kd,),
        "self_attn.v_proj.weight": (kd, h),
        "self_attn.v_proj.bias": (kd,),
        "self_attn.o_proj.weight": (h, qd),
        "mlp.gate_proj.weight": (f, h),
        "mlp.up_proj.weight": (f, h),
        "mlp.down_proj.weight": (h, f),
    }
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(cfg.num_layers):
        for k, s in per_layer.items():
            shapes[f"model.layers.{i}.{k}"] = s
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def check_hf_tensors(tensors: Mapping[str, np.ndarray], cfg: ModelConfig, where: str = "") -> None:
    """Raise :class:`CheckpointMismatchError` unless ``tensors`` has exactly the expected names
    and shapes (a tied checkpoint may also carry ``lm_head.weight`` equal to the embedding)."""
    expected = hf_tensor_shapes(cfg)
    names = set(tensors)
    extra = set()
    if cfg.tie_word_embeddings and "lm_head.weight" in names:
        extra.add("lm_head.weight")  # transformers may save the tied copy; checked below
    missing = sorted(set(expected) - names)
    unexpected = sorted(names - set(expected) - extra)
    mis = [(n, tensors[n].shape, expected[n]) for n in sorted(names & set(expected))
           if tuple(tensors[n].shape) != expected[n]]
    if missing or unexpected or mis:
        raise CheckpointMismatchError(missing, unexpected, mis, where)
    if extra:
        emb, head = tensors["model.embed_tokens.weight"], tensors["lm_head.weight"]
        if head.shape != emb.shape or not np.array_equal(np.asarray(head), np.asarray(emb)):
            raise ValueError(
                f"checkpoint{' ' + where if where else ''}: tie_word_embeddings is true but lm_head.weight "
                "differs from model.embed_tokens.weight"
            )


# --------------------------------------------------------------------------- conversion
def hf_to_params(tensors: Mapping[str, np.ndarray], cfg: ModelConfig, where: str = "") -> dict:
    """HF tensors -> nested pure dict of ``Qwen2ForCausalLM`` parameters (NumPy, ``cfg.param_dtype``)."""
    check_hf_tensors(tensors, cfg, where)
    dt = _NP_DTYPES[cfg.param_dtype]

    def conv(a, transpose=False):
        a = np.asarray(a)
        return np.ascontiguousarray((a.T if transpose else a).astype(dt))

    params: dict = {
        "embed_tokens": {"embedding": conv(tensors["model.embed_tokens.weight"])},
        "norm": {"weight": conv(tensors["model.norm.weight"])},
        "layers": {},
    }
    for suffix, path, transpose in _LAYER_TENSORS:
        stacked = np.stack([conv(tensors[f"model.layers.{i}.{suffix}"], transpose) for i in range(cfg.num_layers)])
        node = params["layers"]
        for p in path[:-1]:
            node = node.setdefault(p, {})
        node[path[-1]] = stacked
    if not cfg.tie_word_embeddings:
        params["lm_head"] = conv(tensors["lm_head.weight"], transpose=True)
    return params


def params_to_hf(params: Mapping, cfg: ModelConfig, dtype: str | None = None) -> dict[str, np.ndarray]:
    """Nested pure dict (``nnx.to_pure_dict(nnx.state(model, nnx.Param))``) -> HF tensors in
    ``dtype`` (default ``cfg.param_dtype``)."""
    dt = _NP_DTYPES[dtype or cfg.param_dtype]

    def conv(a, transpose=False):
        a = np.asarray(jax.device_get(a))
        return np.ascontiguousarray((a.T if transpose else a).astype(dt))

    out = {
        "model.embed_tokens.weight": conv(params["embed_tokens"]["embedding"]),
        "model.norm.weight": conv(params["norm"]["weight"]),
    }
    for suffix, path, transpose in _LAYER_TENSORS:
        node = params["layers"]
        for p in path:
            node = node[p]
        stacked = np.asarray(jax.device_get(node))
        for i in range(cfg.num_layers):
            out[f"model.layers.{i}.{suffix}"] = conv(stacked[i], transpose)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = conv(params["lm_head"], transpose=True)
    return out


# --------------------------------------------------------------------------- MSA index branch
_MSA_TENSORS = (("self_attn.index_q.weight", "index_q"), ("self_attn.index_k.weight", "index_k"))
#: ModelConfig fields saved in the metadata of msa_index.safetensors (which layers are msa, and how)
MSA_SETTINGS = ("attention_backend", "attention_backends", "dense_layers", "dense_backend", "layout", "msa")
MSA_METADATA_KEY = "mtraining_msa"


def msa_settings(cfg: ModelConfig) -> dict:
    """The :data:`MSA_SETTINGS` of ``cfg`` as JSON-ready values (the ``msa`` mapping with its defaults)."""
    from mtraining_jax.model.config import MSA_DEFAULTS

    d = cfg.to_dict()
    out = {k: d[k] for k in MSA_SETTINGS}
    out["msa"] = {**MSA_DEFAULTS, **(cfg.msa or {})}
    return out


class MissingMSASettings(ValueError):
    """``msa_index.safetensors`` without the MSA settings in its metadata."""


def read_msa_settings(path: str | os.PathLike) -> dict | None:
    """The MSA settings stored in ``<path>/msa_index.safetensors`` (``None``: no such file);
    ``ValueError`` naming the file when it is unreadable or carries no settings."""
    f = Path(path) / MSA_INDEX_FILE
    if not f.is_file():
        return None
    from safetensors import safe_open

    try:
        with safe_open(str(f), framework="np") as fh:
            meta = fh.metadata() or {}
    except Exception as e:  # noqa: BLE001  (safetensors' Rust errors)
        raise ValueError(f"cannot read {f} (corrupt or not a safetensors file): {e}") from None
    text = meta.get(MSA_METADATA_KEY)
    if text is None:
        raise MissingMSASettings(f"{f} holds an MSA index branch but not the model's MSA settings (metadata key "
                         f"{MSA_METADATA_KEY!r}), so which layers are msa is unknown; re-export it with "
                         f"`mtraining-convert ours-to-hf`, or delete the file to import the dense model only")
    try:
        settings = json.loads(text)
        if not isinstance(settings, dict):
            raise ValueError(f"a JSON object, got {type(settings).__name__}")
    except ValueError as e:
        raise ValueError(f"{f}: metadata {MSA_METADATA_KEY!r} is not valid: {e}") from None
    unknown = sorted(set(settings) - set(MSA_SETTINGS))
    if unknown:
        raise ValueError(f"{f}: unknown MSA setting(s) {unknown}; known: {list(MSA_SETTINGS)}")
    return settings


def msa_index_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF-style names and ``[out, in]`` shapes of the index branch (empty without ``msa`` layers)."""
    if not cfg.has_msa:
        return {}
    h, d = cfg.hidden_size, cfg.msa_index_dim
    outs = {"index_q": cfg.num_kv_heads * d, "index_k": d}
    return {f"model.layers.{i}.{suffix}": (outs[name], h)
            for i in range(cfg.num_layers) for suffix, name in _MSA_TENSORS}


def msa_index_to_hf(params: Mapping, cfg: ModelConfig, dtype: str | None = None) -> dict[str, np.ndarray]:
    """The index branch of ``params`` as HF-style tensors (transposed to ``[out, in]``)."""
    dt = _NP_DTYPES[dtype or cfg.param_dtype]
    out = {}
    for suffix, name in _MSA_TENSORS:
        stacked = np.asarray(jax.device_get(params["layers"]["self_attn"][name]["kernel"]))
        for i in range(cfg.num_layers):
            out[f"model.layers.{i}.{suffix}"] = np.ascontiguousarray(stacked[i].T.astype(dt))
    return out


def add_msa_index(params: dict, cfg: ModelConfig, path: str | os.PathLike | None = None) -> dict:
    """``params`` with the index branch filled in (no-op without ``msa`` layers): read from
    ``<path>/msa_index.safetensors`` when it exists (checked), else initialised (module docstring)."""
    if not cfg.has_msa:
        return params
    shapes = msa_index_shapes(cfg)
    f = None if path is None else Path(path) / MSA_INDEX_FILE
    if f is not None and f.is_file():
        from safetensors.numpy import load_file

        tensors = dict(load_file(str(f)))
        missing = sorted(set(shapes) - set(tensors))
        unexpected = sorted(set(tensors) - set(shapes))
        mis = [(n, tensors[n].shape, shapes[n]) for n in sorted(set(tensors) & set(shapes))
               if tuple(tensors[n].shape) != shapes[n]]
        if missing or unexpected or mis:
            raise CheckpointMismatchError(missing, unexpected, mis, str(f))
    else:
        rng = np.random.default_rng(0)
        tensors = {n: rng.normal(0.0, cfg.initializer_range, s) for n, s in shapes.items()}
    dt = _NP_DTYPES[cfg.param_dtype]
    attn = params["layers"].setdefault("self_attn", {})
    for suffix, name in _MSA_TENSORS:
        attn[name] = {"kernel": np.stack([
            np.ascontiguousarray(np.asarray(tensors[f"model.layers.{i}.{suffix}"]).T.astype(dt))
            for i in range(cfg.num_layers)])}
    return params


def model_params(model: Qwen2ForCausalLM) -> dict:
    """Nested pure dict of the model's parameters."""
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def model_from_params(cfg: ModelConfig, params: Mapping) -> Qwen2ForCausalLM:
    """Build a model holding ``params`` without random initialisation (shapes checked)."""
    graphdef, state = nnx.split(abstract_model(cfg))
    want = nnx.to_pure_dict(state)
    bad = []

    def check(path, a, w):
        if tuple(np.shape(a)) != tuple(w.shape):
            bad.append(("/".join(str(getattr(k, "key", k)) for k in path), np.shape(a), w.shape))

    jax.tree_util.tree_map_with_path(check, params, want)
    if bad:
        raise CheckpointMismatchError([], [], bad)
    dt = jnp.dtype(cfg.param_dtype)
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda a: jnp.asarray(a, dt), params))
    return nnx.merge(graphdef, state)


# --------------------------------------------------------------------------- files
_HF_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def read_hf_config(path: str | os.PathLike) -> dict:
    """Read and architecture-check ``<path>/config.json``; every problem is one ``ValueError`` /
    ``FileNotFoundError`` naming the file."""
    f = Path(path) / CONFIG_FILE
    if not Path(path).is_dir():
        raise FileNotFoundError(f"Hugging Face checkpoint directory not found: {path}")
    if not f.is_file():
        raise FileNotFoundError(f"config.json not found: {f}")
    try:
        with open(f) as fh:
            hf = json.load(fh)
    except json.JSONDecodeError as e:
        raise ValueError(f"{f}:{e.lineno}:{e.colno}: not valid JSON: {e.msg}") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{f}: expected a JSON object, got {type(hf).__name__}")
    missing = [k for k in _HF_REQUIRED if k not in hf]
    if missing:
        raise ValueError(f"{f} lacks required key(s) {missing}")
    for k in (*_HF_REQUIRED, "num_key_value_heads", "head_dim", "max_position_embeddings"):
        v = hf.get(k)
        if (v is not None or k in _HF_REQUIRED) and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{f}: {k} must be a positive integer, got {v!r}")
    try:
        check_hf_architecture(hf)
    except ValueError as e:
        raise ValueError(f"{f}: {e}") from None
    return hf


def check_hf_config_matches(hf: Mapping, cfg: ModelConfig, where: str) -> None:
    """``ValueError`` naming each architecture field where ``config.json`` and ``cfg`` differ
    (head counts matter even where tensor shapes agree). RoPE settings may differ: continued
    pre-training at a longer context changes them on purpose."""
    check_same_architecture(ModelConfig.from_hf_config(hf), cfg, where)


ARCHITECTURE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                       "head_dim", "tie_word_embeddings")


def check_same_architecture(theirs: ModelConfig, cfg: ModelConfig, where: str) -> None:
    """``ValueError`` naming each of :data:`ARCHITECTURE_FIELDS` where a checkpoint's config
    (``theirs``) and the model's (``cfg``) differ."""
    bad = [f"model.{k}={getattr(cfg, k)!r} but the checkpoint has {getattr(theirs, k)!r}"
           for k in ARCHITECTURE_FIELDS if getattr(cfg, k) != getattr(theirs, k)]
    if bad:
        raise ValueError(f"checkpoint {where} does not match the model config: " + "; ".join(bad))


def load_hf_params(path: str | os.PathLike, cfg: ModelConfig) -> dict:
    """Parameters (NumPy, ``cfg.param_dtype``) of the HF checkpoint at ``path`` for the model
    ``cfg`` — whose RoPE / YaRN and execution settings may differ from ``config.json``; the
    architecture fields and every tensor shape are checked."""
    check_hf_config_matches(read_hf_config(path), cfg, str(path))
    return add_msa_index(hf_to_params(read_hf_tensors(path), cfg, where=str(path)), cfg, path)


def read_hf_tensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of ``model.safetensors`` or of the shards in ``model.safetensors.index.json``."""
    from safetensors.numpy import load_file

    def load(f: Path) -> dict:
        try:
            return dict(load_file(str(f)))
        except Exception as e:  # safetensors' Rust errors are no ValueError subclass
            raise ValueError(f"cannot read {f} (corrupt or not a safetensors file): {e}") from None

    path = Path(path)
    single, index = path / WEIGHTS_FILE, path / INDEX_FILE
    if single.is_file():
        return load(single)
    if not index.is_file():
        raise FileNotFoundError(f"no weights in {path}: neither {single} nor {index} exists")
    try:
        with open(index) as fh:
            weight_map = json.load(fh).get("weight_map")
    except (json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"{index}: not a JSON object with a 'weight_map': {e}") from None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index} has no 'weight_map' mapping")
    tensors: dict[str, np.ndarray] = {}
    for shard in sorted(set(weight_map.values())):
        f = path / shard
        if not f.is_file():
            raise FileNotFoundError(f"shard listed in {index} not found: {f}")
        part = load(f)
        tensors.update({k: v for k, v in part.items() if weight_map.get(k) == shard})
    missing = sorted(k for k in weight_map if k not in tensors)
    if missing:
        raise CheckpointMismatchError(missing, [], [], f"{path} (named in the index but absent from their shards)")
    return tensors


def load_hf_checkpoint(path: str | os.PathLike, **overrides) -> tuple[ModelConfig, Qwen2ForCausalLM]:
    """Read a transformers Qwen2 checkpoint directory into ``(ModelConfig, Qwen2ForCausalLM)``.

    ``overrides`` set ModelConfig fields (e.g. ``param_dtype="bfloat16"``,
    ``attention_backend="ring"``); parameters are converted to ``param_dtype``. A checkpoint with
    ``msa_index.safetensors`` gets the MSA settings stored there (before ``overrides``) and its
    index branch (module docstring).
    """
    hf = read_hf_config(path)
    try:
        msa = read_msa_settings(path) or {}
    except MissingMSASettings:
        if not any(k in overrides for k in MSA_SETTINGS):
            raise
        msa = {}  # the caller says which layers are msa
    try:
        cfg = ModelConfig.from_hf_config(hf, **{**msa, **overrides})
    except ValueError as e:
        raise ValueError(f"{Path(path) / CONFIG_FILE}: {e}") from None
    params = add_msa_index(hf_to_params(read_hf_tensors(path), cfg, where=str(path)), cfg, path)
    return cfg, model_from_params(cfg, params)


def save_hf_checkpoint(
    model: Qwen2ForCausalLM,
    path: str | os.PathLike,
    *,
    dtype: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[Path]:
    """Write ``config.json`` + ``model.safetensors`` (or shards of at most ``max_shard_bytes``
    plus ``model.safetensors.index.json``) loadable by transformers, and, for a model with ``msa``
    layers, ``msa_index.safetensors`` (module docstring). Returns the weight files."""
    from safetensors.numpy import save_file

    cfg = model.config
    dtype = dtype or cfg.param_dtype
    if dtype not in _NP_DTYPES:
        raise ValueError(f"dtype must be one of {tuple(_NP_DTYPES)}, got {dtype!r}")
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    params = model_params(model)
    tensors = params_to_hf(params, cfg, dtype)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / MSA_INDEX_FILE).unlink(missing_ok=True)
    extra = []
    if cfg.has_msa:
        extra = [path / MSA_INDEX_FILE]
        save_file(msa_index_to_hf(params, cfg, dtype), str(extra[0]),
                  metadata={"format": "pt", MSA_METADATA_KEY: json.dumps(msa_settings(cfg))})
    with open(path / CONFIG_FILE, "w") as fh:
        json.dump(cfg.to_hf_config(torch_dtype=dtype), fh, indent=2)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, t in tensors.items():
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    for stale in [path / WEIGHTS_FILE, path / INDEX_FILE, *path.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    meta = {"format": "pt"}
    if len(shards) == 1:
        f = path / WEIGHTS_FILE
        save_file(shards[0], str(f), metadata=meta)
        return [f, *extra]
    files, weight_map = [], {}
    for j, shard in enumerate(shards):
        f = path / f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(f), metadata=meta)
        files.append(f)
        weight_map.update({k: f.name for k in shard})
    total = sum(t.nbytes for t in tensors.values())
    with open(path / INDEX_FILE, "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)
    return files + extra
