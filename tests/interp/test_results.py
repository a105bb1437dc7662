"""Tests for interp.results: manifests and resume checks, checkpoint hashing, the crash-safe row log (including
real SIGKILLs of a writer process between and inside batches), and table/figure outputs."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest

from recurscope.interp.results import COMMIT_KEY, RowLog, RunDir, checkpoint_hash, package_versions


@pytest.fixture()
def checkpoint(tmp_path) -> Path:
    ck = tmp_path / "ckpt"
    ck.mkdir()
    (ck / "model-00001-of-00002.safetensors").write_bytes(b"\x01" * 5000)
    (ck / "model-00002-of-00002.safetensors").write_bytes(b"\x02" * 300)
    (ck / "config.json").write_text('{"hidden_size": 8}')
    return ck


def _make_run(out, checkpoint, **overrides):
    kwargs = dict(kind="scan", model_name="gla-tiny", checkpoint_path=checkpoint,
                  args={"n_sources": 16, "filler_tokens": 512, "layers": (0, 1)}, seeds=[0, 1],
                  sources=["wt103:0", "wt103:1"], split="dev")
    kwargs.update(overrides)
    return RunDir.create(out, **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# Checkpoint hash and manifest
# ---------------------------------------------------------------------------------------------------------------


def test_checkpoint_hash_is_content_based(checkpoint, tmp_path):
    first = checkpoint_hash(checkpoint)
    # Independent recomputation of the documented framing: sorted relative paths of the weight files and the files
    # a loader reads beside them (config.json here), each "name\0size\0" + bytes.
    digest = hashlib.sha256()
    for name in sorted([p.name for p in checkpoint.glob("*.safetensors")] + ["config.json"]):
        data = (checkpoint / name).read_bytes()
        digest.update(f"{name}\0{len(data)}\0".encode() + data)
    assert first == "sha256:" + digest.hexdigest()
    (checkpoint / "notes.txt").write_text("read by no loader")
    assert checkpoint_hash(checkpoint) == first
    (checkpoint / "config.json").write_text('{"hidden_size": 9}')  # read by the loader, so in the hash (issue 32)
    assert checkpoint_hash(checkpoint) != first
    first = checkpoint_hash(checkpoint)
    (checkpoint / "model-00002-of-00002.safetensors").write_bytes(b"\x02" * 299 + b"\x03")
    assert checkpoint_hash(checkpoint) != first
    single = checkpoint / "model-00001-of-00002.safetensors"
    assert checkpoint_hash(single).startswith("sha256:")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no weight files"):
        checkpoint_hash(empty)


def test_manifest_records_the_run(checkpoint, tmp_path):
    run = _make_run(tmp_path / "run", checkpoint)
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest == run.manifest
    assert manifest["model_name"] == "gla-tiny" and manifest["kind"] == "scan"
    assert manifest["checkpoint_hash"] == checkpoint_hash(checkpoint)
    assert manifest["sources"] == ["wt103:0", "wt103:1"] and manifest["split"] == "dev"
    assert manifest["seeds"] == [0, 1] and manifest["args"]["layers"] == [0, 1]
    assert manifest["argv"] == sys.argv
    for name in ("torch", "triton", "transformers", "transformer_lens", "nnsight", "pandas", "scipy", "recurscope"):
        assert name in manifest["packages"]
    assert manifest["packages"]["pandas"] == pd.__version__
    assert package_versions(["surely-not-installed-pkg-xyz"]) == {"surely-not-installed-pkg-xyz": None}
    assert manifest["platform"]["python"] and manifest["created"]
    with pytest.raises(FileExistsError, match="RunDir.open"):
        _make_run(tmp_path / "run", checkpoint)


def test_resume_accepts_same_work_and_names_differences(checkpoint, tmp_path):
    _make_run(tmp_path / "run", checkpoint)
    same = RunDir.open(tmp_path / "run", kind="scan", model_name="gla-tiny", checkpoint_path=checkpoint,
                       args={"n_sources": 16, "filler_tokens": 512, "layers": [0, 1]}, seeds=[0, 1],
                       sources=("wt103:0", "wt103:1"), split="dev")
    assert len(same.manifest["resumed"]) == 1
    with pytest.raises(ValueError) as err:
        RunDir.open(tmp_path / "run", model_name="gdn-tiny", args={"n_sources": 32, "filler_tokens": 512,
                                                                   "layers": [0, 1]})
    message = str(err.value)
    assert "model_name" in message and "args" in message and "new --out" in message
    assert "seeds" not in message
    (checkpoint / "model-00002-of-00002.safetensors").write_bytes(b"changed")
    with pytest.raises(ValueError, match="checkpoint_hash"):
        RunDir.open(tmp_path / "run", checkpoint_path=checkpoint)
    with pytest.raises(FileNotFoundError, match="RunDir.create"):
        RunDir.open(tmp_path / "nothing-here")
    reopened = RunDir.create_or_open(tmp_path / "run", kind="scan", model_name="gla-tiny",
                                     args={"n_sources": 16, "filler_tokens": 512, "layers": [0, 1]}, seeds=[0, 1],
                                     sources=["wt103:0", "wt103:1"], split="dev")
    assert reopened.manifest["model_name"] == "gla-tiny"


def test_a_run_without_rows_does_not_block_its_corrected_rerun(checkpoint, tmp_path):
    # e.g. `confirm --top-k 0` failed after writing a manifest with heads []: the corrected command must run
    out = tmp_path / "run"
    _make_run(out, checkpoint, args={"heads": []})
    fixed = dict(kind="scan", model_name="gla-tiny", checkpoint_path=checkpoint, args={"heads": [[0, 1]]},
                 seeds=[0, 1], sources=["wt103:0", "wt103:1"], split="dev")
    run = RunDir.create_or_open(out, **fixed)
    assert run.manifest["args"] == {"heads": [[0, 1]]}
    assert json.loads((out / "manifest.json").read_text())["args"] == {"heads": [[0, 1]]}
    assert "args" in run.manifest["replaced"][0]["differed"][0]
    # once the run holds a committed row, different work is refused again (resume protects the rows)
    run.table("rows", key=["row"]).append([{"row": 0}])
    with pytest.raises(ValueError, match="the work differs"):
        RunDir.create_or_open(out, **{**fixed, "args": {"heads": [[1, 1]]}})
    assert RunDir.create_or_open(out, **fixed).manifest["args"] == {"heads": [[0, 1]]}


# ---------------------------------------------------------------------------------------------------------------
# Row log
# ---------------------------------------------------------------------------------------------------------------


def test_row_log_format_and_round_trip(tmp_path):
    import numpy as np

    log = RowLog(tmp_path / "rows.jsonl", key=["source", "head"])
    assert log.append([{"source": "a", "head": 1, "score": np.float32(0.5)}, {"source": "a", "head": 2,
                                                                             "score": float("nan")}]) == 2
    log.append([{"source": "b", "head": 1, "score": 2.0, "note": "line\nbreak"}])
    lines = (tmp_path / "rows.jsonl").read_text().splitlines()
    # one line per row; each batch's last row carries the commit, so pandas reads exactly the rows
    assert len(lines) == 3 and COMMIT_KEY not in json.loads(lines[0])
    assert json.loads(lines[1])[COMMIT_KEY] == 2 and json.loads(lines[2])[COMMIT_KEY] == 1
    plain = pd.read_json(tmp_path / "rows.jsonl", lines=True)
    assert list(plain["head"]) == [1, 2, 1] and list(plain["source"]) == ["a", "a", "b"]
    assert list(log.read().columns) == ["source", "head", "score", "note"]
    assert log.done_keys() == {("a", 1), ("a", 2), ("b", 1)}
    assert log.done_keys("source") == {"a", "b"}
    frame = log.read()
    assert list(frame["head"]) == [1, 2, 1] and frame["note"].iloc[2] == "line\nbreak"
    assert frame["score"].iloc[0] == 0.5 and np.isnan(frame["score"].iloc[1])
    with pytest.raises(ValueError, match="key columns"):
        log.append([{"source": "c"}])
    with pytest.raises(ValueError, match="reserved"):
        log.append([{"source": "c", "head": 0, COMMIT_KEY: 1}])
    with pytest.raises(ValueError, match="empty"):
        RowLog(tmp_path / "other.jsonl").append([{}])


def test_row_logs_of_the_older_format_with_bare_commit_lines_still_read(tmp_path):
    path = tmp_path / "old.jsonl"
    path.write_bytes(b'{"k": 0}\n{"k": 1}\n{"' + COMMIT_KEY.encode() + b'": 2}\n{"k": 2}\n')
    log = RowLog(path, key=["k"])
    assert list(log.read()["k"]) == [0, 1]                     # the last row was never committed
    log.append([{"k": 2}])
    assert list(log.read()["k"]) == [0, 1, 2]


def test_a_one_row_first_batch_commits_on_the_first_line(tmp_path):
    path = tmp_path / "one.jsonl"
    log = RowLog(path, key=["k"])
    log.append([{"k": 0}])
    with open(path, "ab") as handle:                           # a torn second batch
        handle.write(b'{"k": 1}\n{"k": 2, "pay')
    log.append([{"k": 1}])
    assert list(log.read()["k"]) == [0, 1] and len(path.read_text().splitlines()) == 2


def test_torn_tail_is_ignored_then_truncated(tmp_path):
    path = tmp_path / "rows.jsonl"
    log = RowLog(path, key=["k"])
    log.append([{"k": 0}, {"k": 1}])
    committed = path.read_bytes()
    # A crash mid-batch: two complete rows of the next batch, then a torn third line and no commit line.
    with open(path, "ab") as handle:
        handle.write(b'{"k": 2}\n{"k": 3}\n{"k": 4, "pay')
    assert log.done_keys() == {(0,), (1,)}
    assert list(log.read()["k"]) == [0, 1]
    log.append([{"k": 2}])
    assert path.read_bytes() == committed + b'{"' + COMMIT_KEY.encode() + b'": 1, "k": 2}\n'
    assert list(log.read()["k"]) == [0, 1, 2]
    # Garbage inside an uncommitted tail is tolerated; inside the committed part it is reported.
    with open(path, "ab") as handle:
        handle.write(b"\x00\x00garbage\n")
    assert list(log.read()["k"]) == [0, 1, 2]
    path.write_bytes(b'{"k": 0}\nnot json\n{"' + COMMIT_KEY.encode() + b'": 2}\n')
    with pytest.raises(ValueError, match="corrupt"):
        log.read()


def test_duplicate_keys_keep_first_and_warn(tmp_path):
    log = RowLog(tmp_path / "rows.jsonl", key=["k"])
    log.append([{"k": 0, "v": "first"}, {"k": 1, "v": "x"}])
    log.append([{"k": 0, "v": "second"}])
    with pytest.warns(RuntimeWarning, match="1 rows repeat a key"):
        frame = log.read()
    assert list(frame["k"]) == [0, 1] and frame["v"].iloc[0] == "first"
    assert len(RowLog(tmp_path / "rows.jsonl").read()) == 3  # no key: nothing to deduplicate on


_WRITER = textwrap.dedent("""
    import os, random, signal, sys
    from recurscope.interp.results import RunDir
    out, n_keys, seed, kill_after, how = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    run = RunDir.create_or_open(out, kind="killtest", model_name="none", args={"n_keys": n_keys})
    rows = run.table("rows", key=["key"])
    done = rows.done_keys()
    todo = [k for k in range(n_keys) if (k,) not in done]
    rng = random.Random(seed)
    real_write = os.write

    def torn_write(fd, data):
        # Write half of the batch's bytes, then die inside append: a real torn, uncommitted batch.
        real_write(fd, bytes(data[:max(1, len(data) // 2)]))
        os.kill(os.getpid(), signal.SIGKILL)

    committed, i = 0, 0
    while i < len(todo):
        size = rng.randint(1, 4)
        batch = [{"key": k, "square": k * k, "pad": "x" * rng.randint(10, 200000)} for k in todo[i:i + size]]
        if how == "torn" and committed + len(batch) >= kill_after:
            os.write = torn_write
        rows.append(batch)
        committed += len(batch)
        i += size
        if how == "between" and committed >= kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
    print("finished", flush=True)
""")


@pytest.mark.slow
def test_sigkill_between_and_inside_batches_then_resume(tmp_path):
    # Each writer SIGKILLs itself on a row-count signal (after `kill_after` committed rows, or halfway through the
    # batch that would cross it), so every kill lands mid-run with known rows on disk, whatever the machine's speed.
    out = tmp_path / "run"
    n_keys = 150
    log = RowLog(out / "rows.jsonl", key=["key"])
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]) + os.pathsep +
               os.environ.get("PYTHONPATH", ""))

    def writer(seed, kill_after, how):
        return subprocess.run([sys.executable, "-c", _WRITER, str(out), str(n_keys), str(seed), str(kill_after), how],
                              capture_output=True, text=True, env=env, timeout=120)

    on_disk = 0
    for attempt, (kill_after, how) in enumerate([(5, "between"), (1, "torn"), (20, "between"), (12, "torn"),
                                                 (30, "between"), (3, "torn")]):
        proc = writer(attempt, kill_after, how)
        assert proc.returncode == -signal.SIGKILL, proc.stderr
        committed = len(log.rows())
        if how == "between":  # every row of this run committed, and at least kill_after of them
            assert on_disk + kill_after <= committed <= on_disk + kill_after + 3
            assert (out / "rows.jsonl").read_bytes().endswith(b'}\n')
        else:  # the torn batch left bytes past the last commit line, and none of its rows counts
            assert committed < on_disk + kill_after
            assert not (out / "rows.jsonl").read_bytes().endswith(b'}\n')
        on_disk = committed
    assert 0 < on_disk < n_keys
    finish = writer(99, n_keys + 1, "never")
    assert finish.returncode == 0, finish.stderr
    assert "finished" in finish.stdout

    raw = log.rows()
    assert sorted(r["key"] for r in raw) == list(range(n_keys))  # every key exactly once, none missing
    assert all(r["square"] == r["key"] ** 2 for r in raw)
    assert (out / "rows.jsonl").read_bytes().endswith(b'}\n')
    assert len(json.loads((out / "manifest.json").read_text())["resumed"]) >= 6


# ---------------------------------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------------------------------


def test_write_table_and_figure_path(checkpoint, tmp_path):
    run = _make_run(tmp_path / "run", checkpoint)
    frame = pd.DataFrame({"layer": [0, 1], "head": [3, 2], "score": [0.25, -1.5], "name": ["a", "b"]})
    paths = run.write_table("head_scores", frame)
    pd.testing.assert_frame_equal(pd.read_csv(paths["csv"]), frame, check_dtype=False)
    pd.testing.assert_frame_equal(pd.read_parquet(paths["parquet"]), frame, check_dtype=False)
    figure = run.figure_path("head_scan")
    assert figure == tmp_path / "run" / "figures" / "head_scan" and figure.parent.is_dir()
    with pytest.raises(ValueError, match="plain file name"):
        run.table("../escape")


def test_a_finished_scan_writes_its_rows_as_parquet_equal_to_the_row_log(tmp_path, word_tok):
    from helpers_models import tiny_model
    from recurscope.interp.data import build_pairs
    from recurscope.interp.scan import SCAN_TABLE, run_scan

    model = tiny_model("gla_conv", layers=2, vocab_size=len(word_tok))
    pairs = build_pairs(word_tok, split="dev", n_sources=2, n_facts=2, presentations=2, filler_tokens=8)
    run = RunDir.create(tmp_path / "scan", kind="scan", model_name="tiny", args={})
    run_scan(model, pairs, run_dir=run)
    logged = run.table(SCAN_TABLE).read()
    finished = pd.read_parquet(tmp_path / "scan" / f"{SCAN_TABLE}.parquet")
    pd.testing.assert_frame_equal(finished.reset_index(drop=True), logged.reset_index(drop=True), check_dtype=False)
    assert len(pd.read_json(tmp_path / "scan" / f"{SCAN_TABLE}.jsonl", lines=True)) == len(logged)
