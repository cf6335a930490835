"""Multi-process launch: ``jax.distributed.initialize`` from flags, config, or the cluster env.

One process per host (node); each process drives its local devices, which become the mesh's
``local`` axis, so the mesh's ``node`` axis is the host (``mtraining_jax.mesh.make_mesh``).

* SLURM: ``srun --ntasks-per-node=1 mtraining-train --config ...`` — JAX reads ``SLURM_*``.
* Open MPI: ``mpirun -npernode 1 mtraining-train ...`` — JAX reads ``OMPI_*``.
* Plain processes: on every host run ``mtraining-train --config ... --coordinator-address
  HOST0:12345 --num-processes N --process-id i`` (or set ``JAX_COORDINATOR_ADDRESS``,
  ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``).
"""

from __future__ import annotations

import os

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
        jax.distributed.initialize(cfg.coordinator_address, cfg.num_processes, cfg.process_id)
        return True
    kind = detect_cluster() if cfg.auto else None
    if kind is None:
        return False
    _cpu_collectives()
    if kind == "env":
        jax.distributed.initialize(
            os.environ["JAX_COORDINATOR_ADDRESS"],
            int(os.environ["JAX_NUM_PROCESSES"]),
            int(os.environ["JAX_PROCESS_ID"]),
        )
    else:
        jax.distributed.initialize()  # SLURM / Open MPI auto-detection
    return True


def _cpu_collectives():
    # Cross-process collectives on CPU go through gloo (the default in recent JAX; explicit here).
    if os.environ.get("JAX_PLATFORMS", "").startswith("cpu"):
        try:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        except (AttributeError, ValueError):  # option renamed/removed: gloo is the default then
            pass
