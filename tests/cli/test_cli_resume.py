"""A scan killed with SIGKILL at any point and rerun with the same arguments ends with every row exactly once."""
import os
import signal
import subprocess
import sys
import time

import pandas as pd

from tests.cli.test_cli import SMALL, _checkpoint


def _rows(out):
    from recurscope.interp.results import RunDir

    return RunDir.open(out).table("scan_rows").read()


def test_scan_survives_sigkill_and_resumes(tmp_path):
    ckpt = _checkpoint(tmp_path / "ckpt", family="gated_deltanet")
    out = tmp_path / "scan"
    cmd = [sys.executable, "-m", "recurscope.interp.cli", "scan", str(ckpt), "--n-sources", "6", "--out", str(out),
           *SMALL[:-2], "--batch-size", "1"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log = out / "scan_rows.jsonl"
    killed_mid_run = 0
    for wanted_rows in (1, 9):
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # Kill as soon as the scan has written past `wanted_rows` lines: mid-run, with work on disk.
        deadline = time.time() + 300
        while proc.poll() is None and time.time() < deadline:
            if log.is_file() and log.read_bytes().count(b"\n") >= wanted_rows:
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.05)
        proc.wait()
        if proc.returncode == -signal.SIGKILL and len(_rows(out)) < 24:
            killed_mid_run += 1
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = _rows(out)
    keys = rows[["source", "pair", "layer", "head"]]
    assert not keys.duplicated().any()
    assert len(rows) == 6 * 2 * 2          # 6 pairs x 2 layers x 2 heads
    assert killed_mid_run >= 1, "no kill landed mid-run; the scan finished too fast to test resuming"
    heads = pd.read_csv(out / "scan_heads.csv")
    assert len(heads) == 4
