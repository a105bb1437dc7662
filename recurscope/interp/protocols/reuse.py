"""Head reuse across formats and the value-subspace transfer (How Linear Attention Remembers, App. D.2, Fig. 13).

1. The frozen head's donor write (interventions.donor_write over the target fact's spans) in every format: the five
   templates (cities), the value vocabularies (template `is_in`) and the update format (build_update_pairs: the
   target's last presentation re-binds it, the answer is the new value). Per format: clean recall, the donor-answer
   rate and the qualified donor-answer rate, the donor-answer rate among the examples whose clean recall succeeded.
   Each format first passes the capability gate (protocols.gate, 80% by default): a refused format reports its
   recall only.
2. Subspace transfer: the frozen head's query-time edits Delta = o_t(donor) - o_t(recipient) (hook_head_out at the
   query positions, the output patch's change) of colour-value pairs on DEV sources give a rank-4 basis (top right
   singular vectors). On held-out colour and shape pairs the output patch keeps only Delta's component in that
   basis; the shift kept is the ratio of source means, projected / full output patch, against a random rank-4
   basis (seeded, orthonormal).

Paper: GLA keeps qualified donor-answer rates of at least 89.7% across formats (GDN 46.8-91.9%); the rank-4 colour
basis carries colour edits but produces no shape donor answers in either model.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import pandas as pd
import torch

from recurscope.hooks.patches import ReadoutReplace, head_mask
from recurscope.hooks.points import hook_name
from recurscope.interp import interventions as iv
from recurscope.interp import stats
from recurscope.interp.data.words import TEMPLATES, VALUE_VOCABS
from recurscope.interp.metrics import example_metrics
from recurscope.interp.protocols._common import (PairSpec, ProtocolResult, ci_text, frozen_head, head_label, max_length,
                                                 model_record, pair_spec, run_arms)
from recurscope.interp.protocols.runner import FigureSpec, Section, finish
from recurscope.interp.verdicts import GDN, GLA, Claim, judge_family, measure_from
from recurscope.interp.capability import GATE_THRESHOLD, capability_gate

__all__ = ["FORMATS", "SUBSPACE_ARMS", "PAPER", "format_layouts", "edit_deltas", "fit_basis", "random_basis",
           "projected_output_patch", "run_reuse", "reading"]

#: (family, condition) of every format: the five templates, the value vocabularies, the update format.
FORMATS = tuple([("template", t) for t in TEMPLATES] + [("vocab", v) for v in VALUE_VOCABS] + [("update", "is_in")])
SUBSPACE_ARMS = ("output_patch", "colour_basis", "random_basis")
SUBSPACE_LABELS = {"output_patch": "full output patch", "colour_basis": "projected on the colour basis",
                   "random_basis": "projected on a random basis"}
METRICS = ("clean_correct", "donor_answer", "qualified_donor_answer", "donor_margin_shift")
PROPORTIONS = ("clean_correct", "donor_answer", "qualified_donor_answer")
PAPER = {"GLA qualified": ">= 89.7%", "GDN qualified": "46.8-91.9%",
         "transfer": "the colour basis carries colour edits, no shape donor answers"}


def format_layouts(layout=None) -> dict:
    """{"family:condition": build_pairs keyword arguments} of every format in `layout` (a PairSpec, PairLayout or
    layout name; default the §3.3 layout): the template family changes its template, the vocabulary family its
    values (template `is_in`), the update format re-binds the target (template `is_in`)."""
    base = pair_spec(layout)
    out = {}
    for family, cond in FORMATS:
        if family == "template":
            out[f"{family}:{cond}"] = base.with_(template=cond).kwargs()
        elif family == "vocab":
            out[f"{family}:{cond}"] = base.with_(template="is_in", vocab=cond).kwargs()
        else:
            out[f"{family}:{cond}"] = {**base.with_(template="is_in").kwargs(), "variant": "update", "n_updated": 1}
    return out


def edit_deltas(model, pairs, head, *, batch_size: int = 16) -> torch.Tensor:
    """(P, V) query-time edits o_t(donor) - o_t(recipient) of `head` at every query position of every row."""
    iv.require_one_query_per_state(model, "the subspace transfer (edit_deltas)")
    layer, h = head
    name = hook_name("hook_head_out", layer)
    device = iv.model_device(model)
    T = pairs.recipient_ids.shape[1]
    pos = torch.arange(T)[None]
    out = []
    with torch.no_grad():
        for rows in iv.chunks(torch.arange(len(pairs)), batch_size):
            col = iv.Collector([name])
            with model.hooks(fwd_hooks=col.hooks()):
                model(torch.cat([pairs.recipient_ids[rows], pairs.donor_ids[rows]]).to(device))
            o = col.values[name].cpu()[..., h, :].double()
            m = len(rows)
            mask = (pos >= pairs.query_start[rows][:, None]) & (pos <= pairs.query_pos[rows][:, None])
            out.append((o[m:] - o[:m])[mask])
    return torch.cat(out)


def fit_basis(deltas: torch.Tensor, rank: int = 4) -> torch.Tensor:
    """(V, rank) orthonormal basis: the top right singular vectors of the stacked edits."""
    if not isinstance(rank, int) or not 1 <= rank <= deltas.shape[1]:
        raise ValueError(f"rank must be an integer in [1, {deltas.shape[1]}]; got {rank!r}")
    return torch.linalg.svd(deltas.double(), full_matrices=False)[2][:rank].T.contiguous()


def random_basis(V: int, rank: int = 4, seed: int = 0) -> torch.Tensor:
    """(V, rank) orthonormal basis of a seeded Gaussian subspace."""
    gen = torch.Generator().manual_seed(int(seed))
    return torch.linalg.qr(torch.randn(V, rank, generator=gen, dtype=torch.float64))[0]


def projected_output_patch(model, pairs, head, basis: Optional[torch.Tensor], *, batch_size: int = 16):
    """The output patch of `head` (every query position) keeping only the edit's component in span(basis):
    o = o(recipient) + (o(donor) - o(recipient)) B B^T. basis=None is the full output patch."""
    iv.require_one_query_per_state(model, "the projected output patch")
    layer, h = iv.normalise_heads(model, [tuple(head)])[0]
    iv.check_pairs(model, pairs)
    P = None if basis is None else basis.double() @ basis.double().T
    H = model.n_state_heads

    def suffix(ctx, R, D):
        m = ctx.m
        where = torch.zeros(3 * m, ctx.rec.shape[1], dtype=torch.bool)
        where[2 * m:] = ctx.query_mask

        def value(o):
            out = o.clone()
            delta = o[m:2 * m] - o[:m]
            if P is not None:
                delta = (delta.double() @ P.to(o.device)).to(o.dtype)
            out[2 * m:] = o[:m] + delta
            return out
        patches = [ReadoutReplace(layer, value=value, mask=head_mask(where, H, [h]).to(ctx.device))]
        return iv.SuffixRun([ctx.rec, ctx.don, ctx.rec], [R, D, R], ("clean", None, "logits"), patches)
    name = "output_patch" if basis is None else f"projected_output_patch:rank{basis.shape[1]}"
    spec = iv.SuffixSpec(name, [(layer, h)], iv.resolve_boundaries(pairs, None), suffix)
    return iv.run_intervention(model, pairs, spec, batch_size=batch_size)


def _metric_rows(pairs, result, arm: str, **extra) -> pd.DataFrame:
    f = example_metrics(pairs, result, intervention=arm)
    f["qualified_donor_answer"] = np.where(f["clean_correct"] == 1, f["donor_answer"], np.nan)
    out = f[["row", "source", "clean_correct", "donor_answer", "qualified_donor_answer", "donor_margin_shift"]].copy()
    out.insert(0, "arm", arm)
    for k, v in extra.items():
        out[k] = v
    return out


@dataclass(frozen=True)
class FormatArm:
    """The donor write in one format ("family:condition"), behind the capability gate where set: called as
    (model, pairs, arm) in this process or, under --ray, on a worker (a picklable unit, _common.run_arms)."""

    layouts: dict
    n_sources: int
    chosen: tuple
    gate_threshold: Optional[float]
    batch_size: int
    n_resamples: int
    seed: int

    def __call__(self, model, pairs, arm: str) -> pd.DataFrame:
        from recurscope.interp.data import build_pairs

        family, cond = arm.split(":", 1)
        pairs = build_pairs(model.tokenizer, split="heldout", n_sources=self.n_sources, max_length=max_length(model),
                            **self.layouts[arm])
        reason = ""
        if self.gate_threshold is not None:
            g = capability_gate(model, pairs, threshold=self.gate_threshold, condition=arm,
                                batch_size=self.batch_size, n_resamples=min(self.n_resamples, 2000), seed=self.seed)
            reason = "" if g.passed else g.describe()
        frame = _metric_rows(pairs, iv.donor_write(model, pairs, [self.chosen], batch_size=self.batch_size), arm,
                             family=family, condition=cond, reason=reason)
        if reason:                                       # refused by the gate: recall only
            frame[["donor_answer", "qualified_donor_answer", "donor_margin_shift"]] = np.nan
        return frame


@dataclass(frozen=True)
class SubspaceArm:
    """One arm ("vocab:projection") of the colour-to-shape subspace transfer; the colour basis is fitted once per
    instance on the dev sources, so under --ray every subspace arm runs in one unit (_common.run_arms)."""

    base: PairSpec
    n_sources: int
    n_fit: int
    chosen: tuple
    rank: int
    batch_size: int
    seed: int
    basis: dict = field(default_factory=dict, compare=False, repr=False)

    def bases(self, model) -> dict:
        from recurscope.interp.data import build_pairs

        if not self.basis:
            dev = build_pairs(model.tokenizer, split="dev", n_sources=self.n_fit, max_length=max_length(model),
                              **self.base.with_(template="is_in", vocab="colours").kwargs())
            self.basis["colour_basis"] = fit_basis(edit_deltas(model, dev, self.chosen, batch_size=self.batch_size),
                                                   self.rank)
            self.basis["random_basis"] = random_basis(self.basis["colour_basis"].shape[0], self.rank, self.seed)
        return self.basis

    def __call__(self, model, pairs, arm: str) -> pd.DataFrame:
        from recurscope.interp.data import build_pairs

        vocab, how = arm.split(":", 1)
        pairs = build_pairs(model.tokenizer, split="heldout", n_sources=self.n_sources, max_length=max_length(model),
                            **self.base.with_(template="is_in", vocab=vocab).kwargs())
        B = None if how == "output_patch" else self.bases(model)[how]
        return _metric_rows(pairs, projected_output_patch(model, pairs, self.chosen, B, batch_size=self.batch_size),
                            arm, vocab=vocab, projection=how)


def run_reuse(model, head: Optional[Sequence[int]] = None, *, from_scan=None, n_sources: int = 32,
              n_fit: int = 32, n_dev: int = 16, layout=None, rank: int = 4, seed: int = 0,
              gate_threshold: Optional[float] = GATE_THRESHOLD, formats: Optional[Sequence[str]] = None,
              batch_size: int = 16, n_resamples: int = 9999, run_dir=None, model_name: str = "model",
              progress=None, executor=None) -> ProtocolResult:
    """The donor write in every format (`formats`: "family:condition" keys of format_layouts, default all) and the
    colour-to-shape subspace transfer, on `n_sources` held-out sources; the basis is fitted on `n_fit` dev sources.
    gate_threshold=None reports every format without the capability gate. layout: the layout every format starts
    from (a PairSpec, PairLayout or layout name; default the §3.3 layout), under `seed`. executor: the CLI's --ray
    runner; each format is then one unit on a Ray worker, and the subspace transfer (its basis fitted once) one
    more."""
    base = pair_spec(layout, seed=seed)
    chosen, _ = frozen_head(model, head, from_scan, n_dev=n_dev, layout=base)
    layouts = format_layouts(base)
    keys = list(layouts) if formats is None else list(formats)
    unknown = [k for k in keys if k not in layouts]
    if unknown:
        raise ValueError(f"unknown formats {unknown}; choose from {list(layouts)}")
    rows = run_arms(model, run_dir, "reuse_rows", ("arm", "row"), keys,
                    FormatArm(layouts, n_sources, chosen, gate_threshold, batch_size, n_resamples, seed),
                    progress=progress, executor=executor)
    rows["reason"] = rows["reason"].fillna("")
    sub_arms = [f"{v}:{a}" for v in ("colours", "shapes") for a in SUBSPACE_ARMS]
    sub_rows = run_arms(model, run_dir, "subspace_rows", ("arm", "row"), sub_arms,
                        SubspaceArm(base, n_sources, n_fit, chosen, rank, batch_size, seed), progress=progress,
                        executor=executor, unit_of=lambda arm: "subspace")

    summary_f = stats.summarise(rows, list(METRICS), by=["arm"], source_col="source", n_resamples=n_resamples,
                                seed=seed, proportions=list(PROPORTIONS))
    summary_f["reason"] = summary_f["arm"].map(rows.groupby("arm")["reason"].first())
    summary_f.insert(0, "part", "formats")
    summary_s = stats.summarise(sub_rows, ["donor_margin_shift", "donor_answer"], by=["vocab", "projection"],
                                source_col="source", n_resamples=n_resamples, seed=seed, proportions=["donor_answer"])
    kept = []
    for vocab in ("colours", "shapes"):
        full = sub_rows[sub_rows["arm"] == f"{vocab}:output_patch"].sort_values("row")
        for how in SUBSPACE_ARMS[1:]:
            part = sub_rows[sub_rows["arm"] == f"{vocab}:{how}"].sort_values("row")
            ci = stats.source_ratio_ci(part["donor_margin_shift"].to_numpy(float),
                                       full["donor_margin_shift"].to_numpy(float), full["source"].to_numpy(int),
                                       n_resamples=n_resamples, seed=seed)
            kept.append({"vocab": vocab, "projection": how, "metric": "shift_kept", "estimate": ci.estimate,
                         "low": ci.low, "high": ci.high, "n_sources": ci.n_sources, "n_examples": ci.n_examples,
                         "method": ci.method, "seed": seed, "confidence": ci.confidence})
    summary_s = pd.concat([summary_s, pd.DataFrame(kept)], ignore_index=True)
    summary_s.insert(0, "part", "subspace")
    summary = pd.concat([summary_f, summary_s], ignore_index=True)
    sources = pd.concat([rows.groupby(["arm", "source"])[list(METRICS)].mean().reset_index(),
                         sub_rows.groupby(["arm", "source"])[["donor_margin_shift", "donor_answer"]].mean()
                         .reset_index()], ignore_index=True)
    all_rows = pd.concat([rows.assign(part="formats"), sub_rows.assign(part="subspace")], ignore_index=True)
    info = {"head": chosen, **model_record(model), "n_sources": n_sources, "n_fit": n_fit, "rank": rank, "filler": base.layout.filler_tokens, "formats": keys,
            "gate": gate_threshold}
    result = ProtocolResult("reuse", all_rows, sources, summary, info=info)
    figures = [FigureSpec("reuse", summary_f, dict(
                   row_col="arm", rows=keys, panels=["clean_correct", "qualified_donor_answer"],
                   percent=["clean_correct", "qualified_donor_answer"],
                   reference={"clean_correct": gate_threshold} if gate_threshold else None,
                   reference_labels={"clean_correct": f"the {100 * (gate_threshold or 0):.0f}% gate"},
                   panel_labels={"clean_correct": "clean recall", "qualified_donor_answer": "qualified donor answers"},
                   row_labels={k: k for k in keys},
                   missing_labels={a: "refused by the gate" for a, why in
                                   summary_f.groupby("arm")["reason"].first().items() if why},
                   title=f"{model_name}: donor write across formats, head {head_label(chosen)}")),
               FigureSpec("subspace", summary_s, dict(
                   row_col="projection", rows=list(SUBSPACE_ARMS), hue_col="vocab", row_labels=SUBSPACE_LABELS,
                   controls=["random_basis"],
                   panels=["donor_margin_shift", "donor_answer"], percent=["donor_answer"],
                   title=f"{model_name}: rank-{rank} colour basis, head {head_label(chosen)}"))]
    return finish(result, run_dir, lambda r: reuse_section(r, model_name), figures)


def reuse_section(result: ProtocolResult, model_name: str) -> Section:
    s, info = result.summary, result.info
    f = s[s["part"] == "formats"]
    formats = ["| format | clean recall | donor-answer rate | qualified donor-answer rate | donor-margin shift | gate |",
               "|---|---|---|---|---|---|"]
    for arm in info["formats"]:
        reason = f[f["arm"] == arm]["reason"]
        gate = "–" if not info["gate"] else ("refused" if len(reason) and reason.iloc[0] else "pass")
        formats.append(f"| {arm} | {ci_text(f, {'arm': arm}, 'clean_correct', pct=True)} | "
                       f"{ci_text(f, {'arm': arm}, 'donor_answer', pct=True)} | "
                       f"{ci_text(f, {'arm': arm}, 'qualified_donor_answer', pct=True)} | "
                       f"{ci_text(f, {'arm': arm}, 'donor_margin_shift')} | {gate} |")
    sub = s[s["part"] == "subspace"]
    subspace = [f"Rank-{info['rank']} subspace transfer: basis of colour-value edits (head output at the query "
                f"positions) fitted on {info['n_fit']} dev sources, applied to held-out colour and shape pairs.", "",
                "| values | projection | donor-margin shift | donor-answer rate | shift kept (of the full patch) |",
                "|---|---|---|---|---|"]
    for vocab in ("colours", "shapes"):
        for how in SUBSPACE_ARMS:
            w = {"vocab": vocab, "projection": how}
            subspace.append(f"| {vocab} | {SUBSPACE_LABELS[how]} | {ci_text(sub, w, 'donor_margin_shift')} | "
                            f"{ci_text(sub, w, 'donor_answer', pct=True)} | "
                            + ("1 (reference)" if how == "output_patch" else ci_text(sub, w, "shift_kept", pct=True))
                            + " |")
    intro = (f"Donor write of the frozen head over the target's spans; K = 4, 3 presentations, {info['filler']} "
             f"filler tokens, {info['n_sources']} held-out sources"
             + (f"; every format gated at {100 * info['gate']:.0f}% clean recall" if info["gate"] else "")
             + ". The qualified rate counts donor answers among the examples recalled correctly when clean.")
    return Section(f"Head reuse across formats: {model_name}, head {head_label(info['head'])}", intro,
                   [formats, subspace], reading(s, info))


#: Each family's qualified donor-answer rate in every format (verdicts.paper_family): GLA's floor, GDN's range.
FAMILY_CLAIMS = {GLA: Claim.at_least(0.897, "at least 89.7% on GLA-340M in every format"),
                 GDN: Claim.between(0.468, 0.919, "46.8-91.9% on GDN-340M over the formats")}


def reading(s: pd.DataFrame, info: dict) -> list:
    """info["family"] (GLA or GDN, verdicts.paper_family) picks the paper's numbers of the model's family (the
    colour-basis transfer holds for both); another family's model gets no verdict."""
    family = info.get("family")
    out = [f"The paper: GLA's qualified donor-answer rate is {PAPER['GLA qualified']} in every format (GDN "
           f"{PAPER['GDN qualified']}); {PAPER['transfer']}."]
    f = s[s["part"] == "formats"]
    not_read = []
    for arm in info["formats"]:
        m = measure_from(f, {"arm": arm}, "qualified_donor_answer", "pct")
        if m is None or not m.defined:
            not_read.append(arm)
            continue
        out.append(judge_family(m, family, FAMILY_CLAIMS, f"The qualified donor-answer rate in format {arm}",
                                "at least 89.7% on GLA-340M, 46.8-91.9% on GDN-340M"))
    if not_read:
        out.append(f"Not read: {', '.join(not_read)} (refused by the gate or not evaluated).")
    sub = s[s["part"] == "subspace"]
    carries = Claim.positive("the colour basis carries colour edits (GLA and GDN)")
    out.append(judge_family(measure_from(sub, {"vocab": "colours", "projection": "colour_basis"}, "shift_kept", "pct"),
                            family, {GLA: carries, GDN: carries},
                            f"The share of the colour edit's shift the rank-{info['rank']} colour basis keeps",
                            carries.paper, denominator=measure_from(sub, {"vocab": "colours",
                                                                          "projection": "output_patch"},
                                                                    "donor_margin_shift")))
    none = Claim.near_zero("no shape donor answers (GLA and GDN)")
    out.append(judge_family(measure_from(sub, {"vocab": "shapes", "projection": "colour_basis"}, "donor_answer", "pct"),
                            family, {GLA: none, GDN: none}, "The shape donor-answer rate through the colour basis",
                            none.paper))
    for vocab in ("shapes",):
        for how in ("colour_basis", "random_basis"):
            m = measure_from(sub, {"vocab": vocab, "projection": how}, "shift_kept", "pct")
            if m is not None and m.defined:
                out.append(f"Of the shape edit's shift, {SUBSPACE_LABELS[how].replace('projected on ', '')} "
                           f"keeps {m.text()}.")
    return out


def _from_args(model, args, run_dir, progress, executor=None) -> ProtocolResult:
    return run_reuse(model, args.head, from_scan=args.from_scan, n_sources=args.n_sources, n_fit=args.n_fit,
                     n_dev=args.n_dev, layout=args.pair_spec, rank=args.rank, seed=args.seed,
                     gate_threshold=None if args.no_gate else args.gate, formats=args.formats,
                     batch_size=args.batch_size, n_resamples=args.resamples, run_dir=run_dir, model_name=args.model,
                     progress=progress, executor=executor)
