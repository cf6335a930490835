"""Per-device breakdown of a ``jax.profiler`` trace: where the GPU time of a step goes.

``jax.profiler.trace(dir, create_perfetto_trace=True)`` writes
``dir/plugins/profile/<run>/perfetto_trace.json.gz`` (Chrome trace-event JSON). On a GPU, each
device is a process named ``/device:GPU:<n>`` whose ``Stream #...`` threads hold one complete
event (``"ph": "X"``) per kernel or copy. From those this module computes, per device:

* ``span_ms``   first kernel start to last kernel end;
* ``compute_ms`` union of the intervals of non-communication kernels;
* ``comm_ms``   union of the intervals of communication kernels (names matching ``nccl``);
* ``exposed_comm_ms`` the part of ``comm_ms`` with no compute kernel running on that device — the
  communication the step actually waits for (the measured counterpart of an upper bound from
  transfer sizes); ``exposed`` lists its longest stretches (when, how long, after which kernel);
* ``idle_ms``   ``span_ms`` minus the union of all kernels (launch gaps, host sync);
* ``top``       kernels grouped by name: total ms and count, largest first; given the step's
  optimized HLO text (``compiled.as_text()``), each XLA kernel also gets ``op`` and ``src``: the
  JAX op name and source line of the HLO instruction it runs (:func:`benchmarks.hlo.hlo_sources`),
  so "where do the non-Pallas milliseconds come from" has an answer;
* ``by_source`` every kernel's time, none left out, grouped by where it comes from: ``pallas``
  (Mosaic / Triton kernels: a name holding ``mosaic`` / ``triton`` / ``pallas``, or a Triton
  ``pallas_call``'s name in the step's HLO), ``communication`` (NCCL), the innermost source line of
  the kernel's HLO instruction (``file.py:N``, with the step's HLO text), or ``library`` (cuBLAS / cuDNN / copies
  with no HLO source) — ``[{"source", "ms", "count"}]``, largest first; the sums of kernel durations
  (kernels on several streams may overlap, so they can exceed ``span_ms``).

Usage: ``python -m benchmarks.trace_summary TRACE_DIR [--top 20] [--hlo STEP.hlo.txt]`` (prints
JSON), or :func:`summarize_dir` from a benchmark script.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re

from benchmarks.hlo import hlo_sources

COMM = re.compile(r"nccl|all[-_]?reduce|collective|sendrecv", re.IGNORECASE)
PALLAS = re.compile(r"mosaic|triton|pallas", re.IGNORECASE)


def find_trace(trace_dir: str) -> str:
    """Newest ``perfetto_trace.json.gz`` (or ``*.trace.json.gz``) under ``trace_dir``."""
    hits = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    hits = hits or glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    if not hits:
        raise FileNotFoundError(f"no perfetto_trace.json.gz / *.trace.json.gz under {trace_dir!r}")
    return max(hits, key=os.path.getmtime)


def device_kernels(events: list[dict]) -> dict[str, list[tuple[str, float, float]]]:
    """``{device: [(name, start_us, end_us)]}`` from the GPU processes' ``Stream`` threads."""
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    gpus = {pid: n for pid, n in procs.items() if n.startswith("/device:")}
    out: dict[str, list] = {n: [] for n in gpus.values()}
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in gpus:
            continue
        if not threads.get((e["pid"], e.get("tid")), "").startswith("Stream"):
            continue  # derived rows ("XLA Ops", "XLA Modules", "Steps") repeat the kernels' time
        out[gpus[e["pid"]]].append((e["name"], float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))))
    return out


def _union(intervals) -> list[tuple[float, float]]:
    merged = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _subtract(a_set, b_set) -> list[tuple[float, float]]:
    """Parts of the sorted disjoint intervals ``a_set`` not covered by ``b_set`` (same form)."""
    out = []
    for lo, hi in a_set:
        cur = lo
        for b_lo, b_hi in b_set:
            if b_hi <= cur or b_lo >= hi:
                continue
            if b_lo > cur:
                out.append((cur, b_lo))
            cur = max(cur, b_hi)
        if cur < hi:
            out.append((cur, hi))
    return out


def exposed_intervals(kernels, exposed, top: int = 8) -> list[dict]:
    """The longest of the ``exposed`` stretches (communication with no compute kernel running):
    ``at_ms`` from the step's first kernel, ``ms``, and ``after``: the compute kernel that ended
    last before it."""
    t0 = min(s for _, s, _ in kernels)
    done = sorted((e, n) for n, s, e in kernels if not COMM.search(n))
    rows = []
    for lo, hi in sorted(exposed, key=lambda iv: iv[0] - iv[1])[:top]:
        before = [n for e, n in done if e <= lo + 1e-3]
        rows.append({"at_ms": (lo - t0) / 1e3, "ms": (hi - lo) / 1e3, "after": before[-1][:60] if before else ""})
    return rows


def summarize(kernels: list[tuple[str, float, float]], top: int = 20, sources: dict | None = None) -> dict:
    """Timing summary of one device's kernels (see module docstring); times in ms. ``sources``:
    :func:`benchmarks.hlo.hlo_sources` of the step, to attribute kernels to JAX ops."""
    if not kernels:
        return {"kernels": 0}
    comm = _union((s, e) for n, s, e in kernels if COMM.search(n))
    compute = _union((s, e) for n, s, e in kernels if not COMM.search(n))
    every = _union((s, e) for _, s, e in kernels)
    exposed = _subtract(comm, compute)
    span = max(e for _, _, e in kernels) - min(s for _, s, _ in kernels)
    by_name: dict[str, list[float]] = {}
    for n, s, e in kernels:
        acc = by_name.setdefault(n, [0.0, 0])
        acc[0] += e - s
        acc[1] += 1
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "kernels": len(kernels),
        "span_ms": span / 1e3,
        "compute_ms": _length(compute) / 1e3,
        "comm_ms": _length(comm) / 1e3,
        "exposed_comm_ms": _length(exposed) / 1e3,
        "exposed": exposed_intervals(kernels, exposed),
        "idle_ms": (span - _length(every)) / 1e3,
        "top": [_attributed({"name": n[:120], "ms": t / 1e3, "count": c}, n, sources) for n, (t, c) in ranked],
        "by_source": by_source(by_name, sources),
    }


def source_of(name: str, sources: dict | None) -> str:
    """Where kernel ``name`` comes from (see ``by_source`` in the module docstring)."""
    if COMM.search(name):
        return "communication"
    hit = _hlo_source(name, sources)
    if PALLAS.search(name) or (hit and hit.get("pallas")):
        return "pallas"
    if hit and hit.get("src"):
        return hit["src"].split(" < ")[0]
    return "library"


def by_source(by_name: dict, sources: dict | None) -> list[dict]:
    """``[{"source", "ms", "count"}]`` of every kernel in ``by_name`` (``{name: [us, count]}``)."""
    acc: dict[str, list[float]] = {}
    for n, (t, c) in by_name.items():
        a = acc.setdefault(source_of(n, sources), [0.0, 0])
        a[0] += t
        a[1] += c
    return [{"source": k, "ms": t / 1e3, "count": c} for k, (t, c) in sorted(acc.items(), key=lambda kv: -kv[1][0])]


def _hlo_source(name: str, sources: dict | None) -> dict | None:
    """``{"op", "src"}`` of kernel ``name``'s HLO instruction, or None."""
    return (sources or {}).get(re.sub(r"__\d+$", "", name))  # "__N": N-th launch of one instruction


def _attributed(row: dict, name: str, sources: dict | None) -> dict:
    hit = _hlo_source(name, sources)
    return {**row, **hit} if hit else row


def summarize_dir(trace_dir: str, top: int = 20, hlo_text: str | None = None) -> dict[str, dict]:
    """``{device: summary}`` of the newest trace under ``trace_dir`` (kernels attributed to JAX
    ops when the step's optimized ``hlo_text`` is given)."""
    with gzip.open(find_trace(trace_dir)) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    sources = hlo_sources(hlo_text) if hlo_text else None
    return {dev: summarize(ks, top, sources) for dev, ks in sorted(device_kernels(events).items())}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace_dir")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--hlo", help="the step's optimized HLO text, to attribute kernels to JAX ops")
    a = ap.parse_args()
    hlo = open(a.hlo).read() if a.hlo else None
    print(json.dumps(summarize_dir(a.trace_dir, a.top, hlo), indent=1))


if __name__ == "__main__":
    main()
