"""The capability gate (App. F.2) and the load/gap protocol (§4.2, Fig. 7a-b): the gate refuses a condition under
its preset threshold, computed against hand-made logits; points that cannot be evaluated are NaN, never 0; the load
curve holds the total length fixed."""
import numpy as np
import pytest
import torch

from helpers_models import tiny_model
from recurscope.interp.data import TEMPLATES, build_pairs
from recurscope.interp.data.words import NATURAL_TEMPLATES
from recurscope.interp.protocols import capacity, gate

SMALL = dict(n_facts=4, presentations=2, filler_tokens=12, gap_tokens=4)


@pytest.fixture(scope="module")
def model(word_tok):
    m = tiny_model("gla_conv", layers=2, vocab_size=len(word_tok))
    m.tokenizer = word_tok
    return m


def _clean(pairs, recipient_right, donor_right):
    """Candidate logits where the answer wins exactly on the rows marked right."""
    n, C = pairs.candidate_ids.shape
    out = {}
    for side, idx, right in (("recipient", pairs.recipient_answer_index, recipient_right),
                             ("donor", pairs.donor_answer_index, donor_right)):
        z = torch.zeros(n, C)
        z[torch.arange(n), idx] = torch.where(torch.as_tensor(right), 1.0, -1.0)
        out[side] = z
    return out


def test_gate_refuses_below_its_threshold_and_passes_at_or_above(word_tok, model):
    p = build_pairs(word_tok, split="heldout", n_sources=8, **SMALL)
    rec = np.ones(len(p), bool)
    don = np.arange(len(p)) % 4 != 0                       # donor right on 6 of 8 sources: 75%
    g = gate.capability_gate(model, p, threshold=0.8, clean=_clean(p, rec, don), n_resamples=200)
    assert g.recipient.estimate == 1.0 and g.donor.estimate == pytest.approx(0.75)
    assert not g.passed
    with pytest.raises(gate.CapabilityGateError, match="refused"):
        gate.require_capability(g)
    ok = gate.capability_gate(model, p, threshold=0.75, clean=_clean(p, rec, don), n_resamples=200)
    assert ok.passed and gate.require_capability(ok) is ok


def test_gate_threshold_must_be_a_preset_fraction(word_tok, model):
    p = build_pairs(word_tok, split="heldout", n_sources=2, **SMALL)
    with pytest.raises(ValueError, match="threshold must be a fraction"):
        gate.capability_gate(model, p, threshold=80)


def test_gate_on_a_real_forward_matches_clean_recall(word_tok, model):
    from recurscope.interp import interventions as iv

    p = build_pairs(word_tok, split="heldout", n_sources=3, template="natural_lives", **SMALL)
    clean = iv.clean_run(model, p, batch_size=8)
    g = gate.capability_gate(model, p, threshold=0.5, n_resamples=200)
    expect = (clean["recipient"].argmax(1) == p.recipient_answer_index).float().mean().item()
    assert g.recipient.estimate == pytest.approx(expect)


def test_natural_template_is_separate_from_the_default_templates(word_tok):
    assert set(NATURAL_TEMPLATES).isdisjoint(TEMPLATES)
    p = build_pairs(word_tok, split="heldout", n_sources=1, template="natural_lives", **SMALL)
    assert "lives there" in word_tok.decode(p.recipient_ids[0])


def test_load_curve_keeps_total_length_and_leaves_unevaluable_points_nan(word_tok, model):
    k4 = capacity.load_layout(4)
    total = capacity._bare_length(word_tok, k4) + 20          # K=4 fits with 20 filler tokens, K=16 cannot
    assert capacity.fixed_length_filler(word_tok, k4, total) == 20
    r = capacity.run_capacity(model, (0, 0), loads=(1, 4, 16), gaps=(8,), total_length=total, n_sources=2,
                              batch_size=8, n_resamples=100)
    s = r.summary
    k16 = s[(s["series"] == "load") & (s["x"] == 16)]
    assert len(k16) == 2 and k16["estimate"].isna().all() and (k16["n_sources"] == 0).all()
    assert "fixed total length" in k16["reason"].iloc[0]
    evaluated = r.rows[r.rows["source"].notna() & r.rows["arm"].str.startswith("load:")]
    assert set(evaluated["arm"]) == {"load:1", "load:4"} and (evaluated["length"] == total).all()
    assert s[(s["series"] == "load") & (s["x"] == 1)]["estimate"].notna().all()
    assert "| load | 16 | – | – |" in r.section


def test_high_load_layout_presents_each_fact_once():
    assert capacity.load_layout(32)["presentations"] == 1 and capacity.load_layout(16)["presentations"] == 3
