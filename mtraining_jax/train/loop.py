"""The training loop: :func:`setup` (everything before the first step), :func:`train` (the step
loop) and hooks (what runs after a step); :func:`run` is what ``mtraining-train`` calls.

Setup checks the inputs up front (paths, the run directory :mod:`.rundir`, mesh / layout / model
constraints, token files), builds the data, the jitted steps (:func:`build_training`) and the
state: restored with ``--resume`` (the newest checkpoint that restores,
:meth:`Checkpointer.restore_newest`; changed schedule keys are named), else from
``model.init_from`` or a random initialisation. One invocation per ``run_dir``
(:class:`~.rundir.RunLock`).

Per optimizer step the host batch ``[A, B, S]`` (layout order) becomes a global array
(:func:`to_global`) and the jitted step updates the state. A step with a non-finite loss or
gradient leaves the state unchanged (counted in ``skipped_updates``); ``optim.max_bad_steps`` in a
row raise :class:`NonFiniteLossError` before anything is saved. SIGINT / SIGTERM
(:class:`StopSignals`): the first finishes the step, saves a checkpoint and raises
:class:`Interrupted` (``exit_code`` 130 / 143); a second aborts at once.

A hook is ``hook(run: Run, step: int, metrics: dict) -> None``, called after every good step, in
this order: :func:`eval_hook` (held-out loss, passkey), the config's own (built by
``hook_factories``: config section -> :data:`HookFactory`; a section switched on that no factory
serves is refused up front), then the caller's.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import contextlib
import signal
import time
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from mtraining_jax.layouts import Layout, validate_layout
from mtraining_jax.mesh import make_mesh, num_cp_ranks
from mtraining_jax.train import data as data_lib
from mtraining_jax.train import compile_cache, determinism
from mtraining_jax.train.checkpoint import Checkpointer
from mtraining_jax.train.config import TrainConfig
from mtraining_jax.train.metrics import MetricsWriter, Progress, device_peak_gib, plot_losses
from mtraining_jax.train.offload import check_host_memory, offloaded_keys, streamed_update, whole_update
from mtraining_jax.train.optim import build_adamw, build_optimizer
from mtraining_jax.train.rundir import (RunLock, check_dir, missing_top, prepare_run_dir, remove_created,
                                        saved_config, schedule_changes, schedule_values, truncate_metrics)
from mtraining_jax.train.sharding import resolve_fsdp
from mtraining_jax.train.signals import SIGNAL_NAMES, StopSignals, signal_name  # noqa: F401  (re-exported)
from mtraining_jax.train.state import (abstract_train_state, build_model_config, load_init_params, num_params,
                                       split_model, train_state_fn, train_state_from_params)
from mtraining_jax.train.step import batch_shardings, make_eval_step, make_train_step
from mtraining_jax.train.tokenizer import load_tokenizer


class NonFiniteLossError(RuntimeError):
    """``optim.max_bad_steps`` steps in a row had a NaN/inf loss or gradient."""


class Interrupted(RuntimeError):
    """SIGINT / SIGTERM: the run stopped after a step (a checkpoint was saved when checkpointing
    is on) or before its first one; ``exit_code`` is 128 + the signal's number (130, 143)."""

    def __init__(self, msg: str, signum: int = signal.SIGINT):
        super().__init__(msg)
        self.signum = int(signum)
        self.exit_code = 128 + self.signum


@dataclasses.dataclass
class RunResult:
    """What a finished run reports."""

    final_step: int
    train_losses: list  # (step, loss) of the steps run by this invocation
    eval_metrics: list  # dicts with step, loss, perplexity, passkey_accuracy
    checkpoint_steps: list
    params: object  # final parameters (global arrays)
    run_dir: str
    skipped_updates: int = 0  # steps of the whole run whose update was skipped (non-finite)


Hook = Callable[["Run", int, dict], None]


@dataclasses.dataclass
class Run:
    """A run between :func:`setup` and the end of :func:`train` (what hooks see)."""

    cfg: TrainConfig
    mesh: Any
    model_cfg: Any
    layout: Layout
    loader: Any
    train_step: Callable
    eval_step: Callable
    batch_sharding: Any  # Batch of shardings for [A, B, S] training batches
    eval_sharding: Any  # Batch of shardings for [B, S] evaluation batches
    held: list  # held-out batches
    passkey: list  # passkey batches
    ckpt: Checkpointer | None
    writer: MetricsWriter
    bar: Progress
    state: dict
    start: int
    stop: int
    skipped_updates: int = 0
    train_losses: list = dataclasses.field(default_factory=list)
    eval_metrics: list = dataclasses.field(default_factory=list)
    interrupted: int = 0  # the signal that stops the run (StopSignals.received when run() installs them)
    hooks: list = dataclasses.field(default_factory=list)  # the config's own (:func:`config_hooks`)
    lock: RunLock | None = None  # run_dir's lock (process 0), released by close()
    signals: StopSignals | None = None

    @property
    def stop_signal(self) -> int:
        """The signal asking this run to stop (0: none)."""
        return int(self.interrupted or (self.signals.received if self.signals is not None else 0))

    def save(self, step: int, loss: float) -> None:
        if self.ckpt is not None:
            self.ckpt.save(step, self.state, self.loader.get_state(),
                           {"loss": loss, "model": self.model_cfg.name, "skipped_updates": self.skipped_updates,
                            "schedule": schedule_values(self.cfg)})

    def close(self) -> None:
        self.bar.close()
        try:
            if self.ckpt is not None:
                self.ckpt.wait()
            self.writer.close()
        finally:
            if self.lock is not None:
                self.lock.release()


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


def run_layout(cfg: TrainConfig, model_cfg, num_ranks: int) -> Layout:
    """The loader's sequence layout: ``data.layout`` / ``data.stripe`` when given, else the model's
    (``model.layout``, stripe = the sparse block size), validated against the sequence and ranks."""
    d = cfg.data
    name = d.layout if d.layout is not None else model_cfg.layout
    stripe = d.stripe if d.stripe is not None else model_cfg.mtraining_config().block_size
    validate_layout(name, d.seq_len, num_ranks, stripe)
    return Layout(name, d.seq_len, num_ranks, stripe)


def check_run_config(cfg: TrainConfig, model_cfg, mesh, tokenizer) -> Layout:
    """Validate the cross-section constraints up front (``ValueError`` naming the values); returns
    the loader's layout (:func:`run_layout`)."""
    P_ = num_cp_ranks(mesh)
    d = cfg.data
    layout = run_layout(cfg, model_cfg, P_)
    data_ax = int(mesh.shape.get("data", 1))
    if d.batch_size % data_ax:
        raise ValueError(f"data.batch_size={d.batch_size} is not divisible by mesh.data={data_ax}")
    backends = set(model_cfg.layer_backends)
    if "cudnn" in backends and P_ > 1:  # on one rank every layout is the identity permutation
        raise ValueError(f"attention backend 'cudnn' runs on one device (natural token order); the mesh "
                         f"has {P_} CP ranks and the {layout.name!r} layout")
    if "mtraining" in backends:
        mcfg = model_cfg.mtraining_config()
        if model_cfg.layout != layout.name:
            raise ValueError(f"the mtraining attention expects tokens in the {model_cfg.layout!r} layout "
                             f"(model.layout) but data.layout is {layout.name!r}")
        if layout.name == "block_striped" and layout.stripe != mcfg.block_size:
            raise ValueError(f"data.stripe={layout.stripe} must equal the sparse block size "
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
                what = "is a directory, not a file" if os.path.isdir(p) else "does not exist"
                raise ValueError(f"{key} {p!r} {what}")
    return layout


def evaluate(eval_step, params, batches, shardings) -> tuple[float, float, float]:
    """``(mean loss, accuracy, tokens)`` over host batches."""
    tot = cor = cnt = 0.0
    for b in batches:
        gb = jax.tree.map(to_global, b, shardings) if shardings is not None else b
        l, c, n = jax.device_get(eval_step(params, gb))
        tot, cor, cnt = tot + float(l), cor + float(c), cnt + float(n)
    return tot / max(cnt, 1.0), cor / max(cnt, 1.0), cnt


def eval_hook(run: Run, step: int, metrics: dict) -> None:
    """Held-out loss / perplexity / accuracy and passkey accuracy every ``eval.every`` steps."""
    every = run.cfg.eval.every
    if not every or (step % every and step != run.stop):
        return
    rec = {}
    if run.held:
        loss, acc, _ = evaluate(run.eval_step, run.state["params"], run.held, run.eval_sharding)
        rec.update(loss=loss, perplexity=math.exp(min(loss, 80.0)), accuracy=acc)
    if run.passkey:
        _, acc, _ = evaluate(run.eval_step, run.state["params"], run.passkey, run.eval_sharding)
        rec["passkey_accuracy"] = acc
    if rec:
        run.writer.write(step, rec, split="eval")
        run.eval_metrics.append({"step": step, **rec})
        run.bar.write(f"eval step {step}: " + ", ".join(f"{k}={v:.4f}" for k, v in rec.items()))


#: ``factory(cfg, model_cfg, mesh, tokenizer) -> [Hook, ...]``: the hooks of one config section
#: (an empty list when the section is off), built before the run starts; ``ValueError`` for bad settings
HookFactory = Callable[..., Sequence[Hook]]

#: config sections served by hooks from the layers above the trainer: (key, switched on in cfg?)
HOOKED_SECTIONS = (("eval.long_context", lambda cfg: bool(cfg.eval.long_context.every)),)


def config_hooks(cfg: TrainConfig, model_cfg, mesh, tokenizer,
                 hook_factories: Mapping[str, HookFactory] = MappingProxyType({})) -> list:
    """The hooks the config switches on, built by ``hook_factories`` (module docstring) before the
    run starts; ``ValueError`` naming the section when it is on and no factory serves it."""
    unknown = sorted(set(hook_factories) - {k for k, _ in HOOKED_SECTIONS})
    if unknown:
        raise ValueError(f"hook factories for unknown config section(s) {unknown}; "
                         f"known: {[k for k, _ in HOOKED_SECTIONS]}")
    hooks = []
    for key, on in HOOKED_SECTIONS:
        if not on(cfg):
            continue
        if key not in hook_factories:
            raise ValueError(f"{key} is switched on but this entry point has no hook for it: run the "
                             f"`mtraining-train` command (mtraining_jax.apps.train), or pass "
                             f"hook_factories=mtraining_jax.apps.train.HOOK_FACTORIES to train.loop.run")
        hooks.extend(hook_factories[key](cfg, model_cfg, mesh, tokenizer))
    return hooks


def _is_main() -> bool:
    return jax.process_index() == 0


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


@dataclasses.dataclass(frozen=True)
class Training:
    """The jitted pieces of a run (what :func:`setup`, ``--plan`` and the benchmarks share)."""

    optimizer: Any
    schedule: Callable
    parts: Any  # ModelParts
    fsdp: bool  # state sharded over all devices (mesh.fsdp resolved)
    state_fn: Callable  # jitted () -> fresh state, in its shardings
    abstract: dict  # ShapeDtypeStruct pytree of the state, with shardings
    train_step: Callable
    eval_step: Callable


def build_training(cfg: TrainConfig, mesh, model_cls, model_cfg) -> Training:
    """Optimizer, model split, state shardings (``mesh.fsdp``) and the jitted steps of ``cfg``."""
    optimizer, schedule = build_optimizer(cfg.optim, cfg.steps)
    parts, init_fn = split_model(model_cls, model_cfg, cfg.seed)
    fsdp = resolve_fsdp(cfg.mesh.fsdp, mesh)
    check_host_memory(cfg.optim.offload, mesh)
    offload = offloaded_keys(cfg.optim.offload)
    state_fn = train_state_fn(init_fn, optimizer, mesh, cfg.seed, fsdp, offload)
    abstract = abstract_train_state(state_fn, mesh, fsdp, offload)
    state_sh = jax.tree.map(lambda x: x.sharding, abstract)
    offload_update = None if not offload else (
        functools.partial(streamed_update, build_adamw(cfg.optim, schedule), cfg.optim.clip_norm)
        if cfg.optim.offload_stream else functools.partial(whole_update, optimizer))
    train_step = make_train_step(parts, optimizer, schedule, mesh, cfg.loss_chunk_size, state_sh, offload_update,
                                 msa=cfg.msa)
    eval_step = make_eval_step(parts, mesh, cfg.loss_chunk_size)
    return Training(optimizer, schedule, parts, fsdp, state_fn, abstract, train_step, eval_step)


def setup(cfg: TrainConfig, *, overwrite: bool = False,
          hook_factories: Mapping[str, HookFactory] = MappingProxyType({}),
          signals: StopSignals | None = None) -> Run:
    """Check the inputs, prepare ``run_dir``, build data, steps, the config's hooks (from
    ``hook_factories``) and the state (module docstring). Every check that reads no state runs
    before ``run_dir`` is touched; folders created for a run whose setup then fails, or that a
    signal (``signals``: an active :class:`StopSignals`) stops before its files are written, are
    removed again."""
    t_setup = time.time()
    resume = cfg.checkpoint.resume
    determinism.check(cfg.deterministic)
    compile_cache.enable(cfg.compile_cache_dir)  # before the first compile
    mesh = build_mesh(cfg.mesh)
    model_cls, model_cfg = build_model_config(cfg.model, cfg.config_dir)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    layout = check_run_config(cfg, model_cfg, mesh, tokenizer)
    extra_hooks = config_hooks(cfg, model_cfg, mesh, tokenizer, hook_factories)
    check_dir("run_dir", cfg.run_dir, create=False)  # paths first: nothing is created yet
    check_dir("checkpoint.dir" if cfg.checkpoint.dir else "run_dir/checkpoints", cfg.checkpoint_dir, create=False)

    A = cfg.optim.grad_accum
    train_stream, held_stream = data_lib.build_streams(cfg.data, tokenizer, model_cfg.vocab_size)  # token files checked
    loader = data_lib.build_train_loader(cfg.data, tokenizer, layout, train_stream, accum=A)
    held = data_lib.heldout_batches(cfg.data, layout, held_stream, cfg.eval.batches, tokenizer.eos_id)
    passkey = []
    if cfg.eval.passkey_samples:
        rng = np.random.default_rng([cfg.seed, 314159])
        bs = cfg.data.batch_size
        passkey = [data_lib.single_document(
            data_lib.passkey_batch(tokenizer, cfg.data.seq_len, bs, rng, layout, cfg.eval.passkey_digits),
            cfg.data.pack, cfg.data.positions) for _ in range(math.ceil(cfg.eval.passkey_samples / bs))]

    created = [missing_top(cfg.run_dir), missing_top(cfg.checkpoint_dir)]
    lock = ckpt = None
    msgs = []

    def stop_here() -> None:  # a signal during the setup: stop before the run's files are written
        signum = _any_signal(signals.received if signals is not None else 0)
        if signum:
            newest = f"; the newest checkpoint is step {start}" if start else ""
            raise Interrupted(f"{signal_name(signum, short=True)}: interrupted during the setup, before step "
                              f"{start + 1}; nothing written{newest}", signum)

    start = 0
    try:
        if _is_main():
            check_dir("run_dir", cfg.run_dir)
            lock = RunLock(cfg.run_dir)
            note = lock.acquire()  # before the guard looks: one invocation per run_dir
            if note:
                msgs.append(note)
        prepare_run_dir(cfg.run_dir, cfg.checkpoint_dir, resume=resume, overwrite=overwrite,
                        checkpoint_key="checkpoint.dir" if cfg.checkpoint.dir else "run_dir/checkpoints",
                        is_main=_is_main())
        _sync("mtraining_run_dir")
        stop_here()

        t = build_training(cfg, mesh, model_cls, model_cfg)
        optimizer, state_fn, abstract = t.optimizer, t.state_fn, t.abstract
        train_step, eval_step = t.train_step, t.eval_step

        if cfg.checkpoint.every:
            ckpt = Checkpointer(cfg.checkpoint_dir, cfg.checkpoint.keep, cfg.checkpoint.async_save)
        start, state, skipped = 0, None, 0
        if resume:
            found = ckpt.restore_newest(abstract) if ckpt is not None else None
            if found is not None:  # restore straight into the target shardings, no fresh init
                latest, (state, data_state, meta), damaged = found
                for step, why in damaged:
                    where = ckpt.set_aside(step) if _is_main() else ""
                    msgs.append(f"skipped checkpoint {step}: damaged ({why})"
                                + (f"; moved to {os.path.basename(where)}" if where else ""))
                if damaged:
                    _sync("mtraining_set_aside")
                    ckpt.all_steps()  # reload the step list on every process
                loader.set_state(data_state)
                start, skipped = latest, int(meta.get("skipped_updates", 0))
                msgs.append(f"resumed from step {latest} in {ckpt.directory}"
                            + (" (model.init_from ignored)" if cfg.model.init_from else ""))
                before = meta.get("schedule") or schedule_values(saved_config(cfg.run_dir) or {})
                msgs.extend(schedule_changes(before, schedule_values(cfg)))
            else:
                where = ckpt.directory if ckpt is not None else "this run (checkpoint.every=0)"
                msgs.append(f"no checkpoint in {where}; starting from scratch")
        if state is None and cfg.model.init_from:
            params = load_init_params(cfg.model, model_cfg, abstract["params"], to_global)
            state = train_state_from_params(params, optimizer, mesh, cfg.seed, t.fsdp,
                                            offloaded_keys(cfg.optim.offload))
            msgs.append(f"initialised from {cfg.model.init_from} (fresh optimizer, step 0)")
        if state is None:
            state = state_fn()

        stop_here()
        if _is_main():
            _write_run_files(cfg, model_cfg, ckpt)
            if resume:
                dropped = truncate_metrics(os.path.join(cfg.run_dir, "metrics.jsonl"), start)
                if dropped:
                    msgs.append(f"dropped {dropped} metrics record(s) after step {start} from metrics.jsonl")
        writer = MetricsWriter(cfg.run_dir, cfg.logging.tensorboard, purge_step=start + 1 if resume else None)
    except BaseException:
        if ckpt is not None:
            _close_quietly(ckpt)
        if lock is not None:
            lock.release()
        if _is_main():
            for top in created:
                remove_created(top)
        raise
    bar = Progress(cfg.steps, start, cfg.logging.progress)
    for m in msgs:
        bar.write(m)
    bar.write(
        f"model {model_cfg.name or model_cls.__name__}: {num_params(state['params']):,} parameters; "
        f"mesh {dict(mesh.shape)}{' (FSDP)' if t.fsdp else ''}; layout {layout.name} S={layout.seq_len}; "
        f"backends {sorted(set(model_cfg.layer_backends))}; setup {time.time() - t_setup:.1f}s"
    )
    stop = cfg.steps if cfg.run_steps is None else min(cfg.steps, start + cfg.run_steps)
    docs = dict(segments=cfg.data.pack == "documents", rope_positions=cfg.data.positions == "per_document")
    return Run(cfg, mesh, model_cfg, layout, loader, train_step, eval_step, batch_shardings(mesh, True, **docs),
               batch_shardings(mesh, False, **docs), held, passkey, ckpt, writer, bar, state, start, stop, skipped,
               hooks=extra_hooks, lock=lock)


def _close_quietly(ckpt: Checkpointer) -> None:
    """Close ``ckpt`` after a failed setup (its background threads would otherwise print
    "Event loop is closed" tracebacks at exit)."""
    try:
        ckpt.close()
    except Exception:  # noqa: BLE001
        pass


def _write_run_files(cfg: TrainConfig, model_cfg, ckpt) -> None:
    """``config.yaml`` (reusable with ``--config``: the model inline, no resume flag or process
    ids) in ``run_dir``, and ``model.yaml`` next to the checkpoints (for the converter)."""
    import yaml

    d = cfg.to_dict()
    d["model"] = {"cls": cfg.model.cls, "init_from": cfg.model.init_from, **model_cfg.to_dict()}
    d["checkpoint"]["resume"] = False
    d["distributed"] = {"auto": cfg.distributed.auto, "timeout_s": cfg.distributed.timeout_s}
    with open(os.path.join(cfg.run_dir, "config.yaml"), "w") as f:
        yaml.safe_dump(d, f, sort_keys=False)
    if ckpt is not None:
        model_cfg.to_yaml(os.path.join(ckpt.directory, "model.yaml"))


def _any_signal(signum: int) -> int:
    """The largest stop signal over all processes (0: none; all processes must stop at the same step)."""
    if jax.process_count() == 1:
        return int(signum)
    from jax.experimental import multihost_utils

    return int(np.max(multihost_utils.process_allgather(np.asarray(signum, np.int32))))


def _stop_message(run: Run, signum: int, done: int | None) -> str:
    name = signal_name(signum, short=True)
    if done is None:  # before the first step: the state is the restored / initial one
        last = run.ckpt.latest_step() if run.ckpt is not None else None
        newest = (f"the newest checkpoint is step {last} in {run.ckpt.directory}" if last is not None
                  else "no checkpoint")
        return f"{name}: interrupted before step {run.start + 1}; nothing new to save; {newest}"
    saved = "no checkpoint (checkpoint.every=0)"
    if run.ckpt is not None:
        run.ckpt.wait()
        saved = f"checkpoint saved in {run.ckpt.directory}; continue with --resume"
    return f"{name}: interrupted after step {done}; {saved}"


def train(run: Run, hooks: Sequence[Hook] = ()) -> RunResult:
    """The step loop from ``run.start`` to ``run.stop`` (module docstring). SIGINT / SIGTERM are
    caught here unless :func:`run` already catches them (:class:`StopSignals`)."""
    if run.signals is None:
        with StopSignals(run.bar.write) as sig:
            if run.lock is not None:
                sig.on_abort.append(run.lock.release)
            run.signals = sig
            try:
                return train(run, hooks)
            finally:
                run.signals = None
    cfg, bar = run.cfg, run.bar
    hooks = [eval_hook, *run.hooks, *hooks]
    tokens_per_step = cfg.data.seq_len * cfg.data.batch_size * cfg.optim.grad_accum
    bad_in_a_row = 0
    for step in range(run.start, run.stop):
        if step == run.start:
            stopping = _any_signal(run.stop_signal)  # a signal during the setup: no step at all
            if stopping:
                raise Interrupted(_stop_message(run, stopping, None), stopping)
            bar.write("compiling the training step (the first step includes compilation)...")
            cached = compile_cache.hits()
        t0 = time.time()
        host = next(run.loader)
        batch = jax.tree.map(to_global, host, run.batch_sharding) if run.batch_sharding is not None else host
        done = step + 1
        log = done % cfg.logging.every == 0 or done == run.stop
        run.state, metrics = run.train_step(run.state, batch, log)
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        dt = time.time() - t0
        if step == run.start:
            cached = compile_cache.hits() - cached
            bar.write(f"first step done in {dt:.1f}s"
                      + (f" ({cached} program(s) loaded from the compilation cache)" if cached else ""))
        if not (math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])):
            bad_in_a_row += 1
            run.skipped_updates += 1
            _bad_step(run, done, metrics, bad_in_a_row)
            continue
        bad_in_a_row = 0
        metrics.update(step_time=dt, tokens_per_s=tokens_per_step / dt, skipped_updates=run.skipped_updates)
        run.train_losses.append((done, metrics["loss"]))
        if log:
            peak = device_peak_gib()
            if peak is not None:
                metrics["peak_gib"] = peak
            run.writer.write(done, metrics)
        bar.update(metrics["loss"], metrics["tokens_per_s"], dt, metrics)
        for hook in hooks:
            hook(run, done, metrics)
        stopping = _any_signal(run.stop_signal)
        if run.ckpt is not None and (done % cfg.checkpoint.every == 0 or done == run.stop or stopping):
            run.save(done, metrics["loss"])
        if stopping:
            raise Interrupted(_stop_message(run, stopping, done), stopping)
    return _result(run)


def _bad_step(run: Run, done: int, metrics: dict, in_a_row: int) -> None:
    """Record and warn about a skipped update; raise when ``optim.max_bad_steps`` is reached."""
    limit = run.cfg.optim.max_bad_steps
    loss, gn = metrics["loss"], metrics["grad_norm"]
    what = f"loss {loss}" if not math.isfinite(loss) else f"gradient (grad_norm {gn}) with finite loss {loss:.4f}"
    run.writer.write(done, {**metrics, "skipped_updates": run.skipped_updates})
    run.bar.warn(f"warning: non-finite {what} at step {done}: update skipped "
                  f"({in_a_row} in a row, optim.max_bad_steps={limit})")
    if in_a_row < limit:
        return
    last = None
    if run.ckpt is not None:
        run.ckpt.wait()
        last = run.ckpt.latest_step()
    where = (f"the last good checkpoint is step {last} in {run.ckpt.directory}" if last is not None
             else "no checkpoint was saved")
    if not math.isfinite(loss):
        head = f"non-finite loss {loss} at step {done} (grad_norm {gn})"
    else:
        head = f"non-finite gradient (grad_norm {gn}) at step {done} with finite loss {loss:.4f}"
    raise NonFiniteLossError(f"{head}; {in_a_row} bad step(s) in a row = optim.max_bad_steps; "
                             f"stopping without saving; {where}")


def _result(run: Run) -> RunResult:
    steps = []
    if run.ckpt is not None:
        run.ckpt.wait()
        steps = run.ckpt.all_steps()
    final = run.train_losses[-1][0] if run.train_losses else run.start
    return RunResult(final, run.train_losses, run.eval_metrics, steps, run.state["params"], run.cfg.run_dir,
                     run.skipped_updates)


def run(cfg: TrainConfig, hooks: Sequence[Hook] = (), *, overwrite: bool = False,
        hook_factories: Mapping[str, HookFactory] = MappingProxyType({}),
        signals: StopSignals | None = None) -> RunResult:
    """Train according to ``cfg`` (see module docstring); ``overwrite``: delete an earlier run's
    artefacts in ``run_dir`` first (``--overwrite``); ``hook_factories``: see :func:`config_hooks`;
    ``signals``: an active :class:`StopSignals` (``mtraining-train`` installs one before it imports
    JAX), else the run installs its own."""
    ctx = contextlib.nullcontext(signals) if signals is not None else StopSignals()
    with ctx as sig:  # from the start: a SIGTERM during the setup stops before the first step
        r = setup(cfg, overwrite=overwrite, hook_factories=hook_factories, signals=sig)
        r.signals = sig
        lock, r.lock = r.lock, None  # held until the plot is written too
        if lock is not None:
            sig.on_abort.append(lock.release)
        try:
            try:
                result = train(r, hooks)
            finally:
                r.close()
                if r.ckpt is not None:
                    r.ckpt.close()
            if cfg.logging.plot and _is_main() and os.path.exists(r.writer.path):
                plot_losses(r.writer.path, os.path.join(cfg.run_dir, "loss.png"))
        finally:
            if lock is not None:
                lock.release()
    return result
