"""Trains every QED ablation arm (gdn2, full, nogate, nogate_noproj, rand, noproj) on the same seeds with one recipe:
the same initial weights, data stream, step budget and schedule; only `erase_arm` differs. Training mix: S-NIAH answer
retrieval (weighted up) plus a floor of next-token loss on generated filler, with a staged curriculum over the
haystack length (32 -> 64 -> 128 -> 256 tokens) that advances once the running training accuracy is >= 85%.

Usage:  python -m experiments.qed.train_arms [--arms gdn2 full ...] [--seeds 0 1] [--steps N] [--max-minutes M]
                                             [--jobs 2] [--smoke]
"""
from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Optional, Sequence


import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from experiments.qed import common, tasks
from experiments.train_tiny import init_weights, should_advance, staged_learning_rate  # (shared recipe)
from experiments.training import finish_run, train_loop
from recurscope.interp.data import FillerSource, build_word_tokenizer, save_word_tokenizer
from recurscope.interp.loading import save_model
from recurscope.interp.models import RecurrentLM

DEFAULT_OUT = common.ROOT / "results" / "qed" / "train"
# 300 steps: every arm is at 100% S-NIAH accuracy at the training length by then (the reduced run), and 12 models
# x 300 steps take ~40 min of the 2 cores, which leaves the evaluation (the costly part) room in a few hours.
FULL_STEPS = 300
SMOKE_STEPS = 4
# Staged curriculum: S-NIAH is learned first where it is cheap and easy (a 32-token haystack, a step ~10x cheaper than
# at 256), then the haystack doubles each time the last ADVANCE_WINDOW steps of a stage average >= ADVANCE_ACCURACY
# training accuracy over the 90 number candidates. The last stage is the training length.
STAGE_LENGTHS = (32, 64, 128, common.TRAIN_LENGTH)
ADVANCE_WINDOW, ADVANCE_ACCURACY = 20, 0.85
NIAH_ROWS, FILLER_ROWS = 16, 2         # rows per step, all of the current stage's length
NIAH_WEIGHT = 4.0                      # loss = filler LM loss (the floor) + NIAH_WEIGHT * answer cross-entropy
PEAK_LR, WARMUP_STEPS, GRAD_CLIP = 1e-3, 20, 1.0   # linear warmup, then constant: the clock may end the run
VAL_ROWS = 32                          # held-out filler rows for the validation loss
DATA_SEED_OFFSET = 1_000_003           # S-NIAH training examples use seeds far from the evaluation seed


#: Training mix: task -> weight of its rows. A task joins the mix once the curriculum's length reaches
#: TRAIN_MIN_LENGTH[task] (its needles and query then take at most about half the context; S-NIAH-1 runs from 32).
TRAIN_MIX = {"sniah1": 3, "sniah2": 2, "sniah3": 2, "mk2": 2, "mk4": 2, "mk8": 1, "mk2v2": 1, "mk4v2": 1, "doc": 1,
             "qa": 1}
TRAIN_MIN_LENGTH = {"sniah1": 32, "sniah2": 64, "sniah3": 64, "mk2": 128, "mk4": 128, "mk2v2": 128, "mk4v2": 128,
                    "mk8": 256, "doc": 256, "qa": 256}


def training_batch(tokenizer, step: int, seed: int, length: int = common.TRAIN_LENGTH,
                   niah_rows: int = NIAH_ROWS, filler_rows: int = FILLER_ROWS) -> dict:
    """One step's batch, a pure function of (step, seed, length): `niah_rows` task rows (train-split items, random
    depths; each row's task drawn from TRAIN_MIX among the tasks that fit `length`), then train-split filler."""
    rng = random.Random(f"qed-train/{seed}/{step}")
    mix = [t for t in TRAIN_MIX if TRAIN_MIN_LENGTH[t] <= length]
    drawn = rng.choices(mix, weights=[TRAIN_MIX[t] for t in mix], k=niah_rows)
    parts = []
    for task in mix:
        count = drawn.count(task)
        if count:
            parts.append(tasks.build_task(tokenizer, task, count, length, split="train",
                                          seed=DATA_SEED_OFFSET + seed * 100_003 + step,
                                          depths=[rng.random() for _ in range(count)]))
    filler = [FillerSource(id=(seed * 100_003 + step) * filler_rows + j, split="train").token_ids(tokenizer, length)
              for j in range(filler_rows)]
    tokens = torch.cat([p.input_ids for p in parts] + [torch.tensor(filler, dtype=torch.long)])
    return {"tokens": tokens, "n_niah": niah_rows, "parts": parts}


def batch_losses(model: RecurrentLM, batch: dict, niah_weight: float = 1.0) -> dict:
    """LM loss on the filler rows (every next token) plus `niah_weight` x the answer cross-entropy (full vocabulary,
    every answer token under teacher forcing) of the task rows. niah_acc: S-NIAH-1 rows' accuracy (argmax over the
    number candidates; the curriculum advances on it, as before); task_acc: every task row's accuracy."""
    tokens, n = batch["tokens"], batch["n_niah"]
    logits = model(tokens)
    lm = common.lm_loss(logits[n:], tokens[n:])
    losses, correct, sniah1, row = [], [], [], 0
    for part in batch["parts"]:
        rows = torch.arange(row, row + len(part))
        at = logits[rows[:, None], part.positions].float()           # (n_part, P, V)
        losses.append(F.cross_entropy(at.reshape(-1, at.shape[-1]), part.answer_ids.reshape(-1), reduction="sum"))
        with torch.no_grad():
            ok = part.correct(at)
        correct.append(ok)
        if part.task == "sniah1":
            sniah1.append(ok)
        row += len(part)
    answer_tokens = sum(p.answer_ids.numel() for p in batch["parts"])
    niah = torch.stack(losses).sum() / answer_tokens
    acc = torch.cat(sniah1).float().mean() if sniah1 else torch.tensor(float("nan"))
    return {"loss": lm + niah_weight * niah, "lm_loss": lm, "niah_loss": niah, "niah_acc": acc,
            "task_acc": torch.cat(correct).float().mean()}


@torch.no_grad()
def validation_loss(model: RecurrentLM, tokenizer, rows: int = VAL_ROWS, length: int = common.TRAIN_LENGTH,
                    batch_size: int = 16) -> float:
    """Mean next-token loss (nats) on `rows` held-out filler sources of `length` tokens; the same rows for every arm."""
    model.eval()
    total, count = 0.0, 0
    for lo in range(0, rows, batch_size):
        ids = [FillerSource(id=i, split="heldout").token_ids(tokenizer, length) for i in range(lo, min(rows, lo + batch_size))]
        tokens = torch.tensor(ids, dtype=torch.long)
        loss = common.lm_loss(model(tokens), tokens)
        total += float(loss) * tokens.shape[0]
        count += tokens.shape[0]
    return total / count


def stage_for_step(stage_index: int, stage_accuracies: list[float], stage_lengths: Sequence[int] = STAGE_LENGTHS,
                   window: int = ADVANCE_WINDOW, threshold: float = ADVANCE_ACCURACY) -> tuple[int, bool]:
    """The curriculum stage for the next step: (stage_index + 1, True) when a later stage exists and the current
    stage's last `window` training accuracies average >= `threshold` (experiments/train_tiny.should_advance), else
    (stage_index, False). `stage_accuracies` holds only the current stage's steps."""
    if not 0 <= stage_index < len(stage_lengths):
        raise ValueError(f"stage_index must lie in [0, {len(stage_lengths) - 1}] for stage_lengths={tuple(stage_lengths)};"
                         f" received {stage_index}.")
    if stage_index + 1 < len(stage_lengths) and should_advance(stage_accuracies, window, threshold):
        return stage_index + 1, True
    return stage_index, False


def suite_tokenizer():
    """The word tokenizer with the document and comprehension tasks' words added."""
    return build_word_tokenizer(extra_words=tasks.task_words())


def initial_model(arm: str, seed: int, tokenizer) -> RecurrentLM:
    """The arm's model with the seed's shared initial weights: a gdn2 model is built and initialised
    (experiments/train_tiny.init_weights: N(0, 0.02), residual writers / sqrt(2L), long-memory decays) under
    torch.manual_seed(seed) and copied into the arm's model, so only the arm's own qed_theta (and rand's fixed z)
    can differ between arms."""
    torch.manual_seed(seed)
    reference = RecurrentLM(common.model_config("gdn2", tokenizer))
    init_weights(reference)
    model = RecurrentLM(common.model_config(arm, tokenizer))
    result = model.load_state_dict(reference.state_dict(), strict=False)
    own = [k for k in result.missing_keys if not k.endswith(("qed_theta", "qed_z"))]
    if own or result.unexpected_keys:
        raise RuntimeError(f"arm {arm!r} does not share gdn2's parameters: missing {own}, "
                           f"unexpected {result.unexpected_keys}")
    return model


RESUME_EVERY = 25
LOG_COLUMNS = ["step", "stage", "length", "loss", "lm_loss", "niah_loss", "niah_acc", "task_acc", "lr", "lam_mean",
               "reference_fallback", "skipped", "seconds"]


def _parse_stage_lengths(stage_lengths: Sequence[int]) -> tuple[int, ...]:
    lengths = tuple(int(x) for x in stage_lengths)
    if not lengths or list(lengths) != sorted(lengths) or lengths[-1] != common.TRAIN_LENGTH:
        raise ValueError(f"stage_lengths must be increasing and end at the training length {common.TRAIN_LENGTH}; "
                         f"received {tuple(stage_lengths)}.")
    return lengths


class ArmRecipe:
    """One arm's training recipe for experiments.training.train_loop: S-NIAH plus filler batches whose haystack
    length follows the staged curriculum (stage_for_step), the warmup-then-constant schedule, and the reference
    step loop as the fallback for a step whose chunked gradient is non-finite."""

    columns = LOG_COLUMNS

    def __init__(self, model: RecurrentLM, tokenizer, seed: int, stage_lengths: tuple[int, ...], niah_rows: int,
                 niah_weight: float, peak_lr: float):
        self.model, self.tokenizer, self.seed, self.stage_lengths = model, tokenizer, seed, stage_lengths
        self.niah_rows, self.niah_weight, self.peak_lr = niah_rows, niah_weight, peak_lr
        self.stage, self.stage_accs, self.advances, self.advanced = 0, [], [], False

    def learning_rate(self, step: int) -> float:
        return staged_learning_rate(step, self.peak_lr, WARMUP_STEPS)

    def next_batch(self, step: int, history: list[dict], elapsed) -> dict:
        self.stage, self.advanced = stage_for_step(self.stage, self.stage_accs, self.stage_lengths)
        if self.advanced:
            self.stage_accs = []
            self.advances.append({"step": step, "stage": self.stage, "length": self.stage_lengths[self.stage],
                                  "seconds": round(elapsed(), 1)})
        length = self.stage_lengths[self.stage]
        return {**training_batch(self.tokenizer, step, self.seed, length=length, niah_rows=self.niah_rows),
                "length": length}

    def losses(self, batch: dict) -> dict:
        return batch_losses(self.model, batch, self.niah_weight)

    def fallback_losses(self, batch: dict) -> dict:
        # Guard kept after the chunked backward's overflow fix (commit 9b677e4): the step again through the
        # reference step loop (its autograd graph is recorded before the backend is switched back).
        self.model.set_backend("reference")
        try:
            return batch_losses(self.model, batch, self.niah_weight)
        finally:
            self.model.set_backend("chunked")

    def row(self, batch: dict) -> dict:
        lams = [x for v in common.qed_lambdas(self.model).values() if v for x in v]
        return {"stage": self.stage, "length": batch["length"],
                "lam_mean": round(float(np.mean(lams)), 5) if lams else ""}

    def record(self, row: dict) -> None:
        if row["niah_acc"] == row["niah_acc"]:   # a step without S-NIAH-1 rows (nan) leaves the window alone
            self.stage_accs.append(row["niah_acc"])

    def finished(self) -> bool:
        return False

    def state_dict(self) -> dict:
        return {"stage": self.stage, "stage_accs": self.stage_accs, "advances": self.advances}

    def load_state_dict(self, state: dict) -> None:
        self.stage, self.stage_accs, self.advances = state["stage"], state["stage_accs"], state["advances"]


def train_one(arm: str, seed: int, steps: int, out: Path, threads: int = 1, smoke: bool = False,
              command: Optional[str] = None, log_every: int = 50, peak_lr: float = PEAK_LR,
              max_minutes: Optional[float] = None, stage_lengths: Sequence[int] = STAGE_LENGTHS,
              niah_rows: int = NIAH_ROWS, niah_weight: float = NIAH_WEIGHT, snapshots: Sequence[int] = ()) -> dict:
    """Trains one (arm, seed) into `out` (checkpoint, tokenizer, train_log.csv, summary.json); returns the summary.

    Resumable: every RESUME_EVERY steps the model, optimizer and curriculum state go to `out/resume.pt`, and a call
    with the same settings continues from there (batches are pure functions of the step, so the run is the same).
    `snapshots`: step counts after which the model is also saved to `out/at-step-<n>/`.

    At most `steps` optimizer steps, fewer if `max_minutes` of wall-clock training run out first (recorded in
    summary["stopped_by"]). The batch of a step is a pure function of (seed, step, stage length)."""
    common.check_run(arm)
    stage_lengths = _parse_stage_lengths(stage_lengths)
    torch.set_num_threads(int(threads))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    random.seed(seed)
    np.random.seed(seed)
    tokenizer = suite_tokenizer()
    model = initial_model(arm, seed, tokenizer)
    model.set_backend("chunked")
    model.train()
    optimizer = torch.optim.AdamW(common.qed_param_groups(model, peak_lr), lr=peak_lr, betas=(0.9, 0.95), eps=1e-8)
    recipe = ArmRecipe(model, tokenizer, seed, stage_lengths, niah_rows, niah_weight, peak_lr)
    resume_key = {"arm": arm, "seed": seed, "steps": steps, "peak_lr": peak_lr, "stage_lengths": list(stage_lengths),
                  "niah_rows": niah_rows, "niah_weight": niah_weight, "max_minutes": max_minutes}

    def snapshot(step: int) -> None:
        if step in snapshots:   # the model after `step` steps, for choosing a step budget from the curve
            snap = out / f"at-step-{step}"
            model.eval()
            model.tokenizer = tokenizer
            save_model(model, snap)
            save_word_tokenizer(tokenizer, snap)
            model.train()

    def show(row: dict) -> None:
        step = row["step"]
        if log_every and (step % log_every == 0 or step == steps - 1 or recipe.advanced):
            print(f"[{arm} s{seed}] step {step}/{steps} len {row['length']} loss {row['loss']:.3f} "
                  f"niah_acc {row['niah_acc']:.2f} {row['seconds']:.0f}s", flush=True)

    loop = train_loop(model, optimizer, recipe, steps=steps, run_dir=out, grad_clip=GRAD_CLIP,
                      name=f"{arm} seed {seed}", max_minutes=max_minutes, resume_key=resume_key,
                      resume_every=RESUME_EVERY, on_step_start=snapshot, on_row=show)
    history, stopped_by, stage, advances = loop.history, loop.stopped_by, recipe.stage, recipe.advances
    skipped_steps, fallback_steps, train_seconds = loop.skipped_steps, loop.fallback_steps, loop.seconds
    steps_done = len(history)
    model.eval()
    model.tokenizer = tokenizer
    tail = history[-min(20, steps_done):]
    final = {k: round(float(np.nanmean([r[k] for r in tail])), 4)
             for k in ("loss", "lm_loss", "niah_loss", "niah_acc", "task_acc")}
    at_train_length = [r for r in history if r["length"] == common.TRAIN_LENGTH][-20:]
    final["niah_acc_at_train_length"] = (round(float(np.nanmean([r["niah_acc"] for r in at_train_length])), 4)
                                         if at_train_length else None)
    val = validation_loss(model, tokenizer, rows=4 if smoke else VAL_ROWS)
    n_params = sum(p.numel() for p in model.parameters())
    summary = {"arm": arm, "settings": common.run_settings(arm), "seed": seed, "steps": steps_done, "max_steps": steps, "max_minutes": max_minutes,
               "stopped_by": stopped_by, "smoke": smoke, "parameters": n_params,
               "qed_scalars": common.qed_scalar_count(model), "train_seconds": round(train_seconds, 1),
               "val_loss": round(val, 5), "final": final, "skipped_steps": skipped_steps,
               "reference_fallback_steps": fallback_steps, "lambda": common.qed_lambdas(model),
               "curriculum": {"stage_lengths": list(stage_lengths), "stage_reached": stage,
                              "length_reached": stage_lengths[stage], "advances": advances,
                              "advance_rule": {"window": ADVANCE_WINDOW, "accuracy": ADVANCE_ACCURACY}},
               "command": command or "", "recipe": {
                   "architecture": common.ARCHITECTURE, "init": "experiments/train_tiny.init_weights",
                   "train_length": common.TRAIN_LENGTH, "stage_lengths": list(stage_lengths), "niah_rows": niah_rows,
                   "filler_rows": FILLER_ROWS, "niah_weight": niah_weight, "peak_lr": peak_lr,
                   "schedule": f"linear warmup {WARMUP_STEPS} steps, then constant",
                   "theta_lr_mult": common.THETA_LR_MULT, "weight_decay": common.WEIGHT_DECAY, "grad_clip": GRAD_CLIP,
                   "threads": threads}}
    save_model(model, out, extra_config={"recurscope": {k: summary[k] for k in ("arm", "seed", "steps", "smoke")}})
    save_word_tokenizer(tokenizer, out)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    finish_run(out)
    return summary


def _done(out: Path, steps: int, peak_lr: float, max_minutes: Optional[float] = None) -> bool:
    """True when `out` holds a model trained with this step budget, time limit, lr and the staged recipe."""
    f = out / "summary.json"
    if not (f.is_file() and (out / "model.safetensors").is_file()):
        return False
    s = json.loads(f.read_text())
    return (s.get("max_steps") == steps and s.get("max_minutes") == max_minutes
            and s["recipe"]["peak_lr"] == peak_lr and s["recipe"].get("stage_lengths") == list(STAGE_LENGTHS))


def summary_table(out_root: Path) -> pd.DataFrame:
    """One row per trained (arm, seed) found under `out_root`."""
    rows = []
    for f in sorted(Path(out_root).glob("*/summary.json")):
        s = json.loads(f.read_text())
        lams = [x for v in s["lambda"].values() if v for x in v]
        cur = s.get("curriculum", {})
        adv = {a["length"]: a["step"] for a in cur.get("advances", [])}
        rows.append({"arm": s["arm"], "seed": s["seed"], "steps": s["steps"], "stopped_by": s.get("stopped_by", ""),
                     "peak_lr": s["recipe"]["peak_lr"], "parameters": s["parameters"],
                     "qed_scalars": s["qed_scalars"], "val_loss": s["val_loss"],
                     "final_train_loss": s["final"]["loss"], "final_niah_acc": s["final"]["niah_acc"],
                     "length_reached": cur.get("length_reached", common.TRAIN_LENGTH),
                     **{f"step_to_{L}": adv.get(L, float("nan")) for L in cur.get("stage_lengths", [])[1:]},
                     "lambda_mean": float(np.mean(lams)) if lams else float("nan"),
                     "lambda_min": min(lams) if lams else float("nan"), "lambda_max": max(lams) if lams else float("nan"),
                     "reference_fallback_steps": s.get("reference_fallback_steps", 0),
                     "skipped_steps": len(s.get("skipped_steps", [])), "train_seconds": s["train_seconds"]})
    frame = pd.DataFrame(rows)
    if len(frame):
        frame["arm"] = pd.Categorical(frame["arm"], categories=common.RUNS, ordered=True)
        frame = frame.sort_values(["arm", "seed"]).reset_index(drop=True)
        frame["arm"] = frame["arm"].astype(str)
    return frame


def write_summary(out_root: Path) -> pd.DataFrame:
    frame = summary_table(out_root)
    frame.to_csv(Path(out_root) / "train_summary.csv", index=False)
    (Path(out_root) / "train_summary.md").write_text(common.markdown_table(frame))
    return frame


def run(arms: Sequence[str], seeds: Sequence[int], steps: int, out_root: Path, jobs: int = 1, threads: int = 1,
        smoke: bool = False, force: bool = False, command: Optional[str] = None, peak_lr: float = PEAK_LR,
        max_minutes: Optional[float] = None) -> pd.DataFrame:
    """Trains every (arm, seed) not already trained with this budget (unless `force`), `jobs` at a time."""
    for a in arms:
        common.check_run(a)
    out_root = Path(out_root)
    todo = [(a, s) for s in seeds for a in arms
            if force or not _done(out_root / f"{a}-s{s}", steps, peak_lr, max_minutes)]
    if jobs <= 1 or len(todo) <= 1:
        for a, s in todo:
            train_one(a, s, steps, out_root / f"{a}-s{s}", threads, smoke, command, peak_lr=peak_lr,
                      max_minutes=max_minutes)
    else:
        with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
            futures = [pool.submit(train_one, a, s, steps, out_root / f"{a}-s{s}", threads, smoke, command, 50, peak_lr,
                                   max_minutes) for a, s in todo]
            for f in futures:
                f.result()
    return write_summary(out_root)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", nargs="+", default=list(common.ARMS), choices=common.RUNS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--steps", type=int, default=None, help=f"optimizer steps per model (default {FULL_STEPS})")
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="wall-clock limit on each model's training (the same for every arm)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--jobs", type=int, default=1, help="models trained in parallel processes")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_STEPS} steps per model")
    parser.add_argument("--force", action="store_true", help="retrain models that already exist")
    parser.add_argument("--lr", type=float, default=PEAK_LR, help=f"peak learning rate (default {PEAK_LR})")
    args = parser.parse_args(argv)
    steps = args.steps if args.steps is not None else (SMOKE_STEPS if args.smoke else FULL_STEPS)
    command = "python -m experiments.qed.train_arms " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    frame = run(args.arms, args.seeds, steps, args.out, args.jobs, args.threads, args.smoke, args.force, command,
                args.lr, args.max_minutes)
    print(frame.to_string(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
