"""Pallas Triton kernels of the index estimate's window statistics (MTraining Algorithm 1, steps 2-3;
:mod:`mtraining_jax.sparsity.estimate`, ``SparsityConfig.estimate_impl = "triton"``).

The estimate scores the ``R = last_q`` observation-window queries against every local key. Its XLA
path writes the exact logits' ``J`` partial products (``[B, Hq, R, J, Sk]`` float32) to memory and
reads them back for the row max and again for the probabilities. These kernels compute the same
logits tile by tile from the operands' integer digits and never store them, in three passes over the
keys (each its own ``pallas_call``, so that a caller can ``pmax`` / ``psum`` the row statistics over a
mesh between them):

1. :func:`row_max`: ``m = max_k z[r, k]`` over the causal (and same-document) keys;
2. :func:`exp_digit_sums`: the fixed-point digits of ``e = exp((z - m) * scale)``, summed over keys
   (the softmax denominator as exact integers);
3. :func:`column_digit_sums`: the fixed-point digits of ``a = e / denom``, summed over the window rows
   of each row tile (the vertical and slash scores as exact integers).

Logits: ``z = (sum_l 2^(-w l) L_l) * q_scale * k_scale`` with ``L_l = sum_{a + b = l} q_a . k_b``
over the operands' balanced digits (``bf16`` integers, ``|d| <= 2^(w-1)``): every ``L_l`` is an
integer below ``2^24``, exact in float32 in any summation order, so the bits of ``z`` are those of
the XLA path's ``exact_logits.window_logits`` whatever the tiling. Every later step is one elementwise operation
in the XLA path's order (``exp`` and an IEEE division, ``div.rn.f32`` on the GPU), and every sum is of
integers. Op by op (interpret mode on the CPU, not jitted) the results are the XLA path's bit for bit
(``tests/test_window_scores.py``). Compiled, the two paths' ``exp`` may round differently: on a GPU
the kernels' is libdevice's, and XLA's CPU ``exp`` inside a fusion is not its ``exp`` alone (jitted at
2K, 14/2 heads, the XLA path's own scores move in 14 of 28,672 vertical entries by one unit; the
kernels' do not move). So the two may differ in the last bit of a probability: each path is
deterministic and layout / mesh / program invariant on its own, and a model uses one.

Shapes (the estimate's own; no transposes): query digits ``bf16 [B, R, Hq, J, D]`` with row scales
``f32 [B, R, Hq]``, key digits ``bf16 [B, Sk, Hkv, J, D]`` with ``f32 [B, Sk, Hkv]``, key positions
``int32 [Sk]`` (any order), window rows at global positions ``first .. first + R - 1`` or, for a
window of scattered rows (every document's own last queries), ``q_pos int32 [B, R]`` (``-1``: a
padding row, which sees no key; a program whose rows can see none of its key chunk loads nothing,
:func:`live_programs`, and a key tile that no row of the program sees is skipped, :func:`_skipping`:
both exactly what the masked work gives); optional document ids ``int32 [B, R]`` / ``[B, Sk]``.
Supported (:func:`supports`): ``R`` and ``D`` powers of two >= 16, ``Sk`` a multiple of 16.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._compat import dot, triton_compiler_params
from pallas_kernels.registry import compute_capability

#: keys per program (a power of two dividing ``Sk``, at most this) and per inner tile; window rows
#: per program; Triton's warps and pipeline stages per program (``benchmarks/window_tiles.py`` times
#: other choices: results/training/train_throughput.md run 29; read at trace time)
KEY_CHUNK, KEY_TILE, ROW_TILE = 1024, 64, 64
NUM_WARPS, NUM_STAGES = 4, 2
#: shared memory one program may take (Hopper's opt-in maximum per block, 227 KiB; other GPUs:
#: :data:`SMEM_BY_CAPABILITY`): a key tile that would need more is halved (:func:`smem_bytes`)
SMEM_BYTES = 232448
#: opt-in shared memory per block by CUDA compute capability (CUDA programming guide, "Technical
#: Specifications per Compute Capability"); a capability not listed gets the smallest of them
SMEM_BY_CAPABILITY = {"7.0": 98304, "7.5": 65536, "8.0": 166912, "8.6": 101376, "8.7": 166912, "8.9": 101376,
                      "9.0": SMEM_BYTES, "10.0": SMEM_BYTES, "12.0": 101376}


def smem_limit() -> int:
    """Shared memory a program may take on this platform: :data:`SMEM_BY_CAPABILITY` of the first
    device's compute capability on a CUDA GPU, :data:`SMEM_BYTES` elsewhere (interpret mode)."""
    cc = compute_capability()
    if cc is None:
        return SMEM_BYTES
    return min(SMEM_BY_CAPABILITY.get(str(cc), min(SMEM_BY_CAPABILITY.values())), SMEM_BYTES)


class WindowOperands(NamedTuple):
    """The estimate's operands of the window logits (module docstring for shapes)."""

    q_digits: jax.Array
    q_scale: jax.Array
    k_digits: jax.Array
    k_scale: jax.Array
    k_pos: jax.Array
    q_seg: jax.Array | None = None
    k_seg: jax.Array | None = None
    q_pos: jax.Array | None = None


def _pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def supports(rows: int, keys: int, head_dim: int) -> None:
    """``NotImplementedError`` naming the value these kernels cannot take (the window rows
    ``last_q``, the local keys, the head dimension)."""
    if not _pow2(rows):
        raise NotImplementedError(f"the Triton window kernels need the window rows (last_q, or window_blocks x "
                                  f"block_size) a power of two >= 16, got {rows}")
    if not _pow2(head_dim):
        raise NotImplementedError(f"the Triton window kernels need head_dim a power of two >= 16, got {head_dim}")
    if keys % 16:
        raise NotImplementedError(f"the Triton window kernels need the local keys a multiple of 16, got {keys}")


def row_tile(rows: int, block_size: int) -> int:
    """Window rows per program: ``min(ROW_TILE, rows, block_size)``, so that a row tile never
    straddles a query block (the window starts at a multiple of it)."""
    return min(ROW_TILE, rows, block_size)


def smem_bytes(key_tile: int, rows: int, digits: int, head_dim: int) -> int:
    """Shared memory of one program's pipelined operands, an upper bound of Triton's request:
    ``NUM_STAGES`` key tiles and the row tile, each ``digits`` bf16 planes of ``head_dim`` plus a
    float32 scale and an int32 position or document id per row (on an H200 the compiler asked for
    246,272 bytes at key tile 128, 2 stages, 64 rows, 3 digits, d128; this gives 248,320)."""
    n = NUM_STAGES * key_tile + rows
    return n * digits * head_dim * 2 + n * 8


def _key_chunk(keys: int, rows: int = 0, digits: int = 0, head_dim: int = 0) -> tuple[int, int]:
    """``(kc, tk)``: keys per program (the largest power of two <= ``KEY_CHUNK`` dividing ``keys``)
    and per inner tile (``KEY_TILE``, halved while :func:`smem_bytes` exceeds :func:`smem_limit`)."""
    kc = KEY_CHUNK
    while keys % kc:
        kc //= 2
    tk = min(KEY_TILE, kc)
    limit = smem_limit()
    while tk > 16 and smem_bytes(tk, rows, digits, head_dim) > limit:
        tk //= 2
    return kc, tk


def _grid_specs(ops: WindowOperands, tr: int):
    """``(grid, in_specs, nrt, nkc, kc, tk)``: grid ``(key chunk c, query head h, b * nrt + row tile)``."""
    B, R, Hq, J, D = ops.q_digits.shape
    Sk, Hkv = ops.k_digits.shape[1], ops.k_digits.shape[2]
    g = Hq // Hkv
    nrt = R // tr
    kc, tk = _key_chunk(Sk, tr, J, D)
    nkc = Sk // kc

    specs = [pl.BlockSpec((None, tr, None, None, D), lambda c, h, i, j=j: (i // nrt, i % nrt, h, j, 0))
             for j in range(J)]
    specs.append(pl.BlockSpec((None, tr, None), lambda c, h, i: (i // nrt, i % nrt, h)))
    specs += [pl.BlockSpec((None, kc, None, None, D), lambda c, h, i, j=j: (i // nrt, c, h // g, j, 0))
              for j in range(J)]
    specs.append(pl.BlockSpec((None, kc, None), lambda c, h, i: (i // nrt, c, h // g)))
    specs.append(pl.BlockSpec((kc,), lambda c, h, i: (c,)))
    if ops.q_seg is not None:
        specs += [pl.BlockSpec((None, tr), lambda c, h, i: (i // nrt, i % nrt)),
                  pl.BlockSpec((None, kc), lambda c, h, i: (i // nrt, c))]
    if ops.q_pos is not None:  # the rows' positions, and whether the program has any visible pair
        specs += [pl.BlockSpec((None, tr), lambda c, h, i: (i // nrt, i % nrt)),
                  pl.BlockSpec((None, None, None), lambda c, h, i: (i // nrt, i % nrt, c))]
    return (nkc, Hq, B * nrt), specs, nrt, nkc, kc, tk


def live_programs(ops: WindowOperands, tr: int, kc: int):
    """``int32 [B, R // tr, Sk // kc]``: 0 where no (row, key) pair of the program (row tile, key
    chunk) can be visible, so the program skips its key tiles without loading anything (what a
    program whose every tile is masked gives: exactly the same result), else 1. Exact sufficient
    conditions only (any layout, any document ids): no key of the chunk at or before the tile's
    latest row position, or the rows' and the keys' document id ranges disjoint. The per-document
    window's row tile sees only its own document's keys: about 3 of 128 key chunks at 128K with
    the packed-documents benchmark's 47 documents (``results/documents/packed_documents.md``)."""
    B, R = ops.q_pos.shape
    Sk = ops.k_pos.shape[0]
    qmax = ops.q_pos.astype(jnp.int32).reshape(B, R // tr, tr).max(axis=-1)
    kmin = ops.k_pos.astype(jnp.int32).reshape(Sk // kc, kc).min(axis=-1)
    live = qmax[:, :, None] >= kmin[None, None, :]
    if ops.q_seg is not None:
        qs = ops.q_seg.astype(jnp.int32).reshape(B, R // tr, tr)
        ks = ops.k_seg.astype(jnp.int32).reshape(B, Sk // kc, kc)
        live &= (qs.min(axis=-1)[:, :, None] <= ks.max(axis=-1)[:, None, :])
        live &= (ks.min(axis=-1)[:, None, :] <= qs.max(axis=-1)[:, :, None])
    return live.astype(jnp.int32)


def _operands(ops: WindowOperands, J: int, tr: int, kc: int):
    args = [ops.q_digits] * J + [ops.q_scale] + [ops.k_digits] * J + [ops.k_scale, ops.k_pos]
    if ops.q_seg is not None:
        args += [ops.q_seg.astype(jnp.int32), ops.k_seg.astype(jnp.int32)]
    if ops.q_pos is not None:
        args += [ops.q_pos.astype(jnp.int32), live_programs(ops, tr, kc)]
    return args


def _tile_logits(refs, J: int, w: int, first: int | None, tr: int, nrt: int, segs: bool):
    """``(visible, logits)``: ``visible(rows) -> ok [tr, tk] bool`` (causal, same document) and
    ``logits(rows) -> z [tr, tk] f32`` of the keys ``rows`` (a ``pl.ds``); ``first=None``: the rows'
    positions are the ``q_pos`` operand."""
    q_refs, qs_ref = refs[:J], refs[J]
    k_refs, ks_ref, kpos_ref = refs[J + 1:2 * J + 1], refs[2 * J + 1], refs[2 * J + 2]
    qseg_ref, kseg_ref = (refs[2 * J + 3], refs[2 * J + 4]) if segs else (None, None)
    qd = [r[...] for r in q_refs]
    sq = qs_ref[...]
    if first is None:
        qpos = refs[_n_fixed(J, segs, False)][...]
    else:
        t = pl.program_id(2) % nrt
        qpos = first + t * tr + jnp.arange(tr, dtype=jnp.int32)
    qseg = qseg_ref[...] if segs else None

    def visible(rows):
        ok = kpos_ref[rows][None, :] <= qpos[:, None]
        if segs:
            ok = ok & (kseg_ref[rows][None, :] == qseg[:, None])
        return ok

    def logits(rows):
        kd = [r[rows, :] for r in k_refs]
        z = None
        for lw in range(J):  # L_l = sum_{a+b=l} q_a . k_b: integers < 2^24, exact in any order
            part = None
            for a in range(lw + 1):
                p = dot(qd[a], kd[lw - a], trans_b=True)
                part = p if part is None else part + p
            z = part if z is None else z + part * np.float32(2.0 ** (-w * lw))
        return z * sq[:, None] * ks_ref[rows][None, :]

    return visible, logits


def _skipping(skip_tiles: bool, ok, compute, skip, carry):
    """``compute(carry)`` where some pair of the tile is visible, else ``skip(carry)`` (what an
    all-masked tile gives: exactly the same result), when ``skip_tiles``: a window of scattered rows
    (``q_pos``, the per-document window), whose rows see their own documents' keys alone, so that
    most key tiles are other documents' (about 2 % of the tiles visible on the packed-documents
    benchmark's 47 documents at 128K). Otherwise the loop stays branch-free as tuned (a sequence
    window sees every key tile but the last; with documents, the last document's alone, but the
    branch is not yet timed there on a GPU)."""
    if not skip_tiles:
        return compute(carry)
    return lax.cond(jnp.max(ok.astype(jnp.int32)) > 0, compute, skip, carry)


def _n_fixed(J: int, segs: bool, rows: bool) -> int:
    """Operands before the pass's own: digits and scales, key positions, document ids, row positions
    and the program's :func:`live_programs` flag."""
    return 2 * J + 3 + (2 if segs else 0) + (2 if rows else 0)


def _if_live(refs, J: int, segs: bool, first: int | None, run, dead):
    """``run()`` in a program that may have a visible pair, else ``dead()`` (which loads nothing):
    the flag of :func:`live_programs`, for a window of scattered rows (``first=None``); a sequence
    window's programs always run (branch-free as tuned)."""
    if first is not None:
        return run()
    live = refs[_n_fixed(J, segs, False) + 1][...]
    return lax.cond(live > 0, lambda _: run(), lambda _: dead(), 0)


def _first(ops: WindowOperands, first: int | None) -> int | None:
    """The static first window position, or ``None`` where the rows' positions are ``ops.q_pos``."""
    if (first is None) == (ops.q_pos is None):
        raise ValueError(f"give the window rows either as first={first!r} or as q_pos, exactly one of them")
    return first


def _call(kernel, name: str, ops, out_shape, out_specs, extra_args, extra_specs, interpret, grid, specs, tr: int):
    """The pass ``kernel`` as one ``pallas_call`` named ``name`` (what a profile shows)."""
    kc = ops.k_digits.shape[1] // grid[0]
    return pl.pallas_call(kernel, grid=grid, in_specs=specs + extra_specs, out_specs=out_specs, out_shape=out_shape,
                          compiler_params=triton_compiler_params(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
                          interpret=interpret, name=name)(*_operands(ops, ops.q_digits.shape[3], tr, kc), *extra_args)



def _key_tile(i, tk: int):
    """The ``i``-th ``tk``-row tile of a key chunk, its start marked a multiple of ``tk`` (a loop index;
    ``pl.multiple_of`` on a constant fails in JAX 0.11's Triton lowering, which folds a one-trip
    ``fori_loop``'s index to a constant: ``'TypedInt' object has no attribute 'owner'``)."""
    if isinstance(i, (int, np.integer)):
        return pl.ds(int(i) * tk, tk)
    return pl.ds(pl.multiple_of(i * tk, tk), tk)


def _over_tiles(n: int, body, init):
    """``lax.fori_loop(0, n, body, init)``; one tile: ``body(0, init)`` (a Python index, see :func:`_key_tile`)."""
    return body(0, init) if n == 1 else lax.fori_loop(0, n, body, init)

def row_max(ops: WindowOperands, *, first: int | None, w: int, block_size: int, interpret: bool = False):
    """``f32 [B, Hq, R]``: each window row's largest logit over the local causal (same-document) keys
    (``-inf`` where it has none); ``pmax`` it over a mesh."""
    B, R, Hq, J, _ = ops.q_digits.shape
    segs = ops.q_seg is not None
    first = _first(ops, first)
    tr = row_tile(R, block_size)
    grid, specs, nrt, nkc, kc, tk = _grid_specs(ops, tr)
    nf = _n_fixed(J, segs, ops.q_pos is not None)

    def kernel(*refs):
        def run():
            visible, logits = _tile_logits(refs, J, w, first, tr, nrt, segs)

            def body(i, mx):
                rows = _key_tile(i, tk)
                ok = visible(rows)

                def fold(mx):
                    return jnp.maximum(mx, jnp.max(jnp.where(ok, logits(rows), -jnp.inf), axis=1))

                return _skipping(first is None, ok, fold, lambda mx: mx, mx)

            return _over_tiles(kc // tk, body, jnp.full((tr,), -jnp.inf, jnp.float32))

        refs[nf][...] = _if_live(refs, J, segs, first, run, lambda: jnp.full((tr,), -jnp.inf, jnp.float32))

    out = _call(kernel, "triton_window_row_max", ops, jax.ShapeDtypeStruct((B, Hq, nkc, R), jnp.float32),
                pl.BlockSpec((None, None, None, tr), lambda c, h, i: (i // nrt, h, c, i % nrt)), [], [], interpret,
                grid, specs, tr)
    return out.max(axis=2)


def fixed_point_digits(x, widths: Sequence[int]):
    """Fixed-point digits of ``x`` in ``[0, 1]`` (float32): ``int32`` ``d_j`` with
    ``x = sum_j d_j 2^-(w_0 + .. + w_j) + rest``, ``0 <= rest < 2^-sum(w)``, ``d_0 <= 2^w_0``.

    Every step (a power-of-two scaling, a floor, the subtraction of the integer part) is exact in
    floating point, so the digits are the exact truncation of ``x``, however the program is
    compiled or fused (the estimate's XLA path uses this function too)."""
    out, t = [], x
    for wd in widths:
        t = t * np.float32(2.0**wd)
        d = jnp.floor(t)
        out.append(d.astype(jnp.int32))
        t = t - d
    return out


def _row_spec(nrt: int, tr: int):
    return pl.BlockSpec((None, None, tr), lambda c, h, i: (i // nrt, h, i % nrt))


def _probabilities(z, ok, m, scale):
    return jnp.where(ok, jnp.exp((z - m[:, None]) * np.float32(scale)), np.float32(0.0))


def exp_digit_sums(ops: WindowOperands, m, *, first: int | None, w: int, block_size: int, scale: float,
                   widths: Sequence[int], interpret: bool = False):
    """``int32 [len(widths), B, Hq, R]``: per window row, the sums over the local keys of the digits
    (``widths`` bits each) of ``e = exp((z - m) * scale)`` (zero off the causal keys); ``m`` the rows'
    global max ``f32 [B, Hq, R]``. ``psum`` it over a mesh."""
    B, R, Hq, J, _ = ops.q_digits.shape
    segs = ops.q_seg is not None
    first = _first(ops, first)
    tr = row_tile(R, block_size)
    grid, specs, nrt, nkc, kc, tk = _grid_specs(ops, tr)
    nf, nd = _n_fixed(J, segs, ops.q_pos is not None) + 1, len(widths)

    def kernel(*refs):
        zeros = tuple(jnp.zeros((tr,), jnp.int32) for _ in range(nd))

        def run():
            visible, logits = _tile_logits(refs, J, w, first, tr, nrt, segs)
            mrow = refs[nf - 1][...]

            def body(i, sums):
                rows = _key_tile(i, tk)
                ok = visible(rows)

                def add(sums):
                    ds = fixed_point_digits(_probabilities(logits(rows), ok, mrow, scale), widths)
                    return tuple(s + d.sum(axis=1, dtype=jnp.int32) for s, d in zip(sums, ds))

                return _skipping(first is None, ok, add, lambda sums: sums, sums)

            return _over_tiles(kc // tk, body, zeros)

        sums = _if_live(refs, J, segs, first, run, lambda: zeros)
        for j in range(nd):
            refs[nf + j][...] = sums[j]

    shape = jax.ShapeDtypeStruct((B, Hq, nkc, R), jnp.int32)
    spec = pl.BlockSpec((None, None, None, tr), lambda c, h, i: (i // nrt, h, c, i % nrt))
    outs = _call(kernel, "triton_window_exp_digit_sums", ops, (shape,) * nd, (spec,) * nd, [m], [_row_spec(nrt, tr)],
                 interpret, grid, specs, tr)
    return jnp.stack([o.sum(axis=2, dtype=jnp.int32) for o in outs])


def _div_rn(x, y, interpret: bool):
    """IEEE ``x / y`` (round to nearest): Triton's own ``/`` on float32 is ``div.full.f32``, an
    approximation within 2 ulp."""
    if interpret:
        return x / y
    return plgpu.elementwise_inline_asm("div.rn.f32 $0, $1, $2;", args=[x, y], constraints="=f,f,f", pack=1,
                                        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])[0]


def column_digit_sums(ops: WindowOperands, m, denom, *, first: int | None, w: int, block_size: int, scale: float,
                      widths: tuple[int, int], interpret: bool = False):
    """``(hi, lo) int32 [B, Hq, R // row_tile, Sk]``: per row tile and local key, the sums over the
    tile's window rows of the two fixed-point digits (``widths``) of ``a = e / denom`` (``denom``
    ``f32 [B, Hq, R]``, the rows' global softmax denominators)."""
    B, R, Hq, J, _ = ops.q_digits.shape
    Sk = ops.k_digits.shape[1]
    segs = ops.q_seg is not None
    first = _first(ops, first)
    tr = row_tile(R, block_size)
    grid, specs, nrt, nkc, kc, tk = _grid_specs(ops, tr)
    nf = _n_fixed(J, segs, ops.q_pos is not None) + 2

    def kernel(*refs):
        hi_ref, lo_ref = refs[nf], refs[nf + 1]

        def run():
            visible, logits = _tile_logits(refs, J, w, first, tr, nrt, segs)
            mrow, drow = refs[nf - 2][...], refs[nf - 1][...]

            def body(i, carry):
                rows = _key_tile(i, tk)
                ok = visible(rows)

                def write(carry):
                    e = _probabilities(logits(rows), ok, mrow, scale)
                    a = _div_rn(e, jnp.broadcast_to(drow[:, None], e.shape), interpret)
                    hi, lo = fixed_point_digits(a, widths)
                    hi_ref[rows] = hi.sum(axis=0, dtype=jnp.int32)
                    lo_ref[rows] = lo.sum(axis=0, dtype=jnp.int32)
                    return carry

                def zeros(carry):
                    hi_ref[rows] = jnp.zeros((tk,), jnp.int32)
                    lo_ref[rows] = jnp.zeros((tk,), jnp.int32)
                    return carry

                return _skipping(first is None, ok, write, zeros, carry)

            return _over_tiles(kc // tk, body, 0)

        def dead():  # the whole chunk's sums are zero
            hi_ref[...] = jnp.zeros((kc,), jnp.int32)
            lo_ref[...] = jnp.zeros((kc,), jnp.int32)
            return 0

        _if_live(refs, J, segs, first, run, dead)

    shape = jax.ShapeDtypeStruct((B, Hq, nrt, Sk), jnp.int32)
    spec = pl.BlockSpec((None, None, None, kc), lambda c, h, i: (i // nrt, h, i % nrt, c))
    return _call(kernel, "triton_window_column_digit_sums", ops, (shape, shape), (spec, spec), [m, denom],
                 [_row_spec(nrt, tr)] * 2, interpret, grid, specs, tr)
