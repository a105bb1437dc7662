"""Deterministic English-like filler text from a small hand-written grammar and vocabulary, cut into sources.

A source is one passage named by (split, integer id); its text is a pure function of (split, id, base seed), and the
dev, held-out and train splits draw from seeds that cannot coincide.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterator

from .tokenizer import encode_words
from .words import (  # the filler's closed word classes and inflections (re-exported names: FILLER_WORDS, ...)
    _COORDINATORS,
    _OBJECT_PRONOUNS,
    _PLURAL_DETERMINERS,
    _SINGULAR_DETERMINERS,
    _SUBJECT_PRONOUNS,
    _SUBORDINATORS,
    FILLER_WORDS,
    FillerLexicon,
    _gerund,
    _is_vowel,
    _past,
    _third_person,
    filler_vocabulary,
)

__all__ = [
    "SPLITS",
    "FILLER_WORDS",
    "FillerGrammar",
    "Source",
    "FillerSource",
    "TextSource",
    "FillerStream",
    "sources",
    "filler_vocabulary",
]

# Split names and the code each contributes to a source's seed; the code occupies its own bit field of the seed.
SPLITS = {"dev": 0, "heldout": 1, "train": 2}


class FillerGrammar(FillerLexicon):
    """Sentence generators over the filler word classes (interp.data.words.FillerLexicon)."""

    # --- phrase generators: each takes the caller's Random so a source's stream is a pure function of its seed ---

    def noun_phrase(self, rng: random.Random, plural: bool | None = None, allow_pp: bool = True) -> tuple[str, bool]:
        """Return (phrase, is_plural)."""
        if plural is None:
            plural = rng.random() < 0.35
        index = rng.choice(self.countable) if plural else rng.randrange(len(self.nouns_sg))
        noun = self.nouns_pl[index] if plural else self.nouns_sg[index]
        roll = rng.random()
        determiner = None
        if roll < 0.07:
            modifiers, determiner = [rng.choice(self.superlatives)], "the"
        elif roll < 0.17:
            modifiers = [rng.choice(self.adjectives), rng.choice(self.adjectives)]
        elif roll < 0.55:
            modifiers = [rng.choice(self.adjectives)]
        else:
            modifiers = []
        if determiner is None:
            determiner = rng.choice(_PLURAL_DETERMINERS if plural else _SINGULAR_DETERMINERS)
        words = modifiers + [noun]
        if determiner == "a" and _is_vowel(words[0][0]):
            determiner = "an"
        words.insert(0, determiner)
        if allow_pp and rng.random() < 0.2:
            words.append(self.prepositional_phrase(rng, allow_pp=False))
        return " ".join(words), plural

    def subject(self, rng: random.Random) -> tuple[str, bool]:
        if rng.random() < 0.2:
            pronoun = rng.choice(sorted(_SUBJECT_PRONOUNS))
            return pronoun, _SUBJECT_PRONOUNS[pronoun] == "pl"
        return self.noun_phrase(rng)

    def obj(self, rng: random.Random) -> str:
        if rng.random() < 0.12:
            return rng.choice(_OBJECT_PRONOUNS)
        return self.noun_phrase(rng)[0]

    def prepositional_phrase(self, rng: random.Random, allow_pp: bool = True) -> str:
        return rng.choice(self.prepositions) + " " + self.noun_phrase(rng, allow_pp=allow_pp)[0]

    def verb(self, rng: random.Random, transitive: bool, plural: bool, tense: str) -> str:
        base = rng.choice(self.transitive if transitive else self.intransitive)
        if tense == "past":
            return _past(base)
        if tense == "progressive":
            return ("were " if plural else "was ") + _gerund(base)
        return base if plural else _third_person(base)

    def clause(self, rng: random.Random, tense: str) -> str:
        """An independent clause: subject, verb, optional object, adverb and prepositional phrase."""
        subject, plural = self.subject(rng)
        transitive = rng.random() < 0.6
        parts = [subject]
        if rng.random() < 0.12:
            parts.append(rng.choice(self.adverbs))
        parts.append(self.verb(rng, transitive, plural, tense))
        if transitive:
            parts.append(self.obj(rng))
        if rng.random() < 0.35:
            parts.append(rng.choice(self.adverbs))
        if rng.random() < 0.45:
            parts.append(self.prepositional_phrase(rng))
        return " ".join(parts)

    def copular_clause(self, rng: random.Random, tense: str) -> str:
        subject, plural = self.subject(rng)
        be = ("were" if plural else "was") if tense != "present" else ("are" if plural else "is")
        if rng.random() < 0.3:
            return f"{subject} {be} {rng.choice(self.comparatives)} than {self.noun_phrase(rng, allow_pp=False)[0]}"
        return f"{subject} {be} {rng.choice(['', 'very ', 'quite ', 'rather ', 'too '])}{rng.choice(self.adjectives)}"

    def sentence(self, rng: random.Random) -> str:
        """One sentence from one of several clause structures, with its own punctuation."""
        tense = rng.choice(("past", "past", "present", "progressive"))
        form = rng.randrange(12)
        if form == 0:
            body, end = self.clause(rng, tense), "."
        elif form == 1:
            body, end = f"{self.prepositional_phrase(rng)}, {self.clause(rng, tense)}", "."
        elif form == 2:
            body = f"{rng.choice(_SUBORDINATORS)} {self.clause(rng, tense)}, {self.clause(rng, tense)}"
            end = "."
        elif form == 3:
            body = f"{self.clause(rng, tense)}, {rng.choice(_COORDINATORS)} {self.clause(rng, tense)}"
            end = "."
        elif form == 4:
            body, end = f"{self.clause(rng, tense)}; {self.clause(rng, tense)}", "."
        elif form == 5:
            noun, plural = self.noun_phrase(rng, allow_pp=False)
            verb = self.verb(rng, True, plural, tense)
            body = f"{noun} that {verb} {self.obj(rng)} {self.verb(rng, False, plural, tense)}"
            end = "."
        elif form == 6:
            body = f"{rng.choice(self.adverbs)}, {self.clause(rng, tense)}"
            end = rng.choice((".", ".", "!"))
        elif form == 7:
            subject, plural = self.subject(rng)
            aux = "did" if tense != "present" else ("do" if plural else "does")
            verb = rng.choice(self.transitive)
            body, end = f"{aux} {subject} {verb} {self.obj(rng)}", "?"
        elif form == 8:
            body = f"{self.copular_clause(rng, tense)}, but {self.copular_clause(rng, tense)}"
            end = "."
        elif form == 9:
            noun, plural = self.noun_phrase(rng)
            be = "were" if plural else "was"
            body, end = f"there {be} {noun} {self.prepositional_phrase(rng)}", "."
        elif form == 10:
            body = f"{self.clause(rng, tense)} {rng.choice(_SUBORDINATORS)} {self.clause(rng, tense)}"
            end = "."
        else:
            body = f"{self.copular_clause(rng, tense)}: {self.clause(rng, tense)}"
            end = "."
        return body + end


_GRAMMAR = FillerGrammar()


def _check_split(split: str) -> int:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {sorted(SPLITS)}; received {split!r}.")
    return SPLITS[split]


def source_seed(split: str, index: int, seed: int = 0) -> int:
    """The integer that seeds source (split, index) under base seed `seed`.

    Injective: index fills the low 40 bits, the split code the next 8 bits and the base seed the bits above, so two
    different (split, index, seed) triples can never share a seed.
    """
    code = _check_split(split)
    if not 0 <= index < 2 ** 40:
        raise ValueError(f"source index must be in [0, 2**40); received {index}.")
    if seed < 0:
        raise ValueError(f"seed must be a non-negative integer; received {seed}.")
    return (seed << 48) | (code << 40) | index


@dataclass(frozen=True)
class Source:
    """One passage used as filler: an integer id within a split, and a way to produce its text and tokens."""

    id: int
    split: str

    def sentences(self) -> Iterator[str]:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def origin(self) -> str:
        return "source"

    def text(self, n_sentences: int = 20) -> str:
        """The first `n_sentences` sentences (or chunks, for corpus sources) joined with spaces."""
        out = []
        for i, sentence in enumerate(self.sentences()):
            if i >= n_sentences:
                break
            out.append(sentence)
        return " ".join(out)

    def words(self, tokenizer, exclude_ids: frozenset[int] | set[int] = frozenset(),
              chunk_sentences: int = 16) -> Iterator[list[int]]:
        """This source's text as a stream of words, each the list of its token ids as they appear mid-sentence.

        Deterministic for a given tokenizer: sentences are encoded in fixed chunks. A word holding any token in
        `exclude_ids` (task keys and values) is skipped, so filler can never mention a task word.
        """
        chunk: list[str] = []
        iterator = self.sentences()
        while True:
            chunk.clear()
            for sentence in iterator:
                chunk.append(sentence)
                if len(chunk) >= chunk_sentences:
                    break
            if not chunk:
                return
            for word in encode_words(tokenizer, " ".join(chunk)):
                if not any(t in exclude_ids for t in word):
                    yield word

    def token_ids(self, tokenizer, n: int, exclude_ids: frozenset[int] | set[int] = frozenset()) -> list[int]:
        """Exactly `n` token ids from the start of this source (the last word may be cut); see `words`."""
        return self.stream(tokenizer, exclude_ids).take(n, whole_words=False)

    def stream(self, tokenizer, exclude_ids: frozenset[int] | set[int] = frozenset()) -> "FillerStream":
        """A cursor over this source's words that hands out exact token counts (see FillerStream)."""
        return FillerStream(self, self.words(tokenizer, exclude_ids))


class FillerStream:
    """Hands out consecutive filler chunks of exact token counts from a source's word stream.

    With whole_words=True a chunk starts and ends on word boundaries: words are taken in order and, when the next
    word would overshoot the count, the chunk restarts after the chunk's first word (that word is skipped). With
    one token per word (word-level tokenizers) nothing is ever skipped.
    """

    def __init__(self, source: Source, words: Iterator[list[int]]) -> None:
        self.source = source
        self._words = words
        self._buffer: list[list[int]] = []
        self.consumed_tokens = 0

    def _word(self, index: int) -> list[int]:
        while len(self._buffer) <= index:
            try:
                self._buffer.append(next(self._words))
            except StopIteration:
                raise ValueError(
                    f"{self.source.origin} source (split={self.source.split!r}, id={self.source.id}) ran out of "
                    f"filler after {self.consumed_tokens} tokens; use longer windows or fewer filler tokens."
                ) from None
        return self._buffer[index]

    def take(self, n: int, whole_words: bool = True) -> list[int]:
        if n < 0:
            raise ValueError(f"number of filler tokens must be >= 0; received {n}.")
        out: list[int] = []
        if not whole_words:
            index = 0
            while len(out) < n:
                out.extend(self._word(index))
                index += 1
            if len(out) > n:  # keep the cut word's tail for the next chunk
                tail = out[n:]
                out = out[:n]
                self._buffer[index - 1] = tail
                index -= 1
            del self._buffer[:index]
        else:
            first, total, index = 0, 0, 0
            while total != n:
                if first > 256:  # no exact word-aligned fit nearby (words all longer than n): cut a word instead
                    del self._buffer[:first]
                    return self.take(n, whole_words=False)
                word = self._word(index)
                if total + len(word) <= n:
                    total += len(word)
                    index += 1
                else:
                    total -= len(self._word(first))
                    first += 1
                    if first > index:
                        index = first
                        total = 0
            out = [t for i in range(first, index) for t in self._buffer[i]]
            del self._buffer[:index]
        self.consumed_tokens += len(out)
        return out


@dataclass(frozen=True)
class FillerSource(Source):
    """A source of generated filler: an unbounded stream of sentences, a pure function of (split, id, seed)."""

    seed: int = 0

    def __post_init__(self) -> None:
        source_seed(self.split, self.id, self.seed)  # validates all three

    @property
    def origin(self) -> str:
        return "filler"

    def sentences(self) -> Iterator[str]:
        rng = random.Random(source_seed(self.split, self.id, self.seed))
        while True:
            yield _GRAMMAR.sentence(rng)


@dataclass(frozen=True)
class TextSource(Source):
    """A fixed window of text from a corpus on disk (see interp.data.corpora)."""

    text_window: str = ""
    corpus: str = "corpus"
    document: str = ""

    @property
    def origin(self) -> str:
        return self.corpus

    def sentences(self) -> Iterator[str]:
        # Yield the window in word chunks so token_ids can stop early on long windows.
        words = self.text_window.split()
        for start in range(0, len(words), 64):
            yield " ".join(words[start:start + 64])


def sources(split: str, n: int, seed: int = 0, start: int = 0) -> list[FillerSource]:
    """The first `n` generated filler sources of `split` (ids start .. start+n-1) under base seed `seed`."""
    _check_split(split)
    if n < 0:
        raise ValueError(f"n (number of sources) must be >= 0; received {n}.")
    return [FillerSource(id=start + i, split=split, seed=seed) for i in range(n)]
