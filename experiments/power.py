"""The effect a comparison could have seen: the minimum detectable effect (MDE) at 80 % power.

A verdict of "not reproduced" says nothing about effects smaller than the study could detect, so every such
verdict carries its MDE, computed from the results by one formula (the two-sample t-test's power
approximation, pooled standard deviation, Holm's first-step level — the most stringent one, so the MDE is
conservative):

    MDE = (t_{1 − α/(2m), df} + t_{power, df}) · s_p · √(1/n_a + 1/n_b),   df = n_a + n_b − 2,
    s_p² = ((n_a − 1) s_a² + (n_b − 1) s_b²) / df

with α the family-wise level, m the number of comparisons in the Holm family, s_a, s_b the arms' sample
standard deviations of the endpoint. The verdicts themselves come from permutation tests; this is the usual
planning approximation to their power, stated as such. For a slope on dose ranks x (H1 of study 9) the same
formula with the slope's standard error s_p / √(Σ (x_i − x̄)²) in place of s_p · √(1/n_a + 1/n_b).

Beside it, the one-sided Fisher exact test of two arms' event counts (``fisher_greater``: how often runs
collapsed), read by the summaries. Pure Python (no SciPy): the t quantile by bisection on the t distribution's CDF, computed through the
regularised incomplete beta function (continued fraction, Numerical Recipes' ``betacf``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

POWER = 0.80


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz), |error| < 1e-14."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        step = d * c
        h *= step
        if abs(step - 1.0) < 1e-15:
            break
    return h


def incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T ≤ t) for Student's t with ``df`` degrees of freedom."""
    tail = 0.5 * incomplete_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t (bisection to 1e-12)."""
    if not 0.0 < p < 1.0 or df <= 0:
        raise ValueError(f"need 0 < p < 1 and df > 0, got p={p}, df={df}")
    lo, hi = -1e3, 1e3
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12:
            break
    return 0.5 * (lo + hi)


def pooled_sd(a: Sequence[float], b: Sequence[float]) -> float:
    """s_p of two samples (each ≥ 2 values)."""
    import statistics

    na, nb = len(a), len(b)
    return math.sqrt(((na - 1) * statistics.variance(a) + (nb - 1) * statistics.variance(b)) / (na + nb - 2))


def mde_two_sample(a: Sequence[float], b: Sequence[float], alpha: float = 0.05, family: int = 1,
                   power: float = POWER) -> float:
    """The module docstring's MDE of mean(a) − mean(b) in a Holm family of ``family`` comparisons."""
    na, nb = len(a), len(b)
    df = na + nb - 2
    crit = t_quantile(1 - alpha / (2 * family), df) + t_quantile(power, df)
    return crit * pooled_sd(a, b) * math.sqrt(1 / na + 1 / nb)


def mde_from_sd(sd: float, se_factor: float, df: int, alpha: float = 0.05, family: int = 1,
                power: float = POWER) -> float:
    """MDE of a statistic whose standard error is ``sd · se_factor`` with ``df`` degrees of freedom."""
    return (t_quantile(1 - alpha / (2 * family), df) + t_quantile(power, df)) * sd * se_factor


def mde_of_arms(arms: Sequence[tuple[float, int]], alpha: float = 0.05, family: int = 1,
                power: float = POWER) -> float | None:
    """The MDE of a difference between two of ``arms`` — (sample sd, seeds) each, all compared in one verdict —
    by the module docstring's formula with the sd pooled over every arm (df = Σ (n − 1)) and the two smallest
    seed counts as n_a, n_b (the least powered pair: conservative). None without two arms of ≥ 2 seeds."""
    usable = sorted(((sd, n) for sd, n in arms if n >= 2), key=lambda arm: arm[1])
    if len(usable) < 2:
        return None
    df = sum(n - 1 for _, n in usable)
    sd = math.sqrt(sum((n - 1) * s * s for s, n in usable) / df)
    (_, na), (_, nb) = usable[:2]
    return mde_from_sd(sd, math.sqrt(1 / na + 1 / nb), df, alpha, family, power)


def detectable_ratio(ratio: float, ci_low: float, claim: float, alpha: float = 0.05,
                     power: float = POWER) -> float:
    """The ratio a "lower end of the (1 − alpha) interval ≥ ``claim``" rule detects with ``power``, given the
    interval's lower half-width on the log scale: σ = (log ratio − log ci_low) / z_{1−α/2}, and the detectable
    ratio is claim · exp((z_{1−α/2} + z_power) σ) — the ratio-scale MDE of a bootstrap interval (normal on the
    log scale)."""
    from statistics import NormalDist

    z = NormalDist().inv_cdf
    sigma = (math.log(ratio) - math.log(ci_low)) / z(1 - alpha / 2)
    return claim * math.exp((z(1 - alpha / 2) + z(power)) * sigma)


def clopper_pearson(k: int, n: int, alpha: float = 0.05) -> tuple[float, float]:
    """The exact (Clopper-Pearson) 1 − alpha interval of a binomial proportion k / n: lower, the p with
    P(X ≥ k) = alpha / 2; upper, the p with P(X ≤ k) = alpha / 2 — found by bisection on the binomial sums (to
    1e-12; both tails increase with p)."""

    def tail_at_least(p: float) -> float:  # P(X ≥ k)
        return sum(math.comb(n, x) * p**x * (1 - p) ** (n - x) for x in range(k, n + 1))

    def bisect(f, target: float) -> float:
        lo, hi = 0.0, 1.0
        while hi - lo > 1e-12:
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
        return (lo + hi) / 2

    lower = 0.0 if k == 0 else bisect(tail_at_least, alpha / 2)  # both tails increase with p
    upper = 1.0 if k == n else bisect(lambda p: tail_at_least(p) - math.comb(n, k) * p**k * (1 - p) ** (n - k),
                                      1 - alpha / 2)  # P(X ≥ k + 1) = 1 − P(X ≤ k)
    return lower, upper


def fisher_greater(events_a: int, n_a: int, events_b: int, n_b: int) -> float:
    """One-sided Fisher exact p that arm a has more events than arm b (hypergeometric upper tail)."""
    total, events = n_a + n_b, events_a + events_b
    denom = math.comb(total, n_a)
    return sum(math.comb(events, k) * math.comb(total - events, n_a - k)
               for k in range(events_a, min(events, n_a) + 1)) / denom
