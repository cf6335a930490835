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

Both write into a temporary folder next to ``OUT_DIR`` (``.OUT_DIR.tmp-<host>-<pid>``) and rename
it at the end: on any failure, Ctrl-C or SIGTERM ``OUT_DIR`` is untouched and the temporary folder
removed (one left by a killed conversion, ``kill -9``, is removed by the next conversion to the
same ``OUT_DIR``). A non-empty ``OUT_DIR`` needs ``--force``.

MSA (``msa`` layers): ``ours-to-hf`` writes the index branch to ``msa_index.safetensors`` with the
model's MSA settings in its metadata; ``hf-to-ours`` reads both back (a file without the settings
is refused; :mod:`mtraining_jax.model.hf_io`).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys

EXIT_CODES = """exit status:
  0    done
  2    bad arguments or a bad / damaged checkpoint (one line on stderr naming the file)
  130  interrupted by Ctrl-C (SIGINT): nothing written to OUT_DIR
  143  terminated (SIGTERM): nothing written to OUT_DIR"""

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5e9 bytes (decimal units like transformers; ``KiB/MiB/GiB`` binary)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; expected e.g. 500MB, 5GB, 2GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mtraining-convert", description=__doc__.split("\n\n")[0], epilog=EXIT_CODES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
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


_DONE = False  # set once OUT_DIR is complete


def _stop(signum, frame, dst: str = "") -> None:
    """SIGINT / SIGTERM: remove the temporary folder and end the process at once (130 / 143).
    Nothing is raised: an exception raised in a signal handler can land in a garbage-collection
    callback, where Python prints and ignores it."""
    from mtraining_jax.model.checkpoint import remove_staged

    if _DONE:  # OUT_DIR is complete: the signal came on the way out
        sys.stdout.flush()
        os._exit(0)
    what = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
    remove_staged()
    print(f"mtraining-convert: interrupted ({what}): nothing written to {dst}", file=sys.stderr, flush=True)
    os._exit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    global _DONE
    _DONE = False
    import functools
    import threading

    old = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            old[sig] = signal.signal(sig, functools.partial(_stop, dst=args.dst))
    try:
        return _convert(args)
    except KeyboardInterrupt:  # raised by the code itself (the handler exits directly)
        print(f"mtraining-convert: interrupted (Ctrl-C): nothing written to {args.dst}", file=sys.stderr)
        return 130
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def _done() -> None:
    global _DONE
    _DONE = True


def _convert(args) -> int:
    from mtraining_jax.model.checkpoint import (find_model_checkpoint, load_model_checkpoint, save_model_checkpoint,
                                                staged_dir)
    from mtraining_jax.model.hf_io import load_hf_checkpoint, save_hf_checkpoint

    try:
        staged_dir(args.dst, args.force)  # refuse a bad destination before reading anything
        if args.command == "hf-to-ours":
            cfg, model = load_hf_checkpoint(args.src, param_dtype=args.param_dtype)
            out = save_model_checkpoint(model, args.dst, force=args.force)
            _done()
            msa = f"; MSA index branch of {cfg.layer_backends.count('msa')} msa layer(s)" if cfg.has_msa else ""
            print(f"wrote {out} ({cfg.num_params():,} parameters, {cfg.param_dtype}{msa})")
        else:
            ref = find_model_checkpoint(args.src)
            cfg, model = load_model_checkpoint(args.src)
            with staged_dir(args.dst, args.force) as tmp:
                files = save_hf_checkpoint(model, tmp, dtype=args.dtype, max_shard_bytes=args.max_shard_size)
            _done()
            step = f" (training step {ref.step})" if ref.step is not None else ""
            msa = " (msa_index.safetensors: the MSA index branch)" if cfg.has_msa else ""
            print(f"wrote {args.dst}{step}: {len(files)} safetensors file(s){msa}, {args.dtype}")
    except (OSError, ValueError) as e:
        print(f"mtraining-convert: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
