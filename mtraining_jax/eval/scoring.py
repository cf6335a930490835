"""Answer scoring of :class:`~mtraining_jax.eval.tasks.Example` s with a predictor.

Greedy answer accuracy from one forward pass: with the answer teacher-forced, the argmax at every
answer position equals the answer token exactly when greedy decoding from the prompt would emit
the whole answer, so ``exact = all(pred == label over the answer)`` is greedy exact match (no
KV cache or sequential decoding needed). ``token_accuracy`` is the fraction of answer tokens right.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from mtraining_jax.eval.tasks import Example


def score_batch(predict: Callable, examples: Sequence[Example]):
    """``(exact float64 [N], token_accuracy float64 [N])`` of examples of one length."""
    toks = np.stack([e.tokens for e in examples])
    ans = np.stack([e.answer for e in examples])
    pred, _ = predict(toks[:, :-1], toks[:, 1:])
    hit = np.asarray(pred) == toks[:, 1:]
    n = ans.sum(1)
    right = (hit & ans).sum(1)
    return (right == n).astype(np.float64), right / np.maximum(n, 1)


def score_examples(predict: Callable, examples: Sequence[Example], batch_size: int = 1, progress=None):
    """:func:`score_batch` over ``examples`` in batches of ``batch_size`` (same length per batch);
    ``progress``: a tqdm-like object updated once per example."""
    exact, tok = [], []
    for i in range(0, len(examples), batch_size):
        chunk = examples[i:i + batch_size]
        e, t = score_batch(predict, chunk)
        exact.append(e)
        tok.append(t)
        if progress is not None:
            progress.update(len(chunk))
    if not exact:
        return np.zeros(0), np.zeros(0)
    return np.concatenate(exact), np.concatenate(tok)
