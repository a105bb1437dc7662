"""Head selection over a per-source score table J(l, h): per-source ranks, wins, leave-one-source-out, bootstrap
rank intervals, and Spearman agreement with a source-bootstrap interval."""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pandas as pd
from scipy import stats as sps

from recurscope.interp.stats.intervals import (
    _as_1d, _check_confidence, _check_method, _check_resamples, _check_seed, _run_bootstrap,
)

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


def _rank_desc(values: np.ndarray, axis: int = -1, ties: str = "min") -> np.ndarray:
    # Competition ranking ("min"): rank 1 = largest; tied heads share the better rank ("max": the worse one).
    return sps.rankdata(-np.asarray(values), method=ties, axis=axis).astype(int)


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
    full_worst = int(_rank_desc(values.mean(axis=0), ties="max")[j])
    n_sources = values.shape[0]
    if n_sources == 1:
        return RankInterval(key, full_rank, full_rank, full_worst, 1, values.shape[1], 0, confidence, seed,
                            "degenerate (single source)")

    def rank_of_unit(ties):
        def statistic(index, axis=-1):
            # index holds resampled source positions, shape (..., n_sources).
            means = values[np.asarray(index, dtype=int)].mean(axis=-2)
            return _rank_desc(means, axis=-1, ties=ties)[..., j].astype(float)
        return statistic

    # A tie reports the tie: the low end from the best rank a tied head shares, the high end from the worst, on the
    # same resamples (one seed), so an all-equal scan ranks every head [1, n] and names none.
    ends = [sps.bootstrap((np.arange(n_sources),), rank_of_unit(ties), n_resamples=n_resamples, vectorized=True,
                          confidence_level=confidence, method="percentile", rng=np.random.default_rng(seed))
            for ties in ("min", "max")]
    low = int(np.floor(ends[0].confidence_interval.low))
    high = max(int(np.ceil(ends[1].confidence_interval.high)), full_worst)
    return RankInterval(key, full_rank, low, high, n_sources, values.shape[1], n_resamples, confidence, seed)


def top_is_tied(scores: pd.DataFrame, *, source_col: str = "source", unit_cols: Sequence[str] = ("layer", "head"),
                score_col: str = "score") -> bool:
    """Whether the best mean score is shared by two or more heads (e.g. an all-equal scan): no head can be named."""
    matrix = _score_matrix(scores, source_col=source_col, unit_cols=unit_cols, score_col=score_col)
    means = matrix.to_numpy().mean(axis=0)
    return bool(len(means) > 1 and np.sum(means == means.max()) > 1)


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
