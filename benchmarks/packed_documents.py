"""Packed documents vs one stream: work fraction and time of the sparse attention at 128K on one GPU.

The same random bf16 q/k/v are run through
:func:`mtraining_jax.attention.mtraining.mtraining_attention` on a 1x1 mesh, per kernel impl
(``--impls``, e.g. ``mosaic triton``): as one stream (no ``segment_ids``) and packed as documents
from a realistic length mix (many short documents plus a few long ones, lengths drawn from a
seeded log-uniform mix; q/k by default synthetic per document, ``--qk``), with the index estimated from the sequence's last queries (mode
``documents``) and from every document's own last queries (``documents_per_doc``,
``SparsityConfig(window="per_document")``). Reports per (impl, mode) the executed work fraction (``stats_scalars``),
forward and forward+backward time (each call estimates its index), the index estimate's time alone
(``estimate_ms``: ``fwd_ms - estimate_ms`` is about the forward kernels' share), the block-level
density of the document mask itself, and the relative difference of the output and gradients from the first impl's (a cross-check of the
kernels at full size); one JSON line each to ``--out``, with the run's provenance. ``--estimate-impls xla auto``
times the index estimate's two paths (``SparsityConfig.estimate_impl``) on the same inputs.

    python benchmarks/packed_documents.py --seq 131072 --impls mosaic triton --out $OUT/packed_documents.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script: the repo root

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from benchmarks._driver import append_rows, provenance  # noqa: E402
from benchmarks._timing import timeit  # noqa: E402

from mtraining_jax.attention.mtraining import MTrainingConfig, mtraining_attention, stats_scalars  # noqa: E402
from mtraining_jax.mesh import make_mesh  # noqa: E402
from mtraining_jax.sparsity import SparsityConfig, estimate_index  # noqa: E402
from mtraining_jax.sparsity import estimate as est  # noqa: E402
from mtraining_jax.sparsity.config import ESTIMATE_IMPLS  # noqa: E402
from mtraining_jax.sparsity.convert import convert_step  # noqa: E402
from mtraining_jax.sparsity.synthetic import SyntheticAttention, packed_documents_qk  # noqa: E402
from pallas_kernels.index_format import apply_segments, column_start  # noqa: E402
from pallas_kernels import registry  # noqa: E402


def _rel(a, b) -> float:
    """Relative Frobenius difference of two arrays (float32 on the device)."""
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def length_mix(seq: int, seed: int = 0, short=(256, 4096), long_docs: int = 2, long_share: float = 0.5):
    """Document lengths summing to ``seq``: ``long_docs`` long documents covering ``long_share`` of
    the tokens, the rest log-uniform short documents in ``short``; shuffled (seeded)."""
    rng = np.random.default_rng(seed)
    long_total = int(seq * long_share)
    lens = [long_total // long_docs] * long_docs
    rest = seq - sum(lens)
    while rest > 0:
        n = int(min(rest, np.exp(rng.uniform(np.log(short[0]), np.log(short[1])))))
        lens.append(n)
        rest -= n
    rng.shuffle(lens)
    return np.asarray(lens)


def visible_tile_fraction(lens, seq: int, window_blocks: int, block_size: int = 64) -> dict:
    """Of the (window row tile, key tile) pairs the per-document window's kernels walk (``block_size``
    rows and keys each, one rank, natural order), the fraction in which some row sees some key (its
    own document, causal): the tiles they compute; the rest they skip (exact)."""
    seg = jnp.asarray(np.repeat(np.arange(len(lens)), lens)[None].astype(np.int32))
    cfg = SparsityConfig(window="per_document", window_blocks=window_blocks, block_size=block_size)
    blocks, rows, rseg = (np.asarray(x)[0] for x in est._document_window(seg, jnp.arange(seq), seq, cfg, lambda x: x))
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    visible = 0
    for w, b in enumerate(blocks):
        ok, ids = rows[w * block_size:(w + 1) * block_size], rseg[w * block_size:(w + 1) * block_size]
        tiles = set()
        for d in set(ids[ok].tolist()) if b >= 0 else ():
            last = b * block_size + int(np.nonzero(ok & (ids == d))[0].max())
            tiles |= set(range(starts[d] // block_size, last // block_size + 1))
        visible += len(tiles)
    total = len(blocks) * (seq // block_size)
    return {"documents": int(len(lens)), "window_blocks_used": int((blocks >= 0).sum()), "visible_tiles": visible,
            "tiles": total, "visible_fraction": visible / total}


def column_waste(lens, heads: int, kv_heads: int, head_dim: int, seed: int, window: str,
                 window_blocks: int = 64, block_size: int = 64) -> dict:
    """Of the pairs the kernels compute on one packed row (``lens``: document lengths), how many are column
    slots of OTHER documents, masked per token (CPU). The index is the library's: ``estimate_index``
    (``SparsityConfig(window=...)``) on :func:`~mtraining_jax.sparsity.synthetic.packed_documents_qk`'s q/k,
    ``convert_step``, ``apply_segments``. Verticals are one position-sorted list per head and every query
    block computes a PREFIX of it (``col_count`` slots), so a vertical of an early document is also
    computed, then masked, by every later query block of other documents. ``col_tiles_row_start``: the
    column tiles left when each row starts at the tile holding its
    :func:`~pallas_kernels.index_format.column_start` (as the Triton kernels do)."""
    bs = block_size
    seq = int(np.sum(lens))
    seg_np = np.repeat(np.arange(len(lens)), lens).astype(np.int32)
    q, k, _ = packed_documents_qk(lens, SyntheticAttention(num_q_heads=heads, num_kv_heads=kv_heads,
                                                            head_dim=head_dim), seed)
    pos, seg = jnp.arange(seq, dtype=jnp.int32), jnp.asarray(seg_np[None])
    cfg = SparsityConfig(window=window, window_blocks=window_blocks, block_size=bs)
    vs = est.estimate_index(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), pos, cfg, segment_ids=seg)
    idx = apply_segments(convert_step(vs, pos, pos, seq_len=seq, block_size=bs), seg, seg, bs)
    cc, ci = np.asarray(idx.col_count)[0], np.asarray(idx.col_idx)[0]  # [H, nQB], [H, MC] (key of each slot)
    rows = seg_np.reshape(-1, bs)
    kseg = seg_np[np.clip(ci, 0, seq - 1)][:, None, :]  # [H, 1, MC]
    in_prefix = np.arange(ci.shape[-1])[None, None, :] < cc[..., None]  # [H, nQB, MC]
    same = in_prefix & (kseg >= rows.min(1)[None, :, None]) & (kseg <= rows.max(1)[None, :, None])
    col, useful = int(in_prefix.sum()) * bs, int(same.sum()) * bs  # each slot: 64 query rows
    block = int(np.asarray(idx.block_count).sum()) * bs * bs
    start = np.asarray(column_start(idx, seg, seg, bs))[0]  # [H, nQB]: what the kernels skip up to
    tiles = -(-cc // bs)
    return {"window": window, "documents": int(len(lens)), "verticals_per_head": float(np.asarray(vs.v_count).mean()),
            "block_pairs": block, "column_pairs": col, "column_pairs_same_document": useful,
            "other_document_share_of_work": (col - useful) / max(block + col, 1),
            "col_tiles": int(tiles.sum()), "col_tiles_row_start": int((tiles - start // bs).sum())}


def plot_column_waste(rows, path: str) -> None:
    """Bar chart of ``column_waste`` rows (``what == "column_waste"``): per length and seed, the share of the
    computed pairs that are other documents' columns, and the column tiles with / without a per-row start."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("what") == "column_waste" and r["window"] == "per_document"]
    labels = [f"{r['seq'] // 1024}K s{r['seed']}\n{r['documents']} docs" for r in rows]
    x = np.arange(len(rows))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.8))
    a1.bar(x, [100 * r["other_document_share_of_work"] for r in rows], color="tab:red")
    a1.set_ylabel("% of computed pairs"), a1.set_title("other documents' columns (masked per token)")
    a2.bar(x - 0.2, [r["col_tiles"] for r in rows], 0.4, label="now: each row's prefix of the column list")
    a2.bar(x + 0.2, [r["col_tiles_row_start"] for r in rows], 0.4, label="with a per-row column start")
    a2.set_yscale("log"), a2.set_ylabel("column tiles (64 rows x 64 slots)"), a2.legend(fontsize=8)
    for a in (a1, a2):
        a.set_xticks(x, labels, fontsize=8)
    fig.suptitle("Packed documents, per-document window (SparsityConfig defaults; 14 / 2 heads, d64)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def timing_groups(rows, runs=None) -> dict:
    """``{(mode, estimate path, code): [rows]}`` of the timing rows (of ``runs`` if given); ``code`` is
    the commit's first 7 characters and, for ``benchmarks.ab_trees`` rows, the arm."""
    rows = [r for r in rows if "fwd_bwd_ms" in r and (not runs or r.get("run") in runs)]
    if not rows:
        raise ValueError(f"no timing rows{' of runs ' + ', '.join(runs) if runs else ''} to plot")
    groups: dict = {}
    for r in rows:
        code = str(r["commit"])[:7] + (f" {r['ab_arm']}" if r.get("ab_arm") else "")
        groups.setdefault((r["mode"], r["estimate"], code), []).append(r)
    return groups


def plot_timings(rows, path: str, runs=None) -> None:
    """Bar chart of the timing rows (``fwd_ms`` / ``fwd_bwd_ms``, and ``estimate_ms`` where rows have it;
    of ``runs`` if given): per mode, index-estimate path and code (the commit, and the A/B arm of
    ``benchmarks.ab_trees`` rows: two arms of one commit stay apart), the median over processes (bars)
    and each process (dots)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = timing_groups(rows, runs)
    rows = [r for g in groups.values() for r in g]
    keys = sorted(groups)
    x = np.arange(len(keys))
    bars = [("fwd_ms", "forward"), ("fwd_bwd_ms", "forward + backward")]
    if any("estimate_ms" in r for r in rows):
        bars.insert(0, ("estimate_ms", "index estimate alone"))
    width = 0.8 / len(bars)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(keys)), 4.0))
    for j, (col, name) in enumerate(bars):
        off = (j - (len(bars) - 1) / 2) * width
        vals = [[r[col] for r in groups[k] if col in r] for k in keys]
        ax.bar(x + off, [np.median(v) if v else 0.0 for v in vals], width, label=name)
        for i, v in enumerate(vals):
            if v:
                ax.plot([x[i] + off] * len(v), v, "k.", ms=4)
                ax.annotate(f"{np.median(v):.1f}", (x[i] + off, np.median(v)), ha="center", va="bottom", fontsize=7)
    ax.set_yscale("log"), ax.set_ylabel("ms (median of a process's repeats; dots: processes)"), ax.legend(fontsize=8)
    ax.set_xticks(x, [f"{m}\nestimate {e}\n{c}" for m, e, c in keys], fontsize=7)
    r0 = rows[0]
    ax.set_title(f"Packed documents, {r0['seq'] // 1024}K, {r0['heads']} / {r0['kv_heads']} heads, d{r0['head_dim']}, "
                 f"kernels {r0['kernel_fwd']} ({r0['device']}, JAX {r0['jax']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=131072)
    ap.add_argument("--heads", type=int, default=14)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--impls", nargs="+", default=["auto"], help="kernel impls to time (registry names)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--modes", nargs="+", default=["stream", "documents", "documents_per_doc"])
    ap.add_argument("--window-blocks", type=int, default=64, help="per-document window: query blocks")
    ap.add_argument("--estimate-impls", nargs="+", default=["auto"], choices=ESTIMATE_IMPLS,
                    help="the index estimate's paths to time (SparsityConfig.estimate_impl)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--qk", choices=("synthetic", "random"), default="synthetic",
                    help="q/k: packed synthetic documents (sparsity.synthetic) or i.i.d. normal (diffuse "
                         "attention: the budgets saturate)")
    ap.add_argument("--visible-tiles-only", action="store_true",
                    help="only count the key tiles the per-document window's kernels compute (no timing; CPU)")
    ap.add_argument("--column-waste-only", action="store_true",
                    help="only the share of the kernels' work that is other documents' columns (CPU; column_waste), "
                         "per window, --seeds")
    ap.add_argument("--seeds", type=int, nargs="+", default=None, help="with --column-waste-only: length mixes")
    ap.add_argument("--plot-from", default=None,
                    help="with --plot: draw the rows of this JSONL file (no run): --plot-what's kind")
    ap.add_argument("--plot-what", choices=("column_waste", "timings"), default="column_waste",
                    help="--plot-from's rows to draw: the column_waste counts, or the timing rows (of --runs)")
    ap.add_argument("--runs", nargs="+", default=None, help="--plot-what timings: the rows' run labels to draw")
    ap.add_argument("--plot", default=None, help="PNG path for --plot-from's chart")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.plot_from:
        with open(a.plot_from) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        if a.plot_what == "timings":
            plot_timings(rows, a.plot, a.runs)
        else:
            plot_column_waste(rows, a.plot)
        return []
    prov = provenance(argv)
    if a.column_waste_only:
        recs = []
        for seed, window in itertools.product(a.seeds or [a.seed], ("per_document", "sequence")):
            rec = {"what": "column_waste", "seq": a.seq, "seed": seed, "heads": a.heads, "kv_heads": a.kv_heads,
                   "head_dim": a.head_dim, **column_waste(length_mix(a.seq, seed), a.heads, a.kv_heads, a.head_dim,
                                                          seed, window, a.window_blocks), **prov}
            print(json.dumps(rec), flush=True)
            recs.append(rec)
        append_rows(a.out, recs, {})
        return recs
    if a.visible_tiles_only:
        rec = {"what": "per_document_visible_tiles", "seq": a.seq, "seed": a.seed, "window_blocks": a.window_blocks,
               **visible_tile_fraction(length_mix(a.seq, a.seed), a.seq, a.window_blocks), **prov}
        print(json.dumps(rec), flush=True)
        append_rows(a.out, [rec], {})
        return [rec]
    S, H, HK, D = a.seq, a.heads, a.kv_heads, a.head_dim
    ks = jax.random.split(jax.random.PRNGKey(a.seed), 4)
    q = jax.random.normal(ks[0], (1, S, H, D), jnp.bfloat16)
    k = jax.random.normal(ks[1], (1, S, HK, D), jnp.bfloat16)
    v = jax.random.normal(ks[2], (1, S, HK, D), jnp.bfloat16)
    mesh = make_mesh((1, 1), jax.devices()[:1])
    cfg = MTrainingConfig()
    lay = cfg.make_layout(S, 1)
    lens = length_mix(S, a.seed)
    seg = jnp.asarray(np.repeat(np.arange(len(lens)), lens)[None].astype(np.int32))
    if a.qk == "synthetic":  # per-document sinks, heavy keys and slashes: a realistic index size
        qs, kss, _ = packed_documents_qk(lens, SyntheticAttention(num_q_heads=H, num_kv_heads=HK, head_dim=D), a.seed)
        q, k = lay.permute(qs.astype(jnp.bfloat16)), lay.permute(kss.astype(jnp.bfloat16))
    seg = lay.permute(seg, axis=-1)
    bs = cfg.block_size
    nb = S // bs
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]) // bs
    mask_blocks = sum((e - s + 1) * (e - s + 2) / 2 for s, e in zip(starts, (np.cumsum(lens) - 1) // bs))
    cot = jax.random.normal(ks[3], (1, S, H, D), jnp.float32)
    records, first = [], {}
    laid_pos = jnp.asarray(lay.perm, jnp.int32)
    estimate_fn = jax.jit(lambda q, k, sp, sg: estimate_index(q, k, laid_pos, sp, segment_ids=sg), static_argnums=2)
    for impl, est_impl in itertools.product(a.impls, a.estimate_impls):
        icfg = dataclasses.replace(cfg, ring=dataclasses.replace(cfg.ring, impl=impl), sparsity=dataclasses.replace(cfg.sparsity, estimate_impl=est_impl))
        pdcfg = dataclasses.replace(icfg, sparsity=dataclasses.replace(icfg.sparsity, window="per_document",
                                                                       window_blocks=a.window_blocks))
        for mode, sg, mcfg in (("stream", None, icfg), ("documents", seg, icfg), ("documents_per_doc", seg, pdcfg)):
            if mode not in a.modes:
                continue
            estimate = est.estimate_impl(mcfg.sparsity, S, D, rows=mcfg.sparsity.window_rows_at(S))
            # segment ids: an argument of the call (as in training), not a constant XLA could fold into the program
            fwd = jax.jit(lambda q, k, v, sg, c=mcfg: mtraining_attention(q, k, v, mesh, c, segment_ids=sg,
                                                                          return_stats=True))
            grad = jax.jit(jax.grad(lambda q, k, v, sg, c=mcfg: jnp.sum(
                mtraining_attention(q, k, v, mesh, c, segment_ids=sg).astype(jnp.float32) * cot), argnums=(0, 1, 2)))
            out, st = fwd(q, k, v, sg)
            grads = grad(q, k, v, sg)
            # the calls above compiled and warmed both programs
            t_fwd, _ = timeit(lambda: fwd(q, k, v, sg), warmup=0, repeat=a.repeat)
            t_bwd, _ = timeit(lambda: grad(q, k, v, sg), warmup=0, repeat=a.repeat)
            # the index estimate alone (the call's share that is not the kernels'), same inputs and settings
            t_est, _ = timeit(lambda: estimate_fn(q, k, mcfg.sparsity, sg), warmup=1, repeat=a.repeat)
            same_index = all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(estimate_fn(q, k, mcfg.sparsity, sg)),
                                                                  jax.tree.leaves(st.index)))
            res = (out,) + tuple(grads)
            if mode not in first:
                first[mode] = res
            diff = {f"rel_diff_{n}": _rel(x, y) for n, x, y in zip(("out", "dq", "dk", "dv"), res, first[mode])}
            rec = {"impl": impl, "mode": mode, "estimate_impl": est_impl, "estimate": estimate, "qk": a.qk, "seq": S, "heads": H, "kv_heads": HK, "head_dim": D,
                   "documents": int(len(lens)) if sg is not None else 1,
                   "doc_len_min_median_max": [int(lens.min()), int(np.median(lens)), int(lens.max())]
                   if sg is not None else [S, S, S],
                   "work_fraction": float(stats_scalars(st.work, 1, H, S, bs)["work_fraction"]),
                   "doc_mask_block_fraction": float(mask_blocks / (nb * (nb + 1) / 2)) if sg is not None else 1.0,
                   "fwd_ms": t_fwd * 1e3, "fwd_bwd_ms": t_bwd * 1e3, "estimate_ms": t_est * 1e3,
                   "estimate_is_the_calls": bool(same_index), **diff,
                   "kernel_fwd": registry.resolve(impl, "fwd", q, bs, S, sg is not None),
                   "kernel_bwd": registry.resolve(impl, "bwd", q, bs, S, sg is not None),
                   **prov}
            print(json.dumps(rec), flush=True)
            records.append(rec)
    append_rows(a.out, records, {})
    return records


if __name__ == "__main__":
    main()
