"""Tests for experiments/qed: each arm's erase vector against the paper's formula on the mixer's own cached q, k and
b; the 10x theta learning-rate group; strength 0 equals GDN-2 with the same weights; McNemar against scipy and closed
forms; a smoke train + evaluate run; and the 03_qed notebook executed end to end."""
from __future__ import annotations

import math
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from scipy import stats as sps

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from recurscope import kernels  # noqa: E402
from experiments.qed import common, evaluate, train_arms  # noqa: E402
from recurscope.interp.data import build_word_tokenizer  # noqa: E402
from recurscope.interp.models import RecurrentLM  # noqa: E402
from recurscope.interp.stats import mcnemar_exact  # noqa: E402


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
        b = common.erase_gate_from_block(model.blocks[layer], cache[f"blocks.{layer}.hook_resid_pre"])
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
        with qed.qed_strength(0.0):
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


@pytest.mark.slow
def test_notebook_executes(smoke):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    root, _, _ = smoke
    nb = nbformat.read(ROOT / "notebooks" / "03_qed.ipynb", as_version=4)
    os.environ["QED_CHECKPOINT"] = str(root / "train" / "full-s0")
    try:
        nbclient.NotebookClient(nb, timeout=180, kernel_name="python3",
                                resources={"metadata": {"path": str(ROOT)}}).execute()
    finally:
        os.environ.pop("QED_CHECKPOINT", None)
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "lambda per head" in text and "strength" in text
