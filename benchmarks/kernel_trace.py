"""Where an operator call's GPU time goes: ``jax.profiler`` traces of ``block_sparse_attention`` (forward, or
forward + backward) on a trained model's index, on ``benchmarks/kernels.py``'s synthetic index families
(``--families``, its indices: same seed and order) and on the full causal index, with cuDNN on the same inputs,
summarised by :mod:`benchmarks.trace_summary` (kernel time by source: ``pallas`` kernels, the XLA work each
source line of the library adds, ``library`` cuBLAS / cuDNN, idle gaps). The question it answers: of a call's
milliseconds, how many are the kernels and how many the index operands, ``delta`` and casts around them.

    python -m benchmarks.kernel_trace --model-index results/kernels/model_index_mt_s0_128k.npz --model-layers 1 \\
        --full-seq 32768 --json trace.json
    python -m benchmarks.kernel_trace --families spread,mixed,vert --sparsity 0.95 --json trace.json

Shapes as ``benchmarks/kernels.py`` (B=1, 16 / 2 heads, d128, bf16; fwd+bwd given a bf16 ``dO``, ``--cotangent``);
each case: 3 warm calls, ``--reps`` timed calls (wall clock), then ``--traced-calls`` (3) traced calls (trace
sums over those, per call).
"""

from __future__ import annotations

import argparse
import functools
import json
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._driver import provenance
from benchmarks._timing import timeit
from benchmarks.kernel_cases import BS, COTANGENTS, H, cotangent_dtype, family_index, fwd_bwd, inputs
from benchmarks.model_index import add_model_args, model_entries, model_options
from benchmarks.trace_summary import summarize_dir
from pallas_kernels import api
from pallas_kernels.testing import INDEX_FAMILIES


def trace_case(name: str, fn, args, reps: int, top: int, traced: int = 3) -> dict:
    """Time and trace ``fn(*args)`` (jitted; ``traced`` calls traced): ``{"case", "ms" (sorted), "per_call":
    {pallas, library, xla, idle} ms, "summary"}``."""
    hlo = fn.lower(*args).compile().as_text()
    _, ts = timeit(fn, *args, warmup=3, repeat=reps)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(traced):
                jax.block_until_ready(fn(*args))
        summ = summarize_dir(d, top=top, hlo_text=hlo)
    s = next(iter(summ.values()), {})  # one device (no GPU: no device kernels, an empty summary)
    by = {r["source"]: r["ms"] for r in s.get("by_source", [])}
    pallas, lib = by.get("pallas", 0.0), by.get("library", 0.0)
    xla = sum(by.values()) - pallas - lib
    per_call = {k: v / traced for k, v in (("pallas", pallas), ("library", lib), ("xla", xla),
                                           ("idle", s.get("idle_ms", 0.0)), ("span", s.get("span_ms", 0.0)))}
    row = {"case": name, "ms": sorted(t * 1e3 for t in ts), "per_call": per_call, "summary": summ}
    print(f"{name}: {sorted(round(t * 1e3, 2) for t in ts)} ms; per call: "
          + ", ".join(f"{k} {v:.2f}" for k, v in per_call.items()), flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=131072, help="sequence length of the model-index cases")
    ap.add_argument("--full-seq", type=int, default=0, help="also the full causal index (and cuDNN) at this length")
    ap.add_argument("--families", default="", help="also these synthetic index families at --seq (benchmarks/kernels.py's: "
                    f"{', '.join(INDEX_FAMILIES)}), comma-separated")
    ap.add_argument("--sparsity", type=float, default=0.95, help="with --families: the families' sparsity")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--traced-calls", type=int, default=3, help="calls traced per case (per-call sums over them)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--cotangent", default="do", choices=COTANGENTS, help="how fwd+bwd is timed "
                    "(benchmarks.kernel_cases.fwd_bwd: do = the backward given a bf16 dO; loss = runs <= 39's)")
    add_model_args(ap)
    a = ap.parse_args(argv)
    model = model_options(a, ap)
    families = [f for f in a.families.split(",") if f]
    bad = [f for f in families if f not in INDEX_FAMILIES]
    if bad:
        ap.error(f"--families: unknown {', '.join(bad)} (known: {', '.join(INDEX_FAMILIES)})")
    if not 0 < a.sparsity < 1:
        ap.error(f"--sparsity must be in (0, 1), got {a.sparsity}")
    if a.traced_calls < 1:
        ap.error(f"--traced-calls must be >= 1, got {a.traced_calls}")
    rows = []
    if model or families:
        q, k, v, ct = inputs(a.seq, a.seq, cotangent_dtype(a.cotangent))
        pos = jnp.arange(a.seq, dtype=jnp.int32)
        rng = np.random.default_rng(0)  # benchmarks/kernels.py's seed: its family indices, in its order
        cases = [family_index(rng, fam, a.seq, a.sparsity, 4096) for fam in families]
        cases += [(idx, f"model_L{layer}" + "".join(f"_{kk}{vv}" for kk, vv in bud.items()))
                  for layer, bud, idx, _ in (model_entries(a.seq, H, BS, model) if model else [])]
        for idx, tag in cases:
            idx = jax.tree.map(jnp.asarray, idx)
            f = lambda q, k, v, pos, idx: api.block_sparse_attention(q, k, v, pos, pos, idx)  # noqa: E731
            # positions and index: arguments (as in training), not constants XLA could fold into the program
            rows.append(trace_case(f"{tag}_fb", fwd_bwd(f, a.cotangent), (q, k, v, ct, pos, idx), a.reps, a.top,
                                   a.traced_calls))
    if a.full_seq:
        S = a.full_seq
        q, k, v, ct = inputs(S, S, cotangent_dtype(a.cotangent))
        pos = jnp.arange(S, dtype=jnp.int32)
        cud = functools.partial(jax.nn.dot_product_attention, is_causal=True,  # XLA's attention off a GPU
                                implementation="cudnn" if jax.default_backend() == "gpu" else None)
        for name, f, data in (("full", lambda q, k, v, pos: api.block_sparse_attention(q, k, v, pos, pos, None), (pos,)),
                              ("cudnn", lambda q, k, v: cud(q, k, v), ())):
            rows.append(trace_case(f"{name}_{S}_fwd", jax.jit(f), (q, k, v, *data), a.reps, a.top, a.traced_calls))
            rows.append(trace_case(f"{name}_{S}_fb", fwd_bwd(f, a.cotangent), (q, k, v, ct, *data), a.reps, a.top,
                                   a.traced_calls))
    prov = provenance(argv)
    for r in rows:
        r.update(prov, cotangent=a.cotangent)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
