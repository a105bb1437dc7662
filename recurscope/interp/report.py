"""A readable markdown report of a scan and its confirmation: the tables a paper needs, the figures, and plain
statements of what the numbers show (including where they do not show the paper's effect)."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from recurscope.interp.interventions.registry import INTERVENTIONS, REGISTRY, controls_of, named_intervention
from recurscope.interp.verdicts import Claim, control_verdict, judge, measure_from

#: Report names of the interventions, in protocol order (from interventions.REGISTRY).
LABELS = {entry.name: entry.label for entry in REGISTRY}


def _ci(summary: pd.DataFrame, intervention: str, metric: str, pct: bool = False) -> str:
    row = summary[(summary["intervention"] == intervention) & (summary["metric"] == metric)]
    if row.empty:
        return "–"
    r = row.iloc[0]
    f = (lambda v: f"{100 * v:.1f}%") if pct else (lambda v: f"{v:+.2f}")  # noqa: E731
    return f"{f(r['estimate'])} [{f(r['low'])}, {f(r['high'])}]"


def write_report(out_dir, *, model_name: str, scan_dir, confirm_dir, heads, control_heads, scan_heads: pd.DataFrame,
                 loso=None, summary: pd.DataFrame, figures: dict) -> Path:
    out_dir = Path(out_dir)
    manifest = json.loads((Path(confirm_dir) / "manifest.json").read_text())
    scan_manifest_path = Path(scan_dir) / "manifest.json"
    scan_manifest = json.loads(scan_manifest_path.read_text()) if scan_manifest_path.is_file() else {}
    extra, args = manifest.get("extra", {}), manifest.get("args", {})
    lines = [f"# recurscope report: {model_name}", ""]
    if manifest.get("split") == "dev" or extra.get("confirmation_on_selection_sources"):
        lines += ["> **WARNING: this \"confirmation\" ran on the dev sources, where the scan selected its heads. "
                  "Selection and test on the same sources is not a confirmation; rerun `recurscope confirm` with "
                  "`--sources heldout`.**", ""]
    lines += [f"- checkpoint: `{manifest.get('checkpoint_path')}` ({manifest.get('checkpoint_hash', '')[:19]}...)",
              f"- scan: `{scan_dir}` on {scan_manifest.get('split', 'dev')} sources; "
              f"confirmation: `{confirm_dir}` on {manifest.get('split')} sources "
              f"(n = {summary['n_sources'].max() if len(summary) else 0}, "
              f"{args.get('pairs_per_source', 1)} pair(s) per source)",
              f"- filler: {_filler_line(extra)}",
              f"- seeds: {manifest.get('seeds')}; command: `{' '.join(manifest.get('argv', []))}`", ""]
    lines += ["## Head selection (dev sources)", "",
              "J(l, h) is the mean over sources of the donor-margin shift from a state swap of that single head at "
              "the query boundary (the difference the paper's text defines; its eq. 6 prints a product by mistake).", "",
              "| rank | head | J (logits) | sources won | mean rank |", "|---|---|---|---|---|"]
    for i, r in enumerate(scan_heads.head(10).itertuples(), 1):
        lines.append(f"| {i} | L{r.layer}H{r.head} | {r.J:+.3f} | {r.wins}/{r.n_sources} | {r.mean_rank:.1f} |")
    if loso is not None:
        lines += ["", f"Leave-one-source-out: the winner is {'stable' if loso.stable else 'NOT stable'} "
                      f"({loso.n_stable}/{loso.n_sources} leave-outs agree)."]
    if "scan_heatmap" in figures:
        lines += ["", f"![head scan]({Path(figures['scan_heatmap']).name})"]
    lines += ["", f"## Confirmation on held-out sources: {', '.join(f'L{l}H{h}' for l, h in heads)}", "",
              f"Control head(s): {', '.join(f'L{l}H{h}' for l, h in control_heads)} (the median-|J| head of the same "
              "layer). Estimates are means over sources. " + _intervals_line(summary), "",
              "| intervention | donor-margin shift | donor-specific shift | distractor shift | donor-answer rate | "
              "recall after | clean recall |",
              "|---|---|---|---|---|---|---|"]
    for arm in LABELS:
        if summary[summary["intervention"] == arm].empty:
            continue
        lines.append(f"| {LABELS[arm]} | {_ci(summary, arm, 'donor_margin_shift')} | "
                     f"{_ci(summary, arm, 'donor_specific_shift')} | {_ci(summary, arm, 'distractor_shift')} | "
                     f"{_ci(summary, arm, 'donor_answer', True)} | {_ci(summary, arm, 'intervened_accuracy', True)} | "
                     f"{_ci(summary, arm, 'clean_accuracy', True)} |")
    if "effects" in figures:
        lines += ["", f"![intervention effects]({Path(figures['effects']).name})"]
    lines += ["", "## Reading", ""] + _reading(summary)
    lines += ["", "How to read this: a positive donor-margin shift means the intervention moved the answer towards the "
              "donor's value; the donor-answer rate counts examples whose argmax over the 4 candidates became the "
              "donor's value (chance for a random pick: 25%). Controls should sit near zero. Joint effects of several "
              "heads are measured by running them together, never by adding single-head effects."]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _filler_line(extra: dict) -> str:
    if "filler_source" not in extra:
        return "not recorded (a run from before recurscope recorded it)"
    rate = extra.get("filler_unknown_rate", 0.0)
    limit = extra.get("filler_unknown_limit")
    over = limit is not None and rate > limit
    return (f"{extra['filler_source']}; {100 * rate:.1f}% of its {extra.get('filler_tokens')} tokens are the "
            f"tokenizer's unknown token" + (f" — **above the {100 * limit:.0f}% limit (run with --allow-unk): the "
                                            "filler is largely not the corpus' text**" if over else ""))


def _intervals_line(summary: pd.DataFrame) -> str:
    """Which 95% interval each kind of metric got, from the summary's method column."""
    if "method" not in summary.columns or summary.empty:
        return "Intervals are 95%."
    binary = summary["metric"].isin(["donor_answer", "clean_accuracy", "intervened_accuracy"])

    def kinds(rows):
        return ", ".join(sorted(set(rows["method"].astype(str))))
    return (f"95% intervals: margins by source bootstrap ({kinds(summary[~binary])}); rates by "
            f"{kinds(summary[binary])}. With one pair per source a rate gets a binomial interval (a bootstrap "
            "would collapse to zero width at 0% and 100%); with several, a source-cluster bootstrap.")


def _reading(summary: pd.DataFrame) -> list[str]:
    """The report's reading lines; every verdict comes from interp.verdicts (judge, control_verdict)."""
    out = []

    def m(arm, metric, unit="logit"):
        return measure_from(summary, {"intervention": arm}, metric, unit)
    clean = m("state_swap", "clean_accuracy", "pct")
    if clean:
        out.append(f"- {judge(clean, Claim.between(0.93, 0.97, '93-97% clean recall'), 'Clean recall here')}")
    swap = m("state_swap", named_intervention("state_swap").metric)
    if swap:
        claim = Claim.positive("the state swap moves the margin towards the donor")
        out.append(f"- {judge(swap, claim, 'The donor-margin shift of the state swap')}")
    restore = m("output_restore", named_intervention("output_restore").metric)
    if restore:
        out.append(f"- Restoring every readout of the swapped head(s) after the boundary gives {restore.text()}, the "
                   "clean margin on every row by construction: a head's state reaches the rest of the network only "
                   "through its readouts. It checks the patching; it is not evidence for the paper's claim.")
    last = m("output_restore_last", named_intervention("output_restore_last").metric)
    if last:
        out.append("- The informative arm is the restore at the answer position only. "
                   + str(judge(last, Claim.near_zero("near zero: the swap's effect passes through the readout at the "
                                                     "answer position"),
                               "Its donor-margin shift after restoring the recipient's query-time readout there")))
    for main in INTERVENTIONS:
        for control in controls_of(main):
            out.extend(_control_line(summary, control, main))
    return out


def _control_line(summary: pd.DataFrame, control, main: str) -> list[str]:
    """One reading line for a control (a registry entry) of causal arm `main`, judged as the paper judges controls:
    on the donor-margin shift (verdicts.control_verdict). The donor-specific shift is printed beside it as a
    diagnostic and never turns a large control into a small one."""
    arm = control.name
    margin = measure_from(summary, {"intervention": arm}, "donor_margin_shift")
    if margin is None:
        return []
    specific = measure_from(summary, {"intervention": arm}, "donor_specific_shift")
    verdict = control_verdict(LABELS[arm], margin, specific,
                              measure_from(summary, {"intervention": main}, "donor_margin_shift"),
                              f"the {LABELS[main]}")
    answer = measure_from(summary, {"intervention": arm}, "donor_answer", "pct")
    tail = f" Donor-answer rate {answer.text()}." if answer is not None and answer.defined else ""
    return [f"- {verdict}{tail}"]
