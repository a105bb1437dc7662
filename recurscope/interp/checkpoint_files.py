"""The files of a checkpoint directory, read and checked before any model is built: weight files, JSON files and
shard indexes. Both loaders (fla format and the transformers bridge) use these, so each problem gets the same
message naming the file and the fix."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import torch


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: the message names the file, what is wrong with it and the fix."""


class CheckpointMismatch(CheckpointError):
    """Weights that do not match config.json: the message is one line (counts, the first mismatch and the fix);
    `details` lists every mismatch (the CLI prints them with --verbose)."""

    def __init__(self, message: str, details: list[str]):
        super().__init__(message)
        self.details = details


def mismatch_error(directory, model_type, missing, unexpected, wrong) -> CheckpointMismatch:
    """The refusal of a checkpoint whose weights do not match its config.json: missing and unexpected weight names
    and "name: checkpoint (shape) vs config (shape)" lines, each list sorted."""
    groups = (("missing", "missing weights", "missing weight", missing),
              ("unexpected", "unexpected weights", "unexpected weight", unexpected),
              ("with the wrong shape", "shape mismatches", "shape mismatch", wrong))
    counts = [f"{len(names)} {count}" for count, _, _, names in groups if names]
    first = next(f"{one} {names[0]}" for _, _, one, names in groups if names)
    details = []
    for _, title, _, names in groups:
        if names:
            details.append(f"  {title} ({len(names)}):")
            details += [f"    {n}" for n in names]
    return CheckpointMismatch(f"checkpoint {directory} does not match its config.json ({model_type}): "
                              f"{', '.join(counts)} weights (first: {first}); check that config.json belongs to "
                              "these weights (nothing was loaded; --verbose lists every mismatch)", details)


def shard_path(directory: Path, name, index: Path) -> Path:
    """The file a shard index names, which must be a plain relative path resolving inside `directory` (a shard
    outside would load weights the checkpoint hash does not cover)."""
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"{index} names a shard {name!r}, not a file name; restore the index from the "
                              "original checkpoint")
    # Judged on the name itself, not on where symbolic links lead: Hugging Face's cache links each file of a
    # snapshot to a blob outside it, and the hash reads through those links.
    parts = Path(os.path.normpath(name)).parts
    if Path(name).is_absolute() or not parts or parts[0] in ("..", "."):
        raise CheckpointError(f"{index} names the shard {name!r}, which lies outside the checkpoint directory "
                              f"{directory}; shards must be files inside it: move the shard into the directory and "
                              "name it by its file name")
    return directory / name


def read_index(directory: Path) -> dict:
    """model.safetensors.index.json's weight map (weight name -> shard file name), every shard inside `directory`."""
    index = directory / "model.safetensors.index.json"
    raw = read_json(index, "shard index")
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index} has no 'weight_map' object; restore it from the original checkpoint")
    for fname in set(map(str, weight_map.values())) | {v for v in weight_map.values() if not isinstance(v, str)}:
        shard_path(directory, fname, index)
    return weight_map


# safetensors' integer and boolean dtypes: no weight of a supported model is stored so (an lm_head marked I32 would
# be read as integers and cast, giving logits of 1e11); only these buffers may be.
INTEGER_DTYPES = ("BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64")
INTEGER_BUFFERS = ("position_ids", "num_batches_tracked")


def safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file, checked against the file's size without reading any tensor: a
    truncated or garbled file raises CheckpointError naming it at once (loading would fail minutes later)."""
    size = path.stat().st_size
    fix = "the file is truncated or corrupt: download or save the checkpoint again"
    if size == 0:
        raise CheckpointError(f"{path} is empty (0 bytes); the download or save was interrupted: download or save "
                              "the checkpoint again")
    with open(path, "rb") as fh:
        head = fh.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or 8 + n > size:
            raise CheckpointError(f"{path} cannot be read as weights (its header claims {n} bytes, the file has "
                                  f"{size}); {fix}")
        try:
            header = json.loads(fh.read(n).decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            header = None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} cannot be read as weights (its header is not a JSON object); {fix}")
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = info.get("dtype") if isinstance(info, dict) else None
        if dtype in INTEGER_DTYPES and not name.endswith(INTEGER_BUFFERS):
            raise CheckpointError(f"{path}: tensor `{name}` is stored as {dtype}, but a model weight is floating "
                                  "point (F32, F16, BF16 or F64); its values would be read as garbage: the file is "
                                  "damaged or was not saved from a model: download or save the checkpoint again")
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise CheckpointError(f"{path} cannot be read as weights (tensor {name!r} has no valid data_offsets); "
                                  f"{fix}")
        end = max(end, offsets[1])
    if 8 + n + end != size:
        raise CheckpointError(f"{path} cannot be read as weights (truncated: its header describes {8 + n + end} "
                              f"bytes, the file has {size}); {fix}")
    return {k: v for k, v in header.items() if k != "__metadata__"}


def check_shards(directory: Path) -> None:
    """Every safetensors file's header against its size, then a sharded checkpoint's index: it must name files
    inside the directory that exist, and each must hold exactly the index's keys. Reads headers only."""
    index = directory / "model.safetensors.index.json"
    if not index.is_file():
        for path in sorted(directory.glob("*.safetensors")):
            safetensors_header(path)
        return
    weight_map = read_index(directory)
    by_file: dict[str, set] = {}
    for key, fname in weight_map.items():
        by_file.setdefault(fname, set()).add(key)
    problems = []
    for fname, keys in sorted(by_file.items()):
        path = directory / fname
        if not path.is_file():
            problems.append(f"{fname} is named by the index but missing")
            continue
        held = set(safetensors_header(path))
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
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # safetensors and torch raise their own types for a damaged file
        reason = " ".join(str(err).split())[:300] or type(err).__name__
        if "weights_only" in reason or "Unpickl" in type(err).__name__:
            raise CheckpointError(f"{path} is not a plain weight file: it asks to run code when unpickled, which "
                                  "recurscope never does; use the checkpoint's safetensors files (or convert it "
                                  "with a tool you trust)") from None
        raise CheckpointError(f"{path} cannot be read as weights ({type(err).__name__}: {reason}); the file is "
                              "truncated or corrupt: download or save the checkpoint again") from err
    if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise CheckpointError(f"{path} holds a {type(loaded).__name__}, not a dict of weight tensors; download or "
                              "save the checkpoint again")
    for name, tensor in loaded.items():
        if not (tensor.is_floating_point() or str(name).endswith(INTEGER_BUFFERS)):
            raise CheckpointError(f"{path}: tensor `{name}` is stored as {tensor.dtype}, but a model weight is "
                                  "floating point; the file is damaged or was not saved from a model: download or "
                                  "save the checkpoint again")
    return loaded


# A JSON file of a checkpoint (config, tokenizer configuration, index) larger than this is not one: a link to
# /dev/zero or a stray data file, refused before it is read into memory.
MAX_JSON_BYTES = 1 << 30


def file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def read_regular(path: Path, what: str, limit: int = MAX_JSON_BYTES) -> bytes:
    """The bytes of `path`, which must be a regular file (a link to one is followed) of at most `limit` bytes. A FIFO,
    a device or a socket is refused at once, without blocking on it: opened non-blocking, judged by fstat."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise
    except OSError as err:
        raise CheckpointError(f"{path} cannot be opened ({err.strerror or err}); it should be {what}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(f"{path} is {file_kind(info.st_mode)}, not a regular file; it should be {what}: "
                                  "replace it with the file itself")
        if info.st_size > limit:
            raise CheckpointError(f"{path} is {info.st_size:,} bytes, more than the {limit:,} that {what} can be; "
                                  "it is the wrong file: restore it from the original checkpoint")
        chunks = []
        while True:
            block = os.read(fd, 1 << 20)
            if not block:
                break
            chunks.append(block)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_json(path: Path, what: str):
    try:
        return json.loads(read_regular(path, f"the checkpoint's {what}").decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError is a ValueError
        if isinstance(err, CheckpointError):
            raise

        raise CheckpointError(f"{path} is not valid JSON ({err}); it should be the checkpoint's {what}: restore it "
                              "from the original checkpoint") from None


# Files whose `auto_map` would make transformers import Python shipped with the checkpoint.
CODE_MAP_FILES = ("config.json", "tokenizer_config.json")


def _auto_maps(raw, where: str = "") -> list:
    """The key paths of every `auto_map` in a parsed JSON file (nested ones included, e.g. text_config.auto_map)."""
    found = []
    if isinstance(raw, dict):
        for key, value in raw.items():
            path = f"{where}.{key}" if where else str(key)
            if key == "auto_map":
                found.append(path)
            else:
                found += _auto_maps(value, path)
    elif isinstance(raw, list):
        for i, value in enumerate(raw):
            found += _auto_maps(value, f"{where}[{i}]")
    return found


def check_no_remote_code(directory: Path) -> None:
    """Refuses a checkpoint whose config.json or tokenizer_config.json has an `auto_map`: transformers would import
    the Python it names (after a prompt, or at once with trust_remote_code). recurscope never runs a checkpoint's
    code; it is refused here, before transformers reads anything, naming the file and the key."""
    for name in CODE_MAP_FILES:
        path = Path(directory) / name
        if not path.exists():
            continue
        keys = _auto_maps(read_json(path, "configuration"))
        if keys:
            raise CheckpointError(f"{path}: `{keys[0]}` names Python code shipped with the checkpoint, and recurscope "
                                  "never runs a checkpoint's code; remove the key (recurscope loads fla's and "
                                  "transformers' own architectures only)")


# Tokenizer files: what each must hold, checked before transformers reads them (it raises bare KeyErrors).
TOKENIZER_JSON_KEYS = {"model": dict, "added_tokens": list}


def check_tokenizer_files(directory: Path) -> None:
    """tokenizer.json and tokenizer_config.json parsed and checked, each problem naming its file."""
    tok = directory / "tokenizer.json"
    if tok.exists():              # not is_file(): a FIFO or device is refused by read_json, not skipped
        raw = read_json(tok, "tokenizer (tokenizers' JSON format)")
        if not isinstance(raw, dict):
            raise CheckpointError(f"{tok} holds a JSON {type(raw).__name__}, not a tokenizer object; restore it "
                                  "from the original checkpoint (tokenizer.save_pretrained writes it)")
        for key, kind in TOKENIZER_JSON_KEYS.items():
            if not isinstance(raw.get(key), kind):
                got = "nothing" if key not in raw else f"a {type(raw[key]).__name__}"
                raise CheckpointError(f"{tok}: `{key}` must be a JSON {'object' if kind is dict else 'list'}, got "
                                      f"{got}; the file is damaged: restore it from the original checkpoint")
        vocab = raw["model"].get("vocab")
        if vocab is not None and not isinstance(vocab, (dict, list)):
            raise CheckpointError(f"{tok}: `model.vocab` must be a JSON object or list, got a "
                                  f"{type(vocab).__name__}; restore it from the original checkpoint")
        unk = raw["model"].get("unk_token")
        if raw["model"].get("type") == "WordLevel" and isinstance(vocab, dict) and unk not in vocab:
            raise CheckpointError(f"{tok}: the WordLevel vocabulary lacks its unknown token (`model.unk_token` "
                                  f"{unk!r} is not in `model.vocab`), so any word outside the vocabulary fails to "
                                  "encode; add the token to the vocabulary, or restore the file from the original "
                                  "checkpoint")
    cfg = directory / "tokenizer_config.json"
    if cfg.exists():
        raw = read_json(cfg, "tokenizer configuration")
        if not isinstance(raw, dict):
            raise CheckpointError(f"{cfg} holds a JSON {type(raw).__name__}, not an object of tokenizer options; "
                                  "restore it from the original checkpoint")
        named = raw.get("tokenizer_class")
        if named is not None and not (isinstance(named, str) and named.isidentifier()):
            raise CheckpointError(f"{cfg}: `tokenizer_class` must be the name of a tokenizer class (e.g. "
                                  f"\"PreTrainedTokenizerFast\"), got {named!r}; fix it or remove the key")


def check_finite_weights(named_tensors, directory: Path, rename=lambda name: name) -> None:
    """Refuses NaN/inf in any floating weight, naming the first such tensor (by its checkpoint name)."""
    for name, t in named_tensors:
        if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise CheckpointError(f"weight {rename(name)} in {directory} holds {bad} NaN or inf value(s); the "
                                  "checkpoint is corrupt: download or save it again (or load it with "
                                  "check_finite=False to inspect it)")


# Files a loader reads besides the weights: they change the model (config.json's tie_word_embeddings) or its
# tokens, so the checkpoint hash covers them.
LOADED_TEXT_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                     "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
                     "generation_config.json")


def check_tokenizer_fits(tokenizer, vocab_size: int, directory: Path) -> None:
    """A tokenizer whose ids reach past the model's embedding is the wrong tokenizer for these weights."""
    try:
        n = len(tokenizer)
    except TypeError:          # a raw tokenizers.Tokenizer
        n = tokenizer.get_vocab_size(with_added_tokens=True)
    if n > vocab_size:
        raise CheckpointError(f"the tokenizer in {directory} has {n} tokens but config.json's vocab_size is "
                              f"{vocab_size}: it is not this model's tokenizer (check `tokenizer_class` in "
                              "tokenizer_config.json); restore the checkpoint's own tokenizer files")


def check_cast_fits(named_tensors, dtype, directory: Path, rename=lambda name: name) -> None:
    """Refuses a cast to `dtype` that would turn a finite weight into inf (3e38 in float16), naming the tensor:
    every floating weight's largest magnitude against the dtype's largest finite value."""
    if dtype is None or not dtype.is_floating_point:
        return
    limit = torch.finfo(dtype).max
    for name, t in named_tensors:
        if (t.is_floating_point() and t.numel() and torch.finfo(t.dtype).max > limit
                and float(t.detach().abs().max()) > limit):
            raise CheckpointError(f"weight {rename(name)} in {directory} holds {float(t.detach().abs().max()):.3g}, "
                                  f"beyond {str(dtype).replace('torch.', '')}'s largest value {limit:.3g}: it would "
                                  "become inf; load it in float32 or bfloat16 (--dtype float32)")


def check_cast_fits_files(directory: Path, dtype) -> None:
    """check_cast_fits over a directory's safetensors files, tensor by tensor (the bridge casts while it loads)."""
    if dtype is None or not dtype.is_floating_point or torch.finfo(dtype).max >= torch.finfo(torch.float32).max:
        return
    from safetensors import safe_open

    for path in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            check_cast_fits(((k, handle.get_tensor(k)) for k in handle.keys()), dtype, directory)


def check_config_fits_weights(directory: Path, raw: dict) -> None:
    """config.json's vocab_size x hidden_size embedding (at least one byte a weight) against the bytes of every weight
    file together: a vocab_size of 5e7 would allocate tens of GiB before the shapes are compared, so it is refused
    first, naming both numbers."""
    raw = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    vocab, hidden = raw.get("vocab_size"), raw.get("hidden_size")
    if not (isinstance(vocab, int) and isinstance(hidden, int) and vocab > 0 and hidden > 0):
        return
    held = sum(p.stat().st_size for p in Path(directory).iterdir()
               if p.suffix in (".safetensors", ".bin") and p.is_file())
    need = vocab * hidden
    if held and need > held:
        raise CheckpointError(f"{Path(directory) / 'config.json'}: vocab_size {vocab:,} x hidden_size {hidden:,} = "
                              f"{need:,} embedding weights (at least {need / (1 << 30):,.1f} GiB to build), more than "
                              f"the {held:,} bytes all the weight files hold; vocab_size does not match these "
                              "weights: restore config.json from the original checkpoint")


#: A checkpoint trained on a few thousand tokens of a large vocabulary may store only those tokens' rows of its
#: token-indexed matrices (embedding, output head) plus one row shared by every other token; this file says which.
VOCAB_ROWS_FILE = "vocab_rows.json"


def expand_vocab_rows(directory: Path, state_dict: dict, vocab_size: int) -> dict:
    """`state_dict` with every tensor that VOCAB_ROWS_FILE names expanded from its stored rows to `vocab_size` rows
    (unchanged when the directory has no such file).

    The file holds {"vocab_size": V, "token_ids": [t_0, ..., t_{R-1}], "tensors": [names]}: each named tensor is
    stored with R + 1 rows, row i being token t_i's and row R every other token's. After expansion the model is an
    ordinary V-row model in which the tokens outside token_ids share one embedding and one output row (so they share
    one logit)."""
    path = directory / VOCAB_ROWS_FILE
    if not path.is_file():
        return state_dict
    raw = read_json(path, "stored vocabulary rows")
    fix = f"restore {VOCAB_ROWS_FILE} from the original checkpoint"
    ids, names = (raw.get("token_ids"), raw.get("tensors")) if isinstance(raw, dict) else (None, None)
    if (not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
            or not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names)):
        raise CheckpointError(f"{path} must hold a non-empty list of integer `token_ids` and a list of tensor names "
                              f"`tensors`; {fix}")
    if raw.get("vocab_size") != vocab_size:
        raise CheckpointError(f"{path} is for a vocabulary of {raw.get('vocab_size')!r} tokens but config.json's "
                              f"vocab_size is {vocab_size}; {fix}")
    if len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= vocab_size:
        raise CheckpointError(f"{path}: `token_ids` must be distinct ids in [0, {vocab_size - 1}]; {fix}")
    table = torch.full((vocab_size,), len(ids), dtype=torch.long)
    table[torch.tensor(ids, dtype=torch.long)] = torch.arange(len(ids))
    out = dict(state_dict)
    for name in names:
        tensor = state_dict.get(name)
        if tensor is None or tensor.dim() < 1 or tensor.shape[0] != len(ids) + 1:
            got = "absent" if tensor is None else f"of shape {tuple(tensor.shape)}"
            raise CheckpointError(f"{path} names the weight {name!r}, which must have {len(ids) + 1} rows (one per "
                                  f"listed token and one shared) but is {got}; {fix}")
        out[name] = tensor[table]
    return out
