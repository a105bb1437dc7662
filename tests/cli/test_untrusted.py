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


# ---- writing only what the tool created, only inside --out ---------------------------------------------------------
def test_outputs_never_follow_links_or_open_fifos(tmp_path):
    """write_output, RowLog and RunLock refuse a link or FIFO where their file goes, and leave its target alone (the
    old code wrote through each: open() and savefig follow links, and a FIFO blocked for ever)."""
    from recurscope.interp.results import OutputRefused, RowLog, RunLock, write_output

    outside = tmp_path / "outside.txt"
    outside.write_text("the user's file\n")
    out = tmp_path / "out"
    out.mkdir()
    for name in ("report.md", "rows.jsonl", ".recurscope.lock"):
        (out / name).symlink_to(outside)
    with pytest.raises(OutputRefused, match=r"report.md is a symbolic link \(to .*outside.txt\)"):
        write_output(out / "report.md", "# report\n")
    with pytest.raises(OutputRefused, match="rows.jsonl is a symbolic link"):
        RowLog(out / "rows.jsonl").append([{"a": 1}])
    with pytest.raises(OutputRefused, match="rows.jsonl is a symbolic link"):
        RowLog(out / "rows.jsonl").rows()
    with pytest.raises(OutputRefused, match=".recurscope.lock is a symbolic link"):
        RunLock(out).acquire()
    assert outside.read_text() == "the user's file\n"
    os.mkfifo(out / "fifo.jsonl")
    with pytest.raises(OutputRefused, match="fifo.jsonl is a FIFO"):
        RowLog(out / "fifo.jsonl").rows()
    with pytest.raises(OutputRefused, match="fifo.jsonl is a FIFO"):
        write_output(out / "fifo.jsonl", "x")
    (tmp_path / "elsewhere").mkdir()
    (out / "figures").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OutputRefused, match="figures is a symbolic link"):
        write_output(out / "figures" / "a.png", b"png")
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_write_output_replaces_through_a_rename(tmp_path):
    from recurscope.interp.results import write_output

    path = tmp_path / "report.md"
    path.write_text("old\n")
    inode = path.stat().st_ino
    write_output(path, "new\n")
    assert path.read_text() == "new\n" and path.stat().st_ino != inode     # a new file renamed over the old one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.md"]      # no temporary left


def test_out_dir_accepts_only_empty_or_same_kind(tmp_path):
    from recurscope.interp.results import OutputRefused, RunDir, check_out_dir

    check_out_dir(tmp_path / "absent", "scan")
    (tmp_path / "real").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "real")
    with pytest.raises(OutputRefused, match=r"--out .*alias is a symbolic link .* pass --out .*real"):
        check_out_dir(tmp_path / "alias", "scan")
    (tmp_path / "empty").mkdir()
    check_out_dir(tmp_path / "empty", "scan")
    RunDir.create(tmp_path / "scan", kind="scan", model_name="m")
    check_out_dir(tmp_path / "scan", "scan")
    with pytest.raises(OutputRefused, match="holds a 'scan' run, not a confirm run"):
        check_out_dir(tmp_path / "scan", "confirm")
    run = tmp_path / "run"
    RunDir.create(run / "scan", kind="scan", model_name="m")
    (run / "report.md").write_text("# report\n")
    check_out_dir(run, "run")                                  # a run's own report, beside its scan
    (run / "notes.txt").write_text("mine\n")
    with pytest.raises(OutputRefused, match="notes.txt, which recurscope did not create"):
        check_out_dir(run, "run")


def test_run_lock_covers_nested_result_directories(tmp_path):
    """`run --out X` locks X/scan and X/confirm with X; a writer inside a held directory is refused, and a run is
    refused while a nested directory is held (before, both wrote: 240 rows for 128 keys)."""
    from recurscope.interp.results import RunLock, RunLocked

    out = tmp_path / "X"
    with RunLock(out, nested=("scan", "confirm")):
        for inner in (out / "scan", out / "confirm", out / "scan" / "deeper"):
            with pytest.raises(RunLocked, match=r"lies inside .*X(/scan)?, which another recurscope process"):
                RunLock(inner).acquire()
    with RunLock(out / "confirm"):
        with pytest.raises(RunLocked, match="confirm is in use by another recurscope process"):
            RunLock(out, nested=("scan", "confirm")).acquire()
        with RunLock(out / "scan"):       # a sibling is not nested
            pass
    with RunLock(out, nested=("scan", "confirm")):   # everything was released
        pass


def test_rows_without_manifest_are_not_reused(tmp_path):
    from recurscope.interp.results import RunDir

    run = RunDir.create(tmp_path / "r", kind="scan", model_name="m", seeds=[0])
    run.table("scan_rows", key=["k"]).append([{"k": 1}])
    (tmp_path / "r" / "manifest.json").unlink()
    with pytest.raises(ValueError, match="holds committed rows .scan_rows.jsonl. but no manifest.json"):
        RunDir.create_or_open(tmp_path / "r", kind="scan", model_name="m", seeds=[1])


# ---- reports and moved run directories ------------------------------------------------------------------------
@pytest.mark.slow
def test_moved_run_resumes_and_report_escapes_the_manifest(tmp_path, tiny_checkpoint):
    """A `run` directory moved elsewhere resumes (its confirmation named its scan by the old path, so the rerun was
    refused before); a crafted argv and layout name in the manifest stay inside code spans in report.md."""
    import pandas as pd

    from recurscope.interp.cli import main

    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    args = [*SMALL[:-4], "--n-dev", "2", "--n-heldout", "2", "--gate-threshold", "0"]
    assert main(["run", str(ckpt), "--out", str(tmp_path / "a"), *args]) == 0
    rows = len(pd.read_json(tmp_path / "a" / "confirm" / "confirm_rows.jsonl", lines=True))
    (tmp_path / "a").rename(tmp_path / "b")
    crafted = tmp_path / "b" / "confirm" / "manifest.json"
    manifest = json.loads(crafted.read_text())
    manifest["argv"] = ["x`\n# Injected heading\n<script>alert(1)</script>", "``"]
    manifest["extra"]["pair_layout"]["name"] = "paper`\n## Owned"
    # a checkpoint_path naming another checkpoint (here one whose config groups 4 query heads per state) does not
    # change the report's wording: the report reads only what the run recorded of the loaded model
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "config.json").write_text(json.dumps(dict(model_type="gla", vocab_size=61, hidden_size=32,
                                                           num_hidden_layers=1, num_heads=8, num_kv_heads=2)))
    manifest["checkpoint_path"] = str(elsewhere)
    crafted.write_text(json.dumps(manifest))
    assert main(["run", str(ckpt), "--out", str(tmp_path / "b"), *args]) == 0
    assert len(pd.read_json(tmp_path / "b" / "confirm" / "confirm_rows.jsonl", lines=True)) == rows
    report = (tmp_path / "b" / "report.md").read_text()
    assert "state group read by" not in report
    headings = [line for line in report.splitlines() if line.startswith("#")]
    assert not any("Injected" in h or "Owned" in h for h in headings), headings
    line = next(line for line in report.splitlines() if "command:" in line)
    assert "```" in line and "<script>" in line.split("```")[1]     # inside a code span (fence longer than ``)


@pytest.mark.parametrize("rate", ["x", None, [1], True, -0.5, 7.0])
def test_a_crafted_filler_rate_in_a_manifest_is_no_traceback(rate):
    """report._filler_line reads the manifest's unknown-token rate; a value the run never writes gives a plain line."""
    from recurscope.interp.report import _filler_line

    line = _filler_line({"filler_source": "generated filler", "filler_unknown_rate": rate, "filler_tokens": 5,
                         "filler_unknown_limit": 0.1})
    assert line == "generated filler; its unknown-token rate is not recorded as a number"
