"""Mosaic GPU kernel streams: which stream each pass walks, and the uniform full index (CPU).

``kernel_stream`` (:data:`pallas_kernels.registry.STREAMS`) reaches the forward and dQ kernels
through the backend; ``"auto"`` resolves per pass (:func:`pallas_kernels.mosaic_stream.resolve_stream`):
the forward chooses per call from the index, the dQ takes the split stream, and the API's full
index (``index=None``, ``uniform_index``) takes the shared stream with operands built from one row.
These tests check the choice from the index, the operands, and what each choice lowers for CUDA.
The kernels' results run in the GPU-marked suite of ``test_kernels_gpu.py`` (``TestMosaicGPU``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import mosaic_index
from pallas_kernels.testing import lowering_inputs

BS = 64


@settings(max_examples=10, deadline=None)
@given(shift=st.integers(-6, 8), gap=st.integers(0, 70))
def test_uniform_index_operands_equal_the_general_build(shift, gap):
    """``uniform=True`` (the full index the API builds for ``index=None``: every (batch, head) row alike)
    builds the stream operands from one row and broadcasts them: exactly the general build's, for every
    stream, on ring-like positions (queries ``shift`` blocks after the keys' start: diagonal, partly and
    wholly visible chunks; ``gap`` positions between key blocks). One shape (2 batches, 4 / 2 heads, 4
    query and 6 key blocks), so the examples reuse one compiled build."""
    from pallas_kernels.index_format import full_step_index
    from pallas_kernels.mosaic_stream import stream_operands

    B, hkv, g, nqb, nkb = 2, 2, 2, 4, 6
    H, S, Sk = hkv * g, nqb * BS, nkb * BS
    kp = jnp.asarray(np.arange(Sk) + np.repeat(np.arange(nkb), BS) * gap, jnp.int32)  # gaps between key blocks
    qp = jnp.arange(S, dtype=jnp.int32) + shift * BS
    idx = full_step_index(B, H, S, Sk, qp, kp, BS)
    rng = np.random.default_rng(nqb * nkb)
    k = jnp.asarray(rng.standard_normal((B, Sk, hkv, 64)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((B, Sk, hkv, 64)), jnp.bfloat16)
    for stream, kv_step in (("shared", 64), ("shared", 128), ("split", 128)):
        general = stream_operands(idx, k, v, qp, kp, BS, None, kv_step, None, stream)
        one = stream_operands(idx, k, v, qp, kp, BS, None, kv_step, None, stream, uniform=True)
        for a, b in zip(jax.tree.leaves(general), jax.tree.leaves(one), strict=True):
            a, b = np.asarray(a), np.asarray(b)
            assert a.shape == b.shape and a.dtype == b.dtype
            np.testing.assert_array_equal(a, b)
    # the dK/dV block pass's schedule: every (batch, KV head) list the general build's, entry for entry
    e, c = mosaic_index.kv_schedule(idx, Sk, hkv, BS)
    eu, cu = mosaic_index.uniform_kv_schedule(idx, Sk, hkv, BS)
    np.testing.assert_array_equal(np.asarray(c[..., :2]), np.asarray(cu[..., :2]))
    L = g * nqb
    live = np.arange(L) < np.asarray(c[..., 1:2])
    np.testing.assert_array_equal(np.where(live, mosaic_index.dense_kv_schedule(e, c, L), -1),
                                  np.where(live, mosaic_index.dense_kv_schedule(eu, cu, L), -1))


def test_the_api_marks_only_its_own_full_index_uniform():
    """``_kernel_index``: the full index built for ``index=None`` is uniform; a given index, or the full
    index narrowed to packed documents, is not (its rows differ by batch); a backend that takes
    ``index=None`` itself (XLA) gets none."""
    from types import SimpleNamespace

    from pallas_kernels import api, backend_xla
    from pallas_kernels.index_format import full_step_index

    B, S, H = 2, 256, 4
    q = jnp.zeros((B, S, H, 64), jnp.bfloat16)
    pos = jnp.arange(S, dtype=jnp.int32)
    assert api._kernel_index(backend_xla, None, q, q, pos, pos, BS) == (None, False)
    backend = SimpleNamespace(NEEDS_INDEX=True)  # the Mosaic and Triton backends
    idx, uniform = api._kernel_index(backend, None, q, q, pos, pos, BS)
    assert uniform and idx.block_idx.shape[:2] == (B, H)
    given = full_step_index(B, H, S, S, pos, pos, BS)
    assert api._kernel_index(backend, given, q, q, pos, pos, BS)[1] is False
    segs = (jnp.zeros((B, S), jnp.int32), jnp.zeros((B, S), jnp.int32))
    assert api._kernel_index(backend, None, q, q, pos, pos, BS, segs)[1] is False


def test_uniform_index_kernels_lower_for_cuda():
    """With ``uniform_index`` the backend lowers the shared stream's forward and dQ kernels (the stream
    the per-call choice takes on the full index) and builds their operands once."""
    from pallas_kernels import backend_mosaic
    from pallas_kernels.index_format import full_step_index

    B, S, H, q, k, pos, _ = lowering_inputs(4)
    idx = full_step_index(B, H, S, S, pos, pos, BS)
    lse = jnp.zeros((B, H, S))
    counts = {}
    for uniform in (False, True):
        f = jax.jit(lambda q, k, idx, u=uniform: backend_mosaic.fwd(q, k, k, pos, pos, idx, None, sm_scale=0.1,
                                                                    block_size=BS, uniform_index=u))
        g = jax.jit(lambda q, k, idx, u=uniform: backend_mosaic.bwd(q, k, k, pos, pos, idx, q, lse, lse, None, None,
                                                                    sm_scale=0.1, block_size=BS, uniform_index=u))
        texts = [h.trace(q, k, idx).lower(lowering_platforms=("cuda",)).as_text() for h in (f, g)]
        counts[uniform] = [t.count("custom_call @mosaic_gpu") for t in texts]
    # stream "auto": on a listed index the forward's two streams and the dQ's split one; on the uniform
    # full index the shared stream of each (what "index" would choose there: test_full_index_takes_the_shared_stream)
    assert counts == {False: [2, 3], True: [1, 3]}


def test_backend_takes_the_stream_to_the_kernels():
    """``stream`` (``RingOptions.kernel_stream``) reaches the Mosaic forward and dQ through the
    backend: ``"index"`` lowers both streams' kernels under one conditional, a fixed stream one kernel,
    ``"auto"`` the forward's conditional and the dQ's split kernel, the same program as ``"split"``'s
    backward. The dK/dV passes (two kernels) run on their own lists whatever ``stream`` says: the
    block pass's shared stream (``mosaic_dkv_blocks(stream="shared")``) is slower (results run 34)."""
    from pallas_kernels import backend_mosaic

    B, S, H, q, k, pos, idx = lowering_inputs(3)
    lse = jnp.zeros((B, H, S))
    counts = {}
    texts = {}
    for stream in ("auto", "index", "shared", "split"):
        f = jax.jit(lambda q, k, idx, s=stream: backend_mosaic.fwd(q, k, k, pos, pos, idx, None, sm_scale=0.1,
                                                                   block_size=64, stream=s))
        g = jax.jit(lambda q, k, idx, s=stream: backend_mosaic.bwd(q, k, k, pos, pos, idx, q, lse, lse, None, None,
                                                                   sm_scale=0.1, block_size=64, stream=s))
        texts[stream] = [h.trace(q, k, idx).lower(lowering_platforms=("cuda",)).as_text() for h in (f, g)]
        counts[stream] = [(t.count("custom_call @mosaic_gpu"), t.count("stablehlo.case")) for t in texts[stream]]
    assert counts == {"auto": [(2, 1), (3, 0)], "index": [(2, 1), (4, 1)], "shared": [(1, 0), (3, 0)],
                      "split": [(1, 0), (3, 0)]}
    assert texts["auto"][0] == texts["index"][0] and texts["auto"][1] == texts["split"][1]
    with pytest.raises(ValueError, match="kernel must be one of"):
        from pallas_kernels.mosaic_stream import resolve_stream
        resolve_stream("auto", "dkv_cols")
    assert [resolve_stream("auto", "dkv", uniform=u) for u in (False, True)] == ["split", "split"]


@pytest.mark.parametrize("family, split", [("band", False), ("vert", False), ("spread", True), ("mixed", True)])
def test_auto_stream_choice_per_family(family, split):
    """``stream="auto"`` takes the split stream where adjacent query blocks share few tiles (spread
    diagonals, mixed) and the shared stream where they list the same tiles (a band, verticals):
    the choice run 13 measured faster, made from the index on the device (both step widths)."""
    from pallas_kernels.mosaic_index import pair_stream, prepare
    from pallas_kernels.mosaic_stream import SPLIT_ABOVE, prefer_split, stream_per_work
    from pallas_kernels.testing import index_family

    S, H = 131072, 2  # run 13's length (shorter rows hold too few tiles to tell the families apart)
    idx = jax.tree.map(jnp.asarray, index_family(np.random.default_rng(1), family, 1, H, S, 0.05, block_size=BS,
                                                 vert_cols=4096))
    pos = jnp.arange(S, dtype=jnp.int32)
    k = jnp.zeros((1, S, 1, 64), jnp.bfloat16)
    ops = prepare(idx, k, k, pos, BS, pos)
    for halves in (1, 2):
        share = float(stream_per_work(ops, pair_stream(ops, halves), halves))
        assert 0.5 <= share <= 1.0 and (share > SPLIT_ABOVE) == split, (family, halves, share)
        assert bool(prefer_split(ops, pair_stream(ops, halves), halves)) == split


@pytest.mark.parametrize("S, shift", [(128, 0), (256, 0), (1024, 0), (1024, 2), (4096, 0), (4096, 64)])
def test_full_index_takes_the_shared_stream(S, shift):
    """On the full index (the API's ``index=None``, built once per call: ``uniform_index``) the
    per-call choice is the shared stream at both step widths, so ``stream="auto"`` resolves to it
    there without compiling the split kernel: causal (``shift`` 0) and a ring step whose queries lie
    ``shift`` blocks after the keys' start (diagonal, partly and wholly visible blocks)."""
    from pallas_kernels.index_format import full_step_index
    from pallas_kernels.mosaic_index import pair_stream, prepare
    from pallas_kernels.mosaic_stream import prefer_split, resolve_stream, stream_per_work

    kp = jnp.arange(S, dtype=jnp.int32)
    qp = kp + shift * BS
    idx = full_step_index(1, 2, S, S, qp, kp, BS)
    k = jnp.zeros((1, S, 1, 64), jnp.bfloat16)
    ops = prepare(idx, k, k, kp, BS, qp)
    for halves in (1, 2):
        share = float(stream_per_work(ops, pair_stream(ops, halves), halves))
        assert 0.5 <= share <= 0.7 and not bool(prefer_split(ops, pair_stream(ops, halves), halves)), (halves, share)
    assert [resolve_stream("auto", p, uniform=True) for p in ("fwd", "dq")] == ["shared", "shared"]
    assert [resolve_stream("auto", p) for p in ("fwd", "dq")] == ["index", "split"]


def test_kernel_lowering_benchmark_reports_every_case():
    """benchmarks/kernel_lowering.py: one row per case with both kernels' lowered sizes; stream
    "index" holds both streams' kernels, so it is larger than any one stream's; the defaults (stream
    "auto") are the forward's "index" and the dQ's split stream with segment loops."""
    from benchmarks.kernel_lowering import CASES, sizes

    rows = sizes()
    assert [r["case"] for r in rows] == [c[0] for c in CASES]
    by = {r["case"]: r for r in rows}
    for key in ("fwd_chars", "dq_chars"):
        assert by["index"][key] > max(by[c][key] for c in ("split, loops", "shared, switch"))
        assert by["shared, switch"][key] < by["shared, loops"][key]
    assert by["defaults"]["fwd_chars"] == by["index"]["fwd_chars"]
    assert by["defaults"]["dq_chars"] == by["split, loops"]["dq_chars"] < by["index"]["dq_chars"]


@settings(max_examples=200, deadline=None)
@given(lo0=st.integers(0, 40), n0=st.integers(0, 30), lo1=st.integers(0, 40), n1=st.integers(0, 30),
       f0=st.integers(0, 30), f1=st.integers(0, 30))
def test_column_pair_walk_visits_the_union_once_in_order(lo0, n0, lo1, n1, f0, f1):
    """The column dK/dV pass's shared walk (``col_walk="shared"``) of a CTA's two chunks: its ``n`` tiles
    are the union of the chunks' walks ``[lo, hi)``, ascending, each query block once (a gap between
    disjoint walks skipped, an empty walk ignored), ``tile_of`` inverts it, and each consumer's tiles
    classed by :func:`~pallas_kernels.mosaic_stream.column_tile_kind` (the ``"switch"`` walk) or by its
    five segment loops from ``tile_of`` (``"loops"``) are exactly its own walk, free on exactly its free
    blocks: the split walk's tiles and bodies, in another order."""
    from pallas_kernels.mosaic_stream import column_pair_loops, column_pair_walk, column_tile_kind

    walks = [(lo0, lo0 + n0), (lo1, lo1 + n1)]
    n, at, tile_of = column_pair_walk(*(np.int32(x) for w in walks for x in w))
    blocks = [int(at(np.int32(t))) for t in range(int(n))]
    assert blocks == sorted(set(range(*walks[0])) | set(range(*walks[1]))), (walks, blocks)
    assert all(int(tile_of(np.int32(qb))) == t for t, qb in enumerate(blocks))
    for (lo, hi), fl in zip(walks, (f0, f1)):
        f_lo = min(lo + fl // 3, hi)
        f_hi = min(f_lo + fl, hi)
        kinds = [int(column_tile_kind(np.int32(qb), lo, hi, f_lo, f_hi)) for qb in blocks]
        assert [qb for qb, k in zip(blocks, kinds) if k != 2] == list(range(lo, hi))
        assert [qb for qb, k in zip(blocks, kinds) if k == 0] == list(range(f_lo, f_hi))
        # the kernel's segment loops ("loops" walk): skip, masked, free, masked, skip runs, in order, cover
        # [0, n) once (a loop too many or too few and the kernel hangs) with the same classes
        runs = [tuple(int(x) for x in r)
                for r in column_pair_loops(n, tile_of, *(np.int32(x) for x in (lo, hi, f_lo, f_hi)))]
        assert [r[:2] for r in runs] == list(zip([0] + [r[1] for r in runs[:-1]], [r[1] for r in runs])), runs
        assert runs[-1][1] == int(n) and all(a <= b for a, b, _ in runs), runs
        assert [k for a, b, k in runs for _ in range(a, b)] == kinds, (walks, runs, kinds)


@pytest.mark.parametrize("documents", [False, True])
def test_column_pair_walk_loads_on_ordered_columns(documents):
    """What the shared column walk saves (CPU, a vertical-slash index with position-ordered columns, and
    packed documents): summed over every CTA (chunks ``2p``, ``2p + 1`` of a head, one range) the
    union's tiles are the split walks' tiles minus those both chunks walk, and on ordered columns
    adjacent chunks' walks overlap almost wholly, so the shared stream loads a bit over half the Q/dO
    tiles (0.54 plain; 0.65 with documents, whose chunks straddle two documents: 2026-12-07)."""
    from pallas_kernels.index_format import apply_segments, column_start
    from pallas_kernels.mosaic_stream import column_pair_walk
    from pallas_kernels.testing import vertical_slash_index

    rng = np.random.default_rng(3)
    S, R = 8192, 32
    pos = jnp.arange(S, dtype=jnp.int32)
    idx = vertical_slash_index(rng, 1, 2, S, 0.9, block_size=BS, far_slashes=1, max_cols=600)
    segs = (pos[None] // 3000, pos[None] // 3000) if documents else None
    if documents:
        idx = apply_segments(idx, *segs, BS)
    nch = -(-int(np.asarray(idx.col_count).max()) // BS)
    nch += nch % 2
    start = column_start(idx, *segs, BS) if documents else None
    first, end, nr = (np.asarray(x) if i < 2 else x for i, x in
                      enumerate(mosaic_index.column_ranges(idx.col_count, nch, BS, R, start)))
    split = union = both = 0
    for h, p, r in np.ndindex(first.shape[1], nch // 2, nr):
        w = [(max(first[0, h, c], r * R), max(min(end[0, h, c], (r + 1) * R), max(first[0, h, c], r * R)))
             for c in (2 * p, 2 * p + 1)]
        n = column_pair_walk(*(np.int32(x) for ww in w for x in ww))[0]
        split += sum(hi - lo for lo, hi in w)
        union += int(n)
        both += max(0, min(w[0][1], w[1][1]) - max(w[0][0], w[1][0]))
    assert union == split - both and split > 0
    assert 0.5 <= union / split < (0.7 if documents else 0.58), (union, split)
