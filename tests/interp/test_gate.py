"""The App. F.2 capability gate (protocols.gate.run_gate): one evidence sentence, two phrasings, full-vocabulary
top-1, an evidence-removed control; checked against the pair builder's own sequences and exact implications."""
import torch

from helpers_models import tiny_model
from recurscope.interp.data import build_neutral_pairs, build_pairs
from recurscope.interp.protocols import gate

LAYOUT = dict(split="heldout", n_sources=4, n_facts=1, presentations=1, gap_tokens=4, filler_tokens=12,
              template=gate.NATURAL_TEMPLATE, vocab=gate.GATE_CITIES, on_multitoken="filter")


def test_the_first_phrasing_is_the_builders_own_question_and_the_second_keeps_the_context(word_tok):
    pairs = build_pairs(word_tok, **LAYOUT)
    rec, don, qpos = gate._ask(word_tok, pairs, gate.PHRASINGS[0])
    assert torch.equal(rec, pairs.recipient_ids) and torch.equal(don, pairs.donor_ids)
    assert torch.equal(qpos, pairs.query_pos)
    rec2, _, qpos2 = gate._ask(word_tok, pairs, gate.PHRASINGS[1])
    start = int(pairs.query_start[0])
    assert torch.equal(rec2[:, :start], pairs.recipient_ids[:, :start]) and not torch.equal(rec2, rec)
    assert int(qpos2[0]) == rec2.shape[1] - 1
    # 24 of the 31 cities are single tokens in the word tokenizer; the rest are dropped and reported
    assert len(pairs.report["dropped_values"]) == len(gate.GATE_CITIES) - 24


def test_the_evidence_removed_sequence_does_not_hold_the_answer(word_tok):
    neutral = build_neutral_pairs(word_tok, **LAYOUT)
    answer = neutral.recipient_answer_id
    for i in range(len(neutral)):
        start = int(neutral.query_start[i])
        assert int(answer[i]) not in neutral.donor_ids[i, :start].tolist()
        assert int(answer[i]) in neutral.recipient_ids[i, :start].tolist()


def test_full_vocabulary_top1_implies_top1_among_the_candidates(word_tok):
    model = tiny_model("gla_conv", layers=2, vocab_size=len(word_tok))
    model.tokenizer = word_tok
    pairs = build_pairs(word_tok, **LAYOUT)
    vocab = gate.top1_correct(model, pairs.recipient_ids, pairs.query_pos, *gate._answer(pairs, "recipient",
                                                                                         "vocabulary"))
    cands = gate.top1_correct(model, pairs.recipient_ids, pairs.query_pos, *gate._answer(pairs, "recipient",
                                                                                         "candidates"))
    assert bool((~vocab | cands).all())
    r = gate.run_gate(model, fillers=[12], n_sources=3, n_resamples=100)
    s = r.summary.set_index("metric")
    assert {"recipient_correct", "donor_correct", "evidence_removed_correct"} <= set(s.index)
    both = r.rows["recipient_correct"]
    assert (both == r.rows["recipient_correct_phrasing1"] * r.rows["recipient_correct_phrasing2"]).all()
