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

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import pandas as pd
import torch

from recurscope.interp import stats
from recurscope.interp.interventions.clean_runs import prefix_caches
from recurscope.interp.interventions.common import candidate_logits, model_device
from recurscope.interp.metrics import example_metrics
from recurscope.interp.protocols._common import model_record, ProtocolResult, ci_text, max_length, pair_spec
from recurscope.interp.protocols.runner import FigureSpec, Section, finish
from recurscope.interp.verdicts import AMBIGUITIES, GDN, Claim, Measure, judge, judge_family, measure_from

__all__ = ["ARMS", "PARTS", "require_hybrid", "cache_factorial", "shares", "run_hybrid", "reading"]

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


@dataclass(frozen=True)
class Task:
    """One task of the factorial and what the paper reports on it (Sec. 4.1; Table 2 for update and niah):
    the KV/full share and, for Table 2, the donor-answer rates of the recurrent and the KV swap and clean recall."""

    label: str
    kv_share: tuple                         # (low, high) of the paper's KV/full share
    kv_donor: Optional[tuple] = None        # (low, high) of the paper's KV donor-answer rate
    recurrent_donor: Optional[float] = None
    clean: str = ""
    paper: str = ""


TASKS = {
    "recall": Task("four-fact recall (K = 4, §3.3 layout)", (KV_SHARE_AT_LEAST, 1.0), paper=PAPER),
    "update": Task("entity update (the target re-bound at its last presentation)", (0.962, 0.972),
                   kv_donor=(0.852, 0.898), recurrent_donor=0.0, clean="93.0% (WikiText), 89.1% (PG19)",
                   paper="Table 2, Qwen3.5-4B, 128 sources: clean 93.0% / 89.1%, recurrent donor answers 0.0%, KV "
                         "donor answers 85.2% / 89.8%, KV/full 97.2% / 96.2% (WikiText / PG19 filler)"),
    "niah": Task("RULER single-NIAH (one needle in a haystack)", (0.972, 0.972), kv_donor=(1.0, 1.0),
                 recurrent_donor=0.0, clean="100.0%",
                 paper="Table 2, Qwen3.5-4B, about 4K tokens, 64 sources: clean 100.0%, recurrent donor answers "
                       "0.0%, KV donor answers 100.0%, KV/full 97.2%"),
}


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
                if pairs.candidate_tokens is not None:
                    logits[arm][rows] = continuation_scores(model, cache, suffix,
                                                            [pairs.candidate_tokens[r] for r in rows.tolist()])
                    continue
                out, _ = model.run_suffix(suffix, cache)
                last = out[torch.arange(len(rows), device=out.device), qp]
                logits[arm][rows] = candidate_logits(last, pairs.candidate_ids[rows]).float().cpu()
    return logits


def continuation_scores(model, cache, suffix: torch.Tensor, candidates: list) -> torch.Tensor:
    """(B, C) full conditional log-likelihoods of each row's candidate answers (token lists) after its suffix run
    on `cache`: one forward of every (row, candidate) on the row's cache, logits at the answer positions only
    (data.scoring). For single-token answers this is the candidate logit minus one log-normaliser per row, so
    margins between candidates equal the logit margins."""
    from recurscope.interp.data.scoring import continuation_batch, sequence_loglik

    B, C = suffix.shape[0], len(candidates[0])
    flat = [c for row in candidates for c in row]
    ids, positions, tokens, mask = continuation_batch(suffix.cpu().repeat_interleave(C, 0), flat)
    device = suffix.device
    out = model(ids.to(device), cache=cache.repeat_interleave(C), logit_positions=positions.to(device))
    return sequence_loglik(out, tokens, mask).float().cpu().view(B, C)


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


def factorial_unit(model, pairs, rows) -> list[dict]:
    """One unit of work (rows of whole sources): the factorial's row records, numbered as in the whole batch. A
    top-level function, so that Ray workers can run it (interp.distributed.run_units_ray)."""
    rows = list(rows)
    return cache_factorial(model, pairs.select(rows), len(rows), rows=np.asarray(rows)).to_dict("records")


def factorial_rows(model, pairs, *, run_dir=None, batch_size: int = 16, table: str = "hybrid_rows",
                   progress: Optional[Callable[[str], None]] = None, executor: Optional[Callable] = None
                   ) -> pd.DataFrame:
    """Every arm's rows, chunk by chunk of whole sources; with a result directory each chunk goes to the row log
    `table` as it finishes and the chunks already there are skipped. executor(pairs, units, compute, on_rows), where
    given (the CLI's --ray), runs one unit per source elsewhere; this process alone writes the log."""
    require_hybrid(model)
    log = None if run_dir is None else run_dir.table(table, key=["arm", "row"])
    done = set() if log is None else {int(k[1]) for k in log.done_keys() if k[0] == "both"}
    frames = []
    chunks = source_chunks(pairs, 1 if executor is not None else batch_size)
    todo = [chunk for chunk in chunks if not set(chunk) <= done]

    def on_rows(chunk, records):
        if log is not None:
            log.append(records)
        frames.append(pd.DataFrame.from_records(records))
    if executor is not None:
        if progress:
            progress(f"{len(todo)} source units on Ray ({len(chunks) - len(todo)} done before)")
        if todo:
            executor(pairs, todo, factorial_unit, on_rows)
    else:
        for i, chunk in enumerate(chunks):
            if chunk not in todo:
                continue
            if progress:
                progress(f"sources chunk {i + 1}/{len(chunks)}")
            frame = cache_factorial(model, pairs.select(chunk), batch_size, rows=np.asarray(chunk))
            on_rows(chunk, frame.to_dict("records"))
    if log is not None:
        rows = log.read()
    else:
        rows = pd.concat(frames, ignore_index=True)
    order = {arm: i for i, arm in enumerate(ARMS)}
    return rows.sort_values(["arm", "row"], key=lambda c: c.map(order) if c.name == "arm" else c)\
        .reset_index(drop=True)


def build_factorial_pairs(model, *, n_sources: int, layout=None, task: str = "recall", total_length: int = 4096):
    """The held-out pairs of one task (TASKS): §3.3 four-fact recall, the entity update (the target re-bound at its
    last presentation; the donor's new value differs) or single-needle retrieval (build_niah_pairs). layout: a
    PairSpec, PairLayout or layout name (recall and update; niah takes only its seed)."""
    from recurscope.interp.data import build_pairs

    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    layout = pair_spec(layout)
    if task == "niah":
        return build_niah_pairs(model.tokenizer, n_sources=n_sources, total_length=total_length, seed=layout.seed)
    variant = "update" if task == "update" else "swap"
    return build_pairs(model.tokenizer, split="heldout", n_sources=n_sources, max_length=max_length(model),
                       variant=variant, **layout.kwargs())


def build_niah_pairs(tokenizer, *, n_sources: int, total_length: int, seed: int = 0, n_candidates: int = 4):
    """RULER single-NIAH swap pairs (Table 2): each source is one haystack of `total_length` tokens with one needle
    "the special magic number for KEY is VALUE." at an evenly spaced depth; the donor is the same sequence with
    another number in the needle, all of its tokens replaced (a donor number has as many needle tokens as the
    recipient's, so positions stay aligned). Candidates: the recipient's and the donor's number and n_candidates - 2
    others, shuffled per row, distinct as answer token sequences. Where some answer is several tokens (digit-splitting
    vocabularies), the batch carries each candidate's answer tokens (PairBatch.candidate_tokens) and the factorial
    scores them by full conditional log-likelihood. What cannot be built is refused by name before any prompt is
    written."""
    import random

    from recurscope.interp.data import PairBatch, build_niah

    if n_candidates < 3:
        raise ValueError(f"n_candidates must be >= 3 (the donor-specific shift needs a distractor); got {n_candidates}")
    niah = build_niah(tokenizer, n_sources, total_length, seed=seed)
    words, value_tokens, answers = niah.candidates, niah.value_tokens, niah.candidate_tokens
    if len(words) < n_candidates:
        raise ValueError(f"the tokenizer leaves {len(words)} usable numbers (dropped: {sorted(niah.report['dropped_numbers'])}"
                         f"); n_candidates={n_candidates} needs that many")
    partners = {j: [k for k in range(len(words)) if k != j and len(value_tokens[k]) == len(value_tokens[j])]
                for j in range(len(words))}
    lonely = sorted({words[int(j)] for j in niah.answer_index.tolist() if not partners[int(j)]})
    if lonely:
        raise ValueError(f"no donor number has as many needle tokens as {lonely} in this tokenizer, so the donor "
                         "cannot replace the whole value at the same positions; pass numbers of equal token length")
    rng = random.Random(f"niah-pairs/{seed}/{total_length}/{n_sources}")
    n = len(niah)
    donor_ids = niah.input_ids.clone()
    cands, r_idx, d_idx, d_values, c_words, c_tokens, value_ends = [], [], [], [], [], [], []
    for i in range(n):
        r = int(niah.answer_index[i])
        d = rng.choice(partners[r])
        at = int(niah.value_pos[i])
        donor_ids[i, at:at + len(value_tokens[d])] = torch.tensor(value_tokens[d])
        value_ends.append(at + len(value_tokens[r]))
        others = rng.sample([j for j in range(len(words)) if j not in (r, d)], n_candidates - 2)
        order = [r, d, *others]
        rng.shuffle(order)
        cands.append([answers[j][0] for j in order])
        c_tokens.append([list(answers[j]) for j in order])
        c_words.append([words[j] for j in order])
        r_idx.append(order.index(r))
        d_idx.append(order.index(d))
        d_values.append([words[d]])
    span = niah.needle_span[:, None, None, :]
    value = torch.stack([niah.value_pos, torch.tensor(value_ends)], -1)[:, None, None, :]
    zeros = torch.zeros(n, dtype=torch.long)
    return PairBatch(
        recipient_ids=niah.input_ids, donor_ids=donor_ids, query_start=niah.query_start, query_pos=niah.query_pos,
        candidate_ids=torch.tensor(cands, dtype=torch.long),
        recipient_answer_index=torch.tensor(r_idx, dtype=torch.long),
        donor_answer_index=torch.tensor(d_idx, dtype=torch.long), stale_answer_index=torch.full((n,), -1),
        target_fact=zeros, queried_fact=zeros, is_target=torch.ones(n, dtype=torch.bool),
        group=torch.arange(n), source_id=torch.arange(n), fact_spans=span.clone(), value_spans=value,
        splits=["heldout"] * n, origins=["niah"] * n, templates=["niah"] * n, vocabs=["numbers"] * n,
        variants=["niah"] * n, keys=[[k] for k in niah.keys], candidates=c_words,
        recipient_values=[[v] for v in niah.values], donor_values=d_values, report=dict(niah.report),
        candidate_tokens=c_tokens if niah.multi_token else None)


def run_hybrid(model, pairs=None, *, run_dir=None, task: str = "recall", n_sources: int = 128,
               layout=None, total_length: Optional[int] = None, seed: int = 0,
               batch_size: int = 16, n_resamples: int = 9999, model_name: str = "model",
               progress=None, executor: Optional[Callable] = None) -> ProtocolResult:
    """The factorial on one task (TASKS): `pairs` as given, else held-out pairs of the task in `layout` (recall,
    update) or of `total_length` tokens (niah; default the smaller of 4096, the paper's about 4K, and the model's
    positions). executor: see factorial_rows (the CLI's --ray)."""
    require_hybrid(model)
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    layout = pair_spec(layout, seed=seed)
    limit = max_length(model)
    if total_length is None:
        total_length = min(4096, limit or 4096)
    elif limit is not None and total_length > limit:
        raise ValueError(f"--total-length {total_length} is longer than the model's {limit} positions; pass "
                         f"--total-length {limit} or less")
    if pairs is None:
        pairs = build_factorial_pairs(model, n_sources=n_sources, layout=layout, task=task, total_length=total_length)
    rows = factorial_rows(model, pairs, run_dir=run_dir, batch_size=batch_size, progress=progress,
                          executor=executor)
    label = TASKS[task].label + (f", {total_length} tokens" if task == "niah" else "")
    n_candidates = int(pairs.candidate_ids.shape[1])
    return factorial_result("hybrid", rows, model=model, model_name=model_name, run_dir=run_dir, seed=seed,
                            n_resamples=n_resamples, task=task, label=label, chance=1.0 / n_candidates)


def factorial_result(name: str, rows: pd.DataFrame, *, model, model_name: str, run_dir, seed: int,
                     n_resamples: int, task: str, label: str, chance: float) -> ProtocolResult:
    """Sources, summary (every metric per arm, plus the shares of the full swap), figure and section of a factorial's
    rows."""
    sources = rows.groupby(["arm", "source"])[list(METRICS)].mean().reset_index()
    summary = pd.concat([stats.summarise(rows, list(METRICS), by=["arm"], n_resamples=n_resamples, seed=seed,
                                         proportions=["donor_answer", "clean_correct", "correct"]),
                         shares(rows, n_resamples=n_resamples, seed=seed)], ignore_index=True)
    info = {**model_record(model), "n_sources": int(rows["source"].nunique()), "recurrent_layers": list(model.recurrent_layers),
            "attention_layers": list(model.attention_layers), "task": task, "label": label, "chance": chance}
    result = ProtocolResult(name, rows, sources, summary, info=info)
    labelled = summary.assign(arm=summary["arm"].map(LABELS))
    figure = FigureSpec(name, labelled, dict(
        row_col="arm", rows=[LABELS[a] for a in ARMS], panels=["share_of_full", "donor_margin_shift", "donor_answer"],
        percent=["share_of_full", "donor_answer"],
        panel_labels={"share_of_full": "share of the full swap", "donor_margin_shift": "donor-margin shift",
                      "donor_answer": "donor answers"},
        title=f"{model_name}: hybrid cache factorial, {label}"))
    return finish(result, run_dir, lambda r: factorial_section(r, model_name), [figure])


def factorial_section(result: ProtocolResult, model_name: str) -> Section:
    s, info = result.summary, result.info
    table = ["| arm | share of the full swap | donor-margin shift (logits) | donor answers | recall after |",
             "|---|---|---|---|---|"]
    for arm in ARMS:
        table.append(f"| {LABELS[arm]} | {ci_text(s, {'arm': arm}, 'share_of_full', pct=True)} | "
                     f"{ci_text(s, {'arm': arm}, 'donor_margin_shift')} | "
                     f"{ci_text(s, {'arm': arm}, 'donor_answer', pct=True)} | "
                     f"{ci_text(s, {'arm': arm}, 'correct', pct=True)} |")
    intro = (f"{info['label']}; {info['n_sources']} held-out sources. At the query boundary the recipient takes the "
             f"donor's recurrent caches (state and conv tail of layers {info['recurrent_layers']}), its attention KV "
             f"(layers {info['attention_layers']}) or both; clean recall "
             f"{ci_text(s, {'arm': 'both'}, 'clean_correct', pct=True)}. Shares are ratios of source means with "
             "source-bootstrap 95% intervals.")
    return Section(f"Hybrid cache factorial: {model_name}, {info['label']}", intro, [table],
                   reading(s, info["task"], info["chance"], family=info.get("family", GDN)))


def _share(s: pd.DataFrame, arm: str) -> Optional[Measure]:
    return measure_from(s, {"arm": arm}, "share_of_full", "pct")


def _range(bounds: tuple, paper: str) -> Claim:
    return Claim.equals(bounds[0], paper) if bounds[0] == bounds[1] else Claim.between(*bounds, paper)


def reading(s: pd.DataFrame, task: str = "recall", chance: Optional[float] = None, *,
            family: Optional[str] = GDN) -> list[str]:
    """The Reading of one task's factorial: clean recall against chance (the paper leaves out presets near chance),
    the full swap's shift, the recurrent and KV shares against the paper's, and on Table 2's tasks the donor-answer
    rates against Table 2. The paper's hybrids are Gated DeltaNet hybrids (GDN-340M, Qwen3.5-4B), so a hybrid of
    another family (`family`, verdicts.paper_family: Mamba-2's Nemotron-H, Falcon-H1, ...) gets its shares without a
    verdict."""
    spec = TASKS[task]
    out = [f"The paper: {spec.paper}. (Its hybrid GDN-340M has 16 recurrent and 8 attention layers by App. A's list, "
           f"which its text calls 3:1: {AMBIGUITIES}.)"]
    compare = True
    if chance is not None:
        clean = judge(measure_from(s, {"arm": "both"}, "clean_correct", "pct"),
                      Claim.at_least(chance, f"above chance ({100 * chance:.0f}%), or the preset is left out"),
                      "Clean recall")
        out.append(str(clean))
        if not clean.agrees:
            compare = False
            out.append("Clean recall is not above chance, so there is no answer to attribute: the paper leaves such "
                       "presets out, and the numbers below are not compared with it.")
    full = judge(measure_from(s, {"arm": "both"}, "donor_margin_shift"),
                 Claim.positive("the full swap moves the answer to the donor's"), "The full swap's donor-margin shift")
    out.append(str(full))
    if compare and not full.agrees:
        compare = False
        out.append("With no full-swap effect to divide by, the shares attribute nothing: the numbers below are not "
                   "compared with the paper.")
    claims = []
    if task == "recall":
        claims += [(_share(s, "recurrent"), Claim.at_most(RECURRENT_SHARE_AT_MOST, "at most 3.6%"),
                    "The recurrent caches' share of the full swap"),
                   (_share(s, "kv"), Claim.at_least(KV_SHARE_AT_LEAST, "at least 96%"),
                    "The attention KV's share of the full swap")]
    else:
        lo, hi = spec.kv_share
        dlo, dhi = spec.kv_donor
        claims += [(_share(s, "kv"), _range(spec.kv_share, f"{100 * lo:.1f}%" if lo == hi else
                                            f"{100 * lo:.1f}% to {100 * hi:.1f}%"),
                    "The attention KV's share of the full swap"),
                   (measure_from(s, {"arm": "recurrent"}, "donor_answer", "pct"),
                    Claim.equals(spec.recurrent_donor, f"{100 * spec.recurrent_donor:.1f}%"),
                    "The recurrent swap's donor-answer rate"),
                   (measure_from(s, {"arm": "kv"}, "donor_answer", "pct"),
                    _range(spec.kv_donor, f"{100 * dlo:.1f}%" if dlo == dhi else f"{100 * dlo:.1f}% to {100 * dhi:.1f}%"),
                    "The KV swap's donor-answer rate")]
    for measure, claim, subject in claims:
        if compare:
            out.append(str(judge_family(measure, family, {GDN: claim}, subject,
                                        f"{claim.paper} on its Gated DeltaNet hybrids")))
        else:
            text = "not evaluated" if measure is None else measure.text()
            out.append(f"{subject} is {text} (not compared; paper: {claim.paper}).")
    return out


def _from_args(model, args, run_dir, progress, executor=None) -> ProtocolResult:
    return run_hybrid(model, run_dir=run_dir, task=args.task, n_sources=args.n_sources,
                      layout=args.pair_spec.with_(n_facts=args.n_facts),
                      total_length=args.total_length, seed=args.seed, batch_size=args.batch_size,
                      n_resamples=args.resamples, model_name=args.model, progress=progress, executor=executor)
