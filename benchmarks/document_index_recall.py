"""Which observation window should the vertical-slash index use on packed documents? Measured recall.

MTraining's Algorithm 1 estimates the index from the last ``last_q`` queries of the sequence. On a
sequence packed from many documents those queries belong to the LAST document(s) only: under the
document mask they see nothing of the earlier documents, whose own verticals (their sinks and heavy
keys) the index then misses. Compared here, on the same q/k and the same budgets:

* ``sequence``: the last ``last_q`` queries of the sequence, masked to same-document pairs (what
  :func:`mtraining_jax.sparsity.estimate_index` does with ``segment_ids``; the library's index is
  used, and the NumPy estimator below is checked against it);
* ``per_document``: every document's own last ``min(last_q, length)`` queries;
* ``windows:W``: the last ``last_q`` queries of every ``W``-token window (fixed positions);
* ``library:WINDOW:N``: the library's :func:`~mtraining_jax.sparsity.estimate_index` with
  ``SparsityConfig(window=WINDOW, window_blocks=N)`` (``per_document`` capped at ``N`` query blocks).

Each window's rows are an exact softmax under the causal document mask; vertical (column) and slash
(64-block diagonal) scores are summed over the rows and selected by top-p over the rows' total
mass with the config's caps (the library's rule). Reported per variant: recall (mean over ALL query
rows of the causal document-masked softmax mass the index keeps, the project's recall metric
with segment ids, :func:`mtraining_jax.sparsity.metrics.recall`), the same over the rows of the
last document and of the others, the density (kept pairs / causal same-document pairs), the
kernel work fraction (:func:`kernel_work_fraction`: what the kernels execute on one device,
tiles across a boundary dropped, over dense causal work; columns are computed by every later
query block, masked outside their document) and the number of window rows (the estimate's cost
is ``rows x S`` logits).

q/k: :func:`mtraining_jax.sparsity.synthetic.synthetic_qk` per document (its own sink, heavy keys and
RoPE slash structure; seeds per document), concatenated; document lengths from the seeded length
mix of ``benchmarks/packed_documents.py``.

    PYTHONPATH=. python benchmarks/document_index_recall.py --seq 16384 --out /tmp/document_index_recall.json

The committed records: ``results/documents/documents.jsonl``, run ``index-recall`` (report:
``results/documents/packed_documents.md``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script: the repo root

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from benchmarks._driver import provenance  # noqa: E402
from benchmarks.packed_documents import length_mix  # noqa: E402

from mtraining_jax.sparsity import SparsityConfig, estimate_index  # noqa: E402
from mtraining_jax.sparsity.convert import convert_step  # noqa: E402
from pallas_kernels.index_format import apply_segments, step_work  # noqa: E402
from mtraining_jax.sparsity.index import VerticalSlashIndex  # noqa: E402
from mtraining_jax.sparsity.metrics import recall  # noqa: E402
from mtraining_jax.sparsity.synthetic import SyntheticAttention, packed_documents_qk  # noqa: E402
from pallas_kernels.reference import attention_logits  # noqa: E402


def packed_qk(lens, heads: int, kv_heads: int, head_dim: int, seed: int, sharpness: float):
    """``(q [1, S, H, D], k [1, S, Hkv, D], seg int32 [1, S])``: one synthetic document per length."""
    base = SyntheticAttention(num_q_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, sharpness=sharpness)
    return packed_documents_qk(lens, base, seed)


def window_rows(variant: str, seg: np.ndarray, last_q: int) -> np.ndarray:
    """Sorted global positions of the observation window's query rows."""
    S = seg.shape[-1]
    pos = np.arange(S)
    if variant == "sequence":
        return pos[S - last_q:]
    if variant == "per_document":
        ends = np.r_[np.nonzero(np.diff(seg[0]))[0] + 1, S]  # one past each document's last token
        return pos[pos >= ends[seg[0]] - last_q]
    if variant.startswith("windows:"):
        w = int(variant.split(":")[1])
        return pos[(pos % w) >= w - last_q]
    raise ValueError(f"unknown variant {variant!r}")


def estimate_from_rows(q, k, seg, rows, cfg: SparsityConfig) -> VerticalSlashIndex:
    """Algorithm 1 over the given query rows (exact softmax, causal and same document), float64
    scores, top-p over the rows' total mass with the config's per-head caps; diagonal 0 forced."""
    S, bs = k.shape[1], cfg.block_size
    nb = S // bs
    H = q.shape[2]
    seg_np = np.asarray(seg[0])
    vert = np.zeros((H, S))
    slash = np.zeros((H, nb))
    kp = np.arange(S)
    for i in range(0, len(rows), 256):
        r = rows[i: i + 256]
        z = np.asarray(attention_logits(q[:, r], k, cfg.sm_scale), np.float64)[0]  # [H, R, S]
        ok = (kp[None, :] <= r[:, None]) & (seg_np[kp][None, :] == seg_np[r][:, None])
        z = np.where(ok, z, -np.inf)
        a = np.exp(z - z.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        vert += a.sum(1)
        d = np.where(ok, r[:, None] // bs - kp[None, :] // bs, nb)
        for h in range(H):
            slash[h] += np.bincount(d.ravel(), weights=a[h].ravel(), minlength=nb + 1)[:nb]
    total = float(len(rows))

    def select(scores, p, kmin, kmax, size, force=None):
        idx = np.full((H, size), scores.shape[-1], np.int32)
        cnt = np.zeros(H, np.int32)
        for h in range(H):
            s = scores[h].copy()
            order = list(np.argsort(-s, kind="stable"))
            if force is not None:
                order.remove(force)
                order = [force] + order
            c = np.cumsum(s[order])
            n = int(np.searchsorted(c, p[h] * total - 1e-9) + 1)
            n = min(max(n, kmin[h]), kmax[h], size)
            idx[h, :n] = np.sort(np.asarray(order[:n]))
            cnt[h] = n
        return idx, cnt

    ph = lambda n: cfg.per_head(n, H)  # noqa: E731
    v_idx, v_cnt = select(vert, ph("vertical_p"), ph("vertical_min"), ph("vertical_max"), cfg.max_verticals(S))
    s_idx, s_cnt = select(slash, ph("slash_p"), ph("slash_min"), ph("slash_max"), cfg.max_slashes(S), force=0)
    return VerticalSlashIndex(*(jnp.asarray(x)[None] for x in (v_idx, v_cnt, s_idx, s_cnt)))


def kernel_work_fraction(index: VerticalSlashIndex, seg, bs: int) -> float:
    """Kernel slots of the single-device step index narrowed by ``apply_segments``
    (``index_format.step_work``) over those of the full causal block index."""
    S = seg.shape[-1]
    pos = jnp.arange(S, dtype=jnp.int32)
    step = apply_segments(convert_step(index, pos, pos, seq_len=S, block_size=bs), seg, seg, bs)
    nb = S // bs
    H = index.v_count.shape[1]
    return float(step_work(step, bs)) / (H * nb * (nb + 1) / 2 * bs**2)


def density(index: VerticalSlashIndex, seg, bs: int) -> float:
    """Kept (q, k) pairs / causal same-document pairs, over all heads (host)."""
    S = seg.shape[-1]
    s_np = np.asarray(seg[0])
    kp = np.arange(S)
    kept = tot = 0
    v_idx, v_cnt, s_idx, s_cnt = (np.asarray(x)[0] for x in index)
    for h in range(v_cnt.shape[0]):
        diag = np.zeros(S // bs + 1, bool)
        diag[s_idx[h, :s_cnt[h]]] = True
        vert = np.zeros(S, bool)
        vert[v_idx[h, :v_cnt[h]]] = True
        for i in range(0, S, 512):
            r = np.arange(i, min(S, i + 512))
            ok = (kp[None, :] <= r[:, None]) & (s_np[kp][None, :] == s_np[r][:, None])
            d = np.clip(r[:, None] // bs - kp[None, :] // bs, 0, S // bs)
            kept += int((ok & (diag[d] | vert[None, :])).sum())
            tot += int(ok.sum())
    return kept / tot


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--short", type=int, nargs=2, default=[128, 2048], help="short document lengths (log-uniform)")
    ap.add_argument("--long-docs", type=int, default=2)
    ap.add_argument("--long-share", type=float, default=0.5)
    ap.add_argument("--sharpness", type=float, default=1.0)
    ap.add_argument("--ps", type=float, nargs="+", default=[0.9], help="top-p of verticals and slashes")
    ap.add_argument("--variants", nargs="+", default=["sequence", "per_document", "windows:2048"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    records = []
    for seed, p in [(s_, p_) for s_ in a.seeds for p_ in a.ps]:
        cfg = SparsityConfig(vertical_p=p, slash_p=p)
        lens = length_mix(a.seq, seed, short=tuple(a.short), long_docs=a.long_docs, long_share=a.long_share)
        q, k, seg = packed_qk(lens, a.heads, a.kv_heads, a.head_dim, seed, a.sharpness)
        S = a.seq
        s_np = np.asarray(seg[0])
        last = np.nonzero(s_np == s_np[-1])[0]
        others = np.nonzero(s_np != s_np[-1])[0]
        lib = estimate_index(q, k, jnp.arange(S, dtype=jnp.int32), cfg, segment_ids=seg)
        for variant in a.variants:
            if variant.startswith("library:"):
                _, window, nblk = variant.split(":")
                lcfg = dataclasses.replace(cfg, window=window, window_blocks=int(nblk))
                idx = estimate_index(q, k, jnp.arange(S, dtype=jnp.int32), lcfg, segment_ids=seg)
                rows = window_rows(window, s_np[None], cfg.last_q)
                rows = rows[rows >= np.sort(np.unique(rows // cfg.block_size))[-int(nblk):][0] * cfg.block_size]
            else:
                rows = window_rows(variant, s_np[None], cfg.last_q)
                idx = estimate_from_rows(q, k, seg, rows, cfg)
            if variant == "sequence":  # the NumPy estimator reproduces the library's index
                same = [np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(idx[1::2], lib[1::2])]
                print("sequence estimator equals estimate_index counts:", same, flush=True)
            rec_all = recall(q, k, idx, segment_ids=seg)
            rec = {"variant": variant, "seed": seed, "seq": S, "documents": int(len(lens)),
                   "doc_len_min_median_max": [int(lens.min()), int(np.median(lens)), int(lens.max())],
                   "last_doc_len": int(len(last)), "window_rows": int(len(rows)),
                   "recall": float(rec_all.mean()),
                   "recall_last_doc": float(recall(q, k, idx, rows=last, segment_ids=seg).mean()),
                   "recall_other_docs": float(recall(q, k, idx, rows=others, segment_ids=seg).mean()),
                   "density": density(idx, seg, cfg.block_size),
                   "kernel_work_fraction": kernel_work_fraction(idx, seg, cfg.block_size),
                   "verticals_mean": float(np.asarray(idx.v_count).mean()),
                   "slashes_mean": float(np.asarray(idx.s_count).mean()), "p": p, "sharpness": a.sharpness}
            print(json.dumps(rec), flush=True)
            records.append(rec)
    meta = provenance(argv)  # commit, code, date, command, jax, device
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
