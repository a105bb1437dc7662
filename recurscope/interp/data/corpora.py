"""Loaders for corpora already on disk (WikiText-103 raw, PG19, folders of .txt, cached HF datasets), cut into windows.

Each window is a TextSource, so recall pair builders take corpus filler through the same interface as generated
filler. Split rule: windows are numbered in document order; the first `dev_fraction` of them are "dev", the rest
"heldout" (split="all" returns every window), so the two splits never share a window.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from .filler import TextSource

__all__ = [
    "Document",
    "CorpusNotFoundError",
    "read_wikitext",
    "read_text_folder",
    "read_pg19",
    "read_hf_dataset",
    "corpus_sources",
    "wikitext_sources",
    "text_folder_sources",
    "pg19_sources",
    "hf_dataset_sources",
]


class CorpusNotFoundError(FileNotFoundError, ValueError):
    """A corpus path or cached dataset is missing (both a FileNotFoundError and a ValueError)."""


@dataclass(frozen=True)
class Document:
    name: str
    text: str


def _existing(path: str | os.PathLike, what: str, want_dir: bool | None = None) -> Path:
    path = Path(path)
    if not path.exists():
        raise CorpusNotFoundError(f"{what} path {str(path)!r} does not exist; pass the path of a {what} on disk.")
    if want_dir is True and not path.is_dir():
        raise CorpusNotFoundError(f"{what} path {str(path)!r} is not a directory; pass a folder of .txt files.")
    if want_dir is False and not path.is_file():
        raise CorpusNotFoundError(f"{what} path {str(path)!r} is not a file; pass e.g. .../wiki.valid.raw.")
    return path


_WIKI_TITLE = re.compile(r"^ = (?!=)(.+?) = $")
_WIKI_HEADING = re.compile(r"^ (= )+.*?( =)+ $")


def read_wikitext(path: str | os.PathLike) -> list[Document]:
    """Articles of a WikiText raw file (wiki.valid.raw, ...): split at " = Title = " lines; headings are dropped."""
    path = _existing(path, "WikiText raw file", want_dir=False)
    documents: list[Document] = []
    title, lines = None, []

    def flush() -> None:
        body = " ".join(line.strip() for line in lines if line.strip())
        if body:
            documents.append(Document(name=title or f"{path.name}:preamble", text=body))

    with path.open(encoding="utf-8") as handle:
        for raw in handle:
            line = raw.rstrip("\n")
            match = _WIKI_TITLE.match(line)
            if match:
                flush()
                title, lines = match.group(1).strip(), []
            elif _WIKI_HEADING.match(line):
                continue  # " = = Section = = " and deeper headings
            else:
                lines.append(line)
    flush()
    return documents


def read_text_folder(path: str | os.PathLike, pattern: str = "*.txt", recursive: bool = True) -> list[Document]:
    """Every file matching `pattern` under `path` (sorted by relative path), one document per file."""
    root = _existing(path, "text folder", want_dir=True)
    files = sorted(root.rglob(pattern) if recursive else root.glob(pattern))
    files = [f for f in files if f.is_file()]
    if not files:
        raise CorpusNotFoundError(f"text folder {str(root)!r} holds no files matching {pattern!r}.")
    return [Document(name=str(f.relative_to(root)), text=f.read_text(encoding="utf-8", errors="replace"))
            for f in files]


def read_pg19(path: str | os.PathLike) -> list[Document]:
    """PG19 books: a directory of .txt files (one book each, as in the PG19 release's split folders)."""
    return read_text_folder(path, "*.txt")


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    # datasets and huggingface_hub read the offline switches at import; set the env vars and the live constants.
    import datasets.config as dconfig

    saved_env = {k: os.environ.get(k) for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")}
    saved = (dconfig.HF_DATASETS_OFFLINE, dconfig.HF_HUB_OFFLINE)
    os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"
    dconfig.HF_DATASETS_OFFLINE = dconfig.HF_HUB_OFFLINE = True
    hub_constants = None
    try:
        import huggingface_hub.constants as hub_constants

        hub_saved = hub_constants.HF_HUB_OFFLINE
        hub_constants.HF_HUB_OFFLINE = True
    except (ImportError, AttributeError):
        hub_constants = None
    try:
        yield
    finally:
        dconfig.HF_DATASETS_OFFLINE, dconfig.HF_HUB_OFFLINE = saved
        if hub_constants is not None:
            hub_constants.HF_HUB_OFFLINE = hub_saved
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def read_hf_dataset(name: str, config: str | None = None, split: str = "validation", text_field: str = "text",
                    **load_kwargs) -> list[Document]:
    """Rows of a Hugging Face dataset that is already in the local cache (offline; never downloads).

    Consecutive rows are joined into one document, except that WikiText-style " = Title = " rows start a new one.
    Raises CorpusNotFoundError when the dataset is not cached.
    """
    import datasets

    try:
        with _offline():
            data = datasets.load_dataset(name, config, split=split, download_mode="reuse_cache_if_exists",
                                         **load_kwargs)
    except Exception as error:  # datasets raises several types (ConnectionError, FileNotFoundError, ...) offline
        raise CorpusNotFoundError(
            f"dataset {name!r} (config={config!r}, split={split!r}) is not available offline: {error}. Download it "
            f"once with datasets.load_dataset({name!r}, {config!r}) on a machine with network access, or point "
            f"HF_DATASETS_CACHE at a cache that holds it.") from error
    if text_field not in data.column_names:
        raise ValueError(f"text_field={text_field!r} is not a column of {name!r}; columns: {data.column_names}.")
    documents: list[Document] = []
    current: list[str] = []
    title = f"{name}:0"
    for index, row in enumerate(data[text_field]):
        match = _WIKI_TITLE.match(row.rstrip("\n"))
        if match:
            if current:
                documents.append(Document(title, " ".join(current)))
            title, current = match.group(1).strip(), []
        elif row.strip() and not _WIKI_HEADING.match(row.rstrip("\n")):
            current.append(row.strip())
    if current:
        documents.append(Document(title, " ".join(current)))
    return documents


def corpus_sources(documents: Sequence[Document], split: str = "dev", n: int | None = None,
                   window_words: int = 1024, dev_fraction: float = 0.5, corpus: str = "corpus") -> list[TextSource]:
    """Cut documents into windows of `window_words` whitespace words (short tails dropped) and return one split.

    Window ids are global (unique across splits). The first ceil(dev_fraction * W) windows are "dev", the rest
    "heldout"; split="all" returns all W. n limits the count (ValueError if fewer exist).
    """
    if split not in ("dev", "heldout", "all"):
        raise ValueError(f"split must be 'dev', 'heldout' or 'all'; received {split!r}.")
    if not isinstance(window_words, int) or window_words < 1:
        raise ValueError(f"window_words must be an integer >= 1; received {window_words!r}.")
    if not 0.0 <= dev_fraction <= 1.0:
        raise ValueError(f"dev_fraction must lie in [0, 1]; received {dev_fraction!r}.")
    windows: list[tuple[str, str]] = []
    for document in documents:
        words = document.text.split()
        for start in range(0, len(words) - window_words + 1, window_words):
            windows.append((document.name, " ".join(words[start:start + window_words])))
    n_dev = math.ceil(dev_fraction * len(windows))
    chosen = []
    for wid, (name, text) in enumerate(windows):
        wsplit = "dev" if wid < n_dev else "heldout"
        if split in ("all", wsplit):
            chosen.append(TextSource(id=wid, split=wsplit, text_window=text, corpus=corpus, document=name))
    if n is not None:
        if n > len(chosen):
            raise ValueError(f"{corpus}: only {len(chosen)} windows of {window_words} words in split {split!r} "
                             f"({len(windows)} in all); lower n={n} or window_words, or add text.")
        chosen = chosen[:n]
    return chosen


def wikitext_sources(path: str | os.PathLike, split: str = "dev", n: int | None = None, window_words: int = 1024,
                     dev_fraction: float = 0.5) -> list[TextSource]:
    """Windows of a WikiText raw file (headings skipped)."""
    return corpus_sources(read_wikitext(path), split, n, window_words, dev_fraction, corpus="wikitext")


def text_folder_sources(path: str | os.PathLike, split: str = "dev", n: int | None = None, window_words: int = 1024,
                        dev_fraction: float = 0.5, pattern: str = "*.txt") -> list[TextSource]:
    """Windows of a folder of text files."""
    return corpus_sources(read_text_folder(path, pattern), split, n, window_words, dev_fraction, corpus="text")


def pg19_sources(path: str | os.PathLike, split: str = "dev", n: int | None = None, window_words: int = 1024,
                 dev_fraction: float = 0.5) -> list[TextSource]:
    """Windows of a folder of PG19 books."""
    return corpus_sources(read_pg19(path), split, n, window_words, dev_fraction, corpus="pg19")


def hf_dataset_sources(name: str, config: str | None = None, hf_split: str = "validation", split: str = "dev",
                       n: int | None = None, window_words: int = 1024, dev_fraction: float = 0.5,
                       text_field: str = "text", **load_kwargs) -> list[TextSource]:
    """Windows of a locally cached Hugging Face dataset (see read_hf_dataset)."""
    documents = read_hf_dataset(name, config, hf_split, text_field, **load_kwargs)
    return corpus_sources(documents, split, n, window_words, dev_fraction, corpus=f"hf:{name}")
