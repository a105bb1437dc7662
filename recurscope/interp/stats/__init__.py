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

The modules: `intervals` (source bootstrap, proportions, binomial intervals, `summarise`), `paired_tests` (exact
McNemar), `head_ranks` (per-source ranks, wins, leave-one-source-out, rank intervals, Spearman with an interval),
`seed_level` (sign test, exact seed bootstrap, seed contrasts). Every name is importable from here.
"""
from __future__ import annotations

from recurscope.interp.stats.intervals import (
    DEFAULT_RESAMPLES, BootstrapCI, per_source_means, source_bootstrap_ci, proportion_ci,
    paired_source_bootstrap_ci, source_ratio_ci, summarise, BinomialCI, binomial_ci,
)
from recurscope.interp.stats.paired_tests import (
    McNemarResult, mcnemar_exact, mcnemar_table,
)
from recurscope.interp.stats.head_ranks import (
    rank_per_source, wins_per_head, LeaveOneSourceOut, leave_one_source_out_winner, RankInterval,
    bootstrap_rank_interval, SpearmanCI, spearman_with_ci, top_is_tied,
)
from recurscope.interp.stats.seed_level import (
    EXACT_BOOTSTRAP_MAX, SignTest, sign_test, seed_bootstrap_ci, SeedContrast, seed_contrast,
)

__all__ = [
    "DEFAULT_RESAMPLES", "BootstrapCI", "per_source_means", "source_bootstrap_ci", "proportion_ci",
    "paired_source_bootstrap_ci", "source_ratio_ci", "summarise", "BinomialCI", "binomial_ci", "McNemarResult",
    "mcnemar_exact", "mcnemar_table", "rank_per_source", "wins_per_head", "LeaveOneSourceOut",
    "leave_one_source_out_winner", "RankInterval", "bootstrap_rank_interval", "SpearmanCI", "spearman_with_ci", "top_is_tied",
    "EXACT_BOOTSTRAP_MAX", "SignTest", "sign_test", "seed_bootstrap_ci", "SeedContrast", "seed_contrast",
]
