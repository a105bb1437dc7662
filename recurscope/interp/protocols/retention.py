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
from typing import Optional, Sequence

import numpy as np
import pandas as pd

from recurscope.interp import interventions as iv
from recurscope.interp.metrics import example_metrics, summarise_metrics
from recurscope.interp.protocols._common import (ProtocolResult, ci_text, estimate, finish, frozen_head, head_label,
                                                 logged_arms, max_length, open_run, pair_kwargs)
from recurscope.interp.protocols.capacity import HIGH_LOAD, LOADS, _bare_length, fixed_length_filler, load_layout

__all__ = ["LOADS", "ARMS", "METRICS", "PAPER", "retention_pairs", "run_retention", "add_verb"]

ARMS = ("state_swap", "random_update")
LABELS = {"state_swap": "state swap", "random_update": "equal-norm random update"}
METRICS = ("clean_correct", "donor_margin_shift", "donor_answer", "nontarget_break")
PAPER = {"recall_k32": "47% / 60% / 69% (GLA-340M / GDN-340M / GDN-1.3B)",
         "shift": "halves or more from low load to K = 32",
         "break_k32": "GDN under 2%, GLA about 5%"}
#: a low-load state-swap shift below this (logits) means the head carries no fact: no ratio is read from it
NEGLIGIBLE_SHIFT = 0.25


def retention_pairs(tokenizer, layout: dict, *, n_sources: int, n_nontarget: int = 7, seed: int = 0,
                    max_len: Optional[int] = None):
    """Multi-fact pairs of `layout` with, per pair, its target row and up to `n_nontarget` non-target rows drawn
    once under `seed` (all of them when K - 1 <= n_nontarget): at K = 64 every row costs a forward, so not every
    fact is queried."""
    from recurscope.interp.data import build_multifact_pairs

    if not isinstance(n_nontarget, int) or n_nontarget < 0:
        raise ValueError(f"n_nontarget must be an integer >= 0; got {n_nontarget!r}")
    pairs = build_multifact_pairs(tokenizer, split="heldout", n_sources=n_sources, max_length=max_len, **layout)
    rng = random.Random(f"retention-rows/{seed}/{layout['n_facts']}")
    keep = []
    for g in sorted(set(pairs.group.tolist())):
        rows = [i for i in range(len(pairs)) if int(pairs.group[i]) == g]
        target = [i for i in rows if bool(pairs.is_target[i])]
        others = [i for i in rows if not bool(pairs.is_target[i])]
        keep += target + sorted(rng.sample(others, min(n_nontarget, len(others))))
    return pairs.select(keep)


def _nan_rows(arm: str, reason: str) -> pd.DataFrame:
    return pd.DataFrame({"arm": [arm], "row": [-1], "source": [np.nan], "is_target": [False],
                         **{m: [np.nan] for m in METRICS}, "reason": [reason]})


def run_retention(model, head: Optional[Sequence[int]] = None, *, from_scan=None, loads: Sequence[int] = LOADS,
                  total_length: Optional[int] = None, n_sources: int = 16, n_nontarget: int = 7, n_dev: int = 16,
                  template: str = "is_in", vocab: str = "cities", seed: int = 0, batch_size: int = 16,
                  n_resamples: int = 9999, gate_threshold: Optional[float] = None, run_dir=None,
                  model_name: str = "model", progress=None) -> ProtocolResult:
    """The three measures of Fig. 8 at every K of `loads` on `n_sources` held-out sources. The head is `head`, else
    the top of `from_scan`, else the winner of a scan on `n_dev` dev sources. total_length: the fixed sequence length
    (default: the K = 16 layout with 128 filler tokens, as capacity.py). gate_threshold: when set, a K whose clean
    recall the capability gate refuses keeps its recall but reports no edit shift or break rate."""
    from recurscope.interp.protocols.gate import capability_gate

    bad = [k for k in loads if not isinstance(k, (int, np.integer)) or k < 1]
    if bad:
        raise ValueError(f"loads must be integers >= 1 (numbers of facts K); got {bad}")
    chosen, _ = frozen_head(model, head, from_scan, n_dev=n_dev, layout=pair_kwargs(template=template, vocab=vocab,
                                                                                     seed=seed))
    tok = model.tokenizer
    if total_length is None:
        total_length = 128 + _bare_length(tok, load_layout(16, template=template, vocab=vocab, seed=seed))
    arms = [f"{int(k)}:{arm}" for k in loads for arm in ARMS]
    built: dict = {}

    def pairs_for(k: int):
        if k not in built:
            try:
                layout = load_layout(k, template=template, vocab=vocab, seed=seed)
                layout = {**layout, "filler_tokens": fixed_length_filler(tok, layout, total_length)}
                pairs = retention_pairs(tok, layout, n_sources=n_sources, n_nontarget=n_nontarget, seed=seed,
                                        max_len=max_length(model))
                refused = ""
                if gate_threshold is not None:
                    g = capability_gate(model, pairs, threshold=gate_threshold, condition=f"K = {k}",
                                        batch_size=batch_size, n_resamples=min(n_resamples, 2000), seed=seed)
                    refused = "" if g.passed else g.describe()
                built[k] = (pairs, refused)
            except ValueError as err:                    # not evaluable here: NaN with the reason, never 0
                built[k] = (None, str(err).split(";")[0])
        return built[k]

    def compute(arm_key):
        k, arm = int(arm_key.split(":")[0]), arm_key.split(":", 1)[1]
        pairs, reason = pairs_for(k)
        if pairs is None:
            return _nan_rows(arm_key, reason)
        if arm == "state_swap":
            result = iv.state_swap(model, pairs, [chosen], batch_size=batch_size)
        else:
            result = iv.random_update(model, pairs, [chosen], kind="state_swap", seed=seed, batch_size=batch_size)
        frame = example_metrics(pairs, result, intervention=arm)
        if reason:                                       # refused by the gate: recall only
            frame[["donor_margin_shift", "donor_answer", "nontarget_break"]] = np.nan
        frame.insert(0, "arm", arm_key)
        frame["reason"] = reason
        return frame[["arm", "row", "source", "is_target", *METRICS, "reason"]]
    rows = logged_arms(run_dir, "retention_rows", ("arm", "row"), arms, compute, progress)
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
    summary = summary.sort_values(["k", "intervention", "metric"]).reset_index(drop=True)
    sources = ok.groupby(["k", "intervention", "source"])[list(METRICS)].mean().reset_index()
    counts = (ok[ok["nontarget_break"].notna()].groupby(["k", "intervention"])["nontarget_break"]
              .agg(["sum", "count"]).rename(columns={"sum": "breaks", "count": "eligible"}).reset_index())
    info = {"head": chosen, "total_length": int(total_length), "loads": [int(k) for k in loads],
            "n_sources": n_sources, "n_nontarget": n_nontarget, "template": template, "vocab": vocab,
            "gate": gate_threshold, "break_counts": counts.to_dict("records")}
    result = ProtocolResult("retention", rows, sources, summary, info=info)
    if run_dir is not None and summary["estimate"].notna().any():
        from recurscope.interp.plots import plot_interval_panels

        fig = plot_interval_panels(summary, run_dir.figure_path("retention"), row_col="k", hue_col="intervention",
                                   panels=["clean_correct", "donor_margin_shift", "nontarget_break"], kind="lines",
                                   percent=["clean_correct", "nontarget_break"], reference={"nontarget_break": 0.05},
                                   panel_labels={"clean_correct": "clean recall",
                                                 "donor_margin_shift": "target edit shift",
                                                 "nontarget_break": "non-target break"},
                                   title=f"{model_name}: retention, edit and breakage, head {head_label(chosen)}")
        result.figures["retention"] = fig.png
    result.section = retention_section(result, model_name)
    return finish(result, run_dir)


def retention_section(result: ProtocolResult, model_name: str) -> str:
    s, info = result.summary, result.info
    counts = {(c["k"], c["intervention"]): c for c in info["break_counts"]}
    lines = [f"## Retention, edit strength and breakage against K: {model_name}, head {head_label(info['head'])}", "",
             f"K facts at a fixed total length of {info['total_length']} tokens (K <= 16: 3 presentations, 24-token "
             f"gaps; K >= {HIGH_LOAD}: one presentation, 4-token gaps); {info['n_sources']} held-out sources, the "
             f"target and up to {info['n_nontarget']} non-target facts queried per pair; template "
             f"`{info['template']}`, {info['vocab']}"
             + (f"; capability gate at {100 * info['gate']:.0f}%" if info["gate"] else "")
             + ". – marks a point not evaluated (reason given), never 0.", "",
             "| K | clean recall | edit shift (swap) | edit shift (random) | break (swap, breaks / correct) | "
             "break (random) | not evaluated because |", "|---|---|---|---|---|---|---|"]
    for k in info["loads"]:
        c = counts.get((k, "state_swap"))
        n = f" ({int(c['breaks'])}/{int(c['eligible'])})" if c else ""
        reason = "; ".join(dict.fromkeys(r for r in s[s["k"] == k]["reason"] if r))
        lines.append(f"| {k} | {ci_text(s, {'k': k, 'intervention': 'state_swap'}, 'clean_correct', pct=True)} | "
                     f"{ci_text(s, {'k': k, 'intervention': 'state_swap'}, 'donor_margin_shift')} | "
                     f"{ci_text(s, {'k': k, 'intervention': 'random_update'}, 'donor_margin_shift')} | "
                     f"{ci_text(s, {'k': k, 'intervention': 'state_swap'}, 'nontarget_break', pct=True)}{n} | "
                     f"{ci_text(s, {'k': k, 'intervention': 'random_update'}, 'nontarget_break', pct=True)} | "
                     f"{reason} |")
    if "retention" in result.figures:
        lines += ["", f"![retention](figures/{result.figures['retention'].name})"]
    lines += ["", "### Reading", "", " ".join(_reading(s, info))]
    return "\n".join(lines)


def _reading(s: pd.DataFrame, info: dict) -> list[str]:
    out = [f"The paper at K = 32: clean recall {PAPER['recall_k32']}; the target edit shift {PAPER['shift']}; "
           f"non-target break rate {PAPER['break_k32']}."]
    evaluated = [k for k in info["loads"] if estimate(s, {"k": k, "intervention": "state_swap"}, "clean_correct")]
    if not evaluated:
        return out + ["No K was evaluated here."]
    lo_k, hi_k = min(evaluated), max(evaluated)
    r_lo = estimate(s, {"k": lo_k, "intervention": "state_swap"}, "clean_correct")
    r_hi = estimate(s, {"k": hi_k, "intervention": "state_swap"}, "clean_correct")
    out.append(f"Here clean recall goes from {100 * r_lo[0]:.1f}% at K = {lo_k} to {100 * r_hi[0]:.1f}% "
               f"[{100 * r_hi[1]:.1f}, {100 * r_hi[2]:.1f}] at K = {hi_k}.")
    r32 = estimate(s, {"k": 32, "intervention": "state_swap"}, "clean_correct")
    if r32:
        out.append(f"At K = 32 it is {100 * r32[0]:.1f}%"
                   + (", higher than all three of the paper's models." if r32[0] > 0.75 else
                      ", within the paper's range." if r32[0] >= 0.4 else ", lower than the paper's models."))
    s_lo = estimate(s, {"k": lo_k, "intervention": "state_swap"}, "donor_margin_shift")
    s_hi = estimate(s, {"k": hi_k, "intervention": "state_swap"}, "donor_margin_shift")
    if s_lo and s_hi and abs(s_lo[0]) < NEGLIGIBLE_SHIFT:
        out.append(f"The state-swap edit shift is {s_lo[0]:+.2f} logits at K = {lo_k}: this head does not carry the "
                   "fact, so how it changes with K says nothing.")
    elif s_lo and s_hi:
        ratio = s_hi[0] / s_lo[0]
        out.append(f"The state-swap edit shift goes from {s_lo[0]:+.2f} to {s_hi[0]:+.2f} logits ({100 * ratio:.0f}% "
                   "kept)" + ("; it halves or more, as in the paper." if ratio <= 0.5 else
                              "; it weakens but by less than half, unlike the paper." if ratio < 1 else
                              "; it does not weaken, unlike the paper."))
    s32 = estimate(s, {"k": 32, "intervention": "state_swap"}, "donor_margin_shift")
    if s_lo and s32 and hi_k != 32 and abs(s_lo[0]) >= NEGLIGIBLE_SHIFT:
        out.append(f"At K = 32 it keeps {100 * s32[0] / s_lo[0]:.0f}% ({s32[0]:+.2f}).")
    breaks = [(k, estimate(s, {"k": k, "intervention": "state_swap"}, "nontarget_break")) for k in evaluated]
    breaks = [(k, e) for k, e in breaks if e]
    if breaks:
        worst_k, worst = max(breaks, key=lambda kv: kv[1][0])
        out.append(f"The swap's non-target break rate peaks at {100 * worst[0]:.2f}% [{100 * worst[1]:.2f}, "
                   f"{100 * worst[2]:.2f}] (K = {worst_k})"
                   + (", under the paper's 5% line." if worst[0] < 0.05 else ", above the paper's 5% line."))
    rand_breaks = [(k, estimate(s, {"k": k, "intervention": "random_update"}, "nontarget_break")) for k in evaluated]
    rand_breaks = [(k, e) for k, e in rand_breaks if e]
    if breaks and rand_breaks:
        rk, re_ = max(rand_breaks, key=lambda kv: kv[1][0])
        if re_[0] > worst[0]:
            out.append(f"The equal-norm random update breaks more non-targets than the swap (up to "
                       f"{100 * re_[0]:.2f}% at K = {rk}): the swap's change is confined to the target where a "
                       "random change of the same size is not.")
    rand = [(k, estimate(s, {"k": k, "intervention": "random_update"}, "donor_margin_shift")) for k in evaluated]
    rand = [e for _, e in rand if e]
    if rand:
        biggest = max(abs(e[0]) for e in rand)
        out.append(f"The equal-norm random update moves the target by at most {biggest:.2f} logits in absolute value"
                   + (", small beside the swap." if s_hi and biggest < 0.25 * abs(s_hi[0]) else
                      ", not small beside the swap: part of the edit is perturbation size."))
    missing = [k for k in info["loads"] if k not in evaluated]
    if missing:
        out.append(f"K = {', '.join(map(str, missing))} could not be evaluated (see the table); those points are "
                   "missing, not zero.")
    return out


def add_verb(sub, model_args, load) -> None:
    p = sub.add_parser("retention", help="clean recall, state-swap edit shift and non-target break rate against "
                       "load K, with the random-update control (§4.2, Fig. 8)")
    model_args(p)
    p.add_argument("--head", type=int, nargs=2, metavar=("LAYER", "HEAD"), default=None)
    p.add_argument("--from-scan", default=None)
    p.add_argument("--n-dev", type=int, default=16)
    p.add_argument("--n-sources", type=int, default=16)
    p.add_argument("--n-nontarget", type=int, default=7, help="non-target facts queried per pair (at most K - 1)")
    p.add_argument("--loads", type=int, nargs="+", default=list(LOADS))
    p.add_argument("--total-length", type=int, default=None,
                   help="fixed sequence length (default: the K=16 layout with 128 filler tokens, as `capacity`)")
    p.add_argument("--template", default="is_in")
    p.add_argument("--vocab", default="cities")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resamples", type=int, default=9999)
    p.add_argument("--gate", type=float, default=None, metavar="THRESHOLD",
                   help="report no edit shift or break rate for a K whose clean recall is under this (capability gate)")
    p.add_argument("--out", required=True)
    p.set_defaults(fn=lambda args: _cli(args, load))


def _cli(args, load) -> int:
    model = load(args)
    keys = ("model", "head", "from_scan", "n_dev", "n_sources", "n_nontarget", "loads", "total_length", "template",
            "vocab", "seed", "gate")
    run = open_run(args.out, kind="retention", model=model, model_name=args.model,
                   args={k: getattr(args, k) for k in keys}, seeds=[args.seed], split="heldout")
    result = run_retention(model, args.head, from_scan=args.from_scan, loads=args.loads,
                           total_length=args.total_length, n_sources=args.n_sources, n_nontarget=args.n_nontarget,
                           n_dev=args.n_dev, template=args.template, vocab=args.vocab, seed=args.seed,
                           batch_size=args.batch_size, n_resamples=args.resamples, gate_threshold=args.gate,
                           run_dir=run, model_name=args.model, progress=lambda a: print(f"retention: {a}", flush=True))
    print(result.section)
    print(f"results in {run.path}")
    return 0
