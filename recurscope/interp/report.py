"""A readable markdown report of a scan and its confirmation: the tables a paper needs, the figures, and plain
statements of what the numbers show (including where they do not show the paper's effect)."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

import pandas as pd

from recurscope.interp.interventions.registry import INTERVENTIONS, REGISTRY, controls_of, named_intervention
from recurscope.interp.results import write_output
from recurscope.interp.verdicts import Claim, control_verdict, gate_off, identity_check, judge, measure_from

#: Report names of the interventions, in protocol order (from interventions.REGISTRY).
LABELS = {entry.name: entry.label for entry in REGISTRY}


def _ci(summary: pd.DataFrame, intervention: str, metric: str, pct: bool = False) -> str:
    row = summary[(summary["intervention"] == intervention) & (summary["metric"] == metric)]
    if row.empty:
        return "–"
    r = row.iloc[0]
    f = (lambda v: f"{100 * v:.1f}%") if pct else (lambda v: f"{v:+.2f}")  # noqa: E731
    return f"{f(r['estimate'])} [{f(r['low'])}, {f(r['high'])}]"


MIN_INTERVAL_SOURCES = 8

# Text that reads the same as markdown and as plain text: copied from a manifest or a checkpoint, anything else
# goes into a code span, so a crafted argv, path or word list cannot add a heading, a link or HTML to the report.
_PLAIN = re.compile(r"^[A-Za-z0-9 .,:;()/'%=+@-]*$")


def code_span(value) -> str:
    """`value` as an inline code span that its content cannot end early: line breaks and control characters become
    spaces (a line break could start a heading), and the fence is one backtick longer than any run inside."""
    text = "".join(ch if ch.isprintable() else " " for ch in " ".join(str(value).split()))
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") or not text else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def plain(value) -> str:
    """`value` as it is when it is plain text (a name, a number, a path of ordinary characters), else a code span."""
    text = str(value)
    return text if _PLAIN.match(text) else code_span(text)


def write_report(out_dir, *, model_name: str, scan_dir, confirm_dir, heads, control_heads,
                 scan_heads: Optional[pd.DataFrame], loso=None, summary: Optional[pd.DataFrame], figures: dict,
                 gate: Optional[dict] = None, winner: Optional[dict] = None) -> Path:
    """report.md in `out_dir`. `gate`: the clean-recall gate of the last stage that ran (gate.json); below its
    threshold the report leads with "the model does not do the task" and names no head, reads no control.
    `winner`: the top head's J interval (a winner only when it excludes zero; "no head" otherwise)."""
    out_dir = Path(out_dir)
    main_dir = Path(confirm_dir) if confirm_dir is not None and (Path(confirm_dir) / "manifest.json").is_file() \
        else Path(scan_dir)
    manifest = json.loads((main_dir / "manifest.json").read_text())
    scan_manifest_path = Path(scan_dir) / "manifest.json"
    scan_manifest = json.loads(scan_manifest_path.read_text()) if scan_manifest_path.is_file() else {}
    extra, args = manifest.get("extra", {}), manifest.get("args", {})
    lines = [f"# recurscope report: {plain(model_name)}", ""]
    failed = gate is not None and not gate.get("passed", True)
    if failed:
        lines += [f"> **The model does not do the task.** {_gate_line(gate)}: below the preset "
                  f"{100 * gate['threshold']:.0f}% gate (`--gate-threshold`). No head is named and no control is "
                  "read: patching a model that does not recall the bindings measures nothing. Check the layout "
                  "(`--layout`), the filler (`--corpus`) and the words (`--keys`, `--values`) against what the "
                  "model was trained on (README, 'Your own checkpoint').", ""]
    if manifest.get("split") == "dev" and confirm_dir is not None and main_dir == Path(confirm_dir) \
            or extra.get("confirmation_on_selection_sources"):
        lines += ["> **WARNING: this \"confirmation\" ran on the dev sources, where the scan selected its heads. "
                  "Selection and test on the same sources is not a confirmation; rerun `recurscope confirm` with "
                  "`--sources heldout`.**", ""]
    n_confirm = int(summary["n_sources"].max()) if summary is not None and len(summary) else 0
    lines += [f"- checkpoint: {code_span(manifest.get('checkpoint_path'))} "
              f"({plain(str(manifest.get('checkpoint_hash', ''))[:19])}...)",
              f"- scan: {code_span(scan_dir)} on {plain(scan_manifest.get('split', 'dev'))} sources"
              + (f"; confirmation: {code_span(confirm_dir)} on {plain(manifest.get('split'))} sources (n = "
                 f"{n_confirm}, {plain(args.get('pairs_per_source', 1))} pair(s) per source)"
                 if summary is not None else
                 "; no confirmation ran"),
              f"- layout: {_layout_line(extra.get('pair_layout'))}",
              f"- filler: {_filler_line(extra)}",
              f"- words: {_dropped_line(extra)}"]
    if gate is not None and gate.get("off"):
        lines.append(f"- clean recall gate: {_gate_line(gate)}")
    elif gate is not None:
        lines.append(f"- clean recall on the {gate.get('split', '')} pairs (the gate): {_gate_line(gate)}, "
                     f"threshold {100 * gate['threshold']:.0f}%: {'passed' if not failed else 'NOT passed'}")
    group = recorded_query_group(extra)
    if group > 1:
        lines.append(f"- a \"head\" here (L<layer>H<head>) is a state group read by {group} query heads "
                     "(num_kv_heads < num_heads, as GLA-7B): each intervention edits the group's one state, and the "
                     "output patches replace all its query heads' readouts")
    argv = manifest.get("argv", [])
    command = " ".join(map(str, argv)) if isinstance(argv, list) else str(argv)
    lines += [f"- seeds: {plain(manifest.get('seeds'))}; command: {code_span(command)}", ""]
    if failed:
        path = out_dir / "report.md"
        write_output(path, "\n".join(lines) + "\n")
        return path
    lines += ["## Head selection (dev sources)", "",
              "J(l, h) is the mean over sources of the donor-margin shift from a state swap of that single head at "
              "the query boundary (the difference the paper's text defines; its eq. 6 prints a product, a reading "
              "docs/paper_ambiguities.md sets beside it).", "",
              "| rank | head | J (logits) | sources won | mean rank |", "|---|---|---|---|---|"]
    for i, r in enumerate(scan_heads.head(10).itertuples(), 1):
        lines.append(f"| {i} | L{r.layer}H{r.head} | {r.J:+.3f} | {r.wins}/{r.n_sources} | {r.mean_rank:.1f} |")
    if winner is not None:
        lines += ["", (f"The top head L{winner['layer']}H{winner['head']} has J = {winner['J']:+.3f} "
                       f"[{winner['low']:+.3f}, {winner['high']:+.3f}] (95% source bootstrap, n = "
                       f"{winner['n_sources']}): " + ("its interval excludes zero, so it is the scan's winner."
                                                      if winner["winner"] else
                                                      "**no head**: the interval includes zero, so the scan names no "
                                                      "winner; the confirmation below measures the top head by J, "
                                                      "which is not a finding."))]
        if winner["n_sources"] < MIN_INTERVAL_SOURCES:
            lines += ["", f"> WARNING: only {winner['n_sources']} sources back this interval (fewer than "
                          f"{MIN_INTERVAL_SOURCES}); it is unreliable."]
    if loso is not None:
        lines += ["", f"Leave-one-source-out: the winner is {'stable' if loso.stable else 'NOT stable'} "
                      f"({loso.n_stable}/{loso.n_sources} leave-outs agree)."]
    if "scan_heatmap" in figures:
        lines += ["", f"![head scan]({Path(figures['scan_heatmap']).name})"]
    if summary is None:
        path = out_dir / "report.md"
        write_output(path, "\n".join(lines) + "\n")
        return path
    no_head = winner is not None and not winner["winner"]
    lines += ["", f"## Confirmation on held-out sources: {', '.join(f'L{l}H{h}' for l, h in heads)}"
              + (" (the top head by J; no head: not a winner)" if no_head else ""), "",
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
    if n_confirm and n_confirm < MIN_INTERVAL_SOURCES:
        lines += ["", f"> WARNING: only {n_confirm} held-out sources back these intervals (fewer than "
                      f"{MIN_INTERVAL_SOURCES}); they are unreliable."]
    identities = _by_construction(heads, extra.get("pair_layout"))
    if identities:
        lines += ["", "Arms equal by construction here:"] + [f"- {line}" for line in identities]
    if "effects" in figures:
        lines += ["", f"![intervention effects]({Path(figures['effects']).name})"]
    n_layers = _n_layers(manifest.get("checkpoint_path"))
    if gate is not None and gate.get("off"):
        with gate_off():
            reading = _reading(summary, heads, n_layers)
    else:
        reading = _reading(summary, heads, n_layers)
    lines += ["", "## Reading", ""] + reading
    lines += ["", "How to read this: a positive donor-margin shift means the intervention moved the answer towards the "
              "donor's value; the donor-answer rate counts examples whose argmax over the 4 candidates became the "
              "donor's value (chance for a random pick: 25%). Controls should sit near zero. Joint effects of several "
              "heads are measured by running them together, never by adding single-head effects."]
    path = out_dir / "report.md"
    write_output(path, "\n".join(lines) + "\n")
    return path


def recorded_query_group(extra: dict) -> int:
    """How many query heads read each state (> 1 for GLA with num_kv_heads < num_heads), as the run recorded it from
    the loaded model in the manifest's `extra`; 1 when absent or not a positive integer. The report never opens the
    checkpoint path a manifest names: a crafted path could otherwise change its wording."""
    group = extra.get("query_group", 1) if isinstance(extra, dict) else 1
    return group if isinstance(group, int) and not isinstance(group, bool) and group >= 1 else 1


def _gate_line(gate: dict) -> str:
    if gate.get("off"):
        return "not measured (the gate was off: --gate-threshold 0; nothing here shows the model does the task)"
    r, d = gate["recipient"], gate["donor"]
    return (f"recipient {100 * r[0]:.1f}% [{100 * r[1]:.1f}, {100 * r[2]:.1f}], donor {100 * d[0]:.1f}% "
            f"[{100 * d[1]:.1f}, {100 * d[2]:.1f}] over {gate.get('n_sources')} sources")


def _layout_line(layout: Optional[dict]) -> str:
    if not layout:
        return "not recorded"
    lead = layout.get("lead_tokens")
    return (f"{code_span(layout.get('name'))}: {plain(layout.get('n_facts'))} bindings x "
            f"{plain(layout.get('presentations'))} presentations, {plain(layout.get('gap_tokens'))} filler tokens "
            "between presentations" + (f" ({plain(lead)} before the first)" if lead is not None else "")
            + f", {plain(layout.get('filler_tokens'))} before the query, template {code_span(layout.get('template'))}")


def _dropped_line(extra: dict) -> str:
    keys, values = extra.get("dropped_keys") or {}, extra.get("dropped_values") or {}
    if "dropped_keys" not in extra:
        return "not recorded"
    if not keys and not values:
        return "every key and value is a single token for this tokenizer; none dropped"
    parts = []
    for what, dropped, name in (("key", keys, extra.get("key_list")), ("value", values, extra.get("value_list"))):
        if dropped:
            parts.append(f"{len(dropped)} {what}(s) of {plain(name)} dropped, not single tokens here: "
                         + ", ".join(f"{plain(w)} ({code_span('/'.join(map(str, t)))})"
                                     for w, t in sorted(dropped.items())))
    return "; ".join(parts)


def _by_construction(heads, layout: Optional[dict]) -> list[str]:
    """Arms that cannot differ for these heads and this layout, whatever the model."""
    out = []
    if heads and all(int(layer) == 0 for layer, _ in heads):
        out.append("output patch = state swap: at a layer-0 head donor and recipient feed the head the same query "
                   "tokens after the boundary, so the swapped state produces exactly the donor's query-time outputs.")
    if layout and layout.get("template") == "key_value":
        out.append("output restore (every readout) = output restore (answer position): the query is one token, so "
                   "the suffix has a single readout.")
    return out


def _fraction(value) -> Optional[float]:
    """`value` as a float in [0, 1], else None (manifests are read, not trusted)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        return None
    return float(value)


def _filler_line(extra: dict) -> str:
    if "filler_source" not in extra:
        return "not recorded (a run from before recurscope recorded it)"
    rate, limit = _fraction(extra.get("filler_unknown_rate", 0.0)), _fraction(extra.get("filler_unknown_limit"))
    if rate is None:       # not a number between 0 and 1: a manifest the run did not write
        return f"{plain(extra['filler_source'])}; its unknown-token rate is not recorded as a number"
    over = limit is not None and rate > limit
    return (f"{plain(extra['filler_source'])}; {100 * rate:.1f}% of its {plain(extra.get('filler_tokens'))} "
            "tokens are the "
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


def _n_layers(checkpoint_path) -> Optional[int]:
    """num_hidden_layers of the checkpoint's config.json (either format), or None where it cannot be read."""
    path = None if checkpoint_path is None else Path(checkpoint_path) / "config.json"
    if path is None or not path.is_file():
        return None
    config = json.loads(path.read_text())
    n = config.get("num_hidden_layers", config.get("text_config", {}).get("num_hidden_layers"))
    return int(n) if isinstance(n, int) else None


def _reading(summary: pd.DataFrame, heads=(), n_layers: Optional[int] = None) -> list[str]:
    """The report's reading lines; every verdict comes from interp.verdicts (judge, control_verdict). With `heads`
    all in the last of `n_layers` layers, the answer-position restore equals clean by construction (no later layer
    reads the head's other readouts): an identity check, not evidence."""
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
        subject = "Its donor-margin shift after restoring the recipient's query-time readout there"
        last_layer = n_layers is not None and heads and all(int(layer) == n_layers - 1 for layer, _ in heads)
        if last_layer:
            out.append("- The restore at the answer position only. " + str(identity_check(
                last, subject, f"the head(s) sit in the last layer, L{n_layers - 1}: no later layer reads their other "
                               "readouts, so restoring the answer position's readout gives the clean margin whatever "
                               "the model")))
        else:
            scale = swap.estimate if swap is not None and swap.defined and swap.estimate != 0 else None
            out.append("- The informative arm is the restore at the answer position only. "
                       + str(judge(last, Claim.near_zero("near zero: the swap's effect passes through the readout at "
                                                         "the answer position"), subject, scale=scale)))
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
