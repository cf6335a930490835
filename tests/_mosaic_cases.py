"""Cases shared by the Mosaic kernels' CPU tests (``test_mosaic_kernels.py``, ``test_mosaic_kv_schedule.py``):
random q / k / v, positions and a random step index; packed documents over global positions."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels.testing import random_step_index

BS = 64


def mosaic_case(rng, B, S, Sk, H, Hkv, D, permuted, mb, mc):
    q = jnp.asarray(rng.standard_normal((B, S, H, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, Sk, Hkv, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, Sk, Hkv, D)), jnp.float32)
    if permuted:
        perm = rng.permutation(S + Sk).astype(np.int32)
        qp, kp = jnp.asarray(np.sort(perm[:S])), jnp.asarray(np.sort(perm[S:]))
    else:
        qp, kp = jnp.arange(S, dtype=jnp.int32), jnp.arange(Sk, dtype=jnp.int32)
    idx = random_step_index(rng, B, H, S, Sk, qp, kp, max_blocks=mb, max_cols=mc)
    return q, k, v, qp, kp, idx


def doc_segments(B, qp, kp, ends=(5, 64, 150, 200, 330, 520)):
    """Packed documents over global positions (document ``i`` ends before ``ends[i]``; a short one,
    one ending on a block boundary, longer ones); row ``b`` shifts the boundaries by ``37 * b``."""
    seg = lambda p, b: np.searchsorted(np.asarray(ends) + 37 * b, np.asarray(p), side="right")  # noqa: E731
    return tuple(jnp.asarray(np.stack([seg(p, b) for b in range(B)]).astype(np.int32)) for p in (qp, kp))
