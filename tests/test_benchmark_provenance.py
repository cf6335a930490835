"""Benchmarks whose results are committed write every row (or the file's ``meta``) with its
provenance (``benchmarks._driver.provenance``: commit, code digest, date, command, JAX version,
device), as the results files require."""

import json

PROVENANCE = {"commit", "code", "date", "command", "jax", "device"}


def test_msa_selection_study_rows_carry_provenance(tmp_path):
    from benchmarks import msa_selection_study

    out = tmp_path / "sel.json"
    msa_selection_study.main(["--seq-len", "512", "--top-k", "4", "--sharpness", "1.0", "--out", str(out)])
    rows = json.loads(out.read_text())
    assert rows and all(PROVENANCE <= set(r) for r in rows), rows[0].keys()
    assert "--seq-len 512" in rows[0]["command"] and rows[0]["device"] == "cpu"
    assert 0.0 < rows[0]["mass_recall_a"] <= 1.0


def test_document_index_recall_meta_carries_provenance(tmp_path):
    from benchmarks import document_index_recall

    out = tmp_path / "rec.json"
    document_index_recall.main(["--seq", "1024", "--short", "64", "256", "--variants", "sequence", "--out", str(out)])
    got = json.loads(out.read_text())
    assert PROVENANCE <= set(got["meta"]), got["meta"].keys()
    assert "--seq 1024" in got["meta"]["command"]
    assert got["records"] and 0.0 < got["records"][0]["recall"] <= 1.0
