"""Granite-4.0-H: Mamba-2 and attention layers whose MLP is the routed experts plus a shared MLP, with scaled
residuals, embeddings and logits (the block and BridgedLM read the multipliers off transformers' modules)."""
from dataclasses import replace

from recurscope.interp.bridge.adapters.bamba import SPEC as BAMBA
from recurscope.interp.bridge.adapters.base import MAMBA2_KERNELS, MambaHybridAdapter

SPEC = replace(
    BAMBA, name="granitemoehybrid",
    title="Granite-4.0-H: Mamba-2 SSD + attention, MoE with a shared MLP, scaled residuals (transformers)",
    config_keys=BAMBA.config_keys | {"layer_types", "residual_multiplier", "embedding_multiplier", "logits_scaling"},
)


def granite_mlp(block, h):
    """Granite-4.0-H's MLP: the routed experts (when the layer has them) plus the shared MLP."""
    moe = block.block_sparse_moe
    return block.shared_mlp(h) if moe is None else moe(h) + block.shared_mlp(h)


class GraniteMoeHybridAdapter(MambaHybridAdapter):
    spec = SPEC
    order = 80
    model_types = ("granitemoehybrid",)
    mlp_attr = "shared_mlp"
    mlp_fn = staticmethod(granite_mlp)
    dispatched = {"transformers.models.granitemoehybrid.modeling_granitemoehybrid": MAMBA2_KERNELS}


ADAPTER = GraniteMoeHybridAdapter()
