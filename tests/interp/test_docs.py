"""The documentation's hook table is the one the code defines."""
from pathlib import Path

from recurscope.hooks import render_markdown

ROOT = Path(__file__).resolve().parents[2]


def test_hook_table_in_docs_matches_code():
    text = (ROOT / "docs" / "hooks.md").read_text()
    table = text.split("<!-- table:start -->\n", 1)[1].split("\n<!-- table:end -->", 1)[0]
    assert table == render_markdown()
