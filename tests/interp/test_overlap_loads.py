"""`recurscope overlap --n-facts K1 K2 ...`: the write-key overlap at several loads, each load's rows the same as a
run at that load alone, with a summary, table, figure and Reading per load."""
import pandas as pd
import pytest

from recurscope.interp.cli import main

TINY = ["--n-sources", "3", "--filler", "12", "--presentations", "2", "--gap", "4",
        "--gate-threshold", "0", "--resamples", "100",
        "--batch-size", "8", "--head", "0", "1"]


@pytest.mark.slow
def test_several_loads_equal_each_load_run_alone(tmp_path, capsys):
    both, alone = tmp_path / "both", tmp_path / "alone"
    assert main(["overlap", "tiny-gla", *TINY, "--n-facts", "2", "3", "--out", str(both)]) == 0
    assert main(["overlap", "tiny-gla", *TINY, "--n-facts", "3", "--out", str(alone)]) == 0
    rows = pd.read_parquet(both / "overlap_rows.parquet")
    assert sorted(rows["n_facts"].unique()) == [2, 3]
    key = ["arm", "row"]
    at3 = rows[rows.n_facts == 3].sort_values(key).reset_index(drop=True)
    ref = pd.read_parquet(alone / "overlap_rows.parquet").sort_values(key).reset_index(drop=True)
    pd.testing.assert_frame_equal(at3[ref.columns], ref, check_dtype=False)
    summary = pd.read_csv(both / "overlap_summary.csv")
    assert set(summary.groupby(["n_facts", "arm"]).size().index) == {(k, a) for k in (2, 3) for a in
                                                                    ("aligned", "orthogonal", "control_head:aligned")}
    report = (both / "report.md").read_text()
    assert "| 2 | aligned key" in report and "| 3 | aligned key" in report
    assert "at K = 2" in report and "at K = 3" in report
    assert (both / "figures" / "overlap.png").is_file()


def test_a_load_below_two_is_refused(tmp_path, capsys):
    assert main(["overlap", "tiny-gla", *TINY, "--n-facts", "0", "4", "--out", str(tmp_path / "x")]) == 2
    assert "--n-facts must be at least 1, got 0" in capsys.readouterr().err
    assert main(["overlap", "tiny-gla", *TINY, "--n-facts", "1", "4", "--out", str(tmp_path / "y")]) == 2
    assert "distinct loads of at least 2 facts" in capsys.readouterr().err
