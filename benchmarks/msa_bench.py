"""One GPU: MSA vs MTraining vs cuDNN attention, forward+backward step time and work fraction.

For each length (default 32K and 128K): B=1, 16 query / 2 KV heads, head_dim 128, bfloat16, q/k from
the synthetic vertical-slash generator (as ``benchmarks/sparse_ring.py``), MSA index branch inputs
``q_idx [B, S, 2, 64]``, ``k_idx [B, S, 64]`` (random: selection cost does not depend on values).
Times (median, ``jit(value_and_grad)`` of ``sum(out * cot)`` (+ the KL for MSA)):

* ``cudnn``: ``jax.nn.dot_product_attention(is_causal=True, implementation="cudnn")`` (dense);
* ``mtraining``: :func:`~mtraining_jax.attention.mtraining.mtraining_attention` (default budgets)
  on a 1x1 mesh, with its work fraction;
* ``msa``: :func:`~mtraining_jax.attention.msa.msa_attention` sparse (top-k 16 of 64-token blocks,
  the forced local block included) with the KL loss and recall metric (a logging step of the
  trainer); ``msa_nolog``: the same without the recall metric (the trainer's other steps); its parts alone:
  ``msa_select`` (summaries + top-k), ``msa_attn`` (the sparse ring with the selection, no KL),
  and its work fraction;
* ``msa_warmup`` (``--warmup``): the warm-up step (dense ring + full-support KL).

``--pooling mean max`` runs the MSA cases once per block-score pooling (``max``: the paper's
max-pooled token scores, an ``[S, S]``-work index branch in XLA).

    python -m benchmarks.msa_bench --lengths 32768 131072 --pooling mean max --out $OUT

Memory at 128K (B = 1): inputs 1.2 GiB (bf16 q / cot 512 MiB each); no ``[S, S]`` or
``[S, nb x heads]`` intermediate in any MSA piece: the selection and the KL run over query blocks in
``lax.map`` chunks of at most ``MAP_BYTES`` (256 MiB) of temporaries, the KL keeps ``[S, Hkv, k]``
residuals, the recall metric scores one query block against all keys (``Hq x 64 x S`` float32,
512 MiB). The compiled MSA forward+backward's temporaries (XLA attention twin, CPU lowering):
6.3 GiB (``mean``), 8.4 GiB (``max``). ``--warmup`` adds the full-support KL (``k = S / 64``:
``O(S^2)`` work, run sequentially per query block; 2 GiB of residuals at 128K).

Writes ``$OUT/msa_bench.jsonl`` (one record per length) and prints them.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

from benchmarks._driver import provenance
from benchmarks._timing import timeit
from mtraining_jax.attention.msa import MSAConfig, msa_attention
from mtraining_jax.attention.mtraining import MTrainingConfig, mtraining_attention, stats_scalars
from mtraining_jax.mesh import make_mesh
from mtraining_jax.sparsity.msa_select import index_keys, select_blocks
from mtraining_jax.sparsity.synthetic import SyntheticAttention, synthetic_qk

HQ, HKV, D, DI = 16, 2, 128, 64


def inputs(S, seed=0):
    syn = SyntheticAttention(seq_len=S, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, seed=seed, num_outliers=64)
    q, k = synthetic_qk(syn)
    ks = jax.random.split(jax.random.PRNGKey(seed + 1), 4)
    v = jax.random.normal(ks[0], (1, S, HKV, D))
    cot = jax.random.normal(ks[1], (1, S, HQ, D))
    qi = jax.random.normal(ks[2], (1, S, HKV, DI))
    ki = jax.random.normal(ks[3], (1, S, DI))
    bf = lambda x: x.astype(jnp.bfloat16)  # noqa: E731
    return tuple(bf(x) for x in (q, k, v, cot, qi, ki))


def run(S, args, pooling="mean"):
    mesh = make_mesh((1, 1), jax.devices()[:1])
    q, k, v, cot, qi, ki = inputs(S)
    f32 = lambda o: o.astype(jnp.float32)  # noqa: E731
    rec = {"S": S, "device": jax.devices()[0].device_kind, "jax": jax.__version__, "top_k": args.top_k,
           "pooling": pooling}

    def cudnn_loss(q, k, v):
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        return jnp.sum(f32(o) * f32(cot))

    mt_cfg = MTrainingConfig(layout="contiguous")

    def mt_loss(q, k, v):
        o, st = mtraining_attention(q, k, v, mesh, mt_cfg, return_stats=True)
        return jnp.sum(f32(o) * f32(cot)), st.work

    msa_cfg = MSAConfig(top_k=args.top_k, layout="contiguous", pooling=pooling)

    def msa_loss(q, k, v, qi, ki, warmup=False, metrics=True):
        o, aux = msa_attention(q, k, v, qi, ki, mesh, msa_cfg, warmup=warmup, metrics=metrics)
        return jnp.sum(f32(o) * f32(cot)) + aux.kl, aux

    def msa_attn_only(q, k, v, qi, ki):
        o, _ = msa_attention(q, k, v, qi, ki, mesh, msa_cfg)
        return jnp.sum(f32(o) * f32(cot))

    pos = jnp.arange(S)
    cases = {} if args.skip_baselines else {
        "cudnn": (jax.jit(jax.grad(cudnn_loss, (0, 1, 2))), (q, k, v)),
        "mtraining": (jax.jit(jax.grad(mt_loss, (0, 1, 2), has_aux=True)), (q, k, v))}
    cases |= {
        "msa": (jax.jit(jax.grad(msa_loss, (0, 1, 2, 3, 4), has_aux=True)), (q, k, v, qi, ki)),
        "msa_nolog": (jax.jit(jax.grad(lambda *a: msa_loss(*a, metrics=False), (0, 1, 2, 3, 4), has_aux=True)),
                      (q, k, v, qi, ki)),
        "msa_select": (jax.jit(lambda qi, ki: select_blocks(qi, index_keys(ki, 64, pooling), pos, top_k=args.top_k,
                                                            pooling=pooling)), (qi, ki)),
    }
    if args.warmup:
        cases["msa_warmup"] = (jax.jit(jax.grad(lambda *a: msa_loss(*a, warmup=True), (0, 1, 2, 3, 4), has_aux=True)),
                               (q, k, v, qi, ki))
    for name, (fn, a) in cases.items():
        try:
            rec[f"{name}_fwdbwd_s" if name != "msa_select" else "msa_select_s"], _ = timeit(fn, *a, repeat=args.repeat)
        except Exception as e:  # noqa: BLE001  (record and go on: one failing case must not hide the others)
            rec[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(json.dumps({k2: v2 for k2, v2 in rec.items() if k2.startswith(name)}), flush=True)
    try:  # the sparse attention alone (no KL / recall): a separate jit where XLA drops the unused KL
        rec["msa_attn_fwdbwd_s"], _ = timeit(jax.jit(jax.grad(msa_attn_only, (0, 1, 2))), q, k, v, qi, ki,
                                             repeat=args.repeat)
    except Exception as e:  # noqa: BLE001
        rec["msa_attn_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    _, aux = jax.jit(lambda *a: msa_attention(*a, mesh, msa_cfg))(q, k, v, qi, ki)
    rec["msa_work_fraction"] = float(aux.work_fraction)
    rec["msa_kl"] = float(aux.kl)
    if not args.skip_baselines:
        _, work = jax.jit(mt_loss)(q, k, v)
        rec["mtraining_work_fraction"] = float(stats_scalars(work, 1, HQ, S, 64)["work_fraction"])
    for m in ("mtraining", "msa", "msa_nolog", "msa_attn"):
        if f"{m}_fwdbwd_s" in rec and "cudnn_fwdbwd_s" in rec:
            rec[f"{m}_speedup_vs_cudnn"] = rec["cudnn_fwdbwd_s"] / rec[f"{m}_fwdbwd_s"]
    return rec


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--warmup", action="store_true", help="also time the MSA warm-up step (dense + full KL)")
    ap.add_argument("--pooling", nargs="+", default=["mean"], choices=["mean", "max"])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "msa_bench.jsonl")
    prov = provenance(argv)
    for S in args.lengths:
        for i, pooling in enumerate(args.pooling):
            args.skip_baselines = i > 0  # cuDNN / MTraining once per length
            rec = {**run(S, args, pooling), **prov}
            print(json.dumps(rec), flush=True)
            with open(path, "a") as f:
                f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
