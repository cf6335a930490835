"""``mtraining-eval`` end to end on tiny checkpoints made here: a 1-step training run (MTraining
sparse attention on a 1x2 mesh) and a converter-format checkpoint; clear one-line errors."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from mtraining_jax.eval import cli
from mtraining_jax.model.checkpoint import save_model_checkpoint
from mtraining_jax.model.config import ModelConfig
from mtraining_jax.model.qwen2 import Qwen2ForCausalLM
from mtraining_jax.train.config import load_config
from mtraining_jax.train.loop import run

CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "tiny_cpu.yaml")
SMALL = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=2", "model.num_heads=2",
         "model.num_kv_heads=1", "data.seq_len=512", "steps=1", "checkpoint.every=1", "checkpoint.async_save=false",
         "eval.every=1", "eval.batches=1", "eval.passkey_samples=0", "logging.progress=false",
         "logging.tensorboard=false", "logging.plot=false", "optim.warmup_steps=1", "mesh.shape=[1,2]"]
FAST = ["--depths", "0,1", "--samples", "1", "--tasks", "multikey", "--ruler-samples", "1", "--buckets", "4",
        "--recall-rows", "32", "--no-progress"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    result = run(load_config(CONFIG, SMALL + [f"run_dir={d}"]))
    return str(d), result


def test_eval_run_dir_end_to_end(trained, tmp_path, capsys):
    run_dir, result = trained
    out = str(tmp_path / "ev")
    rc = cli.main([run_dir, "--out", out, "--lengths", "512", "--ppl-windows", "1", "--recall-p", "0.9", *FAST])
    assert rc == 0, capsys.readouterr().err
    res = json.loads(Path(out, "results.json").read_text())
    assert res["model"]["backends"] == ["ring", "mtraining"]
    # an untrained model does not know the needles: every answer is wrong
    assert np.array_equal(res["niah"]["accuracy"], [[0.0], [0.0]]) and res["ruler"]["tasks"]["multikey"]["accuracy"] == [0.0]
    # loss by position over the first held-out window = the trainer's own held-out loss (same window)
    assert res["perplexity"]["windows"] == 1 and len(res["perplexity"]["loss"]) == 4
    np.testing.assert_allclose(res["perplexity"]["mean_loss"], result.eval_metrics[-1]["loss"], rtol=1e-4)
    rec = np.asarray(res["recall"]["recall"]["0.9"])
    assert rec.shape == (2, 2) and np.all((rec > 0) & (rec <= 1 + 1e-6))
    for f in ("niah.png", "position_loss.png", "ruler.png", "recall.png"):
        assert os.path.getsize(os.path.join(out, f)) > 1000
    cmp_dir = str(tmp_path / "cmp")
    assert cli.main(["--compare", out, out, "--labels", "dense,sparse", "--out", cmp_dir]) == 0
    table = open(os.path.join(cmp_dir, "compare.md")).read()
    assert "| NIAH passkey accuracy (mean of grid) | 0.0000 | 0.0000 | +0.0000 |" in table
    assert os.path.isfile(os.path.join(cmp_dir, "compare_niah.png"))


def test_eval_converter_checkpoint_and_errors(trained, tmp_path, capsys):
    cfg = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2,
                      num_kv_heads=1, max_position_embeddings=1024)
    ck = tmp_path / "ck"
    save_model_checkpoint(Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0)), ck)
    out = str(tmp_path / "ev")
    base = ["--out", out, "--ppl-windows", "0", "--recall-p", "", *FAST]
    assert cli.main([str(ck), "--lengths", "512", "--mesh", "1x1", *base]) == 0
    assert json.loads(Path(out, "results.json").read_text())["niah"]["lengths"] == [512]
    capsys.readouterr()

    def err(*argv):
        assert cli.main(list(argv)) == 2
        e = capsys.readouterr().err.strip()
        assert e.startswith("mtraining-eval: error:") and "\n" not in e and "Traceback" not in e
        return e

    assert "'nowhere' does not exist" in err("nowhere", *base)
    assert f"no model checkpoint in {tmp_path}" in err(str(tmp_path), *base)
    assert "context length 2048 exceeds the model's max_position_embeddings=1024" in err(
        str(ck), "--lengths", "2048", *base)
    run_dir = trained[0]  # 500 tokens do not split into 64-token stripes over 2 ranks
    assert "context length 500 cannot run on 2 rank(s)" in err(run_dir, "--lengths", "500", *base)
    (ck / "model.yaml").write_text((ck / "model.yaml").read_text().replace("hidden_size: 64", "hidden_size: 96"))
    assert "does not match the model: embed_tokens/embedding: checkpoint (300, 64), model (300, 96)" in err(str(ck), "--lengths", "512", *base)
