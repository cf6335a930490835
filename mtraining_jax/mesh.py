"""Building the 2-D ``(node, local)`` context-parallel mesh (MTraining §4.2).

Ranks are node-major: ``rank = node * num_local + local``. In one process the shape is given
(e.g. 2x4 of 8 devices); across processes (after ``jax.distributed.initialize``) ``node`` is the
process and ``local`` that process's devices, so the inner ring stays on fast intra-node links.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

NODE_AXIS = "node"
LOCAL_AXIS = "local"
CP_AXES = (NODE_AXIS, LOCAL_AXIS)


def make_mesh(
    shape: tuple[int, int] | None = None,
    devices: Sequence[jax.Device] | None = None,
    *,
    data: int = 1,
) -> Mesh:
    """Build a mesh with axes ``("node", "local")`` (or ``("data", "node", "local")``).

    Args:
      shape: ``(num_nodes, num_local)``. ``None``: one node per process and all of each
        process's devices on ``local`` (single process: ``(1, device_count)``).
      devices: devices to use (default ``jax.devices()``); their count must equal
        ``data * num_nodes * num_local``.
      data: size of an optional leading batch-parallel axis ``"data"`` (kept only when > 1).

    Raises:
      ValueError: the shape does not fit the devices, naming both.
    """
    devices = list(jax.devices() if devices is None else devices)
    if data < 1:
        raise ValueError(f"data axis size must be >= 1, got {data}")
    if shape is None:
        nproc = len({d.process_index for d in devices})
        per = len(devices) // (nproc * data)
        shape = (nproc, per) if nproc > 1 else (1, len(devices) // data)
    if len(shape) != 2 or any((not isinstance(s, (int, np.integer))) or s < 1 for s in shape):
        raise ValueError(f"mesh shape must be two positive integers (node, local), got {shape!r}")
    nodes, local = int(shape[0]), int(shape[1])
    need = data * nodes * local
    if need != len(devices):
        raise ValueError(
            f"mesh shape data={data} x node={nodes} x local={local} needs {need} devices, "
            f"but {len(devices)} are available"
        )
    # Keep each process's devices together on `local` so node == process in multi-host runs.
    devices = sorted(devices, key=lambda d: (d.process_index, d.id))
    arr = np.array(devices, dtype=object).reshape(data, nodes, local)
    if nodes > 1 and len({d.process_index for d in devices}) == nodes:
        for n in range(nodes):
            procs = {d.process_index for d in arr[:, n].ravel()}
            if len(procs) != 1:
                raise ValueError(f"node {n} of the mesh spans processes {sorted(procs)}")
    if data == 1:
        return Mesh(arr[0], CP_AXES)
    return Mesh(arr, ("data",) + CP_AXES)


def check_cp_mesh(mesh: Mesh) -> tuple[int, int]:
    """Return ``(num_nodes, num_local)``; ``ValueError`` if the mesh lacks those axes."""
    missing = [a for a in CP_AXES if a not in mesh.shape]
    if missing:
        raise ValueError(
            f"mesh must have axes {CP_AXES}; axes {tuple(mesh.axis_names)} are missing {missing}"
        )
    return int(mesh.shape[NODE_AXIS]), int(mesh.shape[LOCAL_AXIS])


def num_cp_ranks(mesh: Mesh) -> int:
    n, l = check_cp_mesh(mesh)
    return n * l


def sequence_sharding(mesh: Mesh, seq_axis: int = 1, ndim: int = 4) -> NamedSharding:
    """Sharding that splits ``seq_axis`` over ``(node, local)`` node-major (and batch over
    ``data`` when the mesh has it)."""
    spec = [None] * ndim
    spec[seq_axis] = CP_AXES
    if "data" in mesh.shape and seq_axis != 0:
        spec[0] = "data"
    return NamedSharding(mesh, PartitionSpec(*spec))
