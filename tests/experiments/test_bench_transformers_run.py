"""experiments/bench/transformers_run.py: the forward FLOP count behind its GPU estimate against torch's own
FlopCounterMode on a bridged Qwen3.5 checkpoint, and the preset's shape against Qwen3.5-0.8B's published size."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from experiments.bench.transformers_run import PRESET, forward_flops
from recurscope.interp.data import build_word_tokenizer, save_word_tokenizer
from recurscope.interp.loading import load_model


def test_forward_flops_matches_torch_flop_counter(tmp_path):
    import transformers as tf

    tok = build_word_tokenizer()
    # Linear layers dominate, as at 0.8B; the count leaves out the recurrence and the short convolution.
    shape = dict(vocab_size=len(tok), hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                 layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=4,
                 linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, attn_output_gate=True, tie_word_embeddings=True)
    torch.manual_seed(0)
    tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**shape)).save_pretrained(tmp_path)
    save_word_tokenizer(tok, tmp_path)
    model = load_model(tmp_path)
    T = 96
    tokens = torch.randint(4, len(tok), (1, T), generator=torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(tokens, logit_positions=torch.tensor([T - 1]))
    counted = counter.get_total_flops()
    estimate = forward_flops(model, T)
    assert estimate <= counted <= 1.10 * estimate, (estimate, counted)


def test_preset_is_qwen35_08b_text_model():
    import transformers as tf

    with torch.device("meta"):
        model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**PRESET))
    n = sum(p.numel() for p in model.parameters())
    # Qwen3.5-0.8B: about 0.8B with its vision tower; the text model alone, embeddings tied, is 0.75B.
    assert n == pytest.approx(752e6, rel=0.01)
    assert [i for i, t in enumerate(PRESET["layer_types"]) if t == "full_attention"] == [3, 7, 11, 15, 19, 23]
