"""What every protocol shares: the result of a run, the frozen head, the pairs, the result directory and the report
section. The pair builders, interventions, statistics, figures and result directories are the project's own
(interp.data, interp.interventions, interp.stats, interp.plots, interp.results); nothing here re-implements them."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional, Sequence

import pandas as pd

from recurscope.interp import interventions as iv
from recurscope.interp.data.layout import PairLayout, resolve_layout
from recurscope.interp.results import RunDir
from recurscope.interp.verdicts import paper_family

Head = tuple[int, int]


@dataclass
class ProtocolResult:
    """One protocol run.

    rows: per-example (or per-unit) rows, the raw measurements; sources: per-source means, the statistical unit;
    summary: source-bootstrap estimates with 95% intervals (interp.stats); figures: {name: png path};
    section: the markdown report section (table, figure, "Reading"); info: scalars the section quotes."""

    name: str
    rows: pd.DataFrame
    sources: pd.DataFrame
    summary: pd.DataFrame
    figures: dict = field(default_factory=dict)
    section: str = ""
    info: dict = field(default_factory=dict)
    run_dir: Optional[RunDir] = None


#: The layout of a protocol called as a library function with no layout: the §3.3 layout as the bundled checkpoints
#: record it (4 bindings x 3 presentations, 512 filler tokens, the "where is KEY? KEY is in" query). The command line
#: resolves its own (--layout, else the checkpoint's pair_layout.json, else the paper's; runner.pair_spec_from_args).
PROTOCOL_LAYOUT = "where_is"


@dataclass(frozen=True)
class PairSpec:
    """The recall pairs a protocol builds, apart from the split and the sources: the prompt layout (a PairLayout,
    interp.data.layout) and the words (vocab, or keys/values lists, and what to do with words that are not single
    tokens) under `seed`. kwargs() gives them to build_pairs and its variants."""

    layout: PairLayout = field(default_factory=lambda: resolve_layout(PROTOCOL_LAYOUT))
    vocab: str = "cities"
    keys: Optional[tuple] = None
    values: Optional[tuple] = None
    on_multitoken: str = "filter"
    seed: int = 0

    def with_(self, **changes) -> "PairSpec":
        """A copy with PairLayout fields (n_facts, presentations, filler_tokens, gap_tokens, lead_tokens, template;
        None ignored, as PairLayout.with_) and word fields (vocab, keys, values, on_multitoken, seed) changed."""
        fields = {k for k in PairLayout.__dataclass_fields__ if k != "name"}
        unknown = sorted(set(changes) - fields - set(self.__dataclass_fields__))
        if unknown:
            raise ValueError(f"{unknown} are not PairSpec or PairLayout fields")
        layout = self.layout.with_(**{k: v for k, v in changes.items() if k in fields})
        return replace(self, layout=layout, **{k: v for k, v in changes.items() if k not in fields and k != "layout"})

    def record(self) -> dict:
        """The spec as flat JSON fields, for a manifest: the layout's fields (without its name; lead_tokens where
        set) and the words."""
        layout = self.layout
        out = dict(filler_tokens=layout.filler_tokens, presentations=layout.presentations, n_facts=layout.n_facts,
                   template=layout.template, vocab=self.vocab, seed=self.seed, gap_tokens=layout.gap_tokens)
        if layout.lead_tokens is not None:
            out["lead_tokens"] = layout.lead_tokens
        if self.on_multitoken != "filter":
            out["on_multitoken"] = self.on_multitoken
        for name in ("keys", "values"):
            if getattr(self, name) is not None:
                out[name] = list(getattr(self, name))
        return out

    def kwargs(self) -> dict:
        """build_pairs keyword arguments."""
        out = dict(layout=self.layout, vocab=self.vocab, seed=self.seed)
        if self.on_multitoken != "filter":   # build_pairs' default
            out["on_multitoken"] = self.on_multitoken
        if self.keys is not None:
            out["keys"] = list(self.keys)
        if self.values is not None:
            out["values"] = list(self.values)
        return out


def pair_spec(layout: "PairSpec | PairLayout | str | None" = None, **changes) -> PairSpec:
    """A PairSpec from a PairSpec, a PairLayout, a layout name (interp.data.layout.LAYOUTS) or None
    (PROTOCOL_LAYOUT), with `changes` (PairSpec.with_)."""
    if isinstance(layout, dict):
        raise TypeError("a protocol's layout is a PairSpec, a PairLayout or a layout name, not build_pairs keyword "
                        "arguments: e.g. pair_spec('where_is', filler_tokens=128)")
    spec = layout if isinstance(layout, PairSpec) else PairSpec(resolve_layout(layout or PROTOCOL_LAYOUT))
    return spec.with_(**changes)


def max_length(model) -> Optional[int]:
    """Attention layers bound the sequence length; recurrent-only models take any length."""
    return getattr(model.cfg, "max_position_embeddings", None) if model.attention_layers else None


def model_record(model) -> dict:
    """What every protocol's info records about the model: the paper's family whose numbers apply
    (verdicts.paper_family) and the parameter count, for the Reading's scale caveat (verdicts.scale_caveat)."""
    params = getattr(model, "parameters", None)
    n_params = sum(p.numel() for p in params()) if callable(params) else None
    return {"family": paper_family(model), "n_params": n_params}


def rank_heads(model, *, n_dev: int = 16, layout: "PairSpec | PairLayout | str | None" = None,
               batch_size: int = 96) -> pd.DataFrame:
    """Every recurrent head ranked by J on `n_dev` dev sources (interp.scan.run_scan): the frozen ranking, with the
    top head's source-bootstrap J interval in J_low / J_high (on the first row; ranking_names_a_head reads it)."""
    from recurscope.interp import stats
    from recurscope.interp.data import build_pairs
    from recurscope.interp.scan import run_scan

    dev = build_pairs(model.tokenizer, split="dev", n_sources=n_dev, max_length=max_length(model),
                      **pair_spec(layout).kwargs())
    result = run_scan(model, dev, batch_size=batch_size)
    table = result.heads.copy()
    top = result.scores[(result.scores["layer"] == table.iloc[0]["layer"])
                        & (result.scores["head"] == table.iloc[0]["head"])]
    ci = stats.source_bootstrap_ci(top["score"].to_numpy(), top["source"].to_numpy(), n_resamples=2000)
    table["J_low"], table["J_high"] = float("nan"), float("nan")
    table.loc[table.index[0], ["J_low", "J_high"]] = [ci.low, ci.high]
    return table


def ranking_names_a_head(ranking: pd.DataFrame, scan_dir=None) -> bool:
    """Whether a scan's per-head table (layer, head, J) names a head: its best J is not tied with the next, lies
    above verdicts.IDENTITY_TOLERANCE (float noise), and its source-bootstrap interval excludes zero where known
    (J_low on the table, or the scan directory's winner.json). Otherwise the scan is inside its noise floor."""
    import json
    import math

    from recurscope.interp.verdicts import IDENTITY_TOLERANCE

    J = ranking.sort_values("J", ascending=False, kind="stable")["J"].to_numpy(float)
    if len(J) == 0 or J[0] <= IDENTITY_TOLERANCE or (len(J) > 1 and J[0] == J[1]):
        return False
    top = ranking.sort_values("J", ascending=False, kind="stable").iloc[0]
    if "J_low" in ranking.columns and not math.isnan(float(top["J_low"])):
        return bool(top["J_low"] > 0)
    winner = None if scan_dir is None else Path(scan_dir) / "winner.json"
    if winner is not None and winner.is_file():
        return bool(json.loads(winner.read_text()).get("winner", True))
    return True


def frozen_head(model, head: Optional[Sequence[int]] = None, from_scan=None, *, n_dev: int = 16,
                layout: "PairSpec | PairLayout | str | None" = None) -> tuple[Head, pd.DataFrame | None]:
    """The head a protocol intervenes on, never chosen on the evaluation sources: `head` as given, else the top head
    of a scan directory (`from_scan`), else the winner of a fresh scan on `n_dev` dev sources. Returns (head, the
    scan's per-head table or None)."""
    if head is not None:
        if len(head) != 2:
            raise ValueError(f"head must be one (layer, head) pair, e.g. --head 0 1; got {list(head)}")
        return iv.normalise_heads(model, [tuple(int(x) for x in head)])[0], None
    if from_scan is not None:
        from recurscope.interp.confirm import heads_from_scan

        table = pd.read_csv(Path(from_scan) / "scan_heads.csv") if (Path(from_scan) / "scan_heads.csv").is_file() else None
        chosen = heads_from_scan(from_scan, model, top_k=1)[0]
        if table is not None:
            _refuse_noise(table, from_scan)
        return chosen, table
    table = rank_heads(model, n_dev=n_dev, layout=layout)
    _refuse_noise(table)
    return (int(table.iloc[0]["layer"]), int(table.iloc[0]["head"])), table


def _refuse_noise(table: pd.DataFrame, scan_dir=None) -> None:
    """A head is frozen from a scan only when the scan names one (ranking_names_a_head); otherwise a one-line
    refusal that says why and how to study a head anyway."""
    if ranking_names_a_head(table, scan_dir):
        return
    top = table.sort_values("J", ascending=False, kind="stable").iloc[0]
    interval = (f" [{top['J_low']:+.3g}, {top['J_high']:+.3g}]" if "J_low" in table.columns
                and pd.notna(top["J_low"]) else "")
    raise ValueError(f"the scan names no head: its best J, {top['J']:+.3g}{interval} (L{int(top['layer'])}"
                     f"H{int(top['head'])}), is tied or inside its noise floor, so no head can be frozen from it; "
                     "check that the model does the task, or pass --head LAYER HEAD to study a head you choose")


def frozen_setup(model, pairs, head, from_scan, *, n_dev: int, layout: "PairSpec | PairLayout | str | None",
                 seed: int, build: Callable[[PairSpec], object]):
    """What a single-head protocol starts from: the pairs' spec (pair_spec(layout) under the run's `seed`), the
    frozen head with the scan table it came from (frozen_head) and the evaluation pairs (`build(spec)` when `pairs`
    is None). Returns (spec, head, scan table or None, pairs)."""
    layout = pair_spec(layout, seed=seed)
    chosen, scan_heads = frozen_head(model, head, from_scan, n_dev=n_dev, layout=layout)
    return layout, chosen, scan_heads, (build(layout) if pairs is None else pairs)


def heldout_pairs(model, n_sources: int):
    """build(spec) for frozen_setup: held-out swap pairs (build_pairs) of `n_sources` sources."""
    from recurscope.interp.data import build_pairs

    return lambda spec: build_pairs(model.tokenizer, split="heldout", n_sources=n_sources,
                                    max_length=max_length(model), **spec.kwargs())


def head_label(heads) -> str:
    heads = [heads] if isinstance(heads, tuple) else heads
    return "+".join(f"L{l}H{h}" for l, h in heads)


def open_run(out, *, kind: str, model, model_name: str, args: dict, seeds, sources=None, split=None) -> RunDir:
    """A result directory with its manifest (interp.results.RunDir); an existing one is resumed if the work matches."""
    return RunDir.create_or_open(out, kind=kind, model_name=model_name,
                                 checkpoint_path=getattr(model, "checkpoint_dir", None), args=args, seeds=seeds,
                                 sources=sources, split=split)


def logged_arms(run_dir: Optional[RunDir], table: str, key: Sequence[str], arms: Sequence[str],
                compute: Callable[[str], pd.DataFrame], progress: Optional[Callable[[str], None]] = None) -> pd.DataFrame:
    """Runs compute(arm) for every arm not yet in the row log `table` of run_dir (first key column: the arm) and
    returns all rows; an interrupted run resumes at the first arm without rows."""
    log = None if run_dir is None else run_dir.table(table, key=list(key))
    done = set() if log is None else {k[0] for k in log.done_keys()}
    frames = []
    for arm in arms:
        if arm in done:
            continue
        if progress:
            progress(arm)
        frame = compute(arm)
        if log is not None:
            log.append(frame.to_dict("records"))
        frames.append(frame)
    if log is not None:
        rows = log.read()
        return rows[rows[key[0]].isin(list(arms))].reset_index(drop=True)
    return pd.concat(frames, ignore_index=True)


def source_units(pairs) -> list[tuple]:
    """The row indices of each source of `pairs`, in source order: the independent units of a per-row protocol."""
    source = pairs.source_id.cpu().tolist()
    units: dict[int, list] = {}
    for i, s in enumerate(source):
        units.setdefault(int(s), []).append(i)
    return [tuple(units[s]) for s in sorted(units)]


def logged_arms_on(executor: Callable, run_dir: Optional[RunDir], table: str, arms: Sequence[str], pairs,
                   unit: Callable, progress: Optional[Callable[[str], None]] = None) -> pd.DataFrame:
    """logged_arms with (source, arm) units run by `executor(pairs, units, compute, on_rows)` (the CLI's --ray):
    for each arm, compute = partial(unit, arm=arm), a picklable top-level function (model, pairs, rows) -> row
    records with the rows' indices in the whole batch; this process alone appends them to the row log `table`
    (key (arm, row)), so the result is the in-process run's and either resumes the other."""
    from functools import partial

    log = None if run_dir is None else run_dir.table(table, key=["arm", "row"])
    done = set() if log is None else {(k[0], int(k[1])) for k in log.done_keys()}
    frames = []

    def on_rows(rows, records):
        if log is not None:
            log.append(records)
        frames.append(pd.DataFrame.from_records(records))
    units = source_units(pairs)
    for arm in arms:
        todo = [u for u in units if any((arm, i) not in done for i in u)]
        if not todo:
            continue
        if progress:
            progress(f"{arm}: {len(todo)} source units on Ray")
        executor(pairs, todo, partial(unit, arm=arm), on_rows)
    rows = log.read() if log is not None else pd.concat(frames, ignore_index=True)
    order = {a: i for i, a in enumerate(arms)}             # the in-process order: arm by arm, rows in order
    rows = rows[rows["arm"].isin(list(arms))]
    return rows.sort_values(["arm", "row"], key=lambda c: c.map(order) if c.name == "arm" else c,
                            kind="stable").reset_index(drop=True)


def arm_records(model, pairs, arms: Sequence[str], *, fn: Callable) -> list[dict]:
    """A named unit for --ray (logged_arms_on_ray): fn(model, pairs, arm) (a picklable callable giving the arm's
    rows as a DataFrame) for every arm of the unit, as row records."""
    return pd.concat([fn(model, pairs, arm) for arm in arms], ignore_index=True).to_dict("records")


def arm_frame(model, pairs, keys: Sequence[str], *, fn: Callable) -> pd.DataFrame:
    """arm_records as one DataFrame, its dtypes kept (unit_frames: rows that go to no row log)."""
    return pd.concat([fn(model, pairs, key) for key in keys], ignore_index=True)


def logged_arms_on_ray(executor: Callable, run_dir: Optional[RunDir], table: str, key: Sequence[str],
                       arms: Sequence[str], fn: Callable, pairs=None, progress: Optional[Callable[[str], None]] = None,
                       unit_of: Optional[Callable[[str], object]] = None) -> pd.DataFrame:
    """logged_arms with whole arms as units, run by `executor(pairs, units, compute, on_rows)` (the CLI's --ray):
    fn(model, pairs, arm) is the arm's computation, the same function the in-process run calls (so the rows are
    its rows exactly: the same batches, the same seeds); arms with the same unit_of(arm) (default: each arm alone)
    form one unit, e.g. the arms of one load that share its pairs. This process alone appends each unit's rows to
    the row log `table` (first key column: the arm), arms already logged are skipped, and the rows come back in the
    order of `arms`, as the in-process run returns them."""
    from functools import partial

    log = None if run_dir is None else run_dir.table(table, key=list(key))
    done = set() if log is None else {k[0] for k in log.done_keys()}
    todo = [a for a in arms if a not in done]
    groups: dict = {}
    for arm in todo:
        groups.setdefault(arm if unit_of is None else unit_of(arm), []).append(arm)
    frames = []

    def on_rows(unit, records):
        if log is not None:
            log.append(records)
        frames.append(pd.DataFrame.from_records(records))
    if groups:
        if progress:
            progress(f"{len(todo)} arms in {len(groups)} units on Ray")
        executor(pairs, [tuple(g) for g in groups.values()], partial(arm_records, fn=fn), on_rows)
    rows = log.read() if log is not None else pd.concat(frames, ignore_index=True)
    order = {a: i for i, a in enumerate(arms)}
    rows = rows[rows[key[0]].isin(list(arms))]
    return rows.sort_values(key[0], key=lambda c: c.map(order), kind="stable").reset_index(drop=True)


def unit_frames(model, keys: Sequence[str], fn: Callable, pairs=None, progress: Optional[Callable[[str], None]] = None,
                executor: Optional[Callable] = None) -> pd.DataFrame:
    """fn(model, pairs, key) for every key, concatenated in the order of `keys`, without a row log: in this process,
    or with `executor` (the CLI's --ray) one unit per key on Ray workers."""
    if executor is None:
        frames = []
        for key in keys:
            if progress:
                progress(key)
            frames.append(fn(model, pairs, key))
        return pd.concat(frames, ignore_index=True)
    from functools import partial

    done: dict = {}
    if progress:
        progress(f"{len(keys)} units on Ray")
    executor(pairs, [(key,) for key in keys], partial(arm_frame, fn=fn),
             lambda unit, frame: done.__setitem__(unit[0], frame))
    return pd.concat([done[key] for key in keys], ignore_index=True)


def run_arms(model, run_dir: Optional[RunDir], table: str, key: Sequence[str], arms: Sequence[str], fn: Callable,
             pairs=None, progress: Optional[Callable[[str], None]] = None, executor: Optional[Callable] = None,
             unit_of: Optional[Callable[[str], object]] = None) -> pd.DataFrame:
    """The rows of every arm, fn(model, pairs, arm) each: in this process (logged_arms) or, with `executor` (the
    CLI's --ray), on Ray workers with whole arms as units (logged_arms_on_ray); either resumes the other."""
    if executor is not None:
        return logged_arms_on_ray(executor, run_dir, table, key, arms, fn, pairs, progress, unit_of)
    return logged_arms(run_dir, table, key, arms, lambda arm: fn(model, pairs, arm), progress)


def ci_text(summary: pd.DataFrame, where: dict, metric: str, pct: bool = False, digits: int = 2) -> str:
    """"estimate [low, high]" of one summary row, or "–" where it is missing or undefined."""
    sel = summary["metric"] == metric
    for col, value in where.items():
        sel &= summary[col] == value
    row = summary[sel]
    if row.empty or pd.isna(row.iloc[0]["estimate"]):
        return "–"
    r = row.iloc[0]
    if pct:
        return f"{100 * r['estimate']:.1f}% [{100 * r['low']:.1f}, {100 * r['high']:.1f}]"
    return f"{r['estimate']:+.{digits}f} [{r['low']:+.{digits}f}, {r['high']:+.{digits}f}]"


def estimate(summary: pd.DataFrame, where: dict, metric: str) -> Optional[tuple[float, float, float]]:
    sel = summary["metric"] == metric
    for col, value in where.items():
        sel &= summary[col] == value
    row = summary[sel]
    if row.empty or pd.isna(row.iloc[0]["estimate"]):
        return None
    r = row.iloc[0]
    return float(r["estimate"]), float(r["low"]), float(r["high"])


def pooled_break_rate(rows: pd.DataFrame, by: Sequence[str], *, col: str = "nontarget_break", n_resamples: int = 9999,
                      seed: int = 0) -> pd.DataFrame:
    """The paper's non-target break rate: breaks over the originally-correct non-targets pooled over every source
    (a ratio of sums, not a mean of per-source rates), with a source-bootstrap interval (sources resampled, both sums
    recomputed). One summary row per group of `by`, metric "pooled_break_rate", with the breaks and eligible counts."""
    from recurscope.interp import stats

    records = []
    eligible = rows[rows[col].notna()]
    for key, group in eligible.groupby(list(by), sort=True):
        key = key if isinstance(key, tuple) else (key,)
        per = group.groupby("source")[col].agg(["sum", "count"])
        breaks, eligible_n = int(per["sum"].sum()), int(per["count"].sum())
        ci = stats.source_ratio_ci(per["sum"].to_numpy(float), per["count"].to_numpy(float), per.index.to_numpy(),
                                   n_resamples=n_resamples, seed=seed)
        low, high, method = ci.low, ci.high, f"pooled over sources; {ci.method}"
        if ci.degenerate:              # every source at the same rate (e.g. no break anywhere): the counts' interval
            b = stats.binomial_ci(breaks, eligible_n)
            low, high, method = b.low, b.high, f"pooled; Wilson interval on the counts ({ci.method} bootstrap)"
        records.append({**dict(zip(by, key)), "metric": "pooled_break_rate", "estimate": ci.estimate, "low": low,
                        "high": high, "n_sources": ci.n_sources, "n_examples": eligible_n, "method": method,
                        "breaks": breaks, "eligible": eligible_n})
    return pd.DataFrame(records, columns=[*by, "metric", "estimate", "low", "high", "n_sources", "n_examples",
                                          "method", "breaks", "eligible"])
