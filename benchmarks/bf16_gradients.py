"""bf16 gradient accuracy of the attention op against a float64 reference, per kernel impl and per
choice of the backward's output residual (docs/kernels.md, results/kernels/kernels.md run 12).

Inputs (:func:`adversarial_inputs`): random bf16 q / v, keys sharing a mean direction (as LLM keys
do; that share of dQ cancels in the exact gradient, so an error in ``delta = rowsum(dO * O)`` shows
undamped). Each row: the relative error (Frobenius) of dq / dk / dv vs float64 for
``jax.nn.dot_product_attention`` (XLA and cuDNN) and for ``block_sparse_attention`` per impl with the
residual kept as int4 codes (the library's), int8 codes, an exact float32 error, or the bf16 output
alone. Forward and backward run as separate programs, so residuals are materialised in their saved
dtype.

    python -m benchmarks.bf16_gradients --impls mosaic,triton,xla --json out.jsonl
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import api
from pallas_kernels.reference import dense_attention
from pallas_kernels.rounding import storage_round


def adversarial_inputs(B, S, Hq, Hkv, D, seed=0):
    """``(q, k, v)`` bf16 ``[B, S, H, D]`` and a float32 cotangent ``[B, S, Hq, D]``; keys offset by
    +2 in every component (a shared mean direction)."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(ks[0], (B, S, Hq, D), jnp.float32).astype(jnp.bfloat16)
    k = (jax.random.normal(ks[1], (B, S, Hkv, D), jnp.float32) + 2.0).astype(jnp.bfloat16)
    v = jax.random.normal(ks[2], (B, S, Hkv, D), jnp.float32).astype(jnp.bfloat16)
    cot = jax.random.normal(ks[3], (B, S, Hq, D), jnp.float32)
    return q, k, v, cot


def grads(fn, q, k, v, cot):
    """``(dq, dk, dv)`` of ``fn`` with forward and backward as separate compiled programs (as across a
    training step's remat boundary; one fused program may keep excess precision)."""
    out, pullback = jax.vjp(jax.jit(fn), q, k, v)
    return jax.jit(pullback)(cot.astype(out.dtype))


def rel_error(g, ref) -> float:
    g, ref = np.asarray(g, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(g - ref) / np.linalg.norm(ref))


def reference_grads(q, k, v, cot, mask=None):
    """float64 gradients of the masked dense reference (causal when ``mask`` is None); needs
    ``jax_enable_x64``."""
    f64 = lambda x: x.astype(jnp.float64)  # noqa: E731
    return grads(lambda q, k, v: dense_attention(q, k, v, mask=mask)[0], f64(q), f64(k), f64(v), f64(cot))


def dot_product_attention_fn(group: int, implementation: str, mask=None, batch_heads=None):
    """``jax.nn.dot_product_attention`` on GQA inputs (K/V repeated per query head)."""
    m = None if mask is None else jnp.broadcast_to(mask, batch_heads + mask.shape[-2:])
    return lambda q, k, v: jax.nn.dot_product_attention(  # noqa: E731
        q, jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2), mask=m, is_causal=mask is None,
        implementation=implementation)


def _residual_variant(name):
    """(split_output, output_f32, LO_DTYPE) replacing api's for one variant of the saved residual."""
    if name in ("int2", "int4", "int8"):
        return api.split_output, api.output_f32, getattr(jnp, name)
    if name == "f32":
        def split(out, dtype):
            return out.astype(dtype), out.astype(jnp.float32) - storage_round(out, dtype)
        return split, lambda out, lo=None: storage_round(out) + (0 if lo is None else lo), api.LO_DTYPE
    if name == "bf16":
        return (lambda out, dtype: (out.astype(dtype), None)), api.output_f32, api.LO_DTYPE
    raise ValueError(f"unknown residual variant {name!r}")


def measure(impls, residuals, S=1024, Hq=8, Hkv=2, D=128, block_size=64, seed=3):
    q, k, v, cot = adversarial_inputs(1, S, Hq, Hkv, D, seed)
    ref = reference_grads(q, k, v, cot)
    shape = {"S": S, "Hq": Hq, "Hkv": Hkv, "D": D, "block_size": block_size, "seed": seed}

    def row(name, residual, fn):
        jax.clear_caches()  # a variant patches module globals: no compiled program may be reused
        try:
            g = grads(lambda *a: fn(*a), q, k, v, cot)
        except Exception as e:  # noqa: BLE001 - a backend this platform lacks (cuDNN on CPU)
            return {"impl": name, "residual": residual, "error": f"{type(e).__name__}: {str(e)[:200]}", **shape}
        errs = {f"d{n}_rel": rel_error(a, r) for n, a, r in zip("qkv", g, ref)}
        return {"impl": name, "residual": residual, **errs, **shape}

    rows = [row(f"dot_product_attention[{i}]", "-", dot_product_attention_fn(Hq // Hkv, i)) for i in ("xla", "cudnn")]
    saved = api.split_output, api.output_f32, api.LO_DTYPE
    try:
        for impl in impls:
            for residual in residuals:
                api.split_output, api.output_f32, api.LO_DTYPE = _residual_variant(residual)
                rows.append(row(impl, residual, lambda q, k, v, impl=impl: api.block_sparse_attention(
                    q, k, v, impl=impl, block_size=block_size)))
                api.split_output, api.output_f32, api.LO_DTYPE = saved
    finally:
        api.split_output, api.output_f32, api.LO_DTYPE = saved
    base = next((r for r in rows if r["impl"] == "dot_product_attention[xla]" and "dq_rel" in r), None)
    for r in rows:
        if base is not None and "dq_rel" in r:
            r["x_xla_dpa"] = [r[f"d{n}_rel"] / base[f"d{n}_rel"] for n in "qkv"]
    return rows


def main(argv=None):
    from benchmarks._driver import append_rows, provenance

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impls", default="mosaic,triton,xla")
    p.add_argument("--residuals", default="int4,int8,f32,bf16")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--json", help="append one JSON row per measurement to this file")
    a = p.parse_args(argv)
    jax.config.update("jax_enable_x64", True)
    prov = provenance(argv)
    rows = measure(a.impls.split(","), a.residuals.split(","), S=a.seq)
    print("| impl | residual | dq | dk | dv | x XLA dpa (dq / dk / dv) |\n|---|---|---:|---:|---:|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['impl']} | {r['residual']} | {r['error'][:60]} | | | |")
            continue
        x = " / ".join(f"{t:.2f}" for t in r.get("x_xla_dpa", []))
        print(f"| {r['impl']} | {r['residual']} | {r['dq_rel']:.3e} | {r['dk_rel']:.3e} | {r['dv_rel']:.3e} | {x} |")
    append_rows(a.json, rows, prov)
    return 0


if __name__ == "__main__":
    sys.exit(main())
