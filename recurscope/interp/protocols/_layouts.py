"""Pair layouts shared by several protocols: the load curves' layouts and fixed total length (capacity, retention,
corrector) and the four-fact selectivity pairs (selectivity, coupling). Verbs import these, never each other."""
from __future__ import annotations

from recurscope.interp.protocols._common import PairSpec, max_length, pair_spec


#: K at and above which the high-load layout (one presentation per fact, 4-token gaps) is used.
HIGH_LOAD = 32


def load_layout(k: int, layout=None) -> PairSpec:
    """The pairs (a PairSpec; its filler is set by the caller) for K facts: `layout` (a PairSpec, PairLayout or
    layout name; default the §3.3 layout) with K facts below HIGH_LOAD, else the high-load layout, one presentation
    per fact with 4-token gaps."""
    if k >= HIGH_LOAD:
        return pair_spec(layout, n_facts=k, presentations=1, gap_tokens=4)
    return pair_spec(layout, n_facts=k)


def fixed_length_filler(tokenizer, layout: PairSpec, total_length: int) -> int:
    """The filler before the query that makes a sequence of `layout` exactly `total_length` tokens long; raises
    ValueError when the facts alone are longer."""
    filler = total_length - bare_length(tokenizer, layout)
    if filler < 0:
        raise ValueError(f"K={layout.layout.n_facts} needs {-filler} more tokens than the fixed total length "
                         f"{total_length}")
    return filler


def bare_length(tokenizer, layout: PairSpec) -> int:
    """The length of `layout`'s pairs without filler."""
    from recurscope.interp.data import build_pairs

    bare = build_pairs(tokenizer, split="heldout", n_sources=1, **layout.with_(filler_tokens=0).kwargs())
    return int(bare.recipient_ids.shape[1])


def build_selectivity_pairs(tokenizer, *, n_sources: int = 32, split: str = "heldout", model=None, layout=None):
    """Swap pairs with every fact queried (build_multifact_pairs) in `layout` (a PairSpec, PairLayout or layout
    name; default the §3.3 layout, _common.PROTOCOL_LAYOUT)."""
    from recurscope.interp.data import build_multifact_pairs

    return build_multifact_pairs(tokenizer, split=split, n_sources=n_sources,
                                 max_length=None if model is None else max_length(model),
                                 **pair_spec(layout).kwargs())
