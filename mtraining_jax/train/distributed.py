"""Multi-process launch: ``jax.distributed.initialize`` from flags, config, or the cluster env.

One process per host (node); each process drives its local devices, which become the mesh's
``local`` axis, so the mesh's ``node`` axis is the host (``mtraining_jax.mesh.make_mesh``).

* SLURM: ``srun --ntasks-per-node=1 mtraining-train --config ...`` — JAX reads ``SLURM_*``.
* Open MPI: ``mpirun -npernode 1 mtraining-train ...`` — JAX reads ``OMPI_*``.
* Plain processes: on every host run ``mtraining-train --config ... --coordinator-address
  HOST0:12345 --num-processes N --process-id i`` (or set ``JAX_COORDINATOR_ADDRESS``,
  ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``).
* One box, several processes (e.g. to try the multi-host path on CPU): the same plain launch with
  ``localhost``; ``mesh.cpu_devices`` is the total, split evenly over the processes.

A process whose peers do not all join within ``distributed.timeout_s`` stops with one line naming
the coordinator (exit 2) instead of JAX's own abort with a C++ stack trace.
"""

from __future__ import annotations

import os
import sys
import threading

import jax


def detect_cluster(env=None) -> str | None:
    """Name of the launcher found in the environment (``slurm``, ``openmpi``, ``env``) or None
    for a single-process run."""
    env = os.environ if env is None else env
    if int(env.get("SLURM_NTASKS", "1") or 1) > 1 and "SLURM_JOB_ID" in env:
        return "slurm"
    if int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
        return "openmpi"
    if env.get("JAX_COORDINATOR_ADDRESS"):
        return "env"
    return None


def maybe_initialize(cfg) -> bool:
    """Initialize ``jax.distributed`` for a :class:`DistributedConfig`; returns whether it did.
    Must run before any device is used."""
    explicit = cfg.coordinator_address is not None or cfg.num_processes is not None
    if explicit:
        if cfg.coordinator_address is None or cfg.num_processes is None or cfg.process_id is None:
            raise ValueError(
                "distributed launch needs coordinator_address, num_processes and process_id together; got "
                f"{cfg.coordinator_address!r}, {cfg.num_processes!r}, {cfg.process_id!r}"
            )
        if not 0 <= cfg.process_id < cfg.num_processes:
            raise ValueError(f"process_id {cfg.process_id} is not in [0, num_processes={cfg.num_processes})")
        _cpu_collectives()
        _initialize_or_exit(cfg.timeout_s, cfg.coordinator_address, cfg.num_processes, cfg.process_id)
        return True
    kind = detect_cluster() if cfg.auto else None
    if kind is None:
        return False
    _cpu_collectives()
    if kind == "env":
        _initialize_or_exit(cfg.timeout_s, os.environ["JAX_COORDINATOR_ADDRESS"], int(os.environ["JAX_NUM_PROCESSES"]),
                            int(os.environ["JAX_PROCESS_ID"]))
    else:
        _initialize_or_exit(cfg.timeout_s)  # SLURM / Open MPI auto-detection
    return True


def _initialize_or_exit(timeout_s: int, address: str | None = None, num_processes: int | None = None,
                        process_id: int | None = None) -> None:
    """``jax.distributed.initialize`` with a watchdog: JAX aborts the process (C++ check failure)
    when peers are missing at its deadline, so ours fires first, prints one line naming the
    coordinator and exits with status 2."""

    def give_up():
        who = f"process {process_id} of {num_processes}" if process_id is not None else "this process"
        coord = f"the coordinator {address}" if address else "the cluster's coordinator"
        print(f"mtraining-train: error: {who}: not all processes joined through {coord} within "
              f"distributed.timeout_s={timeout_s} s; start every process with the same --coordinator-address "
              f"and --num-processes (and process ids 0..N-1), and check that {coord} is reachable",
              file=sys.stderr, flush=True)
        os._exit(2)

    timer = threading.Timer(timeout_s, give_up)
    timer.daemon = True
    timer.start()
    try:
        jax.distributed.initialize(address, num_processes, process_id, initialization_timeout=int(timeout_s) + 60)
    finally:
        timer.cancel()


def _cpu_collectives():
    # Cross-process collectives on CPU go through gloo (the default in recent JAX; explicit here).
    if os.environ.get("JAX_PLATFORMS", "").startswith("cpu"):
        try:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        except (AttributeError, ValueError):  # option renamed/removed: gloo is the default then
            pass
