"""Benchmark: block-sparse (vertical-slash) Pallas kernels vs cuDNN and JAX's Pallas Triton ``mha``.

B=1, 16 query heads, 2 KV heads, head_dim 128, bf16, causal. For each sequence length: cuDNN
dense causal (``jax.nn.dot_product_attention(implementation="cudnn")``), JAX's Pallas Triton flash
attention (``jax.experimental.pallas.ops.gpu.attention.mha``, K/V repeated to 16 heads outside the
timed region), our kernels (each ``--impls`` entry: ``triton``; ``auto`` = the registry's choice,
on Hopper the Mosaic GPU kernels: forward and dQ pass, Triton dK/dV passes) with the full causal index (dense work) and
with synthetic vertical-slash indices of the ``--families``
(``pallas_kernels.testing.index_family``: ``band`` local window, ``slash`` near band + far diagonals
(names ``vs95``), ``spread`` diagonals spread over distances, ``vert`` up to ``--vert-cols`` verticals,
``mixed`` 1024 verticals + spread diagonals; names ``<family><sparsity %>``), at each ``--sparsities``
value. Every row carries ``family``, ``density`` (of the causal pairs), ``x_cudnn`` (cuDNN's time / the
row's, fwd+bwd where timed) and ``commit``, ``date``, ``device``, ``jax``, ``command``.

The index-family table of issue 34 (128K, 2 / 5 / 10 % density, all families, cuDNN and Triton in the
same run): ``python -m benchmarks.kernels --seqs 131072 --sparsities 0.98,0.95,0.9 --families
band,slash,spread,vert,mixed --mha-max 0 --dense-max 0 --json out.json``. Family (e), the indices a trained
model estimates on its own q/k (``benchmarks.model_index``; rows ``<impl>_model_L<layer>``, ``family``
``model``, ``model_density`` per model head): add ``--model-ckpt RUN/checkpoints --model-tokens
train_tokens.npy [--model-layers 1,6,11] [--model-budgets ';last_q=1024,vertical_min=1024']``
(budgets: what a recall target costs the kernels), or ``--model-index FILE`` (saved by ``python -m
benchmarks.model_index``: no checkpoint needed).

TFLOP/s are on the *active* work: dense causal counts ``S(S+1)/2`` pairs per head; sparse counts
the (query, key) pairs the index makes the kernel compute (``bs*bs`` per active block,
``bs`` per column). Forward = ``4 * pairs * D`` FLOP; forward+backward = 3.5x forward. Forward+backward is
timed as training runs it: the backward given a bf16 ``dO`` (``--cotangent do``); ``--cotangent loss`` times
runs <= 39's ``grad`` of ``sum(out * ct)`` with a float32 ``ct`` (also a convert of ``ct`` in every row).

Usage (GPU): ``python -m benchmarks.kernels --seqs 32768,131072 --json out.json``; plots of the
committed rows (``results/kernels/kernels.jsonl``, ``run`` = the campaign, ``table`` = what was timed):
``python -m benchmarks.kernels --plot-from results/kernels/kernels.jsonl --runs v10_fb --plot kernels.png``.
The dK/dV block pass's stream per Mosaic row: ``--dkv-streams`` (:func:`dkv_stream`); issue 34's targets
checked against a run's rows: ``python -m benchmarks.kernel_targets ROWS [--runs R] [--tag dkv=shared]``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._driver import check_code_source, provenance
from benchmarks._timing import timeit
from benchmarks.kernel_cases import (BS, COTANGENTS, D, H, HKV, active_pairs, cotangent_dtype, family_index,
                                     fwd_bwd, inputs)
from benchmarks.kernel_passes import PASSES, passes
from benchmarks.kernels_report import load_rows, passes_table, plot, plot_families, plot_passes, table
from benchmarks.model_index import add_model_args, model_entries, model_options, model_seqs, saved_seq_len
from benchmarks.pass_floors import floors_table, plot_floors
from pallas_kernels import api
from pallas_kernels import registry as api_registry
from pallas_kernels.index_format import full_step_index
from pallas_kernels.testing import INDEX_FAMILIES, vertical_slash_index


def _time(fn, *args, reps=5, warmup=2):
    return float(timeit(fn, *args, warmup=warmup, repeat=reps)[0])


@contextlib.contextmanager
def dkv_stream(stream):
    """Within (``stream`` not ``None``): the operator's Mosaic dK/dV block pass takes ``stream`` where it
    is left to ``"auto"`` (``pallas_kernels.mosaic_stream.AUTO_STREAM`` / ``UNIFORM_STREAM``'s
    ``"dkv"``), for programs traced inside; ``None``: as built. JAX's caches are cleared on entry and
    exit: the jitted pass's trace is keyed on ``stream="auto"``, not on what it resolved to, so a trace
    from outside would be reused inside (and the other way round; run 34's first operator rows)."""
    from pallas_kernels import mosaic_stream
    from pallas_kernels.mosaic_dkv import DKV_STREAMS

    if stream is None:
        yield
        return
    if stream not in DKV_STREAMS:
        raise ValueError(f"the dK/dV block pass's stream must be one of {DKV_STREAMS}, got {stream!r}")
    saved = mosaic_stream.AUTO_STREAM["dkv"], mosaic_stream.UNIFORM_STREAM["dkv"]
    jax.clear_caches()
    try:
        mosaic_stream.AUTO_STREAM["dkv"] = mosaic_stream.UNIFORM_STREAM["dkv"] = stream
        yield
    finally:
        mosaic_stream.AUTO_STREAM["dkv"], mosaic_stream.UNIFORM_STREAM["dkv"] = saved
        jax.clear_caches()


def _dkv_variants(dkv_streams, impl: str):
    """``[(name suffix, stream)]``: the dK/dV block pass streams an operator row of ``impl`` is timed
    with (only a Mosaic-capable ``impl``: ``auto``, ``mosaic``; ``None``: as built, no suffix)."""
    if impl not in ("auto", "mosaic"):
        return [("", None)]
    return [("" if st is None else f"[dkv={st}]", st) for st in dkv_streams]


def run(seqs, sparsities, with_mha_max, dense_ours_max, reps, seed=0, impls=("triton", "auto"),
        families=("slash", "vert"), vert_cols=4096, model=None, dkv_streams=(None,), cotangent="do"):
    """The comparison table; ``model``: :func:`benchmarks.model_index.model_options` (a checkpoint's or a
    saved file's indices): also the indices a trained model estimates (family ``model``; a saved file's
    only at its own length, :func:`benchmarks.model_index.model_seqs`). ``dkv_streams``: each Mosaic
    operator row once per dK/dV block pass stream (:func:`dkv_stream`; name ``<impl>[dkv=<stream>]``;
    ``None``: as built). ``cotangent``: how fwd+bwd is timed (:func:`benchmarks.kernel_cases.fwd_bwd`)."""
    rows = []
    rng = np.random.default_rng(seed)
    gpu = jax.default_backend() == "gpu"
    with_model = model_seqs(model, seqs)
    for S in seqs:
        q, k, v, ct = inputs(S, S, cotangent_dtype(cotangent))
        pos = jnp.arange(S, dtype=jnp.int32)
        dense_pairs = H * S * (S + 1) / 2
        scale = D**-0.5

        def add(name, pairs, f, *data, fwd_only=False, family="dense", dkv=None):
            # data (positions, index): arguments of the timed call, as in training; as closed-over constants
            # XLA folded part of the index's operand build into the program (runs up to 33)
            with dkv_stream(dkv):
                fwd, fwd_s = timeit(jax.jit(f), q, k, v, *data, warmup=2, repeat=reps)
                fb, fb_s = (None, None) if fwd_only else timeit(fwd_bwd(f, cotangent), q, k, v, ct, *data, warmup=2,
                                                                 repeat=reps)
            fl = 4 * pairs * D
            spread = lambda ts: None if ts is None else [round(min(ts) * 1e3, 3), round(max(ts) * 1e3, 3)]  # noqa: E731
            row = dict(seq=S, name=name, family=family, cotangent=cotangent, density=pairs / dense_pairs,
                       sparsity=1 - pairs / dense_pairs, fwd_ms=fwd * 1e3,
                       fwd_spread_ms=spread(fwd_s), fb_spread_ms=spread(fb_s),
                       fwd_tflops=fl / fwd / 1e12, fb_ms=None if fb is None else fb * 1e3,
                       fb_tflops=None if fb is None else 3.5 * fl / fb / 1e12)
            rows.append(row)
            print(json.dumps(row), flush=True)

        cud = functools.partial(jax.nn.dot_product_attention, is_causal=True,
                                implementation="cudnn" if gpu else None)  # off GPU (a smoke run): XLA's
        add("cudnn", dense_pairs, lambda q, k, v: cud(q, k, v))
        if S <= with_mha_max:
            from jax.experimental.pallas.ops.gpu.attention import mha
            g = H // HKV

            def mha_f(q, k, v):
                return mha(q, jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2), None, sm_scale=scale,
                           causal=True)
            add("pallas_mha", dense_pairs, mha_f)
        if S <= dense_ours_max:  # the full causal index as the API builds it for index=None (uniform rows)
            for impl in impls:
                for tag, st in _dkv_variants(dkv_streams, impl):
                    add(f"{impl}{tag}_full", dense_pairs, lambda q, k, v, pos, impl=impl: api.block_sparse_attention(
                        q, k, v, pos, pos, None, impl=impl), pos, dkv=st)
        for fam in families:
            for sp in sparsities:
                idx, name = family_index(rng, fam, S, sp, vert_cols)
                idx = jax.tree.map(jnp.asarray, idx)
                pairs = sum(active_pairs(idx, S))
                for impl in impls:
                    for tag, st in _dkv_variants(dkv_streams, impl):
                        add(f"{impl}{tag}_{name}", pairs, lambda q, k, v, pos, idx, impl=impl:
                            api.block_sparse_attention(q, k, v, pos, pos, idx, impl=impl), pos, idx, family=fam,
                            dkv=st)
        if model and S not in with_model:
            print(f"S={S}: no model family (the index file holds another length)", flush=True)
        for layer, bud, idx, den in (model_entries(S, H, BS, model) if S in with_model else []):
            pairs, tag = sum(active_pairs(idx, S)), "".join(f"_{k}{v}" for k, v in bud.items())
            for impl in impls:
                for dtag, st in _dkv_variants(dkv_streams, impl):
                    add(f"{impl}{dtag}_model_L{layer}{tag}", pairs, lambda q, k, v, pos, idx, impl=impl:
                        api.block_sparse_attention(q, k, v, pos, pos, idx, impl=impl), pos,
                        jax.tree.map(jnp.asarray, idx), family="model", dkv=st)
                    rows[-1].update(model_budget=bud, model_density=[round(float(x), 4) for x in den])  # per model head
        base = next(r for r in rows if r["seq"] == S and r["name"] == "cudnn")
        for r in rows:
            if r["seq"] == S:
                key = "fb_ms" if r.get("fb_ms") and base.get("fb_ms") else "fwd_ms"
                r["x_cudnn"] = base[key] / r[key]
    prov = provenance()
    for r in rows:
        r.update(prov)
    return rows


def ring_step(S, hq, hkv, d, reps, impls=("auto",), seed=0, cotangent="do"):
    """One step of the DENSE ring on one GPU, our per-step kernel against cuDNN (issue 33 item 3): a
    ``[1, S, hq, d]`` query chunk against a ``[1, S, hkv, d]`` K/V chunk, fwd and fwd+bwd, for the two
    kinds of step a ring has — ``visible`` (the chunk precedes the queries: no mask; ours with
    ``q_pos = S + i``, ``k_pos = j``, cuDNN with no mask) and ``diagonal`` (the own chunk: causal). Our
    kernel is what the ring runs (``index=None``: dense by position); cuDNN needs GQA heads repeated and
    returns no log-sum-exp, so it cannot be a ring step itself: it is the bound a user would compare with.
    Rows: ``table: ring_step``, ``step``, ``impl``, ``fwd_ms``, ``fb_ms``, TFLOP/s, ``x_cudnn`` (cuDNN
    time / this one: > 1 faster than cuDNN)."""
    kq, kk, kv, kc = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(kq, (1, S, hq, d), jnp.bfloat16)
    k = jax.random.normal(kk, (1, S, hkv, d), jnp.bfloat16)
    v = jax.random.normal(kv, (1, S, hkv, d), jnp.bfloat16)
    ct = jax.random.normal(kc, (1, S, hq, d), cotangent_dtype(cotangent))
    g = hq // hkv
    gpu = jax.default_backend() == "gpu"
    cudnn_impl = "cudnn" if gpu else None  # a CPU smoke run times XLA's attention in its place
    rows = []
    for step, causal in (("visible", False), ("diagonal", True)):
        pairs = hq * (S * (S + 1) / 2 if causal else S * S)
        q_pos = jnp.arange(S, dtype=jnp.int32) + (0 if causal else S)
        k_pos = jnp.arange(S, dtype=jnp.int32)
        fns = {"cudnn": lambda q, k, v, causal=causal: jax.nn.dot_product_attention(
            q, jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2), is_causal=causal, implementation=cudnn_impl)}
        for impl in impls:
            fns[impl] = lambda q, k, v, q_pos, k_pos, impl=impl: api.block_sparse_attention(
                q, k, v, q_pos, k_pos, None, impl=impl)
        for name, f in fns.items():
            data = () if name == "cudnn" else (q_pos, k_pos)  # positions: arguments, as in a ring (not folded)
            fwd = _time(jax.jit(f), q, k, v, *data, reps=reps)
            fb = _time(fwd_bwd(f, cotangent), q, k, v, ct, *data, reps=reps)
            fl = 4 * pairs * d
            rows.append(dict(table="ring_step", seq=S, heads=hq, kv_heads=hkv, head_dim=d, step=step, name=name,
                             cotangent=cotangent,
                             impl=(("cudnn" if gpu else "xla (no cuDNN off GPU)") if name == "cudnn"
                                   else api_registry.resolve(name, "fwd", q, BS, S)),
                             fwd_ms=fwd * 1e3, fb_ms=fb * 1e3, fwd_tflops=fl / fwd / 1e12, fb_tflops=3.5 * fl / fb / 1e12))
            print(json.dumps(rows[-1]), flush=True)
        base = next(r for r in rows if r["step"] == step and r["name"] == "cudnn")
        for r in rows:
            if r["step"] == step:
                r["x_cudnn"], r["x_cudnn_fb"] = base["fwd_ms"] / r["fwd_ms"], base["fb_ms"] / r["fb_ms"]
    prov = provenance()
    for r in rows:
        r.update(prov)
    return rows


FWD_CONFIGS = [dict(num_warps=4, num_stages=2), dict(num_warps=4, num_stages=3), dict(num_warps=8, num_stages=2)]
BWD_CONFIGS = [dict(num_warps=4, num_stages=2), dict(num_warps=4, num_stages=3)]


def sweep(S, sparsities, reps, seed=1):
    """Time each piece on its own: the index preparation (XLA), the forward kernel and the three
    backward passes over the tuning options (``num_warps``, ``num_stages``)."""
    from pallas_kernels import triton_backward as tb
    from pallas_kernels import triton_kernels as tk

    rng = np.random.default_rng(seed)
    q, k, v, do = inputs(S, seed, jnp.bfloat16)
    pos = jnp.arange(S, dtype=jnp.int32)
    scale = D**-0.5
    idxs = {} if S > 32768 else {"full": full_step_index(1, H, S, S, pos, pos, BS)}
    for sp in sparsities:
        idxs[f"vs{int(round(sp * 100))}"] = jax.tree.map(jnp.asarray, vertical_slash_index(rng, 1, H, S, sp))
    rows = []
    it = jax.default_backend() != "gpu"  # interpret mode off GPU (a CPU smoke run of the script)

    def rec(name, kernel, ms, **cfg):
        rows.append(dict(seq=S, index=name, kernel=kernel, ms=ms, **cfg))
        print(json.dumps(rows[-1]), flush=True)

    for name, idx in idxs.items():
        for tname, tf in [("prepare_index", functools.partial(tk.prepare_index, sk=S, bs=BS, col_chunk=64)),
                          ("transpose_blocks", functools.partial(tb.transpose_block_index, sk=S, bs=BS))]:
            rec(name, tname, _time(jax.jit(tf), idx, reps=reps) * 1e3)
        out, lse = tk.pallas_fwd(q, k, v, pos, pos, idx, sm_scale=scale, block_size=BS, interpret=it)
        delta = api.attention_delta(out, do)
        args = (q, k, v, pos, pos, idx, do, lse, delta)
        for cfg in FWD_CONFIGS:
            opts = dict(cfg, interpret=it)
            f = functools.partial(tk.pallas_fwd, sm_scale=scale, block_size=BS, **opts)
            rec(name, "fwd", _time(f, q, k, v, pos, pos, idx, reps=reps) * 1e3, **opts)
        for cfg in BWD_CONFIGS:
            opts = dict(cfg, interpret=it)
            for kname, kf in [("bwd_dq", tb.dq_pass), ("bwd_dkv_blocks", tb.dkv_block_pass)]:
                f = functools.partial(kf, sm_scale=scale, block_size=BS, **opts)
                rec(name, kname, _time(f, *args, reps=reps) * 1e3, **opts)
            if name != "full":
                dk, dv = tb.dkv_block_pass(*args, sm_scale=scale, block_size=BS, **opts)
                f = functools.partial(tb.dkv_col_pass, sm_scale=scale, block_size=BS, **opts)
                rec(name, "bwd_dkv_cols", _time(f, *args, dk, dv, reps=reps) * 1e3, **opts)
            f = functools.partial(tb.pallas_bwd, sm_scale=scale, block_size=BS, **opts)
            rec(name, "bwd_total", _time(f, *args, reps=reps) * 1e3, **opts)
    return rows


def col_split_sweep(S, max_cols, reps, splits=(1, 2, 4, 8), seed=3):
    """The column dK/dV pass alone over its row ranges per column chunk (``col_splits``) on a 95 %
    vertical-slash index with ``max_cols`` columns per head (``S = 131072, max_cols = 1024`` is one
    ring step of 512K tokens on 4 GPUs; ``524288, 4096`` the same on one)."""
    from pallas_kernels import triton_backward as tb
    from pallas_kernels import triton_kernels as tk

    rng = np.random.default_rng(seed)
    q, k, v, do = inputs(S, seed, jnp.bfloat16)
    pos = jnp.arange(S, dtype=jnp.int32)
    it = jax.default_backend() != "gpu"  # interpret mode off GPU (a CPU smoke run of the script)
    idx = jax.tree.map(jnp.asarray, vertical_slash_index(rng, 1, H, S, 0.95, max_cols=max_cols))
    out, lse = tk.pallas_fwd(q, k, v, pos, pos, idx, sm_scale=D**-0.5, block_size=BS, interpret=it)
    args = (q, k, v, pos, pos, idx, do, lse, api.attention_delta(out, do))
    dk, dv = tb.dkv_block_pass(*args, sm_scale=D**-0.5, block_size=BS, interpret=it)
    rows = []
    for sp in (None,) + tuple(splits):
        f = functools.partial(tb.dkv_col_pass, sm_scale=D**-0.5, block_size=BS, col_splits=sp, interpret=it)
        rows.append(dict(seq=S, max_cols=max_cols, kernel="bwd_dkv_cols", col_splits=sp or "auto",
                         ms=_time(f, *args, dk, dv, reps=reps) * 1e3))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def mha_sweep(S, reps, seed=2, cotangent="do"):
    """JAX's Pallas Triton ``mha`` over its block sizes / warps: the best dense Triton flash
    attention on this device, forward and forward+backward (the Triton backend's bar)."""
    from jax.experimental.pallas.ops.gpu.attention import BlockSizes, mha

    q, k, v, ct = inputs(S, seed, cotangent_dtype(cotangent))
    g = H // HKV
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    fl = 4 * H * S * (S + 1) / 2 * D
    rows = []
    for bq, bk, bwd_b, nw, ns in [(128, 128, 32, None, 2), (128, 64, 32, 8, 2), (128, 128, 64, 8, 3),
                                  (128, 64, 64, 4, 3), (64, 64, 64, 4, 2)]:
        bsz = BlockSizes(block_q=bq, block_k=bk, block_q_dkv=bwd_b, block_kv_dkv=bwd_b, block_q_dq=bwd_b,
                         block_kv_dq=bwd_b)
        f = functools.partial(mha, segment_ids=None, sm_scale=D**-0.5, causal=True, block_sizes=bsz,
                              num_warps=nw, num_stages=ns)
        row = dict(seq=S, block_q=bq, block_k=bk, bwd_block=bwd_b, num_warps=nw, num_stages=ns, cotangent=cotangent)
        try:
            t = _time(jax.jit(f), q, k, v, reps=reps)
            tb = _time(fwd_bwd(lambda q, k, v: f(q, k, v), cotangent), q, k, v, ct, reps=reps)
            row.update(fwd_ms=t * 1e3, fwd_tflops=fl / t / 1e12, fb_ms=tb * 1e3, fb_tflops=3.5 * fl / tb / 1e12)
        except Exception as e:  # a config the Triton compiler rejects (shared memory) is recorded
            row.update(error=f"{type(e).__name__}: {str(e)[:200]}")
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _parse_shape(text: str, ap) -> tuple[int, int, int]:
    """``--shape HQ,HKV,D``: three positive integers, ``HKV`` dividing ``HQ``, ``D`` 64 or 128 (the
    kernels' head dims)."""
    try:
        hq, hkv, d = (int(x) for x in text.split(","))
    except ValueError:
        ap.error(f"--shape must be HQ,HKV,D (three integers), got {text!r}")
    if min(hq, hkv, d) < 1 or hq % hkv or d not in (64, 128):
        ap.error(f"--shape {text!r}: need HKV dividing HQ and D in (64, 128)")
    return hq, hkv, d


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="32768,131072")
    ap.add_argument("--sparsities", default="0.9,0.95,0.98")
    ap.add_argument("--mha-max", type=int, default=32768, help="longest sequence for pallas mha")
    ap.add_argument("--dense-max", type=int, default=32768, help="longest sequence for ours_full")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--impls", default="triton,auto", help="kernel impls to time (pallas_kernels.registry)")
    ap.add_argument("--families", default="slash,vert",
                    help="index families: " + ", ".join(INDEX_FAMILIES) + " (pallas_kernels.testing.index_family)")
    ap.add_argument("--vert-cols", type=int, default=4096, help="verticals per head in the vert family")
    ap.add_argument("--json", default=None)
    ap.add_argument("--cotangent", default="do", choices=COTANGENTS, help="how fwd+bwd is timed: do = the "
                    "backward given a bf16 dO (as in training); loss = grad of sum(out * float32 ct), also converting "
                    "ct to bf16 (results/kernels runs <= 39)")
    ap.add_argument("--sweep", default="", help="comma-separated sequence lengths for a kernel-config sweep")
    ap.add_argument("--mha-sweep", type=int, default=0, help="sequence length for a Triton mha config sweep")
    ap.add_argument("--only-sweeps", action="store_true", help="skip the main comparison table")
    ap.add_argument("--plot-from", default="", help="comma-separated results to plot (no timing run): --json "
                    "output (.json) or rows with a run field (.jsonl, e.g. results/kernels/kernels.jsonl)")
    ap.add_argument("--runs", default="", help="with --plot-from: comma-separated run tags, only these rows")
    ap.add_argument("--plot", default=None, help="PNG path for the bar chart")
    ap.add_argument("--col-split-sweep", default="", help="S:max_cols pairs, e.g. 131072:1024,524288:4096")
    ap.add_argument("--ring-step", default="", metavar="S,HQ,HKV,D",
                    help="time one dense ring step (a visible and a causal chunk pair) of our kernel against cuDNN, "
                         "e.g. 131072,14,2,64 (the 0.5B model's chunk on 4 GPUs at 512K); rows go to --json")
    ap.add_argument("--passes", default="", help="comma-separated sequence lengths: time each kernel pass "
                    "alone per backend (families from --families, plus 'full'; a --model-index file's indices too)")
    ap.add_argument("--walks", default="loops", help="with --passes: the Mosaic forward / dQ consumer walks to "
                    "time, comma-separated (pallas_kernels.mosaic_stream.WALKS: loops,switch)")
    ap.add_argument("--streams", default="shared", help="with --passes: the Mosaic forward / dQ streams to time, "
                    "comma-separated (pallas_kernels.mosaic_stream.STREAMS: shared,split)")
    ap.add_argument("--dkv-streams", default="", help="the Mosaic dK/dV block pass's streams to time, "
                    "comma-separated: with --passes split, shared, shared:loops, shared:switch (stream[:walk]); "
                    "in the comparison table each Mosaic operator row once per stream (split, shared, index); "
                    "'default' for the pass as built (default: as built only)")
    ap.add_argument("--col-walks", default="", help="with --passes: the Mosaic column dK/dV pass's walks "
                    "to time, comma-separated, in order, repeats allowed (pallas_kernels.mosaic_dkv.COL_WALKS: "
                    "masked,free,shared, shared:loops, shared:switch; e.g. masked,free,free,masked; default: the operator's, "
                    "DEFAULT_COL_WALK)")
    ap.add_argument("--pass-names", default=",".join(PASSES), help="with --passes: the passes to time, "
                    "comma-separated (" + ",".join(PASSES) + ")")
    ap.add_argument("--pass-impls", default="triton,mosaic", help="with --passes: triton and / or mosaic rows")
    ap.add_argument("--slots", default="", help="with --passes: the Mosaic forward / dQ ring depths to time, "
                    "comma-separated (default: the kernels'); e.g. 2,3,4,5")
    ap.add_argument("--kv-step", type=int, default=None, choices=(64, 128),
                    help="with --passes: keys per step of the Mosaic shared stream (default: the kernels')")
    ap.add_argument("--loads-only", action="store_true", help="with --passes: every Mosaic pass also with its "
                    "tile math removed (benchmarks/pass_floors.py: the floor its loads set)")
    ap.add_argument("--rounds", type=int, default=1, help="with --passes: time every compiled pass this many "
                    "times, alternating (one row per round)")
    ap.add_argument("--shape", default=f"{H},{HKV},{D}", metavar="HQ,HKV,D",
                    help="with --passes: query heads, KV heads, head_dim (14,2,64: the training step's layers)")
    add_model_args(ap)
    a = ap.parse_args()
    try:
        check_code_source()  # the code PYTHONPATH names, not another checkout's (before any timing)
    except RuntimeError as e:
        raise SystemExit(f"error: {e}") from None
    model = model_options(a, ap)
    shape = _parse_shape(a.shape, ap)
    bad = sorted(set(a.pass_names.split(",")) - set(PASSES))
    if bad:
        ap.error(f"--pass-names: unknown pass(es) {bad}; expected some of {list(PASSES)}")
    from pallas_kernels.mosaic_dkv import COL_WALKS, DKV_STREAMS
    from pallas_kernels.mosaic_stream import parse_stream_walk

    col_walks = tuple(a.col_walks.split(",")) if a.col_walks else None
    dkv_streams = tuple(None if x == "default" else x for x in a.dkv_streams.split(",") if x) or (None,)
    for flag, specs, streams, walked in (  # the comparison table's rows take a dK/dV stream, not its walk
            ("--col-walks", col_walks or (), COL_WALKS, ("shared",)),
            ("--dkv-streams", [x for x in dkv_streams if x is not None], DKV_STREAMS, ("shared",) if a.passes else ())):
        for x in specs:
            try:
                parse_stream_walk(x, streams, walked)
            except ValueError as e:
                ap.error(f"{flag}: {e}")
    seqs = [int(s) for s in a.seqs.split(",")]
    pass_seqs = [int(x) for x in a.passes.split(",") if x]
    if model and not a.plot_from:
        timed = ([] if a.only_sweeps else seqs) + pass_seqs  # a saved file's length must be timed
        try:
            ok = model_seqs(model, timed)
        except ValueError as e:  # not a model index file
            ap.error(f"--model-index: {e}")
        if not ok:
            ap.error(f"--model-index {model['index']!r} holds indices of S={saved_seq_len(model['index'])}; "
                     f"none of the timed lengths {timed} is it")
    try:
        slots = tuple(int(x) for x in a.slots.split(",") if x) or (None,)
    except ValueError:
        ap.error(f"--slots: comma-separated integers, got {a.slots!r}")
    if any(n < 2 for n in slots if n is not None):
        ap.error(f"--slots: each >= 2, got {a.slots!r}")
    pass_impls = tuple(x for x in a.pass_impls.split(",") if x)
    if not pass_impls or set(pass_impls) - {"triton", "mosaic"}:
        ap.error(f"--pass-impls: some of triton,mosaic, got {a.pass_impls!r}")
    if a.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {a.rounds}")
    if a.plot_from:
        rows = load_rows(a.plot_from.split(","), [x for x in a.runs.split(",") if x])
        if any(r.get("variant") == "load_only" for r in rows):
            plot_floors([r for r in rows if "pass_" in r], a.plot or "kernel_floors.png")
            return
        if not any("fwd_tflops" in r for r in rows):  # --passes rows
            plot_passes([r for r in rows if "pass_" in r], a.plot or "kernel_passes.png")
            return
        if any(r.get("table") == "families" for r in rows):
            plot_families([r for r in rows if r.get("table") == "families"], a.plot or "kernel_families.png")
            return
        plot([r for r in rows if "fwd_tflops" in r], a.plot or "kernels.png")
        return
    sweeps = []
    for S in [int(x) for x in a.sweep.split(",") if x and x != "0"]:
        sweeps += sweep(S, [0.95], a.reps)
    if a.mha_sweep:
        sweeps += mha_sweep(a.mha_sweep, a.reps, cotangent=a.cotangent)
    for pair in [x for x in a.col_split_sweep.split(",") if x]:
        S, mc = (int(y) for y in pair.split(":"))
        sweeps += col_split_sweep(S, mc, a.reps)
    pass_rows = []
    for S in pass_seqs:
        pass_rows += passes(S, [float(x) for x in a.sparsities.split(",") if x],
                            tuple(f for f in a.families.split(",") if f), a.vert_cols, a.reps,
                            walks=tuple(a.walks.split(",")), streams=tuple(a.streams.split(",")),
                            names=tuple(a.pass_names.split(",")), model=model, shape=shape, col_walks=col_walks,
                            slots=slots, kv_step=a.kv_step, impls=pass_impls, loads_only=a.loads_only,
                            rounds=a.rounds, dkv_streams=dkv_streams)
    if pass_rows:
        print(passes_table(pass_rows))
        if a.loads_only:
            print(floors_table(pass_rows))
        sweeps += pass_rows
    if a.ring_step:
        S, hq, hkv, d = (int(x) for x in a.ring_step.split(","))
        rs = ring_step(S, hq, hkv, d, a.reps, tuple(i for i in a.impls.split(",") if i != "triton") or ("auto",),
                       cotangent=a.cotangent)
        for r in rs:
            print(f"ring step {r['step']:>8} {r['name']:>7} ({r['impl']}): fwd {r['fwd_ms']:8.2f} ms, fwd+bwd "
                  f"{r['fb_ms']:8.2f} ms, {r['fb_tflops']:5.0f} TFLOP/s, x cuDNN {r['x_cudnn_fb']:.2f}")
        sweeps += rs
    if sweeps and a.json:
        prov = provenance()  # commit, code, date, device, jax, command on every row
        with open(a.json.replace(".json", "_sweep.json"), "w") as f:
            json.dump([{**r, **prov} for r in sweeps], f, indent=1)
    if a.only_sweeps:
        return
    sps = [float(s) for s in a.sparsities.split(",") if s]
    rows = run(seqs, sps, a.mha_max, a.dense_max, a.reps, impls=tuple(a.impls.split(",")),
               families=tuple(a.families.split(",")), vert_cols=a.vert_cols, model=model,
               dkv_streams=tuple(x.partition(":")[0] if x else x for x in dkv_streams), cotangent=a.cotangent)
    meta = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                resolved={i: [api_registry.resolve(i, d, jnp.zeros((1, 128, H, D), jnp.bfloat16), BS, 128)
                              for d in ("fwd", "bwd")] for i in a.impls.split(",")},
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(meta)
    print(table(rows))
    if a.plot:
        plot(rows, a.plot)


if __name__ == "__main__":
    main()
