"""Loss by position: does the model use far context?

The first ``num_windows`` windows of ``S + 1`` tokens of a held-out stream (file order, as the
trainer's held-out batches) are scored; the per-token loss ``-log p(x[t+1] | x[:t+1])`` is averaged
over windows in ``num_buckets`` equal-width position buckets. A model that uses long context has a
loss that keeps falling with position. Result (JSON): ``{"seq_len", "windows", "bucket_edges"
[num_buckets + 1], "loss" [num_buckets], "perplexity" [num_buckets], "mean_loss", "window_loss" [windows], "tokens"}``.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np


def position_loss(predict: Callable, stream, seq_len: int, num_windows: int, num_buckets: int = 16,
                  batch_size: int = 1, progress=None) -> dict:
    """See module docstring; ``ValueError`` when the stream holds fewer than one window."""
    stream = np.asarray(stream)
    avail = (len(stream) - 1) // seq_len
    if avail < 1:
        raise ValueError(f"the held-out data has {len(stream)} tokens, fewer than one window of "
                         f"{seq_len} + 1 for the perplexity-by-position evaluation")
    if num_buckets < 1 or seq_len % num_buckets:
        raise ValueError(f"num_buckets={num_buckets} must be positive and divide the length {seq_len}")
    n = min(int(num_windows), avail)
    wins = np.stack([stream[w * seq_len: w * seq_len + seq_len + 1] for w in range(n)]).astype(np.int32)
    nll = []
    for i in range(0, n, batch_size):
        b = wins[i:i + batch_size]
        _, l = predict(b[:, :-1], b[:, 1:])
        nll.append(np.asarray(l, np.float64))
        if progress is not None:
            progress.update(len(b))
    nll = np.concatenate(nll)  # [n, S]
    per = nll.reshape(n, num_buckets, seq_len // num_buckets).mean(axis=(0, 2))
    return {"seq_len": int(seq_len), "windows": n,
            "bucket_edges": [int(x) for x in np.linspace(0, seq_len, num_buckets + 1)],
            "loss": per.tolist(), "perplexity": [math.exp(min(x, 80.0)) for x in per],
            "mean_loss": float(nll.mean()), "window_loss": nll.mean(1).tolist(), "tokens": int(nll.size)}
