"""The transformers bridge on Mamba-2 in transformers' format (`Mamba2ForCausalLM`): tiny random checkpoints built
from transformers' own config class and saved with save_pretrained.

test_bridge.py's per-layout checks run here again with this module's `checkpoint` fixture (parity with transformers'
torch path with idle hooks, stepping, the state patch against a hand edit of transformers' cache, hook_state against
transformers' own state, the write patches, the interventions, the head scan against one full patched forward per
head, the hook table of docs/hooks.md). Added here: Mamba-2's own facts (no attention layer, no erase, the state
N x P while transformers' cache keeps P x N), the state patch's carry-forward at the patched mixer's own output,
single-token steps against transformers' own decode, and the CLI's scan and patch."""
import pytest
import torch
from test_bridge import (  # noqa: F401  (collected here with this module's checkpoint fixture)
    _randomise, test_a_state_patch_through_nnsight_equals_run_with_patches,
    test_component_swaps_equal_the_same_swaps_in_transformers_cache,
    test_every_hook_name_is_a_module_path_and_an_nnsight_envoy, test_greedy_generate_equals_transformers_generate,
    test_conv_tail_spans_reach_as_far_as_the_conv_transformers_runs,
    test_corrected_logits_equal_the_hooked_forward, test_hook_state_at_requested_positions_is_transformers_own_state,
    test_interventions_run_through_the_protocol, test_the_bridge_hook_tables_of_the_docs_are_the_models_hook_points,
    test_lens_after_the_last_layer_is_the_model_itself,
    test_parity_with_transformers_torch_path_hooks_idle, test_state_patch_equals_a_hand_edit_of_the_transformers_cache,
    test_scan_equals_one_full_patched_forward_per_head, test_stepping_equals_the_full_run,
    test_unembed_of_the_last_residual_is_transformers_own_logits,
)

from recurscope.interp.data import build_word_tokenizer, save_word_tokenizer

LAYOUTS = ("mamba2",)
# 4 heads in 2 groups (contiguous: heads 0, 1 read group 0), several chunks of transformers' chunked scan per run;
# time steps dt near 1 (the default 0.001-0.1 leaves the writes, and so every state patch, nearly invisible)
MAMBA2 = dict(hidden_size=32, num_heads=4, head_dim=16, state_size=8, n_groups=2, expand=2, num_hidden_layers=3,
              conv_kernel=4, chunk_size=8, time_step_min=0.2, time_step_max=1.0, pad_token_id=None,
              bos_token_id=None, eos_token_id=None)


def _build(layout: str, vocab: int):
    import transformers as tf

    if layout == "mamba2":
        return tf.Mamba2ForCausalLM(tf.Mamba2Config(vocab_size=vocab, **MAMBA2)), tf.Mamba2ForCausalLM
    raise KeyError(layout)


@pytest.fixture(scope="module", params=LAYOUTS)
def checkpoint(request, tmp_path_factory):
    tok = build_word_tokenizer()
    torch.manual_seed(0)
    hf, cls = _build(request.param, len(tok))
    _randomise(hf, 0)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    save_word_tokenizer(tok, path)
    return request.param, path, cls
