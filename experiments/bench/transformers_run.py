"""What `recurscope run` costs on a transformers checkpoint, measured on a random-weight model of the real shape.

No checkpoint is downloaded: the script builds transformers' own Qwen3_5ForCausalLM from a text config (the preset
below is Qwen3.5-0.8B's shape; --config JSON overrides any key), saves it in bfloat16 with the project's word
tokenizer to --ckpt (reused when its config matches), and then, for each --dtypes entry in a fresh 1-thread child
process (so peak memory is that dtype's alone), loads it with recurscope's load_model and times:

    forward      one recipient of a main-job pair (K=4 facts, 3 presentations, 512 filler tokens), logits at the query
    scan unit    run_scan on one pair, every recurrent head (prefix pass of recipient and donor, clean suffix, the
                 patched suffixes in --batch-size rows), as `recurscope scan` does per pair
    arm          confirm_arm of each --arms entry on --confirm-pairs held-out pairs, per pair

--baseline-scan FILE also times run_scan from another version of interp/scan.py (e.g. `git show
<commit>:interp/scan.py > /tmp/old_scan.py`) on the same pair right after the scan unit, in the same process, and
checks that both give the same rows (reported as "scan unit, baseline" and the largest shift difference).

Each time is given as wall seconds and as the process's CPU seconds: at one thread the CPU seconds are what the step
takes on an idle core, the wall seconds what it took beside whatever else ran (the load average is printed beside).
Peak resident memory is the child's ru_maxrss after each step.

The main job is then extrapolated from the CPU seconds: n_dev x pairs_per_source scan units plus n_heldout x
pairs_per_source pairs x 14 arms, each arm costed as the mean of the arms measured (an assumption: the write arms
rerun the whole sequence, the query-time arms a prefix and a suffix). A GPU time is an ESTIMATE by FLOP scaling, not a
measurement: the job's CPU seconds over the forward's CPU seconds give it in forward-equivalents, times the forward's
FLOPs (2 x the matmul parameters per token, the causal attention scores, the query-position unembedding), over
--gpu-tflops x --gpu-utilisation.

Preset (Qwen3.5-0.8B's text model, from the released config.json as quoted by several public repositories; the
checkpoint itself was not read): 24 layers, 3 Gated DeltaNet : 1 gated attention (layer_types), hidden 1024, MLP
3584, GDN 16 key and 16 value heads of 128 x 128, conv 4, attention 8 query heads and 2 KV heads of 256 with the
output gate, vocabulary 248320, tied embeddings, RoPE theta 1e7 on a quarter of each head.

Usage:  python -m experiments.bench.transformers_run --ckpt /work/results/qwen08/ckpt [--config shape.json]
            [--dtypes float32 bfloat16] [--confirm-pairs 2] [--arms state_swap write_block | all] [--batch-size 16]
            [--baseline-scan FILE]
            [--gpu-tflops 989] [--gpu-utilisation 0.2] [--json results.json]
        python -m experiments.bench.transformers_run --report float32.json bfloat16.json
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

PRESET = dict(
    vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6,
    linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, num_attention_heads=8, num_key_value_heads=2, head_dim=256, attn_output_gate=True,
    tie_word_embeddings=True, max_position_embeddings=262144, rms_norm_eps=1e-6,
    rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25),
)
# The main job's defaults (interp/cli.py): dev and held-out sources, pairs per source, confirmation arms.
MAIN_JOB = dict(n_dev=16, n_heldout=128, pairs_per_source=4)
PAIR_LAYOUT = dict(n_facts=4, presentations=3, filler_tokens=512)


def shape_config(path) -> dict:
    shape = dict(PRESET)
    if path:
        extra = json.loads(Path(path).read_text())
        if not isinstance(extra, dict):
            raise SystemExit(f"--config {path}: expected a JSON object of Qwen3_5TextConfig keys, got {type(extra).__name__}")
        shape.update(extra)
    return shape


def build_checkpoint(ckpt: Path, shape: dict) -> None:
    """Random weights in transformers' own classes, saved in bfloat16 (as the released checkpoints are)."""
    import torch
    import transformers as tf

    from recurscope.interp.data import build_word_tokenizer, save_word_tokenizer

    stamp = ckpt / "bench_shape.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == shape:
        print(f"reusing {ckpt}")
        return
    tok = build_word_tokenizer()
    if len(tok) > shape["vocab_size"]:
        raise SystemExit(f"vocab_size {shape['vocab_size']} is below the word tokenizer's {len(tok)} ids; raise it")
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**shape)).to(torch.bfloat16)
    ckpt.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(ckpt)
    save_word_tokenizer(tok, ckpt)
    stamp.write_text(json.dumps(shape))
    n = sum(p.numel() for p in model.parameters())
    print(f"built {ckpt}: {n / 1e6:.0f}M parameters in {time.perf_counter() - t0:.0f} s")


def rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20   # ru_maxrss is KiB on Linux


class Clock:
    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


def forward_flops(model, T: int) -> float:
    """FLOPs of one forward of T tokens with logits at one position: 2 x every nn.Linear weight per token (the
    unembedding once), plus the causal attention scores and mixing (2 x T^2 x heads x head_dim per attention layer).
    The recurrence (O(T K V) per head) and the short convolution are left out: under 3% here."""
    import torch

    hf = model.hf
    linear = sum(m.weight.numel() for n, m in hf.named_modules()
                 if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head"))
    cfg = hf.config
    attn = 2.0 * T * T * cfg.num_attention_heads * cfg.head_dim * len(model.attention_layers)
    return 2.0 * linear * T + attn + 2.0 * cfg.vocab_size * cfg.hidden_size


def measure(args) -> dict:
    """One dtype, in this (child) process; each step's figures go to stderr as it finishes."""
    import torch

    def done(step, c):
        print(f"{args.measure} {step}: {c.wall:.1f} s wall, {c.cpu:.1f} s CPU, peak {rss_gib():.2f} GiB, "
              f"load {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)

    torch.set_num_threads(1)
    from recurscope.interp.confirm import confirm_arm
    from recurscope.interp.data import build_pairs
    from recurscope.interp.loading import load_model
    from recurscope.interp.scan import all_heads, run_scan

    out = {"dtype": args.measure, "rss_start_gib": rss_gib(), "load_before": os.getloadavg()[0]}
    with Clock() as c:
        model = load_model(args.ckpt, dtype=getattr(torch, args.measure))
    done("load_model", c)
    out.update(load_wall=c.wall, load_cpu=c.cpu, rss_loaded_gib=rss_gib(), heads=len(all_heads(model)))
    dev = build_pairs(model.tokenizer, split="dev", n_sources=1, pairs_per_source=MAIN_JOB["pairs_per_source"],
                      **PAIR_LAYOUT)
    scan_pair = dev.select([int(torch.nonzero(dev.is_target)[0, 0])])
    T = int(scan_pair.recipient_ids.shape[1])
    out["tokens"] = T
    with torch.no_grad():
        model(scan_pair.recipient_ids[:, :32], logit_positions=torch.zeros(1, dtype=torch.long))   # warm-up
        with Clock() as c:
            model(scan_pair.recipient_ids, logit_positions=scan_pair.query_pos)
    done(f"forward of {T} tokens", c)
    out.update(forward_wall=c.wall, forward_cpu=c.cpu, rss_forward_gib=rss_gib(), forward_flops=forward_flops(model, T))
    with Clock() as c:
        rows = run_scan(model, scan_pair, batch_size=args.batch_size).rows
    done("scan unit", c)
    out.update(scan_unit_wall=c.wall, scan_unit_cpu=c.cpu, rss_scan_gib=rss_gib())
    if args.baseline_scan:
        import importlib.util

        spec = importlib.util.spec_from_file_location("baseline_scan", args.baseline_scan)
        baseline = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = baseline   # dataclasses look their module up there
        spec.loader.exec_module(baseline)
        with Clock() as c:
            old = baseline.run_scan(model, scan_pair, batch_size=args.batch_size).rows
        done("scan unit, baseline", c)
        key = ["source", "pair", "layer", "head"]
        diff = (rows.set_index(key)["shift"] - old.set_index(key)["shift"]).abs().max()
        out.update(baseline_wall=c.wall, baseline_cpu=c.cpu, baseline_max_shift_diff=float(diff))
    held = build_pairs(model.tokenizer, split="heldout", n_sources=1, pairs_per_source=MAIN_JOB["pairs_per_source"],
                       **PAIR_LAYOUT)
    held = held.select(range(min(args.confirm_pairs, len(held))))
    head = all_heads(model)[0]
    out["arms"] = {}
    for arm in args.arms:
        with Clock() as c:
            confirm_arm(model, held, [head], arm, batch_size=args.batch_size)
        done(f"arm {arm} on {len(held)} pairs", c)
        out["arms"][arm] = {"wall_per_pair": c.wall / len(held), "cpu_per_pair": c.cpu / len(held)}
    out.update(confirm_pairs=len(held), rss_peak_gib=rss_gib(), load_after=os.getloadavg()[0])
    return out


def report(results: list[dict], args) -> str:
    from recurscope.interp.confirm import ARMS

    lines = [f"{'step':<34}" + "".join(f"{r['dtype']:>26}" for r in results),
             f"{'':<34}" + "".join(f"{'wall s / cpu s':>26}" for _ in results)]

    def row(label, wall, cpu):
        lines.append(f"{label:<34}" + "".join(f"{r[wall]:>15.1f} / {r[cpu]:>7.1f}" for r in results))

    row("load_model", "load_wall", "load_cpu")
    row(f"forward, {results[0]['tokens']} tokens", "forward_wall", "forward_cpu")
    row(f"scan unit, 1 pair x {results[0]['heads']} heads", "scan_unit_wall", "scan_unit_cpu")
    if all("baseline_cpu" in r for r in results):
        row("scan unit, baseline scan", "baseline_wall", "baseline_cpu")
        lines.append(f"{'scan unit / forward (CPU s)':<34}" + "".join(
            f"{r['scan_unit_cpu'] / r['forward_cpu']:>15.2f} / {r['baseline_cpu'] / r['forward_cpu']:>7.2f}"
            for r in results) + "   (this scan / baseline)")
        lines.append(f"{'baseline rows: max |shift diff|':<34}" + "".join(
            f"{r['baseline_max_shift_diff']:>26.1e}" for r in results))
    for arm in args.arms:
        lines.append(f"{'arm ' + arm + ', per pair':<34}" + "".join(
            f"{r['arms'][arm]['wall_per_pair']:>15.1f} / {r['arms'][arm]['cpu_per_pair']:>7.1f}" for r in results))
    for key, label in (("rss_start_gib", "resident after imports (GiB)"), ("rss_loaded_gib", "peak resident, loaded"),
                       ("rss_forward_gib", "peak resident, after forward"), ("rss_peak_gib", "peak resident, all steps")):
        lines.append(f"{label:<34}" + "".join(f"{r[key]:>26.2f}" for r in results))
    lines.append(f"{'load average before / after':<34}" + "".join(
        f"{r['load_before']:>19.2f} / {r['load_after']:>4.2f}" for r in results))
    units = MAIN_JOB["n_dev"] * MAIN_JOB["pairs_per_source"]
    arm_pairs = MAIN_JOB["n_heldout"] * MAIN_JOB["pairs_per_source"] * len(ARMS)
    lines.append(f"\nmain job: {units} scan units + {arm_pairs} (pair, arm) runs ({len(ARMS)} arms)")
    for r in results:
        every_arm = set(r["arms"]) == set(ARMS)
        # CPU seconds of one pair through all arms; arms not measured are costed as the mean of those that were
        arms_cpu = sum(a["cpu_per_pair"] for a in r["arms"].values()) * (1 if every_arm else len(ARMS) / len(r["arms"]))
        lines.append(f"  {r['dtype']}: " + ("every arm measured" if every_arm else
                                             f"arms costed as the mean of {', '.join(r['arms'])}"))
        arm_cpu = arms_cpu / len(ARMS)
        scan_h, conf_h = units * r["scan_unit_cpu"] / 3600, arm_pairs * arm_cpu / 3600
        fwd_equiv = (units * r["scan_unit_cpu"] + arm_pairs * arm_cpu) / r["forward_cpu"]
        flops = fwd_equiv * r["forward_flops"]
        gpu_h = flops / (args.gpu_tflops * 1e12 * args.gpu_utilisation) / 3600
        lines.append(f"  {r['dtype']}: one idle CPU core (1 thread): scan {scan_h:.1f} h + confirmation {conf_h:.1f} h "
                     f"= {scan_h + conf_h:.1f} h; {fwd_equiv:.0f} forward-equivalents, {flops / 1e15:.0f} PFLOP; "
                     f"GPU ESTIMATE by FLOP scaling (not measured) at {args.gpu_tflops:g} TFLOP/s x "
                     f"{args.gpu_utilisation:g}: {gpu_h * 60:.1f} min of arithmetic, a floor (launches, host work and "
                     f"the short query suffixes come on top)")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", default=None, help="where the random-weight checkpoint is built (outside the repository)")
    p.add_argument("--config", default=None, help="JSON object of Qwen3_5TextConfig keys overriding the preset")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--confirm-pairs", type=int, default=2, help="held-out pairs each sampled arm runs on")
    p.add_argument("--arms", nargs="+", default=["state_swap", "write_block"],
                   help="confirmation arms to time (names from interventions.REGISTRY), or `all`; without a scan table the "
                        "control-head arms take the documented fallback control head")
    p.add_argument("--batch-size", type=int, default=16, help="as `recurscope run --batch-size` (default 16)")
    p.add_argument("--gpu-tflops", type=float, default=989.0, help="GPU peak for the estimate (H100 SXM dense bf16)")
    p.add_argument("--gpu-utilisation", type=float, default=0.2, help="assumed fraction of that peak")
    p.add_argument("--baseline-scan", default=None, metavar="FILE",
                   help="also time run_scan from this copy of interp/scan.py (another version) on the same pair")
    p.add_argument("--json", default=None, help="also write the measurements here")
    p.add_argument("--report", nargs="+", default=None, metavar="JSON",
                   help="print the table from measurement files that --json wrote (e.g. one per dtype), measure nothing")
    p.add_argument("--measure", default=None, help=argparse.SUPPRESS)   # internal: the child process's dtype
    args = p.parse_args(argv)
    if args.report:
        results = [r for path in args.report for r in json.loads(Path(path).read_text())]
        args.arms = list(results[0]["arms"])
        print(report(results, args))
        return 0
    if not args.ckpt:
        raise SystemExit("--ckpt DIR is needed: where the random-weight checkpoint is built or reused")
    if args.confirm_pairs < 1 or args.batch_size < 1:
        raise SystemExit("--confirm-pairs and --batch-size must be positive integers")
    if args.measure:
        print("RESULT " + json.dumps(measure(args)))
        return 0
    from recurscope.interp.interventions.registry import named_intervention

    if args.arms == ["all"]:
        from recurscope.interp.confirm import ARMS

        args.arms = list(ARMS)
    for arm in args.arms:
        named_intervention(arm)   # an unknown name fails here, before the build
    ckpt = Path(args.ckpt)
    build_checkpoint(ckpt, shape_config(args.config))
    results = []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    for dtype in args.dtypes:
        cmd = [sys.executable, "-m", "experiments.bench.transformers_run", "--ckpt", str(ckpt), "--measure", dtype,
               "--confirm-pairs", str(args.confirm_pairs), "--batch-size", str(args.batch_size), "--arms", *args.arms]
        if args.baseline_scan:
            cmd += ["--baseline-scan", args.baseline_scan]
        proc = subprocess.run(cmd, env=env, cwd=Path(__file__).resolve().parents[2], stdout=subprocess.PIPE, text=True)   # the child's progress: stderr
        if proc.returncode != 0:
            raise SystemExit(f"{dtype} measurement failed (its traceback is above)")
        results.append(json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))[7:]))
        print(f"{dtype}: done", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(report(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
