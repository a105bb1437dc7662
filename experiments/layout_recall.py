"""Clean recall of every bundled checkpoint under the layout it records (pair_layout.json) and under the paper's
layout (--layout paper), on the same held-out sources: the table in docs/results_tiny.md.

    python -m experiments.layout_recall --n-sources 64
"""
from __future__ import annotations

import argparse

import torch

from recurscope.interp import interventions as iv
from recurscope.interp import stats
from recurscope.interp.data import build_pairs
from recurscope.interp.data.layout import LAYOUTS, recorded_layout
from recurscope.interp.loading import bundled_names, load_model


def recall(model, layout, n_sources: int, seed: int) -> stats.BootstrapCI:
    pairs = build_pairs(model.tokenizer, split="heldout", n_sources=n_sources, layout=layout, seed=seed,
                        pairs_per_source=1)
    clean = iv.clean_run(model, pairs)
    correct = (clean["recipient"].argmax(1) == pairs.recipient_answer_index).float().numpy()
    return stats.proportion_ci(correct, pairs.source_id.numpy())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n-sources", type=int, default=64, help="held-out sources, one pair each")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--models", nargs="*", default=None, help="bundled names (default: all)")
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    print("| model | recorded layout | recall (recorded) | recall (`--layout paper`) |")
    print("|---|---|---|---|")
    for name in args.models or bundled_names():
        model = load_model(name)
        own = recorded_layout(model.checkpoint_dir)
        cells = []
        for layout in (own, LAYOUTS["paper"]):
            ci = recall(model, layout, args.n_sources, args.seed)
            cells.append(f"{100 * ci.estimate:.1f}% [{100 * ci.low:.1f}, {100 * ci.high:.1f}]")
        print(f"| {name} | `{own.name}` | {cells[0]} | {cells[1]} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
