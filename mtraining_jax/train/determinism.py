"""``deterministic: true``: bit-reproducible training steps on GPUs.

The kernels add no floating-point atomics (the Mosaic backward is KV-stationary and sums GQA
heads in registers), so the run-to-run differences of a GPU step come from XLA's scatter-adds
(embedding gradient, the column pass's per-slot dK/dV) and autotuned reductions.
``--xla_gpu_deterministic_ops=true`` makes those deterministic. The flag is read when JAX's
backends start, so :func:`request` sets it in ``XLA_FLAGS`` first (``mtraining-train`` calls it
before anything starts JAX) and :func:`check` refuses a run whose backends started without it.
CPU steps are deterministic already.
"""

from __future__ import annotations

import os

FLAG = "--xla_gpu_deterministic_ops=true"


def _has_flag(flags: str) -> bool:
    return any(f.replace("'", "").replace('"', "") in (FLAG, "--xla_gpu_deterministic_ops")
               for f in flags.split())


def request(deterministic: bool) -> None:
    """Add :data:`FLAG` to ``XLA_FLAGS`` (effective only before JAX's backends start)."""
    if deterministic:
        flags = os.environ.get("XLA_FLAGS", "")
        if not _has_flag(flags):
            os.environ["XLA_FLAGS"] = f"{flags} {FLAG}".strip()


def check(deterministic: bool) -> None:
    """``ValueError`` when ``deterministic`` is asked on a GPU whose backend started without :data:`FLAG`."""
    if not deterministic:
        return
    import jax

    if jax.default_backend() == "cpu" or _has_flag(os.environ.get("XLA_FLAGS", "")):
        return
    raise ValueError(f"deterministic=true needs XLA_FLAGS={FLAG} before JAX starts its GPU backend: mtraining-train "
                     f"sets it; a library caller sets it in the environment before importing JAX")
