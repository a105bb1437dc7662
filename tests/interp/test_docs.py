"""The documentation's hook table is the one the code defines."""
from pathlib import Path

from recurscope.hooks import render_markdown

ROOT = Path(__file__).resolve().parents[2]


def test_hook_table_in_docs_matches_code():
    text = (ROOT / "docs" / "hooks.md").read_text()
    table = text.split("<!-- table:start -->\n", 1)[1].split("\n<!-- table:end -->", 1)[0]
    assert table == render_markdown()


def test_every_docs_page_the_code_names_exists():
    # A docstring that sends the reader to docs/<page>.md must find the page (docs/kernels.md was once missing).
    import re

    named = {}
    for folder in ("kernels", "hooks", "interp", "experiments", "recurscope"):
        for path in (ROOT / folder).rglob("*.py"):
            for page in re.findall(r"docs/[\w.-]+\.md", path.read_text()):
                named.setdefault(page, path.relative_to(ROOT))
    assert "docs/kernels.md" in named
    missing = {page: str(path) for page, path in named.items() if not (ROOT / page).is_file()}
    assert missing == {}
