"""SIGINT (Ctrl-C) and SIGTERM (what Slurm and Kubernetes send before they kill a job) for the
trainer: :class:`StopSignals`. Standard library only, so ``mtraining-train`` installs it before it
imports JAX.

Nothing is raised from a signal handler (an exception raised there lands wherever the main thread
happens to be: inside a garbage-collection callback it is merely printed and ignored). The first
signal sets :attr:`StopSignals.received`, which the trainer checks at its safe points (before the
first step, after every step: then it saves a checkpoint and stops with ``128 + signum``, i.e. 130 /
143). A second signal ends the process at once from a watcher thread woken through
:func:`signal.set_wakeup_fd`: it acts even while the main thread is inside XLA (compiling, running a
step), where Python's own handlers wait until XLA returns.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Callable

SIGNAL_NAMES = {signal.SIGINT: "SIGINT (Ctrl-C)", signal.SIGTERM: "SIGTERM"}


def signal_name(signum: int, short: bool = False) -> str:
    """``"SIGINT (Ctrl-C)"`` (``short``: ``"SIGINT"``), ``"SIGTERM"``."""
    name = SIGNAL_NAMES.get(signum, f"signal {signum}")
    return name.split(" ")[0] if short and signum in SIGNAL_NAMES else name


class StopSignals:
    """While active (main thread only; elsewhere a no-op): SIGINT and SIGTERM are caught. The first
    sets :attr:`received` and prints one line; a second one prints one line, runs :attr:`on_abort`
    (e.g. releasing the run-dir lock) and ends the process at once with ``128 + signum`` (module
    docstring). ``say``: how to print (default: a line on stderr)."""

    def __init__(self, say: Callable[[str], None] | None = None):
        self.received = 0
        self.count = 0
        self.on_abort: list[Callable[[], None]] = []
        self.say = say or (lambda m: print(m, file=sys.stderr, flush=True))
        self._old: dict = {}
        self._old_fd = None
        self._pipe = None
        self._thread = None

    @property
    def exit_code(self) -> int:
        return 128 + self.received if self.received else 0

    def _handler(self, signum, frame):  # main thread, between bytecodes: only the flag
        if not self.received:
            self.received = signum

    def _watch(self, fd: int) -> None:
        while True:
            try:
                data = os.read(fd, 64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum not in SIGNAL_NAMES:
                    continue
                self.count += 1
                if not self.received:
                    self.received = signum
                if self.count == 1:
                    self.say(f"received {signal_name(signum)}: stopping at the next safe point (after the current "
                             f"step, saving a checkpoint); send it again to abort at once")
                    continue
                self.say(f"mtraining-train: aborted: second {signal_name(signum)}; the current step is lost, the "
                         f"newest saved checkpoint stays (continue with --resume)")
                for f in self.on_abort:
                    try:
                        f()
                    except Exception:  # noqa: BLE001
                        pass
                try:
                    sys.stdout.flush()
                except Exception:  # noqa: BLE001
                    pass
                os._exit(128 + signum)

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is not threading.main_thread():
            return self
        r, w = os.pipe()
        os.set_blocking(w, False)
        self._pipe = (r, w)
        for sig in SIGNAL_NAMES:
            self._old[sig] = signal.signal(sig, self._handler)
        self._old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._watch, args=(r,), name="mtraining-signals", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> bool:
        if self._pipe is None:
            return False
        signal.set_wakeup_fd(self._old_fd if self._old_fd is not None else -1)
        for sig, old in self._old.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)
        r, w = self._pipe
        os.close(w)  # the watcher reads EOF and ends
        self._thread.join(timeout=5)
        os.close(r)
        self._pipe = None
        return False
