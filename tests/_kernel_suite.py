"""The block-sparse attention kernels' test suite, written once: ``KernelSuite`` holds the cases (forward,
gradients, packed documents, the dense ``index=None``, fully masked rows, ring accumulators, a narrower dQ)
against the masked dense float32 reference; each backend subclasses it and sets ``impl``, sizes and
tolerances: the XLA twin and the Pallas kernels in interpret mode (``test_kernels.py``, CPU), the Pallas and
Mosaic kernels compiled on a GPU (``test_kernels_gpu.py``, ``@pytest.mark.gpu``).
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


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), "non-finite values"
    return observed(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def inputs(rng, B, Sq, Sk, H, Hkv, D, dtype):
    q = jnp.asarray(rng.standard_normal((B, Sq, H, D)), dtype)
    k = jnp.asarray(rng.standard_normal((B, Sk, Hkv, D)), dtype)
    v = jnp.asarray(rng.standard_normal((B, Sk, Hkv, D)), dtype)
    return q, k, v


def positions(rng, Sq, Sk, permuted):
    """Global positions: plain arange, or a ring-like step (queries and keys from a permuted range)."""
    if not permuted:
        return jnp.arange(Sq, dtype=jnp.int32), jnp.arange(Sk, dtype=jnp.int32)
    perm = rng.permutation(Sq + Sk).astype(np.int32)
    return jnp.asarray(np.sort(perm[:Sq])), jnp.asarray(np.sort(perm[Sq:]))


def reference(q, k, v, q_pos, k_pos, index):
    """Dense float32 reference with the index mask; ``(out, lse)``."""
    mask = None if index is None else step_index_to_mask(index, q.shape[1], k.shape[1], BS)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    return dense_attention(f32(q), f32(k), f32(v), q_pos, k_pos, mask)


def document_segments(q_pos, k_pos, S, batch=2):
    """Segment ids ``(q_seg, k_seg) int32 [batch, S]`` of packed documents laid over the global
    positions (documents are runs of positions, so a ring step's chunks get the ids of their
    positions). Row 0: documents shorter than a block, ending exactly on block boundaries (64, 128)
    and longer ones; row 1: one document over many blocks, then a boundary inside a block."""
    rows = [sorted({5, 14, 64, 128, 200, S + 7, S + 3 * BS, 2 * S}), [1, S - 40, S + 24, 2 * S]]
    segs = [np.stack([np.searchsorted(np.asarray(e), np.asarray(p), side="right") for e in rows[:batch]])
            .astype(np.int32) for p in (q_pos, k_pos)]
    return jnp.asarray(segs[0]), jnp.asarray(segs[1])


class KernelSuite:
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

    def _inputs(self, case, seed, B):
        """``(rng, dtype, q, k, v, q_pos, k_pos, index)`` of ``self.cases[case]`` at ``B`` sequences of
        ``self.S`` tokens (``rng``: for the test's further draws)."""
        g, D, dtype, permuted = self.cases[case]
        rng = np.random.default_rng(seed)
        q, k, v = inputs(rng, B, self.S, self.S, self.H, self.H // g, D, dtype)
        q_pos, k_pos = positions(rng, self.S, self.S, permuted)
        return (rng, dtype, q, k, v, q_pos, k_pos, self._index(rng, B, q_pos, k_pos, self.S))

    @pytest.mark.parametrize("case", range(2))
    def test_forward_matches_reference(self, case):
        B = 1
        rng, dtype, q, k, v, q_pos, k_pos, index = self._inputs(case, 10 + case, B)
        out, lse = api.block_sparse_attention_fwd(q, k, v, q_pos, k_pos, index, impl=self.impl)
        ref_out, ref_lse = reference(q, k, v, q_pos, k_pos, index)
        chex.assert_shape(out, q.shape)
        chex.assert_shape(lse, (B, self.H, self.S))
        assert rel(out, ref_out) < self.tol[dtype]
        fin = np.isfinite(np.asarray(ref_lse))
        np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), fin)  # empty rows: -inf
        assert rel(np.asarray(lse)[fin], np.asarray(ref_lse)[fin]) < self.lse_tol[dtype]
        np.testing.assert_array_equal(np.asarray(out)[~np.moveaxis(fin, 1, 2)], 0.0)

    @pytest.mark.parametrize("case", range(2))
    def test_gradients_match_reference(self, case):
        B = 1
        rng, dtype, q, k, v, q_pos, k_pos, index = self._inputs(case, 20 + case, B)
        ct = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)  # random non-uniform cotangent

        def loss(fn, q, k, v):
            return jnp.sum(fn(q, k, v).astype(jnp.float32) * ct)

        mine = jax.grad(lambda *a: loss(lambda q, k, v: api.block_sparse_attention(
            q, k, v, q_pos, k_pos, index, impl=self.impl), *a), argnums=(0, 1, 2))(q, k, v)
        f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
        ref = jax.grad(lambda *a: loss(lambda q, k, v: reference(q, k, v, q_pos, k_pos, index)[0], *a),
                       argnums=(0, 1, 2))(f32(q), f32(k), f32(v))
        for name, a, b in zip("qkv", mine, ref):
            assert a.dtype == dtype, name
            assert rel(a, b) < self.grad_tol[dtype], f"d{name}: {rel(a, b)}"

    @pytest.mark.parametrize("case", range(2))
    def test_documents_match_reference(self, case):
        """Packed documents (segment ids per sequence): forward and all gradients equal the float32
        reference under (index mask AND block-diagonal document mask AND causal); tiles inside one
        document stay free, tiles across a boundary are dropped, straddling ones masked per token."""
        B = 2
        rng, dtype, q, k, v, q_pos, k_pos, index = self._inputs(case, 40 + case, B)
        q_seg, k_seg = document_segments(q_pos, k_pos, self.S, B)
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
        assert rel(out, ref_out) < self.tol[dtype]
        fin = np.isfinite(np.asarray(ref_lse))
        np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), fin)
        assert rel(np.asarray(lse)[fin], np.asarray(ref_lse)[fin]) < self.lse_tol[dtype]
        ct = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
        mine = jax.grad(lambda *a: jnp.sum(api.block_sparse_attention(
            *a, q_pos, k_pos, index, impl=self.impl, q_seg=q_seg, k_seg=k_seg).astype(jnp.float32) * ct),
            argnums=(0, 1, 2))(q, k, v)
        want = [sum(g) for g in zip(*(jax.grad(lambda *a, b=b: jnp.sum(ref(*a, b)[0] * ct[b:b + 1]), argnums=(0, 1, 2))(
            f32(q), f32(k), f32(v)) for b in range(B)))]  # each row's gradient is zero in the other row
        for name, a, b in zip("qkv", mine, want):
            assert a.dtype == dtype, name
            assert rel(a, b) < self.grad_tol[dtype], f"d{name}: {rel(a, b)}"

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
        q, k, v = inputs(rng, 1, S, S, H, 1, D, dtype)
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
        assert rel(out, ref_out) < self.tol[dtype] and rel(lse, ref_lse) < self.lse_tol[dtype]
        ct = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
        mine = jax.grad(lambda *a: jnp.sum(api.block_sparse_attention(
            *a, pos, pos, index, impl=self.impl, q_seg=seg, k_seg=seg).astype(jnp.float32) * ct),
            argnums=(0, 1, 2))(q, k, v)
        want = jax.grad(lambda *a: jnp.sum(ref(*a)[0] * ct), argnums=(0, 1, 2))(f32(q), f32(k), f32(v))
        for name, a, b in zip("qkv", mine, want):
            assert rel(a, b) < self.grad_tol[dtype], f"d{name}: {rel(a, b)}"

    def test_dense_index_none(self):
        """``index=None`` is dense causal-by-position attention (fwd and bwd)."""
        rng = np.random.default_rng(3)
        q, k, v = inputs(rng, 2, self.S, self.S, self.H, 2, 64, jnp.float32)
        q_pos, k_pos = positions(rng, self.S, self.S, True)
        out, lse = api.block_sparse_attention_fwd(q, k, v, q_pos, k_pos, None, impl=self.impl)
        ref_out, ref_lse = reference(q, k, v, q_pos, k_pos, None)
        assert rel(out, ref_out) < self.tol[jnp.float32]
        do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
        delta = api.attention_delta(ref_out, do)
        mine = api.block_sparse_attention_bwd(q, k, v, q_pos, k_pos, None, do, ref_lse, delta, impl=self.impl)
        _, vjp = jax.vjp(lambda q, k, v: dense_attention(q, k, v, q_pos, k_pos)[0], q, k, v)
        for name, a, b in zip("qkv", mine, vjp(do)):
            assert rel(a, b) < self.grad_tol[jnp.float32], name

    def test_fully_masked_rows_no_nan(self):
        """Rows whose keys all lie in the future (or whose index is empty): out 0, lse -inf, grads finite."""
        rng = np.random.default_rng(4)
        S = self.S
        q, k, v = inputs(rng, 1, S, S, self.H, self.H, 64, jnp.float32)
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
        ref_out, _ = reference(q, k, v, q_pos, k_pos, index)
        assert rel(out, ref_out) < self.tol[jnp.float32]

    def test_ring_accumulators_merge_and_add(self):
        """Two ring steps over disjoint key chunks A, B: the forward of B with ``acc`` = A's
        ``(out, lse)`` equals attention over A ∪ B, and the backward of B with ``dq_acc`` /
        ``dkv_acc`` adds into them. Chunk A's first query block sees no key (empty rows merge)."""
        rng = np.random.default_rng(6)
        S, H, g = self.S, self.H, 2
        q, ka, va = inputs(rng, 1, S, S, H, H // g, 64, jnp.float32)
        _, kb, vb = inputs(rng, 1, S, S, H, H // g, 64, jnp.float32)
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
        assert rel(out, ref_out) < tol
        fin = np.isfinite(np.asarray(ref_lse))
        np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), fin)
        assert rel(np.asarray(lse)[fin], np.asarray(ref_lse)[fin]) < self.lse_tol[jnp.float32]  # GPU: 6.7e-6

        do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
        delta = api.attention_delta(ref_out, do)
        dqa, _, _ = api.block_sparse_attention_bwd(q, ka, va, q_pos, ka_pos, ia, do, ref_lse, delta, impl=self.impl)
        acc = tuple(jnp.asarray(rng.standard_normal(kb.shape), jnp.float32) for _ in range(2))
        dq, dk, dv = api.block_sparse_attention_bwd(q, kb, vb, q_pos, kb_pos, ib, do, ref_lse, delta,
                                                    impl=self.impl, dq_acc=dqa, dkv_acc=acc)
        _, vjp = jax.vjp(lambda q, k, v: dense_attention(q, k, v, q_pos, k_pos, mask)[0], q, k, v)
        rq, rk, rv = vjp(do)
        gtol = self.grad_tol[jnp.float32]
        assert rel(dq, rq) < gtol
        assert rel(dk - acc[0], rk[:, S:]) < gtol
        assert rel(dv - acc[1], rv[:, S:]) < gtol
        with pytest.raises(ValueError, match="dkv_acc"):
            api.block_sparse_attention_bwd(q, kb, vb, q_pos, kb_pos, ib, do, ref_lse, delta, impl=self.impl,
                                           dkv_acc=(acc[0][:, :BS], acc[1]))

    def test_output_in_a_narrower_dtype_is_the_float32_output_rounded_once(self):
        """``out_dtype=bfloat16`` (a final output: the op's forward alone, a ring's last step): the float32
        output rounded once (the Mosaic and Triton kernels round in their epilogue, the XLA twin after),
        merged into ``acc`` too; ``lse`` float32 and unchanged; the op's forward is that output."""
        rng = np.random.default_rng(9)
        S, H, g = self.S, self.H, 2
        q, k, v = inputs(rng, 1, S, S, H, H // g, 128, jnp.bfloat16)
        pos = jnp.arange(S, dtype=jnp.int32)
        index = self._index(rng, 1, pos, pos, S)
        acc = (jnp.asarray(rng.standard_normal(q.shape), jnp.float32),
               jnp.asarray(rng.standard_normal((1, H, S)), jnp.float32))
        for a in (None, acc):
            out32, lse32 = api.block_sparse_attention_fwd(q, k, v, pos, pos, index, impl=self.impl, acc=a)
            out16, lse16 = api.block_sparse_attention_fwd(q, k, v, pos, pos, index, impl=self.impl, acc=a,
                                                          out_dtype=jnp.bfloat16)
            assert out32.dtype == jnp.float32 and out16.dtype == jnp.bfloat16 and lse16.dtype == jnp.float32
            assert float(jnp.abs(out32).max()) > 0.1
            np.testing.assert_array_equal(np.asarray(out16), np.asarray(out32.astype(jnp.bfloat16)))
            np.testing.assert_array_equal(np.asarray(lse16), np.asarray(lse32))
            if a is None:
                op = jax.jit(lambda q, k, v: api.block_sparse_attention(q, k, v, pos, pos, index, impl=self.impl))
                np.testing.assert_array_equal(np.asarray(op(q, k, v)), np.asarray(out16))
        with pytest.raises(ValueError, match="out_dtype must be a floating dtype .* got <class 'jax.numpy.int32'>"):
            api.block_sparse_attention_fwd(q, k, v, pos, pos, index, impl=self.impl, out_dtype=jnp.int32)

    def test_dq_in_a_narrower_dtype_is_the_float32_dq_rounded_once(self):
        """``dq_dtype=bfloat16`` (a ring's last step): the same sum as the float32 dQ, ``dq_acc``
        included, rounded once (the Mosaic dQ kernel rounds in its epilogue, the others after)."""
        rng = np.random.default_rng(8)
        S, H, g = self.S, self.H, 2
        q, k, v = inputs(rng, 1, S, S, H, H // g, 128, jnp.bfloat16)
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
