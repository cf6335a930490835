"""The (node, local) mesh helper: shapes, node-major device order, and errors naming bad shapes."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

from mtraining_jax.mesh import CP_AXES, check_cp_mesh, make_mesh, num_cp_ranks, sequence_sharding


@pytest.mark.parametrize("shape", [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_shapes_and_node_major_order(shape):
    mesh = make_mesh(shape)
    assert mesh.axis_names == CP_AXES
    assert dict(mesh.shape) == {"node": shape[0], "local": shape[1]}
    assert check_cp_mesh(mesh) == shape and num_cp_ranks(mesh) == 8
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    np.testing.assert_array_equal(ids.ravel(), sorted(d.id for d in jax.devices()))  # rank = node * L + local


def test_default_is_one_node_per_process():
    mesh = make_mesh()
    assert dict(mesh.shape) == {"node": 1, "local": len(jax.devices())}


def test_subset_of_devices_and_data_axis():
    mesh = make_mesh((1, 1), jax.devices()[:1])
    assert dict(mesh.shape) == {"node": 1, "local": 1}
    mesh = make_mesh((2, 2), data=2)
    assert mesh.axis_names == ("data",) + CP_AXES
    assert check_cp_mesh(mesh) == (2, 2)
    assert sequence_sharding(mesh).spec == PartitionSpec("data", CP_AXES, None, None)


def test_sequence_sharding_spec():
    mesh = make_mesh((2, 4))
    assert sequence_sharding(mesh).spec == PartitionSpec(None, CP_AXES, None, None)
    assert sequence_sharding(mesh, seq_axis=0, ndim=1).spec == PartitionSpec(CP_AXES)


@pytest.mark.parametrize(
    "shape,kwargs,match",
    [
        ((3, 3), {}, r"node=3 x local=3 needs 9 devices, but 8 are available"),
        ((2, 2), {}, r"node=2 x local=2 needs 4 devices, but 8 are available"),
        ((4, 4), {"data": 2}, r"data=2 x node=4 x local=4 needs 32 devices"),
        ((0, 8), {}, r"two positive integers \(node, local\), got \(0, 8\)"),
        ((8,), {}, r"got \(8,\)"),
        ((2.0, 4), {}, r"got \(2.0, 4\)"),
        ((2, 4), {"data": 0}, r"data axis size must be >= 1, got 0"),
    ],
)
def test_shapes_that_do_not_fit_raise(shape, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_mesh(shape, **kwargs)


def test_mesh_without_cp_axes_raises():
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"))
    with pytest.raises(ValueError, match=r"axes \('x', 'y'\) are missing \['node', 'local'\]"):
        check_cp_mesh(mesh)
