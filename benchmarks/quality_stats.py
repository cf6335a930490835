"""Interval statistics of the quality study, pure functions without scipy: Student-t quantiles and the
paired t-interval over seeds (``paired_interval``, ``verdict``), and the score intervals of proportions
(Wilson; Newcombe's for a difference, independent or paired) that the NIAH pass counts use."""

from __future__ import annotations

import math
import statistics


def _student_t_two_sided(t: float, df: int) -> float:
    """``P(|T| <= t)`` for Student's t with integer ``df`` (closed form, Abramowitz & Stegun 26.7.3-4)."""
    theta = math.atan(t / math.sqrt(df))
    s, c2 = math.sin(theta), math.cos(theta) ** 2
    if df % 2:  # odd
        term = total = math.cos(theta)
        for k in range(1, (df - 1) // 2):
            term *= c2 * (2 * k) / (2 * k + 1)
            total += term
        return (2 / math.pi) * (theta + (s * total if df > 1 else 0.0))
    term = total = 1.0
    for k in range(1, df // 2):
        term *= c2 * (2 * k - 1) / (2 * k)
        total += term
    return s * total


def t_quantile(q: float, df: int) -> float:
    """The ``q`` quantile (``0.5 < q < 1``) of Student's t with integer ``df >= 1``, by bisection on
    the closed-form distribution function (no scipy): ``t_quantile(0.975, 2) = 4.303``."""
    if not 0.5 < q < 1.0 or int(df) != df or df < 1:
        raise ValueError(f"t_quantile needs 0.5 < q < 1 and an integer df >= 1, got q={q}, df={df}")
    target, lo, hi = 2 * q - 1, 0.0, 1.0
    while _student_t_two_sided(hi, int(df)) < target:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _student_t_two_sided(mid, int(df)) < target else (lo, mid)
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return (lo + hi) / 2


def paired_interval(diffs, confidence: float = 0.95) -> dict:
    """Mean of the per-seed differences and its two-sided ``confidence`` t-interval over the seeds
    (``df = n - 1``); ``lo``/``hi``/``sd`` are ``None`` for one seed."""
    d = [float(x) for x in diffs]
    n = len(d)
    out = {"n": n, "mean": statistics.fmean(d) if d else None, "sd": None, "se": None, "t": None,
           "lo": None, "hi": None, "confidence": confidence, "diffs": d}
    if n >= 2:
        sd = statistics.stdev(d)
        t = t_quantile(0.5 + confidence / 2, n - 1)
        se = sd / math.sqrt(n)
        out.update(sd=sd, se=se, t=t, lo=out["mean"] - t * se, hi=out["mean"] + t * se)
    return out


def verdict(iv: dict, base: str = "dense") -> str:
    if iv["n"] == 0:
        return "no paired seeds"
    if iv["lo"] is None:
        return "one seed: no interval, no difference established"
    if iv["lo"] > 0:
        return f"higher than {base} (interval excludes 0)"
    if iv["hi"] < 0:
        return f"lower than {base} (interval excludes 0)"
    return "no difference established (interval includes 0)"


Z95 = 1.959963984540054  # the normal 0.975 quantile


def wilson(k: int, n: int, z: float = Z95) -> tuple:
    """Wilson score interval ``(lo, hi)`` of the proportion ``k / n``."""
    if n <= 0 or not 0 <= k <= n:
        raise ValueError(f"wilson needs 0 <= k <= n and n > 0, got k={k}, n={n}")
    p, z2 = k / n, z * z
    mid, half = (p + z2 / (2 * n)) / (1 + z2 / n), z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, mid - half), min(1.0, mid + half)


def newcombe_unpaired(k1: int, n1: int, k2: int, n2: int, z: float = Z95) -> tuple:
    """``(d, lo, hi)``: ``d = k1/n1 - k2/n2`` and Newcombe's hybrid score interval (his method 10,
    Stat. Med. 1998; independent samples)."""
    p1, p2 = k1 / n1, k2 / n2
    (l1, u1), (l2, u2) = wilson(k1, n1, z), wilson(k2, n2, z)
    d = p1 - p2
    return d, d - math.hypot(p1 - l1, u2 - p2), d + math.hypot(u1 - p1, p2 - l2)


def newcombe_paired(a: int, b: int, c: int, d: int, z: float = Z95) -> tuple:
    """``(D, lo, hi)`` for paired binary outcomes: ``a`` both right, ``b`` only the first, ``c`` only the
    second, ``d`` neither; ``D = (b - c) / n`` and Newcombe's score interval for paired data (his
    method 10, Stat. Med. 1998: ``phi`` from ``ad - bc`` less ``n / 2`` when that is positive, 0 in between)."""
    n = a + b + c + d
    if n <= 0 or min(a, b, c, d) < 0:
        raise ValueError(f"newcombe_paired needs non-negative counts with n > 0, got {(a, b, c, d)}")
    p1, p2 = (a + b) / n, (a + c) / n
    (l1, u1), (l2, u2) = wilson(a + b, n, z), wilson(a + c, n, z)
    den = (a + b) * (c + d) * (a + c) * (b + d)
    B = a * d - b * c
    phi = (B - n / 2 if B > n / 2 else min(B, 0)) / math.sqrt(den) if den else 0.0
    d1, e1, d2, e2 = p1 - l1, u1 - p1, p2 - l2, u2 - p2
    D = p1 - p2
    return (D, D - math.sqrt(max(0.0, d1 * d1 - 2 * phi * d1 * e2 + e2 * e2)),
            D + math.sqrt(max(0.0, e1 * e1 - 2 * phi * e1 * d2 + d2 * d2)))
