"""Tokenizers for the data-layer tests: a small byte-level BPE, and `tok`, which runs a test on both it and the
project's word-level tokenizer (`word_tok`, from tests/conftest.py)."""

import pytest

from recurscope.interp.data import niah_words, recall_words, sources


def train_bpe(vocab_size: int = 2000, task_repeats: int = 30, extra_text: str = ""):
    """A GPT-2-style byte-level BPE trained here on generated filler plus repeated task words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    lines = [s.text(30) for s in sources("train", 10)]
    lines += [" ".join(recall_words() + niah_words())] * task_repeats
    if extra_text:
        lines.append(extra_text)
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(lines, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>",
                                   bos_token="<|endoftext|>", pad_token="<|endoftext|>")


@pytest.fixture(scope="session")
def bpe_tok():
    return train_bpe()


@pytest.fixture(scope="session", params=["word", "bpe"])
def tok(request, word_tok, bpe_tok):
    return word_tok if request.param == "word" else bpe_tok
