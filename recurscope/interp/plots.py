"""Paper-style figures for recurscope results (intervention effects, head scans, accuracy vs length, arm contrasts),
drawn with matplotlib's object API on the Agg canvas so nothing needs a display or changes the global backend.

Every function writes ``<stem>.png`` and ``<stem>.svg`` and returns a ``PlotResult`` holding the two paths, the
Figure, and the exact numbers it plotted as a DataFrame.
"""
from __future__ import annotations

import io
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.text import Text
from matplotlib.transforms import blended_transform_factory
from matplotlib.ticker import FixedLocator, MaxNLocator, PercentFormatter, ScalarFormatter

from recurscope.interp.interventions.registry import INTERVENTION_NAMES, REGISTRY
from recurscope.interp.results import output_dir, write_output
from recurscope.interp.stats import binomial_ci

#: Row order of Figures 3/4 (How Linear Attention Remembers), from interventions.REGISTRY; other interventions
#: follow in order of appearance.
INTERVENTION_ORDER = INTERVENTION_NAMES
#: The report's name for each intervention (the registry's label), so a figure's rows read as the report's table.
INTERVENTION_LABELS = {i.name: i.label for i in REGISTRY}
CONTROLS = frozenset(i.name for i in REGISTRY if i.is_control)
#: How the figures name a metric (the reports' wording); other metrics show their name with spaces.
METRIC_LABELS = {"donor_margin_shift": "donor-margin shift", "donor_specific_shift": "donor-specific shift",
                 "nontarget_margin_change": "non-target margin change", "nontarget_break": "non-target break rate",
                 "target_margin_change": "target margin change", "donor_answer": "donor answers",
                 "clean_correct": "clean recall", "correct": "recall after", "clean_accuracy": "clean recall",
                 "intervened_accuracy": "intervened recall"}
#: Metrics measured in logits (a margin, or a change of one); the figures print the unit beside their name.
LOGIT_METRICS = frozenset({"donor_margin_shift", "donor_specific_shift", "distractor_shift", "target_margin_change",
                           "nontarget_margin_change", "margin_change_b", "answer_margin_change", "joint_minus_sum",
                           "shift", "margin", "sublayer_jump", "score", "J"})
_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
            "#17becf")
_SEED_MARKERS = ("o", "s", "^", "D", "v", "P")


@dataclass
class PlotResult:
    png: Path
    svg: Path
    figure: Figure
    data: pd.DataFrame

    @property
    def paths(self) -> tuple[Path, Path]:
        return self.png, self.svg


# --------------------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------------------


def _require(frame, name: str, cols: Sequence[str]) -> None:
    if not isinstance(frame, pd.DataFrame):
        raise ValueError(f"{name} must be a pandas DataFrame, got {type(frame).__name__}")
    missing = [c for c in cols if c not in frame.columns]
    if missing:
        raise ValueError(f"{name} is missing columns {missing}; it has {list(frame.columns)}")
    if len(frame) == 0:
        raise ValueError(f"{name} is empty: nothing to plot")


def _stem(out_path) -> Path:
    path = Path(out_path)
    if path.suffix in (".png", ".svg"):
        path = path.with_suffix("")
    output_dir(path.parent)
    return path


def overlapping_text(fig: Figure, pad: float = 1.0) -> list[tuple[str, str]]:
    """Pairs of drawn, non-empty texts of `fig` whose boxes overlap when drawn at the figure's own size (titles,
    axis labels, tick labels, legends, annotations); an empty list when a reader can read every label."""
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    # Tick labels exist for ticks outside the view too; only those inside the view limits are drawn.
    all_ticks, drawn_ticks = set(), set()
    for ax in fig.axes:
        for axis, (lo, hi) in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
            lo, hi = min(lo, hi), max(lo, hi)
            tol = 1e-9 * max(1.0, abs(hi - lo))
            for ticks, locs in ((axis.get_major_ticks(), axis.get_majorticklocs()),
                                (axis.get_minor_ticks(), axis.get_minorticklocs())):
                for tick, loc in zip(ticks, locs):
                    for label in (tick.label1, tick.label2):
                        all_ticks.add(id(label))
                        if lo - tol <= loc <= hi + tol and label.get_visible():
                            drawn_ticks.add(id(label))
    found = fig.findobj(Text)   # Text only: a legend's TextArea wraps the same Text again
    texts = [t for t in dict((id(t), t) for t in found).values()
             if t.get_visible() and str(t.get_text()).strip() and (id(t) not in all_ticks or id(t) in drawn_ticks)]
    boxes = [(t, t.get_window_extent(renderer).padded(-pad)) for t in texts]
    clashes = []
    for i, (a, box_a) in enumerate(boxes):
        for b, box_b in boxes[i + 1:]:
            if box_a.width > 0 and box_b.width > 0 and box_a.overlaps(box_b):
                clashes.append((str(a.get_text()), str(b.get_text())))
    return clashes


def fold_axis_scales(fig: Figure) -> None:
    """Puts each axis' multiplier into its label. Matplotlib draws a scale such as "1e-5" at the end of the axis,
    where it collides with the axis label (and an additive offset such as "+1.2" silently changes every tick), so
    offsets are turned off, values under 0.01 or from 10^4 up are written with a multiplier rather than as
    "-0.000150", and the multiplier ends the label as "[×1e-4]"."""
    axes = [(ax, axis) for ax in fig.axes for axis in (ax.xaxis, ax.yaxis)
            if isinstance(axis.get_major_formatter(), ScalarFormatter) and axis.get_scale() in ("linear", "function")]
    for _, axis in axes:
        axis.get_major_formatter().set_useOffset(False)
        axis.get_major_formatter().set_powerlimits((-2, 4))   # 1e-4 as "-1.5 [×1e-4]", not "-0.000150"
    FigureCanvasAgg(fig).draw()
    for ax, axis in axes:
        scale = str(axis.get_offset_text().get_text()).strip()
        if scale and axis.get_offset_text().get_visible():
            axis.get_offset_text().set_visible(False)
            label = axis.get_label_text()
            gap = "\n" if len(label.rsplit("\n", 1)[-1]) > 32 else " "   # a long label takes it on a line of its own
            axis.set_label_text(f"{label}{gap}[×{scale.lstrip('×')}]")


def _save(fig: Figure, out_path, data: pd.DataFrame, dpi: int) -> PlotResult:
    stem = _stem(out_path)
    fold_axis_scales(fig)
    png, svg = stem.with_name(stem.name + ".png"), stem.with_name(stem.name + ".svg")
    for path, options in ((png, {"dpi": dpi}), (svg, {})):
        image = io.BytesIO()      # written through a temporary file and a rename, never through a link
        fig.savefig(image, format=path.suffix[1:], bbox_inches="tight", **options)
        write_output(path, image.getvalue())
    return PlotResult(png, svg, fig, data.reset_index(drop=True))


def _ordered(values, preferred: Sequence = ()) -> list:
    present = list(pd.unique(pd.Series(list(values))))
    return [v for v in preferred if v in present] + [v for v in present if v not in preferred]


def _colours(keys: Sequence, colors: Optional[Mapping]) -> dict:
    colors = dict(colors or {})
    return {k: colors.get(k, _PALETTE[i % len(_PALETTE)]) for i, k in enumerate(keys)}


def _label(name) -> str:
    return INTERVENTION_LABELS.get(str(name), METRIC_LABELS.get(str(name), str(name).replace("_", " ")))


def sample_note(frame: pd.DataFrame) -> str:
    """ "n = 16 sources, 95% intervals" from a summary's n_sources and confidence columns ("" without n_sources), for
    the second line of a figure's title."""
    if "estimate" in frame.columns:   # rows with nothing measured (n = 0) are drawn as n/a, not counted
        frame = frame[np.isfinite(frame["estimate"].astype(float))]
    if "n_sources" not in frame.columns or frame["n_sources"].dropna().empty:
        return ""
    n = frame["n_sources"].dropna().astype(int)
    counts = f"{n.min()}" if n.min() == n.max() else f"{n.min()}-{n.max()}"
    conf = frame["confidence"].dropna() if "confidence" in frame.columns else pd.Series([], dtype=float)
    level = f"{100 * float(conf.iloc[0]):.0f}%" if len(conf) and conf.nunique() == 1 else "95%"
    return f"n = {counts} sources, {level} intervals"


def _with_note(title: Optional[str], note: str) -> Optional[str]:
    if not note:
        return title
    return f"{title}\n{note}" if title else note


def _length_label(length: float) -> str:
    length = int(length)
    return f"{length // 1024}K" if length >= 1024 and length % 1024 == 0 else str(length)


def _check_interval(frame: pd.DataFrame, name: str, est: str = "estimate", low: str = "low", high: str = "high"):
    vals = frame[[est, low, high]].astype(float)
    bad = ~((vals[low] <= vals[est] + 1e-12) & (vals[est] <= vals[high] + 1e-12))
    bad &= vals.notna().all(axis=1)
    if bad.any():
        raise ValueError(f"{name}: {int(bad.sum())} rows have an estimate outside [low, high]; check the summary "
                         f"(first bad row: {frame.loc[bad].iloc[0].to_dict()})")


def _accuracy_counts(table: pd.DataFrame, name: str, group: Sequence[str]) -> pd.DataFrame:
    """(group..., n_correct, n) from either per-example ``correct`` (0/1) or aggregated ``n_correct``/``n``."""
    if "correct" in table.columns:
        _require(table, name, [*group, "correct"])
        correct = table["correct"].astype(float)
        if not correct.isin((0.0, 1.0)).all():
            raise ValueError(f"{name}['correct'] must be 0/1 or booleans per example")
        counts = table.assign(correct=correct).groupby(list(group), sort=True)["correct"].agg(["sum", "count"])
        counts = counts.rename(columns={"sum": "n_correct", "count": "n"}).reset_index()
    elif {"n_correct", "n"} <= set(table.columns):
        _require(table, name, [*group, "n_correct", "n"])
        if table.duplicated(list(group)).any():
            raise ValueError(f"{name} has several rows per {list(group)}; aggregate them first")
        counts = table[[*group, "n_correct", "n"]].copy()
    else:
        raise ValueError(f"{name} needs either a per-example 'correct' column or aggregated 'n_correct' and 'n' "
                         f"columns; it has {list(table.columns)}")
    counts["n_correct"] = counts["n_correct"].astype(int)
    counts["n"] = counts["n"].astype(int)
    counts["accuracy"] = counts["n_correct"] / counts["n"]
    return counts


# --------------------------------------------------------------------------------------------------------------
# Figure 3/4: intervention effects
# --------------------------------------------------------------------------------------------------------------


def plot_intervention_effects(summary: pd.DataFrame, out_path, *, effect_metric: str = "donor_margin_shift",
                              clean_metric: str = "clean_accuracy", intervened_metric: str = "intervened_accuracy",
                              model_col: str = "model", intervention_col: str = "intervention",
                              interventions: Optional[Sequence[str]] = None, models: Optional[Sequence[str]] = None,
                              colors: Optional[Mapping] = None, title: Optional[str] = None,
                              dpi: int = 150) -> PlotResult:
    """Figure 3/4 style. ``summary`` is tidy (as from ``interp.stats.summarise(..., by=[model, intervention])``):
    columns model, intervention, metric, estimate, low, high. Left panel: one row per intervention, x = the
    ``effect_metric`` (donor-margin shift, logits) with its 95% CI, one colour per model. Right panel, drawn when
    the summary has ``clean_metric``/``intervened_metric`` rows: clean (circle) vs intervened (cross) recall.

    Returned data: panel, model, intervention, metric, estimate, low, high, y (row position on the plot).
    """
    _require(summary, "summary", [model_col, intervention_col, "metric", "estimate", "low", "high"])
    effect = summary[summary["metric"] == effect_metric]
    if len(effect) == 0:
        raise ValueError(f"summary has no rows with metric == {effect_metric!r}; metrics present: "
                         f"{sorted(map(str, summary['metric'].unique()))}. Pass effect_metric=")
    _check_interval(summary, "summary")
    accuracy = summary[summary["metric"].isin([clean_metric, intervened_metric])]
    rows = list(interventions) if interventions is not None else _ordered(summary[intervention_col],
                                                                          INTERVENTION_ORDER)
    # The controls below the interventions, under their own heading, so a reader never reads one as the other.
    mains, controls = [r for r in rows if r not in CONTROLS], [r for r in rows if r in CONTROLS]
    rows = mains + controls
    model_list = list(models) if models is not None else _ordered(summary[model_col])
    palette = _colours(model_list, colors)
    n_models = len(model_list)
    dodge = 0.6 / max(n_models, 1)
    offsets = {m: (i - (n_models - 1) / 2) * dodge for i, m in enumerate(model_list)}

    panels = 2 if len(accuracy) else 1
    fig = Figure(figsize=(4.6 * panels + 1.6, 0.5 * len(rows) + 1.8), layout="constrained")
    fig.get_layout_engine().set(wspace=0.08)   # the panels' outer tick labels ("20", "0%") must not touch
    axes = fig.subplots(1, panels, sharey=True, squeeze=False)[0]
    records = []

    ax = axes[0]
    for model in model_list:
        sub = effect[effect[model_col] == model].set_index(intervention_col)
        present = [r for r in rows if r in sub.index]
        if not present:
            continue
        y = np.array([rows.index(r) for r in present], dtype=float) + offsets[model]
        est = sub.loc[present, "estimate"].to_numpy(float)
        low, high = sub.loc[present, "low"].to_numpy(float), sub.loc[present, "high"].to_numpy(float)
        ax.errorbar(est, y, xerr=np.vstack([est - low, high - est]), fmt="o", color=palette[model], capsize=3,
                    label=_label(model), gid=f"effect:{model}")
        records += [{"panel": "effect", "model": model, "intervention": r, "metric": effect_metric, "estimate": e,
                     "low": lo, "high": hi, "y": yy} for r, e, lo, hi, yy in zip(present, est, low, high, y)]
    ax.axvline(0.0, color="0.4", lw=0.8, ls="--")
    ax.set_yticks(range(len(rows)), [_label(r) for r in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlabel(f"{_label(effect_metric).replace('donor margin shift', 'donor-margin shift')} (logits, 95% CI)")
    # Few ticks, scientific notation for tiny effects, so labels never collide.
    ax.xaxis.set_major_locator(MaxNLocator(nbins=5))
    ax.ticklabel_format(axis="x", style="sci", scilimits=(-2, 3))
    if n_models > 1:   # one model: its name is in the title, a one-entry legend says nothing
        ax.legend(loc="best", fontsize="small", frameon=False)
    ax.grid(axis="x", alpha=0.3)
    for axis in axes:
        if mains and controls:
            axis.axhline(len(mains) - 0.5, color="0.2", lw=0.8)
            axis.axhspan(len(mains) - 0.5, len(rows) - 0.5, color="0.93", zorder=0)
    if mains and controls:
        ax.text(-0.02, len(mains) - 0.5, "controls ", transform=ax.get_yaxis_transform(), ha="right", va="top",
                fontsize="small", fontstyle="italic", color="0.3", gid="controls-heading")

    if panels == 2:
        ax = axes[1]
        for model in model_list:
            # Clean above, intervened below the row, so that both intervals show where they overlap.
            for metric, marker, shift in ((clean_metric, "o", -0.17), (intervened_metric, "x", 0.17)):
                sub = accuracy[(accuracy[model_col] == model) & (accuracy["metric"] == metric)]
                sub = sub.set_index(intervention_col)
                present = [r for r in rows if r in sub.index]
                if not present:
                    continue
                y = np.array([rows.index(r) for r in present], dtype=float) + offsets[model] + shift / n_models
                est = sub.loc[present, "estimate"].to_numpy(float)
                low, high = sub.loc[present, "low"].to_numpy(float), sub.loc[present, "high"].to_numpy(float)
                ax.errorbar(est, y, xerr=np.vstack([est - low, high - est]), fmt=marker, color=palette[model],
                            mfc="none" if marker == "o" else palette[model], capsize=3,
                            gid=f"accuracy:{model}:{metric}")
                records += [{"panel": "accuracy", "model": model, "intervention": r, "metric": metric,
                             "estimate": e, "low": lo, "high": hi, "y": yy}
                            for r, e, lo, hi, yy in zip(present, est, low, high, y)]
        ax.set_xlim(-0.04, 1.04)   # markers at 0% and 100% drawn whole, not cut by the frame
        ax.xaxis.set_major_formatter(PercentFormatter(xmax=1))
        ax.set_xlabel("recall accuracy, 95% CI (o clean, x intervened)")
        ax.grid(axis="x", alpha=0.3)
    title = _with_note(title, sample_note(summary[summary["metric"] == effect_metric]))
    if title:
        fig.suptitle(title)
    return _save(fig, out_path, pd.DataFrame(records), dpi)


# --------------------------------------------------------------------------------------------------------------
# Figure 9: head scan
# --------------------------------------------------------------------------------------------------------------


def plot_head_scan(scores: pd.DataFrame, out_path, *, selected: Optional[tuple] = None, score_col: str = "score",
                   source_col: str = "source", title: Optional[str] = None, dpi: int = 150,
                   masked_layers: Optional[Mapping[int, str]] = None, partial: bool = False) -> PlotResult:
    """Figure 9 style. ``scores`` has columns layer, head, score and (optionally) source. Left: layer × head heatmap
    of the mean score J(l, h) over sources (diverging colours centred on 0) with the selected head boxed (default:
    the largest mean). Right, when sources are given: the selected head's rank on each source (1 = best).
    ``masked_layers`` ({layer: reason}, e.g. a hybrid's full-attention layers) are drawn as hatched rows named by
    their reason, so that a layer with no recurrent state is visibly absent rather than silently dropped.
    ``partial=True`` accepts scores for only some heads of a layer (an attribution scan's exactly scanned top K): the
    heads not scanned are cross-hatched cells, never coloured as a zero.

    Returned data: one row per head with layer, head, mean_score, selected; plus, when sources exist, rows with
    kind == "rank" holding source and rank of the selected head. Kind "mean" marks the heatmap rows.
    """
    from recurscope.interp.stats import rank_per_source  # local: only this plot needs it

    _require(scores, "scores", ["layer", "head", score_col])
    has_sources = source_col in scores.columns
    mean = scores.groupby(["layer", "head"], sort=True)[score_col].mean()
    grid = mean.unstack("head").sort_index().sort_index(axis=1)
    if grid.isna().to_numpy().any() and not partial:
        raise ValueError("scores does not cover a full layer × head grid; every layer needs the same heads "
                         "(partial=True draws the heads not scanned as hatched cells)")
    if selected is None:
        selected = tuple(v.item() if isinstance(v, np.generic) else v for v in mean.idxmax())
    selected = tuple(selected)
    if selected not in mean.index:
        raise ValueError(f"selected head {selected} is not in scores; pass a (layer, head) present in the table")

    masked = {int(k): str(v) for k, v in (masked_layers or {}).items() if int(k) not in set(grid.index)}
    if masked:
        grid = grid.reindex(sorted(set(grid.index) | set(masked)))
    panels = 2 if has_sources else 1
    fig = Figure(figsize=(4.4 + 0.3 * grid.shape[1] + 3.4 * (panels - 1), 0.28 * grid.shape[0] + 2.9),
                 layout="constrained")
    axes = fig.subplots(1, panels, squeeze=False, gridspec_kw={"width_ratios": [2, 1.3][:panels]})[0]
    ax = axes[0]
    values = grid.to_numpy(float)
    bound = float(np.nanmax(np.abs(values))) or 1.0
    image = ax.imshow(np.ma.masked_invalid(values), aspect="auto", cmap="RdBu_r",
                      norm=TwoSlopeNorm(0.0, -bound, bound), interpolation="nearest")
    unit = " (logits)" if score_col in LOGIT_METRICS else ""
    fig.colorbar(image, ax=ax, label=f"mean {_label(score_col)} J(l, h){unit}")
    for layer in masked:
        r = list(grid.index).index(layer)
        ax.add_patch(Rectangle((-0.5, r - 0.5), grid.shape[1], 1, facecolor="0.85", hatch="///", ec="0.6", lw=0,
                               gid=f"masked:{layer}"))
    for r, layer in enumerate(grid.index):
        for c, head in enumerate(grid.columns):
            if layer not in masked and np.isnan(values[r, c]):
                ax.add_patch(Rectangle((c - 0.5, r - 0.5), 1, 1, facecolor="white", hatch="xx", ec="0.75", lw=0,
                                       gid=f"unscanned:{layer}:{head}"))
    row = list(grid.index).index(selected[0])
    col = list(grid.columns).index(selected[1])
    ax.add_patch(Rectangle((col - 0.5, row - 0.5), 1, 1, fill=False, ec="black", lw=2, gid="selected"))
    ax.set_xticks(range(grid.shape[1]), [str(h) for h in grid.columns])
    step = max(1, grid.shape[0] // 12)
    ax.set_yticks(range(0, grid.shape[0], step),
                  [f"{layer} ({masked[layer]})" if layer in masked else str(layer) for layer in grid.index[::step]])
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(f"selected L{selected[0]}H{selected[1]}")
    data = mean.rename("mean_score").reset_index()
    data["selected"] = [(r.layer, r.head) == selected for r in data.itertuples()]
    data["kind"] = "mean"

    if has_sources:
        ranks = rank_per_source(scores, source_col=source_col, score_col=score_col)
        mine = ranks[(ranks["layer"] == selected[0]) & (ranks["head"] == selected[1])].sort_values(source_col)
        ax = axes[1]
        x = np.arange(len(mine))
        ax.plot(x, mine["rank"].to_numpy(), "o", color="black", gid="ranks")
        ax.set_xticks(x, [str(s) for s in mine[source_col]], rotation=90, fontsize="small")
        ax.set_ylim(mine["rank"].max() + 0.5 if len(mine) else 2, 0.5)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))   # ranks are whole numbers
        ax.set_xlabel(source_col)
        ax.set_ylabel(f"rank of the selected head\n(1 = best of {len(mean)})")
        wins = int((mine["rank"] == 1).sum())
        ax.set_title(f"ranked first (1) on {wins}/{len(mine)} sources")
        ax.grid(axis="y", alpha=0.3)
        rank_rows = mine[[source_col, "rank"]].rename(columns={source_col: "source"}).assign(
            kind="rank", layer=selected[0], head=selected[1])
        data = pd.concat([data, rank_rows], ignore_index=True)
        title = _with_note(title, f"mean over n = {scores[source_col].nunique()} sources")
    if title:
        fig.suptitle(title)
    return _save(fig, out_path, data, dpi)


# --------------------------------------------------------------------------------------------------------------
# QED Figures 1 and 2
# --------------------------------------------------------------------------------------------------------------


def plot_accuracy_vs_length(table: pd.DataFrame, out_path, *, train_length: Optional[int] = 2048,
                            arms: Optional[Sequence[str]] = None, colors: Optional[Mapping] = None,
                            confidence: float = 0.95, ci_method: str = "wilson", title: Optional[str] = None,
                            dpi: int = 150) -> PlotResult:
    """QED Figure 1 style: accuracy vs context length per arm with binomial intervals (``interp.stats.binomial_ci``,
    Wilson by default), a dashed vertical line at ``train_length``, one panel per seed. ``table`` has columns arm,
    seed, length and either per-example ``correct`` or aggregated ``n_correct`` and ``n``.

    Returned data: seed, arm, length, n_correct, n, accuracy, low, high.
    """
    counts = _accuracy_counts(table, "table", ["seed", "arm", "length"])
    seeds = sorted(counts["seed"].unique())
    arm_list = list(arms) if arms is not None else _ordered(table["arm"])
    palette = _colours(arm_list, colors)
    intervals = [binomial_ci(k, n, confidence=confidence, method=ci_method)
                 for k, n in zip(counts["n_correct"], counts["n"])]
    counts["low"] = [ci.low for ci in intervals]
    counts["high"] = [ci.high for ci in intervals]

    fig = Figure(figsize=(4.2 * len(seeds), 3.4))
    axes = fig.subplots(1, len(seeds), sharey=True, squeeze=False)[0]
    lengths = sorted(counts["length"].unique())
    for ax, seed in zip(axes, seeds):
        for arm in arm_list:
            sub = counts[(counts["seed"] == seed) & (counts["arm"] == arm)].sort_values("length")
            if len(sub) == 0:
                continue
            acc = sub["accuracy"].to_numpy(float)
            ax.errorbar(sub["length"].to_numpy(float), acc,
                        yerr=np.vstack([acc - sub["low"].to_numpy(float), sub["high"].to_numpy(float) - acc]),
                        fmt="-o", ms=4, capsize=3, color=palette[arm], label=_label(arm), gid=f"arm:{arm}")
        if train_length is not None:
            ax.axvline(train_length, color="0.5", ls="--", lw=1, gid="train_length")
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [_length_label(v) for v in lengths])
        ax.minorticks_off()
        ax.set_ylim(-0.02, 1.02)
        ax.yaxis.set_major_formatter(PercentFormatter(xmax=1))
        ax.set_xlabel("context length (tokens)")
        ax.set_title(f"seed {seed}")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"accuracy ({int(round(confidence * 100))}% {ci_method} CI)")
    axes[-1].legend(fontsize="small", frameon=False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    data = counts[["seed", "arm", "length", "n_correct", "n", "accuracy", "low", "high"]]
    return _save(fig, out_path, data.sort_values(["seed", "arm", "length"]), dpi)


def plot_contrasts(table: pd.DataFrame, out_path, *, contrasts: Optional[Sequence[tuple]] = None,
                   train_length: Optional[int] = 2048, title: Optional[str] = None, dpi: int = 150) -> PlotResult:
    """QED Figure 2 style: one panel per contrast (arm_a, arm_b) showing accuracy(arm_a) - accuracy(arm_b) in
    percentage points against length, with a zero line; seed 0 filled markers, seed 1 open (further seeds use
    other marker shapes). ``table`` is the same accuracy table as for ``plot_accuracy_vs_length``. By default each
    arm is contrasted with the first arm. Points only: a paired interval needs per-item data (see
    ``interp.stats.mcnemar_table``).

    Returned data: contrast, arm_a, arm_b, seed, length, accuracy_a, accuracy_b, difference_pp.
    """
    counts = _accuracy_counts(table, "table", ["seed", "arm", "length"])
    arms = _ordered(table["arm"])
    if contrasts is None:
        if len(arms) < 2:
            raise ValueError(f"table has a single arm {arms}; contrasts need at least two arms")
        contrasts = [(arm, arms[0]) for arm in arms[1:]]
    contrasts = [tuple(c) for c in contrasts]
    for pair in contrasts:
        if len(pair) != 2 or any(a not in arms for a in pair):
            raise ValueError(f"each contrast must be (arm_a, arm_b) with arms from {arms}, got {pair!r}")
    seeds = sorted(counts["seed"].unique())
    by_key = {key: dict(zip(sub["length"], sub["accuracy"])) for key, sub in counts.groupby(["seed", "arm"])}

    records = []
    fig = Figure(figsize=(3.3 * len(contrasts), 3.2))
    axes = fig.subplots(1, len(contrasts), sharey=True, squeeze=False)[0]
    for ax, (arm_a, arm_b) in zip(axes, contrasts):
        name = f"{arm_a} − {arm_b}"
        for i, seed in enumerate(seeds):
            acc_a, acc_b = by_key.get((seed, arm_a), {}), by_key.get((seed, arm_b), {})
            lengths = sorted(set(acc_a) & set(acc_b))
            if not lengths:
                continue
            a = np.array([acc_a[n] for n in lengths], dtype=float)
            b = np.array([acc_b[n] for n in lengths], dtype=float)
            diff = 100.0 * (a - b)
            marker = _SEED_MARKERS[(i // 2) % len(_SEED_MARKERS)]
            filled = i % 2 == 0
            ax.plot(lengths, diff, ls="-", lw=0.8, marker=marker, color="C0", mfc="C0" if filled else "white",
                    label=f"seed {seed}", gid=f"contrast:{arm_a}:{arm_b}:{seed}")
            records += [{"contrast": name, "arm_a": arm_a, "arm_b": arm_b, "seed": seed, "length": n,
                         "accuracy_a": x, "accuracy_b": y, "difference_pp": d}
                        for n, x, y, d in zip(lengths, a, b, diff)]
        ax.axhline(0.0, color="0.3", lw=0.8, gid="zero")
        if train_length is not None:
            ax.axvline(train_length, color="0.6", ls="--", lw=0.8)
        all_lengths = sorted(counts["length"].unique())
        ax.set_xscale("log", base=2)
        ax.set_xticks(all_lengths, [_length_label(v) for v in all_lengths])
        ax.minorticks_off()
        ax.set_title(_label(name), fontsize="medium")
        ax.set_xlabel("context length")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accuracy difference (pp)")
    axes[0].legend(fontsize="small", frameon=False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, out_path, pd.DataFrame(records), dpi)


# --------------------------------------------------------------------------------------------------------------
# Protocol figures (Fig. 5, 10, 11, 12; Fig. 3c): estimates with intervals, as panels of points or curves
# --------------------------------------------------------------------------------------------------------------


def plot_interval_panels(summary: pd.DataFrame, out_path, *, panels: Sequence[str], row_col: str,
                         rows: Optional[Sequence] = None, hue_col: Optional[str] = None,
                         panel_labels: Optional[Mapping[str, str]] = None, percent: Sequence[str] = (),
                         reference: Optional[Mapping[str, float]] = None, kind: str = "points",
                         row_labels: Optional[Mapping] = None, row_name: Optional[str] = None,
                         controls: Sequence = (), missing_labels: Optional[Mapping] = None,
                         reference_labels: Optional[Mapping[str, str]] = None,
                         colors: Optional[Mapping] = None,
                         title: Optional[str] = None, dpi: int = 150) -> PlotResult:
    """One panel per metric in ``panels`` (a ``metric`` value of the tidy ``summary``, as from interp.stats.summarise).

    kind="points": one row per ``row_col`` value (arms, heads), the estimate with its 95% interval as a horizontal
    error bar (Fig. 5a-c, 12 style). kind="lines": x = ``row_col`` (numeric: k, layer), the estimate as a line with
    its interval as a band (Fig. 3c recovery, Fig. 11 lens). ``hue_col`` splits colours (models, tasks);
    ``row_labels`` names the rows (and hues) as the report does (default: the interventions registry's labels);
    ``row_name`` names the x axis of a lines panel (default: ``row_col``); ``controls`` lists the rows that are
    controls: a points figure draws them below the others, shaded, under a "controls" heading; ``missing_labels``
    says why a row has no estimate (default "n/a"); ``reference_labels`` names a metric's dashed line in the legend
    (one metric's name covers the same line on every panel);
    ``percent`` lists the metrics drawn as percentages (points, "pp" for a change); logit metrics (LOGIT_METRICS)
    say so on their axis; ``reference`` draws a dashed line per metric (0 by default for points panels). The title
    gets a second line with n and the interval level when the summary has n_sources. A row without a finite
    estimate is marked "n/a" on its panel, and a panel without any "no data", rather than left silently blank.

    Returned data: panel, hue, row, estimate, low, high (the finite rows drawn).
    """
    if kind not in ("points", "lines"):
        raise ValueError(f"kind must be 'points' or 'lines', got {kind!r}")
    cols = ["metric", "estimate", "low", "high", row_col] + ([hue_col] if hue_col else [])
    _require(summary, "summary", cols)
    panels = list(panels)
    missing = [p for p in panels if p not in set(summary["metric"])]
    if missing:
        raise ValueError(f"summary has no rows for metrics {missing}; metrics present: "
                         f"{sorted(map(str, summary['metric'].unique()))}")
    data = summary[summary["metric"].isin(panels)].copy()
    for col in ("estimate", "low", "high"):
        data[col] = data[col].astype(float).where(np.isfinite(data[col].astype(float)))   # ±inf drawn as n/a
    _check_interval(data.dropna(subset=["estimate"]), "summary")
    row_list = list(rows) if rows is not None else _ordered(data[row_col], INTERVENTION_ORDER)
    controls = [r for r in row_list if r in set(controls)] if kind == "points" else []
    mains = [r for r in row_list if r not in controls]
    row_list = mains + controls
    hues = _ordered(data[hue_col], list(row_labels or {})) if hue_col else [None]   # the report's order
    palette = _colours(hues, colors)
    labels = dict(panel_labels or {})
    names = dict(row_labels or {})
    name_of = lambda value: names.get(value, _label(value))   # noqa: E731
    ref = dict(reference or {})
    n = len(panels)
    if kind == "points":
        fig = Figure(figsize=(3.6 * n + 1.2, 0.5 * len(row_list) + 1.9), layout="constrained")
    else:
        fig = Figure(figsize=(4.0 * n + 0.6, 3.6 + (0.3 if hue_col and len(hues) > 1 else 0)), layout="constrained")
    axes = fig.subplots(1, n, sharey=(kind == "points"), squeeze=False)[0]
    dodge = 0.5 / max(len(hues), 1)
    xs = sorted({float(v) for v in data[row_col]}) if kind == "lines" else []
    records = []
    for ax, metric in zip(axes, panels):
        scale = 100.0 if metric in percent else 1.0
        drawn, absent = [], []
        for i, hue in enumerate(hues):
            sub = data[data["metric"] == metric]
            if hue_col:
                sub = sub[sub[hue_col] == hue]
            sub = sub.set_index(row_col)
            given = [r for r in row_list if r in sub.index]
            present = [r for r in given if pd.notna(sub.loc[r, "estimate"])]
            absent += [(r, i) for r in given if r not in present]
            if kind == "lines":
                present = sorted(present, key=float)
            if not present:
                continue
            est = sub.loc[present, "estimate"].to_numpy(float) * scale
            # a bound that is not finite (an interval that could not be computed): the point without its bar
            low = np.where(np.isnan(sub.loc[present, "low"].to_numpy(float)), est / scale,
                           sub.loc[present, "low"].to_numpy(float)) * scale
            high = np.where(np.isnan(sub.loc[present, "high"].to_numpy(float)), est / scale,
                            sub.loc[present, "high"].to_numpy(float)) * scale
            name = name_of(hue) if hue is not None and len(hues) > 1 else None
            if kind == "points":
                y = np.array([row_list.index(r) for r in present], float) + (i - (len(hues) - 1) / 2) * dodge
                ax.errorbar(est, y, xerr=np.vstack([est - low, high - est]), fmt="o", capsize=3,
                            color=palette[hue], label=name)
            else:
                x = np.array(present, dtype=float)
                # each hue its own marker and dash, the first drawn largest: equal curves (two arms both at 100%)
                # stay visible one over the other
                ax.plot(x, est, color=palette[hue], label=name, marker=_SEED_MARKERS[i % len(_SEED_MARKERS)],
                        ls=("-", "--", ":", "-.")[i % 4], ms=max(3.0, 7.0 - 1.5 * i), zorder=2 + i)
                ax.fill_between(x, low, high, color=palette[hue], alpha=0.2, lw=0)
            drawn += list(low) + list(high) + list(est)
            records += [{"panel": metric, "hue": hue, "row": r, "estimate": e / scale, "low": lo / scale,
                         "high": hi / scale} for r, e, lo, hi in zip(present, est, low, high)]
        line = ref.get(metric, 0.0 if kind == "points" and metric not in percent else None)
        if line is not None:
            (ax.axvline if kind == "points" else ax.axhline)(line * scale, color="0.4", lw=0.8, ls="--",
                                                             label=dict(reference_labels or {}).get(metric))
            drawn.append(line * scale)
        _value_limits(ax.set_xlim if kind == "points" else ax.set_ylim, drawn, metric, percent)
        empty = all(rec["panel"] != metric for rec in records)
        if empty:   # with the reason when every row gives the same one
            why = {dict(missing_labels or {}).get(r) for r, _ in absent}
            ax.text(0.5, 0.5, "no data" + (f"\n({why.pop()})" if len(why) == 1 and None not in why else ""),
                    transform=ax.transAxes, ha="center", va="center", color="0.4", gid="no-data")
            if metric in percent and "change" not in metric:
                (ax.set_xlim if kind == "points" else ax.set_ylim)(-4.0, 104.0)
        elif kind == "points":
            for r, i in absent:   # a row with no estimate (e.g. no pair qualified): said, not left blank
                y = row_list.index(r) + (i - (len(hues) - 1) / 2) * dodge
                ax.text(0.5, y, dict(missing_labels or {}).get(r, "n/a"),
                        transform=blended_transform_factory(ax.transAxes, ax.transData),
                        ha="center", va="center", fontsize="small", color="0.4", gid=f"missing:{r}")
        else:
            measured = {float(rec["row"]) for rec in records if rec["panel"] == metric}
            for x in sorted({float(r) for r, _ in absent} - measured):   # an x nothing was measured at
                ax.text(x, 0.03, "n/a", transform=blended_transform_factory(ax.transData, ax.transAxes),
                        ha="center", va="bottom", fontsize="small", color="0.4", gid=f"missing:{x:g}")
        unit = _unit(metric, percent)
        axis_label = labels.get(metric, _label(metric)) + (f" ({unit})" if unit else "") + ", 95%\u00a0CI"
        axis_label = textwrap.fill(axis_label, 44 if kind == "points" else 34,   # never longer than its axis
                                   break_on_hyphens=False)
        if kind == "points":
            ax.set_xlabel(axis_label)
            ax.xaxis.set_major_locator(MaxNLocator(nbins=5))
            ax.grid(axis="x", alpha=0.3)
        else:
            ax.set_ylabel(axis_label)
            ax.set_xlabel(row_name or _label(row_col))
            _value_ticks(ax, xs)
            ax.grid(alpha=0.3)
    handles, names_ = [], []
    for ax in axes:   # hues and named reference lines, each once
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in names_:
                handles.append(h)
                names_.append(lab)
    if names_:   # one legend, below the panels, where it hides no data
        fig.legend(handles, names_, loc="outside lower center", ncols=min(len(names_), 4), fontsize="small",
                   frameon=False)
    if kind == "points":
        axes[0].set_yticks(range(len(row_list)), [name_of(r) for r in row_list])
        axes[0].set_ylim(len(row_list) - 0.5, -0.5)
        if mains and controls:   # the controls apart from what they control, as in the effects figure
            for ax in axes:
                ax.axhline(len(mains) - 0.5, color="0.2", lw=0.8, gid="controls-separator")
                ax.axhspan(len(mains) - 0.5, len(row_list) - 0.5, color="0.93", zorder=0)
            axes[0].text(-0.02, len(mains) - 0.5, "controls ", transform=axes[0].get_yaxis_transform(), ha="right",
                         va="top", fontsize="small", fontstyle="italic", color="0.3", gid="controls-heading")
    if title:   # a title no wider than the figure (a long model path, a long verdict)
        title = textwrap.fill(title, max(40, int(11 * fig.get_figwidth())), break_on_hyphens=False)
    title = _with_note(title, sample_note(data))
    if title:
        fig.suptitle(title)
    return _save(fig, out_path, pd.DataFrame(records), dpi)


def _unit(metric: str, percent: Sequence[str]) -> str:
    if metric in percent:
        return "pp" if "change" in metric else "%"
    return "logits" if metric in LOGIT_METRICS else ""


def _value_limits(set_limits, values, metric: str, percent: Sequence[str]) -> None:
    """Limits of a value axis: a rate drawn in percent spans 0-100% (its ticks never go past 100% or below 0); a
    panel whose values are all equal gets a readable span around them instead of matplotlib's ±0.05 (ticks such as
    -0.04 ... 0.04 for an all-zero panel)."""
    values = np.asarray([v for v in values if np.isfinite(v)], float)
    if not len(values):
        return
    lo, hi = float(values.min()), float(values.max())
    if metric in percent and "change" not in metric and lo >= 0.0 and hi <= 100.0:
        set_limits(-4.0, 104.0)
    elif hi - lo < 1e-12:
        half = 5.0 if metric in percent else max(1.0, 0.1 * abs(lo))
        set_limits(lo - half, hi + half)


def _value_ticks(ax, xs: Sequence[float]) -> None:
    """Ticks of a lines panel's x axis (k, layer, load, gap, filler) at the values measured: a base-2 log axis when
    they are positive and span a factor of 8 or more (loads 1-64, gaps 128-1024), never fractional ticks."""
    if not xs:
        return
    if len(xs) > 1 and min(xs) > 0 and max(xs) / min(xs) >= 8:
        ax.set_xscale("log", base=2)
        ax.minorticks_off()
    if len(xs) <= 12:
        ax.xaxis.set_major_locator(FixedLocator(xs))
        ax.set_xticks(xs, [f"{v:g}" for v in xs])
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    lo, hi = min(xs), max(xs)   # every measured x inside the frame, with room for its "n/a" at either end
    if ax.get_xscale() == "log":
        pad = 2.0 ** (0.06 * np.log2(hi / lo))
        ax.set_xlim(lo / pad, hi * pad)
    elif hi > lo:
        ax.set_xlim(lo - 0.06 * (hi - lo), hi + 0.06 * (hi - lo))
