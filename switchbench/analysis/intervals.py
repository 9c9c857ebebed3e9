"""Confidence intervals across seeds: Student's t-interval of a mean, and Welch's interval of a difference of two
means (unequal variances, Welch–Satterthwaite degrees of freedom). The t quantiles are computed here: SciPy is not
a dependency, and Welch's degrees of freedom are not integers, so no table would do."""

import math
import statistics
from dataclasses import dataclass

SIMPSON_PANELS = 1024  # over at most 64 units of t: quantiles to about 1e-8 for p <= 0.995
BISECTIONS = 60


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float
    df: float | None  # degrees of freedom of the t quantile; None where the spread is 0 (no interval to draw)

    def verdict(self) -> str:
        """For a difference (this model minus the baseline, lower is better): 'matches' when the interval holds
        0, else 'better' or 'worse'."""
        if self.low <= 0 <= self.high:
            return "matches"
        return "better" if self.high < 0 else "worse"


def t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t with ``df`` >= 1 degrees of freedom, 0.5 <= p < 1: bisection on the CDF,
    1/2 + the density integrated from 0 with Simpson's rule. The quantile lies below the Cauchy distribution's
    (df = 1, the heaviest tails), tan(π(p - 1/2)), which bounds the search."""
    if not 0.5 <= p < 1:
        raise ValueError(f"p must be in [0.5, 1); got {p}")
    if not df >= 1:
        raise ValueError(f"degrees of freedom must be >= 1; got {df}")
    constant = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def density(t: float) -> float:
        return constant * (1 + t * t / df) ** (-(df + 1) / 2)

    lo, hi = 0.0, math.tan(math.pi * (p - 0.5))
    for _ in range(BISECTIONS):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _simpson(density, mid) < p - 0.5 else (lo, mid)
    return (lo + hi) / 2


def _simpson(f, end: float) -> float:
    """∫_0^end f."""
    h = end / SIMPSON_PANELS
    inner = sum((4 if i % 2 else 2) * f(i * h) for i in range(1, SIMPSON_PANELS))
    return h / 3 * (f(0.0) + inner + f(end))


def mean_interval(values: list[float], confidence: float = 0.95) -> Interval:
    """The mean ± t(n - 1) · s / sqrt(n)."""
    if len(values) < 2:
        raise ValueError(f"an interval across seeds needs at least 2 values; got {len(values)}")
    mean, se = statistics.fmean(values), statistics.stdev(values) / math.sqrt(len(values))
    return _interval(mean, se, len(values) - 1, confidence)


def difference_interval(a: list[float], b: list[float], confidence: float = 0.95) -> Interval:
    """mean(a) - mean(b) ± t(ν) · sqrt(s_a²/n_a + s_b²/n_b), with Welch–Satterthwaite's
    ν = (s_a²/n_a + s_b²/n_b)² / ((s_a²/n_a)²/(n_a - 1) + (s_b²/n_b)²/(n_b - 1))."""
    if min(len(a), len(b)) < 2:
        raise ValueError(
            f"an interval of a difference needs at least 2 values a side; got {len(a)} and {len(b)}"
        )
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    difference = statistics.fmean(a) - statistics.fmean(b)
    if va + vb == 0:
        return Interval(difference, difference, difference, None)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    return _interval(difference, math.sqrt(va + vb), df, confidence)


def _interval(estimate: float, se: float, df: float, confidence: float) -> Interval:
    if se == 0:
        return Interval(estimate, estimate, estimate, None)
    half = t_quantile(0.5 + confidence / 2, df) * se
    return Interval(estimate, estimate - half, estimate + half, df)
