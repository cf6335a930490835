"""The trainer's command line, ``mtraining-train --config configs/<name>.yaml [key=value ...]``
(the console script is :mod:`mtraining_jax.apps.train`, which adds the evaluation package's hooks).

Examples::

    mtraining-train --config configs/tiny_cpu.yaml
    mtraining-train --config configs/tiny_cpu.yaml steps=20 data.seq_len=2048 optim.lr=1e-3
    mtraining-train --config configs/tiny_cpu.yaml --resume          # or: steps=40 --resume eval.every=0
    mtraining-train --config runs/tiny_cpu/config.yaml run_dir=runs/tiny_cpu_2   # a run's saved config, a new run
    mtraining-train --config configs/qwen2.5-3b-512k.yaml --plan      # per-device memory; does it fit?
    mtraining-train --config configs/qwen2.5-0.5b-128k.yaml --plan --device h100   # for a named GPU's memory
    # a plain multi-process launch (one process per host):
    mtraining-train --config configs/qwen2.5-3b-512k.yaml --coordinator-address host0:1234 \\
        --num-processes 4 --process-id $RANK

Overrides and flags mix in any order. A new run refuses a ``run_dir`` that holds another run:
``--resume`` continues it, ``--overwrite`` deletes its artefacts first (refused when the ``--config``
file is that run's own saved ``config.yaml``: pass ``run_dir=<new>`` to start a new run from it).
One invocation per ``run_dir`` at a time (``run_dir/.lock``).

See :data:`EXIT_CODES` (also in ``--help``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing


EXIT_CODES = """exit status:
  0    done (--plan: it fits, or the device memory is unknown)
  1    non-finite loss or gradient in optim.max_bad_steps steps in a row (the last good checkpoint is kept)
  2    bad config, path or input; run_dir holds another run or is in use by another launch (run_dir/.lock);
       --resume found no checkpoint that restores; --plan: it does not fit (one line on stderr each)
  130  interrupted by SIGINT (Ctrl-C): the current step finished and a checkpoint saved (a second
       Ctrl-C aborts at once, also during compilation, keeping the newest saved checkpoint)
  143  interrupted by SIGTERM (Slurm, Kubernetes): as for SIGINT"""


def _keys_help() -> str:
    from mtraining_jax.train.config import SECTIONS, TrainConfig

    lines = ["config keys (override any with key=value; values are YAML):"]
    top = [f.name for f in dataclasses.fields(TrainConfig)
           if f.name not in SECTIONS and f.name not in ("model", "config_dir")]
    lines.append("  " + ", ".join(top))
    lines.append("  model.path, model.cls, model.init_from (hf:<dir> | ckpt:<dir>), model.<any ModelConfig field> "
                 "(e.g. model.attention_backend=mtraining)")
    for name, cls in SECTIONS.items():
        fields = ", ".join(f.name for f in dataclasses.fields(cls))
        lines.append(f"  {name}.{{{fields}}}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mtraining-train",
        description="Train a Qwen-style LLM on long sequences with (sparse) ring attention.",
        epilog=_keys_help() + "\n\n" + EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", required=True, help="training YAML (e.g. configs/tiny_cpu.yaml)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. optim.lr=3e-4")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint (checkpoint.resume=true)")
    p.add_argument("--overwrite", action="store_true",
                   help="delete the artefacts of an earlier run in run_dir (metrics, checkpoints, plots) first")
    p.add_argument("--coordinator-address", help="host:port of process 0 (multi-process launch)")
    p.add_argument("--num-processes", type=int, help="number of processes (multi-process launch)")
    p.add_argument("--process-id", type=int, help="this process's id in [0, num-processes)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--plan", action="store_true",
                   help="compile the training step, print its per-device memory plan (parameters, gradients, "
                        "optimizer state, activations) and whether it fits the device, and exit (status 2 if not)")
    p.add_argument("--device-memory", metavar="SIZE",
                   help="--plan for a device with this much memory (instead of what this host's device reports): "
                        "80GiB, 141G, ...")
    p.add_argument("--device", metavar="NAME",
                   help="--plan for this GPU's memory: " + ", ".join(
                       f"{k} ({v})" for k, v in sorted(_device_choices().items())))
    return p


def _device_choices() -> dict:
    from mtraining_jax.train.plan import DEVICE_MEMORY

    return {k: d.describe() for k, d in DEVICE_MEMORY.items()}


def setup_platform(cpu_devices: int | None, num_processes: int | None = None) -> None:
    """Ask for ``cpu_devices`` virtual CPU devices in total, ``cpu_devices / num_processes`` in this
    process; effective only before JAX's backends start."""
    if cpu_devices is None:
        return
    nproc = num_processes or int(os.environ.get("JAX_NUM_PROCESSES", "1") or 1)
    if cpu_devices % nproc:
        raise ValueError(f"mesh.cpu_devices={cpu_devices} (the total over all processes) is not divisible by "
                         f"the {nproc} processes")
    per_process = cpu_devices // nproc
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={per_process}".strip()
    import jax

    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", int(per_process))
    except (AttributeError, ValueError, RuntimeError):  # older JAX / backends already up
        pass


def _fail(msg: str, code: int = 2) -> int:
    print(f"mtraining-train: {'error' if code == 2 else 'stopped'}: {msg}", file=sys.stderr)
    return code


def _plan(cfg, device_memory: int | None, device: str | None) -> int:
    """``--plan``: print the memory plan; status 2 with what to change when it does not fit."""
    from mtraining_jax.train.plan import check_fits, memory_plan

    plan = memory_plan(cfg, device_memory, device=device)
    print(plan.table())
    check_fits(plan, cfg)  # DoesNotFit is a ValueError: exit 2 with the message
    return 0


def main(argv: typing.Sequence[str] | None = None, hook_factories: typing.Mapping | None = None) -> int:
    """The command line; ``hook_factories``: the config hooks the layers above provide
    (:func:`mtraining_jax.train.loop.config_hooks`; ``mtraining-train`` passes the evaluation's).
    Returns the exit status (:data:`EXIT_CODES`). SIGINT / SIGTERM are caught from here on
    (:class:`~mtraining_jax.train.signals.StopSignals`, before JAX is imported)."""
    from mtraining_jax.train.signals import StopSignals

    with StopSignals() as signals:
        return _main(argv, hook_factories, signals)


def _stopped_early(signals) -> int:
    from mtraining_jax.train.signals import signal_name

    return _fail(f"{signal_name(signals.received, short=True)}: interrupted before training started; nothing saved",
                 signals.exit_code)


def _main(argv, hook_factories, signals) -> int:
    args = build_parser().parse_intermixed_args(argv)  # overrides before and after flags
    from mtraining_jax.train.config import load_config

    overrides = list(args.overrides)
    if args.resume:
        overrides.append("checkpoint.resume=true")
    if args.resume and args.overwrite:
        return _fail("--resume and --overwrite exclude each other: continue the run or start it again")
    for flag, key in (("coordinator_address", "coordinator_address"), ("num_processes", "num_processes"),
                      ("process_id", "process_id")):
        v = getattr(args, flag)
        if v is not None:
            overrides.append(f"distributed.{key}={v}")
    try:
        cfg = load_config(args.config, overrides)
    except ValueError as e:
        return _fail(str(e))
    device_memory = None
    if (args.device_memory is not None or args.device is not None) and not args.plan:
        return _fail("--device-memory and --device go with --plan")
    if args.device is not None and args.device.lower() not in _device_choices():
        return _fail(f"--device must be one of {', '.join(sorted(_device_choices()))} (or pass --device-memory SIZE), "
                     f"got {args.device!r}")
    if args.device is not None:
        args.device = args.device.lower()
    if args.device_memory is not None and args.device is not None:
        return _fail("--device-memory and --device exclude each other: name the GPU or its memory")
    if args.device_memory is not None:
        from mtraining_jax.train.plan import parse_bytes

        try:
            device_memory = parse_bytes(args.device_memory)
        except ValueError as e:
            return _fail(str(e))
    if args.overwrite:
        from mtraining_jax.train.rundir import deleted_by_overwrite

        if deleted_by_overwrite(cfg.run_dir, args.config):
            return _fail(f"--overwrite would delete {args.config}, the config being read (the saved config of the "
                         f"run in {cfg.run_dir}); to start a new run from it add run_dir=<another folder> "
                         f"(its checkpoints stay), or pass --resume to continue that run")
    if args.print_config:
        import yaml

        from mtraining_jax.train.state import build_model_config

        try:  # the model section is checked against the model's config class, as a run would
            build_model_config(cfg.model, cfg.config_dir)
        except ValueError as e:
            return _fail(str(e))
        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        return 0

    from mtraining_jax.train.distributed import maybe_initialize
    from mtraining_jax.train.loop import Interrupted, NonFiniteLossError, run

    try:
        if signals.received:
            return _stopped_early(signals)
        from mtraining_jax.train import determinism

        determinism.request(cfg.deterministic)
        setup_platform(cfg.mesh.cpu_devices, cfg.distributed.num_processes)
        maybe_initialize(cfg.distributed)
        if args.plan:
            rc = _plan(cfg, device_memory, args.device)
            return _stopped_early(signals) if signals.received else rc
        result = run(cfg, overwrite=args.overwrite, hook_factories=hook_factories or {}, signals=signals)
    except NonFiniteLossError as e:
        return _fail(str(e), 1)
    except Interrupted as e:
        return _fail(str(e), e.exit_code)
    except (ValueError, OSError) as e:
        return _fail(str(e))
    last = result.train_losses[-1][1] if result.train_losses else float("nan")
    skipped = f", {result.skipped_updates} update(s) skipped" if result.skipped_updates else ""
    print(f"done: step {result.final_step}, last loss {last:.4f}{skipped}, run dir {result.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
