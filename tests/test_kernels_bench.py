"""The kernel benchmark's dense ring-step comparison (issue 33 item 3): both kinds of ring step, our
kernel and the cuDNN stand-in, real timings and FLOP counts, speed-ups relative to the same run's cuDNN."""

import pytest

from benchmarks.kernels import ring_step


def test_ring_step_rows():
    rows = ring_step(128, 4, 2, 32, reps=1, impls=("xla",))
    assert [(r["step"], r["name"]) for r in rows] == [("visible", "cudnn"), ("visible", "xla"),
                                                        ("diagonal", "cudnn"), ("diagonal", "xla")]
    for r in rows:
        assert r["table"] == "ring_step" and (r["seq"], r["heads"], r["kv_heads"], r["head_dim"]) == (128, 4, 2, 32)
        assert r["fwd_ms"] > 0 and r["fb_ms"] > 0 and r["fwd_tflops"] > 0
        assert {"commit", "date", "device", "jax", "command"} <= set(r)
    by = {(r["step"], r["name"]): r for r in rows}
    for step in ("visible", "diagonal"):
        assert by[(step, "cudnn")]["x_cudnn_fb"] == 1.0 and by[(step, "cudnn")]["impl"].startswith("xla")
        assert by[(step, "xla")]["x_cudnn_fb"] == pytest.approx(by[(step, "cudnn")]["fb_ms"] / by[(step, "xla")]["fb_ms"])
        assert by[(step, "xla")]["impl"] == "xla"
    # a visible step computes every pair, a diagonal one the causal half (plus the diagonal)
    vis, diag = by[("visible", "xla")], by[("diagonal", "xla")]
    assert vis["fwd_tflops"] * vis["fwd_ms"] / (diag["fwd_tflops"] * diag["fwd_ms"]) == pytest.approx(128 * 128 / (128 * 129 / 2))
