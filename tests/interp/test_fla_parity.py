"""Our models against fla 0.6.0's own forward on tiny random checkpoints saved with fla's save_pretrained."""
import os

import pytest
import torch

from recurscope.interp.loading import load_model, state_from_fla

fla_models = pytest.importorskip("fla.models")


# fla's Triton kernels in the interpreter: conftest's one-config autotune and loop-counter adjustments
pytestmark = pytest.mark.usefixtures("fla_interpreter", "interpreted")


def _compare(fla_model, tmp_path, T=24):
    torch.manual_seed(1)
    fla_model.eval()
    fla_model.save_pretrained(tmp_path)
    tokens = torch.randint(0, fla_model.config.vocab_size, (2, T))
    with torch.no_grad():
        ref = fla_model(tokens, use_cache=True)
        ours = load_model(tmp_path)
        logits, cache = ours(tokens, use_cache=True)
    assert (logits - ref.logits).abs().max().item() < 1e-4
    pkv = ref.past_key_values
    for layer in ours.recurrent_layers:
        theirs = state_from_fla(pkv[layer]["recurrent_state"])
        assert (cache.layers[layer].state - theirs).abs().max().item() < 1e-4
    return ours, tokens


@pytest.mark.slow
@pytest.mark.parametrize("short_conv", [False, True])
def test_gla_matches_fla(tmp_path, short_conv):
    cfg = fla_models.GLAConfig(hidden_size=64, num_hidden_layers=2, num_heads=2, vocab_size=97,
                               use_short_conv=short_conv, fuse_cross_entropy=False)
    _compare(fla_models.GLAForCausalLM(cfg), tmp_path)


def test_gla_grouped_kv_heads_match_fla(tmp_path):
    cfg = fla_models.GLAConfig(hidden_size=64, num_hidden_layers=1, num_heads=4, num_kv_heads=2, vocab_size=97,
                               fuse_cross_entropy=False, tie_word_embeddings=True)
    _compare(fla_models.GLAForCausalLM(cfg), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("variant", [dict(), dict(allow_neg_eigval=True), dict(num_v_heads=4, expand_v=1)])
def test_gated_deltanet_matches_fla(tmp_path, variant):
    cfg = fla_models.GatedDeltaNetConfig(hidden_size=64, num_hidden_layers=2, num_heads=2, head_dim=16,
                                         vocab_size=97, fuse_cross_entropy=False, **variant)
    _compare(fla_models.GatedDeltaNetForCausalLM(cfg), tmp_path, T=20)


def test_hybrid_config_builds_attention_where_fla_puts_it(tmp_path):
    # fla's Attention layer needs flash-attn, which cannot run on a CPU, so fla cannot build the hybrid here.
    # The attention math is checked against an independent softmax reference in test_attention_reference.py;
    # this test checks that an fla hybrid config places attention layers exactly where fla would.
    cfg = fla_models.GatedDeltaNetConfig(hidden_size=64, num_hidden_layers=3, num_heads=2, head_dim=16, vocab_size=97,
                                         attn={"layers": [1], "num_heads": 4, "num_kv_heads": 2}, fuse_cross_entropy=False)
    cfg.save_pretrained(tmp_path)
    from fla.models.configuration_utils import get_attention_spec

    from recurscope.interp.models import ModelConfig, RecurrentLM

    ours = RecurrentLM(ModelConfig.from_dict(cfg.to_dict()))
    expect = [layer for layer in range(3) if get_attention_spec(cfg.attn, layer_idx=layer) is not None]
    assert ours.attention_layers == expect == [1]
    assert ours.blocks[1].mixer.num_kv_heads == 2
