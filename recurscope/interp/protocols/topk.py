"""The App. E.2 top-k test in two input formats (How Linear Attention Remembers, App. E.2, Fig. 14 right).

Per format, on its own cohort: every recurrent component is ranked by J on `n_dev` dev sources (interp.scan) and the
ranking is frozen; on `n_sources` held-out sources the top-k components are state-swapped jointly, k = 1, 2, 4, ...
up to all, and recovery(k) = shift(top k) / shift(all components) (protocols.heads' arms and intervals).

A component is a state: on GLA with query groups (GLA-7B, num_kv_heads < num_heads) it is one state group read by
`model.query_group` query heads, not one query head; on RWKV-7 one head's state.

Formats (FORMATS): "compact" is the paper's App. B layout as recurscope reads it (facts "KEY VALUE.", the query the
key alone, one token, whose next token is the answer); "naturalized" writes each fact as a sentence and asks a
question ("KEY is in VALUE." ... "where is KEY? KEY is in"). The study notes give neither format's wording; both keep
App. B's 4 bindings x 3 presentations and filler, so that only the wording differs.

Capability gate: each format's held-out cohort must reach `gate_threshold` clean recall (recipient and donor,
protocols.gate.capability_gate) before its recovery is reported or compared with the paper; a refused format reports
its clean recall only, and says when that recall is at chance (1 / candidates). gate_threshold=None reports every
format ungated and compares none with the paper.

Paper (App. E.2): on a format-matched cohort RWKV7-13.3B's frozen top-1 recovers 7.5% compact and 54.8% naturalized;
GLA-7B's top-1 recovers 12.3% compact (top-16: 92.3%), GLA-340M's 94.7%.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import pandas as pd

from recurscope.interp import interventions as iv
from recurscope.interp.protocols._common import (ProtocolResult, ci_text, head_label, max_length, model_record,
                                                 pair_spec, run_arms)
from recurscope.interp.capability import capability_gate
from recurscope.interp.protocols._rankings import (arm_rows, frozen_ranking, recovery_records, scan_ranking,
                                                   swap_arms, top_k_sizes)
from recurscope.interp.protocols.runner import FigureSpec, Section, finish
from recurscope.interp.protocols.verbs import GATE_THRESHOLD, TOPK_FORMATS
from recurscope.interp.verdicts import Claim, judge, measure_from

__all__ = ["FORMATS", "PAPER", "format_layout", "paper_claim", "run_topk", "reading"]

#: format -> the recall template that words it (interp.data.words).
FORMATS = {"compact": "key_value", "naturalized": "is_in"}
assert tuple(FORMATS) == TOPK_FORMATS      # verbs.py names them for --formats without importing this module

#: The paper's frozen top-1 recovery, per (checkpoint, format), with how it says it.
PAPER = {
    ("RWKV7-13.3B", "compact"): (0.075, "7.5% compact on RWKV7-13.3B (format-matched cohort)"),
    ("RWKV7-13.3B", "naturalized"): (0.548, "54.8% naturalized on RWKV7-13.3B (format-matched cohort; 53.1% on "
                                             "another cohort)"),
    ("GLA-7B", "compact"): (0.123, "12.3% compact on GLA-7B, one state group read by four query heads (top-16: "
                                   "92.3%)"),
    ("GLA-340M", "compact"): (0.947, "94.7% compact on GLA-340M"),
}


def format_layout(fmt: str, *, filler: int = 512, presentations: int = 3, gap: int = 24, n_facts: int = 4,
                  vocab: str = "cities", seed: int = 0):
    """The PairSpec of one format: App. B's bindings, presentations and filler, worded by the format's template."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose from {list(FORMATS)}")
    return pair_spec("paper", filler_tokens=filler, presentations=presentations, n_facts=n_facts,
                     template=FORMATS[fmt], vocab=vocab, seed=seed, gap_tokens=gap)


@dataclass(frozen=True)
class SwapArm:
    """One joint top-k state swap of one format, called as (model, pairs, arm) in this process or, under --ray, on a
    worker (a picklable unit, _common.run_arms)."""

    arms: dict
    batch_size: int

    def __call__(self, model, pairs, arm: str) -> pd.DataFrame:
        fmt, heads = self.arms[arm]
        return arm_rows(model, pairs, "state_swap", heads, arm, self.batch_size).assign(format=fmt)


def paper_checkpoint(model) -> Optional[str]:
    """The paper checkpoint whose E.2 numbers a model's family is compared with: RWKV-7 -> RWKV7-13.3B, GLA with
    query groups -> GLA-7B, GLA without -> GLA-340M; None for a family the appendix does not test."""
    return model.family.paper_checkpoint(model)   # the family's spec says it


#: The parameter counts of the checkpoints App. E.2 reports, for the Reading's scale caveat.
PAPER_PARAMS = {"RWKV7-13.3B": 13.3e9, "GLA-7B": 7e9, "GLA-340M": 340e6}


def paper_claim(model, fmt: str) -> Optional[tuple[float, str]]:
    checkpoint = paper_checkpoint(model)
    return None if checkpoint is None else PAPER.get((checkpoint, fmt))


def run_topk(model, *, formats: Sequence[str] = tuple(FORMATS), ranking: Optional[pd.DataFrame] = None,
             n_dev: int = 32, n_sources: int = 64, filler: int = 512, presentations: int = 3, gap: int = 24,
             seed: int = 0, gate_threshold: Optional[float] = GATE_THRESHOLD, batch_size: int = 16,
             n_resamples: int = 9999, run_dir=None, model_name: str = "model", progress=None,
             executor=None) -> ProtocolResult:
    """The joint top-k recovery per format, each on its own dev ranking (or `ranking`, a scan's scan_heads table,
    frozen for every format) and held-out cohort, gated by clean recall unless gate_threshold is None. executor:
    the CLI's --ray runner; each arm is then one unit on a Ray worker."""
    from recurscope.interp.data import build_pairs

    formats = list(formats)
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        raise ValueError(f"formats must be a non-empty list from {list(FORMATS)}; got {formats}")
    layouts = {f: format_layout(f, filler=filler, presentations=presentations, gap=gap, seed=seed) for f in formats}
    orders = {f: frozen_ranking(model, ranking, n_dev, layouts[f]) for f in formats}
    if len(orders[formats[0]]) < 2:
        raise ValueError("the top-k test needs at least two recurrent components (state heads)")
    pairs = {f: build_pairs(model.tokenizer, split="heldout", n_sources=n_sources, max_length=max_length(model),
                            **layouts[f].kwargs()) for f in formats}
    gates, records, recall = {}, [], []
    for f in formats:      # clean recall is measured in every format; the gate applies only with a threshold
        p = pairs[f]
        clean = iv.clean_run(model, p, batch_size=batch_size)
        g = capability_gate(model, p, threshold=gate_threshold or GATE_THRESHOLD, condition=f, batch_size=batch_size,
                            n_resamples=min(n_resamples, 2000), seed=seed, clean=clean)
        gates[f] = g
        target = p.is_target.bool()
        correct = (clean["recipient"].argmax(1) == p.recipient_answer_index)[target].float().numpy()
        recall.append(pd.DataFrame({"arm": f"{f}:clean", "row": np.flatnonzero(target.numpy()),
                                    "source": p.source_id[target].numpy(), "clean_recall": correct, "format": f}))
        for side, ci in (("recipient", g.recipient), ("donor", g.donor)):
            records.append({"analysis": "gate", "format": f, "unit": side, "metric": "clean_recall",
                            "estimate": ci.estimate, "low": ci.low, "high": ci.high, "n_sources": ci.n_sources,
                            "method": ci.method, "k": np.nan})
    reported = [f for f in formats if gate_threshold is None or gates[f].passed]
    arms = {f"{f}:{name}": (f, heads) for f in reported for name, (_, heads) in swap_arms(orders[f]).items()}

    frames = [run_arms(model, run_dir, "topk_rows", ("arm", "row"), [a for a in arms if arms[a][0] == f],
                       SwapArm(arms, batch_size), pairs[f], progress, executor) for f in reported]
    rows = (pd.concat(frames, ignore_index=True) if frames else
            pd.DataFrame(columns=["arm", "row", "source", "shift", "answer_margin_change", "n_heads", "format"]))
    for f in reported:
        part = rows[(rows["format"] == f) & rows["arm"].str.contains(":swap:")]
        wide = part.pivot(index=["row", "source"], columns="arm", values="shift").reset_index()
        for r in recovery_records(wide, top_k_sizes(len(orders[f])), n_resamples=n_resamples, seed=seed,
                                  prefix=f"{f}:"):
            records.append({**r, "format": f})
    summary = pd.DataFrame(records)
    rows = pd.concat(recall + ([rows] if len(rows) else []), ignore_index=True)   # clean recall rows, then swaps
    sources = rows.groupby(["arm", "source"])[[c for c in ("clean_recall", "shift") if c in rows]].mean().reset_index()
    chance = 1.0 / pairs[formats[0]].candidate_ids.shape[1]
    info = {"formats": formats, "reported": reported, "rankings": orders, "gate": gate_threshold,
            "gates": {f: g.passed for f, g in gates.items()}, "n_sources": n_sources, "n_dev": n_dev,
            "chance": chance, "query_group": getattr(model, "query_group", 1),
            "checkpoint": paper_checkpoint(model), "claims": {f: paper_claim(model, f) for f in formats},
            "n_components": len(orders[formats[0]]), **model_record(model)}
    if info["checkpoint"] is not None:          # the scale caveat compares with the checkpoint the claims are from
        info.update(paper_params=PAPER_PARAMS[info["checkpoint"]], paper_model=info["checkpoint"])
    result = ProtocolResult("topk", rows, sources, summary, info=info)
    curve = summary[summary["analysis"] == "recovery"]
    m = info["query_group"]
    unit, whole = ("heads", "the all-head swap") if m == 1 else ("state groups", "the all-group swap")
    if len(curve):
        figure = FigureSpec("topk", curve, dict(
            row_col="k", hue_col="format", panels=["recovery"], kind="lines", percent=["recovery"],
            reference={"recovery": 1.0}, panel_labels={"recovery": "recovery(k)"},
            reference_labels={"recovery": whole}, row_name=f"k (top-k {unit} swapped jointly)",
            title=f"{model_name}: joint top-k state swap ({', '.join(reported)}"
                  + ("" if m == 1 else f"; groups of {m} query heads") + ")"))
    else:                  # every format refused by the gate: the figure shows why
        figure = FigureSpec("topk", summary, dict(
            row_col="format", hue_col="unit", panels=["clean_recall"], percent=["clean_recall"],
            reference={"clean_recall": gate_threshold}, panel_labels={"clean_recall": "clean recall"},
            reference_labels={"clean_recall": f"the {100 * gate_threshold:.0f}% gate"},
            title=f"{model_name}: every format under the capability gate; no top-k recovery reported"))
    figures = [figure]
    return finish(result, run_dir, lambda r: topk_section(r, model_name), figures)


def _component(info: dict) -> str:
    m = info["query_group"]
    return (f"a state group read by {m} query heads" if m > 1 else "one head's state")


def topk_section(result: ProtocolResult, model_name: str) -> Section:
    s, info = result.summary, result.info
    gate = ["| format | template | clean recall, recipient | clean recall, donor | gate |", "|---|---|---|---|---|"]
    for f in info["formats"]:
        w = {"analysis": "gate", "format": f}
        verdict = "not applied" if info["gate"] is None else ("pass" if info["gates"][f] else "refused")
        gate.append(f"| {f} | {FORMATS[f]} | {ci_text(s, {**w, 'unit': 'recipient'}, 'clean_recall', pct=True)} | "
                    f"{ci_text(s, {**w, 'unit': 'donor'}, 'clean_recall', pct=True)} | {verdict} |")
    curve = ["| format | k | shift | recovery(k) |", "|---|---|---|---|"]
    for f in info["reported"]:
        for k in top_k_sizes(len(info["rankings"][f])):
            w = {"analysis": "recovery", "format": f, "k": k}
            curve.append(f"| {f} | {k} | {ci_text(s, w, 'shift')} | {ci_text(s, w, 'recovery', pct=True)} |")
    if not info["reported"]:
        curve = ["No format passed the capability gate: no top-k recovery is reported."]
    ranks = "; ".join(f"{f}: " + ", ".join(head_label(h) for h in info["rankings"][f][:4])
                      + (" ..." if len(info["rankings"][f]) > 4 else "") for f in info["formats"])
    intro = (f"{info['n_components']} components, each {_component(info)}. Rankings frozen on {info['n_dev']} dev "
             f"sources per format ({ranks}); {info['n_sources']} held-out sources per format"
             + (f"; each format gated at {100 * info['gate']:.0f}% clean recall" if info["gate"] else
                "; no capability gate") + ".")
    return Section(f"App. E.2 top-k test: {model_name}", intro, [gate, curve], reading(s, info))


def reading(s: pd.DataFrame, info: dict) -> list[str]:
    out = ["The paper (App. E.2, frozen top-1 on a format-matched cohort): RWKV7-13.3B recovers 7.5% in the compact "
           "format and 54.8% in the naturalized one; GLA-7B, whose one intervenable state group is read by four "
           "query heads, recovers 12.3% compact (the top 16 recover 92.3%); GLA-340M 94.7% compact."]
    if info["query_group"] > 1:
        out.append(f"Here a \"head\" is a state group read by {info['query_group']} query heads, as on GLA-7B.")
    chance = info["chance"]
    for f in info["formats"]:
        claim = info["claims"].get(f)
        top1 = measure_from(s, {"analysis": "recovery", "format": f, "k": 1}, "recovery", "pct")
        rec = measure_from(s, {"analysis": "gate", "format": f, "unit": "recipient"}, "clean_recall", "pct")
        at_chance = rec is not None and rec.defined and rec.low <= chance <= rec.high
        plainly = (f" That is chance ({100 * chance:.0f}% among {round(1 / chance)} candidates): the model does not "
                   "do the task in this format (a random or untrained model reads the same), so top-k numbers here "
                   "would say nothing about the paper's." if at_chance else "")
        if info["gate"] is None:
            text = top1.text() if top1 is not None else "–"
            out.append(f"{f.capitalize()} format, ungated: the top-1 component recovers {text}; not compared with "
                       "the paper, which reads recovery only on a model that recalls the facts. Clean recall: "
                       f"{rec.text() if rec else '–'}." + plainly)
            continue
        if not info["gates"][f]:
            out.append(f"{f.capitalize()} format: not judged: clean recall {rec.text() if rec else '–'}, is under "
                       f"the {100 * info['gate']:.0f}% gate, so its top-k recovery is not reported." + plainly)
            continue
        if claim is None:
            out.append(f"{f.capitalize()} format: the top-1 component recovers "
                       f"{top1.text() if top1 is not None else '–'}; the paper gives no number for "
                       f"{info['checkpoint'] or 'this family'} in this format.")
            continue
        value, paper = claim
        ks = sorted(s.loc[(s["analysis"] == "recovery") & (s["format"] == f), "k"].dropna().astype(int).unique())
        whole = measure_from(s, {"analysis": "recovery", "format": f, "k": ks[-1]}, "shift") if ks else None
        out.append(judge(top1, Claim.equals(value, paper), f"{f.capitalize()} format: the frozen top-1 component's "
                                                           f"recovery of the all-component shift", denominator=whole))
    return out


def _from_args(model, args, run_dir, progress, executor=None) -> ProtocolResult:
    return run_topk(model, formats=args.formats, ranking=scan_ranking(model, args.from_scan), n_dev=args.n_dev, n_sources=args.n_sources,
                    filler=args.filler, presentations=args.presentations, gap=args.gap, seed=args.seed,
                    gate_threshold=None if args.no_gate else args.gate, batch_size=args.batch_size,
                    n_resamples=args.resamples, run_dir=run_dir, model_name=args.model, progress=progress,
                    executor=executor)
