"""The one command for the QED suite: train every arm on both seeds, evaluate, time the cost, and rewrite the
generated tables of experiments/qed/README.md (between its `<!-- generated:start -->` and `<!-- generated:end -->`).

Usage:  python -m experiments.qed.run_all                 # the full suite (300 steps, 500 examples per length)
        python -m experiments.qed.run_all --profile reduced   # what fits about an hour on 2 shared cores
        python -m experiments.qed.run_all --profile smoke     # a pipeline check in a couple of minutes
        python -m experiments.qed.run_all --readme-only --profile reduced   # only rewrite the README tables
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Optional


import pandas as pd

from experiments.qed import common, cost, evaluate, train_arms

HERE = Path(__file__).resolve().parent
README = HERE / "README.md"
START, END = "<!-- generated:start -->", "<!-- generated:end -->"

PROFILES = {
    "full": dict(steps=train_arms.FULL_STEPS, lr=train_arms.PEAK_LR, max_minutes=None, n=500, multipliers=[1, 2, 4, 8, 16], strength_multipliers=[1, 2, 4, 8, 16],
                 diag_sequences=128, diag_length=2048, matrix_samples=4000, val_rows=32, repeats=41),
    "reduced": dict(steps=train_arms.FULL_STEPS, lr=train_arms.PEAK_LR, max_minutes=6.0, n=100, multipliers=[1, 2, 4, 8, 16], strength_multipliers=[2, 8],
                    diag_sequences=8, diag_length=1024, matrix_samples=2000, val_rows=32, repeats=9),
    "smoke": dict(steps=train_arms.SMOKE_STEPS, lr=train_arms.PEAK_LR, max_minutes=None, n=8, multipliers=[1, 2], strength_multipliers=[2],
                  diag_sequences=2, diag_length=64, matrix_samples=64, val_rows=4, repeats=3),
}


def results_root(profile: str) -> Path:
    return common.ROOT / "results" / {"full": "qed", "reduced": "qed-reduced", "smoke": "qed-smoke"}[profile]


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def readme_tables(root: Path, profile: str) -> str:
    """Markdown for every result table found under `root` (train/, eval/, cost/)."""
    p = PROFILES[profile]
    limit = f" (wall-clock cap {p['max_minutes']:g} min each)" if p.get("max_minutes") else ""
    out = [f"Profile `{profile}`: at most {p['steps']} steps per model{limit}, staged S-NIAH curriculum "
           f"{' -> '.join(str(x) for x in train_arms.STAGE_LENGTHS)} tokens, lr {p['lr']:g}, {p['n']} S-NIAH "
           f"examples per length, strength sweep at {[common.TRAIN_LENGTH * m for m in p['strength_multipliers']]} "
           f"tokens, diagnostics on {p['diag_sequences']} sequences x {p['diag_length']} tokens per model. Written by "
           f"`python -m experiments.qed.run_all --profile {profile}` from `{root.relative_to(common.ROOT)}/`.", ""]
    train = root / "train" / "train_summary.csv"
    if train.is_file():
        t = pd.read_csv(train)
        cols = ["arm", "seed", "steps", "stopped_by", "parameters", "qed_scalars", "val_loss", "lambda_mean",
                "lambda_min", "lambda_max", "step_to_64", "step_to_128", "step_to_256", "final_niah_acc",
                "reference_fallback_steps", "skipped_steps", "train_seconds"]
        out += ["### Training and validation loss", "",
                "val_loss: mean next-token loss (nats) on 32 held-out filler rows of 256 tokens, the same rows for "
                "every arm. step_to_L: the step at which the curriculum moved to haystack length L (empty: never). "
                "final_niah_acc: training-batch S-NIAH accuracy over the 90 number candidates, mean of the last 20 "
                "steps. "
                "reference_fallback_steps: steps whose chunked backward gave non-finite gradients and were redone "
                "with the reference backend.", "", common.markdown_table(t[[c for c in cols if c in t]])]
    ev = root / "eval"
    if (ev / "val_loss.csv").is_file():
        v = pd.read_csv(ev / "val_loss.csv").pivot(index="arm", columns="seed", values="val_loss")
        v = v.reindex([a for a in common.ARMS if a in v.index])
        v.columns = [f"seed {c}" for c in v.columns]
        out += ["Validation loss (nats), evaluation pass:", "", common.markdown_table(v.reset_index(), digits=5)]
    if (ev / "niah_accuracy.csv").is_file():
        a = pd.read_csv(ev / "niah_accuracy.csv")
        a["cell"] = [f"{_pct(x)} [{_pct(lo)}, {_pct(hi)}]" for x, lo, hi in zip(a["accuracy"], a["ci_low"], a["ci_high"])]
        w = a.pivot(index=["arm", "seed"], columns="length", values="cell").reset_index()
        w["order"] = w["arm"].map({x: i for i, x in enumerate(common.ARMS)})
        w = w.sort_values(["seed", "order"]).drop(columns="order")
        w.columns = [c if isinstance(c, str) else f"{c} tok" for c in w.columns]
        out += ["### S-NIAH accuracy by length", "",
                f"Accuracy % [95% Wilson interval], {int(a['n'].iloc[0])} fixed examples per length (the same for every "
                f"arm); training length {common.TRAIN_LENGTH}. Chance is 1/90 (answer = argmax over the 90 number "
                "tokens).", "", common.markdown_table(w), "", "![Figure 1](figures/fig1_niah_accuracy.png)", ""]
    if (ev / "contrasts.csv").is_file():
        c = pd.read_csv(ev / "contrasts.csv")
        c["cell"] = [f"{d:+.1f} ({x}/{y}, p={pv:.2g})" for d, x, y, pv in
                     zip(c["diff_pp"], c["a_only_correct"], c["b_only_correct"], c["p_value"])]
        w = c.pivot(index=["contrast", "seed"], columns="length", values="cell").reset_index()
        w["order"] = w["contrast"].map({f"{x} - {y}": i for i, (x, y) in enumerate(common.CONTRASTS)})
        w = w.sort_values(["order", "seed"]).drop(columns="order")
        w.columns = [c if isinstance(c, str) else f"{c} tok" for c in w.columns]
        out += ["### Paired contrasts (exact McNemar)", "",
                "Cell: accuracy difference a - b in percentage points (items only a got right / items only b got "
                "right, exact two-sided McNemar p).", "", common.markdown_table(w), "",
                "![Figure 2](figures/fig2_contrasts.png)", ""]
    if (ev / "strength.csv").is_file():
        s = pd.read_csv(ev / "strength.csv")
        ref = s.groupby(["arm", "seed", "length"])["accuracy_reference"].first().reset_index()
        s["cell"] = [f"{_pct(x)} ({d:+.1f}; +{u}/-{v}, p={pv:.2g})" for x, d, u, v, pv in
                     zip(s["accuracy"], s["difference_pp"], s["only_s_correct"], s["only_s1_correct"], s["p_value"])]
        ref = ref.assign(strength=1.0, cell=[f"{_pct(x)} (reference)" for x in ref["accuracy_reference"]])
        s = pd.concat([s[["arm", "seed", "length", "strength", "cell"]], ref[["arm", "seed", "length", "strength", "cell"]]])
        w = s.pivot(index=["arm", "seed", "strength"], columns="length", values="cell").reset_index()
        w.columns = [c if isinstance(c, str) else f"{c} tok" for c in w.columns]
        out += ["### Inference-time strength (every lambda_h times s), paired against s = 1", "",
                "Cell: accuracy % (difference vs s = 1 in pp; items only s got right / only s = 1 got right, exact "
                "McNemar p).", "", common.markdown_table(w.sort_values(["arm", "seed", "strength"])), ""]
    if (ev / "diagnostics.csv").is_file():
        d = pd.read_csv(ev / "diagnostics.csv")
        d["order"] = d["arm"].map({x: i for i, x in enumerate(common.ARMS)})
        d = d.sort_values(["order", "seed"]).drop(columns="order")
        cols1 = ["arm", "seed", "token_heads", "lambda_mean", "e_min", "e_max", "n_abs_e_gt_1", "n_e_outside_0_1",
                 "max_abs_e_minus_gdn2", "max_k_norm_shortfall", "min_strength_leaving_0_1"]
        cols2 = ["arm", "seed", "rho_mean", "abs_rho_mean", "rho_min", "rho_max", "sbar_d_mean", "sbar_d_median",
                 "sbar_d_max", "lam_rho_sbar_d_mean"]
        cols3 = ["arm", "seed", "matrix_samples", "frac_M_spec_in_disk_and_norm_gt_1", "max_sigma_M",
                 "frac_MD_radius_lt_1_and_norm_gt_1", "max_sigma_MD_with_radius_lt_1"]
        out += ["### Eigenvalue and readout diagnostics (trained models, every token-head)", "",
                "e_t = 1 - a_t^T k_t from the model's own erase vector (hook_erase, hook_k); max_abs_e_minus_gdn2 "
                "compares it with the GDN-2 value 1 - sum b k^2 (b from hook_erase_gate); max_k_norm_shortfall: "
                "max of 1 - ||k_t||^2 (the L2 norm's eps), which bounds a projected arm's deviation by lam_max times "
                "it; min_strength_leaving_0_1: the smallest s at which some sample's e_t would leave (0, 1) "
                "(unprojected arms only).", "", common.markdown_table(d[[c for c in cols1 if c in d]]), "",
                "rho_t = q_t^T k_t; ||Sbar_t^T d_t|| with Sbar_t = D_t S_{t-1} from captured states (hook_state) and "
                "d_t = P_perp_k(b * q); lam_rho_sbar_d_mean = mean of lam |rho| ||Sbar^T d||, the one-step output "
                "change of eq. (12).", "", common.markdown_table(d[[c for c in cols2 if c in d]]), "",
                "Non-normality of the erase factor M_t = I - k_t a_t^T and of the full step M_t D_t on a random "
                "subset of token-heads: fraction whose spectrum lies in the unit disk while the largest singular "
                "value exceeds 1.", "", common.markdown_table(d[[c for c in cols3 if c in d]]), ""]
    if (ev / "nonnormal_examples.csv").is_file():
        out += ["Most amplifying token-head per model with spectral radius(M_t D_t) < 1 and ||M_t D_t x|| > ||x|| "
                "(x = top right singular vector):", "",
                common.markdown_table(pd.read_csv(ev / "nonnormal_examples.csv"), digits=5), ""]
    if (ev / "eigenvalue_constructed.csv").is_file():
        out += ["Constructed check (random unit q, k; gates b in (0,1); lam = 0.25; a tenth of the samples with q = k), "
                "float64:", "", common.markdown_table(pd.read_csv(ev / "eigenvalue_constructed.csv")), ""]
    if (ev / "paper_nonnormal_example.json").is_file():
        ex = json.loads((ev / "paper_nonnormal_example.json").read_text())
        out += [f"A hand-worked 2x2 example, not the paper's (k=(1,0), b=(.5,.5), q=(0,1), lam=.2): M = {ex['M']}, spectrum {ex['spectrum']}, "
                f"||M (0,1)|| = {ex['norm_Mx_over_x']:.6f} (sqrt(1.01) = {ex['expected']:.6f}).", ""]
    if (root / "cost" / "cost.csv").is_file():
        out += ["### Cost: forward time, QED (full) vs GDN-2", "",
                "Medians of interleaved repeats (order flipped each repeat), 1 torch thread, on a shared 2-core machine.",
                "", common.markdown_table(pd.read_csv(root / "cost" / "cost.csv")), ""]
    return "\n".join(out)


def write_readme(root: Path, profile: str, readme: Path = README) -> None:
    """Replaces the generated block of the README and copies the small figures next to it."""
    figs = root / "eval" / "figures"
    target = readme.parent / "figures"
    target.mkdir(exist_ok=True)
    for name in ("fig1_niah_accuracy.png", "fig2_contrasts.png"):
        src = figs / name
        if src.is_file() and src.stat().st_size < 200_000:
            shutil.copyfile(src, target / name)
    block = f"{START}\n{readme_tables(root, profile)}\n{END}"
    text = readme.read_text() if readme.is_file() else f"# QED experiments\n\n{START}\n{END}\n"
    if START not in text or END not in text:
        raise ValueError(f"{readme} has no generated block; add the lines {START} and {END} where the tables go")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(head + block + tail)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="full")
    parser.add_argument("--jobs", type=int, default=2, help="parallel processes for training and evaluation")
    parser.add_argument("--readme-only", action="store_true", help="only rewrite the README tables from results")
    parser.add_argument("--skip-train", action="store_true")
    parser.add_argument("--skip-eval", action="store_true")
    parser.add_argument("--skip-cost", action="store_true")
    args = parser.parse_args(argv)
    p = PROFILES[args.profile]
    root = results_root(args.profile)
    t0 = time.time()
    if not args.readme_only:
        if not args.skip_train:
            print(train_arms.run(common.ARMS, [0, 1], p["steps"], root / "train", jobs=args.jobs,
                                 smoke=args.profile == "smoke", peak_lr=p["lr"],
                                 max_minutes=p["max_minutes"]).to_string(index=False))
        if not args.skip_eval:
            evaluate.run(root / "train", root / "eval", common.ARMS, [0, 1], p["n"], p["multipliers"],
                         common.STRENGTHS, ["full"], p["strength_multipliers"], p["diag_sequences"], p["diag_length"],
                         p["matrix_samples"], p["val_rows"], jobs=args.jobs)
        if not args.skip_cost:
            print(cost.run(p["repeats"], root / "cost", smoke=args.profile == "smoke").to_string(index=False))
    if args.profile != "smoke":
        write_readme(root, args.profile)
    else:
        print(readme_tables(root, args.profile))
    print(f"done in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
