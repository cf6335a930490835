"""Launch N local JAX processes (jax.distributed over localhost, gloo CPU collectives) for tests.

Each worker script is started as ``python WORKER PORT PROCESS_ID NUM_PROCESSES LOCAL_DEVICES`` and
prints ``RESULT <name> <json>`` lines; :func:`run_workers` returns one ``{name: value}`` dict per process
and fails the test with the worker's output if a process exits non-zero or times out.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def worker_env() -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "xla_force_host_platform_device_count" not in f)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def init_worker(argv) -> tuple[int, int, int]:
    """Call first in a worker: parse argv, configure CPU devices + gloo, join the runtime."""
    port, pid, nproc, ndev = (int(a) for a in argv[1:5])
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", ndev)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_enable_x64", True)
    jax.distributed.initialize(f"localhost:{port}", num_processes=nproc, process_id=pid,
                               initialization_timeout=60)
    return pid, nproc, ndev


def report(name: str, value) -> None:
    print(f"RESULT {name} {json.dumps(value)}", flush=True)


def global_array(x, sharding):
    """A global ``jax.Array`` with ``sharding`` from the full host array ``x`` (each process
    supplies only its addressable shards)."""
    import jax

    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def shard_rel_errors(got: dict, ref: dict) -> dict:
    """``{name: ||got - ref|| / ||ref||}`` over THIS process's addressable shards of each global
    array in ``got``, against the full host array ``ref[name]`` (same global layout), in float64."""
    import numpy as np

    errs = {}
    for name, arr in got.items():
        num = den = 0.0
        for sh in arr.addressable_shards:
            r = np.asarray(ref[name], np.float64)[sh.index]
            num += float(np.sum((np.asarray(sh.data, np.float64) - r) ** 2))
            den += float(np.sum(r ** 2))
        errs[name] = (num / den) ** 0.5
    return errs


def check_and_report(name: str, got: tuple, ref: tuple, permute, tol: float = 1e-5) -> bool:
    """Relative errors of (out, dq, dk, dv) global arrays vs natural-order host references laid out by
    ``permute``; prints ``RESULT name {...}`` and returns whether all are ``<= tol``."""
    import numpy as np

    names = ("out", "dq", "dk", "dv")
    errs = shard_rel_errors(dict(zip(names, got)), {n: permute(np.asarray(r)) for n, r in zip(names, ref)})
    report(name, errs)
    return all(e <= tol for e in errs.values())


def run_workers(worker: str | Path, num_processes: int = 2, local_devices: int = 4, timeout_s: float = 240,
                extra_args: tuple[str, ...] = ()) -> list[dict]:
    worker = Path(worker)
    port = free_port()
    procs = [
        subprocess.Popen([sys.executable, str(worker), str(port), str(i), str(num_processes), str(local_devices),
                          *extra_args], env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(num_processes)
    ]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout_s)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = []
    for i, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"process {i} exited with {p.returncode}:\n{out[-4000:]}"
        results.append({line.split()[1]: json.loads(line.split(maxsplit=2)[2])
                        for line in out.splitlines() if line.startswith("RESULT ")})
    return results
