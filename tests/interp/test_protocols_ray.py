"""Protocol verbs under `--ray local --workers 2`: hybrid (one unit per source), neutral and selectivity (one unit
per (source, arm)) on two Ray workers, the driver the only writer of the row log; the rows equal the in-process run's, each exactly
once, and the manifest's work is the same (so either run resumes the other)."""
import json

import numpy as np
import pandas as pd
import pytest

from recurscope.interp.cli import main
from recurscope.interp.results import RowLog

TINY = ["--n-sources", "3", "--filler", "12", "--presentations", "2", "--gap", "4", "--resamples", "100",
        "--batch-size", "4"]
VERBS = {"hybrid": ["hybrid", "tiny-gdn-hybrid", *TINY],
         "neutral": ["neutral", "tiny-gla", "--head", "0", "1", *TINY],
         "selectivity": ["selectivity", "tiny-gla", "--head", "0", "1", *TINY]}
ROWS = {"hybrid": 3 * 3, "neutral": 2 * 3 * 4, "selectivity": 6 * 3 * 4}   # arms x sources x rows per source
KEY = ["arm", "row"]


@pytest.fixture
def local_ray():
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()
    yield
    ray.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("verb", list(VERBS))
def test_ray_rows_equal_the_in_process_rows(verb, tmp_path, local_ray):
    args = VERBS[verb]
    assert main([*args, "--out", str(tmp_path / "local")]) == 0
    assert main([*args, "--ray", "local", "--workers", "2", "--out", str(tmp_path / "ray")]) == 0
    raw = pd.DataFrame(RowLog(tmp_path / "ray" / f"{verb}_rows.jsonl").rows())    # raw: duplicates would show here
    assert not raw[KEY].duplicated().any()
    local = pd.read_parquet(tmp_path / "local" / f"{verb}_rows.parquet").sort_values(KEY).reset_index(drop=True)
    on_ray = pd.read_parquet(tmp_path / "ray" / f"{verb}_rows.parquet").sort_values(KEY).reset_index(drop=True)
    assert len(on_ray) == len(local) == ROWS[verb]
    ids = ["arm", "row", "source", "pair", "variant", "clean_correct", "correct"]
    pd.testing.assert_frame_equal(on_ray[ids], local[ids])
    for col in ("donor_margin_shift", "donor_specific_shift", "margin", "clean_margin", "target_margin_change"):
        assert np.allclose(on_ray[col], local[col], atol=1e-4, equal_nan=True), col
    work = lambda d: json.loads((tmp_path / d / "manifest.json").read_text())["args"]  # noqa: E731
    assert work("ray") == work("local") and "workers" not in work("ray")
