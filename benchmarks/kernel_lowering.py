"""Size of the Mosaic GPU query-side kernels' lowered programs (issue 34: compile time), on any host.

Lowers :func:`pallas_kernels.mosaic_fwd.mosaic_fwd` and :func:`pallas_kernels.mosaic_dq.mosaic_dq` for
CUDA (``lower(lowering_platforms=("cuda",))``: no GPU needed) at a small fixed shape (1 x 256, 4 / 2
heads, d128, a random StepIndex) for each stream and walk, and reports the characters of the lowered
text, which holds each kernel's Mosaic MLIR: one copy of the step body per loop of the consumers' walk.
A CPU proxy for the kernels' share of the GPU compile time (run 13: the shared-stream forward with
segment loops, 1.58 M characters, compiled in 12 s; with one loop, 0.47 M, in 4.5 s), not a timing.

``--compile`` (a Hopper GPU): the time each Mosaic kernel of the training step takes to compile, at the
training model's head shape (``--heads 14,2 --head-dim 64``: Qwen2.5-0.5B): one small program per
kernel, ``jit(...).lower(...).compile()`` timed, the rounds at different lengths (each round's kernels
are new to Mosaic GPU's per-process compile cache, so every row pays its kernel's compile).

    python -m benchmarks.kernel_lowering [--json rows.jsonl]
    python -m benchmarks.kernel_lowering --compile [--rounds 2] [--json rows.jsonl]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

#: (label, stream, walk, dQ kv_step): the defaults first (``None``: the kernels' own default; ``"auto"``:
#: the forward per call from the index, the dQ split), then both kernels under one conditional
CASES = (("defaults", None, None, None), ("index", "index", None, None), ("shared, loops", "shared", "loops", 64),
         ("shared, switch", "shared", "switch", 64), ("split, loops", "split", "loops", 128),
         ("split, switch", "split", "switch", 128))


def sizes(seed: int = 2) -> list:
    """``[{case, stream, walk, fwd_chars, dq_chars}]`` for :data:`CASES`."""
    from pallas_kernels.mosaic_dq import mosaic_dq
    from pallas_kernels.mosaic_fwd import mosaic_fwd
    from pallas_kernels.testing import random_step_index

    B, S, H, Hkv, D = 1, 256, 4, 2, 128
    pos = jnp.arange(S, dtype=jnp.int32)
    idx = random_step_index(np.random.default_rng(seed), B, H, S, S, pos, pos, max_blocks=3, max_cols=70)
    q, k = jnp.zeros((B, S, H, D), jnp.bfloat16), jnp.zeros((B, S, Hkv, D), jnp.bfloat16)
    lse = jnp.zeros((B, H, S))
    rows = []
    for label, stream, walk, kv_step in CASES:
        kw = {k_: v for k_, v in (("stream", stream), ("walk", walk)) if v is not None}
        dkw = dict(kw, **({"kv_step": kv_step} if kv_step else {}))
        f = jax.jit(lambda q, k, idx, kw=kw: mosaic_fwd(q, k, k, pos, pos, idx, sm_scale=0.1, **kw))
        g = jax.jit(lambda q, k, idx, do, lse, dkw=dkw: mosaic_dq(q, k, k, pos, pos, idx, do, lse, lse, sm_scale=0.1,
                                                                  **dkw))
        rows.append({"table": "kernel_lowering", "case": label, "stream": stream or "default",
                     "walk": walk or "default",
                     "fwd_chars": len(f.trace(q, k, idx).lower(lowering_platforms=("cuda",)).as_text()),
                     "dq_chars": len(g.trace(q, k, idx, q, lse).lower(lowering_platforms=("cuda",)).as_text())})
    return rows


#: (label, kernel, options) of :func:`compile_times`: the training step's five kernels under
#: ``kernel_stream="auto"`` (the forward's two streams, the dQ's split stream, both dK/dV passes),
#: then the variants a smaller program would take
COMPILE_CASES = (("fwd shared (auto's shared branch)", "fwd", {"stream": "shared", "walk": "switch", "kv_step": 128}),
                 ("fwd split (auto's split branch)", "fwd", {"stream": "split", "walk": "loops", "kv_step": 128}),
                 ("dq split (auto)", "dq", {"stream": "split", "walk": "loops", "kv_step": 128}),
                 ("dkv blocks", "dkv_blocks", {}), ("dkv cols", "dkv_cols", {}),
                 ("fwd split, one loop", "fwd", {"stream": "split", "walk": "switch", "kv_step": 128}),
                 ("dq split, one loop", "dq", {"stream": "split", "walk": "switch", "kv_step": 128}))


def compile_times(heads=(14, 2), head_dim: int = 64, rounds: int = 2, seed: int = 0) -> list:
    """``[{case, kernel, round, seq, lower_s, compile_s, chars}]`` for :data:`COMPILE_CASES` (a GPU):
    round ``r`` at ``S = 4096 * (r + 1)``, so every round compiles every kernel anew."""
    import time

    from pallas_kernels.mosaic_dkv import mosaic_dkv_blocks, mosaic_dkv_cols
    from pallas_kernels.mosaic_dq import mosaic_dq
    from pallas_kernels.mosaic_fwd import mosaic_fwd
    from pallas_kernels.testing import random_step_index

    H, Hkv = heads
    base = jax.jit(lambda x: (x * 2.0).sum()).lower(jnp.ones(8)).compile()  # XLA's own start-up, untimed
    del base
    rows = []
    for r in range(rounds):
        S = 4096 * (r + 1)
        pos = jnp.arange(S, dtype=jnp.int32)
        idx = random_step_index(np.random.default_rng(seed), 1, H, S, S, pos, pos, max_blocks=8, max_cols=200)
        q = jnp.zeros((1, S, H, head_dim), jnp.bfloat16)
        k = jnp.zeros((1, S, Hkv, head_dim), jnp.bfloat16)
        lse = jnp.zeros((1, H, S))
        dk = jnp.zeros((1, S, Hkv, head_dim))
        for label, kernel, kw in COMPILE_CASES:
            fns = {"fwd": lambda q, k, idx, do, lse: mosaic_fwd(q, k, k, pos, pos, idx, sm_scale=0.125, **kw),
                   "dq": lambda q, k, idx, do, lse: mosaic_dq(q, k, k, pos, pos, idx, do, lse, lse, sm_scale=0.125,
                                                              **kw),
                   "dkv_blocks": lambda q, k, idx, do, lse: mosaic_dkv_blocks(q, k, k, pos, pos, idx, do, lse, lse,
                                                                              sm_scale=0.125),
                   "dkv_cols": lambda q, k, idx, do, lse: mosaic_dkv_cols(q, k, k, pos, pos, idx, do, lse, lse, dk,
                                                                          dk, sm_scale=0.125)}
            t0 = time.perf_counter()
            lowered = jax.jit(fns[kernel]).trace(q, k, idx, q, lse).lower()
            t1 = time.perf_counter()
            lowered.compile()
            t2 = time.perf_counter()
            rows.append({"table": "kernel_compile", "case": label, "kernel": kernel, "round": r, "seq": S,
                         "heads": f"{H}/{Hkv}", "head_dim": head_dim, "lower_s": round(t1 - t0, 2),
                         "compile_s": round(t2 - t1, 2), "chars": len(lowered.as_text())})
            print(f"round {r} S={S} {label}: lower {t1 - t0:.2f} s, compile {t2 - t1:.2f} s", flush=True)
    return rows


def main(argv=None) -> int:
    from benchmarks._driver import append_rows, provenance

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="append the rows (JSONL) to this file")
    ap.add_argument("--compile", action="store_true", help="time each kernel's GPU compile (a Hopper GPU)")
    ap.add_argument("--rounds", type=int, default=2, help="--compile: rounds, each at a new length")
    a = ap.parse_args(argv)
    prov = provenance(argv)
    if a.compile:
        rows = compile_times(rounds=a.rounds)
        print("| round | kernel | lower s | compile s | M chars |\n|---|---|---:|---:|---:|")
        for r in rows:
            print(f"| {r['round']} | {r['case']} | {r['lower_s']:.2f} | {r['compile_s']:.2f} | {r['chars'] / 1e6:.2f} |")
        append_rows(a.json, rows, prov)
        return 0
    rows = sizes()
    print("| case | forward (M chars) | dQ (M chars) |\n|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['fwd_chars'] / 1e6:.2f} | {r['dq_chars'] / 1e6:.2f} |")
    append_rows(a.json, rows, prov)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
