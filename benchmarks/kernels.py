"""Benchmark: block-sparse (vertical-slash) Pallas kernels vs cuDNN and JAX's Pallas Triton ``mha``.

B=1, 16 query heads, 2 KV heads, head_dim 128, bf16, causal. For each sequence length: cuDNN
dense causal (``jax.nn.dot_product_attention(implementation="cudnn")``), JAX's Pallas Triton flash
attention (``jax.experimental.pallas.ops.gpu.attention.mha``, K/V repeated to 16 heads outside the
timed region), our kernel with the full causal index (dense work) and with synthetic vertical-slash
indices at about 90/95/98% sparsity (``pallas_kernels.testing.vertical_slash_index``).

TFLOP/s are on the *active* work: dense causal counts ``S(S+1)/2`` pairs per head; sparse counts
the (query, key) pairs the index makes the kernel compute (``bs*bs`` per active block,
``bs`` per column). Forward = ``4 * pairs * D`` FLOP; forward+backward = 3.5x forward.

Usage (GPU): ``PYTHONPATH=. python benchmarks/kernels.py --seqs 32768,131072 --json out.json``
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from _timing import timeit
from pallas_kernels import api
from pallas_kernels.index_format import full_step_index
from pallas_kernels.testing import vertical_slash_index

H, HKV, D, BS = 16, 2, 128, 64


def _time(fn, *args, reps=5, warmup=2):
    return float(timeit(fn, *args, warmup=warmup, repeat=reps)[0])


def _inputs(S, seed, last_dtype):
    """``q, k, v`` bf16 and the cotangent / dO (``last_dtype``), shapes of the benchmark."""
    kq, kk, kv, kc = jax.random.split(jax.random.PRNGKey(seed), 4)
    return (jax.random.normal(kq, (1, S, H, D), jnp.bfloat16), jax.random.normal(kk, (1, S, HKV, D), jnp.bfloat16),
            jax.random.normal(kv, (1, S, HKV, D), jnp.bfloat16), jax.random.normal(kc, (1, S, H, D), last_dtype))


def _fwd_bwd(f):
    def loss(q, k, v, ct):
        return jnp.sum(f(q, k, v).astype(jnp.float32) * ct)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def run(seqs, sparsities, with_mha_max, dense_ours_max, reps, seed=0):
    rows = []
    rng = np.random.default_rng(seed)
    for S in seqs:
        q, k, v, ct = _inputs(S, S, jnp.float32)
        pos = jnp.arange(S, dtype=jnp.int32)
        dense_pairs = H * S * (S + 1) / 2
        scale = D**-0.5

        def add(name, pairs, f, fwd_only=False):
            fwd = _time(jax.jit(f), q, k, v, reps=reps)
            fb = None if fwd_only else _time(_fwd_bwd(f), q, k, v, ct, reps=reps)
            fl = 4 * pairs * D
            row = dict(seq=S, name=name, sparsity=1 - pairs / dense_pairs, fwd_ms=fwd * 1e3,
                       fwd_tflops=fl / fwd / 1e12, fb_ms=None if fb is None else fb * 1e3,
                       fb_tflops=None if fb is None else 3.5 * fl / fb / 1e12)
            rows.append(row)
            print(json.dumps(row), flush=True)

        cud = functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="cudnn")
        add("cudnn", dense_pairs, lambda q, k, v: cud(q, k, v))
        if S <= with_mha_max:
            from jax.experimental.pallas.ops.gpu.attention import mha
            g = H // HKV

            def mha_f(q, k, v):
                return mha(q, jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2), None, sm_scale=scale,
                           causal=True)
            add("pallas_mha", dense_pairs, mha_f)
        if S <= dense_ours_max:
            full = full_step_index(1, H, S, S, pos, pos, BS)
            add("ours_full", dense_pairs, lambda q, k, v: api.block_sparse_attention(
                q, k, v, pos, pos, full, impl="pallas"))
        for sp in sparsities:
            idx = vertical_slash_index(rng, 1, H, S, sp, block_size=BS)
            idx = jax.tree.map(jnp.asarray, idx)
            bc = np.asarray(idx.block_count, np.float64).sum()
            cc = np.asarray(idx.col_count, np.float64).sum()
            pairs = bc * BS * BS + cc * BS
            add(f"ours_vs{int(round(sp * 100))}", pairs, lambda q, k, v, idx=idx: api.block_sparse_attention(
                q, k, v, pos, pos, idx, impl="pallas"))
    return rows


def sweep(S, sparsities, reps, seed=1):
    """Time the raw kernels (fwd, bwd) over num_warps / num_stages and the two dK/dV strategies."""
    from pallas_kernels import triton_kernels as tk

    rng = np.random.default_rng(seed)
    q, k, v, do = _inputs(S, seed, jnp.bfloat16)
    pos = jnp.arange(S, dtype=jnp.int32)
    scale = D**-0.5
    idxs = {} if S > 32768 else {"full": full_step_index(1, H, S, S, pos, pos, BS)}
    for sp in sparsities:
        idxs[f"vs{int(round(sp * 100))}"] = jax.tree.map(jnp.asarray, vertical_slash_index(rng, 1, H, S, sp))
    rows = []
    for name, idx in idxs.items():
        for tname, tf in [("transpose_blocks", tk.transpose_block_index), ("transpose_cols", tk.transpose_col_index)]:
            t = _time(jax.jit(functools.partial(tf, sk=S, **({"bs": BS} if tname == "transpose_blocks" else
                                                            {"chunk": BS}))), idx, reps=reps)
            rows.append(dict(seq=S, index=name, kernel=tname, num_warps=0, num_stages=0, ms=t * 1e3))
            print(json.dumps(rows[-1]), flush=True)
        out, lse = tk.pallas_fwd(q, k, v, pos, pos, idx, sm_scale=scale, block_size=BS)
        delta = api.attention_delta(out, do)
        for nw, ns in [(4, 2), (4, 3)]:
            f = functools.partial(tk.pallas_fwd, sm_scale=scale, block_size=BS, num_warps=nw, num_stages=ns)
            t = _time(f, q, k, v, pos, pos, idx, reps=reps)
            rows.append(dict(seq=S, index=name, kernel="fwd", num_warps=nw, num_stages=ns, ms=t * 1e3))
            print(json.dumps(rows[-1]), flush=True)
        for dkv, nw, ns in [("kv_stationary", 4, 2), ("kv_stationary", 4, 3), ("atomic_cols", 4, 2),
                            ("atomic", 4, 2)]:
            if dkv == "atomic" and (name == "full" or S > 32768):
                continue  # 327 ms at 32K (run 2): not worth the lease time
            f = functools.partial(tk.pallas_bwd, sm_scale=scale, block_size=BS, num_warps=nw, num_stages=ns,
                                  dkv=dkv)
            t = _time(f, q, k, v, pos, pos, idx, do, lse, delta, reps=reps)
            rows.append(dict(seq=S, index=name, kernel=f"bwd_{dkv}", num_warps=nw, num_stages=ns, ms=t * 1e3))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def table(rows):
    cud = {r["seq"]: r for r in rows if r["name"] == "cudnn"}
    out = ["| seq | impl | sparsity | fwd ms | fwd TFLOP/s | fwd x cuDNN | fwd+bwd ms | fwd+bwd TFLOP/s "
           "| fwd+bwd x cuDNN |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = cud[r["seq"]]
        fb = "-" if r["fb_ms"] is None else f"{r['fb_ms']:.2f}"
        fbt = "-" if r["fb_ms"] is None else f"{r['fb_tflops']:.0f}"
        fbx = "-" if r["fb_ms"] is None else f"{c['fb_ms'] / r['fb_ms']:.2f}"
        out.append(f"| {r['seq']} | {r['name']} | {r['sparsity']:.3f} | {r['fwd_ms']:.2f} | {r['fwd_tflops']:.0f} | "
                   f"{c['fwd_ms'] / r['fwd_ms']:.2f} | {fb} | {fbt} | {fbx} |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="32768,131072")
    ap.add_argument("--sparsities", default="0.9,0.95,0.98")
    ap.add_argument("--mha-max", type=int, default=32768, help="longest sequence for pallas mha")
    ap.add_argument("--dense-max", type=int, default=32768, help="longest sequence for ours_full")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--sweep", type=int, default=0, help="sequence length for a kernel-config sweep (0: none)")
    a = ap.parse_args()
    if a.sweep:
        sw = sweep(a.sweep, [0.95], a.reps)
        if a.json:
            with open(a.json.replace(".json", "_sweep.json"), "w") as f:
                json.dump(sw, f, indent=1)
        for r in sw:
            print(f"{r['index']:>5} {r['kernel']:>18} w{r['num_warps']} s{r['num_stages']}: {r['ms']:.2f} ms")
    seqs = [int(s) for s in a.seqs.split(",")]
    sps = [float(s) for s in a.sparsities.split(",") if s]
    rows = run(seqs, sps, a.mha_max, a.dense_max, a.reps)
    meta = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(meta)
    print(table(rows))


if __name__ == "__main__":
    main()
