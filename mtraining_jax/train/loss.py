"""Cross-entropy over a large vocabulary without materialising ``[sequence, vocab]`` logits.

For hidden states ``h [N, H]``, LM-head weight ``W [H, V]``, labels ``y`` and a mask ``m``, with
logits ``z = h W``: ``loss_sum = sum_t m_t (logsumexp(z_t) - z_t[y_t])``.

:func:`chunked_cross_entropy` walks the tokens in chunks of ``chunk_size`` (``lax.scan``), so
peak memory is ``chunk_size x V`` (BurstEngine's fused LM head + cross-entropy, paper 004). Under
differentiation the custom VJP's forward also computes each chunk's ``dh`` and adds its ``dW``
from the same logits, for a unit cotangent; the backward scales them (the loss is linear in its
cotangent). The LM head's logits are thus computed once per step, not again in the backward.
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


def _chunk_logits(h_c, w_c):
    """``z = h_c w_c`` of one chunk, accumulated (and returned) in :func:`_acc_dtype`; ``w_c``
    already in the hidden dtype (cast once per call, not per chunk)."""
    acc = _acc_dtype(h_c, w_c)
    return jnp.dot(h_c, w_c, preferred_element_type=acc, precision="highest" if acc == jnp.float64 else None)


def _max_and_sum_exp(z):
    """``(max_j z_ij, sum_j exp(z_ij - max_i))`` of ``z [c, V]`` in ONE pass over ``z``.

    A variadic reduction over ``(z, 1)`` pairs carrying ``(m, s)`` with the online-softmax
    rescale ``s_big + s_small exp(m_small - m_big)`` (one ``exp`` per combine), so XLA reads the
    float32 logits once for both, not once for the maximum and again for the sum. ``m`` is the
    exact row maximum (a maximum of inputs); ``s`` differs from the two-pass sum by float32
    rounding only. The identity is ``(finfo.min, 0)``: finite, so combining two identities gives
    no ``-inf - -inf``."""
    lo = jnp.asarray(jnp.finfo(z.dtype).min, z.dtype)

    def combine(a, b):
        (ma, sa), (mb, sb) = a, b
        a_big = ma >= mb
        m_big = jnp.where(a_big, ma, mb)
        m_small = jnp.where(a_big, mb, ma)
        s_big = jnp.where(a_big, sa, sb)
        s_small = jnp.where(a_big, sb, sa)
        return m_big, s_big + s_small * jnp.exp(m_small - m_big)

    return jax.lax.reduce((z, jnp.ones_like(z)), (lo, jnp.zeros((), z.dtype)), combine, (z.ndim - 1,))


def _ce_chunks(h, w, y, m, grads: bool):
    """h [C, c, H], y/m [C, c] -> ``(loss_sum, correct, grads)``; ``grads`` the gradients of
    ``loss_sum`` for a unit cotangent, ``(dh [C, c, H] in h's dtype, dw [H, V] accumulated in
    float32)``, computed from the same logits as the loss (``None`` unless ``grads``).

    Per chunk the logits are read twice: their maximum with the sum ``s`` of ``e = exp(z - max)``
    (:func:`_max_and_sum_exp`, one pass), and (with ``grads``) ``dz = (e / s - onehot(y)) m``: a confident
    label's ``e`` is exactly 1, so its ``dz = 1 / s - 1`` keeps ``1 - p`` to float32's relative precision
    (``exp(z - lse)`` loses ``ulp(z)`` of it: 9 % of a row's ``dh`` at ``1 - p = 1e-5``, logits near 55, in
    ``tests/test_train_loss.py``). A token is correct when its label's logit is the chunk row's
    maximum (on an exact tie with another logit it also counts)."""
    acc = _acc_dtype(h, w)
    w_c = w.astype(h.dtype)

    def body(carry, xs):
        loss, corr, dw = carry
        h_c, y_c, m_c = xs
        z = _chunk_logits(h_c, w_c)
        zmax, s = _max_and_sum_exp(z)
        lse = zmax + jnp.log(s)
        tgt = jnp.take_along_axis(z, y_c[:, None], axis=-1)[:, 0]
        mm = m_c.astype(acc)
        loss = loss + jnp.sum(mm * (lse - tgt))
        corr = corr + jnp.sum(mm * (tgt >= zmax))
        if not grads:
            return (loss, corr, dw), None
        # softmax as e / s, not exp(z - lse): z - lse loses ulp(z) of a confident label's 1 - p
        e = jnp.exp(z - zmax[:, None])  # the row's maximum exactly 1
        dz = (e / s[:, None] - jax.nn.one_hot(y_c, z.shape[-1], dtype=acc)) * mm[:, None]
        dz = dz.astype(h.dtype)
        dh_c = jnp.dot(dz, w_c.T, preferred_element_type=acc)
        dw = dw + jnp.dot(h_c.T, dz, preferred_element_type=acc)
        return (loss, corr, dw), dh_c.astype(h.dtype)

    zero = _varying_like(jnp.zeros((), acc), h)
    dw0 = _varying_like(_varying_like(jnp.zeros(w.shape, acc), h), w) if grads else zero
    (loss, corr, dw), dh = jax.lax.scan(body, (zero, zero, dw0), (h, y, m))
    return loss, corr, (dh, dw) if grads else None


@jax.custom_vjp
def _ce_chunked(h, w, y, m):
    loss, corr, _ = _ce_chunks(h, w, y, m, grads=False)
    return loss, corr


def _ce_chunked_fwd(h, w, y, m):
    # The gradients are computed here, from the forward's own logits (Liger-kernel style): the
    # loss is linear in its cotangent, so the backward only scales them; no second pass over the
    # vocabulary (a [chunk, V] matmul and its logits) per chunk.
    loss, corr, (dh, dw) = _ce_chunks(h, w, y, m, grads=True)
    return (loss, corr), (dh, dw, jnp.zeros((0,), w.dtype))


def _ce_chunked_bwd(res, cts):
    dh, dw, w_like = res
    g = cts[0]  # the count of correct predictions has no gradient
    scale = lambda x: (x.astype(_acc_dtype(x, g)) * g).astype(x.dtype)  # noqa: E731
    return scale(dh), scale(dw).astype(w_like.dtype), None, None


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
      in ``hidden`` and ``weight`` (``num_correct`` has zero gradient). A token is correct when its
      label's logit is the largest (exact ties count). Under differentiation the gradients are
      computed in the forward's pass over each chunk, so the backward reads no logits.
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
