"""Bamba: Mamba-2 and attention decoder layers, each followed by a SwiGLU MLP (`feed_forward`); its model unpacks
(hidden states, attention weights) from each layer. The base of Falcon-H1."""
from dataclasses import replace

from recurscope.interp.bridge.adapters.base import MAMBA2_KERNELS, MambaHybridAdapter
from recurscope.interp.bridge.adapters.mamba2 import SPEC as MAMBA2

SPEC = replace(
    MAMBA2, name="bamba", title="Bamba: Mamba-2 SSD + attention decoder layers with a SwiGLU MLP (transformers)",
    config_keys=frozenset({"layers_block_type", "attn_layer_indices", "mamba_n_heads", "mamba_d_head",
                           "mamba_d_state", "mamba_n_groups", "mamba_expand", "mamba_d_conv", "mamba_chunk_size",
                           "time_step_limit", "mamba_conv_bias", "mamba_proj_bias"}),
    state_shape=lambda cfg: (cfg.mamba_d_state, cfg.mamba_d_head), state_heads=lambda cfg: cfg.mamba_n_heads,
    absent_hooks=frozenset({"hook_erase", "hook_erase_gate"}), mlp=True,
)


class BambaAdapter(MambaHybridAdapter):
    spec = SPEC
    order = 70
    model_types = ("bamba",)
    final_norm_attr = "final_layernorm"
    mlp_attr = "feed_forward"
    mlp_norm_attr = "pre_ff_layernorm"
    layer_returns_tuple = True
    dispatched = {"transformers.models.bamba.modeling_bamba": MAMBA2_KERNELS}


ADAPTER = BambaAdapter()
