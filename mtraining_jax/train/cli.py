"""The trainer's command line, ``mtraining-train --config configs/<name>.yaml [key=value ...]``
(the console script is :mod:`mtraining_jax.apps.train`, which adds the evaluation package's hooks).

Examples::

    mtraining-train --config configs/tiny_cpu.yaml
    mtraining-train --config configs/tiny_cpu.yaml steps=20 data.seq_len=2048 optim.lr=1e-3
    mtraining-train --config configs/tiny_cpu.yaml --resume          # or: steps=40 --resume eval.every=0
    mtraining-train --config runs/tiny_cpu/config.yaml --overwrite   # a run's saved config, started again
    mtraining-train --config configs/qwen2.5-3b-512k.yaml --plan      # per-device memory; does it fit?
    # a plain multi-process launch (one process per host):
    mtraining-train --config configs/qwen2.5-3b-512k.yaml --coordinator-address host0:1234 \\
        --num-processes 4 --process-id $RANK

Overrides and flags mix in any order. A new run refuses a ``run_dir`` that holds another run:
``--resume`` continues it, ``--overwrite`` deletes its artefacts first.

Exit status: 0 done (``--plan``: fits, or the device memory is unknown), 1 non-finite loss or
gradient (``optim.max_bad_steps`` steps in a row; the last good checkpoint is kept), 2 bad
config/input (``--plan``: does not fit), 130 interrupted (Ctrl-C; a checkpoint is saved).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing


def _keys_help() -> str:
    from mtraining_jax.train.config import SECTIONS, TrainConfig

    lines = ["config keys (override any with key=value; values are YAML):"]
    top = [f.name for f in dataclasses.fields(TrainConfig) if f.name not in SECTIONS and f.name not in ("model", "config_dir")]
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
        epilog=_keys_help(),
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
                   help="device memory for --plan where the backend reports none (e.g. CPU): 80GiB, 141G, ...")
    return p


def _setup_platform(cpu_devices: int | None, num_processes: int | None = None) -> None:
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


def _plan(cfg, device_memory: int | None) -> int:
    """``--plan``: print the memory plan; status 2 with what to change when it does not fit."""
    from mtraining_jax.train.plan import check_fits, memory_plan

    plan = memory_plan(cfg, device_memory)
    print(plan.table())
    check_fits(plan, cfg)  # DoesNotFit is a ValueError: exit 2 with the message
    return 0


def main(argv: typing.Sequence[str] | None = None, hook_factories: typing.Mapping | None = None) -> int:
    """The command line; ``hook_factories``: the config hooks the layers above provide
    (:func:`mtraining_jax.train.loop.config_hooks`; ``mtraining-train`` passes the evaluation's)."""
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
    if args.device_memory is not None:
        from mtraining_jax.train.plan import parse_bytes

        try:
            device_memory = parse_bytes(args.device_memory)
        except ValueError as e:
            return _fail(str(e))
    if args.print_config:
        import yaml

        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        return 0

    from mtraining_jax.train.distributed import maybe_initialize
    from mtraining_jax.train.loop import Interrupted, NonFiniteLossError, run

    try:
        _setup_platform(cfg.mesh.cpu_devices, cfg.distributed.num_processes)
        maybe_initialize(cfg.distributed)
        if args.plan:
            return _plan(cfg, device_memory)
        result = run(cfg, overwrite=args.overwrite, hook_factories=hook_factories or {})
    except NonFiniteLossError as e:
        return _fail(str(e), 1)
    except Interrupted as e:
        return _fail(str(e), 130)
    except (ValueError, OSError) as e:
        return _fail(str(e))
    last = result.train_losses[-1][1] if result.train_losses else float("nan")
    skipped = f", {result.skipped_updates} update(s) skipped" if result.skipped_updates else ""
    print(f"done: step {result.final_step}, last loss {last:.4f}{skipped}, run dir {result.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
