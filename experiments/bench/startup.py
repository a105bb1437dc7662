"""Start-up cost: `import torch`, `import recurscope`, `import recurscope.kernels`, `recurscope --help`, a protocol
verb's `--help` (`recurscope selectivity --help`) and a Ray worker's start, each in a fresh interpreter, interleaved
and order-rotated, medians over repeats, printed side by side as ratios to `import torch` (targets: `import
recurscope` <= 1.3x, each `--help` <= 0.5x).

Each contender is a subprocess of this checkout's code (PYTHONPATH = the repository root). CPU time is the child's
user + system time (resource.getrusage), which other jobs on a shared machine inflate much less than wall time;
both are printed. `python -c pass` is shown for scale (the interpreter alone), and the first use of the facade
(loading a bundled model: TransformerLens, which the models subclass, comes in here). The worker row is what a Ray actor
of `recurscope scan --ray` does with our code: unpickle its class and arguments (a ModelSpec and the pairs), load the
model, and run one (source, head block) unit; `--no-worker` leaves it out.

--root times another checkout's code (e.g. the main branch's, for a before/after).

Usage:  python -m experiments.bench.startup [--repeats 7] [--clock cpu|wall] [--no-worker] [--root DIR]
"""
from __future__ import annotations

import argparse
import os
import pickle
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TARGETS = {"import recurscope": 1.3, "recurscope --help": 0.5, "recurscope selectivity --help": 0.5}

WORKER_CODE = """
import pickle, sys
cls, spec, pairs, unit = pickle.loads(open(sys.argv[1], "rb").read())
cls(spec, pairs).scan(unit, 8, 4)
"""


def contenders(payload: str | None) -> dict[str, list[str]]:
    py = sys.executable
    out = {
        "python -c pass": [py, "-c", "pass"],
        "import torch": [py, "-c", "import torch"],
        "import recurscope": [py, "-c", "import recurscope"],
        "import recurscope.kernels": [py, "-c", "import recurscope.kernels"],
        "recurscope --help": [py, "-m", "recurscope.interp.cli", "--help"],
        "recurscope selectivity --help": [py, "-m", "recurscope.interp.cli", "selectivity", "--help"],
        "first use: rs.load_model('tiny-gla')": [py, "-c", "import recurscope as rs; rs.load_model('tiny-gla')"],
    }
    if payload is not None:
        out["Ray worker: load tiny-gla, one scan unit"] = [py, "-c", WORKER_CODE, payload]
    return out


def worker_payload(directory: str) -> str:
    """The actor class and what run_scan_ray hands each actor (ModelSpec, pairs) and one unit, pickled as Ray
    would (the class by reference)."""
    from recurscope.interp.data import build_pairs
    from recurscope.interp.distributed import ModelSpec, UnitWorker, scan_units
    from recurscope.interp.loading import load_model

    model = load_model("tiny-gla")
    pairs = build_pairs(model.tokenizer, split="dev", n_sources=2, filler_tokens=16, presentations=2)
    unit = scan_units(pairs, [(0, 0), (0, 1)], workers=1)[0]
    path = os.path.join(directory, "worker.pkl")
    with open(path, "wb") as f:
        pickle.dump((UnitWorker, ModelSpec("tiny-gla"), pairs, unit), f)
    return path


def run_once(argv: list[str], env: dict, root: Path) -> tuple[float, float]:
    """(wall s, CPU s) of one fresh interpreter running argv in root."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    proc = subprocess.run(argv, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          timeout=600)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:3])} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "uptime unavailable"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu", help="the clock of the ratio column")
    p.add_argument("--no-worker", action="store_true", help="leave out the Ray worker row")
    p.add_argument("--root", type=Path, default=ROOT, help="the checkout whose code to time (default: this one)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    root = args.root.resolve()
    if not (root / "recurscope" / "__init__.py").is_file():
        p.error(f"--root {args.root}: no recurscope/__init__.py there; pass a checkout of this repository")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "")}
    print(f"code: {root}")
    print("before:", uptime())
    with tempfile.TemporaryDirectory() as tmp:
        payload = None if args.no_worker else worker_payload(tmp)
        commands = contenders(payload)
        names = list(commands)
        for name in names:     # one untimed run each: the first run after an edit also writes .pyc files
            run_once(commands[name], env, root)
        walls: dict[str, list[float]] = {n: [] for n in names}
        cpus: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.repeats):
            for name in names[r % len(names):] + names[:r % len(names)]:
                wall, cpu = run_once(commands[name], env, root)
                walls[name].append(wall)
                cpus[name].append(cpu)
    print("after: ", uptime())
    wall = {n: statistics.median(v) for n, v in walls.items()}
    cpu = {n: statistics.median(v) for n, v in cpus.items()}
    ref = (cpu if args.clock == "cpu" else wall)["import torch"]
    print(f"\nmedians of {args.repeats} interleaved runs, fresh interpreter each; ratio: {args.clock} time / "
          f"`import torch`'s")
    print(f"| {'command':<42} | {'wall s':>7} | {'CPU s':>6} | {'ratio':>6} | target |")
    print(f"|{'-' * 44}|{'-' * 9}|{'-' * 8}|{'-' * 8}|--------|")
    for name in names:
        ratio = (cpu if args.clock == "cpu" else wall)[name] / ref
        target = TARGETS.get(name)
        mark = "" if target is None else f"<= {target}x " + ("met" if ratio <= target else "MISSED")
        print(f"| {name:<42} | {wall[name]:>7.2f} | {cpu[name]:>6.2f} | {ratio:>5.2f}x | {mark} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
