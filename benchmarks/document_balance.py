"""Load balance of the sparse ring with packed documents (issue 21): worker- and step-level
imbalance (MTraining §3.3) of the EXECUTED ring — the work per (worker, ring step) that the
operator's kernels run after the document mask drops cross-document tiles
(:class:`~mtraining_jax.attention.mtraining.MTrainingStats`) — for the same packed synthetic data
as a stream, with documents and the sequence window, and with documents and the per-document window,
on the block-striped and zig-zag layouts.

    python -m benchmarks.document_balance --seq 8192 --mesh 2x4 --seed 0 --out results.json

CPU is enough (forward only, XLA twin: the work matrix does not depend on the kernel backend; 8
virtual devices are forced). At 16K on a 2-core machine one device's share of the estimate can take
longer than the CPU backend's 40 s collective rendezvous, which aborts the process: stay at 8K there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks._driver import provenance  # noqa: E402
from benchmarks.packed_documents import length_mix  # noqa: E402
from mtraining_jax.attention.mtraining import MTrainingConfig, mtraining_attention, stats_scalars  # noqa: E402
from mtraining_jax.mesh import make_mesh  # noqa: E402
from mtraining_jax.ring.config import RingOptions  # noqa: E402
from mtraining_jax.sparsity.synthetic import SyntheticAttention, packed_documents_qk  # noqa: E402

MODES = ("stream", "documents", "documents_per_doc")


def measure(q, k, v, seg, mesh, cfg: MTrainingConfig, mode: str) -> dict:
    """Imbalance and work of one (layout, mode) on natural-order ``q, k, v, seg``."""
    P = mesh.shape["node"] * mesh.shape["local"]
    S = q.shape[1]
    lay = cfg.make_layout(S, P)
    if mode == "documents_per_doc":
        cfg = dataclasses.replace(cfg, sparsity=dataclasses.replace(cfg.sparsity, window="per_document"))
    sg = None if mode == "stream" else lay.permute(seg, axis=-1)
    fn = jax.jit(lambda a, b, c, s: mtraining_attention(a, b, c, mesh, cfg, segment_ids=s, return_stats=True))
    _, st = fn(lay.permute(q), lay.permute(k), lay.permute(v), sg)
    W = np.asarray(st.work, np.float64)
    sc = stats_scalars(st.work, q.shape[0], q.shape[2], S, cfg.block_size)
    return {"layout": cfg.layout, "ring_order": cfg.ring.ring_order, "mode": mode,
            "worker_imbalance": st.worker_imbalance(), "step_imbalance": st.step_imbalance(),
            "work_fraction": float(sc["work_fraction"]), "max_worker_share": float(W.sum(1).max() / W.sum() * P)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--mesh", default="2x4", help="NODExLOCAL")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layouts", nargs="+", default=["block_striped", "zigzag"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="JSON file for the records")
    a = ap.parse_args(argv)
    nodes, local = (int(x) for x in a.mesh.lower().split("x"))
    mesh = make_mesh((nodes, local), jax.devices()[:nodes * local])
    lens = length_mix(a.seq, a.seed)
    q, k, seg = packed_documents_qk(lens, SyntheticAttention(num_q_heads=a.heads, num_kv_heads=a.kv_heads,
                                                             head_dim=a.head_dim), a.seed)
    v = jax.random.normal(jax.random.PRNGKey(a.seed), k.shape, k.dtype)
    recs = []
    for layout in a.layouts:
        cfg = MTrainingConfig(layout=layout, ring=RingOptions(ring_order="hierarchical", impl="xla"))
        for mode in MODES:
            r = measure(q, k, v, seg, mesh, cfg, mode)
            recs.append(r)
            print(f"{layout:13s} {mode:18s} worker {r['worker_imbalance']:.3f}  step {r['step_imbalance']:.3f}  "
                  f"work {r['work_fraction']:.4f}  busiest worker {r['max_worker_share']:.3f}x mean", flush=True)
    meta = {**provenance(argv), "platform": platform.platform(), "seq": a.seq, "mesh": a.mesh,
            "documents": int(len(lens)), "doc_len_min_median_max": [int(min(lens)), int(np.median(lens)), int(max(lens))],
            "heads": a.heads, "kv_heads": a.kv_heads, "head_dim": a.head_dim, "seed": a.seed}
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "records": recs}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
