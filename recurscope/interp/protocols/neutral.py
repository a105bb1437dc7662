"""Neutral suppression (How Linear Attention Remembers, App. D.1, Fig. 12).

The donor holds filler of equal token length where the recipient presents the target fact (build_neutral_pairs),
so a state swap of the frozen head removes the target's value without offering another; all four facts are queried.
Reported: target accuracy before and after, the other three facts' accuracy change in percentage points, their
margin change and break counts, and the same for the equal-norm random update.

Paper: GLA 91.8% -> 7.6% on the target with +2.15 pp on the others; GDN 96.1% -> 37.1%, +1.11 pp.
"""
from __future__ import annotations

from functools import partial
from typing import Optional, Sequence

import pandas as pd

from recurscope.interp import interventions as iv
from recurscope.interp.metrics import example_metrics
from recurscope.interp import stats
from recurscope.interp.protocols._common import (ProtocolResult, ci_text, frozen_setup, head_label, logged_arms,
                                                 logged_arms_on, max_length, model_record, pair_spec)
from recurscope.interp.protocols.runner import FigureSpec, Section, finish
from recurscope.interp.verdicts import GDN, GLA, Claim, judge_family, measure_from, no_paper_number

__all__ = ["ARMS", "run_neutral", "build_neutral_all_pairs", "reading"]

ARMS = ("state_swap", "random_update")
LABELS = {"state_swap": "state swap (neutral donor)", "random_update": "equal-norm random update"}
METRICS = ("target_clean_accuracy", "target_accuracy", "target_accuracy_change", "others_clean_accuracy",
           "others_accuracy_change", "nontarget_margin_change", "nontarget_break")
PAPER = "GLA 91.8% -> 7.6% (+2.15 pp on the others); GDN 96.1% -> 37.1% (+1.11 pp)"


def build_neutral_all_pairs(tokenizer, *, n_sources: int = 32, split: str = "heldout", model=None, layout=None):
    """Neutral-donor pairs with every fact queried, in `layout` (a PairSpec, PairLayout or layout name; default the
    §3.3 layout)."""
    from recurscope.interp.data import build_neutral_pairs

    return build_neutral_pairs(tokenizer, split=split, n_sources=n_sources, queries="all",
                               max_length=None if model is None else max_length(model), **pair_spec(layout).kwargs())


def neutral_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """Adds the neutral protocol's columns to example_metrics rows: accuracy before/after on the target and the
    others (NaN on the other kind of row), so that source means and the bootstrap skip them."""
    t = frame["is_target"].astype(bool)
    out = frame.copy()
    out["target_clean_accuracy"] = frame["clean_correct"].where(t)
    out["target_accuracy"] = frame["correct"].where(t)
    out["target_accuracy_change"] = (frame["correct"] - frame["clean_correct"]).where(t)
    out["others_clean_accuracy"] = frame["clean_correct"].where(~t)
    out["others_accuracy_change"] = (frame["correct"] - frame["clean_correct"]).where(~t)
    return out


def neutral_arm(model, pairs, arm: str, head, *, seed: int, batch_size: int, rows=None) -> pd.DataFrame:
    """One arm's rows on `pairs` (or on its `rows`, numbered as in the whole batch; the random update is seeded by
    that number, so a unit's rows are the whole run's)."""
    sub = pairs if rows is None else pairs.select(list(rows))
    ids = None if rows is None else list(rows)
    if arm == "state_swap":
        result = iv.state_swap(model, sub, [head], batch_size=batch_size)
    else:
        result = iv.random_update(model, sub, [head], kind="state_swap", seed=seed, batch_size=batch_size, row_ids=ids)
    frame = neutral_rows(example_metrics(sub, result, intervention=arm))
    frame.insert(0, "arm", arm)
    frame["row"] = range(len(frame)) if rows is None else ids
    return frame


def neutral_unit(model, pairs, rows, *, arm: str, head, seed: int, batch_size: int) -> list[dict]:
    """A (source, arm) unit for --ray (protocols._common.logged_arms_on)."""
    return neutral_arm(model, pairs, arm, head, seed=seed, batch_size=batch_size, rows=rows).to_dict("records")


def run_neutral(model, pairs=None, head: Optional[Sequence[int]] = None, *, run_dir=None, from_scan=None,
                n_sources: int = 32, n_dev: int = 16, layout=None, seed: int = 0,
                batch_size: int = 16, n_resamples: int = 9999, model_name: str = "model",
                progress=None, executor=None) -> ProtocolResult:
    layout, chosen, _, pairs = frozen_setup(
        model, pairs, head, from_scan, n_dev=n_dev, layout=layout, seed=seed,
        build=lambda lay: build_neutral_all_pairs(model.tokenizer, n_sources=n_sources, model=model, layout=lay))
    if set(pairs.variants) != {"neutral"}:
        raise ValueError("neutral suppression needs neutral-donor pairs: build them with build_neutral_pairs(..., "
                         "queries='all')")

    if executor is not None:
        rows = logged_arms_on(executor, run_dir, "neutral_rows", ARMS, pairs,
                              partial(neutral_unit, head=chosen, seed=seed, batch_size=batch_size), progress)
    else:
        rows = logged_arms(run_dir, "neutral_rows", ("arm", "row"), ARMS,
                           lambda arm: neutral_arm(model, pairs, arm, chosen, seed=seed, batch_size=batch_size),
                           progress)
    sources = rows.groupby(["arm", "source"])[list(METRICS)].mean().reset_index()
    summary = stats.summarise(rows, list(METRICS), by=["arm"], n_resamples=n_resamples, seed=seed)
    nt = rows[~rows["is_target"].astype(bool)]
    counts = nt.groupby("arm").agg(breaks=("nontarget_break", "sum"), eligible=("nontarget_break", "count"),
                                   fixed=("others_accuracy_change", lambda v: int((v > 0).sum()))).reset_index()
    info = {"head": chosen, **model_record(model), "n_sources": int(rows["source"].nunique()), "counts": counts.to_dict("records")}
    result = ProtocolResult("neutral", rows, sources, summary, info=info)
    figure = FigureSpec("neutral", summary, dict(
        row_col="arm", rows=list(ARMS), panels=["target_clean_accuracy", "target_accuracy", "others_accuracy_change",
                                                "nontarget_margin_change"],
        percent=["target_clean_accuracy", "target_accuracy", "others_accuracy_change"], row_labels=LABELS,
        controls=["random_update"],
        title=f"{model_name}: neutral suppression, head {head_label(chosen)}"))
    return finish(result, run_dir, lambda r: neutral_section(r, model_name), [figure])


def neutral_section(result: ProtocolResult, model_name: str) -> Section:
    s, info = result.summary, result.info
    counts = {c["arm"]: c for c in info["counts"]}
    table = ["| arm | target accuracy before | after | others: accuracy change (pp) | others: margin change | "
             "others: breaks / correct |", "|---|---|---|---|---|---|"]
    for arm in ARMS:
        c = counts.get(arm, {"breaks": 0, "eligible": 0})
        change = measure_from(s, {"arm": arm}, "others_accuracy_change")
        change_text = "–" if change is None or not change.defined else \
            f"{100 * change.estimate:+.2f} [{100 * change.low:+.2f}, {100 * change.high:+.2f}]"
        table.append(f"| {LABELS[arm]} | {ci_text(s, {'arm': arm}, 'target_clean_accuracy', pct=True)} | "
                     f"{ci_text(s, {'arm': arm}, 'target_accuracy', pct=True)} | {change_text} | "
                     f"{ci_text(s, {'arm': arm}, 'nontarget_margin_change')} | {int(c['breaks'])}/{int(c['eligible'])} |")
    intro = f"Neutral donor in the target slot, all four facts queried; {info['n_sources']} held-out sources."
    return Section(f"Neutral suppression: {model_name}, head {head_label(info['head'])}", intro, [table],
                   reading(s, family=info.get("family")))


#: Each family's numbers (verdicts.paper_family): the target's fall and the others' gain.
FAMILY_PAPER = {GLA: ((-0.842, "GLA 91.8% -> 7.6% (-84.2 pp)"), 0.0215, "GLA +2.15 pp"),
                GDN: ((-0.590, "GDN 96.1% -> 37.1% (-59.0 pp)"), 0.0111, "GDN +1.11 pp")}


def reading(s: pd.DataFrame, *, family: Optional[str]) -> list[str]:
    """`family` (GLA or GDN, verdicts.paper_family) picks the paper's numbers of the model's family; another
    family's model gets no verdict against them. The random update is the project's control: the paper
    reports none, so it gets its value and no comparison (verdicts.no_paper_number)."""
    out = [f"The paper: {PAPER}."]
    out.append(judge_family(measure_from(s, {"arm": "state_swap"}, "target_accuracy_change", "pp"), family,
                            {fam: Claim.effect(fall, f"the target's accuracy falls, {text}")
                             for fam, ((fall, text), _, _) in FAMILY_PAPER.items()},
                            "The swap's change in target accuracy", "GLA -84.2 pp, GDN -59.0 pp"))
    out.append(judge_family(measure_from(s, {"arm": "state_swap"}, "others_accuracy_change", "pp"), family,
                            {fam: Claim.effect(gain, f"the others gain {text}")
                             for fam, (_, gain, text) in FAMILY_PAPER.items()},
                            "The swap's change in the other facts' accuracy", "GLA +2.15 pp, GDN +1.11 pp"))
    out.append(no_paper_number(measure_from(s, {"arm": "random_update"}, "target_accuracy_change", "pp"),
                               "The equal-norm random update's change in target accuracy",
                               "App. D.1 runs no random-update control; this one is the project's"))
    return out
