"""`recurscope headscan` killed with SIGKILL in its read scan and rerun: the read scan's committed rows survive on
disk, the rerun adds only the missing ones (each row exactly once), and the result equals an uninterrupted run's."""
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from tests.cli.test_cli_resume import _KILLED_CLI

KEY = ["source", "pair", "layer", "head"]


def _table(out, name):
    from recurscope.interp.results import RunDir

    return RunDir.open(out).table(name).read()


@pytest.mark.slow
def test_headscan_read_scan_survives_sigkill_and_resumes(tmp_path, tiny_checkpoint):
    ckpt = tiny_checkpoint(tmp_path / "ckpt", family="gated_deltanet")   # 2 layers x 2 heads
    n_sources, n_heads = 6, 4
    common = ["headscan", str(ckpt), "--head", "0", "1", "--n-sources", str(n_sources), "--filler", "12",
              "--presentations", "2", "--gap", "4", "--gate-threshold", "0", "--resamples", "100", "--batch-size", "1"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    killed_out, clean_out = tmp_path / "killed", tmp_path / "clean"
    writes = n_sources * n_heads                   # the write scan commits one head (6 rows) per append
    kill_after = writes + 7                        # the read scan commits 6 rows per append: two appends, then kill
    killed = subprocess.run([sys.executable, "-c", _KILLED_CLI, str(kill_after), *common, "--out", str(killed_out)],
                            env=env, capture_output=True, text=True, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    on_disk = _table(killed_out, "read_scan_rows")
    assert 0 < len(on_disk) < n_sources * n_heads       # the read scan died midway with rows committed
    before = on_disk.set_index(KEY)["shift"]

    done = subprocess.run([sys.executable, "-m", "recurscope.interp.cli", *common, "--out", str(killed_out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    fresh = subprocess.run([sys.executable, "-m", "recurscope.interp.cli", *common, "--out", str(clean_out)],
                           env=env, capture_output=True, text=True, timeout=600)
    assert fresh.returncode == 0, fresh.stderr[-2000:]

    resumed, reference = _table(killed_out, "read_scan_rows"), _table(clean_out, "read_scan_rows")
    assert not resumed[KEY].duplicated().any() and len(resumed) == n_sources * n_heads
    resumed = resumed.set_index(KEY).sort_index()
    reference = reference.set_index(KEY).sort_index()
    assert resumed.index.equals(reference.index)
    assert np.allclose(resumed["shift"], reference["shift"], atol=1e-5)
    assert resumed.loc[before.index, "shift"].equals(before)      # the committed rows were kept, not recomputed
    a = (killed_out / "report.md").read_text()
    b = (clean_out / "report.md").read_text()
    assert a == b
