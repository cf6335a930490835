"""MSA selection scheme study (CPU): per-row top-k union + row mask (a) vs per-query-block top-k (b).

On synthetic RoPE attention with vertical-slash structure (:mod:`mtraining_jax.sparsity.synthetic`),
with an index branch that mirrors the main branch (``q_idx`` = the group's mean query, ``k_idx`` =
the group's key: what a well-aligned indexer approximates) and, for contrast, a random one, it
measures for each ``top_k``:

* ``mass_recall``: the FULL causal main-branch attention mass (group-averaged) inside each row's
  attended blocks, mean over rows — for (a) the row's own top-k, for (b) its query block's top-k
  ranked by the mean of the block's rows (``selection="block_mean"``, which reads later rows),
  for (b) causal (``selection="causal"``, the default: ranked by the block's first row), for (b)
  ranked by the 64 rows ending at the block's first row (``mass_recall_b_prev_window``: the causal
  alternative that would need the previous rows from another rank) and for the oracle (top-k
  blocks of the main-branch mass itself, local forced; the paper's I*);
* ``mass_recall_b_maxpool``: (b) with the paper's max-pooled token scores instead of our
  mean-pooled block keys (NumPy; what gathering every token's index key would buy);
* ``block_recall_b_vs_a``: ``|sel_b(row) & sel_a(row)| / |sel_a(row)|``;
* ``work``: executed kernel slots over dense causal ones — (a) must run every block of its query
  block's union (a per-row mask only zeroes entries inside tiles), (b) runs ``k`` per query block.

    PYTHONPATH=. python benchmarks/msa_selection_study.py --out /tmp/msa_selection.json

Writes JSON (and prints a Markdown table). The committed rows: ``results/msa/msa.jsonl``, run
``selection-study`` (report: ``results/msa/msa.md``).
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._driver import provenance
from mtraining_jax.sparsity.msa_select import (block_summaries, row_topk_union, select_blocks,
                                               selection_block_map)
from mtraining_jax.sparsity.synthetic import SyntheticAttention, synthetic_qk

BS = 64


def block_mass(q, k, bs=BS):
    """``float64 [S, nb]``: group-averaged full causal attention mass per KV block (Hkv = 1)."""
    q, k = np.asarray(q[0], np.float64), np.asarray(k[0, :, 0], np.float64)  # [S, Hq, D], [S, D]
    S, Hq, D = q.shape
    nb = S // bs
    out = np.zeros((S, nb))
    for i in range(nb):
        rows = slice(i * bs, (i + 1) * bs)
        s = np.einsum("qhd,kd->hqk", q[rows], k[: (i + 1) * bs]) / np.sqrt(D)
        s = np.where(np.arange((i + 1) * bs)[None, None, :] <= np.arange(i * bs, (i + 1) * bs)[None, :, None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[rows, : i + 1] = p.mean(0).reshape(bs, i + 1, bs).sum(-1)
    return out


def oracle_rows(mass, k, bs=BS):
    S, nb = mass.shape
    sel = np.zeros_like(mass, bool)
    for r in range(S):
        qb = r // bs
        sel[r, qb] = True
        cand = np.argsort(-mass[r, :qb], kind="stable")[: k - 1]
        sel[r, cand] = True
    return sel


def maxpool_rows(qi, ki, k, bs=BS):
    """Scheme (b) with the paper's max-pooled token scores instead of mean-pooled keys (NumPy,
    float64): per query block, mean over rows of the row softmax over candidate blocks of
    ``max_{j in block} q_idx . k_idx_j / sqrt(d)``; top ``k - 1`` + local. ``bool [S, nb]``."""
    q, kk = np.asarray(qi[0, :, 0], np.float64), np.asarray(ki[0], np.float64)
    S, d = q.shape
    nb = S // bs
    sel = np.zeros((S, nb), bool)
    for i in range(nb):
        rows = slice(i * bs, (i + 1) * bs)
        sel[rows, i] = True
        if i == 0:
            continue
        m = (q[rows] @ kk[: i * bs].T / np.sqrt(d)).reshape(bs, i, bs).max(-1)  # [bs, i]
        p = np.exp(m - m.max(1, keepdims=True))
        agg = (p / p.sum(1, keepdims=True)).mean(0)
        sel[rows, np.argsort(-agg, kind="stable")[: k - 1]] = True
    return sel


def study(seq_len: int, top_ks, seed: int, sharpness: float):
    cfg = SyntheticAttention(seq_len=seq_len, num_q_heads=4, num_kv_heads=1, head_dim=64, seed=seed,
                             sharpness=sharpness)
    q, k = synthetic_qk(cfg)
    mass = block_mass(q, k)
    S, nb = mass.shape
    dense_blocks = nb * (nb + 1) / 2
    indexers = {
        "aligned": (q.mean(axis=2, keepdims=True), k[:, :, 0]),
        "random": (jax.random.normal(jax.random.PRNGKey(seed + 1), (1, S, 1, 16)),
                   jax.random.normal(jax.random.PRNGKey(seed + 2), (1, S, 16))),
    }
    rows = []
    pos = jnp.arange(S)
    for name, (qi, ki) in indexers.items():
        kbar = block_summaries(ki, BS)
        for top_k in top_ks:
            row_a, union = row_topk_union(qi, kbar, pos, block_size=BS, top_k=top_k)
            row_a = np.asarray(row_a)[0, 0]  # [S, nb]
            sel_b = select_blocks(qi, kbar, pos, block_size=BS, top_k=top_k, selection="block_mean")
            row_b = np.repeat(np.asarray(selection_block_map(sel_b, nb))[0, 0], BS, axis=0)
            sel_c = select_blocks(qi, kbar, pos, block_size=BS, top_k=top_k, selection="causal")
            row_c = np.repeat(np.asarray(selection_block_map(sel_c, nb))[0, 0], BS, axis=0)
            qi_prev = jnp.concatenate([jnp.zeros_like(qi[:, :BS - 1]), qi[:, :S - BS + 1]], axis=1)  # row r -> r-63
            sel_p = select_blocks(qi_prev, kbar, pos, block_size=BS, top_k=top_k, selection="block_mean")
            row_p = np.repeat(np.asarray(selection_block_map(sel_p, nb))[0, 0], BS, axis=0)
            orc = oracle_rows(mass, top_k)
            row_m = maxpool_rows(qi, ki, top_k)
            rows.append({
                "indexer": name, "seq_len": S, "top_k": top_k, "sharpness": sharpness,
                "mass_recall_a": float((row_a * mass).sum(1).mean()),
                "mass_recall_b": float((row_b * mass).sum(1).mean()),
                "mass_recall_b_causal": float((row_c * mass).sum(1).mean()),
                "mass_recall_b_prev_window": float((row_p * mass).sum(1).mean()),
                "mass_recall_oracle": float((orc * mass).sum(1).mean()),
                "mass_recall_b_maxpool": float((row_m * mass).sum(1).mean()),
                "block_recall_b_vs_a": float(((row_a & row_b).sum(1) / row_a.sum(1)).mean()),
                "work_a": float(np.asarray(union).sum() / dense_blocks),
                "work_b": float(np.asarray(sel_b.block_count).sum() / dense_blocks),
            })
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--top-k", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sharpness", type=float, nargs="+", default=[1.0, 2.0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    prov = provenance(argv)
    rows = [{**r, **prov} for s in args.sharpness for r in study(args.seq_len, args.top_k, args.seed, s)]
    print("| indexer | sharpness | top_k | mass recall (a) | mass recall (b) block_mean | (b) causal | (b) previous 64 rows | "
          "(b) max-pooled | oracle | block recall b vs a | work (a) | work (b) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['indexer']} | {r['sharpness']} | {r['top_k']} | {r['mass_recall_a']:.3f} | {r['mass_recall_b']:.3f} | "
              f"{r['mass_recall_b_causal']:.3f} | {r['mass_recall_b_prev_window']:.3f} | {r['mass_recall_b_maxpool']:.3f} | "
              f"{r['mass_recall_oracle']:.3f} | "
              f"{r['block_recall_b_vs_a']:.3f} | {r['work_a']:.3f} | {r['work_b']:.3f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
