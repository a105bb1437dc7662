"""Scans and confirmations on Ray (interp.distributed): a unit's rows equal the whole-batch rows (in-process, no
Ray), and on one shared local Ray cluster of 2 CPUs: scan --ray and confirm --ray equal the single-process scan and
confirmation row for row, a worker killed mid-unit is replaced and its unit retried, a driver SIGKILLed mid-run
resumes with every row exactly once. Without Ray, --ray says how to install it; under --ray the driver loads on the
CPU and ships the checkpoint's absolute path (stand-ins, no GPU or Ray)."""
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from recurscope.interp import distributed as dist
from recurscope.interp.cli import main
from recurscope.interp.confirm import ARMS, run_confirm
from recurscope.interp.data import build_pairs
from recurscope.interp.interventions import choose_control_heads
from recurscope.interp.loading import load_model
from recurscope.interp.results import RowLog, RunDir
from recurscope.interp.scan import SCAN_KEY, all_heads, run_scan
from tests.cli.test_cli import GATE_OFF, SMALL

ROOT = Path(__file__).resolve().parents[2]
PAIRS = dict(n_facts=2, presentations=2, filler_tokens=12)
KEY = list(SCAN_KEY)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, tiny_checkpoint):
    return tiny_checkpoint(tmp_path_factory.mktemp("distributed") / "ckpt")


def _pairs(model, n_sources=4, split="dev"):
    return build_pairs(model.tokenizer, split=split, n_sources=n_sources, **PAIRS)


def _sorted(frame, key):
    return frame.sort_values(key, kind="stable").reset_index(drop=True)


def _assert_same_rows(got, want, key, value_cols):
    got, want = _sorted(got, key), _sorted(want, key)
    assert got[key].equals(want[key].astype(got[key].dtypes.to_dict()))
    for col in value_cols:
        np.testing.assert_allclose(got[col].to_numpy(float), want[col].to_numpy(float), rtol=1e-5, atol=1e-5,
                                   equal_nan=True, err_msg=col)


# ---- without Ray: units partition the work and compute the whole batch's rows ---------------------------------


def test_units_cover_the_work_once_and_skip_what_is_done(ckpt):
    model = load_model(ckpt)
    pairs = _pairs(model)
    heads = all_heads(model)
    units = dist.scan_units(pairs, heads, head_block=3, workers=2)
    keys = [(u.source, int(pairs.group[i]), *h) for u in units for i in u.rows for h in u.heads]
    assert len(keys) == len(set(keys)) == 4 * len(heads)          # one target row per source here
    assert all(len(u.heads) <= 3 for u in units)
    # whole sources by default when there are >= 2 units per worker; split heads otherwise
    assert all(len(u.heads) == len(heads) for u in dist.scan_units(pairs, heads, workers=2))
    assert len(dist.scan_units(pairs, heads, workers=4)) == 8
    done = frozenset(keys[:5])
    left = [(u.source, int(pairs.group[i]), *h) for u in dist.scan_units(pairs, heads, head_block=3, workers=2,
                                                                          done=done) for i in u.rows for h in u.heads]
    assert sorted(left) == sorted(set(keys) - done)
    confirm = dist.confirm_units(pairs, ARMS, done=frozenset(("write_block", i) for i in range(len(pairs))))
    assert {u.arm for u in confirm} == set(ARMS) - {"write_block"}


def test_unit_rows_equal_the_whole_batch_rows_in_process(ckpt):
    """The worker's code run here, without Ray: scan units and confirmation units (the random control included,
    which is seeded by the row's index in the whole batch) reproduce run_scan and run_confirm."""
    model = load_model(ckpt)
    worker = dist.UnitWorker(lambda: model, _pairs(model, n_sources=3, split="heldout"))
    pairs = worker.pairs
    heads = all_heads(model)
    scan_rows = [r for u in dist.scan_units(pairs, heads, head_block=3) for r in worker.scan(u, 4, 2)]
    _assert_same_rows(pd.DataFrame(scan_rows), run_scan(model, pairs, batch_size=4).rows, KEY + ["row"],
                      ["clean_margin", "margin", "shift"])
    chosen = [(0, 1)]
    unit_rows = [r for u in dist.confirm_units(pairs, ARMS) for r in worker.confirm(u, chosen, None, 3, 8)]
    whole = run_confirm(model, pairs, chosen, seed=3, batch_size=8, n_resamples=100).rows
    _assert_same_rows(pd.DataFrame(unit_rows), whole, ["intervention", "row", "source", "pair"],
                      ["clean_margin", "margin", "donor_margin_shift", "target_margin_change", "correct"])


def test_out_of_memory_names_the_unit_and_the_setting(ckpt):
    model = load_model(ckpt)

    def out_of_memory(module, args):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    model.blocks[-1].register_forward_pre_hook(out_of_memory)
    worker = dist.UnitWorker(lambda: model, _pairs(model, n_sources=2))
    unit = dist.scan_units(worker.pairs, all_heads(model))[1]
    with pytest.raises(dist.UnitOutOfMemory, match=r"source \d+, heads L0H0..L1H1 \(4 heads\)\) ran out of GPU "
                                                     r"memory .*lower --batch-size \(now 96\)"):
        worker.scan(unit, 96, 4)
    unit = dist.confirm_units(worker.pairs, ["state_swap"])[0]
    with pytest.raises(dist.UnitOutOfMemory, match=r"arm state_swap\) ran out of GPU memory .*--batch-size \(now 8\)"):
        worker.confirm(unit, [(0, 1)], None, 0, 8)


def test_model_spec_makes_a_relative_checkpoint_path_absolute(ckpt, tmp_path, monkeypatch):
    """Workers run in their own working directory: a relative path must reach them absolute (and still load
    there), while a bundled name stays a name."""
    monkeypatch.chdir(ckpt.parent)
    spec = dist.ModelSpec(ckpt.name, dtype="float32")
    assert spec.path == str(ckpt.resolve())
    monkeypatch.chdir(tmp_path)                                   # a worker's directory: no `ckpt` here
    shipped = pickle.loads(pickle.dumps(spec))
    assert shipped == spec
    model = shipped()
    assert model.checkpoint_dir.resolve() == ckpt.resolve()
    assert dist.ModelSpec("tiny-gla").path == "tiny-gla"


@pytest.mark.slow  # end to end
def test_ray_driver_loads_on_the_cpu_and_workers_get_the_device(ckpt, tmp_path, monkeypatch):
    """`run --ray --device cuda` (scan and confirm): the driver's own load is asked for the CPU, the workers' model
    spec carries --device and the checkpoint's absolute path. No GPU or Ray needed: the device check, Ray and the
    Ray runs are stood in for (the stand-ins compute in process, so the commands finish as they would)."""
    from recurscope.interp import cli, loading

    real_load = loading.load_model
    driver_devices, specs = [], []

    def driver_load(path, device="cpu", dtype=None, **kwargs):
        driver_devices.append(str(device))
        return real_load(path, device="cpu", dtype=dtype, **kwargs)

    def scan_ray(spec, pairs, heads, run_dir=None, *, batch_size, **kwargs):
        specs.append(spec)
        return run_scan(real_load(spec.path), pairs, run_dir=run_dir, batch_size=batch_size, heads=heads), None

    def confirm_ray(spec, pairs, heads, controls, run_dir=None, *, scan_heads, seed, batch_size, **kwargs):
        specs.append(spec)
        return run_confirm(real_load(spec.path), pairs, heads, run_dir=run_dir, scan_heads=scan_heads, seed=seed,
                           batch_size=batch_size, n_resamples=100), None

    monkeypatch.setattr(cli, "_check_device", lambda spec: None)
    monkeypatch.setattr(dist, "require_ray", lambda: None)
    monkeypatch.setattr(loading, "load_model", driver_load)
    monkeypatch.setattr(dist, "run_scan_ray", scan_ray)
    monkeypatch.setattr(dist, "run_confirm_ray", confirm_ray)
    monkeypatch.chdir(ckpt.parent)
    assert main(["run", ckpt.name, "--n-dev", "2", "--n-heldout", "2", "--pairs-per-source", "1", *SMALL, *GATE_OFF,
                 "--device", "cuda", "--out", str(tmp_path / "run"), "--ray"]) == 0
    assert driver_devices == ["cpu", "cpu"]                       # scan's driver, confirm's driver
    assert [(s.path, s.device, s.dtype) for s in specs] == [(str(ckpt.resolve()), "cuda", "float32")] * 2


def test_ray_missing_gives_the_install_command(ckpt, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)                 # `import ray` now raises ImportError
    code = main(["scan", str(ckpt), "--n-sources", "2", "--out", str(tmp_path / "scan"), *SMALL, "--ray"])
    err = capsys.readouterr().err
    assert code == 2
    assert "Ray, which is not installed" in err and "pip install 'recurscope[distributed]'" in err
    assert not (tmp_path / "scan").exists()                       # refused before any work


# ---- on one local Ray cluster shared by the tests below -------------------------------------------------------


@pytest.fixture(scope="module")
def ray_address():
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()
    dist.connect(num_cpus=2)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.mark.slow
def test_ray_scan_equals_single_process_scan(ckpt, ray_address, tmp_path):
    args = [str(ckpt), "--n-sources", "4", "--pairs-per-source", "1", *SMALL, *GATE_OFF]
    assert main(["scan", *args, "--out", str(tmp_path / "local")]) == 0
    assert main(["scan", *args, "--out", str(tmp_path / "ray"), "--ray", ray_address, "--workers", "2",
                 "--head-block", "2"]) == 0
    local = RunDir.open(tmp_path / "local").table("scan_rows").read()
    on_ray = RowLog(tmp_path / "ray" / "scan_rows.jsonl").rows()
    on_ray = pd.DataFrame(on_ray)
    assert not on_ray[KEY].duplicated().any() and len(on_ray) == len(local) == 4 * 4
    _assert_same_rows(on_ray, local, KEY + ["row", "boundary"], ["clean_margin", "margin", "shift"])
    heads_local = pd.read_csv(tmp_path / "local" / "scan_heads.csv")
    heads_ray = pd.read_csv(tmp_path / "ray" / "scan_heads.csv")
    assert heads_local[["layer", "head"]].equals(heads_ray[["layer", "head"]])


CONFIRM_VALUES = ["clean_margin", "margin", "donor_margin_shift", "target_margin_change", "correct"]


@pytest.mark.slow
def test_ray_confirm_equals_single_process_confirm(ckpt, ray_address, tmp_path):
    args = [str(ckpt), "--pairs-per-source", "1", *SMALL, *GATE_OFF]
    assert main(["scan", *args, "--n-sources", "2", "--out", str(tmp_path / "scan")]) == 0
    confirm = ["confirm", *args, "--n-sources", "3", "--from-scan", str(tmp_path / "scan")]
    assert main([*confirm, "--out", str(tmp_path / "local")]) == 0
    assert main([*confirm, "--out", str(tmp_path / "ray"), "--ray", ray_address, "--workers", "2"]) == 0
    local = RunDir.open(tmp_path / "local").table("confirm_rows").read()
    on_ray = pd.DataFrame(RowLog(tmp_path / "ray" / "confirm_rows.jsonl").rows())    # raw: duplicates show here
    key = ["intervention", "row"]
    assert not on_ray[key].duplicated().any() and len(on_ray) == len(local) == len(ARMS) * 3
    _assert_same_rows(on_ray, local, key + ["source", "pair"], CONFIRM_VALUES)
    summary = [pd.read_csv(tmp_path / d / "confirm_summary.csv") for d in ("local", "ray")]
    _assert_same_rows(summary[1], summary[0], ["intervention", "metric"], ["estimate", "low", "high"])


@dataclass(frozen=True)
class DiesMidUnit:
    """A model factory whose model kills its own worker process at the `after`-th call of its last block (which
    every pass of the model runs), in whichever worker gets there first (the marker file makes it happen once)."""

    path: str
    marker: str
    after: int

    def __call__(self):
        model = load_model(self.path)
        calls = [0]

        def maybe_die(module, args):
            calls[0] += 1
            if calls[0] == self.after:
                try:
                    os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))
                except FileExistsError:
                    return
                os._exit(1)
        model.blocks[-1].register_forward_pre_hook(maybe_die)
        return model


@pytest.mark.slow
def test_killed_worker_is_replaced_and_its_unit_retried(ckpt, ray_address, tmp_path):
    model = load_model(ckpt)
    pairs = _pairs(model)
    run = RunDir.create(tmp_path / "scan", kind="scan", model_name="tiny")
    # Imported under its package name, so that workers can unpickle it (pytest imports this file by basename).
    from tests.interp.test_distributed import DiesMidUnit

    factory = DiesMidUnit(str(ckpt), str(tmp_path / "died"), after=3)   # mid-unit: after prefix and clean suffix
    result, stats = dist.run_scan_ray(factory, pairs, all_heads(model), run, batch_size=1, head_block=2,
                                      workers=2)
    assert (tmp_path / "died").exists()
    assert stats.retried_units >= 1 and stats.actors_started == 3
    rows = pd.DataFrame(run.table("scan_rows").rows())
    assert not rows[KEY].duplicated().any() and len(rows) == 4 * 4
    _assert_same_rows(rows, run_scan(model, pairs).rows, KEY, ["shift"])


@dataclass(frozen=True)
class WaitsAtRowCount:
    """A model factory whose model blocks every pass (at its last block) once the run's row log holds `rows` rows, until
    the `gate` file exists: the driver is then mid-run with rows on disk and work in flight, whatever the load."""

    path: str
    log: str
    rows: int
    gate: str

    def __call__(self):
        model = load_model(self.path)

        def wait(module, args):
            while not os.path.exists(self.gate) and len(RowLog(self.log).rows()) >= self.rows:
                time.sleep(0.05)
        model.blocks[-1].register_forward_pre_hook(wait)
        return model


DRIVER = """
import sys
from recurscope.interp import distributed as dist
from recurscope.interp.data import build_pairs
from recurscope.interp.loading import load_model
from recurscope.interp.results import RunDir
from recurscope.interp.scan import all_heads
from tests.interp.test_distributed import PAIRS, WaitsAtRowCount

ckpt, out, address, gate = sys.argv[1:]
model = load_model(ckpt)
pairs = build_pairs(model.tokenizer, split="dev", n_sources=4, **PAIRS)
run = RunDir.create_or_open(out, kind="scan", model_name="tiny", args={"n_sources": 4})
factory = WaitsAtRowCount(ckpt, out + "/scan_rows.jsonl", 4, gate)
dist.run_scan_ray(factory, pairs, all_heads(model), run, batch_size=1, head_block=1, workers=1, address=address)
"""


@pytest.mark.slow
def test_sigkilled_driver_resumes_without_duplicates_or_gaps(ckpt, ray_address, tmp_path):
    out, gate = tmp_path / "scan", tmp_path / "gate"
    cmd = [sys.executable, "-c", textwrap.dedent(DRIVER), str(ckpt), str(out), ray_address, str(gate)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    log = RowLog(out / "scan_rows.jsonl")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 240
    while proc.poll() is None and len(log.rows()) < 4 and time.time() < deadline:
        time.sleep(0.1)
    assert proc.poll() is None, f"the driver ended before the kill: {proc.stderr.read().decode()[-2000:]}"
    assert len(log.rows()) >= 4
    proc.send_signal(signal.SIGKILL)                              # workers are held: this is mid-run
    proc.wait()
    before = len(log.rows())
    assert 4 <= before < 16
    gate.touch()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = pd.DataFrame(log.rows())                               # raw log: duplicates would show here
    assert not rows[KEY].duplicated().any() and len(rows) == 16
    model = load_model(ckpt)
    _assert_same_rows(rows, run_scan(model, _pairs(model)).rows, KEY, ["shift"])
    assert (out / "scan_heads.csv").is_file()
