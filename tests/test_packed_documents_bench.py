"""``benchmarks/packed_documents.py`` runs (it once broke silently when the kernel impl moved into
``RingOptions``): per (kernel impl, estimate impl, mode) a row with provenance; the estimate's two paths
give the same index, hence the same work and the same outputs and gradients (interpret mode here)."""

from __future__ import annotations

import json
import sys

from benchmarks import packed_documents


def test_importing_it_leaves_sys_path_alone():
    """A benchmark that put ``benchmarks/`` on ``sys.path`` made its ``kernels.py`` shadow the
    ``kernels`` package that ``transformers`` imports, failing the Hugging Face tests after it."""
    assert not any(p.rstrip("/").endswith("benchmarks") for p in sys.path)


def test_packed_documents_rows_per_estimate_impl(tmp_path):
    out = tmp_path / "rows.jsonl"
    rows = packed_documents.main(["--seq", "1024", "--heads", "2", "--kv-heads", "1", "--head-dim", "32",
                                  "--impls", "xla", "--repeat", "1", "--modes", "documents_per_doc",
                                  "--window-blocks", "2", "--estimate-impls", "xla", "triton", "--out", str(out)])
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["estimate"] for r in written] == ["xla", "triton"] == [r["estimate_impl"] for r in rows]
    for r in written:
        assert r["mode"] == "documents_per_doc" and r["documents"] > 1
        assert r["commit"] and r["date"] and r["jax"] and r["device"] == "cpu" and "--estimate-impls" in r["command"]
        assert 0 < r["work_fraction"] < 1 and r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0
    xla, tri = written
    assert tri["work_fraction"] == xla["work_fraction"]
    assert all(tri[f"rel_diff_{n}"] == 0.0 for n in ("out", "dq", "dk", "dv"))
