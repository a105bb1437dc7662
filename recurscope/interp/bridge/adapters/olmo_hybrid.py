"""OLMo-hybrid: Gated DeltaNet layers with separate projections (beta in [0, 2] with linear_allow_neg_eigval) and
post-norm attention layers."""
from dataclasses import replace

from recurscope.interp.bridge.adapters.base import GATED_DELTA_KERNELS
from recurscope.interp.bridge.adapters.qwen3_5 import GDN_KEYS, SPEC as QWEN35, Qwen35Adapter

SPEC = replace(
    QWEN35, name="olmo_hybrid", title="OLMo-hybrid Gated DeltaNet + post-norm attention (transformers)",
    config_keys=GDN_KEYS | {"linear_allow_neg_eigval"},
    kernel_inputs={"q": "l2norm(silu(conv(q_proj))), repeated over value heads",
                   "k": "l2norm(silu(conv(k_proj))), repeated over value heads",
                   "x": "beta v, beta = sigmoid(b_proj), times 2 when linear_allow_neg_eigval",
                   "g": "-exp(A_log) softplus(a_proj + dt_bias), per head", "a": "beta k"},
    mixer="BridgedOlmoHybridGatedDeltaNet",
)


class OlmoHybridAdapter(Qwen35Adapter):
    spec = SPEC
    order = 30
    model_types = ("olmo_hybrid",)
    attention_norm = "post"
    dispatched = {"transformers.models.olmo_hybrid.modeling_olmo_hybrid": GATED_DELTA_KERNELS}


ADAPTER = OlmoHybridAdapter()
