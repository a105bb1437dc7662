"""The seed-level QED study: a task chosen on a dev seed, then every arm and the lambda_max variants on 5 seeds.

Phases (each resumable; working files under results/qed-seeds/<profile>/, and each finished job of the full profile
committed as experiments/qed/results/<run>-s<seed>.json.gz, so the 12-hour study can span sessions):
  dev     trains gdn2 on DEV_SEED (with snapshots), takes the step budget from its training curve (the first
          snapshot whose task accuracy is within PLATEAU of the end of the run), scores every retrieval variant on
          dev-split items at 2x, 4x and 8x the training length, and freezes the discriminating task (gdn2 between
          20% and 90% at all three lengths) into experiments/qed/frozen_task.json.
  main    one job per (run, seed) in JOB_ORDER: train (train_arms.train_one, resumable mid-run) then evaluate
          (eval-split items; cached per model). Several workers may run at once: each claims a job with a lock file.
  sweep   the strength sweep on S-NIAH-1 at the longest length (where full - gdn2 is largest): retrains each QED job
          of SWEEP_RUNS (same recipe and batches; its own folder), checks it against the committed item rows, and
          scores s = 0, 1, 2 on the main evaluation's items; committed as experiments/qed/results/sweep/.
  report  per-seed tables, McNemar per seed, seed-level contrasts (mean, exact seed-bootstrap interval, sign test),
          the forest plot and the lambda_max study; rewrites the generated block of experiments/qed/README.md.

Usage:  python -m experiments.qed.seeds dev
        python -m experiments.qed.seeds main [--worker]      # start one or two of these in the background
        python -m experiments.qed.seeds sweep [--runs full,...]
        python -m experiments.qed.seeds report
        python -m experiments.qed.seeds all --profile smoke  # a pipeline check in about a minute
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import time
from pathlib import Path
from typing import Optional, Sequence


import numpy as np
import pandas as pd
import torch

from experiments.qed import common, tasks, train_arms
from recurscope.interp.loading import load_model
from recurscope.interp.models import qed_strength
from recurscope.interp.stats import binomial_ci, mcnemar_exact, seed_contrast

HERE = Path(__file__).resolve().parent
FROZEN = HERE / "frozen_task.json"
DEV_SEED = 100
DEV_RANGE = (0.2, 0.9)        # gdn2's accuracy band at 2x, 4x and 8x that makes a task discriminating
PLATEAU = 0.03                # a snapshot is on the plateau when its task accuracy is within this of the run's end
CURVE_WINDOW = 20
BATCH_TOKENS = 16_384
STRENGTHS = (0.0, 1.0, 2.0)

PROFILES = {
    # the study: 5 seeds x (6 arms + 5 lambda variants); steps come from the dev curve (frozen_task.json)
    "full": dict(runs=common.RUNS, seeds=(0, 1, 2, 3, 4), dev_steps=400, snapshots=(200, 300), dev_n=100, n=200, extract_n=200,
                 multipliers=(1, 2, 4, 8), strength_multiplier=4, strength_n=100, stage_lengths=None),
    # a pipeline check (tests): tiny everything, its own frozen task file inside the results folder
    "smoke": dict(runs=("gdn2", "full", "full-lm0.5-l0.2"), seeds=(0, 1), dev_steps=6, snapshots=(3,), dev_n=4, n=4, extract_n=4, multipliers=(1, 2),
                  strength_multiplier=2, strength_n=4, stage_lengths=(32, 256)),
}
#: (arm_a, arm_b) contrasts: the paper's four, the two the noproj arm adds, and each lambda variant against gdn2
CONTRASTS = common.CONTRASTS + tuple((r, "gdn2") for r in common.LAMBDA_STUDY)
#: gdn2 and full first (the headline contrast), then the other arms, then the lambda_max study; seeds inside
JOB_ORDER = (("gdn2", "full"), ("rand", "nogate", "noproj", "nogate_noproj"), tuple(common.LAMBDA_STUDY))


#: the sweep phase's runs, headline arm first, then the lambda_0 = 0.2 cells (the largest trained lambda)
SWEEP_RUNS = ("full", "full-lm0.25-l0.2", "full-lm0.5-l0.2", "full-lm0.25-l0.1", "full-lm0.5-l0.1", "full-lm0.5-l0.03")
SWEEP_TASK = "sniah1"

RESULTS = common.ROOT / "results"   # tests point this at a temporary folder


def root_for(profile: str) -> Path:
    return RESULTS / ("qed-seeds" if profile == "full" else f"qed-seeds-{profile}")


#: Finished jobs of the full profile are committed here (gzipped JSON, kilobytes each): the study takes about 12 hours
#: of one core, more than a working session, so each session's finished jobs must outlive its results folder.
COMMITTED_EVAL = HERE / "results"


def eval_dir(profile: str) -> Path:
    return COMMITTED_EVAL if profile == "full" else root_for(profile) / "eval"


def frozen_path(profile: str) -> Path:
    return FROZEN if profile == "full" else root_for(profile) / "frozen_task.json"


def jobs(profile: str) -> list[tuple[str, int]]:
    p = PROFILES[profile]
    return [(run, seed) for group in JOB_ORDER for seed in p["seeds"] for run in group if run in p["runs"]]


# ---------------------------------------------------------------------------------------------------------------
# Scoring
# ---------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def score(model, batch: tasks.TaskBatch, batch_tokens: int = BATCH_TOKENS) -> np.ndarray:
    """Per-item correctness of `batch` (teacher-forced, logits at the batch's positions only)."""
    model.eval()
    step = max(1, batch_tokens // batch.input_ids.shape[1])
    out = []
    for lo in range(0, len(batch), step):
        part = batch.select(lo, min(len(batch), lo + step))
        out.append(part.correct(common.last_logits(model, part.input_ids, part.positions)).numpy())
    return np.concatenate(out)


def curve_steps(log: pd.DataFrame, snapshots: Sequence[int], final: int, window: int = CURVE_WINDOW,
                plateau: float = PLATEAU) -> tuple[int, dict]:
    """The step budget from a training curve: the first of `snapshots` (then `final`) whose mean task accuracy over
    the `window` steps before it is within `plateau` of the mean over the last `window` steps of the run."""
    acc = log["task_acc"].to_numpy(dtype=float)
    end = float(np.nanmean(acc[-window:]))
    at = {int(s): float(np.nanmean(acc[max(0, s - window):s])) for s in list(snapshots) + [final] if s <= len(acc)}
    chosen = next(s for s in sorted(at) if at[s] >= end - plateau)
    return chosen, {"task_acc_before_step": at, "task_acc_end": end, "window": window, "plateau": plateau}


def choose_task(dev: pd.DataFrame, band: tuple[float, float] = DEV_RANGE) -> tuple[str, bool]:
    """The retrieval variant (not sniah1) whose dev accuracies at every scored length lie in `band`, closest to the
    band's middle (smallest largest distance); (name, True). If none lies in the band: the closest one, False."""
    mid = sum(band) / 2
    best, best_dist, best_in = None, float("inf"), False
    for task, g in dev[dev["task"] != "sniah1"].groupby("task", sort=True):
        acc = g["accuracy"].to_numpy()
        inside = bool(((acc >= band[0]) & (acc <= band[1])).all())
        dist = float(np.abs(acc - mid).max())
        if (inside, -dist) > (best_in, -best_dist):
            best, best_dist, best_in = task, dist, inside
    return best, best_in


def dev_scores(profile: str, checkpoint: Path) -> pd.DataFrame:
    """Every retrieval variant on dev-split items at 2x, 4x and 8x (the profile's multipliers after 1x); cached in
    `checkpoint/dev_accuracy.csv`, so that snapshots can be scored while the dev run continues."""
    cached = Path(checkpoint) / "dev_accuracy.csv"
    if cached.is_file():
        return pd.read_csv(cached)
    p = PROFILES[profile]
    model = load_model(checkpoint, backend="chunked")
    rows = []
    for task in tasks.RETRIEVAL:
        for m in p["multipliers"][1:]:
            L = common.TRAIN_LENGTH * m
            correct = score(model, tasks.build_task(model.tokenizer, task, p["dev_n"], L, split="dev", seed=DEV_SEED))
            ci = binomial_ci(int(correct.sum()), len(correct))
            rows.append({"task": task, "length": L, "n": len(correct), "accuracy": ci.estimate, "ci_low": ci.low,
                         "ci_high": ci.high})
            print(f"[dev {Path(checkpoint).name}] {task} {L}: {ci.estimate:.3f}", flush=True)
    frame = pd.DataFrame(rows)
    frame.to_csv(cached, index=False)
    return frame


def dev_phase(profile: str) -> dict:
    p = PROFILES[profile]
    root = root_for(profile) / "dev"
    out = root / f"gdn2-s{DEV_SEED}"
    steps = p["dev_steps"]
    stage_lengths = p["stage_lengths"] or train_arms.STAGE_LENGTHS
    if not (out / "summary.json").is_file():
        train_arms.train_one("gdn2", DEV_SEED, steps, out, snapshots=p["snapshots"], stage_lengths=stage_lengths,
                             smoke=profile == "smoke", command=f"python -m experiments.qed.seeds dev --profile {profile}")
    log = pd.read_csv(out / "train_log.csv")
    chosen_steps, curve = curve_steps(log, p["snapshots"], steps)
    dev = dev_scores(profile, out if chosen_steps == steps else out / f"at-step-{chosen_steps}")
    dev.to_csv(root / "dev_accuracy.csv", index=False)
    task, inside = choose_task(dev)
    frozen = {"task": task, "in_band": inside, "band": list(DEV_RANGE), "steps": chosen_steps, "curve": curve,
              "dev_seed": DEV_SEED, "dev_checkpoint_steps": chosen_steps, "stage_lengths": list(stage_lengths),
              "dev_accuracy": dev.to_dict(orient="records"),
              "frozen_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    frozen_path(profile).write_text(json.dumps(frozen, indent=2) + "\n")
    return frozen


# ---------------------------------------------------------------------------------------------------------------
# Main runs
# ---------------------------------------------------------------------------------------------------------------


def read_frozen(profile: str) -> dict:
    f = frozen_path(profile)
    if not f.is_file():
        raise FileNotFoundError(f"{f} does not exist: run `python -m experiments.qed.seeds dev --profile {profile}` "
                                "first (it chooses and freezes the task and the step budget).")
    return json.loads(f.read_text())


def evaluate_one(model, run: str, seed: int, profile: str, task: str) -> dict:
    """Item rows for the frozen task and S-NIAH-1 at every multiplier, doc and qa at the training length, and the
    strength sweep (QED runs) on the frozen task at strength_multiplier x the training length."""
    p = PROFILES[profile]
    rows, strength = [], []
    lengths = [common.TRAIN_LENGTH * m for m in p["multipliers"]]
    plan = [(t, L, p["n"]) for t in dict.fromkeys([task, "sniah1"]) for L in lengths]
    plan += [(t, common.TRAIN_LENGTH, p["extract_n"]) for t in tasks.EXTRACTION]
    for t, L, n in plan:
        correct = score(model, tasks.build_task(model.tokenizer, t, n, L, split="eval", seed=0))
        rows += [{"run": run, "seed": seed, "task": t, "length": L, "item": i, "correct": bool(c)}
                 for i, c in enumerate(correct)]
    if run != "gdn2":
        L = common.TRAIN_LENGTH * p["strength_multiplier"]
        batch = tasks.build_task(model.tokenizer, task, p["strength_n"], L, split="eval", seed=1)
        for s in STRENGTHS:
            with qed_strength(model, s):
                correct = score(model, batch)
            strength += [{"run": run, "seed": seed, "task": task, "length": L, "strength": s, "item": i,
                          "correct": bool(c)} for i, c in enumerate(correct)]
    lam = common.qed_lambdas(model)
    lambdas = [{"run": run, "seed": seed, "layer": layer, "head": h, "lambda": x}
               for layer, v in lam.items() if v for h, x in enumerate(v)]
    return {"items": rows, "strength": strength, "lambda": lambdas}


def _claim(lock: Path) -> bool:
    """Creates `lock` holding this pid; a lock whose process is gone is taken over."""
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        try:
            os.kill(int(lock.read_text().strip() or 0), 0)
            return False
        except (ProcessLookupError, ValueError):
            lock.unlink(missing_ok=True)
            return _claim(lock)
        except PermissionError:
            return False
    with os.fdopen(fd, "w") as fh:
        fh.write(str(os.getpid()))
    return True


def trained(run: str, seed: int, profile: str, frozen: dict, phase: str) -> Path:
    """The training folder of (run, seed), trained (or its interrupted training resumed) unless it is finished."""
    out = root_for(profile) / "train" / f"{run}-s{seed}"
    if not (out / "summary.json").is_file():
        train_arms.train_one(run, seed, frozen["steps"], out, stage_lengths=frozen["stage_lengths"],
                             smoke=profile == "smoke", command=f"python -m experiments.qed.seeds {phase} --profile {profile}")
    return out


def run_job(run: str, seed: int, profile: str, frozen: dict) -> Optional[Path]:
    """Trains and evaluates one (run, seed) unless its result exists; returns the result file."""
    p = PROFILES[profile]
    root = root_for(profile)
    result = eval_dir(profile) / f"{run}-s{seed}.json.gz"
    if result.is_file():
        return result
    lock = root / "locks" / f"{run}-s{seed}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    if not _claim(lock):
        return None
    try:
        t0 = time.time()
        out = trained(run, seed, profile, frozen, "main")
        t1 = time.time()
        model = load_model(out, backend="chunked")
        res = evaluate_one(model, run, seed, profile, frozen["task"])
        res["train_summary"] = json.loads((out / "summary.json").read_text())
        res["eval_seconds"] = round(time.time() - t1, 1)
        res["job_train_seconds"] = round(t1 - t0, 1)
        result.parent.mkdir(parents=True, exist_ok=True)
        tmp = result.with_name(result.name + ".tmp")
        with gzip.open(tmp, "wt") as fh:
            fh.write(json.dumps(res) + "\n")
        tmp.replace(result)
        print(f"[main] {run} s{seed} done: train {t1 - t0:.0f}s, eval {res['eval_seconds']:.0f}s", flush=True)
        return result
    finally:
        lock.unlink(missing_ok=True)


def main_phase(profile: str) -> list[Path]:
    frozen = read_frozen(profile)
    done = []
    for run, seed in jobs(profile):
        path = run_job(run, seed, profile, frozen)
        if path is not None:
            done.append(path)
    return done


def sweep_dir(profile: str) -> Path:
    return eval_dir(profile) / "sweep"


def sweep_job(run: str, seed: int, profile: str, frozen: dict) -> Optional[Path]:
    """Retrains (run, seed) unless its sweep result exists, then scores SWEEP_TASK at the longest multiplier with
    every strength on the main evaluation's items (split eval, seed 0), and records how many of those items the
    retrained model at s = 1 scores as the committed main result did: the recipe and batches are the same, but
    training is not bit-reproducible across runs and machines (float rounding compounds over the steps), so a
    retrained model can differ, and the sweep's comparisons are made within the retrained model."""
    p = PROFILES[profile]
    result = sweep_dir(profile) / f"{run}-s{seed}.json.gz"
    if result.is_file():
        return result
    committed = eval_dir(profile) / f"{run}-s{seed}.json.gz"
    if not committed.is_file():
        raise FileNotFoundError(f"{committed} does not exist: run `python -m experiments.qed.seeds main` first "
                                "(the sweep compares against the main result).")
    root = root_for(profile)
    lock = root / "locks" / f"sweep-{run}-s{seed}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    if not _claim(lock):
        return None
    try:
        model = load_model(trained(run, seed, profile, frozen, "sweep"), backend="chunked")
        L = common.TRAIN_LENGTH * max(p["multipliers"])
        batch = tasks.build_task(model.tokenizer, SWEEP_TASK, p["n"], L, split="eval", seed=0)
        with gzip.open(committed, "rt") as fh:
            main_rows = [r for r in json.loads(fh.read())["items"] if r["task"] == SWEEP_TASK and r["length"] == L]
        main_correct = np.array([r["correct"] for r in sorted(main_rows, key=lambda r: r["item"])], dtype=bool)
        rows, agree = [], None
        for s in STRENGTHS:
            with qed_strength(model, s):
                correct = score(model, batch)
            if s == 1.0:
                agree = int((correct == main_correct).sum())
            rows += [{"run": run, "seed": seed, "task": SWEEP_TASK, "length": L, "strength": s, "item": i,
                      "correct": bool(c)} for i, c in enumerate(correct)]
        res = {"strength": rows, "agree_with_main": agree, "n": len(main_correct),
               "main_accuracy": float(main_correct.mean())}
        result.parent.mkdir(parents=True, exist_ok=True)
        tmp = result.with_name(result.name + ".tmp")
        with gzip.open(tmp, "wt") as fh:
            fh.write(json.dumps(res) + "\n")
        tmp.replace(result)
        print(f"[sweep] {run} s{seed} done: retrained model agrees with the main result on {agree}/{len(main_correct)}"
              " items", flush=True)
        return result
    finally:
        lock.unlink(missing_ok=True)


def sweep_phase(profile: str, runs: Sequence[str] = SWEEP_RUNS) -> list[Path]:
    frozen = read_frozen(profile)
    p = PROFILES[profile]
    done = []
    for run in runs:
        common.check_run(run)
        if run == "gdn2":
            raise ValueError("gdn2 has no QED term to scale; pass QED runs to --runs")
        for seed in p["seeds"]:
            path = sweep_job(run, seed, profile, frozen)
            if path is not None:
                done.append(path)
    return done


def load_sweep(profile: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The sweep's item rows and, per (run, seed), the retrained model's agreement with the main result."""
    rows, agree = [], []
    for f in sorted(sweep_dir(profile).glob("*.json.gz")):
        with gzip.open(f, "rt") as fh:
            r = json.loads(fh.read())
        rows += r["strength"]
        first = r["strength"][0]
        agree.append({"run": first["run"], "seed": first["seed"], "agree_with_main": r["agree_with_main"], "n": r["n"],
                      "main_accuracy": r["main_accuracy"]})
    return pd.DataFrame(rows), pd.DataFrame(agree)


def sweep_seed_level(sweep: pd.DataFrame) -> pd.DataFrame:
    """Per (run, strength): the per-seed accuracy change against s = 1 (pp), its seed-bootstrap interval and sign test."""
    acc = sweep.groupby(["run", "seed", "strength"])["correct"].mean().unstack("strength")
    rows = []
    for run, g in acc.groupby(level="run", sort=False):
        for s in [x for x in STRENGTHS if x != 1.0]:
            d = 100 * (g[s] - g[1.0]).to_numpy()
            sc = seed_contrast(d)
            rows.append({"run": run, "strength": s, "seeds": sc.n_seeds, "acc_s1": round(float(g[1.0].mean()), 4),
                         "acc_s": round(float(g[s].mean()), 4), "mean_pp": round(sc.mean, 2),
                         "ci_low": round(sc.low, 2), "ci_high": round(sc.high, 2),
                         "positive": sc.n_positive, "negative": sc.n_negative, "sign_p": sc.sign_p,
                         "per_seed_pp": " ".join(f"{x:+.1f}" for x in d)})
    if not rows:
        return pd.DataFrame(rows)
    rank = {r: i for i, r in enumerate(common.RUNS)}
    frame = pd.DataFrame(rows)
    return frame.assign(_o=frame["run"].map(rank)).sort_values(["_o", "strength"]).drop(columns="_o").reset_index(drop=True)


# ---------------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------------


def load_results(profile: str) -> dict[str, pd.DataFrame]:
    """Every finished job's rows: items, strength, lambda, train (one row per model), timing."""
    files = sorted(eval_dir(profile).glob("*.json.gz"))
    out = {k: [] for k in ("items", "strength", "lambda", "train")}
    for f in files:
        with gzip.open(f, "rt") as fh:
            r = json.loads(fh.read())
        out["items"] += r["items"]
        out["strength"] += r["strength"]
        out["lambda"] += r["lambda"]
        s = r["train_summary"]
        out["train"].append({"run": s["arm"], "seed": s["seed"], "steps": s["steps"],
                             "length_reached": s["curriculum"]["length_reached"], "val_loss": s["val_loss"],
                             "final_task_acc": s["final"].get("task_acc"), "final_niah_acc": s["final"]["niah_acc"],
                             "train_seconds": s["train_seconds"], "eval_seconds": r["eval_seconds"]})
    return {k: pd.DataFrame(v) for k, v in out.items()}


def _order(frame: pd.DataFrame, col: str = "run") -> pd.DataFrame:
    rank = {r: i for i, r in enumerate(common.RUNS)}
    return frame.assign(_o=frame[col].map(rank)).sort_values(["_o"] + [c for c in ("seed", "task", "length")
                                                                       if c in frame]).drop(columns="_o")


def accuracy_table(items: pd.DataFrame) -> pd.DataFrame:
    g = items.groupby(["run", "seed", "task", "length"])["correct"].agg(n="size", n_correct="sum").reset_index()
    cis = [binomial_ci(int(k), int(m)) for k, m in zip(g["n_correct"], g["n"])]
    g["accuracy"], g["ci_low"], g["ci_high"] = ([c.estimate for c in cis], [c.low for c in cis],
                                                [c.high for c in cis])
    return _order(g).reset_index(drop=True)


def per_seed_contrasts(items: pd.DataFrame, contrasts=CONTRASTS) -> pd.DataFrame:
    """Exact McNemar per (contrast, task, length, seed) on the same items (item noise within one pair of models)."""
    key = items.set_index(["run", "seed", "task", "length", "item"])["correct"].sort_index()
    have = set(zip(items["run"], items["seed"]))
    rows = []
    for a, b in contrasts:
        for (task, L), _ in items.groupby(["task", "length"]):
            for seed in sorted(set(items["seed"])):
                if (a, seed) not in have or (b, seed) not in have:
                    continue
                ca, cb = key.loc[(a, seed, task, L)], key.loc[(b, seed, task, L)]
                if not ca.index.equals(cb.index):
                    raise ValueError(f"{a} and {b} (seed {seed}, {task} {L}) were scored on different items")
                r = mcnemar_exact(ca.to_numpy(), cb.to_numpy())
                rows.append({"contrast": f"{a} - {b}", "task": task, "length": L, "seed": seed, "n": r.n,
                             "acc_a": r.accuracy_a, "acc_b": r.accuracy_b, "diff_pp": 100 * r.accuracy_difference,
                             "a_only": r.b10, "b_only": r.b01, "mcnemar_p": r.p_value})
    return pd.DataFrame(rows)


def seed_level(per_seed: pd.DataFrame) -> pd.DataFrame:
    """Per (contrast, task, length): mean difference over seeds (pp), exact seed-bootstrap 95% interval, sign test."""
    rows = []
    for (c, task, L), g in per_seed.groupby(["contrast", "task", "length"], sort=False):
        sc = seed_contrast(g["diff_pp"].to_numpy())
        rows.append({"contrast": c, "task": task, "length": L, "seeds": sc.n_seeds, "mean_pp": sc.mean,
                     "ci_low": sc.low, "ci_high": sc.high, "positive": sc.n_positive, "negative": sc.n_negative,
                     "ties": sc.n_zero, "sign_p": sc.sign_p, "per_seed_pp": " ".join(f"{x:+.1f}" for x in g["diff_pp"]),
                     "interval": sc.method})
    return pd.DataFrame(rows)


def strength_table(strength: pd.DataFrame) -> pd.DataFrame:
    """Accuracy at each strength, paired (McNemar) against s = 1 on the same items, per (run, seed)."""
    rows = []
    for (run, seed), g in strength.groupby(["run", "seed"]):
        ref = g[g["strength"] == 1.0].set_index("item")["correct"].sort_index()
        for s, gs in g.groupby("strength"):
            c = gs.set_index("item")["correct"].sort_index()
            r = mcnemar_exact(c.to_numpy(), ref.to_numpy())
            rows.append({"run": run, "seed": seed, "length": int(gs["length"].iloc[0]), "strength": s,
                         "accuracy": r.accuracy_a, "diff_vs_s1_pp": 100 * r.accuracy_difference, "only_s": r.b10,
                         "only_s1": r.b01, "mcnemar_p": r.p_value})
    return _order(pd.DataFrame(rows)).reset_index(drop=True)


def forest_plot(seed_table: pd.DataFrame, per_seed: pd.DataFrame, task: str, path: Path) -> Optional[Path]:
    """One panel per length: each contrast's per-seed differences (dots) and the seed mean with its interval."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    st = seed_table[seed_table["task"] == task]
    if st.empty:
        return None
    lengths = sorted(set(st["length"]))
    names = list(dict.fromkeys(st["contrast"]))
    fig, axes = plt.subplots(1, len(lengths), figsize=(3.2 * len(lengths), 0.45 * len(names) + 1.4), sharey=True,
                             squeeze=False)
    for ax, L in zip(axes[0], lengths):
        for y, c in enumerate(names):
            row = st[(st["contrast"] == c) & (st["length"] == L)]
            pts = per_seed[(per_seed["contrast"] == c) & (per_seed["length"] == L) & (per_seed["task"] == task)]
            ax.scatter(pts["diff_pp"], [y] * len(pts), s=10, color="0.6", zorder=2)
            if len(row):
                r = row.iloc[0]
                ax.errorbar(r["mean_pp"], y, xerr=[[r["mean_pp"] - r["ci_low"]], [r["ci_high"] - r["mean_pp"]]],
                            fmt="o", color="C0", capsize=3, zorder=3)
        ax.axvline(0, color="k", lw=0.8)
        ax.set_title(f"{task}, {L} tokens", fontsize=9)
        ax.set_xlabel("a - b (pp)")
    axes[0][0].set_yticks(range(len(names)))
    axes[0][0].set_yticklabels(names, fontsize=8)
    axes[0][0].invert_yaxis()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def report(profile: str) -> dict[str, pd.DataFrame]:
    """Writes every table (csv + md) under <root>/report/ and the forest plot; returns the tables."""
    root = root_for(profile)
    res = load_results(profile)
    out = root / "report"
    out.mkdir(parents=True, exist_ok=True)
    tables = {"train": _order(res["train"]) if len(res["train"]) else res["train"]}
    if len(res["items"]):
        tables["accuracy"] = accuracy_table(res["items"])
        tables["per_seed_contrasts"] = per_seed_contrasts(res["items"])
        if len(tables["per_seed_contrasts"]):
            tables["seed_contrasts"] = seed_level(tables["per_seed_contrasts"])
    if len(res["strength"]):
        tables["strength"] = strength_table(res["strength"])
        tables["strength_seeds"] = sweep_seed_level(res["strength"])
    if len(res["lambda"]):
        tables["lambda"] = _order(res["lambda"]).reset_index(drop=True)
    sweep, agree = load_sweep(profile)
    if len(sweep):
        tables["sweep"] = strength_table(sweep)
        tables["sweep_seeds"] = sweep_seed_level(sweep)
        tables["sweep_agreement"] = _order(agree).reset_index(drop=True)
    for name, frame in tables.items():
        frame.to_csv(out / f"{name}.csv", index=False)
        (out / f"{name}.md").write_text(common.markdown_table(frame))
    if "seed_contrasts" in tables and frozen_path(profile).is_file():
        forest_plot(tables["seed_contrasts"], tables["per_seed_contrasts"], read_frozen(profile)["task"],
                    out / "forest.png")
    return tables


README = HERE / "README.md"
START, END = "<!-- seeds:start -->", "<!-- seeds:end -->"


def _wide(acc: pd.DataFrame, task: str) -> pd.DataFrame:
    a = acc[acc["task"] == task].copy()
    a["cell"] = [f"{100 * x:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]" for x, lo, hi in
                 zip(a["accuracy"], a["ci_low"], a["ci_high"])]
    w = a.pivot(index=["run", "seed"], columns="length", values="cell").reset_index()
    w.columns = [c if isinstance(c, str) else f"{c} tok" for c in w.columns]
    return _order(w).reset_index(drop=True)


def readme_block(profile: str, tables: dict[str, pd.DataFrame]) -> str:
    """Markdown for the generated block: status, the frozen choice, per-seed and seed-level tables, lambda study."""
    frozen = read_frozen(profile)
    done = set(zip(tables["train"]["run"], tables["train"]["seed"])) if len(tables["train"]) else set()
    todo = [f"{r}-s{s}" for r, s in jobs(profile) if (r, s) not in done]
    out = [f"Written by `python -m experiments.qed.seeds report` from `{root_for(profile).relative_to(common.ROOT)}/`"
           f" ({len(done)} of {len(jobs(profile))} jobs finished).", "",
           "**Finished:** " + (", ".join(f"{r}-s{s}" for r, s in jobs(profile) if (r, s) in done) or "none") + ".",
           "", "**Not finished:** " + (", ".join(todo) or "none") + ".", "",
           "### The frozen choice (dev seed)", "",
           f"Task `{frozen['task']}` ({'inside' if frozen['in_band'] else 'OUTSIDE'} the {frozen['band']} band), "
           f"step budget {frozen['steps']} (training curve: mean task accuracy over the 20 steps before each snapshot "
           f"{ {k: round(v, 3) for k, v in frozen['curve']['task_acc_before_step'].items()} }, end of run "
           f"{frozen['curve']['task_acc_end']:.3f}; plateau = within {frozen['curve']['plateau']}). Frozen "
           f"{frozen['frozen_at']}. gdn2 (dev seed {frozen['dev_seed']}) on dev-split items:", ""]
    dev = pd.DataFrame(frozen["dev_accuracy"])
    dev["cell"] = [f"{100 * x:.0f} [{100 * lo:.0f}, {100 * hi:.0f}]" for x, lo, hi in
                   zip(dev["accuracy"], dev["ci_low"], dev["ci_high"])]
    w = dev.pivot(index="task", columns="length", values="cell").reindex(list(tasks.RETRIEVAL)).reset_index()
    w.columns = [c if isinstance(c, str) else f"{c} tok" for c in w.columns]
    out += [common.markdown_table(w), ""]
    if len(tables["train"]):
        out += ["### Training", "", common.markdown_table(tables["train"]), ""]
    if "accuracy" in tables:
        acc = tables["accuracy"]
        for task in dict.fromkeys([frozen["task"], "sniah1", "doc", "qa"]):
            if task in set(acc["task"]):
                out += [f"### Accuracy per seed: `{task}` (%, 95% Wilson interval, {int(acc[acc['task'] == task]['n'].iloc[0])} "
                        "eval-split items per length)", "", common.markdown_table(_wide(acc, task)), ""]
    if "seed_contrasts" in tables:
        sc = tables["seed_contrasts"].copy()
        sc["cell"] = [f"{m:+.1f} [{lo:+.1f}, {hi:+.1f}] ({p_}/{n_}, p={sp:.2g})" for m, lo, hi, p_, n_, sp in
                      zip(sc["mean_pp"], sc["ci_low"], sc["ci_high"], sc["positive"], sc["negative"], sc["sign_p"])]
        for task in dict.fromkeys([frozen["task"], "sniah1", "doc", "qa"]):
            t = sc[sc["task"] == task]
            if len(t):
                w = t.pivot(index="contrast", columns="length", values="cell").reindex(
                    list(dict.fromkeys(t["contrast"]))).reset_index()
                w.insert(1, "seeds", t.groupby("contrast", sort=False)["seeds"].max().to_numpy())
                w.columns = [c if isinstance(c, str) else f"{c} tok" for c in w.columns]
                out += [f"### Contrasts over seeds: `{task}`", "",
                        "Cell: mean over seeds of the per-seed accuracy difference a - b (pp) [exact seed-bootstrap "
                        "95% interval] (seeds with a > b / seeds with a < b, exact sign-test p).", "",
                        common.markdown_table(w), ""]
        out += ["![forest plot](figures/forest_seeds.png)", ""]
    if "per_seed_contrasts" in tables:
        for task in dict.fromkeys([frozen["task"], "doc", "qa"]):
            ps = tables["per_seed_contrasts"]
            ps = ps[ps["task"] == task]
            if len(ps):
                out += [f"### Per-seed exact McNemar (item noise within one pair of models): `{task}`", "",
                        f"{int((ps['mcnemar_p'] < 0.05).sum())} of {len(ps)} per-seed comparisons have p < 0.05 "
                        f"(about {0.05 * len(ps):.0f} would by chance alone if no pair of models differed).", "",
                        "<details><summary>Per seed</summary>", "", common.markdown_table(ps.drop(columns=["task"])),
                        "", "</details>", ""]
    seed_note = ("Over seeds: mean of the per-seed accuracy change from s = 1 (pp) [exact seed-bootstrap 95% interval], "
                 "seeds up / down, exact sign-test p; per seed below.")
    if "strength" in tables:
        L = int(tables["strength"]["length"].iloc[0])
        out += [f"### Inference-time strength (every lambda_h times s) on the frozen task at {L} tokens, paired with "
                "s = 1", "", seed_note, "", common.markdown_table(tables["strength_seeds"]), "",
                "<details><summary>Per seed (exact McNemar against s = 1)</summary>", "",
                common.markdown_table(tables["strength"]), "", "</details>", ""]
    if "sweep" in tables:
        L = int(tables["sweep"]["length"].iloc[0])
        ag = tables["sweep_agreement"]
        out += [f"### Inference-time strength on `{SWEEP_TASK}` at {L} tokens (the sweep phase, retrained models)", "",
                seed_note, "", common.markdown_table(tables["sweep_seeds"]), "",
                f"The sweep retrains each job with the same recipe and batches; at s = 1 the retrained models score "
                f"{int(ag['agree_with_main'].sum())} of {int(ag['n'].sum())} items as the committed main models did "
                f"(per job: {int(ag['agree_with_main'].min())}-{int(ag['agree_with_main'].max())} of "
                f"{int(ag['n'].iloc[0])}).", "",
                "<details><summary>Per seed (exact McNemar against s = 1), and agreement with the main result</summary>",
                "", common.markdown_table(tables["sweep"]), "", common.markdown_table(ag), "", "</details>", ""]
    if "lambda" in tables:
        lam = tables["lambda"]
        g = lam.groupby("run", sort=False)["lambda"].agg(["count", "mean", "min", "max"]).reset_index()
        g.insert(1, "lambda_0", [round(common.run_settings(r)["qed_lambda_max"] /
                                       (1 + np.exp(-common.run_settings(r)["qed_theta_init"])), 4) for r in g["run"]])
        g.insert(1, "lambda_max", [common.run_settings(r)["qed_lambda_max"] for r in g["run"]])
        out += ["### Trained lambda per head (all layers, heads and finished seeds)", "", common.markdown_table(g),
                "", "<details><summary>Per head</summary>", "", common.markdown_table(lam), "", "</details>", ""]
    return "\n".join(out)


def write_readme(profile: str, tables: dict[str, pd.DataFrame], readme: Path = README) -> None:
    forest = root_for(profile) / "report" / "forest.png"
    if forest.is_file() and forest.stat().st_size < 300_000:
        (readme.parent / "figures").mkdir(exist_ok=True)
        (readme.parent / "figures" / "forest_seeds.png").write_bytes(forest.read_bytes())
    text = readme.read_text()
    if START not in text or END not in text:
        raise ValueError(f"{readme} has no seed-study block; add the lines {START} and {END} where the tables go")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(head + START + "\n" + readme_block(profile, tables) + "\n" + END + tail)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=("dev", "main", "sweep", "report", "all"))
    parser.add_argument("--profile", choices=sorted(PROFILES), default="full")
    parser.add_argument("--runs", default=",".join(SWEEP_RUNS),
                        help="sweep: comma-separated QED runs (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.phase in ("dev", "all") and not (args.phase == "all" and frozen_path(args.profile).is_file()):
        print(json.dumps(dev_phase(args.profile), indent=2))
    if args.phase in ("main", "all"):
        main_phase(args.profile)
    if args.phase in ("sweep", "all"):
        runs = [r.strip() for r in args.runs.split(",") if r.strip()]
        if args.profile != "full":
            runs = [r for r in runs if r in PROFILES[args.profile]["runs"]]
        sweep_phase(args.profile, runs)
    if args.phase in ("report", "all"):
        tables = report(args.profile)
        for name, frame in tables.items():
            print(f"\n== {name} ==\n{frame.to_string(index=False)}")
        if args.profile == "full":
            write_readme(args.profile, tables)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
