"""Loading a local transformers checkpoint directory into a BridgedLM, with every problem named."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Union

import torch

from recurscope.interp.bridge.families import bridge_family, supported_model_types
from recurscope.interp.bridge.model import BridgedLM
from recurscope.interp.checkpoint_files import CheckpointError, check_shards

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
                      backend: str = "auto", tokenizer=None) -> BridgedLM:
    """A BridgedLM over the checkpoint in `directory`. `tokenizer`: an object or a directory; by default
    the checkpoint's own. Without any the model loads for forward and hook work (model.tokenizer is None) and
    building pairs says what to do."""
    directory = Path(directory)
    family = bridge_family(raw_config.get("model_type"))
    if family is None:
        raise ValueError(f"model_type {raw_config.get('model_type')!r} is not one the bridge loads "
                         f"({', '.join(supported_model_types())})")
    check_shards(directory)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(tokenizer, (str, Path)):
        tokenizer = _tokenizer(Path(tokenizer), AutoTokenizer)
    elif tokenizer is None and any((directory / f).is_file() for f in TOKENIZER_FILES):
        tokenizer = _tokenizer(directory, AutoTokenizer)
    from transformers.utils import logging as hf_logging

    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()   # its load report would repeat what the check below says in one line
    try:
        hf, info = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype or torch.float32,
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
    model = BridgedLM(hf, family, tokenizer)
    model.to(device)
    model.set_backend(backend)
    model.checkpoint_dir = directory
    model.eval()
    return model
