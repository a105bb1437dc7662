"""Each protocol Reading judges a model against the paper's number of the model's own family (GLA or GDN,
verdicts.paper_family), and makes no comparison for a family the paper did not measure (RWKV-7, Mamba-2): checked on
constructed results whose verdict differs between the two families' numbers."""
from types import SimpleNamespace

import pandas as pd
import pytest

from recurscope.interp import verdicts as V
from recurscope.interp.verdicts import GDN, GLA, Claim, Measure


def kinds(reading) -> list[str]:
    return [item.kind for item in reading if isinstance(item, V.Verdict)]


def _rows(rows, n=16):
    return pd.DataFrame([{"n_sources": n, **r} for r in rows])


def _r(metric, est, low, high, **where):
    return {"metric": metric, "estimate": est, "low": low, "high": high, **where}


OTHER = "rwkv7"      # a family the paper did not measure


# ---- the family map ---------------------------------------------------------------------------------------------

def _spec(name):
    from recurscope.interp.bridge.families import bridge_family
    from recurscope.interp.models.families import FAMILIES

    return FAMILIES[name] if name in FAMILIES else bridge_family(name).spec


@pytest.mark.parametrize("name, family", [("gla", GLA), ("gated_deltanet", GDN), ("gated_deltanet2", GDN),
                                          ("qwen3_5", GDN), ("qwen3_next", GDN), ("olmo_hybrid", GDN),
                                          ("kimi_linear", GDN), ("rwkv7", "rwkv7"), ("mamba2", "mamba2"),
                                          ("nemotron_h", "nemotron_h")])
def test_paper_family_of_a_family_spec_and_of_a_model(name, family):
    """The fact lives in each family's spec (FamilySpec.paper_family), native or bridged."""
    spec = _spec(name)
    assert V.paper_family(spec) == family
    assert V.paper_family(SimpleNamespace(family=spec)) == family


def test_a_family_without_a_paper_family_is_named_by_itself():
    assert V.paper_family(SimpleNamespace(family=SimpleNamespace(name="toy"))) == "toy"


def test_every_native_family_maps_to_gla_gdn_or_itself():
    from recurscope.interp.models.families import FAMILIES

    got = {name: V.paper_family(spec) for name, spec in FAMILIES.items()}
    assert got == {"gla": GLA, "gated_deltanet": GDN, "gated_deltanet2": GDN, "mamba2": "mamba2", "rwkv7": "rwkv7"}


@pytest.mark.parametrize("model, family", [("tiny-gla", GLA), ("tiny-gdn-hybrid", GDN), ("tiny-qed", GDN),
                                           pytest.param("tiny-qwen35", GDN, marks=pytest.mark.slow)])
def test_bundled_models_map_to_their_paper_family(model, family):
    from recurscope.interp.loading import load_model

    assert V.paper_family(load_model(model)) == family


def test_paper_family_refuses_what_has_no_family():
    with pytest.raises(ValueError, match="model family"):
        V.paper_family(3)
    with pytest.raises(ValueError, match="model family"):
        V.paper_family("gla")   # a bare name: its spec (FAMILIES, the bridge's adapters) holds the fact


def test_judge_family_picks_the_claim_and_compares_nothing_for_another_family():
    m = Measure(0.149, 0.1, 0.2, 16, "ratio")
    claims = {GLA: Claim.equals(0.173), GDN: Claim.equals(0.149)}
    assert V.judge_family(m, GDN, claims, "rho").kind == V.AGREES
    assert V.judge_family(Measure(0.149, 0.12, 0.16, 16, "ratio"), GLA, claims, "rho").kind == V.SAME_SIGN
    other = V.judge_family(m, OTHER, claims, "rho", "GLA 0.173, GDN 0.149")
    assert other.kind == V.NOT_COMPARED and "rwkv7" in other.sentence and "GLA 0.173, GDN 0.149" in other.sentence
    assert m.text() in other.sentence


def test_an_effect_claim_needs_the_interval_to_exclude_zero():
    assert V.judge(Measure(0.01, 0.0, 0.02, 16, "pct"), Claim.effect(0.0142), "x").kind == V.NO_EVIDENCE
    assert V.judge(Measure(0.01, 0.0, 0.05, 16, "pct"), Claim.effect(0.0142), "x").kind == V.NOT_INFORMATIVE
    assert V.judge(Measure(0.02, 0.01, 0.05, 16, "pct"), Claim.effect(0.0142), "x").kind == V.AGREES
    assert V.judge(Measure(0.1, 0.05, 0.15, 16, "pct"), Claim.effect(0.0142), "x").kind == V.DIFFERS
    assert V.judge(Measure(0.1, 0.05, 0.15, 16, "pp"), Claim.effect(0.0142), "x").kind == V.SAME_SIGN


# ---- each Reading's family choice ---------------------------------------------------------------------------------

def test_selectivity_reading_uses_the_family_rate():
    from recurscope.interp.protocols import selectivity

    # 85% [80, 90]: holds GLA's 89.1%, lies above GDN's 61.3-71.9%
    s = _rows([_r("donor_answer", 0.85, 0.80, 0.90, arm="state_swap"),
               _r("pooled_break_rate", 0.005, 0.0045, 0.0052, arm="state_swap")])   # GDN's 0.41-0.56%, not 1.42%
    assert kinds(selectivity.reading(s, family=GLA)) == [V.AGREES, V.DIFFERS]
    assert kinds(selectivity.reading(s, family=GDN)) == [V.DIFFERS, V.AGREES]
    assert kinds(selectivity.reading(s, family=OTHER)) == [V.NOT_COMPARED] * 2


def test_headscan_reading_uses_the_family_spearman_and_count():
    from recurscope.interp.protocols import headscan

    s = _rows([_r("frozen_head_rank", 1, 1, 1, scan="write"), _r("frozen_head_rank", 1, 1, 1, scan="read"),
               _r("joint_fraction_above_threshold", 0.03, 0.02, 0.04, scan="both"),      # GDN's 3.1%, not GLA's 1.0%
               _r("spearman", 0.15, 0.140, 0.160, scan="write_vs_read")])                # GDN's 0.149, not 0.173
    assert kinds(headscan.reading(s, 96, family=GLA)) == [V.AGREES, V.AGREES, V.DIFFERS, V.SAME_SIGN]
    assert kinds(headscan.reading(s, 96, family=GDN)) == [V.AGREES] * 4
    assert kinds(headscan.reading(s, 96, family=OTHER)) == [V.NOT_COMPARED] * 4


def test_reuse_reading_uses_gla_floor_or_gdn_range():
    from recurscope.interp.protocols import reuse

    s = _rows([_r("qualified_donor_answer", 0.6, 0.5, 0.7, part="formats", arm="template:is_in")])
    info = {"formats": ["template:is_in"], "rank": 4}
    assert kinds(reuse.reading(s, {**info, "family": GLA}))[0] == V.DIFFERS        # under GLA's 89.7% floor
    assert kinds(reuse.reading(s, {**info, "family": GDN}))[0] == V.AGREES         # inside GDN's 46.8-91.9%
    assert kinds(reuse.reading(s, {**info, "family": OTHER}))[0] == V.NOT_COMPARED


def test_corrector_reading_uses_the_family_gain():
    from recurscope.interp.protocols import corrector

    s = _rows([_r("accuracy_change", 0.015, 0.005, 0.03, arm="corrector"),
               _r("accuracy_change", 0.0, -0.01, 0.01, arm="random_map"),
               _r("accuracy_change", 0.0, -0.01, 0.01, arm="control_head")])
    info = {"method": "logits_and_state"}
    # a gain of +1.5 pp against GLA's +28.1 pp: the sign, not the size; the controls have no paper number
    assert kinds(corrector.reading(s, {**info, "family": GLA})) == [V.SAME_SIGN, V.NO_PAPER_NUMBER,
                                                                    V.NO_PAPER_NUMBER]
    big = s.assign(estimate=[0.28, 0.0, 0.0], low=[0.2, -0.01, -0.01], high=[0.35, 0.01, 0.01])
    assert kinds(corrector.reading(big, {**info, "family": GLA}))[0] == V.AGREES
    assert kinds(corrector.reading(big, {**info, "family": GDN}))[0] == V.SAME_SIGN   # far above GDN's +1.5 pp
    assert kinds(corrector.reading(s, {**info, "family": GDN}))[0] == V.AGREES
    assert kinds(corrector.reading(s, {**info, "family": OTHER})) == [V.NOT_COMPARED, V.NO_PAPER_NUMBER,
                                                                      V.NO_PAPER_NUMBER]


def test_neutral_reading_uses_the_family_gain_of_the_others():
    from recurscope.interp.protocols import neutral

    s = _rows([_r("target_accuracy_change", -0.6, -0.7, -0.5, arm="state_swap"),
               _r("others_accuracy_change", 0.011, 0.005, 0.015, arm="state_swap"),    # GDN's +1.11, not +2.15 pp
               _r("target_accuracy_change", 0.0, -0.05, 0.05, arm="random_update")])
    # -60 pp: GDN's -59.0 pp, not GLA's -84.2 pp; the random update is the project's control (no paper number)
    assert kinds(neutral.reading(s, family=GLA)) == [V.SAME_SIGN, V.SAME_SIGN, V.NO_PAPER_NUMBER]
    assert kinds(neutral.reading(s, family=GDN)) == [V.AGREES, V.AGREES, V.NO_PAPER_NUMBER]
    assert kinds(neutral.reading(s, family=OTHER)) == [V.NOT_COMPARED, V.NOT_COMPARED, V.NO_PAPER_NUMBER]


def test_retention_reading_uses_the_family_recall_and_break_bound():
    from recurscope.interp.protocols import retention

    s = _rows([_r("clean_correct", 1.0, 1.0, 1.0, k=1, intervention="state_swap"),
               _r("clean_correct", 0.47, 0.44, 0.50, k=32, intervention="state_swap"),       # GLA's 47%
               _r("donor_margin_shift", 8.0, 7.0, 9.0, k=1, intervention="state_swap"),
               _r("shift_kept", 0.4, 0.3, 0.45, k=32, intervention="state_swap"),
               _r("pooled_break_rate", 0.05, 0.03, 0.07, k=32, intervention="state_swap")])  # about 5%: GLA's
    info = {"loads": [1, 32]}
    assert kinds(retention.reading(s, {**info, "family": GLA})) == [V.AGREES] * 4
    assert kinds(retention.reading(s, {**info, "family": GDN})) == [V.DIFFERS, V.AGREES, V.AGREES, V.DIFFERS]
    assert kinds(retention.reading(s, {**info, "family": OTHER})) == [V.NOT_COMPARED] * 4


def test_heads_reading_judges_only_gla():
    from recurscope.interp.protocols import heads

    s = _rows([_r("recovery", 0.95, 0.9, 0.98, analysis="recovery", k=1, unit="top1"),
               _r("joint_minus_sum", 0.5, 0.2, 0.8, analysis="nonadditivity", unit="hub+second"),
               _r("hub_minus_all", -1, -2, -0.5, analysis="hub_vs_all", unit="hub")])
    assert kinds(heads.reading(s, 96, family=GLA)) == [V.AGREES] * 3
    for family in (GDN, OTHER):          # the paper's numbers here are GLA's (and RWKV7-13.3B's top-1 only)
        got = heads.reading(s, 96, family=family)
        assert kinds(got) == [V.NOT_COMPARED] * 3 and "94.7%" in got[1].sentence


@pytest.mark.parametrize("module, call", [
    ("coupling", lambda m, s, f: m.reading(s, family=f)),
    ("capacity", lambda m, s, f: m.reading(s, family=f)),
    ("overlap", lambda m, s, f: m.reading(s, family=f)),
    ("lens", lambda m, s, f: m.reading(s, {"localised": 1, "layers": 2, "family": f})),
])
def test_readings_with_one_claim_for_both_families_compare_no_other_family(module, call):
    import importlib

    m = importlib.import_module(f"recurscope.interp.protocols.{module}")
    s = _rows([_r("margin_change_b", -0.3, -0.5, -0.1, arm="parallel"),
               _r("margin_change_b", 0.3, 0.1, 0.5, arm="orthogonal"),
               _r("load_loss", 0.35, 0.30, 0.40, series="contrast", x_from=1, x_to=16),
               _r("load_minus_gap_loss", 0.3, 0.2, 0.4, series="contrast"),
               _r("target_margin_change", -0.3, -0.4, -0.2, arm="aligned"),
               _r("target_margin_change", 0.0, -0.1, 0.1, arm="orthogonal"),
               _r("target_margin_change", 0.0, -0.1, 0.1, arm="control_head:aligned"),
               _r("sublayer_jump", 0.6, 0.5, 0.7, split="heldout", task="retention", layer=1, side="sublayer"),
               _r("sublayer_jump", 0.3, 0.2, 0.4, split="heldout", task="update", layer=1, side="sublayer")])
    gla, gdn, other = (kinds(call(m, s, f)) for f in (GLA, GDN, OTHER))
    assert gla and all(k == V.AGREES for k in gla)
    # the lens's jumps are each family's own numbers (GLA +66.4 / +28.9 pp, GDN +74.2 / +43.0 pp)
    assert gdn == ([V.SAME_SIGN, V.SAME_SIGN] if module == "lens" else gla)
    # overlap's control head is a control, judged on any model; nothing else is compared for RWKV-7
    expected = [V.NOT_COMPARED] * (len(gla) - 1) + [V.AGREES] if module == "overlap" else [V.NOT_COMPARED] * len(gla)
    assert other == expected
