"""Model construction and the training-state pytree.

The NNX model is split once into a static ``graphdef``, its parameters (as a plain nested dict
of arrays — what optax and orbax handle best) and any non-parameter state. Inside ``jit`` the
module is rebuilt from them with :func:`bind`. The training state is the dict
``{"step": int32[], "params": {...}, "opt_state": optax state, "rng": uint32 key data}``,
replicated over the mesh or, with ``fsdp``, sharded over all devices (FSDP / ZeRO-3; the rule is
in :mod:`mtraining_jax.train.sharding`).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mtraining_jax.train.config import ModelSection
from mtraining_jax.train.offload import with_offload
from mtraining_jax.train.sharding import state_shardings


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
    """``(model_class, model_config)`` for the ``model`` section of a training config. Errors are
    one ``ValueError`` with the dotted key (``model.hidden_size must be ...``)."""
    cls = import_object(section.cls)
    cfg_cls = getattr(cls, "config_class", None)
    if cfg_cls is None:
        from mtraining_jax.model.config import ModelConfig as cfg_cls
    fields = dict(section.fields)
    names = {f.name for f in dataclasses.fields(cfg_cls)} if dataclasses.is_dataclass(cfg_cls) else None
    if names is not None:
        unknown = sorted(set(fields) - names)
        if unknown:
            raise ValueError(f"unknown config key(s) {', '.join('model.' + k for k in unknown)}; "
                             f"the model section accepts path, cls, init_from and {sorted(names)}")
    try:
        if section.path is not None:
            path = _resolve_path(section.path, config_dir)
            from mtraining_jax.train.config import read_yaml

            base = read_yaml(path, "model.path")  # syntax errors: one line with file and line
            if not isinstance(base, dict):
                raise ValueError(f"model.path {path!r} must hold a mapping of model fields, got {type(base).__name__}")
            if hasattr(cfg_cls, "from_dict"):
                cfg = cfg_cls.from_dict(merge_fields({"name": os.path.splitext(os.path.basename(path))[0], **base},
                                                     fields))
            else:
                cfg = cfg_cls.from_yaml(path, **fields)
        elif hasattr(cfg_cls, "from_dict"):
            cfg = cfg_cls.from_dict(fields)
        else:
            cfg = cfg_cls(**fields)
    except TypeError as e:  # dataclass constructor: unknown / missing field
        raise ValueError(f"bad model config: {e}") from None
    except ValueError as e:
        raise ValueError(_dotted_model_message(str(e), names or ())) from None
    return cls, cfg


def merge_fields(base: dict, over) -> dict:
    """``base`` with ``over``'s keys set, recursively where both values are mappings (a training
    config's ``model.ring: {impl: xla}`` keeps the model YAML's other ring options)."""
    out = dict(base)
    for k, v in over.items():
        b = out.get(k)
        out[k] = merge_fields(b, v) if isinstance(b, Mapping) and isinstance(v, Mapping) else v
    return out


def _dotted_model_message(msg: str, names) -> str:
    """Prefix a model-config message that starts with a field name (``ring.impl: ...``,
    ``remat must ...``) by ``model.`` (a sparsity field: ``model.sparsity.``; an ``msa <key>``
    message: ``model.msa.<key>``); unknown ``ring`` / ``sparsity`` / ``msa`` keys are named
    ``model.<section>.<key>``."""
    import re

    from mtraining_jax.model.config import MSA_DEFAULTS

    head = msg.split(" ", 1)[0]
    if head == "msa" and msg.count(" ") >= 2 and msg.split(" ", 2)[1] in MSA_DEFAULTS:
        return f"model.msa.{msg.split(' ', 1)[1]}"
    if re.split(r"[ =:.]", msg, maxsplit=1)[0] in names:
        return "model." + msg
    m = re.fullmatch(r"unknown (sparsity|msa|ring) keys (\[.*?\]); known keys: (\[.*\])", msg)
    if m:
        keys = ", ".join(f"model.{m.group(1)}.{k}" for k in re.findall(r"'([^']*)'", m.group(2)))
        return f"unknown config key(s) {keys}; model.{m.group(1)} accepts {m.group(3)}"
    field = re.split(r"[ =]", msg, maxsplit=1)[0]
    if field in _sparsity_fields():
        return "model.sparsity." + msg
    if msg.startswith(("missing", "unknown ModelConfig keys")):
        return "model: " + msg
    return msg if msg.startswith("model") else f"model config: {msg}"


def _sparsity_fields() -> set:
    try:
        from mtraining_jax.sparsity.config import SparsityConfig
    except ImportError:  # pragma: no cover
        return set()
    return {f.name for f in dataclasses.fields(SparsityConfig)}


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


def _fresh_state(params, optimizer, seed: int) -> dict:
    return {
        "step": jnp.zeros((), jnp.int32),
        "params": params,
        "opt_state": optimizer.init(params),
        "rng": jax.random.key_data(jax.random.PRNGKey(seed + 1)),
    }


def host_zeros(abstract, shardings):
    """Zero arrays built straight into their (host-memory) ``shardings``, shard by shard from
    numpy: no device buffer on the way (a jitted ``zeros`` would be computed on the device and
    copied out, briefly holding the whole optimizer state there)."""
    def one(x, s):
        shard = np.zeros(s.shard_shape(x.shape), x.dtype)
        return jax.make_array_from_callback(x.shape, s, lambda _: shard)

    return jax.tree.map(one, abstract, shardings)


def _state_builder(fn, shapes, sh, offload: tuple):
    """``fn(*args) -> state`` jitted into the shardings ``sh``. With the optimizer state offloaded,
    its fresh value (AdamW: counts and moments all zero, as ``optimizer.init`` gives; tested) is
    made by :func:`host_zeros` instead and the jitted part builds the rest."""
    if "opt_state" not in offload:
        return jax.jit(fn, out_shardings=sh)
    rest_sh = {k: v for k, v in sh.items() if k != "opt_state"}
    rest = jax.jit(lambda *a: {k: v for k, v in fn(*a).items() if k != "opt_state"}, out_shardings=rest_sh)

    def build(*args):
        st = rest(*args)
        st["opt_state"] = host_zeros(shapes["opt_state"], sh["opt_state"])
        return {k: st[k] for k in shapes}

    build.shapes = shapes
    return build


def train_state_fn(init_fn, optimizer, mesh: Mesh | None, seed: int, fsdp: bool = False, offload: tuple = ()):
    """A jitted ``() -> {"step", "params", "opt_state", "rng"}`` building the state directly into
    its shardings (replicated, or FSDP-sharded when ``fsdp``; the ``offload`` keys in
    ``pinned_host`` memory; every process computes the same values). ``jax.eval_shape`` of it
    (or its ``shapes``) gives the restore target without allocating anything."""
    fn = lambda: _fresh_state(init_fn(), optimizer, seed)  # noqa: E731
    shapes = jax.eval_shape(fn)
    return _state_builder(fn, shapes, with_offload(state_shardings(shapes, mesh, fsdp), offload), offload)


def train_state_from_params(params, optimizer, mesh: Mesh | None, seed: int, fsdp: bool = False,
                            offload: tuple = ()) -> dict:
    """Step-0 training state around given (pretrained) parameters: fresh optimizer state."""
    fn = lambda p: _fresh_state(p, optimizer, seed)  # noqa: E731
    shapes = jax.eval_shape(fn, params)
    return _state_builder(fn, shapes, with_offload(state_shardings(shapes, mesh, fsdp), offload), offload)(params)


def abstract_train_state(state_fn, mesh: Mesh | None, fsdp: bool = False, offload: tuple = ()):
    """``ShapeDtypeStruct`` pytree of ``state_fn()`` with its shardings (replicated, or FSDP;
    the ``offload`` keys in ``pinned_host`` memory)."""
    shapes = getattr(state_fn, "shapes", None) or jax.eval_shape(state_fn)
    sh = with_offload(state_shardings(shapes, mesh, fsdp), offload)
    if sh is None:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), shapes)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, sh)


def init_train_state(init_fn, optimizer, mesh: Mesh | None, seed: int, fsdp: bool = False, offload: tuple = ()):
    """Initialised training state (see :func:`train_state_fn`)."""
    return train_state_fn(init_fn, optimizer, mesh, seed, fsdp, offload)()


def num_params(params) -> int:
    return int(sum(x.size for x in jax.tree.leaves(params)))


def load_init_params(section: ModelSection, model_cfg, abstract_params, to_global):
    """Pretrained parameters for ``model.init_from`` (``hf:<dir>`` / ``ckpt:<dir>``) as global
    arrays with the shardings of ``abstract_params``. The architecture fields and every shape
    are checked against ``model_cfg`` (errors name the parameter and both shapes); RoPE / YaRN
    settings are ``model_cfg``'s."""
    from mtraining_jax.model.checkpoint import check_shapes, find_model_checkpoint, read_params
    from mtraining_jax.model.config import ModelConfig
    from mtraining_jax.model.hf_io import check_same_architecture, load_hf_params

    kind, where = section.init_source
    try:
        if kind == "hf":
            host = load_hf_params(where, model_cfg)
            check_shapes(jax.tree.map(lambda a: (a.shape, a.dtype), host), abstract_params, where)
            return jax.tree.map(lambda a, t: to_global(a.astype(t.dtype), t.sharding), host, abstract_params)
        ref = find_model_checkpoint(where)
        theirs = ModelConfig.from_yaml(ref.config_file)
        check_same_architecture(theirs, model_cfg, str(ref.config_file))
        if model_cfg.has_msa and not theirs.has_msa:  # continued pretraining of a dense model (MSA paper §4)
            return _dense_into_msa(ref, model_cfg, abstract_params, to_global)
        return read_params(ref, abstract_params)
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"model.init_from={section.init_from!r}: {e}") from None


MSA_INDEX_PARAMS = ("index_q", "index_k")  # the MSA index branch's modules (``model/msa`` layers)


def _dense_into_msa(ref, model_cfg, abstract_params, to_global):
    """A dense checkpoint's weights in an MSA model: every parameter the checkpoint has, read and
    checked as usual; the index branch (:data:`MSA_INDEX_PARAMS`), which a dense model has none of,
    initialised fresh (normal, ``initializer_range``, seeded; the same rule as an HF checkpoint
    without ``msa_index.safetensors``), for the indexer warm-up to train."""
    from mtraining_jax.model.checkpoint import read_params

    def split(tree):  # (tree without the index branch, {path: leaf} of the index branch)
        rest, index = {}, {}
        for k, v in tree.items():
            if k in MSA_INDEX_PARAMS:
                index[k] = v
            elif isinstance(v, dict):
                r, i = split(v)
                rest[k] = r
                if i:
                    index[k] = i
            else:
                rest[k] = v
        return rest, index

    dense_target, index_target = split(abstract_params)
    params = read_params(ref, dense_target)
    rng = np.random.default_rng(0)
    fresh = jax.tree.map(lambda t: to_global(rng.normal(0.0, model_cfg.initializer_range, t.shape).astype(t.dtype),
                                             t.sharding), index_target)

    def merge(a, b):
        return {k: merge(a[k], b[k]) if k in a and k in b else (a[k] if k in a else b[k]) for k in {**a, **b}}

    return merge(params, fresh)
