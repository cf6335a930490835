"""Size of the Mosaic GPU query-side kernels' lowered programs (issue 34: compile time), on any host.

Lowers :func:`pallas_kernels.mosaic_fwd.mosaic_fwd` and :func:`pallas_kernels.mosaic_bwd.mosaic_dq` for
CUDA (``lower(lowering_platforms=("cuda",))``: no GPU needed) at a small fixed shape (1 x 256, 4 / 2
heads, d128, a random StepIndex) for each stream and walk, and reports the characters of the lowered
text, which holds each kernel's Mosaic MLIR: one copy of the step body per loop of the consumers' walk.
A CPU proxy for the kernels' share of the GPU compile time (run 13: the shared-stream forward with
segment loops, 1.58 M characters, compiled in 12 s; with one loop, 0.47 M, in 4.5 s), not a timing.

    python -m benchmarks.kernel_lowering [--json rows.jsonl]
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
    from pallas_kernels.mosaic_bwd import mosaic_dq
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


def main(argv=None) -> int:
    from benchmarks._driver import append_rows, provenance

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="append the rows (JSONL) to this file")
    a = ap.parse_args(argv)
    prov = provenance(argv)
    rows = sizes()
    print("| case | forward (M chars) | dQ (M chars) |\n|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['fwd_chars'] / 1e6:.2f} | {r['dq_chars'] / 1e6:.2f} |")
    append_rows(a.json, rows, prov)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
