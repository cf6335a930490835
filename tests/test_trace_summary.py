"""The trace summary behind the measured exposed-communication numbers (benchmarks/trace_summary.py)."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("trace_summary", os.path.join(ROOT, "benchmarks", "trace_summary.py"))
ts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ts)


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


def test_schedule_outline_keeps_collectives_and_kernels_in_order():
    hlo = """HloModule m

%fused (p: f32[2]) -> f32[2] {
  ROOT %c = f32[2]{0} collective-permute(%p), source_target_pairs={{0,1}}
}

ENTRY %main {
  %p.1 = f32[2]{0} parameter(0)
  %collective-permute-start = (f32[2]{0}, f32[2]{0}, u32[], u32[]) collective-permute-start(%p.1), metadata={op_name="a/ppermute"}
  %add.3 = f32[2]{0} add(%p.1, %p.1)
  %pallas_call.3 = (f32[4]{0}, f32[4]{0}) custom-call(%add.3, %p.1), custom_call_target="__gpu$xla.gpu.triton", backend_config={"name": "block_sparse_fwd", "ir": "x"}
  ROOT %collective-permute-done = f32[2]{0} collective-permute-done(%collective-permute-start), metadata={op_name="a/ppermute"}
}
"""
    assert ts.schedule_outline(hlo) == [
        "collective-permute-start = collective-permute-start(p.1) a/ppermute",
        "pallas_call.3 = custom-call(add.3,p.1) block_sparse_fwd",
        "collective-permute-done = collective-permute-done(collective-permute-start) a/ppermute",
    ]
    # opcodes over every computation (the fused one's synchronous permute too), not the names or
    # operands that mention them: the text says "collective-permute-start" 3 times, for 1 instruction
    counts = ts.op_counts(hlo)
    assert hlo.count("collective-permute-start") == 3
    assert (counts["collective-permute-start"], counts["collective-permute-done"], counts["collective-permute"]) == (1, 1, 1)
    assert (counts["custom-call"], counts["add"], counts["parameter"]) == (1, 1, 1)
    assert sum(counts.values()) == 6


def test_hlo_sources_resolve_stack_frames():
    hlo = """HloModule m

FileNames
1 "/x/ring.py"
2 "/x/model.py"

FunctionNames
1 "f"
2 "g"

FileLocations
1 {file_name_id=1 function_name_id=1 line=42 end_line=42 column=1 end_column=2}
2 {file_name_id=2 function_name_id=2 line=7 end_line=7 column=1 end_column=2}

StackFrames
1 {file_location_id=2 parent_frame_id=1}
2 {file_location_id=1 parent_frame_id=2}

ENTRY %main {
  %input_scatter_fusion.3 = f32[2]{0} fusion(%p), kind=kInput, metadata={op_name="jit(f)/scatter-add" stack_frame_id=2}
}
"""
    got = ts.hlo_sources(hlo)
    assert got["input_scatter_fusion_3"] == {"op": "jit(f)/scatter-add", "src": "ring.py:42 < model.py:7"}
