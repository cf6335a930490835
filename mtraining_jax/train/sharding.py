"""Shardings of the training state: replicated, or FSDP / ZeRO-3 over the whole mesh.

With ``fsdp`` every array of the state ``{step, params, opt_state, rng}`` is split over ALL mesh
axes together (one shard per device) along its largest dimension divisible by the device count,
never the leading ``[num_layers]`` axis of the stacked layers (the model gathers one layer at a
time inside its scan: :func:`mtraining_jax.model.qwen2.gather_layer_params`); arrays with no such
dimension stay replicated. The rule depends only on the key path and shape, so Adam's ``mu`` /
``nu`` get their parameter's sharding and a checkpoint restores onto any mesh.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

STACKED_KEY = "layers"  # parameters under this key carry a leading [num_layers] axis


def resolve_fsdp(fsdp: bool | None, mesh: Mesh | None) -> bool:
    """``mesh.fsdp``: ``None`` (auto) is on when the mesh has more than one device."""
    if mesh is None:
        return False
    return mesh.size > 1 if fsdp is None else bool(fsdp)


def _names(path) -> list:
    return [getattr(k, "key", getattr(k, "name", None)) for k in path]


def fsdp_spec(shape: tuple[int, ...], num_devices: int, axes: tuple[str, ...], stacked: bool) -> P:
    """``PartitionSpec`` splitting the largest dimension of ``shape`` divisible by ``num_devices``
    (skipping dimension 0 when ``stacked``) over ``axes``; ``P()`` when none is."""
    first = 1 if stacked else 0
    best = None
    for d in range(first, len(shape)):
        if shape[d] % num_devices == 0 and shape[d] >= num_devices and (best is None or shape[d] > shape[best]):
            best = d
    if best is None or num_devices == 1:
        return P()
    spec = [None] * len(shape)
    spec[best] = axes if len(axes) > 1 else axes[0]
    return P(*spec)


def state_shardings(abstract_state, mesh: Mesh | None, fsdp: bool):
    """Pytree of ``NamedSharding`` for ``abstract_state`` (arrays or ``ShapeDtypeStruct`` s):
    :func:`fsdp_spec` per leaf when ``fsdp``, else replicated. ``None`` without a mesh."""
    if mesh is None:
        return None
    if not fsdp:
        rep = NamedSharding(mesh, P())
        return jax.tree.map(lambda _: rep, abstract_state)
    axes = tuple(mesh.axis_names)

    def one(path, x):
        stacked = STACKED_KEY in _names(path)
        return NamedSharding(mesh, fsdp_spec(tuple(np.shape(x)), mesh.size, axes, stacked))

    return jax.tree_util.tree_map_with_path(one, abstract_state)


def shard_bytes(abstract) -> int:
    """Bytes ONE device holds of a pytree of sharded ``ShapeDtypeStruct`` s / arrays (the
    largest shard; every shard is equal under :func:`fsdp_spec`)."""
    total = 0
    for x in jax.tree.leaves(abstract):
        sh = getattr(x, "sharding", None)
        shape = sh.shard_shape(x.shape) if sh is not None else x.shape
        total += int(np.prod(shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
    return total
