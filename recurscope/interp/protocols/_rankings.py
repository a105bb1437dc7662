"""A frozen head ranking and the joint top-k swaps over it, shared by heads (Fig. 3c) and topk (App. E.2). Verbs
import these, never each other."""
from __future__ import annotations

from typing import Optional

import pandas as pd

from recurscope.interp import interventions as iv
from recurscope.interp import stats
from recurscope.interp.metrics import example_metrics
from recurscope.interp.protocols._common import rank_heads, ranking_names_a_head
from recurscope.interp.scan import all_heads


def top_k_sizes(n_heads: int) -> list[int]:
    """1, 2, 4, ... below n_heads, then n_heads."""
    if n_heads < 1:
        raise ValueError(f"n_heads must be >= 1, got {n_heads}")
    ks, k = [], 1
    while k < n_heads:
        ks.append(k)
        k *= 2
    return ks + [n_heads]


def swap_arms(order: list) -> dict:
    """The joint top-k state-swap arms of a frozen ranking: {"swap:top<k>": ("state_swap", the top k heads)}."""
    return {f"swap:top{k}": ("state_swap", order[:k]) for k in top_k_sizes(len(order))}


def arm_rows(model, pairs, kind: str, heads: list, arm: str, batch_size: int) -> pd.DataFrame:
    """One joint intervention (`kind`, an interventions function) of `heads` on the target rows of `pairs`: the
    donor-margin shift and the correct answer's margin change per row."""
    frame = example_metrics(pairs, getattr(iv, kind)(model, pairs, heads, batch_size=batch_size), intervention=kind)
    frame = frame[frame["is_target"].astype(bool)]
    return pd.DataFrame({"arm": arm, "row": frame["row"], "source": frame["source"],
                         "shift": frame["donor_margin_shift"], "answer_margin_change": frame["target_margin_change"],
                         "n_heads": len(heads)})


def recovery_records(wide: pd.DataFrame, ks: list, *, n_resamples: int, seed: int, prefix: str = "") -> list:
    """recovery(k) = shift(top k) / shift(all), a ratio of source means with a source-bootstrap interval, and each
    arm's shift; `wide` holds one column per arm ("<prefix>swap:top<k>") and "source"."""
    src = wide["source"].to_numpy()
    all_arm = f"{prefix}swap:top{ks[-1]}"
    out = []
    for k in ks:
        arm = f"{prefix}swap:top{k}"
        for metric, ci in (("shift", stats.source_bootstrap_ci(wide[arm], src, n_resamples=n_resamples, seed=seed)),
                           ("recovery", stats.source_ratio_ci(wide[arm], wide[all_arm], src,
                                                              n_resamples=n_resamples, seed=seed))):
            out.append({"analysis": "recovery", "unit": f"top{k}", "metric": metric, "estimate": ci.estimate,
                        "low": ci.low, "high": ci.high, "n_sources": ci.n_sources, "method": ci.method, "k": k})
    return out


def frozen_ranking(model, ranking: Optional[pd.DataFrame], n_dev: int, layout, with_tie: bool = False):
    """Every recurrent head (state group), best J first: `ranking` (a scan's scan_heads) or a fresh dev scan. With
    `with_tie`, (order, hub_named): hub_named is False when the best J is tied or inside the scan's noise floor
    (ranking_names_a_head), so no head is called the hub."""
    if ranking is None:
        ranking = rank_heads(model, n_dev=n_dev, layout=layout)
    named = ranking_names_a_head(ranking)
    ranking = ranking.sort_values("J", ascending=False, kind="stable")
    order = [(int(r.layer), int(r.head)) for r in ranking.itertuples()]
    if sorted(order) != all_heads(model):
        raise ValueError("the ranking must score every recurrent head of the model once; pass a full scan's "
                         "scan_heads table")
    return (order, named) if with_tie else order


def scan_ranking(model, from_scan) -> Optional[pd.DataFrame]:
    """The per-head table (scan_heads.csv) of the scan directory `from_scan` to freeze, or None without one."""
    if not from_scan:
        return None
    from pathlib import Path

    from recurscope.interp.confirm import heads_from_scan

    heads_from_scan(from_scan, model)                      # refuses a scan of another checkpoint
    return pd.read_csv(Path(from_scan) / "scan_heads.csv")
