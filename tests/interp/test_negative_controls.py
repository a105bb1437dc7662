"""The negative controls of issue 40: every protocol verb on models that cannot do the task must claim nothing.

Two kinds of model, where every effect is noise:
- random-weight models of each family the verbs support (saved with the word tokenizer, tests/conftest.py);
- a "live noise" model: the bundled tiny-gla with every recurrent head's output projection scaled by 1e-7, so the
  scans still run through real weights but the states reach the logits only as float noise.

Asserted on each: no sentence "agrees with the paper", no named head or hub, no crash (exit 0, or a one-line
refusal with exit 2), and a Reading that says why nothing is claimed. Three paths: the command line with the
default capability gate (the model is refused before anything runs), the command line with --gate-threshold 0
(everything runs, every verdict reads "not gated"), and the Python path without a gate, where the verdict rules
alone must hold (ties, noise floors, ratios without a denominator, controls without a paper number)."""
import re

import pytest
import torch

from recurscope.interp import verdicts as V
from recurscope.interp.cli import main
from recurscope.interp.protocols import VERBS

SMALL = ["--n-sources", "4", "--filler", "12", "--presentations", "2", "--gap", "4", "--resamples", "100",
         "--batch-size", "8"]
#: Verbs whose options differ from SMALL (their own layouts), as in tests/cli/test_protocol_verbs.py.
OWN = {"gate": ["--n-sources", "4", "--fillers", "8", "--resamples", "100", "--batch-size", "8"],
       "capacity": ["--n-sources", "4", "--loads", "1", "2", "--gaps", "8", "16", "--total-length", "120",
                    "--resamples", "100", "--batch-size", "8"],
       "retention": ["--n-sources", "4", "--loads", "1", "2", "--total-length", "200", "--n-nontarget", "1",
                     "--resamples", "100", "--batch-size", "8"],
       "corrector": ["--n-sources", "4", "--n-fit", "4", "--pairs-per-source", "2", "--k", "2", "--total-length",
                     "200", "--resamples", "100", "--batch-size", "8"],
       "reuse": ["--n-sources", "4", "--n-fit", "4", "--filler", "12", "--formats", "template:is_in", "update:is_in",
                 "--resamples", "100", "--batch-size", "8"],
       "topk": ["--n-sources", "4", "--n-dev", "4", "--filler", "12", "--presentations", "2", "--gap", "4",
                "--resamples", "100", "--batch-size", "8"],
       "heads": [*SMALL, "--n-dev", "4"]}
#: Verbs that take no --head (a ranking, a layer, or no head at all).
NO_HEAD = {"heads", "lens", "gate", "hybrid", "topk"}
NAMED = re.compile(r"\b(?:winner|hub|frozen head|top head)\b[^.]*\bL\d+H\d+", re.I)


def verb_args(verb: str, path, out, *, head: bool = True) -> list[str]:
    own = OWN.get(verb, SMALL)
    return [verb, str(path), *own, *([] if verb in NO_HEAD or not head else ["--head", "0", "1"]), "--out", str(out)]


def assert_claims_nothing(text: str, why: str):
    assert V.AGREES not in text, text
    assert not NAMED.search(text), text
    assert why in text, text


@pytest.fixture(scope="module")
def live_noise(tmp_path_factory):
    """tiny-gla with every recurrent head's output projection scaled by 1e-7, saved as a checkpoint."""
    from recurscope.interp.loading import load_model, save_model

    model = load_model("tiny-gla")
    with torch.no_grad():
        for layer in model.recurrent_layers:
            model.blocks[layer].mixer.o_proj.weight.mul_(1e-7)
    path = tmp_path_factory.mktemp("live-noise") / "tiny-gla-noise"
    save_model(model, path)
    return path


@pytest.fixture(scope="module")
def random_gla(tmp_path_factory, tiny_checkpoint):
    return tiny_checkpoint(tmp_path_factory.mktemp("random") / "gla", "gla")


# ---- the command line with the default gate: refused before anything runs, for every verb ---------------------

@pytest.mark.parametrize("verb", [v for v in VERBS if v not in ("gate", "hybrid")])
def test_every_verb_refuses_a_random_model_at_the_capability_gate(verb, random_gla, tmp_path, capsys):
    out = tmp_path / verb
    assert main(verb_args(verb, random_gla, out)) == 0
    text = capsys.readouterr().out
    report = (out / "report.md").read_text()
    for t in (text, report):
        assert_claims_nothing(t, V.REFUSED)
    assert "THE MODEL DOES NOT DO THE TASK" in report and not (out / f"{verb}_summary.csv").exists()


def test_the_live_noise_model_is_refused_at_the_gate(live_noise, tmp_path, capsys):
    for verb in ("headscan", "heads", "selectivity"):
        out = tmp_path / verb
        assert main(verb_args(verb, live_noise, out, head=False)) == 0
        assert_claims_nothing((out / "report.md").read_text(), V.REFUSED)


def test_the_gate_verb_on_a_random_model_refuses_and_claims_nothing(random_gla, tmp_path, capsys):
    out = tmp_path / "gate"
    assert main(verb_args("gate", random_gla, out)) == 0
    report = (out / "report.md").read_text()
    assert V.AGREES not in report and "refused" in report


def test_hybrid_on_a_random_hybrid_is_refused(tmp_path, word_tok, capsys):
    from helpers_models import tiny_model
    from recurscope.interp.loading import save_model

    model = tiny_model("gdn_hybrid", vocab_size=len(word_tok))
    model.tokenizer = word_tok
    save_model(model, tmp_path / "hybrid")
    out = tmp_path / "out"
    assert main(verb_args("hybrid", tmp_path / "hybrid", out)) == 0
    assert_claims_nothing((out / "report.md").read_text(), V.REFUSED)


# ---- --gate-threshold 0: everything runs, nothing is compared -----------------------------------------------

QUICK_UNGATED = ("headscan", "heads", "neutral", "overlap")


def _ungated(verb, path, tmp_path, capsys, head=True):
    out = tmp_path / verb
    rc = main([*verb_args(verb, path, out, head=head)[:-2], "--gate-threshold", "0", "--out", str(out)])
    captured = capsys.readouterr()
    return rc, captured, out


@pytest.mark.parametrize("verb", QUICK_UNGATED)
def test_ungated_verbs_on_the_live_noise_model_read_not_gated(verb, live_noise, tmp_path, capsys):
    rc, captured, out = _ungated(verb, live_noise, tmp_path, capsys)
    assert rc == 0, captured.err
    report = (out / "report.md").read_text()
    assert V.AGREES not in report and V.NOT_GATED in report
    assert "not informative" in report or V.NOT_GATED in report


@pytest.mark.slow
@pytest.mark.parametrize("verb", [v for v in VERBS if v not in ("gate", "hybrid") and v not in QUICK_UNGATED])
def test_every_other_ungated_verb_on_a_random_model_reads_not_gated(verb, random_gla, tmp_path, capsys):
    rc, captured, out = _ungated(verb, random_gla, tmp_path, capsys)
    assert rc == 0, captured.err
    report = (out / "report.md").read_text()
    reading = report.split("### Reading", 1)[1]
    # every verdict reads "not gated"; a verb with a gate of its own (topk's per-format gate) says it refused
    assert V.AGREES not in report and (V.NOT_GATED in reading or "under the 80% gate" in reading)


def test_a_head_is_never_frozen_from_a_scan_inside_its_noise_floor(live_noise, tmp_path, capsys):
    """The issue's selectivity without --head froze a head from a scan with J ~ 5e-8: now a one-line refusal."""
    rc, captured, out = _ungated("selectivity", live_noise, tmp_path, capsys, head=False)
    assert rc == 2
    errors = [line for line in captured.err.strip().splitlines() if not line.startswith("WARNING")]
    assert len(errors) == 1 and "names no head" in errors[0] and "Traceback" not in captured.err


# ---- the Python path without a gate: the verdict rules alone ------------------------------------------------

@pytest.fixture(scope="module")
def noise_model(live_noise):
    from recurscope.interp.loading import load_model

    return load_model(str(live_noise))


def _verdicts(section_reading):
    return [v for v in section_reading if isinstance(v, V.Verdict)]


def test_headscan_on_live_noise_names_no_rank_and_agrees_with_nothing(noise_model):
    """The issue's headscan: rank 1 [1, 1] from four tied heads, and a Spearman of +0.400 [-0.500, +1.000], both
    'agreeing'. On live noise neither may agree."""
    from recurscope.interp.protocols import headscan
    from recurscope.interp.protocols._common import pair_spec

    r = headscan.run_headscan(noise_model, head=(0, 0), n_sources=4, n_resamples=200,
                              layout=pair_spec("where_is", filler_tokens=12, presentations=2, gap_tokens=4))
    kinds = [v.kind for v in _verdicts(headscan.reading(r.summary, r.info["n_heads"], family=V.GLA))]
    assert V.AGREES not in kinds and V.AGREES not in r.section


def test_heads_on_live_noise_names_no_hub_and_no_ratio(noise_model):
    """The issue's heads: a top-1 recovery of 75.2% [-24.1, 4362.2] 'agreeing', and L0H0 named the hub from a
    four-way tie. On live noise: no hub, no agreement."""
    from recurscope.interp.protocols import heads
    from recurscope.interp.protocols._common import pair_spec

    r = heads.run_heads(noise_model, n_dev=4, n_sources=4, n_resamples=200,
                        layout=pair_spec("where_is", filler_tokens=12, presentations=2, gap_tokens=4))
    assert r.info["hub_named"] is False
    assert V.AGREES not in r.section and "No hub is named" in r.section


def test_neutral_and_corrector_controls_are_never_compared_with_an_invented_zero():
    import pandas as pd

    from recurscope.interp.protocols import corrector, neutral

    s = pd.DataFrame([{"metric": "target_accuracy_change", "arm": "random_update", "estimate": 0.0, "low": -0.01,
                       "high": 0.01, "n_sources": 16}])
    v = neutral.reading(s, family=V.GDN)[-1]
    assert v.kind == V.NO_PAPER_NUMBER and V.AGREES not in v.sentence
    s = pd.DataFrame([{"metric": "accuracy_change", "arm": arm, "estimate": 0.0, "low": -0.01, "high": 0.01,
                       "n_sources": 16} for arm in ("random_map", "control_head")])
    got = [v.kind for v in _verdicts(corrector.reading(s, {"method": "logits_and_state", "family": V.GLA}))]
    assert got[-2:] == [V.NO_PAPER_NUMBER, V.NO_PAPER_NUMBER]


def test_reuse_does_not_crash_without_a_denominator(word_tok):
    """The issue's reuse exited 2 after 589 s: "the denominator's mean is 0". A ratio over a zero denominator is now
    undefined, and the Reading says so."""
    import pandas as pd

    from recurscope.interp.protocols import reuse

    s = pd.DataFrame([
        {"part": "subspace", "vocab": "colours", "projection": "output_patch", "metric": "donor_margin_shift",
         "estimate": 0.0, "low": 0.0, "high": 0.0, "n_sources": 8},
        {"part": "subspace", "vocab": "colours", "projection": "colour_basis", "metric": "shift_kept",
         "estimate": float("nan"), "low": float("nan"), "high": float("nan"), "n_sources": 8}])
    got = _verdicts(reuse.reading(s, {"formats": [], "rank": 4, "family": V.GLA}))
    assert got[0].kind == V.UNDEFINED


def test_a_four_way_tie_names_no_hub_and_no_frozen_head():
    """The issue's heads named L0H0 the hub from a four-way tie (all J equal): a tied ranking names no head."""
    import pandas as pd

    from recurscope.interp.protocols._common import _refuse_noise, ranking_names_a_head

    tied = pd.DataFrame({"layer": [0, 0, 1, 1], "head": [0, 1, 0, 1], "J": [0.0] * 4})
    assert not ranking_names_a_head(tied)
    assert not ranking_names_a_head(tied.assign(J=[5e-8, 1e-8, 0.0, 0.0]))          # inside float noise
    assert not ranking_names_a_head(tied.assign(J=[0.5, 0.1, 0.0, 0.0], J_low=[-0.1] + [float("nan")] * 3))
    assert ranking_names_a_head(tied.assign(J=[0.5, 0.1, 0.0, 0.0], J_low=[0.2] + [float("nan")] * 3))
    with pytest.raises(ValueError, match="names no head"):
        _refuse_noise(tied)


def test_overlap_controls_are_not_near_zero_against_a_noise_sized_aligned_effect():
    """The issue's overlap on a random model (clean recall 18.8%): its near-zero arms 'agreed'. Judged against the
    aligned key's own effect, noise of the same size is not informative."""
    import pandas as pd

    from recurscope.interp.protocols import overlap

    s = pd.DataFrame([{"metric": "target_margin_change", "arm": arm, "estimate": est, "low": lo, "high": hi,
                       "n_sources": 4} for arm, est, lo, hi in (("aligned", -0.01, -0.03, 0.01),
                                                                ("orthogonal", 0.0, -0.02, 0.02),
                                                                ("control_head:aligned", 0.0, -0.03, 0.03))])
    got = [v.kind for v in _verdicts(overlap.reading(s, family=V.GLA))]
    assert V.AGREES not in got and got[1:] == [V.NOT_INFORMATIVE] * 2


def test_topk_on_tiny_rwkv7_says_the_scale_in_its_reading():
    """The issue's topk tiny-rwkv7: 56.5% 'agrees' with RWKV7-13.3B's 54.8%, with no word about a 12,500-fold
    difference in size. The Reading now says it."""
    from recurscope.interp.protocols.runner import paper_scale_caveat

    caveat = paper_scale_caveat({"n_params": 1_062_016, "paper_params": 13.3e9, "paper_model": "RWKV7-13.3B"})
    assert "RWKV7-13.3B" in caveat and "1/12,523" in caveat
    assert paper_scale_caveat({"n_params": 340e6 / 50}) is None         # within 100x of 340M: no caveat
