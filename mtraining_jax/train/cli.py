"""``mtraining-train --config configs/<name>.yaml [key=value ...]`` (also ``python -m mtraining_jax.train``).

Examples::

    mtraining-train --config configs/tiny_cpu.yaml
    mtraining-train --config configs/tiny_cpu.yaml steps=20 data.seq_len=2048 optim.lr=1e-3
    mtraining-train --config configs/tiny_cpu.yaml --resume
    # a plain multi-process launch (one process per host):
    mtraining-train --config configs/qwen2.5-3b-512k.yaml --coordinator-address host0:1234 \\
        --num-processes 4 --process-id $RANK

Exit status: 0 done, 1 non-finite loss (the last good checkpoint is kept), 2 bad config/input.
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
    lines.append("  model.path, model.cls, model.<any ModelConfig field> (e.g. model.attention_backend=mtraining)")
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
    p.add_argument("--coordinator-address", help="host:port of process 0 (multi-process launch)")
    p.add_argument("--num-processes", type=int, help="number of processes (multi-process launch)")
    p.add_argument("--process-id", type=int, help="this process's id in [0, num-processes)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    return p


def _setup_platform(cpu_devices: int | None) -> None:
    """Ask for ``cpu_devices`` virtual CPU devices; effective only before JAX's backends start."""
    if cpu_devices is None:
        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={cpu_devices}".strip()
    import jax

    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", int(cpu_devices))
    except (AttributeError, ValueError, RuntimeError):  # older JAX / backends already up
        pass


def main(argv: typing.Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from mtraining_jax.train.config import load_config

    overrides = list(args.overrides)
    if args.resume:
        overrides.append("checkpoint.resume=true")
    for flag, key in (("coordinator_address", "coordinator_address"), ("num_processes", "num_processes"),
                      ("process_id", "process_id")):
        v = getattr(args, flag)
        if v is not None:
            overrides.append(f"distributed.{key}={v}")
    try:
        cfg = load_config(args.config, overrides)
    except ValueError as e:
        print(f"mtraining-train: error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        import yaml

        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        return 0
    _setup_platform(cfg.mesh.cpu_devices)

    from mtraining_jax.train.distributed import maybe_initialize
    from mtraining_jax.train.loop import NonFiniteLossError, run

    try:
        maybe_initialize(cfg.distributed)
        result = run(cfg)
    except NonFiniteLossError as e:
        print(f"mtraining-train: stopped: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"mtraining-train: error: {e}", file=sys.stderr)
        return 2
    last = result.train_losses[-1][1] if result.train_losses else float("nan")
    print(f"done: step {result.final_step}, last loss {last:.4f}, run dir {result.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
