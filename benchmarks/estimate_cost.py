"""What the index estimate (MTraining Algorithm 1, :func:`mtraining_jax.sparsity.estimate_index`) costs per layer
as its observation window ``last_q`` grows, against dense attention (cuDNN, forward and forward + backward) of
the same shape in the same run: the price of a larger window (``quality.md``: ``last_q=1024`` takes 38 % of the
sparse read's loss away on a trained model) at the lengths users train at.

    MTRAINING_COMMIT=<sha> python benchmarks/estimate_cost.py --seq 131072 --last-q 64,256,1024 --out rows.jsonl
    python benchmarks/estimate_cost.py --seq 131072 --last-q 64 --heads 14,2 --head-dim 64 --impls xla,triton
    python benchmarks/estimate_cost.py --seq 131072 --last-q 64 --heads 14,2 --head-dim 64 --impls xla,triton \
        --window per_document --dense none --trace   # packed documents; where each impl's GPU time goes

One JSON row per (S, last_q, impl) and per cuDNN pass, printed as it is measured (``fn``, ``S``, ``last_q``,
``impl`` (``SparsityConfig.estimate_impl``), ``ms`` median with ``ms_min`` / ``ms_max`` over ``--repeats``,
``compile_s``, ``window`` and ``documents``; with several impls, ``index_diff``: the entries of the index that
differ from the first impl's; with ``--trace``, per impl an ``estimate_trace`` row: a ``jax.profiler`` trace of 3
calls (:func:`benchmarks.kernel_trace.trace_case`: ``per_call`` ms of Pallas kernels / XLA work / libraries / idle,
``by_source``: the time per library source line, largest first; empty off a GPU);
and the run's ``commit``, ``date``, ``device``, ``jax``, ``command``); B = 1, 16 query / 2 KV heads, d128, bf16,
random q/k, default budgets. The impls alternate per repeat round so that drift affects them alike.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script: the repo root


def positive_ints(text: str) -> list:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=positive_ints, default=[131072], help="sequence lengths (comma-separated)")
    ap.add_argument("--last-q", type=positive_ints, default=[64, 256, 1024], help="observation windows")
    ap.add_argument("--heads", type=positive_ints, default=[16, 2], help="query heads, KV heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--impls", default="xla", help="estimate impls, comma-separated (xla, triton)")
    ap.add_argument("--dense", choices=("cudnn", "xla", "none"), default="cudnn",
                    help="the dense attention timed beside it (xla on a CPU)")
    ap.add_argument("--window", choices=("sequence", "per_document"), default="sequence",
                    help="the observation window (SparsityConfig.window); per_document: packed documents of "
                         "benchmarks/packed_documents.py's length mix (seed 0)")
    ap.add_argument("--window-blocks", type=int, default=64, help="per_document: the window's query blocks")
    ap.add_argument("--trace", action="store_true", help="also trace each impl (an estimate_trace row per impl)")
    ap.add_argument("--out", help="also append the rows to this JSONL file")
    a = ap.parse_args(argv)
    if len(a.heads) != 2 or a.heads[0] % a.heads[1]:
        ap.error(f"--heads: expected QUERY,KV with KV dividing QUERY, got {a.heads}")
    for S in a.seq:
        for lq in a.last_q:
            if lq > S:
                ap.error(f"--last-q {lq} is larger than --seq {S}")
    from mtraining_jax.sparsity.config import ESTIMATE_IMPLS

    impls = [x.strip() for x in a.impls.split(",") if x.strip()]
    if not impls or any(x not in ESTIMATE_IMPLS for x in impls) or len(set(impls)) < len(impls):
        ap.error(f"--impls: expected distinct names from {ESTIMATE_IMPLS}, got {a.impls!r}")

    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks._driver import provenance
    from benchmarks._timing import timeit
    from mtraining_jax.sparsity import SparsityConfig, estimate_index

    prov = provenance(argv)
    Hq, Hkv = a.heads

    def emit(row):
        row.update(prov)
        print(json.dumps(row), flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps(row) + "\n")

    def measure(fn, *args):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        compile_s = time.perf_counter() - t0
        med, ts = timeit(fn, *args, warmup=1, repeat=a.repeats)
        return {"ms": med * 1e3, "ms_min": min(ts) * 1e3, "ms_max": max(ts) * 1e3, "compile_s": compile_s}

    def measure_alternating(fns, *args):
        """Each fn compiled, then ``--repeats`` rounds timing each once in turn (order rotated per round)."""
        compile_s = {}
        for name, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            compile_s[name] = time.perf_counter() - t0
            timeit(fn, *args, warmup=1, repeat=1)
        ts = {name: [] for name in fns}
        names = list(fns)
        for r in range(a.repeats):
            for name in names[r % len(names):] + names[:r % len(names)]:
                ts[name].append(timeit(fns[name], *args, warmup=0, repeat=1)[0])
        return {name: {"ms": float(np.median(t)) * 1e3, "ms_min": min(t) * 1e3, "ms_max": max(t) * 1e3,
                       "compile_s": compile_s[name]} for name, t in ts.items()}

    for S in a.seq:
        kq, kk, kv = jax.random.split(jax.random.key(S), 3)
        q = jax.random.normal(kq, (1, S, Hq, a.head_dim), jnp.bfloat16)
        k = jax.random.normal(kk, (1, S, Hkv, a.head_dim), jnp.bfloat16)
        v = jax.random.normal(kv, (1, S, Hkv, a.head_dim), jnp.bfloat16)
        pos = jnp.arange(S, dtype=jnp.int32)
        seg, docs = None, 1
        if a.window == "per_document":
            from benchmarks.packed_documents import length_mix

            lens = length_mix(S, 0)
            seg, docs = jnp.asarray(np.repeat(np.arange(len(lens)), lens)[None], jnp.int32), len(lens)
        for lq in a.last_q:
            cfgs = {impl: SparsityConfig(last_q=lq, estimate_impl=impl, window=a.window, window_blocks=a.window_blocks)
                    for impl in impls}
            fns = {impl: jax.jit(lambda q, k, cfg=cfg: estimate_index(q, k, pos, cfg, segment_ids=seg))
                   for impl, cfg in cfgs.items()}
            first = jax.tree.map(np.asarray, fns[impls[0]](q, k))
            for impl, m in measure_alternating(fns, q, k).items():
                row = {"fn": "estimate_index", "impl": impl, "S": S, "last_q": lq, "heads": [Hq, Hkv],
                       "head_dim": a.head_dim, "window": a.window, "documents": docs, **m}
                if len(impls) > 1:
                    got = jax.tree.map(np.asarray, fns[impl](q, k))
                    row["index_diff"] = int(sum((x != y).sum() for x, y in zip(got, first)))
                emit(row)
            if a.trace:
                from benchmarks.kernel_trace import trace_case

                for impl in impls:
                    tr = trace_case(f"estimate {impl} {a.window} {S}", fns[impl], (q, k), reps=3, top=20)
                    dev = next(iter(tr["summary"].values()), {})
                    emit({"fn": "estimate_trace", "impl": impl, "S": S, "last_q": lq, "heads": [Hq, Hkv],
                          "head_dim": a.head_dim, "window": a.window, "documents": docs, "per_call": tr["per_call"],
                          "by_source": dev.get("by_source", [])[:15], "top": dev.get("top", [])[:15]})
        if a.dense != "none":
            impl = None if a.dense == "xla" else a.dense
            att = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)  # noqa: E731
            fb = jax.jit(jax.grad(lambda q, k, v: att(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
            emit({"fn": f"{a.dense}_fwd", "S": S, "heads": [Hq, Hkv], "head_dim": a.head_dim,
                  **measure(jax.jit(att), q, k, v)})
            emit({"fn": f"{a.dense}_fwd_bwd", "S": S, "heads": [Hq, Hkv], "head_dim": a.head_dim,
                  **measure(fb, q, k, v)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
