"""Loading a local transformers checkpoint directory into a BridgedLM, with every problem named."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Union

import torch

from recurscope.interp.bridge.families import bridge_family, supported_model_types
from recurscope.interp.bridge.model import BridgedLM
from recurscope.interp.checkpoint_files import check_shards

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def _tokenizer(directory: Path, auto):
    """The tokenizer class the directory's tokenizer_config.json names, if transformers has it; AutoTokenizer
    otherwise. (AutoTokenizer prefers the model_type's own class, e.g. Qwen3_5Tokenizer, which would misread a
    plain tokenizers-backend tokenizer.json saved beside a Qwen3.5 model.)"""
    import transformers

    cfg_file = directory / "tokenizer_config.json"
    named = json.loads(cfg_file.read_text()).get("tokenizer_class") if cfg_file.is_file() else None
    cls = getattr(transformers, named, None) if named else None
    return (cls or auto).from_pretrained(str(directory))


def load_transformers(directory: Union[str, Path], raw_config: dict, device="cpu", dtype: Optional[torch.dtype] = None,
                      backend: str = "auto") -> BridgedLM:
    directory = Path(directory)
    family = bridge_family(raw_config.get("model_type"))
    if family is None:
        raise ValueError(f"model_type {raw_config.get('model_type')!r} is not one the bridge loads "
                         f"({', '.join(supported_model_types())})")
    if not any((directory / f).is_file() for f in TOKENIZER_FILES):
        raise ValueError(f"{directory} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); copy the tokenizer "
                         "files of the original checkpoint into it (AutoTokenizer.from_pretrained(...).save_pretrained)")
    check_shards(directory)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = _tokenizer(directory, AutoTokenizer)
    hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype or torch.float32)
    model = BridgedLM(hf, family, tokenizer)
    model.to(device)
    model.set_backend(backend)
    model.checkpoint_dir = directory
    model.eval()
    return model
