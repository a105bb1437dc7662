"""Recall pair builders on a word-level and a byte-level BPE tokenizer: alignment, spans, balance, variants, errors."""

from collections import Counter

import pytest
import torch

from recurscope.interp.data import (TEMPLATES, VALUE_VOCABS, PairBatch, build_multifact_pairs, build_neutral_pairs,
                         build_pairs, build_update_pairs, corpus_sources, iter_pairs, single_token_id,
                         text_folder_sources)

SMALL = dict(n_facts=3, presentations=3, filler_tokens=40, gap_tokens=8)



def spaced(text):
    # The word-level decoder tidies spaces before punctuation; BPE decodes verbatim. Compare on words only.
    import re
    return re.findall(r"\w+|[^\w\s]", text)


def test_swap_pairs_differ_only_at_target_values(tok):
    batch = build_pairs(tok, n_sources=8, **SMALL)
    n, length = batch.recipient_ids.shape
    assert batch.donor_ids.shape == (n, length)
    for i in range(n):
        differ = (batch.recipient_ids[i] != batch.donor_ids[i]).nonzero().flatten().tolist()
        spans = batch.target_value_spans[i].tolist()
        assert differ == [s for s, e in spans]
        assert all(e == s + 1 for s, e in spans)
        assert set(batch.recipient_ids[i, differ].tolist()) == {int(batch.recipient_answer_id[i])}
        assert set(batch.donor_ids[i, differ].tolist()) == {int(batch.donor_answer_id[i])}


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_spans_point_at_the_fact_tokens(tok, template):
    batch = build_pairs(tok, n_sources=4, template=template, vocab="animals", **SMALL)
    frame = batch.to_frame()
    tmpl = TEMPLATES[template]
    for i, row in frame.iterrows():
        ids = batch.recipient_ids[i]
        for f, key in enumerate(row["keys"]):
            value = row.recipient_values[f]
            for (s, e), (vs, ve) in zip(row.fact_spans[f], row.value_spans[f]):
                assert spaced(tok.decode(ids[s:e])) == spaced(tmpl.fact.format(key=key, value=value))
                assert ids[vs] == single_token_id(tok, value) and s <= vs < ve <= e
            starts = [s for s, _ in row.fact_spans[f]]
            assert starts == sorted(starts)
        # The query prompt ends at query_pos, the last token of the sequence; the answer comes next.
        assert row.query_pos == len(ids) - 1
        prompt = tok.decode(ids[row.query_start:row.query_pos + 1])
        assert spaced(prompt) == spaced(tmpl.query.format(key=row.target_key))
        assert row.recipient_answer == row.recipient_values[row.target_fact]


def test_filler_never_holds_task_tokens(tok):
    batch = build_pairs(tok, n_sources=6, **SMALL)
    reserved = set()
    for word in list(VALUE_VOCABS["cities"]) + [k for ks in batch.keys for k in ks]:
        reserved.add(single_token_id(tok, word))
    for i in range(len(batch)):
        mask = torch.ones(batch.recipient_ids.shape[1], dtype=torch.bool)
        for s, e in batch.fact_spans[i].reshape(-1, 2).tolist():
            mask[s:e] = False
        mask[int(batch.query_start[i]):] = False
        assert not reserved & set(batch.recipient_ids[i][mask].tolist())


def test_candidates_are_single_tokens_and_balanced(tok):
    batch = build_pairs(tok, n_sources=12, pairs_per_source=4, vocab="cities", **SMALL)
    assert len(batch) == 48
    for i in range(len(batch)):
        ids = batch.candidate_ids[i].tolist()
        assert len(set(ids)) == 4
        assert ids == [single_token_id(tok, w) for w in batch.candidates[i]]
        assert batch.recipient_answer_index[i] != batch.donor_answer_index[i]
    assert Counter(batch.recipient_answer_index.tolist()) == {0: 12, 1: 12, 2: 12, 3: 12}
    assert Counter(batch.donor_answer_index.tolist()) == {0: 12, 1: 12, 2: 12, 3: 12}
    assert Counter(zip(batch.recipient_answer_index.tolist(), batch.donor_answer_index.tolist())) == {
        (a, b): 4 for a in range(4) for b in range(4) if a != b}
    frame = batch.to_frame()
    # 48 pairs over 24 cities: every value is the recipient answer exactly twice, and the donor answer twice.
    assert set(Counter(frame.recipient_answer).values()) == {2} and len(set(frame.recipient_answer)) == 24
    assert set(Counter(frame.donor_answer).values()) == {2}
    assert Counter(batch.target_fact.tolist()) == {0: 16, 1: 16, 2: 16}
    # Pairs of one source share its filler but differ in bindings.
    assert frame.groupby("source_id").size().tolist() == [4] * 12


def test_generation_is_deterministic(tok):
    a = build_pairs(tok, n_sources=4, seed=3, **SMALL)
    b = build_pairs(tok, n_sources=4, seed=3, **SMALL)
    c = build_pairs(tok, n_sources=4, seed=4, **SMALL)
    assert torch.equal(a.recipient_ids, b.recipient_ids) and torch.equal(a.donor_ids, b.donor_ids)
    assert a.to_frame().equals(b.to_frame())
    assert not torch.equal(a.recipient_ids, c.recipient_ids)
    listed = list(iter_pairs(tok, "dev", 4, seed=3, **SMALL))
    assert [p.recipient_ids for p in listed] == a.recipient_ids.tolist()


def test_dev_and_heldout_pairs_use_different_filler(word_tok):
    dev = build_pairs(word_tok, split="dev", n_sources=4, **SMALL)
    held = build_pairs(word_tok, split="heldout", n_sources=4, **SMALL)
    assert set(held.splits) == {"heldout"} and set(dev.splits) == {"dev"}
    for i in range(4):
        assert not torch.equal(dev.recipient_ids[i, :8], held.recipient_ids[i, :8])


def test_neutral_counterfactual(tok):
    batch = build_neutral_pairs(tok, n_sources=6, **SMALL)
    assert batch.recipient_ids.shape == batch.donor_ids.shape
    assert (batch.donor_answer_index == -1).all() and (batch.donor_answer_id == -1).all()
    for i, row in batch.to_frame().iterrows():
        target_key = single_token_id(tok, row.target_key)
        target_value = int(batch.recipient_answer_id[i])
        context = batch.donor_ids[i, :row.query_start].tolist()
        assert target_key not in context and target_value not in context
        inside = torch.zeros(batch.donor_ids.shape[1], dtype=torch.bool)
        for s, e in row.fact_spans[row.target_fact]:
            inside[s:e] = True
            assert batch.donor_ids[i, s:e].tolist() != batch.recipient_ids[i, s:e].tolist()
        assert torch.equal(batch.donor_ids[i][~inside], batch.recipient_ids[i][~inside])
        # The non-target facts are untouched in the neutral run.
        for f in range(row.n_facts):
            if f != row.target_fact:
                for s, e in row.fact_spans[f]:
                    assert batch.donor_ids[i, s:e].tolist() == batch.recipient_ids[i, s:e].tolist()


def test_changed_later_answer_is_the_latest_value(tok):
    batch = build_update_pairs(tok, n_sources=8, n_updated=1, **SMALL)
    frame = batch.to_frame()
    for i, row in frame.iterrows():
        ids = batch.recipient_ids[i]
        value_spans = row.value_spans[row.target_fact]
        latest = max(value_spans)
        assert ids[latest[0]] == batch.recipient_answer_id[i]
        stale_id = batch.candidate_ids[i, row.stale_answer_index]
        for span in value_spans:
            if span != latest:
                assert ids[span[0]] == stale_id
        assert len({row.recipient_answer_index, row.donor_answer_index, row.stale_answer_index}) == 3
        differ = (batch.recipient_ids[i] != batch.donor_ids[i]).nonzero().flatten().tolist()
        assert differ == [latest[0]]
        assert batch.donor_ids[i, latest[0]] == batch.donor_answer_id[i]
    with pytest.raises(ValueError, match="n_updated"):
        build_update_pairs(tok, n_sources=1, n_facts=2, presentations=1, filler_tokens=4, gap_tokens=2)


def test_multifact_rows_share_context_and_query_every_fact(tok):
    batch = build_multifact_pairs(tok, n_sources=4, **SMALL)
    frame = batch.to_frame()
    assert len(batch) == 4 * 3
    for group, rows in frame.groupby("group"):
        assert sorted(rows.queried_fact) == [0, 1, 2]
        assert rows.is_target.sum() == 1
        starts = set(rows.query_start)
        assert len(starts) == 1
        start = starts.pop()
        first = batch.recipient_ids[rows.index[0], :start]
        for i in rows.index:
            assert torch.equal(batch.recipient_ids[i, :start], first)
            row = frame.loc[i]
            answer = row.recipient_values[row.queried_fact]
            assert row.recipient_answer == answer
            s = row.value_spans[row.queried_fact][0][0]
            assert batch.recipient_ids[i, s] == batch.candidate_ids[i, row.recipient_answer_index]
            if not row.is_target:
                assert row.donor_answer_index == row.recipient_answer_index


def test_corpus_sources_as_filler(word_tok, tmp_path):
    folder = tmp_path / "books"
    folder.mkdir()
    from recurscope.interp.data import sources

    for b in range(4):
        (folder / f"book{b}.txt").write_text(sources("train", 1, start=b)[0].text(80))
    corpus = text_folder_sources(folder, "dev", window_words=300)
    batch = build_pairs(word_tok, corpus, **SMALL)
    assert len(batch) == len(corpus) and set(batch.origins) == {"text"}
    assert batch.source_id.tolist() == [s.id for s in corpus]
    # The filler starts with the window's own words.
    assert spaced(word_tok.decode(batch.recipient_ids[0, :6])) == spaced(corpus[0].text_window)[:6]
    with pytest.raises(ValueError, match="ran out of filler"):
        build_pairs(word_tok, corpus, n_facts=3, filler_tokens=5000)


def test_mixed_lengths_are_left_padded(word_tok):
    a = list(iter_pairs(word_tok, "dev", 2, template="colon", **SMALL))
    b = list(iter_pairs(word_tok, "dev", 2, template="likes", **SMALL))
    batch = PairBatch.collate(a + b, pad_id=word_tok.pad_token_id)
    lengths = [len(p.recipient_ids) for p in a + b]
    assert len(set(lengths)) == 2 and batch.recipient_ids.shape[1] == max(lengths)
    for i, p in enumerate(a + b):
        pad = max(lengths) - len(p.recipient_ids)
        assert (batch.recipient_ids[i, :pad] == word_tok.pad_token_id).all()
        assert batch.recipient_ids[i, pad:].tolist() == p.recipient_ids
        assert int(batch.query_start[i]) == p.query_start + pad
        assert batch.recipient_ids[i, batch.query_pos[i]] == p.recipient_ids[p.query_pos]
        s = batch.value_spans[i, p.target_fact, 0, 0]
        assert batch.recipient_ids[i, s] == p.recipient_ids[p.value_spans[p.target_fact][0][0]]


def test_bos_and_lengths(word_tok):
    batch = build_pairs(word_tok, n_sources=2, add_bos=True, **SMALL)
    assert (batch.recipient_ids[:, 0] == word_tok.bos_token_id).all()
    k, r = 3, 3
    fact_len = batch.fact_spans[0, 0, 0, 1] - batch.fact_spans[0, 0, 0, 0]
    query_len = batch.query_pos[0] - batch.query_start[0] + 1
    assert batch.recipient_ids.shape[1] == 1 + 8 + (k * r - 1) * 8 + 40 + k * r * fact_len + query_len
    # F filler tokens lie between the end of the last presentation and the query.
    assert batch.query_start[0] - batch.fact_spans[0].reshape(-1, 2)[:, 1].max() == 40


def test_error_cases(tok, tmp_path):
    with pytest.raises(ValueError, match="n_facts=4 bindings need 4 distinct keys"):
        build_pairs(tok, n_sources=1, n_facts=4, keys=["Alice", "Bob", "Carol"], filler_tokens=4)
    with pytest.raises(ValueError, match="at least n_candidates=4"):
        build_pairs(tok, n_sources=1, n_facts=2, vocab=["Paris", "Rome", "Oslo"], filler_tokens=4)
    with pytest.raises(ValueError, match="max_length=100"):
        build_pairs(tok, n_sources=1, filler_tokens=512, max_length=100)
    with pytest.raises(ValueError, match="does not exist"):
        text_folder_sources(tmp_path / "nope")
    with pytest.raises(ValueError, match="template"):
        build_pairs(tok, n_sources=1, template="nope")
    with pytest.raises(ValueError, match="vocab"):
        build_pairs(tok, n_sources=1, vocab="planets")
    with pytest.raises(ValueError, match="variant"):
        build_pairs(tok, n_sources=1, variant="erase")
    with pytest.raises(ValueError, match="filler_tokens"):
        build_pairs(tok, n_sources=1, filler_tokens=-1)


def test_multitoken_values_rejected_or_filtered(bpe_tok):
    vocab = list(VALUE_VOCABS["cities"][:6]) + ["Zyzzyvaquux"]
    with pytest.raises(ValueError, match="Zyzzyvaquux"):
        build_pairs(bpe_tok, n_sources=1, vocab=vocab, on_multitoken="error", **SMALL)
    batch = build_pairs(bpe_tok, n_sources=4, vocab=vocab, **SMALL)   # filter is the default
    assert batch.report["n_filtered"] == 1 and list(batch.report["dropped_values"]) == ["Zyzzyvaquux"]
    assert all("Zyzzyvaquux" not in c for c in batch.candidates)
    with pytest.raises(ValueError, match="Zyzzyvaquux"):
        build_pairs(bpe_tok, n_sources=1, keys=["Alice", "Bob", "Zyzzyvaquux"], n_facts=2, filler_tokens=4,
                    on_multitoken="error")


def test_load_extremes(word_tok):
    one = build_pairs(word_tok, n_sources=2, n_facts=1, presentations=1, filler_tokens=0, gap_tokens=0)
    assert (one.target_fact == 0).all() and one.fact_spans.shape[1:3] == (1, 1)
    many = build_pairs(word_tok, n_sources=2, n_facts=32, presentations=2, filler_tokens=16, gap_tokens=2,
                       vocab="cities")
    frame = many.to_frame()
    for _, row in frame.iterrows():
        target_value = row.recipient_values[row.target_fact]
        others = [v for f, v in enumerate(row.recipient_values) if f != row.target_fact]
        assert target_value not in others and row.donor_answer not in others
