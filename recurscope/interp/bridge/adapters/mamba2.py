"""Mamba-2 in transformers' format (`Mamba2ForCausalLM`): norm, Mamba-2 mixer, residual blocks; the base of
Nemotron-H. fla's Mamba-2 shares the model_type "mamba2" (and registers itself in transformers' Auto classes), so
this adapter claims only configs with transformers' key names."""
from recurscope.interp.bridge.adapters.base import MAMBA2_KERNELS, MIXERS, TRANSFORMERS_WEIGHTS, BridgeAdapter
from recurscope.interp.models.families import FamilySpec

SPEC = FamilySpec(
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
    mixer="BridgedMamba2", mixer_module=MIXERS,
    state_shape=lambda cfg: (cfg.state_size, cfg.head_dim), state_heads=lambda cfg: cfg.num_heads,
    absent_hooks=frozenset({"hook_erase", "hook_erase_gate", "hook_mlp_out"}),
    mlp=False,
)


class Mamba2Adapter(BridgeAdapter):
    spec = SPEC
    order = 50
    model_types = ("mamba2",)
    linear_attr = attention_attr = "mixer"
    mixer_norm_attr = "norm"
    final_norm_attr = "norm_f"
    conv_kernel_key = "conv_kernel"
    state_transposed = True
    model_class = "Mamba2ForCausalLM"
    dispatched = {"transformers.models.mamba2.modeling_mamba2": MAMBA2_KERNELS}

    def claims(self, raw_config: dict) -> bool:
        # transformers' config names its options layer_norm_epsilon and time_step_limit where fla's has norm_eps
        # and dt_limit
        return super().claims(raw_config) and ("layer_norm_epsilon" in raw_config or "time_step_limit" in raw_config)


ADAPTER = Mamba2Adapter()
