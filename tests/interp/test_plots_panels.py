"""plot_interval_panels draws exactly the summary's numbers, in order, and refuses what it cannot draw."""
import pandas as pd
import pytest

from recurscope.interp.plots import overlapping_text, plot_interval_panels


def _summary():
    rows = []
    for task in ("a", "b"):
        for x in (2, 0, 1):                       # out of order on purpose
            for metric in ("acc", "shift"):
                e = 0.1 * x + (task == "b")
                rows.append({"task": task, "x": x, "metric": metric, "estimate": e, "low": e - 0.05, "high": e + 0.05})
    return pd.DataFrame(rows)


def test_lines_follow_x_and_keep_the_numbers(tmp_path):
    s = _summary()
    res = plot_interval_panels(s, tmp_path / "f", row_col="x", panels=["acc"], hue_col="task", kind="lines",
                               percent=["acc"])
    assert res.png.is_file() and res.svg.is_file()
    assert overlapping_text(res.figure) == []
    for task in ("a", "b"):
        got = res.data[res.data.hue == task]
        assert list(got["row"]) == [0, 1, 2]
        want = s[(s.task == task) & (s.metric == "acc")].set_index("x").loc[[0, 1, 2], "estimate"]
        assert list(got["estimate"]) == pytest.approx(list(want))


def test_points_and_errors(tmp_path):
    s = _summary()[lambda f: f.task == "a"]
    res = plot_interval_panels(s, tmp_path / "g", row_col="x", panels=["acc", "shift"], rows=[2, 1, 0])
    assert len(res.data) == 6
    assert overlapping_text(res.figure) == []
    with pytest.raises(ValueError, match="no rows for metrics"):
        plot_interval_panels(s, tmp_path / "h", row_col="x", panels=["missing"])
    bad = s.assign(low=s["estimate"] + 1)
    with pytest.raises(ValueError, match="outside"):
        plot_interval_panels(bad, tmp_path / "i", row_col="x", panels=["acc"])
