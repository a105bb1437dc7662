"""Head structure (How Linear Attention Remembers, Fig. 3c, App. E.2): non-additivity of write blocks and the joint
top-k recovery curve.

A head ranking is frozen on dev sources (interp.scan.run_scan: J per head). On held-out sources:
- non-additivity: a write block of the hub (rank 1), of the second head, of both jointly and of all heads jointly,
  read as the change in the correct answer's margin (Fig. 3c); each joint run is compared with the sum of the
  single-head runs (joint - sum, paired over sources). Every run is
  a real joint intervention; sums are only the comparison;
- recovery: a joint state swap of the top-k heads, k = 1, 2, 4, ... up to all; recovery(k) = shift(top-k) /
  shift(all heads), a ratio of source means with a paired source-bootstrap interval (recovery(all) = 1 exactly).
A GLA state shared by several query heads is one state head here (model.n_state_heads), i.e. one component.

Paper: GLA-340M's top-1 head recovers 94.7% of the all-head shift; GLA-7B needs the top 16.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pandas as pd

from recurscope.interp import stats
from recurscope.interp.protocols._common import (ProtocolResult, ci_text, head_label, max_length, model_record,
                                                 pair_spec, run_arms)
from recurscope.interp.protocols._rankings import (arm_rows, frozen_ranking, recovery_records,  # noqa: F401  (shared with topk)
                                                   scan_ranking, swap_arms, top_k_sizes)
from recurscope.interp.protocols.runner import FigureSpec, Section, finish
from recurscope.interp.verdicts import GLA, Claim, gated, judge_family, measure_from, not_informative

__all__ = ["run_heads", "top_k_sizes", "swap_arms", "arm_rows", "recovery_records", "frozen_ranking",
           "scan_ranking", "reading"]

#: Above this many heads, single-head write blocks run for the hub and the second head only (the all-heads sum
#: would cost one run per head).
MAX_SINGLE_RUNS = 64


@dataclass(frozen=True)
class HeadSetArm:
    """One arm of the head-structure protocol: a write block or state swap of a set of heads over the pairs, called
    as (model, pairs, arm) in this process or, under --ray, on a worker (a picklable unit, _common.run_arms)."""

    arms: dict
    batch_size: int

    def __call__(self, model, pairs, arm: str) -> pd.DataFrame:
        kind, heads = self.arms[arm]
        return arm_rows(model, pairs, kind, heads, arm, self.batch_size)


def run_heads(model, pairs=None, *, ranking: Optional[pd.DataFrame] = None, run_dir=None, n_dev: int = 32,
              n_sources: int = 64, layout=None, seed: int = 0, batch_size: int = 16,
              n_resamples: int = 9999, model_name: str = "model", progress=None, executor=None) -> ProtocolResult:
    """ranking: a per-head table with layer, head, J (a scan's scan_heads); default: a fresh scan on n_dev dev
    sources. pairs: held-out swap pairs (default: n_sources held-out sources, target queries, in `layout`: a
    PairSpec, PairLayout or layout name, default the §3.3 layout, under `seed`). executor: the CLI's --ray runner;
    each arm is then one unit on a Ray worker (the ranking's scan, when no ranking is given, runs here)."""
    from recurscope.interp.data import build_pairs

    layout = pair_spec(layout, seed=seed)
    order, hub_named = frozen_ranking(model, ranking, n_dev, layout, with_tie=True)
    if len(order) < 2:
        raise ValueError("head structure needs at least two recurrent heads")
    if pairs is None:
        pairs = build_pairs(model.tokenizer, split="heldout", n_sources=n_sources, max_length=max_length(model),
                            **layout.kwargs())
    hub, second = order[0], order[1]
    singles = order if len(order) <= MAX_SINGLE_RUNS else [hub, second]
    arms = {f"block:{head_label(h)}": ("write_block", [h]) for h in singles}
    arms["block:hub+second"] = ("write_block", [hub, second])
    arms["block:all"] = ("write_block", order)
    ks = top_k_sizes(len(order))
    arms.update(swap_arms(order))

    rows = run_arms(model, run_dir, "heads_rows", ("arm", "row"), list(arms), HeadSetArm(arms, batch_size), pairs,
                    progress, executor)
    wide = rows.pivot(index=["row", "source"], columns="arm", values="shift").reset_index()
    # Fig. 3c reads write blocks by the change in the correct answer's margin (z_r - max other candidate).
    answer = rows.pivot(index=["row", "source"], columns="arm", values="answer_margin_change").reset_index()
    src = wide["source"].to_numpy()

    records = []

    def add(analysis, unit, metric, ci, **extra):
        records.append({"analysis": analysis, "unit": unit, "metric": metric, "estimate": ci.estimate,
                        "low": ci.low, "high": ci.high, "n_sources": ci.n_sources, "method": ci.method, **extra})
    for arm in arms:
        if arm.startswith("block:"):
            add("write_block", arm[6:], "answer_margin_change",
                stats.source_bootstrap_ci(answer[arm], src, n_resamples=n_resamples, seed=seed))
    comparisons = {"hub+second": [hub, second]}
    if len(singles) == len(order):
        comparisons["all"] = order
    for name, heads in comparisons.items():
        total = sum(answer[f"block:{head_label(h)}"] for h in heads)
        add("write_block", f"sum of singles ({name})", "answer_margin_change",
            stats.source_bootstrap_ci(total, src, n_resamples=n_resamples, seed=seed))
        add("nonadditivity", name, "joint_minus_sum",
            stats.paired_source_bootstrap_ci(answer[f"block:{name}"], total, src, n_resamples=n_resamples, seed=seed))
    add("hub_vs_all", "hub", "hub_minus_all",
        stats.paired_source_bootstrap_ci(answer[f"block:{head_label(hub)}"], answer["block:all"], src,
                                         n_resamples=n_resamples, seed=seed))
    records += recovery_records(wide, ks, n_resamples=n_resamples, seed=seed)
    summary = pd.DataFrame(records)
    sources = rows.groupby(["arm", "source"])["shift"].mean().reset_index()
    info = {**model_record(model), "ranking": order, "hub": hub, "second": second,
            "n_sources": int(rows["source"].nunique()), "ks": ks, "hub_named": hub_named}
    result = ProtocolResult("heads", rows, sources, summary, info=info)
    blocks = summary[summary["analysis"].isin(["write_block", "nonadditivity"])]
    figures = [FigureSpec("nonadditivity", blocks, dict(
                   row_col="unit", panels=["answer_margin_change", "joint_minus_sum"],
                   panel_labels={"answer_margin_change": "change in the correct answer's margin",
                                 "joint_minus_sum": "joint - sum of singles"},
                   title=f"{model_name}: write-block non-additivity")),
               FigureSpec("recovery", summary[summary["analysis"] == "recovery"], dict(
                   row_col="k", panels=["recovery", "shift"], kind="lines", percent=["recovery"],
                   row_name="k (top-k heads swapped jointly)",
                   reference={"recovery": 1.0}, reference_labels={"recovery": "the all-head swap"},
                   panel_labels={"recovery": "recovery(k)", "shift": "joint state-swap shift"},
                   title=f"{model_name}: joint top-k state swap"))]
    return finish(result, run_dir, lambda r: heads_section(r, model_name), figures)


def heads_section(result: ProtocolResult, model_name: str) -> Section:
    s, info = result.summary, result.info
    ranking = ", ".join(head_label(h) for h in info["ranking"][:8]) + (" ..." if len(info["ranking"]) > 8 else "")
    blocks = ["| write block on | change in the correct answer's margin |", "|---|---|"]
    for unit in s[s["analysis"] == "write_block"]["unit"]:
        blocks.append(f"| {unit} | {ci_text(s, {'analysis': 'write_block', 'unit': unit}, 'answer_margin_change')} |")
    joint = ["| joint run | joint - sum of single-head runs |", "|---|---|"]
    for unit in s[s["analysis"] == "nonadditivity"]["unit"]:
        joint.append(f"| {unit} | {ci_text(s, {'analysis': 'nonadditivity', 'unit': unit}, 'joint_minus_sum')} |")
    recovery = ["| k (joint state swap of the top k) | shift | recovery(k) |", "|---|---|---|"]
    for k in info["ks"]:
        recovery.append(f"| {k} | {ci_text(s, {'analysis': 'recovery', 'k': k}, 'shift')} | "
                        f"{ci_text(s, {'analysis': 'recovery', 'k': k}, 'recovery', pct=True)} |")
    named = info.get("hub_named", True)
    intro = (f"Ranking frozen on dev sources: {ranking}. {info['n_sources']} held-out sources."
             + ("" if named else " **No hub is named**: the ranking's best J is tied or inside the scan's noise "
                                 "floor, so 'hub' and 'second' below are only the first two heads of the order.")
             + ("" if gated() or not named else " **No hub is named**: the capability gate is off "
                                                "(--gate-threshold 0), so the order is a diagnostic, not a finding."))
    return Section(f"Head structure: {model_name}", intro, [blocks, joint, recovery],
                   reading(s, len(info["ranking"]), family=info.get("family"), hub_named=named))


def reading(s: pd.DataFrame, n_heads: int, *, family: Optional[str], hub_named: bool = True) -> list[str]:
    """The paper's numbers here are GLA's (Fig. 3c on GLA-340M; App. E.2's top-1 recovery on GLA-340M and GLA-7B,
    besides RWKV7-13.3B): only a GLA model (family from verdicts.paper_family) is judged; others get none. The
    recovery is a ratio: undefined where the all-head shift's interval includes zero. The joint-minus-sum is
    judged against the hub's own effect (negligible below verdicts.NEGLIGIBLE_FRACTION of it). Without a named hub
    (hub_named False: a tied or noise-floor ranking) nothing is judged."""
    out = ["The paper: GLA-340M's top-1 head recovers 94.7% of the all-head shift and GLA-7B needs the top 16 "
           "(92.3%); on GLA, blocking the hub hurts the correct answer more than blocking all heads, and blocking "
           "the hub with the second head differs from the sum of the two single blocks."]
    subjects = {"recovery": f"The top-1 head's recovery of the all-head shift ({n_heads} heads in all)",
                "joint": "Blocking the hub and the second head together minus the sum of their single blocks",
                "hub": "The hub's write block minus the all-head write block, in the correct answer's margin"}
    if not hub_named:
        why = "no hub: the frozen ranking's best J is tied or inside the scan's noise floor"
        where = {"recovery": ({"analysis": "recovery", "k": 1}, "recovery", "pct"),
                 "joint": ({"analysis": "nonadditivity", "unit": "hub+second"}, "joint_minus_sum", "logit"),
                 "hub": ({"analysis": "hub_vs_all", "unit": "hub"}, "hub_minus_all", "logit")}
        return out + [not_informative(measure_from(s, *where[key]), subject, why) for key, subject in subjects.items()]
    ks = sorted(s.loc[s["analysis"] == "recovery", "k"].dropna().astype(int).unique())
    all_shift = measure_from(s, {"analysis": "recovery", "k": ks[-1]}, "shift") if ks else None
    recovery = Claim.equals(0.947, "94.7% on GLA-340M, 12.3% on GLA-7B")
    out.append(judge_family(measure_from(s, {"analysis": "recovery", "k": 1}, "recovery", "pct"), family,
                            {GLA: recovery}, subjects["recovery"],
                            "GLA-340M 94.7%, GLA-7B 12.3%, RWKV7-13.3B 53.1% (naturalized input; 7.5% compact), no "
                            "GDN model", denominator=all_shift))
    hub_block = measure_from(s, {"analysis": "write_block", "unit": head_label_of(s, "hub")}, "answer_margin_change")
    joint = Claim.nonzero("the joint block differs from the sum of single blocks (GLA-340M)")
    out.append(judge_family(measure_from(s, {"analysis": "nonadditivity", "unit": "hub+second"}, "joint_minus_sum"),
                            family, {GLA: joint}, subjects["joint"],
                            "GLA-340M's joint block differs from the sum of single blocks",
                            scale=hub_block.estimate if hub_block is not None and hub_block.defined else None))
    hub = Claim.negative("blocking the hub alone hurts the correct answer more than blocking all heads (GLA-340M)")
    out.append(judge_family(measure_from(s, {"analysis": "hub_vs_all", "unit": "hub"}, "hub_minus_all"), family,
                            {GLA: hub}, subjects["hub"],
                            "on GLA-340M blocking the hub hurts more than blocking all heads"))
    if n_heads <= 4:
        out.append("With this few heads the ranking has little to rank; the wider checkpoints are the test.")
    return out


def head_label_of(s: pd.DataFrame, which: str) -> Optional[str]:
    """The write-block unit of the hub: the first single-head block in the summary (the runs are in ranking order)."""
    units = [u for u in s.loc[s["analysis"] == "write_block", "unit"] if u.startswith("L") and "+" not in u]
    return units[0] if which == "hub" and units else None


def _from_args(model, args, run_dir, progress, executor=None) -> ProtocolResult:
    return run_heads(model, ranking=scan_ranking(model, args.from_scan), run_dir=run_dir, n_dev=args.n_dev, n_sources=args.n_sources,
                     layout=args.pair_spec, seed=args.seed, batch_size=args.batch_size,
                     n_resamples=args.resamples, model_name=args.model, progress=progress,
                     executor=executor)
