"""Seed-level inference: one number per training seed (a contrast's accuracy difference, say), so that the
interval and the test speak about training-run variance: the sign test, the exact seed bootstrap, a seed contrast."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np
from scipy import stats as sps

from recurscope.interp.stats.intervals import BootstrapCI, _as_1d, _check_confidence, _check_resamples, _check_seed

# --------------------------------------------------------------------------------------------------------------
# Seed-level inference: one number per training seed (e.g. a contrast's accuracy difference), so the interval and
# the test speak about training-run variance, which per-item tests (McNemar) between two fixed models cannot.
# --------------------------------------------------------------------------------------------------------------

#: Up to this many seeds the bootstrap distribution is enumerated exactly (C(2n-1, n) distinct resamples: 6,435 at
#: 8), so the interval has no Monte Carlo error and needs no random seed.
EXACT_BOOTSTRAP_MAX = 8


@dataclass(frozen=True)
class SignTest:
    n_positive: int
    n_negative: int
    n_zero: int          # ties, dropped before the test (the usual sign-test convention)
    p_value: float       # exact two-sided binomial test of P(positive) = 1/2 on the non-zero signs


def sign_test(differences) -> SignTest:
    """Exact two-sided sign test over per-seed differences (scipy.stats.binomtest on the non-zero signs)."""
    d = _as_1d("differences", differences)
    if d.size == 0:
        raise ValueError("differences is empty; pass one difference per seed")
    pos, neg = int((d > 0).sum()), int((d < 0).sum())
    p = 1.0 if pos + neg == 0 else float(sps.binomtest(pos, pos + neg, 0.5, alternative="two-sided").pvalue)
    return SignTest(pos, neg, int(d.size - pos - neg), p)


def _weighted_quantile_inverted_cdf(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    """The smallest value whose cumulative weight reaches q (numpy's 'inverted_cdf' quantile, with weights)."""
    order = np.argsort(values, kind="stable")
    cum = np.cumsum(weights[order])
    i = int(np.searchsorted(cum, q * cum[-1] - 1e-12, side="left"))
    return float(values[order][min(i, len(values) - 1)])


def seed_bootstrap_ci(values, confidence: float = 0.95, statistic: Callable = np.mean, n_resamples: int = 99_999,
                      seed: int = 0) -> BootstrapCI:
    """Percentile bootstrap interval of `statistic` over seeds (one value per seed).

    With at most EXACT_BOOTSTRAP_MAX seeds the bootstrap distribution is enumerated exactly: every multiset of n
    seed indices with its multinomial probability n! / (prod c_i! n^n). Above that, scipy.stats.bootstrap
    (percentile, `n_resamples`, `seed`). BCa is not used: with a handful of seeds its jackknife is unstable."""
    from itertools import combinations_with_replacement
    from math import factorial

    x = _as_1d("values", values)
    confidence = _check_confidence(confidence)
    n = x.size
    if n == 0:
        raise ValueError("values is empty; pass one value per seed")
    estimate = float(statistic(x))
    if n == 1 or np.all(x == x[0]):
        why = "single seed" if n == 1 else "zero variance"
        return BootstrapCI(estimate, estimate, estimate, n, n, f"degenerate ({why})", 0, confidence, 0)
    alpha = 1 - confidence
    if n <= EXACT_BOOTSTRAP_MAX:
        stats_, weights = [], []
        for combo in combinations_with_replacement(range(n), n):
            counts = np.bincount(combo, minlength=n)
            stats_.append(float(statistic(x[list(combo)])))
            weights.append(factorial(n) / np.prod([factorial(int(c)) for c in counts]))
        stats_, weights = np.asarray(stats_), np.asarray(weights, dtype=float)
        low = _weighted_quantile_inverted_cdf(stats_, weights, alpha / 2)
        high = _weighted_quantile_inverted_cdf(stats_, weights, 1 - alpha / 2)
        return BootstrapCI(estimate, low, high, n, n, "percentile (exact enumeration)", 0, confidence,
                           len(stats_))
    seed = _check_seed(seed)
    res = sps.bootstrap((x,), statistic, n_resamples=_check_resamples(n_resamples), confidence_level=confidence,
                        method="percentile", random_state=np.random.default_rng(seed), vectorized=False)
    return BootstrapCI(estimate, float(res.confidence_interval.low), float(res.confidence_interval.high), n, n,
                       "percentile", seed, confidence, n_resamples)


@dataclass(frozen=True)
class SeedContrast:
    """A contrast summarised over seeds: mean of the per-seed differences, its seed-bootstrap interval and the
    exact sign test."""

    n_seeds: int
    mean: float
    low: float
    high: float
    confidence: float
    method: str
    n_positive: int
    n_negative: int
    n_zero: int
    sign_p: float

    def as_dict(self) -> dict:
        return asdict(self)


def seed_contrast(differences, confidence: float = 0.95) -> SeedContrast:
    """seed_bootstrap_ci (mean) and sign_test of one difference per seed."""
    ci = seed_bootstrap_ci(differences, confidence)
    st = sign_test(differences)
    return SeedContrast(ci.n_sources, ci.estimate, ci.low, ci.high, ci.confidence, ci.method, st.n_positive,
                        st.n_negative, st.n_zero, st.p_value)
