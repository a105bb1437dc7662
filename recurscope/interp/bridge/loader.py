"""Loading a local transformers checkpoint directory into a BridgedLM, with every problem named."""
from __future__ import annotations

import warnings

from pathlib import Path
from typing import Optional, Union

import torch

from recurscope.interp.bridge.families import bridge_family, supported_model_types
from recurscope.interp.bridge.model import BridgedLM
from recurscope.interp.checkpoint_files import (VOCAB_ROWS_FILE, CheckpointError, check_cast_fits_files,
                                                check_config_fits_weights, check_finite_weights,
                                                check_no_remote_code, check_shards, check_tokenizer_fits,
                                                expand_vocab_rows, mismatch_error, read_json, read_weight_file)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def _named_tokenizer_class(directory: Path) -> Optional[str]:
    """The tokenizer class tokenizer_config.json names, checked to be one of transformers' tokenizer classes (never
    any other attribute of transformers: a name like "pipeline" or "AutoModel" is refused by name); None when it
    names none."""
    import transformers

    cfg_file = directory / "tokenizer_config.json"
    raw = read_json(cfg_file, "tokenizer configuration") if cfg_file.exists() else {}
    named = raw.get("tokenizer_class") if isinstance(raw, dict) else None
    if not named or named == "AutoTokenizer":
        return None
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
    return named


def tokenizer_class(directory: Path, auto):
    """For a native (fla-format) checkpoint, whose model_type AutoTokenizer does not know: the tokenizer class
    tokenizer_config.json names (checked to be one of transformers' tokenizer classes), else `auto`."""
    import transformers

    named = _named_tokenizer_class(directory)
    return auto if named is None else getattr(transformers, named)


def _tokenizer(directory: Path, config):
    """The tokenizer transformers' AutoTokenizer chooses for this model's config (its model_type's own class where
    transformers registers one, e.g. Qwen3_5Tokenizer for qwen3_5, which matches Qwen's own encoder where
    Qwen2Tokenizer, often named in tokenizer_config.json, differs on some scripts). A disagreement with the named
    `tokenizer_class` is reported once, as a warning naming both."""
    import transformers
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    named = _named_tokenizer_class(directory)
    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()   # its notes on the class choice are said once below, in one line
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), trust_remote_code=False)
    except Exception as err:  # tokenizers and transformers raise many types for damaged files
        reason = " ".join(str(err).split())[:300] or type(err).__name__
        raise CheckpointError(f"the tokenizer files of {directory} cannot be loaded by AutoTokenizer "
                              f"({type(err).__name__}: {reason}); restore tokenizer.json and tokenizer_config.json "
                              "from the original checkpoint") from err
    finally:
        hf_logging.set_verbosity(previous)
    chosen = type(tokenizer).__name__
    # names are compared as the classes they are (transformers 5 keeps PreTrainedTokenizerFast as a name of
    # TokenizersBackend, and Qwen2TokenizerFast of Qwen2Tokenizer)
    if named is None or getattr(transformers, named) is type(tokenizer):
        return tokenizer
    where = f"{directory / 'tokenizer_config.json'} names tokenizer_class {named}; transformers' AutoTokenizer " \
            f"chooses {chosen} for model_type {getattr(config, 'model_type', None)!r}"
    declared, read = _model_kinds(directory, tokenizer)
    if declared is not None and read is not None and declared != read:
        # A model-specific class rebuilds its own BPE from the vocabulary; a tokenizer.json of another kind (a
        # word-level vocabulary saved beside a small model) is then misread, so the named class reads it instead.
        warnings.warn(f"{where}, which reads tokenizer.json's {declared} model as {read}; recurscope uses {named}",
                      TokenizerClassWarning, stacklevel=3)
        return getattr(transformers, named).from_pretrained(str(directory), trust_remote_code=False)
    warnings.warn(f"{where}; recurscope uses {chosen}, as transformers would (for {named}, pass --tokenizer DIR, a "
                  "directory holding only the tokenizer's files)", TokenizerClassWarning, stacklevel=3)
    return tokenizer


def _model_kinds(directory: Path, tokenizer) -> tuple[Optional[str], Optional[str]]:
    """The tokenizer model kind tokenizer.json declares (BPE, WordLevel, Unigram...) and the one `tokenizer` built
    (None where either is unknown)."""
    file = directory / "tokenizer.json"
    try:
        declared = read_json(file, "tokenizer").get("model", {}).get("type") if file.is_file() else None
    except (CheckpointError, AttributeError):
        declared = None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    read = type(backend.model).__name__ if backend is not None else None
    return declared, read


class TokenizerClassWarning(UserWarning):
    """tokenizer_config.json names another class than the one transformers' AutoTokenizer chooses."""


# config.json keys the bridge and transformers' models read, checked for type and range (models.config.check_key
# words the messages) before transformers sees them; Qwen3.5's multimodal layout nests them in text_config.
BRIDGE_POSITIVE_INTS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                        "num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings",
                        "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                        "linear_value_head_dim", "linear_conv_kernel_dim", "moe_intermediate_size", "num_experts",
                        "num_experts_per_tok", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
                        "qk_nope_head_dim", "v_head_dim",
                        # Mamba-2 and Nemotron-H (n_groups 0 divided by zero in transformers)
                        "num_heads", "n_groups", "state_size", "ssm_state_size", "mamba_num_heads", "mamba_head_dim",
                        "conv_kernel", "chunk_size", "expand")
BRIDGE_BOOLS = ("tie_word_embeddings", "attention_bias", "linear_allow_neg_eigval", "use_bias", "use_conv_bias",
                "mamba_proj_bias", "mlp_bias", "residual_in_fp32", "rescale_prenorm_residual", "norm_before_gate",
                "rms_norm")
BRIDGE_POSITIVE_FLOATS = ("time_step_min", "time_step_max", "time_step_floor", "layer_norm_epsilon")
#: [low, high] pairs a Mamba-2 layer reads: time_step_limit clamps dt (low < high, or every dt is one constant)
BRIDGE_RANGES = {"time_step_limit": True, "A_init_range": False}
BRIDGE_ACTIVATIONS = ("hidden_act", "mamba_hidden_act", "mlp_hidden_act")


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
    for key in BRIDGE_POSITIVE_FLOATS:
        if raw.get(key) is not None and not (fla_config._is_number(raw[key]) and raw[key] > 0):
            raise ValueError(f"{where}: `{key}` must be a positive number, got {fla_config._show(raw[key])}")
    for key, strict in BRIDGE_RANGES.items():
        if raw.get(key) is None:
            continue
        pair = fla_config.range_pair(raw[key])
        if pair is None or pair[0] < 0 or (pair[0] >= pair[1] if strict else pair[0] > pair[1]):
            raise ValueError(f"{where}: `{key}` must be a pair [low, high] of numbers with 0 <= low "
                             f"{'<' if strict else '<='} high, got {fla_config._show(raw[key])}; fix it to match the "
                             "checkpoint (transformers' default time_step_limit is "
                             "[0.0, {\"__float__\": \"Infinity\"}])")
    for key in BRIDGE_ACTIVATIONS:
        if key in raw:
            from transformers.activations import ACT2CLS

            if not (isinstance(raw[key], str) and raw[key] in ACT2CLS):
                raise ValueError(f"{where}: `{key}` must name an activation transformers knows (e.g. \"silu\", "
                                 f"\"relu2\", \"gelu\"), got {fla_config._show(raw[key])}")
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
    if not any(directory.glob("*.safetensors")):
        for path in sorted(directory.glob("pytorch_model*.bin")):   # pickles: refused unless plain tensors
            read_weight_file(path)
    check_config_fits_weights(directory, raw_config)     # before transformers allocates a 5e7-row embedding
    check_no_remote_code(directory)        # load_model checked already; a direct caller is checked here
    if isinstance(tokenizer, (str, Path)):
        check_no_remote_code(Path(tokenizer))
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    # the family's own class where AutoModelForCausalLM may build another library's (fla's Mamba-2, see model_class)
    model_cls = getattr(transformers, family.model_class) if family.model_class else AutoModelForCausalLM
    try:
        config = (model_cls.config_class if family.model_class else AutoConfig).from_pretrained(
            str(directory), trust_remote_code=False)
    except Exception as err:  # transformers' strict config validation raises several types, over several lines
        reason = " ".join(str(err).split()) or type(err).__name__
        raise CheckpointError(f"{directory}/config.json is refused by transformers ({reason}); fix the key it "
                              "names to match the checkpoint") from None
    if isinstance(tokenizer, (str, Path)):
        tokenizer = _tokenizer(Path(tokenizer), config)
    elif tokenizer is None and any((directory / f).is_file() for f in TOKENIZER_FILES):
        tokenizer = _tokenizer(directory, config)
    if tokenizer is not None:
        text = getattr(config, "text_config", None) or config
        check_tokenizer_fits(tokenizer, int(text.vocab_size), directory)
    from transformers.utils import logging as hf_logging

    check_cast_fits_files(directory, dtype)   # transformers casts as it loads: a weight beyond float16 becomes inf
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
    previous, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()   # its load report would repeat what the check below says in one line
    hf_logging.disable_progress_bar()  # a bar per load would interleave with tables such as `recurscope models`
    try:
        with warnings.catch_warnings():
            # fla, imported by transformers for some families, warns on every CPU-only import; not the user's concern
            warnings.filterwarnings("ignore", message="Triton is not supported on current platform")
            hf, info = model_cls.from_pretrained(**source, config=config, dtype=dtype or torch.float32,
                                                 output_loading_info=True, ignore_mismatched_sizes=True,
                                                 trust_remote_code=False)
    finally:
        hf_logging.set_verbosity(previous)
        if bars:
            hf_logging.enable_progress_bar()
    missing, unexpected = sorted(info.get("missing_keys", [])), sorted(info.get("unexpected_keys", []))
    wrong = sorted(f"{m[0]}: checkpoint {tuple(m[1])} vs config {tuple(m[2])}" if isinstance(m, (tuple, list))
                   and len(m) == 3 else str(m) for m in info.get("mismatched_keys", []))
    if missing or unexpected or wrong:
        raise mismatch_error(directory, raw_config.get("model_type"), missing, unexpected, wrong)
    if check_finite:
        check_finite_weights(hf.state_dict().items(), directory)
    model = BridgedLM(hf, family, tokenizer)
    model.to(device)
    model.set_backend(backend)
    model.checkpoint_dir = directory
    model.eval()
    return model
