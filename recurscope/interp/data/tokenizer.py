"""Tokenizer helpers: the project's word-level tokenizer, and mid-sentence encoding that works for any HF tokenizer.

The pair and S-NIAH generators write each prompt as text and tokenise it once (`encode_text`), recovering spans
from character offsets (`span_tokens`); mid-sentence encoding (`encode_continuation`, `encode_words`) serves the
checks that a word is one token where a template puts it, the answer tokens after a query, and filler handed out as
token ids.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Sequence

from .words import default_word_list

__all__ = [
    "SPECIAL_TOKENS",
    "encode_continuation",
    "encode_words",
    "single_token_id",
    "single_token_ids",
    "token_strings",
    "build_word_tokenizer",
    "save_word_tokenizer",
    "load_word_tokenizer",
    "default_word_list",
]

SPECIAL_TOKENS = {"pad_token": "[PAD]", "unk_token": "[UNK]", "bos_token": "[BOS]", "eos_token": "[EOS]"}

# A plain word placed before a segment so the tokenizer treats the segment as mid-sentence (BPE leading-space
# tokens, SentencePiece word-boundary marks); its own ids are then stripped off.
_ANCHOR = "the"


def _encode_batch(tokenizer, texts: list[str]) -> list[list[int]]:
    if hasattr(tokenizer, "encode_batch") and not callable(getattr(tokenizer, "convert_ids_to_tokens", None)):
        # A raw `tokenizers.Tokenizer`.
        return [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
    return list(tokenizer(texts, add_special_tokens=False)["input_ids"])


def token_strings(tokenizer, ids: Sequence[int]) -> list[str]:
    """The token strings of `ids` (for error messages)."""
    if callable(getattr(tokenizer, "convert_ids_to_tokens", None)):
        return list(tokenizer.convert_ids_to_tokens(list(ids)))
    return [tokenizer.id_to_token(i) for i in ids]


def encode_continuation(tokenizer, text: str, leading_space: bool = True) -> list[int]:
    """Token ids of `text` as it appears mid-sentence (after a space when `leading_space`), without special tokens.

    Works for word-level, byte-level BPE (GPT-2 style `Ġword`) and SentencePiece (`▁word`) tokenizers: the text is
    encoded after an anchor word and the anchor's ids are removed. If the anchor's ids are not a prefix (a tokenizer
    that merges across the space), the text is encoded on its own instead.
    """
    if not text:
        return []
    joined = _ANCHOR + (" " if leading_space else "") + text
    anchor_ids, joined_ids = _encode_batch(tokenizer, [_ANCHOR, joined])
    if joined_ids[:len(anchor_ids)] == anchor_ids:
        return list(joined_ids[len(anchor_ids):])
    return list(_encode_batch(tokenizer, [(" " if leading_space else "") + text])[0])


def encode_words(tokenizer, text: str) -> list[list[int]]:
    """Token ids of `text` mid-sentence, grouped by the pre-tokenizer's words (a BPE word may span several tokens).

    Uses the fast tokenizer's word ids; tokenizers without them give one group per token.
    """
    if not text:
        return []
    if hasattr(tokenizer, "encode_batch") and not callable(getattr(tokenizer, "convert_ids_to_tokens", None)):
        encodings = tokenizer.encode_batch([_ANCHOR, _ANCHOR + " " + text], add_special_tokens=False)
        anchor_ids, ids, word_ids = encodings[0].ids, encodings[1].ids, encodings[1].word_ids
    else:
        batch = tokenizer([_ANCHOR, _ANCHOR + " " + text], add_special_tokens=False)
        anchor_ids, ids = batch["input_ids"][0], batch["input_ids"][1]
        try:
            word_ids = batch.word_ids(1)
        except (ValueError, AttributeError):  # slow tokenizers have no word ids
            word_ids = None
    if list(ids[:len(anchor_ids)]) != list(anchor_ids):
        return [[t] for t in encode_continuation(tokenizer, text)]
    start = len(anchor_ids)
    if word_ids is None or any(w is None for w in word_ids[start:]):
        return [[t] for t in ids[start:]]
    groups: list[list[int]] = []
    previous = None
    for token, word in zip(ids[start:], word_ids[start:]):
        if word != previous:
            groups.append([])
            previous = word
        groups[-1].append(token)
    return groups


def _unk_id(tokenizer) -> int | None:
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None and hasattr(tokenizer, "token_to_id"):
        unk = tokenizer.token_to_id(SPECIAL_TOKENS["unk_token"])
    return unk


def single_token_id(tokenizer, word: str) -> int:
    """The id of `word` as one token mid-sentence; ValueError naming the word and its tokenisation otherwise."""
    ids = encode_continuation(tokenizer, word)
    unk = _unk_id(tokenizer)
    if len(ids) != 1:
        raise ValueError(
            f"{word!r} is not a single token mid-sentence for this tokenizer: it tokenises as "
            f"{token_strings(tokenizer, ids)} ({len(ids)} tokens). Choose words that are single tokens, or pass "
            f"on_multitoken='filter' to drop them.")
    if unk is not None and ids[0] == unk:
        raise ValueError(
            f"{word!r} is unknown to this tokenizer (it maps to the unknown token id {unk}). Add it to the "
            f"tokenizer's vocabulary, or pass on_multitoken='filter' to drop it.")
    return ids[0]


def single_token_ids(tokenizer, words: Sequence[str], on_multitoken: str = "error",
                     what: str = "word") -> tuple[list[str], list[int], dict[str, list[str]]]:
    """Ids of `words` that are single tokens: returns (kept words, their ids, dropped word -> its tokens).

    on_multitoken='error' raises one ValueError naming every offending word and how it tokenised;
    'filter' drops them and reports them in the third return value.
    """
    if on_multitoken not in ("error", "filter"):
        raise ValueError(f"on_multitoken must be 'error' or 'filter'; received {on_multitoken!r}.")
    kept, ids, dropped = [], [], {}
    unk = _unk_id(tokenizer)
    for word in words:
        piece = encode_continuation(tokenizer, word)
        if len(piece) == 1 and (unk is None or piece[0] != unk):
            kept.append(word)
            ids.append(piece[0])
        else:
            dropped[word] = token_strings(tokenizer, piece)
    if dropped and on_multitoken == "error":
        detail = "; ".join(f"{w!r} -> {t}" for w, t in dropped.items())
        raise ValueError(
            f"{len(dropped)} {what}(s) are not single known tokens mid-sentence for this tokenizer: {detail}. "
            f"Use single-token words, or pass on_multitoken='filter' to drop them.")
    check_distinct_tokens(kept, ids, what)
    return kept, ids, dropped


def check_distinct_tokens(words: Sequence[str], ids: Sequence[int], what: str) -> None:
    """Two words of one list on the same token id would make their answers indistinguishable: refused by name."""
    by_id: dict[int, list[str]] = {}
    for word, token in zip(words, ids):
        by_id.setdefault(token, []).append(word)
    collisions = {token: ws for token, ws in by_id.items() if len(ws) > 1}
    if collisions:
        raise ValueError(f"several {what}s map to the same token id: {collisions}; {what}s must be distinct words "
                         f"with distinct tokens.")


def build_word_tokenizer(extra_words: Iterable[str] = ()):
    """A word-level `PreTrainedTokenizerFast` whose vocabulary is every word the generators emit plus `extra_words`.

    Model: tokenizers WordLevel; pre-tokenizer: split on whitespace, then isolate each punctuation mark; specials
    [PAD]=0, [UNK]=1, [BOS]=2, [EOS]=3; case-sensitive. Ids are assigned in sorted order after the specials, so the
    vocabulary is deterministic.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pre = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation("isolated")])
    words: set[str] = set()
    for word in list(default_word_list()) + list(extra_words):
        if not isinstance(word, str):
            raise ValueError(f"extra_words must be strings; received {word!r} ({type(word).__name__}).")
        words.update(piece for piece, _ in pre.pre_tokenize_str(word))
    specials = [SPECIAL_TOKENS[k] for k in ("pad_token", "unk_token", "bos_token", "eos_token")]
    vocab = {token: i for i, token in enumerate(specials)}
    for word in sorted(words - set(specials)):
        vocab[word] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL_TOKENS["unk_token"]))
    backend.pre_tokenizer = pre
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=True)  # joins words with spaces, tidies punctuation
    backend.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **SPECIAL_TOKENS)


def save_word_tokenizer(tokenizer, directory: str | os.PathLike) -> Path:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json to `directory`; return its path.

    The directory loads with `AutoTokenizer.from_pretrained(directory)` and the file with
    `PreTrainedTokenizerFast(tokenizer_file=directory / "tokenizer.json")`.
    """
    import json

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(directory))
    if not (directory / "tokenizer.json").exists():  # older transformers may only write the config
        tokenizer.backend_tokenizer.save(str(directory / "tokenizer.json"))
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    config.update(SPECIAL_TOKENS)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (directory / "special_tokens_map.json").write_text(json.dumps(SPECIAL_TOKENS, indent=2, sort_keys=True) + "\n")
    return directory


def load_word_tokenizer(directory: str | os.PathLike):
    """Load a tokenizer directory written by `save_word_tokenizer` (AutoTokenizer, with a clear error if missing)."""
    from transformers import AutoTokenizer

    directory = Path(directory)
    if not (directory / "tokenizer.json").is_file():
        raise ValueError(f"tokenizer directory {str(directory)!r} has no tokenizer.json; write it with "
                         f"save_word_tokenizer(tokenizer, directory) first.")
    return AutoTokenizer.from_pretrained(str(directory), trust_remote_code=False)


# --- whole-text encoding: the ids a model's own tokenizer gives a prompt, and where each character went ----------

def encode_text(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """`tokenizer(text).input_ids` (special tokens and BOS as the tokenizer's config says) and each token's
    character offsets in `text` ((0, 0) for special tokens). Needs a fast (Rust-backed) tokenizer for the offsets."""
    if hasattr(tokenizer, "encode_batch") and not callable(getattr(tokenizer, "convert_ids_to_tokens", None)):
        encoding = tokenizer.encode(text)   # a raw `tokenizers.Tokenizer`: its post-processor adds the specials
        return list(encoding.ids), [tuple(o) for o in encoding.offsets]
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"{type(tokenizer).__name__} is a slow tokenizer without character offsets; recall pairs "
                         "are built as text and need offsets: load the model's fast tokenizer (tokenizer.json).")
    encoding = tokenizer(text, return_offsets_mapping=True)
    return list(encoding["input_ids"]), [tuple(o) for o in encoding["offset_mapping"]]


def span_tokens(text: str, offsets: Sequence[tuple[int, int]], start: int, end: int) -> tuple[int, int] | None:
    """The half-open token span [a, b) that covers exactly the characters text[start:end]: every token overlapping
    them, provided those tokens hold nothing else but whitespace. None when a token also holds a neighbour's
    characters (the word's tokenisation merged with its context)."""
    hits = [i for i, (s, e) in enumerate(offsets) if e > s and s < end and e > start]
    if not hits or hits != list(range(hits[0], hits[-1] + 1)):
        return None
    first, last = offsets[hits[0]], offsets[hits[-1]]
    if text[first[0]:start].strip() or text[end:last[1]].strip():
        return None
    return hits[0], hits[-1] + 1


def decode_text(tokenizer, ids: Sequence[int]) -> str:
    """The text of `ids` as the tokenizer writes it back (for filler handed out as token ids)."""
    if hasattr(tokenizer, "encode_batch") and not callable(getattr(tokenizer, "convert_ids_to_tokens", None)):
        return tokenizer.decode(list(ids), skip_special_tokens=False)
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def require_tokenizer(tokenizer) -> None:
    """A clear error where a model without a tokenizer meets code that writes prompts as text."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer, and prompts are written as text for the model's own "
                         "tokenizer: pass --tokenizer DIR on the command line (a directory holding its tokenizer.json), "
                         "load it with load_model(dir, tokenizer=<a tokenizer or its directory>), or save its "
                         "tokenizer.json and tokenizer_config.json beside config.json.")


def vocabulary_hash(tokenizer) -> str:
    """A tokenizer's identity: sha256 over its vocabulary (token -> id, sorted), so pairs built with one tokenizer
    are refused on a model whose tokenizer differs even where the two vocabularies have the same size. Cached on
    the tokenizer per vocabulary size (adding tokens changes it)."""
    import hashlib
    import json

    try:
        size = len(tokenizer)
    except TypeError:          # a raw tokenizers.Tokenizer
        size = tokenizer.get_vocab_size(with_added_tokens=True)
    cached = getattr(tokenizer, "_recurscope_vocabulary_hash", None)
    if cached is not None and cached[0] == size:
        return cached[1]
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    digest = "sha256:" + hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()
    try:
        tokenizer._recurscope_vocabulary_hash = (size, digest)
    except AttributeError:     # objects without a __dict__ are hashed each time
        pass
    return digest
