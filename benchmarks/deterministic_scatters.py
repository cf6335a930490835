"""The scatters of a config's training gradient that XLA serialises under deterministic GPU ops.

``deterministic: true`` (``--xla_gpu_deterministic_ops``) makes XLA's GPU compiler rewrite every
scatter it cannot prove deterministic into a loop over its indices (``ScatterExpander``,
``kEliminateIndeterministicScatters``; a sort-based rewrite first where it applies): a scatter is
deterministic when its indices are declared unique (``unique_indices=True``), or it combines with
min / max, or with add / mul / or / xor on integers. A float scatter-add or an overwriting scatter
(``.at[].set``) without unique indices is serialised: at long context that is most of what the flag
costs (2.4x on the study's MTraining step, ``results/quality/determinism_cost.jsonl``).

This script traces (does not compile) a config's gradient as the GPU program
(:func:`benchmarks.saved_residuals.traced_as_gpu`) and lists those scatters, grouped by primitive,
shape, dtype and source. The library declares its scatters' unique indices; the one left in a
training step is the embedding's gradient (its token ids repeat), which the dense trainer has too.

    python benchmarks/deterministic_scatters.py --config configs/quality/mtraining.yaml --set data.seq_len=4096
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script: the repo root

from benchmarks.saved_residuals import traced_as_gpu, training_loss  # noqa: E402

# combiners XLA counts as associative (IsScatterCombinerAssociative): any dtype / integers only
_ANY_DTYPE = {"scatter-min", "scatter_min", "scatter-max", "scatter_max"}
_INTEGER_ONLY = {"scatter-add", "scatter_add", "scatter-mul", "scatter_mul"}


def serialised(eqn) -> bool:
    """Whether XLA's deterministic GPU mode serialises this scatter equation."""
    import jax.numpy as jnp

    name = eqn.primitive.name
    if not name.startswith("scatter") or eqn.params.get("unique_indices"):
        return False
    if name in _ANY_DTYPE:
        return False
    dtype = eqn.outvars[0].aval.dtype
    if name in _INTEGER_ONLY and jnp.issubdtype(dtype, jnp.integer):
        return False
    return True


def _source(eqn) -> str:
    tb = eqn.source_info.traceback
    frames = [f for f in (tb.frames if tb else []) if "site-packages" not in f.file_name]
    return " <- ".join(f"{os.path.relpath(f.file_name, ROOT)}:{f.line_num}" for f in frames[:3]) or "?"


def _subjaxprs(params):
    for p in params.values():
        for sub in p if isinstance(p, (list, tuple)) else (p,):
            if hasattr(sub, "eqns"):
                yield sub
            elif hasattr(getattr(sub, "jaxpr", None), "eqns"):
                yield sub.jaxpr


def serialised_scatters(jaxpr) -> list[dict]:
    """The serialised scatters of a (closed) jaxpr and its sub-jaxprs, grouped: ``primitive``,
    ``shape``, ``dtype``, ``source``, ``count``; most frequent first."""
    found = collections.Counter()

    def walk(jx):
        for eqn in jx.eqns:
            if serialised(eqn):
                aval = eqn.outvars[0].aval
                found[(eqn.primitive.name, tuple(aval.shape), str(aval.dtype), _source(eqn))] += 1
            for sub in _subjaxprs(eqn.params):
                walk(sub)

    walk(getattr(jaxpr, "jaxpr", jaxpr))
    return [{"primitive": p, "shape": list(s), "dtype": d, "source": src, "count": n}
            for (p, s, d, src), n in found.most_common()]


def step_scatters(config: str, overrides: list, as_gpu: bool = True) -> list[dict]:
    """:func:`serialised_scatters` of ``config``'s training gradient (traced as the GPU program)."""
    import jax

    with traced_as_gpu() if as_gpu else contextlib.nullcontext():
        loss, params, batch = training_loss(config, overrides)
        return serialised_scatters(jax.make_jaxpr(jax.grad(loss))(params, batch))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="training YAML")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeat)")
    p.add_argument("--as-traced", action="store_true",
                   help="trace on this host's backend as it is (no GPU patches: the CPU program)")
    args = p.parse_args(argv)
    groups = step_scatters(args.config, args.set, as_gpu=not args.as_traced)
    for g in groups:
        print(f"x{g['count']:<3} {g['primitive']} {tuple(g['shape'])} {g['dtype']}  {g['source']}")
    print(f"{sum(g['count'] for g in groups)} serialised scatter(s) in the training gradient "
          f"({args.config} {' '.join(args.set)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
