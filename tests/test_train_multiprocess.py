"""2 processes x 4 CPU devices train 2 steps with jax.distributed on localhost (gloo collectives),
matching the same run in one process on 8 devices."""

import json
import os
from pathlib import Path

import pytest

from _multiprocess import run_workers
from mtraining_jax.train.config import load_config
from mtraining_jax.train.loop import run

HERE = os.path.dirname(os.path.abspath(__file__))
OVERRIDES = [
    "model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=2",
    "model.num_heads=2", "model.num_kv_heads=1", "data.seq_len=512", "steps=2",
    "optim.warmup_steps=1", "eval.every=0",
    "checkpoint.every=2", "logging.progress=false",
]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_processes_train_two_steps(tmp_path):
    run_dir = tmp_path / "mp"
    run_workers(Path(HERE) / "_train_mp_worker.py", 2, 4, timeout_s=240, extra_args=(str(run_dir), *OVERRIDES))
    recs = [json.loads(l) for l in open(run_dir / "metrics.jsonl")]
    mp_train = {r["step"]: r["loss"] for r in recs if r["split"] == "train"}
    assert sorted(mp_train) == [1, 2]
    assert (run_dir / "checkpoints" / "2").is_dir()

    # The same run in this process (8 devices, the same 2 x 4 mesh) gives the same losses.
    single = run(load_config(os.path.join(HERE, "..", "configs", "tiny_cpu.yaml"),
                             OVERRIDES + [f"run_dir={tmp_path / 'single'}", "checkpoint.every=0"]))
    for step, loss in single.train_losses:
        assert mp_train[step] == pytest.approx(loss, rel=1e-5, abs=1e-5)
