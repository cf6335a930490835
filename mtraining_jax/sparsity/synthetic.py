"""Synthetic queries / keys with RoPE whose attention has MTraining's vertical-slash structure (App. A).

Model (Appendix A, Eq. 7-14): before RoPE, ``q_n = mu_q + xi_n`` and ``k_m = mu_k + chi_m`` with
per-channel means ``mu`` and zero-mean noise. After RoPE (``z_{n,m} = q_n W_{n-m} k_m^T``) the mean
part ``sum_i phi^{(i)}_{n-m} mu_q^{(i)} mu_k^{(i)} + ...`` depends on ``n - m`` only: a superposition of
cosines in the relative position, which peaks at ``n - m = 0`` and at the relative distances where
several channel frequencies re-align -> slash bands (Theorem A.1). Verticals come from outliers of the
key distribution (Eq. 10): a few "heavy" keys get a large component along the query mean in the
lowest-frequency RoPE channels (which barely rotate over the sequence, so the boost survives every
relative distance). Position 0 is an attention sink (a heavier outlier).

``sharpness`` multiplies the logits (inverse temperature): larger -> more concentrated attention ->
the top-p budgets pick fewer lines (higher sparsity for the same ``p``). Deterministic from ``seed``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from mtraining_jax.sparsity.positions import check_positions


@dataclasses.dataclass(frozen=True)
class SyntheticAttention:
    """Generator parameters (see module docstring)."""

    seq_len: int = 4096
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    rope_theta: float = 1e6
    mean_scale: float = 1.0  # size of the channel means mu_q, mu_k (slash strength)
    noise: float = 1.0  # std of xi, chi
    num_outliers: int = 32  # heavy keys (verticals), besides the sink at position 0
    outlier_scale: float = 2.5
    sink_scale: float = 3.0
    sharpness: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_q_heads={self.num_q_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.num_outliers >= self.seq_len:
            raise ValueError(f"num_outliers={self.num_outliers} must be < seq_len={self.seq_len}")


def rope(x, positions, theta: float):
    """Rotate-half RoPE (Qwen / Llama convention): ``x [B, S, H, D]``, ``positions [S]``."""
    D = x.shape[-1]
    inv = 1.0 / (theta ** (np.arange(0, D, 2, dtype=np.float64) / D))  # [D/2]
    ang = jnp.asarray(np.asarray(positions, np.float64)[:, None] * inv[None, :], jnp.float32)
    cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def synthetic_qk(cfg: SyntheticAttention, query_positions=None):
    """``(q [1, R, Hq, D], k [1, S, Hkv, D])`` float32 in natural order, RoPE applied.

    ``query_positions``: global positions of the query rows to generate (default all ``S``); the
    rows are the same whatever subset is asked for, so an estimator can get only the last rows.
    """
    S, D, Hq, Hkv = cfg.seq_len, cfg.head_dim, cfg.num_q_heads, cfg.num_kv_heads
    if query_positions is not None:
        check_positions(query_positions, S, name="query_positions", permutation=False,
                        shape=(np.size(query_positions),))
    qpos = np.arange(S) if query_positions is None else np.asarray(query_positions)
    kmu, kq, kk, ko, kd = jax.random.split(jax.random.PRNGKey(cfg.seed), 5)
    g = Hq // Hkv
    # channel means shared by a KV group (the query mean sets what the group looks for)
    mu_k = cfg.mean_scale * jax.random.normal(kmu, (Hkv, D))
    mu_q = jnp.repeat(mu_k, g, axis=0) + 0.5 * cfg.mean_scale * jax.random.normal(kd, (Hq, D))
    # per-row noise from a per-position key so any subset of rows is reproducible
    qnoise = jax.vmap(lambda p: jax.random.normal(jax.random.fold_in(kq, p), (Hq, D)))(jnp.asarray(qpos))
    q = (mu_q[None] + cfg.noise * qnoise)[None]
    k = (mu_k[None] + cfg.noise * jax.random.normal(kk, (S, Hkv, D)))[None]
    # heavy keys: a component along the group's mean query in the 4 lowest-frequency channel pairs
    rng = np.random.default_rng(cfg.seed)
    heavy = np.sort(rng.choice(np.arange(1, S), size=cfg.num_outliers, replace=False))
    low = np.r_[D // 2 - 4: D // 2, D - 4: D]
    dirn = jnp.zeros((Hkv, D)).at[:, low].set(jnp.sign(mu_q.reshape(Hkv, g, D).mean(1)[:, low]))
    scale = np.full(cfg.num_outliers + 1, cfg.outlier_scale)
    scale[0] = cfg.sink_scale
    rows = np.r_[0, heavy]
    k = k.at[0, rows].add(jnp.asarray(scale)[:, None, None] * dirn[None] * np.sqrt(D) / 2)
    t = cfg.sharpness
    return rope(q, qpos, cfg.rope_theta) * t, rope(k, np.arange(S), cfg.rope_theta)


def heavy_positions(cfg: SyntheticAttention) -> np.ndarray:
    """Positions of the outlier keys (including the sink 0), for plots and tests."""
    rng = np.random.default_rng(cfg.seed)
    return np.r_[0, np.sort(rng.choice(np.arange(1, cfg.seq_len), size=cfg.num_outliers, replace=False))]


def packed_documents_qk(lengths, base: SyntheticAttention, seed: int = 0):
    """``(q [1, S, Hq, D], k [1, S, Hkv, D], segment_ids int32 [1, S])``, ``S = sum(lengths)``: one
    synthetic document per length (its own sink, ``min(num_outliers, len // 64)`` heavy keys and
    RoPE from its first token; seeded per document), concatenated as packed documents. ``base``
    gives heads, head_dim, scales and sharpness (its ``seq_len`` / ``seed`` are replaced)."""
    qs, ks = [], []
    for d, n in enumerate(np.asarray(lengths, np.int64)):
        cfg = dataclasses.replace(base, seq_len=int(n), num_outliers=int(max(1, min(base.num_outliers, n // 64)))
                                  if n > 2 else 0, seed=seed * 100003 + d)
        q, k = synthetic_qk(cfg)
        qs.append(q)
        ks.append(k)
    seg = np.repeat(np.arange(len(qs)), np.asarray(lengths, np.int64))[None].astype(np.int32)
    return jnp.concatenate(qs, axis=1), jnp.concatenate(ks, axis=1), jnp.asarray(seg)
