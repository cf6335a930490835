"""The ring's options, defined once, and the static description of one ring call.

* :class:`RingOptions` — what a user chooses for every ring of a model: ring order, backward side,
  K/V exchange and its capacity, fused kernel calls, kernel implementation. Held by
  ``MTrainingConfig.ring``, ``MSAConfig.ring`` and ``ModelConfig.ring`` (YAML: ``model.ring.<field>``),
  taken by ``ring_attention`` / ``ring_attention_shard`` (``options=`` or the fields as keywords).
* :class:`RingConfig` — one ring call resolved from those options and the call's shapes (mesh
  sizes, block size, ``"auto"`` choices made, capacity in tokens): the custom VJP's static argument.

Both are validated on construction from the one registry of each choice (:mod:`.schedule`,
:mod:`.sides`, :mod:`.exchange`, ``pallas_kernels.registry``)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from mtraining_jax.mesh import CP_AXES, LOCAL_AXIS, NODE_AXIS
from mtraining_jax.ring.exchange import capacity_tokens, validate_kv_exchange
from mtraining_jax.ring.schedule import validate_ring_order
from mtraining_jax.ring.sides import validate_backward_ring
from pallas_kernels.index_format import DEFAULT_BLOCK
from pallas_kernels.registry import validate_impl, validate_stream

__all__ = ["RingOptions", "RingConfig", "ring_options", "dense_block"]


def _named(name: str, check, value) -> None:
    """``check(value)``; its ``ValueError`` re-raised starting with the field ``name``."""
    try:
        check(value)
    except ValueError as e:
        msg = str(e)
        raise ValueError(msg if msg.startswith(name) else f"{name}: {msg}") from None


def _check_capacity(capacity) -> None:
    if capacity is not None:
        capacity_tokens(capacity, 1 << 30, 1)  # a token count or a fraction in (0, 1]


@dataclasses.dataclass(frozen=True)
class RingOptions:
    """How every ring runs (hashable, validated on construction: a bad value is a ``ValueError``
    starting with the field's name and naming the value). All choices are exact: they change
    the communication and the kernel calls, never the result beyond float rounding.

    Attributes:
      ring_order: ``"hierarchical"`` (inner ring over ``local``, outer over ``node``; MTraining
        Algorithm 2) or ``"flat"`` (one ring over all ranks): :data:`.schedule.RING_ORDERS`.
      backward_ring: which side circulates in the backward (:data:`.sides.BACKWARD_RINGS`):
        ``"kv"`` (K/V + dK/dV travel), ``"query"`` (Q, dO, lse, delta + dQ travel; BurstEngine) or
        ``"auto"`` (the side with fewer bytes per hop, :func:`.sides.resolve_backward_ring`).
        ``"query"`` needs every rank's index (:class:`.index_source.GlobalIndexSource`).
      kv_exchange: how K/V reach the ranks that attend to them (:data:`.exchange.KV_EXCHANGES`):
        ``"ring"`` (whole chunks around the ring), ``"sparse"`` (each rank receives only the tokens
        its index needs, :mod:`.exchange`; needs a :class:`.index_source.GlobalIndexSource`) or
        ``"auto"`` (fewer bytes). It applies to the sparse rings (``mtraining``, ``msa``); a dense
        ring needs every token and sends whole chunks (:meth:`for_dense`).
      exchange_capacity: the sparse exchange's static capacity, a token count or a fraction in
        ``(0, 1]`` of the chunk; ``None``: exact from a concrete index, else
        ``exchange.DEFAULT_CAPACITY_FRACTION`` of the chunk, checked at run time (a step that needs
        more sends the whole chunk).
      fuse_forward: the forward's first kernel call covers the own chunk AND the chunk of step 1
        (its hop overlaps what precedes the ring, e.g. the index estimate).
      fuse_backward: the K/V-side backward's first kernel call covers the chunk saved from the
        forward's last step AND the own chunk (one call fewer).
        Fusing needs the index of two chunks at once: the dense ring and
        :class:`.index_source.FusedIndexSource` indexes fuse, a ``[P]``-stacked ``StepIndex``, the
        sparse exchange and the query-side backward do not.
      impl: the per-step kernel (:data:`pallas_kernels.registry.IMPLS`): ``"auto"`` (Mosaic GPU on
        Hopper, Triton on other GPUs, the XLA twin elsewhere), ``"mosaic"``, ``"triton"``,
        ``"pallas"``, ``"xla"``.
      kernel_stream: what the Mosaic forward / dQ kernels' CTAs stream
        (:data:`pallas_kernels.registry.STREAMS`): ``"auto"`` (the forward per call from the index,
        both its streams' kernels compiled; the dQ on the split stream:
        :data:`pallas_kernels.mosaic_stream.AUTO_STREAM`), ``"index"`` (both passes per call from the
        index), ``"shared"`` or ``"split"`` (one kernel each: fewer kernels to compile,
        results/training/train_throughput.md). Every choice gives the same result; other kernel
        backends ignore it.
    """

    ring_order: str = "hierarchical"
    backward_ring: str = "auto"
    kv_exchange: str = "ring"
    exchange_capacity: int | float | None = None
    fuse_forward: bool = True
    fuse_backward: bool = True
    impl: str = "auto"
    kernel_stream: str = "auto"

    def __post_init__(self):
        _named("ring_order", validate_ring_order, self.ring_order)
        _named("backward_ring", validate_backward_ring, self.backward_ring)
        _named("kv_exchange", validate_kv_exchange, self.kv_exchange)
        _named("exchange_capacity", _check_capacity, self.exchange_capacity)
        for name in ("fuse_forward", "fuse_backward"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        _named("impl", validate_impl, self.impl)
        _named("kernel_stream", validate_stream, self.kernel_stream)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_mapping(cls, options: "RingOptions | Mapping[str, Any] | None", where: str = "ring") -> "RingOptions":
        """``options`` as :class:`RingOptions`: itself, the defaults (``None``) or a mapping of its
        fields (a config section). A bad key or value is a ``ValueError`` naming ``where.<key>``."""
        if options is None:
            return cls()
        if isinstance(options, cls):
            return options
        if not isinstance(options, Mapping):
            raise ValueError(f"{where} must be a mapping of ring options {list(cls.field_names())}, got {options!r}")
        unknown = sorted(set(options) - set(cls.field_names()))
        if unknown:
            raise ValueError(f"unknown {where} keys {unknown}; known keys: {list(cls.field_names())}")
        try:
            return cls(**options)
        except ValueError as e:
            raise ValueError(f"{where}.{e}") from None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes) -> "RingOptions":
        return dataclasses.replace(self, **changes)

    def for_dense(self) -> "RingOptions":
        """These options for a dense ring: the K/V exchange is the ring (every token is needed)."""
        return self if (self.kv_exchange, self.exchange_capacity) == ("ring", None) else \
            self.replace(kv_exchange="ring", exchange_capacity=None)


def ring_options(options: RingOptions | None = None, *, caller: str = "ring attention", **fields) -> RingOptions:
    """``options`` (default :class:`RingOptions`) with ``fields`` (ring options given as keywords)
    replaced; a keyword that is not a ring option is a ``TypeError`` naming it."""
    unknown = sorted(set(fields) - set(RingOptions.field_names()))
    if unknown:
        raise TypeError(f"{caller} got unexpected keyword argument(s) {unknown}; the ring options are "
                        f"{list(RingOptions.field_names())}")
    if options is None:
        options = RingOptions()
    elif not isinstance(options, RingOptions):
        raise ValueError(f"options must be a RingOptions, got {type(options).__name__}")
    return options.replace(**fields) if fields else options


@dataclasses.dataclass(frozen=True)
class RingConfig:
    """Static description of one ring call (hashable: it is the custom VJP's non-differentiable arg),
    resolved by ``ring_attention_shard`` from :class:`RingOptions` and the call's shapes.

    Attributes:
      num_nodes: ``N``, size of the ``node`` mesh axis.
      num_local: ``L``, size of the ``local`` mesh axis.
      ring_order, impl, fuse_forward, fuse_backward, kernel_stream: as :class:`RingOptions`.
      sm_scale: softmax scale; ``None`` means ``head_dim ** -0.5``.
      block_size: block size of the per-step ``StepIndex`` (when one is given).
      backward_ring: :attr:`RingOptions.backward_ring`, ``"auto"`` resolved to ``"kv"`` or ``"query"``
        by ``ring_attention_shard`` (may stay ``"auto"`` here: resolved again from the shapes).
      kv_exchange: :attr:`RingOptions.kv_exchange` resolved (``"ring"`` or ``"sparse"``).
      exchange_capacity: tokens per compact buffer of the sparse exchange (a multiple of
        ``block_size``, at most the chunk; 0 when unused).
      exchange_guard: the capacity was configured, not computed from a concrete index: check every
        step's need at run time and send the whole chunk where it does not fit.
    """

    num_nodes: int
    num_local: int
    ring_order: str = "hierarchical"
    sm_scale: float | None = None
    impl: str = "auto"
    block_size: int = DEFAULT_BLOCK
    fuse_forward: bool = True
    fuse_backward: bool = True
    backward_ring: str = "auto"
    kv_exchange: str = "ring"
    exchange_capacity: int = 0
    exchange_guard: bool = False
    kernel_stream: str = "auto"

    def __post_init__(self):
        for name in ("num_nodes", "num_local", "block_size"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < 1:
                raise ValueError(f"{name} must be a positive integer, got {val!r}")
        if isinstance(self.exchange_capacity, bool) or not isinstance(self.exchange_capacity, (int, np.integer)) \
                or self.exchange_capacity < 0 or self.exchange_capacity % self.block_size:
            raise ValueError(f"exchange_capacity must be a non-negative multiple of block_size={self.block_size}, "
                             f"got {self.exchange_capacity!r}")
        for name in ("fuse_forward", "fuse_backward", "exchange_guard"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        validate_ring_order(self.ring_order)
        validate_impl(self.impl)
        validate_stream(self.kernel_stream)
        validate_backward_ring(self.backward_ring)
        validate_kv_exchange(self.kv_exchange)
        if self.kv_exchange == "sparse" and self.exchange_capacity == 0:
            raise ValueError("kv_exchange='sparse' needs a positive exchange_capacity")

    @property
    def num_ranks(self) -> int:
        return self.num_nodes * self.num_local

    @property
    def outer(self) -> tuple[str | tuple[str, ...], int]:
        """``(axis, size)`` of the outer ring (size 1: no outer ring)."""
        if self.ring_order == "flat":
            return CP_AXES, 1
        return NODE_AXIS, self.num_nodes

    @property
    def inner(self) -> tuple[str | tuple[str, ...], int]:
        """``(axis, size)`` of the inner ring."""
        if self.ring_order == "flat":
            return CP_AXES, self.num_ranks
        return LOCAL_AXIS, self.num_local



def dense_block(sl: int) -> int:
    """Largest power of two ``<= DEFAULT_BLOCK`` dividing ``sl`` (tile size of the dense ring)."""
    b = DEFAULT_BLOCK
    while b > 1 and sl % b:
        b //= 2
    return b
