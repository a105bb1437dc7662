"""Tests for interp.plots: files are valid PNG/SVG, and the numbers drawn (read back from the matplotlib artists)
are the numbers given, computed independently where the plot derives them (means, ranks, binomial intervals)."""
from __future__ import annotations

import xml.etree.ElementTree as ET

import matplotlib.image as mpimg
import numpy as np
import pandas as pd
import pytest
from matplotlib.container import ErrorbarContainer
from matplotlib.patches import Rectangle
from scipy import stats as sps

from recurscope.interp import plots as P

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _check_files(result):
    assert result.png.exists() and result.svg.exists()
    assert result.png.read_bytes()[:8] == PNG_MAGIC
    image = mpimg.imread(result.png)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    root = ET.parse(result.svg).getroot()
    assert root.tag.endswith("svg")
    assert P.overlapping_text(result.figure) == [], "labels overlap at the saved size"


def _errorbars(ax):
    """(x, y, low_or_left segments) for every error-bar container on an axes."""
    out = []
    for container in ax.containers:
        if isinstance(container, ErrorbarContainer):
            line, _, bars = container.lines
            segments = bars[0].get_segments()
            out.append((np.asarray(line.get_xdata(), float), np.asarray(line.get_ydata(), float), segments,
                        line))
    return out


def _summary():
    rng = np.random.default_rng(0)
    rows = []
    for model in ("GLA-340M", "GDN-340M", "GDN-1.3B"):
        for intervention in reversed(P.INTERVENTION_ORDER):  # given out of order on purpose
            est = rng.normal()
            rows.append({"model": model, "intervention": intervention, "metric": "donor_margin_shift",
                         "estimate": est, "low": est - rng.uniform(0.1, 0.5), "high": est + rng.uniform(0.1, 0.5)})
            for metric, acc in (("clean_accuracy", 0.93), ("intervened_accuracy", rng.uniform(0.1, 0.6))):
                rows.append({"model": model, "intervention": intervention, "metric": metric, "estimate": acc,
                             "low": acc - 0.05, "high": min(1.0, acc + 0.04)})
    return pd.DataFrame(rows)


def test_intervention_effects_draws_the_summary(tmp_path):
    summary = _summary()
    result = P.plot_intervention_effects(summary, tmp_path / "fig3.png")
    assert result.png == tmp_path / "fig3.png" and result.svg == tmp_path / "fig3.svg"
    _check_files(result)
    effect_ax, accuracy_ax = result.figure.axes[:2]
    labels = [t.get_text() for t in effect_ax.get_yticklabels()]
    from recurscope.interp.interventions import REGISTRY

    # Paper row order, the interventions above their controls, each row named as the report names it.
    assert labels == [i.label for i in REGISTRY if not i.is_control] + [i.label for i in REGISTRY if i.is_control]
    bars = _errorbars(effect_ax)
    assert len(bars) == 3
    effect = summary[summary.metric == "donor_margin_shift"].set_index(["model", "intervention"])
    for (x, y, segments, line), model in zip(bars, ["GLA-340M", "GDN-340M", "GDN-1.3B"]):
        expected = effect.loc[model].loc[list(P.INTERVENTION_ORDER)]
        np.testing.assert_allclose(x, expected["estimate"])
        np.testing.assert_allclose([s[0][0] for s in segments], expected["low"])
        np.testing.assert_allclose([s[1][0] for s in segments], expected["high"])
        np.testing.assert_array_less(np.abs(y - np.round(y)), 0.31)  # dodged around each intervention row
    accuracy_bars = _errorbars(accuracy_ax)
    assert len(accuracy_bars) == 6  # clean and intervened per model
    drawn = sorted(np.concatenate([b[0] for b in accuracy_bars]))
    given = sorted(summary[summary.metric != "donor_margin_shift"]["estimate"])
    np.testing.assert_allclose(drawn, given)
    data = result.data[result.data.panel == "effect"].set_index(["model", "intervention"])
    pd.testing.assert_series_equal(data["estimate"].sort_index(), effect["estimate"].sort_index(),
                                   check_names=False)


def test_intervention_effects_without_accuracy_and_bad_input(tmp_path):
    summary = _summary()
    only_effects = summary[summary.metric == "donor_margin_shift"]
    result = P.plot_intervention_effects(only_effects, tmp_path / "effects")
    _check_files(result)
    assert len([ax for ax in result.figure.axes if ax.containers]) == 1
    with pytest.raises(ValueError, match="donor_margin_shift"):
        P.plot_intervention_effects(summary[summary.metric != "donor_margin_shift"], tmp_path / "x")
    broken = only_effects.copy()
    broken.loc[broken.index[0], "low"] = broken["estimate"].iloc[0] + 1
    with pytest.raises(ValueError, match="outside"):
        P.plot_intervention_effects(broken, tmp_path / "y")


def test_head_scan_heatmap_and_ranks(tmp_path):
    rng = np.random.default_rng(1)
    rows = [{"source": s, "layer": layer, "head": head, "score": rng.normal() + (2.5 if (layer, head) == (5, 3) else 0)}
            for s in range(8) for layer in range(6) for head in range(4)]
    scores = pd.DataFrame(rows)
    result = P.plot_head_scan(scores, tmp_path / "scan")
    _check_files(result)
    heat_ax = result.figure.axes[0]
    drawn = np.asarray(heat_ax.images[0].get_array())
    expected = np.zeros((6, 4))
    for (layer, head), value in scores.groupby(["layer", "head"])["score"].mean().items():
        expected[layer, head] = value
    np.testing.assert_allclose(drawn, expected)
    boxes = [p for p in heat_ax.patches if isinstance(p, Rectangle) and p.get_gid() == "selected"]
    assert len(boxes) == 1 and boxes[0].get_xy() == (3 - 0.5, 5 - 0.5)  # column = head 3, row = layer 5
    rank_line = [line for ax in result.figure.axes for line in ax.lines if line.get_gid() == "ranks"][0]
    per_source = scores.pivot_table(index="source", columns=["layer", "head"], values="score")
    expected_ranks = sps.rankdata(-per_source.to_numpy(), axis=1, method="min")[:, list(per_source.columns).index((5, 3))]
    np.testing.assert_array_equal(rank_line.get_ydata(), expected_ranks)
    chosen = P.plot_head_scan(scores, tmp_path / "scan2", selected=(0, 1))
    assert bool(chosen.data.query("kind == 'mean' and layer == 0 and head == 1")["selected"].item())
    with pytest.raises(ValueError, match="selected head"):
        P.plot_head_scan(scores, tmp_path / "scan3", selected=(9, 9))


def test_head_scan_of_some_heads_hatches_the_rest_and_only_when_asked(tmp_path):
    """An attribution scan's exact top K covers some heads of a layer: partial=True draws the others hatched and
    uncoloured (never as a zero J); without it the partial grid is refused (issue 39: the README's
    `scan --method attribution --confirm-top 3` exited 2 here)."""
    scores = pd.DataFrame([{"source": s, "layer": layer, "head": head, "score": 1.0 + layer + head}
                           for s in range(3) for layer, head in [(0, 1), (1, 0), (1, 1)]])
    with pytest.raises(ValueError, match="full layer"):
        P.plot_head_scan(scores, tmp_path / "refused")
    result = P.plot_head_scan(scores, tmp_path / "scan", partial=True)
    _check_files(result)
    heat_ax = result.figure.axes[0]
    drawn = np.ma.getmaskarray(heat_ax.images[0].get_array())
    np.testing.assert_array_equal(drawn, [[True, False], [False, False]])   # L0H0 not scanned: masked, no colour
    hatched = [p.get_gid() for p in heat_ax.patches if str(p.get_gid()).startswith("unscanned:")]
    assert hatched == ["unscanned:0:0"]
    selected = [p for p in heat_ax.patches if p.get_gid() == "selected"]
    assert selected[0].get_xy() == (1 - 0.5, 1 - 0.5)                      # L1H1, the largest J


def _accuracy_table():
    rng = np.random.default_rng(2)
    rows = []
    for seed in (0, 1):
        for arm, p in (("gdn2", 0.5), ("qed", 0.7), ("qed_rand", 0.6)):
            for length in (1024, 2048, 4096, 8192):
                hits = rng.random(60) < p * (1.0 if length <= 2048 else 0.7)
                rows += [{"seed": seed, "arm": arm, "length": length, "item": i, "correct": bool(c)}
                         for i, c in enumerate(hits)]
    return pd.DataFrame(rows)


def test_accuracy_vs_length_uses_binomial_intervals(tmp_path):
    table = _accuracy_table()
    result = P.plot_accuracy_vs_length(table, tmp_path / "fig1", train_length=2048)
    _check_files(result)
    panels = [ax for ax in result.figure.axes if ax.containers]
    assert len(panels) == 2 and [ax.get_title() for ax in panels] == ["seed 0", "seed 1"]
    for ax, seed in zip(panels, (0, 1)):
        assert any(line.get_gid() == "train_length" and line.get_xdata()[0] == 2048 and line.get_linestyle() == "--"
                   for line in ax.lines)
        for (x, y, segments, line), arm in zip(_errorbars(ax), ("gdn2", "qed", "qed_rand")):
            sub = table[(table.seed == seed) & (table.arm == arm)]
            k = sub.groupby("length")["correct"].sum()
            n = sub.groupby("length")["correct"].count()
            np.testing.assert_array_equal(x, k.index.to_numpy())
            np.testing.assert_allclose(y, (k / n).to_numpy())
            for segment, kk, nn in zip(segments, k, n):
                ci = sps.binomtest(int(kk), int(nn)).proportion_ci(method="wilson")
                assert segment[0][1] == pytest.approx(ci.low) and segment[1][1] == pytest.approx(ci.high)
    aggregated = result.data.drop(columns=["accuracy", "low", "high"])
    again = P.plot_accuracy_vs_length(aggregated, tmp_path / "fig1b")
    pd.testing.assert_frame_equal(again.data, result.data)
    with pytest.raises(ValueError, match="correct"):
        P.plot_accuracy_vs_length(table.drop(columns=["correct"]), tmp_path / "bad")


def test_contrasts_are_differences_in_points(tmp_path):
    table = _accuracy_table()
    contrasts = [("qed", "gdn2"), ("qed", "qed_rand")]
    result = P.plot_contrasts(table, tmp_path / "fig2", contrasts=contrasts)
    _check_files(result)
    acc = table.groupby(["seed", "arm", "length"])["correct"].mean()
    panels = [ax for ax in result.figure.axes if ax.lines]
    assert len(panels) == 2
    for ax, (a, b) in zip(panels, contrasts):
        assert any(line.get_gid() == "zero" and line.get_ydata()[0] == 0 for line in ax.lines)
        for seed in (0, 1):
            line = [ln for ln in ax.lines if ln.get_gid() == f"contrast:{a}:{b}:{seed}"][0]
            expected = 100 * (acc.loc[(seed, a)] - acc.loc[(seed, b)])
            np.testing.assert_allclose(line.get_xdata(), expected.index.to_numpy())
            np.testing.assert_allclose(line.get_ydata(), expected.to_numpy())
            filled = line.get_markerfacecolor() != "white"
            assert filled == (seed == 0)
    assert set(result.data["contrast"]) == {"qed − gdn2", "qed − qed_rand"}
    default = P.plot_contrasts(table, tmp_path / "fig2b")
    assert set(zip(default.data.arm_a, default.data.arm_b)) == {("qed", "gdn2"), ("qed_rand", "gdn2")}
    with pytest.raises(ValueError, match="arm_a, arm_b"):
        P.plot_contrasts(table, tmp_path / "bad", contrasts=[("qed", "nope")])


def test_effects_figure_groups_controls_offsets_recall_and_has_no_clashing_text(tmp_path):
    from recurscope.interp.interventions import REGISTRY

    one_model = _summary().query("model == 'GLA-340M'")
    result = P.plot_intervention_effects(one_model, tmp_path / "one", title="GLA-340M: L0H1 on held-out sources")
    effect_ax, accuracy_ax = result.figure.axes[:2]
    assert effect_ax.get_legend() is None            # one model: the title names it
    n_main = sum(not i.is_control for i in REGISTRY)
    separators = [line for line in effect_ax.lines if list(line.get_ydata()) == [n_main - 0.5] * 2]
    assert len(separators) == 1
    heading = [t for t in effect_ax.texts if t.get_gid() == "controls-heading"]
    assert len(heading) == 1 and heading[0].get_text().strip() == "controls"
    acc = result.data[result.data.panel == "accuracy"].pivot(index="intervention", columns="metric", values="y")
    assert (acc["intervened_accuracy"] - acc["clean_accuracy"] > 0.2).all()   # never on one line
    assert P.overlapping_text(result.figure) == []
    many = P.plot_intervention_effects(_summary(), tmp_path / "many", title="three models")
    assert many.figure.axes[0].get_legend() is not None and P.overlapping_text(many.figure) == []


def test_overlapping_text_finds_a_clash():
    from matplotlib.figure import Figure

    fig = Figure(figsize=(3, 2))
    ax = fig.subplots()
    ax.text(0.5, 0.5, "first label")
    ax.text(0.52, 0.5, "second label")
    assert ("first label", "second label") in P.overlapping_text(fig)


def test_head_scan_rank_ticks_are_whole_and_attention_layers_are_masked_rows(tmp_path):
    rows = [{"source": s, "layer": layer, "head": head, "score": float(layer == 0 and head == 1) * 5 + 0.01 * s}
            for s in range(4) for layer in (0, 2) for head in range(2)]
    result = P.plot_head_scan(pd.DataFrame(rows), tmp_path / "scan", masked_layers={1: "attention"},
                              title="a hybrid: state-swap donor-margin shift per head")
    heat_ax = result.figure.axes[0]
    (rank_ax,) = [ax for ax in result.figure.axes if ax.get_ylabel().startswith("rank of the selected head")]
    labels = [t.get_text() for t in heat_ax.get_yticklabels()]
    assert labels == ["0", "1 (attention)", "2"]
    assert [p.get_gid() for p in heat_ax.patches if p.get_gid() and p.get_gid().startswith("masked")] == ["masked:1"]
    assert np.isnan(np.asarray(heat_ax.images[0].get_array().filled(np.nan))[1]).all()
    ticks = [t for t in rank_ax.get_yticks() if rank_ax.get_ylim()[1] <= t <= rank_ax.get_ylim()[0]]
    assert ticks and all(float(t).is_integer() for t in ticks)      # every rank is 1 here: no 0.6-1.4 ticks
    assert P.overlapping_text(result.figure) == []
