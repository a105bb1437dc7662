"""The hybrid cache factorial (How Linear Attention Remembers, Sec. 4.1, Fig. 6).

At the query boundary b = query_start - 1 the recipient's cache gets, from the donor's run on the same prefix
length, either its recurrent caches (the state and the short-convolution tail of every linear-attention layer), its
attention KV (every attention layer), or both; the recipient's suffix (the query) then runs on that cache. Each arm's
donor-margin shift is reported as a share of the full swap's (a ratio of source means with a source-bootstrap
interval, sources resampled jointly for numerator and denominator), beside its donor-answer rate.

Paper: a matched hybrid GDN-340M puts <1% on the recurrent caches and >99% on the KV; on Qwen3.5-4B (retrieval,
latest-value, integration) the recurrent/local share is 0.2%-3.6% and the KV share 96%-100%. The paper leaves out
presets whose clean recall is near chance, where there is no answer to attribute.

Units are sources: every row of a source is computed in one chunk and logged at once (row log `hybrid_rows`, key
(arm, row)), so an interrupted run resumes at the first source without rows.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import pandas as pd
import torch

from recurscope.interp import stats
from recurscope.interp.interventions.clean_runs import prefix_caches
from recurscope.interp.interventions.common import candidate_logits, model_device
from recurscope.interp.metrics import example_metrics
from recurscope.interp.protocols._common import ProtocolResult, ci_text, max_length, pair_kwargs
from recurscope.interp.protocols.runner import FigureSpec, Section, Verb, finish
from recurscope.interp.verdicts import Claim, Measure, judge, measure_from

__all__ = ["ARMS", "PARTS", "require_hybrid", "cache_factorial", "shares", "run_hybrid", "reading", "VERB"]

#: The cache parts each arm takes from the donor (RecurrentCache.swap_from parts).
PARTS = {"recurrent": ("state", "conv"), "kv": ("kv",), "both": ("state", "conv", "kv")}
ARMS = tuple(PARTS)
LABELS = {"recurrent": "recurrent caches (state + conv)", "kv": "attention KV", "both": "both (full swap)"}
METRICS = ("donor_margin_shift", "donor_answer", "clean_correct", "correct")
PAPER = ("recurrent/local share <1% and KV share >99% on a hybrid GDN-340M; 0.2%-3.6% and 96%-100% on Qwen3.5-4B "
         "(retrieval, latest-value, integration)")
#: The paper's bounds on the shares of the full swap (Sec. 4.1): the recurrent share at most 3.6%, the KV at least 96%.
RECURRENT_SHARE_AT_MOST = 0.036
KV_SHARE_AT_LEAST = 0.96


def require_hybrid(model) -> None:
    if not model.attention_layers or not model.recurrent_layers:
        raise ValueError("the cache factorial needs a hybrid (recurrent and attention layers); this model has "
                         f"recurrent layers {list(model.recurrent_layers)} and attention layers "
                         f"{list(model.attention_layers)}: use a hybrid such as tiny-gdn-hybrid or tiny-qwen35")


@torch.no_grad()
def factorial_logits(model, pairs, batch_size: int = 16) -> dict[str, torch.Tensor]:
    """Candidate logits (N, C) of the recipient's query run on its clean cache ("clean") and on each arm's cache."""
    device = model_device(model)
    b_all = (pairs.query_start - 1).cpu()
    logits = {arm: torch.empty(len(pairs), pairs.candidate_ids.shape[1]) for arm in ("clean", *ARMS)}
    for b in torch.unique(b_all).tolist():
        rows_all = torch.nonzero(b_all == b)[:, 0]
        for i in range(0, len(rows_all), batch_size):
            rows = rows_all[i:i + batch_size]
            R, D = prefix_caches(model, pairs, rows, b, device)
            caches = {"clean": R, **{arm: R.swap_from(D, parts=parts) for arm, parts in PARTS.items()}}
            suffix = pairs.recipient_ids[rows, b + 1:].to(device)
            qp = (pairs.query_pos[rows] - (b + 1)).to(device)
            for arm, cache in caches.items():
                out, _ = model.run_suffix(suffix, cache)
                last = out[torch.arange(len(rows), device=out.device), qp]
                logits[arm][rows] = candidate_logits(last, pairs.candidate_ids[rows]).float().cpu()
    return logits


def cache_factorial(model, pairs, batch_size: int = 16, rows: Optional[np.ndarray] = None) -> pd.DataFrame:
    """One row per (arm, example): example_metrics of swapping that part of the donor's cache at b. `rows`: the
    examples' row numbers in the whole batch (default 0..N-1), so that chunks of a batch keep their numbering."""
    require_hybrid(model)
    logits = factorial_logits(model, pairs, batch_size)
    frames = []
    for arm in ARMS:
        m = example_metrics(pairs, logits=logits[arm], clean=logits["clean"], intervention=f"swap_{arm}")
        if rows is not None:
            m["row"] = np.asarray(rows, dtype=int)
        m.insert(0, "arm", arm)
        frames.append(m)
    return pd.concat(frames, ignore_index=True)


def shares(rows: pd.DataFrame, n_resamples: int = 9999, seed: int = 0) -> pd.DataFrame:
    """Each arm's donor-margin shift as a share of the full swap's: mean over sources of the arm's shift over the
    mean of the full swap's, with a source-bootstrap interval (stats.source_ratio_ci, sources resampled jointly, so
    the full swap's own share is exactly 1). Summary rows: arm, metric "share_of_full", estimate, low, high, n."""
    full = rows[rows["arm"] == "both"].set_index("row")["donor_margin_shift"]
    records = []
    for arm in ARMS:
        part = rows[rows["arm"] == arm].set_index("row")
        ci = stats.source_ratio_ci(part["donor_margin_shift"].to_numpy(float),
                                   full.reindex(part.index).to_numpy(float), part["source"].to_numpy(),
                                   n_resamples=n_resamples, seed=seed)
        records.append({"arm": arm, "metric": "share_of_full", "estimate": ci.estimate, "low": ci.low,
                        "high": ci.high, "n_sources": ci.n_sources, "n_examples": ci.n_examples,
                        "method": ci.method, "seed": seed, "confidence": ci.confidence})
    return pd.DataFrame(records)


def source_chunks(pairs, batch_size: int) -> list[list[int]]:
    """Whole sources grouped into chunks of about batch_size rows: the units a run logs and resumes by."""
    source = pairs.source_id.cpu().numpy()
    chunks, current = [], []
    for s in dict.fromkeys(source.tolist()):
        rows = np.flatnonzero(source == s).tolist()
        if current and len(current) + len(rows) > batch_size:
            chunks.append(current)
            current = []
        current += rows
    if current:
        chunks.append(current)
    return chunks


def factorial_rows(model, pairs, *, run_dir=None, batch_size: int = 16, table: str = "hybrid_rows",
                   progress: Optional[Callable[[str], None]] = None) -> pd.DataFrame:
    """Every arm's rows, chunk by chunk of whole sources; with a result directory each chunk goes to the row log
    `table` as it finishes and the chunks already there are skipped."""
    require_hybrid(model)
    log = None if run_dir is None else run_dir.table(table, key=["arm", "row"])
    done = set() if log is None else {int(k[1]) for k in log.done_keys() if k[0] == "both"}
    frames = []
    chunks = source_chunks(pairs, batch_size)
    for i, chunk in enumerate(chunks):
        if set(chunk) <= done:
            continue
        if progress:
            progress(f"sources chunk {i + 1}/{len(chunks)}")
        frame = cache_factorial(model, pairs.select(chunk), batch_size, rows=np.asarray(chunk))
        if log is not None:
            log.append(frame.to_dict("records"))
        frames.append(frame)
    if log is not None:
        return log.read().sort_values(["arm", "row"], key=lambda c: c.map(ARMS.index) if c.name == "arm" else c)\
            .reset_index(drop=True)
    return pd.concat(frames, ignore_index=True)


def build_factorial_pairs(model, *, n_sources: int, layout: dict):
    from recurscope.interp.data import build_pairs

    return build_pairs(model.tokenizer, split="heldout", n_sources=n_sources, max_length=max_length(model), **layout)


def run_hybrid(model, pairs=None, *, run_dir=None, n_sources: int = 128, layout: Optional[dict] = None,
               seed: int = 0, batch_size: int = 16, n_resamples: int = 9999, model_name: str = "model",
               progress=None) -> ProtocolResult:
    require_hybrid(model)
    layout = {**pair_kwargs(seed=seed), **(layout or {})}
    if pairs is None:
        pairs = build_factorial_pairs(model, n_sources=n_sources, layout=layout)
    rows = factorial_rows(model, pairs, run_dir=run_dir, batch_size=batch_size, progress=progress)
    return factorial_result("hybrid", rows, model=model, model_name=model_name, run_dir=run_dir, seed=seed,
                            n_resamples=n_resamples, task="four-fact recall (K = 4, §3.3 layout)")


def factorial_result(name: str, rows: pd.DataFrame, *, model, model_name: str, run_dir, seed: int,
                     n_resamples: int, task: str, reading_fn=None) -> ProtocolResult:
    """Sources, summary (every metric per arm, plus the shares of the full swap), figure and section of a factorial's
    rows."""
    sources = rows.groupby(["arm", "source"])[list(METRICS)].mean().reset_index()
    summary = pd.concat([stats.summarise(rows, list(METRICS), by=["arm"], n_resamples=n_resamples, seed=seed,
                                         proportions=["donor_answer", "clean_correct", "correct"]),
                         shares(rows, n_resamples=n_resamples, seed=seed)], ignore_index=True)
    info = {"n_sources": int(rows["source"].nunique()), "recurrent_layers": list(model.recurrent_layers),
            "attention_layers": list(model.attention_layers), "task": task}
    result = ProtocolResult(name, rows, sources, summary, info=info)
    labelled = summary.assign(arm=summary["arm"].map(LABELS))
    figure = FigureSpec(name, labelled, dict(
        row_col="arm", rows=[LABELS[a] for a in ARMS], panels=["share_of_full", "donor_margin_shift", "donor_answer"],
        percent=["share_of_full", "donor_answer"],
        panel_labels={"share_of_full": "share of the full swap", "donor_margin_shift": "donor-margin shift",
                      "donor_answer": "donor answers"},
        title=f"{model_name}: hybrid cache factorial, {task}"))
    read = reading_fn or reading
    return finish(result, run_dir, lambda r: factorial_section(r, model_name, read), [figure])


def factorial_section(result: ProtocolResult, model_name: str, read) -> Section:
    s, info = result.summary, result.info
    table = ["| arm | share of the full swap | donor-margin shift (logits) | donor answers | recall after |",
             "|---|---|---|---|---|"]
    for arm in ARMS:
        table.append(f"| {LABELS[arm]} | {ci_text(s, {'arm': arm}, 'share_of_full', pct=True)} | "
                     f"{ci_text(s, {'arm': arm}, 'donor_margin_shift')} | "
                     f"{ci_text(s, {'arm': arm}, 'donor_answer', pct=True)} | "
                     f"{ci_text(s, {'arm': arm}, 'correct', pct=True)} |")
    intro = (f"{info['task']}; {info['n_sources']} held-out sources. At the query boundary the recipient takes the "
             f"donor's recurrent caches (state and conv tail of layers {info['recurrent_layers']}), its attention KV "
             f"(layers {info['attention_layers']}) or both; clean recall "
             f"{ci_text(s, {'arm': 'both'}, 'clean_correct', pct=True)}. Shares are ratios of source means with "
             "source-bootstrap 95% intervals.")
    return Section(f"Hybrid cache factorial: {model_name}", intro, [table], read(s))


def _share(s: pd.DataFrame, arm: str) -> Optional[Measure]:
    return measure_from(s, {"arm": arm}, "share_of_full", "pct")


def reading(s: pd.DataFrame) -> list[str]:
    out = [f"The paper: {PAPER}."]
    full = measure_from(s, {"arm": "both"}, "donor_margin_shift")
    v = judge(full, Claim.positive("the full swap moves the answer to the donor's"),
              "The full swap's donor-margin shift")
    out.append(str(v))
    if not v.agrees:
        out.append("With no full-swap effect to divide by, the shares below attribute nothing.")
    out.append(str(judge(_share(s, "recurrent"), Claim.at_most(RECURRENT_SHARE_AT_MOST, "at most 3.6%"),
                         "The recurrent caches' share of the full swap")))
    out.append(str(judge(_share(s, "kv"), Claim.at_least(KV_SHARE_AT_LEAST, "at least 96%"),
                         "The attention KV's share of the full swap")))
    return out


def _options(p) -> None:
    p.add_argument("--n-facts", type=int, default=4, help="facts bound per sequence (K)")


def _from_args(model, args, run_dir, progress) -> ProtocolResult:
    from recurscope.interp.protocols.runner import layout_from_args

    layout = {**layout_from_args(args), "n_facts": args.n_facts}
    return run_hybrid(model, run_dir=run_dir, n_sources=args.n_sources, layout=layout, seed=args.seed,
                      batch_size=args.batch_size, n_resamples=args.resamples, model_name=args.model,
                      progress=progress)


VERB = Verb("hybrid", "hybrid cache factorial: recurrent caches, attention KV, both (Sec. 4.1, Fig. 6)", run_hybrid,
            from_args=_from_args, n_sources=128, head=False, ranking=False, options=_options,
            check=require_hybrid)
