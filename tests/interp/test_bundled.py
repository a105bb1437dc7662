"""Every bundled checkpoint loads by name, with its tokenizer, and its config, weights and tokenizer agree."""
import pytest
import torch

from recurscope.interp.loading import bundled_names, load_model


@pytest.mark.parametrize("name", bundled_names())
def test_bundled_checkpoint_loads_with_its_tokenizer(name):
    model = load_model(name)
    assert model.tokenizer is not None
    assert len(model.tokenizer) == model.cfg.vocab_size
    ids = model.tokenizer("where is", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids)
    assert logits.shape == (1, ids.shape[1], model.cfg.vocab_size) and torch.isfinite(logits).all()


@pytest.mark.slow
@pytest.mark.parametrize("name", bundled_names())
def test_bundled_checkpoint_has_learned_the_task(name):
    """Smoke check of clean recall on 32 held-out sources (every template, K=4, 3 presentations, F=512);
    the full 128-source figure with CIs is in the checkpoint's eval_summary.json."""
    from experiments.train_tiny import evaluate

    model = load_model(name)
    with torch.no_grad():
        result = evaluate(model, model.tokenizer, n_sources=32, progress=False)
    assert result["overall"]["accuracy"] > 0.75, result["per_template"]
