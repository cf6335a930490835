"""MTraining's dynamic vertical-slash sparse index (Algorithm 1, App. B.1; poster "distributed sparse indexing").

* :mod:`.config`    ``SparsityConfig`` (budgets, caps, block size, last_q; per layer / per head)
* :mod:`.index`     ``VerticalSlashIndex`` (global, per query head, identical on every rank)
* :mod:`.budgets`   top-p coverage budgets
* :mod:`.estimate`  ``estimate_index`` (single device), ``estimate_index_shard`` (inside shard_map)
* :mod:`.convert`   global index -> per-rank, per-ring-step ``StepIndex`` for the kernels
* :mod:`.masks`     dense-equivalent mask and masked reference attention (tests, notebooks)
* :mod:`.metrics`   worker/step imbalance, computation ratio, sparsity, recall (§3.3, Table 3)
* :mod:`.synthetic` RoPE q/k with vertical-slash structure (App. A) for benchmarks and notebooks
"""

from mtraining_jax.sparsity.config import SparsityConfig
from mtraining_jax.sparsity.convert import RankStepIndex, convert_index, convert_step
from mtraining_jax.sparsity.estimate import estimate_index, estimate_index_shard
from mtraining_jax.sparsity.index import VerticalSlashIndex
from mtraining_jax.sparsity.masks import index_to_mask, masked_reference

__all__ = [
    "RankStepIndex", "SparsityConfig", "VerticalSlashIndex", "convert_index", "convert_step", "estimate_index",
    "estimate_index_shard", "index_to_mask", "masked_reference",
]
