"""``mtraining-train`` (also ``python -m mtraining_jax.apps.train``): the trainer's command line
(:mod:`mtraining_jax.train.cli`) with every config hook the layers above the trainer provide.

:data:`HOOK_FACTORIES` maps a config section to the factory of its hooks
(:func:`mtraining_jax.train.loop.config_hooks`): ``eval.long_context`` -> the evaluation package's
:class:`~mtraining_jax.eval.hook.LongContextHook` (NIAH / RULER-style accuracy during training).
Library users pass it to :func:`run` here, or to ``train.loop.run(cfg, hook_factories=...)``.
"""

from __future__ import annotations

import sys
from types import MappingProxyType
from typing import Sequence

from mtraining_jax.train import cli


def long_context_hooks(cfg, model_cfg, mesh, tokenizer) -> list:
    """``eval.long_context`` -> ``[LongContextHook]`` (settings checked against model and mesh)."""
    if not cfg.eval.long_context.every:
        return []
    from mtraining_jax.eval.hook import LongContextHook  # imported late: the command starts (and
    # catches SIGTERM, mtraining_jax.train.cli.main) before JAX is imported

    return [LongContextHook(cfg, model_cfg, mesh, tokenizer)]


HOOK_FACTORIES = MappingProxyType({"eval.long_context": long_context_hooks})


def run(cfg, hooks: Sequence = (), *, overwrite: bool = False):
    """:func:`mtraining_jax.train.loop.run` with :data:`HOOK_FACTORIES` (returns its ``RunResult``)."""
    from mtraining_jax.train import loop

    return loop.run(cfg, hooks, overwrite=overwrite, hook_factories=HOOK_FACTORIES)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``mtraining-train`` console script (options: ``mtraining-train --help``)."""
    return cli.main(argv, hook_factories=HOOK_FACTORIES)


if __name__ == "__main__":
    sys.exit(main())
