"""The transformers bridge on Qwen3-Next, OLMo-hybrid and Kimi-Linear: tiny random checkpoints built from
transformers' own config classes and saved with save_pretrained.

The per-layout checks are test_bridge.py's own (parity with transformers' torch path with idle hooks, stepping,
the state patch against a hand edit of transformers' cache, write patches that keep the erase, the interventions,
the head scan against one full patched forward per head);
importing them here makes pytest collect them once more, with this module's `checkpoint` fixture over these three
families (among them the per-component cache swaps, the hook_state captures and the hook tables of docs/hooks.md).
Added here: single-token steps against transformers' own decode, per-head K/V swaps past the cached heads refused,
the refusal of a transformers hybrid the bridge does not know, and one CLI smoke."""
import pytest
import torch
from test_bridge import (  # noqa: F401  (collected here with this module's checkpoint fixture)
    _patch_cli_runs_the_five_interventions, tiny_checkpoint,
    test_a_state_patch_through_nnsight_equals_run_with_patches,
    test_component_swaps_equal_the_same_swaps_in_transformers_cache,
    test_every_hook_name_is_a_module_path_and_an_nnsight_envoy, test_greedy_generate_equals_transformers_generate,
    test_conv_tail_spans_reach_as_far_as_the_conv_transformers_runs,
    test_corrected_logits_equal_the_hooked_forward, test_hook_state_at_requested_positions_is_transformers_own_state,
    test_interventions_run_through_the_protocol, test_the_bridge_hook_tables_of_the_docs_are_the_models_hook_points,
    test_lens_after_the_last_layer_is_the_model_itself, test_loads_as_a_bridge_with_the_project_hooks,
    test_parity_with_transformers_torch_path_hooks_idle, test_state_patch_equals_a_hand_edit_of_the_transformers_cache,
    test_scan_equals_one_full_patched_forward_per_head, test_stepping_equals_the_full_run,
    test_unembed_of_the_last_residual_is_transformers_own_logits,
    test_write_patches_keep_the_erase,
)

from recurscope.interp.bridge.torch_path import torch_reference_path
from recurscope.interp.loading import load_model

LAYOUTS = ("qwen3_next", "olmo_hybrid", "kimi_linear")
LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"]   # 3:1, the attention last
GDN = dict(linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=16,
           linear_conv_kernel_dim=4)
DECODER = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64,
               layer_types=LAYER_TYPES, initializer_range=0.05, pad_token_id=None, bos_token_id=None,
               eos_token_id=None)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=24)


def _build(layout: str, vocab: int):
    import transformers as tf

    if layout == "qwen3_next":   # fused in_proj_qkvz / in_proj_ba, gated attention, MoE in every layer
        cfg = tf.Qwen3NextConfig(vocab_size=vocab, num_key_value_heads=1, head_dim=16, num_experts=4,
                                 shared_expert_intermediate_size=24, decoder_sparse_step=1, **MOE, **GDN, **DECODER)
        return tf.Qwen3NextForCausalLM(cfg), tf.Qwen3NextForCausalLM
    if layout == "olmo_hybrid":   # separate projections, beta in [0, 2], post-norm attention layers without RoPE
        # (NoPE, as the released checkpoints; RoPE positions across prefix and suffix are covered by Qwen3-Next)
        cfg = tf.OlmoHybridConfig(vocab_size=vocab, num_key_value_heads=1, linear_allow_neg_eigval=True,
                                  rope_parameters={"rope_type": "default", "rope_theta": None}, **GDN, **DECODER)
        return tf.OlmoHybridForCausalLM(cfg), tf.OlmoHybridForCausalLM
    if layout == "kimi_linear":   # KDA (per-channel decay) and MLA attention; a dense first MLP, then MoE
        cfg = tf.KimiLinearConfig(vocab_size=vocab, num_key_value_heads=2,
                                  linear_attn_config=dict(head_dim=8, num_heads=2, short_conv_kernel_size=4),
                                  kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=8,
                                  v_head_dim=8, num_local_experts=4, n_shared_experts=1,
                                  mlp_layer_types=["dense"] + ["sparse"] * 3, **MOE, **DECODER)
        return tf.KimiLinearForCausalLM(cfg), tf.KimiLinearForCausalLM
    raise KeyError(layout)


@pytest.fixture(scope="module", params=LAYOUTS)
def checkpoint(request, tmp_path_factory):
    return tiny_checkpoint(request.param, _build, tmp_path_factory)


def test_loads_the_family_of_config_json(checkpoint):
    layout, path, _ = checkpoint
    model = load_model(path)
    assert model.family.name == layout
    mixers = {"qwen3_next": "BridgedQwen3NextGatedDeltaNet", "olmo_hybrid": "BridgedOlmoHybridGatedDeltaNet",
              "kimi_linear": "BridgedKimiDeltaAttention"}
    assert all(type(model.blocks[l].mixer).__name__ == mixers[layout] for l in model.recurrent_layers)
    assert model.blocks[3].norm_layout == ("post" if layout == "olmo_hybrid" else "pre")
    if layout == "olmo_hybrid":
        assert model.text_model[0].rotary_emb is None


def test_single_token_steps_equal_transformers_own_decode(checkpoint):
    """Token by token through the bridge's cache == transformers' own decode steps (its single-token conv update and
    recurrent kernel), and == the full run."""
    from transformers import DynamicCache

    _, path, cls = checkpoint
    model = load_model(path)
    ref = cls.from_pretrained(str(path), dtype=torch.float32).eval()
    tokens = torch.randint(4, model.cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), torch_reference_path():
        full = model(tokens)
        cache = model.run_prefix(tokens[:, :6])
        theirs = DynamicCache(config=ref.config.get_text_config(decoder=True))
        ref(input_ids=tokens[:, :6], cache=theirs, use_cache=True)
        ours, expected = [], []
        for t in range(6, 12):
            step, cache = model.run_suffix(tokens[:, t:t + 1], cache)
            ours.append(step)
            expected.append(ref(input_ids=tokens[:, t:t + 1], cache=theirs, use_cache=True,
                                position_ids=torch.tensor([[t]])).logits)
    torch.testing.assert_close(torch.cat(ours, 1), torch.cat(expected, 1), rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.cat(ours, 1), full[:, 6:], rtol=0, atol=1e-5)


def test_a_kv_head_swap_past_the_cached_heads_is_refused(checkpoint):
    """Per-head K/V swaps index the cached K/V heads (one shared latent under Kimi's MLA, Hkv under GQA)."""
    _, path, _ = checkpoint
    model = load_model(path)
    tokens = torch.randint(4, model.cfg.vocab_size, (1, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        cache = model.run_prefix(tokens)
    kv_heads = cache.layers[3].keys.shape[2]
    assert kv_heads == 1   # Hkv = 1 in the Qwen3-Next and OLMo-hybrid configs; the MLA latent in Kimi-Linear
    cache.swap_from(cache, layers=[3], heads=[0], parts=("kv",))
    with pytest.raises(ValueError, match=r"head 1 is out of range for layer 3's K/V: it caches 1 key/value heads"):
        cache.swap_from(cache, layers=[3], heads=[1], parts=("kv",))


def test_refuses_an_unknown_architecture_by_name(tmp_path):
    """A transformers hybrid the bridge does not know is refused with its model_type and the supported ones."""
    from transformers import Lfm2Config, Lfm2ForCausalLM

    Lfm2ForCausalLM(Lfm2Config(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=1, layer_types=["conv", "full_attention"],
                               pad_token_id=None, bos_token_id=None, eos_token_id=None)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"unknown model_type 'lfm2' .*qwen3_next, olmo_hybrid, kimi_linear"):
        load_model(tmp_path)


def test_recurscope_patch_runs_on_a_tiny_kimi_linear(tmp_path_factory, capsys):
    _patch_cli_runs_the_five_interventions(tiny_checkpoint("kimi_linear", _build, tmp_path_factory)[1], capsys)
