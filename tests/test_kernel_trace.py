"""``benchmarks/kernel_trace.py``: every case timed, traced and written with provenance (on CPU the trace
holds no device kernels: the summary is empty and the per-call split zero, the timings real)."""

import json

from benchmarks.kernel_trace import main


def test_every_case_is_timed_traced_and_written(tmp_path):
    out = tmp_path / "trace.json"
    assert main(["--full-seq", "128", "--reps", "2", "--traced-calls", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["case"] for r in rows] == ["full_128_fwd", "full_128_fb", "cudnn_128_fwd", "cudnn_128_fb"]
    for r in rows:
        assert len(r["ms"]) == 2 and all(t > 0 for t in r["ms"]) and r["ms"] == sorted(r["ms"])
        assert set(r["per_call"]) == {"pallas", "library", "xla", "idle", "span"}
        assert r["command"] and r["commit"] and "jax" in r


def test_family_cases_trace_the_benchmark_families(tmp_path):
    out = tmp_path / "trace.json"
    assert main(["--families", "vert", "--seq", "256", "--sparsity", "0.75", "--reps", "2", "--traced-calls", "1",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["case"] for r in rows] == ["vert75_fb"]
    assert all(len(r["ms"]) == 2 and r["ms"][0] > 0 for r in rows)


def test_bad_family_or_sparsity_is_refused_naming_it(capsys):
    import pytest
    with pytest.raises(SystemExit):
        main(["--families", "spread", "--sparsity", "95"])
    assert "--sparsity must be in (0, 1), got 95.0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--families", "spread,diag"])
    assert "--families: unknown diag (known: band, slash, spread, vert, mixed)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--full-seq", "128", "--traced-calls", "0"])
    assert "--traced-calls must be >= 1, got 0" in capsys.readouterr().err
