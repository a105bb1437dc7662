"""A scan killed with SIGKILL mid-run and rerun with the same arguments ends with every row exactly once.

The kill is deterministic: the child wraps RowLog.append and SIGKILLs itself once it has committed a given number of
rows, so each run dies at a known point with work on disk, however fast or slow the machine."""
import os
import signal
import subprocess
import sys
import textwrap

import pandas as pd
import pytest

from tests.cli.test_cli import GATE_OFF, SMALL

# argv: kill_after_rows, then the CLI's own arguments.
_KILLED_CLI = textwrap.dedent("""
    import os, signal, sys
    from recurscope.interp import results
    kill_after, committed = int(sys.argv[1]), 0
    real_append = results.RowLog.append

    def append(self, rows):
        global committed
        n = real_append(self, rows)
        committed += n
        if committed >= kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
        return n

    results.RowLog.append = append
    from recurscope.interp.cli import main
    sys.exit(main(sys.argv[2:]))
""")


def _rows(out):
    from recurscope.interp.results import RunDir

    return RunDir.open(out).table("scan_rows").read()


@pytest.mark.slow
def test_scan_survives_sigkill_and_resumes(tmp_path, tiny_checkpoint):
    ckpt = tiny_checkpoint(tmp_path / "ckpt", family="gated_deltanet")
    out = tmp_path / "scan"
    args = ["scan", str(ckpt), "--n-sources", "6", "--out", str(out), *SMALL[:-2], *GATE_OFF, "--batch-size", "1",
            "--pairs-per-source", "1"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    total = 6 * 2 * 2  # 6 pairs x 2 layers x 2 heads; --batch-size 1 commits one row per append
    on_disk = 0
    for kill_after in (1, 9):
        killed = subprocess.run([sys.executable, "-c", _KILLED_CLI, str(kill_after), *args], env=env,
                                capture_output=True, text=True, timeout=600)
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
        # The rows committed before the kill are on disk, and only those: this run added exactly kill_after.
        assert len(_rows(out)) == on_disk + kill_after < total
        on_disk += kill_after
    done = subprocess.run([sys.executable, "-m", "recurscope.interp.cli", *args], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = _rows(out)
    keys = rows[["source", "pair", "layer", "head"]]
    assert not keys.duplicated().any()
    assert len(rows) == total
    heads = pd.read_csv(out / "scan_heads.csv")
    assert len(heads) == 4
