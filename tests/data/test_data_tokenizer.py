"""Word-level tokenizer construction, saving and loading; single-token lookups on word-level and BPE tokenizers."""

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from recurscope.interp.data import (default_word_list, encode_continuation, load_word_tokenizer, save_word_tokenizer,
                         single_token_id, single_token_ids, sources)


def test_every_generated_word_is_one_known_token(word_tok):
    words = default_word_list()
    assert 2000 <= len(word_tok) <= 5000
    kept, ids, dropped = single_token_ids(word_tok, words)
    assert not dropped and len(set(ids)) == len(words)
    assert word_tok.unk_token_id not in ids
    assert [word_tok.pad_token_id, word_tok.unk_token_id, word_tok.bos_token_id, word_tok.eos_token_id] == [0, 1, 2, 3]


def test_pre_tokenizer_splits_whitespace_and_punctuation(word_tok):
    ids = word_tok("Alice is in Paris.where?", add_special_tokens=False)["input_ids"]
    assert word_tok.convert_ids_to_tokens(ids) == ["Alice", "is", "in", "Paris", ".", "where", "?"]
    assert word_tok.convert_ids_to_tokens(word_tok("zzqx", add_special_tokens=False)["input_ids"]) == ["[UNK]"]


def test_extra_words_are_added(word_tok):
    from recurscope.interp.data import build_word_tokenizer

    tok = build_word_tokenizer(["Zyzzyva", "quux-frob"])
    single_token_id(tok, "Zyzzyva")
    assert tok.convert_ids_to_tokens(encode_continuation(tok, "quux-frob")) == ["quux", "-", "frob"]
    with pytest.raises(ValueError, match="Zyzzyva"):
        single_token_id(word_tok, "Zyzzyva")


def test_save_and_load_round_trip(word_tok, tmp_path):
    directory = save_word_tokenizer(word_tok, tmp_path / "tok")
    text = sources("dev", 1)[0].text(5) + " Alice is in Paris."
    expected = word_tok(text, add_special_tokens=False)["input_ids"]
    auto = AutoTokenizer.from_pretrained(str(directory))
    assert auto(text, add_special_tokens=False)["input_ids"] == expected
    assert auto.pad_token_id == 0 and auto.bos_token_id == 2
    from_file = PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"))
    assert from_file(text, add_special_tokens=False)["input_ids"] == expected
    assert load_word_tokenizer(directory)(text, add_special_tokens=False)["input_ids"] == expected
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_word_tokenizer(tmp_path / "missing")


def test_single_token_id_uses_the_mid_sentence_form(bpe_tok):
    token = single_token_id(bpe_tok, "Alice")
    assert bpe_tok.convert_ids_to_tokens([token]) == ["ĠAlice"]
    # In running text the word appears exactly as this id.
    ids = bpe_tok("the Alice", add_special_tokens=False)["input_ids"]
    assert ids[-1] == token


def test_multi_token_words_are_named(bpe_tok):
    with pytest.raises(ValueError, match=r"'Zyzzyvaquux' is not a single token.*tokenises as \["):
        single_token_id(bpe_tok, "Zyzzyvaquux")
    kept, ids, dropped = single_token_ids(bpe_tok, ["Alice", "Zyzzyvaquux", "Bob"], on_multitoken="filter")
    assert kept == ["Alice", "Bob"] and list(dropped) == ["Zyzzyvaquux"] and len(dropped["Zyzzyvaquux"]) > 1
    with pytest.raises(ValueError, match="Zyzzyvaquux"):
        single_token_ids(bpe_tok, ["Alice", "Zyzzyvaquux"])
    with pytest.raises(ValueError, match="on_multitoken"):
        single_token_ids(bpe_tok, ["Alice"], on_multitoken="drop")


def test_data_modules_import_in_one_direction():
    # words <- tokenizer <- filler <- recall, niah, corpora: the word lists live in words.py, so no module of
    # interp.data imports one that imports it back (lazy imports inside functions count too).
    import ast
    from pathlib import Path

    import recurscope.interp.data as data

    folder = Path(data.__file__).parent
    graph = {}
    for path in folder.glob("*.py"):
        if path.stem == "__init__":
            continue
        graph[path.stem] = {node.module for node in ast.walk(ast.parse(path.read_text()))
                            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module}
    assert graph["words"] == set() and graph["tokenizer"] == {"words"}

    def reaches(start, goal, seen=()):
        return any(m == goal or (m not in seen and reaches(m, goal, seen + (m,))) for m in graph.get(start, ()))

    assert [m for m in graph if reaches(m, m)] == []
