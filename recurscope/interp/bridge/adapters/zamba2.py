"""Zamba2: Mamba-2 layers, some of which ("hybrid") first run a transformer block shared by several depths (per-use
LoRA adapters) whose projected output feeds the mixer's input (`SharedBlock`). The shared blocks read the token
embeddings, which the layer-by-layer protocol carries in the residual's trailing channels (`run_layer`)."""
from dataclasses import replace

import torch

from recurscope.interp.bridge.adapters.base import MAMBA2_KERNELS, MambaHybridAdapter
from recurscope.interp.bridge.adapters.mamba2 import SPEC as MAMBA2
from recurscope.interp.bridge.blocks import BridgeBlock

SPEC = replace(
    MAMBA2, name="zamba2",
    title="Zamba2: Mamba-2 SSD layers, with a transformer block shared by several depths (per-use LoRA adapters) "
          "feeding some of them (transformers)",
    config_keys=frozenset({"layers_block_type", "mamba_d_state", "mamba_d_conv", "mamba_expand", "mamba_ngroups",
                           "n_mamba_heads", "time_step_min", "time_step_max", "time_step_floor", "use_conv_bias",
                           "chunk_size", "add_bias_linear", "num_mem_blocks", "use_shared_attention_adapter",
                           "adapter_rank", "use_mem_rope", "use_long_context"}),
    kernel_inputs=dict(MAMBA2.kernel_inputs,
                       x="dt x, dt = clamp(softplus(in_proj[dt part] + dt_bias), (time_step_min, inf)) per head, "
                         "x = silu(conv1d(in_proj))[x part]"),
    state_shape=lambda cfg: (cfg.mamba_d_state, cfg.mamba_headdim), state_heads=lambda cfg: cfg.n_mamba_heads,
)


class SharedBlock(BridgeBlock):
    """Zamba2's hybrid layer: its shared transformer block reads the residual and the token embeddings; its output,
    projected by `linear` (hook_attn_out), is added to the mixer's input (before the mixer norm), not to the residual
    stream; then the mixer, whose output is added to the residual (attention_mask is the mixer's mask, causal_mask
    the shared attention's). Each use of the shared block is its own module (tied weights) with its own hook points,
    blocks.{l}.attn.hook_*."""

    @property
    def mixer_output_scale(self) -> float:
        return 1.0

    def residual_update(self, resid, attention_mask, position_ids, cache, position_embeddings, kwargs):
        shared = self.shared_transformer(resid, original_hidden_states=kwargs["original_hidden_states"],
                                         layer_idx=kwargs["layer_idx"], attention_mask=kwargs.get("causal_mask"),
                                         cache=cache, position_embeddings=position_embeddings,
                                         position_ids=position_ids)
        fed = self.hook_attn_out(self.linear(shared))
        mixed = self.mixer(self._sub(self.mixer_norm_attr)(resid + fed), cache=cache, attention_mask=attention_mask)
        resid = self.hook_resid_mid(resid + self.hook_mixer_out(mixed))
        return self._mlp_forward(resid, True)


class Zamba2Adapter(MambaHybridAdapter):
    spec = SPEC
    order = 100
    model_types = ("zamba2",)
    final_norm_attr = "final_layernorm"
    shared_block_types = ("hybrid",)
    # the mixer, its norm and the shared block's attention inside a hybrid layer (module paths)
    shared_block_paths = ("mamba_decoder.mamba", "mamba_decoder.input_layernorm", "shared_transformer.self_attn")
    layer_args = ("original_hidden_states", "layer_idx", "attention_mask", "causal_mask")
    dispatched = {"transformers.models.zamba2.modeling_zamba2": MAMBA2_KERNELS}

    def is_recurrent_type(self, layer_type: str) -> bool:
        return layer_type in self.shared_block_types or super().is_recurrent_type(layer_type)

    def make_block(self, layer, layer_type: str):
        if layer_type not in self.shared_block_types:
            return super().make_block(layer, layer_type)
        from recurscope.interp.bridge.mixers import add_attention_hooks

        mixer_path, norm_path, attn_path = self.shared_block_paths
        self.wrap_mixer(layer, mixer_path)
        add_attention_hooks(layer.get_submodule(attn_path))
        block = SharedBlock(layer, mixer_path, True, "pre", norm_path, False, self.mlp_attr, self.mlp_norm_attr,
                            None, attn_path, self.layer_args)
        block.returns_tuple = self.layer_returns_tuple
        return block

    def run_layer(self, model, layer, resid, layer_cache, context):
        # The shared blocks read the token embeddings at every use: the residual between layers carries them in its
        # trailing channels (layer 0 takes the bare embeddings and appends them), so that rows regrouped between
        # layers (the head scan's growing batch) keep their own
        kwargs, seen = context
        d = model.cfg.hidden_size
        embeds = resid if layer == 0 else resid[..., d:]
        per_layer = list(kwargs)
        per_layer[layer] = dict(kwargs[layer], original_hidden_states=embeds)
        out = model.run_block(layer, resid[..., :d], layer_cache, (per_layer, seen))
        return torch.cat([out, embeds], dim=-1)


ADAPTER = Zamba2Adapter()
