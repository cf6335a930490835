"""The ring cost model's calibration on measurements (:mod:`benchmarks.comm_model`): the records, the
earlier rate-only rule (:func:`calibrate`), the traced fits (:func:`fit_step_terms`, :func:`fit_two_lengths`,
:func:`calibrate_traced`), held-out errors and the predictions with their bands."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Iterable

import numpy as np

from benchmarks.trace_summary import COMM
from mtraining_jax.ring.sides import resolve_backward_ring
from benchmarks.comm_model_sim import (IB_400G, NVLINK_H100, STEP_FORMS, Kernels, Link, RingCosts, Workload, n_calls,
                                      simulate, simulate_fused)


# ------------------------------------------------------------------ calibration on measurements


#: every ring measurement (sparse_ring / scaling / multi-process runs; ``run`` tags the campaign). It is
#: read from the repository checkout (an editable install or ``PYTHONPATH=.``), not packaged: from a
#: wheel install pass ``--records`` / ``--earlier-records``.
RING_RECORDS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results", "ring",
                            "ring.jsonl")


def read_records(paths: Iterable[str]) -> list[dict]:
    """Every JSON row of the JSONL files ``paths``, in order."""
    out = []
    for p in paths:
        with open(p) as f:
            out += [json.loads(line) for line in f if line.strip()]
    return out


def _mesh(r: dict) -> tuple[int, int]:
    if "mesh" in r and r["mesh"]:
        n, l = (int(x) for x in str(r["mesh"]).split("x"))
        return n, l
    return 1, int(r.get("gpus", 1))


def _fit(one_gpu: dict, index_s: float, step_overhead: float = Kernels().step_overhead) -> Kernels:
    """The kernels' ``rate`` from a one-GPU record (its time minus the index estimate and the two
    kernel calls' fixed overhead); the overhead itself is not fitted (one point per length)."""
    t = one_gpu["sparse_fwdbwd_s"] - index_s * one_gpu["S"] / Kernels().index_ref_len - 2 * step_overhead
    return Kernels(rate=Workload(one_gpu["S"], one_gpu["density"]).flops / t, step_overhead=step_overhead,
                   index_s=index_s)


def calibrate(records: list[dict]) -> list[dict]:
    """Per family (``run`` tag: same code, same machine kind) and length with a one-GPU sparse
    record: fit the rate on it and predict the family's multi-GPU records of that length. Returns
    rows with the relative error (the one-GPU rows are the fits: 0 by construction)."""
    rows = []
    fams = {}
    for r in records:
        if r.get("sparse_fwdbwd_s") and r.get("density") and r.get("mode", "total") == "total":
            fams.setdefault(r.get("run") or "v?", []).append(r)
    for run, rs in sorted(fams.items()):
        seen = set()
        for r in rs:
            one = next((o for o in rs if _mesh(o) == (1, 1) and o["S"] == r["S"]), None)
            n, l = _mesh(r)
            key = (r["S"], n, l, r.get("ring_order", "hierarchical"))
            if one is None or key in seen:
                continue
            seen.add(key)
            idx = one["index_s"] * Kernels().index_ref_len / one["S"] if one.get("index_s") else Kernels().index_s
            k = _fit(one, idx)
            p = simulate(Workload(r["S"], r["density"]), n, l, key[3], kernels=k)
            rows.append(dict(run=run, S=r["S"], mesh=f"{n}x{l}", ring_order=key[3], measured_s=r["sparse_fwdbwd_s"],
                             predicted_s=p.step_s, rel_err=p.step_s / r["sparse_fwdbwd_s"] - 1,
                             fitted_rate_tflops=k.rate / 1e12, exposed_s=p.exposed_comm_s, fitted_on_1gpu=n * l == 1))
    return rows


#: attention shapes of the predictions: the measured GQA model and its multi-head twin (same Hq)
MODELS = {"GQA16/2": dict(heads=16, kv_heads=2), "MHA16": dict(heads=16, kv_heads=16)}


def predictions(kernels: Kernels, dense_rate: float, lengths=(262144, 524288, 1048576),
                meshes=((1, 1), (1, 8), (4, 8)), densities=None, models=MODELS,
                sides=("kv", "query"), exchange_capacities=(1.0, 0.25)) -> list[dict]:
    """Dense and sparse ring at each length and mesh (hierarchical; 4 x 8 over :data:`IB_400G`),
    per attention shape of ``models`` and backward side, and the sparse ring with the sparse-aware
    K/V exchange at each capacity of ``exchange_capacities`` (fraction of a chunk: 1.0 is what the
    synthetic index needs on every layout, ``exchange_rows``; 0.25 an index of few, short slashes)."""
    densities = densities or {262144: 0.0277, 524288: 0.0144, 1048576: 0.0075}
    rows = []
    for S in lengths:
        for n, l in meshes:
            for model, heads in models.items():
                for side in sides:
                    for name, dens, k in (("sparse", densities[S], kernels),
                                          ("dense", 1.0, dataclasses.replace(kernels, rate=dense_rate, index_s=0.0))):
                        p = simulate(Workload(S, dens, **heads), n, l, "hierarchical", kernels=k, backward_ring=side)
                        rows.append(dict(S=S, mesh=f"{n}x{l}", gpus=n * l, model=model, ring=name, density=dens,
                                         auto=resolve_backward_ring("auto", head_dim=128, itemsize=2, **heads),
                                         **p.as_dict()))
                # the sparse ring with the sparse-aware K/V exchange (K/V-side backward) at each capacity
                for cap in exchange_capacities:
                    p = simulate(Workload(S, densities[S], **heads), n, l, "hierarchical", kernels=kernels,
                                 backward_ring="kv", kv_exchange="sparse", capacity_fraction=cap)
                    rows.append(dict(S=S, mesh=f"{n}x{l}", gpus=n * l, model=model, ring=f"exchange@{cap:g}",
                                     density=densities[S], capacity_fraction=cap,
                                     auto=resolve_backward_ring("auto", head_dim=128, itemsize=2, **heads),
                                     **p.as_dict()))
    return rows


#: the ring's attention kernels in a trace summary (``benchmarks/trace_summary.py`` ``top``, by name; the
#: Triton / Pallas kernels of the earlier code are named ``block_sparse_*``)
KERNEL_NAMES = re.compile(r"mosaic|pallas|triton|block_sparse", re.IGNORECASE)
#: the index estimate's XLA kernels in a trace summary (by the source file of their HLO instruction)
INDEX_SRC = "estimate.py"
#: a per-step XLA kernel taking at least this long (ms per launch, at the fitted chunk) is counted as
#: moving chunk-sized arrays (K/V, dK/dV, accumulators: tens of MB at 128K-token chunks) and scaled with
#: the chunk; shorter ones (sorts and searches over the index, small copies, launch-bound kernels) are fixed
ROW_KERNEL_MS = 0.1
#: ``fuse`` field of a record -> (fuse_forward, fuse_backward)
FUSE_FLAGS = {"both": (True, True), "backward": (False, True), "forward": (True, False), "none": (False, False)}


def trace_components(rec: dict) -> dict:
    """Mean over the traced devices of a record's ``sparse_trace`` (``benchmarks/trace_summary.py``),
    in ms: ``kernels`` (the ring's attention kernels, :data:`KERNEL_NAMES`), ``compute`` (every
    non-communication kernel), ``xla`` = compute - kernels, ``index`` (XLA kernels from
    :data:`INDEX_SRC`), ``exposed`` (communication with no compute running), ``idle``, ``span``; and
    ``ops``: ``{(op, first source frame): (ms, launches)}`` of the XLA kernels listed (the summary lists
    the top 60 kernel names)."""
    devs = [d for d in (rec.get("sparse_trace") or {}).values() if d.get("kernels")]
    if not devs:
        raise ValueError(f"record {rec.get('run')} {rec.get('mesh')} has no traced device")
    n = len(devs)
    out = {k: 0.0 for k in ("kernels", "compute", "index", "exposed", "idle", "span")}
    ops: dict = {}
    for d in devs:
        out["compute"] += d["compute_ms"] / n
        out["exposed"] += d.get("exposed_comm_ms", 0.0) / n
        out["idle"] += d.get("idle_ms", 0.0) / n
        out["span"] += d["span_ms"] / n
        for t in d.get("top", []):
            if KERNEL_NAMES.search(t["name"]):
                out["kernels"] += t["ms"] / n
                continue
            if COMM.search(t["name"]):
                continue
            if INDEX_SRC in t.get("src", ""):
                out["index"] += t["ms"] / n
            key = (t["op"].split("/")[-1] if t.get("op") else t["name"].rstrip("_0123456789"),
                   t.get("src", "").split(" < ")[0])
            ms, cnt = ops.get(key, (0.0, 0.0))
            ops[key] = (ms + t["ms"] / n, cnt + t["count"] / n)
    out["xla"] = out["compute"] - out["kernels"]
    out["devices"] = n
    out["ops"] = ops
    return out


def _fuse(rec: dict) -> tuple[bool, bool]:
    return FUSE_FLAGS[rec.get("fuse") or "none"]  # records before the fused calls (v11) have no "fuse"


def fit_step_terms(one: dict, multi: dict, row_kernel_ms: float = ROW_KERNEL_MS) -> dict:
    """The per-call and per-step terms from ONE multi-GPU trace and the one-GPU trace of its family
    (same length): kernels ``K_P = W / P + k (m / P)`` with ``K_1 = W + k`` (``m``: kernel calls per
    pass, weighted 1:2.5 forward : backward) gives the per-call cost ``k`` per ``S`` rows; XLA
    ``X_P = X_1 / P + (P - 1) x`` gives the per-step cost ``x``; its chunk-scaled part is the extra time
    (over ``1/P`` of the one-GPU trace, matched by op and source line) of the per-step kernels taking
    ``>= row_kernel_ms`` per launch, the rest is fixed. Returns the terms (seconds) and the inputs (ms)."""
    if one["S"] != multi["S"]:
        raise ValueError(f"one-GPU record at S={one['S']} and the multi-GPU one at S={multi['S']}")
    n, l = _mesh(multi)
    P, S = n * l, multi["S"]
    ff, fb = _fuse(multi)
    m = (n_calls(P, ff) + 2.5 * n_calls(P, fb)) / 3.5
    if m <= 1:
        raise ValueError(f"{multi.get('mesh')}: {P} ranks make one kernel call per pass, as one GPU: the "
                         "per-call cost is not identifiable from this record")
    c1, cp = trace_components(one), trace_components(multi)
    k = (cp["kernels"] - c1["kernels"] / P) / ((m - 1) / P)
    extra = cp["xla"] - c1["xla"] / P
    x = extra / (P - 1)
    row_part = 0.0
    for key, (ms, cnt) in cp["ops"].items():
        e = ms - c1["ops"].get(key, (0.0, 0.0))[0] / P
        if e > 0 and cnt and ms / cnt >= row_kernel_ms:
            row_part += e
    rho = min(max(row_part / extra, 0.0), 1.0) if extra > 0 else 0.0
    rows = S // P
    return dict(run=multi.get("run"), mesh=f"{n}x{l}", ring_order=multi.get("ring_order", "hierarchical"), S=S,
                P=P, rows=rows, calls_weighted=m, kernels_1gpu_ms=c1["kernels"], kernels_ms=cp["kernels"],
                xla_1gpu_ms=c1["xla"], xla_ms=cp["xla"], per_call_ms_at_S=k, xla_extra_ms=extra,
                row_part_ms=row_part, row_fraction=rho, call_row_s=k * 1e-3 / S, step_s=x * 1e-3,
                step_fixed_s=(1 - rho) * x * 1e-3, step_row_s=rho * x * 1e-3 / rows)


def fit_costs(one: dict, terms: dict, sync_hops: int = 0) -> RingCosts:
    """:class:`RingCosts` of a family from its one-GPU traced record and the per-call / per-step
    ``terms`` (:func:`fit_step_terms`): the kernels' trace time minus the per-call cost of one call
    per pass gives the rate; XLA time is split into the index estimate and the rest per token; the
    host term is the measured time minus the trace's compute and exposed time."""
    if _mesh(one) != (1, 1):
        raise ValueError(f"fit_costs needs a one-GPU record, got mesh {one.get('mesh')}")
    c = trace_components(one)
    S = one["S"]
    call_fixed_s = terms.get("call_fixed_s", 0.0)
    work_ms = c["kernels"] - (call_fixed_s + terms["call_row_s"] * S) * 1e3
    if work_ms <= 0:
        raise ValueError("the per-call cost exceeds the one-GPU kernels' time")
    return RingCosts(rate=Workload(S, one["density"]).flops / (work_ms * 1e-3), call_row_s=terms["call_row_s"],
                     index_token_s=c["index"] * 1e-3 / S, xla_token_s=(c["xla"] - c["index"]) * 1e-3 / S,
                     step_fixed_s=terms["step_fixed_s"], step_row_s=terms["step_row_s"],
                     host_s=measured_host_s(one), sync_hops=int(sync_hops), call_fixed_s=call_fixed_s,
                     host_multi_s=terms.get("host_multi_s"))


def measured_host_s(rec: dict) -> float:
    """A traced record's host term: its measured time minus the trace's compute and exposed time."""
    c = trace_components(rec)
    return rec["sparse_fwdbwd_s"] - (c["compute"] + c["exposed"]) * 1e-3


def fit_two_lengths(pairs) -> dict:
    """Per-call, per-step and multi-GPU host terms from traced ``(one-GPU, multi-GPU)`` record pairs at
    TWO lengths (same mesh family, e.g. 1x4 at 256K and 512K), solved exactly instead of assumed:

    * kernels: ``K_P - K_1 / P = c0 (m - 1/P) + c1 (S/P) (m - 1)`` per length (``m`` calls per pass,
      weighted 1 : 2.5 forward : backward; each call costs ``c0 + c1 * rows``) -> ``call_fixed_s = c0``,
      ``call_row_s = c1``;
    * XLA per ring step beyond the first: ``(X_P - X_1 / P) / (P - 1) = x0 + x1 * S/P`` per length ->
      ``step_fixed_s``, ``step_row_s``;
    * host term on more than one GPU: the mean of the multi-GPU records' measured host terms
      (:func:`measured_host_s`), ``host_multi_s``.

    Returns the terms (seconds), with the inputs (ms) per pair under ``pairs``."""
    if len(pairs) != 2:
        raise ValueError(f"fit_two_lengths needs two (one-GPU, multi-GPU) pairs, got {len(pairs)}")
    A, b_call, X, b_step, inputs = [], [], [], [], []
    for one, multi in pairs:
        t = fit_step_terms(one, multi)
        P, S, m = t["P"], t["S"], t["calls_weighted"]
        A.append([m - 1 / P, (S / P) * (m - 1)])
        b_call.append((t["kernels_ms"] - t["kernels_1gpu_ms"] / P) * 1e-3)
        X.append([1.0, S / P])
        b_step.append(t["step_s"])
        inputs.append(dict(t, measured_host_ms=measured_host_s(multi) * 1e3))
    if inputs[0]["S"] == inputs[1]["S"]:
        raise ValueError(f"the two pairs are at the same length S={inputs[0]['S']}: the terms are not identifiable")
    c0, c1 = np.linalg.solve(np.array(A), np.array(b_call))
    x0, x1 = np.linalg.solve(np.array(X), np.array(b_step))
    host = float(np.mean([p["measured_host_ms"] for p in inputs])) * 1e-3
    first = inputs[0]
    return dict(run=first["run"], mesh=first["mesh"], ring_order=first["ring_order"], S=first["S"], P=first["P"],
                rows=first["rows"], form="two lengths", call_fixed_s=float(c0), call_row_s=float(c1),
                step_fixed_s=float(x0), step_row_s=float(x1), step_s=float(x0 + x1 * first["rows"]),
                row_fraction=float(x1 * first["rows"] / (x0 + x1 * first["rows"])) if x0 + x1 * first["rows"] else 0.0,
                per_call_ms_at_S=float(c0 + c1 * first["S"]) * 1e3, host_multi_s=host, pairs=inputs,
                fits=[(p["run"], p["mesh"], p["ring_order"], p["S"]) for p in inputs])


#: the record whose trace gives the per-call and per-step terms: (run, mesh, ring order)
FIT_RECORD = ("v14", "1x4", "hierarchical", "524288")


def traced_records(records: list[dict]) -> list[dict]:
    """The ``records`` a calibration can use: traced, timed, with a density, whole fwd+bwd, the K/V ring."""
    return [r for r in records if r.get("sparse_trace") and r.get("sparse_fwdbwd_s") and r.get("density")
            and r.get("mode", "total") == "total" and (r.get("kv_exchange") or "ring") == "ring"
            and (r.get("backward_ring") or "auto") in ("auto", "kv")]


def find_record(records, run, mesh, order="hierarchical", S=None):
    """The first of ``records`` of ``run`` on ``mesh`` (``"PxQ"``) with ``order`` (and length ``S``), or ``None``."""
    return next((r for r in records if r.get("run") == run and "%dx%d" % _mesh(r) == mesh
                 and r.get("ring_order", "hierarchical") == order and (S is None or r["S"] == S)), None)


def calibrate_traced(records: list[dict], fit: tuple = FIT_RECORD, intra: Link = NVLINK_H100,
                     inter: Link | None = None) -> tuple[list[dict], dict, dict]:
    """The traced families (records with ``sparse_trace``; ``run`` tag = same code and machine):
    per-call / per-step terms from the ``fit`` record (``(run, mesh, order[, S])``; :func:`fit_step_terms`,
    with its family's one-GPU record of that length) or, given a list of two such records at two
    lengths, from both (:func:`fit_two_lengths`: per-call and per-step terms with a fixed and a per-row
    part, and a multi-GPU host term); every family's other costs from its own one-GPU record
    (:func:`fit_costs`), each record predicted with :func:`simulate_fused` (its own count of
    synchronous permutes from the compiled HLO; ``inter`` defaults to ``intra``: the measured meshes are
    one host), also with every per-step form (``forms``). Returns ``(rows, terms, {run: RingCosts})``; a
    row's ``role``: ``"fit: 1 GPU"``, ``"fit: per-step terms"`` or ``"held out"``."""
    traced = traced_records(records)
    fits = list(fit) if fit and isinstance(fit[0], (tuple, list)) else [fit]
    pairs = []
    for f in fits:
        run, mesh, order, fit_S = (tuple(f) + (None,))[:4]
        multi = find_record(traced, run, mesh, order, S=int(fit_S) if fit_S else None)
        if multi is None:
            raise ValueError(f"no traced record {run} {mesh} {order} to fit the per-step terms on")
        one_fit = find_record(traced, run, "1x1", S=multi["S"])
        if one_fit is None:
            raise ValueError(f"no one-GPU traced record of {run} at S={multi['S']}")
        pairs.append((one_fit, multi))
    terms = fit_step_terms(*pairs[0]) if len(pairs) == 1 else fit_two_lengths(pairs)
    fitted = [m for _, m in pairs]
    rows, costs = [], {}
    for r in sorted(traced, key=lambda r: (r["run"], r["S"], _mesh(r)[0] * _mesh(r)[1], _mesh(r),
                                           r.get("ring_order", ""))):
        one = find_record(traced, r["run"], "1x1", S=r["S"])
        if one is None:
            continue
        n, l = _mesh(r)
        c = fit_costs(one, terms, sync_hops=r.get("hlo_collective_permute_sync") or 0)
        costs.setdefault(r["run"], dataclasses.replace(c, sync_hops=0))
        ff, fb = _fuse(r)
        p = simulate_fused(Workload(r["S"], r["density"]), n, l, r.get("ring_order", "hierarchical"), costs=c,
                           intra=intra, inter=inter or intra, fuse_forward=ff, fuse_backward=fb)
        forms = {f: simulate_fused(Workload(r["S"], r["density"]), n, l, r.get("ring_order", "hierarchical"),
                                   costs=c.with_form(f, terms["rows"]), intra=intra, inter=inter or intra,
                                   fuse_forward=ff, fuse_backward=fb).step_s for f in STEP_FORMS}
        m = trace_components(r)
        role = "fit: 1 GPU" if n * l == 1 else "fit: per-step terms" if any(r is m for m in fitted) else "held out"
        rows.append(dict(run=r["run"], commit=r.get("commit"), device=r.get("device"), S=r["S"], mesh=f"{n}x{l}",
                         ring_order=r.get("ring_order", "hierarchical"), role=role, measured_s=r["sparse_fwdbwd_s"],
                         predicted_s=p.step_s, rel_err=p.step_s / r["sparse_fwdbwd_s"] - 1,
                         sync_hops=c.sync_hops, predicted=p.as_dict(), forms=forms,
                         measured_trace_ms={k: m[k] for k in ("kernels", "xla", "index", "exposed", "idle", "span")},
                         measured_host_ms=measured_host_s(r) * 1e3,
                         worker_imbalance=r.get("worker_imbalance"), step_imbalance=r.get("step_imbalance")))
    return rows, terms, costs


def held_out_error(rows: list[dict]) -> dict:
    """Relative error of the held-out rows: ``lo`` (most negative, <= 0), ``hi`` (most positive,
    >= 0), ``max_abs``, ``n``."""
    errs = [r["rel_err"] for r in rows if r["role"] == "held out"]
    if not errs:
        return dict(lo=0.0, hi=0.0, max_abs=0.0, n=0)
    return dict(lo=min(0.0, min(errs)), hi=max(0.0, max(errs)), max_abs=max(abs(e) for e in errs), n=len(errs))


#: meshes of the traced predictions: (nodes, local, order); up to 8 GPUs on one host (NVLink both ways)
TRACED_MESHES = ((1, 1, "hierarchical"), (1, 4, "hierarchical"), (1, 8, "hierarchical"), (2, 4, "hierarchical"),
                 (2, 4, "flat"), (4, 8, "hierarchical"), (4, 8, "flat"))
#: index density of the synthetic inputs: measured at 512K (v12), 1M extrapolated (halves per doubling:
#: 0.0554 / 0.0277 / 0.0144 at 128K / 256K / 512K)
DENSITIES = {524288: 0.01444, 1048576: 0.0075}


def traced_predictions(costs: RingCosts, rows_ref: int, err: dict, lengths=(524288, 1048576),
                       meshes=TRACED_MESHES, densities=None, intra: Link = NVLINK_H100, inter: Link = IB_400G,
                       dense_rate: float | None = None, gpus_per_host: int = 8, measured_S: int | None = None,
                       length_err: float = 0.0) -> list[dict]:
    """The sparse ring at each length and mesh with ``costs`` (meshes of up to ``gpus_per_host`` GPUs
    on one host: ``intra`` on both axes; larger ones ``inter`` between nodes); the central value uses
    the fitted per-step split, ``forms`` every form of :data:`STEP_FORMS` (same per-step cost at chunks
    of ``rows_ref`` tokens), and the band is ``[min over forms / (1 + err.hi), max over forms / (1 +
    err.lo)]``: the range the measurement would fall in if the model erred as on the held-out records;
    at a length other than ``measured_S`` the band is widened by ``length_err`` either way (the error of
    the same fit carried to another length, :func:`main`'s check on an earlier family). With
    ``dense_rate`` also the dense ring (:func:`simulate`, its kernels at that rate, no per-call cost)."""
    densities = {**DENSITIES, **(densities or {})}
    out = []
    for S in lengths:
        w = Workload(S, densities[S])
        for n, l, order in meshes:
            link = intra if n * l <= gpus_per_host else inter
            sim = {f: simulate_fused(w, n, l, order, costs=costs.with_form(f, rows_ref), intra=intra, inter=link)
                   for f in STEP_FORMS}
            p = sim["split"]
            vals = [q.step_s for q in sim.values()]
            le = length_err if measured_S and S != measured_S else 0.0
            out.append(dict(S=S, mesh=f"{n}x{l}", gpus=n * l, ring_order=order, ring="sparse", density=densities[S],
                            inter="NVLink" if link is intra else "400G", **p.as_dict(),
                            forms={f: q.step_s for f, q in sim.items()},
                            band_lo_s=min(vals) / (1 + err["hi"]) / (1 + le),
                            band_hi_s=max(vals) / (1 + err["lo"]) / (1 - le)))
            if dense_rate:
                k = Kernels(rate=dense_rate, step_overhead=0.0, index_s=0.0)
                d = simulate(Workload(S, 1.0), n, l, order, kernels=k, intra=intra, inter=link)
                out.append(dict(S=S, mesh=f"{n}x{l}", gpus=n * l, ring_order=order, ring="dense", density=1.0,
                                inter="NVLink" if link is intra else "400G", step_s=d.step_s,
                                exposed_comm_s=d.exposed_comm_s, bytes_inner=d.bytes_inner, bytes_outer=d.bytes_outer,
                                steps=d.steps))
    return out


def fit_dense_rate(records: list[dict], run: str) -> tuple[float, dict] | tuple[None, None]:
    """The dense ring kernels' rate from the family's multi-GPU dense record with the most GPUs (the
    dense ring is compute-bound: ``flops / P / time``), and that record."""
    rs = [r for r in records if r.get("run") == run and r.get("dense_fwdbwd_s")]
    if not rs:
        return None, None
    r = max(rs, key=lambda r: _mesh(r)[0] * _mesh(r)[1])
    n, l = _mesh(r)
    return Workload(r["S"], 1.0).flops / (n * l) / r["dense_fwdbwd_s"], r
