"""The index-source contract of the sparse ring, in one place.

``ring_attention_shard(step_index=...)`` takes ``None`` (the dense causal ring), a
:class:`~pallas_kernels.index_format.StepIndex` whose arrays have a leading ``[P]`` ring-step axis,
or an *index source* that converts the index of one ring step on demand. What a source can do
decides what the ring can do with it; each capability is a ``runtime_checkable`` protocol (checked
with ``isinstance``, i.e. by the presence of the members):

* :class:`IndexSource` — ``step(s) -> StepIndex`` (this rank's queries vs the chunk it holds at ring
  step ``s``) and ``num_steps`` (``== P``): every sparse ring;
* :class:`FusedIndexSource` — also ``steps((s, t, ...)) -> StepIndex`` over those chunks concatenated:
  the fused kernel calls (``fuse_forward`` / ``fuse_backward``);
* :class:`GlobalIndexSource` — also ``for_rank(r)`` (the same source for rank ``r``'s queries: every
  rank holds the identical global index) and ``index`` (that global index, a pytree; a concrete one
  lets the sparse exchange size its buffers exactly on the host): the query-side backward ring and
  the sparse K/V exchange.

Implementations: :class:`mtraining_jax.sparsity.convert.RankStepIndex` and
:class:`mtraining_jax.sparsity.msa_select.MSARankStepIndex` (all three),
:class:`mtraining_jax.ring.steps.StackedStepIndex` (no ``steps``: one chunk per entry).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from pallas_kernels.index_format import StepIndex

__all__ = ["IndexSource", "FusedIndexSource", "GlobalIndexSource", "can_fuse", "has_every_rank"]


@runtime_checkable
class IndexSource(Protocol):
    """``step(s)``: the :class:`StepIndex` of ring step ``s``; ``num_steps``: ``P``."""

    @property
    def num_steps(self) -> int: ...

    def step(self, s) -> StepIndex: ...


@runtime_checkable
class FusedIndexSource(IndexSource, Protocol):
    """An :class:`IndexSource` that also converts several ring steps for one kernel call."""

    def steps(self, steps: tuple[int, ...]) -> StepIndex: ...


@runtime_checkable
class GlobalIndexSource(IndexSource, Protocol):
    """An :class:`IndexSource` that also describes every other rank's queries."""

    index: Any

    def for_rank(self, rank) -> "GlobalIndexSource": ...


def can_fuse(step_index) -> bool:
    """Fused steps need the index of several chunks at once: dense (``None``) or a
    :class:`FusedIndexSource` (a ``[P]``-stacked ``StepIndex`` holds one chunk per entry)."""
    return step_index is None or isinstance(step_index, FusedIndexSource)


def has_every_rank(step_index) -> bool:
    """Whether ``step_index`` describes every rank's queries (dense, or a :class:`GlobalIndexSource`):
    what the query-side backward and the sparse exchange need."""
    return step_index is None or isinstance(step_index, GlobalIndexSource)
