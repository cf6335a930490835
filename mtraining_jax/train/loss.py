"""Cross-entropy over a large vocabulary without materialising ``[sequence, vocab]`` logits.

For hidden states ``h [N, H]``, LM-head weight ``W [H, V]``, labels ``y`` and a mask ``m``, with
logits ``z = h W``: ``loss_sum = sum_t m_t (logsumexp(z_t) - z_t[y_t])``.

:func:`chunked_cross_entropy` walks the tokens in chunks of ``chunk_size`` (``lax.scan``): the
forward keeps only the per-token ``logsumexp``; the custom VJP recomputes each chunk's logits
(BurstEngine's fused LM head + cross-entropy, paper 004), so peak memory is ``chunk_size x V``.
Matmuls take the hidden dtype and accumulate in float32 (float64 for float64 inputs).
:func:`sharded_cross_entropy` runs it per device under ``shard_map`` over ``("node", "local")``
(batch over ``"data"``) and sums over the mesh.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from mtraining_jax.mesh import CP_AXES


def _acc_dtype(*xs):
    return jnp.promote_types(jnp.result_type(*xs), jnp.float32)


def _vma(x) -> frozenset:
    """Mesh axes ``x`` varies over inside ``shard_map`` (JAX 0.10+: ``manual_axis_type.varying``;
    JAX 0.6-0.9: ``.vma``)."""
    t = jax.typeof(x)
    mat = getattr(t, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(t, "vma", ()) or ())


def _varying_like(x, ref):
    """Give ``x`` the manual-axis variance of ``ref`` (needed for ``scan`` carries under
    ``shard_map``, whose accumulators become device-varying); a no-op outside ``shard_map``."""
    missing = tuple(sorted(_vma(ref) - _vma(x)))
    if not missing:
        return x
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, missing, to="varying")
    return jax.lax.pvary(x, missing)  # older JAX


def cross_entropy_reference(hidden, weight, labels, mask):
    """Plain loss (materialises all logits): ``(loss_sum, num_correct)``; for tests."""
    acc = _acc_dtype(hidden, weight)
    z = jnp.einsum("...h,hv->...v", hidden.astype(acc), weight.astype(acc), precision="highest")
    lse = jax.nn.logsumexp(z, axis=-1)
    tgt = jnp.take_along_axis(z, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
    m = mask.astype(acc)
    correct = jnp.sum(m * (jnp.argmax(z, axis=-1) == labels))
    return jnp.sum(m * (lse - tgt)), correct


def _chunk_logits(h_c, w):
    acc = _acc_dtype(h_c, w)
    return jnp.dot(h_c, w.astype(h_c.dtype), preferred_element_type=acc,
                   precision="highest" if acc == jnp.float64 else None)


def _ce_fwd_chunks(h, w, y, m):
    """h [C, c, H], y/m [C, c] -> (loss_sum, correct, lse [C, c])."""

    def body(carry, xs):
        loss, corr = carry
        h_c, y_c, m_c = xs
        z = _chunk_logits(h_c, w)
        lse = jax.nn.logsumexp(z, axis=-1)
        tgt = jnp.take_along_axis(z, y_c[:, None], axis=-1)[:, 0]
        mm = m_c.astype(z.dtype)
        loss = loss + jnp.sum(mm * (lse - tgt))
        corr = corr + jnp.sum(mm * (jnp.argmax(z, axis=-1) == y_c))
        return (loss, corr), lse

    acc = _acc_dtype(h, w)
    zero = _varying_like(jnp.zeros((), acc), h)
    (loss, corr), lse = jax.lax.scan(body, (zero, zero), (h, y, m))
    return loss, corr, lse


@jax.custom_vjp
def _ce_chunked(h, w, y, m):
    loss, corr, _ = _ce_fwd_chunks(h, w, y, m)
    return loss, corr


def _ce_chunked_fwd(h, w, y, m):
    loss, corr, lse = _ce_fwd_chunks(h, w, y, m)
    return (loss, corr), (h, w, y, m, lse)


def _ce_chunked_bwd(res, cts):
    h, w, y, m, lse = res
    g = cts[0]  # the count of correct predictions has no gradient
    acc = _acc_dtype(h, w)
    V = w.shape[1]

    def body(dw, xs):
        h_c, y_c, m_c, lse_c = xs
        z = _chunk_logits(h_c, w)
        dz = jnp.exp(z - lse_c[:, None]) - jax.nn.one_hot(y_c, V, dtype=z.dtype)
        dz = dz * (m_c.astype(z.dtype) * g)[:, None]
        dh_c = jnp.dot(dz.astype(h.dtype), w.astype(h.dtype).T, preferred_element_type=acc)
        dw = dw + jnp.dot(h_c.T, dz.astype(h.dtype), preferred_element_type=acc)
        return dw, dh_c.astype(h.dtype)

    dw0 = _varying_like(_varying_like(jnp.zeros(w.shape, acc), h), w)
    dw, dh = jax.lax.scan(body, dw0, (h, y, m, lse))
    return dh, dw.astype(w.dtype), None, None


_ce_chunked.defvjp(_ce_chunked_fwd, _ce_chunked_bwd)


def chunked_cross_entropy(hidden, weight, labels, mask, chunk_size: int = 1024):
    """Summed masked cross-entropy and number of correct argmax predictions.

    Args:
      hidden: ``[..., H]`` final hidden states (any leading dims, e.g. ``[B, S]``).
      weight: ``[H, V]`` LM-head weight.
      labels: int ``[...]`` target ids in ``[0, V)``.
      mask: ``[...]`` weights (1 = counts, 0 = ignored).
      chunk_size: tokens per chunk (peak logits memory ``chunk_size x V``).

    Returns:
      ``(loss_sum, num_correct)`` scalars in float32 (float64 for float64 inputs); differentiable
      in ``hidden`` and ``weight`` (``num_correct`` has zero gradient).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    H = hidden.shape[-1]
    if weight.ndim != 2 or weight.shape[0] != H:
        raise ValueError(f"weight must be [hidden={H}, vocab], got shape {weight.shape}")
    if labels.shape != hidden.shape[:-1] or mask.shape != labels.shape:
        raise ValueError(
            f"labels {labels.shape} and mask {mask.shape} must match hidden's leading dims {hidden.shape[:-1]}"
        )
    h = hidden.reshape(-1, H)
    y = labels.reshape(-1).astype(jnp.int32)
    m = mask.reshape(-1)
    n = h.shape[0]
    c = min(chunk_size, n)
    pad = (-n) % c
    if pad:
        h = jnp.pad(h, ((0, pad), (0, 0)))
        y = jnp.pad(y, (0, pad))
        m = jnp.pad(m, (0, pad))
    k = h.shape[0] // c
    return _ce_chunked(h.reshape(k, c, H), weight, y.reshape(k, c), m.reshape(k, c))


def sharded_cross_entropy(hidden, weight, labels, mask, mesh: Mesh | None, chunk_size: int = 1024):
    """:func:`chunked_cross_entropy` of ``hidden [B, S, H]`` sharded as ``P(data?, (node, local))``
    over ``mesh``: each device reduces its own tokens, then ``psum`` over the mesh. Returns
    ``(loss_sum, num_correct, num_tokens)`` (replicated scalars). ``mesh=None``: single device."""
    if mesh is None:
        loss, corr = chunked_cross_entropy(hidden, weight, labels, mask, chunk_size)
        return loss, corr, jnp.sum(mask.astype(loss.dtype))
    batch_axis = "data" if "data" in mesh.shape else None
    axes = tuple(mesh.axis_names)
    tok = P(batch_axis, CP_AXES)

    def local(h, w, y, m):
        # Make W device-varying here so the custom_vjp's dW is per device; the transpose of this
        # cast is the single psum of dW over the mesh.
        w = _varying_like(w, h)
        loss, corr = chunked_cross_entropy(h, w, y, m, chunk_size)
        cnt = jnp.sum(m.astype(loss.dtype))
        return tuple(jax.lax.psum(x, axes) for x in (loss, corr, cnt))

    fn = jax.shard_map(local, mesh=mesh, in_specs=(P(batch_axis, CP_AXES, None), P(), tok, tok),
                       out_specs=(P(), P(), P()))
    return fn(hidden, weight, labels, mask)
