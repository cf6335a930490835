"""One process of the multi-process MTraining sparse ring test (``tests/test_mtraining_multiprocess.py``).

Every process builds the same global inputs from a fixed seed, runs ``mtraining_attention`` on
``make_mesh()`` (node = process, local = its CPU devices) for both ring orders, and compares ITS
addressable shards of the output and of dq/dk/dv with the masked dense reference built from the same
global index (estimated on one device). Prints ``RESULT <order> {"out": err, ...}``.
"""

from __future__ import annotations

import sys

from _multiprocess import check_and_report, global_array, init_worker


def main() -> int:
    pid, nproc, ndev = init_worker(sys.argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from mtraining_jax.attention.mtraining import MTrainingConfig, mtraining_attention
    from mtraining_jax.mesh import make_mesh, sequence_sharding
    from mtraining_jax.ring.config import RingOptions
    from mtraining_jax.sparsity import SparsityConfig, estimate_index, masked_reference

    mesh = make_mesh()
    assert dict(mesh.shape) == {"node": nproc, "local": ndev}, mesh.shape
    B, S, Hq, Hkv, D = 1, 1024, 4, 2, 32
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, S, h, D)).astype(np.float32) for h in (Hq, Hkv, Hkv))
    k[:, 5] *= 4.0
    cot = (rng.standard_normal((B, S, Hq, D)) * (1 + rng.random((B, S, Hq, D)))).astype(np.float32)
    sparsity = SparsityConfig(vertical_p=0.6, slash_p=0.6, vertical_min=4, vertical_max=24, slash_max=4)
    index = estimate_index(jnp.asarray(q), jnp.asarray(k), jnp.arange(S, dtype=jnp.int32), sparsity)

    def ref_loss(q, k, v):
        out, _ = masked_reference(q, k, v, index)
        return jnp.sum(out * cot), out

    (_, ref_out), ref_grads = jax.value_and_grad(ref_loss, argnums=(0, 1, 2), has_aux=True)(
        *(x.astype(np.float64) for x in (q, k, v)))
    shard = sequence_sharding(mesh)
    ok = True
    # the query-side backward ring too: its first hop (from rank (n-1, l-1)) and dQ totals cross processes
    for order, side in (("hierarchical", "auto"), ("flat", "auto"), ("hierarchical", "query")):
        name = order if side == "auto" else f"{order}-{side}"
        cfg = MTrainingConfig(sparsity=sparsity, ring=RingOptions(ring_order=order, impl="xla", backward_ring=side))
        lay = cfg.make_layout(S, nproc * ndev)

        def loss(q, k, v, c):
            out = mtraining_attention(q, k, v, mesh, cfg)
            return jnp.sum(out * c), out

        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
            *(global_array(lay.permute(x), shard) for x in (q, k, v, cot)))
        ok &= check_and_report(name, (out, *grads), (ref_out, *ref_grads), lay.permute)
    jax.distributed.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
