"""FSDP / ZeRO-3 (issue 20) on 8 CPU devices: the sharding rule, FSDP vs replicated losses over 10
steps, per-device state bytes from the compiled step's memory analysis, a checkpoint written on a
2x4 mesh continued on 1x8 and 4x2, and ``--plan``."""

import dataclasses
import os
import shutil

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from mtraining_jax.train import cli
from mtraining_jax.train.checkpoint import Checkpointer
from mtraining_jax.train.config import load_config
from mtraining_jax.train.loop import build_mesh, setup, to_global, train
from mtraining_jax.train.plan import DoesNotFit, check_fits, memory_plan, parse_bytes
from mtraining_jax.train.sharding import fsdp_spec, resolve_fsdp, shard_bytes

from _tiny_train import CONFIG, TINY, tiny_config, token_file, training_parts

pytestmark = pytest.mark.usefixtures("jax_compilation_cache")
@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return token_file(tmp_path_factory)


def _cfg(tokens, *extra):
    return tiny_config(tokens, *extra)


def test_fsdp_spec_rule():
    axes = ("node", "local")
    assert fsdp_spec((4, 64, 32), 8, axes, stacked=True) == P(None, axes, None)  # largest divisible, not dim 0
    assert fsdp_spec((16, 8), 8, axes, stacked=True) == P(None, axes)  # dim 0 (layers) never split
    assert fsdp_spec((512, 64), 8, axes, stacked=False) == P(axes, None)
    assert fsdp_spec((4, 12), 8, axes, stacked=True) == P()  # nothing divisible: replicated
    assert fsdp_spec((), 8, axes, stacked=False) == P()
    assert fsdp_spec((64,), 8, ("local",), stacked=False) == P("local")
    assert fsdp_spec((64,), 1, ("local",), stacked=False) == P()
    assert resolve_fsdp(None, None) is False
    assert resolve_fsdp(None, build_mesh(load_config(CONFIG, []).mesh)) is True  # 8 devices: on by default
    with pytest.raises(ValueError, match="mesh.fsdp must be true or false, got 'yes'"):
        load_config(CONFIG, ["mesh.fsdp='yes'"])


def _steps(cfg, n):
    """``(losses of n steps, compiled memory analysis, abstract state, batch bytes per device)``."""
    t, loader, sh = training_parts(cfg)
    batches = [jax.tree.map(to_global, next(loader), sh) for _ in range(n)]
    state = t.state_fn()
    ma = t.train_step.lower(state, batches[0]).compile().memory_analysis()
    losses = []
    for b in batches:
        state, m = t.train_step(state, b)
        losses.append(float(m["loss"]))
    return np.array(losses), ma, t.abstract, shard_bytes(batches[0])


def test_fsdp_matches_replicated_and_shards_the_state(tokens):
    rep, ma_rep, abs_rep, batch_rep = _steps(_cfg(tokens, "mesh.fsdp=false"), 10)
    fsdp, ma_fsdp, abs_fsdp, batch_fsdp = _steps(_cfg(tokens), 10)  # default: on with 8 devices
    assert np.all(np.isfinite(rep)) and rep[-1] < rep[0] - 0.1  # it trains
    np.testing.assert_allclose(fsdp, rep, rtol=1e-6, atol=0)  # float32 sums in another order: ~3e-7 after 10 steps
    # parameters + optimizer state per device, from the compiled step (its arguments minus the batch)
    state_rep = ma_rep.argument_size_in_bytes - batch_rep
    state_fsdp = ma_fsdp.argument_size_in_bytes - batch_fsdp
    assert state_rep == shard_bytes(abs_rep) and state_fsdp == shard_bytes(abs_fsdp)
    assert state_fsdp <= state_rep / 8 * 1.05, (state_fsdp, state_rep)
    spec = abs_fsdp["params"]["layers"]["mlp"]["up_proj"]["kernel"].sharding.spec
    assert spec == P(None, None, ("node", "local"))  # [L, 64, 128]: the 128 dim over all devices
    mu = abs_fsdp["opt_state"][1][0].mu["layers"]["mlp"]["up_proj"]["kernel"].sharding.spec
    assert mu == spec


def test_checkpoint_from_2x4_continues_on_1x8_and_4x2(tokens, tmp_path):
    """Restored into the new mesh's FSDP shardings bit for bit; the continued losses equal the 2x4
    run's (to float32 rounding: the reductions run over another device arrangement)."""
    run_dir = str(tmp_path / "run")
    base = ["steps=4", "checkpoint.every=2", f"run_dir={run_dir}", "model.attention_backend=reference"]
    r = setup(_cfg(tokens, *base, "mesh.shape=[2,4]"))
    whole = train(r)  # 2x4 throughout; checkpoint at step 2 (and 4)
    r.close()
    ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"))
    saved, _, _ = ckpt.restore(2)  # host arrays of step 2
    ckpt.close()
    want = [loss for step, loss in whole.train_losses if step > 2]
    for shape in ("[1,8]", "[4,2]"):
        # continue a copy of the step-2 checkpoint on the other mesh
        d = str(tmp_path / f"cont{shape}")
        shutil.copytree(os.path.join(run_dir, "checkpoints", "2"), os.path.join(d, "checkpoints", "2"))
        r = setup(_cfg(tokens, *base, f"mesh.shape={shape}", f"run_dir={d}", "checkpoint.resume=true"))
        assert r.start == 2 and dict(r.mesh.shape) == {"node": int(shape[1]), "local": int(shape[3])}
        for a, b in zip(jax.tree.leaves(r.state), jax.tree.leaves(saved), strict=True):  # lossless reshard
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        k = r.state["params"]["layers"]["mlp"]["up_proj"]["kernel"]
        assert k.sharding.spec == P(None, None, ("node", "local"))
        assert k.addressable_shards[0].data.shape == (2, 64, 16)
        cont = train(r)
        r.close()
        np.testing.assert_allclose([l for _, l in cont.train_losses], want, rtol=0, atol=1e-5)


def test_plan_reports_sharded_state_and_says_what_to_change(tokens, capsys):
    cfg = _cfg(tokens, "mesh.fsdp=false")
    plan = memory_plan(cfg, parse_bytes("1GiB"))
    assert plan.fits and not plan.fsdp and plan.num_devices == 8
    per_layer = (64 * 64 + 64) + 2 * (64 * 32 + 32) + 64 * 64 + 3 * 64 * 128 + 2 * 64  # q, k+v, o, MLP, norms
    n_params = 2 * 512 * 64 + 2 * per_layer + 64  # embedding, untied lm_head, layers, final norm
    assert plan.params == 4 * n_params  # float32, replicated, untied lm_head
    assert 0 <= plan.opt_state - 2 * plan.params <= 64  # Adam mu + nu (and its step count)
    # what the compiled step takes, donates and returns, against the state's own byte counts: it
    # takes the state and the batch, donates the whole state (aliased to its output) and returns
    # only a few metric scalars besides (a broken donation would add the state to the peak)
    assert 0 <= plan.argument - (plan.params + plan.opt_state + plan.batch) <= 64
    assert 0 <= plan.alias - (plan.params + plan.opt_state) <= 64
    assert 0 <= plan.output - plan.alias <= 1024
    assert 0 <= plan.peak - (plan.params + plan.opt_state + plan.batch + plan.temp) <= 2048
    assert plan.activations > 0
    with pytest.raises(DoesNotFit, match=r"needs .* per device but the device has 2.0 MiB; change: mesh.fsdp=true"):
        check_fits(dataclasses.replace(plan, device_memory=parse_bytes("2MiB")), cfg)
    advice = dataclasses.replace(plan, fsdp=True, remat="save_attn", activations=10 * plan.opt_state).advice(cfg)
    assert advice[0].startswith("model.remat=selective (now save_attn") and not any("fsdp" in a for a in advice)
    assert advice[1].startswith("model.remat=full (now save_attn") and advice[2].startswith("optim.offload=opt_state")
    advice = dataclasses.replace(plan, fsdp=True, remat="full", activations=0).advice(cfg)
    assert advice[0].startswith("optim.offload=opt_state (the optimizer state, 1.1 MiB") and "remat" not in advice[1]
    # the CLI (same program: from the compilation cache): the table on stdout and status 0 when it
    # fits; status 2 and what to change when it does not
    args = ["--config", CONFIG, *TINY, f"data.path={tokens}", "mesh.fsdp=false", "--plan"]
    assert cli.main(args + ["--device-memory", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert "replicated state" in out and "-> fits" in out
    assert cli.main(args + ["--device-memory", "100KiB"]) == 2
    err = capsys.readouterr().err
    assert "does not fit" not in err and "but the device has 0.1 MiB; change: mesh.fsdp=true" in err
    assert cli.main(args + ["--device-memory", "lots"]) == 2
    assert "--device-memory must be a size like 80GiB" in capsys.readouterr().err
