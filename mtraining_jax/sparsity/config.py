"""``SparsityConfig``: the knobs of MTraining's dynamic vertical-slash pattern (paper App. B.1).

One config per attention layer; budget fields take a scalar (every head) or a tuple with one entry
per query head (checked against the number of heads at call entry, :meth:`SparsityConfig.check`).
Every field is validated on construction (``ValueError`` naming the field and the value).

Fields and defaults:

* ``block_size = 64``: slash diagonals are pooled over 64x64 blocks (App. B.1 (ii)); the kernels'
  tile edge (one of ``pallas_kernels.api.SUPPORTED_BLOCKS``).
* ``last_q = 64``: Algorithm 1's observation window (the public MTraining code's default).
* ``vertical_p = slash_p = 0.9``: top-p coverage of the estimated attention mass (poster ``score_cover``).
* ``vertical_min = 64``, ``vertical_max = 4096`` tokens (the public code's cap); ``slash_min = 1``
  (diagonal 0 is always kept), ``slash_max = 64`` block diagonals (4096 tokens of band). The caps bound a
  head's work (about ``vertical_max + slash_max * block_size`` keys per query row); where a head's attention is
  diffuse they also bound the index's recall, so lifting them trades speed for recall (``docs/evaluation.md``).
* ``max_cols``: static column slots per (query block, ring step) of the converted index (``None``:
  the exact bound; smaller trades exactness for memory, :mod:`mtraining_jax.sparsity.convert`).
* ``sm_scale = None``: ``head_dim ** -0.5``; otherwise a finite number > 0.
* ``window = "sequence"``: the last ``last_q`` queries of the sequence; ``"per_document"`` (packed
  documents): every document's own last ``last_q`` queries, in at most ``window_blocks`` query
  blocks (:mod:`mtraining_jax.sparsity.estimate`).
* ``estimate_impl = "auto"``: how the estimate computes the window's statistics: ``"xla"`` (the
  logits' partial products in memory, rows in chunks), ``"triton"`` (Pallas Triton kernels that
  keep the logits on chip, :mod:`pallas_kernels.window_scores`; interpret mode off a GPU; the
  window's rows and ``head_dim`` powers of two >= 16) or ``"auto"`` (``"triton"`` on a
  GPU where it applies, else ``"xla"``). Same integers op by op in interpret mode; compiled the
  two may differ in the last bit of a probability (``exp``), each deterministic.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Union

import numpy as np

from pallas_kernels.api import SUPPORTED_BLOCKS, check_sm_scale

PerHead = Union[int, float, tuple]

#: fixed-point bits of the integer probability scores are chosen so that sums never overflow int32
_INT32_HEADROOM = 29


#: observation windows of the index estimate (``SparsityConfig.window``)
WINDOWS = ("sequence", "per_document")

#: how the index estimate computes its window statistics (``SparsityConfig.estimate_impl``)
ESTIMATE_IMPLS = ("auto", "xla", "triton")

PER_HEAD_FIELDS = ("vertical_p", "slash_p", "vertical_min", "vertical_max", "slash_min", "slash_max")


def _as_tuple(x):
    if isinstance(x, np.ndarray):
        return tuple(x.tolist())
    if isinstance(x, (list, tuple)):
        return tuple(x)  # entries keep their type (checked in __post_init__)
    return x


def _entries(x):
    return x if isinstance(x, tuple) else (x,)


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_real(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


@dataclasses.dataclass(frozen=True)
class SparsityConfig:
    """Vertical-slash budget configuration for one layer (see module docstring for defaults)."""

    block_size: int = 64
    last_q: int = 64
    vertical_p: PerHead = 0.9
    slash_p: PerHead = 0.9
    vertical_min: PerHead = 64
    vertical_max: PerHead = 4096
    slash_min: PerHead = 1
    slash_max: PerHead = 64
    max_cols: int | None = None
    sm_scale: float | None = None
    window: str = "sequence"
    window_blocks: int = 64
    estimate_impl: str = "auto"

    def __post_init__(self):
        for name in PER_HEAD_FIELDS:
            object.__setattr__(self, name, _as_tuple(getattr(self, name)))
        if not _is_int(self.block_size) or self.block_size not in SUPPORTED_BLOCKS:
            raise ValueError(f"block_size={self.block_size!r} is not one of the kernels' block sizes "
                             f"{SUPPORTED_BLOCKS}")
        if not _is_int(self.last_q) or self.last_q < 1:
            raise ValueError(f"last_q must be a positive integer, got {self.last_q!r}")
        lengths = {n: len(getattr(self, n)) for n in PER_HEAD_FIELDS if isinstance(getattr(self, n), tuple)}
        if len(set(lengths.values())) > 1 or 0 in lengths.values():
            raise ValueError(f"per-head tuples must all have one entry per query head, got lengths {lengths}")
        for name in ("vertical_p", "slash_p"):
            v = getattr(self, name)
            if not all(_is_real(x) and 0 < x <= 1 for x in _entries(v)):
                raise ValueError(f"{name} must be number(s) in (0, 1], got {v!r}")
        for name in ("vertical_min", "vertical_max", "slash_min", "slash_max"):
            if not all(_is_int(x) for x in _entries(getattr(self, name))):
                raise ValueError(f"{name} must be integer(s), got {getattr(self, name)!r}")
        if np.any(np.asarray(self.vertical_min) < 0):
            raise ValueError(f"vertical_min must be >= 0, got {self.vertical_min!r}")
        if np.any(np.asarray(self.slash_min) < 1):
            raise ValueError(
                f"slash_min must be >= 1 (diagonal 0 is always active), got {self.slash_min!r}")
        for lo, hi in (("vertical_min", "vertical_max"), ("slash_min", "slash_max")):
            a, b = np.broadcast_arrays(np.asarray(getattr(self, lo)), np.asarray(getattr(self, hi)))
            if np.any(b < a):
                raise ValueError(
                    f"{hi}={getattr(self, hi)!r} is below the minimum {lo}={getattr(self, lo)!r}")
        if self.max_cols is not None and (not _is_int(self.max_cols) or self.max_cols < 1):
            raise ValueError(f"max_cols must be None or a positive integer, got {self.max_cols!r}")
        check_sm_scale(self.sm_scale)
        if not isinstance(self.window, str) or self.window not in WINDOWS:
            raise ValueError(f"window={self.window!r} is not one of {WINDOWS}")
        if not _is_int(self.window_blocks) or self.window_blocks < 1:
            raise ValueError(f"window_blocks must be a positive integer, got {self.window_blocks!r}")
        if not isinstance(self.estimate_impl, str) or self.estimate_impl not in ESTIMATE_IMPLS:
            raise ValueError(f"estimate_impl={self.estimate_impl!r} is not one of {ESTIMATE_IMPLS}")
        if self.estimate_impl == "triton":
            if self.window == "sequence" and (self.last_q < 16 or self.last_q & (self.last_q - 1)):
                raise ValueError(f"estimate_impl='triton' needs last_q a power of two >= 16, got {self.last_q}")
            rows = self.window_blocks * self.block_size
            if self.window == "per_document" and rows & (rows - 1):
                raise ValueError(f"estimate_impl='triton' with window='per_document' needs window_blocks x block_size "
                                 f"a power of two, got {self.window_blocks} x {self.block_size}")

    # ----------------------------------------------------------------------------------------------
    def per_head(self, name: str, num_heads: int) -> np.ndarray:
        """Field ``name`` as an array ``[num_heads]`` (``ValueError`` on a wrong per-head length)."""
        v = getattr(self, name)
        if isinstance(v, tuple):
            if len(v) != num_heads:
                raise ValueError(f"{name} has {len(v)} per-head entries but there are {num_heads} query heads")
            return np.asarray(v)
        return np.full((num_heads,), v)

    def check(self, seq_len: int, num_heads: int, num_ranks: int = 1) -> None:
        """Validate against a problem: ``ValueError`` naming the bad value."""
        if self.last_q > seq_len:
            raise ValueError(f"last_q={self.last_q} is larger than the sequence length {seq_len}")
        if seq_len % num_ranks or (seq_len // num_ranks) % self.block_size:
            raise ValueError(
                f"block_size={self.block_size} does not divide the per-rank sequence length "
                f"{seq_len}/{num_ranks} = {seq_len / num_ranks:g}")
        if seq_len > 2**23:
            raise ValueError(f"seq_len={seq_len} > 2^23 would overflow the int32 fixed-point softmax sums")
        for name in PER_HEAD_FIELDS:
            self.per_head(name, num_heads)

    def max_verticals(self, seq_len: int) -> int:
        """Static ``MV``: vertical slots of the global index."""
        return int(min(np.max(np.asarray(self.vertical_max)), seq_len))

    def max_slashes(self, seq_len: int) -> int:
        """Static ``MS``: slash slots of the global index (block-diagonals)."""
        return int(min(np.max(np.asarray(self.slash_max)), seq_len // self.block_size))

    @property
    def window_rows(self) -> int:
        """Static bound on the query rows of the observation window, whatever the length:
        ``last_q`` (``"sequence"``) or ``window_blocks * block_size`` (``"per_document"``, with
        padding rows); the integer scores' bit widths are set from it (:attr:`score_bits`)."""
        return self.last_q if self.window == "sequence" else self.window_blocks * self.block_size

    def window_rows_at(self, seq_len: int) -> int:
        """The observation window's rows at ``seq_len`` (what the estimate scores, padding rows
        included): ``last_q``, or ``min(window_blocks, seq_len / block_size) * block_size`` for the
        per-document window; at most :attr:`window_rows`."""
        if self.window == "sequence":
            return self.last_q
        return min(self.window_blocks, seq_len // self.block_size) * self.block_size

    @property
    def score_bits(self) -> int:
        """Fixed-point fraction bits ``F`` of the integer probability scores (``sum < 2^31``)."""
        rows = self.window_rows
        return _INT32_HEADROOM - math.ceil(math.log2(rows)) if rows > 1 else _INT32_HEADROOM
