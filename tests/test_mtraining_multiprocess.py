"""MTraining sparse ring attention across 2 real processes x 4 CPU devices (node = process)."""

from pathlib import Path

import pytest

from _multiprocess import run_workers


@pytest.mark.slow(seconds=40)
def test_sparse_ring_two_processes_matches_masked_reference():
    results = run_workers(Path(__file__).with_name("_mtraining_mp_worker.py"), 2, 4, timeout_s=300)
    for i, res in enumerate(results):
        assert set(res) == {"hierarchical", "flat", "hierarchical-query"}, res
        for order, errs in res.items():
            assert set(errs) == {"out", "dq", "dk", "dv"}
            assert all(e <= 1e-5 for e in errs.values()), (i, order, errs)
