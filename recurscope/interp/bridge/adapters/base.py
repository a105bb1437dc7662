"""What every bridged architecture shares: `BridgeAdapter`, one subclass per transformers architecture (its own module
in this package), in the manner of TransformerLens's `model_bridge/supported_architectures` adapters.

An adapter owns everything recurscope knows about one architecture: its `FamilySpec` (config keys, kernel inputs,
mixer, hook set, state shape, the paper family whose numbers apply), the config.json `model_type` values it loads,
where its decoder layers keep their mixer, norms, attention and MLP, how each layer type becomes a `BridgeBlock`,
how transformers' cache object is read and written, and which of transformers' kernel functions its modeling module
dispatches (`torch_path`). Defaults are the Qwen3.5 decoder hybrid's; a subclass changes what differs.
"""
from __future__ import annotations

from typing import Callable, ClassVar, Optional

import torch

from recurscope.interp.models.families import FamilySpec, WeightMap


def _same(name: str) -> str:
    return name


TRANSFORMERS_WEIGHTS = WeightMap("transformers", _same, _same)   # transformers' modules keep their own names

#: the functions transformers' delta-rule and Mamba-2 modeling modules hand to fla or causal-conv1d when they import
GATED_DELTA_KERNELS = ("causal_conv1d_update", "causal_conv1d_fn", "torch_chunk_gated_delta_rule",
                       "torch_recurrent_gated_delta_rule")
MAMBA2_KERNELS = ("causal_conv1d_update", "causal_conv1d_fn", "mamba2_split_conv1d_scan_combined",
                  "mamba2_selective_state_update", "mamba2_chunk_scan")
MIXERS = "recurscope.interp.bridge.mixers"


class LayerView:
    """What a bridged layer reads of transformers' cache, served from one recurscope LayerCache without writing it:
    the layer's own call sees the cached state, conv tail and K/V with its new inputs appended, as transformers'
    cache returns them, and nothing is stored. The head scan's rows share the recipient's cache as batch-expanded
    views, which transformers' in-place cache updates could not take (and would copy per row)."""

    def __init__(self, lc, seen: int, new_kv_only: bool = False, state_transposed: bool = False):
        # new_kv_only: `update` returns the new K/V alone; the attention function reads the cached ones itself
        # (the module's shared_kv, set by BridgedLM.run_layer). state_transposed: the layer reads its state as
        # transformers keeps it, (V, K) per head (Mamba-2), while the LayerCache holds recurscope's (K, V)
        self.lc, self.seen, self.new_kv_only, self.state_transposed = lc, seen, new_kv_only, state_transposed

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        state = self.lc.state
        return state.transpose(-1, -2) if self.state_transposed and state is not None else state

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        return self.lc.conv.get(str(state_idx))

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        tail = self.lc.conv.get(str(state_idx))
        return conv_states if tail is None else torch.cat([tail.to(conv_states.dtype), conv_states], dim=-1)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        return recurrent_states

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.lc.keys is None or self.new_kv_only:
            return key_states, value_states
        return (torch.cat([self.lc.keys.transpose(1, 2), key_states], dim=-2),
                torch.cat([self.lc.values.transpose(1, 2), value_states], dim=-2))


class BridgeAdapter:
    """One transformers architecture. Class attributes are its facts; methods are what it does differently.

    spec: its FamilySpec. model_types: the config.json model_type values it loads (text and multimodal layouts).
    order: where it is listed among the architectures (error messages, `supported_model_types`).
    linear_attr / attention_attr: the decoder layer's attribute holding the recurrent mixer / the full attention
    (Kimi-Linear: the same attribute). attention_norm: "post" when its attention layers norm the mixer's and the
    MLP's outputs (OLMo-hybrid). cached_kv_to_attention: its attention hands the cache's K/V to the attention
    function as they are, so the head scan's rows can read a shared cached K/V there (False for Kimi's MLA).
    mixer_norm_attr / final_norm_attr: the layer's norm before its mixer, the text model's final norm.
    conv_kernel_key: the config key of the recurrent layers' short conv kernel; short_conv: False for an
    architecture whose recurrent layers have none (MiniMax's lightning attention). state_transposed: transformers' cache
    keeps each head's state as (V, K) (Mamba-2); the bridge's RecurrentCache and hook_state keep (K, V).
    model_class: the transformers class to build where AutoModelForCausalLM may give another library's (fla
    registers its Mamba-2 under the same model_type). mlp_block_types: layer types holding only an MLP or MoE after
    their norm (Nemotron-H). mlp_attr / mlp_norm_attr: the layer's MLP and the norm before it. mlp_fn: the MLP as a
    function of the block and its normed input, when it is not one module (Granite-4.0-H). layer_returns_tuple: its
    model unpacks (hidden_states, attention weights) from each layer. layer_args: names of the positional arguments
    after the hidden states with which its model calls each layer (Zamba2). dispatched: its modeling module(s) and the
    kernel functions transformers dispatches there to fla or causal-conv1d (`torch_path` swaps them back).
    """
    spec: ClassVar[FamilySpec]
    model_types: ClassVar[tuple] = ()
    order: ClassVar[int] = 100
    linear_attr: ClassVar[str] = "linear_attn"
    attention_attr: ClassVar[str] = "self_attn"
    attention_norm: ClassVar[str] = "pre"
    cached_kv_to_attention: ClassVar[bool] = True
    mixer_norm_attr: ClassVar[str] = "input_layernorm"
    final_norm_attr: ClassVar[str] = "norm"
    conv_kernel_key: ClassVar[str] = "linear_conv_kernel_dim"
    short_conv: ClassVar[bool] = True
    state_transposed: ClassVar[bool] = False
    model_class: ClassVar[Optional[str]] = None
    mlp_block_types: ClassVar[tuple] = ()
    mlp_attr: ClassVar[str] = "mlp"
    mlp_norm_attr: ClassVar[str] = "post_attention_layernorm"
    mlp_fn: ClassVar[Optional[Callable]] = None
    layer_returns_tuple: ClassVar[bool] = False
    layer_args: ClassVar[tuple] = ()
    dispatched: ClassVar[dict] = {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec.name!r})"

    # ---- which checkpoints ----------------------------------------------------------------------------------------
    def claims(self, raw_config: dict) -> bool:
        """Whether a config.json is this architecture's (its model_type; an adapter whose model_type another format
        shares looks further)."""
        return raw_config.get("model_type") in self.model_types

    def conv_size(self, text_config) -> int:
        """The short convolution's kernel (1 without one): write_block_conv_tail widens spans by it - 1."""
        return int(getattr(text_config, self.conv_kernel_key)) if self.short_conv else 1

    def layer_types(self, text_config) -> list:
        """Each decoder layer's kind, as transformers' config names it ("linear_attention", ...)."""
        return list(text_config.layer_types)

    def decoder_layers(self, text_model):
        """The text model's nn.ModuleList of decoder layers (the bridge puts its blocks in their places)."""
        return text_model.layers

    def cap_logits(self, hf_model, logits):
        """What transformers' forward does to the LM head's output after any multiplier (xLSTM: a soft cap)."""
        return logits

    # ---- the blocks -----------------------------------------------------------------------------------------------
    def is_recurrent_type(self, layer_type: str) -> bool:
        return layer_type == "linear_attention"

    def wrap_mixer(self, layer, path: str) -> None:
        """Replaces the recurrent module at `path` (inside the decoder layer) by the spec's bridged mixer over it."""
        owner, _, name = path.rpartition(".")
        owner = layer.get_submodule(owner) if owner else layer
        setattr(owner, name, self.spec.mixer_class(getattr(owner, name)))

    def make_block(self, layer, layer_type: str):
        """The BridgeBlock over transformers' decoder layer `layer` of type `layer_type`: its recurrent mixer swapped
        for the bridged one, or its attention given the hook points."""
        from recurscope.interp.bridge.blocks import BridgeBlock
        from recurscope.interp.bridge.mixers import add_attention_hooks

        recurrent = self.is_recurrent_type(layer_type)
        mlp_only = layer_type in self.mlp_block_types
        if recurrent:
            self.wrap_mixer(layer, self.linear_attr)
        elif not mlp_only:
            add_attention_hooks(layer.get_submodule(self.attention_attr))
        block = BridgeBlock(layer, self.linear_attr if recurrent else self.attention_attr, recurrent,
                            "pre" if recurrent else self.attention_norm, self.mixer_norm_attr, mlp_only, self.mlp_attr,
                            self.mlp_norm_attr, type(self).mlp_fn, None, self.layer_args)
        block.returns_tuple = self.layer_returns_tuple
        return block

    # ---- the layer-by-layer protocol --------------------------------------------------------------------------------
    def run_layer(self, model, layer: int, resid: torch.Tensor, layer_cache, context) -> torch.Tensor:
        """One layer of the protocol's layer-by-layer run (BridgedLM.run_layer)."""
        return model.run_block(layer, resid, layer_cache, context)

    # ---- transformers' cache object ---------------------------------------------------------------------------------
    def new_hf_cache(self, hf_config):
        from transformers import DynamicCache

        return DynamicCache(config=hf_config)

    def layer_view(self, layer_cache, seen: int, new_kv_only: bool = False) -> LayerView:
        return LayerView(layer_cache, seen, new_kv_only=new_kv_only, state_transposed=self.state_transposed)

    def to_hf_cache(self, blocks, cache, hf_config):
        """transformers' cache object holding a RecurrentCache's states, conv tails and K/V (copies: transformers
        updates its cache in place); an empty one when `cache` is None."""
        hf_cache = self.new_hf_cache(hf_config)
        if cache is None:
            return hf_cache
        if len(cache.layers) != len(blocks):
            raise ValueError(f"the cache has {len(cache.layers)} layers but the model has {len(blocks)}")
        for i, lc in enumerate(cache.layers):
            layer = hf_cache.layers[i]
            if lc.kind == "none":   # an MLP-only block: transformers keeps no cache layer content for it
                continue
            if lc.kind in ("recurrent", "hybrid"):   # "hybrid": a parallel block's state, conv tail and K/V
                for key, conv in lc.conv.items():
                    idx = int(key)
                    layer.conv_states[idx] = conv.clone()
                    layer.conv_kernel_size[idx] = conv.shape[-1]
                    layer.is_conv_states_initialized[idx] = True
                    layer.has_previous_state[idx] = True
                if lc.state is not None:
                    state = lc.state.transpose(-1, -2) if self.state_transposed else lc.state
                    layer.recurrent_states[0] = state.contiguous().clone()
                    layer.is_recurrent_states_initialized[0] = True
                    layer.has_previous_state[0] = True
                layer.device, layer.dtype = lc.state.device, lc.state.dtype
            if lc.kind != "recurrent" and lc.keys is not None:
                layer.update(lc.keys.transpose(1, 2).contiguous(), lc.values.transpose(1, 2).contiguous())
        return hf_cache

    def from_hf_cache(self, blocks, hf_cache, seen: int):
        """The RecurrentCache of transformers' cache object after a run of `seen` tokens in all."""
        from recurscope.interp.models.cache import LayerCache, RecurrentCache

        layers = []
        for i, block in enumerate(blocks):
            layer = hf_cache.layers[i]
            if block.is_recurrent:
                conv = {str(k): v for k, v in layer.conv_states.items() if v is not None}
                state = layer.recurrent_states[0]
                if self.state_transposed and state is not None:
                    state = state.transpose(-1, -2)
                hybrid = block.attn_attr is not None   # Falcon-H1's and Zamba2's: the state and the attention's K/V
                kv = {} if not hybrid or layer.keys is None else \
                    dict(keys=layer.keys.transpose(1, 2), values=layer.values.transpose(1, 2))
                layers.append(LayerCache("hybrid" if hybrid else "recurrent", state=state, conv=conv, **kv))
            elif block.mlp_only:
                layers.append(LayerCache("none"))
            else:
                layers.append(LayerCache("attention", keys=layer.keys.transpose(1, 2),
                                         values=layer.values.transpose(1, 2)))
        return RecurrentCache(layers, seen)


class MambaHybridAdapter(BridgeAdapter):
    """The Mamba-2 hybrids whose decoder layers keep the Mamba-2 mixer as `mamba` (Bamba, Granite-4.0-H, Falcon-H1,
    Zamba2): transformers' cache keeps each head's state transposed, N x P."""
    linear_attr = "mamba"
    conv_kernel_key = "mamba_d_conv"
    state_transposed = True
