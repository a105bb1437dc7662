"""Times the recurrence backends side by side on a CPU: reference step loop, chunked, and fla's pure-torch chunk form.

Prints, for GDN and GDN-2/QED at B=1, H=4, K=V=128: median times, speed ratios, the chunked path's GFLOP/s
next to a plain torch matmul's GFLOP/s measured in the same run, and QED's overhead over GDN-2.

Useful FLOPs of the chunked algorithm, per chunk of C steps and per head (multiply-add = 2 FLOPs), as implemented
in kernels/chunked.py:
    pairwise A_qk, A_ak (lower triangles)          C(C+1) K + C(C-1) K
    unit-triangular inverse of (I + A_ak)           C^3 / 3
    R0 = L^-1 X, M = L^-1 (a e^G)                   2 C^2 (V + K)
    sequential: R = R0 - M S, S' = D S + K^T R      4 C K V
    output: A_qk R + (q e^G) S_0                    2 C^2 V + 2 C K V   (lower triangle of A_qk: C(C+1) V)
For a family without an erase vector (GLA) the A_ak, inverse, M and M S terms drop out. Elementwise work
(exponentials, decay factors) is not counted.

Usage:  python experiments/bench/recurrence.py [--quick] [--threads N] [--repeats R]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import torch

from recurscope import kernels
from recurscope.kernels.inputs import family_inputs

B, H, K, V, C = 1, 4, 128, 128, 64


def chunked_flops(T: int, with_erase: bool = True) -> float:
    n_chunks = -(-T // C)
    per = C * (C + 1) * K + C * (C + 1) * V + 2 * C * K * V          # A_qk, A_qk R, (q e^G) S_0
    per += 2 * C * K * V                                              # S' = D S + K^T R
    if with_erase:                                                    # A_ak, inverse, L^-1 [X, a e^G], M S
        per += C * (C - 1) * K + C ** 3 / 3 + 2 * C * C * (V + K) + 2 * C * K * V
    return float(per * n_chunks * B * H)


def median_time(fn, repeats: int) -> float:
    fn()                                                              # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_gflops(repeats: int) -> float:
    """A plain (B*H*N, C, K) @ (K, V)-sized batched product, the shape class the chunked path lives on."""
    a, b = torch.randn(128, 64, 128), torch.randn(128, 128, 128)
    t = median_time(lambda: torch.bmm(a, b), max(repeats, 5) * 3)
    return 2 * 128 * 64 * 128 * 128 / t / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="T in {512, 2048} and 3 repeats (about a minute)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch.set_num_threads (default: all cores)")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per entry (median reported)")
    ap.add_argument("--lengths", type=int, nargs="*", default=None, help="sequence lengths")
    ap.add_argument("--reference-max-T", type=int, default=2048, help="skip the step loop above this length")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    repeats = args.repeats or (3 if args.quick else 7)
    lengths = args.lengths or ([512, 2048] if args.quick else [512, 2048, 8192])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fla.ops.gated_delta_rule.naive import naive_chunk_gated_delta_rule
        from fla.ops.gdn2.naive import naive_chunk_gdn2

    print(f"recurrence benchmark: B={B} H={H} K=V={K}, float32, threads={torch.get_num_threads()}, "
          f"median of {repeats}, torch {torch.__version__}, load average {os.getloadavg()[0]:.2f}")
    mm_rate = matmul_gflops(repeats)
    print(f"torch bmm (128 x 64x128 @ 128x128) in this run: {mm_rate:.1f} GFLOP/s")
    print("fla baseline: fla.ops.gated_delta_rule.naive.naive_chunk_gated_delta_rule (GDN) and "
          "fla.ops.gdn2.naive.naive_chunk_gdn2 (GDN-2; QED has no fla op), both pure-torch chunk forms, C=64")
    header = (f"{'family':7s} {'T':>5s} {'reference':>10s} {'chunked':>9s} {'fla naive':>10s} "
              f"{'ref/chk':>8s} {'fla/chk':>8s} {'GFLOP/s':>8s} {'% mm':>6s}")
    print(header)
    print("-" * len(header))
    chunked_times = {}
    with torch.no_grad():
        for T in lengths:
            # One builder for every family (kernels.inputs); one seed, so the three share q, k and v.
            gdn, gdn2, qed = (family_inputs(f, B, T, H, K, V, dtype=torch.float32, decay=(0.0, 0.05))
                              for f in ("gdn", "gdn2", "qed"))
            cases = {
                "GDN": (gdn.args(), lambda: naive_chunk_gated_delta_rule(gdn.q, gdn.k, gdn.v, gdn.g, gdn.beta,
                                                                         chunk_size=64)),
                "GDN-2": (gdn2.args(), lambda: naive_chunk_gdn2(gdn2.q, gdn2.k, gdn2.v, gdn2.g, gdn2.b, gdn2.w,
                                                                chunk_size=64)),
                "QED": (qed.args(), None),
            }
            for fam, (args_, fla_fn) in cases.items():
                run = lambda backend: kernels.recurrence(*args_, backend=backend)  # noqa: E731
                t_chk = median_time(lambda: run("chunked"), repeats)
                chunked_times[fam, T] = t_chk
                t_ref = median_time(lambda: run("reference"), max(1, repeats // 2)) if T <= args.reference_max_T else None
                t_fla = median_time(fla_fn, repeats) if fla_fn is not None else None
                rate = chunked_flops(T) / t_chk / 1e9
                fmt = lambda t, why="skipped": f"{t * 1e3:8.1f}ms" if t is not None else f"{why:>10s}"  # noqa: E731
                ratio = lambda t: f"{t / t_chk:7.1f}x" if t is not None else f"{'-':>8s}"  # noqa: E731
                print(f"{fam:7s} {T:5d} {fmt(t_ref):>10s} {fmt(t_chk):>9s} {fmt(t_fla, 'no fla op'):>10s} "
                      f"{ratio(t_ref)} {ratio(t_fla)} {rate:8.1f} {100 * rate / mm_rate:5.0f}%")
    if any(T > args.reference_max_T for T in lengths):
        print(f"reference skipped above T={args.reference_max_T}: the step loop is linear in T and only adds minutes")
    print("QED overhead over GDN-2 (chunked, same shapes): " + ", ".join(
        f"T={T}: {100 * (chunked_times['QED', T] / chunked_times['GDN-2', T] - 1):+.0f}%" for T in lengths))
    print(f"load average at the end: {os.getloadavg()[0]:.2f} (other jobs on the machine inflate every figure)")


if __name__ == "__main__":
    main()
