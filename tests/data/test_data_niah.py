"""S-NIAH generator: exact lengths, needle placement and answers, determinism, scoring."""

import re

import pytest
import torch

from recurscope.interp.data import NEEDLE, NIAH_QUERY, build_niah, single_token_id


def words(text):
    return re.findall(r"\w+|[^\w\s]", text)


@pytest.mark.parametrize("total", [64, 257, 1000])
def test_length_is_exact_and_needle_is_where_recorded(tok, total):
    batch = build_niah(tok, 6, total, seed=1)
    assert batch.input_ids.shape == (6, total)
    frame = batch.to_frame()
    for i, row in frame.iterrows():
        ids = batch.input_ids[i]
        needle = tok.decode(ids[row.needle_start:row.needle_end])
        assert words(needle) == words(NEEDLE.format(key=row.key, value=row.value))
        assert ids[row.value_pos] == batch.answer_ids[i] == single_token_id(tok, row.value)
        assert batch.candidate_ids[batch.answer_index[i]] == batch.answer_ids[i]
        query = tok.decode(ids[batch.query_start[i]:])
        assert words(query) == words(NIAH_QUERY.format(key=row.key))
        assert row.query_pos == total - 1
        # Only the needle holds a number.
        numbers = set(batch.candidate_ids.tolist())
        outside = torch.cat([ids[:row.needle_start], ids[row.needle_end:]]).tolist()
        assert not numbers & set(outside)


def test_depths_and_determinism(word_tok):
    batch = build_niah(word_tok, 5, 300, depths=[0.0, 0.5, 1.0], seed=2)
    starts = batch.needle_span[:, 0].tolist()
    assert starts[0] == 0 and starts[3] == 0
    needle_len = int(batch.needle_span[0, 1] - batch.needle_span[0, 0])
    assert batch.needle_span[2, 1] == batch.query_start[2]          # depth 1: right before the query
    assert abs(starts[1] - 0.5 * (300 - needle_len - (300 - int(batch.query_start[1])))) < 8
    again = build_niah(word_tok, 5, 300, depths=[0.0, 0.5, 1.0], seed=2)
    assert torch.equal(batch.input_ids, again.input_ids)
    other = build_niah(word_tok, 5, 300, depths=[0.0, 0.5, 1.0], seed=3)
    assert not torch.equal(batch.input_ids, other.input_ids)
    # Values cycle through the number vocabulary: no repeats within one pass.
    many = build_niah(word_tok, 90, 80, seed=0)
    assert sorted(many.values) == sorted(many.candidates)


def test_score_by_candidates_and_full_vocabulary(word_tok):
    batch = build_niah(word_tok, 4, 120, seed=0)
    logits = torch.zeros(4, len(word_tok))
    logits[torch.arange(4), batch.answer_ids] = 5.0
    logits[1, word_tok.convert_tokens_to_ids("the")] = 9.0        # wrong over the vocabulary, right among numbers
    logits[2, batch.candidate_ids[(batch.answer_index[2] + 1) % len(batch.candidate_ids)]] = 9.0   # wrong number
    scores = batch.score(logits)
    assert scores["candidate_correct"].tolist() == [True, True, False, True]
    assert scores["vocab_correct"].tolist() == [True, False, False, True]
    full = torch.zeros(4, 120, len(word_tok))
    full[:, -1] = logits
    assert batch.score(full)["vocab_correct"].tolist() == [True, False, False, True]


def test_errors(word_tok):
    with pytest.raises(ValueError, match="total_tokens=10 is too short"):
        build_niah(word_tok, 2, 10)
    with pytest.raises(ValueError, match="depths"):
        build_niah(word_tok, 2, 100, depths=[1.5])
    with pytest.raises(ValueError, match="n must be"):
        build_niah(word_tok, 0, 100)
