"""One process of the multi-process MSA test (``tests/test_msa_multiprocess.py``).

Every process builds the same global inputs from a fixed seed and runs ``msa_attention`` on
``make_mesh()`` (node = process, local = its CPU devices), block_striped layout, both ring orders:
the index keys' all-gather, the per-rank top-k, the sparse ring and the KL's key all-gather all
cross the process boundary. It compares ITS addressable shards of the output, dq / dk / dv (of
``sum(out * cot) + kl``) with the float64 dense reference masked by the selection, and of the
index-branch gradients d q_idx / d k_idx with the single-process KL (:func:`msa_kl_sum` on the
natural order, no mesh), plus the KL value and the work fraction.
Prints ``RESULT <order> {"out": err, ..., "dqi": err, "dki": err, "kl": err, "work": err}``.
"""

from __future__ import annotations

import sys

from _multiprocess import global_array, init_worker, report, shard_rel_errors


def main() -> int:
    pid, nproc, ndev = init_worker(sys.argv)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    from mtraining_jax.attention.msa import MSAConfig, msa_attention
    from mtraining_jax.attention.msa_kl import msa_kl_sum
    from mtraining_jax.mesh import CP_AXES, make_mesh, sequence_sharding
    from mtraining_jax.ring.config import RingOptions
    from mtraining_jax.sparsity.msa_select import index_keys, select_blocks, selection_block_map, selection_work
    from pallas_kernels.reference import dense_attention

    mesh = make_mesh()
    assert dict(mesh.shape) == {"node": nproc, "local": ndev}, mesh.shape
    B, S, Hq, Hkv, D, DI, BS, TOPK = 1, 512, 4, 2, 32, 16, 64, 3
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, S, h, D)).astype(np.float32) for h in (Hq, Hkv, Hkv))
    qi = rng.standard_normal((B, S, Hkv, DI)).astype(np.float32)
    ki = rng.standard_normal((B, S, DI)).astype(np.float32)
    cot = rng.standard_normal((B, S, Hq, D)).astype(np.float32)
    pos = jnp.arange(S, dtype=jnp.int32)

    # single-process results on this process's default device: selection, masked reference, KL
    sel = select_blocks(jnp.asarray(qi), index_keys(jnp.asarray(ki), BS), pos, block_size=BS, top_k=TOPK)
    blk = np.asarray(selection_block_map(sel, S // BS))  # [B, G, nQB, nb]
    mask = np.repeat(np.repeat(np.repeat(blk, Hq // Hkv, 1), BS, 2), BS, 3) & np.tril(np.ones((S, S), bool))

    def ref_loss(q, k, v):
        out, _ = dense_attention(q, k, v, mask=jnp.asarray(mask))
        return jnp.sum(out * cot), out

    (_, ref_out), ref_g = jax.value_and_grad(ref_loss, argnums=(0, 1, 2), has_aux=True)(
        *(x.astype(np.float64) for x in (q, k, v)))

    def ref_kl(qi, ki):
        return msa_kl_sum(jnp.asarray(q), jnp.asarray(k), pos, qi, index_keys(ki, BS), ki, sel,
                          block_size=BS) / (B * S * Hkv)

    kl1, (dqi1, dki1) = jax.value_and_grad(ref_kl, argnums=(0, 1))(jnp.asarray(qi), jnp.asarray(ki))
    nb = S // BS
    work1 = float(selection_work(sel, Hq, BS)) / (B * Hq * nb * (nb + 1) / 2 * BS**2)

    shard4 = sequence_sharding(mesh)
    shard3 = NamedSharding(mesh, PartitionSpec(None, CP_AXES, None))
    ok = True
    for order in ("hierarchical", "flat"):
        cfg = MSAConfig(top_k=TOPK, layout="block_striped", ring=RingOptions(ring_order=order, impl="xla"))
        lay = cfg.make_layout(S, nproc * ndev)

        def loss(q, k, v, qi, ki, c):
            out, aux = msa_attention(q, k, v, qi, ki, mesh, cfg)
            return jnp.sum(out * c) + aux.kl, (out, aux)

        args = [global_array(lay.permute(x), shard4) for x in (q, k, v, qi)]
        args += [global_array(lay.permute(ki), shard3), global_array(lay.permute(cot), shard4)]
        (_, (out, aux)), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(*args)
        names = ("out", "dq", "dk", "dv", "dqi", "dki")
        refs = (ref_out, *ref_g, dqi1, dki1)
        errs = shard_rel_errors(dict(zip(names, (out, *g))), {n: lay.permute(np.asarray(r)) for n, r in zip(names, refs)})
        errs["kl"] = abs(float(aux.kl) - float(kl1)) / float(kl1)
        errs["work"] = abs(float(aux.work_fraction) - work1) / work1
        rec = float(aux.recall)
        errs["recall_ok"] = 0.0 if 0.0 < rec <= 1.0 + 1e-6 else 1.0
        report(order, errs)
        ok &= all(e <= (1e-4 if n in ("dqi", "dki", "kl") else 1e-5) for n, e in errs.items())
    jax.distributed.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
