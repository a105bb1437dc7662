"""Every documented --dtype runs (issue 42): float64 through the exact scan, the attribution scan, natural lengths
and the confirmation, with the capability gate on (its clean run filled a float32 buffer with float64 logits:
"Index put requires the source and destination dtypes match"). The float64 scan's J must agree with float32's."""
import json

import pandas as pd
import pytest

from recurscope.interp.cli import main

pytestmark = pytest.mark.slow
SMALL = ["--n-facts", "2", "--presentations", "2", "--filler", "12", "--n-sources", "2", "--batch-size", "8"]


@pytest.fixture(scope="module")
def scans(tmp_path_factory):
    root = tmp_path_factory.mktemp("dtypes")
    for dtype in ("float32", "float64"):
        assert main(["scan", "tiny-gla", "--out", str(root / dtype), *SMALL, "--dtype", dtype]) == 0
    return root


def _J(out):
    return pd.read_csv(out / "scan_heads.csv").set_index(["layer", "head"])["J"].sort_index()


def test_float64_scan_agrees_with_float32(scans):
    j32, j64 = _J(scans / "float32"), _J(scans / "float64")
    assert json.loads((scans / "float64" / "gate.json").read_text())["passed"]
    assert (j64 - j32).abs().max() < 1e-3 * max(1.0, j32.abs().max())


@pytest.mark.parametrize("extra", [["--method", "attribution", "--confirm-top", "2"], ["--lengths", "natural"]],
                         ids=["attribution", "natural"])
def test_float64_scan_variants(scans, tmp_path, extra):
    assert main(["scan", "tiny-gla", "--out", str(tmp_path / "s"), *SMALL, "--dtype", "float64", *extra]) == 0
    top = _J(tmp_path / "s")
    assert top.idxmax() == _J(scans / "float64").idxmax()     # the same winner as the exact equal-length scan


@pytest.mark.parametrize("extra", [[], ["--lengths", "natural"]], ids=["equal", "natural"])
def test_float64_confirm(scans, tmp_path, extra):
    assert main(["confirm", "tiny-gla", "--from-scan", str(scans / "float64"), "--out", str(tmp_path / "c"), *SMALL,
                 "--dtype", "float64", *extra]) == 0
    summary = pd.read_csv(tmp_path / "c" / "confirm_summary.csv")
    assert summary["estimate"].notna().any()
