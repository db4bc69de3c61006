"""Paired statistics of `rehearse --grpo`: a variant against bf16, seed by seed.

Variants share seeds, prompts and the sampling stream, so the per-seed difference d_k = x_k(variant)
- x_k(bf16) cancels most of the luck of a run (which prompts, which random numbers). Its mean gets a
Student-t confidence interval (not a standard deviation), and the **minimum detectable difference**
MDD = (t_{1-a/2} + t_{power}) x SE: the smallest true difference the run finds with probability
`power` at this level. A verdict "no difference" is only as strong as its MDD, so it is printed
beside it.

The MDD is exact for the t test: the noncentrality delta at which the two-sided test rejects with
probability `power` (`noncentral_t_cdf`, solved by bisection), times the standard error it is given.
That standard error need not be the comparison's own: a variant that tracks bf16 closely has nearly
coinciding samples (shared prompts and random numbers), and a real effect pulls them apart, so the
caller passes the largest SE of the comparisons that carry an effect (`report._paired`).

The t quantiles come from the regularized incomplete beta function (Numerical Recipes' continued
fraction), bisected; the noncentral t from its defining integral over the chi distribution
(Simpson's rule); a ratio of paired means gets Fieller's interval: no scipy (not in the stack).
"""
from __future__ import annotations

import functools
import math
from typing import Dict, List, Optional, Sequence

POWER = 0.8


def mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def std(xs: Sequence[float]) -> float:
    """Sample std (n - 1); 0 for one value."""
    if len(xs) < 2:
        return 0.0
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _betacf(a: float, b: float, x: float) -> float:
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
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
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: int) -> float:
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: int) -> float:
    """The p-quantile of Student's t with `df` degrees of freedom (0.5 < p < 1)."""
    if not 0.5 < p < 1.0 or df < 1:
        raise ValueError(f"t_quantile: need 0.5 < p < 1 and df >= 1, got p={p}, df={df}")
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _normal_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


SIMPSON_INTERVALS = 2000


def noncentral_t_cdf(t: float, df: int, delta: float) -> float:
    """P(T <= t) for T = (Z + delta) / sqrt(V / df), Z standard normal, V chi-square with `df` degrees
    of freedom: the integral of Phi(t u - delta) over the density of u = sqrt(V / df),
    g(u) = 2 (df/2)^(df/2) / Gamma(df/2) u^(df-1) exp(-df u^2 / 2), by Simpson's rule on [0, U] with
    U = 1 + 12 / sqrt(df) (beyond it g carries less than 1e-12 of the mass)."""
    if df < 1:
        raise ValueError(f"noncentral_t_cdf: need df >= 1, got {df}")
    nu = float(df)
    log_c = math.log(2.0) + (nu / 2.0) * math.log(nu / 2.0) - math.lgamma(nu / 2.0)
    upper = 1.0 + 12.0 / math.sqrt(nu)
    n = SIMPSON_INTERVALS
    h = upper / n
    total = 0.0
    for i in range(n + 1):
        u = i * h
        if u == 0.0:
            g = math.exp(log_c) if df == 1 else 0.0
        else:
            g = math.exp(log_c + (nu - 1.0) * math.log(u) - nu * u * u / 2.0)
        w = 1.0 if i in (0, n) else (4.0 if i % 2 else 2.0)
        total += w * g * _normal_cdf(t * u - delta)
    return min(1.0, max(0.0, total * h / 3.0))


def power_two_sided(delta: float, df: int, level: float) -> float:
    """Probability that the two-sided t test at `level` rejects when the true mean is delta SEs."""
    t_ci = t_quantile(1.0 - (1.0 - level) / 2.0, df)
    return 1.0 - noncentral_t_cdf(t_ci, df, delta) + noncentral_t_cdf(-t_ci, df, delta)


@functools.lru_cache(maxsize=64)
def detectable_delta(df: int, level: float, power: float = POWER) -> float:
    """The noncentrality (true mean / SE) the two-sided t test at `level` finds with probability `power`
    (cached: a run asks for a few (df, level) pairs many times)."""
    lo, hi = 0.0, 1.0
    while power_two_sided(hi, df, level) < power:
        hi *= 2.0
        if hi > 1e6:
            raise ValueError(f"detectable_delta: no noncentrality reaches power {power} at df={df}")
    for _ in range(50):
        mid = 0.5 * (lo + hi)
        if power_two_sided(mid, df, level) < power:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def paired(variant: Sequence[float], reference: Sequence[float], level: float,
           power_se: Optional[float] = None, power_se_source: str = "") -> Dict[str, object]:
    """Paired comparison of per-seed values: the mean difference, its two-sided `level` confidence
    interval, the MDD and whether a difference was detected (the interval excludes 0).

    The MDD is detectable_delta x the SE the power is computed with: `power_se` when given (the
    caller's SE under an effect, named by `power_se_source`) if larger than this comparison's own,
    else its own."""
    if len(variant) != len(reference):
        raise ValueError(f"paired: {len(variant)} values against {len(reference)}: the seeds must pair")
    d: List[float] = [a - b for a, b in zip(variant, reference)]
    k = len(d)
    m = mean(d)
    if k < 2:
        return {"diff": m, "per_seed": d, "seeds": k, "level": level, "se": float("nan"), "ci": [float("-inf"),
                float("inf")], "mdd": float("inf"), "detected": False, "rule": "one seed: no interval"}
    se = std(d) / math.sqrt(k)
    t_ci = t_quantile(1.0 - (1.0 - level) / 2.0, k - 1)
    half = t_ci * se
    delta = detectable_delta(k - 1, level)
    if power_se is None:
        se_p, source = se, power_se_source or "this comparison's own SE"
    elif power_se > se:
        se_p, source = power_se, power_se_source or "given"
    else:
        se_p, source = se, f"this comparison's own SE, larger than {power_se_source or 'the one given'}"
    lo, hi = m - half, m + half
    return {"diff": m, "per_seed": d, "seeds": k, "level": level, "se": se, "ci": [lo, hi],
            "mdd": delta * se_p, "power_se": se_p, "power_se_source": source, "delta": delta,
            "detected": lo > 0 or hi < 0,
            "rule": f"mean of {k} per-seed differences +- t({1 - (1 - level) / 2:.4g}, {k - 1} df) x SE; MDD = "
                    f"delta x SE_power, delta = {delta:.3f} the noncentrality at which the two-sided t test "
                    f"rejects with {POWER:.0%} power (noncentral t, {k - 1} df); SE_power: {source}"}


def fieller(num: Sequence[float], den: Sequence[float], level: float) -> Dict[str, object]:
    """The ratio mean(num) / mean(den) of paired per-seed values, with Fieller's `level` interval: the
    set of R for which the paired t test of num_k - R den_k does not reject. Bounded only when mean(den)
    itself is resolved (its own t statistic beyond the critical value); otherwise the interval is
    reported unbounded."""
    if len(num) != len(den):
        raise ValueError(f"fieller: {len(num)} values against {len(den)}: the seeds must pair")
    k = len(num)
    a, b = mean(num), mean(den)
    ratio = a / b if b != 0 else float("nan")
    per_seed = [x / y if y != 0 else float("nan") for x, y in zip(num, den)]
    out: Dict[str, object] = {"ratio": ratio, "per_seed": per_seed, "seeds": k, "level": level}
    if k < 2:
        out.update(ci=[float("-inf"), float("inf")], bounded=False)
        return out
    t2 = t_quantile(1.0 - (1.0 - level) / 2.0, k - 1) ** 2
    ma, mb = a, b
    s11 = sum((x - ma) ** 2 for x in num) / (k - 1) / k
    s22 = sum((y - mb) ** 2 for y in den) / (k - 1) / k
    s12 = sum((x - ma) * (y - mb) for x, y in zip(num, den)) / (k - 1) / k
    qa = b * b - t2 * s22
    qb = a * b - t2 * s12
    qc = a * a - t2 * s11
    disc = qb * qb - qa * qc
    if qa <= 0 or disc < 0:
        out.update(ci=[float("-inf"), float("inf")], bounded=False)
        return out
    r = math.sqrt(disc)
    out.update(ci=[(qb - r) / qa, (qb + r) / qa], bounded=True)
    return out
