"""experiments.training.train_loop, the one loop of every trainer: the trainers reproduce the runs recorded before
they shared it, and the loop's resume, stop and non-finite handling hold on a small recipe whose every step is known."""
from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import pytest
import torch

from experiments import training
from experiments.training import STOP_FILE, train_loop, warmup_constant, warmup_stable_decay

GOLDEN = Path(__file__).parent / "golden" / "train_loops.json"
LOSS_KEYS = ("loss", "lm_loss", "niah_loss", "niah_acc", "task_acc", "recall_loss", "recall_acc", "lam_mean")


class LinearRecipe:
    """Least squares on fixed random data; `poison` maps a step to "loss" or "grad" to make that step non-finite."""

    columns = ["step", "loss", "lr", "seconds", "reference_fallback", "skipped", "x"]

    def __init__(self, model, poison=None, fallback=False, done_after=None):
        self.model, self.poison, self.done_after, self.seen = model, poison or {}, done_after, 0
        self.rng = random.Random(0)
        if fallback:
            self.fallback_losses = lambda batch: self.losses({**batch, "poison": None})

    def learning_rate(self, step):
        return warmup_constant(step, 0.1, 2)

    def next_batch(self, step, history, elapsed):
        g = torch.Generator().manual_seed(step)
        return {"x": torch.randn(8, 3, generator=g), "y": torch.randn(8, 1, generator=g),
                "poison": self.poison.get(step), "draw": self.rng.random()}

    def losses(self, batch):
        pred = self.model(batch["x"])
        loss = ((pred - batch["y"]) ** 2).mean()
        if batch["poison"] == "loss":
            loss = loss * float("nan")
        if batch["poison"] == "grad":
            w = self.model.weight
            loss = loss + 0.0 * torch.sqrt((w - w.detach()).sum())   # adds 0, but its gradient is 0 * inf = nan
        return {"loss": loss}

    def row(self, batch):
        return {"x": round(batch["draw"], 6)}

    def record(self, row):
        self.seen += 1

    def finished(self):
        return self.done_after is not None and self.seen >= self.done_after

    def state_dict(self):
        return {"rng": self.rng.getstate(), "seen": self.seen}

    def load_state_dict(self, state):
        self.rng.setstate(state["rng"])
        self.seen = state["seen"]


def _setup(**kw):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD([{"params": model.parameters(), "lr_scale": 1.0}], lr=0.1)
    return model, opt, LinearRecipe(model, **kw)


def _log(run_dir):
    return list(csv.DictReader(open(run_dir / "train_log.csv")))


def test_schedules():
    assert [warmup_constant(s, 1.0, 4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    lrs = [warmup_stable_decay(s, 100, 1.0, 0.05, 0.25, 0.1) for s in range(101)]
    assert lrs[0] == pytest.approx(0.2) and lrs[4] == 1.0 and lrs[74] == 1.0
    assert lrs[100] == pytest.approx(0.1) and all(a >= b for a, b in zip(lrs[5:], lrs[6:]))


def test_an_interrupted_run_resumes_to_the_same_model_and_log(tmp_path, monkeypatch):
    model, opt, recipe = _setup()
    straight = train_loop(model, opt, recipe, steps=7, run_dir=tmp_path / "a", grad_clip=1.0, resume_key={"k": 1},
                          resume_every=2)
    real = LinearRecipe.losses

    def dies_at_step_5(self, batch):
        if batch["x"].equal(torch.randn(8, 3, generator=torch.Generator().manual_seed(5))):
            raise KeyboardInterrupt("killed")
        return real(self, batch)

    model_b, opt_b, recipe_b = _setup()
    monkeypatch.setattr(LinearRecipe, "losses", dies_at_step_5)
    with pytest.raises(KeyboardInterrupt):
        train_loop(model_b, opt_b, recipe_b, steps=7, run_dir=tmp_path / "b", grad_clip=1.0, resume_key={"k": 1},
                   resume_every=2)
    monkeypatch.setattr(LinearRecipe, "losses", real)
    model_c, opt_c, recipe_c = _setup()
    resumed = train_loop(model_c, opt_c, recipe_c, steps=7, run_dir=tmp_path / "b", grad_clip=1.0,
                         resume_key={"k": 1}, resume_every=2)
    assert resumed.resumed_from == 4
    torch.testing.assert_close(model_c.weight, model.weight, rtol=0, atol=0)
    strip = lambda rows: [{k: v for k, v in r.items() if k != "seconds"} for r in rows]
    assert strip(_log(tmp_path / "b")) == strip(_log(tmp_path / "a"))
    assert [r["step"] for r in resumed.history] == list(range(7)) == [r["step"] for r in straight.history]


def test_another_runs_resume_point_is_not_used(tmp_path):
    model, opt, recipe = _setup()
    train_loop(model, opt, recipe, steps=3, run_dir=tmp_path, grad_clip=1.0, resume_key={"k": 1})
    model2, opt2, recipe2 = _setup()
    again = train_loop(model2, opt2, recipe2, steps=3, run_dir=tmp_path, grad_clip=1.0, resume_key={"k": 2})
    assert again.resumed_from == 0 and len(again.history) == 3


def test_stop_file_max_minutes_and_recipe_finish_stop_cleanly(tmp_path):
    model, opt, recipe = _setup(done_after=2)
    res = train_loop(model, opt, recipe, steps=10, run_dir=tmp_path / "a", grad_clip=1.0)
    assert res.stopped_by == "stop_recall" and len(res.history) == 2
    (tmp_path / "b").mkdir()
    model, opt, recipe = _setup()
    calls = []
    res = train_loop(model, opt, recipe, steps=10, run_dir=tmp_path / "b", grad_clip=1.0,
                     on_step_start=lambda s: calls.append(s) or (s == 3 and (tmp_path / "b" / STOP_FILE).touch()))
    assert res.stopped_by == "stop_file" and len(res.history) == 3
    with pytest.raises(ValueError, match="max_minutes"):
        train_loop(model, opt, recipe, steps=10, run_dir=tmp_path / "c", grad_clip=1.0, max_minutes=0)


def test_a_non_finite_loss_stops_with_its_step(tmp_path):
    model, opt, recipe = _setup(poison={2: "loss"})
    with pytest.raises(FloatingPointError, match="step 2"):
        train_loop(model, opt, recipe, steps=5, run_dir=tmp_path, grad_clip=1.0)


def test_a_non_finite_gradient_falls_back_then_skips_and_too_many_skips_stop(tmp_path):
    model, opt, recipe = _setup(poison={1: "grad"}, fallback=True)
    res = train_loop(model, opt, recipe, steps=3, run_dir=tmp_path / "a", grad_clip=1.0)
    assert res.fallback_steps == 1 and res.skipped_steps == []
    assert [r["reference_fallback"] for r in _log(tmp_path / "a")] == ["0", "1", "0"]
    model, opt, recipe = _setup(poison={1: "grad"})
    before = model.weight.detach().clone()
    res = train_loop(model, opt, recipe, steps=2, run_dir=tmp_path / "b", grad_clip=1.0)
    assert [s["step"] for s in res.skipped_steps] == [1] and torch.isfinite(model.weight).all()
    assert not torch.equal(before, model.weight)
    model, opt, recipe = _setup(poison={0: "grad", 1: "grad"})
    with pytest.raises(FloatingPointError, match="non-finite gradients"):
        train_loop(model, opt, recipe, steps=3, run_dir=tmp_path / "c", grad_clip=1.0, max_skips=1)


def _compare(rows, want):
    assert len(rows) == len(want)
    for row, expected in zip(rows, want):
        row.pop("seconds", None)
        assert {k: v for k, v in row.items() if k not in LOSS_KEYS} == \
               {k: v for k, v in expected.items() if k not in LOSS_KEYS}
        for k in LOSS_KEYS:
            if k in expected and expected[k] != "":
                assert float(row[k]) == pytest.approx(float(expected[k]), abs=1e-4), k


@pytest.mark.slow
def test_the_qed_arm_trainer_reproduces_its_run_from_before_the_shared_loop(tmp_path):
    from experiments.qed import train_arms
    from recurscope.interp.loading import load_model

    want = json.loads(GOLDEN.read_text())["train_arms"]
    summary = train_arms.train_one("full", 0, 6, tmp_path, smoke=True, log_every=0, stage_lengths=(32, 256))
    _compare(_log(tmp_path), want["rows"])
    assert summary["final"] == pytest.approx(want["final"], abs=1e-4)
    assert summary["val_loss"] == pytest.approx(want["val_loss"], abs=1e-4)
    total = float(sum(p.double().abs().sum() for p in load_model(tmp_path).parameters()))
    assert total == pytest.approx(want["param_sum"], rel=1e-6)


@pytest.mark.slow
def test_the_qwen35_trainer_reproduces_its_run_from_before_the_shared_loop(tmp_path, monkeypatch):
    import transformers

    from experiments import train_tiny_hf as q

    want = json.loads(GOLDEN.read_text())["train_tiny_qwen35"]
    # The evaluation (16 held-out sources at 512 filler tokens) is not what this test is about.
    monkeypatch.setattr(q.tt, "evaluate", lambda model, tokenizer, progress=False: {"overall": {"accuracy": 0.0}})
    monkeypatch.setattr(q.tt, "_summary_markdown", lambda *a, **k: "")
    summary = q.train(tmp_path, steps=6, seed=0, threads=1, command="golden")
    _compare(_log(tmp_path), want["rows"])
    assert summary["final_losses"] == pytest.approx(want["final"], abs=1e-4)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "model"))
    assert float(sum(p.double().abs().sum() for p in hf.parameters())) == pytest.approx(want["param_sum"], rel=1e-6)


def test_every_trainer_runs_on_the_shared_loop():
    import inspect

    from experiments import train_tiny, train_tiny_hf
    from experiments.qed import train_arms

    for module in (train_tiny, train_tiny_hf, train_arms):
        source = inspect.getsource(module)
        assert "train_loop(" in source and ".backward()" not in source, module.__name__
    assert training.train_loop.__module__ == "experiments.training"
