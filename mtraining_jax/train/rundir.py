"""The run directory: checked up front, never silently reused.

``run_dir`` holds one run's artefacts (:data:`RUN_ARTEFACTS`: ``metrics.jsonl``, ``tensorboard/``,
``loss.png``, ``config.yaml``, ``checkpoints/``). :func:`prepare_run_dir` decides what a new
invocation may do with it:

* fresh run (neither ``--resume`` nor ``--overwrite``): ``run_dir`` must be absent or hold nothing
  but empty folders, and the checkpoint folder no checkpoint, else :class:`RunDirError` offering
  both flags;
* ``--overwrite``: the artefacts of the old run (and nothing else) are deleted first;
* ``--resume``: the run continues; :func:`truncate_metrics` then drops the records of steps after
  the restored checkpoint, so ``metrics.jsonl`` (and the loss plot drawn from it) holds one run.

Paths are checked before anything is written: a file where a folder belongs (``run_dir``,
``checkpoint.dir`` or one of their parents) or an unwritable folder is a ``ValueError`` naming
the config key and the path. Only process 0 deletes or rewrites files.
"""

from __future__ import annotations

import json
import os
import shutil

RUN_ARTEFACTS = ("metrics.jsonl", "tensorboard", "loss.png", "config.yaml", "checkpoints")


class RunDirError(ValueError):
    """A new run would reuse a directory that holds another run."""


def check_dir(key: str, path: str) -> str:
    """Create ``path`` (a folder) or raise ``ValueError`` naming ``key`` when it cannot be one."""
    path = os.path.abspath(path)
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        what = "is a file" if probe == path else f"cannot be created: {probe!r} is a file"
        raise ValueError(f"{key} {path!r} {what}, not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"{key} {path!r} is not writable (no write permission on {probe!r})")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{key} {path!r} cannot be created: {e.strerror}") from None
    return path


def _has_checkpoints(ckpt_dir: str) -> list[int]:
    if not os.path.isdir(ckpt_dir):
        return []
    return sorted(int(n) for n in os.listdir(ckpt_dir) if n.isdigit())


def prepare_run_dir(run_dir: str, ckpt_dir: str, *, resume: bool, overwrite: bool, checkpoint_key: str,
                    is_main: bool = True) -> None:
    """Check, refuse or clear ``run_dir`` and ``ckpt_dir`` for a new invocation (module docstring)."""
    if resume and overwrite:
        raise ValueError("--resume and --overwrite exclude each other: continue the run or start it again")
    check_dir("run_dir", run_dir)
    # empty folders hold no run (e.g. the checkpoint folder of a start that failed its checks)
    entries = sorted(e for e in os.listdir(run_dir)
                     if not (os.path.isdir(os.path.join(run_dir, e)) and not os.listdir(os.path.join(run_dir, e))))
    check_dir(checkpoint_key, ckpt_dir)
    if resume:
        return
    steps = _has_checkpoints(ckpt_dir)
    if not entries and not steps:
        return
    if not overwrite:
        held = [e + ("/" if os.path.isdir(os.path.join(run_dir, e)) else "") for e in entries[:6]]
        held += ["..."] if len(entries) > 6 else []
        ck = f"; checkpoints at steps {steps} in {ckpt_dir!r}" if steps else ""
        raise RunDirError(
            f"run_dir {run_dir!r} is not empty ({', '.join(held) or 'no files'}{ck}); pass --resume to "
            f"continue that run or --overwrite to delete its artefacts and start again (or choose another run_dir)"
        )
    if not is_main:
        return
    for name in RUN_ARTEFACTS:
        p = os.path.join(run_dir, name)
        if os.path.isdir(p):
            shutil.rmtree(p)
        elif os.path.exists(p):
            os.remove(p)
    for s in steps:  # a checkpoint.dir outside run_dir
        shutil.rmtree(os.path.join(ckpt_dir, str(s)), ignore_errors=True)


def truncate_metrics(path: str, last_step: int) -> int:
    """Drop the records of ``path`` (``metrics.jsonl``) with ``step > last_step`` — steps a resumed
    run is about to redo — rewriting the file atomically. Returns how many were dropped."""
    if not os.path.isfile(path):
        return 0
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    keep = []
    for line in lines:
        try:
            if int(json.loads(line)["step"]) <= last_step:
                keep.append(line)
        except (ValueError, KeyError, TypeError):  # a torn last line of a killed run
            continue
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(keep)
    os.replace(tmp, path)
    return len(lines) - len(keep)
