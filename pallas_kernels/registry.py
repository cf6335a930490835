"""The kernel backends of block-sparse attention: the ONE place their names live and are chosen.

Backends (one module each, in order of preference on a GPU that has them):

* ``mosaic`` — :mod:`pallas_kernels.backend_mosaic`: Pallas Mosaic GPU (Hopper wgmma + TMA);
* ``triton`` — :mod:`pallas_kernels.backend_triton`: Pallas Triton kernels (any CUDA GPU;
  interpret mode elsewhere);
* ``xla`` — :mod:`pallas_kernels.backend_xla`: the plain ``jax.numpy`` twin (any platform).

Each backend module defines ``supports(problem)``, which raises :class:`NotImplementedError` naming
the reason when it cannot run a :class:`Problem`, and ``fwd`` / ``bwd`` with the signatures of
:func:`pallas_kernels.api.block_sparse_attention_fwd` / ``_bwd`` (index already built; packed
documents: keyword ``segs = (q_seg [B, Sq], k_seg [B, Sk])`` or ``None``; keyword ``stream``, one of
:data:`STREAMS`, which only the Mosaic backend uses).
``impl="auto"`` tries ``mosaic`` (compute capability 9.x), then ``triton`` (GPU), then ``xla``,
falling through on ``NotImplementedError``; a named backend is used or its reason raised.
``"pallas"`` is accepted as the earlier name of ``triton``.
"""

from __future__ import annotations

import dataclasses
import importlib

import jax

BACKENDS = ("mosaic", "triton", "xla")
ALIASES = {"pallas": "triton"}
IMPLS = ("auto",) + BACKENDS + tuple(ALIASES)
DIRECTIONS = ("fwd", "bwd")
#: what the Mosaic forward / dQ kernels' CTAs stream (:mod:`pallas_kernels.mosaic_stream`; the dK/dV
#: block pass takes the same names when called directly, :func:`pallas_kernels.mosaic_dkv.mosaic_dkv_blocks`):
#: ``"shared"``, the union of two query blocks' tiles; ``"split"``, each block its own;
#: ``"index"``, one of the two per call from the index (both kernels compiled, one runs);
#: ``"auto"``, per pass what was measured fastest (:func:`pallas_kernels.mosaic_stream.resolve_stream`).
#: The other backends have one schedule and ignore it; every choice gives the same result.
STREAMS = ("auto", "index", "shared", "split")


def validate_stream(stream) -> str:
    """``stream`` when it is one of :data:`STREAMS`; else ``ValueError`` naming it."""
    if not isinstance(stream, str) or stream not in STREAMS:
        raise ValueError(f"unknown kernel stream {stream!r}; expected one of {STREAMS}")
    return stream


@dataclasses.dataclass(frozen=True)
class Problem:
    """What a backend needs to know to accept a call (all static)."""

    direction: str  # "fwd" or "bwd"
    dtype: str  # q's dtype name
    head_dim: int
    block_size: int
    sq: int
    sk: int
    platform: str  # jax.default_backend(): "gpu", "cpu", "tpu"
    compute_capability: str | None  # "9.0" on an H100/H200, None off CUDA
    segments: bool = False  # packed documents: q_seg / k_seg segment ids given


def validate_impl(impl) -> str:
    """Canonical backend name (or ``"auto"``) of ``impl``; ``ValueError`` naming the bad value."""
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r} (kernel backend); expected one of {IMPLS}")
    return ALIASES.get(impl, impl)


def compute_capability() -> str | None:
    """The default device's CUDA compute capability (e.g. ``"9.0"``), or ``None``."""
    if jax.default_backend() != "gpu":
        return None
    return getattr(jax.devices()[0], "compute_capability", None)


def problem(direction: str, q, block_size: int, sk: int, segments: bool = False) -> Problem:
    return Problem(direction, jax.numpy.dtype(q.dtype).name, int(q.shape[-1]), int(block_size), int(q.shape[1]),
                   int(sk), jax.default_backend(), compute_capability(), bool(segments))


def module(name: str):
    """The backend module of a canonical backend name."""
    return importlib.import_module(f"pallas_kernels.backend_{name}")


def candidates(impl: str, prob: Problem) -> tuple[str, ...]:
    impl = validate_impl(impl)
    if impl != "auto":
        return (impl,)
    if prob.platform == "gpu":
        return BACKENDS
    return ("xla",)


def select(impl: str, prob: Problem):
    """The backend module that runs ``prob``: the first candidate whose ``supports`` accepts it.
    A named backend that cannot run it raises its ``NotImplementedError``."""
    reasons = []
    for name in candidates(impl, prob):
        mod = module(name)
        try:
            mod.supports(prob)
        except NotImplementedError as e:
            if validate_impl(impl) != "auto":
                raise NotImplementedError(f"kernel impl {name!r} cannot run this call: {e}") from None
            reasons.append(f"{name}: {e}")
            continue
        return mod
    raise NotImplementedError("no kernel backend can run this call: " + "; ".join(reasons))


def resolve(impl: str, direction: str, q, block_size: int, sk: int, segments: bool = False) -> str:
    """Name of the backend :func:`select` picks (for logs, tests and benchmarks)."""
    return select(impl, problem(direction, q, block_size, sk, segments)).NAME
