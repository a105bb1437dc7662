"""Four-fact selectivity (How Linear Attention Remembers, §3.3, Fig. 5a-b).

K = 4 facts, each presented 3 times, 512 filler tokens, and every fact queried in the same context. On the frozen
head, a state swap at the query boundary and a donor write over the target fact's spans change the target fact; the
question is whether the three other facts survive. Per source: the target's donor-answer rate and donor-margin shift
(with the donor-specific shift beside it), the non-target break rate (a correct non-target made wrong, over the
non-targets that were correct) and the non-target margin change. Controls: the equal-norm random update (for the
swap), the equal-norm random write (for the donor write) and both interventions on the control head.

Paper (GLA-340M / GDN-340M / 1.3B): target donor-answer 89.1 / 71.9 / 61.3%, non-target break 1.42 / 0.41 / 0.56%.
"""
from __future__ import annotations

from functools import partial
from typing import Optional, Sequence

import pandas as pd

from recurscope.interp import interventions as iv
from recurscope.interp.metrics import example_metrics, source_means, summarise_metrics
from recurscope.interp.protocols._common import (ProtocolResult, ci_text, frozen_setup, head_label, logged_arms,
                                                 logged_arms_on, model_record, pooled_break_rate)
from recurscope.interp.protocols._layouts import build_selectivity_pairs  # noqa: F401  (shared with coupling)
from recurscope.interp.protocols.runner import FigureSpec, Section, finish
from recurscope.interp.verdicts import AMBIGUITIES, GDN, GLA, Claim, control_verdict, judge_family, measure_from

__all__ = ["ARMS", "PAPER", "run_selectivity", "build_selectivity_pairs", "reading"]

ARMS = ("state_swap", "donor_write", "random_update", "random_write", "control_head:state_swap",
        "control_head:donor_write")
LABELS = {"state_swap": "state swap", "donor_write": "donor write", "random_update": "equal-norm random update",
          "random_write": "equal-norm random write",
          "control_head:state_swap": "control head, state swap", "control_head:donor_write": "control head, donor write"}
METRICS = ("donor_answer", "donor_margin_shift", "donor_specific_shift", "nontarget_break", "nontarget_margin_change",
           "clean_correct")
PAPER = {"target donor-answer rate": "89.1% / 71.9% / 61.3%", "pooled non-target break rate": "1.42% / 0.41% / 0.56%"}
#: Each family's span (verdicts.paper_family): GLA-340M's one number; GDN-340M's and GDN-1.3B's range. A measured
#: rate agrees when its interval overlaps its family's span and excludes zero.
PAPER_SPAN = {GLA: {"donor_answer": (0.891, 0.891), "pooled_break_rate": (0.0142, 0.0142)},
              GDN: {"donor_answer": (0.613, 0.719), "pooled_break_rate": (0.0041, 0.0056)}}
#: Each control's causal arm: its donor-margin shift is the control's yardstick.
CONTROL_OF = {"random_update": "state_swap", "random_write": "donor_write", "control_head:state_swap": "state_swap",
              "control_head:donor_write": "donor_write"}


def _arm(model, pairs, head, arm: str, *, seed: int, batch_size: int, scan_heads=None, rows=None) -> pd.DataFrame:
    """One arm's rows on `pairs`, or on its `rows` (numbered as in the whole batch, which also seeds the random
    controls, so that a unit's rows are the whole run's)."""
    ids = None if rows is None else list(rows)
    pairs = pairs if rows is None else pairs.select(ids)
    if arm == "random_update":
        result = iv.random_update(model, pairs, [head], kind="state_swap", seed=seed, batch_size=batch_size,
                                  row_ids=ids)
    elif arm == "random_write":
        result = iv.random_write(model, pairs, [head], variant="value", seed=seed, batch_size=batch_size, row_ids=ids)
    elif arm.startswith("control_head:"):
        result = iv.control_head(model, pairs, [head], arm.split(":", 1)[1], scan=scan_heads, batch_size=batch_size)
    elif arm in ("state_swap", "donor_write"):
        result = getattr(iv, arm)(model, pairs, [head], batch_size=batch_size)
    else:
        raise ValueError(f"arm must be one of {ARMS}, got {arm!r}")
    frame = example_metrics(pairs, result, intervention=arm)
    frame.insert(0, "arm", arm)
    frame["row"] = range(len(frame)) if ids is None else ids
    return frame


def selectivity_unit(model, pairs, rows, *, arm: str, head, seed: int, batch_size: int, scan_heads=None) -> list:
    """A (source, arm) unit for --ray (protocols._common.logged_arms_on)."""
    return _arm(model, pairs, head, arm, seed=seed, batch_size=batch_size, scan_heads=scan_heads,
                rows=rows).to_dict("records")


def run_selectivity(model, pairs=None, head: Optional[Sequence[int]] = None, *, run_dir=None, from_scan=None,
                    n_sources: int = 32, n_dev: int = 16, layout=None, seed: int = 0,
                    batch_size: int = 16, arms: Sequence[str] = ARMS, n_resamples: int = 9999,
                    model_name: str = "model", progress=None, executor=None) -> ProtocolResult:
    """Runs every arm on the frozen head over four-fact pairs (all facts queried); returns rows, per-source means,
    the summary by arm (with the pooled break rate), the figure and the report section. The head is `head`, else the
    top of `from_scan`, else the winner of a scan on `n_dev` dev sources (never the evaluation sources)."""
    bad = [a for a in arms if a not in ARMS]
    if bad:
        raise ValueError(f"unknown arms {bad}; choose from {ARMS}")
    layout, chosen, scan_heads, pairs = frozen_setup(
        model, pairs, head, from_scan, n_dev=n_dev, layout=layout, seed=seed,
        build=lambda lay: build_selectivity_pairs(model.tokenizer, n_sources=n_sources, model=model, layout=lay))
    if int(pairs.is_target.sum()) == len(pairs):
        raise ValueError("selectivity needs non-target rows: build the pairs with build_multifact_pairs "
                         "(queries='all')")
    controls = iv.choose_control_heads(model, [chosen], scan_heads)

    if executor is not None:     # --ray: (source, arm) units
        rows = logged_arms_on(executor, run_dir, "selectivity_rows", arms, pairs,
                              partial(selectivity_unit, head=chosen, seed=seed, batch_size=batch_size,
                                      scan_heads=scan_heads), progress)
    else:
        rows = logged_arms(run_dir, "selectivity_rows", ("arm", "row"), arms,
                           lambda arm: _arm(model, pairs, chosen, arm, seed=seed, batch_size=batch_size,
                                            scan_heads=scan_heads), progress)
    sources = source_means(rows, METRICS, by=("arm",))
    summary = summarise_metrics(rows, METRICS, by=("arm",), n_resamples=n_resamples, seed=seed)
    pooled = pooled_break_rate(rows, ("arm",), n_resamples=n_resamples, seed=seed)
    summary = pd.concat([summary, pooled.drop(columns=["breaks", "eligible"])], ignore_index=True)
    counts = pooled[["arm", "breaks", "eligible"]]
    info = {"head": chosen, "control_head": controls[0], **model_record(model), "n_sources": int(rows["source"].nunique()),
            "break_counts": counts.to_dict("records")}
    result = ProtocolResult("selectivity", rows, sources, summary, info=info)
    breaks = "pooled_break_rate" if len(pooled) else "nontarget_break"
    figure = FigureSpec("selectivity", summary, dict(
        row_col="arm", rows=[a for a in ARMS if a in arms],
        panels=["donor_answer", "donor_margin_shift", breaks, "nontarget_margin_change"],
        percent=["donor_answer", breaks], panel_labels={"pooled_break_rate": "non-target break rate (pooled)"},
        row_labels=LABELS, controls=[a for a in ARMS if a.startswith(("random", "control"))],
        title=f"{model_name}: four-fact selectivity, head {head_label(chosen)}"))
    return finish(result, run_dir, lambda r: selectivity_section(r, model_name), [figure])


def selectivity_section(result: ProtocolResult, model_name: str) -> Section:
    s, info = result.summary, result.info
    counts = {c["arm"]: c for c in info["break_counts"]}
    table = ["| arm | target donor-answer | target margin shift | donor-specific shift | non-target break, pooled "
             "(breaks / correct) | non-target margin change |", "|---|---|---|---|---|---|"]
    for arm, label in LABELS.items():
        if s[s["arm"] == arm].empty:
            continue
        c = counts.get(arm, {"breaks": 0, "eligible": 0})
        table.append(f"| {label} | {ci_text(s, {'arm': arm}, 'donor_answer', pct=True)} | "
                     f"{ci_text(s, {'arm': arm}, 'donor_margin_shift')} | "
                     f"{ci_text(s, {'arm': arm}, 'donor_specific_shift')} | "
                     f"{ci_text(s, {'arm': arm}, 'pooled_break_rate', pct=True)} ({int(c['breaks'])}/{int(c['eligible'])}) | "
                     f"{ci_text(s, {'arm': arm}, 'nontarget_margin_change')} |")
    intro = (f"K = 4 facts, every fact queried; {info['n_sources']} held-out sources; control head "
             f"{head_label(info['control_head'])}. Means over sources with 95% source-bootstrap intervals; the break "
             "rate is the paper's, pooled over the originally-correct non-targets of every source.")
    return Section(f"Four-fact selectivity: {model_name}, head {head_label(info['head'])}", intro, [table],
                   reading(s, family=info.get("family")))


def _span_text(lo: float, hi: float) -> str:
    return f"{100 * lo:.3g}%" if lo == hi else f"{100 * lo:.3g}-{100 * hi:.3g}%"


def reading(s: pd.DataFrame, *, family: Optional[str]) -> list[str]:
    """The Reading's sentences, each verdict from interp.verdicts.judge_family / control_verdict; `family` (GLA or
    GDN, verdicts.paper_family) picks the paper's numbers of the model's family."""
    out = [f"The paper reports target donor-answer rates of {PAPER['target donor-answer rate']} and non-target break "
           f"rates of {PAPER['pooled non-target break rate']} (GLA-340M / GDN-340M / 1.3B; Fig. 5 at K = 4, whose GLA "
           f"1.42% is not Fig. 8's K = 4 point: {AMBIGUITIES})."]
    for arm in ("state_swap", "donor_write"):
        for metric, what in (("donor_answer", "target donor-answer rate"), ("pooled_break_rate", "pooled non-target "
                                                                                                  "break rate")):
            m = measure_from(s, {"arm": arm}, metric, "pct")
            if m is not None:
                claims = {fam: Claim.between(*spans[metric], f"{_span_text(*spans[metric])} on "
                                             f"{'GLA-340M' if fam == GLA else 'GDN-340M / GDN-1.3B'}")
                          for fam, spans in PAPER_SPAN.items()}
                out.append(judge_family(m, family, claims, f"The {LABELS[arm]}'s {what}",
                                        f"{PAPER[what]} (GLA-340M / GDN-340M / GDN-1.3B)"))
    for arm, main in CONTROL_OF.items():
        margin = measure_from(s, {"arm": arm}, "donor_margin_shift")
        if margin is not None:
            out.append(control_verdict(LABELS[arm], margin, measure_from(s, {"arm": arm}, "donor_specific_shift"),
                                       measure_from(s, {"arm": main}, "donor_margin_shift"),
                                       f"the {LABELS[main]}"))
    return out
