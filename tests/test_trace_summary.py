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
