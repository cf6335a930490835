"""MSA attention across 2 real processes x 2 CPU devices (node = process): output, main-branch and
index-branch gradients, KL and work fraction equal the single-process / reference results."""

from pathlib import Path

import pytest

from _multiprocess import run_workers


@pytest.mark.slow(seconds=29)
def test_msa_two_processes_match_single_process():
    results = run_workers(Path(__file__).with_name("_msa_mp_worker.py"), 2, 2, timeout_s=300)
    for i, res in enumerate(results):
        assert set(res) == {"hierarchical", "flat"}, res
        for order, errs in res.items():
            assert set(errs) == {"out", "dq", "dk", "dv", "dqi", "dki", "kl", "work", "recall_ok"}
            for name, e in errs.items():
                assert e <= (1e-4 if name in ("dqi", "dki", "kl") else 1e-5), (i, order, name, e)
