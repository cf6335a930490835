"""A quality-study run's curves from the trainer's metrics: cumulative training time per step
(:func:`time_curve`), and an arm's curves joined after the warm start it continued (:func:`join_warm`)."""

from __future__ import annotations

import statistics


def time_curve(train_rows, compile_steps=(), start: int = 0) -> list:
    """``[[step, cumulative training seconds]]`` from the trainer's ``step_time`` of the steps after
    ``start`` (every logged step; a gap of ``g`` steps counts ``g`` times the logged one); the first
    step and the steps in ``compile_steps`` (the first of each resumed slice), which carry a
    compilation, count as the median of the others. ``start``: the step the run continued from (a
    warm start's ``W``): the steps up to it are not this run's and are not counted."""
    st = [(int(m["step"]), float(m["step_time"])) for m in train_rows if "step_time" in m and int(m["step"]) > start]
    if not st:
        return []
    if len(st) > 1:
        slow = {st[0][0], *compile_steps}
        rest = [t for s, t in st if s not in slow] or [t for _, t in st[1:]]
        med = statistics.median(rest)
        st = [(s, med if s in slow else t) for s, t in st]
    out, cum, prev = [], 0.0, start
    for s, t in st:
        cum += t * max(s - prev, 1)
        prev = s
        out.append([s, cum])
    return out


def join_warm(rec: dict, warm: dict, own_time: list) -> None:
    """An arm's row continuing ``warm`` (:func:`benchmarks.quality_warm.warm_start`'s record, steps
    1 .. ``W`` trained densely) gets whole-schedule curves: ``train_time`` is the warm start's measured
    time (``warm['train_time']``, the same for every arm of the seed) followed by ``own_time`` (the
    arm's :func:`time_curve` from ``W``) shifted by it; ``heldout_curve`` and ``train_loss`` start
    with the warm start's. So "equal training time" compares arms that paid the same dense prefix."""
    W = int(warm["steps"])
    prefix = [p for p in warm.get("train_time") or [] if p[0] <= W]
    offset = prefix[-1][1] if prefix else float(warm.get("seconds") or 0.0)  # older records: wall time
    rec["train_time"] = [list(p) for p in prefix] + [[s, offset + t] for s, t in own_time]
    for key in ("heldout_curve", "train_loss"):
        own = [p for p in rec.get(key) or [] if p[0] > W]
        rec[key] = [list(p) for p in warm.get(key) or [] if p[0] <= W] + own
