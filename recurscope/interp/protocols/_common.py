"""What every protocol shares: the result of a run, the frozen head, the pairs, the result directory and the report
section. The pair builders, interventions, statistics, figures and result directories are the project's own
(interp.data, interp.interventions, interp.stats, interp.plots, interp.results); nothing here re-implements them."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import pandas as pd

from recurscope.interp import interventions as iv
from recurscope.interp.results import RunDir

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


def pair_kwargs(filler: int = 512, presentations: int = 3, n_facts: int = 4, template: str = "is_in",
                vocab: str = "cities", seed: int = 0, gap_tokens: int = 24) -> dict:
    """The layout of §3.3 (K = 4 facts, 3 presentations, 512 filler tokens) as build_pairs keyword arguments."""
    return dict(filler_tokens=filler, presentations=presentations, n_facts=n_facts, template=template, vocab=vocab,
                seed=seed, gap_tokens=gap_tokens)


def max_length(model) -> Optional[int]:
    """Attention layers bound the sequence length; recurrent-only models take any length."""
    return getattr(model.cfg, "max_position_embeddings", None) if model.attention_layers else None


def rank_heads(model, *, n_dev: int = 16, layout: Optional[dict] = None, batch_size: int = 96) -> pd.DataFrame:
    """Every recurrent head ranked by J on `n_dev` dev sources (interp.scan.run_scan): the frozen ranking."""
    from recurscope.interp.data import build_pairs
    from recurscope.interp.scan import run_scan

    layout = dict(layout or pair_kwargs())
    dev = build_pairs(model.tokenizer, split="dev", n_sources=n_dev, max_length=max_length(model), **layout)
    return run_scan(model, dev, batch_size=batch_size).heads


def frozen_head(model, head: Optional[Sequence[int]] = None, from_scan=None, *, n_dev: int = 16,
                layout: Optional[dict] = None) -> tuple[Head, pd.DataFrame | None]:
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
        return heads_from_scan(from_scan, model, top_k=1)[0], table
    table = rank_heads(model, n_dev=n_dev, layout=layout)
    return (int(table.iloc[0]["layer"]), int(table.iloc[0]["head"])), table


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


def finish(result: ProtocolResult, run_dir: Optional[RunDir]) -> ProtocolResult:
    """Writes the per-source rows, the summary and the report section (report.md) into run_dir."""
    result.run_dir = run_dir
    if run_dir is None:
        return result
    run_dir.write_table(f"{result.name}_sources", result.sources)
    run_dir.write_table(f"{result.name}_summary", result.summary)
    (run_dir.path / "report.md").write_text(result.section + "\n")
    return result


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


def excludes_zero(e: Optional[tuple]) -> bool:
    return e is not None and (e[1] > 0 or e[2] < 0)


# ---- command-line pieces shared by the protocol verbs ----------------------------------------------------

def add_protocol_args(p, *, n_sources: int, split: str = "heldout") -> None:
    """Options every protocol verb shares: the frozen head, the sources and the §3.3 layout, the result directory."""
    p.add_argument("--head", type=int, nargs=2, metavar=("LAYER", "HEAD"), default=None,
                   help="the frozen head; default: the top head of --from-scan, else of a fresh scan on --n-dev dev sources")
    p.add_argument("--from-scan", default=None, help="a scan result directory whose top head is the frozen head")
    p.add_argument("--n-dev", type=int, default=16, help="dev sources for the head scan when no head is given")
    p.add_argument("--n-sources", type=int, default=n_sources, help=f"{split} sources to evaluate on")
    p.add_argument("--filler", type=int, default=512, help="filler tokens between the last presentation and the query")
    p.add_argument("--presentations", type=int, default=3)
    p.add_argument("--gap", type=int, default=24, help="filler tokens between presentations")
    p.add_argument("--template", default="is_in")
    p.add_argument("--vocab", default="cities")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resamples", type=int, default=9999, help="bootstrap resamples per interval")
    p.add_argument("--out", required=True, help="result directory (resumed if it holds the same work)")


def layout_from_args(args) -> dict:
    return pair_kwargs(filler=args.filler, presentations=args.presentations, template=args.template,
                       vocab=args.vocab, seed=args.seed, gap_tokens=args.gap)


def work_args(args, *extra) -> dict:
    keys = ("model", "head", "from_scan", "n_dev", "n_sources", "filler", "presentations", "gap", "template", "vocab",
            "seed", *extra)
    return {k: getattr(args, k) for k in keys}
