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

    from jax.sharding import NamedSharding, PartitionSpec

    from pallas_kernels.index_format import StepIndex, step_index_to_mask
    from pallas_kernels.reference import dense_attention
    from mtraining_jax.ring.attention import StackedStepIndex, ring_attention, ring_attention_shard
    from mtraining_jax.ring.schedule import source_table
    from mtraining_jax.layouts import Layout
    from mtraining_jax.mesh import CP_AXES, make_mesh, sequence_sharding

    mesh = make_mesh()
    assert dict(mesh.shape) == {"node": nproc, "local": ndev}, mesh.shape
    assert all(d.process_index == n for n in range(nproc) for d in mesh.devices[n]), "node != process"

    B, S, Hq, Hkv, D = 1, 512, 4, 2, 32
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

    # the sparse K/V exchange (guarded capacity: one all-reduce across the processes, direct sends
    # owner -> holder, dK/dV back) with a sparse index: every row of (rank, step) attends one KV
    # block of the visiting chunk (all blocks at steps s % 3 == 0: those take the whole-chunk path)
    # and one column
    bs, sl = 16, S // P
    nb = sl // bs
    shape = (P, P, B, Hq, nb)
    bidx = np.zeros(shape + (nb,), np.int32)
    bcnt = np.ones(shape, np.int32)
    for r in range(P):
        for t in range(P):
            if t % 3 == 0:
                bidx[r, t] = np.arange(nb)
                bcnt[r, t] = nb
            else:
                bidx[r, t, ..., 0] = (r + t) % nb
    index = StepIndex(jnp.asarray(bidx), jnp.asarray(bcnt), jnp.ones(shape + (nb,), jnp.int32),
                      jnp.full((P, P, B, Hq, 1), bs + 3, jnp.int32), jnp.ones(shape, jnp.int32))
    src = source_table(nproc, ndev, "hierarchical")
    m = np.asarray(jax.vmap(jax.vmap(lambda ix: step_index_to_mask(ix, sl, sl, bs)))(index))
    laid = np.zeros((B, Hq, S, S), bool)
    for r in range(P):
        for t in range(P):
            c = int(src[r, t])
            laid[:, :, r * sl:(r + 1) * sl, c * sl:(c + 1) * sl] = m[r, t]
    mask = laid[:, :, lay.inverse][:, :, :, lay.inverse]

    def ref_masked(q, k, v):
        out, _ = dense_attention(q, k, v, mask=mask)
        return jnp.sum(out * cot), out

    (_, mref_out), mref_grads = jax.value_and_grad(ref_masked, argnums=(0, 1, 2), has_aux=True)(
        *(x.astype(np.float64) for x in (q, k, v)))
    spec = PartitionSpec(None, CP_AXES, None, None)

    def body(q, k, v, pos, idx):
        return ring_attention_shard(q, k, v, pos, pos, num_nodes=nproc, num_local=ndev, ring_order="hierarchical",
                                    step_index=StackedStepIndex(idx, jax.lax.axis_index(CP_AXES)), block_size=bs,
                                    kv_exchange="sparse", exchange_capacity=0.5, backward_ring="kv")

    ring = jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec, PartitionSpec(CP_AXES), PartitionSpec()),
                         out_specs=spec, check_vma=False)

    def sparse_loss(q, k, v, c, pos, idx):
        out = ring(q, k, v, pos, idx)
        return jnp.sum(out * c), out

    fn = jax.jit(jax.value_and_grad(sparse_loss, argnums=(0, 1, 2), has_aux=True))
    rep = NamedSharding(mesh, PartitionSpec())
    (_, out), grads = fn(*(global_array(lay.permute(x), shard) for x in (q, k, v, cot)),
                         global_array(np.asarray(lay.perm, np.int32), NamedSharding(mesh, PartitionSpec(CP_AXES))),
                         jax.tree.map(lambda a: global_array(np.asarray(a), rep), index))
    ok &= check_and_report("hierarchical-sparse-exchange", (out, *grads), (mref_out, *mref_grads), lay.permute)
    jax.distributed.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
