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

The estimates can be saved (:func:`save_indices`, the CLI below) as a small ``.npz`` of the
vertical-slash indices (a few hundred KB at 128K) with the provenance of the estimate, and timed
later from that file (``benchmarks/kernels.py --model-index FILE``) without the checkpoint: a GPU
session that trains a model keeps its index, and any later session times the same index.

    python -m benchmarks.model_index --ckpt RUN/checkpoints --tokens train_tokens.npy --seq-len 131072 \
        --layers 1,6,11 --budgets ';last_q=1024,vertical_min=1024,slash_max=256' --out model_index.npz
"""

from __future__ import annotations

import dataclasses
import json
import sys

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


def model_vs_indices(ckpt: str, tokens_path: str, seq_len: int, *, layers=None, offset: int = 0,
                     backend: str | None = None, block_size: int = 64, budgets=({},)) -> list:
    """``[(layer, budget, VerticalSlashIndex [1, Hq, ...])]``: MTraining's estimate on the model's own q/k
    for every layer and budget (module docstring). ``layers``: layer numbers (default: the model's
    ``mtraining`` layers, else all); ``backend``: the attention backend of every layer while reading
    q/k (default: the model's own); ``budgets``: dicts of
    :class:`~mtraining_jax.sparsity.config.SparsityConfig` fields replacing the model's (``{}``: its
    own), e.g. the larger budgets that reach a recall target, to time what they cost the kernels."""
    from mtraining_jax.eval.checkpoints import load_for_eval
    from mtraining_jax.eval.recall import layer_qk
    from mtraining_jax.mesh import make_mesh
    from mtraining_jax.sparsity.estimate import estimate_index

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
    return [(int(layer), dict(budget),
             estimate_index(qs[layer].astype(jnp.float32), ks[layer].astype(jnp.float32), pos, sp))
            for layer in layers for budget, sp in zip(budgets, configs)]


def step_entries(entries, seq_len: int, heads: int, block_size: int = 64) -> list:
    """``[(layer, budget, StepIndex [1, heads, ...], density of the causal pairs per model head)]`` of the
    ``(layer, budget, VerticalSlashIndex)`` entries: the kernels' operand with the heads repeated."""
    from mtraining_jax.sparsity.convert import convert_step
    from mtraining_jax.sparsity.metrics import density

    pos = jnp.arange(seq_len, dtype=jnp.int32)
    return [(layer, budget, cycle_heads(convert_step(vs, pos, pos, seq_len=seq_len, block_size=block_size), heads),
             np.asarray(density(vs, seq_len, block_size))[0]) for layer, budget, vs in entries]


def model_step_indices(ckpt: str, tokens_path: str, seq_len: int, heads: int, *, block_size: int = 64,
                       **kw) -> list:
    """:func:`step_entries` of :func:`model_vs_indices` (same keywords)."""
    return step_entries(model_vs_indices(ckpt, tokens_path, seq_len, block_size=block_size, **kw), seq_len, heads,
                        block_size)


_FIELDS = ("v_idx", "v_count", "s_idx", "s_count")


def save_indices(path: str, entries, meta: dict) -> str:
    """Write the ``(layer, budget, VerticalSlashIndex)`` entries and ``meta`` (JSON-able: at least
    ``seq_len`` and ``block_size``; the estimate's provenance) to the ``.npz`` file ``path``."""
    for key in ("seq_len", "block_size"):
        if not isinstance(meta.get(key), int):
            raise ValueError(f"save_indices: meta[{key!r}] must be an int, got {meta.get(key)!r}")
    arrays = {f"e{i}_{f}": np.asarray(getattr(vs, f)) for i, (_, _, vs) in enumerate(entries) for f in _FIELDS}
    meta = dict(meta, entries=[{"layer": int(layer), "budget": dict(budget)} for layer, budget, _ in entries])
    np.savez_compressed(path, meta=np.asarray(json.dumps(meta)), **arrays)
    return path


def load_indices(path: str) -> tuple:
    """``(entries, meta)`` of a :func:`save_indices` file; a ``ValueError`` naming ``path`` when it is not one."""
    from mtraining_jax.sparsity.index import VerticalSlashIndex

    try:
        z = np.load(path, allow_pickle=False)
        if not hasattr(z, "files"):  # np.load gives an ndarray for a .npy file
            raise ValueError("not an .npz archive")
        with z:
            meta = json.loads(str(z["meta"]))
            entries = [(e["layer"], e["budget"], VerticalSlashIndex(*(jnp.asarray(z[f"e{i}_{f}"]) for f in _FIELDS)))
                       for i, e in enumerate(meta["entries"])]
    except (OSError, KeyError, ValueError, json.JSONDecodeError) as e:
        raise ValueError(f"{path!r} is not a model index file (benchmarks/model_index.py --out): "
                         f"{type(e).__name__}: {e}") from None
    return entries, meta


def saved_seq_len(path: str) -> int:
    """The sequence length of a :func:`save_indices` file (its ``meta``)."""
    return int(load_indices(path)[1]["seq_len"])


def model_seqs(model: dict | None, seqs) -> list:
    """The lengths of ``seqs`` that get the ``model`` family: all of them for a checkpoint (it estimates
    at any length), only the saved length for a ``model['index']`` file (``[]`` when none of ``seqs`` is
    it: ``benchmarks/kernels.py`` refuses that before any timing)."""
    if not model:
        return []
    if not model.get("index"):
        return list(seqs)
    n = saved_seq_len(model["index"])
    return [n] if n in seqs else []


def model_entries(seq_len: int, heads: int, block_size: int, model: dict) -> list:
    """:func:`step_entries` for ``benchmarks/kernels.py``: from ``model['index']`` (a saved file, whose
    length and block size must be the benchmark's) or from a checkpoint (:func:`model_step_indices`)."""
    if model.get("index"):
        entries, meta = load_indices(model["index"])
        if (meta["seq_len"], meta["block_size"]) != (seq_len, block_size):
            raise ValueError(f"{model['index']!r} holds indices of S={meta['seq_len']}, block {meta['block_size']}; "
                             f"the benchmark times S={seq_len}, block {block_size}")
        layers = model.get("layers")
        missing = sorted(set(layers or []) - {e[0] for e in entries})
        if missing:
            raise ValueError(f"{model['index']!r} holds layers {sorted({e[0] for e in entries})}, not {missing}")
        return step_entries([e for e in entries if layers is None or e[0] in layers], seq_len, heads, block_size)
    kw = {k: v for k, v in model.items() if k != "index"}
    return model_step_indices(seq_len=seq_len, heads=heads, block_size=block_size, **kw)


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
    ap.add_argument("--model-index", help="instead of --model-ckpt / --model-tokens: a saved index file "
                    "(python -m benchmarks.model_index --out); --model-layers picks among its layers")


def model_options(a, ap) -> dict | None:
    """The keywords of :func:`model_step_indices` the ``--model-*`` flags ask for (``None``: no model family)."""
    if bool(a.model_ckpt) != bool(a.model_tokens):
        ap.error("--model-ckpt and --model-tokens go together")
    index = getattr(a, "model_index", None)
    if index and a.model_ckpt:
        ap.error("--model-index replaces --model-ckpt / --model-tokens: give one or the other")
    if index and a.model_budgets != [{}]:
        ap.error("--model-budgets applies to --model-ckpt; a --model-index file holds the budgets it was saved with")
    if not (a.model_ckpt or index):
        return None
    try:
        layers = [int(x) for x in a.model_layers.split(",") if x] or None
    except ValueError:
        ap.error(f"--model-layers: comma-separated layer numbers, got {a.model_layers!r}")
    if index:
        return dict(index=index, layers=layers)
    return dict(ckpt=a.model_ckpt, tokens_path=a.model_tokens, layers=layers, budgets=a.model_budgets)


def main(argv=None) -> int:
    """Estimate a trained model's indices and save them (module docstring); prints each entry's density."""
    import argparse

    from benchmarks._driver import provenance
    from benchmarks.quality_probes import parse_budgets

    ap = argparse.ArgumentParser(description="save the vertical-slash indices a trained model estimates")
    ap.add_argument("--ckpt", required=True, help="a load_for_eval path (a training run's checkpoints, ...)")
    ap.add_argument("--tokens", required=True, help="a flat .npy token file (e.g. the quality study's train_tokens.npy)")
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--offset", type=int, default=0, help="first token of the window in --tokens")
    ap.add_argument("--layers", default="", help="comma-separated layers (default: the model's mtraining layers, "
                    "else all)")
    ap.add_argument("--budgets", type=parse_budgets, default=[{}], help="';'-separated SparsityConfig budgets (an "
                    "empty one: the model's own)")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--out", required=True, help=".npz path")
    a = ap.parse_args(argv)
    try:
        layers = [int(x) for x in a.layers.split(",") if x] or None
    except ValueError:
        ap.error(f"--layers: comma-separated layer numbers, got {a.layers!r}")
    from mtraining_jax.sparsity.metrics import density

    try:
        entries = model_vs_indices(a.ckpt, a.tokens, a.seq_len, layers=layers, offset=a.offset,
                                   block_size=a.block_size, budgets=a.budgets)
    except ValueError as e:
        print(f"model_index: {e}", file=sys.stderr)
        return 1
    meta = dict(provenance(argv), seq_len=a.seq_len, block_size=a.block_size, ckpt=a.ckpt, tokens=a.tokens,
                offset=a.offset)
    for layer, budget, vs in entries:
        den = np.asarray(density(vs, a.seq_len, a.block_size))[0]
        print(f"layer {layer} budget {budget or 'own'}: density mean {den.mean():.4f} "
              f"(heads {den.min():.4f}..{den.max():.4f})")
    print(save_indices(a.out, entries, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
