"""Block-sparse attention kernels vs the masked dense float32 reference on the CPU: the shared suite
(``tests/_kernel_suite.py``'s ``KernelSuite``) on the XLA twin and on the Pallas kernels in interpret mode,
and the API's input validation. The same suite on a GPU: ``test_kernels_gpu.py`` (``pytest -m gpu``).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from _kernel_suite import BS, KernelSuite, inputs, positions, reference, rel
from pallas_kernels import api
from pallas_kernels.testing import random_step_index


class TestXlaTwin(KernelSuite):
    impl = "xla"

    def test_ring_step_shapes_sq_ne_sk(self):
        """A ring step with fewer queries than keys, columns only (no blocks)."""
        rng = np.random.default_rng(5)
        q, k, v = inputs(rng, 1, 64, 192, 2, 1, 64, jnp.float32)
        q_pos, k_pos = positions(rng, 64, 192, True)
        index = random_step_index(rng, 1, 2, 64, 192, q_pos, k_pos, max_blocks=1, max_cols=20,
                                  p_empty=0.0, p_full=0.0)
        index = index._replace(block_count=jnp.zeros_like(index.block_count))
        out, lse = api.block_sparse_attention_fwd(q, k, v, q_pos, k_pos, index, impl="xla")
        ref_out, _ = reference(q, k, v, q_pos, k_pos, index)
        assert rel(out, ref_out) < 4e-7  # observed 1.1e-7


class TestPallasInterpret(KernelSuite):
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
        q, k, v = inputs(rng, 1, S, S, self.H, 2, 64, jnp.float32)
        q_pos, k_pos = positions(rng, S, S, True)
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


class TestValidation:
    def _args(self, S=128, D=64, H=2, Hkv=2):
        rng = np.random.default_rng(0)
        q, k, v = inputs(rng, 1, S, S, H, Hkv, D, jnp.float32)
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
