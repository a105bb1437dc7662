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
    """Smoke check of clean recall on 32 held-out sources under the layout the checkpoint records (where_is: every
    template; paper: key_value with every value vocabulary; K=4, 3 presentations, F=512); the full 128-source figure
    with CIs is in the checkpoint's eval_summary.json."""
    from experiments.train_tiny import evaluate, evaluate_layout
    from recurscope.interp.data.layout import recorded_layout
    from recurscope.interp.loading import CHECKPOINT_DIR

    model = load_model(name)
    layout = recorded_layout(CHECKPOINT_DIR / name)
    with torch.no_grad():
        if layout is not None and layout.name == "paper":
            import json

            vocabs = json.loads((CHECKPOINT_DIR / name / "eval_summary.json").read_text()).get("vocabs")
            result = evaluate_layout(model, model.tokenizer, "paper", n_sources=32, progress=False, batch_size=8,
                                     vocabs=vocabs)
        else:
            result = evaluate(model, model.tokenizer, n_sources=32, progress=False)
    assert result["overall"]["accuracy"] > 0.75, result["per_template"]


def _real_vocabulary_checkpoints() -> list[str]:
    from recurscope.interp.checkpoint_files import VOCAB_ROWS_FILE
    from recurscope.interp.loading import CHECKPOINT_DIR

    return [n for n in bundled_names() if (CHECKPOINT_DIR / n / VOCAB_ROWS_FILE).is_file()]


@pytest.mark.slow
@pytest.mark.parametrize("name", _real_vocabulary_checkpoints())
def test_real_vocabulary_checkpoint_prompts_are_the_package_encoders_ids(name):
    """The checkpoints on GPT-2's and Qwen3.5's vocabularies: their paper-layout prompts, built with the tokenizer in
    the checkpoint directory, are exactly what the vocabulary's own PyPI package encodes from the same text."""
    import json

    from experiments.compact_vocab import prompt_ids_match_package
    from recurscope.interp.checkpoint_files import VOCAB_ROWS_FILE
    from recurscope.interp.data.layout import recorded_layout
    from recurscope.interp.loading import CHECKPOINT_DIR

    model = load_model(name)
    vocabulary = json.loads((CHECKPOINT_DIR / name / VOCAB_ROWS_FILE).read_text())["vocabulary"]
    assert recorded_layout(CHECKPOINT_DIR / name).name == "paper"
    vocabs = json.loads((CHECKPOINT_DIR / name / "eval_summary.json").read_text()).get("vocabs")
    check = prompt_ids_match_package(model.tokenizer, vocabulary, "paper", n_sources=8, vocabs=vocabs)
    assert check["rows"] == 8 and check["equal_after_package_quirks"] == check["rows"]   # PACKAGE_QUIRKS: " gazed"
