"""`recurscope hybrid --task niah` on real vocabularies (Qwen3.5/3.6, which splits every digit, and GPT-2): the donor
replaces the whole number, candidates are distinct answer token sequences, and the factorial scores each by its full
conditional log-likelihood after the query, checked against a full forward of the tokenizer's own ids."""

import pytest
import torch

from recurscope.interp.models import ModelConfig, RecurrentLM
from recurscope.interp.protocols import hybrid


def text_of(tok, ids):
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def test_niah_donor_replaces_the_whole_number_on_every_pair(real_tok):
    pairs = hybrid.build_niah_pairs(real_tok, n_sources=32, total_length=160, seed=3)
    n = len(pairs)
    answers = pairs.candidate_tokens or [[[int(t)] for t in row] for row in pairs.candidate_ids.tolist()]
    for i in range(n):
        r, d = pairs.recipient_ids[i].tolist(), pairs.donor_ids[i].tolist()
        a, b = pairs.value_spans[i, 0, 0].tolist()
        assert text_of(real_tok, d[a:b]).strip() == pairs.donor_values[i][0]
        assert text_of(real_tok, r[a:b]).strip() == pairs.recipient_values[i][0]
        assert pairs.donor_values[i][0] != pairs.recipient_values[i][0]
        assert r != d
        differ = [j for j in range(len(r)) if r[j] != d[j]]
        assert a <= min(differ) and max(differ) < b
        # The donor is the tokenizer's own tokenisation of its text.
        assert real_tok(text_of(real_tok, d)).input_ids == d
        # Candidates: distinct answer sequences, each the tokenizer's own continuation of the prompt.
        assert len({tuple(c) for c in answers[i]}) == len(answers[i])
        for word, tokens in zip(pairs.candidates[i], answers[i]):
            assert real_tok(text_of(real_tok, r) + " " + word).input_ids == r + list(tokens)
        assert pairs.candidates[i][int(pairs.recipient_answer_index[i])] == pairs.recipient_values[i][0]
        assert pairs.candidates[i][int(pairs.donor_answer_index[i])] == pairs.donor_values[i][0]
    assert (pairs.candidate_tokens is not None) == (real_tok.vocab_name == "qwen35")


def test_niah_refuses_too_few_numbers_by_name(real_tok):
    with pytest.raises(ValueError, match=r"leaves 3 usable numbers.*n_candidates=4"):
        _pairs_with(real_tok, ["12", "34", "56"], n_candidates=4)


def _pairs_with(tok, numbers, **kw):
    from unittest import mock

    from recurscope.interp.data import niah as niah_module

    real = niah_module.build_niah
    with mock.patch("recurscope.interp.data.build_niah", lambda *a, **k: real(*a, numbers=numbers, n_choices=2, **k)):
        return hybrid.build_niah_pairs(tok, n_sources=3, total_length=120, **kw)


def test_niah_refuses_a_number_without_a_donor_of_its_length(real_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(real_tokenizer_dir("qwen35")))
    with pytest.raises(ValueError, match=r"no donor number has as many needle tokens as \['7'\]"):
        _pairs_with(tok, ["7", "12", "34", "56"], n_candidates=3)


def test_multi_token_pairs_are_refused_where_one_position_scores(real_tokenizer_dir):
    from transformers import AutoTokenizer

    from recurscope.interp.interventions import clean_run

    tok = AutoTokenizer.from_pretrained(str(real_tokenizer_dir("qwen35")))
    pairs = hybrid.build_niah_pairs(tok, n_sources=2, total_length=120)
    model = _random_hybrid(tok)
    with pytest.raises(ValueError, match="several tokens .*hybrid cache factorial"):
        clean_run(model, pairs)


def _random_hybrid(tok):
    torch.manual_seed(0)
    model = RecurrentLM(ModelConfig.from_dict(dict(
        model_type="gated_deltanet", vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_heads=2,
        head_dim=16, attn={"layers": [1], "num_heads": 2}, bos_token_id=None, eos_token_id=None, pad_token_id=None)))
    model.tokenizer = tok
    return model.eval()


def test_factorial_scores_multi_token_answers_by_their_full_likelihood(real_tokenizer_dir):
    """On a random hybrid with Qwen's vocabulary: the clean arm's scores are each candidate's log-likelihood after
    the recipient, the full swap's after the donor, both from full forwards of the tokenizer's own ids of the text
    plus " NUMBER" (the cache path, the batching and the gathering of answer positions are what is checked)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(real_tokenizer_dir("qwen35")))
    model = _random_hybrid(tok)
    pairs = hybrid.build_niah_pairs(tok, n_sources=3, total_length=120, seed=2)
    assert pairs.candidate_tokens is not None
    scores = hybrid.factorial_logits(model, pairs, batch_size=2)
    for i in range(len(pairs)):
        for side, arm in (("recipient", "clean"), ("donor", "both")):
            ids = getattr(pairs, f"{side}_ids")[i].tolist()
            for slot, word in enumerate(pairs.candidates[i]):
                seq = tok(text_of(tok, ids) + " " + word).input_ids
                with torch.no_grad():
                    logp = torch.log_softmax(model(torch.tensor([seq]))[0].double(), -1)
                want = sum(float(logp[j - 1, seq[j]]) for j in range(len(ids), len(seq)))
                assert scores[arm][i, slot].item() == pytest.approx(want, abs=2e-3)
    rows = hybrid.cache_factorial(model, pairs)
    assert set(rows.arm) == {"recurrent", "kv", "both"} and rows["donor_margin_shift"].notna().all()
