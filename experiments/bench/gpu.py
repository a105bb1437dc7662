"""The GPU measurements, in one short run (a few minutes on one GPU): interleaved, order-rotated rounds, paired
median ratios beside ratios of minima, CUDA synchronised around every timed call.

1. The recurrence through fla's chunk kernels (kernels.recurrence(backend="fla")) against fla's own plain chunk call,
   for GLA (chunk_gla) and Gated DeltaNet (chunk_gated_delta_rule), patches off and on. "On" means write_scale at
   every step, states captured at 4 positions and extra writes at 2 positions (6 splits).
   Targets: <= 1.25x fla's plain call with patches off, <= 1.5x with patches on.
2. Our Triton kernel (backend="triton", kernels.triton_recurrent) against fla's fused recurrent kernel
   (fused_recurrent_gla, fused_recurrent_gated_delta_rule), plain calls.
3. Grouped value heads and packed sequences (issue 30), Gated DeltaNet, the same B x T tokens:
   - GVA (H_k = H / 2): our fla path and our Triton kernel reading q and k per key head, against the same calls
     with q and k repeated over the value heads first (today's bridge before the change) and fla's own call with
     H_k keys; target: native <= 1.0x repeat-then-call;
   - varlen (B sequences of lengths varying 4x, packed into one row with cu_seqlens): our fla path and our Triton
     kernel packed, against the same backends on the sequences right-padded to the longest and one call per
     sequence, and fla's own packed call; target: packed <= 1.0x padded.
4. The 96-head scan against one clean + one donor forward on a GLA-340M-shaped model (experiments/bench/scan.py's
   scan_vs_forward) at 611 tokens; targets <= 1.25x with the scan's patches counted as "on": <= 1.5x.

Shapes for 1-3: B=4, T=4096, H=16, K=V=128, bfloat16 inputs (float32 gates), fla's usual training shape.
Run with the checkout on the path:  PYTHONPATH=. python -m experiments.bench.gpu [--repeats 10] [--skip-scan]

The functions take the device and the shapes, so that tests/experiments/test_bench_gpu.py runs the whole script on
tiny shapes on a CPU (fla's and our Triton kernels in Triton's interpreter) and the first GPU run does not stop
on a mistake in the script itself; those CPU timings mean nothing.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from typing import Optional

import torch
import torch.nn.functional as F

import recurscope
from recurscope import kernels
from recurscope.kernels.fla_chunk import fallback_reason

SHAPE = dict(B=4, T=4096, H=16, K=128, V=128, dtype=torch.bfloat16)    # fla's usual training shape
SCAN_LENGTH = 611


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed_rounds(fns: dict, repeats: int, device: torch.device) -> dict:
    names = list(fns)
    for n in names:                                        # warm-up: compiles and autotunes every kernel
        fns[n]()
    sync(device)
    times = {n: [] for n in names}
    for r in range(repeats):
        shift = r % len(names)
        for n in names[shift:] + names[:shift]:
            sync(device)
            t0 = time.perf_counter()
            fns[n]()
            sync(device)
            times[n].append(time.perf_counter() - t0)
    return times


def report(title: str, times: dict, base: str, targets: dict) -> list[str]:
    print(f"\n{title}  (ratios: time / {base})")
    verdicts = []
    for n, ts in times.items():
        paired = statistics.median(t / b for t, b in zip(ts, times[base]))
        print(f"  {n:44s} median {statistics.median(ts) * 1e3:8.3f} ms  min {min(ts) * 1e3:8.3f} ms  "
              f"paired {paired:5.2f}x  mins {min(ts) / min(times[base]):5.2f}x")
        if n in targets:
            ok = paired <= targets[n]
            verdicts.append(f"{title}: {n} = {paired:.2f}x (target <= {targets[n]}x) {'met' if ok else 'MISSED'}")
    return verdicts


def inputs(device, B, T, H, K, V, dtype):
    gen = torch.Generator(device=device).manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen, device=device)  # noqa: E731
    q, k, v = r(B, T, H, K), F.normalize(r(B, T, H, K), dim=-1), r(B, T, H, V)
    beta = torch.rand(B, T, H, generator=gen, device=device) * 0.9 + 0.05
    g_chan = F.logsigmoid(r(B, T, H, K) + 4.0) / 16
    g_head = F.logsigmoid(r(B, T, H) + 4.0)
    ws = torch.rand(B, T, H, generator=gen, device=device)
    u, y = torch.zeros(B, T, H, K, device=device), torch.zeros(B, T, H, V, device=device)
    for t in (T // 3, 2 * T // 3):
        u[:, t], y[:, t] = r(B, H, K) * 0.1, r(B, H, V)
    bf = lambda t: t.to(dtype)  # noqa: E731
    return dict(q=bf(q), k=bf(k), v=bf(v), beta=beta, g_chan=g_chan, g_head=g_head, ws=ws, extra=(u, y),
                capture=[T // 4, T // 2, 3 * T // 4, T - 1])


def recurrence_benches(repeats: int, device: torch.device, shape: dict = SHAPE) -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
        from fla.ops.gla import chunk_gla, fused_recurrent_gla
    B, T, H, K, V = (shape[n] for n in "BTHKV")
    d = inputs(device, **shape)
    q, k, v, beta = d["q"], d["k"], d["v"], d["beta"]
    scale = K ** -0.5
    patches = dict(write_scale=d["ws"], extra_write=d["extra"], capture=d["capture"])
    bt = beta[..., None]
    families = {
        "GLA": ((q, k, v, d["g_chan"], None),
                lambda: chunk_gla(q, k, v, d["g_chan"], scale=scale, output_final_state=True),
                lambda: fused_recurrent_gla(q, k, v, gk=d["g_chan"], scale=scale, output_final_state=True)),
        "GDN": ((q, k, (bt * v.float()).to(v.dtype), d["g_head"], (bt * k.float()).to(k.dtype)),
                lambda: chunk_gated_delta_rule(q, k, v, d["g_head"], beta.to(q.dtype), scale=scale,
                                               output_final_state=True),
                lambda: fused_recurrent_gated_delta_rule(q, k, v, g=d["g_head"], beta=beta.to(q.dtype), scale=scale,
                                                         output_final_state=True)),
    }
    verdicts = []
    with torch.no_grad():
        for fam, (args_, fla_chunk_fn, fla_fused_fn) in families.items():
            for label, kw in (("patches off", {}), ("patches on", patches)):
                why = fallback_reason(*args_, extra_write=kw.get("extra_write"))
                print(f"{fam} {label}: {'fla chunk kernels' if why is None else 'FALLS BACK to triton: ' + why}")
            times = timed_rounds({
                "fla plain chunk": fla_chunk_fn,
                "recurscope fla path, patches off": lambda: kernels.recurrence(*args_, scale=scale, backend="fla"),
                "recurscope fla path, patches on": lambda: kernels.recurrence(*args_, scale=scale, backend="fla",
                                                                              **patches),
            }, repeats, device)
            verdicts += report(f"{fam} B={B} T={T} H={H} K={K} V={V} {str(q.dtype)[6:]}: fla path vs fla's chunk call",
                               times,
                               "fla plain chunk", {"recurscope fla path, patches off": 1.25,
                                                   "recurscope fla path, patches on": 1.5})
            times = timed_rounds({
                "fla fused recurrent": fla_fused_fn,
                "recurscope triton kernel": lambda: kernels.recurrence(*args_, scale=scale, backend="triton"),
            }, repeats, device)
            verdicts += report(f"{fam}: our Triton kernel vs fla's fused recurrent", times, "fla fused recurrent",
                               {"recurscope triton kernel": 1.25})
    return verdicts


def varlen_gva_benches(repeats: int, device: torch.device, shape: dict = SHAPE) -> list[str]:
    """Grouped value heads and packed sequences on the fla and triton backends (item 3 of the docstring)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    B, T, H, K, V = (shape[n] for n in "BTHKV")
    d = inputs(device, **shape)
    q, k, v, beta, g = d["q"], d["k"], d["v"], d["beta"], d["g_head"]
    scale = K ** -0.5
    bt = beta[..., None]
    x = (bt * v.float()).to(v.dtype)
    verdicts = []
    with torch.no_grad():
        # GVA: one key head per two value heads
        qk, kk = q[:, :, ::2].contiguous(), k[:, :, ::2].contiguous()
        ak = (bt.unflatten(2, (H // 2, 2)) * kk.float()[:, :, :, None]).flatten(2, 3).to(k.dtype)
        rep = lambda t: t.repeat_interleave(2, dim=2)  # noqa: E731
        print(f"GVA: {fallback_reason(qk, kk, x, g, ak) or 'fla chunk kernels'}")
        times = timed_rounds({
            "fla path, q k repeated first": lambda: kernels.recurrence(rep(qk), rep(kk), x, g, ak, scale=scale,
                                                                        backend="fla"),
            "fla path, grouped value heads": lambda: kernels.recurrence(qk, kk, x, g, ak, scale=scale, backend="fla"),
            "fla's own GVA call": lambda: chunk_gated_delta_rule(qk, kk, v, g, beta.to(q.dtype), scale=scale,
                                                                 output_final_state=True),
            "triton, q k repeated first": lambda: kernels.recurrence(rep(qk), rep(kk), x, g, ak, scale=scale,
                                                                      backend="triton"),
            "triton, grouped value heads": lambda: kernels.recurrence(qk, kk, x, g, ak, scale=scale,
                                                                       backend="triton"),
        }, repeats, device)
        verdicts += report(f"GDN GVA H_k={H // 2} H={H} T={T}: native vs repeat-then-call", times,
                           "fla path, q k repeated first", {"fla path, grouped value heads": 1.0})
        verdicts += report(f"GDN GVA H_k={H // 2} H={H} T={T}, triton", {n: times[n] for n in times
                                                                          if n.startswith("triton")},
                           "triton, q k repeated first", {"triton, grouped value heads": 1.0})
        # varlen: lengths from T/4 to T (4x apart), B of them, packed into one row
        n = max(2, 2 * B)
        lengths = [max(1, round(T / 4 + (T - T / 4) * i / (n - 1))) for i in range(n)]
        total = sum(lengths)
        cu = [0]
        for L in lengths:
            cu.append(cu[-1] + L)
        flat = lambda t: t.reshape(1, -1, *t.shape[2:])[:, :total].contiguous()  # noqa: E731
        big = inputs(device, B=n, T=T, H=H, K=K, V=V, dtype=q.dtype)
        pq, pk, pv, pb, pg = (flat(big[c]) for c in ("q", "k", "v", "beta", "g_head"))
        px, pa = (pb[..., None] * pv.float()).to(pv.dtype), (pb[..., None] * pk.float()).to(pk.dtype)
        Tm = max(lengths)
        pad = lambda t: torch.stack([F.pad(t[0, lo:hi], (0, 0) * (t.dim() - 2) + (0, Tm - (hi - lo)))  # noqa: E731
                                     for lo, hi in zip(cu[:-1], cu[1:])])
        dq, dk, dx, dg, da = (pad(t) for t in (pq, pk, px, pg, pa))
        cu_t = torch.tensor(cu, device=device)
        for backend in ("fla", "triton"):
            seq = lambda i: slice(cu[i], cu[i + 1])  # noqa: E731
            times = timed_rounds({
                "padded batch": lambda: kernels.recurrence(dq, dk, dx, dg, da, scale=scale, backend=backend),
                "packed, cu_seqlens": lambda: kernels.recurrence(pq, pk, px, pg, pa, scale=scale, backend=backend,
                                                                 cu_seqlens=cu_t),
                "one call per sequence": lambda: [kernels.recurrence(
                    pq[:, seq(i)], pk[:, seq(i)], px[:, seq(i)], pg[:, seq(i)], pa[:, seq(i)], scale=scale,
                    backend=backend) for i in range(n)],
                **({"fla's own packed call": lambda: chunk_gated_delta_rule(
                    pq, pk, pv, pg, pb.to(pq.dtype), scale=scale, output_final_state=True, cu_seqlens=cu_t)}
                   if backend == "fla" else {}),
            }, repeats, device)
            verdicts += report(f"GDN varlen {backend}, {n} sequences of {lengths[0]}..{lengths[-1]} tokens "
                               f"({total} packed, {n * Tm} padded)", times, "padded batch",
                               {"packed, cu_seqlens": 1.0})
    return verdicts


def scan_bench(repeats: int, device: torch.device, model_shape: Optional[dict] = None,
               length: int = SCAN_LENGTH) -> list[str]:
    """The scan of every head against one clean + one donor forward; model_shape defaults to scan.py's GLA-340M."""
    from experiments.bench.scan import LENGTHS, SHAPES, scan_vs_forward

    from recurscope.interp.data import build_pairs, build_word_tokenizer
    from recurscope.interp.models import ModelConfig, RecurrentLM
    from recurscope.interp.scan import all_heads

    torch.manual_seed(0)
    model = RecurrentLM(ModelConfig.from_dict(model_shape or SHAPES["gla"])).eval().to(device)
    pairs = build_pairs(build_word_tokenizer(), split="dev", n_sources=1, presentations=3, gap_tokens=24,
                        **LENGTHS[length])
    times, paired = scan_vs_forward(model, pairs, device, repeats)
    print(f"\n{len(all_heads(model))}-head scan vs one clean + one donor forward, "
          f"{'GLA-340M shape' if model_shape is None else 'given shape'}, {pairs.recipient_ids.shape[1]} tokens, "
          f"backend {kernels.resolve_backend('auto', device)}")
    for n, ts in times.items():
        print(f"  {n:44s} median {statistics.median(ts):8.3f} s  min {min(ts):8.3f} s")
    ok = paired <= 1.5
    return [f"scan / (clean + donor) = {paired:.2f}x (target <= 1.5x with patches on) {'met' if ok else 'MISSED'}"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--skip-scan", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("experiments/bench/gpu.py needs a CUDA GPU; the CPU benchmarks are recurrence.py and scan.py")
    print(f"GPU benchmark on {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"recurscope code timed: {os.path.dirname(os.path.dirname(recurscope.__file__))}")
    cuda = torch.device("cuda")
    verdicts = recurrence_benches(args.repeats, cuda)
    verdicts += varlen_gva_benches(args.repeats, cuda)
    if not args.skip_scan:
        verdicts += scan_bench(max(3, args.repeats // 3), cuda)
    print()
    for v in verdicts:
        print("target: " + v)


if __name__ == "__main__":
    main()
