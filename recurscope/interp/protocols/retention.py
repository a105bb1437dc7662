"""Retention, edit strength and breakage against load K (How Linear Attention Remembers, §4.2, Fig. 8).

For every K, at one fixed total length (the layouts of capacity.py: K <= 16 present every fact 3 times with
24-token gaps; K >= 32 is the high-load layout, one presentation per fact with 4-token gaps; the filler before the
query takes the rest), on held-out multi-fact pairs (build_multifact_pairs; the target row and up to
`n_nontarget` other facts of the same context queried):
- clean recall over every queried fact (retention);
- the frozen head's state swap: the target's donor-margin shift (edit strength) and the non-target break rate (a
  correct non-target made wrong, over the non-targets that were correct; metrics.example_metrics);
- the same two under the equal-norm random update of the state (interventions.random_update), the control.
Keys are distinct up to K = 64 (KEY_NAMES); when K - 1 exceeds the free values of the vocabulary (cities: 24) the
builder lets facts share values. A point the layout or the vocabulary cannot evaluate, a break rate with no non-target (K = 1), or a condition the
capability gate refuses (--gate) is NaN with its reason, never 0.

Paper at K = 32: clean recall 47 / 60 / 69% (GLA-340M / GDN-340M / GDN-1.3B); the edit shift halves or more from
low load; GDN's break rate stays under 2%, GLA's near or above 5%.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import pandas as pd

from recurscope.interp import interventions as iv
from recurscope.interp.metrics import example_metrics, summarise_metrics
from recurscope.interp import stats
from recurscope.interp.protocols._common import (PairSpec, ProtocolResult, ci_text, frozen_head, head_label, max_length,
                                                 model_record, pair_spec, pooled_break_rate, run_arms)
from recurscope.interp.protocols.runner import FigureSpec, Section, finish
from recurscope.interp.verdicts import (AGREES, AMBIGUITIES, GDN, GLA, Claim, control_verdict, judge, judge_family,
                                        measure_from)
from recurscope.interp.protocols._layouts import HIGH_LOAD, bare_length, fixed_length_filler, load_layout
from recurscope.interp.protocols.verbs import LOADS

__all__ = ["LOADS", "ARMS", "METRICS", "PAPER", "retention_pairs", "shift_kept", "run_retention", "reading"]

ARMS = ("state_swap", "random_update")
LABELS = {"state_swap": "state swap", "random_update": "equal-norm random update"}
METRICS = ("clean_correct", "donor_margin_shift", "donor_answer", "nontarget_break")
PAPER = {"recall_k32": "47% / 60% / 69% (GLA-340M / GDN-340M / GDN-1.3B)",
         "shift": "halves or more from low load to K = 32",
         "break_k32": "GDN under 2%, GLA about 5%"}
#: a low-load state-swap shift below this (logits) means the head carries no fact: no ratio is read from it
NEGLIGIBLE_SHIFT = 0.25


def retention_pairs(tokenizer, layout, *, n_sources: int, n_nontarget: int = 7, seed: int = 0,
                    max_len: Optional[int] = None):
    """Multi-fact pairs of `layout` (a PairSpec, PairLayout or layout name) with, per pair, its target row and up to `n_nontarget` non-target rows drawn
    once under `seed` (all of them when K - 1 <= n_nontarget): at K = 64 every row costs a forward, so not every
    fact is queried."""
    from recurscope.interp.data import build_multifact_pairs

    if not isinstance(n_nontarget, int) or n_nontarget < 0:
        raise ValueError(f"n_nontarget must be an integer >= 0; got {n_nontarget!r}")
    layout = pair_spec(layout)
    pairs = build_multifact_pairs(tokenizer, split="heldout", n_sources=n_sources, max_length=max_len,
                                  **layout.kwargs())
    rng = random.Random(f"retention-rows/{seed}/{layout.layout.n_facts}")
    keep = []
    for g in sorted(set(pairs.group.tolist())):
        rows = [i for i in range(len(pairs)) if int(pairs.group[i]) == g]
        target = [i for i in rows if bool(pairs.is_target[i])]
        others = [i for i in rows if not bool(pairs.is_target[i])]
        keep += target + sorted(rng.sample(others, min(n_nontarget, len(others))))
    return pairs.select(keep)


def shift_kept(ok: pd.DataFrame, k_from: int, k_to: int, *, n_resamples: int = 9999, seed: int = 0) -> dict:
    """The state swap's edit shift at K = k_to over that at K = k_from: a ratio of source means over the sources
    evaluated at both, with a paired source-bootstrap interval."""
    swap = ok[ok["intervention"] == "state_swap"]
    per = swap[swap["is_target"].astype(bool)].groupby(["k", "source"])["donor_margin_shift"].mean().unstack("k")
    per = per[[k_from, k_to]].dropna()
    ci = stats.source_ratio_ci(per[k_to].to_numpy(float), per[k_from].to_numpy(float), per.index.to_numpy(),
                               n_resamples=n_resamples, seed=seed)
    return {"k": k_to, "intervention": "state_swap", "metric": "shift_kept", "estimate": ci.estimate, "low": ci.low,
            "high": ci.high, "n_sources": ci.n_sources, "n_examples": ci.n_examples, "method": ci.method,
            "k_from": k_from}


def _nan_rows(arm: str, reason: str) -> pd.DataFrame:
    return pd.DataFrame({"arm": [arm], "row": [-1], "source": [np.nan], "is_target": [False],
                         **{m: [np.nan] for m in METRICS}, "reason": [reason]})


@dataclass(frozen=True)
class LoadArm:
    """One arm ("K:arm") of the retention curve: the pairs of load K (built once per K and instance, with the
    capability gate where set) and the arm's intervention on the frozen head. Called as (model, pairs, arm) in this
    process or, under --ray, on a worker that computes every arm of one K (a picklable unit, _common.run_arms)."""

    base: PairSpec
    total_length: int
    n_sources: int
    n_nontarget: int
    chosen: tuple
    batch_size: int
    gate_threshold: Optional[float]
    n_resamples: int
    seed: int
    built: dict = field(default_factory=dict, compare=False, repr=False)

    def pairs_for(self, model, k: int):
        from recurscope.interp.capability import capability_gate

        if k not in self.built:
            tok = model.tokenizer
            try:
                spec = load_layout(k, self.base)
                spec = spec.with_(filler_tokens=fixed_length_filler(tok, spec, self.total_length))
                pairs = retention_pairs(tok, spec, n_sources=self.n_sources, n_nontarget=self.n_nontarget,
                                        seed=self.seed, max_len=max_length(model))
                refused = ""
                if self.gate_threshold is not None:
                    g = capability_gate(model, pairs, threshold=self.gate_threshold, condition=f"K = {k}",
                                        batch_size=self.batch_size, n_resamples=min(self.n_resamples, 2000),
                                        seed=self.seed)
                    refused = "" if g.passed else g.describe()
                self.built[k] = (pairs, refused)
            except ValueError as err:                    # not evaluable here: NaN with the reason, never 0
                self.built[k] = (None, str(err).split(";")[0])
        return self.built[k]

    def __call__(self, model, pairs, arm_key: str) -> pd.DataFrame:
        k, arm = int(arm_key.split(":")[0]), arm_key.split(":", 1)[1]
        pairs, reason = self.pairs_for(model, k)
        if pairs is None:
            return _nan_rows(arm_key, reason)
        if arm == "state_swap":
            result = iv.state_swap(model, pairs, [self.chosen], batch_size=self.batch_size)
        else:
            result = iv.random_update(model, pairs, [self.chosen], kind="state_swap", seed=self.seed,
                                      batch_size=self.batch_size)
        frame = example_metrics(pairs, result, intervention=arm)
        if reason:                                       # refused by the gate: recall only
            frame[["donor_margin_shift", "donor_answer", "nontarget_break"]] = np.nan
        frame.insert(0, "arm", arm_key)
        frame["reason"] = reason
        return frame[["arm", "row", "source", "is_target", *METRICS, "reason"]]


def run_retention(model, head: Optional[Sequence[int]] = None, *, from_scan=None, loads: Sequence[int] = LOADS,
                  total_length: Optional[int] = None, n_sources: int = 16, n_nontarget: int = 7, n_dev: int = 16,
                  layout=None, seed: int = 0, batch_size: int = 16,
                  n_resamples: int = 9999, gate_threshold: Optional[float] = None, run_dir=None,
                  model_name: str = "model", progress=None, executor=None) -> ProtocolResult:
    """The three measures of Fig. 8 at every K of `loads` on `n_sources` held-out sources. The head is `head`, else
    the top of `from_scan`, else the winner of a scan on `n_dev` dev sources. total_length: the fixed sequence length
    (default: the K = 16 layout with 128 filler tokens, as capacity.py). gate_threshold: when set, a K whose clean
    recall the capability gate refuses keeps its recall but reports no edit shift or break rate. layout: the pairs'
    layout and words (a PairSpec, PairLayout or layout name; default the §3.3 layout), under `seed`. executor: the
    CLI's --ray runner; the arms of each K are then one unit on a Ray worker."""

    bad = [k for k in loads if not isinstance(k, (int, np.integer)) or k < 1]
    if bad:
        raise ValueError(f"loads must be integers >= 1 (numbers of facts K); got {bad}")
    base = pair_spec(layout, seed=seed)
    chosen, _ = frozen_head(model, head, from_scan, n_dev=n_dev, layout=base)
    tok = model.tokenizer
    if total_length is None:
        total_length = 128 + bare_length(tok, load_layout(16, base))
    arms = [f"{int(k)}:{arm}" for k in loads for arm in ARMS]
    compute = LoadArm(base, total_length, n_sources, n_nontarget, chosen, batch_size, gate_threshold, n_resamples,
                      seed)
    rows = run_arms(model, run_dir, "retention_rows", ("arm", "row"), arms, compute, progress=progress,
                    executor=executor, unit_of=lambda arm: arm.split(":")[0])
    rows["reason"] = rows["reason"].fillna("")
    rows["k"] = rows["arm"].str.split(":").str[0].astype(int)
    rows["intervention"] = rows["arm"].str.split(":", n=1).str[1]
    ok = rows[rows["source"].notna()].copy()
    ok["source"] = ok["source"].astype(int)
    summary = summarise_metrics(ok, METRICS, by=("k", "intervention"), n_resamples=n_resamples, seed=seed)
    reasons = rows.groupby("k")["reason"].agg(lambda r: next((x for x in r if x), ""))
    missing = [{"k": int(k), "intervention": a, "metric": m, "estimate": np.nan, "low": np.nan, "high": np.nan,
                "n_sources": 0, "n_examples": 0, "method": "not evaluated"}
               for k in loads for a in ARMS for m in METRICS
               if summary[(summary["k"] == k) & (summary["intervention"] == a) & (summary["metric"] == m)].empty]
    summary = pd.concat([summary, pd.DataFrame(missing)], ignore_index=True) if missing else summary
    summary["reason"] = [(reasons.get(k, "") or ("no non-target fact at K = 1" if m == "nontarget_break" and k == 1
                                                  else "")) if pd.isna(e) else ""
                         for k, m, e in zip(summary["k"], summary["metric"], summary["estimate"])]
    pooled = pooled_break_rate(ok, ("k", "intervention"), n_resamples=n_resamples, seed=seed)
    extra = [pooled.drop(columns=["breaks", "eligible"])]
    evaluated = sorted(set(ok[ok["donor_margin_shift"].notna()]["k"]))
    if len(evaluated) >= 2:
        try:               # the paper's claim is about K = 32; the highest K stands in only where 32 is not run
            extra.append(pd.DataFrame([shift_kept(ok, evaluated[0], 32 if 32 in evaluated else evaluated[-1],
                                                  n_resamples=n_resamples, seed=seed)]))
        except ValueError:                                 # no low-load shift to divide by: no ratio is read
            pass
    summary = pd.concat([summary, *extra], ignore_index=True)
    summary["reason"] = summary["reason"].fillna("")
    summary = summary.sort_values(["k", "intervention", "metric"]).reset_index(drop=True)
    sources = ok.groupby(["k", "intervention", "source"])[list(METRICS)].mean().reset_index()
    info = {"head": chosen, **model_record(model), "total_length": int(total_length), "loads": [int(k) for k in loads],
            "n_sources": n_sources, "n_nontarget": n_nontarget, "template": base.layout.template,
            "vocab": base.vocab,
            "gate": gate_threshold, "break_counts": pooled[["k", "intervention", "breaks", "eligible"]]
            .to_dict("records")}
    result = ProtocolResult("retention", rows, sources, summary, info=info)
    figures = []
    if summary["estimate"].notna().any():
        figures.append(FigureSpec("retention", summary, dict(
            row_col="k", hue_col="intervention", panels=["clean_correct", "donor_margin_shift", "nontarget_break"],
            kind="lines", percent=["clean_correct", "nontarget_break"], reference={"nontarget_break": 0.05},
            reference_labels={"nontarget_break": "5% break rate"},
            row_labels=LABELS, row_name="facts K (fixed sequence length)",
            panel_labels={"clean_correct": "clean recall", "donor_margin_shift": "target edit shift",
                          "nontarget_break": "non-target break (mean of per-source rates)"},
            title=f"{model_name}: retention, edit and breakage, head {head_label(chosen)}")))
    return finish(result, run_dir, lambda r: retention_section(r, model_name), figures)


def retention_section(result: ProtocolResult, model_name: str) -> Section:
    s, info = result.summary, result.info
    counts = {(c["k"], c["intervention"]): c for c in info["break_counts"]}
    table = ["| K | clean recall | edit shift (swap) | edit shift (random) | break, pooled (swap, breaks / correct) | "
             "break, pooled (random) | not evaluated because |", "|---|---|---|---|---|---|---|"]
    for k in info["loads"]:
        c = counts.get((k, "state_swap"))
        n = f" ({int(c['breaks'])}/{int(c['eligible'])})" if c else ""
        reason = "; ".join(dict.fromkeys(r for r in s[s["k"] == k]["reason"] if r))
        table.append(f"| {k} | {ci_text(s, {'k': k, 'intervention': 'state_swap'}, 'clean_correct', pct=True)} | "
                     f"{ci_text(s, {'k': k, 'intervention': 'state_swap'}, 'donor_margin_shift')} | "
                     f"{ci_text(s, {'k': k, 'intervention': 'random_update'}, 'donor_margin_shift')} | "
                     f"{ci_text(s, {'k': k, 'intervention': 'state_swap'}, 'pooled_break_rate', pct=True)}{n} | "
                     f"{ci_text(s, {'k': k, 'intervention': 'random_update'}, 'pooled_break_rate', pct=True)} | "
                     f"{reason} |")
    intro = (f"K facts at a fixed total length of {info['total_length']} tokens (K <= 16: 3 presentations, 24-token "
             f"gaps; K >= {HIGH_LOAD}: one presentation, 4-token gaps); {info['n_sources']} held-out sources, the "
             f"target and up to {info['n_nontarget']} non-target facts queried per pair; template "
             f"`{info['template']}`, {info['vocab']}"
             + (f"; capability gate at {100 * info['gate']:.0f}%" if info["gate"] else "")
             + ". The break rate is pooled over the originally-correct non-targets of every source. – marks a point "
             "not evaluated (reason given), never 0.")
    return Section(f"Retention, edit strength and breakage against K: {model_name}, head {head_label(info['head'])}",
                   intro, [table], reading(s, info))


#: Each family's claims at K = 32 (verdicts.paper_family): clean recall, and the highest pooled break rate.
FAMILY_PAPER = {GLA: (Claim.effect(0.47, "47% on GLA-340M"),
                      Claim.effect(0.05, "about 5% on GLA-340M (near or above the 5% line)")),
                GDN: (Claim.between(0.60, 0.69, "60% / 69% on GDN-340M / GDN-1.3B"),
                      Claim.at_most(0.02, "under 2% on GDN-340M and GDN-1.3B"))}


def reading(s: pd.DataFrame, info: dict) -> list:
    """info["family"] (GLA or GDN, verdicts.paper_family) picks the paper's numbers of the model's family; another
    family's model gets no verdict against them (the random update is a control and is judged on any model)."""
    family = info.get("family")
    recall_claims = {fam: c[0] for fam, c in FAMILY_PAPER.items()}
    break_claims = {fam: c[1] for fam, c in FAMILY_PAPER.items()}
    out = [f"The paper at K = 32: clean recall {PAPER['recall_k32']}; the target edit shift {PAPER['shift']}; "
           f"non-target break rate {PAPER['break_k32']}."]
    swap = {"intervention": "state_swap"}
    evaluated = [k for k in info["loads"] if (m := measure_from(s, {"k": k, **swap}, "clean_correct")) and m.defined]
    if not evaluated:
        return out + ["No K was evaluated here."]
    lo_k, hi_k = min(evaluated), max(evaluated)
    if 32 in evaluated:
        out.append(judge_family(measure_from(s, {"k": 32, **swap}, "clean_correct", "pct"), family, recall_claims,
                                "Clean recall at K = 32", PAPER["recall_k32"]))
    moves = Claim.positive("the swap moves the target towards the donor")
    low_measure = measure_from(s, {"k": lo_k, **swap}, "donor_margin_shift")
    # whether the head carries the fact at all decides whether a trend is read, on any model
    low = judge(low_measure, moves, f"The state swap's edit shift at K = {lo_k}")
    out.append(judge_family(low_measure, family, {GLA: moves, GDN: moves}, f"The state swap's edit shift at K = {lo_k}",
                            "the swap moves the target towards the donor on GLA and GDN"))
    if low.kind != AGREES:
        out.append("The head does not carry the fact at low load here, so no trend of its edit with K is read.")
    elif 32 in evaluated and lo_k != 32:
        halves = Claim.at_most(0.5, "the edit halves or more by K = 32")
        out.append(judge_family(measure_from(s, {"k": 32, **swap}, "shift_kept", "pct"), family,
                                {GLA: halves, GDN: halves}, f"The share of the K = {lo_k} edit shift kept at K = 32",
                                "the edit halves or more by K = 32 on GLA and GDN"))
    elif (kept := measure_from(s, {"k": hi_k, **swap}, "shift_kept", "pct")) is not None:
        out.append(f"The share of the K = {lo_k} edit shift kept at K = {hi_k} is {kept.text()}; the paper's claim "
                   "is about K = 32, not run here, so no verdict is given.")
    breaks = [(k, measure_from(s, {"k": k, **swap}, "pooled_break_rate", "pct")) for k in evaluated]
    breaks = [(k, m) for k, m in breaks if m is not None and m.defined]
    if breaks:
        k, m = max(breaks, key=lambda km: km[1].estimate)
        out.append(judge_family(m, family, break_claims,
                                f"The swap's pooled non-target break rate at K = {k}, its highest", PAPER["break_k32"]))
        out.append(f"The paper's GLA break-rate wording ('above 5%' from low load) is looser than its Fig. 8(c), and "
                   f"Fig. 5's 1.42% at K = 4 is not Fig. 8's K = 4 point ({AMBIGUITIES}).")
    for k in (lo_k, hi_k) if hi_k != lo_k else (lo_k,):
        control = measure_from(s, {"k": k, "intervention": "random_update"}, "donor_margin_shift")
        if control is not None:
            out.append(control_verdict(f"equal-norm random update at K = {k}", control,
                                       main=measure_from(s, {"k": k, **swap}, "donor_margin_shift"),
                                       main_name="the state swap"))
    missing = [k for k in info["loads"] if k not in evaluated]
    if missing:
        out.append(f"K = {', '.join(map(str, missing))} could not be evaluated (see the table); those points are "
                   "missing, not zero.")
    return out
