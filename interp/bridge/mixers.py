"""Linear-attention layers of transformers' models, with the recurrence routed through `kernels.recurrence` and the
project's hook points. Each bridged layer adopts the transformers layer's own submodules and parameters under their
own names (so weights, `state_dict` and `save_pretrained` are unchanged) and reads and writes transformers' own
cache object exactly as the transformers layer does; only the kernel call differs.
"""
from __future__ import annotations

import importlib
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from transformer_lens.hook_points import HookPoint

from recurscope.interp.models.mixers import RecurrentMixer


def _adopt(target: torch.nn.Module, source: torch.nn.Module) -> None:
    """Registers `source`'s children and direct parameters on `target` under the same names."""
    for name, child in source.named_children():
        setattr(target, name, child)
    for name, param in source.named_parameters(recurse=False):
        setattr(target, name, param)
    for name, buf in source.named_buffers(recurse=False):
        target.register_buffer(name, buf)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # x / sqrt(|x|^2 + eps), in float32, as transformers' (and fla's) gated delta rule normalises q and k
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class BridgedGatedDeltaNet(RecurrentMixer):
    """transformers' Gated DeltaNet layer (Qwen3.5, Qwen3.5-MoE): in_proj_qkv -> causal conv + SiLU -> q, k, v;
    beta = sigmoid(in_proj_b), g = -exp(A_log) softplus(in_proj_a + dt_bias) per value head; q, k L2-normalised and
    repeated over the value heads; kernel inputs x = beta v, a = beta k, scale = head_k_dim^-1/2; then the gated
    RMSNorm with z = in_proj_z and out_proj."""

    def __init__(self, hf_layer: torch.nn.Module):
        super().__init__()
        _adopt(self, hf_layer)
        for attr in ("num_v_heads", "num_k_heads", "head_k_dim", "head_v_dim", "key_dim", "value_dim",
                     "conv_kernel_size", "layer_idx", "activation", "hidden_size"):
            setattr(self, attr, getattr(hf_layer, attr))
        self.head_k, self.head_v = self.head_k_dim, self.head_v_dim
        self.modeling = importlib.import_module(type(hf_layer).__module__)   # its causal conv functions
        self.state_positions: Optional[Sequence[int]] = None                  # set by the bridge for one call

    # transformers' conv with its cache: the cache keeps the last conv_kernel_size inputs of the layer
    def _conv(self, mixed: torch.Tensor, cache) -> torch.Tensor:
        T = mixed.shape[-1]
        if cache is not None:
            mixed = cache.update_conv_state(mixed, self.layer_idx, conv_kernel_size=self.conv_kernel_size)
        out = self.modeling.causal_conv1d_fn(mixed, self.conv1d.weight.squeeze(1), self.conv1d.bias,
                                             activation=self.activation)
        return out[:, :, -T:]

    def _project(self, h: torch.Tensor, cache):
        B, T, _ = h.shape
        mixed = self._conv(self.in_proj_qkv(h).transpose(1, 2), cache).transpose(1, 2)
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(B, T, -1, self.head_k_dim)
        k = k.reshape(B, T, -1, self.head_k_dim)
        v = v.reshape(B, T, -1, self.head_v_dim)
        z = self.in_proj_z(h).reshape(B, T, -1, self.head_v_dim)
        beta = self.in_proj_b(h).sigmoid()
        acc = torch.promote_types(h.dtype, torch.float32)
        g = -self.A_log.to(acc).exp() * F.softplus(self.in_proj_a(h).to(acc) + self.dt_bias)
        return q, k, v, beta, g, z

    def forward(self, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs):
        if attention_mask is not None:   # transformers zeroes padded positions before the layer
            hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
        init = None if cache is None else cache.get_recurrent_state(self.layer_idx)
        q, k, v, beta, g, z = self._project(hidden_states, cache)
        acc = torch.promote_types(hidden_states.dtype, torch.float32)   # float32, as transformers, or float64
        groups = self.num_v_heads // self.num_k_heads
        q, k = _l2norm(q.to(acc)), _l2norm(k.to(acc))
        if groups > 1:   # each key head serves `groups` consecutive value heads
            q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
        q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v.to(acc))
        g = self.hook_decay(g.to(acc))
        b = beta.to(acc)[..., None]
        a = self.hook_erase(b * k)
        o, S = self._recur(q, k, b * v, g, a, None if init is None else init.to(acc), self.state_positions,
                           self.head_k_dim ** -0.5)
        if cache is not None:
            cache.update_recurrent_state(S.to(init.dtype if init is not None else S.dtype), self.layer_idx)
        o = self.hook_head_out(o.to(hidden_states.dtype))
        B, T = hidden_states.shape[:2]
        zz = self.hook_z(self.norm(o.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
                         .reshape(B, T, -1, self.head_v_dim))
        return self.out_proj(zz.reshape(B, T, -1))


# ---------------------------------------------------------------------------------------------------------------
# Attention: transformers' attention module, with recurscope's eager attention function and its hook points
# ---------------------------------------------------------------------------------------------------------------

ATTENTION_NAME = "recurscope"


def add_attention_hooks(attn: torch.nn.Module) -> None:
    attn.hook_q = HookPoint()          # (B, T, H, D) after norm and RoPE
    attn.hook_k = HookPoint()          # (B, S, Hkv, D) every cached and new key after RoPE
    attn.hook_v = HookPoint()          # (B, S, Hkv, D)
    attn.hook_pattern = HookPoint()    # (B, H, T, S) softmax weights
    attn.hook_head_out = HookPoint()   # (B, T, H, D) per-head output (before any output gate and o_proj)


def hooked_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Softmax attention with recurscope's hook points, in the signature of transformers' attention interface:
    query (B, H, T, D), key/value (B, Hkv, S, D) -> (output (B, T, H, D), weights (B, H, T, S))."""
    q = module.hook_q(query.transpose(1, 2))
    k = module.hook_k(key.transpose(1, 2))
    v = module.hook_v(value.transpose(1, 2))
    H, Hkv = q.shape[2], k.shape[2]
    if H != Hkv:
        k, v = k.repeat_interleave(H // Hkv, dim=2), v.repeat_interleave(H // Hkv, dim=2)
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.einsum("bthd,bshd->bhts", q, k) * scale
    if attention_mask is not None:
        mask = attention_mask[:, :, :, : k.shape[1]]
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    pattern = module.hook_pattern(torch.softmax(scores.float(), dim=-1).to(q.dtype))
    out = module.hook_head_out(torch.einsum("bhts,bshd->bthd", pattern, v))
    return out.contiguous(), pattern


def register_attention() -> None:
    """Makes `attn_implementation="recurscope"` known to transformers (eager-style masks)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ATTENTION_NAME, hooked_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, eager_mask)
