"""Model-level CPU benchmark with random weights: forward tokens/s of 340M-shaped GLA and Gated DeltaNet, and the time
and peak-memory cost of `run_with_cache(tokens, state_positions=[4 positions])` next to a plain forward.

Shapes (the paper notes' 340M models): 24 layers, hidden 1024, 4 heads, vocab 32000.
GLA as fla's gla-340M: expand_k 0.5, expand_v 1, tied embeddings (state 128x256, 341.7M parameters).
GDN as fla's gdn-340M: head_dim 256, expand_v 1, short convolutions (state 256x256, 399.5M parameters).

Every figure comes from a fresh subprocess. Timing: one process per family runs the plain forward and run_with_cache
alternately (so a change in machine load hits both alike) and reports medians under torch.no_grad. Memory: one
process per (family, variant): after a short warm-up the process's peak-RSS mark is reset (Linux /proc/self/clear_refs,
then VmHWM from /proc/self/status; falls back to resource.getrusage's ru_maxrss where that is not possible) and
the figure is peak RSS during the call minus RSS just before it, with the call's results held. Those processes run
with MALLOC_MMAP_THRESHOLD_ fixed, so glibc hands large blocks back to the OS on free and the peak is not hidden
by memory kept from the warm-up.

Before/after in one run (--baseline DIR): DIR is another checkout of recurscope, e.g. the commit before a change:
`mkdir /tmp/recurscope-before && git archive d7997da | tar -x -C /tmp/recurscope-before`. Timing workers of this
checkout and of DIR (DIR's code imported through PYTHONPATH, this file driving both) alternate, in flipped order
each round, so that machine load hits both alike; each times a full forward of --seq-len tokens and one decoding
step (one token continuing a cache of the prefix, where per-call overheads such as host reads weigh most). The
table gives both medians and their ratio.

Usage:  python -m experiments.bench.models [--families gla gdn] [--repeats 3] [--seq-len 512] [--threads N]
        python -m experiments.bench.models --baseline /tmp/recurscope-before [--rounds 3] [--steps 32] ...
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = {
    "gla": dict(model_type="gla", expand_k=0.5, expand_v=1.0, tie_word_embeddings=True),
    "gdn": dict(model_type="gated_deltanet", head_dim=256, expand_v=1.0, use_short_conv=True),
}
SHAPE = dict(vocab_size=32000, hidden_size=1024, num_hidden_layers=24, num_heads=4)
VARIANTS = ("forward", "run_with_cache")


def state_positions(T: int) -> list[int]:
    """Four positions: the last token of each quarter of the sequence."""
    return [T // 4 - 1, T // 2 - 1, 3 * T // 4 - 1, T - 1]


def build(family: str):
    import torch

    from recurscope.interp.models import ModelConfig, RecurrentLM

    torch.manual_seed(0)
    return RecurrentLM(ModelConfig.from_dict({**SHAPE, **CONFIGS[family]})).eval()


def call(model, tokens, variant: str):
    """Runs one variant; returns what it produced (kept alive by the caller) and the bytes of cached tensors."""
    if variant == "forward":
        return model(tokens), 0
    logits, cache = model.run_with_cache(tokens, state_positions=state_positions(tokens.shape[1]))
    return (logits, cache), sum(t.nelement() * t.element_size() for t in cache.values())


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")   # resets the peak-RSS mark (VmHWM), Linux >= 4.0
        return True
    except OSError:
        return False


# ---- workers (run in fresh subprocesses) -----------------------------------------------------------------
def time_worker(family: str, T: int, repeats: int) -> dict:
    import torch

    model = build(family)
    n_params = sum(p.numel() for p in model.parameters())
    tokens = torch.randint(0, SHAPE["vocab_size"], (1, T), generator=torch.Generator().manual_seed(1))
    load_before = os.getloadavg()
    times = {v: [] for v in VARIANTS}
    with torch.no_grad():
        for v in VARIANTS:                     # warm-up on a short input (lazy initialisation, thread pools)
            call(model, tokens[:, :64], v)
        for _ in range(repeats):
            for v in VARIANTS:
                t0 = time.perf_counter()
                out = call(model, tokens, v)
                times[v].append(time.perf_counter() - t0)
                del out
    return dict(family=family, params=n_params, state=list(model.cfg.state_shape()), T=T, times=times,
                threads=torch.get_num_threads(), load=[load_before, os.getloadavg()])


def memory_worker(family: str, variant: str, T: int) -> dict:
    import torch

    model = build(family)
    tokens = torch.randint(0, SHAPE["vocab_size"], (1, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        call(model, tokens[:, :64], variant)
        gc.collect()
        method = "VmHWM after clear_refs" if _reset_peak() else "ru_maxrss (not reset: includes model build)"
        before_kib = _status_kib("VmRSS")
        kept, cached_bytes = call(model, tokens, variant)
        if method.startswith("VmHWM"):
            peak_kib = _status_kib("VmHWM")
        else:
            peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    del kept
    return dict(family=family, variant=variant, method=method, rss_before=before_kib * 1024,
                peak=peak_kib * 1024, peak_delta=(peak_kib - before_kib) * 1024, cached_bytes=cached_bytes)


def compare_worker(family: str, T: int, repeats: int, steps: int) -> dict:
    """Medians of a full forward and of one decoding step, with whichever recurscope this process imports."""
    import torch

    import recurscope

    model = build(family)
    tokens = torch.randint(0, SHAPE["vocab_size"], (1, T + steps), generator=torch.Generator().manual_seed(1))
    prefix = tokens[:, :T]
    with torch.no_grad():
        model(prefix[:, :64])                  # warm-up (lazy initialisation, thread pools)
        forward = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(prefix)
            forward.append(time.perf_counter() - t0)
        _, cache = model(prefix, use_cache=True)
        step = []
        for i in range(steps):
            t0 = time.perf_counter()
            _, cache = model(tokens[:, T + i:T + i + 1], cache=cache, use_cache=True)
            step.append(time.perf_counter() - t0)
    return dict(family=family, code=os.path.dirname(recurscope.__file__), forward=statistics.median(forward),
                step=statistics.median(step[1:] if steps > 1 else step), threads=torch.get_num_threads())


def compare(args) -> None:
    """Before/after table: this checkout against --baseline, alternating worker processes."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    base = os.path.abspath(args.baseline)
    if not all(os.path.exists(os.path.join(base, p)) for p in ("recurscope/__init__.py", "interp", "pyproject.toml")):
        raise SystemExit(f"--baseline {base} is not a recurscope checkout (needs recurscope/__init__.py, interp/ and "
                         f"pyproject.toml); make one with `mkdir {base} && git archive <commit> | tar -x -C {base}`")
    common = ["--seq-len", str(args.seq_len), "--repeats", str(args.repeats), "--steps", str(args.steps)]
    if args.threads is not None:
        common += ["--threads", str(args.threads)]
    print(f"before: {base}; after: {here}; B=1, T={args.seq_len}, {args.rounds} rounds x {args.repeats} forwards and "
          f"{args.steps} decoding steps per process, {os.cpu_count()} CPUs, load average {os.getloadavg()}",
          flush=True)
    rows = []
    for family in args.families:
        got = {"before": [], "after": []}
        for r in range(args.rounds):
            order = [("after", here), ("before", base)]
            for name, root in (order if r % 2 == 0 else order[::-1]):
                out = _run_worker(["compare", family, *common], {"PYTHONPATH": root})
                if os.path.realpath(out["code"]) != os.path.realpath(root):
                    raise RuntimeError(f"the {name} worker imported recurscope from {out['code']}, not {root}")
                got[name].append(out)
        rows.append((family, got))
        print(f"  {family}: done, load average {os.getloadavg()[0]:.2f}", flush=True)
    print()
    print("| model | threads | forward s before | forward s after | after/before | step ms before | step ms after "
          "| after/before |")
    print("|---|---|---|---|---|---|---|---|")
    for family, got in rows:
        med = {k: {v: statistics.median(o[v] for o in got[k]) for v in ("forward", "step")} for k in got}
        print(f"| {family} | {got['after'][0]['threads']} | {med['before']['forward']:.3f} "
              f"| {med['after']['forward']:.3f} | {med['after']['forward'] / med['before']['forward']:.3f} "
              f"| {1e3 * med['before']['step']:.2f} "
              f"| {1e3 * med['after']['step']:.2f} | {med['after']['step'] / med['before']['step']:.3f} |")
    print(f"(medians over {args.rounds} processes each; load average at the end {os.getloadavg()})")


def _run_worker(args: list[str], env_extra: dict | None = None) -> dict:
    env = dict(os.environ, **(env_extra or {}))
    res = subprocess.run([sys.executable, "-m", "experiments.bench.models", "--worker", *args], capture_output=True, cwd=ROOT,
                         text=True, env=env)
    if res.returncode != 0:
        raise RuntimeError(f"worker {args} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


# ---- driver ----------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=None, help="torch threads in the workers (default: torch's)")
    parser.add_argument("--baseline", default=None, help="another checkout to time against (before/after table)")
    parser.add_argument("--rounds", type=int, default=3, help="with --baseline: worker processes per side")
    parser.add_argument("--steps", type=int, default=32, help="with --baseline: timed decoding steps per process")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.seq_len < 64 or args.seq_len % 4:
        parser.error(f"--seq-len must be a multiple of 4 and at least 64, got {args.seq_len}")
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")

    if args.worker:
        kind, family, *rest = args.worker
        if kind == "compare":
            out = compare_worker(family, args.seq_len, args.repeats, args.steps)
        elif kind == "time":
            out = time_worker(family, args.seq_len, args.repeats)
        else:
            out = memory_worker(family, rest[0], args.seq_len)
        print(json.dumps(out))
        return
    if args.baseline:
        compare(args)
        return

    common = ["--seq-len", str(args.seq_len), "--repeats", str(args.repeats)]
    if args.threads is not None:
        common += ["--threads", str(args.threads)]
    mmap_env = {"MALLOC_MMAP_THRESHOLD_": "131072"}
    print(f"B=1, T={args.seq_len}, state_positions={state_positions(args.seq_len)}, repeats={args.repeats}, "
          f"{os.cpu_count()} CPUs, load average at start {os.getloadavg()[0]:.2f}", flush=True)
    rows = []
    for family in args.families:
        timing = _run_worker(["time", family, *common])
        memory = {v: _run_worker(["mem", family, v, *common], mmap_env) for v in VARIANTS}
        rows.append((family, timing, memory))
        print(f"  {family}: done, load average {os.getloadavg()[0]:.2f}", flush=True)

    mib = 2 ** 20
    print()
    print("| model | params | state K x V | threads | forward s (median) | tokens/s | run_with_cache s | time ratio "
          "| fwd peak dMiB | rwc peak dMiB | cached MiB | rwc / (fwd + cached) | load (1-min, start-end) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for family, timing, memory in rows:
        t_fwd = statistics.median(timing["times"]["forward"])
        t_rwc = statistics.median(timing["times"]["run_with_cache"])
        fwd, rwc = memory["forward"], memory["run_with_cache"]
        bound = fwd["peak_delta"] + rwc["cached_bytes"]
        K, V = timing["state"]
        print(f"| {family} | {timing['params'] / 1e6:.1f}M | {K}x{V} | {timing['threads']} | {t_fwd:.2f} "
              f"| {timing['T'] / t_fwd:.1f} | {t_rwc:.2f} | {t_rwc / t_fwd:.2f} | {fwd['peak_delta'] / mib:.0f} "
              f"| {rwc['peak_delta'] / mib:.0f} | {rwc['cached_bytes'] / mib:.0f} | {rwc['peak_delta'] / bound:.2f} "
              f"| {timing['load'][0][0]:.1f}-{timing['load'][1][0]:.1f} |")
    print()
    for family, timing, memory in rows:
        fwd, rwc = memory["forward"], memory["run_with_cache"]
        total_ratio = rwc["peak"] / (fwd["peak"] + rwc["cached_bytes"])
        print(f"{family}: all forward times {[round(t, 2) for t in timing['times']['forward']]}, run_with_cache "
              f"{[round(t, 2) for t in timing['times']['run_with_cache']]}; whole-process peak RSS "
              f"forward {fwd['peak'] / mib:.0f} MiB, run_with_cache {rwc['peak'] / mib:.0f} MiB "
              f"(ratio to forward + cached: {total_ratio:.2f}); memory measured by {rwc['method']}")
    print("Target: run_with_cache with states within 1.5x of (plain forward + cached tensors), on the peak increase.")


if __name__ == "__main__":
    main()
