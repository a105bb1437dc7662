"""experiments/train_tiny_hf.py's architecture table: each entry builds transformers' own model with train_tiny's
init (long-memory decays), and the saved model loads through the bridge with transformers' logits."""
from __future__ import annotations

import math

import pytest
import torch

from experiments import train_tiny_hf as hf_trainer
from recurscope.interp.bridge.torch_path import torch_reference_path
from recurscope.interp.data import build_word_tokenizer
from recurscope.interp.loading import load_model


def test_nemotronh_mamba_decays_start_long_and_the_bridge_loads_it(tmp_path):
    tokenizer = build_word_tokenizer()
    torch.manual_seed(0)
    hf = hf_trainer.build_model(tokenizer, "tiny-nemotronh")
    mixers = [layer.mixer for layer in hf.model.layers if hasattr(layer.mixer, "A_log")]
    assert len(mixers) == 2
    for mixer in mixers:   # dt = 0.5 per head; log-decays dt A spread over [-0.04, -0.001] as for native Mamba-2
        dt = torch.nn.functional.softplus(mixer.dt_bias.detach())
        assert torch.allclose(dt, torch.full_like(dt, 0.5), rtol=1e-5)
        g = -dt * mixer.A_log.detach().exp()
        assert float(g.max()) == pytest.approx(-1e-3, rel=1e-4) and float(g.min()) == pytest.approx(-4e-2, rel=1e-4)
        # torch's Conv1d init, U(-1/2, 1/2) for width 4 (std 0.29), not transformers' N(0, 0.02): the state's readout
        # is cubic in the conv's outputs
        assert float(mixer.conv1d.weight.detach().std()) > 0.2
    layers = len(hf.config.layers_block_type)
    out_proj = mixers[0].out_proj.weight.detach()
    assert float(out_proj.std()) == pytest.approx(0.02 / math.sqrt(2 * layers), rel=0.1)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    tokens = torch.randint(0, len(tokenizer), (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), torch_reference_path():
        want = hf.eval()(input_ids=tokens, use_cache=False).logits
        got = ours(tokens)
    got = got[0] if isinstance(got, tuple) else got
    assert (got - want).abs().max().item() < 1e-4 * want.abs().max().item()


def test_unknown_architecture_is_a_value_error():
    with pytest.raises(ValueError, match="tiny-nemotronh"):
        hf_trainer.build_model(build_word_tokenizer(), "tiny-nope")
