"""Test-wide setup: Triton kernels run in the interpreter on a CPU (set before any triton.jit decorates a kernel),
and torch uses one thread: the tests use tiny shapes, where a second OpenMP thread only adds contention."""
import os

# setdefault so that a GPU run can override it with TRITON_INTERPRET=0.
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def word_tok():
    """The project's word-level tokenizer (every word the data generators emit)."""
    from recurscope.interp.data import build_word_tokenizer

    return build_word_tokenizer()


@pytest.fixture(scope="session")
def tiny_checkpoint(word_tok):
    """make(path, family="gla", seed=0): save a tiny random 2-layer model with the word tokenizer at `path`."""
    from recurscope.interp.loading import save_model
    from recurscope.interp.models import ModelConfig, RecurrentLM

    def make(path, family="gla", seed=0):
        torch.manual_seed(seed)
        extra = {} if family == "gla" else {"head_dim": 16}
        model = RecurrentLM(ModelConfig.from_dict(dict(model_type=family, vocab_size=len(word_tok), hidden_size=32,
                                                       num_hidden_layers=2, num_heads=2, **extra)))
        model.tokenizer = word_tok
        save_model(model, path)
        return path

    return make
