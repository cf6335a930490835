"""Host offload of the optimizer state (``optim.offload: opt_state``, issue 20) on 8 CPU devices:
the moments live in ``pinned_host`` memory (FSDP-sharded), training gives the same losses and
parameters as without offload, checkpoints save and resume, and a platform without host memory
is a clear error."""

import os
import shutil
import types

import jax
import numpy as np
import pytest

from mtraining_jax.train.checkpoint import Checkpointer
from mtraining_jax.train.config import load_config
from mtraining_jax.train.loop import setup, to_global, train
from mtraining_jax.train.offload import check_host_memory

from _tiny_train import CONFIG, tiny_config, token_file, training_parts

pytestmark = pytest.mark.usefixtures("jax_compilation_cache")
BASE = ["optim.clip_norm=0.5", "mesh.shape=[1,4]"]  # 4 CP ranks (FSDP over them)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return token_file(tmp_path_factory)


def _cfg(tokens, *extra):
    return tiny_config(tokens, *extra, base=BASE)


def _run(cfg, n, fresh=None):
    t, loader, sh = training_parts(cfg)
    state = t.state_fn()
    if fresh is not None:
        fresh.append(jax.device_get(state))
        batch = jax.tree.map(to_global, next(loader), sh)
        fresh.append(t.train_step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes)
    losses = []
    for _ in range(n):
        state, m = t.train_step(state, jax.tree.map(to_global, next(loader), sh))
        losses.append(float(m["loss"]))
    return np.array(losses), state, t.abstract


@pytest.fixture(scope="module")
def reference(tokens):
    fresh = []
    return (*_run(_cfg(tokens), 4, fresh), fresh)


@pytest.mark.parametrize("stream", [True, False])
def test_offloaded_state_lives_in_host_memory_and_trains_the_same(tokens, reference, stream):
    ref, ref_state, _, (ref_fresh, ref_temp) = reference
    fresh = []
    off, off_state, off_abs = _run(_cfg(tokens, "optim.offload=opt_state", f"optim.offload_stream={str(stream).lower()}"),
                                   4, fresh)
    # the host-built fresh optimizer state (zeros straight into pinned_host) is optimizer.init's
    for a, b in zip(jax.tree.leaves(fresh[0]), jax.tree.leaves(ref_fresh), strict=True):
        np.testing.assert_array_equal(a, b)
    if stream:  # CPU (one memory): the streamed update keeps one layer's moments at a time and
        # rewrites parameters and moments in place, so no temporary beyond the no-offload step's
        assert fresh[1] <= ref_temp, (fresh[1], ref_temp)
    assert ref[-1] < ref[0] - 0.1  # it trains (and the clip is active: lr 1e-2, clip 0.5)
    np.testing.assert_allclose(off, ref, rtol=0, atol=1e-6)
    # parameters and moments: float32 rounding of differently fused updates. Adam moves an element by
    # up to ~lr = 1e-2 a step; where |g| is near eps a last-bit change of g moves that element's update
    # by more than its last digits: seen 6.04e-6 and 3.14e-5, each on 1 of 32,768 elements (CI, 2 xdist
    # workers). A skipped, doubled or stale update moves nearly every element of a leaf by ~1e-2. So:
    # every element within 1e-3 (a tenth of one step's bound), and at most 0.1 % of a leaf's elements
    # beyond 2e-5 (0.05 % of the four steps' bound).
    for a, b in zip(jax.tree.leaves(off_state), jax.tree.leaves(ref_state), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-3)
        beyond = np.abs(a.astype(np.float64) - b) > 2e-5
        assert beyond.mean() <= 1e-3, (a.shape, int(beyond.sum()))
    # the moments (FSDP-sharded as before) and the step counts are in pinned_host memory, the
    # parameters in device memory; the shardings after steps are those of the abstract state
    for tree in (off_abs, off_state):
        kinds = {x.sharding.memory_kind for x in jax.tree.leaves(tree["opt_state"])}
        assert kinds == {"pinned_host"}, kinds
        assert {x.sharding.memory_kind for x in jax.tree.leaves(tree["params"])} == {"device"}
    mu = off_state["opt_state"][1][0].mu["layers"]["mlp"]["up_proj"]["kernel"]
    ref_mu = ref_state["opt_state"][1][0].mu["layers"]["mlp"]["up_proj"]["kernel"]
    assert mu.sharding.spec == ref_mu.sharding.spec == jax.sharding.PartitionSpec(None, None, ("node", "local"))
    assert {x.sharding.memory_kind for x in jax.tree.leaves(ref_state)} == {"device"}


def test_offload_checkpoint_resumes(tokens, tmp_path):
    run_dir = str(tmp_path / "run")
    base = ["steps=4", "checkpoint.every=2", f"run_dir={run_dir}", "optim.offload=opt_state"]
    r = setup(_cfg(tokens, *base))
    whole = train(r)
    r.close()
    ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"))
    saved, _, _ = ckpt.restore(2)
    ckpt.close()
    # continue a copy of the step-2 checkpoint
    d = str(tmp_path / "cont")
    shutil.copytree(os.path.join(run_dir, "checkpoints", "2"), os.path.join(d, "checkpoints", "2"))
    r = setup(_cfg(tokens, *base, f"run_dir={d}", "checkpoint.resume=true"))
    assert r.start == 2
    assert {x.sharding.memory_kind for x in jax.tree.leaves(r.state["opt_state"])} == {"pinned_host"}
    for a, b in zip(jax.tree.leaves(r.state), jax.tree.leaves(saved), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    cont = train(r)
    r.close()
    want = [loss for step, loss in whole.train_losses if step > 2]
    np.testing.assert_allclose([l for _, l in cont.train_losses], want, rtol=0, atol=1e-6)


def test_offload_config_and_platform_errors():
    with pytest.raises(ValueError, match=r"optim.offload must be one of \('none', 'opt_state'\), got 'params'"):
        load_config(CONFIG, ["optim.offload=params"])
    dev = types.SimpleNamespace(platform="tpu", addressable_memories=lambda: [types.SimpleNamespace(kind="device")],
                                __str__=lambda self: "dev0")
    mesh = types.SimpleNamespace(devices=np.array([dev], dtype=object))
    with pytest.raises(ValueError, match=r"optim.offload='opt_state' needs 'pinned_host' memory, but the tpu device "
                                         r".* has only \['device'\]; set optim.offload=none"):
        check_host_memory("opt_state", mesh)
    check_host_memory("none", mesh)  # nothing offloaded: nothing to check
