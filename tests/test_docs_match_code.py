"""Docs that describe the code say what it does: the prompt builders' docstrings (text tokenised once, not segments
encoded apart) and the README's place for dropped words (the step manifests under --out, which a run writes)."""
import json
import re
from pathlib import Path

from recurscope.interp.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_prompt_builders_say_prompts_are_tokenised_once():
    from recurscope.interp.data import niah, recall, tokenizer

    for module in (recall, niah, tokenizer):
        doc = " ".join(module.__doc__.split())
        assert "separately encoded" not in doc and "assembled at the token level" not in doc, module.__name__
    assert "written as text and tokenised once" in " ".join(recall.__doc__.split())


def test_the_readme_names_where_a_run_writes_dropped_words(tmp_path, capsys):
    readme = " ".join((ROOT / "README.md").read_text().split())
    paragraph = readme.split("**Dropped words.**", 1)[1].split("**Real text filler.**", 1)[0]
    assert "`scan/manifest.json`" in paragraph and "`extra.dropped_keys`" in paragraph
    out = tmp_path / "run"
    assert main(["run", "tiny-gla", "--keys", "Alice,Bob,Carol,Zyzzyvaquux", "--n-facts", "2", "--presentations", "2",
                 "--filler", "12", "--n-dev", "1", "--n-heldout", "1", "--batch-size", "8", "--out", str(out)]) == 0
    manifest = json.loads((out / "scan" / "manifest.json").read_text())
    assert "Zyzzyvaquux" in manifest["extra"]["dropped_keys"]
    assert not (out / "manifest.json").exists()    # `run` writes no top-level manifest, as the README says
    if (out / "confirm" / "manifest.json").exists():
        assert "Zyzzyvaquux" in json.loads((out / "confirm" / "manifest.json").read_text())["extra"]["dropped_keys"]
    assert re.search(r"words:.*Zyzzyvaquux", (out / "report.md").read_text())
