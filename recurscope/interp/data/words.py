"""Every word the generators in interp.data can emit, in one place: task keys, values and numbers, the recall
templates, the S-NIAH sentences and the filler lexicon with its inflections.

Task words (keys, values, numbers) are reserved: the filler lexicon drops them and every inflection of them, so filler
can never state or hint at a binding. This module imports nothing from the rest of interp.data; the generators and
the tokenizer import their words from here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

__all__ = ["KEY_NAMES", "VALUE_VOCABS", "NUMBER_WORDS", "RESERVED_WORDS", "Template", "TEMPLATES",
           "NATURAL_TEMPLATES", "LAYOUT_TEMPLATES", "recall_words",
           "NOISE_SENTENCES", "NEEDLE", "NIAH_QUERY", "niah_words", "FillerLexicon", "FILLER_WORDS",
           "filler_vocabulary", "default_word_list"]

# Single-word given names; 96 of them so that K up to 64 bindings can use distinct keys.
KEY_NAMES: tuple[str, ...] = tuple("""
Alice Bob Carol David Emma Frank Grace Henry Irene Jack Kevin Laura Maria Nancy Oliver Peter Quinn Rachel Simon Tina
Ursula Victor Wendy Xavier Yvonne Zach Aaron Bella Caleb Diana Ethan Fiona George Hannah Isaac Julia Kyle Lily Mason
Nora Oscar Paula Ryan Sarah Thomas Uma Vera Walter Amy Brian Chloe Daniel Eva Felix Gina Hugo Ivy Jason Karen Leo Mia
Noah Olga Paul Rita Sam Tara Vincent Wanda Yusuf Zoe Adam Ben Clara Derek Elena Fred Helen Igor Jenny Kurt Lucy Max
Nina Owen Pablo Ruth Steve Tom Anna
""".split())

# Value vocabularies: each at least 8 single words, distinct across vocabularies.
VALUE_VOCABS: dict[str, tuple[str, ...]] = {
    "cities": tuple("""Paris London Tokyo Berlin Madrid Rome Cairo Lima Oslo Vienna Prague Dublin Athens Moscow Delhi
        Sydney Toronto Boston Chicago Denver Seattle Houston Dallas Miami""".split()),
    "colours": tuple("red blue green yellow purple orange pink brown black white grey silver gold violet".split()),
    "shapes": tuple("circle square triangle oval star cube sphere cone pyramid diamond hexagon cylinder".split()),
    "animals": tuple("cat dog horse tiger lion rabbit wolf fox bear eagle owl snake mouse sheep goat deer".split()),
    "instruments": tuple("piano violin guitar drum flute trumpet harp cello banjo organ clarinet trombone".split()),
    "fruits": tuple("apple banana cherry grape lemon mango peach pear plum melon".split()),
}

# Two-digit numbers: the S-NIAH value vocabulary (single tokens in most BPE vocabularies).
NUMBER_WORDS: tuple[str, ...] = tuple(str(n) for n in range(10, 100))

RESERVED_WORDS: frozenset[str] = frozenset(
    w.lower() for w in KEY_NAMES + sum(VALUE_VOCABS.values(), ()) + NUMBER_WORDS)


def _check_tables() -> None:
    # Guard the invariants the builders rely on; a failed edit of the lists above fails at import.
    assert len(set(KEY_NAMES)) == len(KEY_NAMES) >= 64
    all_values = sum(VALUE_VOCABS.values(), ())
    assert len(set(v.lower() for v in all_values)) == len(all_values)
    assert all(len(v) >= 8 for v in VALUE_VOCABS.values())
    assert not set(k.lower() for k in KEY_NAMES) & set(v.lower() for v in all_values)


_check_tables()


# --- recall templates ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Template:
    """A fact sentence with one {key} and one {value}, and a query prompt whose next token is the value.

    A slot must follow a space (or start the text); punctuation written against a word ("is in {value}.") is encoded
    without a leading space.
    """

    name: str
    fact: str
    query: str

    def __post_init__(self) -> None:
        if self.fact.count("{key}") != 1 or self.fact.count("{value}") != 1:
            raise ValueError(f"template {self.name!r}: fact must contain exactly one {{key}} and one {{value}}; "
                             f"received {self.fact!r}.")
        if "{value}" in self.query or "{key}" not in self.query:
            raise ValueError(f"template {self.name!r}: query must contain {{key}} and no {{value}} (the value is "
                             f"the answer, the token right after the prompt); received {self.query!r}.")
        for text in (self.fact, self.query):
            for match in re.finditer(r"\{(key|value)\}", text):
                if match.start() > 0 and not text[match.start() - 1].isspace():
                    raise ValueError(f"template {self.name!r}: a slot must follow a space or start the text; "
                                     f"received {text!r}.")
            if re.sub(r"\{(key|value)\}", "", text).count("{") or re.sub(r"\{(key|value)\}", "", text).count("}"):
                raise ValueError(f"template {self.name!r}: only {{key}} and {{value}} slots are allowed; "
                                 f"received {text!r}.")

    def words(self) -> list[str]:
        """The literal words and punctuation marks of the fact and the query."""
        text = re.sub(r"\{(key|value)\}", " ", self.fact + " " + self.query)
        return re.findall(r"\w+|[^\w\s]", text)


TEMPLATES: dict[str, Template] = {
    t.name: t for t in (
        Template("is_in", "{key} is in {value}.", "where is {key}? {key} is in"),
        Template("colon", "{key}: {value};", "{key}:"),
        Template("belongs", "the {value} belongs to {key}.", "what belongs to {key}? the"),
        Template("likes", "{key} likes the {value}.", "what does {key} like? {key} likes the"),
        Template("value_of", "the value of {key} is {value}.", "so the value of {key} is"),
    )
}


#: Natural-sentence fact presentation for the capability gate (App. F.2). Kept out of TEMPLATES so that the default
#: template set, recall_words() and every existing golden digest stay as they were; build_pairs resolves these names
#: too. Every word is in the bundled tokenizers' filler lexicon.
NATURAL_TEMPLATES: dict[str, Template] = {
    t.name: t for t in (
        Template("natural_lives", "{key} moved to the town of {value} and now lives there.",
                 "where does {key} live now? {key} lives in"),
    )
}


#: The paper layout's template (interp.data.layout): the fact "KEY VALUE." and a query that is the key alone, one
#: token, whose next token is the value. Kept out of TEMPLATES for the same reason as NATURAL_TEMPLATES.
LAYOUT_TEMPLATES: dict[str, Template] = {
    t.name: t for t in (
        Template("key_value", "{key} {value}.", "{key}"),
    )
}


def recall_words() -> list[str]:
    """Every word the recall task can emit besides filler: keys, values of every vocabulary, template words."""
    words: list[str] = list(KEY_NAMES)
    for values in VALUE_VOCABS.values():
        words.extend(values)
    for template in TEMPLATES.values():
        words.extend(template.words())
    return list(dict.fromkeys(words))


# --- S-NIAH ------------------------------------------------------------------------------------------------------

NOISE_SENTENCES: tuple[str, ...] = (
    "The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
NEEDLE = "the special magic number for {key} is {value}."
NIAH_QUERY = "what is the special magic number for {key}? the special magic number for {key} is"


def niah_words() -> list[str]:
    """Every word and punctuation mark the S-NIAH generator can emit (keys and numbers included)."""
    text = " ".join(NOISE_SENTENCES) + " " + NEEDLE + " " + NIAH_QUERY
    words = re.findall(r"\w+|[^\w\s]", re.sub(r"\{(key|value)\}", " ", text))
    return list(dict.fromkeys(words + list(KEY_NAMES) + list(NUMBER_WORDS)))


# --- filler lexicon -----------------------------------------------------------------------------------------------
# Every word here is lowercase; inflected forms are generated below. Words that are task keys or values
# (RESERVED_WORDS) are removed, together with all their inflections, so filler never states a fact.

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


class FillerLexicon:
    """The filler's word classes with their inflections (interp.data.filler.FillerGrammar adds the sentences).

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


FILLER_WORDS: tuple[str, ...] = tuple(FillerLexicon().words())


def filler_vocabulary() -> list[str]:
    """Every word the filler generator can emit, plus its punctuation marks."""
    return list(FILLER_WORDS) + list(_PUNCTUATION)


def default_word_list() -> list[str]:
    """Every word the generators in interp.data can emit: filler words, keys, values, template and S-NIAH words."""
    return list(dict.fromkeys(filler_vocabulary() + recall_words() + niah_words()))
