"""Source-level intervals: the source bootstrap of a mean, of a paired difference and of a ratio, proportions
(binomial or source-cluster bootstrap), binomial intervals, and the tidy `summarise` table; and the input checks the
other statistics modules share."""
from __future__ import annotations

import inspect
import math
import warnings
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import numpy as np
import pandas as pd
from scipy import stats as sps

DEFAULT_RESAMPLES = 9999
_METHODS = {"bca": "BCa", "percentile": "percentile", "basic": "basic"}


# --------------------------------------------------------------------------------------------------------------
# Input checks
# --------------------------------------------------------------------------------------------------------------


def _as_1d(name: str, values, *, numeric: bool = True) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional (one entry per example), got shape {arr.shape}; "
                         f"flatten it or pass one column")
    if numeric:
        if arr.dtype == bool:
            arr = arr.astype(float)
        if not np.issubdtype(arr.dtype, np.number):
            raise ValueError(f"{name} must be numeric, got dtype {arr.dtype}; convert it with astype(float)")
        arr = arr.astype(float)
        if not np.all(np.isfinite(arr)):
            bad = int(np.sum(~np.isfinite(arr)))
            raise ValueError(f"{name} must be finite, got {bad} NaN/inf entries; drop those examples first "
                             f"(summarise() drops NaN per metric)")
    return arr


def _check_confidence(confidence: float) -> float:
    if not (0.0 < float(confidence) < 1.0):
        raise ValueError(f"confidence must be strictly between 0 and 1 (e.g. 0.95), got {confidence!r}")
    return float(confidence)


def _check_method(method: str) -> str:
    key = str(method).lower()
    if key not in _METHODS:
        raise ValueError(f"method must be one of {sorted(_METHODS.values())}, got {method!r}")
    return key


def _check_resamples(n_resamples: int) -> int:
    if int(n_resamples) < 100:
        raise ValueError(f"n_resamples must be at least 100 for a usable interval, got {n_resamples!r}")
    return int(n_resamples)


def _check_seed(seed) -> int:
    if seed is None or isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed must be an explicit integer so the interval can be reproduced, got {seed!r}")
    return int(seed)


def _accepts_axis(fn: Callable) -> bool:
    try:
        return "axis" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


# --------------------------------------------------------------------------------------------------------------
# Source bootstrap
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BootstrapCI:
    """A point estimate with a source-bootstrap interval. ``method`` says how the interval was obtained, including
    ``"degenerate (single source)"`` and ``"degenerate (zero variance)"`` where low == high == estimate."""

    estimate: float
    low: float
    high: float
    n_sources: int
    n_examples: int
    method: str
    seed: int
    confidence: float = 0.95
    n_resamples: int = 0

    @property
    def degenerate(self) -> bool:
        return self.method.startswith("degenerate")

    def as_dict(self) -> dict:
        return asdict(self)


def per_source_means(values, sources) -> pd.Series:
    """Mean of ``values`` within each source (index: source, sorted). This is the aggregation step every source
    bootstrap starts from."""
    vals = _as_1d("values", values)
    srcs = _as_1d("sources", sources, numeric=False)
    if len(vals) != len(srcs):
        raise ValueError(f"values and sources must have the same length (one source label per example), got "
                         f"{len(vals)} values and {len(srcs)} sources")
    if len(vals) == 0:
        raise ValueError("values is empty: need at least one example from one source")
    return pd.Series(vals).groupby(pd.Series(srcs), sort=True).mean()


def _run_bootstrap(data: tuple, statistic: Callable, *, vectorized: bool, paired: bool, estimate: float,
                   n_resamples: int, confidence: float, seed: int, method: str) -> tuple[float, float, str]:
    """Run scipy.stats.bootstrap and return (low, high, method actually used), handling degenerate cases."""
    def call(m: str):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", sps.DegenerateDataWarning)
            warnings.simplefilter("ignore", RuntimeWarning)
            return sps.bootstrap(data, statistic, n_resamples=n_resamples, vectorized=vectorized, paired=paired,
                                 confidence_level=confidence, method=m, rng=np.random.default_rng(seed))

    res = call(method)
    dist = np.asarray(res.bootstrap_distribution, dtype=float)
    if np.isnan(dist).any():
        # e.g. a Spearman resample with a constant column; an interval would silently drop those resamples.
        return np.nan, np.nan, f"undefined ({int(np.isnan(dist).sum())} resamples gave NaN)"
    scale = max(1.0, abs(estimate), *(float(np.max(np.abs(d))) for d in data))
    if np.ptp(dist) <= 1e-12 * scale:
        return estimate, estimate, "degenerate (zero variance)"
    low, high = float(res.confidence_interval.low), float(res.confidence_interval.high)
    if method == "bca" and not (np.isfinite(low) and np.isfinite(high)):
        res = call("percentile")
        return float(res.confidence_interval.low), float(res.confidence_interval.high), "percentile (BCa undefined)"
    return low, high, _METHODS[method]


def source_bootstrap_ci(values, sources, statistic: Callable = np.mean, n_resamples: int = DEFAULT_RESAMPLES,
                        confidence: float = 0.95, seed: int = 0, method: str = "BCa") -> BootstrapCI:
    """Estimate ``statistic`` over per-source means and its bootstrap interval, resampling sources.

    values: one number per example; sources: the source label of each example. Each source is first reduced to the
    mean of its examples; ``statistic`` (default mean) is then taken over sources and ``scipy.stats.bootstrap``
    resamples sources with ``rng=np.random.default_rng(seed)``. A single source or zero spread between sources gives
    low == high == estimate with ``method`` saying "degenerate (...)" instead of raising.
    """
    confidence, n_resamples, seed, key = (_check_confidence(confidence), _check_resamples(n_resamples),
                                          _check_seed(seed), _check_method(method))
    means = per_source_means(values, sources)
    per_source = means.to_numpy()
    n_examples = len(np.asarray(values))
    estimate = float(statistic(per_source))
    if len(per_source) == 1:
        return BootstrapCI(estimate, estimate, estimate, 1, n_examples, "degenerate (single source)", seed,
                           confidence, 0)
    low, high, used = _run_bootstrap((per_source,), statistic, vectorized=_accepts_axis(statistic), paired=False,
                                     estimate=estimate, n_resamples=n_resamples, confidence=confidence, seed=seed,
                                     method=key)
    return BootstrapCI(estimate, low, high, len(per_source), n_examples, used, seed, confidence, n_resamples)


def _check_binary(name: str, values) -> np.ndarray:
    arr = _as_1d(name, values)
    if not np.all(np.isin(arr, (0.0, 1.0))):
        raise ValueError(f"{name} must hold 0/1 outcomes for a proportion interval, got values such as "
                         f"{np.unique(arr)[:5].tolist()}; use source_bootstrap_ci for a continuous metric")
    return arr


def proportion_ci(values, sources, confidence: float = 0.95, seed: int = 0, n_resamples: int = DEFAULT_RESAMPLES,
                  method: str = "BCa", binomial_method: str = "wilson") -> BootstrapCI:
    """Interval for the proportion of 1s in 0/1 ``values`` (one per example) labelled by ``sources``.

    One example per source: binomial interval (``binomial_ci``, Wilson by default) over the examples. Several
    examples per source: source-cluster bootstrap of the source means (``source_bootstrap_ci``); if that is
    degenerate (all source means equal), the binomial interval with the sources as n. ``method`` names the one used.
    The estimate is the mean over sources (with one example per source, the plain proportion k/n)."""
    vals = _check_binary("values", values)
    means = per_source_means(vals, sources)
    per_source_n = pd.Series(vals).groupby(pd.Series(_as_1d("sources", sources, numeric=False))).size()
    confidence = _check_confidence(confidence)
    if int(per_source_n.max()) == 1:
        ci = binomial_ci(int(vals.sum()), len(vals), confidence=confidence, method=binomial_method)
        return BootstrapCI(ci.estimate, ci.low, ci.high, len(means), len(vals),
                           f"{_BINOMIAL_NAMES[binomial_method]} (one example per source)", _check_seed(seed),
                           confidence, 0)
    boot = source_bootstrap_ci(vals, sources, n_resamples=n_resamples, confidence=confidence, seed=seed,
                               method=method)
    if not boot.degenerate:
        return BootstrapCI(boot.estimate, boot.low, boot.high, boot.n_sources, boot.n_examples,
                           f"source-cluster bootstrap, {boot.method}", boot.seed, confidence, boot.n_resamples)
    n = len(means)
    ci = binomial_ci(int(round(boot.estimate * n)), n, confidence=confidence, method=binomial_method)
    return BootstrapCI(boot.estimate, ci.low, ci.high, n, len(vals),
                       f"{_BINOMIAL_NAMES[binomial_method]} over sources (bootstrap degenerate: every source has the "
                       f"same mean)", boot.seed, confidence, 0)


def paired_source_bootstrap_ci(a, b, sources, statistic: Callable = np.mean, n_resamples: int = DEFAULT_RESAMPLES,
                               confidence: float = 0.95, seed: int = 0, method: str = "BCa",
                               sources_b=None) -> BootstrapCI:
    """Interval for ``statistic(A) - statistic(B)`` where A and B are per-source means measured on the same sources.

    By default ``a`` and ``b`` are aligned per example (e.g. intervened and clean margin of the same pair) and share
    ``sources``. Pass ``sources_b`` when ``b`` has its own examples; both must then cover the same set of sources.
    Sources are resampled jointly (``paired=True``), so source-level variation common to both arms cancels.
    """
    confidence, n_resamples, seed, key = (_check_confidence(confidence), _check_resamples(n_resamples),
                                          _check_seed(seed), _check_method(method))
    mean_a = per_source_means(a, sources)
    mean_b = per_source_means(b, sources if sources_b is None else sources_b)
    if sources_b is None and len(np.asarray(a)) != len(np.asarray(b)):
        raise ValueError(f"a and b must be aligned per example when sources_b is not given, got {len(np.asarray(a))}"
                         f" and {len(np.asarray(b))} entries; pass sources_b for unaligned arms")
    if set(mean_a.index) != set(mean_b.index):
        only_a = sorted(map(str, set(mean_a.index) - set(mean_b.index)))[:5]
        only_b = sorted(map(str, set(mean_b.index) - set(mean_a.index)))[:5]
        raise ValueError(f"a and b must cover the same sources for a paired comparison; only in a: {only_a}, only in "
                         f"b: {only_b}; restrict both to the common sources")
    mean_b = mean_b.reindex(mean_a.index)
    arr_a, arr_b = mean_a.to_numpy(), mean_b.to_numpy()
    n_examples = len(np.asarray(a)) + (0 if sources_b is None else len(np.asarray(b)))
    estimate = float(statistic(arr_a) - statistic(arr_b))
    if len(arr_a) == 1:
        return BootstrapCI(estimate, estimate, estimate, 1, n_examples, "degenerate (single source)", seed,
                           confidence, 0)
    if _accepts_axis(statistic):
        def difference(x, y, axis=-1):
            return statistic(x, axis=axis) - statistic(y, axis=axis)
        vectorized = True
    else:
        def difference(x, y):
            return statistic(x) - statistic(y)
        vectorized = False
    low, high, used = _run_bootstrap((arr_a, arr_b), difference, vectorized=vectorized, paired=True,
                                     estimate=estimate, n_resamples=n_resamples, confidence=confidence, seed=seed,
                                     method=key)
    return BootstrapCI(estimate, low, high, len(arr_a), n_examples, used, seed, confidence, n_resamples)


def source_ratio_ci(a, b, sources, n_resamples: int = DEFAULT_RESAMPLES, confidence: float = 0.95, seed: int = 0,
                    method: str = "BCa") -> BootstrapCI:
    """Interval for mean(A) / mean(B), A and B per-source means of examples aligned per row (e.g. the shift of the
    top-k heads and of all heads on the same pairs, the recovery of Fig. 3c). Sources are resampled jointly, so a
    ratio of a quantity with itself is exactly 1 in every resample."""
    confidence, n_resamples, seed, key = (_check_confidence(confidence), _check_resamples(n_resamples),
                                          _check_seed(seed), _check_method(method))
    if len(np.asarray(a)) != len(np.asarray(b)):
        raise ValueError(f"a and b must be aligned per example, got {len(np.asarray(a))} and {len(np.asarray(b))} "
                         f"entries")
    mean_a = per_source_means(a, sources)
    mean_b = per_source_means(b, sources).reindex(mean_a.index)
    arr_a, arr_b = mean_a.to_numpy(), mean_b.to_numpy()
    if arr_b.mean() == 0:         # no effect to recover: the ratio is undefined, reported as such, never a crash
        return BootstrapCI(math.nan, math.nan, math.nan, len(arr_a), len(np.asarray(a)),
                           "undefined (the denominator's mean is 0)", seed, confidence, 0)
    estimate = float(arr_a.mean() / arr_b.mean())
    if len(arr_a) == 1:
        return BootstrapCI(estimate, estimate, estimate, 1, len(np.asarray(a)), "degenerate (single source)", seed,
                           confidence, 0)

    def ratio(x, y, axis=-1):
        return np.mean(x, axis=axis) / np.mean(y, axis=axis)
    low, high, used = _run_bootstrap((arr_a, arr_b), ratio, vectorized=True, paired=True, estimate=estimate,
                                     n_resamples=n_resamples, confidence=confidence, seed=seed, method=key)
    return BootstrapCI(estimate, low, high, len(arr_a), len(np.asarray(a)), used, seed, confidence, n_resamples)


def summarise(frame: pd.DataFrame, value_cols, by: Sequence[str] = (), source_col: str = "source",
              statistic: Callable = np.mean, n_resamples: int = DEFAULT_RESAMPLES, confidence: float = 0.95,
              seed: int = 0, method: str = "BCa", proportions: Sequence[str] = ()) -> pd.DataFrame:
    """Tidy table of source-bootstrap estimates: one row per group of ``by`` and per metric in ``value_cols``.
    Metrics named in ``proportions`` (0/1 outcomes) get ``proportion_ci`` instead (binomial interval with one
    example per source, source-cluster bootstrap with several; see the module docstring).

    Columns: *by, metric, estimate, low, high, n_sources, n_examples, method, seed, confidence. NaN values of a
    metric are dropped for that metric only (an experiment point that was not evaluated is not a zero).
    """
    if not isinstance(frame, pd.DataFrame):
        raise ValueError(f"frame must be a pandas DataFrame, got {type(frame).__name__}")
    value_cols = [value_cols] if isinstance(value_cols, str) else list(value_cols)
    by = [by] if isinstance(by, str) else list(by)
    missing = [c for c in [*value_cols, *by, source_col] if c not in frame.columns]
    if missing:
        raise ValueError(f"frame is missing columns {missing}; it has {list(frame.columns)}. Pass the right "
                         f"value_cols/by/source_col")
    if not value_cols:
        raise ValueError("value_cols must name at least one metric column")
    proportions = set([proportions] if isinstance(proportions, str) else proportions)
    records = []
    groups = frame.groupby(by, sort=True, dropna=False) if by else [((), frame)]
    for key, group in groups:
        key = key if isinstance(key, tuple) else (key,)
        for col in value_cols:
            sub = group[[col, source_col]].dropna(subset=[col])
            row = dict(zip(by, key))
            row["metric"] = col
            if len(sub) == 0:
                row.update(estimate=np.nan, low=np.nan, high=np.nan, n_sources=0, n_examples=0,
                           method="no data", seed=seed, confidence=confidence)
                records.append(row)
                continue
            if col in proportions:
                ci = proportion_ci(sub[col].to_numpy(), sub[source_col].to_numpy(), n_resamples=n_resamples,
                                   confidence=confidence, seed=seed, method=method)
            else:
                ci = source_bootstrap_ci(sub[col].to_numpy(), sub[source_col].to_numpy(), statistic=statistic,
                                         n_resamples=n_resamples, confidence=confidence, seed=seed, method=method)
            row.update(estimate=ci.estimate, low=ci.low, high=ci.high, n_sources=ci.n_sources,
                       n_examples=ci.n_examples, method=ci.method, seed=ci.seed, confidence=ci.confidence)
            records.append(row)
    return pd.DataFrame.from_records(records, columns=[*by, "metric", "estimate", "low", "high", "n_sources",
                                                       "n_examples", "method", "seed", "confidence"])



@dataclass(frozen=True)
class BinomialCI:
    estimate: float
    low: float
    high: float
    k: int
    n: int
    method: str
    confidence: float


_BINOMIAL_NAMES = {"wilson": "Wilson", "wilsoncc": "Wilson (continuity-corrected)", "exact": "Clopper-Pearson"}


def binomial_ci(k: int, n: int, confidence: float = 0.95, method: str = "wilson") -> BinomialCI:
    """Interval for a proportion k/n via scipy.stats.binomtest(k, n).proportion_ci. method: "wilson" (score
    interval, the default: good coverage near 0 and 1), "wilsoncc" (with continuity correction) or "exact"
    (Clopper-Pearson)."""
    confidence = _check_confidence(confidence)
    if method not in ("wilson", "wilsoncc", "exact"):
        raise ValueError(f"method must be 'wilson', 'wilsoncc' or 'exact', got {method!r}")
    if isinstance(k, bool) or isinstance(n, bool) or int(k) != k or int(n) != n:
        raise ValueError(f"k and n must be integers (counts), got k={k!r}, n={n!r}")
    k, n = int(k), int(n)
    if n < 1 or not (0 <= k <= n):
        raise ValueError(f"need n >= 1 and 0 <= k <= n, got k={k}, n={n}")
    ci = sps.binomtest(k, n).proportion_ci(confidence_level=confidence, method=method)
    return BinomialCI(k / n, float(ci.low), float(ci.high), k, n, method, confidence)
