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


def test_a_module_run_records_python_dash_m(monkeypatch):
    """``python -m benchmarks.X`` leaves the module file's absolute path in ``sys.argv[0]`` (the machine's own
    checkout, e.g. ``/work/main/benchmarks/kernels.py``); the row's command says ``python -m benchmarks.X``."""
    import sys
    import types
    from importlib.machinery import ModuleSpec

    from benchmarks._driver import provenance

    main = types.ModuleType("__main__")
    main.__spec__ = ModuleSpec("benchmarks.kernels", None)
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(sys, "argv", ["/work/main/benchmarks/kernels.py", "--seqs", "32768"])
    assert provenance()["command"] == "python -m benchmarks.kernels --seqs 32768"
    assert provenance(["--reps", "a b"])["command"] == "python -m benchmarks.kernels --reps 'a b'"
    main.__spec__ = None  # a script run as a file: its path as given
    monkeypatch.setattr(sys, "argv", ["benchmarks/kernels.py", "--seqs", "1"])
    assert provenance()["command"] == "benchmarks/kernels.py --seqs 1"
