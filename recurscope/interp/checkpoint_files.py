"""The files of a checkpoint directory, read and checked before any model is built: weight files, JSON files and
shard indexes. Both loaders (fla format and the transformers bridge) use these, so each problem gets the same
message naming the file and the fix."""
from __future__ import annotations

import json
from pathlib import Path

import torch


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: the message names the file, what is wrong with it and the fix."""


def check_shards(directory: Path) -> None:
    """A sharded checkpoint's index must name existing files, and each file must hold exactly the index's keys."""
    index = directory / "model.safetensors.index.json"
    if not index.is_file():
        return
    from safetensors import safe_open

    weight_map = json.loads(index.read_text()).get("weight_map", {})
    by_file: dict[str, set] = {}
    for key, fname in weight_map.items():
        by_file.setdefault(fname, set()).add(key)
    problems = []
    for fname, keys in sorted(by_file.items()):
        path = directory / fname
        if not path.is_file():
            problems.append(f"{fname} is named by the index but missing")
            continue
        with safe_open(str(path), "pt") as fh:
            held = set(fh.keys())
        if held - keys:
            problems.append(f"{fname} holds {len(held - keys)} weights the index puts elsewhere or omits "
                            f"(e.g. {sorted(held - keys)[:3]})")
        if keys - held:
            problems.append(f"{fname} lacks {len(keys - held)} weights the index puts in it (e.g. {sorted(keys - held)[:3]})")
    stray = sorted(p.name for p in directory.glob("*.safetensors") if p.name not in by_file)
    if stray:
        problems.append(f"files not in the index: {stray}")
    if problems:
        raise CheckpointError(f"the shards of {directory} do not match model.safetensors.index.json: " + "; ".join(problems)
                         + ". Re-download or re-save the checkpoint; nothing was loaded.")


def read_weight_file(path: Path) -> dict:
    """One weight file's tensors; a truncated, empty or garbled file raises CheckpointError naming it."""
    if path.stat().st_size == 0:
        raise CheckpointError(f"{path} is empty (0 bytes); the download or save was interrupted: download or save "
                              "the checkpoint again")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # safetensors and torch raise their own types for a damaged file
        reason = " ".join(str(err).split()) or type(err).__name__
        raise CheckpointError(f"{path} cannot be read as weights ({type(err).__name__}: {reason}); the file is "
                              "truncated or corrupt: download or save the checkpoint again") from err


def read_json(path: Path, what: str):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError is a ValueError
        raise CheckpointError(f"{path} is not valid JSON ({err}); it should be the checkpoint's {what}: restore it "
                              "from the original checkpoint") from None
