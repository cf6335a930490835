"""Dense ring vs MTraining sparse ring, forward+backward, scaling over GPUs (issues 5 and 8).

For each mesh ``(node, local)`` (``--meshes 1x1 1x2 1x4 1x8 2x4``; ``--gpus P`` = ``1xP``), ring order
(``--ring-orders hierarchical flat``; identical schedules on a ``1xP`` mesh, so run once there) and
length, at a fixed TOTAL length (``--lengths``) and/or a fixed PER-GPU length
(``--per-gpu-length``: ``S = that x P``): B=1, 16 query / 2 KV heads, head_dim 128, bfloat16, q/k
from the synthetic vertical-slash generator (RoPE, channel means, outlier keys), block_striped layout.
Reports the median time of jit(value_and_grad) for

* dense ring (``ring_attention``: dense causal flash per step),
* sparse ring (``mtraining_attention``: online index + block-sparse kernel per step),

the index density, worker- and step-level imbalance of the executed sparse ring, the time of one K/V
ring transfer alone (per ring axis) and the exposed-communication bound it gives, and optionally
(``--check``) a sampled-row correctness check (output and dq of 256 random query rows against the
masked float32 reference of the same index), and with ``--profile`` a traced step
(``benchmarks/trace_summary.py``: per-GPU kernel breakdown, each XLA kernel attributed to its JAX
op and source line, and the MEASURED exposed communication: NCCL time with no compute kernel running,
with its longest stretches). The fwd+bwd step is timed per isolated call (``sparse_fwdbwd_s``) and
back to back (``sparse_fwdbwd_steady_s``, as a training loop runs). ``--fuse none backward both``
runs each multi-GPU case once per fused-kernel-call variant (``RingOptions.fuse_forward`` /
``fuse_backward``; default ``both``, the library default); ``--backward-ring kv query`` once per
backward side (``RingOptions.backward_ring`` / ``ring_attention(backward_ring=)``; default
``auto``; every side also on one GPU, where they must cost the same). Appends JSON lines to
``--out/sparse_ring.jsonl``, writes the optimized HLO of each multi-GPU sparse step and its schedule
reduced to collectives and kernels (``schedule_S*.txt``),
then the scaling table (``scaling_table.md``) and a throughput-vs-GPUs plot (``scaling.png``).
``--report JSONL...`` only turns existing records into the table and plot (records without a
"mesh" field, as written before issue 8, are read as ``1xP``, hierarchical, fixed total length).

    # issue 5 (1-2 GPUs)
    python -m benchmarks.sparse_ring --lengths 131072 262144 --gpus 1 2 --out /tmp/out
    # issue 8 (8 GPUs): strong scaling at 256K/512K, weak scaling at 64K per GPU, (2,4) both orders
    python -m benchmarks.sparse_ring --lengths 262144 524288 --per-gpu-length 65536 \\
        --meshes 1x1 1x2 1x4 1x8 2x4 --ring-orders hierarchical flat --repeat 3 --check --out /tmp/out
    # table + plot from existing records
    python -m benchmarks.sparse_ring --report results/ring/ring.jsonl --runs x4a,x4c \\
        --plot /tmp/scaling_4gpu.png --table /tmp/scaling_4gpu.md
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("XLA_FLAGS", "")
for flag in ("--xla_gpu_enable_latency_hiding_scheduler=true",):
    if flag.split("=")[0] not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += " " + flag

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from benchmarks._driver import provenance  # noqa: E402
from benchmarks._timing import steady_state, timeit  # noqa: E402
from benchmarks.hlo import op_counts, schedule_outline  # noqa: E402
from benchmarks.ring_comm import transfer_units  # noqa: E402
from benchmarks.trace_summary import summarize_dir  # noqa: E402
from mtraining_jax.attention.mtraining import MTrainingConfig, mtraining_attention  # noqa: E402
from pallas_kernels.reference import dense_attention  # noqa: E402
from mtraining_jax.ring.attention import ring_attention  # noqa: E402
from mtraining_jax.ring.config import RingOptions  # noqa: E402
from mtraining_jax.ring.schedule import RING_ORDERS  # noqa: E402
from mtraining_jax.ring.exchange import KV_EXCHANGES  # noqa: E402
from mtraining_jax.ring.sides import BACKWARD_RINGS, resolve_backward_ring  # noqa: E402
from mtraining_jax.mesh import CP_AXES, LOCAL_AXIS, NODE_AXIS, make_mesh, sequence_sharding  # noqa: E402
from mtraining_jax.sparsity import SparsityConfig, convert_index, estimate_index_shard  # noqa: E402
from mtraining_jax.sparsity.index import active_diagonals, vertical_flags  # noqa: E402
from mtraining_jax.sparsity.metrics import density  # noqa: E402
from mtraining_jax.sparsity.synthetic import SyntheticAttention, synthetic_qk  # noqa: E402

HQ, HKV, D = 16, 2, 128
METHODS = ("dense", "sparse")

def make_inputs(S, seed=0, sharpness=1.0):
    syn = SyntheticAttention(seq_len=S, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, seed=seed,
                             sharpness=sharpness, num_outliers=64)
    q, k = synthetic_qk(syn)
    v = jax.random.normal(jax.random.PRNGKey(seed + 1), (1, S, HKV, D), jnp.float32)
    cot = jax.random.normal(jax.random.PRNGKey(seed + 2), (1, S, HQ, D), jnp.float32)
    return q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), cot.astype(jnp.bfloat16)


def sampled_check(q, k, v, cot, out, dq, index, rows, bs):
    """Relative errors of out and dq on natural-order query ``rows`` vs the masked f32 reference."""
    S = q.shape[1]
    vert = vertical_flags(index, S)[0]  # [H, S]
    diag = active_diagonals(index, S // bs)[0]  # [H, nb]
    kpos = jnp.arange(S)
    qb = rows // bs
    d = qb[:, None] - kpos[None, :] // bs  # [R, S]
    allowed = (kpos[None, :] <= rows[:, None])[None] & (
        vert[:, None, :] | jnp.take_along_axis(diag[:, None, :].repeat(len(rows), 1), jnp.clip(d, 0)[None].repeat(HQ, 0), axis=2))
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    q_r, cot_r = f32(q[:, rows]), f32(cot[:, rows])

    def ref(q_r):
        o, _ = dense_attention(q_r, f32(k), f32(v), q_pos=rows, k_pos=kpos, mask=allowed[None])
        return jnp.sum(o * cot_r), o

    (_, o_ref), dq_ref = jax.value_and_grad(ref, has_aux=True)(q_r)
    o_got, dq_got = f32(out[:, rows]), f32(dq[:, rows])  # out, dq already in natural order
    rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))  # noqa: E731
    return rel(o_got, o_ref), rel(dq_got, dq_ref)


def index_only(q, k, mesh, cfg, layout):
    """Index estimation + per-step conversion alone (what the sparse ring adds before its steps)."""
    nodes, local = mesh.shape["node"], mesh.shape["local"]
    spec = PartitionSpec(None, CP_AXES, None, None)

    def body(q_l, k_l):
        rank = jax.lax.axis_index(CP_AXES)
        pos = jnp.asarray(layout.positions, jnp.int32)[rank]
        index = estimate_index_shard(q_l, k_l, pos, cfg.sparsity, axis_names=CP_AXES)
        st = convert_index(index, rank, layout.positions, num_nodes=nodes, num_local=local,
                           ring_order=cfg.ring.ring_order, block_size=cfg.block_size)
        return (st.block_count.sum() + st.col_count.sum() + st.col_idx.sum() + st.block_idx.sum())[None]

    return jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=PartitionSpec(CP_AXES),
                         check_vma=False)(q, k)


# ----------------------------------------------------------------------------- communication model

def parse_mesh(text: str) -> tuple[int, int]:
    """``"NxL"`` -> ``(N, L)`` (node x local); ``ValueError`` naming the text otherwise."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise ValueError(f"mesh must be NODExLOCAL with positive integers, e.g. 2x4; got {text!r}")
    return int(parts[0]), int(parts[1])


def time_ppermute(kv, mesh, axis, size, repeat):
    """Median time of one ring shift of the stacked K/V buffer (sequence-sharded) along ``axis``."""
    spec = PartitionSpec(None, None, CP_AXES)
    shift = jax.jit(jax.shard_map(lambda x: jax.lax.ppermute(x, axis, [(i, (i + 1) % size) for i in range(size)]),
                                  mesh=mesh, in_specs=spec, out_specs=spec))
    return timeit(shift, jax.device_put(kv, NamedSharding(mesh, spec)), repeat=repeat)[0]


def exposed_bound(rec: dict, step_s: float) -> float | None:
    """Upper bound on the exposed communication fraction: all ring transfers serialized / step time."""
    N, L = rec["nodes"], rec["local"]
    if N * L == 1:
        return 0.0
    if "kv_ppermute_s" not in rec or rec.get("kv_exchange", "ring") != "ring":
        return None  # the sparse exchange's bytes depend on its capacity and run-time fallbacks
    side = resolve_backward_ring(rec.get("backward_ring", "kv"), heads=HQ, kv_heads=HKV, head_dim=D, itemsize=2)
    # in bf16 K/V buffers, as timed
    inner, outer = transfer_units(N, L, rec["ring_order"], backward_ring=side, heads_per_kv=HQ // HKV, head_dim=D)
    t_outer = rec.get("kv_ppermute_outer_s", rec["kv_ppermute_s"])
    return (inner * rec["kv_ppermute_s"] + outer * t_outer) / step_s


# ----------------------------------------------------------------------------- measurement

FUSE = {"none": (False, False), "backward": (False, True), "forward": (True, False), "both": (True, True)}


def run_case(S, mesh_shape, ring_order, args, out_dir, fuse="both", backward_ring="auto", kv_exchange="ring"):
    N, L = mesh_shape
    P = N * L
    mesh = make_mesh((N, L), jax.devices()[:P])
    sp = SparsityConfig()  # defaults: p = 0.9, verticals <= 4096, slashes <= 64 diagonals
    fuse_fwd, fuse_bwd = FUSE[fuse]
    cfg = MTrainingConfig(sparsity=sp, layout="block_striped", ring=RingOptions(
        ring_order=ring_order, fuse_forward=fuse_fwd, fuse_backward=fuse_bwd, backward_ring=backward_ring,
        kv_exchange=kv_exchange, exchange_capacity=args.exchange_capacity))
    layout = cfg.make_layout(S, P)
    q, k, v, cot = make_inputs(S, sharpness=args.sharpness)
    shard = sequence_sharding(mesh)
    lq, lk, lv, lc = (jax.device_put(layout.permute(x), shard) for x in (q, k, v, cot))
    perm = jax.device_put(jnp.asarray(layout.perm), NamedSharding(mesh, PartitionSpec(CP_AXES)))

    ring_kw = dict(ring_order=ring_order, fuse_forward=fuse_fwd, fuse_backward=fuse_bwd, backward_ring=backward_ring)

    def dense_loss(q, k, v, c):
        o = ring_attention(q, k, v, perm, mesh, **ring_kw)
        return jnp.sum(o.astype(jnp.float32) * c.astype(jnp.float32))

    def sparse_loss(q, k, v, c):
        o, st = mtraining_attention(q, k, v, mesh, cfg, return_stats=True)
        return jnp.sum(o.astype(jnp.float32) * c.astype(jnp.float32)), (o, st)

    dense_fb = jax.jit(jax.grad(dense_loss, argnums=(0, 1, 2)))
    sparse_fb = jax.jit(jax.value_and_grad(sparse_loss, argnums=(0, 1, 2), has_aux=True))
    sparse_f = jax.jit(lambda q, k, v: mtraining_attention(q, k, v, mesh, cfg))
    dense_f = jax.jit(lambda q, k, v: ring_attention(q, k, v, perm, mesh, **ring_kw))
    rec = {**provenance(), "S": S, "gpus": P, "mesh": f"{N}x{L}", "nodes": N, "local": L, "ring_order": ring_order, "fuse": fuse,
           "backward_ring": backward_ring, "kv_exchange": kv_exchange, "device": jax.devices()[0].device_kind, "jax": jax.__version__}
    if args.tag:
        rec["run"] = args.tag
    rec["index_s"], _ = timeit(jax.jit(lambda q, k: index_only(q, k, mesh, cfg, layout)), lq, lk, repeat=args.repeat)
    if args.index_only:
        return rec
    rec["sparse_fwd_s"], _ = timeit(sparse_f, lq, lk, lv, repeat=args.repeat)
    rec["sparse_fwdbwd_s"], _ = timeit(sparse_fb, lq, lk, lv, lc, repeat=args.repeat)
    # back-to-back calls, one sync at the end: per-step time as a training loop sees it
    rec["sparse_fwdbwd_steady_s"], _ = steady_state(sparse_fb, lq, lk, lv, lc, repeat=args.repeat)
    if not args.skip_dense and (args.dense_meshes is None or f"{N}x{L}" in args.dense_meshes):
        rec["dense_fwd_s"], _ = timeit(dense_f, lq, lk, lv, repeat=args.repeat)
        rec["dense_fwdbwd_s"], _ = timeit(dense_fb, lq, lk, lv, lc, repeat=args.repeat)
        rec["speedup_fwdbwd"] = rec["dense_fwdbwd_s"] / rec["sparse_fwdbwd_s"]
    (_, (o, st)), grads = sparse_fb(lq, lk, lv, lc)
    rec["density"] = float(np.mean(density(st.index, S)))
    rec["worker_imbalance"] = st.worker_imbalance()
    rec["step_imbalance"] = st.step_imbalance()
    if args.check:
        rows = jnp.asarray(np.sort(np.random.default_rng(0).choice(S, 256, replace=False)), jnp.int32)
        rec["check_out_rel"], rec["check_dq_rel"] = sampled_check(
            q, k, v, cot, layout.unpermute(o), layout.unpermute(grads[0]), st.index, rows, cfg.block_size)
    hlo = sparse_fb.lower(lq, lk, lv, lc).compile().as_text() if args.profile or P > 1 else ""
    if args.profile:  # one traced sparse fwd+bwd step: per-GPU kernel breakdown and measured exposed comm
        tdir = os.path.join(out_dir, f"profile_S{S}_{N}x{L}_{ring_order}_{fuse}_{backward_ring}_{kv_exchange}")
        with jax.profiler.trace(tdir, create_perfetto_trace=True):
            jax.block_until_ready(sparse_fb(lq, lk, lv, lc))
        summary = summarize_dir(tdir, top=60, hlo_text=hlo)
        rec["sparse_trace"] = summary
        spans = [d["span_ms"] for d in summary.values() if d.get("kernels")]
        if spans:
            rec["sparse_exposed_comm_measured"] = max(d["exposed_comm_ms"] / d["span_ms"]
                                                      for d in summary.values() if d.get("kernels"))
        for dev, d in summary.items():
            print(f"{dev}: " + json.dumps({k: v for k, v in d.items() if k != "top"}), flush=True)
            for t in d.get("top", []):
                print(f"    {t['ms']:8.2f} ms x{t['count']:<4} {t['name'][:60]}  {t.get('src', '')}", flush=True)
    if P > 1:
        # communication: one K/V-buffer ring shift alone (what each ring step must hide), per ring axis
        kv = jnp.stack([lk, lv])
        if ring_order == "flat":
            rec["kv_ppermute_s"] = time_ppermute(kv, mesh, CP_AXES, P, args.repeat)
        else:
            inner = LOCAL_AXIS if L > 1 else NODE_AXIS
            rec["kv_ppermute_s"] = time_ppermute(kv, mesh, inner, L if L > 1 else N, args.repeat)
            if N > 1 and L > 1:
                rec["kv_ppermute_outer_s"] = time_ppermute(kv, mesh, NODE_AXIS, N, args.repeat)
        for m in METHODS:
            if f"{m}_fwdbwd_s" in rec:
                rec[f"{m}_exposed_comm_bound"] = exposed_bound(rec, rec[f"{m}_fwdbwd_s"])
    if P > 1:
        with open(os.path.join(out_dir, f"sparse_fwdbwd_S{S}_{N}x{L}_{ring_order}_{fuse}_{backward_ring}_{kv_exchange}.hlo.txt"),
                  "w") as f:
            f.write(hlo)
        with open(os.path.join(out_dir, f"schedule_S{S}_{N}x{L}_{ring_order}_{fuse}_{backward_ring}_{kv_exchange}.txt"), "w") as f:
            f.write("\n".join(schedule_outline(hlo)) + "\n")
        ops = op_counts(hlo)
        rec["hlo_collective_permute_starts"] = ops["collective-permute-start"]
        rec["hlo_collective_permute_sync"] = ops["collective-permute"]
    return rec


def plan(args) -> list[tuple[str, int, tuple[int, int], str]]:
    """``(mode, S, (N, L), ring_order)`` cases in run order; skips (with a message) meshes larger
    than the device count and the flat order on ``1xP`` meshes (same schedule as hierarchical)."""
    meshes = [parse_mesh(m) for m in args.meshes] if args.meshes else [(1, p) for p in args.gpus]
    ndev = len(jax.devices())
    cases = []
    for N, L in meshes:
        if N * L > ndev:
            print(f"skip mesh {N}x{L}: needs {N * L} devices, only {ndev} available", flush=True)
            continue
        orders = args.ring_orders if N > 1 else args.ring_orders[:1]
        if N == 1 and len(args.ring_orders) > 1:
            print(f"mesh 1x{L}: ring orders {args.ring_orders} give the same schedule; running "
                  f"{orders[0]} only", flush=True)
        for order in orders:
            cases += [("total", S, (N, L), order) for S in args.lengths]
            if args.per_gpu_length:
                cases.append(("per_gpu", args.per_gpu_length * N * L, (N, L), order))
    return cases


# ----------------------------------------------------------------------------- report

def normalize(rec: dict) -> dict:
    """Fill the issue-8 fields of older records (``gpus`` only: a ``1xP`` mesh, hierarchical, fixed total)."""
    rec = dict(rec)
    if "mesh" not in rec:
        rec.update(mesh=f"1x{rec['gpus']}", nodes=1, local=rec["gpus"])
    rec.setdefault("ring_order", "hierarchical")
    rec.setdefault("mode", "total")
    rec.setdefault("fuse", "pre-v11")  # no fused kernel calls, backward ring in forward order
    rec.setdefault("backward_ring", "kv")  # before issue 22: the K/V side only
    rec.setdefault("kv_exchange", "ring")  # before issue 22: the ring only
    if rec["gpus"] == 1:
        rec["fuse"] = "n/a"  # one chunk: nothing to fuse, every variant is the same program
    return rec


def merge(records: list[dict]) -> list[dict]:
    """One record per case ``(device, mode, S, mesh, ring order, fuse)``; for every field the LAST record that has it wins
    (so a later ``--skip-dense`` or ``--index-only`` run updates only the fields it measured)."""
    cases: dict[tuple, dict] = {}
    for rec in map(normalize, records):
        key = (rec.get("device"), rec["mode"], rec["S"], rec["mesh"], rec["ring_order"], rec["fuse"],
               rec["backward_ring"], rec["kv_exchange"])
        cases.setdefault(key, {}).update(rec)
    return list(cases.values())


def scaling_rows(cases: list[dict]) -> list[dict]:
    """Per (case, method): time, tokens/s, speedup over P = 1, efficiency, imbalance, comm bound.

    Speedup over P = 1: fixed total length, ``t(1) / t(P)`` at the same S; fixed per-GPU length,
    the ratio of attended (q, k) pairs per second (dense: all causal pairs; sparse: density x causal
    pairs), since the work of causal attention grows as S^2 while GPUs grow as P. Efficiency =
    speedup / P. The P = 1 baseline is the 1x1 case of the same device, mode and length.
    """
    def pairs(c, m):
        causal = c["S"] * (c["S"] + 1) / 2
        return causal * (c["density"] if m == "sparse" else 1.0)

    base = {}  # the P = 1 record of the same variant (backward side, exchange), else any variant's
    for c in cases:
        if c["gpus"] == 1:
            key = (c.get("device"), c["mode"], c["S"] if c["mode"] == "total" else c["S"] // c["gpus"])
            base.setdefault(key, c)
            base[key + (c["backward_ring"], c["kv_exchange"])] = c
    rows = []
    for c in sorted(cases, key=lambda c: (c["mode"] != "total", c["S"] // (c["gpus"] if c["mode"] == "per_gpu" else 1),
                                          c["gpus"], c["nodes"], c["ring_order"])):
        key = (c.get("device"), c["mode"], c["S"] if c["mode"] == "total" else c["S"] // c["gpus"])
        b = base.get(key + (c["backward_ring"], c["kv_exchange"]), base.get(key))
        for m in METHODS:
            t = c.get(f"{m}_fwdbwd_s")
            if t is None:
                continue
            row = dict(mode=c["mode"], S=c["S"], mesh=c["mesh"], gpus=c["gpus"], ring_order=c["ring_order"],
                       fuse=c["fuse"], backward_ring=c["backward_ring"], kv_exchange=c["kv_exchange"],
                       method=m, time_s=t, tokens_per_s=c["S"] / t, speedup=None, efficiency=None,
                       worker_imbalance=c.get("worker_imbalance") if m == "sparse" else None,
                       step_imbalance=c.get("step_imbalance") if m == "sparse" else None,
                       exposed_bound=exposed_bound(c, t), exposed_measured=c.get(f"{m}_exposed_comm_measured"),
                       device=c.get("device"))
            tb = b.get(f"{m}_fwdbwd_s") if b else None
            if tb is not None:
                if c["mode"] == "total":
                    row["speedup"] = tb / t
                elif m == "dense" or ("density" in c and "density" in b):
                    row["speedup"] = (pairs(c, m) / t) / (pairs(b, m) / tb)
                if row["speedup"] is not None:
                    row["efficiency"] = row["speedup"] / c["gpus"]
            rows.append(row)
    return rows


def _fmt(x, spec, suffix=""):
    return "–" if x is None else f"{x:{spec}}{suffix}"


def _rate(x):
    return f"{x / 1e6:.2f} M" if x >= 1e6 else f"{x / 1e3:.1f} k"


def _len(S):
    return f"{S // 1024}K" if S % 1024 == 0 else str(S)


def _exposed(r) -> str:
    """Exposed communication: measured from a trace where there is one, then the upper bound."""
    pct = lambda x: _fmt(None if x is None else 100 * x, ".1f", " %")  # noqa: E731
    if r.get("exposed_measured") is None:
        return f"({pct(r['exposed_bound'])})"
    return f"{pct(r['exposed_measured'])} ({pct(r['exposed_bound'])})"


def markdown_table(rows: list[dict]) -> str:
    head = ("| mode | S | mesh (node x local) | ring | method | fwd+bwd | tokens/s | speed-up vs P=1 | "
            "efficiency | worker ID | step ID | exposed comm: traced (bound) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        mode = "fixed total" if r["mode"] == "total" else f"{_len(r['S'] // r['gpus'])}/GPU"
        lines.append(
            f"| {mode} | {_len(r['S'])} | {r['mesh']} | "
            f"{r['ring_order'] + ', fused: ' + r['fuse'] + ', ' if r['gpus'] > 1 else ''}"
            f"bwd {r['backward_ring']}, {r['kv_exchange']} | "
            f"{r['method']} | "
            f"{r['time_s'] * 1e3:.1f} ms | {_rate(r['tokens_per_s'])} | {_fmt(r['speedup'], '.2f', '×')} | "
            f"{_fmt(None if r['efficiency'] is None else 100 * r['efficiency'], '.0f', ' %')} | "
            f"{_fmt(r['worker_imbalance'], '.3f')} | {_fmt(r['step_imbalance'], '.3f')} | "
            f"{_exposed(r)} |")
    return "\n".join(lines)


def targets(rows: list[dict]) -> str:
    """Issue 8's targets, evaluated on what the rows contain ("not measured" otherwise)."""
    def get(mode, S, mesh, method, order=None):
        for r in rows:
            if ((r["mode"], r["S"], r["mesh"], r["method"]) == (mode, S, mesh, method)
                    and order in (None, r["ring_order"])):
                return r
        return None

    S = 524288
    out = ["| target | measured | met? |", "|---|---|---|"]
    one_level = sorted({r["gpus"] for r in rows if r["mesh"].startswith("1x") and r["S"] == S and r["gpus"] > 1})
    pmax = one_level[-1] if one_level else None
    tag = "" if pmax == 8 else f" (measured on {pmax} GPUs: 8 not available)" if pmax else ""
    rp = get("total", S, f"1x{pmax}", "sparse") if pmax else None
    if rp and rp["efficiency"] is not None:
        out.append(f"| sparse ring strong-scaling efficiency ≥ 85 % from 1 to 8 GPUs at 512K{tag} | "
                   f"{100 * rp['efficiency']:.0f} % (1x{pmax}) | {'yes' if rp['efficiency'] >= 0.85 else '**no**'} |")
    else:
        out.append("| sparse ring strong-scaling efficiency ≥ 85 % from 1 to 8 GPUs at 512K | not measured | – |")
    dp = get("total", S, f"1x{pmax}", "dense") if pmax else None
    if rp and dp:
        x = dp["time_s"] / rp["time_s"]
        out.append(f"| sparse ≥ 6× dense at 512K on 8 GPUs{tag} | {x:.1f}× (1x{pmax}) | {'yes' if x >= 6 else '**no**'} |")
    else:
        out.append("| sparse ≥ 6× dense at 512K on 8 GPUs | not measured | – |")
    found = False
    for r in rows:
        if not r["mesh"].startswith("1x") and r["ring_order"] == "hierarchical":
            f = get(r["mode"], r["S"], r["mesh"], r["method"], "flat")
            if f:
                found = True
                ok = r["time_s"] <= f["time_s"]
                out.append(f"| hierarchical no slower than flat on ({r['mesh'].replace('x', ',')}), {r['method']} "
                           f"{_len(r['S'])} ({'fixed total' if r['mode'] == 'total' else 'per GPU'}) | "
                           f"{r['time_s'] * 1e3:.1f} vs {f['time_s'] * 1e3:.1f} ms | {'yes' if ok else '**no**'} |")
    if not found:
        out.append("| hierarchical no slower than flat on (2,4) | not measured | – |")
    return "\n".join(out)


def plot(rows: list[dict], path: str) -> None:
    """Left: throughput (tokens/s, log-log) vs GPUs. One colour per (mode, length, method): solid/dashed
    line with dots for the one-level meshes 1xP, hollow squares (hierarchical) and triangles (flat)
    for two-level meshes NxL, and for fixed-total series a dotted ideal-linear line from P = 1.
    Right: per-GPU efficiency of the fixed-total series that have a 1-GPU point,
    ``tokens_per_s(P) / (P * tokens_per_s(1))``, same colours and markers; weak-scaling (per-GPU length)
    series as the same ratio in active pairs per second (their rows' ``efficiency``)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["mode"] != "total", r["S"] if r["mode"] == "total" else r["S"] // r["gpus"],
                           r["method"]), []).append(r)
    fig, (ax, eff_ax) = plt.subplots(1, 2, figsize=(12, 4.8), constrained_layout=True,
                                     gridspec_kw={"width_ratios": [1.4, 1]})
    for i, ((per_gpu, length, method), rs) in enumerate(sorted(groups.items())):
        color = f"C{i % 10}"
        name = f"{method}, {_len(length)}" + ("/GPU" if per_gpu else " total")
        one = sorted((r for r in rs if r["mesh"].startswith("1x")), key=lambda r: r["gpus"])
        if one:
            ax.plot([r["gpus"] for r in one], [r["tokens_per_s"] for r in one], marker="o", color=color,
                    ls="-" if method == "sparse" else "--", label=f"{name}, 1xP")
        for order, marker in (("hierarchical", "s"), ("flat", "^")):
            two = [r for r in rs if not r["mesh"].startswith("1x") and r["ring_order"] == order]
            if two:
                meshes = "/".join(sorted({r["mesh"] for r in two}))
                ax.plot([r["gpus"] for r in two], [r["tokens_per_s"] for r in two], ls="none", marker=marker,
                        mfc="none", ms=9, color=color, label=f"{name}, {meshes} {order}")
        if not per_gpu and one and one[0]["gpus"] == 1:
            pmax = max(r["gpus"] for r in rs)
            if pmax > 1:
                ax.plot([1, pmax], [one[0]["tokens_per_s"], one[0]["tokens_per_s"] * pmax], ls=":", color=color,
                        alpha=0.5)
            base = one[0]["tokens_per_s"]
            eff = lambda r: 100.0 * r["tokens_per_s"] / (r["gpus"] * base)  # noqa: E731
            eff_ax.plot([r["gpus"] for r in one], [eff(r) for r in one], marker="o", color=color,
                        ls="-" if method == "sparse" else "--", label=f"{name}, 1xP")
            for order, marker in (("hierarchical", "s"), ("flat", "^")):
                two = [r for r in rs if not r["mesh"].startswith("1x") and r["ring_order"] == order]
                if two:
                    eff_ax.plot([r["gpus"] for r in two], [eff(r) for r in two], ls="none", marker=marker,
                                mfc="none", ms=9, color=color)
        if per_gpu and method == "sparse":  # weak scaling: the rows' own efficiency (active pairs per second)
            pts = [r for r in one if r["efficiency"] is not None]
            if pts:
                eff_ax.plot([r["gpus"] for r in pts], [100.0 * r["efficiency"] for r in pts], marker="D", color=color,
                            ls="-.", label=f"{name}, 1xP (active pairs / s)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    gp = sorted({r["gpus"] for r in rows})
    ax.set_xticks(gp, [str(g) for g in gp])
    ax.set_xlabel("GPUs (context-parallel ranks)")
    ax.set_ylabel("tokens / s (forward + backward, one attention layer)")
    dev = sorted({str(r["device"]) for r in rows})
    ax.set_title(f"Ring attention throughput vs GPUs ({', '.join(dev)}); dotted: ideal linear", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    eff_ax.axhline(100.0, ls=":", color="gray")
    eff_ax.set_xscale("log", base=2)
    eff_ax.set_xticks(gp, [str(g) for g in gp])
    eff_ax.set_xlabel("GPUs (context-parallel ranks)")
    eff_ax.set_ylabel("per-GPU efficiency, %")
    eff_ax.set_title("fixed total: tokens/s at P GPUs / (P x tokens/s at 1 GPU);\nper GPU (dash-dot): the same "
                     "in active pairs / s", fontsize=9)
    eff_ax.grid(True, which="both", alpha=0.3)
    if eff_ax.lines[1:]:
        eff_ax.legend(fontsize=7)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(records: list[dict], table_path: str | None, plot_path: str | None) -> str:
    rows = scaling_rows(merge(records))
    if not rows:
        raise ValueError("no forward+backward timings in the records: nothing to report")
    text = markdown_table(rows) + "\n\nTargets (issue 8):\n\n" + targets(one_variant(rows)) + "\n"
    if table_path:
        with open(table_path, "w") as f:
            f.write(text)
    if plot_path:
        plot(one_variant(rows), plot_path)
    return text


def one_variant(rows: list[dict], prefer: str = "both") -> list[dict]:
    """One row per (mode, S, mesh, ring order, method) for the plot: the ``prefer`` fuse variant
    (the default) where a case was run with several, else the last one."""
    keep: dict[tuple, dict] = {}
    for r in rows:
        key = (r["mode"], r["S"], r["mesh"], r["ring_order"], r["method"])
        if key not in keep or keep[key]["fuse"] != prefer:
            keep[key] = r
    return list(keep.values())


def load_jsonl(paths) -> list[dict]:
    records = []
    for p in paths:
        with open(p) as f:
            records += [json.loads(line) for line in f if line.strip()]
    return records


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="*", default=[131072, 262144], help="fixed total lengths")
    ap.add_argument("--per-gpu-length", type=int, default=0, help="also run S = this x P per mesh (weak scaling)")
    ap.add_argument("--gpus", type=int, nargs="+", default=[1, 2], help="meshes 1xP (ignored with --meshes)")
    ap.add_argument("--meshes", nargs="+", help="NODExLOCAL meshes, e.g. 1x1 1x2 1x4 1x8 2x4")
    ap.add_argument("--ring-orders", nargs="+", default=["hierarchical"], choices=list(RING_ORDERS))
    ap.add_argument("--fuse", nargs="+", default=["both"], choices=list(FUSE),
                    help="which passes run their first two chunks in one kernel call (MTrainingConfig.fuse_*)")
    ap.add_argument("--backward-ring", nargs="+", default=["auto"], choices=list(BACKWARD_RINGS),
                    help="which side circulates in the backward ring (RingOptions.backward_ring), one run each")
    ap.add_argument("--kv-exchange", nargs="+", default=["ring"], choices=list(KV_EXCHANGES),
                    help="how K/V reach the ranks (RingOptions.kv_exchange; the sparse ring only), one run each")
    ap.add_argument("--exchange-capacity", type=float, default=None,
                    help="the sparse exchange's capacity, fraction of a chunk (default: exchange.DEFAULT_CAPACITY_FRACTION)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--sharpness", type=float, default=1.0)
    ap.add_argument("--check", action="store_true", help="sampled-row correctness check")
    ap.add_argument("--skip-dense", action="store_true")
    ap.add_argument("--dense-meshes", nargs="+", metavar="NxL",
                    help="time the dense ring only on these meshes (default: every mesh, unless --skip-dense)")
    ap.add_argument("--index-only", action="store_true", help="time only index estimation + conversion")
    ap.add_argument("--profile", action="store_true",
                    help="trace one sparse fwd+bwd step per case: per-GPU kernel breakdown, measured exposed comm")
    ap.add_argument("--tag", default="", help="stored as the records' \"run\" field")
    ap.add_argument("--out", default=".")
    ap.add_argument("--report", nargs="+", metavar="JSONL", help="only build the table + plot from these records "
                    "(e.g. results/ring/ring.jsonl; rows that are not ring timings are skipped)")
    ap.add_argument("--runs", help="with --report: comma-separated run tags, only the records of these runs")
    ap.add_argument("--table", help="markdown table path (default OUT/scaling_table.md)")
    ap.add_argument("--plot", help="PNG plot path (default OUT/scaling.png)")
    args = ap.parse_args(argv)
    if args.report:
        runs = set(args.runs.split(",")) if args.runs else None
        recs = [r for r in load_jsonl(args.report) if "S" in r and (runs is None or r.get("run") in runs)]
        print(report(recs, args.table, args.plot))
        return
    for m in args.meshes or []:
        parse_mesh(m)  # fail before any work
    if any(S < 1 for S in args.lengths) or args.per_gpu_length < 0:
        raise ValueError(f"lengths must be positive: {args.lengths}, per-gpu {args.per_gpu_length}")
    os.makedirs(args.out, exist_ok=True)
    log_path = os.path.join(args.out, "sparse_ring.jsonl")
    records, done = [], {}
    with open(log_path, "a") as log:
        # fusing needs two chunks: on one GPU every variant is the same program, run once
        cases = [(c, f, b, x) for c in plan(args) for f in (args.fuse if c[2] != (1, 1) else args.fuse[:1])
                 for b in args.backward_ring for x in args.kv_exchange]
        for (mode, S, mesh_shape, order), fuse, side, exchange in cases:
            key = (S, mesh_shape, order, fuse, side, exchange)
            if key not in done:  # the same case in both modes is measured once
                done[key] = run_case(S, mesh_shape, order, args, args.out, fuse, side, exchange)
            rec = dict(done[key], mode=mode)
            records.append(rec)
            log.write(json.dumps(rec) + "\n")
            log.flush()
            print(json.dumps(rec), flush=True)
    if records and not args.index_only:
        print(report(records, args.table or os.path.join(args.out, "scaling_table.md"),
                     args.plot or os.path.join(args.out, "scaling.png")))


if __name__ == "__main__":
    sys.exit(main())
