"""Family specs of the transformers-format models the bridge loads (the same FamilySpec as the fla families)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

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
    attention_attr: str         # ... and the one holding full attention (Kimi-Linear: the same attribute)
    attention_norm: str = "pre"  # "post": its attention layers norm the mixer's and the MLP's outputs (OLMo-hybrid)
    # Its attention hands the cache's K/V to the attention function as they are, so the head scan's rows can read a
    # shared cached K/V there (False for Kimi's MLA, which expands its cached latents into keys and values first).
    cached_kv_to_attention: bool = True
    # Where the family keeps the rest of the model (Mamba-2 names them differently from the decoder hybrids):
    mixer_norm_attr: str = "input_layernorm"   # the decoder layer's norm before its mixer
    final_norm_attr: str = "norm"              # the text model's final norm
    conv_kernel_key: str = "linear_conv_kernel_dim"   # the config key of the linear layers' short conv kernel
    # transformers' cache keeps each head's state transposed, (V, K) (Mamba-2: head_dim x state_size); the bridge's
    # RecurrentCache and hook_state keep recurscope's (K, V)
    state_transposed: bool = False
    # the transformers class to build, when AutoModelForCausalLM may not give transformers' own: fla registers its
    # Mamba-2 under the same model_type "mamba2" in transformers' Auto classes once fla.models is imported
    model_class: Optional[str] = None
    # layer_types of blocks that hold only an MLP or MoE after their norm (Nemotron-H's "mlp" and "moe")
    mlp_block_types: tuple = ()
    mlp_attr: str = "mlp"                              # the decoder layer's MLP (Bamba: feed_forward) ...
    mlp_norm_attr: str = "post_attention_layernorm"    # ... and the norm before it (Bamba: pre_ff_layernorm)
    layer_returns_tuple: bool = False   # its model unpacks (hidden_states, attention weights) from each layer (Bamba)
    # the MLP as a function of the block and its normed input, when it is not one module (Granite-4.0-H: the MoE plus
    # the shared MLP)
    mlp_fn: Optional[Callable] = None
    # layer_types of decoder layers that run the recurrent mixer (linear_attr) and attention (attention_attr) side by
    # side on the same normed input, then the MLP (Falcon-H1's "hybrid"): each is both a recurrent and an attention
    # layer, its attention hooks are blocks.{l}.attn.hook_*, and its cache layer holds state, conv tail and K/V
    parallel_block_types: tuple = ()
    # layer_types of decoder layers that first run a transformer block shared by several depths, whose output feeds
    # the recurrent mixer's input (Zamba2's "hybrid"), and where their mixer, its norm and the shared block's
    # attention sit inside such a layer (module paths): each is both a recurrent and an attention layer, with
    # per-use hook names blocks.{l}.attn.hook_* (each use is its own module, with tied weights), and its cache layer
    # holds state, conv tail and K/V. The shared blocks read the token embeddings, which the layer-by-layer protocol
    # carries in the residual's trailing channels (BridgedLM.run_layer)
    shared_block_types: tuple = ()
    shared_block_paths: tuple = ()
    # names of the positional arguments after the hidden states with which the model calls each layer (Zamba2's)
    layer_args: tuple = ()


def _gdn_state_shape(cfg):
    return (cfg.linear_key_head_dim, cfg.linear_value_head_dim)


def _gdn_state_heads(cfg):
    return cfg.linear_num_value_heads


#: config.json keys of the Gated DeltaNet layers (Qwen3.5, Qwen3-Next and OLMo-hybrid share them)
GDN_KEYS = frozenset({"linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                      "linear_value_head_dim", "linear_conv_kernel_dim", "layer_types"})
_MIXERS = "recurscope.interp.bridge.mixers"

QWEN35_GDN = FamilySpec(
    name="qwen3_5", title="Qwen3.5 Gated DeltaNet + gated attention (transformers; dense, MoE, multimodal)",
    weights=TRANSFORMERS_WEIGHTS, config_keys=GDN_KEYS,
    kernel_inputs={"q": "l2norm(silu(conv(in_proj_qkv)[:key_dim])), repeated over value heads",
                   "k": "l2norm(silu(conv(in_proj_qkv)[key_dim:2 key_dim])), repeated over value heads",
                   "x": "beta v, beta = sigmoid(in_proj_b)", "g": "-exp(A_log) softplus(in_proj_a + dt_bias), per head",
                   "a": "beta k"},
    mixer="BridgedGatedDeltaNet", mixer_module=_MIXERS,
    state_shape=_gdn_state_shape, state_heads=_gdn_state_heads,
)

QWEN3_NEXT_GDN = FamilySpec(
    name="qwen3_next", title="Qwen3-Next Gated DeltaNet + gated attention, MoE (transformers)",
    weights=TRANSFORMERS_WEIGHTS, config_keys=GDN_KEYS,
    kernel_inputs={"q": "l2norm(silu(conv(q))), q split per key head from in_proj_qkvz, repeated over value heads",
                   "k": "l2norm(silu(conv(k))), k from the same split, repeated over value heads",
                   "x": "beta v, beta = sigmoid(b), b split from in_proj_ba",
                   "g": "-exp(A_log) softplus(a + dt_bias), a split from in_proj_ba, per head", "a": "beta k"},
    mixer="BridgedQwen3NextGatedDeltaNet", mixer_module=_MIXERS,
    state_shape=_gdn_state_shape, state_heads=_gdn_state_heads,
)

OLMO_HYBRID_GDN = FamilySpec(
    name="olmo_hybrid", title="OLMo-hybrid Gated DeltaNet + post-norm attention (transformers)",
    weights=TRANSFORMERS_WEIGHTS, config_keys=GDN_KEYS | {"linear_allow_neg_eigval"},
    kernel_inputs={"q": "l2norm(silu(conv(q_proj))), repeated over value heads",
                   "k": "l2norm(silu(conv(k_proj))), repeated over value heads",
                   "x": "beta v, beta = sigmoid(b_proj), times 2 when linear_allow_neg_eigval",
                   "g": "-exp(A_log) softplus(a_proj + dt_bias), per head", "a": "beta k"},
    mixer="BridgedOlmoHybridGatedDeltaNet", mixer_module=_MIXERS,
    state_shape=_gdn_state_shape, state_heads=_gdn_state_heads,
)

KIMI_KDA = FamilySpec(
    name="kimi_linear", title="Kimi-Linear KDA (per-channel decay) + MLA attention, MoE (transformers)",
    weights=TRANSFORMERS_WEIGHTS,
    config_keys=frozenset({"linear_attn_config", "layer_types", "mlp_layer_types", "kv_lora_rank", "q_lora_rank",
                           "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"}),
    kernel_inputs={"q": "l2norm(silu(conv(q_proj)))", "k": "l2norm(silu(conv(k_proj)))",
                   "x": "beta v, beta = sigmoid(b_proj)",
                   "g": "forget_gate: -exp(A_log) softplus(f_b_proj(f_a_proj h) + dt_bias), per key channel",
                   "a": "beta k"},
    mixer="BridgedKimiDeltaAttention", mixer_module=_MIXERS,
    state_shape=lambda cfg: (cfg.linear_head_dim, cfg.linear_head_dim), state_heads=lambda cfg: cfg.linear_num_heads,
)

MAMBA2_SSD = FamilySpec(
    name="mamba2", title="Mamba-2 SSD (transformers' Mamba2ForCausalLM)",
    weights=TRANSFORMERS_WEIGHTS,
    config_keys=frozenset({"num_heads", "head_dim", "state_size", "n_groups", "expand", "conv_kernel",
                           "time_step_limit", "use_conv_bias", "use_bias", "chunk_size", "residual_in_fp32"}),
    kernel_inputs={"q": "C = silu(conv1d(in_proj))[C part], repeated over the heads of its group (contiguous)",
                   "k": "B = silu(conv1d(in_proj))[B part], repeated over the heads of its group (contiguous)",
                   "x": "dt x, dt = clamp(softplus(in_proj[dt part] + dt_bias), time_step_limit) per head, "
                        "x = silu(conv1d(in_proj))[x part]",
                   "g": "dt A, A = -exp(A_log), per head (scale 1; D skip and gated norm after the readout)",
                   "a": "none (no erase)"},
    mixer="BridgedMamba2", mixer_module=_MIXERS,
    state_shape=lambda cfg: (cfg.state_size, cfg.head_dim), state_heads=lambda cfg: cfg.num_heads,
    absent_hooks=frozenset({"hook_erase", "hook_erase_gate", "hook_mlp_out"}),
    mlp=False,
)

NEMOTRON_H = FamilySpec(
    name="nemotron_h", title="Nemotron-H: Mamba-2 SSD, attention and MLP/MoE blocks (transformers)",
    weights=TRANSFORMERS_WEIGHTS,
    config_keys=frozenset({"layers_block_type", "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups",
                           "conv_kernel", "time_step_min", "use_conv_bias", "use_bias", "chunk_size"}),
    kernel_inputs=dict(MAMBA2_SSD.kernel_inputs,
                       x="dt x, dt = clamp(softplus(in_proj[dt part] + dt_bias), (time_step_min, inf)) per head, "
                         "x = silu(conv1d(in_proj))[x part]"),
    mixer="BridgedMamba2", mixer_module=_MIXERS,
    state_shape=lambda cfg: (cfg.ssm_state_size, cfg.mamba_head_dim), state_heads=lambda cfg: cfg.mamba_num_heads,
    absent_hooks=frozenset({"hook_erase", "hook_erase_gate"}),
    mlp=False,
)

BAMBA = FamilySpec(
    name="bamba", title="Bamba: Mamba-2 SSD + attention decoder layers with a SwiGLU MLP (transformers)",
    weights=TRANSFORMERS_WEIGHTS,
    config_keys=frozenset({"layers_block_type", "attn_layer_indices", "mamba_n_heads", "mamba_d_head",
                           "mamba_d_state", "mamba_n_groups", "mamba_expand", "mamba_d_conv", "mamba_chunk_size",
                           "time_step_limit", "mamba_conv_bias", "mamba_proj_bias"}),
    kernel_inputs=MAMBA2_SSD.kernel_inputs,
    mixer="BridgedMamba2", mixer_module=_MIXERS,
    state_shape=lambda cfg: (cfg.mamba_d_state, cfg.mamba_d_head), state_heads=lambda cfg: cfg.mamba_n_heads,
    absent_hooks=frozenset({"hook_erase", "hook_erase_gate"}),
)

def _granite_mlp(block, h):
    """Granite-4.0-H's MLP: the routed experts (when the layer has them) plus the shared MLP."""
    moe = block.block_sparse_moe
    return block.shared_mlp(h) if moe is None else moe(h) + block.shared_mlp(h)


GRANITE_MOE_HYBRID = FamilySpec(
    name="granitemoehybrid",
    title="Granite-4.0-H: Mamba-2 SSD + attention, MoE with a shared MLP, scaled residuals (transformers)",
    weights=TRANSFORMERS_WEIGHTS, config_keys=BAMBA.config_keys | {"layer_types", "residual_multiplier",
                                                                   "embedding_multiplier", "logits_scaling"},
    kernel_inputs=MAMBA2_SSD.kernel_inputs,
    mixer="BridgedMamba2", mixer_module=_MIXERS,
    state_shape=BAMBA.state_shape, state_heads=BAMBA.state_heads,
    absent_hooks=frozenset({"hook_erase", "hook_erase_gate"}),
)

FALCON_H1 = FamilySpec(
    name="falcon_h1",
    title="Falcon-H1: Mamba-2 SSD and attention side by side in every decoder layer, muP multipliers (transformers)",
    weights=TRANSFORMERS_WEIGHTS,
    config_keys=frozenset({"layers_block_type", "mamba_d_ssm", "mamba_n_heads", "mamba_d_head", "mamba_n_groups",
                           "mamba_d_state", "mamba_d_conv", "mamba_expand", "mamba_chunk_size", "mamba_conv_bias",
                           "mamba_proj_bias", "mamba_norm_before_gate", "mamba_rms_norm", "time_step_limit",
                           "ssm_multipliers", "ssm_in_multiplier", "ssm_out_multiplier", "attention_in_multiplier",
                           "attention_out_multiplier", "key_multiplier", "mlp_multipliers", "embedding_multiplier",
                           "lm_head_multiplier"}),
    kernel_inputs=dict(MAMBA2_SSD.kernel_inputs,
                       q="C = silu(conv1d(in_proj(ssm_in_multiplier h) * mup_vector))[C part], repeated over the "
                         "heads of its group (contiguous)",
                       k="B from the same split, repeated over the heads of its group (contiguous)",
                       g="dt A, A = -exp(A_log), per head (scale 1; D skip, then gated norm or silu(z) gate, after "
                         "the readout)"),
    mixer="BridgedFalconH1Mamba2", mixer_module=_MIXERS,
    state_shape=lambda cfg: (cfg.mamba_d_state, cfg.mamba_d_head), state_heads=lambda cfg: cfg.mamba_n_heads,
    absent_hooks=frozenset({"hook_erase", "hook_erase_gate"}),
)

ZAMBA2 = FamilySpec(
    name="zamba2",
    title="Zamba2: Mamba-2 SSD layers, with a transformer block shared by several depths (per-use LoRA adapters) "
          "feeding some of them (transformers)",
    weights=TRANSFORMERS_WEIGHTS,
    config_keys=frozenset({"layers_block_type", "mamba_d_state", "mamba_d_conv", "mamba_expand", "mamba_ngroups",
                           "n_mamba_heads", "time_step_min", "time_step_max", "time_step_floor", "use_conv_bias",
                           "chunk_size", "add_bias_linear", "num_mem_blocks", "use_shared_attention_adapter",
                           "adapter_rank", "use_mem_rope", "use_long_context"}),
    kernel_inputs=dict(MAMBA2_SSD.kernel_inputs,
                       x="dt x, dt = clamp(softplus(in_proj[dt part] + dt_bias), (time_step_min, inf)) per head, "
                         "x = silu(conv1d(in_proj))[x part]"),
    mixer="BridgedMamba2", mixer_module=_MIXERS,
    state_shape=lambda cfg: (cfg.mamba_d_state, cfg.mamba_headdim), state_heads=lambda cfg: cfg.n_mamba_heads,
    absent_hooks=frozenset({"hook_erase", "hook_erase_gate", "hook_mlp_out"}),
    mlp=False,
)

BRIDGE_FAMILIES: tuple[BridgeFamily, ...] = (
    BridgeFamily(QWEN35_GDN, ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"), "linear_attn", "self_attn"),
    BridgeFamily(QWEN3_NEXT_GDN, ("qwen3_next",), "linear_attn", "self_attn"),
    BridgeFamily(OLMO_HYBRID_GDN, ("olmo_hybrid",), "linear_attn", "self_attn", attention_norm="post"),
    BridgeFamily(KIMI_KDA, ("kimi_linear",), "self_attn", "self_attn", cached_kv_to_attention=False),
    BridgeFamily(MAMBA2_SSD, ("mamba2",), "mixer", "mixer", mixer_norm_attr="norm", final_norm_attr="norm_f",
                 conv_kernel_key="conv_kernel", state_transposed=True,
                 model_class="Mamba2ForCausalLM"),
    BridgeFamily(NEMOTRON_H, ("nemotron_h",), "mixer", "mixer", mixer_norm_attr="norm", final_norm_attr="norm_f",
                 conv_kernel_key="conv_kernel", state_transposed=True, mlp_block_types=("mlp", "moe")),
    BridgeFamily(BAMBA, ("bamba",), "mamba", "self_attn", final_norm_attr="final_layernorm",
                 conv_kernel_key="mamba_d_conv", state_transposed=True, mlp_attr="feed_forward",
                 mlp_norm_attr="pre_ff_layernorm", layer_returns_tuple=True),
    BridgeFamily(GRANITE_MOE_HYBRID, ("granitemoehybrid",), "mamba", "self_attn", conv_kernel_key="mamba_d_conv",
                 state_transposed=True, mlp_attr="shared_mlp", mlp_fn=_granite_mlp),
    BridgeFamily(FALCON_H1, ("falcon_h1",), "mamba", "self_attn", final_norm_attr="final_layernorm",
                 conv_kernel_key="mamba_d_conv", state_transposed=True, mlp_attr="feed_forward",
                 mlp_norm_attr="pre_ff_layernorm", layer_returns_tuple=True, parallel_block_types=("hybrid",)),
    BridgeFamily(ZAMBA2, ("zamba2",), "mamba", "self_attn", final_norm_attr="final_layernorm",
                 conv_kernel_key="mamba_d_conv", state_transposed=True, shared_block_types=("hybrid",),
                 shared_block_paths=("mamba_decoder.mamba", "mamba_decoder.input_layernorm",
                                     "shared_transformer.self_attn"),
                 layer_args=("original_hidden_states", "layer_idx", "attention_mask", "causal_mask")),
)


def bridge_family(model_type: str):
    for fam in BRIDGE_FAMILIES:
        if model_type in fam.model_types:
            return fam
    return None


def supported_model_types() -> tuple:
    return tuple(t for fam in BRIDGE_FAMILIES for t in fam.model_types)
