"""The confirmation's causal arms with every control (interp.confirm.CONTROLS) on bundled checkpoints: the head is
the winner of a state-swap scan on dev sources, the arms run on held-out sources, and the summary gives the
donor-margin, donor-specific and distractor shifts side by side. Resumable (one row log per model).

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m experiments.protocols.controls_tiny --models tiny-gla tiny-gdn
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from recurscope.interp.confirm import CONTROLS, run_confirm
from recurscope.interp.data import build_pairs
from recurscope.interp.loading import bundled_names, load_model
from recurscope.interp.protocols._common import max_length, open_run, pair_spec
from recurscope.interp.report import LABELS
from recurscope.interp.scan import run_scan

ARMS = ("write_block", "write_block_conv_tail", *[a for main, cs in CONTROLS.items() for a in (main, *cs)])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="results/controls")
    p.add_argument("--models", nargs="+", default=None)
    p.add_argument("--n-dev", type=int, default=16)
    p.add_argument("--n-heldout", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    layout = pair_spec(seed=args.seed)
    lines = []
    for name in args.models or bundled_names():
        model = load_model(name)
        out = Path(args.out) / name
        dev = build_pairs(model.tokenizer, split="dev", n_sources=args.n_dev, max_length=max_length(model),
                          **layout.kwargs())
        scan = run_scan(model, dev, run_dir=open_run(out / "scan", kind="scan", model=model, model_name=name,
                                                     args={"n_dev": args.n_dev, **layout.record()}, seeds=[args.seed],
                                                     split="dev"))
        held = build_pairs(model.tokenizer, split="heldout", n_sources=args.n_heldout, max_length=max_length(model),
                           **layout.kwargs())
        run = open_run(out / "confirm", kind="confirm", model=model, model_name=name,
                       args={"n_heldout": args.n_heldout, "head": list(scan.winner), **layout.record()},
                       seeds=[args.seed], split="heldout")
        result = run_confirm(model, held, [scan.winner], run_dir=run, scan_heads=scan.heads, seed=args.seed,
                             arms=ARMS, progress=lambda arm: print(f"{name}: {arm}", flush=True))
        s = result.summary.set_index(["intervention", "metric"])

        def ci(arm, metric, pct=False):
            if (arm, metric) not in s.index:
                return "–"
            r = s.loc[(arm, metric)]
            if pct:
                return f"{100 * r['estimate']:.1f}%"
            return f"{r['estimate']:+.2f} [{r['low']:+.2f}, {r['high']:+.2f}]"
        lines += [f"### {name} (head L{scan.winner[0]}H{scan.winner[1]}, control head "
                  f"L{result.control_heads[0][0]}H{result.control_heads[0][1]}, {args.n_heldout} held-out sources)", "",
                  "| arm | donor-margin shift | donor-specific shift | distractor shift | donor-answer rate |",
                  "|---|---|---|---|---|"]
        for arm in ARMS:
            lines.append(f"| {LABELS[arm]} | {ci(arm, 'donor_margin_shift')} | {ci(arm, 'donor_specific_shift')} | "
                         f"{ci(arm, 'distractor_shift')} | {ci(arm, 'donor_answer', True)} |")
        lines.append("")
        (Path(args.out) / "controls.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
