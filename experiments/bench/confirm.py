"""Times the confirmation (every arm of interventions.REGISTRY on one head) with the arms sharing their unpatched
runs (run_confirm's default, interventions.reuse_clean_runs) against each arm run from scratch (share_runs=False),
interleaved and order-rotated, on a bundled checkpoint, and checks that both give the same rows.

The main job's confirmation is 128 held-out sources x 4 pairs x 14 arms; --n-sources scales it down for a quick
run (the cost is linear in the pairs). --clock cpu times by this process's CPU time (at one thread, the time other
jobs hold the core then does not count). `uptime` is printed before and after.

Usage:  python -m experiments.bench.confirm [--model tiny-gla] [--n-sources 16] [--repeats 3] [--clock cpu|wall]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import torch

from recurscope.interp.confirm import run_confirm
from recurscope.interp.data import build_pairs
from recurscope.interp.loading import load_model
from recurscope.interp.protocols._common import max_length
from recurscope.interp.scan import run_scan


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "uptime unavailable"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-gla")
    p.add_argument("--n-sources", type=int, default=16, help="held-out sources (the main job uses 128)")
    p.add_argument("--pairs-per-source", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print("before:", uptime())
    model = load_model(args.model)
    dev = build_pairs(model.tokenizer, split="dev", n_sources=4, max_length=max_length(model))
    head = run_scan(model, dev).winner
    pairs = build_pairs(model.tokenizer, split="heldout", n_sources=args.n_sources,
                        pairs_per_source=args.pairs_per_source, max_length=max_length(model))
    print(f"{args.model}: head L{head[0]}H{head[1]}, {len(pairs)} pairs of {pairs.recipient_ids.shape[1]} tokens, "
          f"{args.threads} thread(s), {args.clock} clock")
    contenders = {"shared runs": True, "each arm alone": False}
    times = {k: [] for k in contenders}
    rows = {}
    for r in range(args.repeats):
        order = list(contenders)[r % 2:] + list(contenders)[:r % 2]
        for name in order:
            t = clock()
            res = run_confirm(model, pairs, [head], share_runs=contenders[name], n_resamples=200)
            times[name].append(clock() - t)
            rows[name] = res.rows.sort_values(["intervention", "row"]).reset_index(drop=True)
    same = rows["shared runs"]["donor_margin_shift"].equals(rows["each arm alone"]["donor_margin_shift"])
    ratios = [a / s for a, s in zip(times["each arm alone"], times["shared runs"])]
    for name, ts in times.items():
        print(f"  {name:15s} median {statistics.median(ts):7.2f} s  min {min(ts):7.2f} s")
    print(f"  speed-up of shared runs: paired median {statistics.median(ratios):.2f}x, ratio of minima "
          f"{min(times['each arm alone']) / min(times['shared runs']):.2f}x; rows identical: {same}")
    per_pair = statistics.median(times["shared runs"]) / len(pairs)
    print(f"  shared runs per pair (all arms): {per_pair:.3f} s -> the main job's 512 pairs: {512 * per_pair:.0f} s")
    print("after:", uptime())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
