"""Statistics for recurscope results, built on scipy.stats: source-level bootstrap intervals, exact McNemar tests,
binomial intervals, and the head-selection summaries (per-source ranks, wins, leave-one-source-out, rank intervals).

The statistical unit is the source passage (How Linear Attention Remembers, Sec. 2.3 and appendix B): examples are
first averaged within each source and intervals come from resampling sources, so a source with many examples does
not outweigh a source with few.

Bootstrap method: BCa by default. With 16 to 128 sources the bootstrap distribution of a mean margin shift is often
skewed and the plain percentile interval under-covers; BCa corrects for bias and skew (second-order accurate), and it
is scipy's default. When BCa cannot be computed (scipy returns NaN, e.g. for a statistic that takes very few distinct
values) we rerun with the same seed as a percentile interval and record ``method="percentile (BCa undefined)"``.
Rank intervals are always percentile intervals, because ranks are discrete and the BCa jackknife is not meaningful
for them.

Proportions (0/1 outcomes: recall, donor-answer rate, break rate) use ``proportion_ci``:
- every source contributes one example: the examples are independent, and the interval is a binomial one (Wilson
  score by default, Clopper-Pearson with ``binomial_method="exact"``) from scipy.stats.binomtest. A bootstrap there
  would be an example bootstrap, whose interval collapses to zero width at 0% and 100% (e.g. 32/32 gives
  [100%, 100%] where the exact interval is [89.1%, 100%]);
- sources contribute several examples: a source-cluster bootstrap (BCa, else percentile) of the source means,
  because examples of one source are not independent. When every source has the same mean (e.g. all at 100%) the
  bootstrap has nothing to resample, and the Wilson interval with the number of sources as n is used instead
  (``method`` says so): a source is at least one independent observation.
Continuous metrics (margin shifts) always use the source bootstrap.
"""
from __future__ import annotations

import inspect
import warnings
from dataclasses import asdict, dataclass
from typing import Callable, Hashable, Iterable, Optional, Sequence

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
    if arr_b.mean() == 0:
        raise ValueError("the denominator's mean is 0: the ratio is undefined (no effect to recover)")
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


# --------------------------------------------------------------------------------------------------------------
# Paired and binomial tests
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class McNemarResult:
    """Exact McNemar test of two arms on the same items. b01: items A got wrong and B got right; b10: A right, B
    wrong. accuracy_difference = accuracy_a - accuracy_b = (b10 - b01) / n."""

    n: int
    b01: int
    b10: int
    both_correct: int
    both_wrong: int
    p_value: float
    accuracy_a: float
    accuracy_b: float
    accuracy_difference: float

    def as_dict(self) -> dict:
        return asdict(self)


def _as_correct(name: str, values) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional (one entry per item), got shape {arr.shape}")
    if arr.dtype != bool:
        if not np.issubdtype(arr.dtype, np.number) or not np.all(np.isin(arr, (0, 1))):
            raise ValueError(f"{name} must hold booleans or 0/1 (item answered correctly), got values such as "
                             f"{np.unique(arr)[:5].tolist()}")
        arr = arr.astype(bool)
    return arr


def mcnemar_exact(correct_a, correct_b) -> McNemarResult:
    """Exact two-sided McNemar test: a binomial test (p = 1/2) on the discordant pairs via scipy.stats.binomtest.
    With no discordant pairs the p-value is 1."""
    a = _as_correct("correct_a", correct_a)
    b = _as_correct("correct_b", correct_b)
    if len(a) != len(b):
        raise ValueError(f"correct_a and correct_b must be paired item by item, got {len(a)} and {len(b)} items")
    if len(a) == 0:
        raise ValueError("correct_a is empty: need at least one paired item")
    b01 = int(np.sum(~a & b))
    b10 = int(np.sum(a & ~b))
    discordant = b01 + b10
    p_value = 1.0 if discordant == 0 else float(sps.binomtest(b01, discordant, 0.5).pvalue)
    n = len(a)
    acc_a, acc_b = float(a.mean()), float(b.mean())
    return McNemarResult(n, b01, b10, int(np.sum(a & b)), int(np.sum(~a & ~b)), p_value, acc_a, acc_b,
                         (b10 - b01) / n)


def mcnemar_table(frame: pd.DataFrame, *, arm_col: str, correct_col: str, item_col: str, reference,
                  by: Sequence[str] = ()) -> pd.DataFrame:
    """McNemar tests of every arm against ``reference`` within each group of ``by``, pairing rows on ``item_col``
    (e.g. the QED strength test: every strength s against s = 1 at each length, on the same 500 samples).

    Columns: *by, arm, reference, n, accuracy, accuracy_reference, difference_pp (arm minus reference, percentage
    points), b01 (items the arm got wrong and the reference right), b10 (arm right, reference wrong), p_value.
    """
    by = [by] if isinstance(by, str) else list(by)
    missing = [c for c in [arm_col, correct_col, item_col, *by] if c not in frame.columns]
    if missing:
        raise ValueError(f"frame is missing columns {missing}; it has {list(frame.columns)}")
    if reference not in set(frame[arm_col]):
        raise ValueError(f"reference arm {reference!r} does not occur in column {arm_col!r}; arms present: "
                         f"{sorted(map(str, set(frame[arm_col])))}")
    dup = frame.duplicated([*by, arm_col, item_col])
    if dup.any():
        raise ValueError(f"each (group, arm, item) must occur once for a paired test, got {int(dup.sum())} "
                         f"duplicates of {[*by, arm_col, item_col]}; deduplicate first")
    records = []
    groups = frame.groupby(by, sort=True) if by else [((), frame)]
    for key, group in groups:
        key = key if isinstance(key, tuple) else (key,)
        ref = group[group[arm_col] == reference].set_index(item_col)[correct_col]
        if len(ref) == 0:
            raise ValueError(f"group {dict(zip(by, key))} has no rows for the reference arm {reference!r}")
        for arm in pd.unique(group[arm_col]):
            if arm == reference:
                continue
            this = group[group[arm_col] == arm].set_index(item_col)[correct_col]
            if set(this.index) != set(ref.index):
                raise ValueError(f"arm {arm!r} in group {dict(zip(by, key))} was scored on different items than the "
                                 f"reference ({len(set(this.index) ^ set(ref.index))} items differ); a paired test "
                                 f"needs the same items")
            res = mcnemar_exact(this.to_numpy(), ref.reindex(this.index).to_numpy())
            records.append({**dict(zip(by, key)), "arm": arm, "reference": reference, "n": res.n,
                            "accuracy": res.accuracy_a, "accuracy_reference": res.accuracy_b,
                            "difference_pp": 100.0 * res.accuracy_difference, "b01": res.b01, "b10": res.b10,
                            "p_value": res.p_value})
    return pd.DataFrame.from_records(records, columns=[*by, "arm", "reference", "n", "accuracy", "accuracy_reference",
                                                       "difference_pp", "b01", "b10", "p_value"])


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


# --------------------------------------------------------------------------------------------------------------
# Head selection over a per-source score table J(l, h)
# --------------------------------------------------------------------------------------------------------------


def _score_matrix(scores: pd.DataFrame, *, source_col: str, unit_cols: Sequence[str], score_col: str) -> pd.DataFrame:
    """Pivot to sources × units, insisting that every source scored every unit exactly once."""
    if not isinstance(scores, pd.DataFrame):
        raise ValueError(f"scores must be a pandas DataFrame, got {type(scores).__name__}")
    unit_cols = list(unit_cols)
    missing = [c for c in [source_col, *unit_cols, score_col] if c not in scores.columns]
    if missing:
        raise ValueError(f"scores is missing columns {missing}; expected columns {[source_col, *unit_cols, score_col]}"
                         f", got {list(scores.columns)}")
    if len(scores) == 0:
        raise ValueError("scores is empty: need at least one (source, head) score")
    dup = scores.duplicated([source_col, *unit_cols])
    if dup.any():
        raise ValueError(f"scores has {int(dup.sum())} duplicate (source, layer, head) rows; each source must score "
                         f"each head once")
    values = pd.to_numeric(scores[score_col], errors="coerce")
    if values.isna().any():
        raise ValueError(f"column {score_col!r} must be numeric and non-missing, got {int(values.isna().sum())} "
                         f"missing/non-numeric entries")
    frame = scores.assign(**{score_col: values.astype(float)})
    matrix = frame.pivot(index=source_col, columns=unit_cols, values=score_col).sort_index()
    matrix = matrix.sort_index(axis=1)
    holes = int(matrix.isna().to_numpy().sum())
    if holes:
        raise ValueError(f"scores is not complete: {holes} (source, head) combinations are missing; every source "
                         f"must score every head")
    return matrix


def _rank_desc(values: np.ndarray, axis: int = -1) -> np.ndarray:
    # Competition ranking ("min"): rank 1 = largest; tied heads share the better rank.
    return sps.rankdata(-np.asarray(values), method="min", axis=axis).astype(int)


def rank_per_source(scores: pd.DataFrame, *, source_col: str = "source", unit_cols: Sequence[str] = ("layer", "head"),
                    score_col: str = "score") -> pd.DataFrame:
    """The score table with a ``rank`` column: each head's rank within its source, 1 = largest score, ties share
    the better rank (competition ranking via scipy.stats.rankdata)."""
    matrix = _score_matrix(scores, source_col=source_col, unit_cols=unit_cols, score_col=score_col)
    ranks = _rank_desc(matrix.to_numpy(), axis=1)
    # The long table built from arrays: DataFrame.stack over (layer, head) columns costs ~1 s per 100 heads.
    units = matrix.columns.to_frame(index=False)
    n_sources, n_units = ranks.shape
    long = pd.DataFrame({source_col: np.repeat(matrix.index.to_numpy(), n_units),
                         **{c: np.tile(units[c].to_numpy(), n_sources) for c in units.columns},
                         "rank": ranks.ravel()})
    return scores.merge(long, on=[source_col, *unit_cols], how="left")


def wins_per_head(scores: pd.DataFrame, *, source_col: str = "source", unit_cols: Sequence[str] = ("layer", "head"),
                  score_col: str = "score") -> pd.DataFrame:
    """For every head: on how many sources it ranks first (ties at the top count for every tied head), with its
    mean score. Sorted by wins, then mean score, descending. Columns: *unit_cols, wins, n_sources, mean_score."""
    matrix = _score_matrix(scores, source_col=source_col, unit_cols=unit_cols, score_col=score_col)
    wins = (_rank_desc(matrix.to_numpy(), axis=1) == 1).sum(axis=0)
    out = matrix.columns.to_frame(index=False)
    out["wins"] = wins.astype(int)
    out["n_sources"] = len(matrix)
    out["mean_score"] = matrix.mean(axis=0).to_numpy()
    return out.sort_values(["wins", "mean_score"], ascending=False, kind="stable").reset_index(drop=True)


def _unit_key(columns: pd.Index, j: int) -> tuple:
    key = columns[j]
    key = tuple(key) if isinstance(key, tuple) else (key,)
    return tuple(k.item() if isinstance(k, np.generic) else k for k in key)


@dataclass(frozen=True)
class LeaveOneSourceOut:
    """Winner of the mean score on all sources, and the winner when each source is left out in turn."""

    winner: tuple
    stable: bool
    n_stable: int
    n_sources: int
    per_source: pd.DataFrame  # left_out, winner, winner_score, runner_up, runner_up_score, same_as_full


def leave_one_source_out_winner(scores: pd.DataFrame, *, source_col: str = "source",
                                unit_cols: Sequence[str] = ("layer", "head"),
                                score_col: str = "score") -> LeaveOneSourceOut:
    """Leave each source out in turn and recompute the head with the largest mean score; ``stable`` is True when
    every leave-one-out winner equals the full-data winner (the appendix B stability check). Ties go to the first
    head in (layer, head) order."""
    matrix = _score_matrix(scores, source_col=source_col, unit_cols=unit_cols, score_col=score_col)
    values = matrix.to_numpy()
    n_sources = values.shape[0]
    if n_sources < 2:
        raise ValueError(f"leave-one-source-out needs at least 2 sources, got {n_sources}")
    if values.shape[1] < 2:
        raise ValueError(f"leave-one-source-out needs at least 2 heads to choose between, got {values.shape[1]}")
    full = _unit_key(matrix.columns, int(np.argmax(values.mean(axis=0))))
    rows = []
    for i, source in enumerate(matrix.index):
        kept = np.delete(values, i, axis=0).mean(axis=0)
        order = np.argsort(-kept, kind="stable")
        winner = _unit_key(matrix.columns, int(order[0]))
        rows.append({"left_out": source, "winner": winner, "winner_score": float(kept[order[0]]),
                     "runner_up": _unit_key(matrix.columns, int(order[1])), "runner_up_score": float(kept[order[1]]),
                     "same_as_full": winner == full})
    per_source = pd.DataFrame(rows)
    n_stable = int(per_source["same_as_full"].sum())
    return LeaveOneSourceOut(full, n_stable == n_sources, n_stable, n_sources, per_source)


@dataclass(frozen=True)
class RankInterval:
    unit: tuple
    rank: int          # rank of the unit's mean score over all sources
    low: int           # percentile bounds of the bootstrap rank, floor/ceil to whole ranks
    high: int
    n_sources: int
    n_units: int
    n_resamples: int
    confidence: float
    seed: int
    method: str = "percentile"


def bootstrap_rank_interval(scores: pd.DataFrame, unit, *, source_col: str = "source",
                            unit_cols: Sequence[str] = ("layer", "head"), score_col: str = "score",
                            n_resamples: int = 2000, confidence: float = 0.95, seed: int = 0) -> RankInterval:
    """Percentile bootstrap interval of one head's rank (1 = largest mean score), resampling sources with
    scipy.stats.bootstrap. "Rank interval [1, 1]" in appendix C means the head ranks first in (almost) every
    resample. ``unit`` is the (layer, head) tuple."""
    confidence, n_resamples, seed = _check_confidence(confidence), _check_resamples(n_resamples), _check_seed(seed)
    matrix = _score_matrix(scores, source_col=source_col, unit_cols=unit_cols, score_col=score_col)
    key = tuple(unit) if isinstance(unit, (tuple, list)) else (unit,)
    keys = [_unit_key(matrix.columns, j) for j in range(matrix.shape[1])]
    if key not in keys:
        raise ValueError(f"unit {key} is not among the scored heads ({len(keys)} heads, e.g. {keys[:3]}); pass a "
                         f"(layer, head) tuple present in scores")
    j = keys.index(key)
    values = matrix.to_numpy()
    full_rank = int(_rank_desc(values.mean(axis=0))[j])
    n_sources = values.shape[0]
    if n_sources == 1:
        return RankInterval(key, full_rank, full_rank, full_rank, 1, values.shape[1], 0, confidence, seed,
                            "degenerate (single source)")

    def rank_of_unit(index, axis=-1):
        # index holds resampled source positions, shape (..., n_sources).
        means = values[np.asarray(index, dtype=int)].mean(axis=-2)
        return _rank_desc(means, axis=-1)[..., j].astype(float)

    res = sps.bootstrap((np.arange(n_sources),), rank_of_unit, n_resamples=n_resamples, vectorized=True,
                        confidence_level=confidence, method="percentile", rng=np.random.default_rng(seed))
    low = int(np.floor(res.confidence_interval.low))
    high = int(np.ceil(res.confidence_interval.high))
    return RankInterval(key, full_rank, low, high, n_sources, values.shape[1], n_resamples, confidence, seed)


# --------------------------------------------------------------------------------------------------------------
# Rank correlation
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpearmanCI:
    rho: float
    p_value: float
    low: float
    high: float
    n: int            # number of points correlated (units, or rows when units is None)
    n_sources: int
    method: str
    seed: int
    confidence: float


def spearman_with_ci(x, y, sources, units=None, n_resamples: int = 2000, confidence: float = 0.95, seed: int = 0,
                     method: str = "BCa") -> SpearmanCI:
    """scipy.stats.spearmanr of x and y with a source-bootstrap interval.

    Without ``units`` the correlation is over all rows and sources are resampled as clusters (all rows of a drawn
    source come along). With ``units`` (e.g. a head id per row) x and y are first averaged per unit over the drawn
    sources and the correlation is across units; this is the appendix C write-vs-read rank correlation over heads,
    and every source must then score every unit. The p-value is spearmanr's and treats the points as independent.
    """
    confidence, n_resamples, seed, key = (_check_confidence(confidence), _check_resamples(n_resamples),
                                          _check_seed(seed), _check_method(method))
    xs, ys = _as_1d("x", x), _as_1d("y", y)
    srcs = _as_1d("sources", sources, numeric=False)
    if not (len(xs) == len(ys) == len(srcs)):
        raise ValueError(f"x, y and sources must have the same length, got {len(xs)}, {len(ys)}, {len(srcs)}")
    source_ids, source_pos = np.unique(srcs, return_inverse=True)
    n_sources = len(source_ids)

    if units is not None:
        us = _as_1d("units", units, numeric=False)
        if len(us) != len(xs):
            raise ValueError(f"units must have one entry per row like x, got {len(us)} for {len(xs)} rows")
        frame = pd.DataFrame({"s": source_pos, "u": us, "x": xs, "y": ys})
        if frame.duplicated(["s", "u"]).any():
            raise ValueError("each (source, unit) pair must occur once in x/y; average repeated rows first")
        mx = frame.pivot(index="s", columns="u", values="x")
        my = frame.pivot(index="s", columns="u", values="y")
        if mx.isna().to_numpy().any():
            raise ValueError("with units, every source must score every unit (the table has holes)")
        mx, my = mx.to_numpy(), my.to_numpy()

        def rho_of(index):
            idx = np.asarray(index, dtype=int)
            return sps.spearmanr(mx[idx].mean(axis=0), my[idx].mean(axis=0)).statistic

        full = sps.spearmanr(mx.mean(axis=0), my.mean(axis=0))
        n_points = mx.shape[1]
    else:
        rows_of = [np.flatnonzero(source_pos == s) for s in range(n_sources)]

        def rho_of(index):
            rows = np.concatenate([rows_of[int(s)] for s in index])
            return sps.spearmanr(xs[rows], ys[rows]).statistic

        full = sps.spearmanr(xs, ys)
        n_points = len(xs)

    rho, p_value = float(full.statistic), float(full.pvalue)
    if not np.isfinite(rho):
        return SpearmanCI(rho, p_value, np.nan, np.nan, n_points, n_sources, "undefined (constant input)", seed,
                          confidence)
    if n_sources == 1:
        return SpearmanCI(rho, p_value, rho, rho, n_points, 1, "degenerate (single source)", seed, confidence)
    with warnings.catch_warnings():
        # A resample may make x or y constant; spearmanr then warns and returns NaN, handled below.
        warnings.simplefilter("ignore", sps.ConstantInputWarning)
        low, high, used = _run_bootstrap((np.arange(n_sources, dtype=float),), rho_of, vectorized=False,
                                         paired=False, estimate=rho, n_resamples=n_resamples, confidence=confidence,
                                         seed=seed, method=key)
    return SpearmanCI(rho, p_value, low, high, n_points, n_sources, used, seed, confidence)


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
