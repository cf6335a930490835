"""The training loop: mesh, data, state (fresh or resumed), steps, evaluation, checkpoints, metrics.

``run(cfg)`` is what ``mtraining-train`` calls. Per optimizer step: the loader yields a host
batch ``[A, B, S]`` in layout order; it becomes a global array sharded over the mesh
(:func:`to_global`; every process builds the same host batch and contributes its own shards);
the jitted step updates the replicated state. A non-finite loss stops the run with
:class:`NonFiniteLossError` before anything is saved, so the last good checkpoint stays the
newest. Checkpoints hold the state and the loader state, so ``--resume`` continues exactly.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

import jax
import numpy as np

from mtraining_jax.layouts import Layout, validate_layout
from mtraining_jax.mesh import make_mesh, num_cp_ranks
from mtraining_jax.train import data as data_lib
from mtraining_jax.train.checkpoint import Checkpointer
from mtraining_jax.train.config import TrainConfig
from mtraining_jax.train.metrics import MetricsWriter, Progress, plot_losses
from mtraining_jax.train.optim import build_optimizer
from mtraining_jax.train.state import build_model_config, abstract_train_state, num_params, split_model, train_state_fn
from mtraining_jax.train.step import batch_shardings, make_eval_step, make_train_step
from mtraining_jax.train.tokenizer import load_tokenizer


class NonFiniteLossError(RuntimeError):
    """Raised when a training step produces a NaN/inf loss."""


@dataclasses.dataclass
class RunResult:
    """What a finished run reports."""

    final_step: int
    train_losses: list  # (step, loss) of the steps run by this invocation
    eval_metrics: list  # dicts with step, loss, perplexity, passkey_accuracy
    checkpoint_steps: list
    params: object  # final parameters (global arrays)
    run_dir: str


def to_global(x: np.ndarray, sharding):
    """A global ``jax.Array`` from a host array every process holds in full."""
    if sharding is None:
        return jax.numpy.asarray(x)
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def build_mesh(mcfg):
    """The run's mesh. A single process may use fewer devices than it sees (e.g. the one-GPU
    config on an 8-GPU host takes the first device); multi-process runs use all of them."""
    devices = jax.devices()
    if mcfg.shape is not None and jax.process_count() == 1:
        need = mcfg.data * int(np.prod(mcfg.shape))
        if need < len(devices):
            devices = devices[:need]
    return make_mesh(tuple(mcfg.shape) if mcfg.shape else None, devices, data=mcfg.data)


def check_run_config(cfg: TrainConfig, model_cfg, mesh, tokenizer) -> Layout:
    """Validate the cross-section constraints up front (``ValueError`` naming the values)."""
    P_ = num_cp_ranks(mesh)
    d = cfg.data
    validate_layout(d.layout, d.seq_len, P_, d.stripe)
    data_ax = int(mesh.shape.get("data", 1))
    if d.batch_size % data_ax:
        raise ValueError(f"data.batch_size={d.batch_size} is not divisible by mesh.data={data_ax}")
    backends = set(model_cfg.layer_backends)
    if "cudnn" in backends and P_ > 1:  # on one rank every layout is the identity permutation
        raise ValueError(f"attention backend 'cudnn' runs on one device (natural token order); the mesh "
                         f"has {P_} CP ranks and data.layout={d.layout!r}")
    if "mtraining" in backends:
        mcfg = model_cfg.mtraining_config()
        if model_cfg.layout != d.layout:
            raise ValueError(f"the mtraining attention expects tokens in the {model_cfg.layout!r} layout "
                             f"(model.layout) but data.layout is {d.layout!r}")
        if d.layout == "block_striped" and d.stripe != mcfg.block_size:
            raise ValueError(f"data.stripe={d.stripe} must equal the sparse block size "
                             f"model.sparsity.block_size={mcfg.block_size} for the mtraining attention")
        mcfg.make_layout(d.seq_len, P_)  # sequence vs block size x ranks, naming the values
        mcfg.sparsity.check(d.seq_len, model_cfg.num_heads, P_)
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise ValueError(
            f"tokenizer {getattr(tokenizer, 'name', '')!r} has {tokenizer.vocab_size} tokens but "
            f"model.vocab_size is {model_cfg.vocab_size}"
        )
    if d.source in ("tokens", "text"):
        for key, p in (("data.path", d.path), ("data.eval_path", d.eval_path)):
            if p is not None and not os.path.isfile(p):
                raise ValueError(f"{key} {p!r} does not exist")
    return Layout(d.layout, d.seq_len, P_, d.stripe)


def evaluate(eval_step, params, batches, shardings) -> tuple[float, float, float]:
    """``(mean loss, accuracy, tokens)`` over host batches."""
    tot = cor = cnt = 0.0
    for b in batches:
        gb = jax.tree.map(to_global, b, shardings) if shardings is not None else b
        l, c, n = jax.device_get(eval_step(params, gb))
        tot, cor, cnt = tot + float(l), cor + float(c), cnt + float(n)
    return tot / max(cnt, 1.0), cor / max(cnt, 1.0), cnt


def run(cfg: TrainConfig) -> RunResult:
    """Train according to ``cfg`` (see module docstring)."""
    t_setup = time.time()
    mesh = build_mesh(cfg.mesh)
    model_cls, model_cfg = build_model_config(cfg.model, cfg.config_dir)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    layout = check_run_config(cfg, model_cfg, mesh, tokenizer)

    A = cfg.optim.grad_accum
    train_stream, held_stream = data_lib.build_streams(cfg.data, tokenizer)
    loader = data_lib.build_train_loader(cfg.data, tokenizer, layout, train_stream, accum=A)
    held = data_lib.heldout_batches(cfg.data, layout, held_stream, cfg.eval.batches)
    passkey = []
    if cfg.eval.passkey_samples:
        rng = np.random.default_rng([cfg.seed, 314159])
        n = cfg.eval.passkey_samples
        bs = cfg.data.batch_size
        passkey = [data_lib.passkey_batch(tokenizer, cfg.data.seq_len, bs, rng, layout, cfg.eval.passkey_digits)
                   for _ in range(math.ceil(n / bs))]

    optimizer, schedule = build_optimizer(cfg.optim, cfg.steps)
    parts, init_fn = split_model(model_cls, model_cfg, cfg.seed)
    state_fn = train_state_fn(init_fn, optimizer, mesh, cfg.seed)
    abstract = abstract_train_state(state_fn, mesh)
    state_sh = jax.tree.map(lambda x: x.sharding, abstract)
    train_step = make_train_step(parts, optimizer, schedule, mesh, cfg.loss_chunk_size, state_sh)
    eval_step = make_eval_step(parts, mesh, cfg.loss_chunk_size)
    sh_acc, sh_one = batch_shardings(mesh, True), batch_shardings(mesh, False)

    os.makedirs(cfg.run_dir, exist_ok=True)
    ckpt = Checkpointer(cfg.checkpoint_dir, cfg.checkpoint.keep, cfg.checkpoint.async_save) if cfg.checkpoint.every else None
    start, state = 0, None
    progress_msgs = []
    if cfg.checkpoint.resume and ckpt is not None:
        latest = ckpt.latest_step()
        if latest is not None:  # restore straight into the target shardings, no fresh init
            state, data_state, _ = ckpt.restore(latest, abstract)
            loader.set_state(data_state)
            start = latest
            progress_msgs.append(f"resumed from step {latest} in {ckpt.directory}")
        else:
            progress_msgs.append(f"no checkpoint in {ckpt.directory}; starting from scratch")
    if state is None:
        state = state_fn()

    writer = MetricsWriter(cfg.run_dir, cfg.logging.tensorboard)
    if jax.process_index() == 0:
        import yaml

        with open(os.path.join(cfg.run_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)
    bar = Progress(cfg.steps, start, cfg.logging.progress)
    for m in progress_msgs:
        bar.write(m)
    bar.write(
        f"model {model_cfg.name or model_cls.__name__}: {num_params(state['params']):,} parameters; "
        f"mesh {dict(mesh.shape)}; layout {layout.name} S={layout.seq_len}; "
        f"backends {sorted(set(model_cfg.layer_backends))}; setup {time.time() - t_setup:.1f}s"
    )

    train_losses, eval_metrics = [], []
    tokens_per_step = cfg.data.seq_len * cfg.data.batch_size * A

    def do_eval(step):
        rec = {}
        if held:
            loss, acc, _ = evaluate(eval_step, state["params"], held, sh_one)
            rec.update(loss=loss, perplexity=math.exp(min(loss, 80.0)), accuracy=acc)
        if passkey:
            _, acc, _ = evaluate(eval_step, state["params"], passkey, sh_one)
            rec["passkey_accuracy"] = acc
        if rec:
            writer.write(step, rec, split="eval")
            eval_metrics.append({"step": step, **rec})
            bar.write(f"eval step {step}: " + ", ".join(f"{k}={v:.4f}" for k, v in rec.items()))

    try:
        stop = cfg.steps if cfg.run_steps is None else min(cfg.steps, start + cfg.run_steps)
        for step in range(start, stop):
            t0 = time.time()
            host = next(loader)
            batch = jax.tree.map(to_global, host, sh_acc) if sh_acc is not None else host
            state, metrics = train_step(state, batch)
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
            dt = time.time() - t0
            done = step + 1
            if not math.isfinite(metrics["loss"]):
                writer.write(done, metrics)
                last = None
                if ckpt is not None:
                    ckpt.wait()
                    last = ckpt.latest_step()
                where = f"the last good checkpoint is step {last} in {ckpt.directory}" if last is not None else "no checkpoint was saved"
                raise NonFiniteLossError(
                    f"non-finite loss {metrics['loss']} at step {done} (grad_norm {metrics['grad_norm']}); "
                    f"stopping without saving; {where}"
                )
            metrics.update(step_time=dt, tokens_per_s=tokens_per_step / dt)
            train_losses.append((done, metrics["loss"]))
            if done % cfg.logging.every == 0 or done == stop:
                writer.write(done, metrics)
            bar.update(metrics["loss"], metrics["tokens_per_s"], dt, metrics)
            if cfg.eval.every and (done % cfg.eval.every == 0 or done == stop):
                do_eval(done)
            if ckpt is not None and (done % cfg.checkpoint.every == 0 or done == stop):
                ckpt.save(done, state, loader.get_state(), {"loss": metrics["loss"], "model": model_cfg.name})
    finally:
        bar.close()
        if ckpt is not None:
            ckpt.wait()
        writer.close()

    steps_saved = ckpt.all_steps() if ckpt is not None else []
    if ckpt is not None:
        ckpt.close()
    if cfg.logging.plot and jax.process_index() == 0 and os.path.exists(writer.path):
        plot_losses(writer.path, os.path.join(cfg.run_dir, "loss.png"))
    final = train_losses[-1][0] if train_losses else start
    return RunResult(final, train_losses, eval_metrics, steps_saved, state["params"], cfg.run_dir)
