"""Model configuration read from an HF/fla `config.json`, with every option we do not support rejected by name."""
from __future__ import annotations

import json
import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Optional

from recurscope.interp.models.families import FAMILIES, SHARED_KEYS, FamilySpec, family, option_default, owner_of
from recurscope.interp.models.tl_compat import TLConfigAliases

RECURRENT_TYPES = tuple(FAMILIES)

# Options fla writes that change nothing in inference math, or that we implement.
_IGNORED_KEYS = {
    "architectures", "transformers_version", "torch_dtype", "dtype", "use_cache", "initializer_range",
    "fuse_norm", "fuse_swiglu", "fuse_cross_entropy", "fuse_linear_cross_entropy", "use_l2warp", "attn_mode",
    "bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings", "keys_to_ignore_at_inference",
    "return_dict", "output_hidden_states", "output_attentions", "tie_encoder_decoder", "is_encoder_decoder",
    "_name_or_path", "auto_map", "chunk_size_feed_forward", "problem_type", "id2label", "label2id",
    "tokenizer_class", "prefix", "sep_token_id", "decoder_start_token_id", "task_specific_params",
    "use_gk", "use_gv", "conv_bias", "recurscope",
}


@dataclass
class ModelConfig(TLConfigAliases):
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_heads: int
    norm_eps: float = 1e-6
    hidden_ratio: Optional[float] = 4
    intermediate_size: Optional[int] = None
    hidden_act: str = "swish"
    tie_word_embeddings: bool = False
    attn: Optional[Any] = None            # fla's hybrid spec: dict or list of dicts with "layers"
    attnres_block_size: Optional[int] = None
    max_position_embeddings: int = 2048
    bos_token_id: Optional[int] = 1
    eos_token_id: Optional[int] = 2
    pad_token_id: Optional[int] = None
    fuse_norm: bool = True
    use_short_conv: bool = False
    conv_size: int = 4
    conv_bias: bool = False
    # the family's own options (FamilySpec.option_defaults: GLA's expand_k, GDN's head_dim, GDN-2's erase_arm, ...),
    # read as attributes, cfg.<option>; the fields above are the ones every fla family shares
    options: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    def __getattr__(self, name: str):
        """A family's own option: its value from config.json, else the spec's default (only reached when `name` is
        no field)."""
        if name.startswith("__") or name in ("options", "model_type"):
            raise AttributeError(name)
        options = self.__dict__.get("options", {})
        if name in options:
            return options[name]
        spec = FAMILIES.get(self.__dict__.get("model_type"))
        if spec is not None and name in spec.option_defaults:
            return spec.option_defaults[name]
        raise AttributeError(f"ModelConfig of model_type {self.__dict__.get('model_type')!r} has no option {name!r}")

    # ---- derived sizes -------------------------------------------------
    @property
    def mlp_intermediate(self) -> int:
        if self.intermediate_size is not None:
            return int(self.intermediate_size)
        ratio = 4 if self.hidden_ratio is None else self.hidden_ratio
        inter = int(self.hidden_size * ratio * 2 / 3)
        return 256 * ((inter + 255) // 256)

    def attention_spec(self, layer: int) -> Optional[dict]:
        """fla's hybrid rule: a layer listed in attn["layers"] is full attention."""
        if self.attn is None:
            return None
        specs = [self.attn] if isinstance(self.attn, dict) else list(self.attn)
        for spec in specs:
            if layer in spec["layers"]:
                return {
                    "num_heads": spec.get("num_heads", self.num_heads),
                    "num_kv_heads": spec.get("num_kv_heads", None) or spec.get("num_heads", self.num_heads),
                    "qkv_bias": spec.get("qkv_bias", False),
                    "window_size": spec.get("window_size", None),
                    "rope_theta": spec.get("rope_theta", 10000.0),
                }
        return None

    @property
    def family(self) -> FamilySpec:
        return family(self.model_type)

    @property
    def state_heads(self) -> int:
        """Heads that carry a recurrent state (value heads for grouped GDN)."""
        return self.family.state_heads(self)

    @property
    def query_group(self) -> int:
        """Query heads that read each state (GLA with num_kv_heads < num_heads); 1 elsewhere."""
        return self.family.query_group(self)

    def state_shape(self) -> tuple[int, int]:
        return self.family.state_shape(self)

    def to_dict(self) -> dict:
        """The options this family reads (SHARED_KEYS and its spec's config_keys), then `extra`."""
        keep = SHARED_KEYS | self.family.config_keys
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name in keep}
        out.update({key: getattr(self, key) for key in self.family.option_defaults})
        out.update(self.extra)
        return out

    # ---- construction --------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        """Checks every key against the family's spec before building: unknown keys, another family's options and
        missing required keys are each reported by name."""
        raw = dict(raw)
        if "model_type" not in raw:
            raise ValueError(f"config.json has no model_type; recurscope's fla-format families are {RECURRENT_TYPES}")
        check_key("model_type", raw["model_type"])
        spec = family(raw["model_type"])
        declared = {f.name: f for f in fields(cls) if f.name not in ("options", "extra")}
        allowed = SHARED_KEYS | spec.config_keys
        kwargs, options, unknown, foreign = {}, dict(spec.option_defaults), [], []
        for key, value in raw.items():
            if key in spec.option_defaults:
                options[key] = value
            elif key in allowed:
                kwargs[key] = value
            elif key in _IGNORED_KEYS:
                continue
            elif key in declared or option_default(key) is not None:
                # Another family's option: harmless at its default (older recurscope wrote every field), an error
                # otherwise, since this family would silently ignore it.
                default = _default(declared[key]) if key in declared else option_default(key)[1]
                if value != default:
                    foreign.append(f"{key}={value!r} (a {owner_of(key)} option)")
            else:
                unknown.append(key)
        problems = []
        if unknown:
            problems.append(f"unrecognised config options {sorted(unknown)}")
        if foreign:
            problems.append(f"options that model_type {spec.name!r} does not read: {', '.join(sorted(foreign))}")
        if problems:
            raise ValueError("unsupported config.json: " + "; ".join(problems)
                             + ". recurscope implements fla 0.6.0's math for these options only; remove or change them.")
        missing = [name for name, f in declared.items() if _default(f) is MISSING and name not in kwargs]
        if missing:
            raise ValueError(f"config.json lacks the required key(s) {missing} for model_type {spec.name!r}; "
                             "add them (fla's save_pretrained writes every one).")
        for key, value in kwargs.items():
            check_key(key, value, _default(declared[key]) if key in declared else MISSING)
        _check_attn(kwargs.get("attn"), kwargs["num_hidden_layers"])
        for key, value in options.items():
            check_key(key, value, spec.option_defaults[key])
        cfg = cls(**kwargs, options=options)
        problems = cfg._unsupported()
        if problems:
            raise ValueError("unsupported config.json: " + "; ".join(problems)
                             + ". recurscope implements fla 0.6.0's math for these options only; remove or change them.")
        return cfg

    def _unsupported(self) -> list[str]:
        bad = []
        if self.attnres_block_size is not None:
            bad.append(f"attnres_block_size={self.attnres_block_size} (attention residuals are not implemented)")
        if self.family.mlp and self.family.block is None and self.hidden_act != "swish":   # the SwiGLU MLP's activation
            bad.append(f"hidden_act={self.hidden_act!r} (only 'swish')")
        bad += self.family.validate(self)
        if self.attn is not None:
            specs = [self.attn] if isinstance(self.attn, dict) else self.attn
            for spec in specs:
                if "layers" not in spec:
                    bad.append("attn entry without 'layers'")
                if spec.get("qk_norm"):
                    bad.append("attn.qk_norm=True")
        return bad


# ---- every key the family specs read, checked for type and range before anything is built ---------------------
POSITIVE_INTS = frozenset({"vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "num_kv_heads",
                           "intermediate_size", "attnres_block_size", "max_position_embeddings", "conv_size",
                           "gate_low_rank_dim", "head_dim", "num_v_heads",
                           # Mamba-2 and RWKV-7 (the families' own options)
                           "state_size", "n_groups", "conv_kernel", "chunk_size", "decay_low_rank_dim",
                           "a_low_rank_dim", "v_low_rank_dim"})
TOKEN_IDS = frozenset({"bos_token_id", "eos_token_id", "pad_token_id"})
POSITIVE_FLOATS = frozenset({"norm_eps", "hidden_ratio", "expand_k", "expand_v", "gate_logit_normalizer",
                             "qed_lambda_max", "expand", "dt_min", "dt_max", "dt_init_floor"})
FLOATS = frozenset({"clamp_min", "qed_theta_init", "conv_init"})
BOOLS = frozenset({"tie_word_embeddings", "fuse_norm", "use_short_conv", "conv_bias", "use_output_gate",
                   "elementwise_affine", "use_gate", "allow_neg_eigval",
                   "use_bias", "use_conv_bias", "D_has_hdim", "rmsnorm", "norm_before_gate", "residual_in_fp32",
                   "rescale_prenorm_residual", "norm_first", "norm_bias"})
STRINGS = frozenset({"model_type", "hidden_act", "feature_map", "output_gate_activation", "erase_arm"})
#: [low, high] pairs: the lowest low, and whether low < high strictly
RANGES = {"A_init_range": (0.0, False), "dt_limit": (0.0, False)}


def range_pair(value):
    """A [low, high] pair of numbers (transformers writes inf as {"__float__": "Infinity"}), or None."""
    def one(v):
        if isinstance(v, dict) and set(v) == {"__float__"} and v["__float__"] in ("Infinity", "inf"):
            return math.inf
        return float(v) if _is_number(v) else None
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        return None
    low, high = one(value[0]), one(value[1])
    return None if low is None or high is None or math.isinf(low) else (low, high)


def _show(value) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_key(key: str, value, default=MISSING) -> None:
    """Raises ValueError "config.json: `key` must be ..., got ..." unless `value` has the key's type and range.
    None passes where the key's default is None (an optional key), and for token ids a tokenizer may lack (fla
    checkpoints whose tokenizer has no BOS write `bos_token_id: null`)."""
    if value is None and (default is None or key in TOKEN_IDS):
        return
    if key in POSITIVE_INTS:
        ok, want = _is_int(value) and value > 0, "a positive integer"
    elif key in TOKEN_IDS:
        ok = (_is_int(value) and value >= 0) or (isinstance(value, list) and value
                                                  and all(_is_int(v) and v >= 0 for v in value))
        want = "a non-negative integer token id (or null)"
    elif key in POSITIVE_FLOATS:
        ok, want = _is_number(value) and value > 0, "a positive number"
    elif key in FLOATS:
        ok, want = _is_number(value), "a finite number"
    elif key in BOOLS:
        ok, want = isinstance(value, bool), "true or false (a JSON boolean)"
    elif key in STRINGS:
        ok, want = isinstance(value, str), "a string"
    elif key in RANGES:
        low, strict = RANGES[key]
        pair = range_pair(value)
        ok = pair is not None and pair[0] >= low and (pair[0] < pair[1] if strict else pair[0] <= pair[1])
        want = f"a pair [low, high] of numbers with {low:g} <= low <= high"
    elif key == "value_dim":
        ok = (_is_int(value) and value > 0) or (isinstance(value, list) and value
                                                and all(_is_int(v) and v > 0 for v in value))
        want = "a positive integer (or a list of them, one per layer)"
    elif isinstance(default, bool):     # any other switch: "yes" or "no" would read as true
        ok, want = isinstance(value, bool), "true or false (a JSON boolean)"
    else:
        return
    if not ok:
        raise ValueError(f"config.json: `{key}` must be {want}, got {_show(value)}; fix it to match the "
                         "checkpoint's weights")


def _check_attn(attn, n_layers: int) -> None:
    """fla's hybrid spec: a dict or a list of dicts, each with `layers` (layer indices in range)."""
    if attn is None:
        return
    specs = [attn] if isinstance(attn, dict) else attn
    if not isinstance(specs, list) or not specs or not all(isinstance(sp, dict) for sp in specs):
        raise ValueError(f"config.json: `attn` must be an object (or a list of objects) with `layers`, got "
                         f"{json.dumps(attn)}; e.g. {{\"layers\": [1], \"num_heads\": 4}}")
    for sp in specs:
        layers = sp.get("layers")
        if not isinstance(layers, list) or not all(_is_int(i) and 0 <= i < n_layers for i in layers):
            raise ValueError(f"config.json: `attn.layers` must be a list of layer indices 0..{n_layers - 1}, got "
                             f"{json.dumps(layers)}; list the full-attention layers")
        for key in ("num_heads", "num_kv_heads", "window_size"):
            if sp.get(key) is not None and not (_is_int(sp[key]) and sp[key] > 0):
                raise ValueError(f"config.json: `attn.{key}` must be a positive integer, got {json.dumps(sp[key])}")
        if "rope_theta" in sp and not (_is_number(sp["rope_theta"]) and sp["rope_theta"] > 0):
            raise ValueError(f"config.json: `attn.rope_theta` must be a positive number, got "
                             f"{json.dumps(sp['rope_theta'])}")
        if "qkv_bias" in sp and not isinstance(sp["qkv_bias"], bool):
            raise ValueError(f"config.json: `attn.qkv_bias` must be true or false, got {json.dumps(sp['qkv_bias'])}")


def _default(f):
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING
