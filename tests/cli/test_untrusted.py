"""Untrusted checkpoints and result directories (issue 42): a checkpoint's own code never runs, even when "y" is
typed at transformers' prompt; recurscope writes only inside --out and only over files it created (no link, FIFO or
foreign file is followed or overwritten); nested writers share the run lock.

Each test here failed on the code before issue 42 (the old code ran the checkpoint's Python, followed the links,
replaced the user's files and let a nested scan write beside a run)."""
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = ROOT / "recurscope" / "interp" / "checkpoints"
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
SMALL = ["--n-facts", "2", "--presentations", "2", "--filler", "12", "--batch-size", "8", "--n-sources", "1",
         "--gate-threshold", "0"]

EVIL = textwrap.dedent("""
    import pathlib
    pathlib.Path({marker!r}).write_text("the checkpoint's code ran")
    from transformers import PretrainedConfig, PreTrainedTokenizerFast
    class EvilConfig(PretrainedConfig):
        model_type = "evil"
    class EvilTokenizer(PreTrainedTokenizerFast):
        pass
""")


def _cli(argv, stdin="", timeout=300):
    return subprocess.run([sys.executable, "-m", "recurscope.interp.cli", *argv], input=stdin, capture_output=True,
                          text=True, cwd=ROOT, env=ENV, timeout=timeout)


def _edit_json(path: Path, **changes):
    raw = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    path.write_text(json.dumps(raw))


def _checkpoint_with_code(tmp: Path, bundled: str, where: str) -> tuple[Path, Path]:
    """A copy of a bundled checkpoint whose config.json or tokenizer_config.json maps an Auto class to evil.py,
    which writes a marker file when imported."""
    ckpt = tmp / "ckpt"
    shutil.copytree(BUNDLED / bundled, ckpt)
    marker = tmp / "MARKER"
    (ckpt / "evil.py").write_text(EVIL.format(marker=str(marker)))
    if where == "config.json":
        _edit_json(ckpt / "config.json", auto_map={"AutoConfig": "evil.EvilConfig",
                                                   "AutoModelForCausalLM": "evil.EvilConfig"})
    else:
        _edit_json(ckpt / "tokenizer_config.json", tokenizer_class=None,
                   auto_map={"AutoTokenizer": ["evil.EvilTokenizer", "evil.EvilTokenizer"]})
    return ckpt, marker


@pytest.mark.slow
@pytest.mark.parametrize("bundled,where", [("tiny-gla", "config.json"), ("tiny-qwen35", "config.json"),
                                           ("tiny-qwen35", "tokenizer_config.json")])
def test_checkpoint_code_never_runs(tmp_path, bundled, where):
    """'y' answered on stdin: before issue 42 transformers asked, and the fla checkpoint's evil.py then ran (the
    scan finished, exit 0). Now the auto_map is refused in one line naming the file and the key, exit 2, before
    transformers prints anything, and no marker appears."""
    ckpt, marker = _checkpoint_with_code(tmp_path, bundled, where)
    done = _cli(["scan", str(ckpt), "--out", str(tmp_path / "out"), *SMALL], stdin="y\n")
    assert not marker.exists(), "the checkpoint's code ran"
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {ckpt / where}: `auto_map`"), done.stderr[-2000:]
    assert "custom code" not in done.stdout + done.stderr
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_auto_map_refused_by_the_api(tmp_path):
    from recurscope.interp.checkpoint_files import CheckpointError
    from recurscope.interp.loading import load_model

    ckpt, marker = _checkpoint_with_code(tmp_path, "tiny-gla", "config.json")
    with pytest.raises(CheckpointError, match=r"config.json: `auto_map` names Python code"):
        load_model(ckpt)
    # a tokenizer directory given apart from the checkpoint is checked the same way
    tok, _ = _checkpoint_with_code(tmp_path / "t", "tiny-gla", "tokenizer_config.json")
    with pytest.raises(CheckpointError, match=r"tokenizer_config.json: `auto_map`"):
        load_model("tiny-gla", tokenizer=tok)
    assert not marker.exists()
