"""A run-time check of ``unique_indices=True`` scatters, for CPU tests.

On a GPU, a scatter declared unique (``.at[...].add/.set(..., unique_indices=True)``, or the
transpose of a unique gather) whose in-bounds indices repeat is a silent wrong answer (racing
writes, no atomics); the CPU executes scatters in order, so such a bug passes every CPU test.
Inside :func:`checked_unique_scatters` it cannot:

* ``bind`` of every scatter primitive (``jax.lax.scatter_p``, ``scatter_add_p``, ``scatter_sub_p``,
  ``scatter_mul_p``, ``scatter_min_p``, ``scatter_max_p``) is wrapped (an instance attribute,
  removed on exit); a bind with ``unique_indices=True`` gets a ``jax.debug.callback`` that, when the
  program RUNS, checks that the windows its index tuples address are pairwise disjoint. A tuple
  holds every operand dim the indices address: ``scatter_dims_to_operand_dims`` plus the vmap batch
  dims (``operand_batching_dims``, addressed by the position along ``scatter_indices_batching_dims``),
  so uniqueness is per batch element. ``mode``: ``FILL_OR_DROP`` drops out-of-bounds windows (left
  out), ``CLIP`` clamps first, ``PROMISE_IN_BOUNDS`` checks all.
* A bind whose operands are batched (``vmap``) or carry tangents (``jvp`` / ``grad``) of the trace
  processing it is not checked: the transformation's rule binds the primitive again on the
  underlying values, and that bind is. Every other bind (``jit`` / jaxpr tracers, concrete arrays,
  transposes, ``scan`` / ``checkpoint`` / ``custom_vjp`` / ``shard_map`` bodies) is.
* ``jax.clear_caches()`` on entry and exit: no program traced without the checks runs inside, none
  traced with them runs after.

The manager yields a :class:`UniqueScatterReport`: ``checked`` (one entry per executed check:
primitive, operand shape, sites, where), ``violations`` (:class:`Violation`: primitive, operand shape, a
few colliding coordinates, the site) and ``errors`` (checks that could not run). The site is the
innermost frames in ``mtraining_jax/`` or ``pallas_kernels/`` of where the scatter was traced (of the
forward op for a transpose), else of the caller. Private JAX APIs (the current trace, the source
context) are guarded: without them every unique scatter is checked and the Python stack names it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import threading
import traceback

import jax
import numpy as np

PRIMITIVES = ("scatter_p", "scatter_add_p", "scatter_sub_p", "scatter_mul_p", "scatter_min_p", "scatter_max_p")
_LIBRARY = tuple(os.sep + d + os.sep for d in ("mtraining_jax", "pallas_kernels"))
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_REPLAY = {"eval_jaxpr", "backward_pass", "jaxpr_as_fun"}  # JAX re-binding recorded equations
try:
    _TRACER = jax.core.Tracer
except AttributeError:  # left jax.core's public names
    from jax._src.core import Tracer as _TRACER
_EAGER = threading.local()  # set while an eagerly checked scatter runs (its impl binds it again, traced)


@dataclasses.dataclass
class Violation:
    primitive: str
    operand_shape: tuple
    duplicates: list  # colliding window starts, ":" for dims the indices do not address
    where: str

    def __str__(self):
        return f"{self.primitive} {self.operand_shape} repeats {self.duplicates} at {self.where}"


@dataclasses.dataclass
class UniqueScatterReport:
    checked: list = dataclasses.field(default_factory=list)  # dicts: primitive, operand_shape, sites, where
    violations: list = dataclasses.field(default_factory=list)
    errors: list = dataclasses.field(default_factory=list)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def sites(self) -> collections.Counter:
        """``{"file.py:function": checks that ran}``, counting each check for the innermost three
        frames of its site (the scatter's function and two callers: a shared helper's callers too)."""
        return collections.Counter(s for c in self.checked for s in c["sites"])

    def _check(self, meta, indices):
        try:
            dup = colliding_starts(np.asarray(indices), meta["operand_shape"], meta["updates_shape"],
                                   meta["dnums"], meta["mode"])
        except Exception as e:  # a failed check must not pass silently, nor abort the program
            with self._lock:
                self.errors.append(f"{meta['primitive']} at {meta['where']}: {e!r}")
            return
        with self._lock:
            self.checked.append({k: meta[k] for k in ("primitive", "operand_shape", "sites", "where")})
            if dup:
                self.violations.append(Violation(meta["primitive"], meta["operand_shape"], dup, meta["where"]))


def colliding_starts(indices, operand_shape, updates_shape, dnums, mode, limit: int = 4) -> list:
    """Up to ``limit`` window starts two or more kept updates of a scatter share (overlapping windows
    along addressed dims), as full operand coordinates with ``":"`` for unaddressed dims; ``[]``
    when the in-bounds windows are disjoint."""
    mode = jax.lax.GatherScatterMode.from_any(mode)
    nvec = indices.shape[-1]
    batch_shape = indices.shape[:-1]
    if 0 in updates_shape or not np.prod(batch_shape, dtype=np.int64):
        return []
    ins, obd = tuple(dnums.inserted_window_dims), tuple(getattr(dnums, "operand_batching_dims", ()))
    sibd = tuple(getattr(dnums, "scatter_indices_batching_dims", ()))
    win_dims = [d for d in range(len(operand_shape)) if d not in ins and d not in obd]
    window = [1] * len(operand_shape)
    for d, u in zip(win_dims, dnums.update_window_dims):
        window[d] = updates_shape[u]
    flat = indices.reshape(-1, nvec).astype(np.int64)
    cols = {d: flat[:, i] for i, d in enumerate(dnums.scatter_dims_to_operand_dims)}
    grid = np.indices(batch_shape)
    cols.update({d: grid[a].reshape(-1).astype(np.int64) for d, a in zip(obd, sibd)})
    dims = sorted(cols)
    size = np.array([operand_shape[d] for d in dims], np.int64)
    w = np.array([window[d] for d in dims], np.int64)
    starts = np.stack([cols[d] for d in dims], axis=1) if dims else np.zeros((flat.shape[0], 0), np.int64)
    if mode == jax.lax.GatherScatterMode.CLIP:
        starts = np.clip(starts, 0, size - w)
    elif mode == jax.lax.GatherScatterMode.FILL_OR_DROP:
        starts = starts[np.all((starts >= 0) & (starts + w <= size), axis=1)]
    if len(starts) < 2:
        return []
    if not dims:  # every update writes the same window
        return [tuple(":" for _ in operand_shape)]
    if np.any(w > 1):  # windows wider than one element: every point they cover
        offsets = np.stack(np.meshgrid(*[np.arange(x) for x in w], indexing="ij"), -1).reshape(-1, len(dims))
        if len(starts) * len(offsets) > 20_000_000:
            raise ValueError(f"windows too large to check ({len(starts)} x {len(offsets)} points)")
        owner = np.repeat(np.arange(len(starts)), len(offsets))
        points = (starts[:, None, :] + offsets[None]).reshape(-1, len(dims))
    else:
        owner, points = np.arange(len(starts)), starts
    uniq, inv, counts = np.unique(points, axis=0, return_inverse=True, return_counts=True)
    rep = np.flatnonzero(counts > 1)
    hit = sorted({int(owner[np.flatnonzero(inv.reshape(-1) == r)[0]]) for r in rep[:limit]})
    out = []
    for i in hit[:limit]:
        coord = dict(zip(dims, starts[i].tolist()))
        out.append(tuple(coord.get(d, ":") for d in range(len(operand_shape))))
    return out


def _eager(args) -> bool:
    """Concrete arrays, or shard_map run eagerly: the primitive's implementation binds it again."""
    try:
        from jax._src import core

        if type(core.trace_ctx.trace).__name__ == "ShardMapTrace":
            return True
    except (ImportError, AttributeError):
        pass
    return not any(isinstance(x, _TRACER) for x in args)


def _transformed(args) -> bool:
    """Whether the trace processing this bind batches / differentiates it (and re-binds inside)."""
    if getattr(_EAGER, "on", False):
        return True  # the eager bind's own implementation: checked by that bind
    try:
        from jax._src import core
        from jax._src.interpreters import ad, batching

        cur = core.trace_ctx.trace
        tag = getattr(cur, "tag", None)
        mine = [x for x in args if isinstance(x, core.Tracer) and getattr(x._trace, "tag", None) is tag]
        if isinstance(cur, batching.BatchTrace):
            return any(isinstance(x, batching.BatchTracer) and x.batch_dim is not None for x in mine)
        if isinstance(cur, (ad.JVPTrace, ad.LinearizeTrace)):
            return any(type(getattr(x, "tangent", None)).__name__ != "Zero" for x in mine)
    except (ImportError, AttributeError):
        pass
    return False


def _frames():
    """``(file, line, function)`` innermost first: the library frames of the Python stack above the
    last point where JAX replays recorded equations, else those of JAX's source context (a
    transpose: the forward op), else the caller's frames outside JAX."""
    stack = [(f.filename, f.lineno, f.name) for f in reversed(traceback.extract_stack()[:-2])]
    own = []
    for fr in stack:
        if fr[2] in _REPLAY and f"{os.sep}jax{os.sep}" in fr[0]:
            break
        own.append(fr)
    lib = [fr for fr in own if any(d in fr[0] for d in _LIBRARY)]
    if lib:
        return lib
    try:
        from jax._src import source_info_util

        tb = source_info_util.current().traceback
        ctx = [(f.file_name, f.line_num, f.function_name) for f in (tb.frames if tb is not None else [])]
    except (ImportError, AttributeError):
        ctx = []
    lib = [fr for fr in ctx if any(d in fr[0] for d in _LIBRARY)]
    return lib or [fr for fr in (ctx or stack) if f"{os.sep}jax{os.sep}" not in fr[0] and fr[0] != __file__]


def _wrap(prim, bind, report):
    def checked_bind(*args, **params):
        if params.get("unique_indices") and len(args) >= 3 and not _transformed(args):
            frames = [(f, n, fn.rsplit(".", 1)[-1]) for f, n, fn in _frames()[:3]]  # bare names, any origin
            where = " <- ".join(f"{os.path.relpath(f, _ROOT)}:{n} ({fn})" for f, n, fn in frames) or "?"
            meta = {"primitive": prim.name, "operand_shape": tuple(np.shape(args[0])),
                    "updates_shape": tuple(np.shape(args[2])), "dnums": params["dimension_numbers"],
                    "mode": params.get("mode"), "where": where,
                    "sites": tuple(f"{os.path.basename(f)}:{fn}" for f, _, fn in frames)}
            jax.debug.callback(lambda i: report._check(meta, i), args[1])
            if _eager(args):
                _EAGER.on = True
                try:
                    return bind(*args, **params)
                finally:
                    _EAGER.on = False
        return bind(*args, **params)

    return checked_bind


@contextlib.contextmanager
def checked_unique_scatters():
    """Inside: every executed ``unique_indices=True`` scatter is checked (module docstring); yields
    the :class:`UniqueScatterReport`, complete once the block exits."""
    prims = [getattr(jax.lax, n) for n in PRIMITIVES if hasattr(jax.lax, n)]
    report = UniqueScatterReport()
    jax.clear_caches()
    try:
        for p in prims:
            p.bind = _wrap(p, type(p).bind.__get__(p), report)
            if "bind" not in vars(p):
                raise RuntimeError(f"cannot wrap {p.name}.bind with an instance attribute (JAX {jax.__version__})")
        yield report
    finally:
        try:
            jax.effects_barrier()  # callbacks still in flight land in the report
        finally:
            for p in prims:
                p.__dict__.pop("bind", None)
            jax.clear_caches()
