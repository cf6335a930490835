"""Worker- and step-level imbalance of sparse ring attention (MTraining §3.3, §4.1, Table 3).

Simulates 32 context-parallel workers (4 nodes x 8) on a 512K-token sequence: vertical-slash indices
are ESTIMATED (Algorithm 1, ``estimate_index``) from synthetic RoPE attention with vertical-slash
structure (:mod:`mtraining_jax.sparsity.synthetic`), then the work of every (worker, ring step) is
counted exactly as the converted per-step index would make the kernels work
(``block tiles * 64^2 + columns * 64``, :mod:`mtraining_jax.sparsity.metrics`) for

* zig-zag ring attention (flat ring),
* block-striped sparse ring attention (flat ring; MTraining w/o hierarchical),
* hierarchical block-striped sparse ring attention (MTraining),

plus the dense causal mask under zig-zag for reference. Writes ``results/ring/imbalance.md``
and ``results/ring/imbalance_heatmaps.png`` (``--out-dir``; default: the repository's ``results/ring``).

    python benchmarks/imbalance.py                 # 512K tokens, 4 query heads (a few minutes on CPU)
    python benchmarks/imbalance.py --seq-len 65536 --no-write   # quick look
    python benchmarks/imbalance.py --meshes 1x8 2x4 4x8 --append  # several worker counts, appended

``--meshes`` (node x local, one index estimate shared by all meshes) also compares each scheme with
the dense causal ring of the same layout and order: total work and barrier time (sum over steps
of the slowest worker) of sparse / dense, and appends a section to ``imbalance.md``
with ``--append`` (without ``--meshes`` the output is the single-mesh report above, unchanged).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from mtraining_jax.layouts import Layout
from mtraining_jax.sparsity import SparsityConfig, VerticalSlashIndex, estimate_index
from mtraining_jax.sparsity import metrics
from mtraining_jax.sparsity.synthetic import SyntheticAttention, synthetic_qk

#: where the report and heatmaps go by default (the checkout's ``results/ring``; ``--out-dir`` elsewhere)
RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results", "ring")
SCHEMES = (  # name, layout, ring order
    ("Zig-zag (flat ring)", "zigzag", "flat"),
    ("Block-striped (flat ring)", "block_striped", "flat"),
    ("Block-striped hierarchical (MTraining)", "block_striped", "hierarchical"),
)
PAPER = {  # Table 3: (worker ID, step ID, comp. ratio)
    "Zig-zag (flat ring)": "2.61 ± 0.48 / 1.99 ± 0.35 / 0.42",
    "Block-striped (flat ring)": "1.04 ± 0.01 / 1.19 ± 0.04 / 0.76",
    "Block-striped hierarchical (MTraining)": "1.03 ± 0.02 / 1.16 ± 0.01 / 0.82",
    "Dense causal, zig-zag": "1.02 / 1.01 / 0.88",
}


def estimate(args) -> tuple[VerticalSlashIndex, SyntheticAttention, SparsityConfig]:
    syn = SyntheticAttention(seq_len=args.seq_len, num_q_heads=args.heads, num_kv_heads=args.heads // 2,
                             head_dim=64, num_outliers=args.outliers, sharpness=args.sharpness, seed=args.seed)
    cfg = SparsityConfig(vertical_p=args.p, slash_p=args.p, vertical_max=args.vertical_max,
                         slash_max=args.slash_max)
    S, lq = args.seq_len, cfg.last_q
    # the estimate reads only the last_q query rows: generate those, leave the others zero
    q_last, k = synthetic_qk(syn, query_positions=np.arange(S - lq, S))
    q = jnp.zeros((1, S) + q_last.shape[2:], jnp.float32).at[:, S - lq:].set(q_last)
    g = syn.num_q_heads // syn.num_kv_heads
    f = jax.jit(lambda q, k: estimate_index(q, k, jnp.arange(S), cfg))
    parts = [f(q[:, :, h * g:(h + 1) * g], k[:, :, h:h + 1]) for h in range(syn.num_kv_heads)]  # per KV group
    index = VerticalSlashIndex(*(jnp.concatenate(a, axis=1) for a in zip(*parts)))
    return index, syn, cfg


def dense_index(seq_len: int, bs: int = 64) -> VerticalSlashIndex:
    nb = seq_len // bs
    return VerticalSlashIndex(jnp.zeros((1, 1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32),
                              jnp.arange(nb, dtype=jnp.int32)[None, None], jnp.full((1, 1), nb, jnp.int32))


def summarize(W) -> dict:
    return dict(worker=metrics.worker_imbalance(W), step=metrics.step_imbalance(W),
                ratio=metrics.computation_ratio(W),
                worker_std=float(np.std(W.max(0) / W.mean(0))), step_std=float(np.std(W.max(1) / W.mean(1))))


def parse_mesh(text: str) -> tuple[int, int]:
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise ValueError(f"mesh must be NODExLOCAL with positive integers, e.g. 2x4; got {text!r}")
    return int(parts[0]), int(parts[1])


def mesh_rows(index, S, heads, N, L) -> list[tuple[str, dict]]:
    """Per scheme on an ``N x L`` mesh: imbalance metrics plus sparse / dense work and barrier time,
    the dense causal ring taken with the same layout and ring order (``heads`` heads, like the index)."""
    P = N * L
    rows = []
    for name, layout, order in SCHEMES:
        lay = Layout(layout, S, P)
        W = metrics.work_matrix(index, lay, num_nodes=N, num_local=L, ring_order=order)
        Wd = heads * metrics.work_matrix(dense_index(S), lay, num_nodes=N, num_local=L, ring_order=order)
        r = summarize(W)
        r.update(work_vs_dense=float(W.sum() / Wd.sum()),
                 time_vs_dense=float(W.max(0).sum() / Wd.max(0).sum()),
                 dense_ratio=metrics.computation_ratio(Wd))
        rows.append((name, r))
    return rows


def sweep(args, argv, index, sp, t_est):
    """``--meshes``: the metrics of every scheme on every mesh, from the one estimated index."""
    S = args.seq_len
    lines = ["| workers (node x local) | scheme | worker-level ID | step-level ID | comp. ratio | "
             "dense comp. ratio | sparse / dense work | sparse / dense barrier time |",
             "|---|---|---|---|---|---|---|---|"]
    t0 = time.time()
    for m in args.meshes:
        N, L = parse_mesh(m)
        for name, r in mesh_rows(index, S, args.heads, N, L):
            lines.append(f"| {N * L} ({N}x{L}) | {name} | {r['worker']:.2f} ± {r['worker_std']:.2f} | "
                         f"{r['step']:.2f} ± {r['step_std']:.2f} | {r['ratio']:.2f} | {r['dense_ratio']:.2f} | "
                         f"{r['work_vs_dense']:.3f} | {r['time_vs_dense']:.3f} |")
    table = "\n".join(lines)
    print(table)
    if not args.append:
        return
    cmd = "python benchmarks/imbalance.py " + " ".join(sys.argv[1:] if argv is None else argv)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    md = f"""

## Worker counts {', '.join(f"{parse_mesh(m)[0] * parse_mesh(m)[1]} ({m})" for m in args.meshes)}: imbalance and sparse vs dense work

Command: `{cmd}` ({S // 1024}K tokens, {args.heads} query heads, p = {args.p},
caps {args.vertical_max} / {args.slash_max}). Date: {date};
{platform.machine()} CPU, JAX {jax.__version__}; estimation {t_est:.0f} s, metrics {time.time() - t0:.0f} s.
One index (mean sparsity {sp.mean():.3f}) is laid out over every mesh. "Dense" is the full causal
mask under the SAME layout and ring order (block-striped for the MTraining rows; the section above
uses zig-zag for its dense row). Sparse / dense work = total attended slots; sparse / dense barrier
time = sum over ring steps of the slowest worker's work, i.e. the cost-model time of the sparse ring
relative to the dense ring (communication ignored; its inverse bounds the sparse-over-dense speed-up).

{table}

On a one-level mesh (1xL) the hierarchical and flat orders are the same schedule.
"""
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "imbalance.md"), "a") as f:
        f.write(md)


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 4), constrained_layout=True)
    for ax, (name, W) in zip(axes, results.items()):
        im = ax.imshow(W / W.mean(), cmap="viridis", aspect="auto")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("ring step")
        ax.set_ylabel("worker (node-major rank)")
        fig.colorbar(im, ax=ax, label="work / mean")
    fig.suptitle("Sparse ring attention work per (worker, step), 512K tokens, 32 workers (4x8)")
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=512 * 1024)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--local", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--p", type=float, default=0.9)
    ap.add_argument("--sharpness", type=float, default=1.0)
    ap.add_argument("--outliers", type=int, default=256)
    ap.add_argument("--vertical-max", type=int, default=4096)
    ap.add_argument("--slash-max", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--meshes", nargs="+", help="NODExLOCAL meshes to sweep (e.g. 1x8 2x4 4x8); see module doc")
    ap.add_argument("--append", action="store_true", help="with --meshes: append the table to OUT_DIR/imbalance.md")
    ap.add_argument("--out-dir", default=RESULTS, help="folder of imbalance.md and imbalance_heatmaps.png "
                    "(default: results/ring of this checkout)")
    args = ap.parse_args(argv)
    for m in args.meshes or []:
        parse_mesh(m)
    N, L, S = args.nodes, args.local, args.seq_len
    P = N * L
    t0 = time.time()
    index, syn, cfg = estimate(args)
    t_est = time.time() - t0
    sp = metrics.sparsity(index, S)
    print(f"estimated in {t_est:.1f}s: sparsity per head {np.round(sp[0], 4)} (mean {sp.mean():.4f}); "
          f"verticals {np.asarray(index.v_count)[0]}, slashes {np.asarray(index.s_count)[0]}")
    if args.meshes:
        return sweep(args, argv, index, sp, t_est)
    results, rows = {}, []
    for name, layout, order in SCHEMES:
        W = metrics.work_matrix(index, Layout(layout, S, P), num_nodes=N, num_local=L, ring_order=order)
        results[name] = W
        rows.append((name, summarize(W)))
    Wd = metrics.work_matrix(dense_index(S), Layout("zigzag", S, P), num_nodes=N, num_local=L, ring_order="flat")
    rows.append(("Dense causal, zig-zag", summarize(Wd)))
    t_all = time.time() - t0
    lines = [f"| {n} | {r['worker']:.2f} ± {r['worker_std']:.2f} | {r['step']:.2f} ± {r['step_std']:.2f} | "
             f"{r['ratio']:.2f} | {PAPER[n]} |" for n, r in rows]
    table = "\n".join(["| scheme | worker-level ID | step-level ID | comp. ratio (barrier, no comm) | "
                       "paper Table 3 (worker / step / ratio) |", "|---|---|---|---|---|"] + lines)
    print(table)
    print(f"total {t_all:.1f}s")
    if args.no_write:
        return
    os.makedirs(args.out_dir, exist_ok=True)
    plot(results, os.path.join(args.out_dir, "imbalance_heatmaps.png"))
    cmd = "python benchmarks/imbalance.py" + ("" if argv is None else " " + " ".join(argv))
    md = f"""# Sparse ring attention load imbalance (MTraining §3.3, Table 3)

Command: `{cmd}` (defaults: `--seq-len {S} --nodes {N} --local {L} --heads {args.heads} --p {args.p} \
--outliers {args.outliers} --vertical-max {args.vertical_max} --slash-max {args.slash_max}`)
Date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}.
Machine: {platform.machine()} CPU, {os.cpu_count()} cores, JAX {jax.__version__} ({jax.default_backend()}). \
Wall time {t_all:.0f} s (estimation {t_est:.0f} s).

Setup: {S // 1024}K tokens, {P} simulated workers ({N} nodes x {L}), {args.heads} query heads
({syn.num_kv_heads} KV heads, head_dim 64). Indices are estimated with Algorithm 1 (last_q = {cfg.last_q},
top-p {args.p} for verticals and slashes, caps {args.vertical_max} tokens / {args.slash_max} block-diagonals)
from synthetic RoPE attention with slash bands, {args.outliers} heavy keys and a sink
(`mtraining_jax.sparsity.synthetic`). Sparsity per head: {', '.join(f'{x:.3f}' for x in sp[0])}
(mean {sp.mean():.3f}; the paper reports 0.95 on ProLong at 512K). The slash cap is raised from the
library default (64 block-diagonals = 4096 tokens) because at 512K that cap alone bounds the density
near 2.4% (97.6% sparsity); 256 lets top-p land near the paper's 95%.

Work of worker r at ring step s = (active 64x64 tiles x 64^2 + vertical columns x 64) of its
converted per-step index, summed over heads. Worker-level ID = mean over steps of max/mean over
workers; step-level ID = mean over workers of max/mean over steps (± = std over steps / workers);
computation ratio = total work / (P x sum over steps of the slowest worker), i.e. the busy fraction
with a barrier per ring step and communication ignored (the paper's ratio is measured time and
also pays communication bubbles, so ours is an upper bound on it).

{table}

Heatmaps (work per worker x step, normalised to the mean): `imbalance_heatmaps.png`.

Reading. Zig-zag: the slash band (most of the work) sits near the diagonal, so a worker does most
of its work at step 0 (its own chunk) and at the last steps (its mirror chunk's neighbour), and
workers differ by where their two chunks lie: both imbalance degrees are large (§3.3, Fig. 8).
Block-striped (flat): at step s worker r meets rank (r - s) mod P, so every tile it computes lies
on a block-diagonal d = s (mod P); all workers see the same set of diagonals at a step, which
balances workers (worker ID ~1.0, as in Table 3). The step-level ID is the spread of slash mass
over the residues d mod P: the synthetic RoPE heads put their slashes at periodic distances (the
channel means' cosines re-align), so some residues are heavy (the bright step columns) and the
step ID here (1.5) is above the paper's 1.19 for trained Qwen2.5 heads. Hierarchical order: at step
s = i*L + j, worker (n, l) meets ((n - i) mod N, (l - j) mod L), i.e. residue s for l >= j but
s - L for l < j, so within one step two groups of workers meet different diagonal residues; with
our periodic slash mass that costs worker balance (1.15 vs 1.03), while the paper measures 1.03 vs
1.04 on real attention whose mass varies smoothly with d. Each worker's multiset of steps is the
same as in the flat ring (identical step-level ID). The computation ratio here counts only
compute under per-step barriers; Table 3's also pays un-overlapped communication.
"""
    with open(os.path.join(args.out_dir, "imbalance.md"), "w") as f:
        f.write(md)


if __name__ == "__main__":
    main()
