"""The index estimate's exact window logits (:mod:`mtraining_jax.sparsity.estimate`): the operands as
balanced integer digits (:func:`operand_digits`, a function of the bits of the input alone) and the logits
``q . k`` from one bf16 matmul of the digits whose every output is an integer below ``2^24``, exact in
float32 in any summation order (:func:`window_logits`): the same bits on every rank, in every compiled
program and on any hardware. The Pallas Triton window kernels (:mod:`pallas_kernels.window_scores`) compute
the same integers tile by tile from these digits."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

#: bits of each logits operand kept by the exact dot (:func:`window_logits`): float32's
DOT_BITS = 24


def digit_plan(head_dim: int) -> tuple[int, int]:
    """``(w, J)``: ``J`` balanced digits of ``w`` bits per operand, ``J w >= 24``, such that one
    weight's digit products (``<= J * head_dim`` terms, each ``|.| <= 4^(w-1)``) sum below ``2^24``
    (exact in float32 in any order); ``w = 8, J = 3`` for ``head_dim <= 341``."""
    for w in range(8, 1, -1):
        J = -(-DOT_BITS // w)
        if J * head_dim * 4 ** (w - 1) <= 2**24:
            return w, J
    raise ValueError(f"head_dim {head_dim} is too large for the index estimate's exact logits")


class Digits(NamedTuple):
    """An operand of the exact logits: ``x ~= row_scale * sum_j digits[j] 2^(-w j)``."""

    digits: jax.Array  # bf16 [B, S, H, J, D], integers |d| <= 2^(w-1)
    row_scale: jax.Array  # float32 [B, S, H], a power of two


def pow2(n):
    """Exact float32 ``2^n`` for int32 ``n`` in ``[-126, 127]``, from its bits."""
    return jax.lax.bitcast_convert_type((n.astype(jnp.int32) + 127) << 23, jnp.float32)


def operand_digits(x) -> Digits:
    """Balanced base-``2^w`` digits of the rows (last axis) of ``x`` (float32 ``[B, S, H, D]``).

    With ``2^e > max|x_row|`` (from the bits of the row max), ``u = x 2^(1-w-e)`` lies in
    ``(-2^(w-1), 2^(w-1))``; ``d_0 = round(u)``, ``d_j = round(2^w (previous remainder))``.
    Power-of-two scalings, rounding to an integer and subtracting it are exact, so the digits are
    a function of the bits of ``x`` alone, however the program is fused. A narrower float ``x``
    (bf16, float16) is cast to float32 first, exactly (the row max's bits are read as float32's)."""
    x = x.astype(jnp.float32)
    w, J = digit_plan(x.shape[-1])
    amax = jnp.max(jnp.abs(x), axis=-1)
    biased = (jax.lax.bitcast_convert_type(amax, jnp.int32) >> 23) & 0xFF
    e = jnp.maximum(biased, 1) - 126  # max|x_row| < 2^e (zero and subnormal rows: 2^-125)
    n = jnp.clip(w - 1 - e, -126, 126)  # rows below 2^-119 keep fewer bits (2^n, 2^-n normal)
    t = x * pow2(n)[..., None]
    out = []
    for j in range(J):
        if j:
            t = t * np.float32(2.0**w)
        d = jnp.round(t)
        out.append(d)
        t = t - d
    digits = jnp.stack(out, axis=-2).astype(jnp.bfloat16)  # exact: |d| <= 2^(w-1) <= 128
    return Digits(digits, pow2(-n))


def window_logits(q_rows, k: Digits):
    """``[B, Hq, R, Sk]`` float32 unscaled logits ``q . k`` of the window, the same bits in every
    program: ``q_rows`` float32 ``[B, R, Hq, D]``, ``k`` the keys' digits.

    ``q . k = sq sk sum_l 2^(-w l) L_l`` with ``L_l = sum_{a + b = l} sum_d dq_a dk_b`` (weights
    ``l >= J`` dropped, below ``2^-24`` of the row scales). One bf16 matmul computes every ``L_l``:
    the query operand holds, for weight ``l`` and key digit ``b``, the query digit ``l - b`` (zero
    where ``b > l``), so ``M = J R``, ``K = J D``; each output is an integer ``<= J D 4^(w-1) <= 2^24``
    summed from exact products, exact in float32 in any order and on any hardware."""
    w, J = digit_plan(q_rows.shape[-1])
    qd = operand_digits(q_rows)
    B, R, Hq, _, D = qd.digits.shape
    Hkv = k.digits.shape[2]
    qdig = jnp.moveaxis(qd.digits, 1, 2)  # [B, Hq, R, J, D] (R rows: small)
    zero = jnp.zeros_like(qdig[..., 0, :])
    qcat = jnp.stack([jnp.stack([qdig[..., l - b, :] if b <= l else zero for b in range(J)], axis=-2)
                      for l in range(J)], axis=-3)  # [B, Hq, R, J (weight l), J (key digit b), D]
    qcat = qcat.reshape(B, Hkv, Hq // Hkv, R, J, J, D)
    # the output in the matmul's own order (batch b, h; the query operand's free axes g, q, l; keys k):
    # no transpose of this J x [B, Hq, R, Sk] intermediate
    lv = jnp.einsum("bhgqlcd,bkhcd->bhgqlk", qcat, k.digits, preferred_element_type=jnp.float32)
    z = lv[:, :, :, :, 0]
    for l in range(1, J):  # fixed order; the products are exact, so a fused multiply-add is too
        z = z + lv[:, :, :, :, l] * np.float32(2.0 ** (-w * l))
    z = z.reshape(B, Hq, R, -1)
    sq = jnp.moveaxis(qd.row_scale, 1, 2)[..., None]  # [B, Hq, R, 1]
    sk = jnp.repeat(jnp.moveaxis(k.row_scale, 1, 2), Hq // Hkv, axis=1)[:, :, None, :]  # [B, Hq, 1, Sk]
    return z * sq * sk
