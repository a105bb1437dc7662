"""Invariants of the protocols in interp.protocols and of the donor-specific metric, on tiny random models and
hand-made logits; each compares against an independent reference or an identity that holds exactly."""
import numpy as np
import pandas as pd
import pytest
import torch

from helpers_models import tiny_model
from recurscope.interp import interventions as iv
from recurscope.interp import metrics, stats
from recurscope.interp.data import build_multifact_pairs, build_neutral_pairs, build_pairs
from recurscope.interp.protocols import coupling, headscan, heads, lens, neutral, selectivity

SMALL = dict(n_facts=4, presentations=2, filler_tokens=12, gap_tokens=4)


@pytest.fixture(scope="module")
def model(word_tok):
    m = tiny_model("gla_conv", layers=2, vocab_size=len(word_tok))
    m.tokenizer = word_tok
    return m


@pytest.fixture(scope="module")
def multi(word_tok):
    return build_multifact_pairs(word_tok, split="heldout", n_sources=3, **SMALL)


# ---- the donor-specific metric -------------------------------------------------------------------------------

def test_donor_specific_and_distractor_shifts_add_up_to_the_margin_shift(word_tok):
    p = build_pairs(word_tok, split="dev", n_sources=4, **SMALL)
    gen = torch.Generator().manual_seed(0)
    clean, new = torch.randn(len(p), 4, generator=gen), torch.randn(len(p), 4, generator=gen)
    f = metrics.example_metrics(p, logits=new, clean=clean)
    np.testing.assert_allclose(f.donor_specific_shift + f.distractor_shift, f.donor_margin_shift, atol=1e-12)


def test_losing_confidence_in_the_answer_is_not_donor_specific(word_tok):
    """A drop of the recipient's logit alone raises the donor margin but leaves the donor-specific shift at 0."""
    p = build_pairs(word_tok, split="dev", n_sources=3, **SMALL)
    clean = torch.zeros(len(p), 4)
    clean[torch.arange(len(p)), p.recipient_answer_index] = 3.0
    new = clean.clone()
    new[torch.arange(len(p)), p.recipient_answer_index] = 1.0
    f = metrics.example_metrics(p, logits=new, clean=clean)
    np.testing.assert_allclose(f.donor_margin_shift, 2.0)
    np.testing.assert_allclose(f.donor_specific_shift, 0.0)
    np.testing.assert_allclose(f.distractor_shift, 2.0)
    new[torch.arange(len(p)), p.donor_answer_index] += 0.5       # now the donor gains in particular
    np.testing.assert_allclose(metrics.example_metrics(p, logits=new, clean=clean).donor_specific_shift, 0.5)


def test_break_rate_counts_only_nontargets_that_were_correct(word_tok, multi):
    n = len(multi)
    r = multi.recipient_answer_index
    clean = torch.zeros(n, 4)
    clean[torch.arange(n), r] = 2.0
    nt = torch.nonzero(~multi.is_target)[:, 0]
    wrong_before = nt[:2]
    clean[wrong_before, r[wrong_before]] = -2.0                   # two non-targets wrong before
    new = clean.clone()
    new[nt, r[nt]] = -3.0                                        # every non-target wrong after
    f = metrics.example_metrics(multi, logits=new, clean=clean)
    brk = f.loc[~f.is_target, "nontarget_break"]
    assert brk.notna().sum() == len(nt) - 2 and brk.sum() == len(nt) - 2
    assert f.loc[wrong_before.numpy(), "nontarget_break"].isna().all()
    assert f.loc[~f.is_target, "nontarget_margin_change"].notna().all()


def test_source_ratio_interval():
    rng = np.random.default_rng(0)
    a, src = rng.random(40) + 1, np.repeat(np.arange(10), 4)
    same = stats.source_ratio_ci(a, a, src, n_resamples=200)
    assert same.estimate == same.low == same.high == 1.0
    half = stats.source_ratio_ci(a / 2, a, src, n_resamples=200)
    assert half.estimate == pytest.approx(0.5) and half.low == pytest.approx(0.5) and half.high == pytest.approx(0.5)
    # no denominator (the reuse on a random model crashed here): undefined, never a number, never a crash
    none = stats.source_ratio_ci(a, np.zeros(40), src, n_resamples=200)
    assert np.isnan([none.estimate, none.low, none.high]).all() and none.method.startswith("undefined")


# ---- coupling ------------------------------------------------------------------------------------------------

def test_parallel_and_orthogonal_parts_sum_to_delta_a_and_are_orthogonal():
    gen = torch.Generator().manual_seed(1)
    da, db = torch.randn(5, 6, 7, generator=gen), torch.randn(5, 6, 7, generator=gen)
    db[4] = 0.0                                                  # no B change: everything is orthogonal
    par, orth = coupling.split_parallel(da, db)
    torch.testing.assert_close(par + orth, da.double(), atol=1e-12, rtol=0)
    inner = (par * orth).flatten(1).sum(1)
    torch.testing.assert_close(inner, torch.zeros(5, dtype=torch.float64), atol=1e-10, rtol=0)
    # the parallel part is a multiple of delta_b
    cos = coupling._frobenius_cos(par[:4], db[:4]).abs()
    torch.testing.assert_close(cos, torch.ones(4, dtype=torch.float64), atol=1e-10, rtol=0)
    assert float(par[4].abs().max()) == 0.0


def test_coupling_full_edit_equals_a_state_swap(model, multi):
    """Adding Δ_A = S(donor) - S(recipient) to the recipient's state is the state swap: B's margin change under the
    full edit must match the state swap's non-target margin change from interventions.state_swap."""
    r = coupling.run_coupling(model, multi, head=(0, 1), n_resamples=200)
    full = r.rows[r.rows.arm == "full"].set_index("row")["margin_change_b"].sort_index()
    swap = metrics.example_metrics(multi, iv.state_swap(model, multi, [(0, 1)]))
    ref = swap.loc[full.index, "nontarget_margin_change"]
    np.testing.assert_allclose(full.to_numpy(), ref.to_numpy(), atol=1e-4)
    norms = r.rows.pivot_table(index=["row"], columns="arm", values="norm_edit")
    np.testing.assert_allclose(norms["random_parallel"], norms["parallel"], rtol=1e-9)
    np.testing.assert_allclose(norms["random_orthogonal"], norms["orthogonal"], rtol=1e-9)
    assert "Reading" in r.section


# ---- selectivity and neutral ---------------------------------------------------------------------------------

def test_selectivity_rows_and_counts(model, multi):
    r = selectivity.run_selectivity(model, multi, head=(0, 1), arms=("state_swap", "random_update"),
                                    n_resamples=200)
    swap = r.rows[r.rows.arm == "state_swap"]
    eligible = int(((~swap.is_target) & (swap.clean_correct == 1)).sum())
    counts = {c["arm"]: c for c in r.info["break_counts"]}
    assert counts["state_swap"]["eligible"] == eligible if eligible else "state_swap" not in counts
    est = r.summary.set_index(["arm", "metric"])["estimate"]
    per_source = swap[swap.is_target].groupby("source")["donor_answer"].mean().mean()
    assert est[("state_swap", "donor_answer")] == pytest.approx(per_source)
    assert "### Reading" in r.section and "89.1%" in r.section


def test_neutral_accuracy_columns(model, word_tok):
    p = build_neutral_pairs(word_tok, split="heldout", n_sources=3, queries="all", **SMALL)
    r = neutral.run_neutral(model, p, head=(0, 1), n_resamples=200)
    swap = r.rows[r.rows.arm == "state_swap"]
    t = swap.is_target.astype(bool)
    np.testing.assert_array_equal(swap.loc[t, "target_accuracy"], swap.loc[t, "correct"])
    assert swap.loc[t, "others_accuracy_change"].isna().all()
    np.testing.assert_array_equal(swap.loc[~t, "others_accuracy_change"],
                                  swap.loc[~t, "correct"] - swap.loc[~t, "clean_correct"])
    assert "91.8%" in r.section


# ---- head structure ------------------------------------------------------------------------------------------

def test_recovery_of_all_heads_is_one_and_joint_runs_are_real(model, word_tok):
    p = build_pairs(word_tok, split="heldout", n_sources=3, **SMALL)
    ranking = pd.DataFrame({"layer": [0, 1, 0, 1], "head": [1, 0, 0, 1], "J": [4.0, 3.0, 2.0, 1.0]})
    r = heads.run_heads(model, p, ranking=ranking, n_resamples=200)
    rec = r.summary[(r.summary.analysis == "recovery") & (r.summary.metric == "recovery")].set_index("k")
    assert list(rec.index) == [1, 2, 4]
    assert rec.loc[4, "estimate"] == rec.loc[4, "low"] == rec.loc[4, "high"] == 1.0
    # the joint top-1 swap is the single-head state swap of the top head
    top1 = r.rows[r.rows.arm == "swap:top1"].sort_values("row")["shift"].to_numpy()
    ref = metrics.example_metrics(p, iv.state_swap(model, p, [(0, 1)]))
    np.testing.assert_allclose(top1, ref[ref.is_target].donor_margin_shift.to_numpy(), atol=1e-6)
    assert heads.top_k_sizes(1) == [1] and heads.top_k_sizes(6) == [1, 2, 4, 6] and heads.top_k_sizes(8) == [1, 2, 4, 8]


def test_a_head_with_zero_writes_has_zero_write_scan_shift(word_tok):
    m = tiny_model("gla_conv", layers=2, vocab_size=len(word_tok), seed=3)
    m.tokenizer = word_tok

    def no_write(ws, hook):
        ws = ws.clone()
        ws[:, :, 1] = 0.0
        return ws
    m.add_hook("blocks.0.mixer.hook_write_scale", no_write, is_permanent=True)
    p = build_pairs(word_tok, split="heldout", n_sources=3, **SMALL)
    rows = headscan.write_scan(m, p)
    per_head = rows.groupby(["layer", "head"])["shift"].apply(lambda s: s.abs().max())
    assert per_head[(0, 1)] == 0.0
    assert per_head.drop((0, 1)).min() > 1e-6          # the other heads' writes do move the margin
    r = headscan.run_headscan(m, p, head=(0, 0), n_resamples=200)
    sp = r.summary.set_index(["scan", "metric"])
    assert sp.loc[("write", "fraction_above_threshold"), "n_units"] == 4
    m.reset_hooks(including_permanent=True)


# ---- logit lens ----------------------------------------------------------------------------------------------

def test_lens_after_the_last_layer_is_the_model_itself(model, word_tok):
    p = build_pairs(word_tok, split="heldout", n_sources=4, **SMALL)
    rows = lens.lens_rows(model, p)
    last = rows[(rows.layer == 1) & (rows.side == "after")]
    np.testing.assert_array_equal(last["correct"], last["final_correct"])
    # before layer l + 1 is after layer l: the same residual
    before1 = rows[(rows.layer == 1) & (rows.side == "before")]["correct"].to_numpy()
    after0 = rows[(rows.layer == 0) & (rows.side == "after")]["correct"].to_numpy()
    np.testing.assert_array_equal(before1, after0)
    assert len(last) == int(p.is_target.sum())


# ---- the report's control verdict ------------------------------------------------------------------------------

def test_report_judges_controls_on_the_donor_margin_shift_with_the_shared_verdict():
    """A control whose donor-margin shift is large is not near zero, however small its donor-specific shift; the
    report's line is the verdict function's own sentence (interp.verdicts.control_verdict)."""
    from recurscope.interp import verdicts
    from recurscope.interp.report import LABELS, _reading

    def row(arm, metric, est, low, high, n=16):
        return {"intervention": arm, "metric": metric, "estimate": est, "low": low, "high": high, "n_sources": n}
    summary = pd.DataFrame([
        row("state_swap", "donor_margin_shift", 17.0, 15.0, 19.0), row("state_swap", "clean_accuracy", 1, 1, 1),
        row("donor_write", "donor_margin_shift", 16.0, 14.0, 18.0),
        # the rank-one random write of the issue: a large margin shift, a donor-specific shift near zero
        row("random_write", "donor_margin_shift", 7.66, 6.1, 9.2),
        row("random_write", "donor_specific_shift", 0.02, -0.2, 0.25),
        # a control whose margin shift is inside the noise, with a donor-specific shift that is not
        row("random_update", "donor_margin_shift", 0.1, -0.2, 0.4),
        row("random_update", "donor_specific_shift", 0.5, 0.3, 0.7)])
    lines = _reading(summary)
    m = {arm: verdicts.measure_from(summary, {"intervention": arm}, "donor_margin_shift")
         for arm in ("random_write", "random_update", "state_swap", "donor_write")}
    spec = {arm: verdicts.measure_from(summary, {"intervention": arm}, "donor_specific_shift")
            for arm in ("random_write", "random_update")}
    write = verdicts.control_verdict(LABELS["random_write"], m["random_write"], spec["random_write"],
                                     m["donor_write"], f"the {LABELS['donor_write']}")
    update = verdicts.control_verdict(LABELS["random_update"], m["random_update"], spec["random_update"],
                                      m["state_swap"], f"the {LABELS['state_swap']}")
    assert write.kind == verdicts.DIFFERS and update.kind == verdicts.AGREES
    assert any(write.sentence in line for line in lines) and any(update.sentence in line for line in lines)
