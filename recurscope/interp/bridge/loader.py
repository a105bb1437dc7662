"""Loading a local transformers checkpoint directory into a BridgedLM, with every problem named."""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import torch

from recurscope.interp.bridge.families import bridge_family, supported_model_types
from recurscope.interp.bridge.model import BridgedLM
from recurscope.interp.checkpoint_files import (VOCAB_ROWS_FILE, CheckpointError, check_finite_weights, check_shards,
                                                check_tokenizer_fits, expand_vocab_rows, read_json,
                                                read_weight_file)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def _tokenizer_class(directory: Path, auto):
    """The tokenizer class tokenizer_config.json names, looked up among transformers' tokenizer classes only (never
    any other attribute of transformers: a name like "pipeline" or "AutoModel" is refused); AutoTokenizer when it
    names none. (AutoTokenizer prefers the model_type's own class, e.g. Qwen3_5Tokenizer, which would misread a
    plain tokenizers-backend tokenizer.json saved beside a Qwen3.5 model.)"""
    import transformers

    cfg_file = directory / "tokenizer_config.json"
    raw = read_json(cfg_file, "tokenizer configuration") if cfg_file.is_file() else {}
    named = raw.get("tokenizer_class") if isinstance(raw, dict) else None
    if not named:
        return auto
    if named in ("AutoTokenizer",):
        return auto
    try:
        cls = getattr(transformers, named, None)
    except Exception:  # transformers' lazy module raises its own errors for some names
        cls = None
    base = transformers.PreTrainedTokenizerBase
    if not (isinstance(cls, type) and issubclass(cls, base)):
        what = ("no such name in transformers" if cls is None else "a class but not a tokenizer class"
                if isinstance(cls, type) else f"a {type(cls).__name__}, not a tokenizer class")
        raise CheckpointError(f"{cfg_file}: `tokenizer_class` {named!r} is {what}; name a tokenizer class (e.g. "
                              "\"PreTrainedTokenizerFast\") or remove the key to let AutoTokenizer choose")
    return cls


def _tokenizer(directory: Path, auto):
    cls = _tokenizer_class(directory, auto)
    try:
        return cls.from_pretrained(str(directory))
    except Exception as err:  # tokenizers and transformers raise many types for damaged files
        reason = " ".join(str(err).split())[:300] or type(err).__name__
        raise CheckpointError(f"the tokenizer files of {directory} cannot be loaded by {cls.__name__} "
                              f"({type(err).__name__}: {reason}); restore tokenizer.json and tokenizer_config.json "
                              "from the original checkpoint") from err


# config.json keys the bridge and transformers' models read, checked for type and range (models.config.check_key
# words the messages) before transformers sees them; Qwen3.5's multimodal layout nests them in text_config.
BRIDGE_POSITIVE_INTS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                        "num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings",
                        "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                        "linear_value_head_dim", "linear_conv_kernel_dim", "moe_intermediate_size", "num_experts",
                        "num_experts_per_tok", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
                        "qk_nope_head_dim", "v_head_dim")
BRIDGE_BOOLS = ("tie_word_embeddings", "attention_bias", "linear_allow_neg_eigval")


def check_bridge_config(raw: dict, where: str = "config.json") -> None:
    """Type and range of every key above, then layer_types against num_hidden_layers; ValueError naming the key."""
    from recurscope.interp.models import config as fla_config

    for key in BRIDGE_POSITIVE_INTS:
        if key in raw and raw[key] is not None:
            if not (fla_config._is_int(raw[key]) and raw[key] > 0):
                raise ValueError(f"{where}: `{key}` must be a positive integer, got {fla_config._show(raw[key])}; "
                                 "fix it to match the checkpoint's weights")
    for key in BRIDGE_BOOLS:
        if key in raw and not isinstance(raw[key], bool):
            raise ValueError(f"{where}: `{key}` must be true or false (a JSON boolean), got "
                             f"{fla_config._show(raw[key])}; fix it to match the checkpoint's weights")
    eps = raw.get("rms_norm_eps")
    if eps is not None and not (fla_config._is_number(eps) and eps > 0):
        raise ValueError(f"{where}: `rms_norm_eps` must be a positive number, got {fla_config._show(eps)}")
    types, n = raw.get("layer_types"), raw.get("num_hidden_layers")
    if types is not None and (not isinstance(types, list) or not all(isinstance(t, str) for t in types)
                              or (isinstance(n, int) and len(types) != n)):
        raise ValueError(f"{where}: `layer_types` must be a list of {n} layer kinds (\"linear_attention\" or "
                         f"\"full_attention\"), got {fla_config._show(types)}")
    if isinstance(raw.get("text_config"), dict):
        check_bridge_config(raw["text_config"], f"{where} text_config")


def load_transformers(directory: Union[str, Path], raw_config: dict, device="cpu", dtype: Optional[torch.dtype] = None,
                      backend: str = "auto", tokenizer=None, check_finite: bool = True) -> BridgedLM:
    """A BridgedLM over the checkpoint in `directory`. `tokenizer`: an object or a directory; by default
    the checkpoint's own. Without any the model loads for forward and hook work (model.tokenizer is None) and
    building pairs says what to do. The config's keys are checked for type and range, and transformers' own config
    validation reworded in one line, before any tensor is built; check_finite refuses NaN/inf weights by name."""
    directory = Path(directory)
    family = bridge_family(raw_config.get("model_type"))
    if family is None:
        raise ValueError(f"model_type {raw_config.get('model_type')!r} is not one the bridge loads "
                         f"({', '.join(supported_model_types())})")
    try:
        check_bridge_config(raw_config)
    except ValueError as err:
        raise CheckpointError(f"{directory}/{err}") from None
    check_shards(directory)
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    # the family's own class where AutoModelForCausalLM may build another library's (fla's Mamba-2, see model_class)
    model_cls = getattr(transformers, family.model_class) if family.model_class else AutoModelForCausalLM
    try:
        config = (model_cls.config_class if family.model_class else AutoConfig).from_pretrained(str(directory))
    except Exception as err:  # transformers' strict config validation raises several types, over several lines
        reason = " ".join(str(err).split()) or type(err).__name__
        raise CheckpointError(f"{directory}/config.json is refused by transformers ({reason}); fix the key it "
                              "names to match the checkpoint") from None
    if isinstance(tokenizer, (str, Path)):
        tokenizer = _tokenizer(Path(tokenizer), AutoTokenizer)
    elif tokenizer is None and any((directory / f).is_file() for f in TOKENIZER_FILES):
        tokenizer = _tokenizer(directory, AutoTokenizer)
    if tokenizer is not None:
        text = getattr(config, "text_config", None) or config
        check_tokenizer_fits(tokenizer, int(text.vocab_size), directory)
    from transformers.utils import logging as hf_logging

    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()   # its load report would repeat what the check below says in one line
    source = {"pretrained_model_name_or_path": str(directory)}
    if (directory / VOCAB_ROWS_FILE).is_file():   # token rows stored once per distinct row: expanded here
        if hasattr(model_cls, "_model_mapping"):     # an Auto class needs a path; the concrete class takes weights
            model_cls = model_cls._model_mapping[type(config)]
        weights = {}
        for path in sorted(directory.glob("*.safetensors")):
            weights.update(read_weight_file(path))
        text = getattr(config, "text_config", None) or config
        source = {"pretrained_model_name_or_path": None,
                  "state_dict": expand_vocab_rows(directory, weights, int(text.vocab_size))}
    try:
        hf, info = model_cls.from_pretrained(**source, config=config, dtype=dtype or torch.float32,
                                             output_loading_info=True, ignore_mismatched_sizes=True)
    finally:
        hf_logging.set_verbosity(previous)
    missing, unexpected = sorted(info.get("missing_keys", [])), sorted(info.get("unexpected_keys", []))
    wrong = sorted(f"{m[0]}: checkpoint {tuple(m[1])} vs config {tuple(m[2])}" if isinstance(m, (tuple, list))
                   and len(m) == 3 else str(m) for m in info.get("mismatched_keys", []))
    if missing or unexpected or wrong:
        counts = [f"{len(v)} {k}" for k, v in (("missing", missing), ("unexpected", unexpected),
                                                  ("with the wrong shape", wrong)) if v]
        lines = [f"checkpoint {directory} does not match its config.json ({raw_config.get('model_type')}): "
                 f"{', '.join(counts)} weights; check that config.json belongs to these weights (nothing was loaded)"]
        for title, names in (("missing weights", missing), ("unexpected weights", unexpected),
                             ("shape mismatches", wrong)):
            if names:
                lines.append(f"  {title} ({len(names)}):")
                lines += [f"    {n}" for n in names]
        raise CheckpointError("\n".join(lines))
    if check_finite:
        check_finite_weights(hf.state_dict().items(), directory)
    model = BridgedLM(hf, family, tokenizer)
    model.to(device)
    model.set_backend(backend)
    model.checkpoint_dir = directory
    model.eval()
    return model
