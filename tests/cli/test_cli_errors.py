"""Bad input to the `recurscope` command gets one line naming the problem and the fix, with no traceback (the real
command in a subprocess, run from this checkout); --debug shows the traceback. Also: arguments are validated before
any work, a failed run does not block its corrected rerun, errors are not glued to a progress bar, and what the run
was (pairs per source, filler source and its unknown-token rate, confirmation on dev sources) is recorded.
Each case here failed before issue 16 was fixed."""
import concurrent.futures
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from recurscope.interp import cli
from recurscope.interp.data import FillerSource
from tests.cli.test_cli import GATE_OFF, SMALL

pytestmark = pytest.mark.slow  # the real command in subprocesses, and CLI runs
ROOT = Path(__file__).resolve().parents[2]
ENGLISH = ("The committee met on Tuesday to discuss the proposed budget for the coming fiscal year, and several "
           "members raised concerns about the rising cost of maintaining the bridges along the northern highway. ")


def _cli(*argv):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "recurscope.interp.cli", *map(str, argv)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)


def _corrupt(src: Path, dst: Path, how: str) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    weights = dst / "model.safetensors"
    data = weights.read_bytes()
    if how == "truncated":
        weights.write_bytes(data[:len(data) // 2])
    elif how == "garbage header":
        weights.write_bytes(b"\xff" * 8 + b"{not a header" + data[21:])
    elif how == "empty":
        weights.write_bytes(b"")
    elif how == "invalid config":
        (dst / "config.json").write_text('{"model_type": "gla", "hidden_size": ')
    elif how == "mismatch":
        cfg = json.loads((dst / "config.json").read_text())
        cfg["num_hidden_layers"] = 3
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


SMALL1 = [*SMALL, "--n-sources", "2"]
GATED = [*SMALL1, *GATE_OFF]   # for commands that must get past the gate on random weights


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_checkpoint):
    """A tiny checkpoint and a finished scan of it (in-process)."""
    root = tmp_path_factory.mktemp("errors")
    ckpt = tiny_checkpoint(root / "ckpt")
    assert cli.main(["scan", str(ckpt), "--out", str(root / "scan"), *GATED]) == 0
    return root, ckpt


@pytest.fixture(scope="module")
def cases(base):
    """Every subprocess case, run up to three at a time (each spends most of its time importing torch)."""
    root, ckpt = base
    bad = {how: _corrupt(ckpt, root / how.replace(" ", "_"), how)
           for how in ("truncated", "garbage header", "empty", "invalid config", "mismatch")}
    a_file = root / "a_file"
    a_file.write_text("not a directory")
    english = root / "english"
    english.mkdir()
    (english / "minutes.txt").write_text(ENGLISH * 250)           # 4 windows of 1,024 words
    small = SMALL1
    argv = {
        **{how: ["scan", bad[how], "--out", root / f"out_{i}", *small] for i, how in enumerate(bad)},
        "mismatch --verbose": ["scan", bad["mismatch"], "--out", root / "out_verbose", "--verbose", *small],
        "truncated --debug": ["scan", bad["truncated"], "--out", root / "out_debug", "--debug", *small],
        "--debug first": ["--debug", "scan", bad["empty"], "--out", root / "out_debug2", *small],
        # --out is checked before the model loads: with a corrupt checkpoint the --out error is the one reported
        "out under a file": ["scan", bad["truncated"], "--out", a_file / "sub", *small],
        "out under /proc": ["scan", bad["truncated"], "--out", "/proc/recurscope-test/out", *small],
        "device cuda": ["scan", bad["truncated"], "--device", "cuda", "--out", root / "out_cuda", *small],
        "batch size -4": ["scan", ckpt, "--out", root / "out_batch", *SMALL[:-2], "--n-sources", "2",
                          "--batch-size", "-4"],
        # before the fix this wrote a manifest with heads [] and then failed, blocking the corrected rerun
        "top-k 0": ["confirm", ckpt, "--from-scan", root / "scan", "--top-k", "0", "--out", root / "out_topk",
                    *small],
        "run --sources": ["run", ckpt, "--sources", "heldout", "--n-dev", "2", "--n-heldout", "2", "--out",
                          root / "out_run", *small[:-2]],
        "english corpus": ["scan", ckpt, "--corpus", english, "--out", root / "out_corpus", *small],
    }
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        results = dict(zip(argv, pool.map(lambda a: _cli(*a), argv.values())))
    return root, ckpt, bad, results


def _error_line(proc, *needles) -> str:
    """The run failed with exactly one `error:` line, on a line of its own, naming every needle; no traceback."""
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    errors = [i for i, line in enumerate(lines) if "error:" in line]
    assert len(errors) == 1 and lines[errors[0]].startswith("error: "), proc.stderr[-3000:]
    line = lines[errors[0]]
    for needle in needles:
        assert needle in line, line
    return line


@pytest.mark.parametrize("how", ["truncated", "garbage header", "empty"])
def test_corrupt_weights_are_one_line_naming_the_file(cases, how):
    root, ckpt, bad, results = cases
    line = _error_line(results[how], str(bad[how] / "model.safetensors"), "download or save the checkpoint again")
    assert results[how].stderr.rstrip().endswith(line)      # nothing after it: one line


def test_invalid_config_json_names_the_file(cases):
    root, ckpt, bad, results = cases
    _error_line(results["invalid config"], str(bad["invalid config"] / "config.json"), "not valid JSON",
                "restore it")


def test_config_weight_mismatch_is_one_line_and_lists_all_with_verbose(cases):
    root, ckpt, bad, results = cases
    proc = results["mismatch"]
    line = _error_line(proc, "does not match its config.json", "missing", "check that config.json belongs",
                       "--verbose")
    assert proc.stderr.rstrip().endswith(line)      # nothing after it: one line
    proc = results["mismatch --verbose"]
    line = _error_line(proc, "does not match its config.json", "missing", "check that config.json belongs")
    after = proc.stderr.split(line, 1)[1].splitlines()[1:]
    assert after[0].startswith("  missing weights (") and all(a.startswith("  ") for a in after)
    assert any("model.layers.2." in a for a in after)


def test_debug_shows_the_traceback(cases):
    root, ckpt, bad, results = cases
    for case in ("truncated --debug", "--debug first"):
        proc = results[case]
        assert proc.returncode != 0 and "Traceback" in proc.stderr and "CheckpointError" in proc.stderr


@pytest.mark.parametrize("case, needles", [
    ("out under a file", ["a_file is a file, not a directory", "choose an --out path"]),
    ("out under /proc", ["--out /proc/recurscope-test/out", "cannot write there", "choose a directory"]),
    ("device cuda", ["--device cuda", "torch.cuda.is_available() is False", "use --device cpu"]),
])
def test_unusable_out_and_device_are_refused_before_the_model_loads(cases, case, needles):
    root, ckpt, bad, results = cases
    _error_line(results[case], *needles)       # the checkpoint is corrupt: loading it would have failed first


def test_negative_batch_size_and_zero_top_k_are_refused_before_any_manifest(cases):
    root, ckpt, bad, results = cases
    _error_line(results["batch size -4"], "--batch-size must be at least 1, got -4")
    _error_line(results["top-k 0"], "--top-k must be at least 1, got 0")
    assert not (root / "out_batch" / "manifest.json").exists()
    assert not (root / "out_topk" / "manifest.json").exists()


def test_run_has_no_sources_options(cases):
    # `run` chooses its splits itself (--n-dev, --n-heldout); --sources/--n-sources used to be accepted and ignored
    proc = cases[3]["run --sources"]
    assert proc.returncode == 2 and "unrecognized arguments: --sources heldout" in proc.stderr


def test_help_of_every_command(capsys):
    for command in ("models", "scan", "confirm", "patch", "run"):
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        text = capsys.readouterr().out
        assert "--debug" in text
        assert ("--sources" in text) == (command in ("scan", "confirm", "patch"))


def test_english_corpus_mostly_unknown_tokens_is_refused(cases):
    root, ckpt, bad, results = cases
    line = _error_line(results["english corpus"], "of the filler tokens", "are [UNK]", "above the 5% limit",
                       "--allow-unk")
    rate = float(line.split("--corpus ")[1].split(": ")[1].split("%")[0])
    assert rate > 20
    assert not (root / "out_corpus" / "manifest.json").exists()


# ---- in-process: what gets recorded, reruns, progress bars ------------------------------------------------------

def test_corrected_rerun_after_a_refused_one(base, cases):
    root, ckpt = base
    # the refused `--top-k 0` left no manifest behind, so the corrected command runs in the same --out
    assert cli.main(["confirm", str(ckpt), "--from-scan", str(root / "scan"), "--top-k", "1", "--out",
                     str(root / "out_topk"), *GATED]) == 0


def test_pairs_per_source_is_used_and_recorded(base):
    root, ckpt = base
    assert cli.main(["scan", str(ckpt), "--out", str(root / "pps"), *SMALL, *GATE_OFF, "--n-sources", "2",
                     "--pairs-per-source", "3"]) == 0
    manifest = json.loads((root / "pps" / "manifest.json").read_text())
    assert manifest["args"]["pairs_per_source"] == 3 and manifest["extra"]["pairs_per_source"] == 3
    rows = pd.read_json(root / "pps" / "scan_rows.jsonl", lines=True).dropna(subset=["source"])
    assert rows.groupby("source")["pair"].nunique().tolist() == [3, 3]
    assert cli.DEFAULT_PAIRS_PER_SOURCE == 4


def test_confirm_on_dev_sources_warns_loudly_and_is_recorded(base, capsys):
    from recurscope.interp.confirm import heads_from_scan
    from recurscope.interp.report import write_report

    root, ckpt = base
    out = root / "confirm_dev"
    assert cli.main(["confirm", str(ckpt), "--from-scan", str(root / "scan"), "--sources", "dev", "--out", str(out),
                     *GATED]) == 0
    err = capsys.readouterr().err
    assert err.count("WARNING: confirm --sources dev") == 2 and "NOT a confirmation" in err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["split"] == "dev" and manifest["extra"]["confirmation_on_selection_sources"] is True
    path = write_report(out, model_name="tiny", scan_dir=root / "scan", confirm_dir=out,
                        heads=heads_from_scan(root / "scan"), control_heads=[(0, 0)],
                        scan_heads=pd.read_csv(root / "scan" / "scan_heads.csv"),
                        summary=pd.read_csv(out / "confirm_summary.csv"), figures={})
    assert "WARNING: this \"confirmation\" ran on the dev sources" in path.read_text()


def test_corpus_unknown_rate_is_reported_recorded_and_allowed_on_request(base, tmp_path, capsys):
    root, ckpt = base
    english = tmp_path / "english"
    english.mkdir()
    (english / "minutes.txt").write_text(ENGLISH * 250)
    args = ["scan", str(ckpt), "--corpus", str(english), *GATED]
    assert cli.main([*args, "--out", str(tmp_path / "refused")]) == 2
    assert cli.main([*args, "--out", str(tmp_path / "allowed"), "--allow-unk"]) == 0
    err = capsys.readouterr().err
    assert "WARNING: --corpus" in err and "(--allow-unk given)" in err
    extra = json.loads((tmp_path / "allowed" / "manifest.json").read_text())["extra"]
    assert extra["filler_unknown_rate"] > 0.2 and extra["allow_unk"] is True
    assert extra["filler_source"] == f"local corpus {english}" and extra["filler_unknown_limit"] == 0.05
    # text in the tokenizer's vocabulary passes, with its (zero) rate said and recorded
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "filler.txt").write_text(FillerSource(0, "dev").text(900))
    assert cli.main(["scan", str(ckpt), "--corpus", str(plain), "--out", str(tmp_path / "plain_out"), *GATED]) == 0
    assert "0.0% of the filler tokens" in capsys.readouterr().err
    assert json.loads((tmp_path / "plain_out" / "manifest.json").read_text())["extra"]["filler_unknown_rate"] == 0.0


def test_an_error_is_not_glued_to_a_progress_bar(base, monkeypatch, capsys):
    import recurscope.interp.scan as scan_module

    def failing_scan(model, pairs, progress=None, **kwargs):
        progress(1, 4)
        raise ValueError("the scan failed half way; fix the input")
    monkeypatch.setattr(scan_module, "run_scan", failing_scan)
    root, ckpt = base
    assert cli.main(["scan", str(ckpt), "--out", str(root / "glued"), *GATED]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert "error: the scan failed half way; fix the input" in lines
