"""One spec per model family: what a family reads from config.json, how it feeds the kernel's (q, k, x, g, a), its
mixer, its weight names and its hook points. Config, loading, hook listing, attribution and the CLI ask the spec;
adding a family means adding one `FamilySpec` here (and its mixer). See docs/adding_a_family.md.

The kernel (recurscope.kernels.recurrence) runs, per head,

    S_t = (I - k_t a_t^T) Diag(exp g_t) S_{t-1} + k_t x_t^T,     o_t = scale * S_t^T q_t

and a family is a choice of these five inputs.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from recurscope.kernels import ERASE_ARMS

# ---------------------------------------------------------------------------------------------------------------
# Weight names
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightMap:
    """Renames between a checkpoint's weight names and the module names inside recurscope (both directions)."""
    format: str                               # "fla" or "transformers"
    to_ours: Callable[[str], str]
    to_checkpoint: Callable[[str], str]


def fla_to_ours(name: str) -> str:
    """fla's `model.layers.{i}.attn.q_proj.weight` -> recurscope's `blocks.{i}.mixer.q_proj.weight`."""
    if name.startswith("lm_head."):
        return name
    if not name.startswith("model."):
        raise KeyError(name)
    rest = name[len("model."):]
    rest = re.sub(r"^embeddings\.", "embed.", rest)
    rest = re.sub(r"^layers\.(\d+)\.attn\.", r"blocks.\1.mixer.", rest)
    rest = re.sub(r"^layers\.(\d+)\.", r"blocks.\1.", rest)
    return rest


def ours_to_fla(name: str) -> str:
    if name.startswith("lm_head."):
        return name
    rest = re.sub(r"^embed\.", "embeddings.", name)
    rest = re.sub(r"^blocks\.(\d+)\.mixer\.", r"layers.\1.attn.", rest)
    rest = re.sub(r"^blocks\.(\d+)\.", r"layers.\1.", rest)
    return "model." + rest


FLA_WEIGHTS = WeightMap("fla", fla_to_ours, ours_to_fla)


def mamba2_to_ours(name: str) -> str:
    """fla's Mamba-2 names: `backbone.layers.{i}.mixer.in_proj.weight` -> `blocks.{i}.mixer.in_proj.weight`, the
    block's pre-norm `backbone.layers.{i}.norm` -> `blocks.{i}.attn_norm`, `backbone.norm_f` -> `norm`."""
    if name.startswith("lm_head."):
        return name
    if not name.startswith("backbone."):
        raise KeyError(name)
    rest = name[len("backbone."):]
    rest = re.sub(r"^embeddings\.", "embed.", rest)
    rest = re.sub(r"^norm_f\.", "norm.", rest)
    rest = re.sub(r"^layers\.(\d+)\.norm\.", r"blocks.\1.attn_norm.", rest)
    rest = re.sub(r"^layers\.(\d+)\.", r"blocks.\1.", rest)
    return rest


def ours_to_mamba2(name: str) -> str:
    if name.startswith("lm_head."):
        return name
    rest = re.sub(r"^embed\.", "embeddings.", name)
    rest = re.sub(r"^norm\.", "norm_f.", rest)
    rest = re.sub(r"^blocks\.(\d+)\.attn_norm\.", r"layers.\1.norm.", rest)
    rest = re.sub(r"^blocks\.(\d+)\.", r"layers.\1.", rest)
    return "backbone." + rest


MAMBA2_WEIGHTS = WeightMap("fla", mamba2_to_ours, ours_to_mamba2)

# ---------------------------------------------------------------------------------------------------------------
# The spec
# ---------------------------------------------------------------------------------------------------------------

#: Options every fla-format family shares (the decoder, the hybrid attention layers, the tokenizer ids).
SHARED_KEYS = frozenset({
    "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "norm_eps", "hidden_ratio",
    "intermediate_size", "hidden_act", "tie_word_embeddings", "attn", "attnres_block_size",
    "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "fuse_norm",
    "use_short_conv", "conv_size", "conv_bias",
})


@dataclass(frozen=True)
class FamilySpec:
    """Everything recurscope knows about one family, in one place.

    name: config.json's model_type. config_keys: the options it reads beyond SHARED_KEYS: ModelConfig fields, or
    its own options, declared with their defaults in option_defaults (ModelConfig holds their values and reads
    them as attributes, cfg.<option>), so that a new family's options live in its spec.
    kernel_inputs: how its projections become the kernel's q, k, x, g, a (documentation, rendered in the docs).
    mixer: the mixer class's name in `recurscope.interp.models.mixers` (resolved lazily: mixers import the config).
    absent_hooks: hook points of the recurrent vocabulary that this family lacks (GLA has no erase).
    state_shape / state_heads: per-head state (K, V) and the number of state-carrying heads, from a config.
    query_group: how many consecutive query heads read each state (GLA-7B's num_kv_heads grouping: 4); 1 elsewhere.
    A "head" of the interventions and the scan is a state group; hook_q, hook_head_out and hook_z index query heads.
    validate: messages for options the family does not implement. label: the family as `recurscope models` shows it.
    readout_norm / readout_gate: the mixer's output path o -> norm(o) * act(gate), which attribution freezes (native
    families; a bridged mixer's frozen scale is read off its run, attribution._bridged_map).
    readout_map: for an output path of another form, (model, cache, layer, head, position, batch) -> (s, c, centred):
    hook_z of that head = s * (o - centred * mean(o)) + c, every norm statistic and gate frozen at the run's values
    (attribution.candidate_direction; the cache holds the mixer's hooks, hook_resid_pre and the last hook_resid_post).
    mlp: whether each block carries the SwiGLU MLP after its mixer (Mamba-2's blocks are norm, mixer, residual only;
    without it the block lacks hook_mlp_out, which absent_hooks then lists).
    block: the name of the family's own block class in mixer_module, for a block that is not the decoder's
    (RWKV-7: LayerNorms, a token-shifted feed-forward and the first layer's values passed on); None for `Block`.
    final_norm: cfg -> the final norm module, when it is not the RMSNorm (RWKV-7: a LayerNorm).
    token_shift_reach: how many tokens after a span the family's token shift carries its inputs into (RWKV-7: 1), which
    `interventions.spans_with_conv_tail` adds to a fact span as it adds a short convolution's reach.
    paper_family: the paper's family whose numbers apply ("GLA": its GLA-340M; "GDN": its GDN-340M / 1.3B, for every
    gated delta rule), None for a family the paper did not measure (verdicts.paper_family).
    paper_checkpoint: model -> the paper checkpoint whose App. E.2 top-k numbers apply, or None (protocols.topk).
    """
    name: str
    title: str
    weights: WeightMap
    config_keys: frozenset
    kernel_inputs: Mapping[str, str]
    mixer: str
    state_shape: Callable
    state_heads: Callable
    query_group: Callable = lambda cfg: 1
    absent_hooks: frozenset = frozenset()
    validate: Callable = lambda cfg: []
    label: Optional[Callable] = None
    readout_norm: Optional[Callable] = None
    readout_gate: Optional[Callable] = None
    readout_map: Optional[Callable] = None
    mixer_module: str = "recurscope.interp.models.mixers"
    option_defaults: Mapping[str, Any] = field(default_factory=dict)
    mlp: bool = True
    block: Optional[str] = None
    final_norm: Optional[Callable] = None
    token_shift_reach: int = 0
    paper_family: Optional[str] = None
    paper_checkpoint: Callable = lambda model: None

    def __post_init__(self):
        stray = sorted(set(self.option_defaults) - set(self.config_keys))
        if stray:
            raise ValueError(f"family {self.name!r}: option_defaults names {stray}, which config_keys lacks; list "
                             "every option the family reads in config_keys")

    @property
    def format(self) -> str:
        return self.weights.format

    @property
    def block_class(self):
        if self.block is None:
            return None
        import importlib

        return getattr(importlib.import_module(self.mixer_module), self.block)

    @property
    def mixer_class(self):
        import importlib

        return getattr(importlib.import_module(self.mixer_module), self.mixer)

    def has_hook(self, point: str) -> bool:
        return point.rsplit(".", 1)[-1] not in self.absent_hooks

    def describe(self, cfg) -> str:
        return self.label(cfg) if self.label is not None else self.name


# ---- GLA ----------------------------------------------------------------------------------------------------
def _gla_state_shape(cfg):
    return (int(round(cfg.hidden_size * cfg.expand_k)) // cfg.num_heads,
            int(round(cfg.hidden_size * cfg.expand_v)) // cfg.num_heads)


def _gla_validate(cfg):
    bad = []
    if cfg.feature_map is not None:
        bad.append(f"feature_map={cfg.feature_map!r} (only None)")
    for name, dim in (("expand_k", cfg.expand_k), ("expand_v", cfg.expand_v)):
        total = cfg.hidden_size * dim
        if not math.isclose(total, round(total)) or round(total) % cfg.num_heads:
            bad.append(f"{name}={dim} gives a dimension not divisible into {cfg.num_heads} heads")
    if cfg.num_kv_heads is not None and cfg.num_heads % cfg.num_kv_heads:
        bad.append(f"num_kv_heads={cfg.num_kv_heads} does not divide num_heads={cfg.num_heads}")
    return bad


def _gla_norm(mixer):
    return getattr(mixer, mixer.norm_name)


def _gla_gate(mixer, h):
    if not mixer.use_output_gate:
        return None
    gate = mixer.g_proj(h)
    return gate.reshape(*gate.shape[:-1], -1, mixer.head_v)


GLA = FamilySpec(
    name="gla", title="Gated Linear Attention (fla)", weights=FLA_WEIGHTS,
    config_keys=frozenset({"expand_k", "expand_v", "num_kv_heads", "feature_map", "use_output_gate", "clamp_min",
                           "elementwise_affine", "gate_logit_normalizer", "gate_low_rank_dim"}),
    kernel_inputs={"q": "q_proj (short conv), per head", "k": "k_proj (short conv), num_kv_heads state groups, each read by num_heads / num_kv_heads query heads",
                   "x": "v = v_proj (short conv)", "g": "logsigmoid(gk_proj x) / gate_logit_normalizer, per channel",
                   "a": "none (no erase)"},
    mixer="GLAMixer", state_shape=_gla_state_shape, state_heads=lambda cfg: cfg.num_kv_heads or cfg.num_heads,
    query_group=lambda cfg: cfg.num_heads // (cfg.num_kv_heads or cfg.num_heads),
    absent_hooks=frozenset({"hook_erase", "hook_erase_gate"}), validate=_gla_validate,
    readout_norm=_gla_norm, readout_gate=_gla_gate, paper_family="GLA",
    option_defaults={"expand_k": 0.5, "expand_v": 1.0, "num_kv_heads": None, "feature_map": None,
                     "use_output_gate": True, "clamp_min": None, "elementwise_affine": True,
                     "gate_logit_normalizer": 16.0, "gate_low_rank_dim": 16},
    paper_checkpoint=lambda model: "GLA-7B" if getattr(model, "query_group", 1) > 1 else "GLA-340M",
)


# ---- Gated DeltaNet and GDN-2 --------------------------------------------------------------------------------
def _delta_state_shape(cfg):
    return (cfg.head_dim, int(cfg.head_dim * cfg.expand_v))


def _delta_validate(cfg):
    bad = []
    hv = cfg.num_v_heads or cfg.num_heads
    if hv % cfg.num_heads:
        bad.append(f"num_v_heads={hv} must be a multiple of num_heads={cfg.num_heads}")
    if not math.isclose(cfg.head_dim * cfg.expand_v, int(cfg.head_dim * cfg.expand_v)):
        bad.append(f"head_dim * expand_v = {cfg.head_dim * cfg.expand_v} is not an integer")
    if cfg.output_gate_activation not in ("swish", "silu", "sigmoid"):
        bad.append(f"output_gate_activation={cfg.output_gate_activation!r}")
    return bad


def _gdn2_validate(cfg):
    bad = _delta_validate(cfg)
    if cfg.erase_arm not in ERASE_ARMS:
        bad.append(f"erase_arm={cfg.erase_arm!r} (one of {ERASE_ARMS})")
    return bad


def _gdn_gate(mixer, h):
    if not mixer.use_gate:
        return None
    gate = mixer.g_proj(h)
    return gate.reshape(*gate.shape[:-1], -1, mixer.head_v)


def _gdn2_gate(mixer, h):
    gate = mixer.g_proj(h)
    return gate.reshape(*gate.shape[:-1], -1, mixer.head_v)


_DELTA_KEYS = frozenset({"head_dim", "num_v_heads", "expand_v", "use_gate", "allow_neg_eigval",
                         "output_gate_activation"})
_DELTA_DEFAULTS = {"head_dim": 256, "num_v_heads": None, "expand_v": 1.0, "use_gate": True, "allow_neg_eigval": False,
                   "output_gate_activation": "swish"}

GATED_DELTANET = FamilySpec(
    name="gated_deltanet", title="Gated DeltaNet (fla)", weights=FLA_WEIGHTS, config_keys=_DELTA_KEYS,
    kernel_inputs={"q": "l2norm(silu(conv(q_proj)))", "k": "l2norm(silu(conv(k_proj)))",
                   "x": "beta v, beta = sigmoid(b_proj) (x2 with allow_neg_eigval)",
                   "g": "-exp(A_log) softplus(a_proj + dt_bias), per head", "a": "beta k"},
    mixer="GatedDeltaNetMixer", state_shape=_delta_state_shape, state_heads=lambda cfg: cfg.num_v_heads or cfg.num_heads,
    validate=_delta_validate, readout_norm=lambda mixer: mixer.o_norm, readout_gate=_gdn_gate,
    absent_hooks=frozenset({"hook_erase_gate"}),   # beta is its erase gate, folded into a; only GDN-2 hooks b
    paper_family="GDN",
    option_defaults=_DELTA_DEFAULTS,
)

GATED_DELTANET2 = FamilySpec(
    name="gated_deltanet2", title="Gated DeltaNet-2 and its QED erase arms (recurscope)", weights=FLA_WEIGHTS,
    config_keys=_DELTA_KEYS | {"erase_arm", "qed_lambda_max", "qed_theta_init"},
    kernel_inputs={"q": "l2norm(silu(conv(q_proj)))", "k": "l2norm(silu(conv(k_proj)))",
                   "x": "w * v, w = sigmoid(w_proj), per channel",
                   "g": "-exp(A_log) softplus(f_proj + dt_bias), per channel",
                   "a": "kernels.erase_vector(k, q, b, lam, erase_arm), b = sigmoid(b_proj)"},
    mixer="GatedDeltaNet2Mixer", state_shape=_delta_state_shape,
    state_heads=lambda cfg: cfg.num_v_heads or cfg.num_heads, validate=_gdn2_validate,
    label=lambda cfg: "gated_deltanet2" + ("" if cfg.erase_arm == "gdn2" else f"/{cfg.erase_arm}"),
    readout_norm=lambda mixer: mixer.o_norm, readout_gate=_gdn2_gate,
    # QED: the erase arm and lam_h = qed_lambda_max * sigmoid(theta_h), theta_h starting at qed_theta_init
    option_defaults={**_DELTA_DEFAULTS, "erase_arm": "gdn2", "qed_lambda_max": 0.25, "qed_theta_init": -2.0},
    paper_family="GDN",
)



# ---- Mamba-2 ---------------------------------------------------------------------------------------------------
def dt_limit_pair(value) -> tuple[float, float]:
    """config.json's dt_limit: transformers writes float("inf") as {"__float__": "Infinity"}."""
    def one(v):
        return float(v["__float__"]) if isinstance(v, dict) and "__float__" in v else float(v)
    lo, hi = value
    return one(lo), one(hi)


def _mamba2_validate(cfg):
    bad = []
    inner = cfg.expand * cfg.hidden_size
    if inner != int(inner) or int(inner) % cfg.head_dim:
        bad.append(f"expand * hidden_size = {inner} is not a multiple of head_dim={cfg.head_dim}")
    elif int(inner) // cfg.head_dim != cfg.num_heads:
        bad.append(f"num_heads={cfg.num_heads} but expand * hidden_size / head_dim = {int(inner) // cfg.head_dim}")
    if cfg.num_heads % cfg.n_groups:
        bad.append(f"n_groups={cfg.n_groups} does not divide num_heads={cfg.num_heads}")
    if cfg.hidden_act not in ("silu", "swish"):
        bad.append(f"hidden_act={cfg.hidden_act!r} (Mamba-2's mixer activation: only 'silu')")
    if cfg.attn is not None:
        bad.append("attn (fla's Mamba-2 has no attention layers; its hybrids load through the bridge)")
    try:
        lo, hi = dt_limit_pair(cfg.dt_limit)
        if not 0.0 <= lo <= hi:
            bad.append(f"dt_limit={cfg.dt_limit!r} (needs 0 <= low <= high)")
    except (TypeError, ValueError, KeyError):
        bad.append(f"dt_limit={cfg.dt_limit!r} (a pair [low, high])")
    return bad


def _mamba2_state_shape(cfg):
    return (cfg.state_size, cfg.head_dim)      # (K, V) = (N, P): B and C index the key side, x the value side


def _mamba2_readout_map(model, cache, layer, head, position, batch):
    """hook_z = gated norm of y = o + D x: with the norm's group statistic r frozen (rms of y * silu(gate), or of y
    with norm_before_gate, over the group of heads that the norm spans), z_h = s * o_h + s * D_h x_h with
    s = r * weight_h * silu(gate_h) (r = weight = 1 without the norm)."""
    import torch

    from recurscope.hooks.points import hook_name

    block = model.blocks[layer]
    mixer = block.mixer
    H, P = mixer.num_heads, mixer.head_v
    h = block.attn_norm(cache[hook_name("hook_resid_pre", layer)][batch, position])
    gate = mixer.in_proj(h)[:mixer.intermediate].double().view(H, P)
    o = cache[hook_name("hook_head_out", layer)][batch, position].double()          # (H, P)
    skip = mixer.D.double().reshape(H, -1) * cache[hook_name("hook_v", layer)][batch, position].double()
    act = torch.nn.functional.silu(gate[head])
    norm = getattr(mixer, "norm", None)
    if norm is None:
        s = act
    else:
        per_group = H // mixer.n_groups
        heads = slice(head // per_group * per_group, (head // per_group + 1) * per_group)
        y = (o + skip)[heads]
        u = y if norm.norm_before_gate else y * torch.nn.functional.silu(gate[heads])
        s = torch.rsqrt(u.pow(2).mean() + norm.eps) * norm.weight.double().view(H, P)[head] * act
    return s, s * skip[head], False


MAMBA2 = FamilySpec(
    name="mamba2", title="Mamba-2 (fla)", weights=MAMBA2_WEIGHTS,
    config_keys=frozenset({"head_dim", "state_size", "expand", "n_groups", "conv_kernel", "use_bias", "use_conv_bias",
                           "D_has_hdim", "rmsnorm", "norm_before_gate", "dt_limit", "residual_in_fp32", "chunk_size",
                           "conv_init", "A_init_range", "dt_min", "dt_max", "dt_init_floor",
                           "rescale_prenorm_residual"}),
    kernel_inputs={"q": "C = conv(in_proj) (silu), shared by the heads of a group",
                   "k": "B = conv(in_proj) (silu), shared by the heads of a group",
                   "x": "dt x, dt = clamp(softplus(dt_proj + dt_bias), dt_limit) per head, x = conv(in_proj) (silu)",
                   "g": "dt A, A = -exp(A_log), per head (scale 1; D skip and gated norm after the readout)",
                   "a": "none (no erase)"},
    mixer="Mamba2Mixer", state_shape=_mamba2_state_shape, state_heads=lambda cfg: cfg.num_heads,
    absent_hooks=frozenset({"hook_erase", "hook_erase_gate", "hook_mlp_out"}), validate=_mamba2_validate,
    readout_map=_mamba2_readout_map, mlp=False,
    # conv_init, A_init_range, dt_min, dt_max, dt_init_floor and rescale_prenorm_residual only initialise weights;
    # chunk_size is fla's kernel chunk; residual_in_fp32 changes nothing in float32 (recurscope keeps the residual
    # in the model's dtype).
    option_defaults={"head_dim": 256, "state_size": 128, "expand": 2, "n_groups": 1, "conv_kernel": 4, "use_bias": False,
                     "use_conv_bias": True, "D_has_hdim": False, "rmsnorm": True, "norm_before_gate": False,
                     "dt_limit": [0.0, {"__float__": "Infinity"}], "residual_in_fp32": True, "chunk_size": 256,
                     "conv_init": None, "A_init_range": [1, 16], "dt_min": 0.001, "dt_max": 0.1,
                     "dt_init_floor": 1e-4, "rescale_prenorm_residual": True},
)

# ---- RWKV-7 ----------------------------------------------------------------------------------------------------
def _rwkv7_validate(cfg):
    bad = []
    if cfg.hidden_size % cfg.head_dim:
        bad.append(f"hidden_size={cfg.hidden_size} is not a multiple of head_dim={cfg.head_dim}")
    elif cfg.num_heads != cfg.hidden_size // cfg.head_dim:
        bad.append(f"num_heads={cfg.num_heads} but hidden_size / head_dim = {cfg.hidden_size // cfg.head_dim}")
    if cfg.hidden_act != "sqrelu":
        bad.append(f"hidden_act={cfg.hidden_act!r} (RWKV-7's feed-forward: only 'sqrelu')")
    if cfg.attn is not None:
        bad.append("attn (RWKV-7 hybrids with attention layers are not implemented)")
    vd = cfg.value_dim
    if vd is not None and any(int(v) != cfg.hidden_size for v in (vd if isinstance(vd, (list, tuple)) else [vd])):
        bad.append(f"value_dim={vd!r} (only value_dim = hidden_size is checked against fla)")
    return bad


def _rwkv7_readout_map(model, cache, layer, head, position, batch):
    """hook_z = (group_norm(o) + bonus) * gate: with the head's group-norm statistics frozen,
    z = s * (o - mean o) + gate * (bias + bonus), s = gate * weight / sqrt(var(o) + eps); the bonus
    (r * k * r_k).sum() v and the gate (g_lora of the token-shifted mixer input) do not depend on o."""
    import torch

    from recurscope.hooks.points import hook_name

    block = model.blocks[layer]
    mixer = block.mixer
    V = mixer.head_v
    at = lambda point: cache[hook_name(point, layer)][batch, position, head].double()  # noqa: E731
    resid = cache[hook_name("hook_resid_pre", layer)][batch]
    x = block.attn_norm(resid[position])
    prev = block.attn_norm(resid[position - 1]) if position > 0 else torch.zeros_like(x)   # token_shift's zeros
    gate = mixer.g_lora(x + (prev - x) * mixer.x_g[0, 0]).double()[head * V:(head + 1) * V]
    o = at("hook_head_out")
    norm = mixer.g_norm
    s = gate * torch.rsqrt(o.var(unbiased=False) + norm.eps)
    bias = torch.zeros_like(s)
    if norm.affine:
        s = s * norm.weight.double()[head * V:(head + 1) * V]
        bias = norm.bias.double()[head * V:(head + 1) * V]
    bonus = (at("hook_q") * at("hook_k") * mixer.r_k[head].double()).sum() * at("hook_v")
    return s, gate * (bias + bonus), True


def _rwkv7_final_norm(cfg):
    import torch.nn as nn

    return nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=cfg.norm_bias)


RWKV7 = FamilySpec(
    name="rwkv7", title="RWKV-7 (fla)", weights=FLA_WEIGHTS,
    config_keys=frozenset({"head_dim", "decay_low_rank_dim", "gate_low_rank_dim", "a_low_rank_dim",
                           "v_low_rank_dim", "norm_first", "norm_bias", "value_dim", "elementwise_affine"}),
    kernel_inputs={"q": "r = r_proj(token shift), per head",
                   "k": "k_proj(token shift) * (1 + (iclr - 1) k_a), iclr = sigmoid(a_lora)",
                   "x": "v = lerp(v_proj, v_first, sigmoid(v_lora)) (layer 0: v_proj, which becomes v_first)",
                   "g": "-0.6065 sigmoid(w_lora), per channel (kernels.recurrence_low_rank, scale 1)",
                   "a": "read a = kk = l2norm(k * k_k), erase b = kk * iclr: S = (Diag(exp g) - b a^T) S + k v^T"},
    mixer="RWKV7Mixer", mixer_module="recurscope.interp.models.rwkv7", block="RWKV7Block",
    final_norm=_rwkv7_final_norm, token_shift_reach=1,
    state_shape=lambda cfg: (cfg.head_dim, cfg.head_dim), state_heads=lambda cfg: cfg.num_heads,
    validate=_rwkv7_validate, readout_map=_rwkv7_readout_map,
    paper_checkpoint=lambda model: "RWKV7-13.3B",
    option_defaults={"head_dim": 256, "decay_low_rank_dim": 64, "gate_low_rank_dim": 16, "a_low_rank_dim": 64,
                     "v_low_rank_dim": 16, "norm_first": True, "norm_bias": True, "value_dim": None,
                     "elementwise_affine": True},
)

#: fla-format families, by config.json model_type.
FAMILIES: dict[str, FamilySpec] = {spec.name: spec for spec in (GLA, GATED_DELTANET, GATED_DELTANET2, MAMBA2, RWKV7)}


def family(model_type: str) -> FamilySpec:
    """The spec of an fla-format model_type; a ValueError naming the known ones otherwise."""
    if model_type not in FAMILIES:
        raise ValueError(
            f"unknown model_type {model_type!r} in config.json; recurscope loads {tuple(FAMILIES)} "
            "(fla's 'gla', 'gated_deltanet' and 'mamba2', and recurscope's 'gated_deltanet2' for GDN-2/QED)")
    return FAMILIES[model_type]


def option_default(key: str):
    """(owner, default) of a family's own option (FamilySpec.option_defaults), or None."""
    for spec in FAMILIES.values():
        if key in spec.option_defaults:
            return spec.name, spec.option_defaults[key]
    return None


def owner_of(key: str) -> Optional[str]:
    """The fla-format family whose option `key` is, if it is one family's option."""
    for spec in FAMILIES.values():
        if key in spec.config_keys:
            return spec.name
    return None


def render_markdown() -> str:
    """The family table of docs/adding_a_family.md."""
    rows = ["| model_type | family | format | mixer | q | k | x | g | a | hooks it lacks |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for s in FAMILIES.values():
        k = s.kernel_inputs
        rows.append(f"| `{s.name}` | {s.title} | {s.format} | `{s.mixer}` | {k['q']} | {k['k']} | {k['x']} | "
                    f"{k['g']} | {k['a']} | {', '.join(sorted(s.absent_hooks)) or '—'} |")
    return "\n".join(rows)
