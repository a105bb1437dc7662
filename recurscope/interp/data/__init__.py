"""The data layer: generated filler text, local corpora, recall-task donor/recipient pairs, S-NIAH and tokenizers."""

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
from .niah import NEEDLE, NIAH_QUERY, NOISE_SENTENCES, NiahBatch, build_niah, niah_words
from .recall import (
    MisalignedPairError,
    TEMPLATES,
    VARIANTS,
    PairBatch,
    RecallPair,
    Template,
    build_multifact_pairs,
    build_neutral_pairs,
    build_pairs,
    build_update_pairs,
    iter_pairs,
    recall_words,
)
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
