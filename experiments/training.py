"""The one training loop behind every trained model of the project: the bundled tiny checkpoints
(`experiments.train_tiny`), the transformers-format hybrids (`experiments.train_tiny_hf`) and the QED arms
(`experiments.qed.train_arms`).

A trainer supplies a recipe (its batches, losses, logged fields and curriculum state); the loop owns what every
trainer needs the same way:
- the learning-rate schedule applied per parameter group (`lr * group["lr_scale"]`), from `warmup_constant` or
  `warmup_stable_decay`;
- stopping: the step budget, a wall-clock limit (`max_minutes`), a file named STOP in the run directory, or the
  recipe saying it is finished (a recall target reached);
- non-finite values: a non-finite loss stops the run with its step; a non-finite gradient is recomputed once by the
  recipe's `fallback_losses` where it has one, else (or if still non-finite) the update is skipped and counted, and
  more than `max_skips` skips stop the run;
- resume: every `resume_every` steps (and on every stop) the model, optimizer, log history, RNG states and recipe
  state go atomically to `resume.pt`; a rerun with the same settings (`resume_key`) continues from there and
  produces the same model as an uninterrupted run;
- the CSV log, rewritten from the resumed history so it never holds a row twice.
"""
from __future__ import annotations

import csv
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Protocol, Sequence

import numpy as np
import torch

STOP_FILE = "STOP"          # `touch <run dir>/STOP` ends training cleanly at the next step (then evaluate, save)
RESUME_FILE = "resume.pt"


def warmup_constant(step: int, peak: float, warmup: int) -> float:
    """Linear warmup over `warmup` steps, then constant: a clock or a recall target may end the run anywhere."""
    return peak * min(1.0, (step + 1) / max(1, warmup))


def warmup_stable_decay(step: int, steps: int, peak: float, warmup_fraction: float, decay_fraction: float,
                        final_fraction: float) -> float:
    """Warmup-stable-decay: linear warmup over the first `warmup_fraction` of the steps, constant, then a linear
    decay to `final_fraction * peak` over the last `decay_fraction`."""
    warmup = max(1, int(round(warmup_fraction * steps)))
    decay_start = int(round((1 - decay_fraction) * steps))
    if step < warmup:
        return peak * (step + 1) / warmup
    if step < decay_start:
        return peak
    progress = (step - decay_start) / max(1, steps - decay_start)
    return peak * (1 - (1 - final_fraction) * min(1.0, progress))


class Recipe(Protocol):
    """What a trainer supplies to `train_loop`."""

    columns: Sequence[str]   # the CSV log's columns, in order

    def learning_rate(self, step: int) -> float: ...

    def next_batch(self, step: int, history: list[dict], elapsed: Callable[[], float]) -> dict: ...

    def losses(self, batch: dict) -> dict:
        """Named scalar tensors; "loss" is the one optimised."""

    def row(self, batch: dict) -> dict:
        """The logged fields beyond step, losses, lr, seconds and the loop's flags, read after the update."""

    def record(self, row: dict) -> None:
        """Notes a logged row (curriculum windows); may add fields to it."""

    def finished(self) -> bool: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class LoopResult:
    history: list[dict]
    stopped_by: str            # "steps", "max_minutes", "stop_file" or "stop_recall" (the recipe finished)
    seconds: float             # wall-clock training time, resumed runs included
    skipped_steps: list[dict] = field(default_factory=list)
    fallback_steps: int = 0
    resumed_from: int = 0


def _save_atomically(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)   # a kill mid-write leaves the previous resume point


def train_loop(model: torch.nn.Module, optimizer: torch.optim.Optimizer, recipe: Recipe, *, steps: int,
               run_dir: Path, grad_clip: float, name: str = "run", max_minutes: Optional[float] = None,
               resume_key: Optional[dict] = None, resume_every: Optional[int] = None,
               max_skips: Optional[int] = None, on_step_start: Optional[Callable[[int], None]] = None,
               on_row: Optional[Callable[[dict], None]] = None, log_name: str = "train_log.csv") -> LoopResult:
    """Runs `recipe` on `model` for at most `steps` optimizer steps, writing run_dir/log_name; see the module doc.

    resume_key None: no resume file is read or written. max_skips None: max(3, steps // 10)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1; received {steps}.")
    if max_minutes is not None and not max_minutes > 0:
        raise ValueError(f"max_minutes must be > 0 (a wall-clock limit on training); received {max_minutes!r}.")
    max_skips = max(3, steps // 10) if max_skips is None else max_skips
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    resume_file = run_dir / RESUME_FILE
    result = LoopResult(history=[], stopped_by="steps", seconds=0.0)
    start, elapsed0 = 0, 0.0
    if resume_key is not None and resume_file.is_file():
        saved = torch.load(resume_file, weights_only=False)
        if saved.get("key") == resume_key:   # the same run, interrupted: continue from its last saved step
            model.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            recipe.load_state_dict(saved["recipe"])
            start, elapsed0 = saved["step"], saved["elapsed"]
            result.history, result.skipped_steps = saved["history"], saved["skipped_steps"]
            result.fallback_steps, result.resumed_from = saved["fallback_steps"], start
            random.setstate(saved["python_rng"])
            np.random.set_state(saved["numpy_rng"])
            torch.set_rng_state(saved["torch_rng"])
            print(f"[{name}] resuming at step {start} ({elapsed0:.0f} s trained)", flush=True)
        else:
            print(f"[{name}] {resume_file} holds another run's settings; starting afresh", flush=True)
    t0 = time.time() - elapsed0

    def save_resume(step: int) -> None:
        if resume_key is not None:
            _save_atomically(resume_file, {
                "key": resume_key, "step": step, "elapsed": time.time() - t0, "model": model.state_dict(),
                "optimizer": optimizer.state_dict(), "recipe": recipe.state_dict(), "history": result.history,
                "skipped_steps": result.skipped_steps, "fallback_steps": result.fallback_steps,
                "python_rng": random.getstate(), "numpy_rng": np.random.get_state(),
                "torch_rng": torch.get_rng_state()})

    columns = list(recipe.columns)
    history = result.history
    with open(run_dir / log_name, "w", newline="") as fh:   # rewritten from the resumed history
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        writer.writerows(history)
        fh.flush()
        for step in range(start, steps):
            if resume_every and step > start and step % resume_every == 0:
                save_resume(step)
            if on_step_start is not None:
                on_step_start(step)
            if max_minutes is not None and time.time() - t0 >= 60.0 * max_minutes:
                result.stopped_by = "max_minutes"
                break
            if (run_dir / STOP_FILE).exists():      # a watcher saw the target reached: stop, evaluate, save
                result.stopped_by = "stop_file"
                break
            if recipe.finished():
                result.stopped_by = "stop_recall"
                break
            lr = recipe.learning_rate(step)
            for group in optimizer.param_groups:
                group["lr"] = lr * group.get("lr_scale", 1.0)
            batch = recipe.next_batch(step, history, lambda: time.time() - t0)
            losses = recipe.losses(batch)
            if not torch.isfinite(losses["loss"]):
                raise FloatingPointError(f"non-finite loss {float(losses['loss'].detach())} at step {step} of {name}; lower "
                                         "the learning rate or check the data")
            optimizer.zero_grad(set_to_none=True)
            losses["loss"].backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            fallback = False
            if not bool(torch.isfinite(grad_norm)) and hasattr(recipe, "fallback_losses"):
                # The recipe recomputes the step another way (the QED arms: the reference step loop); counted.
                fallback = True
                optimizer.zero_grad(set_to_none=True)
                losses = recipe.fallback_losses(batch)
                losses["loss"].backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
                result.fallback_steps += 1
            skipped = not bool(torch.isfinite(grad_norm))
            if skipped:
                # A finite loss with a non-finite gradient: skip the update (as a loss scaler would) and record
                # which parameters it hit; too many skips stop the run.
                bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
                result.skipped_steps.append({"step": step, "parameters": bad[:8]})
                if len(result.skipped_steps) > max_skips:
                    raise FloatingPointError(f"{len(result.skipped_steps)} steps of {name} had non-finite gradients "
                                             f"(last at step {step}: {bad[:8]}); lower the learning rate")
            else:
                optimizer.step()
            row = {"step": step, **{k: round(float(v.detach()), 5) for k, v in losses.items()}, **recipe.row(batch),
                   "lr": f"{lr:.3e}", "seconds": round(time.time() - t0, 2)}
            for flag, value in (("reference_fallback", int(fallback)), ("skipped", int(skipped))):
                if flag in columns:
                    row[flag] = value
            recipe.record(row)
            writer.writerow(row)
            fh.flush()
            history.append(row)
            if on_row is not None:
                on_row(row)
        result.seconds = time.time() - t0
        save_resume(history[-1]["step"] + 1 if history else start)
    if not history:
        raise ValueError(f"max_minutes={max_minutes} left no time for a single training step of {name}; raise it.")
    return result


def finish_run(run_dir: Path) -> None:
    """The model is saved: its resume point is no longer needed."""
    (Path(run_dir) / RESUME_FILE).unlink(missing_ok=True)
