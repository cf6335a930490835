"""MSA's collectives, read from the compiled HLO of one layer's forward+backward under shard_map.

Every rank needs every block's index keys (selection) and every selected key (the KL teacher): the
compiled step's all-gathers / reduce-scatters / all-reduces are listed with their bytes (the ring's
own K/V permutes are the same as MTraining's and not repeated here). Runs on virtual CPU devices.

    PYTHONPATH=. python benchmarks/msa_comm.py --seq-len 2048 --mesh 2 4
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.hlo import array_bytes, instructions  # noqa: E402
from mtraining_jax.attention.msa import MSAConfig, msa_attention  # noqa: E402
from mtraining_jax.mesh import make_mesh  # noqa: E402
from mtraining_jax.ring.config import RingOptions  # noqa: E402

COLLECTIVES = ("all-gather", "all-gather-start", "reduce-scatter", "all-reduce", "all-reduce-start")


def collectives(S, mesh_shape, pooling, heads=(4, 2), head_dim=64, index_dim=16, top_k=4):
    """``[(opcode, shape, bytes)]`` of the compiled MSA fwd+bwd (bf16 inputs, B = 1)."""
    hq, hkv = heads
    P = mesh_shape[0] * mesh_shape[1]
    mesh = make_mesh(mesh_shape, jax.devices()[:P])
    cfg = MSAConfig(top_k=top_k, ring=RingOptions(impl="xla"), pooling=pooling)
    shapes = [(1, S, hq, head_dim), (1, S, hkv, head_dim), (1, S, hkv, head_dim), (1, S, hkv, index_dim), (1, S, index_dim)]
    args = [jnp.zeros(s, jnp.bfloat16) for s in shapes]

    def loss(*a):
        o, aux = msa_attention(*a, mesh, cfg)
        return jnp.sum(o.astype(jnp.float32)) + aux.kl

    hlo = jax.jit(jax.grad(loss, (0, 1, 2, 3, 4))).lower(*args).compile().as_text()
    return [(i.opcode, i.shape.split("{")[0], array_bytes(i.shape)) for i in instructions(hlo) if i.opcode in COLLECTIVES]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--mesh", type=int, nargs=2, default=[2, 4])
    args = ap.parse_args(argv)
    for pooling in ("mean", "max"):
        print(f"## pooling={pooling}")
        for op, shape, nbytes in collectives(args.seq_len, tuple(args.mesh), pooling):
            print(f"| {op} | `{shape}` | {nbytes:,} |")


if __name__ == "__main__":
    main()
