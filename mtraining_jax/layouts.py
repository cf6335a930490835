"""Sequence layouts for context parallelism: exact, invertible permutations of the sequence axis.

A layout over ``num_ranks`` ranks is a permutation ``perm`` of ``range(seq_len)``. The laid-out
sequence is ``x_laid = x[..., perm, ...]`` (natural order -> layout order), and it is sharded
*contiguously* over ranks: rank ``r`` holds laid positions ``[r * S/P, (r + 1) * S/P)``, i.e. the
global token positions ``perm.reshape(P, S // P)[r]``. Ranks are numbered node-major on the
``(node, local)`` mesh (``rank = node * num_local + local``), which is what
``PartitionSpec(("node", "local"))`` gives, so ring neighbours on ``local`` are adjacent ranks.

Layouts (MTraining §2 and §4.1; tutorial 002 §3):

* ``contiguous``     rank r holds tokens ``[r*S/P, (r+1)*S/P)``.
* ``zigzag``         the sequence is cut into ``2P`` chunks; rank r holds chunks ``r`` and ``2P-1-r``.
* ``token_striped``  token t is on rank ``t mod P`` (Striped Attention, Brandon et al. 2023).
* ``block_striped``  64-token stripes (``stripe`` tokens); stripe j is on rank ``j mod P`` — the
  MTraining layout (§4.1 (ii)), which spreads slash diagonals evenly over workers and ring steps.

Everything here is NumPy (host-side, static under ``jit``): a layout is a property of shapes.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

LayoutName = Literal["contiguous", "zigzag", "token_striped", "block_striped"]
LAYOUTS: tuple[str, ...] = ("contiguous", "zigzag", "token_striped", "block_striped")
DEFAULT_STRIPE = 64


@dataclasses.dataclass(frozen=True)
class Layout:
    """A sequence layout: which global token positions each of ``num_ranks`` ranks holds.

    Attributes:
      name: one of :data:`LAYOUTS`.
      seq_len: global sequence length ``S``.
      num_ranks: number of context-parallel ranks ``P`` (node-major order).
      stripe: stripe width in tokens for ``block_striped`` (ignored by the others).
    """

    name: str
    seq_len: int
    num_ranks: int
    stripe: int = DEFAULT_STRIPE

    def __post_init__(self):
        validate_layout(self.name, self.seq_len, self.num_ranks, self.stripe)

    @property
    def local_len(self) -> int:
        """Tokens per rank, ``S // P``."""
        return self.seq_len // self.num_ranks

    @property
    def perm(self) -> np.ndarray:
        """``int32 [S]``: laid position i holds global token ``perm[i]``."""
        return layout_permutation(self.name, self.seq_len, self.num_ranks, self.stripe)

    @property
    def inverse(self) -> np.ndarray:
        """``int32 [S]``: global token t sits at laid position ``inverse[t]``."""
        return inverse_permutation(self.perm)

    @property
    def positions(self) -> np.ndarray:
        """``int32 [P, S // P]``: global positions held by each rank, in local order."""
        return self.perm.reshape(self.num_ranks, self.local_len)

    def rank_positions(self, rank: int) -> np.ndarray:
        """``int32 [S // P]``: global positions held by ``rank``."""
        return self.positions[rank]

    def permute(self, x, axis: int = 1):
        """Natural order -> layout order along ``axis`` (works on NumPy and JAX arrays)."""
        return _take(x, self.perm, axis)

    def unpermute(self, x, axis: int = 1):
        """Layout order -> natural order along ``axis``."""
        return _take(x, self.inverse, axis)


def _take(x, idx: np.ndarray, axis: int):
    if isinstance(x, np.ndarray):
        return np.take(x, idx, axis=axis)
    import jax.numpy as jnp  # local import: this module is host-side NumPy otherwise

    return jnp.take(x, jnp.asarray(idx), axis=axis)


def validate_layout(name: str, seq_len: int, num_ranks: int, stripe: int = DEFAULT_STRIPE) -> None:
    """Raise ``ValueError`` naming the bad value if the layout cannot be built."""
    if name not in LAYOUTS:
        raise ValueError(f"unknown layout {name!r}; expected one of {LAYOUTS}")
    if not isinstance(num_ranks, (int, np.integer)) or num_ranks < 1:
        raise ValueError(f"num_ranks must be a positive integer, got {num_ranks!r}")
    if not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
    if name == "block_striped":
        if stripe < 1:
            raise ValueError(f"stripe must be positive, got {stripe}")
        if seq_len % (stripe * num_ranks):
            raise ValueError(
                f"sequence length {seq_len} is not divisible by stripe x ranks = "
                f"{stripe} x {num_ranks} = {stripe * num_ranks} (block_striped layout)"
            )
    elif name == "zigzag":
        if seq_len % (2 * num_ranks):
            raise ValueError(
                f"sequence length {seq_len} is not divisible by 2 x ranks = {2 * num_ranks} "
                "(zigzag layout)"
            )
    elif seq_len % num_ranks:
        raise ValueError(
            f"sequence length {seq_len} is not divisible by the number of ranks {num_ranks} "
            f"({name} layout)"
        )


def layout_permutation(name: str, seq_len: int, num_ranks: int, stripe: int = DEFAULT_STRIPE) -> np.ndarray:
    """``int32 [S]`` permutation for a layout (see module docstring)."""
    validate_layout(name, seq_len, num_ranks, stripe)
    S, P = int(seq_len), int(num_ranks)
    t = np.arange(S, dtype=np.int64)
    if name == "contiguous":
        perm = t
    elif name == "zigzag":
        c = S // (2 * P)
        chunks = t.reshape(2 * P, c)
        perm = np.concatenate(
            [np.concatenate([chunks[r], chunks[2 * P - 1 - r]]) for r in range(P)]
        )
    elif name == "token_striped":
        # rank r holds r, r+P, r+2P, ...
        perm = t.reshape(S // P, P).T.reshape(S)
    else:  # block_striped
        w = int(stripe)
        n = S // w  # stripes; stripe j -> rank j mod P, local stripe j // P
        stripes = t.reshape(n // P, P, w)  # [local stripe, rank, w]
        perm = stripes.transpose(1, 0, 2).reshape(S)
    return perm.astype(np.int32)


def inverse_permutation(perm: np.ndarray) -> np.ndarray:
    """``int32 [S]`` inverse: ``inv[perm[i]] = i``."""
    perm = np.asarray(perm)
    inv = np.empty_like(perm)
    inv[perm] = np.arange(perm.shape[0], dtype=perm.dtype)
    return inv


def causal_work_per_rank(name: str, seq_len: int, num_ranks: int, stripe: int = DEFAULT_STRIPE) -> np.ndarray:
    """``int64 [P]``: number of causal (q, k) pairs whose query lives on each rank.

    Under full causal attention every layout except ``contiguous`` is balanced (within one stripe
    of slack); used by the balance property tests and the imbalance notebook.
    """
    pos = Layout(name, seq_len, num_ranks, stripe).positions.astype(np.int64)
    return (pos + 1).sum(axis=1)
