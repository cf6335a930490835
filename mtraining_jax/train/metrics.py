"""Run metrics: JSONL and TensorBoard event files (``tensorboardX``, a dependency; skipped with a
warning where it is missing, e.g. an offline GPU image), a
tqdm progress bar, and a loss-curve PNG (matplotlib Agg) at the end.

Every record is one JSON line ``{"step": int, "split": "train"|"eval", "time": float, ...}``;
the ``mtraining`` backend's statistics (work fraction, worker / step imbalance, averaged over the sparse
layers; :func:`mtraining_jax.train.step.forward_with_metrics`) arrive in the same records under ``attn/...``.
Train records also carry ``peak_gib`` (:func:`device_peak_gib`) where the devices report it (GPUs).
Only process 0 writes.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings

import jax


def device_peak_bytes(devices=None) -> int | None:
    """Largest ``memory_stats()["peak_bytes_in_use"]`` over ``devices`` (default: this process's), in
    bytes since the process started (the allocator's own counter: everything the program, the state
    and the batch took), or ``None`` where the devices report no memory statistics (the CPU)."""
    peaks = []
    for d in jax.local_devices() if devices is None else devices:
        try:
            stats = d.memory_stats()
        except Exception:  # a backend without the call
            stats = None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


def device_peak_gib() -> float | None:
    """:func:`device_peak_bytes` of this process's devices in GiB (``None`` on the CPU)."""
    peak = device_peak_bytes()
    return None if peak is None else peak / 2**30


class MetricsWriter:
    """Append metrics to ``<run_dir>/metrics.jsonl`` and, if available, TensorBoard.
    ``purge_step``: a resumed run's first step; TensorBoard hides older events at or after it."""

    def __init__(self, run_dir: str, tensorboard: bool = True, purge_step: int | None = None):
        self.enabled = jax.process_index() == 0
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._tb = None
        self.tensorboard_backend = None
        if not self.enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        self._f = open(self.path, "a")
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:
                warnings.warn("tensorboardX is not installed: no TensorBoard event files (metrics.jsonl only)")
            else:
                self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"), purge_step=purge_step)
                self.tensorboard_backend = "tensorboardX"

    def write(self, step: int, metrics: dict, split: str = "train") -> None:
        if not self.enabled:
            return
        rec = {"step": int(step), "split": split, "time": time.time()}
        for k, v in metrics.items():
            v = float(v)
            rec[k] = v if math.isfinite(v) else str(v)
            if self._tb is not None and math.isfinite(v):
                self._tb.add_scalar(f"{split}/{k}", v, int(step))
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        self._f.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_losses(metrics_path: str, png_path: str) -> str:
    """Plot train loss (and eval loss / passkey accuracy when present) against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in recs if r["split"] == "train" and isinstance(r.get("loss"), float)]
    ev = [(r["step"], r["loss"]) for r in recs if r["split"] == "eval" and isinstance(r.get("loss"), float)]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train loss")
    if ev:
        ax.plot(*zip(*ev), "o-", label="held-out loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path


class Progress:
    """tqdm bar showing loss, tokens/s, step time and, with sparse attention, the executed fraction of
    dense causal work and the worker imbalance (process 0, when enabled)."""

    def __init__(self, total: int, initial: int, enabled: bool = True):
        self._bar = None
        self._recall = None  # the last computed MSA recall (computed on logging steps only)
        if enabled and jax.process_index() == 0:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)

    def update(self, loss: float, tokens_per_s: float, step_time: float, attn: dict | None = None) -> None:
        if self._bar is not None:
            extra = {}
            if attn and "attn/work_fraction" in attn:
                extra["work"] = f"{float(attn['attn/work_fraction']):.1%}"
            if attn and "attn/msa_kl" in attn:
                extra["kl"] = f"{float(attn['attn/msa_kl']):.3f}"
                if "msa/kl_grad_norm" in attn:
                    extra["kl_gn"] = f"{float(attn['msa/kl_grad_norm']):.2e}"
                rec = float(attn.get("attn/msa_recall", math.nan))
                self._recall = rec if math.isfinite(rec) else self._recall
                if self._recall is not None:
                    extra["recall"] = f"{self._recall:.1%}"
            if attn and "attn/worker_imbalance" in attn:
                extra["imb"] = f"{float(attn['attn/worker_imbalance']):.2f}"
            if attn and "peak_gib" in attn:
                extra["peak"] = f"{float(attn['peak_gib']):.1f}GiB"
            self._bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}", step_s=f"{step_time:.2f}",
                                  **extra)
            self._bar.update(1)

    def write(self, msg: str) -> None:
        if self._bar is not None:
            self._bar.write(msg)
        elif jax.process_index() == 0:
            print(msg, flush=True)

    def warn(self, msg: str) -> None:
        """``msg`` on stderr (above the bar when there is one), process 0."""
        if self._bar is not None:
            self._bar.write(msg, file=sys.stderr)
        elif jax.process_index() == 0:
            print(msg, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
