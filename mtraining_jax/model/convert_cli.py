"""``mtraining-convert``: Hugging Face Qwen2 checkpoint <-> our (Orbax) model checkpoint.

Usage::

  mtraining-convert hf-to-ours  HF_DIR  OUT_DIR [--param-dtype float32|bfloat16] [--force]
  mtraining-convert ours-to-hf  CKPT    OUT_DIR [--dtype bfloat16|float32] [--max-shard-size 5GB] [--force]

``hf-to-ours`` reads ``config.json`` + ``model.safetensors`` (or the sharded index) and writes
``OUT_DIR/model.yaml`` + ``OUT_DIR/params/`` (see :mod:`mtraining_jax.model.checkpoint`).
``ours-to-hf`` reads ``CKPT`` = ``hf-to-ours`` output, a training ``run_dir`` (its newest
checkpoint), ``run_dir/checkpoints`` or ``run_dir/checkpoints/<step>``, and writes ``config.json`` +
safetensors (sharded above ``--max-shard-size``) that ``transformers.Qwen2ForCausalLM.from_pretrained``
loads.

Both write into a temporary folder next to ``OUT_DIR`` and rename it at the end: on any failure
``OUT_DIR`` is untouched. A non-empty ``OUT_DIR`` needs ``--force``. Exit status 2 on bad
arguments or a bad checkpoint, with a one-line error naming the file on stderr.
"""

from __future__ import annotations

import argparse
import re
import sys

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5e9 bytes (decimal units like transformers; ``KiB/MiB/GiB`` binary)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; expected e.g. 500MB, 5GB, 2GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mtraining-convert", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("hf-to-ours", help="HF checkpoint dir -> our Orbax model checkpoint")
    a.add_argument("src")
    a.add_argument("dst")
    a.add_argument("--param-dtype", default="float32", choices=["float32", "bfloat16"])
    a.add_argument("--force", action="store_true", help="overwrite an existing checkpoint at dst")
    b = sub.add_parser("ours-to-hf", help="our Orbax model checkpoint -> HF checkpoint dir")
    b.add_argument("src")
    b.add_argument("dst")
    b.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    b.add_argument("--max-shard-size", type=parse_size, default="5GB")
    b.add_argument("--force", action="store_true", help="overwrite an existing directory at dst")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from mtraining_jax.model.checkpoint import find_model_checkpoint, load_model_checkpoint, save_model_checkpoint, staged_dir
    from mtraining_jax.model.hf_io import load_hf_checkpoint, save_hf_checkpoint

    try:
        staged_dir(args.dst, args.force)  # refuse a bad destination before reading anything
        if args.command == "hf-to-ours":
            cfg, model = load_hf_checkpoint(args.src, param_dtype=args.param_dtype)
            out = save_model_checkpoint(model, args.dst, force=args.force)
            print(f"wrote {out} ({cfg.num_params():,} parameters, {cfg.param_dtype})")
        else:
            ref = find_model_checkpoint(args.src)
            cfg, model = load_model_checkpoint(args.src)
            with staged_dir(args.dst, args.force) as tmp:
                files = save_hf_checkpoint(model, tmp, dtype=args.dtype, max_shard_bytes=args.max_shard_size)
            step = f" (training step {ref.step})" if ref.step is not None else ""
            print(f"wrote {args.dst}{step}: {len(files)} safetensors file(s), {args.dtype}")
    except (OSError, ValueError) as e:
        print(f"mtraining-convert: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
