"""Kimi-Linear: KDA layers (a gated delta rule with per-channel decay) and MLA attention under one attribute,
`self_attn`; MoE."""
from recurscope.interp.bridge.adapters.base import MIXERS, TRANSFORMERS_WEIGHTS, BridgeAdapter
from recurscope.interp.models.families import FamilySpec

SPEC = FamilySpec(
    name="kimi_linear", title="Kimi-Linear KDA (per-channel decay) + MLA attention, MoE (transformers)",
    weights=TRANSFORMERS_WEIGHTS,
    config_keys=frozenset({"linear_attn_config", "layer_types", "mlp_layer_types", "kv_lora_rank", "q_lora_rank",
                           "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"}),
    kernel_inputs={"q": "l2norm(silu(conv(q_proj)))", "k": "l2norm(silu(conv(k_proj)))",
                   "x": "beta v, beta = sigmoid(b_proj)",
                   "g": "forget_gate: -exp(A_log) softplus(f_b_proj(f_a_proj h) + dt_bias), per key channel",
                   "a": "beta k"},
    mixer="BridgedKimiDeltaAttention", mixer_module=MIXERS,
    state_shape=lambda cfg: (cfg.linear_head_dim, cfg.linear_head_dim), state_heads=lambda cfg: cfg.linear_num_heads,
    paper_family="GDN",   # a gated delta rule with per-channel decay
)


class KimiLinearAdapter(BridgeAdapter):
    spec = SPEC
    order = 40
    model_types = ("kimi_linear",)
    linear_attr = "self_attn"
    # its MLA expands the cached latents into keys and values before the attention function
    cached_kv_to_attention = False
    dispatched = {"transformers.models.kimi_linear.modeling_kimi_linear": (
        "causal_conv1d_update", "causal_conv1d_fn", "recurrent_kimi_delta_attention", "chunk_kimi_delta_attention")}


ADAPTER = KimiLinearAdapter()
