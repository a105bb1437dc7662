"""Golden outputs of the data layer: the pairs, the word list and the filler text are identical, token for token,
to what the code produced before its refactors (iter_pairs split into schedule/layout/candidates; the word lists
moved to words.py). The digests were recorded from main at d7997da; a change here is a change of every dataset."""

import dataclasses
import hashlib
import json

import pytest

from recurscope.interp import data
from recurscope.interp.data import build_niah, iter_pairs, sources, text_folder_sources

# (name, iter_pairs keyword arguments): every variant, both query modes, several layouts and the rarer options.
SETTINGS = {
    "swap": dict(n_facts=3, presentations=3, filler_tokens=40, gap_tokens=8),
    "neutral": dict(variant="neutral", n_facts=2, presentations=2, filler_tokens=30, gap_tokens=5),
    "update": dict(variant="update", n_facts=4, presentations=3, n_updated=2, filler_tokens=20, gap_tokens=4),
    "all_queries": dict(queries="all", n_facts=4, presentations=2, filler_tokens=16, gap_tokens=3, template="colon"),
    "one_fact": dict(n_facts=1, presentations=1, filler_tokens=10, gap_tokens=0, lead_tokens=0, template="belongs",
                     vocab="animals"),
    "per_source": dict(pairs_per_source=3, n_candidates=6, n_facts=2, presentations=2, filler_tokens=12,
                       gap_tokens=2, template="likes", vocab="instruments", seed=7, add_bos=True),
    "custom": dict(keys=["Alice", "Bob", "Carol", "Zach", "Anna"], vocab=["red", "blue", "green", "gold", "pink"],
                   n_facts=3, presentations=2, filler_tokens=8, gap_tokens=2, lead_tokens=5, template="value_of",
                   split="heldout"),
}

DIGESTS = {
    "swap": "f0cccee8c2aa0c64864dbc0dfcf2833a23d2e663f1dd8304566402d33dabbaeb",
    "neutral": "6d861224aa750a5598a698482d986ca90acc71e2359bc574cb354d7ca267dadb",
    "update": "462b357a16c56f4d7fdeb1caa1ea9df02849998fa24b557737ac4e6344e04505",
    "all_queries": "72179801eb302af61c790795fc24679c063ebaf5b7de20ac6b7f9b9434d384e2",
    "one_fact": "34a84eea6832054e0363ff1a4d47c57e76d3aa967e87017b629cec194d080f0a",
    "per_source": "c6b170577539447ec44810896388b1b09b6d41d1ccb21df5403919c4355cd456",
    "custom": "6b12f7383905889c8245287e869f1c630ee8edecd4790b3a2cf2ff98427ddf6c",
}
TEXT_SOURCE_DIGEST = "711b4371fe1fdf203b2308dbef746c7776aea8fed5c6e28736b3d3299652683a"
WORD_DIGESTS = {
    "default_word_list": "961bc188acd11c7421acac85542492fea07222af6a677b09ba953dd38517e26a",
    "recall_words": "ec8b93f05ea3e7641299fb4b639120332ddcbc12b8a728966947f169a4fb6485",
    "niah_words": "ea13621b0d26c2cc7e0f5d8f07ff7cfa6baaf5314c1c03cde96bc5320e057873",
    "filler_vocabulary": "68e18e88fff798e004f9718e81bc4161ecf64e45cc61246dba952152f312a3c2",
}
VOCAB_DIGEST = "b9b8b6e2aa3dd6ad0c5428c5d17ef6b1336ef3526a7d5b0f86dbc326c9fbd5cb"
FILLER_DIGEST = "f0439acca2564ac950fc4a7e11d55740e62727c8347736a0b7ad3b8d950597d9"
NIAH_DIGEST = "2dd4a22fe44a8bd645367963845ecb2ba91fa65d08c4ac34014f608eb1584b50"


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def pairs_digest(tokenizer, **kwargs) -> str:
    split = kwargs.pop("split", "dev")
    n_sources = kwargs.pop("n_sources", 6)
    return digest([dataclasses.asdict(p) for p in iter_pairs(tokenizer, split, n_sources, **kwargs)])


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_pairs_are_unchanged(word_tok, name):
    assert pairs_digest(word_tok, **SETTINGS[name]) == DIGESTS[name]


def test_pairs_on_text_sources_are_unchanged(word_tok, tmp_path):
    for i in range(3):
        text = " ".join(f"plain words number {j} of the file {i} ." for j in range(200))
        (tmp_path / f"doc{i}.txt").write_text(text)
    corpus = text_folder_sources(tmp_path, n=3, window_words=400)
    assert pairs_digest(word_tok, sources=corpus, n_facts=2, presentations=2, filler_tokens=30,
                        gap_tokens=6) == TEXT_SOURCE_DIGEST


@pytest.mark.parametrize("name", sorted(WORD_DIGESTS))
def test_word_lists_are_unchanged(name):
    assert digest(getattr(data, name)()) == WORD_DIGESTS[name]


def test_tokenizer_filler_and_niah_are_unchanged(word_tok):
    assert digest(sorted(word_tok.get_vocab().items())) == VOCAB_DIGEST
    assert digest([s.text(40) for s in sources("train", 4, seed=3)]) == FILLER_DIGEST
    b = build_niah(word_tok, 6, 200, seed=2)
    assert digest([b.input_ids.tolist(), b.answer_ids.tolist(), b.needle_span.tolist(),
                   b.query_pos.tolist()]) == NIAH_DIGEST
