"""Ring attention across 2 real processes x 4 CPU devices (jax.distributed on localhost, gloo).

The mesh is ``make_mesh()``'s default: node = process, local = that process's devices, so the
hierarchical ring's outer hop really crosses processes. Each worker checks its own shards of the
output and of dq/dk/dv against the float64 dense reference (``tests/_ring_mp_worker.py``): both
backward sides, and the sparse K/V exchange against the reference masked by its index (its run-time
capacity check is an all-reduce across the processes, its direct sends cross them).
"""

from pathlib import Path

import pytest

from _multiprocess import run_workers


@pytest.mark.slow(seconds=36)
def test_ring_two_processes_matches_reference():
    results = run_workers(Path(__file__).with_name("_ring_mp_worker.py"), 2, 4, timeout_s=150)
    for i, res in enumerate(results):
        assert set(res) == {"hierarchical", "flat", "hierarchical-query", "hierarchical-sparse-exchange"}, res
        for order, errs in res.items():
            assert set(errs) == {"out", "dq", "dk", "dv"}
            assert all(e <= 1e-5 for e in errs.values()), (i, order, errs)
