"""What a training step keeps from its forward for its backward: the saved residuals of a config's
training loss, traced (not compiled) on any host, grouped by shape, dtype and the op that made them.

The residuals are a property of the program (``jax.vjp``'s saved values under the model's remat
policy), the same on every backend, and at long context they are most of the step's peak: a GPU
config can be inspected on a CPU. Two patches make the trace the GPU's, for this process only: the
attention dispatch sees ``jax.default_backend() == "gpu"`` (so the ``cudnn`` backend traces
``jax.nn.dot_product_attention(implementation="cudnn")``, not the XLA fallback that saves the
``[S, S]`` probabilities), and JAX's cuDNN version check passes (it only gates tracing here: nothing
is compiled or run). XLA may still change what the compiled step holds (it does not rematerialise
on GPUs by default); ``mtraining-train --plan`` on the GPU is the compiled step's own number.

    python benchmarks/saved_residuals.py --config configs/qwen2.5-0.5b-128k.yaml
    python benchmarks/saved_residuals.py --config configs/qwen2.5-0.5b-128k.yaml --set model.attention_backend=cudnn \\
        --out results/memory/saved_residuals.jsonl

Prints the largest groups and the total; ``--out`` appends one row: ``config``, ``overrides``,
``total_bytes``, ``groups`` (the ``--top`` largest: ``shape``, ``dtype``, ``source``, ``count``,
``bytes``), and ``commit``, ``date``, ``device`` (``trace``), ``jax``, ``command``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script: the repo root


@contextlib.contextmanager
def traced_as_gpu():
    """Inside: this process traces the GPU program (module docstring); the patches are undone on exit."""
    import jax
    import jax._src.cudnn.fused_attention_stablehlo as fused

    import mtraining_jax.attention.dispatch as dispatch

    class _GpuJax:  # jax, with default_backend() == "gpu", for the dispatch module only
        def __getattr__(self, name):
            return getattr(jax, name)

        def default_backend(self):
            return "gpu"

    saved = (fused.check_cudnn_version, fused.check_compute_capability, dispatch.jax)
    fused.check_cudnn_version, fused.check_compute_capability = (lambda: 91000), (lambda *a: True)
    dispatch.jax = _GpuJax()
    try:
        yield
    finally:
        fused.check_cudnn_version, fused.check_compute_capability, dispatch.jax = saved


def source_of(src: str) -> str:
    """``saved_residuals``' description without the argument / line noise: ``"op (function)"``."""
    m = re.match(r"output of (?:jitted function )?'?([\w.]+)'? from (\S+?):\d+:\d+ \(([^)]*)\)", src)
    if not m:
        return src.strip()
    return f"{m.group(1)} ({os.path.basename(m.group(2))}: {m.group(3)})"


def group(residuals) -> list[dict]:
    """``[(aval, description)]`` -> groups by (shape, dtype, source), largest first; the function's own
    arguments (parameters, batch) are not residuals of the step and are left out."""
    import numpy as np

    acc = collections.defaultdict(lambda: [0, 0])
    for aval, src in residuals:
        if src.startswith("from the argument"):
            continue
        key = (tuple(int(d) for d in aval.shape), str(aval.dtype), source_of(src))
        nbytes = int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize
        acc[key][0] += 1
        acc[key][1] += nbytes
    return sorted(({"shape": list(k[0]), "dtype": k[1], "source": k[2], "count": c, "bytes": b}
                   for k, (c, b) in acc.items()), key=lambda g: -g["bytes"])


def step_residuals(config: str, overrides: list) -> list:
    """The saved residuals of ``config``'s training loss (one micro-batch, abstract parameters)."""
    from jax._src.ad_checkpoint import saved_residuals

    loss, params, batch = training_loss(config, overrides)
    return saved_residuals(loss, params, batch)


def training_loss(config: str, overrides: list):
    """``(loss(params, batch) -> scalar, params, batch)`` of ``config``'s training step, the
    arguments abstract (``jax.ShapeDtypeStruct``: one micro-batch): for tracing, not running."""
    import inspect

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from mtraining_jax.train.config import load_config
    from mtraining_jax.train.data import Batch
    from mtraining_jax.train.loop import build_mesh
    from mtraining_jax.train.state import build_model_config, split_model
    from mtraining_jax.train.step import make_loss_fn

    cfg = load_config(config, overrides)
    model_cls, model_cfg = build_model_config(cfg.model, os.path.dirname(os.path.abspath(config)))
    parts, _ = split_model(model_cls, model_cfg, cfg.seed)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.to_pure_dict(parts.param_template))
    B, S = cfg.data.batch_size, cfg.data.seq_len
    spec = {"tokens": ((B, S), jnp.int32), "labels": ((B, S), jnp.int32), "mask": ((B, S), jnp.float32),
            "positions": ((S,), jnp.int32)}
    batch = Batch(**{name: jax.ShapeDtypeStruct(*spec[name]) if name in spec else None
                     for name in inspect.signature(Batch).parameters})
    loss_fn = make_loss_fn(parts, build_mesh(cfg.mesh), cfg.loss_chunk_size)
    return (lambda p, b: loss_fn(p, b)[0]), params, batch


def gib(b: int) -> str:
    return f"{b / 2**30:.3f} GiB"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="training YAML")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeat)")
    p.add_argument("--top", type=int, default=12, help="groups printed and kept in the row (default 12)")
    p.add_argument("--out", help="append the row to this JSONL file")
    p.add_argument("--as-traced", action="store_true",
                   help="trace on this host's backend as it is (no GPU patches: the CPU program)")
    args = p.parse_args(argv)
    if args.top < 1:
        raise SystemExit(f"saved_residuals: --top must be >= 1 (got {args.top})")
    with contextlib.nullcontext() if args.as_traced else traced_as_gpu():
        groups = group(step_residuals(args.config, args.set))
    total = sum(g["bytes"] for g in groups)
    for g in groups[:args.top]:
        print(f"{gib(g['bytes']):>12} x{g['count']:<3} {tuple(g['shape'])} {g['dtype']}  {g['source']}")
    print(f"total {gib(total)} in {sum(g['count'] for g in groups)} arrays ({args.config} {' '.join(args.set)})")
    if args.out:
        from benchmarks._driver import provenance

        import jax

        row = {"config": os.path.relpath(os.path.abspath(args.config), ROOT), "overrides": args.set,
               "traced_as": "cpu" if args.as_traced else "gpu", "total_bytes": total, "groups": groups[:args.top],
               **provenance(argv), "device": "trace", "jax": jax.__version__}
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
