"""vocab_rows.json: a checkpoint that stores its token-indexed matrices as the listed tokens' rows plus one shared
row loads, in fla's format and transformers', as the ordinary full-vocabulary model with those rows; a file that
does not match the weights or the config is refused in one line naming it."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from recurscope.interp.checkpoint_files import VOCAB_ROWS_FILE, CheckpointError
from recurscope.interp.loading import load_model, save_model
from recurscope.interp.models import ModelConfig, RecurrentLM

V = 120
IDS = [3, 7, 8, 20, 41, 42, 77, 100, 119]


def _expanded(rows: torch.Tensor) -> torch.Tensor:
    """The reference expansion, written out row by row: token IDS[i] gets row i, every other token the last row."""
    return torch.stack([rows[IDS.index(t)] if t in IDS else rows[-1] for t in range(V)])


def _store_rows(directory, names):
    """Rewrites a saved full-vocabulary checkpoint with only IDS' rows and a shared row, returns the rows stored."""
    weights = load_file(str(directory / "model.safetensors"))
    stored = {}
    for name in names:
        rows = torch.randn(len(IDS) + 1, weights[name].shape[1], generator=torch.Generator().manual_seed(len(stored)))
        weights[name] = stored[name] = rows
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / VOCAB_ROWS_FILE).write_text(json.dumps({"vocab_size": V, "token_ids": IDS, "tensors": names}))
    return stored


def test_fla_checkpoint_with_stored_rows_loads_as_the_expanded_model(tmp_path):
    torch.manual_seed(0)
    model = RecurrentLM(ModelConfig.from_dict(dict(model_type="gla", vocab_size=V, hidden_size=32,
                                                   num_hidden_layers=2, num_heads=2)))
    save_model(model, tmp_path)
    stored = _store_rows(tmp_path, ["model.embeddings.weight", "lm_head.weight"])
    loaded = load_model(tmp_path)
    assert torch.equal(loaded.embed.weight, _expanded(stored["model.embeddings.weight"]))
    assert torch.equal(loaded.lm_head.weight, _expanded(stored["lm_head.weight"]))
    with torch.no_grad():   # every token outside IDS gets one logit
        logits = loaded(torch.tensor([[3, 7, 50]]))
    others = [t for t in range(V) if t not in IDS]
    assert torch.allclose(logits[..., others], logits[..., others[:1]].expand(-1, -1, len(others)))


def test_transformers_checkpoint_with_stored_rows_loads_as_the_expanded_model(tmp_path):
    import transformers

    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        num_attention_heads=2, num_key_value_heads=2, head_dim=16, intermediate_size=64, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=7, pad_token_id=8)
    torch.manual_seed(0)
    hf = transformers.Qwen3_5ForCausalLM(cfg)
    hf.save_pretrained(tmp_path)
    stored = _store_rows(tmp_path, ["model.embed_tokens.weight", "lm_head.weight"])
    loaded = load_model(tmp_path)
    state = loaded.hf.state_dict() if hasattr(loaded, "hf") else loaded.state_dict()
    embed = next(v for k, v in state.items() if k.endswith("embed_tokens.weight"))
    head = next(v for k, v in state.items() if k.endswith("lm_head.weight"))
    assert torch.equal(embed, _expanded(stored["model.embed_tokens.weight"]))
    assert torch.equal(head, _expanded(stored["lm_head.weight"]))
    other = {k: v for k, v in load_file(str(tmp_path / "model.safetensors")).items() if k not in stored}
    assert other and all(torch.equal(state[k], v) for k, v in other.items())   # every other weight as stored


@pytest.mark.parametrize("change, pattern", [
    (dict(vocab_size=V + 1), "is for a vocabulary of 121 tokens but config.json's vocab_size is 120"),
    (dict(token_ids=IDS[:-1]), "must have 9 rows"),
    (dict(token_ids=IDS[:-1] + [IDS[0]]), "must be distinct ids"),
    (dict(tensors=["model.nowhere.weight"]), "names the weight 'model.nowhere.weight'"),
    (dict(token_ids="all"), "must hold a non-empty list of integer `token_ids`"),
])
def test_a_vocab_rows_file_that_does_not_match_is_refused_naming_it(tmp_path, change, pattern):
    torch.manual_seed(0)
    model = RecurrentLM(ModelConfig.from_dict(dict(model_type="gla", vocab_size=V, hidden_size=32,
                                                   num_hidden_layers=2, num_heads=2)))
    save_model(model, tmp_path)
    _store_rows(tmp_path, ["model.embeddings.weight", "lm_head.weight"])
    raw = json.loads((tmp_path / VOCAB_ROWS_FILE).read_text())
    (tmp_path / VOCAB_ROWS_FILE).write_text(json.dumps({**raw, **change}))
    with pytest.raises(CheckpointError, match=pattern) as err:
        load_model(tmp_path)
    assert VOCAB_ROWS_FILE in str(err.value) and "\n" not in str(err.value)
