"""Measured forward-time overhead of QED (full arm) over GDN-2 with the same shapes: the erase vector plus one
recurrence call, and a whole model forward, on the chunked CPU path; the same on the Triton kernel when CUDA is
available. Arms alternate within each repeat (interleaved, order flipped every repeat) and medians are compared.

Usage:  python -m experiments.qed.cost [--repeats 15] [--out DIR] [--smoke]
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Callable, Optional


import pandas as pd
import torch

from recurscope import kernels
from recurscope.kernels.inputs import family_inputs
from experiments.qed import common
from recurscope.interp.data import build_word_tokenizer
from recurscope.interp.models import RecurrentLM

DEFAULT_OUT = common.ROOT / "results" / "qed" / "cost"


def interleaved(fns: dict[str, Callable[[], None]], repeats: int, sync: Callable[[], None] = lambda: None,
                warmup: int = 2) -> dict[str, list[float]]:
    """Seconds per call of each fn, alternating fns inside every repeat and flipping the order each repeat."""
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            fns[n]()
    sync()
    times = {n: [] for n in names}
    for r in range(repeats):
        for n in (names if r % 2 == 0 else names[::-1]):
            sync()
            t = time.perf_counter()
            fns[n]()
            sync()
            times[n].append(time.perf_counter() - t)
    return times


def _row(path, shape, times, repeats):
    base, qed = statistics.median(times["gdn2"]), statistics.median(times["full"])
    return {"path": path, "shape": shape, "repeats": repeats, "gdn2_median_ms": 1e3 * base,
            "qed_median_ms": 1e3 * qed, "overhead_pct": 100 * (qed / base - 1),
            "gdn2_min_ms": 1e3 * min(times["gdn2"]), "qed_min_ms": 1e3 * min(times["full"])}


@torch.no_grad()
def kernel_cost(backend: str, device: str, shape: tuple, repeats: int) -> dict:
    """erase_vector(arm) + kernels.recurrence, gdn2 vs full, same inputs."""
    B, T, H, K, V = shape
    # The project's one input builder; QED's decays are kept in [-0.1, 0] as a trained model's mostly are.
    inp = family_inputs("qed", B, T, H, K, V, dtype=torch.float32, device=device, decay=(0.0, 0.1))
    q, k, x, g, b, lam = inp.q, inp.k, inp.x, inp.g, inp.b, inp.lam
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def step(arm):
        return lambda: kernels.recurrence(q, k, x, g, kernels.erase_vector(k, q, b, lam, arm), backend=backend)
    times = interleaved({"gdn2": step("gdn2"), "full": step("full")}, repeats, sync)
    return _row(f"{backend} kernel ({device})", f"B{B} T{T} H{H} K{K} V{V}", times, repeats)


@torch.no_grad()
def model_cost(backend: str, device: str, batch: int, length: int, repeats: int) -> dict:
    """A whole forward of the suite's architecture, gdn2 vs full with the same shared weights."""
    tok = build_word_tokenizer()
    torch.manual_seed(0)
    base = RecurrentLM(common.model_config("gdn2", tok))
    torch.manual_seed(0)
    qed = RecurrentLM(common.model_config("full", tok))
    qed.load_state_dict(base.state_dict(), strict=False)
    for m in (base, qed):
        m.set_backend(backend)
        m.to(device).eval()
    tokens = torch.randint(0, len(tok), (batch, length), generator=torch.Generator().manual_seed(1)).to(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = interleaved({"gdn2": lambda: base(tokens), "full": lambda: qed(tokens)}, repeats, sync)
    return _row(f"{backend} model forward ({device})", f"suite model, B{batch} T{length}", times, repeats)


def run(repeats: int, out: Path, smoke: bool = False, threads: int = 1) -> pd.DataFrame:
    torch.set_num_threads(threads)
    rows = []
    kshapes = [(1, 64, 2, 32, 64)] if smoke else [(4, 1024, 2, 32, 64), (1, 2048, 8, 128, 128)]
    for shape in kshapes:
        rows.append(kernel_cost("chunked", "cpu", shape, repeats))
    rows.append(model_cost("chunked", "cpu", 1 if smoke else 4, 64 if smoke else 1024, repeats))
    if torch.cuda.is_available():
        for shape in ([(1, 64, 2, 32, 64)] if smoke else [(8, 4096, 8, 128, 128), (16, 2048, 16, 128, 128)]):
            rows.append(kernel_cost("triton", "cuda", shape, repeats))
        rows.append(model_cost("triton", "cuda", 8, 4096, repeats))
    else:
        print("Triton timing skipped: CUDA is not available on this machine (torch.cuda.is_available() is False).")
        rows.append({"path": "triton kernel (cuda)", "shape": "skipped: CUDA not available", "repeats": 0})
    frame = pd.DataFrame(rows)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    frame.to_csv(out / "cost.csv", index=False)
    (out / "cost.md").write_text(common.markdown_table(frame) + f"\ntorch threads: {threads}\n")
    return frame


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1; received {args.repeats}.")
    print(run(3 if args.smoke else args.repeats, args.out, args.smoke, args.threads).to_string(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
