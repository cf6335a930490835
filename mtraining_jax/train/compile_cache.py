"""``compile_cache_dir``: a persistent compilation cache for a run's programs.

JAX writes each compiled program (and XLA's GPU autotuning results) to the folder and reads it back in a
later process that compiles the same program: a run restarted after a preemption, resumed for its next
slice, or run again with the same shapes skips the compile; tracing and lowering still run (what it
saves is measured in ``results/training/train_throughput.md``, run 14). Programs are keyed by their
contents, the JAX / jaxlib version and the devices, so several runs and configs can share one folder.

The first step's log line says how many programs came from the cache (:func:`hits`). Every program is
cached, whatever its compile time (JAX's default skips those under a second, which on
CPU is most of them). A cache folder chosen before the run (``JAX_COMPILATION_CACHE_DIR`` or
``jax.config.update("jax_compilation_cache_dir", ...)``) is left as it is: JAX reads the setting once per
process.
"""

from __future__ import annotations

import os

_HITS = {"n": 0, "listening": False}
HIT_EVENT = "/jax/compilation_cache/cache_hits"  # jax.monitoring: one per program loaded from the cache


def hits() -> int:
    """Programs this process has loaded from the persistent cache so far (counted from :func:`enable`)."""
    return _HITS["n"]


def _count_hits() -> None:
    import jax

    if not _HITS["listening"]:
        def on_event(event, **kwargs):  # noqa: ARG001
            if event == HIT_EVENT:
                _HITS["n"] += 1

        jax.monitoring.register_event_listener(on_event)
        _HITS["listening"] = True


def check(path) -> None:
    """``ValueError`` naming ``path`` unless it is ``None`` or a non-empty string."""
    if path is not None and (not isinstance(path, str) or not path.strip()):
        raise ValueError(f"compile_cache_dir must be a folder path (a non-empty string) or null, got {path!r}")


def enable(path: str | None) -> str | None:
    """Point JAX's persistent compilation cache at ``path`` (created if missing) unless one is set
    already; returns the folder in use (``None``: no cache). Call before the run's first compile."""
    import jax

    check(path)
    current = jax.config.jax_compilation_cache_dir
    if current or path is None:
        if current:
            _count_hits()
        return current or None
    path = os.path.abspath(os.path.expanduser(path))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"compile_cache_dir={path!r} cannot be created: {e}") from None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    _count_hits()
    return path
