"""Cost model and schedule simulator of the dense and sparse rings (issue 22, item 1): the command line
(``python -m benchmarks.comm_model``) and its report. The model lives in :mod:`benchmarks.comm_model_sim`
(links, workload, :func:`simulate`, :func:`simulate_fused`), :mod:`benchmarks.comm_model_fit` (calibration
on the measurements, held-out errors, predictions) and :mod:`benchmarks.comm_model_exchange` (the sparse
K/V exchange).

Given a mesh ``(N nodes, L GPUs per node)``, a ring order, link bandwidths / latencies, the
kernels' throughput on active work and an index density, :func:`simulate` walks the ring's
schedule step by step and predicts, per rank (the block-striped layout balances the work):

* compute per (rank, step): ``3.5 * 4 * D * Hq * pairs / P^2`` FLOP (``pairs`` = the active
  (query, key) pairs of the whole causal sequence, ``density * S (S + 1) / 2``), 1/3.5 of it in the
  forward and 2.5/3.5 in the backward, at ``rate`` TFLOP/s, plus a fixed ``step_overhead`` per
  kernel call in each;
* every collective-permute of one forward + backward, read off the schedule
  (:func:`benchmarks.ring_comm.ring_hops`, the same accounting the compiled HLO is checked
  against): bytes (:func:`benchmarks.ring_comm.hop_bytes`) over the inner (``intra``, NVLink) or
  outer (``inter`` when ``N > 1`` with the hierarchical order, else ``intra``) link;
* overlap as the ring runs it: an inner hop is posted at the start of the step before the one it
  feeds and overlaps that step's compute; an outer hop overlaps the whole inner loop before it
  (hierarchical order); a step starts when its compute is due AND its chunk has arrived, so the
  exposed communication is the waiting time;
* the index estimate once per step (``index_s``, measured, scaled linearly with ``S / P``).

The ring as the current code runs it (issue 33, item 4): :func:`simulate_fused` walks the fused ring
(the first forward call covers steps 0 and 1, the first backward call steps P-1 and 0) with the
per-rank costs the traces of the 4-GPU H100 runs show beyond the kernels' active work
(:class:`RingCosts`): a kernel cost per query row and call (each call re-reads the queries and the
float32 accumulators: ``P - 1`` calls of ``S / P`` rows per pass, so it does not shrink with ``P``),
XLA work per local token (index estimate, loss, conversions) and per ring step beyond the first (the
step's index conversion, concatenations, accumulator adds, small kernels: part fixed, part per chunk
row), a host term per timed call and the synchronous permutes of the compiled program. Calibration
(:func:`calibrate_traced`): every family's one-GPU traced record gives its rate, per-token and host
terms; the per-call and per-step terms come from the components (kernels, XLA) of ONE multi-GPU
trace (default v14 1x4); every other multi-GPU record is held out and its error reported
(``results/ring/comm_model.md``, "Current code"), with predictions for one node of 8 GPUs and
4 nodes x 8 over a 400 Gb/s-class link at 512K and 1M and an error band (:func:`traced_predictions`).
``python -m benchmarks.comm_model --out DIR`` defaults to the run ``v14`` of
``results/ring/ring.jsonl``; older, untraced families (``--earlier-records``) keep the earlier rule:
:func:`calibrate` fits ``rate`` per measured family and length on its one-GPU record (with a fixed
``step_overhead`` per kernel call) and predicts that family's multi-GPU records of the same length.

:func:`backward_bytes` compares the two backward circulations per hop: the K/V side (K, V in the
input dtype + float32 dK, dV travel) and the query side of BurstEngine (Q, dO in the input dtype +
float32 dQ, lse, delta travel): ``(2 Hkv D it + 2 Hkv D 4)`` vs ``(2 Hq D it + Hq D 4 + 2 Hq 4)``
bytes per token — the query side wins only for (near-)MHA. It is the ring's own count
(:func:`mtraining_jax.ring.sides.backward_hop_bytes`, by which ``backward_ring="auto"`` chooses);
:func:`simulate` models either side (``backward_ring``: the query side's hops from
:func:`benchmarks.ring_comm.ring_hops`, its backward visiting the own step first).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from benchmarks.comm_model_exchange import exchange_rows
from benchmarks.comm_model_fit import (FIT_RECORD, MODELS, RING_RECORDS, ROW_KERNEL_MS, calibrate, calibrate_traced,
                                       find_record, fit_dense_rate, held_out_error, predictions, read_records,
                                       traced_predictions, traced_records)
from benchmarks.comm_model_sim import (IB_400G, NVLINK_H100, NVLINK_H200, STEP_FORMS, Kernels, Workload,
                                       backward_bytes)


def markdown_current(result: dict) -> str:
    """The "current code" tables of ``results/ring/comm_model.md`` from :func:`main`'s JSON."""
    lines = ["| family | S | mesh | role | measured ms | predicted ms | error | kernels ms (trace / model) | "
             "XLA ms (trace / model) | exposed comm ms (trace / model) | host ms (measured / model) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["calibration"]:
        p, m = r["predicted"], r["measured_trace_ms"]
        xla_model = (p["index_s"] + p["xla_token_s"] + p["xla_step_s"]) * 1e3
        lines.append(f"| {r['run']} | {r['S'] // 1024}K | {r['mesh']} {r['ring_order']} | {r['role']} | "
                     f"{r['measured_s'] * 1e3:.1f} | {r['predicted_s'] * 1e3:.1f} | {r['rel_err']:+.1%} | "
                     f"{m['kernels']:.1f} / {(p['kernel_s'] + p['call_s']) * 1e3:.1f} | "
                     f"{m['xla']:.1f} / {xla_model:.1f} | "
                     f"{m['exposed']:.2f} / {p['exposed_comm_s'] * 1e3:.2f} | {r['measured_host_ms']:.1f} / "
                     f"{p['host_s'] * 1e3:.1f} |")
    lines += ["", "| S | mesh | inter-node | sparse ms (band) | forms: split / fixed / chunk | kernels + per-call | "
              "XLA per token | XLA per step | exposed comm | host | dense ms | bytes per rank, inner / outer |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    dense = {(r["S"], r["mesh"], r["ring_order"]): r for r in result["predictions"] if r["ring"] == "dense"}
    for r in result["predictions"]:
        if r["ring"] != "sparse":
            continue
        d = dense.get((r["S"], r["mesh"], r["ring_order"]))
        f = r["forms"]
        dense_ms = f"{d['step_s'] * 1e3:.0f}" if d else "-"
        lines.append(f"| {r['S'] // 1024}K | {r['mesh']} {r['ring_order']} | {r['inter'] if r['gpus'] > 1 else '-'} | "
                     f"**{r['step_s'] * 1e3:.1f}** ({r['band_lo_s'] * 1e3:.1f}-{r['band_hi_s'] * 1e3:.1f}) | "
                     f"{f['split'] * 1e3:.1f} / {f['fixed'] * 1e3:.1f} / {f['chunk'] * 1e3:.1f} | "
                     f"{(r['kernel_s'] + r['call_s']) * 1e3:.1f} | {(r['index_s'] + r['xla_token_s']) * 1e3:.1f} | "
                     f"{r['xla_step_s'] * 1e3:.1f} | {r['exposed_comm_s'] * 1e3:.2f} | {r['host_s'] * 1e3:.1f} | "
                     f"{dense_ms} | ")
        lines[-1] += f"{r['bytes_inner'] / 1e6:.0f} / {r['bytes_outer'] / 1e6:.0f} MB |"
    return "\n".join(lines) + "\n"


def _plot(calib: list[dict], preds: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(18, 4.5))
    multi = [r for r in calib if not r["fitted_on_1gpu"]]
    a.scatter([r["measured_s"] * 1e3 for r in multi], [r["predicted_s"] * 1e3 for r in multi], c="C1", label="multi-GPU")
    one = [r for r in calib if r["fitted_on_1gpu"]]
    a.scatter([r["measured_s"] * 1e3 for r in one], [r["predicted_s"] * 1e3 for r in one], c="C0", marker="x",
              label="1 GPU (fitted)")
    hi = max(max(r["measured_s"], r["predicted_s"]) for r in calib) * 1e3 * 1.1
    a.plot([0, hi], [0, hi], "k--", lw=1)
    a.set_xlabel("measured fwd+bwd ms")
    a.set_ylabel("predicted ms")
    a.set_title("sparse ring: model vs measurement")
    a.legend(fontsize=8)
    for ring, style in (("sparse", "-o"), ("dense", "--s"), ("exchange@1", ":^"), ("exchange@0.25", ":v")):
        for S in sorted({r["S"] for r in preds}):
            rs = sorted((r for r in preds if r["ring"] == ring and r["S"] == S and r.get("model", "GQA16/2") == "GQA16/2"
                         and r["backward_ring"] == "kv"), key=lambda r: r["gpus"])
            b.plot([r["gpus"] for r in rs], [r["step_s"] * 1e3 for r in rs], style, label=f"{ring} {S // 1024}K")
    b.set_xscale("log", base=2)
    b.set_yscale("log")
    b.set_xlabel("GPUs (1, one node of 8, 4 nodes x 8 over 400 Gb/s)")
    b.set_ylabel("predicted fwd+bwd ms per layer")
    b.set_title("predictions (hierarchical, GQA 16/2, K/V-side backward; exchange@c: sparse K/V exchange)", fontsize=9)
    b.legend(fontsize=7, ncol=2)
    lengths = sorted({r["S"] for r in preds})
    for (model, side), style in zip([(m, s_) for m in MODELS for s_ in ("kv", "query")], ("-o", "--o", "-s", "--s")):
        rs = {r["S"]: r for r in preds if r["ring"] == "sparse" and r["mesh"] == "4x8" and r["model"] == model
              and r["backward_ring"] == side}
        if len(rs) == len(lengths):
            c.plot([S // 1024 for S in lengths], [rs[S]["exposed_comm_s"] * 1e3 for S in lengths], style,
                   label=f"{model}, {side}-side backward")
    c.set_xlabel("tokens (K)")
    c.set_ylabel("predicted exposed communication, ms per layer")
    c.set_title("sparse ring on 4 nodes x 8: backward side")
    c.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _plot_traced(result: dict, path: str) -> None:
    """comm_model.png: the traced calibration (measured vs predicted), the predictions over GPUs with
    their bands, and the predicted parts of the layer's time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(19, 5))
    cols = {"fit: 1 GPU": "C0", "fit: per-step terms": "C2", "held out": "C1"}
    rows = result["calibration"]
    labels = [f"{r['run']} {r['S'] // 1024}K\n{r['mesh']}{' flat' if r['ring_order'] == 'flat' else ''}" for r in rows]
    errs = [r["rel_err"] * 100 for r in rows]
    lim = max(12.0, min(30.0, max(abs(e) for e in errs) + 4))
    a.bar(range(len(rows)), errs, color=[cols[r["role"]] for r in rows])
    a.set_xticks(range(len(rows)), labels, fontsize=7)
    for x, (e, r) in enumerate(zip(errs, rows)):
        y = max(-lim + 1, min(lim - 3, e))  # a bar beyond the axis gets its label inside
        a.text(x, y + (0.3 if e >= 0 else -0.9), f"{e:+.1f}%\n{r['measured_s'] * 1e3:.0f} ms", ha="center",
               fontsize=7, va="bottom" if e >= 0 else "top")
    for y in (-10, 10):
        a.axhline(y, color="k", ls="--", lw=1)
    a.axhline(0, color="k", lw=0.5)
    for role, col in cols.items():
        a.bar([0], [0], color=col, label=role)
    a.set_ylim(-lim, lim)
    a.set_ylabel("predicted / measured - 1, %")
    a.set_title("sparse ring on H100: model error per record (target +-10 %)", fontsize=10)
    a.legend(fontsize=7, loc="lower left")
    preds = [r for r in result["predictions"] if r["ring"] == "sparse" and r["ring_order"] == "hierarchical"]
    for S, col in zip(sorted({r["S"] for r in preds}), ("C0", "C3")):
        rs = sorted((r for r in preds if r["S"] == S and r["mesh"] != "2x4"), key=lambda r: r["gpus"])
        g = [r["gpus"] for r in rs]
        y = [r["step_s"] * 1e3 for r in rs]
        b.plot(g, y, "-o", c=col, label=f"sparse {S // 1024}K, predicted (band)")
        b.fill_between(g, [r["band_lo_s"] * 1e3 for r in rs], [r["band_hi_s"] * 1e3 for r in rs], color=col, alpha=0.15)
        meas = [r for r in rows if r["S"] == S and r["run"] == result["model"]["current"]]
        if meas:
            b.scatter([int(m["mesh"][0]) * int(m["mesh"][2]) for m in meas], [m["measured_s"] * 1e3 for m in meas],
                      marker="*", s=120, c=col, zorder=3, label=f"measured {S // 1024}K ({result['model']['current']})")
    b.set_xscale("log", base=2)
    b.set_yscale("log")
    b.set_xticks([1, 4, 8, 32])
    b.set_xticklabels(["1", "4", "8\n(1 node)", "32\n(4 x 8, 400G)"])
    b.set_ylabel("fwd+bwd ms per layer")
    b.set_title("predictions, current code (hierarchical; band: per-step forms x held-out error)", fontsize=9)
    b.legend(fontsize=7)
    parts = (("kernel_s", "kernels: active work"), ("call_s", "kernels: per call"), ("index_s", "XLA: index estimate"),
             ("xla_token_s", "XLA: per token, rest"), ("xla_step_s", "XLA: per ring step"),
             ("exposed_comm_s", "exposed comm"), ("host_s", "host"))
    sel = [r for r in preds if r["mesh"] in ("1x4", "1x8", "4x8")]
    sel.sort(key=lambda r: (r["S"], r["gpus"]))
    labels = [f"{r['S'] // 1024}K\n{r['mesh']}" for r in sel]
    bottom = [0.0] * len(sel)
    for (key, lab), col in zip(parts, ("C0", "C9", "C2", "C8", "C3", "C1", "C7")):
        v = [r[key] * 1e3 for r in sel]
        c.bar(labels, v, bottom=bottom, label=lab, color=col)
        bottom = [x + y for x, y in zip(bottom, v)]
    c.set_ylabel("predicted ms per layer (central)")
    c.set_title("where the time goes (hierarchical)", fontsize=10)
    c.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", nargs="+", default=[RING_RECORDS],
                   help="measurements (default: the repository's results/ring/ring.jsonl); families traced on the "
                        "--fit record's device (with a traced one-GPU record) get the per-step model (issue 33), "
                        "the others the earlier rate-only rule")
    p.add_argument("--runs", default="v14",
                   help="comma-separated run tags: only these rows of --records ('' = every row)")
    p.add_argument("--earlier-records", nargs="*", default=[RING_RECORDS],
                   help="older, untraced measurements: calibrated with the earlier rule (section 'earlier'); "
                        "rows of the families --records calibrates are left out")
    p.add_argument("--fit", default=":".join(FIT_RECORD),
                   help="RUN:MESH:ORDER[:S] of the traced record that gives the per-call and per-step terms, or two "
                        "such records at two lengths, comma-separated (fixed + per-row terms, multi-GPU host term)")
    p.add_argument("--current", default="v14",
                   help="family (run tag) whose one-GPU record gives the predictions' costs")
    p.add_argument("--check", default="x4c:1x4:hierarchical:524288",
                   help="RUN:MESH:ORDER:S of an earlier traced family to calibrate the same way on its own records "
                        "(H200 link; '' to skip): the model's structure on other code, hardware and lengths")
    p.add_argument("--rate", type=float, default=360.0, help="earlier model: sparse kernels' fwd+bwd TFLOP/s")
    p.add_argument("--dense-rate", type=float, default=430.0, help="earlier model: dense ring kernels' fwd+bwd TFLOP/s")
    p.add_argument("--exchange-len", type=int, default=0,
                   help="also model the sparse-aware K/V exchange on the synthetic index of this length (CPU: ~1 min at 64K)")
    p.add_argument("--out", help="folder for comm_model.json, comm_model.png and comm_model_current.md")
    a = p.parse_args(argv)
    runs = {x for x in a.runs.split(",") if x}
    records = [r for r in read_records(a.records) if not runs or r.get("run") in runs]
    fits = [tuple(f.split(":")) for f in a.fit.split(",") if f]
    fit = fits[0] if len(fits) == 1 else fits
    traced = traced_records(records)
    ref = find_record(traced, *fits[0][:3], S=int(fits[0][3]) if len(fits[0]) > 3 else None)
    if ref is None and traced:
        print(f"no traced record {a.fit} among --records: the earlier rule only")
    # the per-step model covers the families traced on the fit record's device; the rest: the earlier rule
    traced = [r for r in traced if ref is not None and r.get("device") == ref.get("device")]
    result: dict = {}
    fams = {r["run"] for r in traced}
    earlier = [r for r in records + read_records(a.earlier_records or []) if r.get("run") not in fams]
    length_err = 0.0
    if a.check:
        spec = a.check.split(":")
        fam = [r for r in earlier if r.get("run") == spec[0]]
        if traced_records(fam):
            rows_c, terms_c, _ = calibrate_traced(fam, tuple(spec), intra=NVLINK_H200)
            result["earlier_traced_check"] = dict(fit=spec, terms=terms_c, calibration=rows_c,
                                                  held_out_error=held_out_error(rows_c))
            for r in rows_c:
                print(f"check {r['run']:>5} {r['S'] // 1024:>5}K {r['mesh']:>4} {r['ring_order']:>12} {r['role']:>20}: "
                      f"measured {r['measured_s'] * 1e3:7.1f} ms  predicted {r['predicted_s'] * 1e3:7.1f} ms  "
                      f"({r['rel_err']:+.1%}; fixed {r['forms']['fixed'] / r['measured_s'] - 1:+.1%}, "
                      f"chunk {r['forms']['chunk'] / r['measured_s'] - 1:+.1%})")
            other = [r for r in rows_c if r["S"] != terms_c["S"] and r["mesh"] != "1x1"]
            length_err = max((abs(r["rel_err"]) for r in other), default=0.0)
            result["earlier_traced_check"]["length_err"] = length_err
    if traced:
        calib, terms, costs = calibrate_traced(traced, fit)
        err = held_out_error(calib)
        current = a.current if a.current in costs else max(costs, key=lambda k: max(
            r.get("date", "") for r in traced if r["run"] == k))
        sync = max((r.get("hlo_collective_permute_sync") or 0 for r in traced if r["run"] == current), default=0)
        dense_rate, dense_rec = fit_dense_rate(records, current)
        c = dataclasses.replace(costs[current], sync_hops=sync)
        preds = traced_predictions(c, terms["rows"], err, dense_rate=dense_rate, measured_S=terms["S"],
                                   length_err=length_err)
        cur = [r for r in traced if r["run"] == current]
        result.update(model=dict(
            fit_record=dict(zip(("run", "mesh", "ring_order"), fits[0])),
            fit_records=[dict(zip(("run", "mesh", "ring_order", "S"), f)) for f in fits], terms=terms, current=current,
            current_commit=sorted({r.get("commit") for r in cur})[0], current_device=cur[0].get("device"),
            costs={k: dataclasses.asdict(v) for k, v in costs.items()}, prediction_costs=dataclasses.asdict(c),
            held_out_error=err, length_err=length_err, forms=list(STEP_FORMS), row_kernel_ms=ROW_KERNEL_MS,
            links=dict(intra=dataclasses.asdict(NVLINK_H100), inter=dataclasses.asdict(IB_400G)),
            dense_rate_tflops=dense_rate / 1e12 if dense_rate else None,
            dense_fit=(dict(run=current, mesh=dense_rec["mesh"], measured_s=dense_rec["dense_fwdbwd_s"])
                       if dense_rec else None),
            measured_kv_ppermute_s={f"{r['run']} {r['mesh']} {r.get('ring_order')}": r["kv_ppermute_s"]
                                    for r in traced if r.get("kv_ppermute_s")}),
            calibration=calib, predictions=preds)
        print(f"per-step terms from {terms['run']} {terms['mesh']}: per call {terms['per_call_ms_at_S']:.2f} ms per "
              f"{terms['S'] // 1024}K rows; per step {terms['step_s'] * 1e3:.2f} ms at {terms['rows'] // 1024}K-token "
              f"chunks ({terms['row_fraction']:.0%} chunk-scaled)")
        for r in calib:
            print(f"{r['run']:>6} {r['S'] // 1024:>5}K {r['mesh']:>4} {r['ring_order']:>12} {r['role']:>20}: measured "
                  f"{r['measured_s'] * 1e3:7.1f} ms  predicted {r['predicted_s'] * 1e3:7.1f} ms  ({r['rel_err']:+.1%})")
        print(f"held-out error {err['lo']:+.1%} .. {err['hi']:+.1%} over {err['n']} records")
        for r in preds:
            if r["ring"] == "sparse":
                print(f"sparse {r['S'] // 1024:>5}K {r['mesh']:>4} {r['ring_order']:>12} ({r['inter']}): "
                      f"{r['step_s'] * 1e3:7.1f} ms  band {r['band_lo_s'] * 1e3:.1f}-{r['band_hi_s'] * 1e3:.1f}  "
                      f"(per-step XLA {r['xla_step_s'] * 1e3:.1f}, exposed comm {r['exposed_comm_s'] * 1e3:.2f})")
            else:
                print(f" dense {r['S'] // 1024:>5}K {r['mesh']:>4} {r['ring_order']:>12}: {r['step_s'] * 1e3:9.1f} ms")
    # the earlier rule (rate fitted per family and length, fixed 0.3 ms per kernel call) on the other families
    calib_old = calibrate(earlier)
    preds_old = predictions(Kernels(rate=a.rate * 1e12), a.dense_rate * 1e12)
    result["earlier"] = dict(calibration=calib_old, predictions=preds_old)
    for r in calib_old if not traced else []:
        print(f"{r['run']:>12} {r['S'] // 1024:>5}K {r['mesh']:>4} {r['ring_order']:>12}  measured {r['measured_s'] * 1e3:8.1f} ms"
              f"  predicted {r['predicted_s'] * 1e3:8.1f} ms  ({r['rel_err']:+.0%})")
    w = Workload(262144, 0.0277)
    print("backward bytes per token, GQA 16/2: kv", backward_bytes(w, "kv"), "query", backward_bytes(w, "query"))
    exchange = exchange_rows(a.exchange_len) if a.exchange_len else []
    for r in exchange:
        print(f"exchange {r['S'] // 1024}K {r['mesh']} {r['layout']:>13}: need per pair mean {r['need_mean']:.2f} "
              f"max {r['need_max']:.2f} of a chunk; bytes vs ring {r['fraction']:.3f} (ragged bound "
              f"{r['ideal_fraction']:.3f}) -> {r['choice']}")
        h = r["hot"]
        print(f"   hot blocks (>= 90 % of ranks): {h['hot_blocks']} ({h['hot_tokens_fraction_of_chunk']:.3f} of a chunk); "
              f"capacity {h['capacity']} -> {h['capacity_replicated']} tokens; exchange bytes "
              f"{h['exchange_bytes'] / 1e6:.1f} -> {h['exchange_bytes_replicated'] / 1e6:.1f} MB (ring "
              f"{h['ring_bytes'] / 1e6:.1f}); step imbalance {h['step_imbalance']:.3f} -> "
              f"{h['step_imbalance_replicated']:.3f}; pays: {h['pays']}")
    result["exchange"] = exchange
    if a.out:
        from benchmarks._driver import provenance

        result["meta"] = provenance(argv)  # the code and command that fitted it (its inputs: --records)
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "comm_model.json"), "w") as f:
            json.dump(result, f, indent=1)
        if traced:
            _plot_traced(result, os.path.join(a.out, "comm_model.png"))
            with open(os.path.join(a.out, "comm_model_current.md"), "w") as f:
                f.write(markdown_current(result))
        else:
            _plot(calib_old, preds_old, os.path.join(a.out, "comm_model.png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
