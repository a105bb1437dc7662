"""docs/architecture.md describes the code as it is: every module of the package is named on the page, and every
module path the page names exists."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("kernels", "hooks", "interp")


def _modules():
    for pkg in PACKAGES:
        base = ROOT / "recurscope" / pkg
        for path in sorted(base.rglob("*.py")):
            if "__pycache__" in path.parts or "checkpoints" in path.parts:
                continue
            rel = path.relative_to(base).as_posix()
            if path.name == "__init__.py" and not (pkg == "kernels" and rel == "__init__.py"):
                continue   # the package's public contract is documented only for kernels
            yield pkg, rel


def _named(ticks: set, pkg: str, rel: str) -> bool:
    if rel in ticks or f"{pkg}/{rel}" in ticks:
        return True
    # A module of a subpackage may be named by its file or module name once the subpackage's folder is named.
    folder, _, name = rel.rpartition("/")
    return bool(folder) and f"{folder}/" in ticks and (name in ticks or name[:-3] in ticks)


def test_every_module_is_on_the_architecture_page():
    ticks = set(re.findall(r"`([^`]+)`", DOC.read_text()))
    missing = [f"{pkg}/{rel}" for pkg, rel in _modules() if not _named(ticks, pkg, rel)]
    assert missing == [], f"docs/architecture.md does not name these modules: {missing}"


def test_every_module_path_on_the_page_exists():
    text = DOC.read_text()
    named = set(re.findall(r"`((?:[\w]+/)*[\w]+\.py)`", text))
    # Any tail of an existing file's path counts: `models/config.py`, `protocols/run_tiny.py` (under experiments/).
    known = set()
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).parts
        if ".git" not in parts:
            known |= {"/".join(parts[i:]) for i in range(len(parts))}
    stale = sorted(n for n in named if n not in known)
    assert stale == [], f"docs/architecture.md names modules that do not exist: {stale}"
