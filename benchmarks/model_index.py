"""Kernel indices estimated from a trained model's real queries and keys: the ``model`` index family of
``benchmarks/kernels.py`` (issue 34, family (e)), next to the synthetic ones of
``pallas_kernels.testing.index_family``.

A checkpoint (any ``load_for_eval`` path: a training run's checkpoints, ``mtraining-convert`` output, a
Hugging Face directory) reads ``S`` tokens of a token file (``uint16`` / ``int`` ``.npy``, e.g. the
quality study's ``train_tokens.npy``: consecutive 32K training documents); its decoder layers give
the RoPE'd ``q``/``k`` of each layer (:func:`mtraining_jax.eval.recall.layer_qk`); MTraining's
estimate (:func:`mtraining_jax.sparsity.estimate.estimate_index`, the model's own ``sparsity``
budgets) picks the vertical-slash index of each requested layer, and
:func:`mtraining_jax.sparsity.convert.convert_step` turns it into the kernels' ``StepIndex``.

The benchmark's kernels time random ``q``/``k``/``v`` of their own head count: the model's query
heads are repeated cyclically to fill it (head ``h`` gets the model's head ``h mod Hq``), so the
tile pattern of every head is a real one. A model trained at 32K read at 128K positions is past its
training length: its index is what such a model would ask of the kernels when extended, not a
measured 128K-trained pattern.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


def read_tokens(path: str, seq_len: int, offset: int = 0) -> np.ndarray:
    """``int32 [seq_len]``: tokens ``offset .. offset + seq_len`` of the flat ``.npy`` token file ``path``;
    a ``ValueError`` naming the sizes when the file is shorter."""
    toks = np.load(path, mmap_mode="r").reshape(-1)
    if offset < 0 or offset + seq_len > toks.shape[0]:
        raise ValueError(f"{path!r} holds {toks.shape[0]} tokens: no window of {seq_len} at offset {offset}")
    return np.asarray(toks[offset:offset + seq_len], np.int32)


def cycle_heads(index, heads: int):
    """``index`` (a ``StepIndex`` with heads on axis 1) with ``heads`` heads: head ``h`` = head ``h mod Hq``."""
    hq = index.block_count.shape[1]
    pick = np.arange(heads) % hq
    return jax.tree.map(lambda a: jnp.take(a, pick, axis=1), index)


def model_step_indices(ckpt: str, tokens_path: str, seq_len: int, heads: int, *, layers=None, offset: int = 0,
                       backend: str | None = None, block_size: int = 64, budgets=({},)) -> list:
    """``[(layer, budget, StepIndex [1, heads, ...], density of the causal pairs per model head)]`` for
    every layer and budget (module docstring). ``layers``: layer numbers (default: the model's
    ``mtraining`` layers, else all); ``backend``: the attention backend of every layer while reading
    q/k (default: the model's own); ``budgets``: dicts of
    :class:`~mtraining_jax.sparsity.config.SparsityConfig` fields replacing the model's (``{}``: its
    own), e.g. the larger budgets that reach a recall target, to time what they cost the kernels."""
    from mtraining_jax.eval.checkpoints import load_for_eval
    from mtraining_jax.eval.recall import layer_qk
    from mtraining_jax.mesh import make_mesh
    from mtraining_jax.sparsity.convert import convert_step
    from mtraining_jax.sparsity.estimate import estimate_index
    from mtraining_jax.sparsity.metrics import density

    loaded = load_for_eval(ckpt, **({"attention_backend": backend} if backend else {}))
    cfg = loaded.config
    if seq_len > cfg.max_position_embeddings:  # RoPE is computed, not learned: read past the training length
        cfg = dataclasses.replace(cfg, max_position_embeddings=int(seq_len))
    from mtraining_jax.sparsity.config import SparsityConfig

    known = {f.name for f in dataclasses.fields(SparsityConfig)}
    bad = [k for b in budgets for k in b if k not in known]
    if bad:
        raise ValueError(f"budget fields {bad} are not SparsityConfig fields ({sorted(known)})")
    own = dataclasses.replace(cfg.mtraining_config().sparsity, block_size=block_size)
    configs = [dataclasses.replace(own, **b) for b in budgets]
    n = cfg.num_layers
    if layers is None:
        layers = [i for i, b in enumerate(cfg.layer_backends) if b == "mtraining"] or list(range(n))
    bad = [x for x in layers if not 0 <= int(x) < n]
    if bad:
        raise ValueError(f"layers {bad} are not layers of the {n}-layer model at {ckpt!r}")
    tokens = read_tokens(tokens_path, seq_len, offset)
    mesh = make_mesh((1, 1), jax.devices()[:1])  # one device (sparse / ring layers need a mesh)
    qs, ks, _ = layer_qk(cfg, loaded.params, tokens[None], mesh=mesh)
    pos = jnp.arange(seq_len, dtype=jnp.int32)
    out = []
    for layer in layers:
        for budget, sp in zip(budgets, configs):
            vs = estimate_index(qs[layer].astype(jnp.float32), ks[layer].astype(jnp.float32), pos, sp)
            step = convert_step(vs, pos, pos, seq_len=seq_len, block_size=block_size)
            out.append((int(layer), dict(budget), cycle_heads(step, heads),
                        np.asarray(density(vs, seq_len, block_size))[0]))
    return out


def add_model_args(ap) -> None:
    """The ``--model-*`` flags of ``benchmarks/kernels.py`` (read back by :func:`model_options`)."""
    from benchmarks.quality_probes import parse_budgets

    ap.add_argument("--model-ckpt", help="also the indices this trained model estimates on --model-tokens "
                    "(family 'model'; benchmarks/model_index.py), e.g. a quality-study run's checkpoints")
    ap.add_argument("--model-tokens", help="with --model-ckpt: a flat .npy token file (e.g. train_tokens.npy)")
    ap.add_argument("--model-layers", default="", help="with --model-ckpt: comma-separated layers (default: "
                    "the model's mtraining layers, else all)")
    ap.add_argument("--model-budgets", type=parse_budgets, default=[{}], help="with --model-ckpt: ';'-separated "
                    "SparsityConfig budgets (an empty one: the model's own), e.g. ';last_q=1024,vertical_min=1024'")


def model_options(a, ap) -> dict | None:
    """The keywords of :func:`model_step_indices` the ``--model-*`` flags ask for (``None``: no model family)."""
    if bool(a.model_ckpt) != bool(a.model_tokens):
        ap.error("--model-ckpt and --model-tokens go together")
    if not a.model_ckpt:
        return None
    try:
        layers = [int(x) for x in a.model_layers.split(",") if x] or None
    except ValueError:
        ap.error(f"--model-layers: comma-separated layer numbers, got {a.model_layers!r}")
    return dict(ckpt=a.model_ckpt, tokens_path=a.model_tokens, layers=layers, budgets=a.model_budgets)
