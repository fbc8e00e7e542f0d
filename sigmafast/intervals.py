"""95% confidence intervals for the figures the library reports: Wilson's for a proportion of samples, and
Student's t quantile for the mean of a few independent groups (no SciPy needed)."""

from __future__ import annotations

import math
from statistics import NormalDist

Z95 = 1.959963984540054  # two-sided 95% normal quantile


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (Wilson 1927), 95% by default."""
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n and n >= 1, got successes={successes}, n={n}")
    p = successes / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, center - half), min(1.0, center + half)


def t_central(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with ``df`` degrees of freedom, exactly: Abramowitz & Stegun 26.7.3 (odd df)
    and 26.7.4 (even df), with theta = atan(t / sqrt(df))."""
    theta = math.atan(t / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    if df % 2 == 0:  # sin(theta) (1 + c2/2 + 1*3/(2*4) c2^2 + ... up to c2^((df-2)/2))
        term = total = 1.0
        for k in range(2, df, 2):
            term *= c2 * (k - 1) / k
            total += term
        return math.sin(theta) * total
    if df == 1:
        return 2 * theta / math.pi
    term = total = math.cos(theta)  # 2/pi (theta + sin(theta) (cos + 2/3 cos^3 + ... up to cos^(df-2)))
    for k in range(3, df, 2):
        term *= c2 * (k - 1) / k
        total += term
    return 2 / math.pi * (theta + math.sin(theta) * total)


def t_quantile(level: float, df: int) -> float:
    """The t with P(|T| <= t) = ``level`` (two-sided; 0.95 gives 12.706 at df = 1, 2.262 at 9, 1.96 as df
    grows), by bisection of :func:`t_central` up to 1000 degrees of freedom."""
    if isinstance(df, bool) or not isinstance(df, int) or df < 1:
        raise ValueError(f"df must be an int >= 1, got {df!r}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    if df > 1000:  # t_central would sum df / 2 terms; the Cornish-Fisher expansion is within 1e-11 here
        z = NormalDist().inv_cdf((1 + level) / 2)
        return (z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
                + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3))
    lo, hi = 0.0, 1.0
    while t_central(hi, df) < level:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_central(mid, df) < level else (lo, mid)
    return (lo + hi) / 2
