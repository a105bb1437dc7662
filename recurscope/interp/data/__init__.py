"""The data layer: generated filler text, local corpora, recall-task donor/recipient pairs, S-NIAH and tokenizers.

The pair builders (recall.py, niah.py) import torch; their names are imported on first use (the module
`__getattr__` below), so that the command line can read the layouts and word lists without torch.
"""
import importlib

from .corpora import (
    CorpusNotFoundError,
    Document,
    corpus_sources,
    hf_dataset_sources,
    pg19_sources,
    read_hf_dataset,
    read_pg19,
    read_text_folder,
    read_wikitext,
    text_folder_sources,
    wikitext_sources,
)
from .filler import (
    FILLER_WORDS,
    SPLITS,
    FillerGrammar,
    FillerSource,
    FillerStream,
    Source,
    TextSource,
    filler_vocabulary,
    source_seed,
    sources,
)
from .layout import DEFAULT_LAYOUT, LAYOUTS, PairLayout, recorded_layout, resolve_layout
from .tokenizer import (
    SPECIAL_TOKENS,
    build_word_tokenizer,
    decode_text,
    default_word_list,
    encode_continuation,
    encode_text,
    encode_words,
    load_word_tokenizer,
    save_word_tokenizer,
    single_token_id,
    single_token_ids,
    span_tokens,
    token_strings,
)
from .words import KEY_NAMES, NUMBER_WORDS, RESERVED_WORDS, VALUE_VOCABS

__all__ = [
    "CorpusNotFoundError", "Document", "corpus_sources", "hf_dataset_sources", "pg19_sources", "read_hf_dataset",
    "read_pg19", "read_text_folder", "read_wikitext", "text_folder_sources", "wikitext_sources",
    "FILLER_WORDS", "SPLITS", "FillerGrammar", "FillerSource", "FillerStream", "Source", "TextSource", "filler_vocabulary",
    "source_seed", "sources",
    "DEFAULT_LAYOUT", "LAYOUTS", "PairLayout", "recorded_layout", "resolve_layout",
    "NEEDLE", "NIAH_QUERY", "NOISE_SENTENCES", "NiahBatch", "build_niah", "niah_words",
    "MisalignedPairError", "TEMPLATES", "VARIANTS", "PairBatch", "RecallPair", "Template", "build_multifact_pairs", "build_neutral_pairs",
    "build_pairs", "build_update_pairs", "iter_pairs", "recall_words",
    "SPECIAL_TOKENS", "build_word_tokenizer", "decode_text", "default_word_list", "encode_continuation", "encode_text", "encode_words", "load_word_tokenizer",
    "save_word_tokenizer", "single_token_id", "single_token_ids", "span_tokens", "token_strings",
    "KEY_NAMES", "NUMBER_WORDS", "RESERVED_WORDS", "VALUE_VOCABS",
]

#: names of the torch-importing submodules, imported on first use
_LAZY = {
    **dict.fromkeys(("NEEDLE", "NIAH_QUERY", "NOISE_SENTENCES", "NiahBatch", "build_niah", "niah_words"), "niah"),
    **dict.fromkeys(("MisalignedPairError", "TEMPLATES", "VARIANTS", "PairBatch", "RecallPair", "Template",
                     "build_multifact_pairs", "build_neutral_pairs", "build_pairs", "build_update_pairs", "iter_pairs",
                     "recall_words"), "recall"),
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
