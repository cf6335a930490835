"""The index estimate's Pallas Triton window passes (:mod:`pallas_kernels.window_scores`) timed one by one
and as the whole estimate (``SparsityConfig.estimate_impl="triton"``), for several tilings, beside the XLA
path's estimate in the same process: which tiling to keep, and what each pass costs.

    python -m benchmarks.window_tiles --seq 131072 --heads 14,2 --head-dim 64 --last-q 64 \\
        --tiles 128:2048:4:2,64:2048:4:2,128:2048:8:2,256:4096:8:3 --out rows.jsonl

A tiling is ``KEY_TILE:KEY_CHUNK:NUM_WARPS:NUM_STAGES``. One JSON row per (tiling, fn) and one for the XLA
estimate, printed as measured: ``fn`` (``row_max``, ``exp_digit_sums``, ``column_digit_sums``, ``estimate``),
``impl``, ``tiling``, ``ms`` (median over ``--rounds`` rounds of ``--repeats`` calls; tilings rotated per
round), ``ms_min``, ``ms_max``, ``compile_s``, ``index_diff`` (entries of the estimate's index that differ
from the XLA path's: 0 wherever the platform's ``exp`` agrees), the shape, and the run's ``commit``,
``code``, ``date``, ``device``, ``jax``, ``command``; ``key_tile``: the key tile the kernels used (``KEY_TILE``,
halved where it would need more shared memory than ``window_scores.SMEM_BYTES``). A tiling that fails to
compile gets one row with its ``error`` and the others go on (exit 1 only if every tiling failed).
B = 1, bf16 random q/k, default budgets.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _tiling(text: str) -> tuple[int, int, int, int]:
    try:
        kt, kc, nw, ns = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected KEY_TILE:KEY_CHUNK:NUM_WARPS:NUM_STAGES, got {text!r}") from None
    pow2 = lambda n: n >= 16 and n & (n - 1) == 0  # noqa: E731
    if not (pow2(kt) and pow2(kc) and kt <= kc and nw in (1, 2, 4, 8, 16) and 1 <= ns <= 8):
        raise argparse.ArgumentTypeError(f"tiling {text!r}: tile and chunk powers of two >= 16 with tile <= chunk, "
                                         f"warps in 1..16 (a power of two), stages in 1..8")
    return kt, kc, nw, ns


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=131072)
    ap.add_argument("--heads", default="14,2", help="QUERY,KV heads")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--last-q", type=int, default=64)
    ap.add_argument("--tiles", default="64:1024:4:2", help="comma-separated KEY_TILE:KEY_CHUNK:NUM_WARPS:NUM_STAGES")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", help="also append the rows to this JSONL file")
    a = ap.parse_args(argv)
    try:
        hq, hkv = (int(x) for x in a.heads.split(","))
        assert hq > 0 and hkv > 0 and hq % hkv == 0
    except (ValueError, AssertionError):
        ap.error(f"--heads: expected QUERY,KV with KV dividing QUERY, got {a.heads!r}")
    try:
        tilings = [_tiling(t) for t in a.tiles.split(",") if t.strip()]
    except argparse.ArgumentTypeError as e:
        ap.error(f"--tiles: {e}")
    if not tilings:
        ap.error("--tiles: no tiling given")
    for t in tilings:
        if a.seq % t[1]:
            ap.error(f"--tiles: KEY_CHUNK {t[1]} does not divide --seq {a.seq}")
    if a.rounds < 1 or a.repeats < 1:
        ap.error("--rounds and --repeats must be >= 1")

    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks._driver import provenance
    from benchmarks._timing import timeit
    from mtraining_jax.sparsity import SparsityConfig, estimate_index
    from mtraining_jax.sparsity import estimate as est
    from mtraining_jax.sparsity import exact_logits
    from pallas_kernels import window_scores as ws

    try:
        SparsityConfig(last_q=a.last_q, estimate_impl="triton").check(a.seq, hq)
        ws.supports(a.last_q, a.seq, a.head_dim)
    except (ValueError, NotImplementedError) as e:
        ap.error(str(e))
    prov = provenance(argv)

    def emit(row):
        row.update(S=a.seq, heads=[hq, hkv], head_dim=a.head_dim, last_q=a.last_q, **prov)
        print(json.dumps(row), flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps(row) + "\n")

    S, lq = a.seq, a.last_q
    kq, kk = jax.random.split(jax.random.key(S))
    q = jax.random.normal(kq, (1, S, hq, a.head_dim), jnp.bfloat16)
    k = jax.random.normal(kk, (1, S, hkv, a.head_dim), jnp.bfloat16)
    pos = jnp.arange(S, dtype=jnp.int32)
    cfg = SparsityConfig(last_q=lq, estimate_impl="xla")
    kcfg = dataclasses.replace(cfg, estimate_impl="triton")
    F, G = est.fixed_point_bits(cfg)
    w, _ = exact_logits.digit_plan(a.head_dim)
    scale = est._scale(a.head_dim, cfg)
    qd = exact_logits.operand_digits(q[:, S - lq:].astype(jnp.float32))
    kd = exact_logits.operand_digits(k.astype(jnp.float32))
    ops = ws.WindowOperands(qd.digits, qd.row_scale, kd.digits, kd.row_scale, pos)
    kw = dict(first=S - lq, w=w, block_size=cfg.block_size, interpret=jax.default_backend() != "gpu")

    def programs():
        """The programs, traced with the module's current tiling."""
        return {
            "row_max": (lambda o: ws.row_max(o, **kw), (ops,)),
            "exp_digit_sums": (lambda o, m: ws.exp_digit_sums(o, m, scale=scale, widths=est._E_DIGITS, **kw),
                               (ops, m)),
            "column_digit_sums": (lambda o, m, d: ws.column_digit_sums(o, m, d, scale=scale, widths=(F, G), **kw),
                                  (ops, m, denom)),
            "estimate": (lambda q, k: estimate_index(q, k, pos, kcfg), (q, k)),
        }

    def compile_(f, args):
        """``(executable, seconds)``: compiled ahead of time, so that clearing JAX's caches for the next
        tiling (``estimate_index`` keeps its own jit cache) leaves it as it is."""
        t0 = time.perf_counter()
        exe = jax.jit(f).lower(*args).compile()
        jax.block_until_ready(exe(*args))
        return exe, time.perf_counter() - t0

    xla, xla_compile = compile_(lambda q, k: estimate_index(q, k, pos, cfg), (q, k))
    ref = jax.tree.map(np.asarray, xla(q, k))
    m = ws.row_max(ops, **kw)
    denom = est._denominator(list(ws.exp_digit_sums(ops, m, scale=scale, widths=est._E_DIGITS, **kw)))

    def set_tiling(t):
        ws.KEY_TILE, ws.KEY_CHUNK, ws.NUM_WARPS, ws.NUM_STAGES = t

    progs, compile_s, diffs, key_tile, errors = {}, {}, {}, {}, {}
    default = (ws.KEY_TILE, ws.KEY_CHUNK, ws.NUM_WARPS, ws.NUM_STAGES)
    for t in tilings:
        try:
            set_tiling(t)
            jax.clear_caches()
            progs[t] = {}
            key_tile[t] = ws._key_chunk(S, ws.row_tile(lq, cfg.block_size), qd.digits.shape[-2], a.head_dim)[1]
            for fn, (f, args) in programs().items():
                exe, compile_s[t, fn] = compile_(f, args)
                progs[t][fn] = (exe, args)
                if fn == "estimate":
                    diffs[t] = int(sum((np.asarray(x) != y).sum() for x, y in zip(exe(*args), ref)))
        except jax.errors.JaxRuntimeError as e:  # e.g. more shared memory than the GPU has: report it, go on
            errors[t] = str(e).splitlines()[0][:300]
            progs[t] = {}
        finally:
            set_tiling(default)
            jax.clear_caches()  # nothing traced with this tiling is reused by a later program
        print(f"compiled {':'.join(map(str, t))} (key tile {key_tile[t]}): "
              + ", ".join(f"{fn} {compile_s[t, fn]:.1f} s" for fn in progs[t]) + (f"; FAILED: {errors[t]}" if t in errors
                                                                                  else ""), file=sys.stderr, flush=True)
    samples: dict = {}
    for r in range(a.rounds):
        order = tilings[r % len(tilings):] + tilings[:r % len(tilings)]
        samples.setdefault("xla", []).extend(timeit(xla, q, k, warmup=1, repeat=a.repeats)[1])
        for t in order:
            for fn, (f, args) in progs[t].items():
                samples.setdefault((t, fn), []).extend(timeit(f, *args, warmup=1, repeat=a.repeats)[1])

    def stats(ts):
        return {"ms": float(np.median(ts)) * 1e3, "ms_min": min(ts) * 1e3, "ms_max": max(ts) * 1e3}

    emit({"fn": "estimate", "impl": "xla", "tiling": None, **stats(samples["xla"]), "compile_s": xla_compile,
          "index_diff": 0})
    for t in tilings:
        name = ":".join(map(str, t))
        if t in errors:
            emit({"fn": "estimate", "impl": "triton", "tiling": name, "key_tile": key_tile[t], "error": errors[t]})
        for fn in progs[t]:
            emit({"fn": fn, "impl": "triton", "tiling": name, "key_tile": key_tile[t], **stats(samples[t, fn]),
                  "compile_s": compile_s[t, fn], **({"index_diff": diffs[t]} if fn == "estimate" else {})})
    return 1 if len(errors) == len(tilings) else 0


if __name__ == "__main__":
    sys.exit(main())
