"""run_confirm shares the arms' unpatched runs (clean logits, prefix caches) through interventions.reuse_clean_runs:
every arm's rows must equal the same arm run alone, outside the memo, on native and bridged models alike."""
import pandas as pd
import pytest
import torch

from helpers_models import tiny_model
from recurscope.interp import interventions as iv
from recurscope.interp.confirm import ARMS, confirm_arm, run_confirm
from recurscope.interp.data import build_pairs, build_word_tokenizer
from recurscope.interp.loading import load_model

METRICS = ["donor_margin_shift", "donor_specific_shift", "distractor_shift", "target_margin_change"]


@pytest.fixture(scope="module")
def tok():
    return build_word_tokenizer()


#: family -> (layers, the heads confirmed jointly)
MODELS = {"gla_conv": (2, [(0, 1)]), "gdn_hybrid": (3, [(0, 0), (2, 1)])}


def _model(tok, kind):
    layers, heads = MODELS[kind]
    return tiny_model(kind, layers=layers, vocab_size=len(tok)), heads


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_confirm_with_shared_runs_equals_each_arm_alone(tok, kind):
    model, heads = _model(tok, kind)
    pairs = build_pairs(tok, split="dev", n_sources=4, n_facts=2, filler_tokens=12, gap_tokens=4)  # 2 chunks of 2
    alone = pd.concat([confirm_arm(model, pairs, heads, arm, batch_size=2) for arm in ARMS], ignore_index=True)
    with iv.reuse_clean_runs(model) as memo:
        shared = run_confirm(model, pairs, heads, batch_size=2, n_resamples=200).rows
    assert memo.hits > 0 and memo.entries, "the arms shared nothing"
    key = ["intervention", "row"]
    a = alone.sort_values(key).reset_index(drop=True)
    b = shared.sort_values(key).reset_index(drop=True)
    assert a[key].equals(b[key])
    for col in METRICS + ["correct", "clean_correct"]:
        assert a[col].equals(b[col]), f"{col} differs with shared runs"


def test_a_full_memo_adds_nothing_and_changes_nothing(tok):
    model, heads = _model(tok, "gla_conv")
    pairs = build_pairs(tok, split="dev", n_sources=2, n_facts=2, filler_tokens=12, gap_tokens=4)
    ref = iv.state_swap(model, pairs, heads, batch_size=2)
    with iv.reuse_clean_runs(model, max_bytes=0) as memo:
        out = iv.state_swap(model, pairs, heads, batch_size=2)
    assert not memo.entries and memo.misses > 0
    assert torch.equal(ref.logits, out.logits) and torch.equal(ref.clean, out.clean)


def test_the_memo_ignores_other_models_and_other_pairs(tok):
    (m1, heads), (m2, _) = _model(tok, "gla_conv"), _model(tok, "gdn_hybrid")
    p1 = build_pairs(tok, split="dev", n_sources=2, n_facts=2, filler_tokens=12, gap_tokens=4)
    p2 = build_pairs(tok, split="dev", n_sources=2, n_facts=2, filler_tokens=12, gap_tokens=4, seed=1)
    with iv.reuse_clean_runs(m1) as memo:
        a = iv.state_swap(m1, p1, heads, batch_size=2)
        b = iv.state_swap(m1, p2, heads, batch_size=2)    # new pairs: computed, not served from p1's entries
        iv.state_swap(m2, p1, [(0, 0)], batch_size=2)   # another model: never memoised
    assert memo.hits == 0
    assert torch.equal(b.logits, iv.state_swap(m1, p2, heads, batch_size=2).logits)
    assert not torch.equal(a.logits, b.logits)


@pytest.mark.slow
def test_confirm_with_shared_runs_equals_each_arm_alone_on_the_bridge():
    model = load_model("tiny-qwen35")
    pairs = build_pairs(model.tokenizer, split="dev", n_sources=2, n_facts=2, filler_tokens=16, gap_tokens=4)
    heads = [(0, 0)]
    alone = pd.concat([confirm_arm(model, pairs, heads, arm, batch_size=2) for arm in ARMS], ignore_index=True)
    shared = run_confirm(model, pairs, heads, batch_size=2, n_resamples=200).rows
    key = ["intervention", "row"]
    a = alone.sort_values(key).reset_index(drop=True)
    b = shared.sort_values(key).reset_index(drop=True)
    for col in METRICS:
        assert a[col].equals(b[col]), f"{col} differs with shared runs on the bridge"
