"""`recurscope run DIR` end to end on small random-weight transformers Qwen3.5 checkpoints of two real vocabularies
(Qwen3.5/3.6's 248,077 tokens and GPT-2's 50,257), as a new user would run it: no option needed, the dropped words
in the report, and, the weights being random, a report that says the model does not do the task and names no head
and reads no control. Also: loading without a tokenizer, a config that does not match its weights, the default
--out, and the winner rule on the J interval."""

import json
import shutil

import numpy as np
import pandas as pd
import pytest
import torch

from recurscope.interp.cli import main, winner_verdict

QWEN35 = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
              layer_types=["linear_attention"] * 3 + ["full_attention"], initializer_range=0.05,
              linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=16,
              linear_conv_kernel_dim=4, intermediate_size=64, tie_word_embeddings=True)


def _checkpoint(path, tokenizer_dir, with_tokenizer=True):
    import transformers as tf
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(str(tokenizer_dir)))
    torch.manual_seed(0)
    tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(vocab_size=vocab, **QWEN35)).save_pretrained(path)
    if with_tokenizer:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer_dir / name, path / name)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("vocab", ["qwen35", "gpt2"])
def test_run_on_a_random_qwen35_of_a_real_vocabulary(vocab, real_tokenizer_dir, tmp_path, monkeypatch):
    ckpt = _checkpoint(tmp_path / f"random-qwen35-{vocab}", real_tokenizer_dir(vocab))
    monkeypatch.chdir(tmp_path)
    # No option but the sizes: the layout defaults to the paper's (the checkpoint records none), --out to
    # results/<model name>.
    assert main(["run", str(ckpt), "--n-dev", "2", "--n-heldout", "2", "--pairs-per-source", "2",
                 "--filler", "32"]) == 0
    out = tmp_path / "results" / ckpt.name
    report = (out / "report.md").read_text()
    assert report.split("\n")[2].startswith("> **The model does not do the task.**")
    assert "winner" not in report and "## Reading" not in report and "Control head" not in report
    assert "Head selection" not in report and "no head is named and no control is read" in report.lower()
    assert "layout: `paper+custom`" in report and "template `key_value`" in report
    assert "- filler: generated filler" in report
    manifest = json.loads((out / "scan" / "manifest.json").read_text())
    assert manifest["extra"]["pair_layout"]["name"] == "paper+custom"
    if vocab == "qwen35":   # Qwen's vocabulary splits three of the default key names
        assert "3 key(s) of the default key names dropped" in report
        assert "Ursula (`ĠUrs/ula`)" in report    # token pieces in code spans (report.code_span)
        assert sorted(manifest["extra"]["dropped_keys"]) == ["Ursula", "Wanda", "Yvonne"]
    gate = json.loads((out / "scan" / "gate.json").read_text())
    assert not gate["passed"] and gate["threshold"] == 0.8
    assert not (out / "confirm").exists()


@pytest.mark.slow
def test_a_bridged_checkpoint_without_a_tokenizer(real_tokenizer_dir, tmp_path, capsys):
    from transformers import AutoTokenizer

    from recurscope.interp.loading import load_model

    ckpt = _checkpoint(tmp_path / "bare", real_tokenizer_dir("gpt2"), with_tokenizer=False)
    capsys.readouterr()
    model = load_model(ckpt)             # loads for forward and hook work
    assert model.tokenizer is None
    ids = torch.tensor([[1, 2, 3, 4]])
    assert model(ids).shape[-1] == 50257
    assert main(["scan", str(ckpt), "--n-sources", "2", "--out", str(tmp_path / "scan")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "tokenizer" in errors[0] and "--tokenizer DIR" in errors[0]
    for given in (real_tokenizer_dir("gpt2"), AutoTokenizer.from_pretrained(str(real_tokenizer_dir("gpt2")))):
        assert len(load_model(ckpt, tokenizer=given).tokenizer) == 50257


@pytest.mark.slow
def test_a_config_that_does_not_match_its_weights(real_tokenizer_dir, tmp_path, capsys):
    ckpt = _checkpoint(tmp_path / "mismatch", real_tokenizer_dir("gpt2"))
    config = json.loads((ckpt / "config.json").read_text())
    config["intermediate_size"] = 96
    (ckpt / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert main(["scan", str(ckpt), "--n-sources", "2", "--out", str(tmp_path / "scan")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: checkpoint") and "does not match its config.json" in err and "--verbose" in err
    assert main(["scan", str(ckpt), "--n-sources", "2", "--out", str(tmp_path / "scan"), "--verbose"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: checkpoint") and "does not match its config.json" in err
    assert "up_proj.weight: checkpoint (64, 32) vs config (96, 32)" in err and "Traceback" not in err


def _scan_result(per_source: dict):
    from recurscope.interp.scan import summarise_scan

    rows = [dict(source=s, pair=0, layer=layer, head=head, shift=value)
            for (layer, head), values in per_source.items() for s, value in enumerate(values)]
    return summarise_scan(pd.DataFrame(rows))


def test_a_top_head_whose_interval_includes_zero_is_no_head():
    noisy = _scan_result({(0, 0): [3.0, -2.5, 2.0, -1.5, 2.5, -2.0, 1.0, -1.0], (0, 1): [0.1, -0.1] * 4})
    verdict = winner_verdict(noisy)
    assert (verdict["layer"], verdict["head"]) == (0, 0) and verdict["low"] < 0 < verdict["high"]
    assert not verdict["winner"]
    clear = _scan_result({(0, 0): list(np.linspace(2.0, 3.0, 8)), (0, 1): [0.1, -0.1] * 4})
    assert winner_verdict(clear)["winner"]


def test_the_layout_a_run_uses(tmp_path):
    """--layout, else the checkpoint's pair_layout.json (the word-vocabulary bundled checkpoints record `where_is`,
    the real-vocabulary ones, trained on the paper's layout, `paper`), else the paper's; single options override one
    field each."""
    import argparse

    from recurscope.interp.cli import pair_layout
    from recurscope.interp.loading import CHECKPOINT_DIR, bundled_names

    def args(**kw):
        base = dict(layout=None, n_facts=None, presentations=None, filler=None, gap=None, template=None)
        return argparse.Namespace(**{**base, **kw})

    class Model:
        checkpoint_dir = tmp_path

    from recurscope.interp.checkpoint_files import VOCAB_ROWS_FILE

    for name in bundled_names():
        Model.checkpoint_dir = CHECKPOINT_DIR / name
        trained_on = "paper" if (Model.checkpoint_dir / VOCAB_ROWS_FILE).is_file() else "where_is"
        assert pair_layout(Model, args()).name == trained_on
        assert pair_layout(Model, args(layout="paper")).template == "key_value"
        assert pair_layout(Model, args(layout="where_is")).template == "is_in"
    Model.checkpoint_dir = tmp_path
    assert pair_layout(Model, args()).name == "paper"
    custom = pair_layout(Model, args(filler=64, gap=4))
    assert (custom.filler_tokens, custom.gap_tokens, custom.n_facts, custom.name) == (64, 4, 4, "paper+custom")
    (tmp_path / "pair_layout.json").write_text("{not json")
    with pytest.raises(ValueError, match="pair_layout.json"):
        pair_layout(Model, args())


def test_word_lists_from_commas_or_a_file(tmp_path):
    from recurscope.interp.cli import UsageError, word_list

    assert word_list("red, blue,green") == ["red", "blue", "green"]
    path = tmp_path / "values.txt"
    path.write_text("red\n\nblue\n gold \n")
    assert word_list(str(path)) == ["red", "blue", "gold"]
    assert word_list(None) is None
    with pytest.raises(UsageError, match="holds no words"):
        word_list(" , ")


def test_the_report_names_arms_equal_by_construction():
    from recurscope.interp.report import _by_construction

    paper = {"template": "key_value"}
    lines = _by_construction([(0, 1)], paper)
    assert any(line.startswith("output patch = state swap") for line in lines)
    assert any(line.startswith("output restore (every readout) = output restore (answer position)") for line in lines)
    assert _by_construction([(1, 0)], {"template": "is_in"}) == []
