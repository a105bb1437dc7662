"""Deterministic English-like filler text from a small hand-written grammar and vocabulary, cut into sources.

A source is one passage named by (split, integer id); its text is a pure function of (split, id, base seed), and the
dev, held-out and train splits draw from seeds that cannot coincide.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterator, Sequence

from .tokenizer import encode_words
from .words import RESERVED_WORDS

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

# ----------------------------------------------------------------------------------------------------------------------
# Word lists. Every word here is lowercase; inflected forms are generated below. Words that are task keys or values
# (interp.data.words.RESERVED_WORDS) are removed, together with all their inflections, so filler never states a fact.
# ----------------------------------------------------------------------------------------------------------------------

_NOUNS = """
time year day week month morning evening night hour minute season winter summer autumn moment age era century decade
man woman child family friend neighbour stranger teacher student doctor farmer baker miller sailor soldier captain king
queen prince princess knight merchant traveller worker writer painter singer dancer builder driver guard servant master
judge lawyer priest monk nurse clerk poet scholar hunter fisher shepherd carpenter potter weaver tailor smith cook
gardener pilot engineer officer mayor minister council crowd group team army village town country nation kingdom empire
region province district valley hill mountain river lake sea ocean island coast shore beach harbour bay forest wood
field meadow garden orchard farm road street path bridge tower castle palace church temple school library museum market
shop store office factory mill station hospital prison house home room hall kitchen cellar attic roof wall floor door
window gate fence stair chimney table chair bed desk shelf cupboard lamp candle mirror clock bell box basket bag bottle
cup plate bowl knife spoon fork pot pan kettle jar barrel bucket rope chain book letter note page paper story song poem
word name voice sound noise picture painting map sign signal message report record list plan idea thought dream memory
question answer reason problem matter truth secret promise rule law order trade price coin gift prize reward cost debt
bill account share stone rock clay cloth blanket pillow carpet curtain water fire flame smoke shadow moon cloud storm
wave tide current bread meat cheese butter milk honey soup grain seed root leaf branch tree flower bush stem trunk ship
boat cart wagon wheel engine machine tool hammer nail saw axe blade sword shield arrow spear helmet coat hat shoe boot
glove shirt dress cloak ring necklace crown head face eye ear nose mouth tongue tooth hand arm finger leg foot knee heart
bone shoulder neck journey visit meeting party festival feast dinner breakfast lunch supper game race battle war fight
struggle victory defeat chance choice change effect result purpose method system process structure pattern form level
degree amount quantity measure weight length distance height size part piece section corner edge centre side surface
line point space area bird insect cow pig duck chicken goose hen lamb calf worm beetle bee ant spider frog toad crow
pigeon sparrow swan salmon trout whale seal mountain canal ditch well pond spring stream fountain cliff cave desert plain
island lane avenue square yard porch balcony corridor staircase basement garage barn stable shed cottage cabin tent camp
harbour dock pier lighthouse anchor sail mast oar deck cabin cargo parcel package envelope stamp ticket coin purse wallet
pocket button thread needle ribbon lace scarf belt collar sleeve apron mask umbrella ladder bench stool cradle carriage
saddle bridle whip lantern torch match stove oven furnace hearth log plank beam brick tile pipe wire cable hook lock latch
handle knob switch screen engine motor pump valve gear lever spring bolt screw blanket towel sponge brush comb razor soap
teacup saucer tray napkin jug flask basin tub sink bath cellar vault chest trunk drawer cabinet wardrobe closet
"""

_MASS_NOUNS = set("""
water fire smoke bread meat cheese butter milk honey soup grain clay cloth paper cargo soap thread lace
""".split())

_IRREGULAR_PLURALS = {
    "man": "men", "woman": "women", "child": "children", "foot": "feet", "tooth": "teeth", "knife": "knives",
    "leaf": "leaves", "wolf": "wolves", "shelf": "shelves", "loaf": "loaves", "calf": "calves", "goose": "geese",
    "scarf": "scarves", "half": "halves", "life": "lives", "thief": "thieves",
}

_TRANSITIVE_VERBS = """
accept admire answer approach arrange ask avoid build burn call carry catch change chase check choose clean climb close
collect count cover cross cut describe destroy discover drag draw drop enter examine explain fill find follow forget
gather greet guard help hide hold hunt ignore imagine improve join keep kick know lead leave lift like lose love make mark
measure meet mend move notice obey offer open order paint pass pay pick place plant please pull push raise reach read
receive remember repair repeat rescue return ride save see seek sell send serve share show sign solve sort steal study
support surround take teach tell test thank throw touch trace train trust turn understand use visit wash watch wear
welcome win wrap write borrow lend bring buy fetch feed fold hang heat hire hurt knit lock load mix polish pour print
pack prepare protect punish recognise reject release remove rent replace seize shake sharpen sweep taste tie trade wake
warn weigh wipe hear feel bake boil chop grind roll stir cook ring
"""

_INTRANSITIVE_VERBS = """
arrive begin breathe cry dance fall fly grow happen hesitate hurry jump kneel laugh linger listen live march nod pause
play pray rest run rush sail shine shout sigh sing sit sleep smile speak stand stay stop swim talk travel wait walk
wander weep whisper work worry yawn agree appear complain continue disappear exist fade fail float glow hum knock labour
proceed recover remain retire settle shiver sparkle succeed suffer survive tremble vanish wonder drift stumble crawl
climb gaze glance grin frown blush cough sneeze stroll limp skip hop dive rise sink kneel bow wave smile
"""

# Past tense of irregular verbs; regular verbs are inflected by rule.
_IRREGULAR_PAST = {
    "build": "built", "catch": "caught", "choose": "chose", "cut": "cut", "draw": "drew", "find": "found",
    "forget": "forgot", "hide": "hid", "hold": "held", "keep": "kept", "know": "knew", "lead": "led", "leave": "left",
    "lose": "lost", "make": "made", "meet": "met", "pay": "paid", "read": "read", "ride": "rode", "see": "saw",
    "seek": "sought", "sell": "sold", "send": "sent", "steal": "stole", "take": "took", "teach": "taught",
    "tell": "told", "throw": "threw", "understand": "understood", "wear": "wore", "win": "won", "write": "wrote",
    "begin": "began", "fall": "fell", "fly": "flew", "grow": "grew", "kneel": "knelt", "run": "ran", "shine": "shone",
    "sing": "sang", "sit": "sat", "sleep": "slept", "speak": "spoke", "stand": "stood", "swim": "swam", "wake": "woke",
    "weep": "wept", "lend": "lent", "bring": "brought", "buy": "bought", "feed": "fed", "hang": "hung",
    "hurt": "hurt", "shake": "shook", "sweep": "swept", "hear": "heard", "feel": "felt", "grind": "ground",
    "ring": "rang", "rise": "rose", "sink": "sank", "dive": "dove",
}

# Verbs whose final consonant doubles before -ed / -ing.
_DOUBLING_VERBS = {
    "drop", "stop", "run", "swim", "sit", "begin", "cut", "hum", "nod", "grin", "skip", "hop", "knit", "plan", "chop",
    "stir", "wrap", "win", "shop", "rob",
}

_ADJECTIVES = """
able ancient angry anxious bare beautiful bitter blind bold brave bright brief broad busy calm careful certain cheap
clean clear clever close cold common complete cool correct cruel curious damp dark dead dear deep delicate different
difficult distant dry dull eager early easy empty equal even exact faint fair false familiar famous fast fat fierce
fine firm flat fond foolish foreign formal fresh full gentle glad grand grateful great happy hard harsh heavy high
hollow honest hot huge humble hungry idle ill important innocent kind large late lazy light little lively lonely long
loose loud low lucky mad mild modern narrow near neat new nice noble normal odd old open ordinary patient plain
pleasant polite poor popular possible powerful precious pretty private proud public pure quick quiet rare raw ready real
rich rough round rude sad safe scarce sharp short shy silent simple slight slow small smooth soft solid sorry sour steady
steep still strange strict strong sudden sure sweet swift tall tame tender thick thin tidy tight tiny tired tough true
ugly usual vast warm weak wet whole wide wild wise wooden young sleepy narrow merry weary bleak brisk crisp dusty frail
gloomy graceful grim hasty heavy jolly keen lame lean mighty misty muddy nervous peaceful plump rapid restless rusty
sacred shallow shabby sleek smoky snowy solemn sturdy sunny thirsty tranquil vivid windy wicked worthy icy cheerful
"""

# Adjectives that take -er / -est and an -ly adverb naturally; used to grow the vocabulary with real word forms.
_GRADABLE = """
bold brave bright calm cheap clean clear cold cool dark deep dull fair fast fierce fine firm fresh gentle grand happy
hard harsh heavy high kind late lazy light long loose loud low lucky mild narrow neat nice noble odd plain poor proud
pure quick quiet rare rich rough rude sad safe sharp short slow small smooth soft sour steady steep strange strict strong
sweet swift tall tame thick thin tidy tight tiny tough warm weak wide wild wise young angry busy easy early merry weary
"""

_ADVERBS_FROM = """
angry anxious bitter bold brave bright brief broad busy calm careful certain cheap clean clear clever close cold
common complete cool correct cruel curious dear deep eager easy equal exact faint fair false famous fierce firm
foolish formal fresh gentle glad grand grateful happy harsh heavy honest humble hungry idle lazy light lively loose
loud lucky mad mild narrow neat nice noble normal odd open ordinary patient plain pleasant polite poor proud public
quick quiet rare ready real rich rough rude sad safe sharp short silent simple slight slow smooth soft steady steep
strange strict strong sudden sure sweet swift tender thick tight tired usual warm weak wide wild wise hasty cheerful
"""

_PLAIN_ADVERBS = """
again always never often soon once twice almost already then there here now today yesterday tomorrow together alone
away back forward outside inside everywhere somewhere perhaps indeed rather quite very too also even later early
sometimes seldom finally suddenly meanwhile afterwards instead anyway besides
"""

_PREPOSITIONS = """
in on at by with without near beside behind before after under over above below across along around through toward
into onto from of about against among between beyond during past until upon within beneath
"""

_SUBORDINATORS = "when while because although though if since after before until unless once".split()
_COORDINATORS = "and but yet so".split()
_SINGULAR_DETERMINERS = "the a this that every each his her their our its my no one another".split()
_PLURAL_DETERMINERS = "the these those some many few several his her their our its my no two three both".split()
_SUBJECT_PRONOUNS = {"he": "sg", "she": "sg", "it": "sg", "they": "pl", "we": "pl", "you": "pl"}
_OBJECT_PRONOUNS = "him her it them us you".split()
_FUNCTION_WORDS = """
was were is are had has have did do does will would could should might must can not there what who which whom whose
where why how than as like also just only more most much very such own other same so
""".split()
_PUNCTUATION = [".", ",", ";", "?", "!", ":"]


def _split_words(text: str) -> list[str]:
    # Deduplicate while keeping first-seen order, so the vocabulary is deterministic.
    return list(dict.fromkeys(text.split()))


def _is_vowel(letter: str) -> bool:
    return letter in "aeiou"


def _plural(noun: str) -> str:
    if noun in _IRREGULAR_PLURALS:
        return _IRREGULAR_PLURALS[noun]
    if noun.endswith(("s", "x", "z", "ch", "sh")):
        return noun + "es"
    if noun.endswith("y") and not _is_vowel(noun[-2]):
        return noun[:-1] + "ies"
    return noun + "s"


def _third_person(verb: str) -> str:
    if verb.endswith(("s", "x", "z", "ch", "sh", "o")):
        return verb + "es"
    if verb.endswith("y") and not _is_vowel(verb[-2]):
        return verb[:-1] + "ies"
    return verb + "s"


def _past(verb: str) -> str:
    if verb in _IRREGULAR_PAST:
        return _IRREGULAR_PAST[verb]
    if verb in _DOUBLING_VERBS:
        return verb + verb[-1] + "ed"
    if verb.endswith("e"):
        return verb + "d"
    if verb.endswith("y") and not _is_vowel(verb[-2]):
        return verb[:-1] + "ied"
    return verb + "ed"


def _gerund(verb: str) -> str:
    if verb in _DOUBLING_VERBS:
        return verb + verb[-1] + "ing"
    if verb.endswith("ie"):
        return verb[:-2] + "ying"
    if verb.endswith("e") and not verb.endswith(("ee", "ye", "oe")):
        return verb[:-1] + "ing"
    return verb + "ing"


def _comparative(adjective: str) -> tuple[str, str]:
    stem = adjective
    if adjective.endswith("y") and not _is_vowel(adjective[-2]):
        stem = adjective[:-1] + "i"
    elif adjective.endswith("e"):
        return adjective + "r", adjective + "st"
    elif (len(adjective) >= 3 and not _is_vowel(adjective[-1]) and _is_vowel(adjective[-2])
          and not _is_vowel(adjective[-3]) and adjective[-1] not in "wxy"):
        stem = adjective + adjective[-1]
    return stem + "er", stem + "est"


def _adverb(adjective: str) -> str:
    if adjective.endswith("y") and not _is_vowel(adjective[-2]):
        return adjective[:-1] + "ily"
    if adjective.endswith("le"):
        return adjective[:-1] + "y"
    if adjective.endswith("ue"):
        return adjective[:-1] + "ly"
    if adjective.endswith("ll"):
        return adjective + "y"
    if adjective.endswith("ic"):
        return adjective + "ally"
    return adjective + "ly"


def _not_reserved(words: Sequence[str]) -> list[str]:
    return [w for w in words if w.lower() not in RESERVED_WORDS]


class FillerGrammar:
    """The word classes with their inflections, and sentence generators built on them.

    All word classes drop reserved task words (keys, values) and every inflection of a reserved stem.
    """

    def __init__(self) -> None:
        nouns = _not_reserved(_split_words(_NOUNS))
        self.nouns_sg = nouns
        self.nouns_pl = [n if n in _MASS_NOUNS else _plural(n) for n in nouns]
        self.countable = [i for i, n in enumerate(nouns) if n not in _MASS_NOUNS]
        self.transitive = _not_reserved(_split_words(_TRANSITIVE_VERBS))
        self.intransitive = _not_reserved([v for v in _split_words(_INTRANSITIVE_VERBS)])
        self.adjectives = _not_reserved(_split_words(_ADJECTIVES))
        gradable = [a for a in _not_reserved(_split_words(_GRADABLE)) if a in self.adjectives]
        self.comparatives = [_comparative(a)[0] for a in gradable]
        self.superlatives = [_comparative(a)[1] for a in gradable]
        self.adverbs = _not_reserved(
            [_adverb(a) for a in _split_words(_ADVERBS_FROM) if a in self.adjectives]
            + _split_words(_PLAIN_ADVERBS))
        self.prepositions = _split_words(_PREPOSITIONS)

    def words(self) -> list[str]:
        """Every word form this grammar can emit (lowercase, deduplicated, sorted), punctuation excluded."""
        forms: set[str] = set(self.nouns_sg) | set(self.nouns_pl)
        for verb in self.transitive + self.intransitive:
            forms.update((verb, _third_person(verb), _past(verb), _gerund(verb)))
        forms.update(self.adjectives, self.comparatives, self.superlatives, self.adverbs, self.prepositions)
        forms.update(_SUBORDINATORS, _COORDINATORS, _SINGULAR_DETERMINERS, _PLURAL_DETERMINERS)
        forms.update(_SUBJECT_PRONOUNS, _OBJECT_PRONOUNS, _FUNCTION_WORDS, ["an", "being", "been", "be"])
        return sorted(w for w in forms if w.lower() not in RESERVED_WORDS)

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
FILLER_WORDS: tuple[str, ...] = tuple(_GRAMMAR.words())


def filler_vocabulary() -> list[str]:
    """Every word the filler generator can emit, plus its punctuation marks."""
    return list(FILLER_WORDS) + list(_PUNCTUATION)


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
