"""Retrieval benchmarks over context lengths: the needle-in-a-haystack grid (lengths x depths)
and the RULER-style tasks (:mod:`~mtraining_jax.eval.tasks`), scored by greedy exact match
(:mod:`~mtraining_jax.eval.scoring`).

Result dicts are plain JSON: ``niah = {"task", "lengths", "depths", "samples", "accuracy"
[depth][length], "token_accuracy" [depth][length], "correct" [depth][length][sample]}`` (``correct``: 1
where that sample's whole answer matched; the examples depend only on the seed, the cell and the
haystack stream, so two models' grids on the same stream pair sample by sample); ``ruler = {"lengths", "samples",
"tasks": {task: {"accuracy": [per length], "token_accuracy": [per length]}}}``.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from mtraining_jax.eval.scoring import score_examples
from mtraining_jax.eval.tasks import make_example


def niah_grid(predict: Callable, tokenizer, lengths: Sequence[int], depths: Sequence[float], samples: int,
              seed: int = 0, stream=None, batch_size: int = 1, progress=None, task: str = "passkey") -> dict:
    """Accuracy of ``task`` (default passkey) per (depth, length) cell over ``samples`` examples."""
    acc = np.zeros((len(depths), len(lengths)))
    tacc = np.zeros_like(acc)
    correct = [[[] for _ in lengths] for _ in depths]
    for j, S in enumerate(lengths):
        for i, d in enumerate(depths):
            ex = [make_example(task, tokenizer, S, d, seed, i, s, stream) for s in range(samples)]
            e, t = score_examples(predict, ex, batch_size, progress)
            acc[i, j], tacc[i, j] = e.mean(), t.mean()
            correct[i][j] = [int(x) for x in np.asarray(e) > 0.5]
    return {"task": task, "lengths": [int(x) for x in lengths], "depths": [float(d) for d in depths],
            "samples": int(samples), "accuracy": acc.tolist(), "token_accuracy": tacc.tolist(), "correct": correct}


def ruler_suite(predict: Callable, tokenizer, lengths: Sequence[int], tasks: Sequence[str], samples: int,
                seed: int = 0, stream=None, batch_size: int = 1, progress=None) -> dict:
    """Accuracy per task and length; each sample draws its own needle depth."""
    out = {"lengths": [int(x) for x in lengths], "samples": int(samples), "tasks": {}}
    for task in tasks:
        acc, tacc = [], []
        for S in lengths:
            rng = np.random.default_rng([int(seed), int(S), len(task)])
            ex = [make_example(task, tokenizer, S, float(rng.uniform()), seed, 1000, s, stream)
                  for s in range(samples)]
            e, t = score_examples(predict, ex, batch_size, progress)
            acc.append(float(e.mean()))
            tacc.append(float(t.mean()))
        out["tasks"][task] = {"accuracy": acc, "token_accuracy": tacc}
    return out
