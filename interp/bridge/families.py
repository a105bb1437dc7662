"""Family specs of the transformers-format models the bridge loads (the same FamilySpec as the fla families)."""
from __future__ import annotations

from dataclasses import dataclass

from recurscope.interp.models.families import FamilySpec, WeightMap


def _same(name: str) -> str:
    return name


TRANSFORMERS_WEIGHTS = WeightMap("transformers", _same, _same)   # transformers' modules keep their own names


@dataclass(frozen=True)
class BridgeFamily:
    """A FamilySpec plus what the bridge needs to find its parts in a transformers model."""
    spec: FamilySpec
    model_types: tuple          # config.json model_type values (text and multimodal layouts)
    linear_attr: str            # the decoder layer's attribute holding the linear-attention module
    attention_attr: str         # ... and the one holding full attention


def _gdn_state_shape(cfg):
    return (cfg.linear_key_head_dim, cfg.linear_value_head_dim)


QWEN35_GDN = FamilySpec(
    name="qwen3_5", title="Qwen3.5 Gated DeltaNet + gated attention (transformers; dense, MoE, multimodal)",
    weights=TRANSFORMERS_WEIGHTS,
    config_keys=frozenset({"linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                           "linear_value_head_dim", "linear_conv_kernel_dim", "layer_types"}),
    kernel_inputs={"q": "l2norm(silu(conv(in_proj_qkv)[:key_dim])), repeated over value heads",
                   "k": "l2norm(silu(conv(in_proj_qkv)[key_dim:2 key_dim])), repeated over value heads",
                   "x": "beta v, beta = sigmoid(in_proj_b)", "g": "-exp(A_log) softplus(in_proj_a + dt_bias), per head",
                   "a": "beta k"},
    mixer="BridgedGatedDeltaNet", mixer_module="recurscope.interp.bridge.mixers",
    state_shape=_gdn_state_shape, state_heads=lambda cfg: cfg.linear_num_value_heads,
    readout_norm=lambda mixer: mixer.norm, readout_gate=None,
)

BRIDGE_FAMILIES: tuple[BridgeFamily, ...] = (
    BridgeFamily(QWEN35_GDN, ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"), "linear_attn", "self_attn"),
)


def bridge_family(model_type: str):
    for fam in BRIDGE_FAMILIES:
        if model_type in fam.model_types:
            return fam
    return None


def supported_model_types() -> tuple:
    return tuple(t for fam in BRIDGE_FAMILIES for t in fam.model_types)
