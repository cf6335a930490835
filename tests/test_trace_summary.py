"""The trace summary behind the measured exposed-communication numbers (benchmarks/trace_summary.py)."""

from __future__ import annotations

import gzip
import json

import pytest

from benchmarks import trace_summary as ts


def _trace(tmp_path, kernels):
    """A perfetto-style trace: GPU:0 with two streams, plus a derived "XLA Ops" row and a host row."""
    ev = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
          {"ph": "M", "pid": 1, "tid": 10, "name": "thread_name", "args": {"name": "Stream #13(Compute)"}},
          {"ph": "M", "pid": 1, "tid": 11, "name": "thread_name", "args": {"name": "Stream #14(Nccl)"}},
          {"ph": "M", "pid": 1, "tid": 12, "name": "thread_name", "args": {"name": "XLA Ops"}},
          {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}},
          {"ph": "X", "pid": 1, "tid": 12, "ts": 0, "dur": 1000, "name": "fusion.1"},
          {"ph": "X", "pid": 2, "tid": 1, "ts": 0, "dur": 5000, "name": "python"}]
    ev += [{"ph": "X", "pid": 1, "tid": tid, "ts": s, "dur": d, "name": n} for n, tid, s, d in kernels]
    d = tmp_path / "plugins" / "profile" / "run1"
    d.mkdir(parents=True)
    with gzip.open(d / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": ev}, f)
    return str(tmp_path)


def test_exposed_communication_and_idle_time(tmp_path):
    # compute 0-100 and 150-300 us; nccl 50-200 us (overlapped 50-100 and 150-200: 50 us exposed)
    kernels = [("block_sparse_fwd", 10, 0, 100), ("block_sparse_fwd", 10, 150, 150),
               ("ncclDevKernel_SendRecv", 11, 50, 150)]
    got = ts.summarize_dir(_trace(tmp_path, kernels))
    assert list(got) == ["/device:GPU:0"]
    g = got["/device:GPU:0"]
    assert g["kernels"] == 3  # the derived "XLA Ops" row and the host are ignored
    assert g["span_ms"] == pytest.approx(0.3)
    assert g["compute_ms"] == pytest.approx(0.25)
    assert g["comm_ms"] == pytest.approx(0.15)
    assert g["exposed_comm_ms"] == pytest.approx(0.05)
    assert g["idle_ms"] == pytest.approx(0.0)
    # the one exposed stretch: 100-150 us, right after the first forward kernel
    assert g["exposed"] == [{"at_ms": pytest.approx(0.1), "ms": pytest.approx(0.05), "after": "block_sparse_fwd"}]
    assert g["top"][0] == {"name": "block_sparse_fwd", "ms": pytest.approx(0.25), "count": 2}


def test_missing_trace_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="perfetto_trace"):
        ts.find_trace(str(tmp_path))


def test_every_kernel_millisecond_is_attributed(tmp_path):
    """``by_source``: Pallas kernels, communication, the innermost source line of each XLA kernel's HLO
    instruction (repeated launches ``__N`` included) and library kernels without a source; the groups
    add up to every kernel's time, however many there are (no top-N cut)."""
    kernels = [("anonymous_mosaic_gpu_kernel", 10, 0, 100), ("ncclDevKernel_SendRecv", 11, 0, 40),
               ("loop_add_fusion_2", 10, 100, 10), ("loop_add_fusion_2__3", 10, 110, 10),
               ("input_scatter_fusion", 10, 120, 5), ("nvjet_sm90_tst_128x160", 10, 125, 20),
               ("window_row_max", 10, 145, 7)]  # a Triton pallas_call's kernel, known from the HLO
    kernels += [(f"small_fusion_{i}", 10, 200 + i, 1) for i in range(30)]
    sources = {"loop_add_fusion_2": {"op": "add", "src": "convert.py:123 < convert.py:81"},
               "input_scatter_fusion": {"op": "scatter", "src": "mosaic_index.py:106 < mosaic_fwd.py:208"},
               "window_row_max": {"op": "pallas_call", "src": "window_scores.py:230", "pallas": True}}
    sources.update({f"small_fusion_{i}": {"op": "select", "src": "steps.py:79 < attention.py:84"} for i in range(30)})
    events = json.load(gzip.open(ts.find_trace(_trace(tmp_path, kernels))))["traceEvents"]
    g = ts.summarize(ts.device_kernels(events)["/device:GPU:0"],
                     top=2, sources=sources)
    got = {r["source"]: (r["ms"], r["count"]) for r in g["by_source"]}
    assert got == {"pallas": (pytest.approx(0.107), 2), "communication": (pytest.approx(0.04), 1),
                   "convert.py:123": (pytest.approx(0.02), 2), "mosaic_index.py:106": (pytest.approx(0.005), 1),
                   "library": (pytest.approx(0.02), 1), "steps.py:79": (pytest.approx(0.03), 30)}
    assert sum(r["ms"] for r in g["by_source"]) == pytest.approx(0.222)
    assert [r["source"] for r in g["by_source"]][:2] == ["pallas", "communication"]
    assert len(g["top"]) == 2  # the top-N list is cut; by_source is not
