"""Logit lens per layer (How Linear Attention Remembers, App. C, Fig. 11).

The final norm and the unembedding are applied to the residual stream at the query position before and after each
layer (blocks.{l}.hook_resid_pre / hook_resid_post); the 4-way candidate accuracy (argmax over the four candidate
values is the right answer) says where the answer becomes readable. Two tasks: retention (swap pairs, the
recipient's own sequences) and update (build_update_pairs: the target is re-bound at its last presentation, the
answer is the new value; the stale value is among the candidates, and its rate is reported beside).

Paper: GLA layer 21 goes from 28.9% to 95.3% on retention (GDN layer 20: 25.8% -> 100%); the update task jumps at
the same layers (+28.9 and +43.0 pp).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import pandas as pd
import torch

from recurscope.hooks.points import hook_name
from recurscope.interp import interventions as iv
from recurscope.interp import stats
from recurscope.interp.protocols._common import (ProtocolResult, finish, max_length, open_run, pair_kwargs)

__all__ = ["TASKS", "lens_rows", "run_lens", "add_verb"]

TASKS = ("retention", "update")


def lens_rows(model, pairs, *, batch_size: int = 16, task: str = "retention") -> pd.DataFrame:
    """One row per (target example, layer, side in {before, after}): whether the lens's argmax over the candidates is
    the recipient's answer (and, for update pairs, the stale value)."""
    iv.check_pairs(model, pairs)
    device = iv.model_device(model)
    L = model.cfg.num_hidden_layers
    names = [hook_name("hook_resid_pre", l) for l in range(L)] + [hook_name("hook_resid_post", l) for l in range(L)]
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
                for side, point in (("before", "hook_resid_pre"), ("after", "hook_resid_post")):
                    z = iv.candidate_logits(model.unembed(kept[hook_name(point, layer)]),
                                            pairs.candidate_ids[rows])
                    arg = z.argmax(1)
                    for j, i in enumerate(rows.tolist()):
                        out.append({"task": task, "row": i, "source": int(pairs.source_id[i]), "layer": layer,
                                    "side": side, "correct": float(arg[j] == r[j]),
                                    "stale": float(arg[j] == stale[j]) if int(stale[j]) >= 0 else np.nan,
                                    "final_correct": float(final[j].argmax() == r[j])})
    return pd.DataFrame(out)


def run_lens(model, *, run_dir=None, n_sources: int = 32, layout: Optional[dict] = None, seed: int = 0,
             batch_size: int = 16, n_resamples: int = 9999, model_name: str = "model", progress=None) -> ProtocolResult:
    from recurscope.interp.data import build_pairs, build_update_pairs

    layout = {**pair_kwargs(seed=seed), **(layout or {})}
    frames = []
    for task in TASKS:
        if progress:
            progress(task)
        build = build_pairs if task == "retention" else build_update_pairs
        pairs = build(model.tokenizer, split="heldout", n_sources=n_sources, max_length=max_length(model), **layout)
        frames.append(lens_rows(model, pairs, batch_size=batch_size, task=task))
    rows = pd.concat(frames, ignore_index=True)
    sources = rows.groupby(["task", "layer", "side", "source"])[["correct", "stale"]].mean().reset_index()
    summary = stats.summarise(rows, ["correct", "stale"], by=["task", "layer", "side"], n_resamples=n_resamples,
                              seed=seed)
    # A layer-indexed curve: position 0 is the embedding (before layer 0), position l + 1 is after layer l.
    summary["position"] = np.where(summary["side"] == "before", summary["layer"], summary["layer"] + 1)
    final = rows.groupby("task")["final_correct"].mean().to_dict()
    info = {"n_sources": int(rows["source"].nunique()), "layers": model.cfg.num_hidden_layers, "final": final}
    result = ProtocolResult("lens", rows, sources, summary, info=info)
    if run_dir is not None:
        from recurscope.interp.plots import plot_interval_panels

        curve = summary[(summary["metric"] == "correct") & ((summary["side"] == "after") | (summary["layer"] == 0))]
        fig = plot_interval_panels(curve, run_dir.figure_path("lens"), row_col="position", panels=["correct"],
                                   hue_col="task", kind="lines", percent=["correct"], reference={"correct": 0.25},
                                   panel_labels={"correct": "4-way lens accuracy"},
                                   title=f"{model_name}: logit lens (0 = embedding, l = after layer l - 1)")
        result.figures["lens"] = fig.png
    result.section = lens_section(result, model_name)
    return finish(result, run_dir)


def lens_section(result: ProtocolResult, model_name: str) -> str:
    s, info = result.summary, result.info
    acc = s[s["metric"] == "correct"].set_index(["task", "layer", "side"])
    lines = [f"## Logit lens: {model_name}", "",
             f"{info['n_sources']} held-out sources; 4-way candidate accuracy of the final norm and unembedding applied "
             "to the residual stream at the query position (chance 25%).", "",
             "| task | layer | before the layer | after the layer | jump (pp) |", "|---|---|---|---|---|"]
    jumps = {}
    for task in TASKS:
        for layer in range(info["layers"]):
            b, a = acc.loc[(task, layer, "before")], acc.loc[(task, layer, "after")]
            jumps[(task, layer)] = a["estimate"] - b["estimate"]
            lines.append(f"| {task} | {layer} | {100 * b['estimate']:.1f}% [{100 * b['low']:.1f}, {100 * b['high']:.1f}] "
                         f"| {100 * a['estimate']:.1f}% [{100 * a['low']:.1f}, {100 * a['high']:.1f}] | "
                         f"{100 * (a['estimate'] - b['estimate']):+.1f} |")
    if "lens" in result.figures:
        lines += ["", f"![lens](figures/{result.figures['lens'].name})"]
    reading = ["The paper: the answer becomes readable at one layer, GLA layer 21 going from 28.9% to 95.3% "
               "(GDN layer 20: 25.8% to 100%), and the update task jumps at the same layer (+28.9 / +43.0 pp)."]
    best = {task: max(range(info["layers"]), key=lambda l: jumps[(task, l)]) for task in TASKS}
    r, u = best["retention"], best["update"]
    text = (f"Here the largest retention jump is at layer {r} "
            f"({100 * acc.loc[('retention', r, 'before')]['estimate']:.1f}% -> "
            f"{100 * acc.loc[('retention', r, 'after')]['estimate']:.1f}%); ")
    if jumps[("update", u)] <= 0:
        text += "no layer raises the update task's accuracy."
    else:
        text += (f"the update task's largest jump ({100 * jumps[('update', u)]:+.1f} pp) is at layer {u}"
                 + (", the same layer, as in the paper." if u == r else ", a different layer."))
    reading.append(text)
    stale = s[(s["metric"] == "stale") & (s["task"] == "update") & (s["side"] == "after")
              & (s["layer"] == info["layers"] - 1)]
    reading.append(f"The model's own answer is right on {100 * info['final'].get('retention', np.nan):.1f}% of "
                   f"retention and {100 * info['final'].get('update', np.nan):.1f}% of update queries"
                   + (f"; after the last layer {100 * stale.iloc[0]['estimate']:.1f}% of update queries read the "
                      "stale (overwritten) value." if len(stale) and pd.notna(stale.iloc[0]["estimate"]) else "."))
    lines += ["", "### Reading", "", " ".join(reading)]
    return "\n".join(lines)


def add_verb(sub, model_args, load) -> None:
    p = sub.add_parser("lens", help="logit lens per layer for retention and update (App. C, Fig. 11)")
    model_args(p)
    p.add_argument("--n-sources", type=int, default=32, help="held-out sources")
    p.add_argument("--filler", type=int, default=512)
    p.add_argument("--presentations", type=int, default=3)
    p.add_argument("--gap", type=int, default=24)
    p.add_argument("--template", default="is_in")
    p.add_argument("--vocab", default="cities")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resamples", type=int, default=9999)
    p.add_argument("--out", required=True)
    p.set_defaults(fn=lambda args: _cli(args, load))


def _cli(args, load) -> int:
    from recurscope.interp.protocols._common import layout_from_args

    model = load(args)
    keys = ("model", "n_sources", "filler", "presentations", "gap", "template", "vocab", "seed")
    run = open_run(args.out, kind="lens", model=model, model_name=args.model, args={k: getattr(args, k) for k in keys},
                   seeds=[args.seed], split="heldout")
    result = run_lens(model, run_dir=run, n_sources=args.n_sources, layout=layout_from_args(args), seed=args.seed,
                      batch_size=args.batch_size, n_resamples=args.resamples, model_name=args.model,
                      progress=lambda task: print(f"lens: {task}", flush=True))
    print(result.section)
    print(f"results in {run.path}")
    return 0
