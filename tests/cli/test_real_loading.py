"""Loading real checkpoints as they are published: `bos_token_id`/`eos_token_id` null in a native config.json, the
tokenizer class transformers' AutoTokenizer chooses (Qwen3_5Tokenizer for Qwen3.5, even where tokenizer_config.json
names Qwen2Tokenizer, said once), and `--tokenizer DIR` on every command that takes a model, with the refusal for a
checkpoint without a tokenizer pointing to it."""

import argparse
import json
import shutil
import warnings

import pytest
import torch

from recurscope.interp.cli import main
from recurscope.interp.loading import load_model

SMALL = ["--n-facts", "2", "--presentations", "2", "--filler", "12", "--batch-size", "8", "--n-sources", "1"]


def test_null_bos_and_eos_in_a_native_config_load(tiny_checkpoint, tmp_path):
    ckpt = tiny_checkpoint(tmp_path / "gla")
    config = json.loads((ckpt / "config.json").read_text())
    config.update(bos_token_id=None, eos_token_id=None)
    (ckpt / "config.json").write_text(json.dumps(config))
    model = load_model(ckpt)
    assert model.cfg.bos_token_id is None and model.cfg.eos_token_id is None
    assert model(torch.tensor([[1, 2, 3]])).shape == (1, 3, model.cfg.vocab_size)


def _commands():
    from recurscope.interp.cli import build_parser

    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_every_command_that_takes_a_model_takes_tokenizer():
    commands = _commands()
    with_model = {name for name, p in commands.items() if any(a.dest == "model" for a in p._actions)}
    assert {"scan", "confirm", "patch", "run", "hybrid", "selectivity"} <= with_model
    lacking = sorted(name for name in with_model
                     if not any("--tokenizer" in a.option_strings for a in commands[name]._actions))
    assert not lacking, f"commands without --tokenizer: {lacking}"


def test_a_checkpoint_without_a_tokenizer_runs_with_tokenizer_dir(tiny_checkpoint, word_tok, tmp_path, capsys):
    ckpt = tiny_checkpoint(tmp_path / "bare")
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.move(str(ckpt / name), str(tok_dir / name))
    capsys.readouterr()
    assert main(["scan", str(ckpt), *SMALL, "--out", str(tmp_path / "no_tok")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "--tokenizer DIR" in err[0]
    assert main(["scan", str(ckpt), *SMALL, "--tokenizer", str(tok_dir), "--out", str(tmp_path / "with_tok")]) == 0
    assert json.loads((tmp_path / "with_tok" / "manifest.json").read_text())["args"]["tokenizer"] == str(tok_dir)
    empty = tmp_path / "empty"
    empty.mkdir()
    capsys.readouterr()
    assert main(["scan", str(ckpt), *SMALL, "--tokenizer", str(empty), "--out", str(tmp_path / "bad_tok")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds no tokenizer.json" in err[0] and str(empty) in err[0]


def test_the_tokenizer_class_is_autotokenizers_choice_said_once(real_tokenizer_dir, tmp_path):
    """A Qwen3.5 checkpoint whose tokenizer_config.json names Qwen2Tokenizer (as published ones do): transformers'
    AutoTokenizer chooses Qwen3_5Tokenizer for model_type qwen3_5, which encodes Devanagari, Tamil and Bengali as
    Qwen's own encoder does; Qwen2Tokenizer does not."""
    import transformers as tf
    from transformers import Qwen2Tokenizer

    from recurscope.interp.bridge.loader import TokenizerClassWarning
    from tests.real_tokenizers import reference_encoder

    source = real_tokenizer_dir("qwen35")
    ckpt = tmp_path / "qwen35"
    torch.manual_seed(0)
    # Published Qwen3.5 checkpoints are the multimodal layout, model_type qwen3_5 (the text tower under it).
    text = dict(vocab_size=248077, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                head_dim=8, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=1,
                linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                intermediate_size=32, tie_word_embeddings=True)
    vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=16)
    tf.Qwen3_5ForConditionalGeneration(tf.Qwen3_5Config(text_config=text, vision_config=vision)).save_pretrained(ckpt)
    assert json.loads((ckpt / "config.json").read_text())["model_type"] == "qwen3_5"
    shutil.copy(source / "tokenizer.json", ckpt / "tokenizer.json")
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "Qwen2Tokenizer"
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        model = load_model(ckpt)
    said = [w for w in caught if issubclass(w.category, TokenizerClassWarning)]
    assert len(said) == 1 and "Qwen2Tokenizer" in str(said[0].message) and "Qwen3_5Tokenizer" in str(said[0].message)
    assert type(model.tokenizer).__name__ == "Qwen3_5Tokenizer"
    reference = reference_encoder("qwen35")
    texts = ["नमस्ते दुनिया", "வணக்கம் உலகம்", "ক্ষমা", "हिन्दी भाषा"]
    assert all(model.tokenizer(t, add_special_tokens=False).input_ids == reference(t) for t in texts)
    named = Qwen2Tokenizer.from_pretrained(str(ckpt))   # what the named class alone would give
    assert any(named(t, add_special_tokens=False).input_ids != reference(t) for t in texts)
    # --tokenizer DIR holding only the tokenizer's files: AutoTokenizer then follows tokenizer_class, as the warning
    # says; PreTrainedTokenizerFast and the TokenizersBackend it names in transformers 5 are one class, so no warning.
    for cls, want in (("Qwen2Tokenizer", "Qwen2Tokenizer"), ("PreTrainedTokenizerFast", "TokenizersBackend")):
        alone = tmp_path / f"tok-{cls}"
        alone.mkdir()
        shutil.copy(source / "tokenizer.json", alone / "tokenizer.json")
        (alone / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": cls}))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tokenizer = load_model(ckpt, tokenizer=alone).tokenizer
        assert type(tokenizer).__name__ == want
        assert not [w for w in caught if issubclass(w.category, TokenizerClassWarning)]
