"""One process of the multi-process ring test (started by ``tests/test_ring_multiprocess.py``).

Usage: ``python tests/_ring_mp_worker.py PORT PROCESS_ID NUM_PROCESSES LOCAL_DEVICES``.

Every process builds the same global inputs from a fixed seed, joins the distributed runtime over
localhost (gloo CPU collectives), runs ring attention with ``make_mesh()`` (node = process, local =
its CPU devices) and checks ITS addressable shards of the output and of dq/dk/dv against the
float64 dense reference. Prints one ``RESULT <order> <json>`` line per ring order; exits non-zero
on any mismatch.
"""

from __future__ import annotations

import sys

from _multiprocess import check_and_report, global_array, init_worker


def main() -> int:
    pid, nproc, ndev = init_worker(sys.argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.reference import dense_attention
    from mtraining_jax.ring.attention import ring_attention
    from mtraining_jax.layouts import Layout
    from mtraining_jax.mesh import make_mesh, sequence_sharding

    mesh = make_mesh()
    assert dict(mesh.shape) == {"node": nproc, "local": ndev}, mesh.shape
    assert all(d.process_index == n for n in range(nproc) for d in mesh.devices[n]), "node != process"

    B, S, Hq, Hkv, D = 1, 128, 4, 2, 32
    P = nproc * ndev
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, S, h, D)).astype(np.float32) for h in (Hq, Hkv, Hkv))
    cot = (rng.standard_normal((B, S, Hq, D)) * (1 + rng.random((B, S, Hq, D)))).astype(np.float32)

    def ref_loss(q, k, v):
        out, _ = dense_attention(q, k, v)
        return jnp.sum(out * cot), out

    (_, ref_out), ref_grads = jax.value_and_grad(ref_loss, argnums=(0, 1, 2), has_aux=True)(
        *(x.astype(np.float64) for x in (q, k, v)))

    lay = Layout("block_striped", S, P, stripe=16)
    shard = sequence_sharding(mesh)

    ok = True
    # the query-side backward ring too: its first hop (from rank (n-1, l-1)) and dQ totals cross processes
    for order, side in (("hierarchical", "auto"), ("flat", "auto"), ("hierarchical", "query")):
        name = order if side == "auto" else f"{order}-{side}"
        def loss(q, k, v, c):
            out = ring_attention(q, k, v, lay.perm, mesh, ring_order=order, backward_ring=side)
            return jnp.sum(out * c), out

        fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
        (_, out), grads = fn(*(global_array(lay.permute(x), shard) for x in (q, k, v, cot)))
        ok &= check_and_report(name, (out, *grads), (ref_out, *ref_grads), lay.permute)
    jax.distributed.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
