"""Does the ring's K/V transfer overlap its attention compute? Dump the scheduled HLO (and a profile).

Run on a multi-GPU host (not in CI), e.g. 2 GPUs as one node or as two nodes::

    XLA_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=true" \\
        python -m benchmarks.ring_overlap --mesh 1x2 --order hierarchical --seq 65536 --out /tmp/ring_overlap

It compiles forward+backward of :func:`mtraining_jax.ring.attention.ring_attention` under ``jit``,
writes the optimised HLO (``ring.hlo.txt``), and reports, for every asynchronous collective-permute
(``collective-permute-start`` ... ``-done``), how many fusions / custom calls (the attention kernels)
XLA scheduled between the start and its done (:func:`benchmarks.hlo.overlap_report`): a transfer
with zero compute inside is exposed. With ``--profile`` it also times a few steps and writes a ``jax.profiler`` trace (open it in
Perfetto/TensorBoard to see NCCL send/recv kernels on their own stream under the attention kernels).
The same script runs on CPU (``--cpu N`` virtual devices) to check the HLO plumbing; CPU permutes are
synchronous, so overlap is only meaningful on GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from benchmarks.hlo import overlap_report
from mtraining_jax.ring.schedule import RING_ORDERS


def _parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mesh", default="1x2", help="NODExLOCAL, e.g. 1x2, 2x4")
    p.add_argument("--order", default="hierarchical", choices=RING_ORDERS)
    p.add_argument("--layout", default="block_striped")
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--impl", default="auto")
    p.add_argument("--profile", action="store_true", help="time 5 steps and write a profiler trace")
    p.add_argument("--cpu", type=int, default=0, help="use N virtual CPU devices instead of GPUs")
    p.add_argument("--out", default="ring_overlap_out")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse_args(argv)
    if args.cpu:
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.cpu}"
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import jax.numpy as jnp

    from mtraining_jax.ring.attention import ring_attention
    from mtraining_jax.layouts import Layout
    from mtraining_jax.mesh import make_mesh, sequence_sharding

    nodes, local = (int(x) for x in args.mesh.lower().split("x"))
    mesh = make_mesh((nodes, local), jax.devices()[: nodes * local])
    P = nodes * local
    lay = Layout(args.layout, args.seq, P, stripe=min(64, args.seq // P))
    dt = jnp.dtype(args.dtype)
    shard = sequence_sharding(mesh)
    key = jax.random.key(0)
    kq, kk, kv, kc = jax.random.split(key, 4)
    B, S, H, Hkv, D = 1, args.seq, args.heads, args.kv_heads, args.head_dim
    q = jax.device_put(jax.random.normal(kq, (B, S, H, D), dt), shard)
    k = jax.device_put(jax.random.normal(kk, (B, S, Hkv, D), dt), shard)
    v = jax.device_put(jax.random.normal(kv, (B, S, Hkv, D), dt), shard)
    cot = jax.device_put(jax.random.normal(kc, (B, S, H, D), dt), shard)
    pos = jnp.asarray(lay.perm)

    @jax.jit
    def step(q, k, v, cot):
        def loss(q, k, v):
            out = ring_attention(q, k, v, pos, mesh, ring_order=args.order, impl=args.impl)
            return jnp.sum(out.astype(jnp.float32) * cot.astype(jnp.float32))

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    compiled = step.lower(q, k, v, cot).compile()
    hlo = compiled.as_text()
    (out_dir / "ring.hlo.txt").write_text(hlo)
    report = overlap_report(hlo)
    print(f"devices={jax.devices()[0].platform} x{P} mesh={nodes}x{local} order={args.order} S={S} "
          f"H={H}/{Hkv} D={D} {args.dtype}")
    print(f"async collective-permutes: {len(report)}; exposed (no compute inside): "
          f"{sum(1 for _, n in report if n == 0)}")
    for name, n in report:
        print(f"  {name}: {n} compute ops between start and done")
    if args.profile:
        jax.block_until_ready(step(q, k, v, cot))
        t = time.perf_counter()
        for _ in range(5):
            jax.block_until_ready(step(q, k, v, cot))
        print(f"fwd+bwd step: {(time.perf_counter() - t) / 5 * 1e3:.2f} ms")
        with jax.profiler.trace(str(out_dir / "trace")):
            jax.block_until_ready(step(q, k, v, cot))
        print(f"profile written to {out_dir / 'trace'}")
    print(f"HLO written to {out_dir / 'ring.hlo.txt'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
