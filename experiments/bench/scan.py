"""Times the head-selection scan two ways on a GLA-340M-shaped model with random weights: the batched scan
(interp.scan.run_scan: one prefix forward of recipient and donor per pair, then every head's query suffix in one
batch) against the naive scan (interp.scan.naive_head_shifts: one full patched forward per head), side by side in
one run, each also as a ratio to one clean plus one donor full forward of the same pairs (the faster of running
them as one 2-row batch or one row at a time).

Shape (fla's GLA-340M config): 24 layers, hidden 1024, 4 heads, expand_k 0.5, expand_v 1 (state 128 x 256 per
head, 96 heads), vocab 32000. Pairs: word-tokenizer recall pairs of about 600 tokens (4 facts x 3 presentations,
24-token gaps, 256 filler tokens, 7-token query). Target: all 96 heads for at most 3x one clean + one donor forward.

The naive scan takes about (heads + 2) full forwards per pair; --naive-heads N times it on the first N heads only
and scales the time to all heads (printed as an extrapolation), for slow CPUs.

Usage:  python experiments/bench/scan.py [--pairs 1] [--naive-heads 96] [--batch-size 96] [--threads N]
                                         [--device cpu|cuda] [--layers 24]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from recurscope.interp.data import build_pairs, build_word_tokenizer
from recurscope.interp.models import ModelConfig, RecurrentLM
from recurscope.interp.scan import all_heads, naive_head_shifts, run_scan

GLA_340M = dict(model_type="gla", vocab_size=32000, hidden_size=1024, num_hidden_layers=24, num_heads=4,
                expand_k=0.5, expand_v=1.0, hidden_ratio=4, use_short_conv=False, use_output_gate=True,
                gate_logit_normalizer=16, gate_low_rank_dim=16, tie_word_embeddings=False)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, repeats=1):
    times = []
    out = None
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=1, help="pairs (sources) to scan")
    ap.add_argument("--naive-heads", type=int, default=None, help="time the naive scan on this many heads only")
    ap.add_argument("--batch-size", type=int, default=96, help="(pair, head) rows per suffix batch")
    ap.add_argument("--filler", type=int, default=256, help="filler tokens before the query (256 -> ~611 tokens)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=3, help="repeats of the clean+donor forward (median)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    torch.manual_seed(0)
    cfg = ModelConfig.from_dict({**GLA_340M, "num_hidden_layers": args.layers})
    model = RecurrentLM(cfg).eval().to(device)
    n_params = sum(p.numel() for p in model.parameters())
    tok = build_word_tokenizer()
    pairs = build_pairs(tok, split="dev", n_sources=args.pairs, n_facts=4, presentations=3, gap_tokens=24,
                        filler_tokens=args.filler)
    T = pairs.recipient_ids.shape[1]
    suffix = int(pairs.query_pos[0] - pairs.query_start[0] + 1)
    heads = all_heads(model)
    print(f"model: GLA shape, {args.layers} layers, {len(heads)} heads, state {cfg.state_shape()}, "
          f"{n_params / 1e6:.1f}M params, device {device}, threads {torch.get_num_threads()}")
    print(f"pairs: {len(pairs)} x {T} tokens (query suffix {suffix} tokens)")

    with torch.no_grad():
        both = torch.cat([pairs.recipient_ids, pairs.donor_ids]).to(device)
        model(both[:, :32])                                                     # warm-up
        t_pair, _ = timed(lambda: model(both), device, args.repeats)
        t_clean, _ = timed(lambda: [model(both[i:i + 1]) for i in range(len(both))], device, 1)

    t_fast, res = timed(lambda: run_scan(model, pairs, batch_size=args.batch_size), device)
    n_naive = len(heads) if args.naive_heads is None else min(args.naive_heads, len(heads))
    t_naive, slow = timed(lambda: naive_head_shifts(model, pairs, heads=heads[:n_naive]), device)
    t_naive_all = t_naive * len(heads) / n_naive
    label = "naive (one full forward per head)" + ("" if n_naive == len(heads) else
                                                    f", {n_naive} heads timed, scaled to {len(heads)}")

    fast = res.rows.set_index(["source", "pair", "layer", "head"])["shift"]
    ref = slow.set_index(["source", "pair", "layer", "head"])["shift"]
    diff = (fast.loc[ref.index] - ref).abs().max()

    # The reference is the faster of the two ways to run one clean + one donor forward (conservative for the scan).
    t_ref = min(t_pair, t_clean)
    print()
    print(f"{'one clean + one donor forward, batched (2 rows)':<60} {t_pair:9.2f} s   {t_pair / t_ref:5.2f}x")
    print(f"{'one clean + one donor forward, one row at a time':<60} {t_clean:9.2f} s   {t_clean / t_ref:5.2f}x")
    print(f"{'batched scan, all ' + str(len(heads)) + ' heads':<60} {t_fast:9.2f} s   {t_fast / t_ref:5.2f}x")
    print(f"{label:<60} {t_naive_all:9.2f} s   {t_naive_all / t_ref:5.2f}x")
    print(f"naive / batched: {t_naive_all / t_fast:.1f}x;  batched scan vs target (<= 3x clean+donor): "
          f"{t_fast / t_ref:.2f}x {'OK' if t_fast / t_ref <= 3 else 'MISSED'}")
    print(f"max |shift(batched) - shift(naive)| over {len(ref)} (pair, head) rows: {diff:.2e}")


if __name__ == "__main__":
    main()
