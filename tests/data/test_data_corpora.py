"""Corpus loaders: WikiText parsing, text folders and PG19, windowing and the dev/held-out split, HF cache errors."""

import pytest

from recurscope.interp.data import (CorpusNotFoundError, Document, corpus_sources, pg19_sources, read_hf_dataset,
                         read_wikitext, text_folder_sources, wikitext_sources)

WIKI = """ 
 = Robert Boulter = 
 
 Robert Boulter is an English film , television and theatre actor . He had a guest role in 2000 . 
 
 = = Career = = 
 
 = = = 2000 – 2005 = = = 
 
 In 2006 , Boulter starred alongside Whishaw in the play Citizenship . 
 
 = Du Fu = 
 
 Du Fu was a prominent Chinese poet of the Tang dynasty . 
"""


def test_wikitext_articles_and_headings(tmp_path):
    path = tmp_path / "wiki.valid.raw"
    path.write_text(WIKI)
    docs = read_wikitext(path)
    assert [d.name for d in docs] == ["Robert Boulter", "Du Fu"]
    assert "Career" not in docs[0].text and "=" not in docs[0].text
    assert docs[0].text.startswith("Robert Boulter is") and docs[0].text.endswith("Citizenship .")
    sources = wikitext_sources(path, "all", window_words=5)
    assert all(len(s.text_window.split()) == 5 for s in sources)
    assert {s.document for s in sources} == {"Robert Boulter", "Du Fu"}


def test_windows_split_into_disjoint_dev_and_heldout(tmp_path):
    docs = [Document(f"d{i}", " ".join(f"w{i}x{j}" for j in range(95))) for i in range(4)]
    dev = corpus_sources(docs, "dev", window_words=10)
    held = corpus_sources(docs, "heldout", window_words=10)
    every = corpus_sources(docs, "all", window_words=10)
    assert len(every) == 4 * 9 and len(dev) == len(held) == 18
    assert not {s.id for s in dev} & {s.id for s in held}
    assert not {s.text_window for s in dev} & {s.text_window for s in held}
    assert sorted(s.id for s in dev + held) == [s.id for s in every]
    assert {s.split for s in dev} == {"dev"} and {s.split for s in held} == {"heldout"}
    assert len(corpus_sources(docs, "dev", n=5, window_words=10)) == 5
    with pytest.raises(ValueError, match="only 18 windows"):
        corpus_sources(docs, "dev", n=19, window_words=10)
    with pytest.raises(ValueError, match="split"):
        corpus_sources(docs, "test")


def test_text_folder_and_pg19(tmp_path, word_tok):
    root = tmp_path / "pg19" / "validation"
    root.mkdir(parents=True)
    (root / "b.txt").write_text("the quiet miller walked home . " * 40)
    (root / "a.txt").write_text("a brave sailor sang loudly ! " * 40)
    (root / "notes.md").write_text("ignored")
    books = pg19_sources(tmp_path / "pg19", "all", window_words=50)
    assert [s.document for s in books][:1] == ["validation/a.txt"] and len(books) == 8
    assert set(s.origin for s in books) == {"pg19"}
    ids = books[0].token_ids(word_tok, 30)
    assert word_tok.decode(ids).split()[:3] == ["a", "brave", "sailor"]
    folder = text_folder_sources(root, "heldout", window_words=50)
    assert all(s.split == "heldout" for s in folder)


def test_missing_paths_are_clear_errors(tmp_path):
    for call in (lambda: read_wikitext(tmp_path / "wiki.test.raw"),
                 lambda: text_folder_sources(tmp_path / "missing"),
                 lambda: pg19_sources(tmp_path / "missing")):
        with pytest.raises(ValueError, match="does not exist") as info:
            call()
        assert isinstance(info.value, FileNotFoundError)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorpusNotFoundError, match="no files"):
        text_folder_sources(tmp_path / "empty")


def test_hf_dataset_offline(tmp_path):
    data = tmp_path / "rows.txt"
    data.write_text(" = Title One = \n Some text here about things .\n = = Sub = = \n more text .\n")
    docs = read_hf_dataset("text", split="train", data_files=str(data), cache_dir=str(tmp_path / "cache"))
    assert docs == [Document("Title One", "Some text here about things . more text .")]
    with pytest.raises(CorpusNotFoundError, match="not available offline"):
        read_hf_dataset("recurscope-tests/no-such-dataset", cache_dir=str(tmp_path / "cache"))
