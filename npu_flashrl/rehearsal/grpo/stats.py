"""Paired statistics of `rehearse --grpo`: a variant against bf16, seed by seed.

Variants share seeds, prompts and the sampling stream, so the per-seed difference d_k = x_k(variant)
- x_k(bf16) cancels most of the luck of a run (which prompts, which random numbers). Its mean gets a
Student-t confidence interval (not a standard deviation), and the **minimum detectable difference**
MDD = (t_{1-a/2} + t_{power}) x SE: the smallest true difference the run finds with probability
`power` at this level. A verdict "no difference" is only as strong as its MDD, so it is printed
beside it.

The t quantiles come from the regularized incomplete beta function (Numerical Recipes' continued
fraction), bisected: no scipy.
"""
from __future__ import annotations

import math
from typing import Dict, List, Sequence

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


def paired(variant: Sequence[float], reference: Sequence[float], level: float) -> Dict[str, object]:
    """Paired comparison of per-seed values: the mean difference, its two-sided `level` confidence
    interval, the MDD and whether a difference was detected (the interval excludes 0)."""
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
    mdd = (t_ci + t_quantile(POWER, k - 1)) * se
    lo, hi = m - half, m + half
    return {"diff": m, "per_seed": d, "seeds": k, "level": level, "se": se, "ci": [lo, hi], "mdd": mdd,
            "detected": lo > 0 or hi < 0,
            "rule": f"mean of {k} per-seed differences +- t({1 - (1 - level) / 2:.4g}, {k - 1} df) x SE; MDD = "
                    f"(t_ci + t({POWER:g})) x SE, the difference found with {POWER:.0%} power"}
