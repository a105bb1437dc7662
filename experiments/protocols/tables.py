"""One markdown table per protocol across models, with the paper's numbers beside, from the result directories of
run_tiny.py (<root>/<model>/<protocol>/<protocol>_summary.csv). Prints to stdout.

    PYTHONPATH=. python -m experiments.protocols.tables results/protocols results/protocols_b
"""
from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from recurscope.interp.protocols import neutral, selectivity

PAPER = {
    "selectivity": "GLA-340M 89.1% / 1.42%; GDN-340M 71.9% / 0.41%; GDN-1.3B 61.3% / 0.56% (donor answer / break)",
    "neutral": "GLA 91.8% -> 7.6%, others +2.15 pp; GDN 96.1% -> 37.1%, others +1.11 pp",
    "coupling": "parallel part lowers B's margin, orthogonal part raises it, random directions move it less, full "
                "edit weak",
    "heads": "GLA-340M top-1 recovers 94.7%; GLA-7B top-1 12.3%, top-16 92.3%",
    "headscan": "rank [1, 1] in both scans; 1.0% (GLA) / 3.1% (GDN) of 96 heads above 0.25; Spearman 0.173 "
                "[-0.014, 0.320] (GLA), 0.149 [-0.027, 0.285] (GDN)",
    "lens": "GLA layer 21: 28.9% -> 95.3%; GDN layer 20: 25.8% -> 100%; update jumps at the same layer (+28.9 / "
            "+43.0 pp)",
}


def ci(s: pd.DataFrame, where: dict, metric: str, pct: bool = False, digits: int = 2) -> str:
    sel = s["metric"] == metric
    for k, v in where.items():
        sel &= s[k] == v
    r = s[sel]
    if r.empty or pd.isna(r.iloc[0]["estimate"]):
        return "–"
    r = r.iloc[0]
    if pct:
        return f"{100 * r['estimate']:.1f}% [{100 * r['low']:.1f}, {100 * r['high']:.1f}]"
    return f"{r['estimate']:+.{digits}f} [{r['low']:+.{digits}f}, {r['high']:+.{digits}f}]"


def load(roots, proto):
    out = {}
    for root in roots:
        for d in sorted(Path(root).glob(f"*/{proto}/{proto}_summary.csv")):
            out[d.parent.parent.name] = pd.read_csv(d)
    return dict(sorted(out.items()))


def main(roots) -> None:
    sel = load(roots, "selectivity")
    print("### Four-fact selectivity (§3.3)\n\nPaper: " + PAPER["selectivity"] + "\n")
    print("| model | arm | target donor-answer | donor-specific shift | non-target break | non-target margin change |")
    print("|---|---|---|---|---|---|")
    for m, s in sel.items():
        for arm in [a for a in selectivity.ARMS if a in set(s["arm"])]:
            print(f"| {m} | {arm} | {ci(s, {'arm': arm}, 'donor_answer', True)} | "
                  f"{ci(s, {'arm': arm}, 'donor_specific_shift')} | {ci(s, {'arm': arm}, 'nontarget_break', True)} | "
                  f"{ci(s, {'arm': arm}, 'nontarget_margin_change')} |")
    cp = load(roots, "coupling")
    print("\n### Frobenius coupling (§2.4)\n\nPaper: " + PAPER["coupling"] + "\n")
    print("| model | parallel | orthogonal | full Δ_A | random (‖parallel‖) | random (‖orthogonal‖) | cos(Δ_A, Δ_B) |")
    print("|---|---|---|---|---|---|---|")
    for m, s in cp.items():
        cells = [ci(s, {"arm": a}, "margin_change_b") for a in ("parallel", "orthogonal", "full", "random_parallel",
                                                               "random_orthogonal")]
        print(f"| {m} | " + " | ".join(cells) + f" | {ci(s, {'arm': 'full'}, 'cos_ab', digits=3)} |")
    ne = load(roots, "neutral")
    print("\n### Neutral suppression (App. D.1)\n\nPaper: " + PAPER["neutral"] + "\n")
    print("| model | arm | target before | target after | others' accuracy change | others' margin change |")
    print("|---|---|---|---|---|---|")
    for m, s in ne.items():
        for arm in [a for a in neutral.ARMS if a in set(s["arm"])]:
            print(f"| {m} | {arm} | {ci(s, {'arm': arm}, 'target_clean_accuracy', True)} | "
                  f"{ci(s, {'arm': arm}, 'target_accuracy', True)} | "
                  f"{ci(s, {'arm': arm}, 'others_accuracy_change', True)} | "
                  f"{ci(s, {'arm': arm}, 'nontarget_margin_change')} |")
    hd = load(roots, "heads")
    print("\n### Head structure (Fig. 3c, App. E.2)\n\nPaper: " + PAPER["heads"] + "\n")
    print("| model | recovery(1) | recovery(2) | hub block | all-heads block | hub+second: joint - sum | all: joint - sum |")
    print("|---|---|---|---|---|---|---|")
    for m, s in hd.items():
        wb = s[s["analysis"] == "write_block"]
        hub = wb.iloc[0]["unit"]
        print(f"| {m} | {ci(s, {'analysis': 'recovery', 'unit': 'top1'}, 'recovery', True)} | "
              f"{ci(s, {'analysis': 'recovery', 'unit': 'top2'}, 'recovery', True)} | "
              f"{hub}: {ci(s, {'analysis': 'write_block', 'unit': hub}, 'answer_margin_change')} | "
              f"{ci(s, {'analysis': 'write_block', 'unit': 'all'}, 'answer_margin_change')} | "
              f"{ci(s, {'analysis': 'nonadditivity', 'unit': 'hub+second'}, 'joint_minus_sum')} | "
              f"{ci(s, {'analysis': 'nonadditivity', 'unit': 'all'}, 'joint_minus_sum')} |")
    hs = load(roots, "headscan")
    print("\n### Held-out all-head write and read scans (App. C)\n\nPaper: " + PAPER["headscan"] + "\n")
    print("| model | write rank | read rank | write: heads > 0.25 | read: heads > 0.25 | write-vs-read Spearman |")
    print("|---|---|---|---|---|---|")
    for m, s in hs.items():
        s = s.set_index(["scan", "metric"])

        def rank(scan):
            r = s.loc[(scan, "frozen_head_rank")]
            return f"{int(r['estimate'])} [{int(r['low'])}, {int(r['high'])}]"

        def frac(scan):
            r = s.loc[(scan, "fraction_above_threshold")]
            return f"{100 * r['estimate']:.0f}% ({int(round(r['estimate'] * r['n_units']))}/{int(r['n_units'])})"
        sp = s.loc[("write_vs_read", "spearman")]
        print(f"| {m} | {rank('write')} | {rank('read')} | {frac('write')} | {frac('read')} | "
              f"{sp['estimate']:+.3f} [{sp['low']:+.3f}, {sp['high']:+.3f}] |")
    ln = load(roots, "lens")
    print("\n### Logit lens (App. C)\n\nPaper: " + PAPER["lens"] + "\n")
    n_layers = max((int(s["layer"].max()) + 1 for s in ln.values()), default=0)   # the deepest model sets the columns
    print("| model | task | embedding | " + " | ".join(f"after layer {i}" for i in range(n_layers)) + " |")
    print("|---|---|---|" + "---|" * n_layers)
    for m, s in ln.items():
        acc = s[s["metric"] == "correct"]
        for task in ("retention", "update"):
            a = acc[acc["task"] == task]
            cells = [f"{100 * a[(a.layer == 0) & (a.side == 'before')].iloc[0]['estimate']:.1f}%"]
            for layer in range(n_layers):
                r = a[(a.layer == layer) & (a.side == "after")]
                cells.append(f"{100 * r.iloc[0]['estimate']:.1f}%" if len(r) else "–")
            print(f"| {m} | {task} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:] or ["results/protocols"])
