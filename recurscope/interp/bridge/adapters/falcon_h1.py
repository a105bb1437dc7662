"""Falcon-H1: in its "hybrid" decoder layers the Mamba-2 mixer and the attention run side by side on the same normed
input and both outputs join the residual stream (`ParallelBlock`); muP multipliers around both."""
from dataclasses import replace

import torch

from recurscope.interp.bridge.adapters.bamba import BambaAdapter
from recurscope.interp.bridge.adapters.base import MAMBA2_KERNELS
from recurscope.interp.bridge.adapters.mamba2 import SPEC as MAMBA2
from recurscope.interp.bridge.blocks import BridgeBlock

SPEC = replace(
    MAMBA2, name="falcon_h1",
    title="Falcon-H1: Mamba-2 SSD and attention side by side in every decoder layer, muP multipliers (transformers)",
    config_keys=frozenset({"layers_block_type", "mamba_d_ssm", "mamba_n_heads", "mamba_d_head", "mamba_n_groups",
                           "mamba_d_state", "mamba_d_conv", "mamba_expand", "mamba_chunk_size", "mamba_conv_bias",
                           "mamba_proj_bias", "mamba_norm_before_gate", "mamba_rms_norm", "time_step_limit",
                           "ssm_multipliers", "ssm_in_multiplier", "ssm_out_multiplier", "attention_in_multiplier",
                           "attention_out_multiplier", "key_multiplier", "mlp_multipliers", "embedding_multiplier",
                           "lm_head_multiplier"}),
    kernel_inputs=dict(MAMBA2.kernel_inputs,
                       q="C = silu(conv1d(in_proj(ssm_in_multiplier h) * mup_vector))[C part], repeated over the "
                         "heads of its group (contiguous)",
                       k="B from the same split, repeated over the heads of its group (contiguous)",
                       g="dt A, A = -exp(A_log), per head (scale 1; D skip, then gated norm or silu(z) gate, after "
                         "the readout)"),
    mixer="BridgedFalconH1Mamba2",
    state_shape=lambda cfg: (cfg.mamba_d_state, cfg.mamba_d_head), state_heads=lambda cfg: cfg.mamba_n_heads,
    absent_hooks=frozenset({"hook_erase", "hook_erase_gate"}), mlp=True,
)


class ParallelBlock(BridgeBlock):
    """A decoder layer that runs its recurrent mixer and its attention (`attn`) side by side on the same normed
    input; both outputs are added to the residual stream (as transformers adds them: residual + (mixer +
    attention)), then the MLP. hook_resid_mid is the residual plus both. The layer's muP multipliers: the mixer's
    output times ssm_out_multiplier, the attention's input times attention_in_multiplier and its output times
    attn_out_multiplier."""

    def __init__(self, hf_layer, *args, **kwargs):
        super().__init__(hf_layer, *args, **kwargs)
        self.mixer_out_multiplier = float(getattr(hf_layer, "ssm_out_multiplier", 1.0))
        self.attention_in_multiplier = float(getattr(hf_layer, "attention_in_multiplier", 1.0))
        self.attention_out_multiplier = float(getattr(hf_layer, "attn_out_multiplier", 1.0))

    @property
    def mixer_output_scale(self) -> float:
        return self.mixer_out_multiplier

    def residual_update(self, resid, attention_mask, position_ids, cache, position_embeddings, kwargs):
        h = self._sub(self.mixer_norm_attr)(resid)
        if self.residual_in_fp32:
            resid = resid.to(torch.promote_types(resid.dtype, torch.float32))
        mixed = self.mixer(h, cache=cache, attention_mask=kwargs.get("mamba_attention_mask"))
        if self.mixer_out_multiplier != 1.0:
            mixed = mixed * self.mixer_out_multiplier
        attended, _ = self.attn(hidden_states=h * self.attention_in_multiplier if self.attention_in_multiplier != 1.0
                                else h, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                                position_embeddings=position_embeddings)
        if self.attention_out_multiplier != 1.0:
            attended = attended * self.attention_out_multiplier
        resid = self.hook_resid_mid(resid + (self.hook_mixer_out(mixed) + self.hook_attn_out(attended)))
        return self._mlp_forward(resid, True)


class FalconH1Adapter(BambaAdapter):
    spec = SPEC
    order = 90
    model_types = ("falcon_h1",)
    parallel_block_types = ("hybrid",)
    dispatched = {"transformers.models.falcon_h1.modeling_falcon_h1": MAMBA2_KERNELS}

    def is_recurrent_type(self, layer_type: str) -> bool:
        return layer_type in self.parallel_block_types or super().is_recurrent_type(layer_type)

    def make_block(self, layer, layer_type: str):
        if layer_type not in self.parallel_block_types:
            return super().make_block(layer, layer_type)
        from recurscope.interp.bridge.mixers import add_attention_hooks

        self.wrap_mixer(layer, self.linear_attr)
        add_attention_hooks(layer.get_submodule(self.attention_attr))
        block = ParallelBlock(layer, self.linear_attr, True, "pre", self.mixer_norm_attr, False, self.mlp_attr,
                              self.mlp_norm_attr, None, self.attention_attr, self.layer_args)
        block.returns_tuple = self.layer_returns_tuple
        return block


ADAPTER = FalconH1Adapter()
