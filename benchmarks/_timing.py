"""Wall-clock timing shared by the benchmark scripts (``from benchmarks._timing import timeit``)."""

from __future__ import annotations

import statistics
import time

import jax


def timeit(fn, *args, warmup: int = 1, repeat: int = 5):
    """``(median seconds, samples)`` of ``fn(*args)`` after ``warmup`` calls; every call is waited
    for with ``block_until_ready`` so device work is inside the clock."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), ts


def steady_state(fn, *args, steps: int = 8, warmup: int = 1, repeat: int = 3):
    """``(median seconds per call, samples)`` of ``steps`` calls issued back to back and waited for
    once: how a training loop runs (the host dispatches call ``i + 1`` while the devices execute
    call ``i``), so the host's dispatch and the final sync are no longer inside every call's time.
    :func:`timeit` measures one isolated call; report both."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = None
        for _ in range(steps):
            out = fn(*args)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) / steps)
    return statistics.median(ts), ts
