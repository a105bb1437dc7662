"""Mamba-2 as an fla-format family: parity with fla 0.6.0's own Mamba2ForCausalLM (saved with fla's save_pretrained,
loaded with load_model), the documented hook meanings, stepping, and a state swap against a hand edit of the cache.

fla's CPU path (Mamba2.torch_forward) has two branches. Its prefill repeats B and C over the heads with `.repeat`
(head h reads group h % n_groups), its one-token decode with expand + reshape (head h reads group h // (H / n_groups)),
as mamba_ssm, transformers' Mamba2 and the gated norm's groups do. With n_groups = 1 the two agree and the prefill is
the reference; with n_groups > 1 recurscope follows the decode branch, which is checked token by token from an empty
cache.
"""
import os
import warnings

import pytest
import torch

from recurscope.hooks import StateReplace, hook_name, run_with_patches
from recurscope.interp.loading import load_model, save_model, state_from_fla
from recurscope.interp.models import ModelConfig

from helpers_models import (assert_steps_equal_the_full_run, assert_write_block_is_the_state_edit_that_removes_it,
                            tiny_model)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    fla_mamba2 = pytest.importorskip("fla.models.mamba2")

pytestmark = pytest.mark.usefixtures("fla_interpreter", "interpreted")
TOL = 1e-4


def fla_model(seed=0, **overrides):
    """A tiny random fla Mamba-2: 8 heads of 8 channels, states 8 x 8, dt and A drawn so the states matter."""
    kw = dict(vocab_size=53, hidden_size=32, state_size=8, num_hidden_layers=2, head_dim=8, expand=2, n_groups=1,
              conv_kernel=4, chunk_size=16, dt_min=0.3, dt_max=1.0, A_init_range=(0.05, 0.5),
              fuse_cross_entropy=False)
    kw.update(overrides)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = fla_mamba2.Mamba2ForCausalLM(fla_mamba2.Mamba2Config(**kw)).eval()
    with torch.no_grad():                     # move every weight off its init (norm weights and D included)
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def fla_decode_from_empty(model, tokens):
    """fla's one-token decode branch for every token, from a cache emptied after a one-token prefill."""
    with torch.no_grad():
        pkv = model(tokens[:, :1], use_cache=True).past_key_values
        for layer in range(model.config.num_hidden_layers):
            pkv[layer]["recurrent_state"].zero_()
            pkv[layer]["conv_state"].zero_()
        logits = []
        for t in range(tokens.shape[1]):
            out = model(tokens[:, t:t + 1], past_key_values=pkv, use_cache=True)
            pkv = out.past_key_values
            logits.append(out.logits)
    return torch.cat(logits, 1), pkv


@pytest.mark.parametrize("variant", [dict(), dict(D_has_hdim=True, norm_before_gate=True, use_bias=True)],
                         ids=["default", "D_per_channel+norm_first+bias"])
def test_matches_fla_prefill_with_idle_hooks(tmp_path, variant):
    ref_model = fla_model(**variant)
    ref_model.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    tokens = torch.randint(0, 53, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = ref_model(tokens, use_cache=True)
        logits, cache = ours(tokens, use_cache=True)
    assert (logits - ref.logits).abs().max().item() < TOL
    for layer in ours.recurrent_layers:
        theirs = state_from_fla(ref.past_key_values[layer]["recurrent_state"])     # fla keeps P x N per head
        assert cache.layers[layer].state.shape == (2, 8, 8, 8)
        assert (cache.layers[layer].state - theirs).abs().max().item() < TOL


def test_grouped_B_and_C_match_fla_decode(tmp_path):
    ref_model = fla_model(n_groups=2)
    ref_model.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    tokens = torch.randint(0, 53, (2, 13), generator=torch.Generator().manual_seed(2))
    ref_logits, pkv = fla_decode_from_empty(ref_model, tokens)
    with torch.no_grad():
        logits, cache = ours(tokens, use_cache=True)
    assert (logits - ref_logits).abs().max().item() < TOL
    for layer in ours.recurrent_layers:
        assert (cache.layers[layer].state - state_from_fla(pkv[layer]["recurrent_state"])).abs().max().item() < TOL


def test_fla_loads_what_save_model_writes(tmp_path):
    ours = tiny_model("mamba2", vocab_size=53)
    save_model(ours, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = fla_mamba2.Mamba2ForCausalLM.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, 53, (1, 11), generator=torch.Generator().manual_seed(3))
    ref_logits, _ = fla_decode_from_empty(theirs, tokens)          # n_groups = 2: fla's decode branch
    with torch.no_grad():
        assert (ours(tokens) - ref_logits).abs().max().item() < TOL


def test_hooks_hold_what_docs_hooks_md_says():
    """hook_state is the N x P state S_t; hook_head_out is its readout S_t^T C_t (hook_q), before the D skip."""
    model = tiny_model("mamba2")
    tokens = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, state_positions=[5, 11])
    for layer in model.recurrent_layers:
        S = cache[hook_name("hook_state", layer)]                   # (B, P, H, N, P)
        assert S.shape == (2, 2, 8, 8, 8)
        q = cache[hook_name("hook_q", layer)]                       # C, (B, T, H, N)
        o = cache[hook_name("hook_head_out", layer)]
        for i, t in enumerate((5, 11)):
            readout = torch.einsum("bhnp,bhn->bhp", S[:, i], q[:, t])
            torch.testing.assert_close(o[:, t], readout, atol=1e-5, rtol=1e-5)
        # B and C are shared within each group of 4 heads
        assert torch.equal(q[:, :, 0], q[:, :, 3]) and not torch.equal(q[:, :, 3], q[:, :, 4])


def test_stepping_token_by_token_equals_the_full_forward():
    tokens = torch.randint(0, 61, (2, 15), generator=torch.Generator().manual_seed(5))
    assert_steps_equal_the_full_run(tiny_model("mamba2"), tokens)


def test_state_swap_equals_a_hand_edit_of_the_cache_then_the_suffix():
    model = tiny_model("mamba2")
    gen = torch.Generator().manual_seed(6)
    tokens = torch.randint(0, 61, (2, 16), generator=gen)
    p, layer, head = 6, 1, 5
    new_state = torch.randn(2, 8, 8, generator=gen)                 # (B, N, P) for the one head
    with torch.no_grad():
        patched = run_with_patches(model, tokens, [StateReplace(layer, [head], p, new_state)])
        _, cache = model(tokens[:, :p + 1], use_cache=True)
        cache.layers[layer].state[:, head] = new_state
        suffix = model(tokens[:, p + 1:], cache=cache)
        clean = model(tokens)
    torch.testing.assert_close(patched[:, p + 1:], suffix, atol=1e-5, rtol=1e-5)
    assert (patched[:, p + 1:] - clean[:, p + 1:]).abs().max() > 1e-3    # the swap moved the later logits
    torch.testing.assert_close(patched[:, :p], clean[:, :p], atol=0, rtol=0)


def test_config_errors_name_the_option():
    base = dict(model_type="mamba2", vocab_size=61, hidden_size=32, num_hidden_layers=1, head_dim=8, state_size=8)
    with pytest.raises(ValueError, match=r"num_heads=2 but expand \* hidden_size / head_dim = 8"):
        ModelConfig.from_dict(dict(base, num_heads=2))
    with pytest.raises(ValueError, match=r"n_groups=3 does not divide num_heads=8"):
        ModelConfig.from_dict(dict(base, num_heads=8, n_groups=3))
    with pytest.raises(ValueError, match=r"expand_k=0.25 \(a gla option\)"):
        ModelConfig.from_dict(dict(base, num_heads=8, expand_k=0.25))
    cfg = ModelConfig.from_dict(dict(base, num_heads=8, dt_limit=[0.0, {"__float__": "Infinity"}]))
    assert cfg.state_shape() == (8, 8) and cfg.state_heads == 8


def test_a_write_block_equals_a_state_edit_that_removes_that_write():
    """Blocking head h's write at step p (WriteScale 0) equals replacing S_p by S_p - B_p (dt_p x_p)^T there: the
    write is exactly hook_write_key (B) times hook_write_value (dt x), and the block carries forward."""
    assert_write_block_is_the_state_edit_that_removes_it(tiny_model("mamba2"), layer=0, head=6, p=4)


def test_a_transformers_mamba2_checkpoint_is_told_from_fla_s(tmp_path):
    """transformers' Mamba-2 config.json has the same model_type ("mamba2") and class name as fla's: its keys
    (layer_norm_epsilon, time_step_limit) send it to the bridge (tests/interp/test_bridge_mamba.py loads it)."""
    import json

    from transformers import Mamba2Config

    from recurscope.interp.loading import checkpoint_format

    Mamba2Config(hidden_size=32, num_heads=8, head_dim=8, state_size=8, num_hidden_layers=1,
                 vocab_size=50).save_pretrained(tmp_path)
    assert checkpoint_format(json.loads((tmp_path / "config.json").read_text())) == "transformers"
    save_model(tiny_model("mamba2"), tmp_path / "fla")
    assert checkpoint_format(json.loads((tmp_path / "fla" / "config.json").read_text())) == "fla"
