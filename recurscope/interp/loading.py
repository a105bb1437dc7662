"""Checkpoint loading and saving in Hugging Face / fla format, and the bundled tiny checkpoints by name.

Weight names follow fla (`model.layers.{i}.attn.q_proj.weight`, ...); inside recurscope the same tensors live
under TransformerLens-style module names (`blocks.{i}.mixer.q_proj.weight`). The mapping is a pure renaming.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Union

import torch

from recurscope.interp.checkpoint_files import (CheckpointError, check_cast_fits, check_config_fits_weights,
                                                check_finite_weights, check_no_remote_code, check_shards,
                                                check_tokenizer_files, check_tokenizer_fits, read_index, read_json,
                                                expand_vocab_rows, mismatch_error, read_weight_file)
from recurscope.interp.models import ModelConfig, RecurrentLM
from recurscope.interp.models.families import fla_to_ours, ours_to_fla  # noqa: F401  (public names)
from recurscope.interp.models.protocol import RecurrentModel

CHECKPOINT_DIR = Path(__file__).parent / "checkpoints"


def bundled_names() -> list[str]:
    if not CHECKPOINT_DIR.is_dir():
        return []
    return sorted(p.name for p in CHECKPOINT_DIR.iterdir() if (p / "config.json").is_file())


def resolve_checkpoint(path_or_name: Union[str, os.PathLike]) -> Path:
    """A local directory, or the name of a bundled checkpoint. A local folder that holds no config.json (a result
    directory named like a bundled checkpoint, say `--out tiny-gla`) does not hide the bundled checkpoint."""
    p = Path(path_or_name).expanduser()
    if p.is_dir() and ((p / "config.json").is_file() or str(path_or_name) not in bundled_names()):
        return p
    if str(path_or_name) in bundled_names():
        return CHECKPOINT_DIR / str(path_or_name)
    raise ValueError(
        f"no checkpoint at {str(path_or_name)!r}: it is neither a local directory nor a bundled name "
        f"({', '.join(bundled_names()) or 'none bundled'}). Models load from local directories only; download one "
        "first, e.g. with `huggingface-cli download fla-hub/gla-340M-15B --local-dir DIR` on a machine with network."
    )


def _read_state_dict(directory: Path) -> dict:
    files = sorted(directory.glob("*.safetensors"))
    index = directory / "model.safetensors.index.json"
    if files or index.is_file():
        check_shards(directory)         # headers against sizes, shards inside the directory, before any tensor
        if index.is_file():
            files = [directory / n for n in sorted(set(read_index(directory).values()))]
            absent = [str(f) for f in files if not f.is_file()]
            if absent:
                raise CheckpointError(f"{index} lists shards that are not there: {absent}; download the missing "
                                      "shards")
        sd = {}
        for f in files:
            sd.update(read_weight_file(f))
        return sd
    bins = sorted(directory.glob("pytorch_model*.bin"))
    if bins:
        sd = {}
        for f in bins:
            sd.update(read_weight_file(f))
        return sd
    raise CheckpointError(f"{directory} has a config.json but no model.safetensors, sharded safetensors or "
                          "pytorch_model.bin; copy the weights beside config.json")


def _read_config(cfg_file: Path) -> ModelConfig:
    raw = read_json(cfg_file, "model configuration")
    if not isinstance(raw, dict):
        raise CheckpointError(f"{cfg_file} holds a JSON {type(raw).__name__}, not an object of model options; "
                              "restore it from the original checkpoint")
    try:
        return ModelConfig.from_dict(raw)
    except (ValueError, TypeError) as err:
        raise CheckpointError(f"{cfg_file}: {err}") from None


def check_tokenizer_dir(directory: Path) -> None:
    """A tokenizer directory given by the user (--tokenizer DIR, load_model(tokenizer=DIR)) must hold a tokenizer's
    files; one that does not is refused rather than loading the model without a tokenizer."""
    if not directory.is_dir():
        raise CheckpointError(f"the tokenizer directory {directory} does not exist; pass the directory that holds "
                              "the tokenizer's tokenizer.json and tokenizer_config.json")
    if not any((directory / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise CheckpointError(f"the tokenizer directory {directory} holds no tokenizer.json or tokenizer_config.json;"
                              " pass the directory that holds the tokenizer's files")
    check_tokenizer_files(directory)


def checkpoint_format(raw_config: dict) -> str:
    """"fla" or "transformers", from config.json's model_type; anything else is refused by name."""
    from recurscope.interp.bridge.families import adapter_for, supported_model_types
    from recurscope.interp.models.families import FAMILIES

    model_type = raw_config.get("model_type")
    if not isinstance(model_type, str):
        raise ValueError(f"`model_type` must be a string naming the architecture (e.g. \"gla\"), got {model_type!r}; "
                         "restore config.json from the original checkpoint")
    if adapter_for(raw_config) is not None:   # an adapter claims it (Mamba-2's looks past the shared model_type)
        return "transformers"
    if model_type in FAMILIES:
        return "fla"
    raise ValueError(
        f"unknown model_type {model_type!r} in config.json (architectures {raw_config.get('architectures')}): "
        f"recurscope loads fla's format ({', '.join(FAMILIES)}) and, through its transformers bridge, "
        f"{', '.join(supported_model_types())}; this architecture is neither")


def _check_load_args(path_or_name, device, dtype, tokenizer) -> None:
    """load_model's arguments, each refused in one line naming it and the fix (TypeError for a wrong type)."""
    if not isinstance(path_or_name, (str, os.PathLike)) or not str(path_or_name).strip():
        raise TypeError(f"load_model: path_or_name must be a checkpoint directory or a bundled name (a string or "
                        f"path), got {path_or_name!r}; e.g. load_model('tiny-gla')")
    if isinstance(dtype, str):
        raise TypeError(f"load_model: dtype must be a torch dtype, got the string {dtype!r}; pass "
                        f"torch.{dtype.replace('torch.', '')}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"load_model: dtype must be a floating torch dtype (torch.float32, torch.bfloat16, "
                        f"torch.float16, torch.float64) or None, got {dtype!r}")
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"load_model: device must be a string or torch.device such as 'cpu' or 'cuda:0', got "
                        f"{device!r}")
    try:
        torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"load_model: device {device!r} is not a device torch knows; use 'cpu', 'cuda' or "
                         "'cuda:N'") from None
    if tokenizer is None:
        return
    if isinstance(tokenizer, (str, os.PathLike)):
        path = Path(tokenizer).expanduser()
        if not str(tokenizer).strip() or not path.is_dir():
            raise ValueError(f"load_model: tokenizer {str(tokenizer)!r} is not a directory; pass a tokenizer "
                             "directory (with tokenizer.json), a tokenizer object, or None for the checkpoint's own")
        return
    if isinstance(tokenizer, (bool, bytes, bytearray, dict, list, tuple, int, float)) or not (
            callable(getattr(tokenizer, "encode", None)) and callable(getattr(tokenizer, "decode", None))):
        raise TypeError(f"load_model: tokenizer must be a tokenizer object (with encode and decode, e.g. "
                        f"transformers' PreTrainedTokenizerFast), a tokenizer directory or None, got "
                        f"{type(tokenizer).__name__}")


def load_model(path_or_name: Union[str, os.PathLike], device: Union[str, torch.device] = "cpu",
               dtype: Optional[torch.dtype] = None, backend: str = "auto", tokenizer=None,
               check_finite: bool = True) -> RecurrentModel:
    """Loads a local checkpoint directory (or a bundled name) strictly: every mismatch is listed.

    Every file is checked before any tensor is built (config keys for type and range, tokenizer files, each weight
    file's header against its size and index, shards inside the directory); check_finite refuses NaN/inf weights
    by tensor name (False loads them, e.g. to inspect a diverged checkpoint).

    fla's format gives a RecurrentLM; a transformers checkpoint of a family the bridge knows (Qwen3.5 dense, MoE or
    multimodal, Qwen3-Next, OLMo-hybrid, Kimi-Linear, Mamba-2) gives a BridgedLM. Both implement the same model protocol (interp.models.protocol).

    tokenizer: a tokenizer object, or a directory to load one from (AutoTokenizer); by default the checkpoint's own
    (tokenizer.json beside config.json). A checkpoint without one loads for forward and hook work; building recall
    pairs then asks for one."""
    _check_load_args(path_or_name, device, dtype, tokenizer)
    directory = resolve_checkpoint(path_or_name)
    cfg_file = directory / "config.json"
    if not cfg_file.exists():     # a FIFO or device config.json is refused by read_json, at once
        raise CheckpointError(f"{directory} has no config.json; copy the checkpoint's config.json beside its weights")
    raw_config = read_json(cfg_file, "model configuration")
    check_no_remote_code(directory)           # before transformers reads any file of it
    if isinstance(tokenizer, (str, os.PathLike)):
        check_no_remote_code(Path(tokenizer))
    try:
        fmt = checkpoint_format(raw_config) if isinstance(raw_config, dict) else "fla"
    except ValueError as err:
        raise CheckpointError(f"{cfg_file}: {err}") from None
    check_tokenizer_files(directory)
    if isinstance(tokenizer, (str, os.PathLike)):
        check_tokenizer_dir(Path(tokenizer))
    if fmt == "transformers":
        from recurscope.interp.bridge import load_transformers

        model = load_transformers(directory, raw_config, device=device, dtype=dtype, backend=backend,
                                  tokenizer=tokenizer, check_finite=check_finite)
        model.name_or_path = str(path_or_name)
        return model
    cfg = _read_config(cfg_file)
    weights = cfg.family.weights
    # The shapes come from the model itself, built before the weights are read: a probe on the meta device would
    # initialise its weights through torch's Python decompositions, whose first use imports torch._dynamo (1-3 s).
    check_config_fits_weights(directory, raw_config)     # before a 5e7-row embedding is allocated
    model = RecurrentLM(cfg)
    expected = {weights.to_checkpoint(k): v.shape for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    raw = expand_vocab_rows(directory, _read_state_dict(directory), cfg.vocab_size)
    missing = sorted(set(expected) - set(raw))
    unexpected = sorted(k for k in set(raw) - set(expected) if not (cfg.tie_word_embeddings and k == "lm_head.weight"))
    wrong = sorted(f"{k}: checkpoint {tuple(raw[k].shape)} vs config {tuple(expected[k])}"
                   for k in set(raw) & set(expected) if tuple(raw[k].shape) != tuple(expected[k]))
    if missing or unexpected or wrong:
        raise mismatch_error(directory, cfg.model_type, missing, unexpected, wrong)
    ours = {weights.to_ours(k): v for k, v in raw.items() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    result = model.load_state_dict(ours, strict=not cfg.tie_word_embeddings)
    if cfg.tie_word_embeddings:
        leftover = [k for k in result.missing_keys if k != "lm_head.weight"]
        if leftover or result.unexpected_keys:
            raise ValueError(f"internal weight mapping error: missing {leftover}, unexpected {result.unexpected_keys}")
    if check_finite:
        check_finite_weights(ours.items(), directory, weights.to_checkpoint)
    check_cast_fits(ours.items(), dtype, directory, weights.to_checkpoint)
    model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
    model.set_backend(backend)
    model.name_or_path = str(path_or_name)
    model.checkpoint_dir = directory
    model.eval()
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        model.tokenizer = tokenizer
        return model
    tokenizer_dir = Path(tokenizer) if tokenizer is not None else directory
    if (tokenizer_dir / "tokenizer.json").exists() or (tokenizer_dir / "tokenizer_config.json").exists():
        check_tokenizer_files(tokenizer_dir)
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        from recurscope.interp.bridge.loader import tokenizer_class

        # tokenizer_config.json's tokenizer_class must name a tokenizer class (never a model class or any other name)
        cls = tokenizer_class(tokenizer_dir, AutoTokenizer)
        # AutoTokenizer peeks at config.json, whose fla model_type transformers does not know; that is expected.
        previous = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            model.tokenizer = cls.from_pretrained(str(tokenizer_dir), trust_remote_code=False)
        except Exception as err:  # tokenizers and transformers raise many types for damaged files
            reason = " ".join(str(err).split())[:300] or type(err).__name__
            raise CheckpointError(f"the tokenizer files of {tokenizer_dir} cannot be loaded ({type(err).__name__}: "
                                  f"{reason}); restore tokenizer.json and tokenizer_config.json from the original "
                                  "checkpoint") from err
        finally:
            hf_logging.set_verbosity(previous)
        check_tokenizer_fits(model.tokenizer, cfg.vocab_size, tokenizer_dir)
    return model


def save_model(model: RecurrentLM, directory: Union[str, os.PathLike], extra_config: Optional[dict] = None) -> Path:
    """Writes config.json and model.safetensors with fla's weight names (and the tokenizer, if attached)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg.to_dict()
    cfg.update(extra_config or {})
    (directory / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    sd = {}
    for k, v in model.state_dict().items():
        if model.cfg.tie_word_embeddings and k == "lm_head.weight":
            continue
        sd[model.family.weights.to_checkpoint(k)] = v.detach().contiguous().cpu()
    save_file(sd, str(directory / "model.safetensors"), metadata={"format": "pt"})
    if model.tokenizer is not None:
        model.tokenizer.save_pretrained(str(directory))
    return directory


def state_from_fla(state: torch.Tensor) -> torch.Tensor:
    """fla's GLA/GDN caches keep each head's state as (V, K); recurscope keeps (K, V) everywhere."""
    return state.transpose(-1, -2)
