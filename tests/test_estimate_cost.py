"""``benchmarks/estimate_cost.py``: one row per (S, last_q) and per dense pass with the timing and provenance
fields, at toy size on the CPU; bad sizes are refused naming the value."""

import json

import jax
import pytest

from benchmarks import estimate_cost


def test_rows_at_toy_size(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    assert estimate_cost.main(["--seq", "512", "--last-q", "64,128", "--heads", "4,2", "--head-dim", "16",
                               "--dense", "xla", "--repeats", "2", "--out", str(out)]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(r["fn"], r.get("last_q")) for r in rows] == [("estimate_index", 64), ("estimate_index", 128),
                                                         ("xla_fwd", None), ("xla_fwd_bwd", None)]
    for r in rows:
        assert r["S"] == 512 and r["heads"] == [4, 2] and 0 < r["ms_min"] <= r["ms"] <= r["ms_max"]
        assert r["device"] == "cpu" and r["jax"] == jax.__version__ and "--last-q 64,128" in r["command"]
        assert r["commit"] and r["date"]
    assert capsys.readouterr().out.count('"fn"') == 4


@pytest.mark.parametrize("window", ["sequence", "per_document"])
def test_two_impls_alternate_and_report_their_index_difference(tmp_path, window):
    out = tmp_path / "rows.jsonl"
    assert estimate_cost.main(["--seq", "1024", "--last-q", "64", "--heads", "4,2", "--head-dim", "16", "--dense",
                               "none", "--repeats", "2", "--impls", "xla,triton", "--window", window,
                               "--window-blocks", "4", "--out", str(out)] + (["--trace"] if window == "sequence" else [])) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    if window == "sequence":  # a traced row per impl, after the timed ones (no GPU here: no device kernels)
        traced, rows = rows[2:], rows[:2]
        assert [(r["fn"], r["impl"]) for r in traced] == [("estimate_trace", "xla"), ("estimate_trace", "triton")]
        assert all(set(r["per_call"]) == {"pallas", "library", "xla", "idle", "span"} for r in traced)
    assert [r["impl"] for r in rows] == ["xla", "triton"]
    assert all(r["window"] == window for r in rows)
    assert [r["documents"] > 1 for r in rows] == [window == "per_document"] * 2
    assert [r["index_diff"] for r in rows] == [0, 0]  # interpret mode: the same integers, the same index
    assert all(0 < r["ms_min"] <= r["ms"] <= r["ms_max"] for r in rows)


@pytest.mark.parametrize("argv, msg", [(["--impls", "xla,cuda"], "expected distinct names from"),
                                       (["--impls", "xla,xla"], "got 'xla,xla'"),(["--seq", "128", "--last-q", "256"], "--last-q 256 is larger than --seq 128"),
                                       (["--heads", "16,3"], "KV dividing QUERY, got \\[16, 3\\]"),
                                       (["--seq", "1x"], "got '1x'"), (["--last-q", "0"], "got '0'")])
def test_bad_sizes_are_refused(argv, msg, capsys):
    with pytest.raises(SystemExit):
        estimate_cost.main(argv)
    assert msg.replace("\\", "") in capsys.readouterr().err
