"""Logit lens per layer and per recurrent sublayer (How Linear Attention Remembers, App. C, Fig. 11).

The final norm and the unembedding are applied to the residual stream at the query position before each layer
(blocks.{l}.hook_resid_pre), after its mixer (hook_resid_mid: the sublayer lens, before and after the recurrent
mixer, as the paper reads it) and after the whole layer (hook_resid_post); the 4-way candidate accuracy (argmax
over the four candidate values is the right answer) says where the answer becomes readable. Two tasks: retention
(swap pairs, the recipient's own sequences) and update (build_update_pairs: the target is re-bound at its last
presentation, the answer is the new value; the stale value is among the candidates, and its rate is reported beside).

The paper's split: the layer is LOCALISED on one set of sources (96 dev sources by default: the recurrent layer
whose mixer raises retention accuracy most) and CONFIRMED on separate ones (128 held-out sources), so the layer is
never picked on the sources it is scored on. On the confirmation sources each sublayer's jump (after the mixer minus
before, per source) gets a paired source-bootstrap interval.

Paper: GLA layer 21's recurrent sublayer takes retention from 28.9% to 95.3% (GDN layer 20: 25.8% -> 100%) on the
128 confirmation sources; the update task jumps at the same layers (+28.9 and +43.0 pp).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from recurscope.hooks.points import hook_name
from recurscope.interp import interventions as iv
from recurscope.interp import stats
from recurscope.interp.protocols._common import (PairSpec, ProtocolResult, max_length, model_record, pair_spec,
                                                 unit_frames)
from recurscope.interp.protocols.runner import FigureSpec, Section, finish
from recurscope.interp.verdicts import GDN, GLA, Claim, judge_family, measure_from

__all__ = ["TASKS", "SIDES", "lens_rows", "localise", "run_lens", "reading"]

TASKS = ("retention", "update")
#: Where the lens reads, per layer: before it, after its mixer (the sublayer lens) and after the whole layer.
SIDES = {"before": "hook_resid_pre", "after_mixer": "hook_resid_mid", "after": "hook_resid_post"}


def lens_rows(model, pairs, *, batch_size: int = 16, task: str = "retention") -> pd.DataFrame:
    """One row per (target example, layer, side in SIDES): whether the lens's argmax over the candidates is
    the recipient's answer (and, for update pairs, the stale value)."""
    iv.check_pairs(model, pairs)
    device = iv.model_device(model)
    L = model.cfg.num_hidden_layers
    names = [hook_name(point, l) for point in SIDES.values() for l in range(L)]
    targets = torch.nonzero(pairs.is_target)[:, 0]
    out = []
    with torch.no_grad():
        for start in range(0, len(targets), batch_size):
            rows = targets[start:start + batch_size]
            kept = {}

            def keep(t, hook):
                kept[hook.name] = t[torch.arange(len(rows), device=t.device), pairs.query_pos[rows].to(t.device)]

            logits = model.run_with_hooks(pairs.recipient_ids[rows].to(device),
                                          fwd_hooks=[(n, keep) for n in names])
            final = iv.candidate_logits(logits[torch.arange(len(rows), device=logits.device),
                                               pairs.query_pos[rows].to(logits.device)], pairs.candidate_ids[rows])
            r = pairs.recipient_answer_index[rows]
            stale = pairs.stale_answer_index[rows]
            for layer in range(L):
                for side, point in SIDES.items():
                    z = iv.candidate_logits(model.unembed(kept[hook_name(point, layer)]),
                                            pairs.candidate_ids[rows])
                    arg = z.argmax(1)
                    for j, i in enumerate(rows.tolist()):
                        out.append({"task": task, "row": i, "source": int(pairs.source_id[i]), "layer": layer,
                                    "side": side, "correct": float(arg[j] == r[j]),
                                    "stale": float(arg[j] == stale[j]) if int(stale[j]) >= 0 else np.nan,
                                    "final_correct": float(final[j].argmax() == r[j])})
    return pd.DataFrame(out)


def localise(rows: pd.DataFrame, layers) -> int:
    """The layer whose mixer raises retention accuracy most (mean over sources of after_mixer - before)."""
    ret = rows[rows["task"] == "retention"]
    per = ret.groupby(["layer", "side", "source"])["correct"].mean().unstack("side")
    jump = (per["after_mixer"] - per["before"]).groupby("layer").mean()
    return int(jump.loc[list(layers)].idxmax())


def _jumps(rows: pd.DataFrame, n_resamples: int, seed: int) -> pd.DataFrame:
    """Per (split, task, layer): the sublayer jump after_mixer - before, paired over sources."""
    records = []
    for (split, task, layer), g in rows.groupby(["split", "task", "layer"]):
        wide = g.pivot_table(index=["row", "source"], columns="side", values="correct").reset_index()
        ci = stats.paired_source_bootstrap_ci(wide["after_mixer"], wide["before"], wide["source"],
                                              n_resamples=n_resamples, seed=seed)
        records.append({"split": split, "task": task, "layer": layer, "side": "sublayer", "metric": "sublayer_jump",
                        "estimate": ci.estimate, "low": ci.low, "high": ci.high, "n_sources": ci.n_sources,
                        "n_examples": ci.n_examples, "method": ci.method})
    return pd.DataFrame(records)


@dataclass(frozen=True)
class LensUnit:
    """The lens rows of one split and task ("split:task": localisation on dev, confirmation held out), its pairs
    built here: called in this process or, under --ray, on a worker (a picklable unit, _common.unit_frames)."""

    layout: PairSpec
    n_sources: dict
    batch_size: int

    def __call__(self, model, pairs, key: str) -> pd.DataFrame:
        from recurscope.interp.data import build_pairs, build_update_pairs

        split, task = key.split(":", 1)
        build = build_pairs if task == "retention" else build_update_pairs
        pairs = build(model.tokenizer, split=split, n_sources=self.n_sources[split], max_length=max_length(model),
                      **self.layout.kwargs())
        return lens_rows(model, pairs, batch_size=self.batch_size, task=task).assign(split=split)


def run_lens(model, *, run_dir=None, n_sources: int = 128, n_localise: int = 96, layout=None,
             seed: int = 0, batch_size: int = 16, n_resamples: int = 9999, model_name: str = "model",
             progress=None, executor=None) -> ProtocolResult:
    """Localises the layer on `n_localise` dev sources and confirms on `n_sources` held-out sources (separate
    sources by construction: the dev and held-out splits share none). layout: the pairs' layout and words (a
    PairSpec, PairLayout or layout name; default the §3.3 layout), under `seed`. executor: the CLI's --ray runner;
    each (split, task) is then one unit on a Ray worker."""
    layout = pair_spec(layout, seed=seed)
    keys = [f"{split}:{task}" for split in ("dev", "heldout") for task in TASKS]
    rows = unit_frames(model, keys, LensUnit(layout, {"dev": n_localise, "heldout": n_sources}, batch_size),
                       progress=progress, executor=executor)
    recurrent = sorted(model.recurrent_layers)
    layer = localise(rows[rows["split"] == "dev"], recurrent)
    confirm = rows[rows["split"] == "heldout"]
    sources = confirm.groupby(["task", "layer", "side", "source"])[["correct", "stale"]].mean().reset_index()
    summary = stats.summarise(rows, ["correct", "stale"], by=["split", "task", "layer", "side"],
                              n_resamples=n_resamples, seed=seed)
    summary = pd.concat([summary, _jumps(rows, n_resamples, seed)], ignore_index=True)
    # A layer-indexed curve: position 0 is the embedding (before layer 0), position l + 1 is after layer l.
    summary["position"] = np.where(summary["side"] == "before", summary["layer"], summary["layer"] + 1)
    final = confirm.groupby("task")["final_correct"].mean().to_dict()
    info = {**model_record(model), "n_sources": int(confirm["source"].nunique()), "n_localise": int(rows[rows["split"] == "dev"]["source"]
                                                                                .nunique()),
            "layers": model.cfg.num_hidden_layers, "recurrent": recurrent, "localised": layer, "final": final}
    result = ProtocolResult("lens", rows, sources, summary, info=info)
    held = summary[summary["split"] == "heldout"]
    curve = held[(held["metric"] == "correct") & ((held["side"] == "after") | ((held["side"] == "before")
                                                                             & (held["layer"] == 0)))]
    figure = FigureSpec("lens", curve, dict(
        row_col="position", panels=["correct"], hue_col="task", kind="lines", percent=["correct"],
        reference={"correct": 0.25}, panel_labels={"correct": "4-way lens accuracy"},
        reference_labels={"correct": "chance (1 in 4)"},
        row_name="position (0 = embedding, l = after layer l - 1)",
        title=f"{model_name}: logit lens on the confirmation sources"))
    return finish(result, run_dir, lambda r: lens_section(r, model_name), [figure])


def _pct(summary, where, metric) -> str:
    m = measure_from(summary, where, metric, "pct")
    return "–" if m is None or not m.defined else f"{100 * m.estimate:.1f}% [{100 * m.low:.1f}, {100 * m.high:.1f}]"


def lens_section(result: ProtocolResult, model_name: str) -> Section:
    s, info = result.summary, result.info
    held = s[s["split"] == "heldout"]
    table = ["| task | layer | before the layer | after its mixer | after the layer | mixer jump (pp) |",
             "|---|---|---|---|---|---|"]
    for task in TASKS:
        for layer in range(info["layers"]):
            w = {"task": task, "layer": layer}
            jump = measure_from(held, {**w, "side": "sublayer"}, "sublayer_jump", "pp")
            mark = " (localised)" if layer == info["localised"] else ("" if layer in info["recurrent"] else
                                                                     " (attention)")
            table.append(f"| {task} | {layer}{mark} | {_pct(held, {**w, 'side': 'before'}, 'correct')} | "
                         f"{_pct(held, {**w, 'side': 'after_mixer'}, 'correct')} | "
                         f"{_pct(held, {**w, 'side': 'after'}, 'correct')} | "
                         + ("–" if jump is None or not jump.defined else
                            f"{100 * jump.estimate:+.1f} [{100 * jump.low:+.1f}, {100 * jump.high:+.1f}]") + " |")
    intro = (f"Layer localised on {info['n_localise']} dev sources (the recurrent layer whose mixer raises retention "
             f"accuracy most: layer {info['localised']}), confirmed on {info['n_sources']} separate held-out sources "
             "(the table). 4-way candidate accuracy of the final norm and unembedding applied to the residual "
             "stream at the query position (chance 25%); the jump is after the mixer minus before, paired over "
             "sources.")
    return Section(f"Logit lens: {model_name}", intro, [table], reading(s, info))


#: Each family's numbers (verdicts.paper_family): the retention jump at the localised sublayer, the update jump.
FAMILY_PAPER = {GLA: ((0.664, "+66.4 pp on GLA-340M (layer 21: 28.9% -> 95.3%)"), (0.289, "+28.9 pp on GLA-340M")),
                GDN: ((0.742, "+74.2 pp on GDN-340M (layer 20: 25.8% -> 100%)"), (0.430, "+43.0 pp on GDN-340M"))}


def reading(s: pd.DataFrame, info: dict) -> list[str]:
    """info["family"] (GLA or GDN, verdicts.paper_family) picks the paper's numbers of the model's family; another
    family's model gets no verdict."""
    family = info.get("family")
    out = ["The paper: on 128 confirmation sources the answer becomes readable at one recurrent sublayer, GLA layer "
           "21 going from 28.9% to 95.3% (GDN layer 20: 25.8% to 100%), and the update task jumps at the same layer "
           "(+28.9 / +43.0 pp)."]
    held, layer = s[s["split"] == "heldout"], info["localised"]
    where = {"layer": layer, "side": "sublayer"}
    out.append(judge_family(measure_from(held, {**where, "task": "retention"}, "sublayer_jump", "pp"), family,
                            {fam: Claim.effect(ret, f"a jump in retention accuracy at the localised layer, {text}")
                             for fam, ((ret, text), _) in FAMILY_PAPER.items()},
                            f"On the confirmation sources, the retention jump at the localised layer {layer}",
                            "GLA-340M +66.4 pp, GDN-340M +74.2 pp"))
    out.append(judge_family(measure_from(held, {**where, "task": "update"}, "sublayer_jump", "pp"), family,
                            {fam: Claim.effect(upd, f"the update task jumps at the same layer, {text}")
                             for fam, (_, (upd, text)) in FAMILY_PAPER.items()},
                            "The update task's jump at that layer", "GLA-340M +28.9 pp, GDN-340M +43.0 pp"))
    last = {"layer": info["layers"] - 1, "side": "after", "task": "update"}
    for metric, what in (("correct", "the new (updated) value"), ("stale", "the stale (overwritten) value")):
        m = measure_from(held, last, metric, "pct")
        if m is not None and m.defined:
            out.append(f"After the last layer, update queries read {what} on {m.text()} (chance 25%).")
    return out
