"""What the backward's ``delta = rowsum(dO * O)`` costs on one GPU, as the operator computes it
(:func:`pallas_kernels.api.attention_delta`: an einsum at ``precision="highest"`` over the float32
output restored from bf16 + its low codes) against a plain row sum and transpose, the row sum without
the transpose (layout ``[B, Sq, H]``: what the transpose costs) and the einsum on the bf16 output alone
(no codes: the floor without them, a less accurate delta). Each variant twice, in alternating order.

    python benchmarks/attention_delta.py --out rows.jsonl

Rows: ``S, H, D, variant, ms`` (median of ``--repeat``), ``min_ms``, ``max_ms``, ``TBps`` (the bytes of
``O``, its codes and ``dO`` read, per second), ``max_abs_diff`` against the operator's delta (``None``
where the layout differs) and provenance. Results: results/kernels/kernels.md run 27.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks._driver import append_rows, provenance  # noqa: E402
from benchmarks._timing import timeit  # noqa: E402
from pallas_kernels import api  # noqa: E402


def _operator(o, lo, do):
    return api.attention_delta(o, do, lo)


def _rowsum_t(o, lo, do):
    return jnp.sum(api.output_f32(o, lo) * do.astype(jnp.float32), axis=-1).transpose(0, 2, 1)


def _rowsum_bqh(o, lo, do):
    return jnp.sum(api.output_f32(o, lo) * do.astype(jnp.float32), axis=-1)


def _no_codes(o, lo, do):
    return jnp.einsum("bqhd,bqhd->bhq", o.astype(jnp.float32), do.astype(jnp.float32), precision="highest")


VARIANTS = {"einsum": _operator, "rowsum_T": _rowsum_t, "rowsum_bqh": _rowsum_bqh, "einsum_nolo": _no_codes}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="131072x16x128,131072x14x64", help="SxHxD, comma-separated")
    ap.add_argument("--repeat", type=int, default=21)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    prov = provenance(argv)
    rows = []
    for shape in a.shapes.split(","):
        S, H, D = (int(x) for x in shape.split("x"))
        k = jax.random.split(jax.random.PRNGKey(0), 2)
        o, lo = jax.jit(lambda x: api.split_output(x, jnp.bfloat16))(jax.random.normal(k[0], (1, S, H, D), jnp.float32))
        do = jax.random.normal(k[1], (1, S, H, D), jnp.bfloat16)
        ref = _operator(o, lo, do)
        for name in ["einsum", "rowsum_T", "rowsum_bqh", "einsum_nolo", "einsum", "rowsum_T"]:
            f = jax.jit(VARIANTS[name])
            t, ts = timeit(f, o, lo, do, warmup=3, repeat=a.repeat)
            r = f(o, lo, do)
            diff = float(jnp.max(jnp.abs(r - ref))) if r.shape == ref.shape else None
            gb = (o.size * 2 + lo.size * 0.5 + do.size * 2) / 1e9
            row = dict(S=S, H=H, D=D, variant=name, ms=t * 1e3, min_ms=min(ts) * 1e3, max_ms=max(ts) * 1e3,
                       TBps=gb / t / 1e3, max_abs_diff=diff, **prov)
            print(json.dumps(row), flush=True)
            rows.append(row)
    append_rows(a.out, rows, {})
    return rows


if __name__ == "__main__":
    main()
