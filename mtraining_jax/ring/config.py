"""The static description of one ring (:class:`RingConfig`): mesh sizes, ring order, kernel choice,
fusion and the backward's side, each validated on construction from its registry
(:mod:`.schedule`, :mod:`.sides`, ``pallas_kernels.registry``)."""

from __future__ import annotations

import dataclasses

import numpy as np

from mtraining_jax.mesh import CP_AXES, LOCAL_AXIS, NODE_AXIS
from mtraining_jax.ring.exchange import validate_kv_exchange
from mtraining_jax.ring.schedule import validate_ring_order
from mtraining_jax.ring.sides import validate_backward_ring
from pallas_kernels.index_format import DEFAULT_BLOCK
from pallas_kernels.registry import validate_impl

__all__ = ["RingConfig", "dense_block"]


@dataclasses.dataclass(frozen=True)
class RingConfig:
    """Static description of one ring (hashable: it is the custom VJP's non-differentiable arg).

    Attributes:
      num_nodes: ``N``, size of the ``node`` mesh axis.
      num_local: ``L``, size of the ``local`` mesh axis.
      ring_order: ``"flat"`` or ``"hierarchical"`` (:mod:`.attention`).
      sm_scale: softmax scale; ``None`` means ``head_dim ** -0.5``.
      impl: per-step kernel implementation passed to ``pallas_kernels.api``.
      block_size: block size of the per-step ``StepIndex`` (when one is given).
      fuse_forward: the forward's first kernel call covers the own chunk AND the chunk of step 1
        (it waits for the first hop, which then overlaps whatever precedes the ring, e.g. the index
        estimate, instead of a kernel call; one call fewer over this rank's queries).
      fuse_backward: the backward's first kernel call covers the chunk saved from the forward's
        last step AND the own chunk (both already here; one call fewer, one hop fewer).
      Fusing needs the index of two chunks at once: it applies to the dense ring and to index
      sources with ``steps`` (``RankStepIndex``), not to a ``[P]``-stacked ``StepIndex``; the
      query-side backward has no fused call (its chunks are other ranks' queries).
      backward_ring: which side circulates in the backward (:data:`.sides.BACKWARD_RINGS`):
        ``"kv"`` (K/V + dK/dV travel), ``"query"`` (Q, dO, lse, delta + dQ travel; BurstEngine) or
        ``"auto"`` (the side with fewer bytes per hop, :func:`.sides.resolve_backward_ring`).
      kv_exchange: how K/V reach the ranks that attend to them (:data:`.exchange.KV_EXCHANGES`):
        ``"ring"`` (whole chunks around the ring) or ``"sparse"`` (each rank receives only the tokens
        its index needs, :mod:`.exchange`); ``"auto"`` is resolved by ``ring_attention_shard``.
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
