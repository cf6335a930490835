"""``ModelConfig``: the frozen, validated description of a Qwen2-family decoder.

Architecture (shapes, RoPE, norms) and execution choices (attention backend per layer, remat
policy, scan vs Python loop, dtypes); built from a YAML under ``configs/model/``
(:meth:`ModelConfig.from_yaml`) or a Hugging Face ``config.json`` dict
(:meth:`ModelConfig.from_hf_config`, written back by :meth:`ModelConfig.to_hf_config`). Every
inconsistency is a ``ValueError`` naming the field and the value, at construction.

Per-layer attention backends (MTraining keeps a few dense layers, §4): layer ``i`` uses
``attention_backends[i]`` when given, else ``dense_backend`` when ``i in dense_layers``, else
``attention_backend``. ``dense_backend=None`` is the dense counterpart of ``attention_backend``
(``ring`` for ``mtraining`` and ``msa``, the backend itself otherwise).

``ring``: the :class:`~mtraining_jax.ring.config.RingOptions` of every ring of the model (YAML
``ring: {...}``, ``model.ring.<field>=...``). ``ring_order`` and ``attention_impl`` are older names
of ``ring.ring_order`` / ``ring.impl``: moved into ``ring`` (read back as ``None``); a ``ValueError``
when ``ring`` sets the same option to another value.

``msa`` (``msa`` layers, :mod:`mtraining_jax.attention.msa`): ``None`` or a mapping with the keys of
:data:`MSA_DEFAULTS` — ``index_dim`` (``d_idx``), ``top_k`` (blocks per query block and KV group,
the local block included), ``block_size`` (64, the kernels' tile), ``recall_blocks`` (rows sampled
for the recall metric), ``pooling`` (``mean`` or ``max``), ``selection`` (``causal``: a query block's
first row ranks its candidate blocks; ``block_mean``: all its rows, a look-ahead kept for earlier
runs; :mod:`mtraining_jax.sparsity.msa_select`). When any layer is ``msa``, EVERY layer
carries the index branch (``index_q [hidden, Hkv * d_idx]``, ``index_k [hidden, d_idx]``; the layers
are one stacked module); non-``msa`` layers do not use it.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Mapping

from mtraining_jax.attention.backends import BACKENDS, SPARSE_BACKENDS
from mtraining_jax.ring.config import RingOptions

REMAT_POLICIES: tuple[str, ...] = ("none", "full", "save_attn", "selective")
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16", "float64")
HF_MODEL_TYPES: tuple[str, ...] = ("qwen2",)
HF_ARCHITECTURES: tuple[str, ...] = ("Qwen2ForCausalLM",)
# rope_scaling keys accepted for "yarn" (transformers' _validate_yarn_rope_parameters).
_YARN_KEYS = {
    "rope_type", "type", "factor", "original_max_position_embeddings", "attention_factor",
    "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate", "rope_theta",
}


#: older top-level names of ring options: ``{ModelConfig field: RingOptions field}``
RING_ALIASES: dict[str, str] = {"ring_order": "ring_order", "attention_impl": "impl"}
MSA_DEFAULTS: dict[str, Any] = {"index_dim": 64, "top_k": 16, "block_size": 64, "recall_blocks": 1, "pooling": "mean",
                                "selection": "causal"}


def _dense_counterpart(backend: str) -> str:
    return "ring" if backend in SPARSE_BACKENDS else backend


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Qwen2-family decoder configuration (see module docstring).

    Shapes: ``head_dim`` defaults to ``hidden_size // num_heads``; query heads form
    ``num_kv_heads`` contiguous groups (GQA). ``rope_scaling`` is ``None`` or a dict with Hugging
    Face keys (only ``rope_type: yarn`` / ``default`` are supported).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 32768
    rope_scaling: Mapping[str, Any] | None = None
    initializer_range: float = 0.02
    # execution
    attention_backend: str = "reference"
    dense_layers: tuple[int, ...] = ()
    dense_backend: str | None = None
    attention_backends: tuple[str, ...] | None = None
    # every ring's options (RingOptions or a mapping of its fields; a RingOptions after construction)
    ring: RingOptions | Mapping[str, Any] | None = None
    # older names of ring.ring_order / ring.impl (moved into ``ring``; None after construction)
    ring_order: str | None = None
    attention_impl: str | None = None
    # MTraining sparse attention (backend "mtraining"): SparsityConfig fields (scalars or per-head
    # lists) and the sequence layout the data loader applies (block_striped, zigzag, contiguous).
    sparsity: Mapping[str, Any] | None = None
    layout: str = "block_striped"
    # MiniMax Sparse Attention (backend "msa"): keys of MSA_DEFAULTS (see module docstring).
    msa: Mapping[str, Any] | None = None
    remat: str = "none"
    # remat "selective": these layers run as "save_attn", the others as "full" (None: the
    # remat_save_fraction share of the layers, see ModelConfig.remat_saved_layers).
    remat_save_layers: tuple[int, ...] | None = None
    remat_save_fraction: float = 0.5
    scan_layers: bool = True
    dtype: str = "float32"
    param_dtype: str = "float32"
    name: str = ""

    def __post_init__(self):
        if self.head_dim is None:
            if self.num_heads and self.hidden_size % self.num_heads:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) is not divisible by num_heads ({self.num_heads}); "
                    "set head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // max(self.num_heads, 1))
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{f} must be a positive integer, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be positive, got {self.rms_norm_eps}")
        for f in ("dtype", "param_dtype"):
            if getattr(self, f) not in DTYPES:
                raise ValueError(f"{f} must be one of {DTYPES}, got {getattr(self, f)!r}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat must be one of {REMAT_POLICIES}, got {self.remat!r}")
        self._check_selective_remat()
        self._fold_ring_options()
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {BACKENDS}, got {self.attention_backend!r}")
        if self.dense_backend is not None and self.dense_backend not in BACKENDS:
            raise ValueError(f"dense_backend must be one of {BACKENDS}, got {self.dense_backend!r}")
        object.__setattr__(self, "dense_layers", tuple(int(i) for i in self.dense_layers))
        bad = [i for i in self.dense_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"dense_layers {bad} out of range for num_layers={self.num_layers}")
        if self.attention_backends is not None:
            object.__setattr__(self, "attention_backends", tuple(self.attention_backends))
            if len(self.attention_backends) != self.num_layers:
                raise ValueError(
                    f"attention_backends has {len(self.attention_backends)} entries, "
                    f"num_layers is {self.num_layers}"
                )
            bad_b = [b for b in self.attention_backends if b not in BACKENDS]
            if bad_b:
                raise ValueError(f"attention_backends entries {bad_b} not in {BACKENDS}")
        if self.rope_scaling is not None:
            object.__setattr__(self, "rope_scaling", _check_rope_scaling(dict(self.rope_scaling)))
        if self.sparsity is not None:
            object.__setattr__(self, "sparsity", {k: (list(v) if isinstance(v, (list, tuple)) else v)
                                                  for k, v in dict(self.sparsity).items()})
        if "mtraining" in self.layer_backends:
            self.mtraining_config()  # validates sparsity keys/values and the layout, naming them
        if self.msa is not None:
            object.__setattr__(self, "msa", dict(self.msa))
            unknown = sorted(set(self.msa) - set(MSA_DEFAULTS))
            if unknown:
                raise ValueError(f"unknown msa keys {unknown}; known keys: {sorted(MSA_DEFAULTS)}")
            d = self.msa.get("index_dim", MSA_DEFAULTS["index_dim"])
            if not isinstance(d, int) or isinstance(d, bool) or d < 1:
                raise ValueError(f"msa index_dim must be a positive integer, got {d!r}")
        if self.has_msa:
            if "mtraining" in self.layer_backends:
                raise ValueError(f"msa and mtraining layers in one model are not supported (their per-layer "
                                 f"statistics differ); layer backends: {list(self.layer_backends)}")
            self.msa_config()  # validates top_k, block_size, recall_blocks and the layout

    def _fold_ring_options(self):
        """``ring`` as :class:`RingOptions`, the older top-level names moved into it."""
        ring = {} if self.ring is None else self.ring
        given = dict(ring) if isinstance(ring, Mapping) else None  # a mapping's keys, to find conflicts
        for alias, key in RING_ALIASES.items():
            value = getattr(self, alias)
            if value is None:
                continue
            try:
                RingOptions(**{key: value})
            except ValueError as e:  # name the key the user wrote
                raise ValueError(f"{alias}{str(e)[len(key):]}") from None
            if given is None and isinstance(ring, RingOptions):
                ring = ring.replace(**{key: value})
            elif given is not None:
                if key in given and given[key] != value:
                    raise ValueError(f"{alias}={value!r} and ring.{key}={given[key]!r} disagree; {alias} is the "
                                     f"older name of ring.{key}: set one")
                given[key] = value
            object.__setattr__(self, alias, None)
        object.__setattr__(self, "ring", RingOptions.from_mapping(ring if given is None else given))

    def __hash__(self):  # rope_scaling is a dict: hash the canonical JSON form (NNX keeps cfg static)
        import json

        return hash(json.dumps(self.to_dict(), sort_keys=True))

    # ----------------------------------------------------------------- derived
    @property
    def num_groups(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    def layer_backend(self, layer: int) -> str:
        """Attention backend of decoder layer ``layer`` (see module docstring)."""
        if self.attention_backends is not None:
            return self.attention_backends[layer]
        if layer in self.dense_layers:
            return self.dense_backend or _dense_counterpart(self.attention_backend)
        return self.attention_backend

    @property
    def layer_backends(self) -> tuple[str, ...]:
        return tuple(self.layer_backend(i) for i in range(self.num_layers))

    @property
    def remat_saved_layers(self) -> tuple[int, ...]:
        """Layers whose attention residuals are kept under ``remat: selective`` (sorted; empty for the
        other policies): ``remat_save_layers`` when given, else ``round(remat_save_fraction *
        num_layers)`` layers, the dense-attention layers first (the most expensive forward to
        recompute), then the ``mtraining`` layers, each group in layer order (few contiguous runs: each
        run of one (backend, policy) is one layer scan).
        """
        if self.remat != "selective":
            return ()
        if self.remat_save_layers is not None:
            return tuple(sorted(set(self.remat_save_layers)))
        n = int(round(self.remat_save_fraction * self.num_layers))
        order = sorted(range(self.num_layers), key=lambda i: (self.layer_backend(i) == "mtraining", i))
        return tuple(sorted(order[:n]))

    def layer_remat(self, layer: int) -> str:
        """The remat policy decoder layer ``layer`` runs under: ``cfg.remat``, except under
        ``selective``: ``save_attn`` for :attr:`remat_saved_layers`, ``full`` for the rest."""
        if self.remat != "selective":
            return self.remat
        return "save_attn" if layer in self.remat_saved_layers else "full"

    @property
    def layer_remats(self) -> tuple[str, ...]:
        return tuple(self.layer_remat(i) for i in range(self.num_layers))

    def _check_selective_remat(self):
        if self.remat_save_layers is not None:
            layers = tuple(self.remat_save_layers)
            if any(isinstance(i, bool) or not isinstance(i, int) for i in layers):
                raise ValueError(f"remat_save_layers must be a list of layer indices, got {list(layers)!r}")
            object.__setattr__(self, "remat_save_layers", layers)
            bad = [i for i in layers if not 0 <= i < self.num_layers]
            if bad:
                raise ValueError(f"remat_save_layers {bad} out of range for num_layers={self.num_layers}")
            if self.remat != "selective":
                raise ValueError(f"remat_save_layers is set ({list(layers)}) but remat is {self.remat!r}; "
                                 "it applies to remat: selective only")
        f = self.remat_save_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f <= 1.0:
            raise ValueError(f"remat_save_fraction must be a number in [0, 1], got {f!r}")

    def mtraining_config(self):
        """The :class:`~mtraining_jax.attention.mtraining.MTrainingConfig` of the ``mtraining`` layers."""
        from mtraining_jax.attention.mtraining import MTrainingConfig
        from mtraining_jax.sparsity.config import SparsityConfig

        known = {f.name for f in dataclasses.fields(SparsityConfig)}
        unknown = sorted(set(self.sparsity or {}) - known)
        if unknown:
            raise ValueError(f"unknown sparsity keys {unknown}; known keys: {sorted(known)}")
        return MTrainingConfig(sparsity=SparsityConfig(**(self.sparsity or {})), layout=self.layout, ring=self.ring)

    @property
    def has_msa(self) -> bool:
        """Whether any layer uses ``msa`` (then every layer carries the index branch)."""
        return "msa" in self.layer_backends

    @property
    def msa_index_dim(self) -> int:
        return int((self.msa or {}).get("index_dim", MSA_DEFAULTS["index_dim"]))

    def msa_config(self):
        """The :class:`~mtraining_jax.attention.msa.MSAConfig` of the ``msa`` layers."""
        from mtraining_jax.attention.msa import MSAConfig

        m = {**MSA_DEFAULTS, **(self.msa or {})}
        return MSAConfig(top_k=m["top_k"], block_size=m["block_size"], recall_blocks=m["recall_blocks"],
                         pooling=m["pooling"], selection=m["selection"], layout=self.layout, ring=self.ring)

    def attention_spec(self, backend: str) -> dict[str, Any]:
        """The keywords of :func:`mtraining_jax.attention.dispatch.attention` for a layer of ``backend``
        (besides the call's ``mesh``, ``segment_ids`` and the ``msa`` flags): ``ring`` layers get the
        ring options (for a dense ring: :meth:`~RingOptions.for_dense`), ``mtraining`` / ``msa``
        layers their config, which holds them; ``reference`` / ``cudnn`` nothing."""
        if backend == "ring":
            return {"backend": backend, "ring": self.ring.for_dense()}
        if backend == "mtraining":
            return {"backend": backend, "mtraining": self.mtraining_config()}
        if backend == "msa":
            return {"backend": backend, "msa": self.msa_config()}
        return {"backend": backend}

    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * self.num_heads * d + self.num_heads * d  # q
        attn += 2 * (h * self.num_kv_heads * d + self.num_kv_heads * d)  # k, v
        attn += self.num_heads * d * h  # o
        mlp = 3 * h * self.intermediate_size
        layer = attn + mlp + 2 * h
        if self.has_msa:
            layer += h * (self.num_kv_heads + 1) * self.msa_index_dim  # index_q, index_k
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + emb + h

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # --------------------------------------------------------------------- I/O
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown ModelConfig keys {unknown}; known keys: {sorted(names)}")
        d = dict(d)
        for k in ("dense_layers", "attention_backends", "remat_save_layers"):
            if d.get(k) is not None:
                d[k] = tuple(d[k])
        if "rope_theta" in d:
            d["rope_theta"] = float(d["rope_theta"])
        if "rms_norm_eps" in d:
            d["rms_norm_eps"] = float(d["rms_norm_eps"])
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)  # ring: a dict of RingOptions fields
        for alias in RING_ALIASES:  # moved into ring on construction
            if d[alias] is None:
                del d[alias]
        for k in ("dense_layers", "attention_backends", "remat_save_layers"):
            if d[k] is not None:
                d[k] = list(d[k])
        if d["rope_scaling"] is not None:
            d["rope_scaling"] = dict(d["rope_scaling"])
        return d

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides) -> "ModelConfig":
        """Load ``path`` (a mapping of ModelConfig fields); ``overrides`` replace keys."""
        import yaml

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"model config file not found: {path}")
        with open(path) as f:
            d = yaml.safe_load(f) or {}
        if not isinstance(d, dict):
            raise ValueError(f"{path}: expected a mapping of ModelConfig fields, got {type(d).__name__}")
        d.update(overrides)
        d.setdefault("name", path.stem)
        return cls.from_dict(d)

    def to_yaml(self, path: str | Path) -> None:
        import yaml

        with open(path, "w") as f:
            yaml.safe_dump(self.to_dict(), f, sort_keys=False)

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any], **overrides) -> "ModelConfig":
        """Build from a transformers ``Qwen2Config`` dict (``config.json``).

        Accepts both the transformers-4 keys (``rope_theta`` + ``rope_scaling``) and the
        transformers-5 ``rope_parameters`` dict. ``overrides`` set execution fields (backend,
        remat, dtypes...). Unknown ``model_type``/``architectures`` and sliding-window attention
        raise ``ValueError``.
        """
        check_hf_architecture(hf)
        if hf.get("use_sliding_window", False):
            raise ValueError("use_sliding_window=true (sliding-window attention) is not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf.get('hidden_act')!r} is not supported (Qwen2 uses silu)")
        rope_theta = hf.get("rope_theta")
        scaling = hf.get("rope_scaling")
        params = hf.get("rope_parameters")
        if params:  # transformers >= 5
            params = dict(params)
            rope_theta = params.pop("rope_theta", rope_theta)
            params.pop("partial_rotary_factor", None)
            rtype = params.get("rope_type", params.get("type", "default"))
            if scaling is None and rtype != "default":
                scaling = params
        if scaling is not None:
            scaling = dict(scaling)
            scaling.pop("rope_theta", None)
            if scaling.get("rope_type", scaling.get("type", "default")) == "default":
                scaling = None
        if scaling is not None and "original_max_position_embeddings" not in scaling:
            # transformers' standardize_rope_params: falls back to max_position_embeddings
            scaling["original_max_position_embeddings"] = hf.get(
                "original_max_position_embeddings", hf.get("max_position_embeddings", 32768)
            )

        def num(key, default=None, kind=int):  # config.json values: one line naming key and value
            v = hf.get(key, default)
            try:
                if isinstance(v, bool) or (kind is int and isinstance(v, float) and not v.is_integer()):
                    raise TypeError
                return kind(v)
            except (TypeError, ValueError):
                what = "an integer" if kind is int else "a number"
                raise ValueError(f"config.json {key} must be {what}, got {v!r}") from None

        kw = dict(
            vocab_size=num("vocab_size"),
            hidden_size=num("hidden_size"),
            intermediate_size=num("intermediate_size"),
            num_layers=num("num_hidden_layers"),
            num_heads=num("num_attention_heads"),
            num_kv_heads=num("num_key_value_heads") if hf.get("num_key_value_heads") else num("num_attention_heads"),
            head_dim=hf.get("head_dim"),
            rope_theta=float(rope_theta if rope_theta is not None else 10_000.0),
            rms_norm_eps=num("rms_norm_eps", 1e-6, float),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=num("max_position_embeddings", 32768),
            rope_scaling=scaling,
            initializer_range=num("initializer_range", 0.02, float),
            name=str(hf.get("_name_or_path", "") or ""),
        )
        kw.update(overrides)
        return cls(**kw)

    def to_hf_config(self, torch_dtype: str = "float32") -> dict[str, Any]:
        """A transformers ``Qwen2Config`` dict (``config.json``) in the hub's (v4) key style,
        which transformers 4 and 5 both read."""
        return {
            "architectures": list(HF_ARCHITECTURES),
            "model_type": "qwen2",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "initializer_range": self.initializer_range,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else dict(self.rope_scaling),
            "tie_word_embeddings": self.tie_word_embeddings,
            "use_sliding_window": False,
            "attention_dropout": 0.0,
            "torch_dtype": torch_dtype,
            "dtype": torch_dtype,
            "use_cache": True,
        }


def check_hf_architecture(hf: Mapping[str, Any]) -> None:
    """``ValueError`` unless ``config.json`` describes a Qwen2 causal LM."""
    mt = hf.get("model_type")
    if mt not in HF_MODEL_TYPES:
        raise ValueError(f"unsupported model_type {mt!r} in config.json; supported: {HF_MODEL_TYPES}")
    archs = hf.get("architectures") or list(HF_ARCHITECTURES)
    bad = [a for a in archs if a not in HF_ARCHITECTURES]
    if bad:
        raise ValueError(f"unsupported architectures {bad} in config.json; supported: {HF_ARCHITECTURES}")


def _check_rope_scaling(s: dict) -> dict:
    rtype = s.get("rope_type", s.get("type"))
    if rtype == "default":
        return s
    if rtype != "yarn":
        raise ValueError(f"rope_scaling type {rtype!r} is not supported (only 'yarn')")
    s["rope_type"] = "yarn"
    s.pop("type", None)
    unknown = sorted(set(s) - _YARN_KEYS)
    if unknown:
        raise ValueError(f"unknown yarn rope_scaling keys {unknown}")
    for key in ("factor", "original_max_position_embeddings"):
        if s.get(key) is None:
            raise ValueError(f"yarn rope_scaling needs {key!r}, got {s.get(key)!r}")
    if not (isinstance(s["factor"], (int, float)) and math.isfinite(s["factor"]) and s["factor"] > 0):
        raise ValueError(f"yarn rope_scaling factor must be a positive number, got {s['factor']!r}")
    return s
