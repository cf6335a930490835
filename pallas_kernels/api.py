"""Public entry points of the block-sparse (vertical-slash) flash attention.

Shapes: ``q [B, Sq, Hq, D]``, ``k, v [B, Sk, Hkv, D]`` of one float dtype (GQA: ``Hq % Hkv == 0``), positions
``q_pos int [Sq]``, ``k_pos int [Sk]`` (global, after the layout permutation), ``index`` a
:class:`~pallas_kernels.index_format.StepIndex` or ``None`` (dense causal by position). Packed
documents: ``q_seg int32 [B, Sq]``, ``k_seg int32 [B, Sk]`` (both or neither).

* :func:`block_sparse_attention_fwd` -> ``(out f32 [B, Sq, Hq, D], lse f32 [B, Hq, Sq])`` (rows
  with no allowed key: out 0, lse -inf; ``out`` in ``out_dtype`` when asked), merged with ``acc``
  (earlier ring steps) when given.
* :func:`block_sparse_attention_bwd` -> float32 ``(dq, dk, dv)`` of one step from ``do`` (q's shape, read
  in q's dtype), the FINAL ``lse`` and ``delta = rowsum(dO * O)`` (float32 ``[B, Hq, Sq]``), added to ``dq_acc`` /
  ``dkv_acc`` when given. Every operand's shape and dtype is checked before a backend is chosen
  (:mod:`pallas_kernels.inputs`): a kernel would read a transposed ``lse`` without a word.
* :func:`block_sparse_attention` — single-device op with ``custom_vjp`` (output in q's dtype).

``impl``: ``"auto"``, ``"mosaic"``, ``"triton"`` (alias ``"pallas"``) or ``"xla"``; what each
supports and how ``"auto"`` chooses: :mod:`pallas_kernels.registry`. Ground truth:
``reference.dense_attention`` with ``index_format.step_index_to_mask``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import registry
from pallas_kernels.inputs import check_array, check_positions, check_qkv, stats_dtypes
from pallas_kernels.index_format import DEFAULT_BLOCK, StepIndex, apply_segments, check_step_index, full_step_index
from pallas_kernels.rounding import storage_round
from pallas_kernels.registry import IMPLS  # noqa: F401  (re-exported: the impl names api callers pass)

SUPPORTED_HEAD_DIMS = (32, 64, 128, 256)
SUPPORTED_BLOCKS = (16, 32, 64, 128)


#: the integer type of ``out_lo`` (:func:`split_output`): the bf16 / f16 rounding error of each output
#: element in ``1 / lo_steps(LO_DTYPE)`` of the element's ulp. int4 (half a byte per element, packed)
#: gives the bf16 gradients of int8 codes or of a float32 output (tests/test_bf16_gradients.py)
LO_DTYPE = jnp.int4


def lo_steps(dtype) -> int:
    """Codes per ulp of an ``out_lo`` of integer ``dtype`` (codes in ``[-steps/2, steps/2]``): 14 for
    int4, 254 for int8."""
    return 2 * int(jnp.iinfo(dtype).max)


def _ulp(hi):
    """``f32``: the spacing of ``hi``'s dtype at each element of ``hi`` (``2^(e - precision)`` for
    ``|hi|`` in ``[2^(e-1), 2^e)``; the subnormal spacing below the dtype's smallest normal), at
    least float32's smallest normal (subnormals flush to zero on GPUs and XLA's CPU; an output that
    small restores to within ``2^-126 / (2 lo_steps)``)."""
    return _ulp_of(_as_stored(hi), hi.dtype)


def _ulp_of(hi32, dtype):
    """``f32``: ``2^(e - (nmant + 1))`` (at least ``2^-126``) with ``2^(e-1) <= max(|hi32|, smallest
    normal of dtype) < 2^e``, from the float32 exponent bits: elementwise integer operations that fuse
    into their consumer (``jnp.frexp`` / ``jnp.ldexp`` gave XLA:GPU four materialised
    ``[B, S, Hq, D]`` broadcasts, 1.75 GiB per sparse layer at 128K, in the training step's backward)."""
    fi = jnp.finfo(dtype)
    y = jnp.maximum(jnp.abs(hi32), jnp.float32(fi.smallest_normal))  # a normal float32
    e = (jax.lax.bitcast_convert_type(y, jnp.int32) >> 23) - 126  # frexp's exponent (sign bit 0)
    u = jnp.maximum(e - (fi.nmant + 1), -126)
    return jax.lax.bitcast_convert_type((u + 127) << 23, jnp.float32)


def _as_stored(hi):
    """``f32``: the values of ``hi`` (bf16 / f16) as stored, also inside a program that would keep
    them in excess precision."""
    return _rounded_f32(hi.astype(jnp.float32), hi.dtype)


def _rounded_f32(x32, dtype):
    """``f32``: ``x32`` rounded to ``dtype`` by :func:`~pallas_kernels.rounding.storage_round` (kept by
    every program); below the smallest normal, where that flushes f16 subnormals, by the convert
    (an error below ``2^-25`` where a program drops it)."""
    small = jnp.abs(x32) < jnp.finfo(dtype).smallest_normal
    return jnp.where(small, x32.astype(dtype).astype(jnp.float32), storage_round(x32, dtype))


def split_output(out, dtype):
    """``(hi, lo)``: the float32 output ``out [B, Sq, Hq, D]`` as ``hi = out`` rounded to ``dtype``
    (the op's result) and ``lo [B, Sq, Hq, D]`` of integer type :data:`LO_DTYPE`, its rounding error
    ``out - hi`` in units of ``ulp(hi) / lo_steps`` (``None`` when ``dtype`` is float32).

    Round-to-nearest puts ``out - hi`` within half an ulp of ``hi``, so the codes fit, and
    :func:`output_f32` restores the float32 output to ``ulp / (2 lo_steps)`` per element (int4:
    ``ulp / 28``, ``~2^-13`` relative in bf16; the rounded output alone is off by up to ``ulp / 2``).
    A backward that saves ``(hi, lo)`` forms :func:`attention_delta` from that, not from the rounded
    result (which doubles the dQ error when keys share a direction), at half a byte per element beside
    ``hi`` (the op's output, usually kept by the next layer anyway). The error is taken against the
    rounding as :mod:`pallas_kernels.rounding` keeps it: a plain ``out - hi.astype(f32)`` is zero
    on XLA:GPU, which drops the convert pair."""
    hi = out.astype(dtype)
    if jnp.dtype(dtype) == jnp.float32:
        return hi, None
    out32 = out.astype(jnp.float32)
    hi32 = _rounded_f32(out32, dtype)
    steps = lo_steps(LO_DTYPE)
    codes = jnp.clip(jnp.round((out32 - hi32) / _ulp_of(hi32, dtype) * steps), -steps // 2, steps // 2)
    return hi, codes.astype(LO_DTYPE)


def output_f32(out, out_lo=None):
    """``f32``: the output ``hi`` of :func:`split_output` with its rounding error ``out_lo`` added back
    (``hi`` taken at its stored values, also where a program would keep it in excess precision)."""
    if out_lo is None:
        return out.astype(jnp.float32)
    hi32 = _as_stored(out)
    return hi32 + out_lo.astype(jnp.float32) * (_ulp_of(hi32, out.dtype) / lo_steps(out_lo.dtype))


def attention_delta(out, do, out_lo=None):
    """``delta f32 [B, Hq, Sq] = rowsum(dO * O)`` (computed once per attention, FlashAttention-2).

    ``out``: ``O [B, Sq, Hq, D]``; with ``out_lo`` (:func:`split_output`) ``O`` is the float32 output
    restored by :func:`output_f32` (a delta from O rounded to bf16 loses gradient accuracy)."""
    return jnp.einsum("bqhd,bqhd->bhq", output_f32(out, out_lo), do.astype(jnp.float32), precision="highest")


def check_sm_scale(sm_scale) -> None:
    """``ValueError`` naming ``sm_scale`` unless it is ``None`` (``D ** -0.5``) or a finite number > 0."""
    ok = (isinstance(sm_scale, (int, float, np.integer, np.floating)) and not isinstance(sm_scale, (bool, np.bool_))
          and math.isfinite(sm_scale) and sm_scale > 0)
    if sm_scale is not None and not ok:
        raise ValueError(f"sm_scale must be None or a finite number > 0, got {sm_scale!r}")


def _check(q, k, v, q_pos, k_pos, index, block_size):
    check_qkv(q, k, v, same_seq=False)
    B, Sq, Hq, D = q.shape
    check_positions("q_pos", q_pos, Sq, "Sq")
    check_positions("k_pos", k_pos, k.shape[1], "Sk")
    if not isinstance(block_size, int) or isinstance(block_size, bool):
        raise ValueError(f"block_size must be an int, got {block_size!r}")
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim {D} is not supported; expected one of {SUPPORTED_HEAD_DIMS}")
    if block_size not in SUPPORTED_BLOCKS:
        raise ValueError(f"block_size {block_size} is not supported; expected one of {SUPPORTED_BLOCKS}")
    if Sq % block_size or k.shape[1] % block_size:
        raise ValueError(f"query length {Sq} and key length {k.shape[1]} must be multiples of "
                         f"the block size {block_size}")
    if index is not None:
        check_step_index(index, B, Hq, Sq, k.shape[1], block_size)


def _check_segs(q, k, q_seg, k_seg):
    """``None`` or ``(q_seg, k_seg)`` as int32; ``ValueError`` naming a bad shape or dtype."""
    if q_seg is None and k_seg is None:
        return None
    if q_seg is None or k_seg is None:
        raise ValueError("give both q_seg and k_seg (packed documents) or neither")
    want = ((q.shape[0], q.shape[1]), (k.shape[0], k.shape[1]))
    for name, a, w in (("q_seg", q_seg, want[0]), ("k_seg", k_seg, want[1])):
        if tuple(a.shape) != w:
            raise ValueError(f"{name} has shape {tuple(a.shape)}, expected [B, S] = {list(w)}")
        if not jnp.issubdtype(a.dtype, jnp.integer):
            raise ValueError(f"{name} must be integer segment ids, got dtype {a.dtype}")
    return jnp.asarray(q_seg, jnp.int32), jnp.asarray(k_seg, jnp.int32)


def _check_acc(name, got, want, dtypes):
    """``ValueError`` unless ``got`` holds one float32 (:func:`stats_dtypes`) accumulator of each shape in ``want``."""
    if not isinstance(got, (tuple, list)) or len(got) != len(want):
        raise ValueError(f"{name} must be {len(want)} float32 array(s) of shape(s) {[tuple(w) for w in want]}, "
                         f"got {type(got).__name__}{f' of {len(got)}' if isinstance(got, (tuple, list)) else ''}")
    for i, (a, shape) in enumerate(zip(got, want)):
        check_array(f"{name}[{i}]", a, shape, dtypes)


def _check_bwd_inputs(q, do, lse, delta):
    """``do [B, Sq, Hq, D]`` floating (read in q's dtype); ``lse``, ``delta`` float32 ``[B, Hq, Sq]``
    (:func:`stats_dtypes`)."""
    B, Sq, Hq, _ = q.shape
    check_array("do", do, q.shape)
    check_array("lse", lse, (B, Hq, Sq), stats_dtypes(q))
    check_array("delta", delta, (B, Hq, Sq), stats_dtypes(q))


def _backend(impl: str, direction: str, q, k, block_size: int, segs=None):
    return registry.select(impl, registry.problem(direction, q, block_size, k.shape[1], segs is not None))


def _scale(q, sm_scale):
    return float(q.shape[-1] ** -0.5 if sm_scale is None else sm_scale)


def _kernel_index(backend, index, q, k, q_pos, k_pos, block_size, segs=None):
    """``(index, uniform)``: the backend's index (the full causal one built for ``index=None`` when the
    backend needs one, narrowed to the documents) and whether every (batch, head) row of it is the same
    (built here, no documents), which a backend may use to build its operands once."""
    uniform = False
    if index is None and backend.NEEDS_INDEX:
        index = full_step_index(q.shape[0], q.shape[2], q.shape[1], k.shape[1], q_pos, k_pos, block_size)
        uniform = segs is None
    if index is not None and segs is not None:
        index = apply_segments(index, segs[0], segs[1], block_size)
    return index, uniform


def block_sparse_attention_fwd(q, k, v, q_pos, k_pos, index: StepIndex | None = None, *, sm_scale=None,
                               block_size: int = DEFAULT_BLOCK, impl: str = "auto", acc=None, q_seg=None,
                               k_seg=None, stream: str = "auto", out_dtype=jnp.float32):
    """Forward for one (query chunk, K/V chunk) pair; see module docstring.

    ``acc``: ``None`` or ``(out f32 [B, Sq, Hq, D], lse f32 [B, Hq, Sq])`` of the same queries over
    keys disjoint from this chunk's (earlier ring steps); the result is then the merged
    ``(out, lse)`` over both key sets. ``stream``: what the Mosaic kernel's CTAs stream
    (:data:`pallas_kernels.registry.STREAMS`; ``"index"`` compiles both streams' kernels and runs one,
    a fixed choice compiles one, ``"auto"`` is ``"index"`` in the forward and ``"split"`` in the dQ on a
    listed index); the other backends ignore it, and the result is the same. ``out_dtype``: float32
    (default), or a narrower float dtype when the output is final (nothing merges into it later, no
    backward needs its float32 value): the float32 result rounded once, by the Mosaic and Triton
    kernels in their epilogue (no float32 output written), by the XLA twin after; ``lse`` stays float32."""
    registry.validate_stream(stream)
    _check(q, k, v, q_pos, k_pos, index, block_size)  # first: a non-float q is named as such
    _check_float_dtype("out_dtype", out_dtype)
    segs = _check_segs(q, k, q_seg, k_seg)
    if acc is not None:
        _check_acc("acc", acc, [q.shape, (q.shape[0], q.shape[2], q.shape[1])], stats_dtypes(q))
    backend = _backend(impl, "fwd", q, k, block_size, segs)
    q_pos, k_pos = jnp.asarray(q_pos, jnp.int32), jnp.asarray(k_pos, jnp.int32)
    idx, uniform = _kernel_index(backend, index, q, k, q_pos, k_pos, block_size, segs)
    return backend.fwd(q, k, v, q_pos, k_pos, idx, acc, sm_scale=_scale(q, sm_scale), block_size=block_size,
                       segs=segs, stream=stream, uniform_index=uniform, out_dtype=jnp.dtype(out_dtype))


def _check_float_dtype(name: str, dtype) -> None:
    try:
        ok = isinstance(dtype, (type, str, jnp.dtype)) and jnp.issubdtype(dtype, jnp.floating)
    except TypeError:  # a string that names no dtype
        ok = False
    if not ok:
        raise ValueError(f"{name} must be a floating dtype (float32, bfloat16, float16), got {dtype!r}")


def block_sparse_attention_bwd(q, k, v, q_pos, k_pos, index, do, lse, delta, *, sm_scale=None,
                               block_size: int = DEFAULT_BLOCK, impl: str = "auto", dq_acc=None, dkv_acc=None,
                               q_seg=None, k_seg=None, stream: str = "auto", dq_dtype=jnp.float32):
    """Backward for one pair given the final ``lse`` and ``delta``; returns ``(dq, dk, dv)``, dK/dV
    float32, dQ in ``dq_dtype``.

    ``dq_acc`` (``f32 [B, Sq, Hq, D]``) and ``dkv_acc = (dk, dv)`` (``f32 [B, Sk, Hkv, D]`` each),
    if given, are added to the result (ring steps accumulating over chunks). ``dq_dtype``: float32
    (default), or a narrower float dtype when nothing is added to dQ afterwards (a ring's last step):
    the sum is then rounded once, by the Mosaic dQ kernel itself (no float32 dQ buffer), by the
    other backends after theirs. ``stream``: the Mosaic dQ kernel's, as in
    :func:`block_sparse_attention_fwd`."""
    registry.validate_stream(stream)
    _check(q, k, v, q_pos, k_pos, index, block_size)  # first: a non-float q is named as such
    _check_float_dtype("dq_dtype", dq_dtype)
    _check_bwd_inputs(q, do, lse, delta)
    segs = _check_segs(q, k, q_seg, k_seg)
    if dq_acc is not None:
        check_array("dq_acc", dq_acc, q.shape, stats_dtypes(q))
    if dkv_acc is not None:
        _check_acc("dkv_acc", dkv_acc, [k.shape, k.shape], stats_dtypes(q))
    backend = _backend(impl, "bwd", q, k, block_size, segs)
    q_pos, k_pos = jnp.asarray(q_pos, jnp.int32), jnp.asarray(k_pos, jnp.int32)
    idx, uniform = _kernel_index(backend, index, q, k, q_pos, k_pos, block_size, segs)
    do = do.astype(q.dtype)  # as the kernels read it: every backend takes the same dO
    return backend.bwd(q, k, v, q_pos, k_pos, idx, do, lse, delta, dq_acc, dkv_acc,
                       sm_scale=_scale(q, sm_scale), block_size=block_size, segs=segs, stream=stream,
                       dq_dtype=jnp.dtype(dq_dtype), uniform_index=uniform)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _op(q, k, v, q_pos, k_pos, index, segs, sm_scale, block_size, impl):
    # no backward reads this output (a traced forward alone): rounded to q's dtype in the kernel
    out, _ = block_sparse_attention_fwd(q, k, v, q_pos, k_pos, index, sm_scale=sm_scale,
                                        block_size=block_size, impl=impl, out_dtype=q.dtype, **_seg_kw(segs))
    return out


def _seg_kw(segs):
    return {} if segs is None else {"q_seg": segs[0], "k_seg": segs[1]}


def _op_fwd(q, k, v, q_pos, k_pos, index, segs, sm_scale, block_size, impl):
    out, lse = block_sparse_attention_fwd(q, k, v, q_pos, k_pos, index, sm_scale=sm_scale,
                                          block_size=block_size, impl=impl, **_seg_kw(segs))
    out_c, out_lo = split_output(out, q.dtype)  # delta from the float32 O (see split_output)
    return out_c, (q, k, v, q_pos, k_pos, index, segs, out_c, out_lo, lse)


def _op_bwd(sm_scale, block_size, impl, res, do):
    q, k, v, q_pos, k_pos, index, segs, out, out_lo, lse = res
    delta = attention_delta(out, do, out_lo)
    dq, dk, dv = block_sparse_attention_bwd(q, k, v, q_pos, k_pos, index, do, lse, delta, sm_scale=sm_scale,
                                            block_size=block_size, impl=impl, dq_dtype=q.dtype, **_seg_kw(segs))
    zeros_like_int = lambda x: None if x is None else jax.tree.map(  # noqa: E731
        lambda a: jnp.zeros(a.shape, jax.dtypes.float0), x)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
            zeros_like_int(q_pos), zeros_like_int(k_pos), zeros_like_int(index), zeros_like_int(segs))


_op.defvjp(_op_fwd, _op_bwd)


def block_sparse_attention(q, k, v, q_pos=None, k_pos=None, index: StepIndex | None = None, *, sm_scale=None,
                           block_size: int = DEFAULT_BLOCK, impl: str = "auto", q_seg=None, k_seg=None):
    """Single-device block-sparse attention with ``custom_vjp``; ``out`` in ``q.dtype``."""
    registry.validate_impl(impl)
    check_sm_scale(sm_scale)
    check_qkv(q, k, v, same_seq=False)  # before the positions: a non-float q is named as such
    Sq, Sk = q.shape[1], k.shape[1]
    q_pos = jnp.arange(Sq, dtype=jnp.int32) if q_pos is None else check_positions("q_pos", q_pos, Sq, "Sq")
    k_pos = jnp.arange(Sk, dtype=jnp.int32) if k_pos is None else check_positions("k_pos", k_pos, Sk, "Sk")
    return _op(q, k, v, q_pos, k_pos, index, _check_segs(q, k, q_seg, k_seg), sm_scale, block_size, impl)
