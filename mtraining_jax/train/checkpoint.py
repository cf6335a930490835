"""Orbax checkpoints of a training run: parameters, optimizer state, step, RNG, data-iterator state.

One :class:`orbax.checkpoint.CheckpointManager` under ``<run_dir>/checkpoints``: step folders
``<step>/{state, data, meta}`` (``state`` = ``{step, params, opt_state, rng}``, ``data`` = the
loader's JSON dict, ``meta`` = run info), saved asynchronously, the last ``keep`` kept; a step is
finalised by a rename, so a run killed mid-save leaves the previous one the latest. :meth:`restore`
checks the stored shapes first (``ValueError`` naming each parameter and both shapes).
:meth:`restore_newest` (``--resume``) restores the newest step that reads back, naming each newer
step it skipped and moving it aside to ``<step>.damaged`` (:meth:`set_aside`); a model mismatch
stops at once. Each step this class saves gets a list of its files and their sizes once Orbax has
finalised it (:data:`FILE_LIST`); a restore compares the folder with it first, so a truncated or
missing file is named before any array is read (Orbax's concurrent reads, abandoned when one of them
fails, would otherwise report themselves with tracebacks for the rest of the run). A step without the
list (saved by an older version) is restored as before. The run's ``model.yaml`` beside the step folders lets
:mod:`mtraining_jax.model.checkpoint` read them.
"""

from __future__ import annotations

import json
import os
import threading

import jax
import orbax.checkpoint as ocp

from mtraining_jax.model.checkpoint import (STATE_NAME, DamagedCheckpointError, ParamShapeError, check_shapes,
                                           stored_shapes)


#: a finalised step's files (paths relative to the step folder) and sizes in bytes, written beside its items
FILE_LIST = "mtraining_files.json"


def _step_files(step_dir: str) -> dict:
    files = {}
    for root, _, names in os.walk(step_dir):
        for name in names:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, step_dir)
            if rel != FILE_LIST and not rel.startswith(FILE_LIST + "."):
                files[rel] = os.path.getsize(path)
    return files


def write_file_list(step_dir: str) -> None:
    """Record the files of the finalised step folder ``step_dir`` and their sizes (:data:`FILE_LIST`;
    written to a temporary name and renamed, so a reader sees all of it or none)."""
    tmp = os.path.join(step_dir, f"{FILE_LIST}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(_step_files(step_dir), f, sort_keys=True)
    os.replace(tmp, os.path.join(step_dir, FILE_LIST))


def check_file_list(step_dir: str) -> None:
    """:class:`DamagedCheckpointError` naming the first file of ``step_dir`` that is missing or whose size
    differs from its :data:`FILE_LIST` entry (no data read); nothing to check without the list."""
    path = os.path.join(step_dir, FILE_LIST)
    if not os.path.exists(path):
        return
    try:
        with open(path) as f:
            saved = json.load(f)
        saved = {str(k): int(v) for k, v in saved.items()}
    except (OSError, ValueError, AttributeError, TypeError) as e:
        raise DamagedCheckpointError(f"checkpoint {step_dir} is damaged: its file list {FILE_LIST} is unreadable "
                                     f"({type(e).__name__})") from None
    for rel, size in sorted(saved.items()):
        full = os.path.join(step_dir, rel)
        if not os.path.isfile(full):
            raise DamagedCheckpointError(f"checkpoint {step_dir} is damaged: {rel} is missing")
        got = os.path.getsize(full)
        if got != size:
            raise DamagedCheckpointError(f"checkpoint {step_dir} is damaged: {rel} has {got} bytes, "
                                         f"{size} when saved")


class NoRestorableCheckpoint(ValueError):
    """Every checkpoint of the folder failed to restore (one line naming the folder and why)."""


def _reason(e: BaseException) -> str:
    """One line: the innermost cause of ``e`` (Orbax wraps TensorStore's precise error)."""
    while e.__cause__ is not None:
        e = e.__cause__
    lines = str(e).strip().splitlines()
    text = lines[0] if lines else ""
    if isinstance(e, DamagedCheckpointError):
        text = text.split(" is damaged: ", 1)[-1]
    else:
        text = f"{type(e).__name__}: {text}"
    return text if len(text) <= 240 else text[:237] + "..."


#: Orbax's per-array read coroutine: a failed restore abandons the ones still running or suspended
_ORBAX_READ = "_read_array_index_and_device_put"


class _DropAbandonedReads:
    """``sys.unraisablehook`` that drops the reports of abandoned Orbax reads and passes on the rest."""

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, unraisable):
        read = _ORBAX_READ in repr(getattr(unraisable, "object", None))
        late = (unraisable.exc_type is RuntimeError and str(unraisable.exc_value) == "Event loop is closed")
        if not (read or late):  # late: an abandoned read's callback scheduled on the restore's closed loop
            self.previous(unraisable)


def quiet_abandoned_reads() -> None:
    """After a failed restore: no ``Exception ignored in: <coroutine ... _read_array_index_and_device_put>``
    reports with tracebacks from then on (nor ``RuntimeError: Event loop is closed`` ones that reach
    ``sys.unraisablehook``; those Orbax's reading threads print themselves still appear, at random).

    Orbax reads the arrays of a checkpoint concurrently; when one read fails, the others are
    abandoned, and each is reported with a traceback whenever the garbage collector finalizes it
    (at random points of the run that follows, or at exit), for a failure
    :meth:`Checkpointer.restore_newest` already named in one line; their callbacks that complete after
    the restore's event loop closed are reported as well. This wraps the installed
    ``sys.unraisablehook`` (once) so that those reports are dropped and every other unraisable
    exception reaches it as before, then collects the reads that are already unreachable."""
    import gc
    import sys

    if not isinstance(sys.unraisablehook, _DropAbandonedReads):
        sys.unraisablehook = _DropAbandonedReads(sys.unraisablehook)
    gc.collect()


class Checkpointer:
    """Save/restore training checkpoints (see module docstring)."""

    def __init__(self, directory: str, keep: int = 3, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        self._unlisted: set[int] = set()  # steps saved here whose file list is not written yet
        self._lock = threading.Lock()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=async_save,
            create=True,
            # Orbax takes the callback with asynchronous saves only (a synchronous one is listed by `save`)
            async_options=ocp.AsyncOptions(post_finalization_callback=self._list_finalised) if async_save else None,
        )
        self._mgr = ocp.CheckpointManager(
            self.directory, options=options, item_names=(STATE_NAME, "data", "meta")
        )

    def save(self, step: int, state, data_state: dict, meta: dict | None = None) -> bool:
        """Start saving ``state`` (array pytree) + ``data_state`` (JSON dict) as ``step``."""
        with self._lock:
            self._unlisted.add(int(step))
        saved = self._mgr.save(
            int(step),
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=ocp.args.JsonSave(dict(data_state)),
                meta=ocp.args.JsonSave(dict(meta or {})),
            ),
            force=True,
        )
        self._list_finalised()  # a synchronous save is final here; an asynchronous one lists itself later
        return saved

    def _list_finalised(self) -> None:
        """Write the file list of each step saved here whose folder is final (one process writes)."""
        if jax.process_index() != 0:
            return
        with self._lock:
            for step in sorted(self._unlisted):
                where = os.path.join(self.directory, str(step))
                if os.path.isdir(where):  # finalised: Orbax renames the temporary folder last
                    write_file_list(where)
                    self._unlisted.discard(step)

    def latest_step(self) -> int | None:
        """Newest finalised step (unfinished temporary folders are ignored)."""
        self._mgr.reload()
        return self._mgr.latest_step()

    def all_steps(self) -> list[int]:
        self._mgr.reload()
        return sorted(self._mgr.all_steps())

    def restore(self, step: int, target=None):
        """``(state, data_state, meta)`` of ``step``; ``target`` is a pytree of arrays or
        ``jax.ShapeDtypeStruct`` giving structure, dtypes and shardings of ``state`` (``None``:
        plain nested dicts of host arrays, for inspection)."""
        abstract = None if target is None else jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), target
        )
        where = os.path.join(self.directory, str(int(step)))
        check_file_list(where)
        if abstract is not None:
            stored = stored_shapes(os.path.join(where, STATE_NAME))
            if isinstance(stored, dict) and isinstance(abstract, dict) and "params" in stored and "params" in abstract:
                check_shapes(stored["params"], abstract["params"], where, prefix="params/")  # named first
            check_shapes(stored, abstract, where)
        out = self._mgr.restore(
            int(step),
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract),
                data=ocp.args.JsonRestore(),
                meta=ocp.args.JsonRestore(),
            ),
        )
        return out["state"], dict(out["data"]), dict(out["meta"] or {})

    def restore_newest(self, target) -> tuple[int, tuple, list[tuple[int, str]]] | None:
        """``(step, (state, data_state, meta), skipped)`` of the newest step that restores into
        ``target``; ``skipped``: ``(step, reason)`` of the newer ones that did not (module
        docstring). ``None`` without checkpoints; :class:`NoRestorableCheckpoint` when none restores;
        a :class:`~mtraining_jax.model.checkpoint.ParamShapeError` (the model changed) at once."""
        steps = self.all_steps()
        if not steps:
            return None
        skipped = []
        for step in reversed(steps):
            try:
                got = self.restore(step, target)
            except ParamShapeError:
                raise
            except Exception as e:  # noqa: BLE001  (TensorStore, JSON and OS errors alike)
                skipped.append((step, _reason(e)))
                continue
            if skipped:  # outside the handlers: their exceptions no longer hold the failed reads
                quiet_abandoned_reads()
            return step, got, skipped
        quiet_abandoned_reads()
        raise NoRestorableCheckpoint(
            f"no checkpoint in {self.directory} restores (" + "; ".join(f"step {s}: {r}" for s, r in skipped)
            + "); start again with --overwrite, or restore the folder from a backup")

    def set_aside(self, step: int) -> str:
        """Rename the (damaged) ``step`` folder to ``<step>.damaged`` (a free name) and return it."""
        src = os.path.join(self.directory, str(int(step)))
        dst, n = src + ".damaged", 1
        while os.path.exists(dst):
            n += 1
            dst = f"{src}.damaged{n}"
        os.rename(src, dst)
        self._mgr.reload()
        return dst

    def run_info(self, step: int) -> dict:
        """The JSON ``meta`` item of ``step`` (loss at that step, model name)."""
        out = self._mgr.restore(int(step), args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(out["meta"] or {})

    def wait(self) -> None:
        """Block until pending asynchronous saves are finalised (and their file lists written)."""
        self._mgr.wait_until_finished()
        self._list_finalised()

    def close(self) -> None:
        self.wait()
        self._mgr.close()
