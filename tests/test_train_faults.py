"""The trainer under real faults (issue 36): a damaged newest checkpoint, SIGTERM / a second signal
during compilation, two launches on one run_dir, schedule changes on resume, the --overwrite of a
run's own config, --plan for a named GPU, and one-line messages (file, line, dotted key, value).

Runs use configs/tiny_cpu.yaml shrunk to milliseconds per step (one device, dense reference
attention, 128-token sequences, a 2-layer 32-wide model) on a random token file; the subprocess
tests run ``python -m mtraining_jax.apps.train`` as a user would.
"""

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from mtraining_jax.train import cli
from mtraining_jax.train.checkpoint import FILE_LIST
from mtraining_jax.train.rundir import HOST, LOCK_NAME, RunDirLocked, RunLock

pytestmark = pytest.mark.usefixtures("jax_compilation_cache")
ROOT = os.path.join(os.path.dirname(__file__), "..")
CONFIG = os.path.join(ROOT, "configs", "tiny_cpu.yaml")
FAST = [
    "model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=2", "model.num_heads=2",
    "model.num_kv_heads=1", "model.attention_backend=reference", "model.dense_layers=[]", "mesh.shape=[1,1]",
    "data.seq_len=128", "data.source=tokens", "data.heldout_percent=10", "eval.every=0", "logging.progress=false",
    "logging.tensorboard=false", "logging.plot=false", "optim.warmup_steps=1", "checkpoint.async_save=false",
]


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "tokens.npy"
    np.save(path, np.random.default_rng(0).integers(0, 259, 6000).astype(np.uint16))
    return str(path)


def _main(capsys, tokens, *args):
    rc = cli.main(["--config", CONFIG, *FAST, f"data.path={tokens}", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _metric_steps(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["step"] for line in f]


def _ckpt_names(run_dir):
    return sorted(os.listdir(os.path.join(run_dir, "checkpoints")))


def _truncate_data(step_dir):
    """Cut every array data file of a checkpoint to a third (a full disk, a bad copy)."""
    for root, _, files in os.walk(os.path.join(step_dir, "state")):
        if os.path.basename(root) == "d" and "ocdbt.process_0" in root:
            for f in files:
                p = os.path.join(root, f)
                os.truncate(p, os.path.getsize(p) // 3)


# ------------------------------------------------------------------------------------ checkpoints
def test_resume_skips_a_damaged_checkpoint_and_names_schedule_changes(tmp_path, tokens, capsys, caplog):
    rd = str(tmp_path / "run")
    # steps=100000 (8 of them run): the program of the SIGTERM test's subprocess, compiled once
    rc, _, _ = _main(capsys, tokens, f"run_dir={rd}", "steps=100000", "run_steps=8", "checkpoint.every=2",
                     "checkpoint.keep=5")
    assert rc == 0 and _ckpt_names(rd) == ["2", "4", "6", "8", "model.yaml"]
    _truncate_data(os.path.join(rd, "checkpoints", "8"))
    with caplog.at_level(logging.WARNING):
        rc, out, err = _main(capsys, tokens, f"run_dir={rd}", "steps=10", "checkpoint.every=2", "checkpoint.keep=5",
                             "optim.lr=1e-3", "--resume")
    assert rc == 0, err
    lines = out.splitlines()
    skipped = [line for line in lines if line.startswith("skipped checkpoint")]
    assert len(skipped) == 1 and skipped[0].startswith("skipped checkpoint 8: damaged (")
    # named from the step's file list, before Orbax reads (and abandons) anything
    assert skipped[0].endswith("); moved to 8.damaged") and " when saved)" in skipped[0]
    assert re.match(r"skipped checkpoint 8: damaged \(state/ocdbt\.process_0/d/\w+ has (\d+) bytes, (\d+) when saved\)",
                    skipped[0])
    assert f"resumed from step 6 in {rd}/checkpoints" in lines
    assert "note: steps changed since the checkpoint was written: 100000 -> 10" in lines
    assert "note: optim.lr changed since the checkpoint was written: 0.003 -> 0.001" in lines
    assert sum(line.startswith("note:") for line in lines) == 2  # seq_len, batch, accum unchanged
    assert "Traceback" not in err and "done: step 10" in out
    assert not [r for r in caplog.records if "_CHECKPOINT_METADATA" in r.getMessage()]  # no absl warning
    assert _metric_steps(rd) == list(range(1, 11))  # each step once: 7 and 8 redone from checkpoint 6
    assert "8.damaged" in _ckpt_names(rd) and "10" in _ckpt_names(rd) and not os.path.exists(f"{rd}/{LOCK_NAME}")
    # the README's old "a run's saved config, reused" line: --overwrite would delete that config and run
    saved = os.path.join(rd, "config.yaml")
    rc = cli.main(["--config", saved, "--overwrite", "steps=2"])
    err = capsys.readouterr().err
    assert rc == 2 and err == (f"mtraining-train: error: --overwrite would delete {saved}, the config being read (the "
                               f"saved config of the run in {rd}); to start a new run from it add run_dir=<another "
                               f"folder> (its checkpoints stay), or pass --resume to continue that run\n")
    assert "10" in _ckpt_names(rd)
    # nothing restores: one line naming the folder and each step's reason
    for name in _ckpt_names(rd):
        if name.isdigit():
            os.remove(os.path.join(rd, "checkpoints", name, "state", "_METADATA"))
    os.remove(os.path.join(rd, "checkpoints", "6", FILE_LIST))  # as an older version saved it: Orbax's error
    rc, _, err = _main(capsys, tokens, f"run_dir={rd}", "steps=12", "checkpoint.every=2", "--resume")
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"mtraining-train: error: no checkpoint in {rd}/checkpoints restores (step 10: "
                          "state/_METADATA is missing; step 8: state/_METADATA is missing; "
                          "step 6: its _METADATA file is missing; step 4: ")
    assert err.rstrip().endswith("start again with --overwrite, or restore the folder from a backup")


def test_a_checkpoint_is_checked_against_its_file_list_before_orbax_reads(tmp_path, monkeypatch):
    """Each saved step lists its files and sizes once final; a restore names a truncated, missing or
    unlisted-damage file from that list before Orbax reads anything; a step without the list (an older
    version's) goes through Orbax as before (its TensorStore error, one line)."""
    import jax.numpy as jnp

    from mtraining_jax.model.checkpoint import DamagedCheckpointError
    from mtraining_jax.train.checkpoint import Checkpointer, _step_files

    state = {"params": {"w": jnp.arange(4096.0).reshape(64, 64)}, "step": jnp.asarray(3)}
    ck = Checkpointer(str(tmp_path / "ck"), keep=2, async_save=True)
    for step in (1, 2, 3):
        ck.save(step, state, {"epoch": step})
    ck.wait()
    assert sorted(os.listdir(ck.directory)) == ["2", "3"]  # rotated: the lists go with their steps
    for step in ("2", "3"):
        where = os.path.join(ck.directory, step)
        with open(os.path.join(where, FILE_LIST)) as f:
            listed = json.load(f)
        assert listed == _step_files(where) and any(k.startswith("state/ocdbt.process_0/d/") for k in listed)
    got, data, _ = ck.restore(3, state)
    assert data == {"epoch": 3} and np.array_equal(got["params"]["w"], state["params"]["w"])

    where = os.path.join(ck.directory, "3")
    listed = json.load(open(os.path.join(where, FILE_LIST)))
    blob = next(k for k in sorted(listed) if k.startswith("state/ocdbt.process_0/d/"))
    os.truncate(os.path.join(where, blob), listed[blob] // 3)
    reads = []
    monkeypatch.setattr(ck._mgr, "restore", lambda *a, **k: reads.append(a))
    with pytest.raises(DamagedCheckpointError, match=re.escape(f"{where} is damaged: {blob} has "
                                                               f"{listed[blob] // 3} bytes, {listed[blob]} when saved")):
        ck.restore(3, state)
    meta = os.path.join(where, "meta", "metadata")
    os.rename(meta, meta + ".away")
    with pytest.raises(DamagedCheckpointError, match="is damaged: meta/metadata is missing"):
        ck.restore(3, state)
    os.rename(meta + ".away", meta)
    with open(os.path.join(where, FILE_LIST), "w") as f:
        f.write("[1, 2")
    with pytest.raises(DamagedCheckpointError, match=f"its file list {FILE_LIST} is unreadable"):
        ck.restore(3, state)
    assert reads == []  # Orbax was never asked
    monkeypatch.undo()
    # the step without its list: Orbax's own error, named in one line by restore_newest
    os.remove(os.path.join(where, FILE_LIST))
    _truncate_data(where)
    step, (got, data, _), skipped = ck.restore_newest(state)
    assert step == 2 and data == {"epoch": 2} and [s for s, _ in skipped] == [3]
    assert "OUT_OF_RANGE" in skipped[0][1] and "\n" not in skipped[0][1]  # the truncated blob, read by Orbax
    ck.close()


# ------------------------------------------------------------------------------ signals and the lock
def _launch(tokens, run_dir, *extra, cache=False):
    """``mtraining-train`` in a subprocess; ``cache``: sharing this module's compilation cache (and
    float64 like tests/conftest.py, so the programs match the in-process ones)."""
    import jax

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for k in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
              "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"):
        env.pop(k, None)
    if cache:
        env.update(JAX_COMPILATION_CACHE_DIR=jax.config.jax_compilation_cache_dir, JAX_ENABLE_X64="1",
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    cmd = [sys.executable, "-m", "mtraining_jax.apps.train", "--config", CONFIG, *FAST, f"data.path={tokens}",
           f"run_dir={run_dir}", *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(cond, proc, timeout=120):
    t0 = time.time()
    while not cond():
        assert proc.poll() is None, proc.communicate()
        assert time.time() - t0 < timeout, "timed out"
        time.sleep(0.05)


def test_second_signal_aborts_during_compilation(tmp_path, tokens):
    rd = str(tmp_path / "run")
    proc = _launch(tokens, rd, "steps=50", "checkpoint.every=1")
    seen = []
    for line in proc.stdout:  # the first step compiles (no compilation cache in this process)
        seen.append(line)
        if line.startswith("compiling the training step"):
            break
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (seen, out, err)
    assert err.splitlines() == [
        "received SIGINT (Ctrl-C): stopping at the next safe point (after the current step, saving a checkpoint); "
        "send it again to abort at once",
        "mtraining-train: aborted: second SIGINT (Ctrl-C); the current step is lost, the newest saved checkpoint "
        "stays (continue with --resume)"]
    assert "first step done" not in out
    assert not [n for n in os.listdir(os.path.join(rd, "checkpoints")) if n[0].isdigit()]  # nothing saved
    assert not os.path.exists(os.path.join(rd, LOCK_NAME))  # released on the way out


def test_sigterm_saves_a_second_launch_is_refused_and_resume_continues(tmp_path, tokens, capsys):
    rd = str(tmp_path / "run")
    proc = _launch(tokens, rd, "steps=100000", "checkpoint.every=100000", cache=True)
    metrics = os.path.join(rd, "metrics.jsonl")
    _wait_for(lambda: os.path.exists(metrics) and os.path.getsize(metrics) > 0, proc)
    # an identical second launch: one line, exit 2, nothing of the first run touched
    rc, _, err = _main(capsys, tokens, f"run_dir={rd}", "steps=100000", "checkpoint.every=100000")
    with open(os.path.join(rd, LOCK_NAME)) as f:
        lock = json.load(f)
    assert lock["pid"] == proc.pid and lock["host"] == HOST
    assert rc == 2 and err == (f"mtraining-train: error: run_dir {rd!r} is in use by another mtraining-train (pid "
                               f"{proc.pid} on host {HOST}, since {lock['since']}); wait for it to finish or choose "
                               f"another run_dir (lock {rd}/{LOCK_NAME})\n")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    last = err.splitlines()[-1]
    step = int(last.split("after step ")[1].split(";")[0])
    assert last == (f"mtraining-train: stopped: SIGTERM: interrupted after step {step}; checkpoint saved in "
                    f"{rd}/checkpoints; continue with --resume")
    assert "Traceback" not in err and _ckpt_names(rd) == [str(step), "model.yaml"]
    assert not os.path.exists(os.path.join(rd, LOCK_NAME))
    rc, out, err = _main(capsys, tokens, f"run_dir={rd}", "steps=100000", "run_steps=2", "checkpoint.every=100000",
                         "--resume")  # the subprocess's program: from the compilation cache
    assert rc == 0, err
    assert f"resumed from step {step} in {rd}/checkpoints" in out and "note:" not in out  # same schedule
    steps = _metric_steps(rd)
    assert steps == list(range(1, step + 3))  # one run, no step twice


def test_stale_and_foreign_locks(tmp_path):
    rd = tmp_path / "run"
    rd.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (rd / LOCK_NAME).write_text(json.dumps({"host": HOST, "pid": dead.pid, "start": "1", "since": "then"}))
    lock = RunLock(str(rd))
    assert lock.acquire() == f"removed the stale lock of pid {dead.pid} on {HOST} (not running)"
    assert json.loads((rd / LOCK_NAME).read_text())["pid"] == os.getpid()
    with pytest.raises(RunDirLocked, match=rf"is in use by another mtraining-train \(pid {os.getpid()} on host "):
        RunLock(str(rd)).acquire()  # a live owner (this process)
    lock.release()
    assert not (rd / LOCK_NAME).exists()
    (rd / LOCK_NAME).write_text(json.dumps({"host": "elsewhere", "pid": 1, "since": "then"}))
    with pytest.raises(RunDirLocked, match=r"\(pid 1 on host elsewhere, since then\); .*\(if that process is gone, "
                                           r"delete the lock file\)"):
        RunLock(str(rd)).acquire()  # another host's process: cannot tell, refuse


# ------------------------------------------------------------------------------- config and messages
def test_plan_names_the_device_it_judges_against(tokens, capsys, monkeypatch):
    args = ["--config", CONFIG, *FAST, f"data.path={tokens}", "steps=100000", "--plan"]  # a compiled program
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "  compiled for this host's devices: 1 x cpu (cpu)" in out
    assert ("  device memory unknown: this plan is for this host's cpu devices, which report no memory limit; pass "
            "--device h100|h200 or --device-memory SIZE to judge it against a GPU's memory") in out
    assert cli.main(args + ["--device", "h100"]) == 0
    out = capsys.readouterr().out
    assert ("  device memory                                       59.38 GiB  -> fits (0% used) "
            "[h100: XLA_PYTHON_CLIENT_MEM_FRACTION=0.75 x 79.18 GiB]") in out
    assert "note: compiled on this host's cpu, not on the GPU" in out and "run --plan on the GPU for its plan" in out
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    assert cli.main(args + ["--device", "h200"]) == 0
    assert "132.81 GiB  -> fits (0% used) [h200: XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 x 139.80 GiB]" in capsys.readouterr().out
    assert cli.main(args + ["--device", "a100"]) == 2
    assert capsys.readouterr().err == ("mtraining-train: error: --device must be one of h100, h200 (or pass "
                                       "--device-memory SIZE), got 'a100'\n")
    assert cli.main(args[:-1] + ["--device", "h100"]) == 2
    assert capsys.readouterr().err == "mtraining-train: error: --device-memory and --device go with --plan\n"


def test_messages_name_file_line_key_and_value(tmp_path, tokens, capsys):
    bad = tmp_path / "docs.jsonl"
    bad.write_text('{"text": "one"}\n\n{"text": "two"}\n{"text": nope}\n')
    rd = tmp_path / "run"
    rc, _, err = _main(capsys, tokens, f"run_dir={rd}", "data.source=text", f"data.path={bad}")
    assert rc == 2 and err == f"mtraining-train: error: {bad}:4:10: not valid JSON: Expecting value\n"
    assert not rd.exists()  # nothing created for a failed check
    bad.write_text('{"text": "one"}\n{"body": "two"}\n')
    rc, _, err = _main(capsys, tokens, f"run_dir={rd}", "data.source=text", f"data.path={bad}")
    assert err == f"mtraining-train: error: {bad}:2: JSON record has no field 'text' (data.text_key); it has ['body']\n"
    rc, _, err = _main(capsys, tokens, f"run_dir={rd}", "mesh.shape=[2,4")
    assert rc == 2 and err == ("mtraining-train: error: override mesh.shape=[2,4: cannot parse the value '[2,4' as "
                               "YAML (while parsing a flow sequence: expected ',' or ']', but got '<stream end>' at "
                               "column 5); quote it or fix the brackets\n")
    rc, _, err = _main(capsys, tokens, f"run_dir={rd}", "model.attention_backend=mtraining", "model.sparsity.vertical_p=2")
    assert rc == 2 and err == "mtraining-train: error: model.sparsity.vertical_p must be number(s) in (0, 1], got 2\n"
    rc, _, err = _main(capsys, tokens, f"run_dir={rd}", "model.attention_backend=mtraining", "model.sparsity.vertcal_p=2")
    assert rc == 2 and err.startswith("mtraining-train: error: unknown config key(s) model.sparsity.vertcal_p; "
                                      "model.sparsity accepts [")
    rc, _, err = _main(capsys, tokens, f"run_dir={rd}", "model.attention_backend=msa", "model.layout=contiguous",
                       "model.msa={index_dim: 0}")
    assert rc == 2 and err == "mtraining-train: error: model.msa.index_dim must be a positive integer, got 0\n"
    # a failure after the run folder was made (the init checkpoint is missing): the folder goes again
    rc, _, err = _main(capsys, tokens, f"run_dir={rd / 'deep'}", f"model.init_from=ckpt:{tmp_path / 'nothing'}")
    assert rc == 2 and len(err.splitlines()) == 1 and str(tmp_path / "nothing") in err
    assert not rd.exists()
    help_text = cli.build_parser().format_help()
    for line in ("exit status:", "  0    done", "  1    non-finite loss", "  2    bad config", "  130  interrupted by "
                 "SIGINT (Ctrl-C)", "  143  interrupted by SIGTERM"):
        assert line in help_text


def test_eval_out_must_be_a_folder(tmp_path, capsys):
    from mtraining_jax.eval.cli import build_parser, main

    f = tmp_path / "afile"
    f.write_text("x")
    assert main([str(tmp_path), "--out", str(f)]) == 2
    assert capsys.readouterr().err == f"mtraining-eval: error: --out {str(f)!r} is a file, not a directory\n"
    assert main([str(tmp_path), "--out", str(f / "sub")]) == 2
    assert capsys.readouterr().err == f"mtraining-eval: error: --out {str(f / 'sub')!r} cannot be created: {str(f)!r} is a file, not a directory\n"
    assert "130  interrupted (Ctrl-C)" in build_parser().format_help()


def test_abandoned_orbax_reads_are_not_reported(monkeypatch):
    """A failed Orbax restore abandons its other per-array reads; finalized later by the garbage
    collector, each would print "Exception ignored in: <coroutine ... _read_array_index_and_device_put>"
    with a TensorStore traceback in the middle of the resumed run. ``quiet_abandoned_reads`` (called by
    ``restore_newest`` after a skipped checkpoint) drops those reports from then on; every other
    unraisable exception still reaches the hook that was installed."""
    import gc
    import sys

    from mtraining_jax.train.checkpoint import quiet_abandoned_reads

    class _Suspend:
        def __await__(self):
            yield

    async def _read_array_index_and_device_put():  # the shape of Orbax's: an error raised on close
        try:
            await _Suspend()
        except BaseException as e:
            raise Exception("Encountered error while reading array index") from e

    async def other_reader():
        try:
            await _Suspend()
        except BaseException as e:
            raise Exception("someone else's error") from e

    def abandon(coro_fn):
        c = coro_fn()
        c.send(None)  # suspended at the await, as a failed restore leaves them
        box = [c]
        box.append(box)  # only the cyclic collector frees it

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(repr(u.object)))  # restored after the test
    mine = lambda: [x for x in seen if "<locals>" in x]  # noqa: E731  (not other tests' leftovers)
    abandon(_read_array_index_and_device_put)
    gc.collect()
    assert len(mine()) == 1 and "_read_array_index_and_device_put" in mine()[0]  # the report, before
    quiet_abandoned_reads()
    quiet_abandoned_reads()  # installed once
    assert sys.unraisablehook.previous is not None and not hasattr(sys.unraisablehook.previous, "previous")
    abandon(_read_array_index_and_device_put)
    abandon(other_reader)
    gc.collect()
    assert len(mine()) == 2 and "other_reader" in mine()[1], mine()
    import types

    report = dict(exc_traceback=None, err_msg=None, object=None)
    sys.unraisablehook(types.SimpleNamespace(exc_type=RuntimeError, exc_value=RuntimeError("Event loop is closed"),
                                             **report))
    sys.unraisablehook(types.SimpleNamespace(exc_type=RuntimeError, exc_value=RuntimeError("<locals> other"),
                                             **dict(report, object="<locals> other")))
    assert len(mine()) == 3 and mine()[2] == "'<locals> other'"  # a late callback's report dropped, others not
