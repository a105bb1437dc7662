"""Every command and snippet in the README runs as written, at small sizes, so that a README that drifts fails CI.

The fenced ```bash blocks' `recurscope ...` commands run in order in one scratch folder (so a later command finds
what an earlier one wrote, as `confirm --from-scan results/scan` does), each with its own options kept and size
options appended (argparse keeps the last value); the ```python blocks run as they are. The install commands are
checked against `.ci/install` and `.ci/run` rather than run (the suite itself is their second half).
"""
from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from recurscope.interp.cli import main
from tests.cli.test_protocol_verbs import OWN_ARGS, TINY

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

#: size options for the main job's commands (the protocol verbs take test_protocol_verbs' TINY / OWN_ARGS)
MAIN_JOB_SIZES = {"scan": ["--n-sources", "2", "--filler", "16", "--presentations", "2", "--batch-size", "8"],
                  "confirm": ["--n-sources", "2", "--filler", "16", "--presentations", "2", "--batch-size", "8"],
                  "patch": ["--filler", "16", "--presentations", "2"],
                  "run": ["--n-dev", "2", "--n-heldout", "2", "--filler", "16", "--presentations", "2",
                          "--batch-size", "8"],
                  "models": []}


def fenced(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README, flags=re.S | re.M)


def commands() -> list[list[str]]:
    """Each `recurscope` command of the README's bash blocks as argv (comments dropped, `a && b` split)."""
    found = []
    for block in fenced("bash"):
        for line in block.splitlines():
            argv: list[str] = []
            for token in shlex.split(line, comments=True) + ["&&"]:
                if token != "&&":
                    argv.append(token)
                    continue
                if argv and argv[0] == "recurscope":
                    found.append(argv[1:])
                argv = []
    return found


def _help(verb: str) -> str:
    text = io.StringIO()
    with contextlib.redirect_stdout(text), pytest.raises(SystemExit):
        main([verb, "--help"])
    return text.getvalue()


def small(argv: list[str]) -> list[str]:
    verb = argv[0]
    if verb in MAIN_JOB_SIZES:
        return argv + MAIN_JOB_SIZES[verb]
    extra = list(OWN_ARGS.get(verb, TINY))
    if "--n-dev" in _help(verb):
        extra += ["--n-dev", "2"]
    return argv + extra


def test_the_readme_opens_with_the_two_fresh_machine_commands():
    first = fenced("bash")[0].splitlines()
    assert first[0].startswith("bash .ci/install && recurscope run tiny-gla --out results/tiny-gla")
    assert first[1].startswith("bash .ci/install test && python3 -m pytest -q")
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash .ci/install test" in ci and "python3 -m pytest -q" in ci, ".ci/run must run the README's commands"


def test_the_readme_has_commands_and_snippets_to_run():
    verbs = {argv[0] for argv in commands()}
    assert {"run", "models", "scan", "confirm", "patch", "selectivity", "hybrid", "topk"} <= verbs, verbs
    assert len(fenced("python")) >= 2


@pytest.mark.slow
def test_every_readme_command_runs_at_small_sizes(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    failed = []
    for argv in commands():
        code = main(small(argv))
        if code != 0:
            failed.append((" ".join(argv), code, capsys.readouterr().err.strip().splitlines()[-1:]))
        elif "--out" in argv:
            out = tmp_path / argv[argv.index("--out") + 1]
            # `run` writes its scan/ and confirm/ result directories and report.md beside them
            assert any(out.rglob("manifest.json")), f"`recurscope {' '.join(argv)}` wrote no result directory"
    assert failed == [], failed


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(fenced("python"))))
def test_every_readme_snippet_runs(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(fenced("python")[index], f"README.md python block {index + 1}", "exec"), {"__name__": "readme"})
