"""The run directory: checked up front, never silently reused.

``run_dir`` holds one run's artefacts (:data:`RUN_ARTEFACTS`). :func:`prepare_run_dir`:

* fresh run: ``run_dir`` must be absent or hold only empty folders (and no checkpoint), else
  :class:`RunDirError` offering both flags;
* ``--overwrite``: the old run's artefacts (and nothing else) are deleted first;
* ``--resume``: the run continues; :func:`truncate_metrics` drops the records of steps after the
  restored checkpoint.

A file where a folder belongs or an unwritable folder is a ``ValueError`` naming the config key and
the path; folders created for a run whose checks fail are removed (:func:`remove_created`). Only
process 0 deletes or rewrites files. :class:`RunLock`: one invocation per ``run_dir``
(``run_dir/.lock``, created ``O_CREAT | O_EXCL`` with the owner's host, pid and start time; a
second launch is a :class:`RunDirLocked`; a lock whose process is gone on this host is taken over).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time

RUN_ARTEFACTS = ("metrics.jsonl", "tensorboard", "loss.png", "config.yaml", "checkpoints")
LOCK_NAME = ".lock"
HOST = socket.gethostname() or "localhost"


class RunDirError(ValueError):
    """A new run would reuse a directory that holds another run."""


class RunDirLocked(RunDirError):
    """Another live invocation holds ``run_dir``'s lock."""


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: exists, another user's
        return True
    return True


def _proc_start(pid: int) -> str | None:
    """The start time of ``pid`` in clock ticks since boot (Linux ``/proc``), to tell a reused pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


class RunLock:
    """``run_dir/.lock`` held by this process (module docstring). :meth:`acquire` raises
    :class:`RunDirLocked` when a live owner holds it and returns a note (or ``None``) when it
    took over a stale one; :meth:`release` removes it if it is still ours."""

    def __init__(self, run_dir: str):
        self.run_dir = os.path.abspath(run_dir)
        self.path = os.path.join(self.run_dir, LOCK_NAME)
        self.held = False
        self.info = {"host": HOST, "pid": os.getpid(), "start": _proc_start(os.getpid()),
                     "since": time.strftime("%Y-%m-%d %H:%M:%S")}

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(self.info, f)
        self.held = True
        return True

    def owner(self) -> dict | None:
        """The lock file's content (``{}`` when unreadable, ``None`` when absent)."""
        try:
            with open(self.path) as f:
                d = json.load(f)
            return d if isinstance(d, dict) else {}
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}

    def _stale(self, owner: dict) -> bool:
        if owner.get("host") != HOST or not isinstance(owner.get("pid"), int):
            return False  # another host's process (shared file system): cannot tell
        pid = owner["pid"]
        if not pid_alive(pid):
            return True
        start = _proc_start(pid)
        return owner.get("start") is not None and start is not None and start != owner["start"]  # pid reused

    def acquire(self) -> str | None:
        note = None
        for _ in range(3):
            if self._create():
                return note
            owner = self.owner()
            if owner is None:  # released between our two calls
                continue
            if owner and not self._stale(owner):
                who = f"pid {owner.get('pid')} on host {owner.get('host')}, since {owner.get('since')}"
                gone = (" (if that process is gone, delete the lock file)" if owner.get("host") != HOST else "")
                raise RunDirLocked(f"run_dir {self.run_dir!r} is in use by another mtraining-train ({who}); "
                                   f"wait for it to finish or choose another run_dir (lock {self.path}){gone}")
            if not owner:  # torn (a writer killed between create and write): stale only once it is old
                try:
                    if time.time() - os.path.getmtime(self.path) < 10:
                        time.sleep(0.5)
                        continue
                except FileNotFoundError:
                    continue
            # break the stale lock atomically: move it aside, check it is still the stale one
            aside = f"{self.path}.stale-{HOST}-{os.getpid()}"
            try:
                os.rename(self.path, aside)
            except FileNotFoundError:
                continue
            try:
                with open(aside) as f:
                    moved = json.load(f)
            except (OSError, ValueError):
                moved = {}
            if moved and moved != owner:  # a live owner's fresh lock: put it back, never clobber
                try:
                    os.link(aside, self.path)
                except FileExistsError:
                    pass
                os.remove(aside)
                continue
            os.remove(aside)
            note = (f"removed the stale lock of pid {owner.get('pid')} on {owner.get('host')} (not running)"
                    if owner else "removed a torn lock file")
        if self._create():
            return note
        raise RunDirLocked(f"run_dir {self.run_dir!r} is in use by another mtraining-train (lock {self.path})")

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        if self.owner() == self.info:
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass


def missing_top(path: str) -> str | None:
    """The outermost folder of ``path`` that does not exist yet (``None``: it exists), i.e. what
    creating ``path`` would add; :func:`remove_created` removes it again after failed checks."""
    path = os.path.abspath(path)
    top = None
    while not os.path.exists(path):
        top = path
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return top


def remove_created(top: str | None) -> None:
    """Remove ``top`` (from :func:`missing_top`) if it holds nothing but empty folders and a lock."""
    if top is None or not os.path.isdir(top):
        return
    for root, _dirs, files in os.walk(top):
        if any(f != LOCK_NAME for f in files):
            return
    shutil.rmtree(top, ignore_errors=True)


def check_dir(key: str, path: str, create: bool = True) -> str:
    """Create ``path`` (a folder; ``create=False``: only check that it could be) or raise
    ``ValueError`` naming ``key`` when it cannot be one."""
    path = os.path.abspath(path)
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        what = "is a file" if probe == path else f"cannot be created: {probe!r} is a file"
        raise ValueError(f"{key} {path!r} {what}, not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"{key} {path!r} is not writable (no write permission on {probe!r})")
    if not create:
        return path
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
    entries = sorted(e for e in os.listdir(run_dir) if not e.startswith(LOCK_NAME)
                     and not (os.path.isdir(os.path.join(run_dir, e)) and not os.listdir(os.path.join(run_dir, e))))
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


#: config keys that shape the optimisation a resumed run continues: the schedule spans ``steps``;
#: a step's tokens are ``data.seq_len x data.batch_size x optim.grad_accum``
SCHEDULE_KEYS = ("steps", "data.seq_len", "data.batch_size", "optim.grad_accum", "optim.lr", "optim.min_lr_ratio",
                 "optim.warmup_steps")


def schedule_values(cfg) -> dict:
    """``{dotted key: value}`` of :data:`SCHEDULE_KEYS` in ``cfg`` (a ``TrainConfig`` or its dict)."""
    d = cfg if isinstance(cfg, dict) else cfg.to_dict()
    out = {}
    for key in SCHEDULE_KEYS:
        node = d
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        out[key] = node
    return out


def schedule_changes(before: dict, now: dict) -> list[str]:
    """One line per :data:`SCHEDULE_KEYS` entry whose value differs between ``before`` (what the
    checkpoint's run used) and ``now``."""
    lines = []
    for key in SCHEDULE_KEYS:
        if key in before and before[key] is not None and before[key] != now.get(key):
            lines.append(f"note: {key} changed since the checkpoint was written: {before[key]!r} -> {now.get(key)!r}")
    return lines


def saved_config(run_dir: str) -> dict | None:
    """``run_dir/config.yaml`` as a dict (``None`` when absent or unreadable)."""
    import yaml

    try:
        with open(os.path.join(run_dir, "config.yaml")) as f:
            d = yaml.safe_load(f)
        return d if isinstance(d, dict) else None
    except (OSError, yaml.YAMLError):
        return None


def deleted_by_overwrite(run_dir: str, path: str) -> bool:
    """Whether ``--overwrite`` of ``run_dir`` would delete ``path`` (one of :data:`RUN_ARTEFACTS`)."""
    path, run_dir = os.path.realpath(path), os.path.realpath(run_dir)
    return any(path == (a := os.path.join(run_dir, name)) or path.startswith(a + os.sep) for name in RUN_ARTEFACTS)
