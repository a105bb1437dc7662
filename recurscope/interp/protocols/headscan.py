"""Held-out all-head scans of writes and reads (How Linear Attention Remembers, App. C, Fig. 10).

On held-out sources, every recurrent head gets two scores per source: the write scan (a donor write of that head
alone over the target fact's spans) and the read scan (a state swap of that head alone at the query boundary,
interp.scan.run_scan), both as the mean donor-margin shift. Reported: the frozen head's bootstrap rank interval in
each scan (interp.stats.bootstrap_rank_interval), the fraction of heads above 0.25 logit in each, and the
write-versus-read Spearman correlation over heads with its source-bootstrap interval (interp.stats.spearman_with_ci).

Both scans resume after a kill: the write scan's rows go to the result directory's row log "write_scan_rows" head by
head, the read scan's to "read_scan_rows" batch by batch (interp.scan.run_scan), and a rerun computes only what is
missing.

Paper (340M, 96 heads, 32 sources): the selected head ranks [1, 1] in both; 1.0% (GLA) / 3.1% (GDN) of heads
exceed 0.25 logit; write-vs-read Spearman 0.173 [-0.014, 0.320] (GLA), 0.149 [-0.027, 0.285] (GDN).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Optional, Sequence

import numpy as np
import pandas as pd

from recurscope.interp import interventions as iv
from recurscope.interp import stats
from recurscope.interp.metrics import example_metrics
from recurscope.interp.protocols._common import (ProtocolResult, arm_records, frozen_setup, head_label, heldout_pairs,
                                                 model_record, source_units)
from recurscope.interp.protocols.runner import FigureSpec, Section, finish
from recurscope.interp.verdicts import GDN, GLA, Claim, Measure, judge_family
from recurscope.interp.scan import all_heads, run_scan

__all__ = ["THRESHOLD", "write_scan", "joint_threshold_fraction", "run_headscan", "reading"]

THRESHOLD = 0.25        # logits: a head "matters" in a scan when its mean shift exceeds this (App. C)


@dataclass(frozen=True)
class WriteHead:
    """The write scan's rows of one head ("layer:head"): the donor-margin shift of a donor write of that head alone
    on every target row. Called in this process or, under --ray, on a worker (_common.arm_records)."""

    batch_size: int

    def __call__(self, model, pairs, key: str) -> pd.DataFrame:
        layer, head = (int(x) for x in key.split(":"))
        f = example_metrics(pairs, iv.donor_write(model, pairs, [(layer, head)], batch_size=self.batch_size))
        f = f[f["is_target"].astype(bool)]
        return pd.DataFrame({"layer": layer, "head": head, "row": f["row"], "source": f["source"],
                             "pair": f["pair"], "shift": f["donor_margin_shift"]})


def write_scan(model, pairs, heads: Optional[Sequence] = None, *, batch_size: int = 16, run_dir=None,
               progress=None, executor=None) -> pd.DataFrame:
    """One row per (target example, head): the donor-margin shift of a donor write of that head alone. executor:
    the CLI's --ray runner; each head is then one unit on a Ray worker (this process the only writer)."""
    heads = all_heads(model) if heads is None else iv.normalise_heads(model, heads)
    log = None if run_dir is None else run_dir.table("write_scan_rows", key=["layer", "head", "row"])
    done = set() if log is None else {(k[0], k[1]) for k in log.done_keys()}
    frames = []
    compute = WriteHead(batch_size)
    todo = [(layer, head) for layer, head in heads if (layer, head) not in done]

    def on_rows(unit, records):
        if log is not None:
            log.append(records)
        frames.append(pd.DataFrame.from_records(records))
    if executor is not None and todo:
        if progress:
            progress(f"write scan: {len(todo)} head units on Ray")
        executor(pairs, [(f"{l}:{h}",) for l, h in todo], partial(arm_records, fn=compute), on_rows)
    for layer, head in ([] if executor is not None else todo):
        if progress:
            progress(f"write scan {head_label((layer, head))}")
        on_rows(None, compute(model, pairs, f"{layer}:{head}").to_dict("records"))
    rows = log.read() if log is not None else pd.concat(frames, ignore_index=True)
    order = {h: i for i, h in enumerate(heads)}
    rank = [order.get((int(l), int(h)), len(order)) for l, h in zip(rows["layer"], rows["head"])]
    rows = rows.assign(_order=rank)
    return rows[rows["_order"] < len(order)].sort_values("_order", kind="stable").drop(columns="_order")\
        .reset_index(drop=True)


def read_scan_unit(model, pairs, rows, *, batch_size: int) -> list[dict]:
    """A read-scan unit for --ray: every head's state swap on one source's rows (scan.scan_rows on them), the rows
    numbered as in the whole batch."""
    from recurscope.interp.scan import SCAN_KEY, scan_rows

    frame = scan_rows(model, pairs.select(list(rows)), None, batch_size).sort_values(list(SCAN_KEY), kind="stable")
    frame["row"] = [rows[i] for i in frame["row"]]
    return frame.to_dict("records")


def read_scan(model, pairs, run_dir=None, *, batch_size: int, executor=None) -> pd.DataFrame:
    """The read scan (App. C): every head's state swap (scan.run_scan, row log "read_scan_rows"). executor: the CLI's
    --ray runner; each source's rows are then one unit on a Ray worker, equal to the in-process rows to float
    tolerance (the scan's suffix batches group other rows)."""
    if executor is None:
        return run_scan(model, pairs, run_dir, batch_size=batch_size, table="read_scan_rows").rows
    from recurscope.interp.scan import SCAN_KEY, summarise_scan

    table = "read_scan_rows"
    log = None if run_dir is None else run_dir.table(table, key=list(SCAN_KEY))
    done = set() if log is None else log.done_keys()
    collected: list = []
    target = {i for i in range(len(pairs)) if bool(pairs.is_target[i]) and int(pairs.donor_answer_index[i]) >= 0}
    groups = {int(pairs.group[i]) for i in target}
    heads = all_heads(model)

    def keys(unit):
        return {(int(pairs.source_id[i]), int(pairs.group[i]), l, h) for i in unit for l, h in heads}
    units = [u for u in (tuple(i for i in unit if i in target) for unit in source_units(pairs))
             if u and not keys(u) <= done]

    def on_rows(unit, records):
        new = [r for r in records if tuple(r[k] for k in SCAN_KEY) not in done]
        if log is not None:
            log.append(new)
        done.update(tuple(r[k] for k in SCAN_KEY) for r in new)
        collected.extend(new)
    if units:
        executor(pairs, units, partial(read_scan_unit, batch_size=batch_size), on_rows)
    frame = log.read() if log is not None else pd.DataFrame(collected)
    frame = frame[frame["pair"].isin(groups)].sort_values(list(SCAN_KEY), kind="stable").reset_index(drop=True)
    result = summarise_scan(frame)
    if run_dir is not None:
        run_dir.write_table("read_scan_heads", result.heads)
        run_dir.write_table(table, frame)
    return result.rows


def joint_threshold_fraction(scores: pd.DataFrame, *, threshold: float = THRESHOLD, n_resamples: int = 2000,
                             seed: int = 0) -> dict:
    """The paper's joint-threshold count (App. C): the fraction of heads whose mean shift over sources exceeds
    `threshold` in both the write and the read scan, with a percentile interval from resampling sources (the same
    resample in both scans). scores: per (scan, source, layer, head) rows with a "score" column."""
    wide = {scan: scores[scores["scan"] == scan].pivot_table(index="source", columns=["layer", "head"],
                                                               values="score")
            for scan in ("write", "read")}
    heads = wide["write"].columns.intersection(wide["read"].columns)
    sources = wide["write"].index.intersection(wide["read"].index)
    if len(heads) == 0 or len(sources) == 0:
        raise ValueError("the joint count needs both scans on common heads and sources")
    w = wide["write"].loc[sources, heads].to_numpy(float)
    r = wide["read"].loc[sources, heads].to_numpy(float)

    def count(idx):
        return ((w[idx].mean(0) > threshold) & (r[idx].mean(0) > threshold)).sum()
    est = int(count(slice(None)))
    rng = np.random.default_rng(seed)
    n = len(sources)
    boot = np.array([count(rng.integers(0, n, n)) for _ in range(n_resamples if n > 1 else 0)])
    low, high = (np.quantile(boot, [0.025, 0.975]) if len(boot) else (est, est))
    return {"count": est, "n_heads": int(len(heads)), "n_sources": int(n), "estimate": est / len(heads),
            "low": float(low) / len(heads), "high": float(high) / len(heads),
            "method": "percentile source bootstrap" if n > 1 else "degenerate (single source)"}


def run_headscan(model, pairs=None, head: Optional[Sequence[int]] = None, *, run_dir=None, from_scan=None,
                 n_sources: int = 32, n_dev: int = 16, layout=None, seed: int = 0,
                 batch_size: int = 16, n_resamples: int = 2000, model_name: str = "model",
                 progress=None, executor=None) -> ProtocolResult:
    """The write scan and the read scan of every head on held-out pairs. executor: the CLI's --ray runner (the
    write scan's units are heads, the read scan's sources)."""
    layout, chosen, _, pairs = frozen_setup(model, pairs, head, from_scan, n_dev=n_dev, layout=layout, seed=seed,
                                            build=heldout_pairs(model, n_sources))
    writes = write_scan(model, pairs, batch_size=batch_size, run_dir=run_dir, progress=progress, executor=executor)
    if progress:
        progress("read scan (every head's state swap)")
    reads = read_scan(model, pairs, run_dir, batch_size=max(batch_size, 1) * 6, executor=executor)
    rows = pd.concat([writes.assign(scan="write")[["scan", "source", "pair", "layer", "head", "shift"]],
                      reads.assign(scan="read")[["scan", "source", "pair", "layer", "head", "shift"]]],
                     ignore_index=True)
    scores = rows.groupby(["scan", "source", "layer", "head"])["shift"].mean().rename("score").reset_index()
    per_head = scores.groupby(["scan", "layer", "head"])["score"].mean().rename("J").reset_index()
    records = []
    for scan in ("write", "read"):
        sc = scores[scores["scan"] == scan]
        ri = stats.bootstrap_rank_interval(sc, chosen, n_resamples=n_resamples, seed=seed)
        J = per_head[per_head["scan"] == scan]["J"]
        records.append({"scan": scan, "metric": "frozen_head_rank", "estimate": ri.rank, "low": ri.low,
                        "high": ri.high, "n_units": ri.n_units, "n_sources": ri.n_sources})
        records.append({"scan": scan, "metric": "fraction_above_threshold", "estimate": float((J > THRESHOLD).mean()),
                        "low": float("nan"), "high": float("nan"), "n_units": int(len(J)),
                        "n_sources": ri.n_sources})
    joint = joint_threshold_fraction(scores, n_resamples=n_resamples, seed=seed)
    records.append({"scan": "both", "metric": "joint_fraction_above_threshold", "estimate": joint["estimate"],
                    "low": joint["low"], "high": joint["high"], "n_units": joint["n_heads"],
                    "n_sources": joint["n_sources"]})
    wide = scores.pivot(index=["source", "layer", "head"], columns="scan", values="score").reset_index()
    sp = stats.spearman_with_ci(wide["write"], wide["read"], wide["source"],
                                units=[f"L{l}H{h}" for l, h in zip(wide["layer"], wide["head"])],
                                n_resamples=n_resamples, seed=seed)
    records.append({"scan": "write_vs_read", "metric": "spearman", "estimate": sp.rho, "low": sp.low,
                    "high": sp.high, "n_units": sp.n, "n_sources": sp.n_sources})
    summary = pd.DataFrame(records)
    info = {"head": chosen, **model_record(model), "n_heads": int(per_head[["layer", "head"]].drop_duplicates().shape[0]),
            "n_sources": int(scores["source"].nunique()), "spearman_method": sp.method,
            "per_head": per_head}
    result = ProtocolResult("headscan", rows, scores, summary, info=info)
    if run_dir is not None:
        run_dir.write_table("headscan_heads", per_head)
    figure = FigureSpec("headscan", draw=lambda path: _figure(per_head, chosen, path, model_name,
                                                              int(scores["source"].nunique())))
    return finish(result, run_dir, lambda r: headscan_section(r, model_name), [figure])


def _figure(per_head: pd.DataFrame, chosen, out, model_name: str, n_sources: int):
    """Fig. 10 style: write score against read score, one point per head (mean over sources), the frozen head
    marked, the 0.25-logit threshold of both scans drawn and named; the legend below the axes, off the points."""
    from matplotlib.figure import Figure

    from recurscope.interp.plots import _save

    wide = per_head.pivot(index=["layer", "head"], columns="scan", values="J").reset_index()
    fig = Figure(figsize=(4.6, 4.8), layout="constrained")
    ax = fig.subplots()
    ax.scatter(wide["write"], wide["read"], s=18, color="#1f77b4", label=f"heads ({len(wide)})")
    sel = (wide["layer"] == chosen[0]) & (wide["head"] == chosen[1])
    ax.scatter(wide.loc[sel, "write"], wide.loc[sel, "read"], s=60, facecolor="none", edgecolor="#d62728",
               label=f"frozen head {head_label(chosen)}")
    ax.axvline(THRESHOLD, color="0.5", lw=0.8, ls="--", label=f"{THRESHOLD:g}-logit threshold")
    ax.axhline(THRESHOLD, color="0.5", lw=0.8, ls="--")
    ax.set_xlabel("write scan: donor-write shift (logits)")
    ax.set_ylabel("read scan: state-swap shift (logits)")
    fig.legend(loc="outside lower center", ncols=2, fontsize="small", frameon=False)
    fig.suptitle(f"{model_name}: held-out all-head scans\nmean over n = {n_sources} sources")
    return _save(fig, out, wide, 150).png


def headscan_section(result: ProtocolResult, model_name: str) -> Section:
    s, info = result.summary.set_index(["scan", "metric"]), result.info
    table = ["| scan | frozen head's rank [95% interval] | heads above 0.25 logit |", "|---|---|---|"]
    for scan in ("write", "read"):
        r, f = s.loc[(scan, "frozen_head_rank")], s.loc[(scan, "fraction_above_threshold")]
        table.append(f"| {scan} | {int(r['estimate'])} [{int(r['low'])}, {int(r['high'])}] | "
                     f"{100 * f['estimate']:.1f}% ({int(round(f['estimate'] * f['n_units']))}/{int(f['n_units'])}) |")
    j = s.loc[("both", "joint_fraction_above_threshold")]
    table.append(f"| both at once (the paper's count) | – | {100 * j['estimate']:.1f}% [{100 * j['low']:.1f}, "
                 f"{100 * j['high']:.1f}] ({int(round(j['estimate'] * j['n_units']))}/{int(j['n_units'])}) |")
    sp = s.loc[("write_vs_read", "spearman")]
    spearman = [f"Write-vs-read Spearman over heads: {sp['estimate']:+.3f} [{sp['low']:+.3f}, {sp['high']:+.3f}] "
                f"({info['spearman_method']})."]
    intro = f"{info['n_heads']} heads, {info['n_sources']} held-out sources; frozen head {head_label(info['head'])}."
    return Section(f"Held-out all-head write and read scans: {model_name}", intro, [table, spearman],
                   reading(result.summary, info["n_heads"], family=info.get("family")))


def _measure(summary: pd.DataFrame, scan: str, metric: str, unit: str) -> Measure:
    r = summary[(summary["scan"] == scan) & (summary["metric"] == metric)].iloc[0]
    return Measure(float(r["estimate"]), float(r["low"]), float(r["high"]), int(r["n_sources"]), unit)


#: Each family's numbers (verdicts.paper_family): heads above 0.25 logit in both scans, write-vs-read Spearman.
FAMILY_PAPER = {GLA: (0.010, 0.173, "0.173 [-0.014, 0.320] on GLA-340M"),
                GDN: (0.031, 0.149, "0.149 [-0.027, 0.285] on GDN-340M")}


def reading(summary: pd.DataFrame, n_heads: int, *, family: Optional[str]) -> list[str]:
    """`family` (GLA or GDN, verdicts.paper_family) picks the paper's numbers of the model's family; the rank
    claim ([1, 1] on both 340M models) is judged on either, and on no other family."""
    out = ["The paper (96 heads, 32 sources): rank [1, 1] in both scans, 1.0% (GLA) / 3.1% (GDN) of heads above 0.25 "
           "logit in both scans at once, write-vs-read Spearman 0.173 [-0.014, 0.320] (GLA) and 0.149 [-0.027, "
           "0.285] (GDN)."]
    for scan in ("write", "read"):
        rank = Claim.at_most(1, "rank [1, 1] on GLA-340M and GDN-340M")
        out.append(judge_family(_measure(summary, scan, "frozen_head_rank", "rank"), family, {GLA: rank, GDN: rank},
                                f"The frozen head's rank in the {scan} scan", "rank [1, 1] on GLA-340M and GDN-340M"))
    out.append(judge_family(_measure(summary, "both", "joint_fraction_above_threshold", "pct"), family,
                            {fam: Claim.effect(frac, f"{100 * frac:.1f}% of 96 heads on {fam}-340M")
                             for fam, (frac, _, _) in FAMILY_PAPER.items()},
                            f"The fraction of the {n_heads} heads above 0.25 logit in both scans",
                            "GLA-340M 1.0%, GDN-340M 3.1% of 96 heads"))
    out.append(judge_family(_measure(summary, "write_vs_read", "spearman", "ratio"), family,
                            {fam: Claim.equals(rho, text) for fam, (_, rho, text) in FAMILY_PAPER.items()},
                            "The write-vs-read Spearman correlation over heads", "GLA-340M 0.173, GDN-340M 0.149"))
    if n_heads <= 8:
        out.append(f"With {n_heads} heads, the fractions move in steps of {100 / n_heads:.0f}% and a Spearman "
                   "correlation over so few points says little; the wider checkpoints are the real test.")
    return out
