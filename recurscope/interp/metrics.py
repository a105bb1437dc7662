"""Per-example metrics of an intervention over the four candidate logits (How Linear Attention Remembers, Sec. 3.3),
as tidy pandas rows whose statistical unit is the source passage, and their source-bootstrap summary.

Metrics, per row i with candidate logits z (clean) and z' (intervened), recipient answer r_i and donor answer d_i:
- clean_correct / correct: argmax over the candidates is r_i (before / after);
- margin m = z_d - z_r; donor_margin_shift = m' - m (positive: towards the donor). Target rows with a donor only;
- donor_specific_shift: the change in z_d - mean(z_c, c not in {r, d}), the donor against the non-donor
  distractors; distractor_shift: the change in mean(z_c, c not in {r, d}) - z_r. The two add up to
  donor_margin_shift. The margin shift rises whenever the recipient's answer loses confidence, towards the donor
  and the distractors alike; only the donor-specific shift says the donor's value in particular gained (a control
  is "near zero" when this one is). Target rows with a donor only;
- donor_answer: argmax of z' is d_i. Target rows with a donor only;
- target_margin = z_r - max_{c != r} z_c; target_margin_change = target_margin' - target_margin. Target rows;
- nontarget_break (multi-fact pairs): on a non-target row that was correct before, 1 if it is now wrong, else 0;
  undefined (NaN) on rows that were wrong before, so its mean is the break rate over the originally correct;
- nontarget_margin_change: the answer-margin change (as target_margin_change) on non-target rows.
Undefined entries are NaN so that means skip them; 0/1 metrics are floats for the same reason.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import pandas as pd
import torch


__all__ = ["METRICS", "BINARY_METRICS", "example_metrics", "summarise_metrics", "source_means"]

METRICS = ("clean_correct", "correct", "donor_margin_shift", "donor_specific_shift", "distractor_shift",
           "donor_answer", "target_margin_change", "nontarget_break", "nontarget_margin_change")
# 0/1 outcomes: summarised as proportions (stats.proportion_ci: a binomial interval when each source gives one
# example, a source-cluster bootstrap when sources give several). confirm adds the two accuracy columns.
BINARY_METRICS = ("clean_correct", "correct", "donor_answer", "nontarget_break", "clean_accuracy",
                  "intervened_accuracy")


def _as_array(name: str, t, n: int, C: int) -> np.ndarray:
    arr = t.detach().cpu().double().numpy() if isinstance(t, torch.Tensor) else np.asarray(t, dtype=float)
    if arr.shape != (n, C):
        raise ValueError(f"{name} must be candidate logits of shape (N={n}, C={C}), got {arr.shape}; pass "
                         f"InterventionResult.logits / .clean")
    return arr


def example_metrics(pairs, result=None, *, logits=None, clean=None, intervention: Optional[str] = None,
                    heads: Optional[str] = None) -> pd.DataFrame:
    """One row per example of `pairs`: identifiers (source, pair, row, ...) and every metric in METRICS, plus the
    raw margins (clean_margin, margin, clean_target_margin, target_margin).

    Pass an InterventionResult as `result`, or the candidate logits as `logits` (intervened) and `clean`.
    """
    if result is not None:
        logits = result.logits if logits is None else logits
        clean = result.clean if clean is None else clean
        intervention = result.name if intervention is None else intervention
        heads = result.heads_label() if heads is None else heads
    if logits is None or clean is None:
        raise ValueError("example_metrics needs an InterventionResult, or both logits= (intervened) and clean= "
                         "candidate logits of shape (N, C)")
    n, C = pairs.candidate_ids.shape
    z_new, z_old = _as_array("logits", logits, n, C), _as_array("clean", clean, n, C)
    rows = np.arange(n)
    r = pairs.recipient_answer_index.cpu().numpy()
    d = pairs.donor_answer_index.cpu().numpy()
    is_target = pairs.is_target.cpu().numpy().astype(bool)
    if bool(((r < 0) | (r >= C)).any()) or bool((d >= C).any()):
        raise ValueError(f"answer indices must lie in [0, {C - 1}] (donor -1 = none); got recipient {r.tolist()}, "
                         f"donor {d.tolist()}")
    has_donor = is_target & (d >= 0)
    d_safe = np.where(d >= 0, d, 0)

    def margin(z):
        return np.where(has_donor, z[rows, d_safe] - z[rows, r], np.nan)

    # Non-donor distractors: every candidate other than the recipient's and the donor's answer.
    distractor = np.ones((n, C), dtype=bool)
    distractor[rows, r] = False
    distractor[rows, d_safe] &= ~has_donor
    if C < 3:
        raise ValueError(f"the donor-specific shift needs at least one non-donor distractor, i.e. C >= 3 candidates; "
                         f"got C={C}; build pairs with n_candidates >= 3")

    def distractor_mean(z):
        return np.where(distractor, z, 0.0).sum(axis=1) / distractor.sum(axis=1)

    def donor_specific(z):
        return np.where(has_donor, z[rows, d_safe] - distractor_mean(z), np.nan)

    def answer_margin(z):
        others = z.copy()
        others[rows, r] = -np.inf
        return z[rows, r] - others.max(axis=1)

    arg_old, arg_new = z_old.argmax(axis=1), z_new.argmax(axis=1)
    clean_correct = arg_old == r
    correct = arg_new == r
    m_old, m_new = margin(z_old), margin(z_new)
    t_old, t_new = answer_margin(z_old), answer_margin(z_new)
    frame = pd.DataFrame({
        "source": pairs.source_id.cpu().numpy().astype(int),
        "pair": pairs.group.cpu().numpy().astype(int),
        "row": rows,
        "queried_fact": pairs.queried_fact.cpu().numpy().astype(int),
        "target_fact": pairs.target_fact.cpu().numpy().astype(int),
        "is_target": is_target,
        "variant": list(pairs.variants),
        "intervention": intervention,
        "heads": heads,
        "clean_correct": clean_correct.astype(float),
        "correct": correct.astype(float),
        "clean_margin": m_old,
        "margin": m_new,
        "donor_margin_shift": m_new - m_old,
        "donor_specific_shift": donor_specific(z_new) - donor_specific(z_old),
        "distractor_shift": np.where(has_donor, (distractor_mean(z_new) - z_new[rows, r])
                                     - (distractor_mean(z_old) - z_old[rows, r]), np.nan),
        "donor_answer": np.where(has_donor, (arg_new == d_safe).astype(float), np.nan),
        "clean_target_margin": np.where(is_target, t_old, np.nan),
        "target_margin": np.where(is_target, t_new, np.nan),
        "target_margin_change": np.where(is_target, t_new - t_old, np.nan),
        "nontarget_break": np.where(~is_target & clean_correct, (~correct).astype(float), np.nan),
        "nontarget_margin_change": np.where(~is_target, t_new - t_old, np.nan),
    })
    return frame


def source_means(frame: pd.DataFrame, metrics: Sequence[str] = METRICS, by: Sequence[str] = ()) -> pd.DataFrame:
    """Mean of each metric within each source (and `by` group), NaN entries skipped: one row per source."""
    missing = [c for c in [*metrics, *by, "source"] if c not in frame.columns]
    if missing:
        raise ValueError(f"frame is missing columns {missing}; build it with example_metrics")
    return frame.groupby([*by, "source"], sort=True)[list(metrics)].mean().reset_index()


def summarise_metrics(frame: pd.DataFrame, metrics: Sequence[str] = METRICS, by: Sequence[str] = ("intervention",),
                      **kwargs) -> pd.DataFrame:
    """Estimate and 95% interval of each metric (interp.stats.summarise; sources are the unit): a source bootstrap
    for margins, stats.proportion_ci for the 0/1 metrics in BINARY_METRICS. kwargs go to stats.summarise
    (n_resamples, confidence, seed, method)."""
    # scipy (through interp.stats) is imported here, not at module load: Ray workers compute rows, never this summary
    from recurscope.interp import stats

    by = [c for c in by if c in frame.columns]
    return stats.summarise(frame, list(metrics), by=by, source_col="source",
                           proportions=[m for m in metrics if m in BINARY_METRICS], **kwargs)
