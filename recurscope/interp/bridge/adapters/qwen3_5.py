"""Qwen3.5 (dense, MoE, multimodal): Gated DeltaNet layers (`linear_attn`) and gated softmax attention
(`self_attn`), pre-norm; the base of the other Gated DeltaNet decoder hybrids (Qwen3-Next, OLMo-hybrid)."""
from recurscope.interp.bridge.adapters.base import GATED_DELTA_KERNELS, MIXERS, TRANSFORMERS_WEIGHTS, BridgeAdapter
from recurscope.interp.models.families import FamilySpec


def gdn_state_shape(cfg):
    return (cfg.linear_key_head_dim, cfg.linear_value_head_dim)


def gdn_state_heads(cfg):
    return cfg.linear_num_value_heads


#: config.json keys of the Gated DeltaNet layers (Qwen3.5, Qwen3-Next and OLMo-hybrid share them)
GDN_KEYS = frozenset({"linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                      "linear_value_head_dim", "linear_conv_kernel_dim", "layer_types"})

SPEC = FamilySpec(
    name="qwen3_5", title="Qwen3.5 Gated DeltaNet + gated attention (transformers; dense, MoE, multimodal)",
    weights=TRANSFORMERS_WEIGHTS, config_keys=GDN_KEYS,
    kernel_inputs={"q": "l2norm(silu(conv(in_proj_qkv)[:key_dim])), repeated over value heads",
                   "k": "l2norm(silu(conv(in_proj_qkv)[key_dim:2 key_dim])), repeated over value heads",
                   "x": "beta v, beta = sigmoid(in_proj_b)", "g": "-exp(A_log) softplus(in_proj_a + dt_bias), per head",
                   "a": "beta k"},
    mixer="BridgedGatedDeltaNet", mixer_module=MIXERS,
    state_shape=gdn_state_shape, state_heads=gdn_state_heads, paper_family="GDN",
)


class Qwen35Adapter(BridgeAdapter):
    spec = SPEC
    order = 10
    model_types = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
    dispatched = {"transformers.models.qwen3_5.modeling_qwen3_5": GATED_DELTA_KERNELS,
                  "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe": GATED_DELTA_KERNELS}


ADAPTER = Qwen35Adapter()
