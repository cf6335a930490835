"""``benchmarks/packed_documents.py`` runs (it once broke silently when the kernel impl moved into
``RingOptions``): per (kernel impl, estimate impl, mode) a row with provenance; the estimate's two paths
give the same index, hence the same work and the same outputs and gradients (interpret mode here)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

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
        assert 0 < r["work_fraction"] < 1 and r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["estimate_ms"] > 0
        assert r["estimate_is_the_calls"]  # the estimate timed alone is the index the call used
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


def test_column_waste_counts_other_documents_columns(tmp_path):
    """``--column-waste-only``: the pairs the kernels compute on other documents' columns, against a
    token-level count on the same index: every reported other-document slot is masked for all 64 rows of
    its query block (so at most the token-level count of other-document column pairs), and a per-row
    start drops only whole tiles before the row's first same-document slot."""
    import jax.numpy as jnp

    from mtraining_jax.sparsity import SparsityConfig
    from mtraining_jax.sparsity.convert import convert_step
    from mtraining_jax.sparsity.estimate import estimate_index
    from mtraining_jax.sparsity.synthetic import SyntheticAttention, packed_documents_qk
    from pallas_kernels.index_format import apply_segments

    lens, bs = np.array([700, 300, 500, 548]), 64
    got = packed_documents.column_waste(lens, 2, 1, 32, 0, "per_document", window_blocks=8)
    seg = np.repeat(np.arange(4), lens).astype(np.int32)
    q, k, _ = packed_documents_qk(lens, SyntheticAttention(num_q_heads=2, num_kv_heads=1, head_dim=32), 0)
    pos = jnp.arange(2048, dtype=jnp.int32)
    vs = estimate_index(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), pos,
                        SparsityConfig(window="per_document", window_blocks=8), segment_ids=jnp.asarray(seg[None]))
    idx = apply_segments(convert_step(vs, pos, pos, seq_len=2048, block_size=bs), seg[None], seg[None], bs)
    cc, ci = np.asarray(idx.col_count)[0], np.asarray(idx.col_idx)[0]
    other = total = 0
    for h in range(2):
        for b in range(2048 // bs):
            keys = ci[h, :cc[h, b]]
            qs = seg[b * bs:(b + 1) * bs]
            total += keys.size * bs
            other += int((seg[keys][None, :] != qs[:, None]).sum())
    assert got["column_pairs"] == total > 0
    waste = got["column_pairs"] - got["column_pairs_same_document"]
    assert 0 < waste <= other  # the documents' verticals do reach later documents' rows here
    assert got["other_document_share_of_work"] == waste / (got["block_pairs"] + total)
    assert 0 < got["col_tiles_row_start"] < got["col_tiles"] == int((-(-cc // bs)).sum())
    rows = packed_documents.main(["--seq", "2048", "--heads", "2", "--kv-heads", "1", "--head-dim", "32",
                                  "--window-blocks", "8", "--column-waste-only", "--out", str(tmp_path / "w.jsonl")])
    assert [r["window"] for r in rows] == ["per_document", "sequence"] and rows[0]["commit"] and rows[0]["command"]
    png = tmp_path / "w.png"
    packed_documents.main(["--plot-from", str(tmp_path / "w.jsonl"), "--plot", str(png)])
    assert png.stat().st_size > 0


def test_timing_plot_draws_the_chosen_runs_and_names_an_empty_choice(tmp_path):
    row = {"mode": "documents_per_doc", "estimate": "xla", "commit": "abc1234def", "fwd_ms": 180.0, "fwd_bwd_ms": 190.0,
           "seq": 131072, "heads": 14, "kv_heads": 2, "head_dim": 64, "kernel_fwd": "mosaic", "device": "H100",
           "jax": "0.11.2", "run": "a"}
    rows = [row, {**row, "fwd_ms": 182.0}, {**row, "estimate": "triton", "fwd_ms": 38.0, "fwd_bwd_ms": 45.0},
            {**row, "run": "b", "fwd_ms": 1.0}, {"what": "column_waste"}]
    f = tmp_path / "rows.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    png = tmp_path / "t.png"
    packed_documents.main(["--plot-from", str(f), "--plot-what", "timings", "--runs", "a", "--plot", str(png)])
    assert png.stat().st_size > 0
    with pytest.raises(ValueError, match="no timing rows of runs c"):
        packed_documents.plot_timings(rows, str(tmp_path / "u.png"), ["c"])
    # two A/B arms of one commit stay apart, and their estimate_ms is drawn
    ab = [{**row, "run": "d", "ab_arm": arm, "estimate_ms": 28.0 + i} for i, arm in enumerate(("old", "new", "old"))]
    groups = packed_documents.timing_groups(rows + ab, ["d"])
    assert {k: len(v) for k, v in groups.items()} == {("documents_per_doc", "xla", "abc1234 old"): 2,
                                                       ("documents_per_doc", "xla", "abc1234 new"): 1}
    packed_documents.plot_timings(rows + ab, str(tmp_path / "d.png"), ["d"])
    assert (tmp_path / "d.png").stat().st_size > 0
