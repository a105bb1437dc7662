"""The capability gate (App. F.2) and the load/gap protocol (§4.2, Fig. 7a-b): the gate refuses a condition under
its preset threshold, computed against hand-made logits; points that cannot be evaluated are NaN, never 0; the load
curve holds the total length fixed."""
import numpy as np
import pytest
import torch

from helpers_models import tiny_model
from recurscope.interp.data import TEMPLATES, build_pairs
from recurscope.interp.data.words import NATURAL_TEMPLATES
from recurscope.interp.protocols import _layouts, capacity, gate

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
    total = _layouts.bare_length(word_tok, k4) + 20          # K=4 fits with 20 filler tokens, K=16 cannot
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
    assert capacity.load_layout(32).layout.presentations == 1 and capacity.load_layout(16).layout.presentations == 3
    assert capacity.load_layout(32).layout.gap_tokens == 4 and capacity.load_layout(16).layout.gap_tokens == 24
    # below the high load, the given layout's presentations and template; above, one presentation of each fact
    paper = capacity.load_layout(4, "paper")
    assert (paper.layout.template, paper.layout.presentations, paper.layout.n_facts) == ("key_value", 3, 4)
    assert capacity.load_layout(64, "paper").layout.template == "key_value"


# ---- write-key overlap (Fig. 7c) ------------------------------------------------------------------------------

def test_aligned_and_orthogonal_keys_keep_the_norm():
    from recurscope.interp.protocols import overlap

    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 5, 3, 4, generator=gen)
    d = torch.nn.functional.normalize(torch.randn(2, 3, 4, generator=gen), dim=-1)
    for mode in ("aligned", "orthogonal"):
        new = overlap.replace_keys(keys, d, mode)
        torch.testing.assert_close(new.norm(dim=-1), keys.norm(dim=-1))
    cos = torch.nn.functional.cosine_similarity(overlap.replace_keys(keys, d, "aligned"), d[:, None], dim=-1)
    torch.testing.assert_close(cos, torch.ones_like(cos))
    dot = (overlap.replace_keys(keys, d, "orthogonal") * d[:, None]).sum(-1)
    torch.testing.assert_close(dot, torch.zeros_like(dot), atol=1e-5, rtol=0)


def test_interfering_spans_are_other_facts_after_the_target(word_tok):
    from recurscope.interp.protocols import overlap

    p = build_pairs(word_tok, split="heldout", n_sources=3, **SMALL)
    spans = overlap.interfering_spans(p)
    for i in range(len(p)):
        t = int(p.target_fact[i])
        first_end = int(p.fact_spans[i, t, :, 1].min())
        mine = {tuple(s) for s in p.fact_spans[i, t].tolist()}
        got = [tuple(s) for s in spans[i].tolist() if s[0] >= 0]
        assert got and all(s[0] >= first_end and s not in mine for s in got)
        expect = [tuple(s) for f in range(4) if f != t for s in p.fact_spans[i, f].tolist() if s[0] >= first_end]
        assert sorted(got) == sorted(expect)


def test_aligned_write_keeps_the_original_key_in_the_erase(word_tok):
    """On a GDN head the patched run's write key has the clean key's norm and the target direction on the interfering
    positions, while the erase vector of that layer (built from the original key) is unchanged everywhere."""
    from recurscope.hooks.patches import patch_hooks
    from recurscope.hooks.points import hook_name
    from recurscope.interp import interventions as iv
    from recurscope.interp.protocols import overlap

    m = tiny_model("gdn", layers=2, vocab_size=len(word_tok))
    p = build_pairs(word_tok, split="heldout", n_sources=2, **SMALL)
    rows = torch.arange(len(p))
    T = p.recipient_ids.shape[1]
    pos_mask = iv.span_mask(overlap.interfering_spans(p), T)
    patches = overlap.overlap_patches(m, p, rows, (1, 0), "aligned", pos_mask, torch.device("cpu"))
    names = [hook_name("hook_write_key", 1), hook_name("hook_erase", 1)]
    clean, patched = iv.Collector(names), iv.Collector(names)
    with torch.no_grad():
        with m.hooks(fwd_hooks=clean.hooks()):
            m(p.recipient_ids)
        with m.hooks(fwd_hooks=patch_hooks(m, patches) + patched.hooks()):
            m(p.recipient_ids)
    k0, k1 = clean.values[names[0]][..., 0, :], patched.values[names[0]][..., 0, :]
    torch.testing.assert_close(k1.norm(dim=-1), k0.norm(dim=-1))
    assert not torch.allclose(k1[pos_mask], k0[pos_mask])
    torch.testing.assert_close(k1[~pos_mask], k0[~pos_mask])
    torch.testing.assert_close(patched.values[names[1]], clean.values[names[1]])


def test_capacity_refuses_the_shift_of_a_condition_the_gate_refuses(word_tok, model):
    """An untrained model is near chance, so a 0.99 gate refuses every condition: recall is still reported, the
    state-swap shift is NaN with the gate's reason."""
    total = _layouts.bare_length(word_tok, capacity.load_layout(1)) + 8
    r = capacity.run_capacity(model, (0, 0), loads=(1,), gaps=(), total_length=total, n_sources=3, batch_size=8,
                              n_resamples=100, gate_threshold=0.99)
    s = r.summary
    assert s[s["metric"] == "clean_correct"]["estimate"].notna().all()
    shift = s[s["metric"] == "donor_margin_shift"]
    assert shift["estimate"].isna().all() and "refused" in shift["reason"].iloc[0]
