"""Index recall on a model's real queries and keys: how much of the true softmax attention mass
the vertical-slash index (MTraining Algorithm 1) keeps, per layer and query head.

:func:`layer_qk` runs the model's decoder layers one by one (same modules and attention backends
as ``Qwen2ForCausalLM.__call__``, sequence in the model's layout and sharded over the mesh) and
returns each layer's RoPE'd ``q [B, S, Hq, D]`` and ``k [B, S, Hkv, D]`` in natural order.
:func:`index_recall` estimates the index from them at each top-p (``vertical_p = slash_p = p``,
the other budgets from the model's ``sparsity`` config) and measures
:func:`~mtraining_jax.sparsity.metrics.recall` (mass kept, mean over sampled query rows) and
:func:`~mtraining_jax.sparsity.metrics.density` (attended fraction of the causal pairs).
Every layer is measured, dense ones included (what the index would keep there).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtraining_jax.eval.predictor import layout_for
from mtraining_jax.mesh import num_cp_ranks
from mtraining_jax.model.config import ModelConfig
from mtraining_jax.model.qwen2 import Qwen2ForCausalLM, attend
from mtraining_jax.sparsity.config import SparsityConfig
from mtraining_jax.sparsity.estimate import estimate_index
from mtraining_jax.sparsity.metrics import density, recall
from mtraining_jax.train.loop import to_global
from mtraining_jax.train.state import bind, split_model
from mtraining_jax.train.step import batch_shardings


def layer_qk(cfg: ModelConfig, params, tokens, mesh=None):
    """``([q per layer], [k per layer], hidden)`` for ``tokens int [B, S]`` (natural order); q/k
    in natural order as device arrays, ``hidden`` the final-normed hidden states (natural order,
    equal to the model's own forward: tested). The program is built once per ``(cfg, mesh)`` and
    compiled once per token shape (:func:`_qk_program`): calls in a loop do not recompile."""
    tokens = np.asarray(tokens, np.int32)
    P_ = 1 if mesh is None else num_cp_ranks(mesh)
    lay = layout_for(cfg, tokens.shape[1], P_)
    tok, pos = lay.permute(tokens, axis=1), lay.perm.astype(np.int32)
    sh = batch_shardings(mesh, False)
    if sh is not None:
        tok, pos = to_global(tok, sh.tokens), to_global(pos, sh.positions)
    qs, ks, h = _qk_program(cfg, mesh)(params, tok, pos)
    nat, dev = jnp.asarray(lay.inverse), jax.devices()[0]

    def natural(a):  # gathered on one device, natural order
        return jnp.take(jax.device_put(a, dev), nat, axis=1)

    return [natural(q) for q in qs], [natural(k) for k in ks], natural(h)


@functools.lru_cache(maxsize=8)
def _qk_program(cfg: ModelConfig, mesh):
    """The jitted ``(params, tokens, positions) -> (qs, ks, hidden)`` of :func:`layer_qk` (layout order)."""
    parts, _ = split_model(Qwen2ForCausalLM, cfg, 0)
    backends = cfg.layer_backends

    def run(params, tok, pos):
        model = bind(parts, params)
        x = model.embed_tokens(tok).astype(jnp.dtype(cfg.dtype))
        cos, sin = model.rope(pos)
        graphdef, stacked = nnx.split(model.layers)
        qs, ks = [], []
        for i, backend in enumerate(backends):
            layer = nnx.merge(graphdef, jax.tree.map(lambda t: t[i], stacked))
            q, k, v, *index = layer.attention_inputs(x, cos, sin, backend)
            extra = dict(msa_index=index[0], msa_metrics=False) if index else {}
            o, _ = attend(q, k, v, pos, mesh=mesh, **cfg.attention_spec(backend), **extra)
            x = layer.finish(x, o)
            qs.append(q)
            ks.append(k)
        return qs, ks, model.norm(x)

    return jax.jit(run)


_estimate = jax.jit(estimate_index, static_argnums=3)


def sparsity_for(cfg: ModelConfig, p: float) -> SparsityConfig:
    """The model's sparsity budgets with ``vertical_p = slash_p = p``."""
    return dataclasses.replace(cfg.mtraining_config().sparsity, vertical_p=float(p), slash_p=float(p))


def index_recall(cfg: ModelConfig, params, tokens, ps: Sequence[float] = (0.9, 0.5), mesh=None,
                 num_rows: int = 512, qk=None, budgets: dict | None = None) -> dict:
    """Recall and density per layer and head at each ``p`` (see module docstring).

    Returns JSON: ``{"p": [...], "seq_len", "rows", "backends": [per layer], "recall": {p: [L][H]},
    "density": {p: [L][H]}, "mean_recall": {p}, "min_recall": {p}, "mean_density": {p},
    "window_recall": {p: [L][H]}, "mean_window_recall": {p}, "vertical_needed", "slash_needed",
    "vertical_capped", "slash_capped": {p: [L][H]}, "mean_vertical_needed", ...: {p}}`` (``p`` keys
    formatted ``"%g"``; values
    averaged over the batch). ``window_recall``: the recall on the estimate's own observation window (the
    last ``last_q`` rows; ``window="sequence"`` only, else absent), which the top-p budgets cover to at least
    ``p`` unless a cap (``vertical_max``, ``slash_max``) binds: recall at ``p`` on the other rows below it is
    the window's pattern not holding for them, not the budget. Which budget binds: the index is estimated
    again without the caps (``vertical_max`` = S, ``slash_max`` = every block diagonal; the capped index
    is a prefix of it), and ``vertical_needed`` / ``slash_needed`` ``{p: [L][H]}`` are its counts (the
    lines the window's top-p asks for, batch mean), ``vertical_capped`` / ``slash_capped`` the share of
    the batch where that exceeds the cap (means over layers and heads: ``mean_...``). ``qk``: ``(qs, ks)``
    of :func:`layer_qk` already computed (then ``params``, ``tokens`` and ``mesh`` are not used). ``budgets``: other
    :class:`~mtraining_jax.sparsity.config.SparsityConfig` fields replaced in every estimate (e.g.
    ``{"vertical_max": 16384, "slash_max": 256, "last_q": 256}``: a budget sweep), recorded as
    ``"budgets"``; ``ValueError`` naming a field SparsityConfig does not have or a bad value.
    """
    budgets = dict(budgets or {})
    unknown = sorted(set(budgets) - {f.name for f in dataclasses.fields(SparsityConfig)})
    if unknown:
        raise ValueError(f"unknown sparsity budget field(s) {unknown}")
    qs, ks = qk if qk is not None else layer_qk(cfg, params, tokens, mesh)[:2]
    S = qs[0].shape[1]
    rows = np.unique(np.linspace(0, S - 1, min(num_rows, S)).astype(np.int64))
    pos = jnp.arange(S, dtype=jnp.int32)
    out = {"p": [float(p) for p in ps], "seq_len": int(S), "rows": int(len(rows)),
           "backends": list(cfg.layer_backends), "recall": {}, "density": {}, "mean_recall": {},
           "min_recall": {}, "mean_density": {}, "budgets": budgets}
    for p in ps:
        sp = dataclasses.replace(sparsity_for(cfg, p), **budgets)
        window = np.arange(S - sp.last_q, S) if sp.window == "sequence" else None
        H = qs[0].shape[2]
        caps = (np.minimum(sp.per_head("vertical_max", H), sp.max_verticals(S)),
                np.minimum(sp.per_head("slash_max", H), sp.max_slashes(S)))
        uncapped = dataclasses.replace(sp, vertical_max=max(S, int(np.max(sp.vertical_min))),
                                       slash_max=max(S // sp.block_size, int(np.max(sp.slash_min))))
        rec, den, win = [], [], []
        need = {"vertical_needed": [], "slash_needed": [], "vertical_capped": [], "slash_capped": []}
        for q, k in zip(qs, ks):
            q32, k32 = q.astype(jnp.float32), k.astype(jnp.float32)
            idx = _estimate(q32, k32, pos, sp)
            free = _estimate(q32, k32, pos, uncapped)
            for name, count, cap in (("vertical", free.v_count, caps[0]), ("slash", free.s_count, caps[1])):
                count = np.asarray(count)
                need[name + "_needed"].append(count.mean(0))
                need[name + "_capped"].append((count > cap).mean(0))
            rec.append(np.asarray(recall(q32, k32, idx, rows=rows, block_size=sp.block_size,
                                         sm_scale=sp.sm_scale)).mean(0))
            den.append(density(idx, S, sp.block_size).mean(0))
            if window is not None:
                win.append(np.asarray(recall(q32, k32, idx, rows=window, block_size=sp.block_size,
                                             sm_scale=sp.sm_scale)).mean(0))
        key = f"{p:g}"
        rec, den = np.stack(rec), np.stack(den)
        out["recall"][key], out["density"][key] = rec.tolist(), den.tolist()
        out["mean_recall"][key], out["min_recall"][key] = float(rec.mean()), float(rec.min())
        out["mean_density"][key] = float(den.mean())
        for name, c in need.items():
            c = np.stack(c)
            out.setdefault(name, {})[key] = c.tolist()
            out.setdefault("mean_" + name, {})[key] = float(c.mean())
        if win:
            out.setdefault("window_recall", {})[key] = np.stack(win).tolist()
            out.setdefault("mean_window_recall", {})[key] = float(np.mean(win))
    return out


def needle_recall(cfg: ModelConfig, params, tokenizer, lengths: Sequence[int], depths: Sequence[float],
                  samples: int = 2, seed: int = 0, stream=None, mesh=None, p: float = 0.9,
                  layers: Sequence[int] | None = None, budgets: dict | None = None) -> dict:
    """How much of the attention that a passkey's answer pays to its needle the vertical-slash index keeps:
    the NIAH grid's examples (:func:`~mtraining_jax.eval.tasks.make_example`, the first ``samples`` of each
    cell, so they pair with ``niah["correct"]``), each run through the model (:func:`layer_qk`), the index
    estimated per layer at top-p ``p`` (the model's budgets, ``budgets`` replaced) and
    :func:`~mtraining_jax.sparsity.metrics.column_recall` of the needle's key occurrences for the answer's
    query rows. Per example, over ``layers`` (default: the model's ``mtraining`` layers, every layer if it
    has none) and every head: ``mass`` = the mean needle mass per head, ``kept`` = the kept part over the
    needle mass (mass-weighted, so the heads that look at the needle count). Returns JSON ``{"p", "lengths",
    "depths", "samples", "layers", "budgets", "mass" [depth][length][sample], "kept" [depth][length][sample],
    "layer_kept" [L] (pooled over the examples), "mean_kept"}``."""
    from mtraining_jax.eval.tasks import make_example
    from mtraining_jax.sparsity.metrics import column_recall

    budgets = dict(budgets or {})
    sp = dataclasses.replace(sparsity_for(cfg, p), **budgets)
    L = len(cfg.layer_backends)
    if layers is None:
        layers = [i for i, b in enumerate(cfg.layer_backends) if b == "mtraining"] or list(range(L))
    layers = [int(i) for i in layers]
    if not layers or min(layers) < 0 or max(layers) >= L:
        raise ValueError(f"needle_recall: layers {layers} must be a non-empty subset of 0..{L - 1}")
    shape = (len(depths), len(lengths), int(samples))
    mass, kept = np.zeros(shape), np.zeros(shape)
    lk, lm = np.zeros(L), np.zeros(L)
    cells = [(i, s) for i in range(len(depths)) for s in range(samples)]
    for j, S in enumerate(lengths):  # one batch (one compilation) per length
        exs = [make_example("passkey", tokenizer, S, depths[i], seed, i, s, stream) for i, s in cells]
        rows = np.nonzero(exs[0].answer)[0]  # the answer ends every example: the same rows in all
        cols = [_occurrences(e.tokens[:rows[0]], e.tokens[rows[0] + 1:rows[-1] + 2]) for e in exs]
        qs, ks = layer_qk(cfg, params, np.stack([e.tokens[:S] for e in exs]), mesh)[:2]
        pos = jnp.arange(S, dtype=jnp.int32)
        for li, (q, k) in enumerate(zip(qs, ks)):
            q32, k32 = q.astype(jnp.float32), k.astype(jnp.float32)
            idx = _estimate(q32, k32, pos, sp)
            for b, (i, s) in enumerate(cells):
                kk, mm = column_recall(q32[b:b + 1], k32[b:b + 1], jax.tree.map(lambda a: a[b:b + 1], idx),
                                       rows=rows, cols=cols[b], block_size=sp.block_size, sm_scale=sp.sm_scale)
                lk[li] += kk.sum()
                lm[li] += mm.sum()
                if li in layers:
                    kept[i, j, s] += kk.sum()
                    mass[i, j, s] += mm.sum()
        for i, s in cells:
            kept[i, j, s] = kept[i, j, s] / max(mass[i, j, s], 1e-30)
            mass[i, j, s] /= len(layers) * qs[0].shape[2]
    return {"p": float(p), "lengths": [int(x) for x in lengths], "depths": [float(d) for d in depths],
            "samples": int(samples), "layers": layers, "budgets": budgets, "mass": mass.tolist(),
            "kept": kept.tolist(), "layer_kept": (lk / np.maximum(lm, 1e-30)).tolist(),
            "mean_kept": float(sum(lk[layers]) / max(sum(lm[layers]), 1e-30))}


def _occurrences(hay: np.ndarray, needle: np.ndarray) -> np.ndarray:
    """Positions of every token of every occurrence of ``needle`` in ``hay`` (``ValueError`` if none)."""
    n = len(needle)
    win = np.lib.stride_tricks.sliding_window_view(np.asarray(hay), n)
    starts = np.nonzero((win == np.asarray(needle)).all(1))[0]
    if not len(starts):
        raise ValueError("needle_recall: the answer does not occur before the question")
    return np.unique((starts[:, None] + np.arange(n)).ravel())
