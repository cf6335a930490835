"""What a Mosaic query-side CTA's two consumers can share, per index family (issue 34 item 2; CPU,
no timing): the forward and dQ kernels run two consumer warpgroups per CTA over one stream of K/V
tiles; a step both consumers use keeps the FlashAttention-3 ping-pong (one's softmax under the
other's matmuls), a step only one uses runs its softmax and matmuls in series.

Per pairing of the CTA's two (head, query block) rows:

* ``blocks``: query blocks ``2p`` and ``2p + 1`` of one head (the kernels today);
* ``heads``: one query block of two query heads of the same KV group;
* ``separate``: each consumer its own tiles, the two lists interleaved (both busy while both have
  tiles);

and for the dK/dV block pass (KV-stationary: a CTA = KV blocks ``2p`` and ``2p + 1`` of one KV head, each
walking the (query head of its group, query block) tiles that list it, Q and dO loaded per tile):

* ``kv_blocks``: what one stream of the two KV blocks' tile lists (their union) would carry; today each
  consumer loads its own list (``stream_per_work`` 1.0), the pass that waits on these loads on spread /
  mixed / a trained model's index (results/kernels/kernels.md run 33);
* ``col_chunks``: the same for the column dK/dV pass (a CTA = column chunks ``2p``, ``2p + 1`` of one query
  head and one range of query blocks, each walking the query blocks that need it): what
  ``col_walk="shared"`` (one stream of the union of the two walks) carries per tile computed.

``stream_per_work`` = tiles the stream carries / tiles the two rows compute (0.5: every tile shared),
``paired_work`` = share of the rows' tiles computed in steps both consumers use. Block tiles only
(column tiles are per row in every pairing). For ``blocks`` also per CTA: ``cta_q10`` / ``cta_q50`` /
``cta_q90``, quantiles of each CTA's own ``stream_per_work`` (CTAs with work), and ``work_above_split``, the
share of the work in CTAs above ``SPLIT_ABOVE`` (what a per-CTA stream choice, instead of the per-call one,
would move to the other stream).

    python -m benchmarks.consumer_pairing --seq 131072 --densities 0.02,0.05 --json pairing.jsonl

``--model-index FILE`` (saved by ``python -m benchmarks.model_index``): the same for the indices a
trained model estimated (family ``model_L<layer>[_budget]``, heads repeated to ``--heads`` as
``benchmarks/kernels.py`` times them; ``density``: the file's mean over the model's heads), e.g. to
see which stream ``stream="auto"`` would take on a real model's index.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from pallas_kernels.testing import INDEX_FAMILIES, index_family

PAIRINGS = ("blocks", "heads", "separate")


def row_sets(index, b: int = 0):
    """``sets[h][i]``: the KV blocks query block ``i`` of head ``h`` lists."""
    bi, bc = np.asarray(index.block_idx)[b], np.asarray(index.block_count)[b]
    return [[set(bi[h, i, :bc[h, i]].tolist()) for i in range(bi.shape[1])] for h in range(bi.shape[0])]


def pairing_stats(sets, pairing: str) -> dict:
    """``{stream_per_work, paired_work}`` of one pairing (module docstring) over every CTA."""
    H, nqb = len(sets), len(sets[0])
    if pairing == "heads":
        pairs = [(sets[h][i], sets[h + 1][i]) for h in range(0, H - 1, 2) for i in range(nqb)]
    else:
        pairs = [(sets[h][2 * p], sets[h][2 * p + 1]) for h in range(H) for p in range(nqb // 2)]
    work = sum(len(a) + len(b) for a, b in pairs)
    if pairing == "separate":
        stream, paired = work, sum(2 * min(len(a), len(b)) for a, b in pairs)
    else:
        stream, paired = sum(len(a | b) for a, b in pairs), sum(2 * len(a & b) for a, b in pairs)
    out = {"stream_per_work": stream / work, "paired_work": paired / work}
    if pairing == "blocks":
        from pallas_kernels.mosaic_stream import SPLIT_ABOVE

        w = np.array([len(a) + len(b) for a, b in pairs if a or b], float)
        r = np.array([len(a | b) for a, b in pairs if a or b]) / w
        q = np.quantile(r, [0.1, 0.5, 0.9])
        out.update(cta_q10=float(q[0]), cta_q50=float(q[1]), cta_q90=float(q[2]),
                   work_above_split=float(w[r > SPLIT_ABOVE].sum() / w.sum()))
    return out


def kv_pairing_stats(sets, kv_heads: int) -> dict:
    """``{stream_per_work, paired_work}`` of pairing ``kv_blocks`` (module docstring): the dK/dV block
    pass's CTAs (KV blocks ``2p``, ``2p + 1`` of one KV head; query heads ``g * H / kv_heads`` onwards
    form KV head ``g``'s group) over ``sets[h][i]`` (the KV blocks query block ``i`` of head ``h`` lists)."""
    H = len(sets)
    if H % kv_heads:
        raise ValueError(f"kv_heads={kv_heads} must divide the {H} query heads")
    per = H // kv_heads
    lists = [dict() for _ in range(kv_heads)]  # lists[g][j]: the (query head, query block) tiles listing j
    for h in range(H):
        grp = lists[h // per]
        for i, kvs in enumerate(sets[h]):
            for j in kvs:
                grp.setdefault(j, set()).add((h, i))
    work = stream = paired = 0
    for grp in lists:
        for p in range((max(grp, default=-1) + 2) // 2):
            a, b = grp.get(2 * p, set()), grp.get(2 * p + 1, set())
            work += len(a) + len(b)
            stream += len(a | b)
            paired += 2 * len(a & b)
    return {"stream_per_work": stream / work if work else 1.0, "paired_work": paired / work if work else 0.0}


def col_pairing_stats(index, bs: int = 64, range_blocks: int = 512) -> dict:
    """``{stream_per_work, paired_work}`` of pairing ``col_chunks`` (module docstring) over every CTA of
    the column dK/dV pass (:func:`pallas_kernels.mosaic_dkv.mosaic_dkv_cols`'s chunks and ranges; no
    packed documents)."""
    from pallas_kernels.mosaic_index import column_ranges

    mcp = -(-max(index.max_cols, 1) // (2 * bs)) * 2 * bs  # as mosaic_index.column_tiles pads the list
    first, end, nr = column_ranges(index.col_count, mcp // bs, bs, range_blocks)
    r = np.arange(nr)[:, None, None, None] * range_blocks
    lo = np.maximum(np.asarray(first)[None], r)
    hi = np.maximum(np.minimum(np.asarray(end)[None], r + range_blocks), lo)  # [ranges, B, H, chunks]
    work = int((hi - lo).sum())
    both = int(np.maximum(0, np.minimum(hi[..., 0::2], hi[..., 1::2]) - np.maximum(lo[..., 0::2], lo[..., 1::2])).sum())
    return {"stream_per_work": (work - both) / work if work else 1.0, "paired_work": 2 * both / work if work else 0.0}


def _rows(sets, kv_heads: int, index=None, **fields) -> list:
    """One row per pairing (:data:`PAIRINGS`, then ``kv_blocks``, then with ``index`` ``col_chunks``) of
    ``sets``, each with ``fields``."""
    rows = [{"table": "consumer_pairing", **fields, "pairing": p, **pairing_stats(sets, p)} for p in PAIRINGS]
    rows += [{"table": "consumer_pairing", **fields, "pairing": "kv_blocks", **kv_pairing_stats(sets, kv_heads),
              "kv_heads": kv_heads}]
    if index is not None and int(np.asarray(index.col_count).max()) > 0:
        rows.append({"table": "consumer_pairing", **fields, "pairing": "col_chunks", **col_pairing_stats(index)})
    return rows


def measure(seq: int, densities, families=INDEX_FAMILIES, heads: int = 16, seed: int = 1, kv_heads: int = 2):
    rows = []
    for fam in families:
        for dens in densities:
            idx = index_family(np.random.default_rng(seed), fam, 1, heads, seq, dens)
            for row in _rows(row_sets(idx), kv_heads, idx, family=fam, S=seq, density=dens, heads=heads):
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def measure_model(path: str, heads: int = 16, kv_heads: int = 2):
    """The rows of :func:`measure` for every ``(layer, budget)`` index of the saved file ``path``."""
    from benchmarks.model_index import load_indices, step_entries

    entries, meta = load_indices(path)
    rows = []
    for layer, bud, idx, den in step_entries(entries, meta["seq_len"], heads, meta["block_size"]):
        fam = f"model_L{layer}" + "".join(f"_{k}{v}" for k, v in bud.items())
        rows += _rows(row_sets(idx), kv_heads, idx, family=fam, S=meta["seq_len"], density=float(den.mean()), heads=heads,
                      model_index=path)
    return rows


def table(rows) -> str:
    out = ["| family | density | stream / work: blocks / heads | paired work: blocks / heads / separate "
           "| blocks, per CTA: stream / work q10 / q50 / q90 | work in CTAs above SPLIT_ABOVE "
           "| dK/dV blocks: stream / work | dK/dV columns: stream / work |",
           "|---|---|---|---|---|---|---|---|"]
    keys = list(dict.fromkeys((r["family"], r["density"]) for r in rows))
    for fam, dens in keys:
        by = {r["pairing"]: r for r in rows if (r["family"], r["density"]) == (fam, dens)}
        out.append(f"| {fam} | {dens:.0%} | {by['blocks']['stream_per_work']:.2f} / {by['heads']['stream_per_work']:.2f} "
                   f"| {by['blocks']['paired_work']:.2f} / {by['heads']['paired_work']:.2f} / "
                   f"{by['separate']['paired_work']:.2f} | {by['blocks']['cta_q10']:.2f} / {by['blocks']['cta_q50']:.2f} / "
                   f"{by['blocks']['cta_q90']:.2f} | {by['blocks']['work_above_split']:.0%} | "
                   + (f"{by['kv_blocks']['stream_per_work']:.2f} |" if "kv_blocks" in by else "- |")
                   + (f" {by['col_chunks']['stream_per_work']:.2f} |" if "col_chunks" in by else " - |"))
    return "\n".join(out)


def main(argv=None):
    from benchmarks._driver import append_rows, provenance

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=131072)
    p.add_argument("--densities", default="0.02,0.05")
    p.add_argument("--families", default=",".join(INDEX_FAMILIES))
    p.add_argument("--model-index", help="instead of the synthetic families: a saved model index file "
                   "(python -m benchmarks.model_index --out)")
    p.add_argument("--heads", type=int, default=16, help="query heads (a model index's heads are repeated to this)")
    p.add_argument("--kv-heads", type=int, default=2, help="KV heads (the dK/dV pairing's groups; must divide --heads)")
    p.add_argument("--json", help="append the rows (JSONL) to this file")
    a = p.parse_args(argv)
    if a.kv_heads < 1 or a.heads % a.kv_heads:
        p.error(f"--kv-heads must divide --heads={a.heads}, got {a.kv_heads}")
    prov = provenance(argv)
    if a.model_index:
        try:
            rows = measure_model(a.model_index, a.heads, a.kv_heads)
        except ValueError as e:
            print(f"consumer_pairing: {e}", file=sys.stderr)
            return 1
    else:
        rows = measure(a.seq, [float(x) for x in a.densities.split(",")], a.families.split(","), heads=a.heads,
                       kv_heads=a.kv_heads)
    print(table(rows))
    append_rows(a.json, rows, prov)
    return 0


if __name__ == "__main__":
    sys.exit(main())
