"""Neutral suppression (How Linear Attention Remembers, App. D.1, Fig. 12).

The donor holds filler of equal token length where the recipient presents the target fact (build_neutral_pairs),
so a state swap of the frozen head removes the target's value without offering another; all four facts are queried.
Reported: target accuracy before and after, the other three facts' accuracy change in percentage points, their
margin change and break counts, and the same for the equal-norm random update.

Paper: GLA 91.8% -> 7.6% on the target with +2.15 pp on the others; GDN 96.1% -> 37.1%, +1.11 pp.
"""
from __future__ import annotations

from typing import Optional, Sequence

import pandas as pd

from recurscope.interp import interventions as iv
from recurscope.interp.metrics import example_metrics
from recurscope.interp import stats
from recurscope.interp.protocols._common import (ProtocolResult, add_protocol_args, ci_text, estimate, finish,
                                                 frozen_head, head_label, layout_from_args, logged_arms, max_length,
                                                 open_run, pair_kwargs, work_args)

__all__ = ["ARMS", "run_neutral", "build_neutral_all_pairs", "add_verb"]

ARMS = ("state_swap", "random_update")
LABELS = {"state_swap": "state swap (neutral donor)", "random_update": "equal-norm random update"}
METRICS = ("target_clean_accuracy", "target_accuracy", "others_clean_accuracy", "others_accuracy_change",
           "nontarget_margin_change", "nontarget_break")
PAPER = "GLA 91.8% -> 7.6% (+2.15 pp on the others); GDN 96.1% -> 37.1% (+1.11 pp)"


def build_neutral_all_pairs(tokenizer, *, n_sources: int = 32, split: str = "heldout", model=None, **layout):
    """Neutral-donor pairs with every fact queried, in the §3.3 layout unless overridden."""
    from recurscope.interp.data import build_neutral_pairs

    return build_neutral_pairs(tokenizer, split=split, n_sources=n_sources, queries="all",
                               max_length=None if model is None else max_length(model), **{**pair_kwargs(), **layout})


def neutral_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """Adds the neutral protocol's columns to example_metrics rows: accuracy before/after on the target and the
    others (NaN on the other kind of row), so that source means and the bootstrap skip them."""
    t = frame["is_target"].astype(bool)
    out = frame.copy()
    out["target_clean_accuracy"] = frame["clean_correct"].where(t)
    out["target_accuracy"] = frame["correct"].where(t)
    out["others_clean_accuracy"] = frame["clean_correct"].where(~t)
    out["others_accuracy_change"] = (frame["correct"] - frame["clean_correct"]).where(~t)
    return out


def run_neutral(model, pairs=None, head: Optional[Sequence[int]] = None, *, run_dir=None, from_scan=None,
                n_sources: int = 32, n_dev: int = 16, layout: Optional[dict] = None, seed: int = 0,
                batch_size: int = 16, n_resamples: int = 9999, model_name: str = "model",
                progress=None) -> ProtocolResult:
    layout = {**pair_kwargs(seed=seed), **(layout or {})}
    chosen, _ = frozen_head(model, head, from_scan, n_dev=n_dev, layout=layout)
    if pairs is None:
        pairs = build_neutral_all_pairs(model.tokenizer, n_sources=n_sources, model=model, **layout)
    if set(pairs.variants) != {"neutral"}:
        raise ValueError("neutral suppression needs neutral-donor pairs: build them with build_neutral_pairs(..., "
                         "queries='all')")

    def compute(arm):
        if arm == "state_swap":
            result = iv.state_swap(model, pairs, [chosen], batch_size=batch_size)
        else:
            result = iv.random_update(model, pairs, [chosen], kind="state_swap", seed=seed, batch_size=batch_size)
        frame = neutral_rows(example_metrics(pairs, result, intervention=arm))
        frame.insert(0, "arm", arm)
        frame["row"] = range(len(frame))
        return frame
    rows = logged_arms(run_dir, "neutral_rows", ("arm", "row"), ARMS, compute, progress)
    sources = rows.groupby(["arm", "source"])[list(METRICS)].mean().reset_index()
    summary = stats.summarise(rows, list(METRICS), by=["arm"], n_resamples=n_resamples, seed=seed)
    nt = rows[~rows["is_target"].astype(bool)]
    counts = nt.groupby("arm").agg(breaks=("nontarget_break", "sum"), eligible=("nontarget_break", "count"),
                                   fixed=("others_accuracy_change", lambda v: int((v > 0).sum()))).reset_index()
    info = {"head": chosen, "n_sources": int(rows["source"].nunique()), "counts": counts.to_dict("records")}
    result = ProtocolResult("neutral", rows, sources, summary, info=info)
    if run_dir is not None:
        from recurscope.interp.plots import plot_interval_panels

        fig = plot_interval_panels(summary, run_dir.figure_path("neutral"), row_col="arm", rows=list(ARMS),
                                   panels=["target_clean_accuracy", "target_accuracy", "others_accuracy_change",
                                           "nontarget_margin_change"],
                                   percent=["target_clean_accuracy", "target_accuracy", "others_accuracy_change"],
                                   title=f"{model_name}: neutral suppression, head {head_label(chosen)}")
        result.figures["neutral"] = fig.png
    result.section = neutral_section(result, model_name)
    return finish(result, run_dir)


def neutral_section(result: ProtocolResult, model_name: str) -> str:
    s, info = result.summary, result.info
    counts = {c["arm"]: c for c in info["counts"]}
    lines = [f"## Neutral suppression: {model_name}, head {head_label(info['head'])}", "",
             f"Neutral donor in the target slot, all four facts queried; {info['n_sources']} held-out sources.", "",
             "| arm | target accuracy before | after | others: accuracy change (pp) | others: margin change | "
             "others: breaks / correct |", "|---|---|---|---|---|---|"]
    for arm in ARMS:
        c = counts.get(arm, {"breaks": 0, "eligible": 0})
        change = estimate(s, {"arm": arm}, "others_accuracy_change")
        change_text = "–" if change is None else \
            f"{100 * change[0]:+.2f} [{100 * change[1]:+.2f}, {100 * change[2]:+.2f}]"
        lines.append(f"| {LABELS[arm]} | {ci_text(s, {'arm': arm}, 'target_clean_accuracy', pct=True)} | "
                     f"{ci_text(s, {'arm': arm}, 'target_accuracy', pct=True)} | {change_text} | "
                     f"{ci_text(s, {'arm': arm}, 'nontarget_margin_change')} | {int(c['breaks'])}/{int(c['eligible'])} |")
    if "neutral" in result.figures:
        lines += ["", f"![neutral](figures/{result.figures['neutral'].name})"]
    before, after = estimate(s, {"arm": "state_swap"}, "target_clean_accuracy"), estimate(s, {"arm": "state_swap"}, "target_accuracy")
    others = estimate(s, {"arm": "state_swap"}, "others_accuracy_change")
    reading = [f"The paper: {PAPER}."]
    if before and after and others:
        reading.append(f"Here the swap takes the target from {100 * before[0]:.1f}% to {100 * after[0]:.1f}% and "
                       f"changes the others by {100 * others[0]:+.2f} pp [{100 * others[1]:+.2f}, {100 * others[2]:+.2f}].")
        suppressed = after[2] < before[0] - 0.3
        reading.append("The target is suppressed and the others survive, as in the paper." if suppressed
                       and others[1] > -0.05 else
                       "The target is suppressed, but the others lose accuracy (unlike the paper)." if suppressed else
                       "The target is NOT suppressed by the neutral donor on this model (unlike the paper).")
    rand = estimate(s, {"arm": "random_update"}, "target_accuracy")
    if rand and before:
        reading.append(f"The equal-norm random update leaves the target at {100 * rand[0]:.1f}%.")
    lines += ["", "### Reading", "", " ".join(reading)]
    return "\n".join(lines)


def add_verb(sub, model_args, load) -> None:
    p = sub.add_parser("neutral", help="neutral suppression of the target fact (App. D.1, Fig. 12)")
    model_args(p)
    add_protocol_args(p, n_sources=32)
    p.set_defaults(fn=lambda args: _cli(args, load))


def _cli(args, load) -> int:
    model = load(args)
    run = open_run(args.out, kind="neutral", model=model, model_name=args.model, args=work_args(args),
                   seeds=[args.seed], split="heldout")
    result = run_neutral(model, head=args.head, run_dir=run, from_scan=args.from_scan, n_sources=args.n_sources,
                         n_dev=args.n_dev, layout=layout_from_args(args), seed=args.seed, batch_size=args.batch_size,
                         n_resamples=args.resamples, model_name=args.model,
                         progress=lambda arm: print(f"neutral: {arm}", flush=True))
    print(result.section)
    print(f"results in {run.path}")
    return 0
