"""Qwen3-Next: Qwen3.5's layout with the fused, per-key-head interleaved projections and MoE in every layer."""
from dataclasses import replace

from recurscope.interp.bridge.adapters.base import GATED_DELTA_KERNELS
from recurscope.interp.bridge.adapters.qwen3_5 import SPEC as QWEN35, Qwen35Adapter

SPEC = replace(
    QWEN35, name="qwen3_next", title="Qwen3-Next Gated DeltaNet + gated attention, MoE (transformers)",
    kernel_inputs={"q": "l2norm(silu(conv(q))), q split per key head from in_proj_qkvz, repeated over value heads",
                   "k": "l2norm(silu(conv(k))), k from the same split, repeated over value heads",
                   "x": "beta v, beta = sigmoid(b), b split from in_proj_ba",
                   "g": "-exp(A_log) softplus(a + dt_bias), a split from in_proj_ba, per head", "a": "beta k"},
    mixer="BridgedQwen3NextGatedDeltaNet",
)


class Qwen3NextAdapter(Qwen35Adapter):
    spec = SPEC
    order = 20
    model_types = ("qwen3_next",)
    dispatched = {"transformers.models.qwen3_next.modeling_qwen3_next": GATED_DELTA_KERNELS}


ADAPTER = Qwen3NextAdapter()
