"""Times the head-selection scan on Ray against the in-process scan, side by side in one run: the 96-head scan of
a GLA-340M-shaped model with random weights over 8 pairs (one per source), in process (interp.scan.run_scan), then
on Ray with 1 worker and with 2 (interp.distributed.run_scan_ray, one actor per worker, one (source, all heads)
unit per pair), each worker and the in-process scan at `--threads` torch threads.

Printed: each run's time; the speed-up of 2 workers over 1 worker and over the in-process scan; Ray's per-unit
overhead, (1-worker work time - in-process time) / units, i.e. what running a unit as a Ray actor task adds
(scheduling, sending the unit and its rows, the unit's own summary) to the same computation in process. The
actors' start (import, model build) is timed apart, as startup, since it is paid once per run. Rows of every run
are checked against the in-process rows. Target on a 2-core machine: 2 workers at least 1.6x one worker.

Usage:  python -m experiments.bench.ray_scan [--pairs 8] [--filler 256] [--layers 24] [--threads 1]
                                             [--address ADDRESS] [--device cpu|cuda]
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from recurscope.interp import distributed as dist
from recurscope.interp.data import build_pairs, build_word_tokenizer
from recurscope.interp.models import ModelConfig, RecurrentLM
from recurscope.interp.scan import SCAN_KEY, all_heads, run_scan

GLA_340M = dict(model_type="gla", vocab_size=32000, hidden_size=1024, num_hidden_layers=24, num_heads=4,
                expand_k=0.5, expand_v=1.0, hidden_ratio=4, use_short_conv=False, use_output_gate=True,
                gate_logit_normalizer=16, gate_low_rank_dim=16, tie_word_embeddings=False)


class RandomGLA:
    """Builds the same random GLA-340M-shaped model in every process (seeded), on `device`."""

    def __init__(self, layers: int, device: str):
        self.layers, self.device = layers, device
        self.uses_gpu = device.startswith("cuda")

    def __call__(self):
        torch.manual_seed(0)
        model = RecurrentLM(ModelConfig.from_dict({**GLA_340M, "num_hidden_layers": self.layers}))
        return model.eval().to(self.device)


def max_shift_difference(rows, reference) -> float:
    key = list(SCAN_KEY)
    a = rows.sort_values(key).reset_index(drop=True)
    b = reference.sort_values(key).reset_index(drop=True)
    assert a[key].to_numpy().tolist() == b[key].to_numpy().tolist(), "the Ray scan's rows differ in their keys"
    return float(np.abs(a["shift"].to_numpy() - b["shift"].to_numpy()).max())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=8, help="pairs (one per source) to scan")
    ap.add_argument("--filler", type=int, default=256, help="filler tokens before the query (256 -> ~611 tokens)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--batch-size", type=int, default=96, help="(pair, head) rows per suffix batch")
    ap.add_argument("--threads", type=int, default=1, help="torch threads in process and per worker")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--address", default=None, help="a Ray cluster to join (default: a local instance)")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load = os.getloadavg()
    print(f"machine: {os.cpu_count()} CPUs, load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} "
          f"(1 / 5 / 15 min) at start")

    factory = RandomGLA(args.layers, args.device)
    model = factory()
    heads = all_heads(model)
    pairs = build_pairs(build_word_tokenizer(), split="dev", n_sources=args.pairs, n_facts=4, presentations=3,
                        gap_tokens=24, filler_tokens=args.filler)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: GLA shape, {args.layers} layers, {len(heads)} heads, {n_params / 1e6:.1f}M params, device "
          f"{args.device}, {args.threads} thread(s) per process; pairs: {len(pairs)} x "
          f"{pairs.recipient_ids.shape[1]} tokens")

    t0 = time.perf_counter()
    reference = run_scan(model, pairs, batch_size=args.batch_size).rows
    in_process = time.perf_counter() - t0
    del model
    print(f"in-process scan: {in_process:.1f} s ({in_process / args.pairs:.2f} s per pair)")

    t0 = time.perf_counter()
    dist.connect(args.address)
    print(f"Ray start/join: {time.perf_counter() - t0:.1f} s")
    runs = {}
    for w in args.workers:
        result, stats = dist.run_scan_ray(factory, pairs, heads, batch_size=args.batch_size, workers=w,
                                          threads_per_worker=args.threads)
        diff = max_shift_difference(result.rows, reference)
        runs[w] = stats
        print(f"Ray, {w} worker(s): {stats.units} units, work {stats.work_s:.1f} s (+ actor startup "
              f"{stats.startup_s:.1f} s, wall {stats.wall_s:.1f} s), max |shift - in-process| = {diff:.1e}")

    print()
    print(f"{'run':<22}{'work s':>9}{'vs in-process':>15}")
    print(f"{'in process':<22}{in_process:>9.1f}{1.0:>14.2f}x")
    for w, stats in runs.items():
        print(f"{f'Ray, {w} worker(s)':<22}{stats.work_s:>9.1f}{in_process / stats.work_s:>14.2f}x")
    if 1 in runs:
        overhead = (runs[1].work_s - in_process) / runs[1].units
        print(f"Ray per-unit overhead (1 worker vs in process): {overhead * 1e3:+.0f} ms per unit "
              f"({100 * overhead * runs[1].units / in_process:+.1f}% of the in-process time)")
        for w, stats in runs.items():
            if w != 1:
                print(f"speed-up of {w} workers over 1: {runs[1].work_s / stats.work_s:.2f}x (target >= 1.6x for 2 "
                      f"workers on 2 cores)")
    load = os.getloadavg()
    print(f"load average at the end: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}")


if __name__ == "__main__":
    main()
