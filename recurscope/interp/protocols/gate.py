"""The natural-sentence capability gate (How Linear Attention Remembers, App. F.2, Table 3).

Before any intervention is read, the model must show it can do the task at all. run_gate is the paper's gate as
specified: ONE evidence sentence (a single natural-sentence fact, presented once), values from 31 single-token
cities (GATE_CITIES; those the tokenizer does not hold as one token are dropped and the count is reported), TWO fixed
question phrasings (PHRASINGS) that must BOTH be answered right, full-vocabulary top-1 (the model's argmax over its
whole vocabulary is the answer's token), a preset threshold of 80% for the recipient and for the donor (the donor's
answer on the donor sequence), and an evidence-removed control (the evidence sentence replaced by filler of equal
length: the answer must then be lost). `--recall candidates` reads top-1 among the pair's four candidates instead
(an easier test, labelled as such).

capability_gate() (interp.capability, re-exported here) is the reusable check the other protocols' --gate options use
on their own pairs: top-1 among the pair's candidates (the project's clean_run); GateResult.passed or
require_capability() (CapabilityGateError). interp.capability.check_capability is the one gate every verb, `run`
and notebook 02 pass before any verdict.

Paper (pure recurrent model, natural sentences): recipient / donor 56.3 / 53.1% at 512 filler, 71.9 / 68.8% at 128;
both under the 80% gate, so the paper stopped there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import pandas as pd

import torch

from recurscope.interp import interventions as iv
from recurscope.interp import stats
from recurscope.interp.protocols._common import ProtocolResult, ci_text, max_length, unit_frames
from recurscope.interp.protocols import verbs
from recurscope.interp.protocols.runner import FigureSpec, Section, finish
from recurscope.interp.capability import CapabilityGateError, GateResult, capability_gate, require_capability
from recurscope.interp.verdicts import measure_from

__all__ = ["GATE_THRESHOLD", "NATURAL_TEMPLATE", "GATE_CITIES", "PHRASINGS", "CapabilityGateError", "GateResult",
           "capability_gate", "require_capability", "top1_correct", "run_gate"]

#: The paper's preset: recipient and donor clean recall both >= 80%.
GATE_THRESHOLD = verbs.GATE_THRESHOLD
NATURAL_TEMPLATE = "natural_lives"
PAPER = {128: (0.719, 0.688), 512: (0.563, 0.531)}
#: 31 cities, single tokens in common BPE vocabularies; run_gate keeps those this tokenizer holds as one token.
GATE_CITIES = tuple("""Paris London Tokyo Berlin Madrid Rome Cairo Lima Oslo Vienna Prague Dublin Athens Moscow Delhi
    Sydney Toronto Boston Chicago Denver Seattle Houston Dallas Miami Lisbon Warsaw Havana Nairobi Manila Seoul
    Bangkok""".split())


#: The two fixed question phrasings of the one evidence sentence (the natural_lives template's fact).
PHRASINGS = ("where does {key} live now? {key} lives in", "in which town does {key} live now? {key} lives in")


def _ask(tokenizer, pairs, question: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The recipient and donor sequences of `pairs` with their question replaced by `question` (the context up to
    query_start kept token for token): (recipient_ids, donor_ids, query_pos)."""
    import re

    from recurscope.interp.data.tokenizer import encode_continuation, single_token_id

    rows = []
    for i in range(len(pairs)):
        key = pairs.keys[i][int(pairs.queried_fact[i])]
        ids = []
        for piece in re.split(r"(\{key\})", question):
            if piece == "{key}":
                ids.append(single_token_id(tokenizer, key))
            elif piece.strip():
                ids.extend(encode_continuation(tokenizer, piece.strip()))
        rows.append(ids)
    if len({len(r) for r in rows}) != 1:
        raise ValueError("the question tokenises to different lengths across keys; use single-token keys")
    q = torch.tensor(rows, dtype=pairs.recipient_ids.dtype)
    start = int(pairs.query_start[0])
    if not bool((pairs.query_start == start).all()):
        raise ValueError("the gate's pairs must share one query start (one layout per call)")
    seq = [torch.cat([ids[:, :start], q], 1) for ids in (pairs.recipient_ids, pairs.donor_ids)]
    return seq[0], seq[1], torch.full((len(pairs),), start + q.shape[1] - 1, dtype=torch.long)




def _check_threshold(threshold) -> float:
    if not isinstance(threshold, (int, float)) or not 0 < threshold <= 1:
        raise ValueError(f"threshold must be a fraction in (0, 1], fixed before the run (the paper uses 0.8); "
                         f"got {threshold!r}")
    return float(threshold)


def top1_correct(model, ids: torch.Tensor, query_pos: torch.Tensor, answer: torch.Tensor, candidate_ids=None, *,
                 batch_size: int = 16) -> torch.Tensor:
    """Whether the model's top-1 at each row's query position is its answer token: over the whole vocabulary, or
    among `candidate_ids` (N, C) when given (`answer` is then the candidate index)."""
    device = iv.model_device(model)
    out = []
    with torch.no_grad():
        for rows in iv.chunks(torch.arange(len(ids)), batch_size):
            logits = model(ids[rows].to(device))
            z = logits[torch.arange(len(rows), device=logits.device), query_pos[rows].to(logits.device)]
            if candidate_ids is not None:
                z = iv.candidate_logits(z, candidate_ids[rows])
            out.append(z.argmax(-1).cpu() == answer[rows])
    return torch.cat(out)


def _answer(pairs, side: str, recall: str):
    idx = pairs.recipient_answer_index if side == "recipient" else pairs.donor_answer_index
    if recall == "candidates":
        return idx, pairs.candidate_ids
    return pairs.candidate_ids[torch.arange(len(pairs)), idx], None


@dataclass(frozen=True)
class GateFiller:
    """The gate's rows at one filler length (the key, a string): both phrasings for recipient, donor and the
    evidence-removed control. Called in this process or, under --ray, on a worker (_common.unit_frames)."""

    common: dict
    recall: str
    batch_size: int

    def __call__(self, model, pairs, key: str) -> pd.DataFrame:
        from recurscope.interp.data import build_neutral_pairs, build_pairs

        filler, recall, batch_size = int(key), self.recall, self.batch_size
        pairs = build_pairs(model.tokenizer, filler_tokens=filler, template=NATURAL_TEMPLATE, **self.common)
        neutral = build_neutral_pairs(model.tokenizer, filler_tokens=filler, template=NATURAL_TEMPLATE,
                                      **self.common)
        per_phrasing = []
        for question in PHRASINGS:
            rec, don, qpos = _ask(model.tokenizer, pairs, question)
            correct = {side: top1_correct(model, ids, qpos, *_answer(pairs, side, recall), batch_size=batch_size)
                       for side, ids in (("recipient", rec), ("donor", don))}
            _, removed, qpos = _ask(model.tokenizer, neutral, question)
            correct["evidence_removed"] = top1_correct(model, removed, qpos, *_answer(neutral, "recipient", recall),
                                                       batch_size=batch_size)
            per_phrasing.append(correct)
        c0, c1 = per_phrasing
        return pd.DataFrame({"filler": filler, "source": pairs.source_id.numpy(),
                             **{f"{k}_correct": (c0[k] & c1[k]).float().numpy() for k in c0},
                             **{f"{k}_correct_phrasing{i}": c[k].float().numpy()
                                for i, c in enumerate((c0, c1), 1) for k in c}})


def run_gate(model, *, fillers: Sequence[int] = (128, 512), vocab=GATE_CITIES, n_sources: int = 32,
             gap_tokens: int = 24, recall: str = "vocabulary", threshold: float = GATE_THRESHOLD, seed: int = 0,
             batch_size: int = 16, n_resamples: int = 9999, run_dir=None, model_name: str = "model",
             executor=None) -> ProtocolResult:
    """The App. F.2 gate at every filler length on held-out sources: per item, recipient and donor are right only
    when both phrasings are; the evidence-removed control reads the recipient's answer with the evidence gone.
    executor: the CLI's --ray runner; each filler length is then one unit on a Ray worker."""
    from recurscope.interp.data import build_pairs

    threshold = _check_threshold(threshold)
    if recall not in ("vocabulary", "candidates"):
        raise ValueError(f"recall must be 'vocabulary' (the paper's) or 'candidates', got {recall!r}")
    common = dict(split="heldout", n_sources=n_sources, n_facts=1, presentations=1, gap_tokens=gap_tokens,
                  vocab=vocab, seed=seed, max_length=max_length(model), on_multitoken="filter")
    last = build_pairs(model.tokenizer, filler_tokens=int(fillers[-1]), template=NATURAL_TEMPLATE, **common)
    used = {"kept": len(vocab) - len(last.report.get("dropped_values", {})), "of": len(vocab)}
    rows = unit_frames(model, [str(int(f)) for f in fillers], GateFiller(common, recall, batch_size),
                       executor=executor)
    metrics = [c for c in rows.columns if c.endswith(("_correct", "_phrasing1", "_phrasing2"))]
    summary = stats.summarise(rows, metrics, by=["filler"], n_resamples=n_resamples, seed=seed, proportions=metrics)
    point = summary.set_index(["filler", "metric"])["estimate"]
    summary["passed"] = [bool(point[(f, "recipient_correct")] >= threshold and point[(f, "donor_correct")] >= threshold)
                         for f in summary["filler"]]
    summary["threshold"] = threshold
    sources = rows.groupby(["filler", "source"])[metrics].mean().reset_index()
    info = {"threshold": threshold, "n_sources": int(rows["source"].nunique()), "fillers": [int(f) for f in fillers],
            "recall": recall, "cities": used}
    result = ProtocolResult("gate", rows, sources, summary, info=info)
    figure = FigureSpec("gate", summary, dict(
        row_col="filler", panels=["recipient_correct", "donor_correct", "evidence_removed_correct"], kind="lines",
        percent=["recipient_correct", "donor_correct", "evidence_removed_correct"],
        reference={"recipient_correct": threshold, "donor_correct": threshold}, row_name="filler tokens",
        reference_labels={"recipient_correct": f"the {100 * threshold:.0f}% gate"},
        panel_labels={"recipient_correct": "recipient recall", "donor_correct": "donor recall",
                      "evidence_removed_correct": "evidence removed"},
        title=f"{model_name}: App. F.2 capability gate"))
    return finish(result, run_dir, lambda r: gate_section(r, model_name), [figure])


def gate_section(result: ProtocolResult, model_name: str) -> Section:
    s, info = result.summary, result.info
    table = ["| filler | recipient recall | donor recall | evidence removed | gate | paper (recipient / donor) |",
             "|---|---|---|---|---|---|"]
    verdicts = []
    for f in info["fillers"]:
        passed = bool(s[s["filler"] == f]["passed"].iloc[0])
        paper = PAPER.get(f)
        table.append(f"| {f} | {ci_text(s, {'filler': f}, 'recipient_correct', pct=True)} | "
                     f"{ci_text(s, {'filler': f}, 'donor_correct', pct=True)} | "
                     f"{ci_text(s, {'filler': f}, 'evidence_removed_correct', pct=True)} | "
                     f"{'pass' if passed else 'refused'} | "
                     + (f"{100 * paper[0]:.1f}% / {100 * paper[1]:.1f}%" if paper else "–") + " |")
        verdicts.append((f, passed))
    passed = [f for f, ok in verdicts if ok]
    refused = [f for f, ok in verdicts if not ok]
    reading = ["The paper's pure recurrent model reaches 71.9 / 68.8% at 128 filler and 56.3 / 53.1% at 512 on "
               "natural sentences, under its 80% gate, so no intervention was run there."]
    if passed:
        reading.append(f"Here the gate passes at filler {', '.join(map(str, passed))} (both point estimates at or "
                       "above the threshold, the paper's rule; intervals in the table): interventions on that format "
                       "may be read.")
    if refused:
        reading.append(f"It refuses filler {', '.join(map(str, refused))}: intervention results on those conditions "
                       f"are not to be reported.")
    for f in info["fillers"]:
        m = measure_from(s, {"filler": f}, "evidence_removed_correct", "pct")
        if m is not None and m.defined:
            reading.append(f"With the evidence removed (filler {f}) the recipient's answer is top-1 on {m.text()}: "
                           "what the gate counts comes from the evidence sentence only where this is low.")
    if info["recall"] == "candidates":
        reading.append("Recall here is top-1 among the four candidates, not over the vocabulary as in the paper: the "
                       "easier test.")
    recall = ("full-vocabulary top-1" if info["recall"] == "vocabulary" else "top-1 among the four candidates")
    intro = (f"One evidence sentence, {info['cities']['kept']} of the {info['cities']['of']} cities as single "
             f"tokens, two question phrasings that must both be answered right, {recall}; {info['n_sources']} "
             f"held-out sources; preset threshold {100 * info['threshold']:.0f}% for recipient and donor. The "
             "evidence-removed control replaces the evidence sentence by filler of equal length.")
    return Section(f"Capability gate (App. F.2): {model_name}", intro, [table], reading)


def _from_args(model, args, run_dir, progress, executor=None) -> ProtocolResult:
    return run_gate(model, fillers=args.fillers, n_sources=args.n_sources, gap_tokens=args.gap, recall=args.recall,
                    threshold=args.threshold, seed=args.seed, batch_size=args.batch_size,
                    n_resamples=args.resamples, run_dir=run_dir, model_name=args.model, executor=executor)
