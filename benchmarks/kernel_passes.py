"""``benchmarks/kernels.py --passes``: each kernel pass alone, per backend (Triton, Mosaic GPU), on the same
inputs, with its compile time and TFLOP/s on the pass's own active work; with ``--loads-only`` each Mosaic
pass also with its tile math removed (:mod:`benchmarks.pass_floors`)."""

from __future__ import annotations

import contextlib
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._timing import timeit
from benchmarks.kernel_cases import BS, D, H, HKV, active_pairs, family_index, inputs
from benchmarks.model_index import model_entries, model_seqs
from benchmarks.pass_floors import loads_only as loads_only_kernels
from pallas_kernels import api

PASSES = ("fwd", "dq", "dkv_blocks", "dkv_cols")


def dkv_blocks_variant(spec):
    """:func:`pallas_kernels.mosaic_dkv.mosaic_dkv_blocks` with the stream (and walk) of ``spec``:
    ``None`` (as built), ``"<stream>"`` or ``"<stream>:<walk>"``."""
    from pallas_kernels import mosaic_dkv
    from pallas_kernels.mosaic_stream import parse_stream_walk

    if spec is None:
        return mosaic_dkv.mosaic_dkv_blocks
    stream, walk = parse_stream_walk(spec, mosaic_dkv.DKV_STREAMS)
    return functools.partial(mosaic_dkv.mosaic_dkv_blocks, stream=stream, walk=walk)


def dkv_cols_variant(spec):
    """:func:`pallas_kernels.mosaic_dkv.mosaic_dkv_cols` with the column walk of ``spec``: ``"<col_walk>"``
    or ``"shared:<walk>"``."""
    from pallas_kernels import mosaic_dkv
    from pallas_kernels.mosaic_stream import parse_stream_walk

    col_walk, walk = parse_stream_walk(spec, mosaic_dkv.COL_WALKS)
    return functools.partial(mosaic_dkv.mosaic_dkv_cols, col_walk=col_walk, walk=walk)


def passes(S, sparsities, families, vert_cols, reps, seed=1, walks=("loops",), streams=("shared",), names=PASSES,
           model=None, shape=(H, HKV, D), col_walks=None, slots=(None,), kv_step=None, impls=("triton", "mosaic"),
           loads_only=False, rounds=1, dkv_streams=(None,)):
    """Each kernel pass alone, per backend (Triton, Mosaic GPU), on the same inputs: forward, dQ,
    dK/dV block pass, dK/dV column pass, with its compile time (``compile_s``) and TFLOP/s on the
    pass's own active work. ``walks`` x ``streams``: the Mosaic forward and dQ once per consumer walk
    and stream (:data:`pallas_kernels.mosaic_stream.WALKS`, ``STREAMS``; impl e.g. ``mosaic[switch]``,
    ``mosaic[split]``; the split dQ takes 128-key steps); ``names``: the passes to time (:data:`PASSES`);
    ``model`` (as :func:`run`'s): also a trained model's indices (index ``model_L<layer>[_budget]``)
    (``2 D`` FLOP per pair and matmul: forward 2 matmuls, dQ 3, dK/dV 4; block passes count the
    block pairs, the column pass the column pairs; the Mosaic passes move the listed columns inside
    active blocks from the block pass to the column pass, a small share of either). ``shape``: (query
    heads, KV heads, head_dim), e.g. ``(14, 2, 64)``: the Qwen2.5-0.5B layers of the training step.
    ``col_walks``: the Mosaic column pass once per entry, in order (:data:`pallas_kernels.mosaic_dkv.COL_WALKS`;
    default: the operator's, :data:`~pallas_kernels.mosaic_dkv.DEFAULT_COL_WALK`; impl ``mosaic`` for the
    default walk, ``mosaic[<walk>]`` for another (``shared:loops`` / ``shared:switch``: the shared walk's loops),
    and every column-pass row says its ``col_walk``; repeat
    entries, e.g. ``masked,free,free,masked``, to time an A/B both ways round in one process).
    ``slots`` x the above: the Mosaic forward / dQ's ring depth (``None``: the kernel's default; impl
    ``mosaic[...,s3]``); ``kv_step``: the shared stream's keys per step (default: the kernel's; the split
    stream always 128); ``impls``: ``triton`` and / or ``mosaic`` rows. ``loads_only``: every Mosaic pass
    also compiled inside :func:`benchmarks.pass_floors.loads_only` (rows ``variant: full`` / ``load_only``);
    ``rounds``: every compiled pass timed once per round, the rounds alternating over all of them (a
    row per round). ``dkv_streams``: the Mosaic dK/dV block pass once per entry (``None``: as built, impl
    ``mosaic``; ``"split"``, ``"shared"`` (its default walk), ``"shared:loops"`` / ``"shared:switch"``:
    impl ``mosaic[shared,loops]`` etc.; :func:`pallas_kernels.mosaic_dkv.mosaic_dkv_blocks`)."""
    from pallas_kernels import mosaic_dkv, mosaic_dq, mosaic_fwd
    from pallas_kernels import triton_backward as tb
    from pallas_kernels import triton_kernels as tk

    hq, hkv, d = shape
    col_walks = col_walks or (mosaic_dkv.DEFAULT_COL_WALK,)
    rng = np.random.default_rng(seed)
    q, k, v, do = inputs(S, seed, jnp.bfloat16, shape)
    pos = jnp.arange(S, dtype=jnp.int32)
    kw = dict(sm_scale=d**-0.5, block_size=BS)
    rows = []
    cases = [family_index(rng, fam, S, sp, vert_cols, hq)
             for fam in families for sp in (sparsities if fam != "full" else [0.0])]
    cases += [(idx, f"model_L{layer}" + "".join(f"_{k}{v}" for k, v in bud.items()))
              for layer, bud, idx, _ in (model_entries(S, hq, BS, model) if model_seqs(model, [S]) else [])]
    for idx, name in cases:
        idx = jax.tree.map(jnp.asarray, idx)
        bp, cp = active_pairs(idx, S)
        out, lse = api.block_sparse_attention_fwd(q, k, v, pos, pos, idx, impl="auto")
        delta = api.attention_delta(out, do)
        args = (q, k, v, pos, pos, idx, do, lse, delta)
        zeros = jnp.zeros(k.shape, jnp.float32)
        variants = [(w, st, n) for w in walks for st in streams for n in slots]

        def variant(f, w, st, n, dq=False):
            opts = dict(walk=w, stream=st, **({"kv_step": 128} if dq and st == "split" else {}))
            if n is not None:
                opts["slots"] = n
            if kv_step is not None and st != "split":
                opts["kv_step"] = kv_step
            return functools.partial(f, **opts)

        def mname(w, st, n):
            tags = [x for x in (w, st) if x not in ("loops", "shared")] + ([f"s{n}"] if n is not None else [])
            tags += [f"kv{kv_step}"] if kv_step is not None and st != "split" else []
            return "mosaic" + (f"[{','.join(tags)}]" if tags else "")

        fns = [("fwd", "triton", tk.pallas_fwd, args[:6], 2 * (bp + cp)),
               *[("fwd", mname(w, st, n), variant(mosaic_fwd.mosaic_fwd, w, st, n), args[:6], 2 * (bp + cp))
                 for w, st, n in variants],
               ("dq", "triton", tb.dq_pass, args, 3 * (bp + cp)),
               *[("dq", mname(w, st, n), variant(mosaic_dq.mosaic_dq, w, st, n, dq=True), args, 3 * (bp + cp))
                 for w, st, n in variants],
               ("dkv_blocks", "triton", tb.dkv_block_pass, args, 4 * bp),
               *[("dkv_blocks", "mosaic" if ds is None else f"mosaic[{ds.replace(':', ',')}]",
                  dkv_blocks_variant(ds), args, 4 * bp) for ds in dkv_streams],
               ("dkv_cols", "triton", tb.dkv_col_pass, args + (zeros, zeros), 4 * cp),
               *[("dkv_cols", "mosaic" if cw == mosaic_dkv.DEFAULT_COL_WALK else f"mosaic[{cw.replace(':', ',')}]",
                  dkv_cols_variant(cw), args + (zeros, zeros), 4 * cp, {"col_walk": cw})
                 for cw in col_walks]]
        fns = [f for f in fns if f[0] in names and not (f[0] == "dkv_cols" and cp == 0)
               and f[1].split("[")[0] in impls]
        modes = [("full", contextlib.nullcontext)] + ([("load_only", loads_only_kernels)] if loads_only else [])
        built = []
        for mode, ctx in modes:
            with ctx():
                for pname, impl, fn, a, matmul_pairs, *extra in fns:
                    fields = dict(extra[0]) if extra else {}  # the row's own fields (a column pass's col_walk)
                    if loads_only:
                        if impl == "triton" and mode != "full":
                            continue
                        fields["variant"] = mode
                    t0 = time.perf_counter()
                    compiled = jax.jit(functools.partial(fn, **kw)).lower(*a).compile()
                    built.append((pname, impl, compiled, a, matmul_pairs, fields, time.perf_counter() - t0))
        for rnd in range(rounds):
            for pname, impl, compiled, a, matmul_pairs, fields, compile_s in built:
                ms, ts = timeit(compiled, *a, warmup=2, repeat=reps)
                row = dict(seq=S, index=name, sparsity=1 - (bp + cp) / (hq * S * (S + 1) / 2), pass_=pname,
                           impl=impl, heads=hq, kv_heads=hkv, head_dim=d,
                           ms=ms * 1e3, spread_ms=[round(min(ts) * 1e3, 3), round(max(ts) * 1e3, 3)],
                           tflops=2 * d * matmul_pairs / ms / 1e12, compile_s=round(compile_s, 2), **fields,
                           **({"round": rnd} if rounds > 1 else {}))
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows
