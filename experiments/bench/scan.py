"""Times the head-selection scan against one clean plus one donor forward, interleaved and order-rotated, on
GLA-340M-, GDN-340M- and hybrid-GDN-340M-shaped models with random weights, at two sequence lengths.

Per (shape, length) each round runs, in an order rotated by one place per round:
    clean + donor forward, batched    model(recipient and donor as one 2-row batch), full logits
    clean + donor forward, row by row model(recipient), model(donor)
    scan, all heads                   interp.scan.run_scan (prefix pass, clean suffix, growing batch of patched rows)
and the scan's time is divided, within the round, by the faster of the two forward ways (paired ratio); the median
of the paired ratios is printed beside the ratio of the minima. `uptime` is printed before and after: other jobs on
a shared machine inflate every figure. --naive-heads N also times one full patched forward per head on N heads
(interp.scan.naive_head_shifts), scales it to all heads and checks that the two agree.

Shapes (fla's configs): GLA-340M: 24 layers, hidden 1024, 4 heads, expand_k 0.5, expand_v 1 (state 128 x 256 per
head); GDN-340M: 24 layers, hidden 1024, 4 heads, head_dim 256, expand_v 1 (state 256 x 256). 96 heads each.
Hybrid GDN-340M (`gdn_hybrid`): GDN-340M with full softmax attention at the layers the paper's App. A lists, 2, 5,
8, ..., 23 (16 recurrent and 8 attention layers, 2:1; the paper's text calls it 3:1, docs/paper_ambiguities.md), 8
query and 2 KV heads of 128 with RoPE (fla's `attn` option): 64 scanned heads. `gdn_hybrid_3to1`: the 3:1 variant,
attention at every 4th layer (3, 7, ..., 23) as Qwen3.5 and the bundled tiny-gdn-hybrid's pattern; 18 recurrent
layers, 72 scanned heads.
Pairs: word-tokenizer recall pairs with a 7-token query; 4 facts and 256 filler tokens give 611 tokens, 2 facts
and 126 filler tokens 307. Targets: scan <= 1.5x clean + donor at 611 tokens, <= 2x at 307.

`qwen35` is a transformers model through the bridge (interp.bridge): transformers' own Qwen3_5ForCausalLM with
random weights, saved with save_pretrained and loaded by load_model, a small Qwen3.5-0.8B-like shape (8 layers,
3 Gated DeltaNet : 1 gated attention, hidden 512, GDN 8 key and 8 value heads of 128 x 128, attention 4 query and 1
KV heads of 128 with the output gate and partial RoPE, MLP 1792, vocabulary 32000): 48 scanned heads.

--baseline-scan FILE adds a fourth contender: run_scan from another version of interp/scan.py (e.g.
`git show <commit>:interp/scan.py > /tmp/old_scan.py`), loaded beside the current one and run on the same model in
the same rounds; its rows are checked against the current scan's, and the paired old / new ratio is printed.

--varlen adds the case of rows of different lengths (issue 30): four word-tokenizer pairs of one layout with 0, 100,
200 and 300 filler tokens (lengths about 2.4x apart) in one left-padded batch, scanned three ways in interleaved,
order-rotated rounds: packed (run_scan on the batch: prefixes packed with cu_seqlens, no padding computed), padded
(the same batch with its lengths dropped, so that the padding runs through the model: today's cost of batching
unequal rows; its rows differ, since the padding is read) and one scan per row at its own length (the loop). Ratios
are to packed; packed rows are checked against the loop's. `--lengths` with no value skips the equal-length cases.

--clock cpu (CPU only) times by this process's CPU time: at one thread the time other jobs hold the core then
does not count (cache and memory-bandwidth contention still does).

Usage:  python -m experiments.bench.scan [--shapes gla gdn gdn_hybrid qwen35] [--lengths 611 307] [--repeats 3]
                                         [--threads 1] [--layers N] [--naive-heads 0] [--device cpu|cuda]
                                         [--clock wall|cpu] [--baseline-scan FILE] [--varlen]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

import pandas as pd
import torch

import recurscope

from recurscope.interp.data import build_pairs, build_word_tokenizer, save_word_tokenizer
from recurscope.interp.loading import load_model
from recurscope.interp.models import ModelConfig, RecurrentLM
from recurscope.interp.scan import SCAN_KEY, all_heads, naive_head_shifts, run_scan

SHAPES = {
    "gla": dict(model_type="gla", vocab_size=32000, hidden_size=1024, num_hidden_layers=24, num_heads=4,
                expand_k=0.5, expand_v=1.0, hidden_ratio=4, use_short_conv=False, use_output_gate=True,
                gate_logit_normalizer=16, gate_low_rank_dim=16, tie_word_embeddings=False),
    "gdn": dict(model_type="gated_deltanet", vocab_size=32000, hidden_size=1024, num_hidden_layers=24, num_heads=4,
                head_dim=256, expand_v=1.0, hidden_ratio=4, tie_word_embeddings=False),
}
# Each hybrid's attention layers as (first, step): the paper's hybrid GDN-340M (App. A's list 2, 5, ..., 23: 16 / 8,
# 2:1) and the 3:1 pattern of Qwen3.5 and tiny-gdn-hybrid (3, 7, ..., 23: 18 / 6).
HYBRID_ATTENTION = {"gdn_hybrid": (2, 3), "gdn_hybrid_3to1": (3, 4)}
for _name, (_first, _step) in HYBRID_ATTENTION.items():
    SHAPES[_name] = dict(SHAPES["gdn"], attn={"layers": list(range(_first, 24, _step)), "num_heads": 8,
                                              "num_kv_heads": 2})
# transformers' Qwen3_5TextConfig keys: a small Qwen3.5-0.8B-like text model, run through the bridge.
BRIDGED_SHAPES = {
    "qwen35": dict(vocab_size=32000, hidden_size=512, intermediate_size=1792, num_hidden_layers=8,
                   linear_num_key_heads=8, linear_num_value_heads=8, linear_key_head_dim=128,
                   linear_value_head_dim=128, linear_conv_kernel_dim=4, num_attention_heads=4, num_key_value_heads=1,
                   head_dim=128, attn_output_gate=True, tie_word_embeddings=False, rms_norm_eps=1e-6,
                   rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25)),
}
LENGTHS = {611: dict(n_facts=4, filler_tokens=256), 307: dict(n_facts=2, filler_tokens=126)}
TARGETS = {611: 1.5, 307: 2.0}


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "uptime unavailable"


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def timed(fn, device, clock=time.perf_counter) -> float:
    sync(device)
    t0 = clock()
    fn()
    sync(device)
    return clock() - t0


def load_baseline(path: str):
    """interp/scan.py of another version as its own module; it imports the rest of recurscope from this checkout."""
    spec = importlib.util.spec_from_file_location("baseline_scan", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def build(shape: str, layers, device, workdir: str):
    """A native RecurrentLM from SHAPES, or a transformers model from BRIDGED_SHAPES saved and loaded through the
    bridge; `layers` (None: the shape's own) keeps a hybrid's attention pattern (HYBRID_ATTENTION)."""
    if shape in BRIDGED_SHAPES:
        import transformers as tf

        raw = dict(BRIDGED_SHAPES[shape])
        n = layers or raw["num_hidden_layers"]
        raw.update(num_hidden_layers=n, layer_types=[("full" if l % 4 == 3 else "linear") + "_attention"
                                                     for l in range(n)])
        hf = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**raw))
        path = os.path.join(workdir, shape)
        hf.save_pretrained(path)
        save_word_tokenizer(build_word_tokenizer(), path)
        model = load_model(path, device=str(device))
        return model, f"{shape} through the transformers bridge"
    raw = dict(SHAPES[shape])
    if layers:
        raw["num_hidden_layers"] = layers
    if raw.get("attn"):   # keep the hybrid's pattern when --layers shortens the model
        first, step = HYBRID_ATTENTION[shape]
        raw["attn"] = dict(raw["attn"], layers=list(range(first, raw["num_hidden_layers"], step)))
    return RecurrentLM(ModelConfig.from_dict(raw)).eval().to(device), f"{shape.upper()}-340M shape"


def scan_vs_forward(model, pairs, device, repeats: int, batch_size: int = 96, clock=time.perf_counter,
                    baseline=None):
    """Interleaved, order-rotated rounds of the two forward ways and the scan (and the scan of a `baseline` module
    with run_scan); returns ({name: times}, the median over rounds of scan time / the faster forward way of the
    same round)."""
    both = torch.cat([pairs.recipient_ids, pairs.donor_ids]).to(device)
    n_heads = len(all_heads(model))
    with torch.no_grad():
        model(both[:, :32])                                                     # warm-up
    fns = {
        "clean + donor, batched": lambda: model(both),
        "clean + donor, row by row": lambda: [model(both[i:i + 1]) for i in range(2)],
        f"scan, {n_heads} heads": lambda: run_scan(model, pairs, batch_size=batch_size),
    }
    if baseline is not None:
        fns[f"baseline scan, {n_heads} heads"] = lambda: baseline.run_scan(model, pairs, batch_size=batch_size)
    names = list(fns)
    times = {n: [] for n in names}
    with torch.no_grad():
        for r in range(repeats):
            shift = r % len(names)
            for n in names[shift:] + names[:shift]:
                times[n].append(timed(fns[n], device, clock))
    ref = [min(a, b) for a, b in zip(times[names[0]], times[names[1]])]
    return times, statistics.median(s / f for s, f in zip(times[names[2]], ref))


VARLEN_FILLERS = (0, 100, 200, 300)


def varlen_pairs(tok):
    """One pair per filler count of VARLEN_FILLERS (same layout otherwise), collated into one left-padded batch."""
    import dataclasses

    from recurscope.interp.data.recall import PairBatch, iter_pairs

    made = []
    for j, filler in enumerate(VARLEN_FILLERS):
        p = next(iter(iter_pairs(tok, "dev", 1, n_facts=2, presentations=3, gap_tokens=24, filler_tokens=filler,
                                 seed=j)))
        made.append(dataclasses.replace(p, source_id=j, group=j))
    return PairBatch.collate(made, 0)


def varlen_scan(model, pairs, device, repeats: int, batch_size: int = 96, clock=time.perf_counter):
    """Interleaved, order-rotated rounds of the packed scan, the padded scan and one scan per row; returns
    ({name: times}, max |shift| difference between the packed rows and the loop's)."""
    import dataclasses

    padded = dataclasses.replace(pairs, lengths=None)
    alone = [pairs.select([i]).trimmed() for i in range(len(pairs))]
    fns = {
        "packed (cu_seqlens)": lambda: run_scan(model, pairs, batch_size=batch_size),
        "padded": lambda: run_scan(model, padded, batch_size=batch_size),
        "one scan per row": lambda: [run_scan(model, p, batch_size=batch_size) for p in alone],
    }
    names = list(fns)
    times = {n: [] for n in names}
    with torch.no_grad():
        for r in range(repeats):
            shift = r % len(names)
            for n in names[shift:] + names[:shift]:
                times[n].append(timed(fns[n], device, clock))
        key = list(SCAN_KEY)
        packed_rows = run_scan(model, pairs, batch_size=batch_size).rows.set_index(key)["shift"]
        loop_rows = pd.concat([run_scan(model, p, batch_size=batch_size).rows for p in alone]).set_index(key)["shift"]
    return times, float((packed_rows - loop_rows.loc[packed_rows.index]).abs().max())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="*", default=["gla", "gdn", "gdn_hybrid", "qwen35"],
                    choices=sorted(SHAPES) + sorted(BRIDGED_SHAPES))
    ap.add_argument("--lengths", type=int, nargs="*", default=[611, 307], choices=sorted(LENGTHS))
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds per (shape, length)")
    ap.add_argument("--batch-size", type=int, default=96, help="(pair, head) rows per suffix batch")
    ap.add_argument("--layers", type=int, default=None, help="layers of every shape (default: each shape's own)")
    ap.add_argument("--baseline-scan", default=None, metavar="FILE",
                    help="also time run_scan from this copy of interp/scan.py (another version) in the same rounds")
    ap.add_argument("--varlen", action="store_true",
                    help="also time the scan of rows of different lengths: packed, padded and one scan per row")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--naive-heads", type=int, default=0, help="time the naive scan on this many heads (0: skip)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="wall: elapsed time; cpu (CPU device only): this process's CPU time, which at one thread "
                         "leaves out the time other jobs hold the core")
    args = ap.parse_args()
    if args.clock == "cpu" and args.device != "cpu":
        ap.error("--clock cpu times the CPU; with --device cuda use the wall clock")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    tok = build_word_tokenizer()
    print(f"scan benchmark: device {device}, threads {torch.get_num_threads()}, {args.repeats} interleaved rounds, "
          f"order rotated per round, batch_size {args.batch_size}, clock {args.clock}")
    print(f"uptime before: {uptime()}")
    # `python -m experiments.bench.X` from a checkout times that checkout; say which code is being timed.
    print(f"recurscope code timed: {os.path.dirname(os.path.dirname(recurscope.__file__))}")
    baseline = None if args.baseline_scan is None else load_baseline(args.baseline_scan)
    if baseline is not None:
        print(f"baseline scan: {args.baseline_scan}")
    workdir = tempfile.mkdtemp(prefix="scan-bench-")
    verdicts = []
    for shape in args.shapes:
        torch.manual_seed(0)
        model, title = build(shape, args.layers, device, workdir)
        heads = all_heads(model)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"\n{title}: {len(model.blocks)} layers ({len(model.attention_layers)} attention), "
              f"{len(heads)} heads, state {model.cfg.state_shape()}, {n_params / 1e6:.1f}M params")
        for length in args.lengths:
            pairs = build_pairs(tok, split="dev", n_sources=1, presentations=3, gap_tokens=24, **LENGTHS[length])
            T = pairs.recipient_ids.shape[1]
            times, paired = scan_vs_forward(model, pairs, device, args.repeats, args.batch_size, CLOCKS[args.clock],
                                            baseline)
            names = list(times)
            ref = [min(a, b) for a, b in zip(times[names[0]], times[names[1]])]
            scan_t = times[names[2]]
            print(f"  {T} tokens (query suffix {int(pairs.query_pos[0] - pairs.query_start[0] + 1)}):")
            for n in names:
                print(f"    {n:28s} median {statistics.median(times[n]):8.2f} s   min {min(times[n]):8.2f} s")
            print(f"    scan / (clean + donor): paired median {paired:.2f}x, ratio of minima "
                  f"{min(scan_t) / min(ref):.2f}x (target <= {TARGETS[length]}x)")
            if baseline is not None:
                old_t = times[names[3]]
                print(f"    baseline scan / (clean + donor): paired median "
                      f"{statistics.median(o / f for o, f in zip(old_t, ref)):.2f}x, ratio of minima "
                      f"{min(old_t) / min(ref):.2f}x; baseline / scan: paired median "
                      f"{statistics.median(o / n for o, n in zip(old_t, scan_t)):.2f}x, ratio of minima "
                      f"{min(old_t) / min(scan_t):.2f}x")
                with torch.no_grad():
                    new_rows = run_scan(model, pairs, batch_size=args.batch_size).rows.set_index(list(SCAN_KEY))
                    old_rows = baseline.run_scan(model, pairs, batch_size=args.batch_size).rows.set_index(list(SCAN_KEY))
                print(f"    baseline vs scan rows: max |shift difference| "
                      f"{(new_rows['shift'] - old_rows.loc[new_rows.index, 'shift']).abs().max():.2e}")
            verdicts.append(f"{title}, {T} tokens: scan / (clean + donor) = {paired:.2f}x (target <= "
                            f"{TARGETS[length]}x) {'met' if paired <= TARGETS[length] else 'MISSED'}")
            if args.naive_heads:
                n_naive = min(args.naive_heads, len(heads))
                t_naive = timed(lambda: naive_head_shifts(model, pairs, heads=heads[:n_naive]), device)
                slow = naive_head_shifts(model, pairs, heads=heads[:n_naive]).set_index(["layer", "head"])["shift"]
                fast = run_scan(model, pairs, heads=heads[:n_naive]).rows.set_index(["layer", "head"])["shift"]
                print(f"    naive scan, {n_naive} heads timed, scaled to {len(heads)}: "
                      f"{t_naive * len(heads) / n_naive:.1f} s; max |shift difference| "
                      f"{(fast.loc[slow.index] - slow).abs().max():.2e}")
        if args.varlen:
            pairs = varlen_pairs(tok)
            lengths = pairs.row_lengths().tolist()
            times, diff = varlen_scan(model, pairs, device, args.repeats, args.batch_size, CLOCKS[args.clock])
            base = times["packed (cu_seqlens)"]
            print(f"  rows of {lengths} tokens ({max(lengths) / min(lengths):.1f}x apart; {sum(lengths)} packed, "
                  f"{len(lengths) * max(lengths)} padded), ratios paired to packed:")
            for n, ts in times.items():
                print(f"    {n:28s} median {statistics.median(ts):8.2f} s   min {min(ts):8.2f} s   paired "
                      f"{statistics.median(t / b for t, b in zip(ts, base)):5.2f}x   mins {min(ts) / min(base):5.2f}x")
            print(f"    packed vs one scan per row: max |shift difference| {diff:.2e}")
            for n in ("padded", "one scan per row"):
                ratio = statistics.median(t / b for t, b in zip(times[n], base))
                verdicts.append(f"{title}, varlen {lengths}: {n} / packed = {ratio:.2f}x (target >= 1x) "
                                f"{'met' if ratio >= 1 else 'MISSED'}")
    print(f"\nuptime after: {uptime()}")
    for v in verdicts:
        print("target: " + v)


if __name__ == "__main__":
    main()
