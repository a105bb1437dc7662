"""Executes the notebooks in place, so that they are committed with their outputs (plots visible on GitHub).

    python -m experiments.run_notebooks                  # every notebook in notebooks/
    python -m experiments.run_notebooks 01_quickstart    # one or more, by name

Each notebook runs at the small sizes written in it, in a fresh kernel whose working directory is a scratch folder
and whose path has the repository root first (so `recurscope` and `experiments` are this checkout's). Outputs are
kept; the kernel's timing metadata is dropped so that a rerun changes only what the code prints. 03_qed reads the QED
checkpoint and seed-study report that QED_CHECKPOINT and QED_SEEDS_REPORT name, and trains a smoke checkpoint itself
when there is none.
The tests execute every notebook too, without comparing outputs (tests/notebooks/test_notebooks.py).
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"


def execute(path: Path, timeout: int = 1200) -> float:
    """Runs `path` top to bottom and writes it back with its outputs; returns the seconds it took."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    env_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    start = time.time()
    previous = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = env_path   # the kernel inherits the environment
    try:
        with tempfile.TemporaryDirectory(prefix="notebook-") as scratch:
            NotebookClient(nb, timeout=timeout, kernel_name="python3",
                           resources={"metadata": {"path": scratch}}).execute()
    finally:
        if previous is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = previous
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    if errors:
        raise RuntimeError(f"{path.name}: a cell raised {errors[0].get('ename')}: {errors[0].get('evalue')}")
    for cell in nb.cells:
        cell.get("metadata", {}).pop("execution", None)
    nb.metadata.pop("widgets", None)
    nbformat.write(nb, path)
    return time.time() - start


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="notebook names (default: every notebook in notebooks/)")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per cell")
    args = parser.parse_args(argv)
    paths = sorted(NOTEBOOKS.glob("*.ipynb"))
    if args.names:
        wanted = {n.removesuffix(".ipynb") for n in args.names}
        unknown = wanted - {p.stem for p in paths}
        if unknown:
            parser.error(f"no notebook named {sorted(unknown)}; the notebooks are {[p.stem for p in paths]}")
        paths = [p for p in paths if p.stem in wanted]
    for path in paths:
        seconds = execute(path, args.timeout)
        print(f"{path.name}: executed with outputs in {seconds:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
