"""``benchmarks/packed_documents.py`` runs (it once broke silently when the kernel impl moved into
``RingOptions``): per (kernel impl, estimate impl, mode) a row with provenance; the estimate's two paths
give the same index, hence the same work and the same outputs and gradients (interpret mode here)."""

from __future__ import annotations

import json
import sys

import numpy as np

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


def test_visible_tiles_of_the_per_document_window():
    """The tiles the per-document window's kernels compute, against a hand count."""
    # two documents, tokens 0-99 and 100-255; their last 64 rows: 36-99 (blocks 0-1) and 192-255 (block 3);
    # the fourth window block is padding (walked, every tile skipped)
    got = packed_documents.visible_tile_fraction(np.array([100, 156]), 256, window_blocks=4)
    # block 3: doc 1's key tiles 1-3; block 1 (rows 64-99; 100-127 are outside doc 1's window): doc 0's 0-1;
    # block 0 (rows 36-63): tile 0
    assert got["window_blocks_used"] == 3 and got["tiles"] == 16
    assert got["visible_tiles"] == 3 + 2 + 1 and got["visible_fraction"] == 6 / 16
    rows = packed_documents.main(["--seq", "131072", "--visible-tiles-only"])
    assert rows[0]["documents"] == 47 and 0.01 < rows[0]["visible_fraction"] < 0.03
