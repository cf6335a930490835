"""A run is never lost: run-directory guard, resume de-duplication, skipped non-finite updates,
SIGINT, up-front checks of paths / token files / YAML, overrides anywhere (issue 26, findings 1 4 5 6 7 9 10).

Runs use configs/tiny_cpu.yaml shrunk to seconds: one device, dense reference attention, 128-token
sequences, a 2-layer 32-wide model.
"""

import json
import os
import signal

import numpy as np
import pytest

from mtraining_jax.train import cli
from mtraining_jax.train.checkpoint import Checkpointer
from mtraining_jax.train.config import load_config
from mtraining_jax.train.loop import Interrupted, run

pytestmark = pytest.mark.usefixtures("jax_compilation_cache")
CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "tiny_cpu.yaml")
FAST = [
    "model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=2", "model.num_heads=2",
    "model.num_kv_heads=1", "model.attention_backend=reference", "model.dense_layers=[]", "mesh.shape=[1,1]",
    "data.seq_len=128", "eval.every=0", "logging.progress=false", "logging.tensorboard=false",
    "logging.plot=false", "optim.warmup_steps=1", "checkpoint.async_save=false",
]


def _main(capsys, *args):
    rc = cli.main(["--config", CONFIG, *FAST, *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _steps(run_dir):
    return sorted(int(n) for n in os.listdir(os.path.join(run_dir, "checkpoints")) if n.isdigit())


def test_second_run_is_refused_and_overwrite_clears_the_first(tmp_path, capsys):
    rd = str(tmp_path / "run")
    rc, _, _ = _main(capsys, f"run_dir={rd}", "steps=2", "checkpoint.every=1", "checkpoint.keep=5")
    assert rc == 0 and _steps(rd) == [1, 2]
    before = open(os.path.join(rd, "metrics.jsonl")).read()
    rc, _, err = _main(capsys, f"run_dir={rd}", "steps=3", "checkpoint.every=1")
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "is not empty" in err and "--resume" in err and "--overwrite" in err and "[1, 2]" in err
    assert _steps(rd) == [1, 2] and open(os.path.join(rd, "metrics.jsonl")).read() == before  # untouched
    rc, _, _ = _main(capsys, f"run_dir={rd}", "--overwrite", "steps=1", "checkpoint.every=1")
    assert rc == 0
    assert _steps(rd) == [1] and [r["step"] for r in _records(rd)] == [1]
    rc, _, err = _main(capsys, f"run_dir={rd}", "--overwrite", "--resume")
    assert rc == 2 and "exclude each other" in err


def test_resume_drops_metrics_after_the_checkpoint_and_accepts_overrides_anywhere(tmp_path, capsys):
    rd = tmp_path / "run"
    rc, _, _ = _main(capsys, f"run_dir={rd}", "steps=4", "checkpoint.every=2", "checkpoint.keep=5",
                     "logging.plot=true")
    assert rc == 0 and _steps(rd) == [2, 4]
    first = {r["step"]: r["loss"] for r in _records(rd)}
    # A run killed after step 4 was logged but before its checkpoint was written:
    Checkpointer(str(rd / "checkpoints"))._mgr.delete(4)
    # overrides before and after the flag (finding 9)
    rc = cli.main(["--config", CONFIG, *FAST, f"run_dir={rd}", "steps=4", "--resume", "checkpoint.every=2",
                   "logging.plot=true"])
    out = capsys.readouterr().out
    assert rc == 0 and "resumed from step 2" in out and "dropped 2 metrics record(s) after step 2" in out
    recs = _records(rd)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]  # each step once, the redone ones from this run
    for r in recs:
        assert r["loss"] == pytest.approx(first[r["step"]], abs=1e-6)  # exact resume
    assert (rd / "loss.png").stat().st_size > 1000


def test_non_finite_gradient_with_finite_loss_stops_with_exit_1(tmp_path, capsys):
    # lr=1e6: the first update makes the weights huge; the next loss stays finite (softmax
    # saturates) while its gradient overflows. Before issue 26 this ran to "done" with frozen weights.
    rd = tmp_path / "run"
    rc, _, err = _main(capsys, f"run_dir={rd}", "steps=5", "optim.lr=1e6", "optim.clip_norm=0",
                       "checkpoint.every=1")
    assert rc == 1, err
    assert "non-finite gradient (grad_norm nan) at step" in err and "with finite loss" in err, err
    assert "optim.max_bad_steps" in err and "last good checkpoint is step" in err
    recs = _records(rd)
    bad = recs[-1]
    assert bad["skipped_updates"] == 1.0
    assert _steps(rd)[-1] == bad["step"] - 1  # nothing saved at or after the bad step
    ck = Checkpointer(str(rd / "checkpoints"))
    state, _, _ = ck.restore(_steps(rd)[-1])
    ck.close()
    assert all(np.isfinite(np.asarray(x)).all() for x in _leaves(state["params"]))


def test_bad_steps_are_skipped_and_counted_up_to_max_bad_steps(tmp_path, capsys):
    rd = tmp_path / "run"
    rc, _, err = _main(capsys, f"run_dir={rd}", "steps=4", "optim.lr=1e6", "optim.clip_norm=0",
                       "checkpoint.every=0", "optim.max_bad_steps=2")
    recs = _records(rd)
    skipped = [r for r in recs if r.get("skipped_updates") and r["step"] > 1]
    assert skipped, recs
    assert err.count("warning: non-finite") >= 1 and "update skipped" in err
    if rc == 1:  # two bad steps in a row
        assert "2 bad step(s) in a row" in err
    else:
        assert rc == 0


def _leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def test_sigint_saves_a_checkpoint_and_resume_continues(tmp_path):
    cfg = load_config(CONFIG, FAST + [f"run_dir={tmp_path}", "steps=5", "checkpoint.every=100"])

    def ctrl_c_at_step_2(r, step, metrics):
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)

    before = signal.getsignal(signal.SIGINT)  # Python's default_int_handler; SIG_IGN in an xdist worker
    with pytest.raises(Interrupted, match=r"interrupted after step 2; checkpoint saved in .*--resume"):
        run(cfg, hooks=[ctrl_c_at_step_2])
    assert signal.getsignal(signal.SIGINT) is before  # the caller's handler restored
    assert _steps(tmp_path) == [2]
    res = run(load_config(CONFIG, FAST + [f"run_dir={tmp_path}", "steps=3", "checkpoint.every=100",
                                          "checkpoint.resume=true"]))
    assert [s for s, _ in res.train_losses] == [3]


def test_resume_with_a_changed_model_names_the_parameter_and_both_shapes(tmp_path, capsys):
    rd = tmp_path / "run"
    assert _main(capsys, f"run_dir={rd}", "steps=1", "checkpoint.every=1")[0] == 0
    rc, _, err = _main(capsys, f"run_dir={rd}", "steps=2", "--resume", "model.intermediate_size=48")
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "params/layers/mlp/down_proj/kernel: checkpoint (2, 64, 32), model (2, 48, 32)" in err


@pytest.mark.parametrize("where", ["run_dir", "checkpoint.dir", "parent"])
def test_a_file_where_a_directory_belongs_is_an_error_up_front(tmp_path, capsys, where):
    f = tmp_path / "afile"
    f.write_text("x")
    arg = {"run_dir": f"run_dir={f}", "checkpoint.dir": f"checkpoint.dir={f}",
           "parent": f"run_dir={f / 'sub'}"}[where]
    rc, _, err = _main(capsys, f"run_dir={tmp_path / 'run'}", arg, "steps=1", "checkpoint.every=1")
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert str(f) in err and "not a directory" in err and ("checkpoint.dir" in err) == (where == "checkpoint.dir")


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: np.save(p, np.array([1, 2, 600, 3] * 100, np.int64)),
         "token id 600 at position 2 is outside the model's vocabulary [0, model.vocab_size=512)"),
        (lambda p: np.save(p, np.arange(400, dtype=np.float32)), "holds float32 values; token ids must be integers"),
        (lambda p: np.save(p, np.zeros(0, np.int32)), "holds no tokens"),
    ],
    ids=["id-beyond-vocab", "float-tokens", "empty"],
)
def test_token_files_are_checked_up_front(tmp_path, capsys, make, message):
    path = str(tmp_path / "tokens.npy")
    make(path)
    rc, _, err = _main(capsys, f"run_dir={tmp_path / 'run'}", "steps=1", "data.source=tokens",
                       f"data.path={path}", "data.heldout_percent=10")
    assert rc == 2 and message in err and path in err and len(err.strip().splitlines()) == 1


def test_raw_token_file_size_must_match_the_dtype(tmp_path, capsys):
    path = tmp_path / "tokens.bin"
    path.write_bytes(b"\x01\x00\x02")
    rc, _, err = _main(capsys, f"run_dir={tmp_path / 'run'}", "data.source=tokens", f"data.path={path}",
                       "data.token_dtype=uint16")
    assert rc == 2 and "has 3 bytes, not a multiple of data.token_dtype=uint16" in err


def test_yaml_syntax_error_is_one_line_with_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: 3\noptim:\n  lr: [1e-3\n  warmup_steps: 2\n")
    assert cli.main(["--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"{bad}:" in err and "YAML syntax error" in err
    assert cli.main(["--config", str(tmp_path)]) == 2
    assert "is a directory, not a YAML file" in capsys.readouterr().err


def test_model_messages_carry_the_dotted_key(tmp_path, capsys):
    rd = f"run_dir={tmp_path / 'run'}"
    rc, _, err = _main(capsys, rd, "model.num_kv_heads=0")
    assert rc == 2 and "model.num_kv_heads must be a positive integer, got 0" in err
    rc, _, err = _main(capsys, rd, "model.hidden_sise=3")
    assert rc == 2 and "unknown config key(s) model.hidden_sise" in err
    assert not (tmp_path / "run").exists()  # nothing created for a bad config
    rc, _, err = _main(capsys, rd, "model.init_from=s3:bucket")
    assert rc == 2 and "model.init_from must look like 'hf:<dir>' or 'ckpt:<dir>'" in err


def test_saved_config_is_reusable_with_config(tmp_path, capsys):
    rd = tmp_path / "run"
    assert _main(capsys, f"run_dir={rd}", "steps=1", "checkpoint.every=0")[0] == 0
    saved = rd / "config.yaml"
    # a new run from it (--overwrite of its own run_dir is refused: tests/test_train_faults.py)
    rc = cli.main(["--config", str(saved), f"run_dir={tmp_path / 'again'}", "steps=2"])
    out = capsys.readouterr().out
    assert rc == 0 and "done: step 2" in out and "compiling the training step" in out
    assert load_config(str(saved)).model.fields["hidden_size"] == 32
    assert load_config(str(tmp_path / "again" / "config.yaml")).model.fields["hidden_size"] == 32
