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
        # fla repeats k, v and the gate over a query group and keeps one identical copy of the state per query head
        mine = cache.layers[layer].state.repeat_interleave(ours.query_group, dim=1)
        assert (mine - theirs).abs().max().item() < 1e-4
    return ours, tokens


@pytest.mark.slow
@pytest.mark.parametrize("short_conv", [False, True])
def test_gla_matches_fla(tmp_path, short_conv):
    cfg = fla_models.GLAConfig(hidden_size=64, num_hidden_layers=2, num_heads=2, vocab_size=97,
                               use_short_conv=short_conv, fuse_cross_entropy=False)
    _compare(fla_models.GLAForCausalLM(cfg), tmp_path)


@pytest.mark.parametrize("short_conv", [False, True])
def test_gla_grouped_kv_heads_match_fla(tmp_path, short_conv):
    """GLA-7B's layout: num_kv_heads state groups, each read by num_heads / num_kv_heads query heads. Our model keeps
    one state per group (the unit an intervention edits); fla keeps one identical copy per query head."""
    cfg = fla_models.GLAConfig(hidden_size=64, num_hidden_layers=2, num_heads=4, num_kv_heads=2, vocab_size=97,
                               use_short_conv=short_conv, fuse_cross_entropy=False, tie_word_embeddings=True)
    ours, tokens = _compare(fla_models.GLAForCausalLM(cfg), tmp_path)
    assert ours.n_state_heads == 2 and ours.query_group == 2 and ours.heads() == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # stepping: the prefix's cache continued token by token gives the full run's logits
    with torch.no_grad():
        full, _ = ours(tokens, use_cache=True)
        _, cache = ours(tokens[:, :10], use_cache=True)
        for t in range(10, tokens.shape[1]):
            step, cache = ours(tokens[:, t:t + 1], cache=cache, use_cache=True)
            assert (step[:, 0] - full[:, t]).abs().max().item() < 1e-4
        assert cache.layers[0].state.shape[1] == 2


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
