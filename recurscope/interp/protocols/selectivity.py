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

from typing import Optional, Sequence

import pandas as pd

from recurscope.interp import interventions as iv
from recurscope.interp.metrics import example_metrics, source_means, summarise_metrics
from recurscope.interp.protocols._common import (ProtocolResult, add_protocol_args, ci_text, estimate,
                                                 excludes_zero, finish, frozen_head, head_label, layout_from_args,
                                                 logged_arms, max_length, open_run, pair_kwargs, work_args)

__all__ = ["ARMS", "PAPER", "run_selectivity", "build_selectivity_pairs", "add_verb"]

ARMS = ("state_swap", "donor_write", "random_update", "random_write", "control_head:state_swap",
        "control_head:donor_write")
LABELS = {"state_swap": "state swap", "donor_write": "donor write", "random_update": "equal-norm random update",
          "random_write": "equal-norm random write",
          "control_head:state_swap": "control head, state swap", "control_head:donor_write": "control head, donor write"}
METRICS = ("donor_answer", "donor_margin_shift", "donor_specific_shift", "nontarget_break", "nontarget_margin_change",
           "clean_correct")
PAPER = {"target donor-answer rate": "89.1% / 71.9% / 61.3%", "non-target break rate": "1.42% / 0.41% / 0.56%"}


def build_selectivity_pairs(tokenizer, *, n_sources: int = 32, split: str = "heldout", model=None, **layout):
    """Swap pairs with every fact queried (build_multifact_pairs) in the §3.3 layout unless overridden."""
    from recurscope.interp.data import build_multifact_pairs

    kwargs = {**pair_kwargs(), **layout}
    return build_multifact_pairs(tokenizer, split=split, n_sources=n_sources,
                                 max_length=None if model is None else max_length(model), **kwargs)


def _arm(model, pairs, head, arm: str, *, seed: int, batch_size: int, scan_heads=None) -> pd.DataFrame:
    if arm == "random_update":
        result = iv.random_update(model, pairs, [head], kind="state_swap", seed=seed, batch_size=batch_size)
    elif arm == "random_write":
        result = iv.random_write(model, pairs, [head], variant="value", seed=seed, batch_size=batch_size)
    elif arm.startswith("control_head:"):
        result = iv.control_head(model, pairs, [head], arm.split(":", 1)[1], scan=scan_heads, batch_size=batch_size)
    elif arm in ("state_swap", "donor_write"):
        result = getattr(iv, arm)(model, pairs, [head], batch_size=batch_size)
    else:
        raise ValueError(f"arm must be one of {ARMS}, got {arm!r}")
    frame = example_metrics(pairs, result, intervention=arm)
    frame.insert(0, "arm", arm)
    return frame


def run_selectivity(model, pairs=None, head: Optional[Sequence[int]] = None, *, run_dir=None, from_scan=None,
                    n_sources: int = 32, n_dev: int = 16, layout: Optional[dict] = None, seed: int = 0,
                    batch_size: int = 16, arms: Sequence[str] = ARMS, n_resamples: int = 9999,
                    model_name: str = "model", progress=None) -> ProtocolResult:
    """Runs every arm on the frozen head over four-fact pairs (all facts queried); returns rows, per-source means,
    the summary by arm, the figure and the report section. The head is `head`, else the top of `from_scan`, else the
    winner of a scan on `n_dev` dev sources (never the evaluation sources)."""
    layout = {**pair_kwargs(seed=seed), **(layout or {})}
    bad = [a for a in arms if a not in ARMS]
    if bad:
        raise ValueError(f"unknown arms {bad}; choose from {ARMS}")
    chosen, scan_heads = frozen_head(model, head, from_scan, n_dev=n_dev, layout=layout)
    if pairs is None:
        pairs = build_selectivity_pairs(model.tokenizer, n_sources=n_sources, model=model, **layout)
    if int(pairs.is_target.sum()) == len(pairs):
        raise ValueError("selectivity needs non-target rows: build the pairs with build_multifact_pairs "
                         "(queries='all')")
    controls = iv.choose_control_heads(model, [chosen], scan_heads)

    def compute(arm):
        frame = _arm(model, pairs, chosen, arm, seed=seed, batch_size=batch_size, scan_heads=scan_heads)
        frame["row"] = range(len(frame))
        return frame
    rows = logged_arms(run_dir, "selectivity_rows", ("arm", "row"), arms, compute, progress)
    sources = source_means(rows, METRICS, by=("arm",))
    summary = summarise_metrics(rows, METRICS, by=("arm",), n_resamples=n_resamples, seed=seed)
    counts = (rows[rows["nontarget_break"].notna()].groupby("arm")["nontarget_break"].agg(["sum", "count"])
              .rename(columns={"sum": "breaks", "count": "eligible"}).reset_index())
    info = {"head": chosen, "control_head": controls[0], "n_sources": int(rows["source"].nunique()),
            "break_counts": counts.to_dict("records")}
    result = ProtocolResult("selectivity", rows, sources, summary, info=info)
    if run_dir is not None:
        from recurscope.interp.plots import plot_interval_panels

        fig = plot_interval_panels(summary, run_dir.figure_path("selectivity"), row_col="arm",
                                   rows=[a for a in ARMS if a in arms],
                                   panels=["donor_answer", "donor_margin_shift", "nontarget_break",
                                           "nontarget_margin_change"],
                                   percent=["donor_answer", "nontarget_break"],
                                   title=f"{model_name}: four-fact selectivity, head {head_label(chosen)}")
        result.figures["selectivity"] = fig.png
    result.section = selectivity_section(result, model_name)
    return finish(result, run_dir)


def selectivity_section(result: ProtocolResult, model_name: str) -> str:
    s, info = result.summary, result.info
    counts = {c["arm"]: c for c in info["break_counts"]}
    lines = [f"## Four-fact selectivity: {model_name}, head {head_label(info['head'])}", "",
             f"K = 4 facts, every fact queried; {info['n_sources']} held-out sources; control head "
             f"{head_label(info['control_head'])}. Means over sources with 95% source-bootstrap intervals.", "",
             "| arm | target donor-answer | target margin shift | donor-specific shift | non-target break "
             "(breaks / correct) | non-target margin change |", "|---|---|---|---|---|---|"]
    for arm, label in LABELS.items():
        if s[s["arm"] == arm].empty:
            continue
        c = counts.get(arm, {"breaks": 0, "eligible": 0})
        lines.append(f"| {label} | {ci_text(s, {'arm': arm}, 'donor_answer', pct=True)} | "
                     f"{ci_text(s, {'arm': arm}, 'donor_margin_shift')} | "
                     f"{ci_text(s, {'arm': arm}, 'donor_specific_shift')} | "
                     f"{ci_text(s, {'arm': arm}, 'nontarget_break', pct=True)} ({int(c['breaks'])}/{int(c['eligible'])}) | "
                     f"{ci_text(s, {'arm': arm}, 'nontarget_margin_change')} |")
    if "selectivity" in result.figures:
        lines += ["", f"![selectivity](figures/{result.figures['selectivity'].name})"]
    lines += ["", "### Reading", "", " ".join(_reading(s))]
    return "\n".join(lines)


def _reading(s: pd.DataFrame) -> list[str]:
    out = [f"The paper reports target donor-answer rates of {PAPER['target donor-answer rate']} and non-target break "
           f"rates of {PAPER['non-target break rate']} (GLA-340M / GDN-340M / 1.3B)."]
    for arm in ("state_swap", "donor_write"):
        answer, brk = estimate(s, {"arm": arm}, "donor_answer"), estimate(s, {"arm": arm}, "nontarget_break")
        if answer is None:
            continue
        text = f"Here the {LABELS[arm]} turns {100 * answer[0]:.1f}% of target answers into the donor's"
        if brk is not None:
            text += (f" and breaks {100 * brk[0]:.2f}% [{100 * brk[1]:.2f}, {100 * brk[2]:.2f}] of the correct "
                     "non-targets")
        selective = answer[0] >= 0.5 and brk is not None and brk[0] < 0.05
        out.append(text + (": the edit is selective, as in the paper." if selective else
                           ": the edit is NOT selective in the paper's sense." if answer[0] >= 0.5 else
                           ": the target edit is weaker than the paper's."))
    for arm in ("random_update", "random_write", "control_head:state_swap", "control_head:donor_write"):
        e = estimate(s, {"arm": arm}, "donor_specific_shift")
        if e is not None:
            out.append(f"The {LABELS[arm]} moves the donor against the distractors by {e[0]:+.2f} "
                       f"[{e[1]:+.2f}, {e[2]:+.2f}] logits"
                       + (" — not zero." if excludes_zero(e) and abs(e[0]) >= 0.1 else " — near zero, as a control "
                          "should be."))
    return out


def add_verb(sub, model_args, load) -> None:
    p = sub.add_parser("selectivity", help="four-fact selectivity of the frozen head (§3.3, Fig. 5a-b)")
    model_args(p)
    add_protocol_args(p, n_sources=32)
    p.set_defaults(fn=lambda args: _cli(args, load))


def _cli(args, load) -> int:
    model = load(args)
    run = open_run(args.out, kind="selectivity", model=model, model_name=args.model, args=work_args(args),
                   seeds=[args.seed], split="heldout")
    result = run_selectivity(model, head=args.head, run_dir=run, from_scan=args.from_scan, n_sources=args.n_sources,
                             n_dev=args.n_dev, layout=layout_from_args(args), seed=args.seed,
                             batch_size=args.batch_size, n_resamples=args.resamples, model_name=args.model,
                             progress=lambda arm: print(f"selectivity: {arm}", flush=True))
    print(result.section)
    print(f"results in {run.path}")
    return 0
