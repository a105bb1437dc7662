"""Every protocol verb whose units are independent, under `--ray local --workers 2`: its units (sources, arms, loads,
conditions, formats, heads, filler lengths, top-k swaps) run on two Ray workers, the driver the only writer of the row logs; the
finished per-row table equals the in-process run's, row for row, each row logged once, and the manifest's work is
the same (so either run resumes the other). One Ray instance serves every case (start-up is slow)."""
import json

import numpy as np
import pandas as pd
import pytest

from recurscope.interp.cli import main
from recurscope.interp.protocols.verbs import TABLE
from recurscope.interp.results import RowLog

TINY = ["--n-sources", "3", "--filler", "12", "--presentations", "2", "--gap", "4",
        "--gate-threshold", "0", "--resamples", "100",
        "--batch-size", "4"]
HEAD = ["--head", "0", "1"]
VERBS = {
    "hybrid": ["tiny-gdn-hybrid", *TINY],
    "neutral": ["tiny-gla", *HEAD, *TINY],
    "selectivity": ["tiny-gla", *HEAD, *TINY],
    "coupling": ["tiny-gla", *HEAD, *TINY],
    "heads": ["tiny-gla", *TINY, "--n-dev", "2"],
    "headscan": ["tiny-gla", *HEAD, *TINY],
    "lens": ["tiny-gla", *TINY, "--n-localise", "2"],
    "gate": ["tiny-gla", "--n-sources", "3", "--fillers", "8", "16", "--resamples", "100", "--batch-size", "4"],
    "capacity": ["tiny-gla", *HEAD, "--n-sources", "2", "--loads", "1", "2", "--gaps", "8", "16", "--total-length",
                 "120", "--gate-threshold", "0", "--resamples", "100", "--batch-size", "4"],
    "overlap": ["tiny-gla", *HEAD, *TINY, "--n-facts", "2", "4"],
    "retention": ["tiny-gla", *HEAD, "--n-sources", "2", "--loads", "1", "2", "--total-length", "200",
                  "--n-nontarget", "1", "--gate-threshold", "0", "--resamples", "100", "--batch-size", "4"],
    "reuse": ["tiny-gla", *HEAD, "--n-sources", "2", "--n-fit", "2", "--filler", "16", "--formats", "template:is_in",
              "update:is_in", "--gate-threshold", "0", "--resamples", "100", "--batch-size", "4"],
    "topk": ["tiny-gla", *TINY, "--n-dev", "2", "--no-gate"],
}
#: Verbs whose Ray units are sources of a batched in-process computation (the rest: whole arms, loads, heads, ...).
SOURCE_UNITS = {"hybrid", "neutral", "selectivity"}
#: Each verb's row logs and their keys (lens and gate keep no row log: their units are few and short).
LOGS = {"hybrid": {"hybrid_rows": ["arm", "row"]}, "neutral": {"neutral_rows": ["arm", "row"]},
        "selectivity": {"selectivity_rows": ["arm", "row"]},
        "coupling": {"coupling_rows": ["pair", "fact_b", "arm"]}, "heads": {"heads_rows": ["arm", "row"]},
        "headscan": {"write_scan_rows": ["layer", "head", "row"],
                     "read_scan_rows": ["source", "pair", "layer", "head"]},
        "lens": {}, "gate": {}, "capacity": {"capacity_rows": ["arm", "row"]},
        "overlap": {"overlap_rows": ["n_facts", "arm", "row"]}, "retention": {"retention_rows": ["arm", "row"]},
        "reuse": {"reuse_rows": ["arm", "row"], "subspace_rows": ["arm", "row"]},
        "topk": {"topk_rows": ["arm", "row"]}}


def test_every_verb_with_independent_units_takes_ray_and_the_rest_say_why_not():
    assert {name for name, verb in TABLE.items() if verb.ray} == set(VERBS)
    for name, verb in TABLE.items():
        assert verb.ray != bool(verb.serial), name          # a verb without --ray says why in its --help


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING", _node_ip_address="127.0.0.1")
    yield
    ray.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("verb", list(VERBS))
def test_ray_rows_equal_the_in_process_rows(verb, tmp_path, local_ray):
    args = [verb, *VERBS[verb]]
    assert main([*args, "--out", str(tmp_path / "local")]) == 0
    assert main([*args, "--ray", "local", "--workers", "2", "--out", str(tmp_path / "ray")]) == 0
    for table, key in LOGS[verb].items():                  # raw logs: a unit written twice would show here
        raw = pd.DataFrame(RowLog(tmp_path / "ray" / f"{table}.jsonl").rows())
        assert len(raw) and not raw[key].duplicated().any(), table
    local = pd.read_parquet(tmp_path / "local" / f"{verb}_rows.parquet")
    on_ray = pd.read_parquet(tmp_path / "ray" / f"{verb}_rows.parquet")
    assert len(local) > 0 and list(on_ray.columns) == list(local.columns)
    # Units of whole arms, conditions, loads, formats, heads or pairs compute what the in-process run computes, batch
    # for batch: their rows are equal exactly. Where a unit is one source of a batched computation (hybrid, neutral,
    # selectivity, headscan's read scan), its batches group other rows, so the floats agree to tolerance (as
    # scan --ray); which rows, and every count and answer, still exactly.
    tolerant = pd.Series(verb in SOURCE_UNITS, index=local.index)
    if verb == "headscan":
        tolerant = local["scan"] == "read"
    pd.testing.assert_frame_equal(on_ray[~tolerant], local[~tolerant])
    floats = [c for c in local.columns if local[c].dtype.kind == "f"]
    pd.testing.assert_frame_equal(on_ray.loc[tolerant].drop(columns=floats), local.loc[tolerant].drop(columns=floats))
    for col in floats:
        assert np.allclose(on_ray.loc[tolerant, col], local.loc[tolerant, col], atol=1e-4, equal_nan=True), col
    work = lambda d: json.loads((tmp_path / d / "manifest.json").read_text())["args"]  # noqa: E731
    assert work("ray") == work("local") and "workers" not in work("ray") and "ray" not in work("ray")
