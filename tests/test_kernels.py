"""Block-sparse attention kernels vs the masked dense float32 reference, one suite for every backend.

``_KernelSuite`` holds the cases; subclasses pick the backend: the XLA twin, the Pallas kernel in
interpret mode (CPU), and the Pallas kernel on a GPU (``@pytest.mark.gpu``, 8K-sized shapes;
run with ``pytest -m gpu tests/test_kernels.py``).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.reference import dense_attention
from pallas_kernels import api
from pallas_kernels.index_format import step_index_to_mask
from pallas_kernels.testing import random_step_index
from _observed import observed

BS = 64


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), "non-finite values"
    return observed(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _inputs(rng, B, Sq, Sk, H, Hkv, D, dtype):
    q = jnp.asarray(rng.standard_normal((B, Sq, H, D)), dtype)
    k = jnp.asarray(rng.standard_normal((B, Sk, Hkv, D)), dtype)
    v = jnp.asarray(rng.standard_normal((B, Sk, Hkv, D)), dtype)
    return q, k, v


def _positions(rng, Sq, Sk, permuted):
    """Global positions: plain arange, or a ring-like step (queries and keys from a permuted range)."""
    if not permuted:
        return jnp.arange(Sq, dtype=jnp.int32), jnp.arange(Sk, dtype=jnp.int32)
    perm = rng.permutation(Sq + Sk).astype(np.int32)
    return jnp.asarray(np.sort(perm[:Sq])), jnp.asarray(np.sort(perm[Sq:]))


def _reference(q, k, v, q_pos, k_pos, index):
    """Dense float32 reference with the index mask; ``(out, lse)``."""
    mask = None if index is None else step_index_to_mask(index, q.shape[1], k.shape[1], BS)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    return dense_attention(f32(q), f32(k), f32(v), q_pos, k_pos, mask)


def _document_segments(q_pos, k_pos, S, batch=2):
    """Segment ids ``(q_seg, k_seg) int32 [batch, S]`` of packed documents laid over the global
    positions (documents are runs of positions, so a ring step's chunks get the ids of their
    positions). Row 0: documents shorter than a block, ending exactly on block boundaries (64, 128)
    and longer ones; row 1: one document over many blocks, then a boundary inside a block."""
    rows = [sorted({5, 14, 64, 128, 200, S + 7, S + 3 * BS, 2 * S}), [1, S - 40, S + 24, 2 * S]]
    segs = [np.stack([np.searchsorted(np.asarray(e), np.asarray(p), side="right") for e in rows[:batch]])
            .astype(np.int32) for p in (q_pos, k_pos)]
    return jnp.asarray(segs[0]), jnp.asarray(segs[1])


class _KernelSuite:
    impl: str = "xla"
    S: int = 128  # query and key length
    H: int = 4
    # relative error against the float32 reference of the same (bf16-rounded) values: ~3x the largest
    # error observed on CPU (XLA twin, `MTRAINING_TEST_ERRORS`) over every test of the suite. bfloat16
    # inputs: out 9.9e-8, lse 5.0e-8 (both float32 results), dq/dk/dv 2.4e-3 (bf16 results); float32
    # inputs: out 3.2e-7, lse 6.6e-8, dq/dk/dv 4.8e-7. The float32 values also bound the float32 tests
    # (dense index, masked rows, ring accumulators).
    tol = {jnp.float32: 1e-6, jnp.bfloat16: 3e-7}  # forward output (float32)
    lse_tol = {jnp.float32: 2e-7, jnp.bfloat16: 1.5e-7}
    grad_tol = {jnp.float32: 1.5e-6, jnp.bfloat16: 7e-3}
    cases = [  # (gqa group, head_dim, dtype, permuted positions)
        (1, 64, jnp.float32, False),
        (4, 128, jnp.bfloat16, True),
    ]

    def _index(self, rng, B, q_pos, k_pos, sk):
        return random_step_index(rng, B, self.H, self.S, sk, q_pos, k_pos, max_blocks=max(1, sk // BS - 1),
                                 max_cols=12)

    @pytest.mark.parametrize("case", range(2))
    def test_forward_matches_reference(self, case):
        g, D, dtype, permuted = self.cases[case]
        rng = np.random.default_rng(10 + case)
        B = 1
        q, k, v = _inputs(rng, B, self.S, self.S, self.H, self.H // g, D, dtype)
        q_pos, k_pos = _positions(rng, self.S, self.S, permuted)
        index = self._index(rng, B, q_pos, k_pos, self.S)
        out, lse = api.block_sparse_attention_fwd(q, k, v, q_pos, k_pos, index, impl=self.impl)
        ref_out, ref_lse = _reference(q, k, v, q_pos, k_pos, index)
        chex.assert_shape(out, q.shape)
        chex.assert_shape(lse, (B, self.H, self.S))
        assert _rel(out, ref_out) < self.tol[dtype]
        fin = np.isfinite(np.asarray(ref_lse))
        np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), fin)  # empty rows: -inf
        assert _rel(np.asarray(lse)[fin], np.asarray(ref_lse)[fin]) < self.lse_tol[dtype]
        np.testing.assert_array_equal(np.asarray(out)[~np.moveaxis(fin, 1, 2)], 0.0)

    @pytest.mark.parametrize("case", range(2))
    def test_gradients_match_reference(self, case):
        g, D, dtype, permuted = self.cases[case]
        rng = np.random.default_rng(20 + case)
        B = 1
        q, k, v = _inputs(rng, B, self.S, self.S, self.H, self.H // g, D, dtype)
        q_pos, k_pos = _positions(rng, self.S, self.S, permuted)
        index = self._index(rng, B, q_pos, k_pos, self.S)
        ct = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)  # random non-uniform cotangent

        def loss(fn, q, k, v):
            return jnp.sum(fn(q, k, v).astype(jnp.float32) * ct)

        mine = jax.grad(lambda *a: loss(lambda q, k, v: api.block_sparse_attention(
            q, k, v, q_pos, k_pos, index, impl=self.impl), *a), argnums=(0, 1, 2))(q, k, v)
        f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
        ref = jax.grad(lambda *a: loss(lambda q, k, v: _reference(q, k, v, q_pos, k_pos, index)[0], *a),
                       argnums=(0, 1, 2))(f32(q), f32(k), f32(v))
        for name, a, b in zip("qkv", mine, ref):
            assert a.dtype == dtype, name
            assert _rel(a, b) < self.grad_tol[dtype], f"d{name}: {_rel(a, b)}"

    @pytest.mark.parametrize("case", range(2))
    def test_documents_match_reference(self, case):
        """Packed documents (segment ids per sequence): forward and all gradients equal the float32
        reference under (index mask AND block-diagonal document mask AND causal); tiles inside one
        document stay free, tiles across a boundary are dropped, straddling ones masked per token."""
        g, D, dtype, permuted = self.cases[case]
        rng = np.random.default_rng(40 + case)
        B = 2
        q, k, v = _inputs(rng, B, self.S, self.S, self.H, self.H // g, D, dtype)
        q_pos, k_pos = _positions(rng, self.S, self.S, permuted)
        index = self._index(rng, B, q_pos, k_pos, self.S)
        q_seg, k_seg = _document_segments(q_pos, k_pos, self.S, B)
        mask = step_index_to_mask(index, self.S, self.S, BS)
        f32 = lambda x: x.astype(jnp.float32)  # noqa: E731

        def ref(q, k, v, b):  # batch row b (the float32 reference's [S, S] logits one row at a time: at the
            # GPU suite's 8K, both rows' gradients held 12 GiB at once and ran out on an H100)
            rows = slice(b, b + 1)
            return dense_attention(f32(q[rows]), f32(k[rows]), f32(v[rows]), q_pos, k_pos, mask[rows],
                                   q_seg=q_seg[rows], k_seg=k_seg[rows])

        out, lse = api.block_sparse_attention_fwd(q, k, v, q_pos, k_pos, index, impl=self.impl, q_seg=q_seg,
                                                  k_seg=k_seg)
        refs = [ref(q, k, v, b) for b in range(B)]
        ref_out, ref_lse = (jnp.concatenate(x) for x in zip(*refs))
        assert _rel(out, ref_out) < self.tol[dtype]
        fin = np.isfinite(np.asarray(ref_lse))
        np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), fin)
        assert _rel(np.asarray(lse)[fin], np.asarray(ref_lse)[fin]) < self.lse_tol[dtype]
        ct = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
        mine = jax.grad(lambda *a: jnp.sum(api.block_sparse_attention(
            *a, q_pos, k_pos, index, impl=self.impl, q_seg=q_seg, k_seg=k_seg).astype(jnp.float32) * ct),
            argnums=(0, 1, 2))(q, k, v)
        want = [sum(g) for g in zip(*(jax.grad(lambda *a, b=b: jnp.sum(ref(*a, b)[0] * ct[b:b + 1]), argnums=(0, 1, 2))(
            f32(q), f32(k), f32(v)) for b in range(B)))]  # each row's gradient is zero in the other row
        for name, a, b in zip("qkv", mine, want):
            assert a.dtype == dtype, name
            assert _rel(a, b) < self.grad_tol[dtype], f"d{name}: {_rel(a, b)}"

    def test_documents_column_walk_starts_past_earlier_documents(self):
        """Packed documents with position-sorted columns: the forward's and dQ's column walks start at
        ``column_start`` (Triton: the row's chunk; Mosaic: the CTA's stream from its rows' earlier start
        step, the later row skipping to its own) and the column dK/dV passes skip a row's chunks before
        it (the second document's rows skip the first document's columns, two 64-column chunks and more
        here; the CTA of query blocks 8 and 9 has one row in each document), and out, lse and every
        gradient equal the float32 reference under the document mask (the suite's first case's dtype)."""
        from pallas_kernels.index_format import StepIndex, apply_segments, column_start

        _, D, dtype, _ = self.cases[0]
        rng = np.random.default_rng(11)
        S, H, nqb = 1024, 2, 16
        q, k, v = _inputs(rng, 1, S, S, H, 1, D, dtype)
        pos = jnp.arange(S, dtype=jnp.int32)
        cols = np.stack([np.sort(rng.choice(S, 320, replace=False)) for _ in range(H)])  # [H, 320] by position
        last = np.arange(nqb) * BS + BS - 1
        index = StepIndex(block_idx=jnp.asarray(np.broadcast_to(np.arange(nqb)[:, None], (1, H, nqb, 1)), jnp.int32),
                          block_count=jnp.ones((1, H, nqb), jnp.int32), block_causal=jnp.ones((1, H, nqb, 1), jnp.int32),
                          col_idx=jnp.asarray(cols[None], jnp.int32),
                          col_count=jnp.asarray((cols[None, :, None, :] <= last[None, None, :, None]).sum(-1), jnp.int32))
        seg = jnp.asarray((np.arange(S) >= 520)[None].astype(np.int32))  # documents [0, 520), [520, 1024)
        start = np.asarray(column_start(apply_segments(index, seg, seg, BS), seg, seg, BS))
        assert start[0, :, 9:].min() >= 2 * BS and start[0, :, :9].max() == 0, start  # rows 9+: 128 keys skipped
        mask = step_index_to_mask(index, S, S, BS)
        f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
        ref = lambda q, k, v: dense_attention(f32(q), f32(k), f32(v), pos, pos, mask, q_seg=seg, k_seg=seg)  # noqa: E731
        out, lse = api.block_sparse_attention_fwd(q, k, v, pos, pos, index, impl=self.impl, q_seg=seg, k_seg=seg)
        ref_out, ref_lse = ref(q, k, v)
        assert _rel(out, ref_out) < self.tol[dtype] and _rel(lse, ref_lse) < self.lse_tol[dtype]
        ct = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
        mine = jax.grad(lambda *a: jnp.sum(api.block_sparse_attention(
            *a, pos, pos, index, impl=self.impl, q_seg=seg, k_seg=seg).astype(jnp.float32) * ct),
            argnums=(0, 1, 2))(q, k, v)
        want = jax.grad(lambda *a: jnp.sum(ref(*a)[0] * ct), argnums=(0, 1, 2))(f32(q), f32(k), f32(v))
        for name, a, b in zip("qkv", mine, want):
            assert _rel(a, b) < self.grad_tol[dtype], f"d{name}: {_rel(a, b)}"

    def test_dense_index_none(self):
        """``index=None`` is dense causal-by-position attention (fwd and bwd)."""
        rng = np.random.default_rng(3)
        q, k, v = _inputs(rng, 2, self.S, self.S, self.H, 2, 64, jnp.float32)
        q_pos, k_pos = _positions(rng, self.S, self.S, True)
        out, lse = api.block_sparse_attention_fwd(q, k, v, q_pos, k_pos, None, impl=self.impl)
        ref_out, ref_lse = _reference(q, k, v, q_pos, k_pos, None)
        assert _rel(out, ref_out) < self.tol[jnp.float32]
        do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
        delta = api.attention_delta(ref_out, do)
        mine = api.block_sparse_attention_bwd(q, k, v, q_pos, k_pos, None, do, ref_lse, delta, impl=self.impl)
        _, vjp = jax.vjp(lambda q, k, v: dense_attention(q, k, v, q_pos, k_pos)[0], q, k, v)
        for name, a, b in zip("qkv", mine, vjp(do)):
            assert _rel(a, b) < self.grad_tol[jnp.float32], name

    def test_fully_masked_rows_no_nan(self):
        """Rows whose keys all lie in the future (or whose index is empty): out 0, lse -inf, grads finite."""
        rng = np.random.default_rng(4)
        S = self.S
        q, k, v = _inputs(rng, 1, S, S, self.H, self.H, 64, jnp.float32)
        q_pos = jnp.arange(S, dtype=jnp.int32)
        k_pos = q_pos + BS  # the first query block sees no key at all
        index = random_step_index(rng, 1, self.H, S, S, q_pos, k_pos, p_empty=0.5, max_cols=4)
        out, lse = api.block_sparse_attention_fwd(q, k, v, q_pos, k_pos, index, impl=self.impl)
        assert np.all(np.isneginf(np.asarray(lse)[:, :, :BS]))
        np.testing.assert_array_equal(np.asarray(out)[:, :BS], 0.0)
        grads = jax.grad(lambda q, k, v: jnp.sum(api.block_sparse_attention(
            q, k, v, q_pos, k_pos, index, impl=self.impl) ** 2), argnums=(0, 1, 2))(q, k, v)
        for gr in grads:
            assert np.all(np.isfinite(np.asarray(gr)))
        ref_out, _ = _reference(q, k, v, q_pos, k_pos, index)
        assert _rel(out, ref_out) < self.tol[jnp.float32]

    def test_ring_accumulators_merge_and_add(self):
        """Two ring steps over disjoint key chunks A, B: the forward of B with ``acc`` = A's
        ``(out, lse)`` equals attention over A ∪ B, and the backward of B with ``dq_acc`` /
        ``dkv_acc`` adds into them. Chunk A's first query block sees no key (empty rows merge)."""
        rng = np.random.default_rng(6)
        S, H, g = self.S, self.H, 2
        q, ka, va = _inputs(rng, 1, S, S, H, H // g, 64, jnp.float32)
        _, kb, vb = _inputs(rng, 1, S, S, H, H // g, 64, jnp.float32)
        perm = np.sort(rng.permutation(2 * S).astype(np.int32).reshape(2, S), axis=1)
        q_pos, kb_pos = jnp.asarray(perm[0] + BS), jnp.asarray(perm[1])
        ka_pos = jnp.asarray(np.sort(rng.permutation(3 * S)[:S].astype(np.int32)) + int(q_pos[BS - 1]) + 1)
        ia = random_step_index(rng, 1, H, S, S, q_pos, ka_pos, max_cols=12)
        ib = random_step_index(rng, 1, H, S, S, q_pos, kb_pos, max_cols=12)
        fa = api.block_sparse_attention_fwd(q, ka, va, q_pos, ka_pos, ia, impl=self.impl)
        out, lse = api.block_sparse_attention_fwd(q, kb, vb, q_pos, kb_pos, ib, impl=self.impl, acc=fa)
        cat = lambda a, b: jnp.concatenate([a, b], axis=1)  # noqa: E731
        k, v, k_pos = cat(ka, kb), cat(va, vb), jnp.concatenate([ka_pos, kb_pos])
        mask = jnp.concatenate([step_index_to_mask(ia, S, S, BS), step_index_to_mask(ib, S, S, BS)], axis=-1)
        ref_out, ref_lse = dense_attention(q, k, v, q_pos, k_pos, mask)
        tol = self.tol[jnp.float32]  # f32 inputs: TF32 tensor-core dots on the GPU
        assert np.all(np.isneginf(np.asarray(fa[1])[:, :, :BS]))  # chunk A: first block empty
        assert _rel(out, ref_out) < tol
        fin = np.isfinite(np.asarray(ref_lse))
        np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), fin)
        assert _rel(np.asarray(lse)[fin], np.asarray(ref_lse)[fin]) < self.lse_tol[jnp.float32]  # GPU: 6.7e-6

        do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
        delta = api.attention_delta(ref_out, do)
        dqa, _, _ = api.block_sparse_attention_bwd(q, ka, va, q_pos, ka_pos, ia, do, ref_lse, delta, impl=self.impl)
        acc = tuple(jnp.asarray(rng.standard_normal(kb.shape), jnp.float32) for _ in range(2))
        dq, dk, dv = api.block_sparse_attention_bwd(q, kb, vb, q_pos, kb_pos, ib, do, ref_lse, delta,
                                                    impl=self.impl, dq_acc=dqa, dkv_acc=acc)
        _, vjp = jax.vjp(lambda q, k, v: dense_attention(q, k, v, q_pos, k_pos, mask)[0], q, k, v)
        rq, rk, rv = vjp(do)
        gtol = self.grad_tol[jnp.float32]
        assert _rel(dq, rq) < gtol
        assert _rel(dk - acc[0], rk[:, S:]) < gtol
        assert _rel(dv - acc[1], rv[:, S:]) < gtol
        with pytest.raises(ValueError, match="dkv_acc"):
            api.block_sparse_attention_bwd(q, kb, vb, q_pos, kb_pos, ib, do, ref_lse, delta, impl=self.impl,
                                           dkv_acc=(acc[0][:, :BS], acc[1]))

    def test_dq_in_a_narrower_dtype_is_the_float32_dq_rounded_once(self):
        """``dq_dtype=bfloat16`` (a ring's last step): the same sum as the float32 dQ, ``dq_acc``
        included, rounded once (the Mosaic dQ kernel rounds in its epilogue, the others after)."""
        rng = np.random.default_rng(8)
        S, H, g = self.S, self.H, 2
        q, k, v = _inputs(rng, 1, S, S, H, H // g, 128, jnp.bfloat16)
        pos = jnp.arange(S, dtype=jnp.int32)
        index = self._index(rng, 1, pos, pos, S)
        out, lse = api.block_sparse_attention_fwd(q, k, v, pos, pos, index, impl=self.impl)
        do = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)
        delta = api.attention_delta(out, do)
        acc = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
        args = (q, k, v, pos, pos, index, do, lse, delta)
        dq32, dk32, _ = api.block_sparse_attention_bwd(*args, impl=self.impl, dq_acc=acc)
        dq16, dk16, _ = api.block_sparse_attention_bwd(*args, impl=self.impl, dq_acc=acc, dq_dtype=jnp.bfloat16)
        assert dq32.dtype == jnp.float32 and dq16.dtype == jnp.bfloat16 and dk16.dtype == jnp.float32
        assert float(jnp.max(jnp.abs(dq32 - acc))) > 0.1  # the pass added something to the accumulator
        np.testing.assert_array_equal(np.asarray(dq16), np.asarray(dq32.astype(jnp.bfloat16)))
        # dK: the same pass both times, but the column pass's scatter-add (XLA) adds in any order on a GPU
        np.testing.assert_allclose(np.asarray(dk16), np.asarray(dk32), rtol=1e-5, atol=1e-6)
        with pytest.raises(ValueError, match="dq_dtype must be a floating dtype .* got <class 'jax.numpy.int32'>"):
            api.block_sparse_attention_bwd(*args, impl=self.impl, dq_dtype=jnp.int32)
        with pytest.raises(ValueError, match="dq_dtype must be a floating dtype .* got 'bf16x'"):
            api.block_sparse_attention_bwd(*args, impl=self.impl, dq_dtype="bf16x")


class TestXlaTwin(_KernelSuite):
    impl = "xla"

    def test_ring_step_shapes_sq_ne_sk(self):
        """A ring step with fewer queries than keys, columns only (no blocks)."""
        rng = np.random.default_rng(5)
        q, k, v = _inputs(rng, 1, 64, 192, 2, 1, 64, jnp.float32)
        q_pos, k_pos = _positions(rng, 64, 192, True)
        index = random_step_index(rng, 1, 2, 64, 192, q_pos, k_pos, max_blocks=1, max_cols=20,
                                  p_empty=0.0, p_full=0.0)
        index = index._replace(block_count=jnp.zeros_like(index.block_count))
        out, lse = api.block_sparse_attention_fwd(q, k, v, q_pos, k_pos, index, impl="xla")
        ref_out, _ = _reference(q, k, v, q_pos, k_pos, index)
        assert _rel(out, ref_out) < 4e-7  # observed 1.1e-7


class TestPallasInterpret(_KernelSuite):
    """Five blocks per side, so rows hold pairs of free tiles, odd tails and masked tiles."""
    impl = "pallas"
    S = 320
    # ~3x the largest error observed (Triton interpret on CPU): bfloat16 out 6.3e-4 (P rounded to bf16
    # for the PV dot), lse 5.6e-8, dq/dk/dv 3.0e-3; float32 out 2.8e-7, lse 5.7e-8, dq/dk/dv 5.6e-7
    tol = {jnp.float32: 1e-6, jnp.bfloat16: 2e-3}
    lse_tol = {jnp.float32: 2e-7, jnp.bfloat16: 1.5e-7}
    grad_tol = {jnp.float32: 1.7e-6, jnp.bfloat16: 9e-3}

    def test_column_pass_row_ranges_agree(self):
        """The column dK/dV pass gives the same result with its column chunks' query blocks in one
        range (plain stores) or split over several programs (atomic adds)."""
        from pallas_kernels import triton_backward as tb

        rng = np.random.default_rng(7)
        S = 1024  # 16 query blocks
        q, k, v = _inputs(rng, 1, S, S, self.H, 2, 64, jnp.float32)
        q_pos, k_pos = _positions(rng, S, S, True)
        index = random_step_index(rng, 1, self.H, S, S, q_pos, k_pos, max_blocks=3, max_cols=150)
        do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
        out, lse = api.block_sparse_attention_fwd(q, k, v, q_pos, k_pos, index, impl="xla")
        args = (q, k, v, q_pos, k_pos, index, do, lse, api.attention_delta(out, do))
        zeros = jnp.zeros(k.shape, jnp.float32)
        res = [tb.dkv_col_pass(*args, zeros, zeros, sm_scale=64**-0.5, block_size=BS, interpret=True,
                               col_splits=sp) for sp in (1, 2, 4)]
        assert float(jnp.abs(res[0][0]).max()) > 0
        for dk, dv in res[1:]:
            np.testing.assert_allclose(np.asarray(dk), np.asarray(res[0][0]), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(np.asarray(dv), np.asarray(res[0][1]), rtol=1e-5, atol=1e-6)


class _GPUSizes(_KernelSuite):
    """8K-token cases with up to 24 active blocks and 200 listed columns per row."""
    S = 8192
    # compiled kernels (TF32 / bf16 tensor-core dots, approximate exp): ~3x the largest error observed
    # on an H100 (JAX 0.11.2, 2026-11-26, `MTRAINING_TEST_ERRORS`, Triton and Mosaic alike) over the
    # forward / gradient / documents tests: out f32 3.0e-4, bf16 8.8e-4; lse f32 1.5e-5, bf16 7.0e-8;
    # dq/dk/dv f32 5.7e-4, bf16 2.95e-3
    tol = {jnp.float32: 1e-3, jnp.bfloat16: 3e-3}
    lse_tol = {jnp.float32: 5e-5, jnp.bfloat16: 2e-7}
    grad_tol = {jnp.float32: 2e-3, jnp.bfloat16: 9e-3}

    def _index(self, rng, B, q_pos, k_pos, sk):
        return random_step_index(rng, B, self.H, self.S, sk, q_pos, k_pos, max_blocks=24, max_cols=200)


@pytest.mark.gpu
class TestPallasGPU(_GPUSizes):
    impl = "pallas"
    H = 4
    cases = [
        (1, 64, jnp.float32, False),
        (4, 128, jnp.bfloat16, True),
    ]


@pytest.mark.gpu
class TestMosaicGPU(_GPUSizes):
    """``impl="auto"`` on a Hopper GPU: the Mosaic GPU forward and dQ pass (bf16 / f16) with the
    Triton dK/dV passes; float32 cases of the shared suite fall through to Triton (the registry
    falls through for what Mosaic does not run)."""
    impl = "auto"
    H = 8
    cases = [
        (1, 64, jnp.bfloat16, False),
        (4, 128, jnp.bfloat16, True),
    ]

    def setup_method(self):
        from pallas_kernels import registry

        q = jnp.zeros((1, self.S, self.H, 128), jnp.bfloat16)
        assert registry.resolve("auto", "fwd", q, BS, self.S) == "mosaic", "needs a Hopper GPU"

    @pytest.mark.parametrize("g, D, B, sk", [(8, 128, 2, 4096), (1, 64, 1, 8192), (4, 128, 1, 12288)])
    def test_mosaic_merges_into_ring_accumulators(self, g, D, B, sk):
        """Forward of one ring step (``Sq != Sk``, permuted positions, GQA ``g``) merged into random
        earlier-step accumulators (some rows empty there) equals the twin's float32 result."""
        rng = np.random.default_rng(30 + g)
        S, H = 4096, 8
        q, k, v = _inputs(rng, B, S, sk, H, H // g, D, jnp.bfloat16)
        q_pos, k_pos = _positions(rng, S, sk, True)
        index = random_step_index(rng, B, H, S, sk, q_pos, k_pos, max_blocks=16, max_cols=300)
        empty = jnp.asarray(rng.random((B, H, S)) < 0.2)
        acc = (jnp.asarray(rng.standard_normal(q.shape), jnp.float32),
               jnp.where(empty, -jnp.inf, jnp.asarray(rng.standard_normal((B, H, S)), jnp.float32)))
        out, lse = api.block_sparse_attention_fwd(q, k, v, q_pos, k_pos, index, impl="mosaic", acc=acc)
        f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
        ref_out, ref_lse = api.block_sparse_attention_fwd(f32(q), f32(k), f32(v), q_pos, k_pos, index, impl="xla",
                                                          acc=acc)
        assert _rel(out, ref_out) < 1e-2
        fin = np.isfinite(np.asarray(ref_lse))
        np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), fin)
        assert _rel(np.asarray(lse)[fin], np.asarray(ref_lse)[fin]) < 1e-5

    def test_kernels_compile_early(self):
        """``pallas_kernels.mosaic_precompile`` is on (the kernels' launch starts it): a program's new Mosaic
        kernels are compiled on the worker as they are lowered, without failure, and the program that
        holds them runs them (its result as the twin's)."""
        from pallas_kernels import mosaic_precompile as mp
        from pallas_kernels.mosaic_fwd import mosaic_fwd

        rng = np.random.default_rng(50)
        B, S, H, Hkv, D = 1, 2048, 4, 2, 64
        q, k, v = _inputs(rng, B, S, S, H, Hkv, D, jnp.bfloat16)
        pos = jnp.arange(S, dtype=jnp.int32)
        index = random_step_index(rng, B, H, S, S, pos, pos, max_blocks=8, max_cols=100)
        assert mp.wait(120)  # what earlier tests handed over
        before = mp.stats()["compiled"]
        f = jax.jit(lambda q, k, v, index: mosaic_fwd(q, k, v, pos, pos, index, sm_scale=0.0987654, stream="split",
                                                      walk="loops", kv_step=128))  # a scale no other test uses
        lowered = f.trace(q, k, v, index).lower()
        assert mp.stats()["active"], "start() is called by the kernels' launch on a Hopper GPU"
        assert mp.wait(120)
        stats = mp.stats()
        assert stats["errors"] == [] and stats["compiled"] == before + 1, stats
        out, lse = lowered.compile()(q, k, v, index)
        f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
        ref_out, _ = api.block_sparse_attention_fwd(f32(q), f32(k), f32(v), pos, pos, index, impl="xla",
                                                    sm_scale=0.0987654)
        assert _rel(out, ref_out) < 1e-2 and float(jnp.abs(ref_out).max()) > 0

    def test_kernels_compile_early_in_two_processes(self):
        """Under ``jax.distributed`` (two processes on this machine's GPUs; on one GPU both share it) each
        process's worker compiles its kernels on its own local device (``jax.devices()[0]`` belongs to process
        0), without errors, and the kernels run."""
        import json
        import os
        import subprocess
        import sys

        from _multiprocess import REPO, free_port

        port = free_port()
        env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false",
                   PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
        env.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)
        procs = [subprocess.Popen([sys.executable, str(REPO / "tests" / "_precompile_mp_worker.py"), str(port), str(i)],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
                 for i in (0, 1)]
        outs = [p.communicate(timeout=300)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
        got = [json.loads(line[len("RESULT "):]) for o in outs for line in o.splitlines() if line.startswith("RESULT ")]
        assert sorted(r["pid"] for r in got) == [0, 1], outs
        assert got[0]["local"] != got[1]["local"]
        for r in got:
            assert r["waited"] and r["stats"]["active"] and r["stats"]["errors"] == [], r
            assert r["stats"]["compiled"] >= 1 and r["finite"] and r["absmax"] > 0, r

    @pytest.mark.parametrize("documents", [False, True])
    def test_column_walks_agree(self, documents):
        """The column dK/dV pass's ``col_walk="free"`` (no mask on each chunk's query blocks of
        ``column_free_range``, where the mask keeps every pair; walked first) gives the masked walk's
        dK/dV: the same tiles, within bf16 rounding of P (the two tile bodies compile to different
        instruction schedules, so a score can differ in its last float32 bit and a P on a bf16 rounding
        boundary round the other way: 1.3e-5 relative on an H100, 2026-12-05) and float32 summation
        order. On position-ordered columns most of the walk is free; with packed documents each chunk's
        walk ends with its last document (``column_start``) and the free part is the rest of the chunk's
        document."""
        from pallas_kernels.index_format import apply_segments, column_start
        from pallas_kernels.mosaic_dkv import COL_WALKS, mosaic_dkv_cols
        from pallas_kernels.mosaic_index import column_free_range, column_operands, column_ranges
        from pallas_kernels.testing import vertical_slash_index

        rng = np.random.default_rng(50 + documents)
        B, S, H, Hkv, D = 1, 8192, 8, 2, 128
        q, k, v = _inputs(rng, B, S, S, H, Hkv, D, jnp.bfloat16)
        pos = jnp.arange(S, dtype=jnp.int32)
        index = jax.tree.map(jnp.asarray, vertical_slash_index(rng, B, H, S, 0.9, block_size=BS, far_slashes=1,
                                                               max_cols=300))
        segs = None
        if documents:
            segs = (pos[None] // 3000, pos[None] // 3000)
            index = apply_segments(index, *segs, BS)
        _, _, c_info = column_operands(index, k, v, pos, BS, segs=segs)
        start = column_start(index, *segs, BS) if documents else None
        first, end, _ = column_ranges(index.col_count, c_info.shape[2], BS, 512, start)
        lo, hi = column_free_range(c_info, index.col_count, pos, BS, first, end, segs[0] if documents else None)
        free, walked = int((hi - lo).sum()), int((end - first).sum())
        plain = int((S // BS - column_ranges(index.col_count, c_info.shape[2], BS, 512)[0]).sum())
        # CPU count with this index's generator (2026-12-06): plain 2392 of 3423 free; documents 436 of
        # 1883 walked free, the plain walk 3451
        assert free > (0.15 if documents else 0.5) * walked and walked < (0.7 if documents else 1.01) * plain, (
            free, walked, plain)
        out, lse = api.block_sparse_attention_fwd(q, k, v, pos, pos, index, impl="auto",
                                                  **(dict(q_seg=segs[0], k_seg=segs[1]) if documents else {}))
        do = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)
        delta = api.attention_delta(out, do)
        z = jnp.zeros(k.shape, jnp.float32)
        got = {w: mosaic_dkv_cols(q, k, v, pos, pos, index, do, lse, delta, z, z, sm_scale=D ** -0.5, segs=segs,
                                  col_walk=w) for w in COL_WALKS}
        for a, b in zip(got["free"], got["masked"]):
            assert float(jnp.abs(b).max()) > 0 and _rel(a, b) < 1e-4

    @pytest.mark.parametrize("documents", [False, True])
    def test_dkv_block_streams_equal_the_float32_walk(self, documents):
        """The dK/dV block pass on each stream (``"split"``: each consumer its KV block's own Q/dO
        tiles; ``"shared"``: one stream of both blocks' tiles, segment loops or one switching loop;
        ``"index"``, ``"auto"``) equals the float32 emulation of its walk
        (:func:`~pallas_kernels.mosaic_index.emulate_dkv_blocks`), and the streams agree with each
        other to bf16 rounding of P and dS (the tiles summed in another order); on a ring step with
        permuted positions, GQA 4, two KV heads, causal columns and (optionally) packed documents, and
        on the uniform full index (``index=None``'s, schedule built for one row)."""
        from pallas_kernels.index_format import apply_segments, full_step_index
        from pallas_kernels.mosaic_dkv import mosaic_dkv_blocks
        from pallas_kernels.mosaic_index import emulate_dkv_blocks

        rng = np.random.default_rng(50 + documents)
        B, S, H, Hkv, D = 1, 2048, 8, 2, 128
        q, k, v = _inputs(rng, B, S, S, H, Hkv, D, jnp.bfloat16)
        q_pos, k_pos = _positions(rng, S, S, True)
        index = random_step_index(rng, B, H, S, S, q_pos, k_pos, max_blocks=16, max_cols=300)
        segs = None
        if documents:
            segs = (jnp.asarray(q_pos)[None] // 700, jnp.asarray(k_pos)[None] // 700)
            index = apply_segments(index, *segs, BS)
        do = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)
        f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
        cases = [(index, q_pos, k_pos, segs, False)]
        if not documents:  # the full causal index as the API builds it (uniform rows)
            pos = jnp.arange(S, dtype=jnp.int32)
            cases.append((full_step_index(B, H, S, S, pos, pos, BS), pos, pos, None, True))
        for idx, qp, kp, sg, uniform in cases:
            out, lse = api.block_sparse_attention_fwd(f32(q), f32(k), f32(v), qp, kp, idx, impl="xla",
                                                      q_seg=None if sg is None else sg[0],
                                                      k_seg=None if sg is None else sg[1])
            delta = api.attention_delta(out, do)
            want = emulate_dkv_blocks(f32(q), f32(k), f32(v), qp, kp, idx, f32(do), lse, delta, sm_scale=D ** -0.5,
                                      block_size=BS, segs=sg)
            assert float(jnp.abs(want[0]).max()) > 0 and float(jnp.abs(want[1]).max()) > 0
            got = {}
            for stream, walk in (("split", "switch"), ("shared", "loops"), ("shared", "switch"), ("index", "switch"),
                                 ("auto", "switch")):
                got[stream, walk] = mosaic_dkv_blocks(q, k, v, qp, kp, idx, do, lse, delta, sm_scale=D ** -0.5,
                                                      segs=sg, uniform=uniform, stream=stream, walk=walk)
                for name, a, b in zip(("dk", "dv"), got[stream, walk], want):
                    assert _rel(a, b) < 1e-2, (stream, walk, uniform, name, _rel(a, b))
            for a, b in zip(got["shared", "loops"], got["shared", "switch"]):  # the same tiles in the same order
                assert _rel(a, b) < 1e-6
            for a, b in zip(got["shared", "switch"], got["split", "switch"]):
                assert _rel(a, b) < 5e-3
            for a, b in zip(got["auto", "switch"], got["split", "switch"]):  # "auto": the split stream
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    @pytest.mark.parametrize("documents", [False, True])
    def test_walks_and_streams_equal_segment_loops(self, documents):
        """``walk="switch"`` (one loop, the step body chosen per tile) gives the forward's ``(out, lse)``
        and the dQ pass's ``dq`` of the segment loops (the same tiles in the same order: equal to
        float32 rounding of the instruction schedule); ``stream="split"`` (separate streams) the same
        within bf16 rounding of P (the tiles in another order), on a ring step with permuted positions, GQA 4, causal columns and (optionally) packed documents."""
        from pallas_kernels.index_format import apply_segments
        from pallas_kernels.mosaic_dq import mosaic_dq
        from pallas_kernels.mosaic_fwd import mosaic_fwd

        rng = np.random.default_rng(40 + documents)
        B, S, sk, H, Hkv, D = 1, 4096, 4096, 8, 2, 128
        q, k, v = _inputs(rng, B, S, sk, H, Hkv, D, jnp.bfloat16)
        q_pos, k_pos = _positions(rng, S, sk, True)
        index = random_step_index(rng, B, H, S, sk, q_pos, k_pos, max_blocks=16, max_cols=300)
        segs = None
        if documents:
            segs = (jnp.asarray(q_pos)[None] // 700, jnp.asarray(k_pos)[None] // 700)
            index = apply_segments(index, *segs, BS)
        kw = dict(sm_scale=D ** -0.5, segs=segs)
        got = {w: mosaic_fwd(q, k, v, q_pos, k_pos, index, walk=w, stream="shared", **kw) for w in ("loops", "switch")}
        (out, lse), (out2, lse2) = got["loops"], got["switch"]
        assert _rel(out2, out) < 1e-6
        fin = np.isfinite(np.asarray(lse))
        np.testing.assert_array_equal(np.isfinite(np.asarray(lse2)), fin)
        np.testing.assert_allclose(np.asarray(lse2)[fin], np.asarray(lse)[fin], rtol=0, atol=1e-6)
        do = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)
        delta = api.attention_delta(out, do)
        dq = {w: mosaic_dq(q, k, v, q_pos, k_pos, index, do, lse, delta, walk=w, stream="shared", **kw)
              for w in ("loops", "switch")}
        assert _rel(dq["switch"], dq["loops"]) < 1e-6
        assert float(jnp.abs(dq["loops"]).max()) > 0
        # separate streams (each consumer its own tiles, every block step half each): the same
        # attention, its tiles summed in another order
        for walk in ("loops", "switch"):
            out3, lse3 = mosaic_fwd(q, k, v, q_pos, k_pos, index, walk=walk, stream="split", **kw)
            assert _rel(out3, out) < 5e-3
            np.testing.assert_array_equal(np.isfinite(np.asarray(lse3)), fin)
            np.testing.assert_allclose(np.asarray(lse3)[fin], np.asarray(lse)[fin], rtol=0, atol=1e-4)
            dq3 = mosaic_dq(q, k, v, q_pos, k_pos, index, do, lse, delta, walk=walk, stream="split", kv_step=128, **kw)
            assert _rel(dq3, dq["loops"]) < 5e-3
        # stream="index" runs the stream prefer_split picks, bit for bit; the defaults (stream="auto")
        # are "index" in the forward and the split stream (128-key steps, segment loops) in the dQ
        from pallas_kernels.mosaic_index import pair_stream, prepare
        from pallas_kernels.mosaic_stream import prefer_split
        ops = prepare(index, k, v, k_pos, BS, q_pos, segs)
        for kv_step, f, a in ((128, mosaic_fwd, ()), (64, mosaic_dq, (do, lse, delta))):
            split = bool(prefer_split(ops, pair_stream(ops, kv_step // BS), kv_step // BS))
            pick = dict(stream="split", walk="loops", kv_step=128) if split else dict(stream="shared", kv_step=kv_step)
            if f is mosaic_fwd and not split:
                pick["walk"] = "switch"
            default = dict(stream="split", walk="loops", kv_step=128) if f is mosaic_dq else pick
            for got, want in ((dict(stream="index"), pick), ({}, default)):
                for x, y in zip(jax.tree.leaves(f(q, k, v, q_pos, k_pos, index, *a, **got, **kw)),
                                jax.tree.leaves(f(q, k, v, q_pos, k_pos, index, *a, **want, **kw))):
                    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


class TestValidation:
    def _args(self, S=128, D=64, H=2, Hkv=2):
        rng = np.random.default_rng(0)
        q, k, v = _inputs(rng, 1, S, S, H, Hkv, D, jnp.float32)
        return q, k, v, jnp.arange(S, dtype=jnp.int32), jnp.arange(S, dtype=jnp.int32)

    def test_bad_head_dim(self):
        with pytest.raises(ValueError, match="head_dim 48"):
            api.block_sparse_attention_fwd(*self._args(D=48), None)

    def test_bad_sequence_length(self):
        q, k, v, qp, kp = self._args(S=100)
        with pytest.raises(ValueError, match="multiples of the block size"):
            api.block_sparse_attention_fwd(q, k, v, qp, kp, None)

    def test_index_shape_mismatch(self):
        q, k, v, qp, kp = self._args()
        index = random_step_index(np.random.default_rng(0), 1, 3, 128, 128, qp, kp)  # 3 heads, q has 2
        with pytest.raises(ValueError, match="block_count"):
            api.block_sparse_attention_fwd(q, k, v, qp, kp, index)

    def test_bad_impl_and_gqa(self):
        q, k, v, qp, kp = self._args(H=3, Hkv=2)
        with pytest.raises(ValueError, match="multiple of KV heads"):
            api.block_sparse_attention_fwd(q, k, v, qp, kp, None)
        with pytest.raises(ValueError, match="unknown impl"):
            api.block_sparse_attention(*self._args(), impl="cuda")
