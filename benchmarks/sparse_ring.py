"""Dense ring vs MTraining sparse ring, forward+backward, on 1 and 2 GPUs (issue 5).

For each GPU count P (mesh (1, P)) and total length S: B=1, 16 query / 2 KV heads, head_dim 128,
bfloat16, q/k from the synthetic vertical-slash generator (RoPE, channel means, outlier keys),
block_striped layout, hierarchical ring. Reports the median time of jit(value_and_grad) for

* dense ring (``ring_attention``: dense causal flash per step),
* sparse ring (``mtraining_attention``: online index + block-sparse kernel per step),

the index density, the exposed-communication estimate, and a sampled-row correctness check
(output and dq of 256 random query rows against the masked float32 reference of the same index).
Writes JSON lines and the optimized HLO of the 2-GPU sparse step (for the schedule of the
collective-permutes) to ``--out``.

    PYTHONPATH=. python benchmarks/sparse_ring.py --lengths 131072 262144 --gpus 1 2 --out /tmp/out
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "")
for flag in ("--xla_gpu_enable_latency_hiding_scheduler=true",):
    if flag.split("=")[0] not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += " " + flag

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from mtraining_jax.attention.mtraining import MTrainingConfig, mtraining_attention  # noqa: E402
from mtraining_jax.attention.reference import dense_attention  # noqa: E402
from mtraining_jax.attention.ring import ring_attention  # noqa: E402
from mtraining_jax.mesh import CP_AXES, make_mesh, sequence_sharding  # noqa: E402
from mtraining_jax.sparsity import SparsityConfig, convert_index, estimate_index_shard  # noqa: E402
from mtraining_jax.sparsity.index import active_diagonals, vertical_flags  # noqa: E402
from mtraining_jax.sparsity.metrics import density  # noqa: E402
from mtraining_jax.sparsity.synthetic import SyntheticAttention, synthetic_qk  # noqa: E402

HQ, HKV, D = 16, 2, 128


def timeit(fn, *args, warmup=1, repeat=5):
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), ts


def make_inputs(S, seed=0, sharpness=1.0):
    syn = SyntheticAttention(seq_len=S, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, seed=seed,
                             sharpness=sharpness, num_outliers=64)
    q, k = synthetic_qk(syn)
    v = jax.random.normal(jax.random.PRNGKey(seed + 1), (1, S, HKV, D), jnp.float32)
    cot = jax.random.normal(jax.random.PRNGKey(seed + 2), (1, S, HQ, D), jnp.float32)
    return q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), cot.astype(jnp.bfloat16)


def sampled_check(q, k, v, cot, out, dq, index, rows, bs):
    """Relative errors of out and dq on natural-order query ``rows`` vs the masked f32 reference."""
    S = q.shape[1]
    vert = vertical_flags(index, S)[0]  # [H, S]
    diag = active_diagonals(index, S // bs)[0]  # [H, nb]
    kpos = jnp.arange(S)
    qb = rows // bs
    d = qb[:, None] - kpos[None, :] // bs  # [R, S]
    allowed = (kpos[None, :] <= rows[:, None])[None] & (
        vert[:, None, :] | jnp.take_along_axis(diag[:, None, :].repeat(len(rows), 1), jnp.clip(d, 0)[None].repeat(HQ, 0), axis=2))
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    q_r, cot_r = f32(q[:, rows]), f32(cot[:, rows])

    def ref(q_r):
        o, _ = dense_attention(q_r, f32(k), f32(v), q_pos=rows, k_pos=kpos, mask=allowed[None])
        return jnp.sum(o * cot_r), o

    (_, o_ref), dq_ref = jax.value_and_grad(ref, has_aux=True)(q_r)
    o_got, dq_got = f32(out[:, rows]), f32(dq[:, rows])  # out, dq already in natural order
    rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))  # noqa: E731
    return rel(o_got, o_ref), rel(dq_got, dq_ref)


def index_only(q, k, mesh, cfg, layout):
    """Index estimation + per-step conversion alone (what the sparse ring adds before its steps)."""
    nodes, local = mesh.shape["node"], mesh.shape["local"]
    spec = PartitionSpec(None, CP_AXES, None, None)

    def body(q_l, k_l):
        rank = jax.lax.axis_index(CP_AXES)
        pos = jnp.asarray(layout.positions, jnp.int32)[rank]
        index = estimate_index_shard(q_l, k_l, pos, cfg.sparsity, axis_names=CP_AXES)
        st = convert_index(index, rank, layout.positions, num_nodes=nodes, num_local=local,
                           ring_order=cfg.ring_order, block_size=cfg.block_size)
        return (st.block_count.sum() + st.col_count.sum() + st.col_idx.sum() + st.block_idx.sum())[None]

    return jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=PartitionSpec(CP_AXES),
                         check_vma=False)(q, k)


def run_case(S, P, args, out_dir, log):
    devices = jax.devices()[:P]
    mesh = make_mesh((1, P), devices)
    sp = SparsityConfig()  # defaults: p = 0.9, verticals <= 4096, slashes <= 64 diagonals
    cfg = MTrainingConfig(sparsity=sp, layout="block_striped", ring_order="hierarchical")
    layout = cfg.make_layout(S, P)
    q, k, v, cot = make_inputs(S, sharpness=args.sharpness)
    shard = sequence_sharding(mesh)
    lq, lk, lv, lc = (jax.device_put(layout.permute(x), shard) for x in (q, k, v, cot))
    perm = jax.device_put(jnp.asarray(layout.perm), NamedSharding(mesh, PartitionSpec(CP_AXES)))

    def dense_loss(q, k, v, c):
        o = ring_attention(q, k, v, perm, mesh, ring_order=cfg.ring_order)
        return jnp.sum(o.astype(jnp.float32) * c.astype(jnp.float32))

    def sparse_loss(q, k, v, c):
        o, st = mtraining_attention(q, k, v, mesh, cfg, return_stats=True)
        return jnp.sum(o.astype(jnp.float32) * c.astype(jnp.float32)), (o, st)

    dense_fb = jax.jit(jax.grad(dense_loss, argnums=(0, 1, 2)))
    sparse_fb = jax.jit(jax.value_and_grad(sparse_loss, argnums=(0, 1, 2), has_aux=True))
    sparse_f = jax.jit(lambda q, k, v: mtraining_attention(q, k, v, mesh, cfg))
    dense_f = jax.jit(lambda q, k, v: ring_attention(q, k, v, perm, mesh, ring_order=cfg.ring_order))
    rec = {"S": S, "gpus": P, "device": jax.devices()[0].device_kind, "jax": jax.__version__}
    rec["index_s"], _ = timeit(jax.jit(lambda q, k: index_only(q, k, mesh, cfg, layout)), lq, lk, repeat=args.repeat)
    if args.index_only:
        print(json.dumps(rec), flush=True)
        log.write(json.dumps(rec) + "\n")
        return rec
    rec["sparse_fwd_s"], _ = timeit(sparse_f, lq, lk, lv, repeat=args.repeat)
    rec["sparse_fwdbwd_s"], _ = timeit(sparse_fb, lq, lk, lv, lc, repeat=args.repeat)
    if not args.skip_dense:
        rec["dense_fwd_s"], _ = timeit(dense_f, lq, lk, lv, repeat=args.repeat)
        rec["dense_fwdbwd_s"], _ = timeit(dense_fb, lq, lk, lv, lc, repeat=args.repeat)
        rec["speedup_fwdbwd"] = rec["dense_fwdbwd_s"] / rec["sparse_fwdbwd_s"]
    (_, (o, st)), grads = sparse_fb(lq, lk, lv, lc)
    rec["density"] = float(np.mean(density(st.index, S)))
    rec["worker_imbalance"] = st.worker_imbalance()
    rec["step_imbalance"] = st.step_imbalance()
    if args.check:
        rows = jnp.asarray(np.sort(np.random.default_rng(0).choice(S, 256, replace=False)), jnp.int32)
        rec["check_out_rel"], rec["check_dq_rel"] = sampled_check(
            q, k, v, cot, layout.unpermute(o), layout.unpermute(grads[0]), st.index, rows, cfg.block_size)
    if P > 1:
        # exposed communication: time one KV-buffer ppermute alone (what each ring step must hide)
        kv = jnp.stack([lk, lv])
        spec = PartitionSpec(None, None, CP_AXES)
        shift = jax.jit(jax.shard_map(lambda x: jax.lax.ppermute(x, "local", [(i, (i + 1) % P) for i in range(P)]),
                                      mesh=mesh, in_specs=spec, out_specs=spec))
        kv = jax.device_put(kv, NamedSharding(mesh, spec))
        rec["kv_ppermute_s"], _ = timeit(shift, kv, repeat=args.repeat)
        hlo = sparse_fb.lower(lq, lk, lv, lc).compile().as_text()
        with open(os.path.join(out_dir, f"sparse_fwdbwd_S{S}_P{P}.hlo.txt"), "w") as f:
            f.write(hlo)
        rec["hlo_collective_permute_starts"] = hlo.count("collective-permute-start")
        rec["hlo_collective_permute_sync"] = hlo.count("collective-permute(")
    log.write(json.dumps(rec) + "\n")
    log.flush()
    print(json.dumps(rec), flush=True)
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[131072, 262144])
    ap.add_argument("--gpus", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--sharpness", type=float, default=1.0)
    ap.add_argument("--check", action="store_true", help="sampled-row correctness check")
    ap.add_argument("--skip-dense", action="store_true")
    ap.add_argument("--index-only", action="store_true", help="time only index estimation + conversion")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sparse_ring.jsonl"), "a") as log:
        for P in args.gpus:
            if P > len(jax.devices()):
                print(f"skip P={P}: only {len(jax.devices())} devices")
                continue
            for S in args.lengths:
                run_case(S, P, args, args.out, log)


if __name__ == "__main__":
    main()
