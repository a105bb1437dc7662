"""The scan by attribution patching (`recurscope scan --method attribution`) against the exact scan, on every bundled
model and on a random-weight Qwen3.5 of a given shape: how well the first-order estimate ranks the heads, and what
it saves.

Per model: the same dev pairs (word-tokenizer recall pairs, --n-sources x --pairs-per-source, --filler tokens) go to
    exact         interp.scan.run_scan: every head's state swap run (prefix pass, clean suffix, patched suffixes)
    attribution   interp.scan_attribution.attribution_shifts: prefix pass, one clean suffix with the recipients'
                  cached states as leaves, one backward pass per batch of pairs, (S_donor - S_recipient) . dm/dS
in --repeats rounds, the order swapped each round; each time is the minimum over rounds of this process's CPU
seconds (one thread, so that other jobs on a shared machine do not count) and of the wall seconds.

Agreement, on J (each head's mean over sources of the per-source mean shift, as the scan ranks heads):
    Spearman      scipy.stats.spearmanr of the two J vectors over all heads
    top-1         whether the two scans pick the same winner
    top-5         how many of the exact scan's 5 best heads are among the estimate's 5 best
Rounding: a head whose donor and recipient states are equal (estimate below 1e-6 of the largest) still shifts the
exact margin by float rounding (transformers' norms and softmax run in float32 even in a float64 model); the largest
such |exact J| is reported as the noise floor, and the Spearman is also given over the heads whose |exact J| is 10x
above it.
Where the linear estimate fails, per (pair, head) row: for the rows whose exact shift is large (|shift| above a
quarter of the largest on that model), the ratio estimate / exact; a ratio off 1 by more than 25% is counted as a
failure, and the heads of the exact top 5 are listed with their exact and estimated J. For the exact winner the
exact shift is also measured part of the way along the swap (alpha = 0.25 ... 1 of S_donor - S_recipient, through the
model protocol's cache edit and run_suffix), beside the linear estimate alpha x J_estimate: the shape of that curve
says why the estimate misses.

The Qwen3.5 model is transformers' own Qwen3_5ForCausalLM with random weights, built by
experiments.bench.transformers_run.build_checkpoint (its PRESET is Qwen3.5-0.8B's text shape; --qwen-config JSON
overrides keys, e.g. fewer layers on a small machine) and loaded through the bridge.

Usage:  python -m experiments.bench.attribution [--models tiny-gla ... | --models all] [--n-sources 8]
            [--pairs-per-source 2] [--filler 128] [--repeats 2]
            [--qwen-ckpt DIR [--qwen-config JSON] [--qwen-dtype float64] [--qwen-sources N]]
            [--json out.json]
        python -m experiments.bench.attribution --report bundled.json qwen.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

import torch
from scipy.stats import spearmanr

from recurscope.interp.data import build_pairs
from recurscope.interp.loading import bundled_names, load_model
from recurscope.interp.scan import SCAN_KEY, run_scan, summarise_scan
from recurscope.interp.scan_attribution import attribution_shifts

DTYPES = {"float32": torch.float32, "float64": torch.float64}
NOISE_MULTIPLE = 10     # heads whose |exact J| exceeds this multiple of the noise floor are "clear" of it
NULL_SHARE = 1e-6       # estimates below this share of the largest count as "the swap changes nothing"
FAIL_RATIO = 0.25        # |estimate / exact - 1| above this counts as a failure of the linear estimate
LARGE_SHARE = 0.25       # rows whose |exact shift| is above this share of the model's largest


def _timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def compare(model, pairs, repeats: int) -> dict:
    """Both scans on the same pairs, interleaved; agreement and costs."""
    times = {"exact": [], "attribution": []}
    runs = {"exact": lambda: run_scan(model, pairs).rows,
            "attribution": lambda: attribution_shifts(model, pairs)}
    rows = {}
    for r in range(repeats):
        for method in (("exact", "attribution") if r % 2 == 0 else ("attribution", "exact")):
            rows[method], wall, cpu = _timed(runs[method])
            times[method].append((wall, cpu))
    J = {m: summarise_scan(rows[m]).heads.set_index(["layer", "head"])["J"] for m in rows}
    exact, est = J["exact"], J["attribution"].reindex(J["exact"].index)
    n = len(exact)
    k = min(5, n)
    top_exact, top_est = list(exact.sort_values(ascending=False).index[:k]), list(est.sort_values(ascending=False).index[:k])
    paired = rows["exact"].set_index(list(SCAN_KEY))["shift"].to_frame("exact").join(
        rows["attribution"].set_index(list(SCAN_KEY))["shift"].rename("estimate"))
    large = paired[paired["exact"].abs() > LARGE_SHARE * paired["exact"].abs().max()]
    ratio = large["estimate"] / large["exact"]
    best = {m: min(t, key=lambda wc: wc[1]) for m, t in times.items()}
    curve = along_swap(model, pairs, *top_exact[0])
    return dict(
        curve=curve, slope=float(est[top_exact[0]]),
        J=[[int(l), int(h), float(exact[(l, h)]), float(est[(l, h)])] for l, h in exact.index],
        heads=n, rows=len(paired), spearman=float(spearmanr(exact.to_numpy(), est.to_numpy()).statistic),
        top1=bool(top_exact[0] == top_est[0]), top5=len(set(top_exact) & set(top_est)), top_k=k,
        exact_cpu=best["exact"][1], attribution_cpu=best["attribution"][1],
        exact_wall=min(w for w, _ in times["exact"]), attribution_wall=min(w for w, _ in times["attribution"]),
        large_rows=len(large), failing_rows=int(((ratio - 1).abs() > FAIL_RATIO).sum()),
        ratio_median=float(ratio.median()) if len(ratio) else float("nan"),
        ratio_range=[float(ratio.min()), float(ratio.max())] if len(ratio) else [],
        top_heads=[dict(layer=int(l), head=int(h), exact=float(exact[(l, h)]), estimate=float(est[(l, h)]))
                   for l, h in top_exact],
    )


ALPHAS = (0.25, 0.5, 0.75, 1.0)


def along_swap(model, pairs, layer: int, head: int) -> list[float]:
    """The mean over target pairs of the exact margin shift when the head's state is moved a share alpha of the way
    to the donor's, S = S_rec + alpha (S_don - S_rec), for each alpha in ALPHAS (the linear estimate is alpha x the
    slope at 0): where the curve bends, the first-order estimate misses."""
    from recurscope.interp.interventions import candidate_logits
    from recurscope.interp.scan import _target_rows

    shifts = []
    with torch.no_grad():
        for i in _target_rows(pairs).tolist():
            b, qp = int(pairs.query_start[i]) - 1, int(pairs.query_pos[i]) - int(pairs.query_start[i])
            rec = model.run_prefix(pairs.recipient_ids[i:i + 1, :b + 1])
            don = model.run_prefix(pairs.donor_ids[i:i + 1, :b + 1])
            s_rec, s_don = rec.head_state(layer, head), don.head_state(layer, head)
            suffix = pairs.recipient_ids[i:i + 1, b + 1:]
            cand = pairs.candidate_ids[i:i + 1]
            d, r = int(pairs.donor_answer_index[i]), int(pairs.recipient_answer_index[i])
            margins = []
            for alpha in (0.0,) + ALPHAS:
                cache = rec.clone()
                cache.set_head_state(layer, head, s_rec + alpha * (s_don - s_rec))
                z = candidate_logits(model.run_suffix(suffix, cache)[0][:, qp], cand)
                margins.append(float(z[0, d] - z[0, r]))
            shifts.append([m - margins[0] for m in margins[1:]])
    return torch.tensor(shifts, dtype=torch.float64).mean(0).tolist()


def _pairs(model, args):
    return build_pairs(model.tokenizer, split="dev", n_sources=args.n_sources, pairs_per_source=args.pairs_per_source,
                       n_facts=4, filler_tokens=args.filler, seed=0,
                       max_length=getattr(model.cfg, "max_position_embeddings", None) if model.attention_layers else None)


def _qwen(args):
    from experiments.bench.transformers_run import build_checkpoint, shape_config

    shape = shape_config(args.qwen_config)
    build_checkpoint(Path(args.qwen_ckpt), shape)
    return load_model(args.qwen_ckpt, dtype=DTYPES[args.qwen_dtype]), shape


def above_noise(J) -> tuple[float, int, float]:
    """(noise floor, heads clear of it, their Spearman) from [layer, head, exact J, estimated J] rows. Heads whose
    estimate is negligible (below NULL_SHARE of the largest: their donor and recipient states are equal or nearly,
    e.g. a fast-decaying head holding only tokens the two share) shift the exact margin by rounding alone; the
    largest such |exact J| is the noise floor, and the heads whose |exact J| is NOISE_MULTIPLE times above it are
    ranked against their estimates."""
    J = torch.tensor([row[2:] for row in J], dtype=torch.float64)
    exact, est = J[:, 0], J[:, 1]
    null = est.abs() <= NULL_SHARE * est.abs().max()
    floor = float(exact[null].abs().max()) if bool(null.any()) else 0.0
    clear = exact.abs() > NOISE_MULTIPLE * floor
    rho = float(spearmanr(exact[clear].numpy(), est[clear].numpy()).statistic) if int(clear.sum()) > 2 else float("nan")
    return floor, int(clear.sum()), rho


def table(results: dict) -> str:
    lines = ["| model | heads | pairs x heads | Spearman | noise floor: heads clear, their Spearman | top-1 | top-5 | "
             "exact CPU s | attribution CPU s | CPU ratio | large rows failing (> 25% off) | "
             "estimate / exact on large rows: median [min, max] |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        rr = r["ratio_range"]
        span = f"{r['ratio_median']:.2f} [{rr[0]:.2f}, {rr[1]:.2f}]" if rr else "–"
        floor, n_clear, rho = above_noise(r["J"])
        clear = f"{floor:.1g}: {n_clear}, {rho:.3f}"
        lines.append(f"| {name} | {r['heads']} | {r['rows']} | {r['spearman']:.3f} | {clear} | {'yes' if r['top1'] else 'no'} | "
                     f"{r['top5']}/{r['top_k']} | {r['exact_cpu']:.2f} | {r['attribution_cpu']:.2f} | "
                     f"{r['exact_cpu'] / r['attribution_cpu']:.1f}x | {r['failing_rows']}/{r['large_rows']} | {span} |")
    lines += ["", "| model | exact top heads: L.H exact J / estimated J | top head: mean shift at alpha = "
              + ", ".join(f"{a:g}" for a in ALPHAS) + " (linear: alpha x estimate) |", "|---|---|---|"]
    for name, r in results.items():
        heads = ", ".join(f"L{h['layer']}H{h['head']} {h['exact']:+.3g} / {h['estimate']:+.3g}" for h in r["top_heads"])
        curve = ", ".join(f"{c:+.3g}" for c in r["curve"])
        linear = ", ".join(f"{a * r['slope']:+.3g}" for a in ALPHAS)
        lines.append(f"| {name} | {heads} | {curve} (linear {linear}) |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["all"], help="bundled names, all, or none (only --qwen-ckpt)")
    p.add_argument("--n-sources", type=int, default=8)
    p.add_argument("--pairs-per-source", type=int, default=2)
    p.add_argument("--filler", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--qwen-ckpt", default=None, help="build (or reuse) a random Qwen3.5 of --qwen-config's shape here")
    p.add_argument("--qwen-config", default=None, help="JSON of Qwen3_5TextConfig keys over the 0.8B preset")
    p.add_argument("--qwen-dtype", default="float32", choices=sorted(DTYPES),
                   help="float64 where the random model's swap effects sit near float32's rounding of the margins")
    p.add_argument("--qwen-sources", type=int, default=None, help="sources for the Qwen3.5 model (default --n-sources)")
    p.add_argument("--json", default=None)
    p.add_argument("--report", nargs="+", default=None, help="only print the tables of earlier --json files")
    args = p.parse_args(argv)
    if args.report:
        results = {}
        for path in args.report:
            results.update(json.loads(Path(path).read_text()))
        print(table(results))
        return
    torch.set_num_threads(args.threads)
    names = bundled_names() if args.models == ["all"] else [] if args.models == ["none"] else args.models
    print("uptime before:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    results = {}
    for name in names:
        model = load_model(name)
        results[name] = compare(model, _pairs(model, args), args.repeats)
        print(name, json.dumps(results[name]), flush=True)
    if args.qwen_ckpt:
        model, shape = _qwen(args)
        sources = args.qwen_sources or args.n_sources
        label = (f"random Qwen3.5 ({shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, "
                 f"{shape['linear_num_value_heads']} GDN heads, {args.qwen_dtype})")
        qargs = argparse.Namespace(**{**vars(args), "n_sources": sources})
        results[label] = compare(model, _pairs(model, qargs), args.repeats)
        print(label, json.dumps(results[label]), flush=True)
    print("uptime after:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    print(f"threads {args.threads}, {args.n_sources} dev sources x {args.pairs_per_source} pairs, {args.filler} filler "
          f"tokens, {args.repeats} rounds, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
