"""What a reader of the CLI's figures would stumble on, checked on the matplotlib objects at the saved size: row
names as the report writes them, units on every value axis, n and the interval level in the title, no multiplier
colliding with an axis label, rate axes that stop at 0% and 100%, readable limits for an all-equal (random-model)
panel, rows and panels without data said rather than blank, whole-number x ticks at the values measured, and
legends beside the data rather than on it."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from recurscope.interp import plots as P

ARMS = ("state_swap", "random_update", "control_head:state_swap")
LABELS = {"state_swap": "state swap", "random_update": "equal-norm random update",
          "control_head:state_swap": "control head, state swap"}


def _points(scale=1.0, shift=None, n=6):
    rows = []
    for i, arm in enumerate(ARMS):
        e = (shift if shift is not None else 1.5 * i) * scale
        rows.append({"arm": arm, "metric": "donor_margin_shift", "estimate": e, "low": e - 0.4 * scale,
                     "high": e + 0.4 * scale, "n_sources": n, "confidence": 0.95})
        rows.append({"arm": arm, "metric": "donor_answer", "estimate": 0.0, "low": 0.0, "high": 0.46,
                     "n_sources": n, "confidence": 0.95})
    return pd.DataFrame(rows)


def _draw(summary, tmp_path, **options):
    options = {"row_col": "arm", "rows": list(ARMS), "panels": ["donor_answer", "donor_margin_shift"],
               "percent": ["donor_answer"], "title": "tiny: selectivity", **options}
    result = P.plot_interval_panels(summary, tmp_path / "f", **options)
    assert P.overlapping_text(result.figure) == [], "labels overlap at the saved size"
    return result


def _visible_ticks(ax, axis="x"):
    lo, hi = sorted(ax.get_xlim() if axis == "x" else ax.get_ylim())
    ticks = ax.get_xticks() if axis == "x" else ax.get_yticks()
    return [t for t in ticks if lo - 1e-9 <= t <= hi + 1e-9]


def test_points_rows_are_the_reports_labels_with_controls_apart(tmp_path):
    result = _draw(_points(), tmp_path, row_labels=LABELS, controls=["random_update", "control_head:state_swap"])
    ax = result.figure.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == [LABELS[a] for a in ARMS]   # no "control head:state swap"
    assert [t.get_gid() for t in ax.texts] == ["controls-heading"]
    assert all(any(line.get_gid() == "controls-separator" for line in a.lines) for a in result.figure.axes)


def test_value_axes_carry_units_and_the_title_n_and_interval(tmp_path):
    result = _draw(_points(), tmp_path)
    share, shift = result.figure.axes
    assert share.get_xlabel() == "donor answers (%), 95%\u00a0CI"        # "95% CI" never split over two lines
    assert shift.get_xlabel() == "donor-margin shift (logits), 95%\u00a0CI"
    assert result.figure.get_suptitle() == "tiny: selectivity\nn = 6 sources, 95% intervals"


def test_a_rate_axis_stops_at_0_and_100_percent(tmp_path):
    share = _draw(_points(), tmp_path).figure.axes[0]
    lo, hi = share.get_xlim()
    assert -5 <= lo < 0 and 100 < hi <= 105                   # markers at 0% and 100% whole; no 104% tick
    assert min(_visible_ticks(share)) >= 0 and max(_visible_ticks(share)) <= 100


def test_an_all_equal_panel_gets_readable_ticks(tmp_path):
    """A random model moves nothing: every estimate 0 with a zero-width interval. Matplotlib's default limits are
    ±0.05, with ticks -0.04 ... 0.04 on an axis of logits or percentage points."""
    zero = _points(shift=0.0).assign(low=0.0, high=0.0)
    result = _draw(zero, tmp_path, panels=["donor_margin_shift"], percent=[])
    lo, hi = result.figure.axes[0].get_xlim()
    assert hi - lo >= 2.0


def test_a_tiny_scale_goes_into_the_axis_label(tmp_path):
    """Shifts of 1e-5 logits (random weights): matplotlib writes "1e-5" at the end of the axis, on the label."""
    result = _draw(_points(scale=1e-5), tmp_path)
    shift = result.figure.axes[1]
    assert not shift.xaxis.get_offset_text().get_visible()
    assert shift.get_xlabel().startswith("donor-margin shift (logits), 95%\u00a0CI\n[×1e")


def test_missing_rows_and_an_empty_panel_are_said(tmp_path):
    s = _points()
    s.loc[(s.arm == "random_update") & (s.metric == "donor_margin_shift"), ["estimate", "low", "high"]] = np.nan
    s.loc[(s.arm == "state_swap") & (s.metric == "donor_margin_shift"), ["estimate", "low", "high"]] = np.inf
    s.loc[s.metric == "donor_answer", ["estimate", "low", "high"]] = np.nan
    result = _draw(s, tmp_path)
    share, shift = result.figure.axes
    assert [t.get_gid() for t in shift.texts] == ["missing:state_swap", "missing:random_update"]
    assert "no-data" in [t.get_gid() for t in share.texts]
    assert np.isfinite(shift.get_xlim()).all()
    assert list(result.data["row"]) == ["control_head:state_swap"]
    assert result.figure.get_suptitle().endswith("n = 6 sources, 95% intervals")


def _lines(xs, tasks=("retention", "update")):
    rows = []
    for t, task in enumerate(tasks):
        for x in xs:
            e = 0.3 + 0.1 * t
            rows.append({"task": task, "k": x, "metric": "correct", "estimate": e, "low": e - 0.1, "high": e + 0.1,
                         "n_sources": 4, "confidence": 0.95})
    return pd.DataFrame(rows)


def test_lines_ticks_are_the_values_measured(tmp_path):
    result = P.plot_interval_panels(_lines([1, 2, 4, 8, 16], tasks=("a",)), tmp_path / "k", row_col="k", panels=["correct"],
                                    kind="lines", percent=["correct"], row_name="k (heads)")
    ax = result.figure.axes[0]
    assert ax.get_xscale() == "log" and list(_visible_ticks(ax)) == [1, 2, 4, 8, 16]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2", "4", "8", "16"]
    assert ax.get_xlabel() == "k (heads)"
    few = P.plot_interval_panels(_lines([1, 2], tasks=("a",)), tmp_path / "few", row_col="k", panels=["correct"], kind="lines")
    assert all(float(t).is_integer() for t in _visible_ticks(few.figure.axes[0]))
    assert P.overlapping_text(result.figure) == [] and P.overlapping_text(few.figure) == []


def test_lines_legend_sits_beside_the_data_and_missing_x_is_said(tmp_path):
    s = _lines([0, 1, 2, 3])
    s.loc[s.k == 3, ["estimate", "low", "high"]] = np.nan
    result = P.plot_interval_panels(s, tmp_path / "lens", row_col="k", panels=["correct"], kind="lines",
                                    hue_col="task", percent=["correct"], title="a model: logit lens")
    ax = result.figure.axes[0]
    assert ax.get_legend() is None and len(result.figure.legends) == 1
    legend_box = result.figure.legends[0].get_window_extent(result.figure.canvas.get_renderer())
    assert not legend_box.overlaps(ax.get_window_extent())
    assert [t.get_gid() for t in ax.texts] == ["missing:3"]
    assert P.overlapping_text(result.figure) == []


def test_effects_recall_markers_at_0_and_100_percent_are_whole(tmp_path):
    rows = []
    for arm in ("state_swap", "random_update"):
        rows.append({"model": "m", "intervention": arm, "metric": "donor_margin_shift", "estimate": 2e-6,
                     "low": 1e-6, "high": 3e-6, "n_sources": 4, "confidence": 0.95})
        for metric, e in (("clean_accuracy", 1.0), ("intervened_accuracy", 0.0)):
            rows.append({"model": "m", "intervention": arm, "metric": metric, "estimate": e,
                         "low": min(e, 0.51), "high": max(e, 0.49), "n_sources": 4, "confidence": 0.95})
    result = P.plot_intervention_effects(pd.DataFrame(rows), tmp_path / "effects", title="m: L0H1 on held-out")
    effect_ax, recall_ax = result.figure.axes[:2]
    lo, hi = recall_ax.get_xlim()
    assert lo < -0.02 and hi > 1.02
    assert result.figure.get_suptitle() == "m: L0H1 on held-out\nn = 4 sources, 95% intervals"
    assert "[×1e" in effect_ax.get_xlabel() and not effect_ax.xaxis.get_offset_text().get_visible()
    assert P.overlapping_text(result.figure) == []


def test_head_scan_says_its_unit_its_n_and_how_many_heads_a_rank_is_of(tmp_path):
    rows = [{"source": s, "layer": layer, "head": head, "score": 1e-6 * (layer + head + s)}
            for s in range(3) for layer in range(2) for head in range(3)]
    result = P.plot_head_scan(pd.DataFrame(rows), tmp_path / "scan", title="m: state-swap shift per head")
    colourbar = [ax for ax in result.figure.axes if ax.get_ylabel().startswith("mean")][0]
    assert colourbar.get_ylabel().startswith("mean score J(l, h) (logits)")
    assert "[×1e" in colourbar.get_ylabel()                                  # the 1e-6 scale, in the label
    rank_ax = [ax for ax in result.figure.axes if ax.get_ylabel().startswith("rank")][0]
    assert rank_ax.get_ylabel() == "rank of the selected head\n(1 = best of 6)"
    assert result.figure.get_suptitle() == "m: state-swap shift per head\nmean over n = 3 sources"
    assert P.overlapping_text(result.figure) == []


def test_headscan_figure_names_its_threshold_and_keeps_the_legend_off_the_points(tmp_path):
    per_head = pd.DataFrame([{"scan": scan, "layer": layer, "head": head, "J": 0.0}
                             for scan in ("write", "read") for layer in range(2) for head in range(2)])
    fig = _last_figure(tmp_path / "headscan", per_head, (0, 1))
    assert (tmp_path / "headscan.png").is_file()
    ax = fig.axes[0]
    assert ax.get_legend() is None and len(fig.legends) == 1
    names = [t.get_text() for t in fig.legends[0].get_texts()]
    assert names == ["heads (4)", "frozen head L0H1", "0.25-logit threshold"]
    assert fig.get_suptitle() == "m: held-out all-head scans\nmean over n = 5 sources"
    assert P.overlapping_text(fig) == []


def _last_figure(stem, per_head, chosen):
    """The Figure headscan._figure draws (it returns the PNG path only): caught from plots._save."""
    from recurscope.interp.protocols import headscan

    caught = []
    with pytest.MonkeyPatch.context() as mp:
        save = P._save
        mp.setattr(P, "_save", lambda fig, *a, **k: (caught.append(fig), save(fig, *a, **k))[1])
        headscan._figure(per_head, chosen, stem, "m", 5)
    return caught[-1]


def test_small_values_are_not_written_out_as_long_decimals(tmp_path):
    """A random model's shifts of 1e-4 logits: matplotlib's default writes ticks as "-0.000150"."""
    s = _lines([16, 32], tasks=("a",)).assign(metric="donor_margin_shift")
    s[["estimate", "low", "high"]] *= -5e-4
    s[["low", "high"]] = np.sort(s[["low", "high"]].to_numpy(), axis=1)
    result = P.plot_interval_panels(s, tmp_path / "gap", row_col="k", panels=["donor_margin_shift"], kind="lines")
    ax = result.figure.axes[0]
    assert max(len(t.get_text()) for t in ax.get_yticklabels()) <= 5
    assert "[×1e" in ax.get_ylabel()
    assert P.overlapping_text(result.figure) == []


def test_an_empty_panel_says_why_and_keeps_a_rate_axis(tmp_path):
    s = _points()
    s.loc[s.metric == "donor_answer", ["estimate", "low", "high"]] = np.nan
    result = _draw(s, tmp_path, missing_labels={a: "refused by the gate" for a in ARMS})
    share = result.figure.axes[0]
    (text,) = [t for t in share.texts if t.get_gid() == "no-data"]
    assert text.get_text() == "no data\n(refused by the gate)"
    assert share.get_xlim() == (-4.0, 104.0)                   # not matplotlib's 0-1 on a percent axis


def test_long_axis_labels_wrap_at_words(tmp_path):
    s = _lines([1, 2], tasks=("a",)).assign(metric="nontarget_break")
    result = P.plot_interval_panels(s, tmp_path / "r", row_col="k", panels=["nontarget_break"], kind="lines",
                                    percent=["nontarget_break"],
                                    panel_labels={"nontarget_break": "non-target break (mean of per-source rates)"})
    label = result.figure.axes[0].get_ylabel()
    assert "\n" in label and "per-source" in label
    assert P.overlapping_text(result.figure) == []


def test_an_end_value_without_data_is_inside_the_frame(tmp_path):
    s = _lines([1, 2, 4], tasks=("a",))
    s.loc[s.k == 4, ["estimate", "low", "high"]] = np.nan
    result = P.plot_interval_panels(s, tmp_path / "load", row_col="k", panels=["correct"], kind="lines",
                                    percent=["correct"])
    ax = result.figure.axes[0]
    lo, hi = ax.get_xlim()
    assert lo < 1 and hi > 4                                    # "n/a" at K = 4 not cut by the frame
    (na,) = [t for t in ax.texts if t.get_gid() == "missing:4"]
    renderer = result.figure.canvas.get_renderer()
    assert ax.get_window_extent(renderer).x1 >= na.get_window_extent(renderer).x1
    assert P.overlapping_text(result.figure) == []


def test_curves_follow_the_reports_order_and_names(tmp_path):
    s = _lines([2, 4], tasks=("aligned", "control_head:aligned", "orthogonal"))
    names = {"aligned": "aligned key", "orthogonal": "orthogonalised key",
             "control_head:aligned": "control head, aligned key"}
    result = P.plot_interval_panels(s, tmp_path / "o", row_col="k", panels=["correct"], kind="lines",
                                    hue_col="task", row_labels=names, percent=["correct"])
    assert [t.get_text() for t in result.figure.legends[0].get_texts()] == list(names.values())
    assert P.overlapping_text(result.figure) == []


def test_a_long_title_is_no_wider_than_the_figure(tmp_path):
    title = "/a/long/path/to/a/random-model: every format under the capability gate; no top-k recovery reported"
    result = _draw(_points(), tmp_path, panels=["donor_answer"], title=title)
    fig = result.figure
    renderer = fig.canvas.get_renderer()
    assert fig._suptitle.get_window_extent(renderer).width <= fig.bbox.width
    assert fig.get_suptitle().endswith("\nn = 6 sources, 95% intervals")
