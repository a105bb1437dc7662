"""The chunked kernel's float32 error against the float64 reference under hard resets (docs/kernels.md, "Stable
decays"): GDN-2 inputs (B=2, T=300, H=2, K=16, V=8, per-step log decays in [-0.1, 0], seed 7) with a reset of the given
size at about 2.5% of the (step, row, head, channel) entries, as fla's KDA varlen test writes -1000 at masked positions.
Prints fla's error ratio, rms(diff) / rms(ref), of o for the current kernel and, with --baseline DIR, for an older
checkout's kernels/chunked.py (called directly, as it may refuse -inf through today's entry).

Usage:  python -m experiments.bench.decay_precision [--baseline DIR]
"""
from __future__ import annotations

import argparse
import importlib.util
import os

import torch

from recurscope import kernels
from recurscope.kernels.chunked import recurrence_chunked
from recurscope.kernels.inputs import family_inputs

RESETS = (-30.0, -100.0, -1000.0, -1e4, float("-inf"))


def err_ratio(mine, ref):
    return float((mine.double() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", default=None, help="an older checkout whose kernels/chunked.py is measured too")
    args = ap.parse_args()
    kernels_run = {"current": recurrence_chunked}
    if args.baseline:
        path = os.path.join(args.baseline, "kernels", "chunked.py")
        spec = importlib.util.spec_from_file_location("baseline_chunked", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        kernels_run["baseline"] = mod.recurrence_chunked
    inp = family_inputs("gdn2", 2, 300, 2, 16, 8, dtype=torch.float32, seed=7, decay=(0.0, 0.1))
    print(f"{'reset':>8s} " + " ".join(f"{n:>10s}" for n in kernels_run))
    for reset in RESETS:
        g = inp.g.clone()
        gen = torch.Generator().manual_seed(1)
        where = (torch.rand(g.shape[:3], generator=gen) < 0.05)[..., None] & (torch.rand(g.shape, generator=gen) < 0.5)
        g[where] = reset
        ref = kernels.recurrence(*(t.double() for t in (inp.q, inp.k, inp.x, g, inp.a)), backend="reference").o
        row = []
        for fn in kernels_run.values():
            with torch.no_grad():
                o = fn(inp.q, inp.k, inp.x, g, inp.a, scale=16 ** -0.5)[0]
            row.append(f"{err_ratio(o, ref):10.2e}" if torch.isfinite(o).all() else f"{'non-finite':>10s}")
        print(f"{reset:8.0e} " + " ".join(row))


if __name__ == "__main__":
    main()
