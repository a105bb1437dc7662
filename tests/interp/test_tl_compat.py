"""TransformerLens's surface on both model kinds (a native RecurrentLM and a bridged Qwen3.5, the bundled tiny-gla
and tiny-qwen35): the config aliases against the model's own tensors, tokens, W_E / W_U, forward's return types,
the ActivationCache and its state and readout accessors, generate, TransformerLens's own activation patching,
every hook name as a module path and an nnsight envoy on every native family, the one model protocol, and
rs.torch_reference."""
from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers_models import FAMILIES, tiny_model
from transformer_lens.ActivationCache import ActivationCache

from recurscope.interp.loading import load_model

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = ("tiny-gla", "tiny-qwen35")


@pytest.fixture(scope="module", params=BUNDLED)
def model(request):
    return load_model(request.param)


def _tokens(model, B=2, T=12, seed=0):
    return torch.randint(4, model.cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


def test_config_aliases_are_the_models_own_sizes(model):
    tokens = _tokens(model, B=1)
    _, cache = model.run_with_cache(tokens, state_positions=[3])
    layer = model.recurrent_layers[0]
    state = cache[f"blocks.{layer}.mixer.hook_state"]                 # (B, P, H, K, V)
    cfg = model.cfg
    assert cfg.n_layers == len(model.blocks)
    assert (cfg.d_vocab, cfg.d_model) == tuple(model.W_E.shape)
    assert cfg.d_model == cache["blocks.0.hook_resid_pre"].shape[-1]
    assert (cfg.n_heads, cfg.d_head) == tuple(state.shape[2:4]) and cfg.n_heads == model.n_state_heads
    assert cfg.n_ctx == cfg.max_position_embeddings
    assert cfg.device == model.W_E.device


def test_tokens_round_trip_through_the_tokenizer(model):
    tok = model.tokenizer
    text = "the cat sat on the mat"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert model.to_tokens(text).tolist() == [ids]
    assert model.to_tokens(text, prepend_bos=True).tolist() == [[tok.bos_token_id] + ids]
    assert model.to_str_tokens(text) == [tok.decode([i]) for i in ids]
    assert model.to_string(torch.tensor(ids)) == tok.decode(ids)
    two = model.to_tokens([text, "a dog"])
    assert two.shape == (2, len(ids)) and two[1, 2:].eq(tok.pad_token_id).all()
    assert model.to_single_token("cat") == ids[1]


def test_W_U_is_what_unembed_applies_after_the_final_norm(model):
    tokens = _tokens(model)
    _, cache = model.run_with_cache(tokens)
    last = cache[f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"]
    norm = model.norm if hasattr(model, "norm") else model.text_model[0].norm
    torch.testing.assert_close(norm(last) @ model.W_U, model(tokens), rtol=0, atol=1e-4)
    torch.testing.assert_close(model.W_E[tokens], cache["hook_embed"], rtol=0, atol=0)


def test_forward_return_types(model):
    tokens = _tokens(model)
    with torch.no_grad():
        logits = model(tokens)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        torch.testing.assert_close(model(tokens, return_type="loss"), loss)
        both_logits, both_loss = model(tokens, return_type="both")
        assert torch.equal(both_logits, logits) and torch.allclose(both_loss, loss)
        assert model(tokens, return_type=None) is None
        per_token = model(tokens, return_type="loss", loss_per_token=True)
        assert per_token.shape == (2, tokens.shape[1] - 1) and torch.allclose(per_token.mean(), loss)
        out, cache = model(tokens, return_type="loss", use_cache=True)
        assert torch.allclose(out, loss) and cache.seen_tokens == tokens.shape[1]
        text_logits = model("the cat sat")
        assert torch.equal(text_logits, model(model.to_tokens("the cat sat")))
    with pytest.raises(ValueError, match="return_type must be one of"):
        model(tokens, return_type="probs")


def test_run_with_cache_is_an_activation_cache_with_state_and_readout_stacks(model):
    tokens, positions = _tokens(model), [9, 4]
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens, state_positions=positions)
        _, plain = model.run_with_cache(tokens, return_cache_object=False)
        _, with_bos = model.run_with_cache("the cat sat", prepend_bos=True)
    assert isinstance(cache, ActivationCache) and type(plain) is dict
    layers, H = model.recurrent_layers, model.n_state_heads
    states, labels = cache.stack_states(return_labels=True)
    assert labels == layers and states.shape[:4] == (len(layers), 2, 2, H)
    for i, l in enumerate(layers):
        S = cache[f"blocks.{l}.mixer.hook_state"]
        assert torch.equal(states[i], S)
        assert torch.equal(cache.stack_states(position=4)[i], S[:, 0])    # positions are sorted: 4 first
    per_head, head_labels = cache.stack_head_states(9, return_labels=True)
    assert head_labels == [f"L{l}H{h}" for l, h in model.heads()]
    for j, (l, h) in enumerate(model.heads()):
        assert torch.equal(per_head[j], cache[f"blocks.{l}.mixer.hook_state"][:, 1, h])
        assert torch.equal(cache.stack_head_readouts()[j], cache[f"blocks.{l}.mixer.hook_head_out"][:, :, h])
        assert torch.equal(cache.stack_head_readouts("hook_z")[j], cache[f"blocks.{l}.mixer.hook_z"][:, :, h])
    assert cache.stack_readouts().shape[:3] == (len(layers), 2, tokens.shape[1])
    with pytest.raises(ValueError, match="was not captured"):
        cache.stack_states(position=5)
    torch.testing.assert_close(cache.accumulated_resid(layer=1)[-1], cache["blocks.0.hook_resid_post"])
    assert with_bos["hook_embed"].shape[1] == len(model.to_tokens("the cat sat")[0]) + 1


def test_generate_steps_equal_the_full_forward_and_sampling_is_seeded(model):
    prompt = _tokens(model, T=8, seed=3)
    with torch.no_grad():
        greedy = model.generate(prompt, max_new_tokens=6, do_sample=False, stop_at_eos=False)
        full = model(greedy)
        top1 = model.generate(prompt, max_new_tokens=6, top_k=1, stop_at_eos=False,
                              generator=torch.Generator().manual_seed(0))
        a, b = (model.generate(prompt, max_new_tokens=6, temperature=1.5, top_p=0.9, stop_at_eos=False,
                               generator=torch.Generator().manual_seed(1)) for _ in range(2))
        text = model.generate("the cat", max_new_tokens=3, do_sample=False)
    assert torch.equal(greedy[:, :8], prompt) and greedy.shape == (2, 14)
    assert torch.equal(full[:, 7:-1].argmax(-1), greedy[:, 8:])
    assert torch.equal(top1, greedy)                                   # top_k=1 leaves only the argmax
    assert torch.equal(a, b) and a.shape == greedy.shape
    assert isinstance(text, str) and text.startswith("the cat")
    with pytest.raises(ValueError, match="generate prompts of one length together"):
        model.generate(["the cat", "the cat sat on"], max_new_tokens=2)


def test_generate_stops_rows_at_eos():
    model = load_model("tiny-gla")
    prompt = _tokens(model, T=6, seed=4)
    with torch.no_grad():
        free = model.generate(prompt, max_new_tokens=5, do_sample=False, stop_at_eos=False)
        eos = int(free[0, 7])            # pretend the first row's second new token is EOS
        stopped = model.generate(prompt, max_new_tokens=5, do_sample=False, eos_token_id=eos)
    assert torch.equal(stopped[0, :8], free[0, :8]) and stopped[0, 8:].eq(eos).all()


def test_transformer_lens_activation_patching_runs(model):
    """TransformerLens's own get_act_patch_resid_pre: patching the embedding (layer 0's resid_pre) of the one
    token in which clean and corrupted differ gives the clean run's metric exactly, positions before it leave the
    corrupted run's, as causality demands."""
    from transformer_lens import patching

    clean = _tokens(model, B=1, T=8, seed=5)
    corrupted = clean.clone()
    corrupted[0, 5] = (clean[0, 5] + 1) % model.cfg.vocab_size
    target = int(clean[0, -1])

    def metric(logits):
        return logits[0, -1, target] - logits[0, -1].mean()

    with torch.no_grad():
        _, clean_cache = model.run_with_cache(clean)
        result = patching.get_act_patch_resid_pre(model, corrupted, clean_cache, metric)
        clean_metric, corrupted_metric = metric(model(clean)), metric(model(corrupted))
    assert result.shape == (model.cfg.n_layers, 8)
    torch.testing.assert_close(result[0, 5], clean_metric, rtol=0, atol=1e-4)
    torch.testing.assert_close(result[:, :5], corrupted_metric.expand(model.cfg.n_layers, 5), rtol=0, atol=1e-4)
    assert abs(float(clean_metric - corrupted_metric)) > 1e-3


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_hook_name_is_a_module_path_and_an_nnsight_envoy_on_every_native_family(family):
    from recurscope.hooks.nnsight import RecurscopeNNsight
    from recurscope.hooks.points import names_for

    model = tiny_model(family)
    model_nn = RecurscopeNNsight(model)
    assert names_for(model) == set(model.hook_dict)
    for name, point in model.hook_dict.items():
        assert model.get_submodule(name) is point
        assert model_nn.get(name)._module is point


def test_both_kinds_are_the_checked_recurrent_model_with_one_protocol():
    from recurscope.interp.bridge import BridgedLM, TransformersBridge
    from recurscope.interp.models.decoder import RecurrentLM
    from recurscope.interp.models.protocol import ProtocolMethods, RecurrentModel

    assert TransformersBridge is BridgedLM
    for name in ("recurrent_layers", "attention_layers", "n_state_heads", "family", "set_backend", "debug",
                 "run_with_cache", "heads"):   # defined once, not overridden by either kind
        assert name in ProtocolMethods.__dict__ and name not in RecurrentLM.__dict__ and name not in BridgedLM.__dict__
    for name in BUNDLED:
        model = load_model(name)
        assert isinstance(model, RecurrentModel)
        mixers = [model.blocks[l].mixer for l in model.recurrent_layers]
        model.debug = True
        assert model.debug and all(m.check_finite for m in mixers)
        model.debug = False
        model.set_backend("reference")
        assert all(m.backend == "reference" for m in mixers)
        with pytest.raises(ValueError, match="backend must be one of"):
            model.set_backend("cuda-magic")
    assert not isinstance(torch.nn.Linear(2, 2), RecurrentModel)


def test_the_scan_lists_heads_through_the_protocol():
    from recurscope.interp.scan import all_heads

    model = load_model("tiny-gla")
    assert all_heads(model) == model.heads()
    model.heads = lambda: [(1, 0)]       # a model that narrows its inventory is scanned on that inventory
    assert all_heads(model) == [(1, 0)]


def test_debug_names_a_nan_on_the_bridge_as_on_native_models():
    model = load_model("tiny-qwen35")
    tokens = _tokens(model, B=1)
    with torch.no_grad():
        model.blocks[0].mixer.dt_bias.fill_(float("nan"))
        model.debug = False
        assert torch.isnan(model(tokens)).any()      # no check: the NaN flows through
        model.debug = True
        with pytest.raises(ValueError, match="NaN|nan|finite"):
            model(tokens)


def test_torch_reference_runs_transformers_own_forward():
    """rs.torch_reference(): transformers' own forward of tiny-qwen35 on its torch path (fla would otherwise take
    the recurrence, whose Triton kernels need a GPU), equal to the bridge."""
    import recurscope as rs
    from transformers import AutoModelForCausalLM

    model = load_model("tiny-qwen35")
    hf = AutoModelForCausalLM.from_pretrained(str(model.checkpoint_dir)).eval()
    tokens = _tokens(model, B=1)
    with torch.no_grad():
        with rs.torch_reference():
            theirs = hf(input_ids=tokens).logits
        torch.testing.assert_close(model(tokens), theirs, rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", BUNDLED)
def test_nnsight_doc_example_runs_on_every_bundled_kind(name, tmp_path):
    text = (ROOT / "docs" / "nnsight.md").read_text()
    code = re.search(r"```python\n(.*?)```", text.split("## Using nnsight", 1)[1], re.S).group(1)
    assert 'load_model("tiny-qwen35")' in code
    script = tmp_path / "nnsight_example.py"   # nnsight reads the trace body from the source file
    script.write_text(code.replace('load_model("tiny-qwen35")', f'load_model("{name}")'))
    result = runpy.run_path(str(script), run_name="__main__")
    assert float((result["patched_logits"] - result["reference"]).abs().max()) < 1e-5


def test_quickstart_nnsight_cell_runs_on_tiny_qwen35(tmp_path):
    import json

    cells = json.loads((ROOT / "notebooks" / "01_quickstart.ipynb").read_text())["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    assert 'load_model("tiny-gla")' in code and "RecurscopeNNsight" in code
    script = tmp_path / "quickstart.py"
    script.write_text(code.replace('load_model("tiny-gla")', 'load_model("tiny-qwen35")'))
    with torch.no_grad():
        scope = runpy.run_path(str(script), run_name="__main__")
    assert type(scope["model"]).__name__ == "BridgedLM"
    assert float((scope["nn_logits"] - scope["hooked"]).abs().max()) < 1e-5


def test_the_transformer_lens_doc_runs_against_transformer_lens_own_bridge(tmp_path):
    """docs/transformer_lens.md's script as it stands: TransformerLens 4's own bridge of tiny-qwen35 gives the same
    logits, its state patch changes one readout while recurscope's carries forward, the write block keeps the
    erase, and the scan, interventions, TransformerLens's patching and generate run."""
    text = (ROOT / "docs" / "transformer_lens.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    script = tmp_path / "transformer_lens_doc.py"
    script.write_text(code)
    scope = runpy.run_path(str(script), run_name="__main__")
    assert scope["effect"].shape == (scope["model"].cfg.n_layers, 8)
