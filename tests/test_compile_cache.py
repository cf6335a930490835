"""``compile_cache_dir`` (mtraining_jax.train.compile_cache): a restarted run loads its compiled programs from
the folder (the first step's line says how many), a folder chosen before the run is kept, bad values are
refused by name. Each run is its own process: JAX reads the cache setting once per process."""

import os
import subprocess
import sys

import pytest

from mtraining_jax.train import compile_cache
from mtraining_jax.train.config import load_config

ROOT = os.path.join(os.path.dirname(__file__), "..")
CONFIG = os.path.join(ROOT, "configs", "tiny_cpu.yaml")
SMALL = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=2", "model.num_heads=2",
         "model.num_kv_heads=1", "model.attention_backend=reference", "model.dense_layers=[]", "mesh.shape=[1,1]",
         "data.seq_len=128", "eval.every=0", "eval.passkey_samples=0", "logging.progress=false",
         "logging.tensorboard=false", "logging.plot=false", "optim.warmup_steps=1", "checkpoint.async_save=false",
         "steps=1"]


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
    return dict(env, PYTHONUNBUFFERED="1", **extra)


def _train(run_dir, *extra, env=None):
    cmd = [sys.executable, "-m", "mtraining_jax.apps.train", "--config", CONFIG, *SMALL, f"run_dir={run_dir}", *extra]
    res = subprocess.run(cmd, cwd=ROOT, env=env or _env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return next(line for line in res.stdout.splitlines() if line.startswith("first step done"))


def test_a_restarted_run_loads_its_programs_from_the_cache(tmp_path):
    cache = tmp_path / "cache"
    first = _train(tmp_path / "a", f"compile_cache_dir={cache}")
    assert "compilation cache" not in first  # cold: nothing to load
    entries = set(os.listdir(cache))
    assert any(e.startswith("jit_train_step") for e in entries), sorted(entries)
    second = _train(tmp_path / "b", f"compile_cache_dir={cache}")
    assert "loaded from the compilation cache" in second and int(second.split("(")[1].split()[0]) >= 1, second
    # a cache chosen in the environment wins (JAX reads it once per process); the config's folder stays unused
    other = tmp_path / "env-cache"
    _train(tmp_path / "c", f"compile_cache_dir={tmp_path / 'unused'}",
           env=_env(JAX_COMPILATION_CACHE_DIR=str(other), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0"))
    assert not (tmp_path / "unused").exists() and any(e.startswith("jit_train_step") for e in os.listdir(other))


def test_bad_values_are_refused_by_name(tmp_path):
    for bad, msg in (("5", "compile_cache_dir must be a string, got 5"), ('""', "compile_cache_dir must be a folder path"),
                     ("[a]", "compile_cache_dir must be a string, got \\['a'\\]")):
        with pytest.raises(ValueError, match=msg):
            load_config(CONFIG, [f"compile_cache_dir={bad}"])
    assert load_config(CONFIG, []).compile_cache_dir is None
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code = ("import jax; jax.config.update('jax_compilation_cache_dir', None)\n"
            "from mtraining_jax.train.compile_cache import enable\n"
            f"enable({str(blocker / 'sub')!r})")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True)
    assert res.returncode != 0 and f"compile_cache_dir={str(blocker / 'sub')!r} cannot be created" in res.stderr
    with pytest.raises(ValueError, match="got '  '"):
        compile_cache.check("  ")
