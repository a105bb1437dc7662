"""Every bundled checkpoint loads by name, with its tokenizer, and its config, weights and tokenizer agree."""
import pytest
import torch

from interp.loading import bundled_names, load_model


@pytest.mark.parametrize("name", bundled_names())
def test_bundled_checkpoint_loads_with_its_tokenizer(name):
    model = load_model(name)
    assert model.tokenizer is not None
    assert len(model.tokenizer) == model.cfg.vocab_size
    ids = model.tokenizer("where is", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids)
    assert logits.shape == (1, ids.shape[1], model.cfg.vocab_size) and torch.isfinite(logits).all()
