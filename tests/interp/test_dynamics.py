"""Retention vs K (Fig. 8), the state-feature corrector (App. F.1) and head reuse (App. D.2): points not evaluated are
NaN, the corrector is fitted on dev sources only and never applied to one it saw, its correction is what the model's
own forward gives, and the projected output patch reduces to the output patch under the identity basis."""
import numpy as np
import pytest
import torch

from helpers_models import tiny_model
from recurscope.hooks.points import hook_name
from recurscope.interp import interventions as iv
from recurscope.interp.data import build_pairs
from recurscope.interp.data.words import TEMPLATES, VALUE_VOCABS
from recurscope.interp.protocols import _layouts, capacity, corrector, retention, reuse

SMALL = dict(n_facts=4, presentations=2, filler_tokens=12, gap_tokens=4)


@pytest.fixture(scope="module")
def model(word_tok):
    m = tiny_model("gla_conv", layers=2, vocab_size=len(word_tok))
    m.tokenizer = word_tok
    return m


# ---- retention (Fig. 8) ---------------------------------------------------------------------------------------

def test_retention_pairs_query_the_target_and_a_fixed_number_of_others(word_tok):
    layout = capacity.load_layout(8).with_(filler_tokens=8)
    p = retention.retention_pairs(word_tok, layout, n_sources=3, n_nontarget=3)
    for g in set(p.group.tolist()):
        rows = (p.group == g).nonzero()[:, 0]
        assert int(p.is_target[rows].sum()) == 1 and len(rows) == 4
        assert len(set(p.queried_fact[rows].tolist())) == 4                      # distinct facts queried
        assert all(torch.equal(p.recipient_ids[rows[0], :p.query_start[rows[0]]],
                               p.recipient_ids[r, :p.query_start[r]]) for r in rows)   # one shared context
    few = retention.retention_pairs(word_tok, capacity.load_layout(2).with_(filler_tokens=8), n_sources=2,
                                    n_nontarget=7)
    assert len(few) == 4                                                           # K - 1 = 1 other fact per pair


def test_retention_leaves_unevaluated_points_nan_with_a_reason(word_tok, model):
    total = _layouts.bare_length(word_tok, capacity.load_layout(4)) + 10    # K = 16 cannot fit
    r = retention.run_retention(model, (0, 0), loads=(1, 4, 16), total_length=total, n_sources=2, n_nontarget=2,
                                batch_size=8, n_resamples=100)
    s = r.summary
    k16 = s[s["k"] == 16]
    assert len(k16) == len(retention.ARMS) * len(retention.METRICS)
    assert k16["estimate"].isna().all() and (k16["n_sources"] == 0).all()
    assert k16["reason"].str.contains("fixed total length").all()
    k1_break = s[(s["k"] == 1) & (s["metric"] == "nontarget_break")]
    assert k1_break["estimate"].isna().all() and k1_break["reason"].str.contains("no non-target").all()
    k4 = s[(s["k"] == 4) & (s["intervention"] == "state_swap")].set_index("metric")["estimate"]
    assert k4[["clean_correct", "donor_margin_shift", "nontarget_break"]].notna().all()
    assert "| 16 | – | – | – | – | – |" in r.section
    # the break rate is the share of correct non-targets made wrong, recounted from the rows
    rows = r.rows[(r.rows["k"] == 4) & (r.rows["intervention"] == "state_swap") & ~r.rows["is_target"].astype(bool)]
    eligible = rows["clean_correct"] == 1
    counts = {(c["k"], c["intervention"]): c for c in r.info["break_counts"]}[(4, "state_swap")]
    assert counts["eligible"] == eligible.sum() and counts["breaks"] == rows.loc[eligible, "nontarget_break"].sum()


def test_retention_gate_keeps_recall_and_refuses_the_edit(word_tok, model):
    total = _layouts.bare_length(word_tok, capacity.load_layout(2)) + 8
    r = retention.run_retention(model, (0, 0), loads=(2,), total_length=total, n_sources=3, n_nontarget=1,
                                batch_size=8, n_resamples=100, gate_threshold=0.99)
    s = r.summary.set_index(["intervention", "metric"])
    assert not np.isnan(s.loc[("state_swap", "clean_correct"), "estimate"])
    for m in ("donor_margin_shift", "nontarget_break"):
        assert np.isnan(s.loc[("state_swap", m), "estimate"]) and "refused" in s.loc[("state_swap", m), "reason"]


# ---- corrector (F.1) ------------------------------------------------------------------------------------------

def test_corrector_is_fitted_on_dev_sources_only_and_refuses_them_later(word_tok, model):
    dev = build_pairs(word_tok, split="dev", n_sources=3, **SMALL)
    held = build_pairs(word_tok, split="heldout", n_sources=3, **SMALL)
    with pytest.raises(ValueError, match="dev sources only"):
        corrector.fit_corrector(model, held, (0, 1))
    fitted = corrector.fit_corrector(model, dev, (0, 1), rank=2)
    assert fitted.fit_sources == corrector.source_keys(dev) and all(k[0] == "dev" for k in fitted.fit_sources)
    feats = corrector.collect_features(model, held, [(0, 1)])
    assert fitted.delta(feats.readout[(0, 1)], held).shape == feats.resid.shape
    with pytest.raises(ValueError, match="held-out sources only"):
        fitted.delta(corrector.collect_features(model, dev, [(0, 1)]).readout[(0, 1)], dev)


@pytest.mark.parametrize("method", ["logits_and_state", "residual"])
def test_run_corrector_never_fits_on_a_heldout_source(word_tok, model, monkeypatch, method):
    seen = []
    real = corrector.fit_corrector

    def spy(model, pairs, head, **kw):
        seen.append(corrector.source_keys(pairs))
        return real(model, pairs, head, **kw)
    monkeypatch.setattr(corrector, "fit_corrector", spy)
    total = _layouts.bare_length(word_tok, capacity.load_layout(2)) + 8
    r = corrector.run_corrector(model, (0, 1), k=2, total_length=total, n_sources=3, n_fit=3, pairs_per_source=2,
                                rank=2, batch_size=8, n_resamples=100, method=method)
    assert len(seen) == 2                                                        # frozen head and control head
    evaluated = {("heldout", s) for s in r.rows["source"]}
    for keys in seen:
        assert {k[0] for k in keys} == {"dev"} and not {(k[0], k[2]) for k in keys} & evaluated
    assert r.info["shared_sources"] == 0 and set(r.rows["arm"]) == set(corrector.ARMS)
    if method == "residual":
        assert r.info["chosen"]["corrector"]["multiple"] in corrector.ALPHAS
    assert r.info["method"] == method
    counts = {c["arm"]: c for c in r.info["counts"]}["corrector"]
    assert counts["after"] - counts["before"] == counts["rescued"] - counts["broken"]


def test_corrected_logits_equal_the_hooked_forward(word_tok, model):
    """Adding delta to the last residual at the query position in a real forward gives the same candidate logits
    as the corrector's shortcut through the model's final norm and unembedding."""
    p = build_pairs(word_tok, split="heldout", n_sources=3, **SMALL)
    feats = corrector.collect_features(model, p, [(0, 1)])
    delta = torch.randn(feats.resid.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    fast = corrector.corrected_logits(model, p, feats.resid, delta)
    last = hook_name("hook_resid_post", len(model.blocks) - 1)

    def add(resid, hook):
        out = resid.clone()
        out[torch.arange(len(p)), p.query_pos] += delta.to(out.dtype)
        return out
    with torch.no_grad(), model.hooks(fwd_hooks=[(last, add)]):
        logits = model(p.recipient_ids)
    ref = iv.candidate_logits(logits[torch.arange(len(p)), p.query_pos], p.candidate_ids)
    torch.testing.assert_close(fast, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(corrector.corrected_logits(model, p, feats.resid, 0 * delta), feats.clean,
                               atol=1e-4, rtol=1e-4)


def test_ridge_rank_truncates_and_matches_least_squares():
    gen = torch.Generator().manual_seed(1)
    X = torch.randn(200, 6, generator=gen, dtype=torch.float64)
    Y = X @ torch.randn(6, 5, generator=gen, dtype=torch.float64)
    full = corrector._ridge_rank(X, Y, rank=5, ridge=1e-12)
    torch.testing.assert_close(full, torch.linalg.lstsq(X, Y).solution, atol=1e-6, rtol=1e-6)
    low = corrector._ridge_rank(X, Y, rank=2, ridge=1e-12)
    assert torch.linalg.matrix_rank(low) == 2
    fitted = corrector.Corrector((0, 0), torch.zeros(6), low, 1.0, 2)
    rand = corrector.random_corrector(fitted, seed=3)
    torch.testing.assert_close(rand.weight.norm(), low.norm())
    assert torch.linalg.matrix_rank(rand.weight) == 2 and not torch.allclose(rand.weight, low)


# ---- head reuse (D.2) ----------------------------------------------------------------------------------------

def test_formats_cover_templates_vocabularies_and_the_update_format():
    layouts = reuse.format_layouts()
    assert {k for k in layouts if k.startswith("template:")} == {f"template:{t}" for t in TEMPLATES}
    assert {k for k in layouts if k.startswith("vocab:")} == {f"vocab:{v}" for v in VALUE_VOCABS}
    assert layouts["update:is_in"]["variant"] == "update"


def test_projected_output_patch_with_the_identity_basis_is_the_output_patch(word_tok, model):
    p = build_pairs(word_tok, split="heldout", n_sources=3, **SMALL)
    ref = iv.output_patch(model, p, [(1, 0)], batch_size=4)
    V = model.cfg.state_shape()[1]
    for basis in (None, torch.eye(V, dtype=torch.float64)):
        got = reuse.projected_output_patch(model, p, (1, 0), basis, batch_size=4)
        torch.testing.assert_close(got.logits, ref.logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got.clean, ref.clean)
    # a basis orthogonal to every edit (one pair: fewer query positions than V) leaves the clean logits
    one = build_pairs(word_tok, split="heldout", n_sources=1, **SMALL)
    deltas = reuse.edit_deltas(model, one, (1, 0))
    assert torch.linalg.matrix_rank(deltas) <= V - 2
    null = torch.linalg.svd(deltas, full_matrices=True)[2][-2:].T
    got = reuse.projected_output_patch(model, one, (1, 0), null, batch_size=4)
    full = iv.output_patch(model, one, [(1, 0)])
    full_change = float((full.logits - full.clean).abs().max())
    assert full_change > 0 and float((got.logits - got.clean).abs().max()) < 0.02 * full_change


def test_fit_basis_recovers_a_planted_subspace_and_the_random_basis_is_orthonormal():
    gen = torch.Generator().manual_seed(2)
    Q = torch.linalg.qr(torch.randn(16, 4, generator=gen, dtype=torch.float64))[0]
    deltas = torch.randn(50, 4, generator=gen, dtype=torch.float64) @ Q.T
    B = reuse.fit_basis(deltas, 4)
    torch.testing.assert_close(B @ B.T, Q @ Q.T)
    R = reuse.random_basis(16, 4, seed=0)
    torch.testing.assert_close(R.T @ R, torch.eye(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="rank must be"):
        reuse.fit_basis(deltas, 17)


def test_qualified_rate_counts_only_clean_successes(word_tok, model):
    p = build_pairs(word_tok, split="heldout", n_sources=4, **SMALL)
    res = iv.donor_write(model, p, [(0, 1)], batch_size=8)
    f = reuse._metric_rows(p, res, "x")
    ok = f["clean_correct"] == 1
    assert f.loc[~ok, "qualified_donor_answer"].isna().all()
    assert (f.loc[ok, "qualified_donor_answer"] == f.loc[ok, "donor_answer"]).all()
