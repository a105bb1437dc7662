"""MiniMax-Text-01 (transformers' `MiniMaxForCausalLM`): lightning attention layers, linear attention with a fixed
per-head decay, interleaved with softmax attention (GQA, RoPE); a sparse MoE in every layer; a residual stream that
each layer normalises first (`MiniMaxBlock`).

Lightning attention per head h (transformers' `MiniMaxLightningAttention`, its block-wise form and its decode step
alike):

    q, k, v = silu(qkv_proj(x)) split per head,    S_t = exp(-s_h) S_{t-1} + k_t v_t^T,    o_t = S_t^T q_t

with s_h the layer's slope (`slope_rate`, fixed by the head and the depth, not learned); then an RMSNorm over all
heads together (`norm`), times sigmoid(output_gate(x)), then out_proj. It is the kernel's recurrence with g = -s_h at
every step, a = 0 (no erase), x = v and scale 1: an exact fit, with no short convolution.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from recurscope.interp.bridge.adapters.base import TRANSFORMERS_WEIGHTS, BridgeAdapter, LayerView
from recurscope.interp.bridge.blocks import BridgeBlock
from recurscope.interp.bridge.mixers import _adopt
from recurscope.interp.models.families import FamilySpec
from recurscope.interp.models.mixers import RecurrentMixer

SPEC = FamilySpec(
    name="minimax", title="MiniMax-Text-01: lightning attention (fixed per-head decay) + softmax attention, MoE "
                          "(transformers)",
    weights=TRANSFORMERS_WEIGHTS,
    config_keys=frozenset({"layer_types", "head_dim", "block_size", "full_attn_alpha_factor", "full_attn_beta_factor",
                           "linear_attn_alpha_factor", "linear_attn_beta_factor", "mlp_alpha_factor",
                           "mlp_beta_factor"}),
    kernel_inputs={"q": "silu(qkv_proj)[q part], per head", "k": "silu(qkv_proj)[k part], per head",
                   "x": "v = silu(qkv_proj)[v part]",
                   "g": "-slope_rate per head, the same at every step (base^(h+1) times a factor falling with depth)",
                   "a": "none (no erase)"},
    mixer="BridgedLightningAttention", mixer_module=__name__,
    state_shape=lambda cfg: (_head_dim(cfg),) * 2, state_heads=lambda cfg: cfg.num_attention_heads,
    absent_hooks=frozenset({"hook_erase", "hook_erase_gate"}),
)


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class BridgedLightningAttention(RecurrentMixer):
    """transformers' `MiniMaxLightningAttention` with its recurrence through `kernels.recurrence`: q, k, v from
    silu(qkv_proj(x)) (padded positions zeroed, as transformers), g = -slope_rate per head, no erase, scale 1. Its
    state is (head_dim, head_dim) per head, key side first, as transformers' `MiniMaxCache.linear_cache` keeps it.
    hook_head_out is S_t^T q_t; hook_z is sigmoid(output_gate(x)) times `norm` of all heads' readouts together
    (one RMSNorm over H * head_dim), per head; then out_proj."""

    readout_scale = 1.0
    norm_attr, out_attr = "norm", "out_proj"

    def __init__(self, hf_layer: torch.nn.Module):
        super().__init__(hf_layer.layer_idx)
        del self.hook_erase                  # no erase term
        _adopt(self, hf_layer)
        self.layer_idx, self.act_fn = hf_layer.layer_idx, hf_layer.act_fn
        self.num_heads, self.head_dim = hf_layer.num_attention_heads, hf_layer.head_dim
        self.head_k = self.head_v = self.head_dim
        self.state_positions: Optional[Sequence[int]] = None   # set by the bridge for one call

    def forward(self, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs):
        B, T, _ = hidden_states.shape
        qkv = self.act_fn(self.qkv_proj(hidden_states))
        if attention_mask is not None and attention_mask.dim() == 2:   # transformers zeroes padded positions
            qkv = (qkv * attention_mask[:, :, None]).to(qkv.dtype)
        acc = torch.promote_types(hidden_states.dtype, torch.float32)
        q, k, v = qkv.reshape(B, T, self.num_heads, 3 * self.head_dim).to(acc).split(self.head_dim, dim=-1)
        q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)
        g = self.hook_decay(-self.slope_rate.reshape(1, 1, self.num_heads).to(acc).expand(B, T, self.num_heads))
        init = None if cache is None else cache.get_linear_cache(self.layer_idx)
        if isinstance(init, list):   # transformers' placeholder for a layer without a state yet
            init = None
        o, S = self._recur(q, k, v, g, None, None if init is None else init.to(acc), self.state_positions,
                           self.readout_scale)
        if cache is not None and S is not None:   # None when keep_final_state is off (the scan's suffix rows)
            cache.set_linear_cache(self.layer_idx, S.to(init.dtype if init is not None else hidden_states.dtype))
        o = self.hook_head_out(o.to(hidden_states.dtype))
        z = torch.sigmoid(self.output_gate(hidden_states)) * self.norm(o.reshape(B, T, -1))
        z = self.hook_z(z.reshape(B, T, self.num_heads, self.head_dim))
        return self.out_proj(z.reshape(B, T, -1))


class MiniMaxBlock(BridgeBlock):
    """MiniMax's decoder layer: the residual stream is normalised first and the normed stream carried on,

        h = input_layernorm(x),  m = h * alpha + mixer(h) * beta,  y = p * mlp_alpha + mlp(p) * mlp_beta,
        p = post_attention_layernorm(m)

    with (alpha, beta) the layer kind's factors (linear_attn_* or full_attn_*). hook_resid_pre is x, hook_mixer_out
    the mixer's output times beta, hook_resid_mid is m, hook_mlp_out the MoE's output times mlp_beta, hook_resid_post
    y. The mixer's output is normed after out_proj (post_attention_layernorm), so the block reads as post-norm
    (`norm_layout`), and attribution's candidate direction, which follows pre-norm blocks, is refused here."""

    def __init__(self, hf_layer, *args, **kwargs):
        super().__init__(hf_layer, *args, **kwargs)
        self.attn_alpha, self.attn_beta = float(hf_layer.attn_alpha_factor), float(hf_layer.attn_beta_factor)
        self.mlp_alpha, self.mlp_beta = float(hf_layer.mlp_alpha_factor), float(hf_layer.mlp_beta_factor)

    @property
    def mixer_output_scale(self) -> float:
        return self.attn_beta

    def residual_update(self, resid, attention_mask, position_ids, cache, position_embeddings, kwargs):
        h = self.input_layernorm(resid)
        if self.is_recurrent:
            mixed = self.mixer(h, cache=cache, attention_mask=attention_mask)
        else:
            mixed, _ = self.mixer(hidden_states=h, attention_mask=attention_mask, position_ids=position_ids,
                                  cache=cache, position_embeddings=position_embeddings)
        mid = self.hook_resid_mid(h * self.attn_alpha + self.hook_mixer_out(mixed * self.attn_beta))
        p = self.post_attention_layernorm(mid)
        return self.hook_resid_post(p * self.mlp_alpha + self.hook_mlp_out(self.mlp(p) * self.mlp_beta))


class _LinearCacheView(LayerView):
    """A LayerView that also serves MiniMaxCache's linear-attention state (read only, as LayerView)."""

    def get_linear_cache(self, layer_idx: int):
        return self.lc.state

    def set_linear_cache(self, layer_idx: int, linear_cache) -> None:
        pass


class MiniMaxAdapter(BridgeAdapter):
    spec = SPEC
    order = 110
    model_types = ("minimax",)
    linear_attr = attention_attr = "self_attn"
    short_conv = False
    dispatched = {}   # transformers' lightning attention and softmax attention are plain torch

    def make_block(self, layer, layer_type: str):
        from recurscope.interp.bridge.mixers import add_attention_hooks

        recurrent = self.is_recurrent_type(layer_type)
        if recurrent:
            self.wrap_mixer(layer, self.linear_attr)
        else:
            add_attention_hooks(layer.self_attn)
        return MiniMaxBlock(layer, "self_attn", recurrent, "post")

    def new_hf_cache(self, hf_config):
        """A MiniMaxCache with one layer per decoder layer of its kind. transformers' own starts empty and adds plain
        attention layers as they are written, so its mask functions take layer 0's length for the cached length
        (0 when layer 0 is a lightning layer), which misplaces a multi-token run after a prefix; here the first
        attention layer is the first one that is not linear, as transformers' find_first_full_attention_index wants."""
        from transformers.cache_utils import DynamicLayer, LinearAttentionLayer
        from transformers.models.minimax.modeling_minimax import MiniMaxCache

        hf_cache = MiniMaxCache()
        kinds = hf_config.layer_types
        hf_cache.layers = [LinearAttentionLayer() if kind == "linear_attention" else DynamicLayer() for kind in kinds]
        hf_cache.linear_cache = [[] for _ in kinds]   # transformers' placeholder for a layer without a state yet
        return hf_cache

    def layer_view(self, layer_cache, seen: int, new_kv_only: bool = False) -> LayerView:
        return _LinearCacheView(layer_cache, seen, new_kv_only=new_kv_only)

    def to_hf_cache(self, blocks, cache, hf_config):
        hf_cache = self.new_hf_cache(hf_config)
        if cache is None:
            return hf_cache
        if len(cache.layers) != len(blocks):
            raise ValueError(f"the cache has {len(cache.layers)} layers but the model has {len(blocks)}")
        for i, lc in enumerate(cache.layers):
            if lc.kind == "recurrent" and lc.state is not None:
                hf_cache.set_linear_cache(i, lc.state.contiguous().clone())
            elif lc.kind == "attention" and lc.keys is not None:
                hf_cache.update(lc.keys.transpose(1, 2).contiguous(), lc.values.transpose(1, 2).contiguous(), i)
        return hf_cache

    def from_hf_cache(self, blocks, hf_cache, seen: int):
        from recurscope.interp.models.cache import LayerCache, RecurrentCache

        layers = []
        for i, block in enumerate(blocks):
            if block.is_recurrent:
                state = hf_cache.linear_cache[i]
                layers.append(LayerCache("recurrent", state=None if isinstance(state, list) else state, conv={}))
            else:
                layer = hf_cache.layers[i]
                layers.append(LayerCache("attention", keys=layer.keys.transpose(1, 2),
                                         values=layer.values.transpose(1, 2)))
        return RecurrentCache(layers, seen)


ADAPTER = MiniMaxAdapter()
