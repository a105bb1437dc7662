"""Runs every protocol of interp.protocols on the bundled checkpoints at sizes that finish in minutes on one CPU
thread, and writes one markdown file with every report section (the source of docs/results_tiny.md's protocol
tables). Resumable: each protocol's result directory is reopened and finished arms are skipped.

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m experiments.protocols.run_tiny --out results/protocols
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from recurscope.interp.loading import bundled_names, load_model
from recurscope.interp.protocols import coupling, headscan, heads, lens, neutral, selectivity
from recurscope.interp.protocols._common import open_run, pair_spec
from recurscope.interp.scan import run_scan

PROTOCOLS = ("selectivity", "coupling", "neutral", "heads", "headscan", "lens")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="results/protocols")
    p.add_argument("--models", nargs="+", default=None, help="default: every bundled checkpoint")
    p.add_argument("--protocols", nargs="+", default=list(PROTOCOLS), choices=PROTOCOLS)
    p.add_argument("--n-dev", type=int, default=16)
    p.add_argument("--n-sources", type=int, default=16, help="held-out sources per protocol")
    p.add_argument("--n-heads-sources", type=int, default=32, help="held-out sources for the top-k recovery")
    p.add_argument("--filler", type=int, default=512)
    p.add_argument("--resamples", type=int, default=9999)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    layout = pair_spec(filler_tokens=args.filler, seed=args.seed)
    sections = []
    for name in args.models or bundled_names():
        model = load_model(name)
        # One dev scan per model freezes the head and the ranking every protocol uses.
        scan_dir = out / name / "scan"
        from recurscope.interp.data import build_pairs
        from recurscope.interp.protocols._common import max_length

        dev = build_pairs(model.tokenizer, split="dev", n_sources=args.n_dev, max_length=max_length(model),
                          **layout.kwargs())
        run = open_run(scan_dir, kind="scan", model=model, model_name=name, args={"n_dev": args.n_dev, **layout.record()},
                       seeds=[args.seed], split="dev")
        scan = run_scan(model, dev, run_dir=run)
        head, ranking = scan.winner, scan.heads
        first_section = len(sections)
        common = dict(seed=args.seed, n_resamples=args.resamples, model_name=name, layout=layout)
        for proto in args.protocols:
            t0 = time.time()
            run = open_run(out / name / proto, kind=proto, model=model, model_name=name,
                           args={"n_sources": args.n_sources, "n_heads_sources": args.n_heads_sources,
                                 "n_dev": args.n_dev, "head": list(head), **layout.record()}, seeds=[args.seed],
                           split="heldout")
            if proto == "selectivity":
                r = selectivity.run_selectivity(model, head=head, run_dir=run, n_sources=args.n_sources, **common)
            elif proto == "coupling":
                r = coupling.run_coupling(model, head=head, run_dir=run, n_sources=args.n_sources, **common)
            elif proto == "neutral":
                r = neutral.run_neutral(model, head=head, run_dir=run, n_sources=args.n_sources, **common)
            elif proto == "heads":
                r = heads.run_heads(model, ranking=ranking, run_dir=run, n_sources=args.n_heads_sources, **common)
            elif proto == "headscan":
                r = headscan.run_headscan(model, head=head, run_dir=run, n_sources=args.n_sources,
                                          **{**common, "n_resamples": min(args.resamples, 2000)})
            else:
                r = lens.run_lens(model, run_dir=run, n_sources=args.n_sources, **common)
            print(f"{name} {proto}: {time.time() - t0:.0f} s", flush=True)
            sections.append(r.section.replace("](figures/", f"]({name}/{proto}/figures/"))
        # one file per model too, so runs of different models into one --out (in parallel) never overwrite each other
        (out / name / "sections.md").write_text("\n\n".join(sections[first_section:]) + "\n")
        (out / "sections.md").write_text("\n\n".join(sections) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
