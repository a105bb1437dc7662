"""Checkpoints round-trip in fla's format, and a bad checkpoint is refused with every problem listed."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from recurscope.interp.loading import CheckpointError, fla_to_ours, load_model, ours_to_fla, save_model
from tests.interp.helpers_models import FAMILIES, tiny_model


@pytest.mark.parametrize("family", list(FAMILIES))
def test_save_load_round_trip(tmp_path, family):
    model = tiny_model(family)
    save_model(model, tmp_path)
    keys = load_file(str(tmp_path / "model.safetensors")).keys()
    prefix = "backbone." if model.cfg.model_type == "mamba2" else "model."   # fla calls the Mamba-2 trunk backbone
    assert all(k.startswith((prefix, "lm_head.")) for k in keys)
    loaded = load_model(tmp_path)
    tokens = torch.randint(0, 61, (1, 9))
    with torch.no_grad():
        assert torch.equal(model(tokens), loaded(tokens))


def test_name_mapping_is_a_bijection():
    model = tiny_model("gdn_hybrid")
    for name in model.state_dict():
        assert fla_to_ours(ours_to_fla(name)) == name
    assert ours_to_fla("blocks.3.mixer.q_proj.weight") == "model.layers.3.attn.q_proj.weight"
    assert ours_to_fla("embed.weight") == "model.embeddings.weight"


def _saved(tmp_path, family="gdn"):
    save_model(tiny_model(family), tmp_path)
    return load_file(str(tmp_path / "model.safetensors"))


def test_missing_unexpected_and_misshapen_weights_are_all_listed(tmp_path):
    sd = _saved(tmp_path)
    sd.pop("model.layers.0.attn.q_proj.weight")
    sd["model.layers.0.attn.surprise"] = torch.zeros(3)
    sd["model.layers.1.attn.k_proj.weight"] = torch.zeros(5, 5)
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError) as err:
        load_model(tmp_path)
    lines = str(err.value).splitlines()
    # one line with the counts, the first mismatch and the fix; every mismatch in `details` (the CLI's --verbose)
    assert len(lines) == 1
    assert "does not match its config.json" in lines[0] and "1 missing, 1 unexpected, 1 with the wrong shape" in lines[0]
    assert "(first: missing weight model.layers.0.attn.q_proj.weight)" in lines[0]
    assert "check that config.json belongs to these weights" in lines[0] and "--verbose" in lines[0]
    details = err.value.details
    assert details[:-1] == ["  missing weights (1):", "    model.layers.0.attn.q_proj.weight",
                            "  unexpected weights (1):", "    model.layers.0.attn.surprise", "  shape mismatches (1):"]
    assert details[-1].startswith("    model.layers.1.attn.k_proj.weight: checkpoint (5, 5) vs config (")


def test_every_mismatch_is_listed_not_the_first_twenty(tmp_path):
    sd = _saved(tmp_path)
    for i in range(30):
        sd[f"model.extra_{i:02d}"] = torch.zeros(1)
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        load_model(tmp_path)
    assert "30 unexpected" in str(err.value)
    assert all(f"    model.extra_{i:02d}" in err.value.details for i in range(30))


def _corrupt(tmp_path, how):
    _saved(tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes({"truncated": data[:len(data) // 2], "garbage header": b"\xff" * 8 + b"not a header" + data[20:],
                         "empty": b""}[how])
    return weights


@pytest.mark.parametrize("how", ["truncated", "garbage header", "empty"])
def test_corrupt_weights_raise_a_recurscope_error_naming_the_file(tmp_path, how):
    weights = _corrupt(tmp_path, how)
    with pytest.raises(CheckpointError) as err:
        load_model(tmp_path)
    msg = str(err.value)
    assert str(weights) in msg and "\n" not in msg
    assert ("download or save the checkpoint again" in msg)


@pytest.mark.parametrize("text, pattern", [("{not json", "is not valid JSON"), ("[1, 2]", "holds a JSON list"),
                                           ('{"model_type": "mamba"}', "unknown model_type 'mamba'")])
def test_invalid_config_json_names_the_file(tmp_path, text, pattern):
    _saved(tmp_path)
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match=pattern) as err:
        load_model(tmp_path)
    assert str(tmp_path / "config.json") in str(err.value)


def test_config_that_does_not_match_the_weights(tmp_path):
    _saved(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["hidden_size"] = 48
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="does not match its config.json"):
        load_model(tmp_path)


@pytest.mark.parametrize("change, pattern", [
    ({"model_type": "mamba"}, "unknown model_type 'mamba'"),
    ({"feature_map": "relu", "model_type": "gla"}, "unsupported config.json"),
    ({"surprise_option": 1}, r"unrecognised config options \['surprise_option'\]"),
    ({"attnres_block_size": 2}, "attention residuals are not implemented"),
])
def test_unknown_types_and_unsupported_options(tmp_path, change, pattern):
    _saved(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(change)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=pattern):
        load_model(tmp_path)


def test_nan_weights_and_missing_paths(tmp_path):
    sd = _saved(tmp_path)
    sd["model.norm.weight"] = torch.full_like(sd["model.norm.weight"], float("nan"))
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="NaN or inf"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="neither a local directory nor a bundled name"):
        load_model(tmp_path / "nowhere")


def test_pytorch_bin_and_sharded_safetensors(tmp_path):
    model = tiny_model("gla")
    save_model(model, tmp_path / "a")
    sd = load_file(str(tmp_path / "a" / "model.safetensors"))
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text((tmp_path / "a" / "config.json").read_text())
    torch.save(sd, tmp_path / "bin" / "pytorch_model.bin")
    (tmp_path / "shard").mkdir()
    (tmp_path / "shard" / "config.json").write_text((tmp_path / "a" / "config.json").read_text())
    names = sorted(sd)
    half = len(names) // 2
    parts = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fname, keys in parts.items():
        save_file({k: sd[k] for k in keys}, str(tmp_path / "shard" / fname))
    index = {"weight_map": {k: f for f, ks in parts.items() for k in ks}}
    (tmp_path / "shard" / "model.safetensors.index.json").write_text(json.dumps(index))
    tokens = torch.randint(0, 61, (1, 7))
    with torch.no_grad():
        for d in ("bin", "shard"):
            assert torch.equal(load_model(tmp_path / d)(tokens), model(tokens))


def test_a_result_folder_named_like_a_bundled_checkpoint_does_not_hide_it(tmp_path, monkeypatch):
    from recurscope.interp.loading import CHECKPOINT_DIR, resolve_checkpoint

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny-gla").mkdir()            # e.g. `recurscope run tiny-gla --out tiny-gla`
    assert resolve_checkpoint("tiny-gla") == CHECKPOINT_DIR / "tiny-gla"
    (tmp_path / "tiny-gla" / "config.json").write_text("{}")   # a real local checkpoint of that name wins
    assert resolve_checkpoint("tiny-gla").resolve() == tmp_path / "tiny-gla"
