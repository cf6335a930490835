"""Compile each Mosaic GPU kernel as soon as it is lowered, on a worker thread, while the program that holds
it is still being lowered and compiled (issue 34: the training step's compile time).

Mosaic GPU compiles a kernel (its MLIR through LLVM and ptxas: 1-2.6 s for each of ours,
``results/kernels/kernels.md`` run 22) when XLA builds the program's custom-call thunk for it: inside the
program's compile, one kernel after the other, under one process-wide lock, after XLA's own passes. The
compiled kernel is kept for the process, keyed by the hash of its module. :func:`start` makes every
Mosaic kernel lowered from then on also go to a worker thread, which compiles it at once in a program of
that one custom call (never run); when XLA reaches the kernel's thunk in the real program, the kernel is
in that cache (or being compiled, and XLA waits for it). The kernels' compile then overlaps the rest of
the lowering and XLA's passes instead of following them. Same modules, same hashes, same binaries: only
when they compile changes.

Active on a GPU backend whose JAX keeps Mosaic GPU's registry of lowered kernels
(``jax.experimental.mosaic.gpu.core.KNOWN_KERNELS``, JAX 0.10-0.11); elsewhere (CPU, a JAX without it)
:func:`start` returns ``False`` and nothing changes. ``MTRAINING_MOSAIC_PRECOMPILE=0`` turns it off
(``benchmarks.compile_memory``'s ``-noprecompile`` variants). A failed early compile is recorded
(:func:`stats`), warned about once and ends the early compiles: XLA then compiles the kernels itself, as without it.
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
import warnings

#: environment switch: ``0`` / ``false`` / ``off`` / ``no`` turn the early compile off
ENV = "MTRAINING_MOSAIC_PRECOMPILE"
#: the custom-call target of a Mosaic GPU kernel (``jax.experimental.mosaic.gpu.core``'s lowering)
TARGET = "mosaic_gpu_v2"

_LOCK = threading.Lock()
_STATE = {"decided": False, "active": False, "queue": None, "worker": None, "compiled": 0, "errors": [],
          "pending": 0}
_IDLE = threading.Condition(_LOCK)


def enabled_by_env() -> bool:
    """Whether :data:`ENV` leaves the early compile on (unset: on)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


class _Registry(dict):
    """Mosaic GPU's ``KNOWN_KERNELS`` (kernel hash -> module bytecode), calling ``on_new(hash, module)`` for
    each kernel added (the lowering adds a kernel once per process, the first time it is lowered)."""

    def __init__(self, entries, on_new):
        super().__init__(entries)
        self.on_new = on_new

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        if self.on_new is not None:
            self.on_new(key, value)


def _core():
    try:
        from jax.experimental.mosaic.gpu import core
    except ImportError:  # a JAX without Mosaic GPU
        return None
    return core if isinstance(getattr(core, "KNOWN_KERNELS", None), dict) else None


def watch(on_new) -> bool:
    """Call ``on_new(kernel_hash: bytes, module: bytes)`` for every Mosaic GPU kernel lowered from now on
    (``None``: stop). ``False`` where this JAX keeps no registry of lowered kernels."""
    core = _core()
    if core is None:
        return False
    reg = core.KNOWN_KERNELS
    if not isinstance(reg, _Registry):
        reg = core.KNOWN_KERNELS = _Registry(reg, None)
    reg.on_new = on_new
    return True


def kernel_program(kernel_hash: bytes, module: bytes):
    """A jitted function of no arguments whose program is the one custom call of kernel ``(kernel_hash,
    module)`` (what the kernel's lowering emits, without operands): compiling it compiles the kernel."""
    import jax
    import jax.numpy as jnp

    def call():
        return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((1,), jnp.int8), has_side_effect=True)(
            kernel_hash=kernel_hash, module=module, use_custom_barrier=False)

    return jax.jit(call)


def _compile(kernel_hash: bytes, module: bytes) -> None:
    import contextlib

    import jax
    from jax._src import config

    # on this process's own first GPU (a multi-process run's jax.devices()[0] may be another process's), and not
    # written to a persistent compilation cache (both settings thread-local: the run's own programs as before)
    no_cache = getattr(config, "enable_compilation_cache", None)
    with no_cache(False) if no_cache is not None else contextlib.nullcontext(), \
            jax.default_device(jax.local_devices()[0]):
        kernel_program(kernel_hash, module).lower().compile()


def _work(q) -> None:
    while True:
        item = q.get()
        if item is None:
            return
        try:
            if _STATE["active"]:
                _compile(*item)
                _STATE["compiled"] += 1
        except Exception as e:  # noqa: BLE001 (any failure: XLA compiles the kernel itself, as without this)
            _STATE["errors"].append(f"{type(e).__name__}: {e}"[:500])
            _STATE["active"] = False
            warnings.warn(f"early Mosaic GPU kernel compile failed ({_STATE['errors'][-1][:200]}); the kernels "
                          "compile inside their programs as usual", RuntimeWarning, stacklevel=1)
        finally:
            with _IDLE:
                _STATE["pending"] -= 1
                _IDLE.notify_all()


def _enqueue(kernel_hash: bytes, module: bytes) -> None:
    q = _STATE["queue"]
    if q is None or not _STATE["active"]:
        return
    with _IDLE:
        _STATE["pending"] += 1
    q.put((kernel_hash, module))


def _on_gpu() -> bool:
    import jax

    try:
        return jax.default_backend() == "gpu" and jax.devices()[0].platform == "gpu"
    except RuntimeError:
        return False


def start() -> bool:
    """Compile every Mosaic GPU kernel lowered from now on early, on a worker thread (module docstring).
    Idempotent and cheap after the first call (the kernels' launch code calls it); ``True`` when active.
    Kernels lowered before the first call compile inside their programs as before."""
    with _LOCK:
        if _STATE["decided"]:
            return _STATE["active"]
        _STATE["decided"] = True
        if not enabled_by_env() or not _on_gpu() or not watch(_enqueue):
            return False
        q = queue.SimpleQueue()
        _STATE.update(queue=q, active=True)
        _STATE["worker"] = threading.Thread(target=_work, args=(q,), name="mosaic-precompile", daemon=True)
        _STATE["worker"].start()
    atexit.register(stop)
    return True


def wait(timeout: float | None = None) -> bool:
    """Block until every kernel handed to the worker so far is compiled (or failed); ``False`` on timeout."""
    with _IDLE:
        return _IDLE.wait_for(lambda: _STATE["pending"] <= 0, timeout)


def stop(timeout: float = 30.0) -> None:
    """Stop the early compile: kernels not started are dropped (their programs compile them), the one in
    progress finishes (at most ``timeout`` seconds waited). Registered at exit by :func:`start`."""
    with _LOCK:
        q, worker = _STATE["queue"], _STATE["worker"]
        _STATE["active"] = False
        watch(None)
    if q is not None and worker is not None and worker.is_alive():
        q.put(None)
        worker.join(timeout)


def stats() -> dict:
    """``{active, compiled, pending, errors}``: kernels compiled early so far, waiting, failures."""
    return {"active": _STATE["active"], "compiled": _STATE["compiled"], "pending": _STATE["pending"],
            "errors": list(_STATE["errors"])}
