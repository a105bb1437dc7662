"""Frobenius coupling of two facts in one head's state (How Linear Attention Remembers, §2.4, §3.3, Fig. 5c).

For ordered fact pairs (A, B) of one context and the frozen head, at the query boundary b:
Δ_A = S_b(donor changing A) - S_b(recipient) and Δ_B likewise for B. Δ_A splits into its part parallel to Δ_B,
P = (<Δ_A, Δ_B>_F / ||Δ_B||_F²) Δ_B, and the orthogonal remainder O = Δ_A - P. Each of P, O and Δ_A is added to
the recipient's state and the query for B is run: the change in B's answer margin (z_B - max of the other
candidates) says how much editing A disturbs B through their overlap. Controls: a Gaussian matrix of the same
Frobenius norm in place of P, of O and of Δ_A. cos(Δ_A, Δ_B) is reported beside.

A is each pair's target fact (its donor from build_multifact_pairs); the donor for B is the recipient with B's value
token replaced, at every presentation, by one of B's distractor candidates (every value is one token, so the
sequences stay aligned). Paper: the parallel part lowers B's margin, the orthogonal part raises it, random directions
move it less, and the full edit is weak.
"""
from __future__ import annotations

import random
from functools import partial
from typing import Optional, Sequence

import pandas as pd
import torch

from recurscope.interp import interventions as iv
from recurscope.interp import stats
from recurscope.interp.protocols._common import (ProtocolResult, ci_text, frozen_setup, head_label, model_record,
                                                 source_units)
from recurscope.interp.protocols.runner import FigureSpec, Section, finish
from recurscope.interp.verdicts import GDN, GLA, Claim, judge_family, measure_from
from recurscope.interp.protocols._layouts import build_selectivity_pairs

__all__ = ["ARMS", "split_parallel", "run_coupling", "reading"]

ARMS = ("full", "parallel", "orthogonal", "random_full", "random_parallel", "random_orthogonal")
LABELS = {"full": "full Δ_A", "parallel": "part of Δ_A parallel to Δ_B", "orthogonal": "orthogonal remainder",
          "random_full": "random, ‖Δ_A‖", "random_parallel": "random, ‖parallel‖",
          "random_orthogonal": "random, ‖orthogonal‖"}
_ARM_CODE = {arm: i for i, arm in enumerate(ARMS)}


def split_parallel(delta_a: torch.Tensor, delta_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(parallel, orthogonal) parts of delta_a with respect to delta_b in the Frobenius inner product, batched over
    the leading dimension: parallel = <Δ_A, Δ_B>_F / ||Δ_B||_F² Δ_B, orthogonal = Δ_A - parallel. Where Δ_B = 0
    the parallel part is 0."""
    if delta_a.shape != delta_b.shape:
        raise ValueError(f"delta_a and delta_b must have the same shape, got {tuple(delta_a.shape)} and "
                         f"{tuple(delta_b.shape)}")
    a, b = delta_a.double().flatten(1), delta_b.double().flatten(1)
    nb = (b * b).sum(1)
    coef = torch.where(nb > 0, (a * b).sum(1) / nb.clamp(min=torch.finfo(torch.float64).tiny), torch.zeros_like(nb))
    parallel = (coef[:, None] * b).reshape(delta_a.shape)
    return parallel, delta_a.double() - parallel


def _frobenius_cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.double().flatten(1), b.double().flatten(1)
    return (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1)).clamp(min=1e-300)


def _answer_margin(z: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    idx = torch.arange(z.shape[0])
    others = z.double().clone()
    others[idx, r] = -torch.inf
    return z.double()[idx, r] - others.max(1).values


def _donor_for_fact(pairs, row: int, fact: int, seed: int) -> tuple[torch.Tensor, int]:
    """The recipient's tokens with fact `fact`'s value replaced by one of the query row's distractor candidates."""
    rng = random.Random(f"coupling/{seed}/{int(pairs.group[row])}/{fact}")
    answer = int(pairs.recipient_answer_index[row])
    choices = [c for c in range(pairs.candidate_ids.shape[1]) if c != answer]
    new_index = rng.choice(choices)
    ids = pairs.recipient_ids[row].clone()
    spans = pairs.value_spans[row, fact]
    for start, end in spans.tolist():
        if start >= 0:
            ids[start:end] = pairs.candidate_ids[row, new_index]
    return ids, new_index


def coupling_group(model, pairs, g: int, head, seed: int) -> list[dict]:
    """The rows of one pair (group g) of four-fact pairs: for each other fact B, B's answer margin on the clean
    recipient state and on the recipient state edited by each arm, with cos(Δ_A, Δ_B) and the norms. One prefix
    batch and one suffix batch of this pair alone, so a pair's rows do not depend on the others."""
    layer, h = head
    device = iv.model_device(model)
    with torch.no_grad():
        rows_g = torch.nonzero(pairs.group == g)[:, 0]
        target_row = int(rows_g[pairs.is_target[rows_g]][0])
        fact_a = int(pairs.target_fact[target_row])
        b_rows = [int(i) for i in rows_g if int(pairs.queried_fact[i]) != fact_a]
        b = int(pairs.query_start[target_row]) - 1
        # One prefix batch: recipient, donor changing A, and one donor per B.
        edited = [_donor_for_fact(pairs, i, int(pairs.queried_fact[i]), seed) for i in b_rows]
        prefix = torch.stack([pairs.recipient_ids[target_row], pairs.donor_ids[target_row],
                              *[e[0] for e in edited]])[:, :b + 1].to(device)
        _, cache = model(prefix, use_cache=True)
        S = cache.head_state(layer, h).double()                       # (2 + nB, K, V)
        nB = len(b_rows)
        delta_a = (S[1] - S[0]).expand(nB, *S.shape[1:])
        delta_b = S[2:] - S[0]
        parallel, orthogonal = split_parallel(delta_a, delta_b)
        cos = _frobenius_cos(delta_a, delta_b)
        edits = {"full": delta_a, "parallel": parallel, "orthogonal": orthogonal}
        for part in ("full", "parallel", "orthogonal"):
            noise = torch.stack([iv.seeded_gaussian(S.shape[1:], seed,
                                                    int(g) * 64 + j * 8 + _ARM_CODE["random_" + part], layer, h)
                                 for j in range(nB)])
            scale = edits[part].flatten(1).norm(dim=1) / noise.flatten(1).norm(dim=1)
            edits["random_" + part] = noise * scale[:, None, None]
        # Suffix runs: for each B, its query on the clean recipient cache and on each edited cache.
        recipient = cache.select([0] * (nB * (1 + len(ARMS))))
        states = [S[0].expand(nB, *S.shape[1:])] + [S[0] + edits[arm] for arm in ARMS]
        recipient.set_head_state(layer, h, torch.cat(states).to(recipient.layers[layer].state.dtype))
        suffix = pairs.recipient_ids[b_rows, b + 1:].repeat(1 + len(ARMS), 1).to(device)
        logits, _ = model(suffix, cache=recipient, use_cache=True)
        qp = (pairs.query_pos[b_rows] - (b + 1)).repeat(1 + len(ARMS)).to(device)
        cand = pairs.candidate_ids[b_rows].repeat(1 + len(ARMS), 1)
        z = iv.candidate_logits(logits[torch.arange(len(qp), device=device), qp], cand)
        r = pairs.recipient_answer_index[b_rows].repeat(1 + len(ARMS))
        margin = _answer_margin(z, r).reshape(1 + len(ARMS), nB)
        correct = (z.argmax(1) == r).reshape(1 + len(ARMS), nB)
        new_rows = []
        for j, i in enumerate(b_rows):
            for k, arm in enumerate(ARMS, 1):
                new_rows.append({
                    "pair": int(g), "source": int(pairs.source_id[i]), "row": i, "fact_a": fact_a,
                    "fact_b": int(pairs.queried_fact[i]), "arm": arm, "cos_ab": float(cos[j]),
                    "norm_delta_a": float(delta_a[j].norm()), "norm_delta_b": float(delta_b[j].norm()),
                    "norm_edit": float(edits[arm][j].norm()), "clean_margin_b": float(margin[0, j]),
                    "margin_b": float(margin[k, j]), "margin_change_b": float(margin[k, j] - margin[0, j]),
                    "clean_correct_b": float(correct[0, j]), "correct_b": float(correct[k, j])})
    return new_rows


def coupling_unit(model, pairs, rows, *, head, seed: int) -> list[dict]:
    """A unit for --ray: the rows of every pair (group) among `rows` (one source's rows, indexing the whole batch)."""
    groups = sorted({int(pairs.group[i]) for i in rows})
    return [r for g in groups for r in coupling_group(model, pairs, g, head, seed)]


def _arm_order(column):
    return column.map({a: i for i, a in enumerate(ARMS)}) if column.name == "arm" else column


def run_coupling(model, pairs=None, head: Optional[Sequence[int]] = None, *, run_dir=None, from_scan=None,
                 n_sources: int = 32, n_dev: int = 16, layout=None, seed: int = 0,
                 n_resamples: int = 9999, model_name: str = "model", progress=None, executor=None) -> ProtocolResult:
    """Rows: one per (pair, fact B != A, arm) with B's answer-margin change, cos(Δ_A, Δ_B) and the norms.
    executor: the CLI's --ray runner; each source's pairs are then one unit on a Ray worker."""
    layout, chosen, _, pairs = frozen_setup(
        model, pairs, head, from_scan, n_dev=n_dev, layout=layout, seed=seed,
        build=lambda lay: build_selectivity_pairs(model.tokenizer, n_sources=n_sources, model=model, layout=lay))
    iv.check_pairs(model, pairs)
    log = None if run_dir is None else run_dir.table("coupling_rows", key=["pair", "fact_b", "arm"])
    done = set() if log is None else {k[0] for k in log.done_keys()}
    collected = []
    groups = sorted(set(pairs.group.tolist()))
    if executor is not None:     # --ray: one unit per source, this process the only writer
        todo = [u for u in source_units(pairs) if any(int(pairs.group[i]) not in done for i in u)]

        def on_rows(unit, records):
            records = [r for r in records if r["pair"] not in done]
            if log is not None:
                log.append(records)
            collected.extend(records)
        if progress:
            progress(f"{len(todo)} source units on Ray")
        executor(pairs, todo, partial(coupling_unit, head=chosen, seed=seed), on_rows)
    for gi, g in enumerate([] if executor is not None else groups):
        if g in done:
            continue
        if progress:
            progress(f"pair {gi + 1}/{len(groups)}")
        new_rows = coupling_group(model, pairs, g, chosen, seed)
        if log is not None:
            log.append(new_rows)
        collected.extend(new_rows)
    rows = log.read() if log is not None else pd.DataFrame(collected)
    rows = rows[rows["pair"].isin(groups)].sort_values(["pair", "row", "arm"], key=_arm_order, kind="stable")
    rows = rows.reset_index(drop=True)
    metrics = ["margin_change_b", "cos_ab", "norm_edit"]
    sources = rows.groupby(["arm", "source"])[metrics].mean().reset_index()
    summary = stats.summarise(rows, metrics, by=["arm"], n_resamples=n_resamples, seed=seed)
    info = {"head": chosen, **model_record(model), "n_sources": int(rows["source"].nunique()), "n_pairs_ab": int(len(rows) / len(ARMS))}
    result = ProtocolResult("coupling", rows, sources, summary, info=info)
    figure = FigureSpec("coupling", summary, dict(row_col="arm", rows=list(ARMS), panels=["margin_change_b"],
                                                  panel_labels={"margin_change_b": "change in B's margin"},
                                                  row_labels=LABELS,
                                                  controls=[a for a in ARMS if a.startswith("random")],
                                                  title=f"{model_name}: Frobenius coupling, head {head_label(chosen)}"))
    return finish(result, run_dir, lambda r: coupling_section(r, model_name), [figure])


def coupling_section(result: ProtocolResult, model_name: str) -> Section:
    s, info = result.summary, result.info
    table = ["| edit | change in B's margin | Frobenius norm of the edit |", "|---|---|---|"]
    for arm in ARMS:
        table.append(f"| {LABELS[arm]} | {ci_text(s, {'arm': arm}, 'margin_change_b')} | "
                     f"{ci_text(s, {'arm': arm}, 'norm_edit')} |")
    intro = (f"{info['n_pairs_ab']} ordered fact pairs (A, B) on {info['n_sources']} held-out sources; edits added "
             "to the recipient's state at the query boundary, B queried. Means over sources, 95% source-bootstrap "
             "intervals.")
    return Section(f"Frobenius coupling: {model_name}, head {head_label(info['head'])}", intro,
                   [table, [f"cos(Δ_A, Δ_B) = {ci_text(s, {'arm': 'full'}, 'cos_ab', digits=3)}"]], reading(s, family=info.get("family")))


def reading(s: pd.DataFrame, *, family: Optional[str]) -> list[str]:
    """The paper's signs hold for its GLA and GDN models alike (Fig. 5c); a model of another family (family from
    verdicts.paper_family) gets no verdict."""
    out = ["The paper: the parallel part lowers B's margin, the orthogonal part raises it, random directions of the "
           "same norm move it less, and the full edit is weak."]
    claims = {"parallel": Claim.negative("the parallel part lowers B's margin"),
              "orthogonal": Claim.positive("the orthogonal part raises B's margin")}
    for arm, claim in claims.items():
        out.append(judge_family(measure_from(s, {"arm": arm}, "margin_change_b"), family, {GLA: claim, GDN: claim},
                                f"B's margin change under the {LABELS[arm]}", f"{claim.paper} (GLA and GDN)"))
    for arm in ("full", "random_parallel", "random_orthogonal"):
        m = measure_from(s, {"arm": arm}, "margin_change_b")
        if m is not None:
            out.append(f"The edit \"{LABELS[arm]}\" moves it by {m.text()} (reported without a verdict: the paper gives no "
                       "number).")
    return out
