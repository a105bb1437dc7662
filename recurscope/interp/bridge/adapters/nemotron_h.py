"""Nemotron-H: Mamba-2, attention and MLP/MoE blocks, each norm, module, residual (Mamba-2's block layout)."""
from dataclasses import replace

from recurscope.interp.bridge.adapters.base import MAMBA2_KERNELS
from recurscope.interp.bridge.adapters.mamba2 import SPEC as MAMBA2, Mamba2Adapter

SPEC = replace(
    MAMBA2, name="nemotron_h", title="Nemotron-H: Mamba-2 SSD, attention and MLP/MoE blocks (transformers)",
    config_keys=frozenset({"layers_block_type", "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups",
                           "conv_kernel", "time_step_min", "use_conv_bias", "use_bias", "chunk_size"}),
    kernel_inputs=dict(MAMBA2.kernel_inputs,
                       x="dt x, dt = clamp(softplus(in_proj[dt part] + dt_bias), (time_step_min, inf)) per head, "
                         "x = silu(conv1d(in_proj))[x part]"),
    state_shape=lambda cfg: (cfg.ssm_state_size, cfg.mamba_head_dim), state_heads=lambda cfg: cfg.mamba_num_heads,
    absent_hooks=frozenset({"hook_erase", "hook_erase_gate"}),
)


class NemotronHAdapter(Mamba2Adapter):
    spec = SPEC
    order = 60
    model_types = ("nemotron_h",)
    model_class = None
    mlp_block_types = ("mlp", "moe")
    dispatched = {"transformers.models.nemotron_h.modeling_nemotron_h": MAMBA2_KERNELS}

    def claims(self, raw_config: dict) -> bool:
        return raw_config.get("model_type") in self.model_types


ADAPTER = NemotronHAdapter()
