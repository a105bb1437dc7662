"""One writer per run directory and clean interrupts (issue 32, items 6 and 7), with real processes: a second
`recurscope` on the same --out is refused at once naming the holder's pid, a lock left by a killed run never blocks
the rerun, two writers started together leave no duplicate rows, and Ctrl-C / SIGTERM end in one line with exit
130 / 143 and every committed row kept (the rerun completes them; --debug keeps the traceback).

The interrupt is deterministic: the child wraps RowLog.append and signals itself once it has committed a given
number of rows, as tests/cli/test_cli_resume.py does with SIGKILL."""
import os
import subprocess
import sys
import textwrap

import pytest

from recurscope.interp import cli
from recurscope.interp.results import RunDir, RunLock
from tests.cli.test_cli import GATE_OFF, SMALL

pytestmark = pytest.mark.slow     # real processes
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}

# argv: signal name, rows after which to send it, then the CLI's own arguments.
_SIGNALLED_CLI = textwrap.dedent("""
    import os, signal, sys
    from recurscope.interp import results
    sig, after, committed = getattr(signal, sys.argv[1]), int(sys.argv[2]), 0
    # A terminal's Ctrl-C reaches a process whose SIGINT is Python's handler. A process started in the background
    # by a non-interactive shell (as CI may start the suite) inherits SIGINT ignored, and Python then installs no
    # handler, so the signal below would be dropped and the run would finish: restore the handler first.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    real_append = results.RowLog.append

    def append(self, rows):
        global committed
        n = real_append(self, rows)
        committed += n
        if committed >= after:
            os.kill(os.getpid(), sig)
        return n

    results.RowLog.append = append
    from recurscope.interp.cli import main
    sys.exit(main(sys.argv[3:]))
""")

_HOLDER = textwrap.dedent("""
    import sys, time
    from recurscope.interp.results import RunLock
    RunLock(sys.argv[1]).acquire()
    print("held", flush=True)
    time.sleep(600)
""")


def _scan_args(ckpt, out, n_sources=4):
    return ["scan", str(ckpt), "--out", str(out), *SMALL[:-2], "--batch-size", "1", "--pairs-per-source", "1",
            "--n-sources", str(n_sources), *GATE_OFF]


def _rows(out):
    return RunDir.open(out).table("scan_rows").read()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, tiny_checkpoint):
    return tiny_checkpoint(tmp_path_factory.mktemp("guard") / "ckpt")


def test_second_writer_is_refused_naming_the_holder_and_a_dead_holder_never_blocks(ckpt, tmp_path, capsys):
    out = tmp_path / "scan"
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(out)], env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert cli.main(_scan_args(ckpt, out, 2)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"error: {out} is in use by another recurscope process (pid {holder.pid}); wait for it to "
                       "finish or use another --out directory"]
        assert not (out / "manifest.json").exists()
    finally:
        holder.kill()                       # SIGKILL: no cleanup runs, the lock file stays behind
        holder.wait()
    assert (out / ".recurscope.lock").read_text().strip() == str(holder.pid)
    assert cli.main(_scan_args(ckpt, out, 2)) == 0     # the OS released the flock with its process
    assert len(_rows(out)) == 2 * 2 * 2


def test_two_writers_started_together_leave_no_duplicate_rows(ckpt, tmp_path):
    out = tmp_path / "scan"
    procs = [subprocess.Popen([sys.executable, "-m", "recurscope.interp.cli", *_scan_args(ckpt, out)], env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(timeout=600), p.stderr.read()) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    refused = next(err for code, err in results if code == 2)
    assert "is in use by another recurscope process (pid" in refused and "Traceback" not in refused
    rows = RunDir.open(out).table("scan_rows").rows()
    keys = [(r["source"], r["pair"], r["layer"], r["head"]) for r in rows]
    assert len(keys) == len(set(keys)) == 4 * 2 * 2


@pytest.mark.parametrize("sig, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_interrupt_is_one_line_keeps_rows_and_the_rerun_completes(ckpt, tmp_path, sig, code):
    out = tmp_path / "scan"
    args = _scan_args(ckpt, out)
    done = subprocess.run([sys.executable, "-c", _SIGNALLED_CLI, sig, "3", *args], env=ENV, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == code, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last == f"interrupted after 3 rows (kept in {out}); rerun the same command to resume"
    assert len(_rows(out)) == 3
    rerun = subprocess.run([sys.executable, "-m", "recurscope.interp.cli", *args], env=ENV, capture_output=True,
                           text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    rows = _rows(out)
    assert len(rows) == 4 * 2 * 2 and not rows[["source", "pair", "layer", "head"]].duplicated().any()


def test_debug_keeps_the_interrupt_traceback(ckpt, tmp_path):
    done = subprocess.run([sys.executable, "-c", _SIGNALLED_CLI, "SIGINT", "1",
                           *_scan_args(ckpt, tmp_path / "scan"), "--debug"], env=ENV, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode != 0 and "Traceback" in done.stderr and "KeyboardInterrupt" in done.stderr


def test_run_lock_is_exclusive_and_released(tmp_path):
    first = RunLock(tmp_path).acquire()
    with pytest.raises(ValueError, match=f"pid {os.getpid()}"):
        RunLock(tmp_path).acquire()
    first.release()
    with RunLock(tmp_path):
        pass
