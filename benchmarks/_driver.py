"""The driver loop shared by the benchmarks that run each case in a fresh subprocess
(``train_throughput``, ``memory_plan``): cases in order under an optional time budget, one JSON row
per case appended (and flushed) to ``OUT/NAME.jsonl`` as soon as it is known, a progress line per
case on stderr, and the markdown table printed and written to ``OUT/NAME.md``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Callable, Iterable, Optional


def drive(cases: Iterable, run: Callable, skipped: Callable, *, timeout: float, time_budget: Optional[float],
          out: Optional[str], name: str, command: str, date: str, describe: Callable,
          min_timeout: float = 0.0) -> list:
    """``run(case, timeout) -> row`` for every case (``skipped(case, reason) -> row`` once the
    ``time_budget`` leaves ``min_timeout`` seconds or less); each row gets ``date`` and ``command``.
    ``describe(case, row) -> str``: the progress line. Returns the rows."""
    log = None
    if out:
        os.makedirs(out, exist_ok=True)
        log = open(os.path.join(out, f"{name}.jsonl"), "w")
    rows, deadline = [], None if time_budget is None else time.time() + time_budget
    try:
        for case in cases:
            t0 = time.time()
            left = timeout if deadline is None else min(timeout, deadline - t0)
            if left <= min_timeout:
                row = skipped(case, f"skipped: --time-budget {time_budget:g} s spent")
            else:
                row = run(case, left)
            row.update(date=date, command=command)
            rows.append(row)
            print(f"[{time.time() - t0:6.1f}s] {describe(case, row)}", file=sys.stderr, flush=True)
            if log is not None:
                log.write(json.dumps(row) + "\n")
                log.flush()
    finally:
        if log is not None:
            log.close()
    return rows


def write_table(table: str, out: Optional[str], name: str, command: str, date: str) -> None:
    """Print the markdown ``table``; with ``out``, also ``OUT/NAME.md`` headed by the command."""
    print(table)
    if out:
        with open(os.path.join(out, f"{name}.md"), "w") as f:
            f.write(f"`{command}` ({date})\n\n{table}\n")


def run_child(cmd, cwd: str, timeout: float, fail: Callable) -> dict:
    """Run one ``--one`` child (``cwd`` first on ``PYTHONPATH``; ``XLA_PYTHON_CLIENT_MEM_FRACTION``
    0.95 unless set, so the default 75 % pool causes no avoidable OOM): its last JSON stdout line,
    else ``fail(reason)`` (timeout, or the exit status and the last 15 lines of output)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = cwd + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    try:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    except subprocess.TimeoutExpired:
        return fail(f"timeout: no result within {timeout:.0f} s")
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                break
    tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-15:]
    return fail(f"child exited with status {proc.returncode}: " + "\n".join(tail))


CODE_PACKAGES = ("mtraining_jax", "pallas_kernels", "benchmarks")


def code_root() -> str:
    """The tree this process's code comes from: the directory holding the imported ``mtraining_jax``."""
    import mtraining_jax

    return os.path.dirname(os.path.dirname(os.path.abspath(mtraining_jax.__file__)))


def code_digest(root: Optional[str] = None) -> str:
    """12 hex digits of SHA-256 over the ``.py`` files of :data:`CODE_PACKAGES` under ``root``
    (default :func:`code_root`), each as its relative path and bytes: two rows with one ``code`` ran
    the same Python sources, whatever their ``commit`` says."""
    import hashlib

    root = root or code_root()
    h = hashlib.sha256()
    for pkg in CODE_PACKAGES:
        files = []
        for d, dirs, names in os.walk(os.path.join(root, pkg)):
            dirs[:] = [x for x in dirs if x != "__pycache__"]
            files += [os.path.join(d, n) for n in names if n.endswith(".py")]
        for f in sorted(files):
            h.update(os.path.relpath(f, root).encode() + b"\0")
            with open(f, "rb") as fh:
                h.update(fh.read() + b"\0")
    return h.hexdigest()[:12]


def check_code_source(environ=None) -> str:
    """:func:`code_root`, after checking it is the tree ``PYTHONPATH`` names: the first
    ``PYTHONPATH`` entry holding an ``mtraining_jax`` folder must be the one imported. ``python -m``
    puts the current directory ahead of ``PYTHONPATH``, so ``PYTHONPATH=other/tree python -m
    benchmarks.x`` run from another checkout runs that checkout's code, not ``other/tree``'s: an A/B of
    two trees would time one code twice (it did: ``results/training/train_throughput.md`` run 28).
    Raises ``RuntimeError`` naming both trees."""
    environ = os.environ if environ is None else environ
    root = code_root()
    for entry in environ.get("PYTHONPATH", "").split(os.pathsep):
        if entry and os.path.isdir(os.path.join(entry, "mtraining_jax")):
            if os.path.realpath(entry) != os.path.realpath(root):
                raise RuntimeError(
                    f"PYTHONPATH names {entry!r} for mtraining_jax, but this process imported it from {root!r} "
                    f"(`python -m` puts the current directory first): run the command from inside {entry!r}")
            break
    return root


def git_commit(repo: str) -> Optional[str]:
    """``git rev-parse --short=12 HEAD`` in ``repo``, with ``+dirty`` where tracked files differ from
    it; ``None`` outside a git checkout (or without git)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=repo, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + "+dirty" if commit and dirty else commit


def _program() -> str:
    """How the running program was started, for a row's ``command``: ``python -m MODULE`` where it runs as a
    module (``sys.argv[0]`` is then the module file's absolute path, which names the machine's checkout, not the
    command to type), else ``sys.argv[0]`` as given."""
    import shlex

    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = getattr(spec, "name", None)
    if name and sys.argv and sys.argv[0].endswith(".py"):
        return f"python -m {name.removesuffix('.__main__')}"
    return shlex.quote(sys.argv[0]) if sys.argv else "python"


def provenance(argv=None) -> dict:
    """``commit``, ``code``, ``date``, ``command`` and (where JAX is imported) ``jax`` / ``device`` of
    a results row. The commit is ``git rev-parse HEAD`` of the repository, with ``+dirty`` where tracked
    files differ from it (the row did not run that commit's code), or ``$MTRAINING_COMMIT`` where the
    tree travels without its ``.git``: set it in the command line. ``code`` is :func:`code_digest` of
    the tree the code was imported from (:func:`check_code_source` first: a ``PYTHONPATH`` naming
    another tree raises)."""
    import datetime
    import shlex

    code = code_digest(check_code_source())

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    commit = os.environ.get("MTRAINING_COMMIT") or git_commit(repo)
    args = sys.argv if argv is None else [sys.argv[0], *argv]
    row = {"commit": commit or "unknown", "code": code,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join([_program(), *(shlex.quote(a) for a in args[1:])])}
    if "jax" in sys.modules:
        jax = sys.modules["jax"]
        row["jax"] = jax.__version__
        try:
            row["device"] = jax.devices()[0].device_kind
        except RuntimeError:
            pass
    return row


def append_rows(path: Optional[str], rows, prov: dict) -> None:
    """Append ``rows`` to the JSONL file ``path`` (nothing when ``path`` is empty), each row with the
    run's ``prov`` (:func:`provenance`) fields."""
    if not path:
        return
    with open(path, "a") as f:
        for r in rows:
            f.write(json.dumps({**r, **prov}) + "\n")
