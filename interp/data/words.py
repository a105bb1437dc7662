"""Task vocabularies shared by the recall and S-NIAH generators: key names, value vocabularies and numbers.

Every word here is reserved: the filler generator never emits it, so filler can never state or hint at a binding.
"""

from __future__ import annotations

__all__ = ["KEY_NAMES", "VALUE_VOCABS", "NUMBER_WORDS", "RESERVED_WORDS"]

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
