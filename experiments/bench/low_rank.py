"""kernels.recurrence_low_rank: the chunked path against the step loop, no autograd, float32, one thread: the lifted
route at several chunk sizes (RWKV-7's decays) and the segment-sum route (the one decays past its range take) at
its chunk of 4. Each time is the minimum over --repeats runs of this process's CPU seconds (so other jobs on a
shared machine do not count). The peers and the same-run bmm share are in experiments.bench.recurrence (RWKV-7).

Usage:  python -m experiments.bench.low_rank [--T 1024] [--heads 4] [--dim 64] [--repeats 3]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from recurscope import kernels
from recurscope.kernels.low_rank import SEGMENT_CHUNK, _low_rank_segments, low_rank_chunked


def cpu_seconds(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64, help="K = V")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    B, T, H, K = 1, args.T, args.heads, args.dim
    gen = torch.Generator().manual_seed(0)
    q, k, x = (torch.randn(B, T, H, K, generator=gen) for _ in range(3))
    kk = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    b = kk * torch.rand(B, T, H, K, generator=gen)
    g = -0.6 * torch.rand(B, T, H, K, generator=gen)          # RWKV-7's range of log w
    with torch.no_grad():
        ref = cpu_seconds(lambda: kernels.recurrence_low_rank(q, k, x, g, kk, b, backend="reference"), args.repeats)
        print(f"T={T} H={H} K=V={K} float32, one thread; step loop {ref * 1e3:.0f} ms")
        for C in (16, 32, 64):
            t = cpu_seconds(lambda: low_rank_chunked(q, k, x, g, kk, b, scale=K ** -0.5, chunk_size=C), args.repeats)
            print(f"  lifted route, chunk {C:>2}: {t * 1e3:6.0f} ms   step loop / chunked = {ref / t:.2f}")
        t = cpu_seconds(lambda: _low_rank_segments(q, k, x, g, kk, b, scale=K ** -0.5, chunk_size=SEGMENT_CHUNK),
                        args.repeats)
        print(f"  segment-sum route, chunk {SEGMENT_CHUNK}: {t * 1e3:6.0f} ms   step loop / chunked = {ref / t:.2f}")


if __name__ == "__main__":
    main()
