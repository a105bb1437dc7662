"""Tests for experiments/qed: each arm's erase vector against the paper's formula on the mixer's own cached q, k and
b (hook_erase_gate checked against a recomputation); the rand arm's z per (layer, head); logits at chosen positions;
the 10x theta learning-rate group; strength 0 equals GDN-2 with the same weights; McNemar, the sign test and the seed
bootstrap against scipy and enumeration; the task generators (deterministic, dev and eval disjoint); resumable
training; the seed study's pipeline; and the 03_qed notebook executed end to end."""
from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from scipy import stats as sps

ROOT = Path(__file__).resolve().parents[2]

from recurscope import kernels
from experiments.qed import common, evaluate, seeds, tasks, train_arms
from recurscope.interp.data import build_word_tokenizer
from recurscope.interp.models import RecurrentLM, qed_strength
from recurscope.interp.stats import mcnemar_exact, seed_bootstrap_ci, seed_contrast, sign_test


@pytest.fixture(scope="module")
def tokenizer():
    return build_word_tokenizer()


def _model(arm, tokenizer, seed=0, theta=None):
    torch.manual_seed(seed)
    model = RecurrentLM(common.model_config(arm, tokenizer))
    model.set_backend("chunked")
    if theta is not None:
        with torch.no_grad():
            for _, m in common.qed_mixers(model):
                m.qed_theta.copy_(torch.tensor(theta, dtype=torch.float32))
    return model.eval()


def _load(path):
    from recurscope.interp.loading import load_model
    return load_model(path)


def _paper_erase(arm, k, q, b, lam, z):
    """Table 1 of the paper, written out: a = b*k + lam * d(arm); P_perp_k(v) = v - k (k.v)."""
    perp = lambda v: v - k * (k * v).sum(-1, keepdim=True)  # noqa: E731
    lam = lam[:, None]
    if arm == "gdn2":
        return b * k
    d = {"full": lambda: perp(b * q), "nogate": lambda: perp(q), "nogate_noproj": lambda: q,
         "noproj": lambda: b * q, "rand": lambda: perp(b * z)}[arm]()
    return b * k + lam * d


@pytest.mark.parametrize("arm", common.ARMS)
def test_each_arm_builds_the_papers_erase_vector_from_its_own_q_k_b(arm, tokenizer):
    model = _model(arm, tokenizer, theta=None if arm == "gdn2" else [0.7, -1.3])
    tokens = torch.randint(0, len(tokenizer), (2, 24), generator=torch.Generator().manual_seed(3))
    _, cache = model.run_with_cache(tokens)
    for layer, mixer in common.qed_mixers(model):
        p = f"blocks.{layer}.mixer."
        q, k, a = cache[p + "hook_q"].float(), cache[p + "hook_k"].float(), cache[p + "hook_erase"]
        b = cache[common.erase_gate_name(layer)]
        # the hook holds the gate the paper defines, recomputed here from the block's input and weights
        block = model.blocks[layer]
        b_ref = torch.sigmoid(block.mixer.b_proj(block.attn_norm(cache[f"blocks.{layer}.hook_resid_pre"])).float())
        torch.testing.assert_close(b, b_ref.reshape(b.shape), rtol=1e-6, atol=1e-7)
        assert ((b > 0) & (b < 1)).all()
        lam = torch.zeros(2) if arm == "gdn2" else 0.25 * torch.sigmoid(torch.tensor([0.7, -1.3]))
        z = getattr(mixer, "qed_z", None)
        expected = _paper_erase(arm, k, q, b, lam, z)
        torch.testing.assert_close(a, expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a, kernels.erase_vector(k, q, b, lam, arm, z), rtol=1e-5, atol=1e-6)
        if arm != "gdn2":  # the added term is really there (the test could not pass with a = b*k)
            assert (a - b * k).abs().max() > 1e-3
        e = kernels.erase_eigenvalue(k, a)
        if arm in ("gdn2", "full", "nogate", "rand"):  # projection keeps e_t at its GDN-2 value
            # exactly so for unit k; the model's L2 norm has an eps, so ||k||^2 < 1 and e moves by at most
            # lam * (1 - ||k||^2) * |k . (b*q)| (plus float32 rounding)
            shortfall = (1 - (k * k).sum(-1)).abs()
            bound = lam.max() * shortfall * (b.abs().sum(-1) + 1) + 1e-6
            assert ((e - common.gdn2_eigenvalue(k, b)).abs() <= bound).all()


def test_theta_group_has_ten_times_the_learning_rate_and_moves_ten_times_as_far(tokenizer):
    model = _model("full", tokenizer).train()
    groups = common.qed_param_groups(model, 1e-3)
    theta = [g for g in groups if g["name"] == "qed_theta"]
    assert len(theta) == 1 and theta[0]["lr"] == pytest.approx(1e-2) and theta[0]["lr_scale"] == 10
    assert theta[0]["weight_decay"] == 0
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)] for p in theta[0]["params"]) == [f"blocks.{i}.mixer.qed_theta" for i in range(2)]
    assert common.qed_scalar_count(model) == 2 * 2  # H per layer
    others = [p for g in groups if g["name"] != "qed_theta" for p in g["params"]]
    assert len(others) + 2 == len(list(model.parameters()))
    assert not any(g["name"] == "qed_theta" for g in common.qed_param_groups(_model("gdn2", tokenizer), 1e-3))
    # AdamW's first step moves every parameter by ~lr (m/sqrt(v) = sign(grad)); theta by ~10x that.
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(groups, lr=1e-3, eps=1e-12)
    tokens = torch.randint(0, len(tokenizer), (2, 32), generator=torch.Generator().manual_seed(0))
    common.lm_loss(model(tokens), tokens).backward()
    opt.step()
    step = {n: (p.detach() - before[n]).abs() for n, p in model.named_parameters()}
    theta_moves = torch.cat([step[f"blocks.{i}.mixer.qed_theta"] for i in range(2)])
    torch.testing.assert_close(theta_moves, torch.full_like(theta_moves, 1e-2), rtol=1e-3, atol=0)
    bias = step["blocks.0.mixer.dt_bias"]
    assert bias.max() == pytest.approx(1e-3, rel=1e-3)
    with pytest.raises(ValueError, match="theta_lr_mult"):
        common.qed_param_groups(model, 1e-3, theta_lr_mult=0)


def test_strength_zero_reduces_qed_to_gdn2_with_the_same_weights(tokenizer):
    qed = _model("full", tokenizer, seed=5, theta=[1.5, 0.5])
    base = _model("gdn2", tokenizer, seed=9)
    missing = base.load_state_dict(qed.state_dict(), strict=False)
    assert missing.missing_keys == [] and sorted(missing.unexpected_keys) == [
        "blocks.0.mixer.qed_theta", "blocks.1.mixer.qed_theta"]
    tokens = torch.randint(0, len(tokenizer), (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = base(tokens)
        with qed_strength(qed, 0.0):
            zero = qed(tokens)
            # prefill + step-by-step decoding also runs at s = 0
            logits, cache = qed(tokens[:, :30], use_cache=True)
            steps = [logits]
            for t in range(30, 40):
                logits, cache = qed(tokens[:, t:t + 1], cache=cache, use_cache=True)
                steps.append(logits)
        one = qed(tokens)
    torch.testing.assert_close(zero, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(steps, 1), ref, rtol=1e-4, atol=1e-4)
    assert (one - ref).abs().max() > 1e-4  # at s = 1 the update really differs
    assert all(m.strength == 1.0 for _, m in common.qed_mixers(qed))


@pytest.mark.parametrize("table", [(40, 3, 9, 48), (10, 0, 0, 5), (7, 12, 1, 0), (0, 25, 25, 0)])
def test_mcnemar_exact_matches_scipy_and_closed_form_on_hand_made_tables(table):
    both, a_only, b_only, neither = table
    a = np.array([1] * both + [1] * a_only + [0] * b_only + [0] * neither, dtype=bool)
    b = np.array([1] * both + [0] * a_only + [1] * b_only + [0] * neither, dtype=bool)
    r = mcnemar_exact(a, b)
    assert (r.b10, r.b01) == (a_only, b_only)
    m = a_only + b_only
    expected = 1.0 if m == 0 else sps.binomtest(b_only, m, 0.5).pvalue
    assert r.p_value == pytest.approx(expected, rel=1e-12)
    if m:  # two-sided exact: 2 * P(X <= min) capped at 1, X ~ Bin(m, 1/2)
        tail = sum(math.comb(m, i) for i in range(min(a_only, b_only) + 1)) / 2 ** m
        assert r.p_value == pytest.approx(min(1.0, 2 * tail), rel=1e-12)
    # contrast_table pairs the same items and reports the same counts
    ex = pd.DataFrame({"arm": ["x"] * len(a) + ["y"] * len(b), "seed": 0, "length": 256,
                       "item": list(range(len(a))) * 2, "correct": list(a) + list(b)})
    c = evaluate.contrast_table(ex, [("x", "y")]).iloc[0]
    assert (c["a_only_correct"], c["b_only_correct"]) == (a_only, b_only)
    assert c["p_value"] == pytest.approx(r.p_value)


def test_constructed_eigenvalues_stay_with_projection_and_leave_without():
    frame = evaluate.constructed_eigenvalue_check(n=2000).set_index("arm")
    for arm in ("gdn2", "full", "nogate", "rand"):
        assert frame.loc[arm, "max_abs_e_minus_gdn2"] < 1e-12 and frame.loc[arm, "n_outside_0_1"] == 0
    for arm in ("noproj", "nogate_noproj"):
        assert frame.loc[arm, "n_outside_0_1"] > 0 and frame.loc[arm, "e_min"] < 0
    ex = evaluate.paper_nonnormal_example()
    assert ex["spectrum"] == pytest.approx([0.5, 1.0]) and ex["norm_Mx_over_x"] == pytest.approx(math.sqrt(1.01))


def test_staged_curriculum_advances_only_after_a_full_window_at_the_threshold():
    L = train_arms.STAGE_LENGTHS
    assert L[-1] == common.TRAIN_LENGTH and list(L) == sorted(L)
    w, thr = train_arms.ADVANCE_WINDOW, train_arms.ADVANCE_ACCURACY
    # one step short of the window: no advance, however accurate
    assert train_arms.stage_for_step(0, [1.0] * (w - 1)) == (0, False)
    # only the last `window` steps count: early failures do not hold a stage back, a late dip does
    assert train_arms.stage_for_step(0, [0.0] * 50 + [thr] * w) == (1, True)
    assert train_arms.stage_for_step(1, [1.0] * 50 + [1.0] * (w - 4) + [0.0] * 4) == (1, False)  # 16/20 = 0.8
    # the mean, not every step, must reach the threshold: 0.85 on average advances, just below does not
    mixed = [0.0, 0.0, 0.0] + [1.0] * (w - 3)  # 17/20 = 0.85 exactly
    assert np.mean(mixed) == thr and train_arms.stage_for_step(2, mixed) == (3, True)
    assert train_arms.stage_for_step(2, [thr - 0.01] * w) == (2, False)
    # the last stage (the training length) is final
    assert train_arms.stage_for_step(len(L) - 1, [1.0] * 100) == (len(L) - 1, False)
    with pytest.raises(ValueError, match="stage_index"):
        train_arms.stage_for_step(len(L), [1.0] * w)
    with pytest.raises(ValueError, match="stage_lengths"):
        train_arms._parse_stage_lengths([64, 32, 256])


def test_every_arm_starts_from_the_same_shared_weights_and_batches_depend_only_on_step_seed_length(tokenizer):
    ref = train_arms.initial_model("gdn2", 3, tokenizer).state_dict()
    for arm in common.QED_ARMS:
        sd = train_arms.initial_model(arm, 3, tokenizer).state_dict()
        assert sorted(set(sd) - set(ref)) == sorted(k for k in sd if k.endswith(("qed_theta", "qed_z")))
        for k, v in ref.items():
            assert torch.equal(sd[k], v), (arm, k)
    other = train_arms.initial_model("gdn2", 4, tokenizer).state_dict()
    assert not torch.equal(other["embed.weight"], ref["embed.weight"])
    # the recipe's init, not torch's default N(0, 1) embedding
    assert ref["embed.weight"].std() == pytest.approx(0.02, rel=0.05)
    a = train_arms.training_batch(tokenizer, 7, 1, length=64, niah_rows=3)
    b = train_arms.training_batch(tokenizer, 7, 1, length=64, niah_rows=3)
    c = train_arms.training_batch(tokenizer, 8, 1, length=64, niah_rows=3)
    assert a["tokens"].shape == (3 + train_arms.FILLER_ROWS, 64) and torch.equal(a["tokens"], b["tokens"])
    assert not torch.equal(a["tokens"], c["tokens"])


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    root = tmp_path_factory.mktemp("qed")
    frame = train_arms.run(["gdn2", "full"], [0], steps=train_arms.SMOKE_STEPS, out_root=root / "train", smoke=True)
    tables = evaluate.run(root / "train", root / "eval", ["gdn2", "full"], [0], n=6, multipliers=[1, 2],
                          strengths=[0.0, 1.0], strength_arms=["full"], strength_multipliers=[1], diag_sequences=2,
                          diag_length=32, matrix_samples=32, val_rows=2)
    return root, frame, tables


@pytest.mark.slow
def test_smoke_training_run_ends_finite_and_writes_its_tables(smoke):
    root, frame, tables = smoke
    assert list(frame["arm"]) == ["gdn2", "full"]
    assert np.isfinite(frame["val_loss"]).all() and np.isfinite(frame["final_train_loss"]).all()
    assert (frame.set_index("arm")["parameters"].diff().dropna() == 4).all()  # full adds H=2 thetas x 2 layers
    written = pd.read_csv(root / "train" / "train_summary.csv")
    assert len(written) == 2 and (root / "train" / "train_summary.md").is_file()
    log = pd.read_csv(root / "train" / "full-s0" / "train_log.csv")
    assert list(log["step"]) == list(range(train_arms.SMOKE_STEPS)) and np.isfinite(log["loss"]).all()
    assert (log["length"] == train_arms.STAGE_LENGTHS[0]).all()  # 4 steps cannot pass the 20-step window
    for name in ("niah_accuracy", "contrasts", "strength", "diagnostics", "val_loss"):
        assert (root / "eval" / f"{name}.csv").is_file(), name
    acc = tables["niah_accuracy"]
    assert set(acc["length"]) == {256, 512} and (acc["n"] == 6).all()
    assert ((acc["ci_low"] <= acc["accuracy"]) & (acc["accuracy"] <= acc["ci_high"])).all()
    strength = tables["strength"]
    assert set(strength["strength"]) == {0.0} and (strength["n"] == 6).all()
    diag = tables["diagnostics"].set_index("arm")
    assert diag.loc["full", "token_heads"] == 2 * 32 * 2 * 2
    # projected arm: e moves only through ||k||^2 < 1 (eps in the L2 norm), by at most lam_max * (1 - ||k||^2)
    lam_max = max(x for v in common.qed_lambdas(_load(root / "train" / "full-s0")).values() for x in v)
    bound = lam_max * diag.loc["full", "max_k_norm_shortfall"] + 2e-6
    assert 0 <= diag.loc["full", "max_abs_e_minus_gdn2"] <= bound
    assert diag.loc["gdn2", "max_abs_e_minus_gdn2"] == 0
    assert (root / "eval" / "figures" / "fig1_niah_accuracy.png").is_file()


@pytest.mark.slow
def test_evaluation_resumes_from_saved_per_model_results(smoke, monkeypatch):
    root, _, tables = smoke
    saved = sorted(p.name for p in (root / "eval" / "per_model").iterdir())
    assert saved == ["full-s0.pt", "gdn2-s0.pt"]
    kwargs = dict(n=6, multipliers=[1, 2], strengths=[0.0, 1.0], strength_arms=["full"], strength_multipliers=[1],
                  diag_sequences=2, diag_length=32, matrix_samples=32, val_rows=2)
    calls = []
    real = evaluate.evaluate_model
    monkeypatch.setattr(evaluate, "evaluate_model", lambda *a, **k: calls.append(a[1:3]) or real(*a, **k))
    again = evaluate.run(root / "train", root / "eval", ["gdn2", "full"], [0], **kwargs)
    assert calls == []  # both models reused, nothing re-evaluated
    pd.testing.assert_frame_equal(again["niah_accuracy"], tables["niah_accuracy"])
    pd.testing.assert_frame_equal(again["diagnostics"], tables["diagnostics"])
    # a model whose result file is gone (an evaluation killed before it finished) is evaluated again; a changed
    # setting invalidates every saved result
    (root / "eval" / "per_model" / "full-s0.pt").unlink()
    evaluate.run(root / "train", root / "eval", ["gdn2", "full"], [0], **kwargs)
    assert calls == [("full", 0)]
    calls.clear()
    out2 = root / "eval-n4"
    shutil.copytree(root / "eval" / "per_model", out2 / "per_model")  # results saved under other settings
    evaluate.run(root / "train", out2, ["gdn2", "full"], [0], **dict(kwargs, n=4))
    assert sorted(calls) == [("full", 0), ("gdn2", 0)]


@pytest.fixture(scope="module")
def seed_study(tmp_path_factory):
    """The seed study's smoke profile end to end (dev choice, 3 runs x 2 seeds, report) in a temporary folder."""
    saved = seeds.RESULTS
    seeds.RESULTS = tmp_path_factory.mktemp("qed-seeds")
    try:
        seeds.main(["all", "--profile", "smoke"])
        yield seeds.root_for("smoke")
    finally:
        seeds.RESULTS = saved


@pytest.mark.slow
def test_seed_study_pipeline_freezes_the_task_and_reports_every_contrast_per_seed(seed_study, monkeypatch):
    root = seed_study
    frozen = json.loads((root / "frozen_task.json").read_text())
    assert frozen["task"] in tasks.RETRIEVAL and frozen["task"] != "sniah1"
    assert frozen["steps"] in (3, 6) and frozen["dev_seed"] == seeds.DEV_SEED
    assert sorted(p.name for p in (root / "eval").glob("*.json.gz")) == sorted(
        f"{r}-s{s}.json.gz" for r in ("gdn2", "full", "full-lm0.5-l0.2") for s in (0, 1))
    sc = pd.read_csv(root / "report" / "seed_contrasts.csv")
    for c in ("full - gdn2", "full-lm0.5-l0.2 - gdn2"):
        rows = sc[sc["contrast"] == c]
        assert set(rows["task"]) == {frozen["task"], "sniah1", "doc", "qa"} and (rows["seeds"] == 2).all()
        assert ((rows["ci_low"] <= rows["mean_pp"]) & (rows["mean_pp"] <= rows["ci_high"])).all()
    per_seed = pd.read_csv(root / "report" / "per_seed_contrasts.csv")
    one = per_seed[(per_seed["contrast"] == "full - gdn2") & (per_seed["task"] == "doc")]
    assert sorted(one["seed"]) == [0, 1]
    row = sc[(sc["contrast"] == "full - gdn2") & (sc["task"] == "doc")].iloc[0]
    assert row["mean_pp"] == pytest.approx(one["diff_pp"].mean())
    lam = pd.read_csv(root / "report" / "lambda.csv")
    assert set(lam["run"]) == {"full", "full-lm0.5-l0.2"} and len(lam) == 2 * 2 * 2 * 2
    st = pd.read_csv(root / "report" / "strength.csv")
    assert set(st["strength"]) == set(seeds.STRENGTHS) and "gdn2" not in set(st["run"])
    assert (root / "report" / "forest.png").is_file()
    # finished jobs are not trained or evaluated again
    monkeypatch.setattr(train_arms, "train_one", lambda *a, **k: pytest.fail("retrained a finished job"))
    monkeypatch.setattr(seeds, "evaluate_one", lambda *a, **k: pytest.fail("re-evaluated a finished job"))
    monkeypatch.setattr(seeds, "RESULTS", root.parent)
    seeds.main_phase("smoke")


@pytest.mark.slow
def test_sweep_scores_the_main_items_at_every_strength_and_reports_over_seeds(seed_study, monkeypatch):
    root = seed_study
    monkeypatch.setattr(seeds, "RESULTS", root.parent)
    sweep, agree = seeds.load_sweep("smoke")
    qed_runs = {"full", "full-lm0.5-l0.2"}          # the smoke profile's QED runs; gdn2 has nothing to scale
    assert set(zip(agree["run"], agree["seed"])) == {(r, s) for r in qed_runs for s in (0, 1)}
    longest = seeds.common.TRAIN_LENGTH * max(seeds.PROFILES["smoke"]["multipliers"])
    assert set(sweep["strength"]) == set(seeds.STRENGTHS) and set(sweep["length"]) == {longest}
    # the smoke sweep reuses the main run's models, so at s = 1 it must score exactly the committed items
    assert (agree["agree_with_main"] == agree["n"]).all()
    items = seeds.load_results("smoke")["items"]
    for (run, seed), g in sweep[sweep["strength"] == 1.0].groupby(["run", "seed"]):
        main = items[(items["run"] == run) & (items["seed"] == seed) & (items["task"] == seeds.SWEEP_TASK)
                     & (items["length"] == longest)].sort_values("item")
        assert g.sort_values("item")["correct"].tolist() == main["correct"].tolist()
    table = pd.read_csv(root / "report" / "sweep_seeds.csv")
    assert set(table["run"]) == qed_runs and set(table["strength"]) == {0.0, 2.0} and (table["seeds"] == 2).all()
    one = table[(table["run"] == "full") & (table["strength"] == 0.0)].iloc[0]
    acc = sweep[sweep["run"] == "full"].groupby(["seed", "strength"])["correct"].mean().unstack()
    assert one["mean_pp"] == pytest.approx(100 * (acc[0.0] - acc[1.0]).mean())
    # the sweep builds exactly the main evaluation's item batch (smoke models score all items alike, so the rows
    # alone cannot tell): record both calls of tasks.build_task for the longest S-NIAH-1 length and compare them
    calls = {"main": [], "sweep": []}
    real = seeds.tasks.build_task

    def recording(where):
        def build(tok, task, n, L, split, seed):
            if task == seeds.SWEEP_TASK and L == longest:
                calls[where].append((task, n, L, split, seed))
            return real(tok, task, n, L, split=split, seed=seed)
        return build
    model = seeds.load_model(root / "train" / "full-s0", backend="chunked")
    monkeypatch.setattr(seeds.tasks, "build_task", recording("main"))
    seeds.evaluate_one(model, "full", 0, "smoke", json.loads((root / "frozen_task.json").read_text())["task"])
    (seeds.sweep_dir("smoke") / "full-s0.json.gz").unlink()
    monkeypatch.setattr(seeds.tasks, "build_task", recording("sweep"))
    seeds.sweep_job("full", 0, "smoke", seeds.read_frozen("smoke"))
    assert calls["main"] and calls["sweep"] == calls["main"][:1]
    monkeypatch.setattr(seeds.tasks, "build_task", real)
    # finished sweep jobs are not redone; gdn2 is refused by name
    monkeypatch.setattr(train_arms, "train_one", lambda *a, **k: pytest.fail("retrained a finished sweep job"))
    monkeypatch.setattr(seeds, "score", lambda *a, **k: pytest.fail("rescored a finished sweep job"))
    seeds.sweep_phase("smoke", ("full",))
    with pytest.raises(ValueError, match="gdn2 has no QED term"):
        seeds.sweep_phase("smoke", ("gdn2",))


@pytest.mark.slow
def test_notebook_executes(smoke, seed_study):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    root, _, _ = smoke
    nb = nbformat.read(ROOT / "notebooks" / "03_qed.ipynb", as_version=4)
    os.environ["QED_CHECKPOINT"] = str(root / "train" / "full-s0")
    os.environ["QED_SEEDS_REPORT"] = str(seed_study / "report")
    try:
        nbclient.NotebookClient(nb, timeout=180, kernel_name="python3",
                                resources={"metadata": {"path": str(ROOT)}}).execute()
    finally:
        os.environ.pop("QED_CHECKPOINT", None)
        os.environ.pop("QED_SEEDS_REPORT", None)
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "lambda per head" in text and "strength" in text
    assert "trained lambda per head" in text and "full-lm0.5-l0.2 - gdn2" in text   # the lambda_max comparison


# ---------------------------------------------------------------------------------------------------------------
# Hooks and forward options the suite uses instead of re-implementing the model
# ---------------------------------------------------------------------------------------------------------------


def test_rand_arm_draws_its_direction_per_layer_and_head(tokenizer):
    model = _model("rand", tokenizer)
    z = torch.stack([m.qed_z for _, m in common.qed_mixers(model)])        # (layers, heads, K)
    assert z.shape == (2, 2, 32)
    torch.testing.assert_close(z.norm(dim=-1), torch.ones(2, 2))
    flat = z.reshape(4, 32)
    gram = flat @ flat.T
    off = gram[~torch.eye(4, dtype=torch.bool)]
    assert off.abs().max() < 0.9        # four different unit vectors (equal ones would give 1)
    assert not torch.equal(z[0], z[1])  # layers differ (the bug: manual_seed(0) in every mixer gave z[0] == z[1])
    # deterministic: the same (layer, head) gives the same z in another model, whatever the global RNG did
    torch.manual_seed(123)
    again = torch.stack([m.qed_z for _, m in common.qed_mixers(_model("rand", tokenizer, seed=77))])
    assert torch.equal(z, again)


def test_logit_positions_return_exactly_the_full_logits_at_those_positions(tokenizer):
    model = _model("full", tokenizer, theta=[0.3, -0.4])
    tokens = torch.randint(4, len(tokenizer), (3, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(tokens)
        one = model(tokens, logit_positions=torch.tensor([19, 4, 0]))
        two = model(tokens, logit_positions=torch.tensor([[18, 19], [3, 4], [0, 7]]))
    torch.testing.assert_close(one, full[torch.arange(3), torch.tensor([19, 4, 0])], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(two, full[torch.arange(3)[:, None], torch.tensor([[18, 19], [3, 4], [0, 7]])],
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(common.last_logits(model, tokens, torch.tensor([19, 4, 0])), one)
    with pytest.raises(ValueError, match="logit_positions must lie in"):
        model(tokens, logit_positions=torch.tensor([20, 0, 0]))
    with pytest.raises(ValueError, match="logit_positions must have shape"):
        model(tokens, logit_positions=torch.tensor([1, 2]))


def test_lambda_study_runs_start_at_their_lambda_0():
    for run, (lm, l0) in common.LAMBDA_STUDY.items():
        s = common.run_settings(run)
        assert s["erase_arm"] == "full" and s["qed_lambda_max"] == lm
        assert lm / (1 + math.exp(-s["qed_theta_init"])) == pytest.approx(l0, rel=1e-12)
    full = common.run_settings("full")
    assert full["qed_lambda_max"] * torch.sigmoid(torch.tensor(full["qed_theta_init"])) == pytest.approx(0.0298, abs=1e-4)
    with pytest.raises(ValueError, match="run must be"):
        common.run_settings("full-lm9")


# ---------------------------------------------------------------------------------------------------------------
# Seed-level statistics (interp/stats.py)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("diffs", [[3.0, 1.5, 2.0, 0.5, 4.0], [1.0, -2.0, 0.0, 3.0, 5.0, -1.0], [-1.0, -2.0, -0.5],
                                   [0.0, 0.0, 2.0]])
def test_sign_test_matches_scipy_binomtest_and_the_closed_form(diffs):
    r = sign_test(diffs)
    d = np.asarray(diffs)
    pos, neg = int((d > 0).sum()), int((d < 0).sum())
    assert (r.n_positive, r.n_negative, r.n_zero) == (pos, neg, int((d == 0).sum()))
    assert r.p_value == pytest.approx(sps.binomtest(pos, pos + neg, 0.5).pvalue, rel=1e-12)
    m = pos + neg   # two-sided exact: 2 * P(X <= min(pos, neg)), capped at 1
    assert r.p_value == pytest.approx(min(1.0, 2 * sum(math.comb(m, i) for i in range(min(pos, neg) + 1)) / 2 ** m))
    assert sign_test([2.0] * 5).p_value == pytest.approx(2 / 32)   # 5 of 5 seeds agree: p = 0.0625, not < 0.05


@pytest.mark.parametrize("values", [[1.0, 4.0, 2.0, 8.0, 3.0], [-3.0, 0.5, 2.0], [0.0, 0.0, 1.0, 10.0, 1.0, 2.0]])
def test_seed_bootstrap_is_the_exact_bootstrap_distribution(values):
    import itertools
    x = np.asarray(values)
    ci = seed_bootstrap_ci(x)
    # brute force: all n^n ordered resamples, equally likely; numpy's inverted-cdf percentiles
    means = np.array([x[list(idx)].mean() for idx in itertools.product(range(len(x)), repeat=len(x))])
    assert ci.low == pytest.approx(np.quantile(means, 0.025, method="inverted_cdf"), abs=1e-12)
    assert ci.high == pytest.approx(np.quantile(means, 0.975, method="inverted_cdf"), abs=1e-12)
    assert ci.estimate == pytest.approx(x.mean()) and ci.method == "percentile (exact enumeration)"
    # and scipy's Monte Carlo percentile bootstrap lands near it
    mc = sps.bootstrap((x,), np.mean, n_resamples=20_000, method="percentile",
                       random_state=np.random.default_rng(0)).confidence_interval
    spread = x.max() - x.min()
    assert abs(mc.low - ci.low) < 0.08 * spread and abs(mc.high - ci.high) < 0.08 * spread


def test_seed_contrast_degenerate_cases_and_bad_input():
    same = seed_contrast([2.0, 2.0, 2.0])
    assert (same.low, same.high, same.mean, same.n_positive, same.sign_p) == (2.0, 2.0, 2.0, 3, 0.25)
    assert same.method == "degenerate (zero variance)"
    many = seed_bootstrap_ci(np.arange(12.0))      # above the enumeration limit: scipy, seeded
    assert many.method == "percentile" and many.low < 5.5 < many.high
    with pytest.raises(ValueError, match="one-dimensional"):
        seed_contrast([[1.0, 2.0]])
    with pytest.raises(ValueError, match="empty"):
        sign_test([])


# ---------------------------------------------------------------------------------------------------------------
# Tasks
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def suite_tok():
    return train_arms.suite_tokenizer()


@pytest.mark.parametrize("task", tasks.TASKS)
def test_task_generator_is_deterministic_exact_and_states_its_answer(task, suite_tok):
    a = tasks.build_task(suite_tok, task, 12, 512, split="eval", seed=3)
    b = tasks.build_task(suite_tok, task, 12, 512, split="eval", seed=3)
    c = tasks.build_task(suite_tok, task, 12, 512, split="eval", seed=4)
    assert torch.equal(a.input_ids, b.input_ids) and a.items == b.items
    assert not torch.equal(a.input_ids, c.input_ids)
    assert a.input_ids.shape == (12, 512) and int(a.input_ids.min()) > 3   # no pad/unk/bos/eos
    P = tasks.RETRIEVAL[task].value_tokens if task in tasks.RETRIEVAL else 1
    assert a.positions.shape == (12, P) and (a.positions[:, -1] == 511).all()
    for row, pos, ans, cand in zip(a.input_ids, a.positions, a.answer_ids, a.candidate_mask):
        # teacher forcing: every answer token but the last is already in the input, right after its position
        assert torch.equal(row[pos[1:]], ans[:-1])
        # the answer is stated in the context (before the teacher-forced answer tokens)
        text = row[: 512 - (P - 1)].tolist()
        hits = sum(text[i:i + P] == ans.tolist() for i in range(len(text) - P + 1))
        assert hits >= 1
        assert bool(cand[ans].all()) and int(cand.sum()) >= 8
    if task in tasks.RETRIEVAL:      # needles: the queried one plus its distractors
        spec = tasks.RETRIEVAL[task]
        magic = tasks._vocab(suite_tok).ids("magic")[0]
        assert ((a.input_ids == magic).sum(-1) == spec.needles + 2).all()   # + the query's two mentions
    # a perfect scorer is right everywhere, a wrong one nowhere
    V = len(suite_tok)
    logits = torch.zeros(12, P, V)
    logits.scatter_(2, a.answer_ids[..., None], 1.0)
    assert a.correct(logits).all()
    assert not a.correct(-logits).any()


def test_dev_and_eval_items_are_disjoint_and_follow_the_split_hash(suite_tok):
    for task in ("mk4", "sniah3", "doc", "qa"):
        dev = tasks.build_task(suite_tok, task, 150, 256, split="dev", seed=0)
        ev = tasks.build_task(suite_tok, task, 150, 256, split="eval", seed=0)
        assert not set(dev.items) & set(ev.items)
        assert all(tasks.item_split(k, v) == "dev" for k, v in dev.items)
        assert all(tasks.item_split(k, v) == "eval" for k, v in ev.items)
        rows_dev = {tuple(r) for r in dev.input_ids.tolist()}
        assert not rows_dev & {tuple(r) for r in ev.input_ids.tolist()}
    shares = pd.Series([tasks.item_split(k, [v]) for k in tasks.KEY_NAMES for v in tasks.NUMBER_WORDS]).value_counts(
        normalize=True)
    assert shares["dev"] == pytest.approx(0.1, abs=0.02) and shares["eval"] == pytest.approx(0.2, abs=0.02)
    with pytest.raises(ValueError, match="too short"):
        tasks.build_task(suite_tok, "mk8", 2, 64)
    with pytest.raises(ValueError, match="task must be one of"):
        tasks.build_task(suite_tok, "niah9", 2, 256)


def test_every_training_task_fits_from_its_minimum_length(suite_tok):
    for task, L in train_arms.TRAIN_MIN_LENGTH.items():
        tasks.build_task(suite_tok, task, 4, L, split="train", seed=1)
    assert set(train_arms.TRAIN_MIX) == set(tasks.TASKS)


# ---------------------------------------------------------------------------------------------------------------
# Training resumes; the seed study's choices
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.slow  # end to end
def test_interrupted_training_resumes_to_the_same_model(tmp_path, monkeypatch):
    monkeypatch.setattr(train_arms, "RESUME_EVERY", 2)
    straight = train_arms.train_one("full", 0, 5, tmp_path / "a", smoke=True, log_every=0, stage_lengths=(32, 256))
    real, calls = train_arms.batch_losses, []

    def dies_at_step_3(*a, **k):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt("killed")
        return real(*a, **k)

    monkeypatch.setattr(train_arms, "batch_losses", dies_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        train_arms.train_one("full", 0, 5, tmp_path / "b", smoke=True, log_every=0, stage_lengths=(32, 256))
    assert (tmp_path / "b" / "resume.pt").is_file()
    monkeypatch.setattr(train_arms, "batch_losses", real)
    resumed = train_arms.train_one("full", 0, 5, tmp_path / "b", smoke=True, log_every=0, stage_lengths=(32, 256))
    assert not (tmp_path / "b" / "resume.pt").exists()
    a, b = _load(tmp_path / "a").state_dict(), _load(tmp_path / "b").state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    assert resumed["final"] == straight["final"]
    log = pd.read_csv(tmp_path / "b" / "train_log.csv")
    assert list(log["step"]) == list(range(5))


def test_step_budget_and_task_are_chosen_by_the_stated_rules():
    log = pd.DataFrame({"task_acc": [0.1] * 100 + [0.5] * 100 + [0.8] * 100 + [0.81] * 100})
    steps, curve = seeds.curve_steps(log, (100, 200, 300), 400)
    assert steps == 300 and curve["task_acc_end"] == pytest.approx(0.81)
    dev = pd.DataFrame({"task": ["sniah1"] * 3 + ["mk2"] * 3 + ["mk4"] * 3 + ["mk8"] * 3,
                        "accuracy": [0.5, 0.5, 0.5, 0.95, 0.9, 0.7, 0.85, 0.6, 0.3, 0.4, 0.15, 0.1]})
    assert seeds.choose_task(dev) == ("mk4", True)
    assert seeds.choose_task(dev[dev["task"] != "mk4"]) == ("mk2", False)
