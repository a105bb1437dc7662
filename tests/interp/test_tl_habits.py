"""TransformerLens and nnsight habits on a native (tiny-gla) and a bridged (tiny-qwen35) model: TransformerLens's
attn_out and block sweeps run under its own names and equal the same patches by hand; its residual-decomposition
helpers that assume its own internals are refused in one line each and listed in docs/transformer_lens.md; reading
hook_state in nnsight without state_positions names state_positions; docs/nnsight.md gives the supported wrapper."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from transformer_lens import patching

from recurscope.interp.loading import load_model

ROOT = Path(__file__).resolve().parents[2]
REFUSED = ("logit_attrs", "decompose_resid", "apply_ln_to_stack", "get_full_resid_decomposition",
           "stack_head_results", "compute_head_results", "stack_neuron_results")


@pytest.fixture(scope="module", params=("tiny-gla", "tiny-qwen35"))
def model(request):
    return load_model(request.param)


def _pair(model, T=7):
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(4, model.cfg.vocab_size, (1, T), generator=g)
    corrupted = clean.clone()
    corrupted[0, 2] = (clean[0, 2] + 1) % model.cfg.vocab_size
    return clean, corrupted


def _metric(answer):
    return lambda logits: logits[0, -1, answer] - logits[0, -1].mean()


def _by_hand(model, corrupted, clean_cache, point, metric):
    """(layers, positions): the metric with `point` of one layer at one position set to the clean run's."""
    out = torch.zeros(model.cfg.n_layers, corrupted.shape[1])
    for layer in range(model.cfg.n_layers):
        name = f"blocks.{layer}.{point}"
        for pos in range(corrupted.shape[1]):
            def put(act, hook, pos=pos, name=name):
                act = act.clone()
                act[:, pos] = clean_cache[name][:, pos]
                return act
            out[layer, pos] = metric(model.run_with_hooks(corrupted, fwd_hooks=[(name, put)]))
    return out


def test_attn_out_and_block_sweeps_equal_the_patches_by_hand(model):
    clean, corrupted = _pair(model)
    metric = _metric(int(clean[0, -1]))
    with torch.no_grad():
        _, cache = model.run_with_cache(clean)
        attn = patching.get_act_patch_attn_out(model, corrupted, cache, metric)
        every = patching.get_act_patch_block_every(model, corrupted, cache, metric)
        by_hand = _by_hand(model, corrupted, cache, "hook_mixer_out", metric)
        resid = _by_hand(model, corrupted, cache, "hook_resid_pre", metric)
        mlp = _by_hand(model, corrupted, cache, "hook_mlp_out", metric)
    assert torch.allclose(attn, by_hand, atol=1e-5)
    assert every.shape == (3, model.cfg.n_layers, clean.shape[1])
    assert torch.allclose(every[0], resid, atol=1e-5) and torch.allclose(every[1], by_hand, atol=1e-5)
    assert torch.allclose(every[2], mlp, atol=1e-5)
    # The corrupted token's residual at its own position carries the whole difference: patching it restores clean.
    assert (by_hand - metric(model(corrupted))).abs().max() > 1e-4


def test_attn_out_is_the_mixer_output_in_the_cache_and_names_filter(model):
    clean, _ = _pair(model)
    _, cache = model.run_with_cache(clean)
    for layer in range(model.cfg.n_layers):
        assert torch.equal(cache["attn_out", layer], cache[f"blocks.{layer}.hook_mixer_out"])
        assert torch.equal(cache[f"blocks.{layer}.hook_attn_out"], cache[f"blocks.{layer}.hook_mixer_out"])
    assert torch.equal(cache["attn_out", -1], cache[f"blocks.{model.cfg.n_layers - 1}.hook_mixer_out"])
    _, only = model.run_with_cache(clean, names_filter=["blocks.0.hook_attn_out"])
    assert list(only.keys()) == ["blocks.0.hook_mixer_out"]


@pytest.mark.parametrize("name", REFUSED)
def test_residual_decomposition_helpers_are_refused_in_one_line(model, name):
    clean, _ = _pair(model)
    _, cache = model.run_with_cache(clean)
    stack = cache.stack_activation("resid_post")
    args = {"logit_attrs": (stack,), "apply_ln_to_stack": (stack,), "stack_neuron_results": (1,)}.get(name, ())
    with pytest.raises(NotImplementedError) as err:
        getattr(cache, name)(*args)
    message = str(err.value)
    assert "\n" not in message and name in message and "recurscope's models" in message
    limits = (ROOT / "docs" / "transformer_lens.md").read_text().split("## Limits", 1)[1]
    assert f"`{name}`" in limits


def test_hook_state_without_state_positions_names_them_in_nnsight(model):
    from recurscope.hooks.nnsight import RecurscopeNNsight, StateNotCapturedError

    clean, _ = _pair(model)
    layer = model.recurrent_layers[0]
    model_nn = RecurscopeNNsight(model)
    with pytest.raises(StateNotCapturedError, match=r"state_positions=\[t\]"):
        with model_nn.trace(clean):
            model_nn.blocks[layer].mixer.hook_state.output.save()
    with model_nn.trace(clean, state_positions=[3]):     # with them, the same read works
        state = model_nn.blocks[layer].mixer.hook_state.output.save()
    _, cache = model.run_with_cache(clean, state_positions=[3])
    assert torch.allclose(state, cache[f"blocks.{layer}.mixer.hook_state"])


def test_the_docs_name_the_wrapper_that_nnsight_language_model_is_not(model):
    """nnsight.LanguageModel wraps transformers models through a pipeline and does not take recurscope's models;
    docs/nnsight.md says so in one line, naming RecurscopeNNsight, whose trace gives the model's own logits."""
    import nnsight

    from recurscope.hooks.nnsight import RecurscopeNNsight

    with pytest.raises(Exception):
        nnsight.LanguageModel(model)
    text = (ROOT / "docs" / "nnsight.md").read_text()
    lines = [line for line in text.splitlines() if "nnsight.LanguageModel" in line]
    assert any("RecurscopeNNsight(model)" in line for line in lines), lines
    clean, _ = _pair(model)
    model_nn = RecurscopeNNsight(model)
    with torch.no_grad():
        with model_nn.trace(clean):
            logits = model_nn.output.save()
        assert torch.allclose(logits, model(clean), atol=1e-6)
    assert re.search(r"`RecurscopeNNsight\(model\)`", text)
