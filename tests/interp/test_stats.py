"""Tests for interp.stats against independent computations (scipy.stats.binom/beta, closed-form Wilson interval,
pandas group means, normal theory) and hand-made head tables whose answers are known."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps

from recurscope.interp import stats as S


# ---------------------------------------------------------------------------------------------------------------
# McNemar
# ---------------------------------------------------------------------------------------------------------------


def _paired_arrays(b01: int, b10: int, both_correct: int, both_wrong: int, seed: int = 0):
    a = [0] * b01 + [1] * b10 + [1] * both_correct + [0] * both_wrong
    b = [1] * b01 + [0] * b10 + [1] * both_correct + [0] * both_wrong
    order = np.random.default_rng(seed).permutation(len(a))
    return np.array(a)[order], np.array(b)[order]


def _exact_mcnemar_reference(b01: int, b10: int) -> float:
    n = b01 + b10
    if n == 0:
        return 1.0
    return min(1.0, 2.0 * sps.binom.cdf(min(b01, b10), n, 0.5))


@pytest.mark.parametrize("b01,b10,cc,ww", [(3, 12, 40, 5), (12, 3, 0, 0), (7, 7, 10, 10), (0, 9, 5, 1), (1, 0, 3, 3),
                                            (25, 40, 400, 35)])
def test_mcnemar_matches_binomial_reference(b01, b10, cc, ww):
    a, b = _paired_arrays(b01, b10, cc, ww)
    res = S.mcnemar_exact(a, b)
    assert (res.b01, res.b10, res.both_correct, res.both_wrong) == (b01, b10, cc, ww)
    assert res.n == b01 + b10 + cc + ww
    assert res.p_value == pytest.approx(_exact_mcnemar_reference(b01, b10), rel=1e-12)
    assert res.accuracy_difference == pytest.approx(a.mean() - b.mean())
    assert res.accuracy_difference == pytest.approx((b10 - b01) / res.n)


def test_mcnemar_known_value_and_symmetry():
    # 3 vs 12 discordant: p = 2 * P(X <= 3), X ~ Bin(15, 1/2) = 2 * 576 / 32768
    a, b = _paired_arrays(3, 12, 20, 20)
    assert S.mcnemar_exact(a, b).p_value == pytest.approx(2 * 576 / 2 ** 15)
    assert S.mcnemar_exact(b, a).p_value == pytest.approx(S.mcnemar_exact(a, b).p_value)
    same = S.mcnemar_exact([1, 0, 1], [1, 0, 1])
    assert same.p_value == 1.0 and same.b01 == same.b10 == 0


def test_mcnemar_against_statsmodels_if_installed():
    sm = pytest.importorskip("statsmodels.stats.contingency_tables")
    a, b = _paired_arrays(9, 21, 50, 20)
    table = [[20, 9], [21, 50]]  # rows a wrong/right, columns b wrong/right
    assert S.mcnemar_exact(a, b).p_value == pytest.approx(sm.mcnemar(table, exact=True).pvalue)


def test_mcnemar_rejects_bad_input():
    with pytest.raises(ValueError, match="paired item by item"):
        S.mcnemar_exact([1, 0], [1, 0, 1])
    with pytest.raises(ValueError, match="0/1"):
        S.mcnemar_exact([1, 2], [1, 0])


def test_mcnemar_table_pairs_items_within_groups():
    rng = np.random.default_rng(3)
    rows = []
    for length in (4096, 8192):
        truth = {s: rng.random(40) < p for s, p in ((1.0, 0.6), (0.0, 0.4), (2.0, 0.7))}
        for s, correct in truth.items():
            # Shuffle row order so pairing must go through the item id, not the row position.
            for item in rng.permutation(40):
                rows.append({"length": length, "strength": s, "item": int(item), "correct": bool(correct[item])})
    frame = pd.DataFrame(rows)
    table = S.mcnemar_table(frame, arm_col="strength", correct_col="correct", item_col="item", reference=1.0,
                            by=["length"])
    assert len(table) == 4 and set(table["arm"]) == {0.0, 2.0}
    for row in table.itertuples():
        sub = frame[frame["length"] == row.length]
        arm = sub[sub["strength"] == row.arm].set_index("item")["correct"].sort_index()
        ref = sub[sub["strength"] == 1.0].set_index("item")["correct"].sort_index()
        b01 = int((~arm & ref).sum())
        b10 = int((arm & ~ref).sum())
        assert (row.b01, row.b10) == (b01, b10)
        assert row.p_value == pytest.approx(_exact_mcnemar_reference(b01, b10))
        assert row.difference_pp == pytest.approx(100 * (arm.mean() - ref.mean()))

    with pytest.raises(ValueError, match="different items"):
        S.mcnemar_table(frame[~((frame["strength"] == 0.0) & (frame["item"] == 3))], arm_col="strength",
                        correct_col="correct", item_col="item", reference=1.0, by=["length"])


# ---------------------------------------------------------------------------------------------------------------
# Binomial intervals
# ---------------------------------------------------------------------------------------------------------------


def test_wilson_interval_for_8_of_10():
    ci = S.binomial_ci(8, 10)
    assert (round(ci.low, 4), round(ci.high, 4)) == (0.4902, 0.9433)  # published Wilson score interval
    z = sps.norm.ppf(0.975)
    p, n = 0.8, 10
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    assert ci.low == pytest.approx(centre - half, rel=1e-10)
    assert ci.high == pytest.approx(centre + half, rel=1e-10)
    assert ci.estimate == 0.8


@pytest.mark.parametrize("k,n", [(8, 10), (0, 20), (20, 20), (213, 500)])
def test_exact_interval_is_clopper_pearson(k, n):
    ci = S.binomial_ci(k, n, method="exact", confidence=0.9)
    low = 0.0 if k == 0 else sps.beta.ppf(0.05, k, n - k + 1)
    high = 1.0 if k == n else sps.beta.ppf(0.95, k + 1, n - k)
    assert ci.low == pytest.approx(low, abs=1e-9)
    assert ci.high == pytest.approx(high, abs=1e-9)


def test_binomial_ci_rejects_bad_counts():
    for k, n in ((11, 10), (-1, 5), (1, 0), (1.5, 3)):
        with pytest.raises(ValueError, match="k"):
            S.binomial_ci(k, n)
    with pytest.raises(ValueError, match="method"):
        S.binomial_ci(1, 2, method="agresti")


# ---------------------------------------------------------------------------------------------------------------
# Source bootstrap
# ---------------------------------------------------------------------------------------------------------------


def test_bootstrap_contains_true_mean_and_is_deterministic():
    rng = np.random.default_rng(11)
    sources = np.repeat(np.arange(300), 4)
    values = 2.0 + rng.normal(0, 1, 300)[sources] + rng.normal(0, 0.5, len(sources))
    first = S.source_bootstrap_ci(values, sources, n_resamples=2000, seed=5)
    again = S.source_bootstrap_ci(values, sources, n_resamples=2000, seed=5)
    other = S.source_bootstrap_ci(values, sources, n_resamples=2000, seed=6)
    assert first == again
    assert (first.low, first.high) != (other.low, other.high)
    assert first.low < 2.0 < first.high
    assert (first.n_sources, first.n_examples, first.method, first.seed) == (300, 1200, "BCa", 5)


def test_percentile_interval_matches_normal_theory():
    rng = np.random.default_rng(2)
    values = rng.normal(0.0, 3.0, 400)
    ci = S.source_bootstrap_ci(values, np.arange(400), n_resamples=4000, seed=1, method="percentile")
    se = values.std(ddof=1) / math.sqrt(400)
    assert ci.method == "percentile"
    assert ci.estimate == pytest.approx(values.mean())
    assert ci.low == pytest.approx(values.mean() - 1.96 * se, abs=0.15 * se)
    assert ci.high == pytest.approx(values.mean() + 1.96 * se, abs=0.15 * se)


def test_sources_are_the_unit_not_examples():
    # 100 examples at 0 from source "big" and a single example at 1 from source "small": per-source mean is 0.5.
    values = np.r_[np.zeros(100), 1.0]
    sources = np.r_[["big"] * 100, ["small"]]
    ci = S.source_bootstrap_ci(values, sources, n_resamples=500, seed=0)
    assert ci.estimate == pytest.approx(0.5)
    assert ci.n_sources == 2 and ci.n_examples == 101
    assert values.mean() == pytest.approx(1 / 101)  # what a per-example mean would have said


def test_estimate_equals_mean_of_per_source_means():
    rng = np.random.default_rng(4)
    sources = rng.integers(0, 17, 300)
    values = rng.normal(sources * 0.1, 1.0)
    expected = pd.Series(values).groupby(sources).mean().mean()
    ci = S.source_bootstrap_ci(values, sources, n_resamples=500, seed=0)
    assert ci.estimate == pytest.approx(expected)
    median = S.source_bootstrap_ci(values, sources, statistic=np.median, n_resamples=500, seed=0)
    assert median.estimate == pytest.approx(pd.Series(values).groupby(sources).mean().median())
    assert median.low <= median.estimate <= median.high


def test_degenerate_cases_do_not_crash():
    single = S.source_bootstrap_ci([0.1, 0.4, 0.7], ["s", "s", "s"], n_resamples=500, seed=0)
    assert single.method == "degenerate (single source)" and single.degenerate
    assert single.low == single.high == single.estimate == pytest.approx(0.4)
    flat = S.source_bootstrap_ci(np.full(12, 0.3), np.arange(12) % 4, n_resamples=500, seed=0)
    assert flat.method == "degenerate (zero variance)"
    assert flat.low == flat.high == flat.estimate == pytest.approx(0.3)


def test_bootstrap_rejects_bad_input():
    with pytest.raises(ValueError, match="same length"):
        S.source_bootstrap_ci([1.0, 2.0], [0], seed=0)
    with pytest.raises(ValueError, match="finite"):
        S.source_bootstrap_ci([1.0, np.nan], [0, 1], seed=0)
    with pytest.raises(ValueError, match="seed"):
        S.source_bootstrap_ci([1.0, 2.0], [0, 1], seed=None)
    with pytest.raises(ValueError, match="confidence"):
        S.source_bootstrap_ci([1.0, 2.0], [0, 1], confidence=95, seed=0)


def test_paired_bootstrap_cancels_source_variation():
    rng = np.random.default_rng(8)
    sources = np.repeat(np.arange(40), 5)
    level = rng.normal(0, 5, 40)[sources]                      # large between-source spread shared by both arms
    b = level + rng.normal(0, 0.2, len(sources))
    a = b + 0.5 + rng.normal(0, 0.2, len(sources))
    paired = S.paired_source_bootstrap_ci(a, b, sources, n_resamples=2000, seed=3)
    expected = (pd.Series(a).groupby(sources).mean() - pd.Series(b).groupby(sources).mean()).mean()
    assert paired.estimate == pytest.approx(expected)
    assert paired.low < 0.5 < paired.high
    alone = S.source_bootstrap_ci(a, sources, n_resamples=2000, seed=3)
    assert (paired.high - paired.low) < (alone.high - alone.low) / 10
    constant = S.paired_source_bootstrap_ci(b + 1.0, b, sources, n_resamples=500, seed=0)
    assert constant.method == "degenerate (zero variance)" and constant.estimate == pytest.approx(1.0)


def test_paired_bootstrap_with_separate_examples_and_mismatched_sources():
    a, sa = [1.0, 2.0, 3.0, 5.0], ["x", "x", "y", "z"]
    b, sb = [1.0, 1.0, 1.0], ["x", "y", "z"]
    res = S.paired_source_bootstrap_ci(a, b, sa, sources_b=sb, n_resamples=500, seed=0)
    assert res.estimate == pytest.approx(np.mean([1.5, 3.0, 5.0]) - 1.0)
    with pytest.raises(ValueError, match="same sources"):
        S.paired_source_bootstrap_ci(a, b, sa, sources_b=["x", "y", "w"], n_resamples=500, seed=0)


def test_summarise_is_tidy_and_matches_direct_calls():
    rng = np.random.default_rng(1)
    frame = pd.DataFrame({"model": np.repeat(["gla", "gdn"], 60), "intervention": np.tile(np.repeat(["a", "b"], 30), 2),
                          "source": np.tile(np.arange(30) % 10, 4), "shift": rng.normal(size=120),
                          "acc": (rng.random(120) < 0.8).astype(float)})
    frame.loc[3, "shift"] = np.nan
    table = S.summarise(frame, ["shift", "acc"], by=["model", "intervention"], n_resamples=500, seed=2)
    assert list(table.columns) == ["model", "intervention", "metric", "estimate", "low", "high", "n_sources",
                                   "n_examples", "method", "seed", "confidence"]
    assert len(table) == 8
    for row in table.itertuples():
        sub = frame[(frame.model == row.model) & (frame.intervention == row.intervention)].dropna(subset=[row.metric])
        direct = S.source_bootstrap_ci(sub[row.metric], sub["source"], n_resamples=500, seed=2)
        assert (row.estimate, row.low, row.high, row.n_examples) == (direct.estimate, direct.low, direct.high,
                                                                     direct.n_examples)
    assert table.query("model == 'gla' and intervention == 'a' and metric == 'shift'")["n_examples"].item() == 29
    with pytest.raises(ValueError, match="missing columns"):
        S.summarise(frame, ["nope"], by=["model"])


# ---------------------------------------------------------------------------------------------------------------
# Head selection
# ---------------------------------------------------------------------------------------------------------------


def _hand_table() -> pd.DataFrame:
    # Head (1, 0) wins on sources s0-s2; head (0, 1) wins only on s3 but has the larger mean thanks to s3's 10.
    scores = {"s0": {(1, 0): 2, (0, 1): 1}, "s1": {(1, 0): 2, (0, 1): 1}, "s2": {(1, 0): 2, (0, 1): 1},
              "s3": {(1, 0): 0, (0, 1): 10}}
    rows = []
    for source, special in scores.items():
        for layer in (0, 1):
            for head in (0, 1):
                rows.append({"source": source, "layer": layer, "head": head,
                             "score": float(special.get((layer, head), -1.0))})
    return pd.DataFrame(rows)


def test_rank_per_source_known_answers():
    ranks = _hand_table().pipe(S.rank_per_source).set_index(["source", "layer", "head"])["rank"]
    assert ranks[("s0", 1, 0)] == 1 and ranks[("s0", 0, 1)] == 2
    assert ranks[("s0", 0, 0)] == 3 and ranks[("s0", 1, 1)] == 3  # tie shares the better rank
    assert ranks[("s3", 0, 1)] == 1 and ranks[("s3", 1, 0)] == 2


def test_wins_per_head_known_answers():
    wins = S.wins_per_head(_hand_table()).set_index(["layer", "head"])
    assert wins.loc[(1, 0), "wins"] == 3 and wins.loc[(0, 1), "wins"] == 1
    assert wins.loc[(0, 0), "wins"] == 0 and wins["n_sources"].eq(4).all()
    assert wins.loc[(0, 1), "mean_score"] == pytest.approx(13 / 4)
    assert list(wins.index[:1]) == [(1, 0)]


def test_leave_one_source_out_detects_an_unstable_winner():
    loso = S.leave_one_source_out_winner(_hand_table())
    assert loso.winner == (0, 1)
    assert not loso.stable and loso.n_stable == 3 and loso.n_sources == 4
    row = loso.per_source.set_index("left_out").loc["s3"]
    assert row["winner"] == (1, 0) and row["winner_score"] == pytest.approx(2.0)
    stable = _hand_table()
    stable.loc[(stable["layer"] == 1) & (stable["head"] == 1), "score"] = 20.0
    result = S.leave_one_source_out_winner(stable)
    assert result.winner == (1, 1) and result.stable and result.n_stable == 4


def test_bootstrap_rank_interval_known_answers():
    table = _hand_table()
    # (0, 1) ranks first whenever s3 is drawn at least once: P(no s3 in 4 draws) = (3/4)^4 = 0.32 -> rank 2.
    mixed = S.bootstrap_rank_interval(table, (0, 1), n_resamples=2000, seed=0)
    assert (mixed.rank, mixed.low, mixed.high) == (1, 1, 2)
    tied_last = S.bootstrap_rank_interval(table, (0, 0), n_resamples=500, seed=0)  # tied with (1, 1) everywhere
    assert (tied_last.rank, tied_last.low, tied_last.high) == (3, 3, 4)            # the tie is reported, [3, 4]
    # an all-equal scan (the random model: every read J exactly 0.0) ranks every head [1, n], names none
    flat = table.assign(score=0.0)
    for unit in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        ri = S.bootstrap_rank_interval(flat, unit, n_resamples=200, seed=0)
        assert (ri.low, ri.high) == (1, 4)
    assert S.top_is_tied(flat) and not S.top_is_tied(table)
    dominant = table.copy()
    dominant.loc[(dominant["layer"] == 1) & (dominant["head"] == 1), "score"] = 20.0
    best = S.bootstrap_rank_interval(dominant, (1, 1), n_resamples=500, seed=0)
    assert (best.rank, best.low, best.high) == (1, 1, 1)
    with pytest.raises(ValueError, match="not among the scored heads"):
        S.bootstrap_rank_interval(table, (5, 5), n_resamples=500, seed=0)


def test_head_helpers_reject_incomplete_tables():
    table = _hand_table()
    with pytest.raises(ValueError, match="not complete"):
        S.wins_per_head(table.iloc[1:])
    with pytest.raises(ValueError, match="duplicate"):
        S.rank_per_source(pd.concat([table, table.iloc[:1]]))


# ---------------------------------------------------------------------------------------------------------------
# Spearman
# ---------------------------------------------------------------------------------------------------------------


def test_spearman_over_units_matches_rank_correlation_of_unit_means():
    rng = np.random.default_rng(6)
    n_sources, n_heads = 12, 30
    write = rng.normal(size=n_heads)
    rows = [{"source": s, "unit": h, "x": write[h] + rng.normal(0, 0.5), "y": 0.6 * write[h] + rng.normal(0, 0.7)}
            for s in range(n_sources) for h in range(n_heads)]
    frame = pd.DataFrame(rows)
    res = S.spearman_with_ci(frame.x, frame.y, frame.source, units=frame.unit, n_resamples=500, seed=1)
    means = frame.groupby("unit")[["x", "y"]].mean()
    expected = means["x"].rank().corr(means["y"].rank())  # Pearson of ranks, computed independently
    assert res.rho == pytest.approx(expected)
    assert res.n == n_heads and res.n_sources == n_sources
    assert res.low <= res.rho <= res.high
    again = S.spearman_with_ci(frame.x, frame.y, frame.source, units=frame.unit, n_resamples=500, seed=1)
    assert (again.low, again.high) == (res.low, res.high)


def test_spearman_pooled_rows_and_perfect_monotone():
    x = np.arange(20, dtype=float)
    res = S.spearman_with_ci(x, x ** 3, np.arange(20) % 5, n_resamples=500, seed=0)
    assert res.rho == pytest.approx(1.0)
    assert res.method == "degenerate (zero variance)" and res.low == res.high == pytest.approx(1.0)
    rng = np.random.default_rng(0)
    y = rng.normal(size=20)
    noisy = S.spearman_with_ci(x, y, np.arange(20) % 5, n_resamples=500, seed=0)
    assert noisy.rho == pytest.approx(pd.Series(x).corr(pd.Series(y), method="spearman"))
    assert noisy.n == 20 and noisy.low < noisy.high


# ---------------------------------------------------------------------------------------------------------------
# Proportions: binomial with one example per source, source-cluster bootstrap with several
# ---------------------------------------------------------------------------------------------------------------


def _wilson(k, n, z=sps.norm.ppf(0.975)):
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return centre - half, centre + half


@pytest.mark.parametrize("k", [0, 5, 32])
def test_proportion_with_one_example_per_source_is_binomial_and_never_zero_width(k):
    values = np.r_[np.ones(k), np.zeros(32 - k)]
    ci = S.proportion_ci(values, np.arange(32))
    low, high = _wilson(k, 32)
    assert ci.estimate == k / 32 and ci.low == pytest.approx(max(low, 0), abs=1e-12)
    assert ci.high == pytest.approx(min(high, 1), abs=1e-12) and ci.method.startswith("Wilson")
    assert ci.high - ci.low > 0.1                        # 32/32 used to read [100%, 100%]
    exact = S.proportion_ci(values, np.arange(32), binomial_method="exact")
    assert exact.low == pytest.approx(sps.beta.ppf(0.025, k, 32 - k + 1) if k else 0.0, abs=1e-9)
    if k == 32:
        assert exact.low == pytest.approx(0.891, abs=5e-4) and exact.method.startswith("Clopper-Pearson")


def test_proportion_with_several_examples_per_source_is_a_source_cluster_bootstrap():
    rng = np.random.default_rng(3)
    sources = np.repeat(np.arange(20), 4)
    values = (rng.random(80) < np.repeat(rng.uniform(0.3, 0.9, 20), 4)).astype(float)
    ci = S.proportion_ci(values, sources, n_resamples=999, seed=1)
    boot = S.source_bootstrap_ci(values, sources, n_resamples=999, seed=1)
    assert (ci.estimate, ci.low, ci.high) == (boot.estimate, boot.low, boot.high)
    assert ci.method == "source-cluster bootstrap, BCa" and ci.n_sources == 20 and ci.n_examples == 80
    # every source at 100%: the bootstrap is degenerate, so the sources count as the binomial n
    full = S.proportion_ci(np.ones(80), sources)
    assert (full.low, full.high) == pytest.approx(_wilson(20, 20)) and "over sources" in full.method
    with pytest.raises(ValueError, match="0/1 outcomes"):
        S.proportion_ci(np.array([0.5, 1.0]), [0, 1])


def test_summarise_uses_proportion_intervals_for_named_metrics():
    frame = pd.DataFrame({"source": np.arange(12), "acc": np.ones(12), "shift": np.linspace(0, 1, 12)})
    table = S.summarise(frame, ["acc", "shift"], proportions=["acc"], n_resamples=500).set_index("metric")
    assert table.loc["acc", "low"] == pytest.approx(_wilson(12, 12)[0]) and table.loc["acc", "high"] == 1.0
    assert table.loc["shift", "method"] == "BCa"
