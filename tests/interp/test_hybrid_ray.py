"""`recurscope hybrid --ray local --workers 2`: one unit per source on two Ray workers, the driver the only writer of
the row log; the rows equal the in-process run's, each exactly once, and the manifest's work is the same (so either
run resumes the other)."""
import json

import numpy as np
import pandas as pd
import pytest

from recurscope.interp.cli import main
from recurscope.interp.results import RowLog

ARGS = ["hybrid", "tiny-gdn-hybrid", "--n-sources", "3", "--filler", "12", "--presentations", "2", "--gap", "4",
        "--resamples", "100", "--batch-size", "4"]
KEY = ["arm", "row"]


@pytest.fixture
def local_ray():
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()
    yield
    ray.shutdown()


@pytest.mark.slow
def test_ray_rows_equal_the_in_process_rows(tmp_path, local_ray):
    assert main([*ARGS, "--out", str(tmp_path / "local")]) == 0
    assert main([*ARGS, "--ray", "local", "--workers", "2", "--out", str(tmp_path / "ray")]) == 0
    raw = pd.DataFrame(RowLog(tmp_path / "ray" / "hybrid_rows.jsonl").rows())    # raw: duplicates would show here
    assert not raw[KEY].duplicated().any()
    local = pd.read_parquet(tmp_path / "local" / "hybrid_rows.parquet").sort_values(KEY).reset_index(drop=True)
    on_ray = pd.read_parquet(tmp_path / "ray" / "hybrid_rows.parquet").sort_values(KEY).reset_index(drop=True)
    assert len(on_ray) == len(local) == 3 * 3
    ids = ["arm", "row", "source", "pair", "variant", "clean_correct", "correct", "donor_answer"]
    pd.testing.assert_frame_equal(on_ray[ids], local[ids])
    for col in ("donor_margin_shift", "donor_specific_shift", "margin", "clean_margin"):
        assert np.allclose(on_ray[col], local[col], atol=1e-4), col
    work = lambda d: json.loads((tmp_path / d / "manifest.json").read_text())["args"]  # noqa: E731
    assert work("ray") == work("local") and "workers" not in work("ray")
