"""benchmarks/quality_curves.py: the training-time curve of a run (compile steps counted as the median
step, logged gaps filled) and an arm's curves joined after a warm start (the dense prefix counted once, as
measured, for every arm)."""

import pytest

from benchmarks.quality_curves import join_warm, time_curve


def _rows(times, first=1, every=1):
    return [{"step": first + i * every, "step_time": t, "split": "train"} for i, t in enumerate(times)]


def test_time_curve_counts_compile_as_median_and_fills_gaps():
    # step 1 compiles (9 s): counted as the median of the others (1 s); steps logged every 2nd count twice
    assert time_curve(_rows([9.0, 1.0, 1.0, 3.0])) == [[1, 1.0], [2, 2.0], [3, 3.0], [4, 6.0]]
    assert time_curve(_rows([9.0, 2.0, 2.0], first=2, every=2)) == [[2, 4.0], [4, 8.0], [6, 12.0]]
    # a resumed slice's first step (4) compiles again
    assert time_curve(_rows([9.0, 1.0, 1.0, 8.0, 1.0]), compile_steps=[4]) == [
        [1, 1.0], [2, 2.0], [3, 3.0], [4, 4.0], [5, 5.0]]
    assert time_curve([]) == [] and time_curve([{"step": 1, "loss": 2.0}]) == []


def test_time_curve_from_a_warm_start_counts_only_the_runs_own_steps():
    rows = _rows([9.0, 0.5, 0.5, 0.5], first=401)  # an arm continuing from step 400
    assert time_curve(rows, start=400) == [[401, 0.5], [402, 1.0], [403, 1.5], [404, 2.0]]
    # without ``start`` the 400 steps before it would be charged at this arm's speed (the old curve)
    assert time_curve(rows)[0] == [401, pytest.approx(0.5 * 401)]
    # logged rows of the warm start itself (step <= start) are not this run's
    assert time_curve(_rows([1.0, 1.0]) + rows, start=400)[0] == [401, 0.5]


def test_join_warm_gives_every_arm_the_same_measured_prefix():
    warm = {"steps": 2, "train_time": [[1, 3.0], [2, 6.0]], "train_loss": [[1, 5.0], [2, 4.0]],
            "heldout_curve": [[2, 4.5]], "seconds": 99.0}
    fast, slow = {}, {}
    for rec, per_step in ((fast, 1.0), (slow, 3.0)):
        rec.update(train_loss=[[3, 3.0], [4, 2.0]], heldout_curve=[[4, 2.5]])
        join_warm(rec, warm, time_curve(_rows([per_step * 5, per_step], first=3), start=2))
    assert fast["train_time"] == [[1, 3.0], [2, 6.0], [3, 7.0], [4, 8.0]]
    assert slow["train_time"] == [[1, 3.0], [2, 6.0], [3, 9.0], [4, 12.0]]
    assert fast["train_loss"] == [[1, 5.0], [2, 4.0], [3, 3.0], [4, 2.0]]
    assert fast["heldout_curve"] == [[2, 4.5], [4, 2.5]]
    # a record without a measured curve (older warm.json): its wall seconds are the shared offset
    rec = {"train_loss": [], "heldout_curve": []}
    join_warm(rec, {"steps": 2, "seconds": 10.0}, [[3, 1.0]])
    assert rec["train_time"] == [[3, 11.0]]
