"""One attention entry point for the model; the backend is chosen by config (per layer).

``attention(q, k, v, positions, *, backend, ...) -> out [B, S, Hq, D]`` in ``q.dtype``, causal by
*global position*: ``out[b, i, h] = softmax_j(q_i . k_j * sm_scale | positions[j] <= positions[i])
v_j`` with GQA (query head ``h`` reads KV head ``h // (Hq // Hkv)``). ``positions int32 [S]``: the
global positions of the laid-out tokens. ``segment_ids int [B, S]`` (packed documents) adds the
document mask ``segment_ids[b, j] == segment_ids[b, i]`` on ``reference``, ``ring`` and ``mtraining``.

Backends:

* ``reference`` — :func:`pallas_kernels.reference.dense_attention` (float32, materialises
  ``[B, Hq, S, S]``); the ground truth.
* ``cudnn`` — ``jax.nn.dot_product_attention(is_causal=True)`` (cuDNN on GPU, XLA elsewhere):
  causal by array index, so ``positions`` must be ``arange(S)``; no segment ids
  (``NotImplementedError``: that function takes none on JAX 0.10).
* ``ring`` — :func:`mtraining_jax.ring.attention.ring_attention` (dense ring); needs ``mesh``.
* ``mtraining`` — :func:`mtraining_jax.attention.mtraining.mtraining_attention` (sparse
  vertical-slash ring); needs ``mesh`` and tokens in its config's layout.
* ``msa`` — :func:`mtraining_jax.attention.msa.msa_attention`; needs ``msa_index``; no packed
  documents.

Positions a backend cannot honour are a ``ValueError`` when concrete and NaN-poison the output when
traced (a wrong layout fails loudly; :func:`_nan_unless` poisons the values). A keyword a backend does
not take, or ``ring=`` beside a config holding other ring options, is a ``ValueError``
(:data:`BACKEND_KEYWORDS`). A model builds each layer's keywords with ``ModelConfig.attention_spec``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mtraining_jax.attention.backends import BACKENDS  # the one list (re-exported)
from mtraining_jax.ring.config import RingOptions
from pallas_kernels.inputs import check_positions, check_qkv, check_segment_ids
from pallas_kernels.reference import dense_attention


def _check_inputs(q, k, v, positions):
    check_qkv(q, k, v)
    S = q.shape[1]
    check_positions("positions", positions, S)
    if not isinstance(positions, jax.core.Tracer):
        pos = np.asarray(positions)
        if not np.array_equal(np.sort(pos), np.arange(S)):
            bad = np.setdiff1d(np.arange(S), pos)
            raise ValueError(f"positions must be a permutation of 0..{S - 1} (each token's place in the "
                             f"sequence); position {int(bad[0])} is missing")


def _cudnn_attention(q, k, v, positions, sm_scale):
    S = q.shape[1]
    natural = None
    if not isinstance(positions, jax.core.Tracer):
        pos = np.asarray(positions)
        if not np.array_equal(pos, np.arange(S)):
            bad = int(np.argmax(pos != np.arange(S)))
            raise ValueError(
                "the cudnn backend needs natural-order positions == arange(S) (its causal mask is by "
                f"index); positions[{bad}] = {int(pos[bad])}, expected {bad}. Use 'reference' or 'ring' "
                "for permuted layouts."
            )
    else:
        natural = jnp.all(positions == jnp.arange(S, dtype=positions.dtype))
    on_gpu = jax.default_backend() == "gpu"
    return jax.nn.dot_product_attention(
        q, k, _nan_unless(v, natural), scale=sm_scale, is_causal=True, implementation="cudnn" if on_gpu else "xla"
    )


def _nan_unless(v, ok):
    """``v`` where the traced check ``ok`` holds, NaN everywhere otherwise (``ok=None``: no check).

    The backends poison the values, not the output: every query attends at least its own key, so
    NaN values make every output row NaN (and ``0 * NaN`` is NaN where a key's weight underflows),
    while the output stays the one array the attention's custom VJP saves and the next layer reads.
    A ``where`` on the output made a second ``[B, S, Hq, D]`` array that the layer's checkpoint kept
    beside it (one per layer: 0.22 GiB at 128K on the Qwen2.5-0.5B shape); on the values it replaces
    ``v`` (``Hkv`` heads) in the saved residuals."""
    if ok is None:
        return v
    return jnp.where(ok, v, jnp.asarray(jnp.nan, v.dtype))


# keywords beyond the common ones (q, k, v, positions, backend, mesh, sm_scale, segment_ids, return_stats)
BACKEND_KEYWORDS: dict[str, tuple[str, ...]] = {
    "reference": (),
    "cudnn": (),
    "ring": ("ring",),
    "mtraining": ("ring", "mtraining"),
    "msa": ("ring", "msa", "msa_index", "msa_warmup", "msa_metrics"),
}


def _check_keywords(backend: str, given: dict) -> None:
    """``ValueError`` naming the keywords given (not ``None``) that ``backend`` does not take."""
    extra = sorted(k for k, v in given.items() if v is not None and k not in BACKEND_KEYWORDS[backend])
    if extra:
        takes = BACKEND_KEYWORDS[backend]
        raise ValueError(f"the {backend!r} attention backend does not take {', '.join(extra)}; it takes "
                         f"{', '.join(takes) if takes else 'no backend-specific keywords'} (besides mesh, sm_scale, "
                         f"segment_ids, return_stats)")


def _with_ring(cfg, ring, what: str):
    """``cfg`` (an MTraining / MSA config) whose ring options are ``ring`` when given; a ``ring``
    that differs from the config's own is a ``ValueError`` (one place for the ring options)."""
    if ring is None or ring == cfg.ring:
        return cfg
    raise ValueError(f"ring={ring} differs from {what}.ring={cfg.ring}; pass the ring options in one place "
                     f"(ring= alone, or inside {what}=)")


def _mtraining_attention(q, k, v, positions, mesh, cfg, ring, sm_scale, segment_ids=None):
    """``(out, stats)``: the sparse ring and its :func:`~mtraining_jax.attention.mtraining.stats_scalars`."""
    import dataclasses

    from mtraining_jax.attention.mtraining import MTrainingConfig, mtraining_attention, stats_scalars  # lazy

    cfg = MTrainingConfig(ring=ring) if cfg is None else _with_ring(cfg, ring, "mtraining")
    if sm_scale is not None:
        cfg = dataclasses.replace(cfg, sparsity=dataclasses.replace(cfg.sparsity, sm_scale=sm_scale))
    ok = None
    if isinstance(positions, jax.core.Tracer):
        perm = cfg.make_layout(q.shape[1], mesh.shape["node"] * mesh.shape["local"]).perm
        ok = jnp.all(positions == jnp.asarray(perm, positions.dtype))
    out, st = mtraining_attention(q, k, _nan_unless(v, ok), mesh, cfg, positions=positions, segment_ids=segment_ids,
                                  return_stats=True)  # checks concrete positions
    stats = stats_scalars(st.work, q.shape[0], q.shape[2], q.shape[1], cfg.block_size)
    return out, stats


def _msa_attention(q, k, v, positions, mesh, cfg, ring, msa_index, msa_warmup, sm_scale, segment_ids,
                   msa_metrics=True):
    """``(out, stats)`` of the MSA backend (see module docstring)."""
    import dataclasses

    from mtraining_jax.attention.msa import MSAConfig, msa_attention  # lazy

    if msa_index is None:
        raise ValueError("the msa attention backend needs msa_index=(q_idx, k_idx) from the model's index branch")
    if segment_ids is not None:
        raise NotImplementedError("the msa backend has no document (segment_ids) mask; train it with data.pack: "
                                  "stream (the default), or use attention_backend reference, ring or mtraining "
                                  "with data.pack: documents")
    cfg = MSAConfig(ring=ring) if cfg is None else _with_ring(cfg, ring, "msa")
    if sm_scale is not None:
        cfg = dataclasses.replace(cfg, sm_scale=sm_scale)
    ok = None
    if isinstance(positions, jax.core.Tracer):
        P = 1 if mesh is None else mesh.shape["node"] * mesh.shape["local"]
        ok = jnp.all(positions == jnp.asarray(cfg.make_layout(q.shape[1], P).perm, positions.dtype))
    out, aux = msa_attention(q, k, _nan_unless(v, ok), msa_index[0], msa_index[1], mesh, cfg, positions=positions,
                             warmup=msa_warmup, metrics=msa_metrics)  # checks concrete positions
    stats = {"msa_kl": aux.kl, "work_fraction": aux.work_fraction, "msa_recall": aux.recall}
    return out, stats


def attention(
    q,
    k,
    v,
    positions,
    *,
    backend: str,
    mesh=None,
    ring=None,
    sm_scale: float | None = None,
    mtraining=None,
    return_stats: bool = False,
    segment_ids=None,
    msa=None,
    msa_index=None,
    msa_warmup=None,
    msa_metrics=None,
):
    """Causal attention by global position through ``backend`` (see module docstring).

    Args:
      q: ``[B, S, Hq, D]``; k, v: ``[B, S, Hkv, D]``; positions: ``int [S]`` global positions.
      backend: one of :data:`BACKENDS`.
      mesh: ``(node, local)`` mesh (``ring`` / ``mtraining``; ``msa``: ``None`` runs one device).
      ring: :class:`~mtraining_jax.ring.config.RingOptions` of the ring backends (``ring``; for
        ``mtraining`` / ``msa`` when no config is given, else it must equal the config's ``ring``);
        ``None``: the defaults.
      sm_scale: softmax scale, default ``D ** -0.5``.
      mtraining: :class:`~mtraining_jax.attention.mtraining.MTrainingConfig` for ``mtraining``.
      return_stats: also return a dict of float32 scalars (``mtraining``: work fraction, worker and
        step imbalance; ``msa``: ``msa_kl`` (differentiable), ``work_fraction``, ``msa_recall``;
        other backends: empty).
      segment_ids: ``int [B, S]`` document of each laid token (packed documents), or ``None``.
      msa, msa_index, msa_warmup, msa_metrics: the ``msa`` backend's config, index branch
        ``(q_idx [B, S, Hkv, d_idx], k_idx [B, S, d_idx])``, warm-up flag (default ``False``) and
        whether to compute ``msa_recall`` (default ``True``, else NaN); the flags may be traced.

    Returns:
      ``[B, S, Hq, D]`` in ``q.dtype`` (and the stats).

    Raises:
      ValueError: an unknown backend, bad shapes or positions, a keyword (other than ``None``) that
      ``backend`` does not take (:data:`BACKEND_KEYWORDS`).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")
    _check_keywords(backend, dict(ring=ring, mtraining=mtraining, msa=msa, msa_index=msa_index,
                                  msa_warmup=msa_warmup, msa_metrics=msa_metrics))
    if ring is not None and not isinstance(ring, RingOptions):
        raise ValueError(f"ring must be a RingOptions, got {type(ring).__name__}")
    positions = positions if isinstance(positions, jax.Array) else jnp.asarray(positions)
    _check_inputs(q, k, v, positions)
    segment_ids = check_segment_ids(segment_ids, *q.shape[:2])
    if backend == "mtraining":
        if mesh is None:
            raise ValueError("the mtraining attention backend needs a mesh (got mesh=None)")
        out, stats = _mtraining_attention(q, k, v, positions, mesh, mtraining, ring, sm_scale, segment_ids)
        out = out.astype(q.dtype)
        return (out, stats) if return_stats else out
    if backend == "msa":
        out, stats = _msa_attention(q, k, v, positions, mesh, msa, ring, msa_index,
                                    False if msa_warmup is None else msa_warmup, sm_scale, segment_ids,
                                    True if msa_metrics is None else msa_metrics)
        out = out.astype(q.dtype)
        return (out, stats) if return_stats else out
    out = _dense_backend(q, k, v, positions, backend, mesh, ring, sm_scale, segment_ids)
    return (out, {}) if return_stats else out


def _dense_backend(q, k, v, positions, backend, mesh, ring, sm_scale, segment_ids=None):
    if backend == "reference":
        out, _ = dense_attention(q, k, v, positions, positions, sm_scale=sm_scale, q_seg=segment_ids,
                                 k_seg=segment_ids)
        return out.astype(q.dtype)
    if backend == "cudnn":
        if segment_ids is not None:
            raise NotImplementedError(
                "the cudnn backend has no document (segment_ids) mask: jax.nn.dot_product_attention takes no "
                "segment ids; use attention_backend 'reference', 'ring' or 'mtraining' with data.pack=documents")
        return _cudnn_attention(q, k, v, positions, sm_scale).astype(q.dtype)
    if backend == "ring":
        if mesh is None:
            raise ValueError("the ring attention backend needs a mesh (got mesh=None)")
        from mtraining_jax.ring.attention import ring_attention  # lazy: optional heavy import

        out = ring_attention(q, k, v, positions, mesh, options=ring, sm_scale=sm_scale, segment_ids=segment_ids)
        return out.astype(q.dtype)
    raise AssertionError(backend)
