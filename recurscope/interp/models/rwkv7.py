"""RWKV-7 ("Goose") with fla 0.6.0's math and parameter names (`RWKV7Attention`, `RWKV7FeedForward`, `RWKV7Block`).

Per head, with r, w, k, v, kk, iclr from the token-shifted LoRA projections:

    S_t = (Diag(w_t) - (kk_t * iclr_t) kk_t^T) S_{t-1} + k_t v_t^T,    o_t = S_t^T r_t

which is `kernels.recurrence_low_rank` with q = r, g = log w = -0.6065 sigmoid(w_lora) (per channel), a = kk (the
read direction, kappa-hat), b = kk * iclr (the erase direction), write k x^T with k = k_proj * (1 + (iclr - 1) k_a)
and x = v, scale 1. fla's own ops take a = -kk, b = kk * iclr (kernels.low_rank documents the sign).

Beyond the recurrence: every projection reads the token shift x_t + (x_{t-1} - x_t) * mu (the cache holds the
last token of each layer's mixer and feed-forward inputs, conv["attn"] and conv["ffn"]); layers after the first
mix their values with the first layer's (the value-first residual, v = lerp(v, v_first, sigmoid(v_lora))); the
readout is a per-head group norm, plus the bonus (r * k * r_k).sum() v, times the output gate g_lora.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformer_lens.hook_points import HookPoint

from recurscope.interp.models.cache import LayerCache
from recurscope.interp.models.config import ModelConfig
from recurscope.interp.models.mixers import RecurrentMixer, _split_heads

#: RWKV-7's decay bound: log w = -exp(-0.5) sigmoid(.) lies in (-0.6065, 0).
LOG_DECAY_BOUND = 0.6065306597126334


def token_shift(x: torch.Tensor, tail: Optional[torch.Tensor]):
    """(x_{t-1} - x_t, the new tail): x (B, T, D), tail (B, 1, D) the previous call's last token (zeros at start)."""
    prev = x.new_zeros(x.shape[0], 1, x.shape[2]) if tail is None else tail.to(x.dtype)
    shifted = torch.cat([prev, x[:, :-1]], dim=1)
    return shifted - x, x[:, -1:]


class _LoRA(nn.Module):
    """fla's LoRA (names `lora.0`, `lora.2` kept): Linear, activation, Linear."""

    def __init__(self, d_in: int, d_out: int, rank: int, act: Optional[nn.Module], bias: bool = True):
        super().__init__()
        self.lora = nn.Sequential(nn.Linear(d_in, rank, bias=False), act if act is not None else nn.Identity(),
                                  nn.Linear(rank, d_out, bias=bias))

    def forward(self, x):
        return self.lora(x)


def value_dim_of(cfg: ModelConfig, layer: int) -> int:
    vd = cfg.value_dim
    if vd is None:
        return cfg.hidden_size
    return int(vd[layer]) if isinstance(vd, (list, tuple)) else int(vd)


class RWKV7Mixer(RecurrentMixer):
    """RWKV-7's time mix. Hooks: hook_q = r, hook_k = the written key k, hook_v = the written value (after the
    value-first mix), hook_decay = log w (B, T, H, K), hook_erase = kk (the erase's read direction, unit norm per
    head), hook_erase_gate = iclr (the in-context learning rate, b = kk * iclr). The write is k v^T (the paper's
    v kappa^T in the V x K orientation), so hook_write_scale = 0 on a span zeroes the fact's write there."""

    readout_scale = 1.0
    low_rank_transition = True

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__(layer)
        self.hook_erase_gate = HookPoint()   # iclr: (B, T, H, K)
        d = cfg.hidden_size
        self.head_dim = cfg.head_dim
        self.num_heads = d // cfg.head_dim
        self.value_dim = value_dim_of(cfg, layer)
        self.head_v = self.value_dim // self.num_heads
        self.head_k = self.head_dim
        for name in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"):
            setattr(self, name, nn.Parameter(torch.zeros(1, 1, d)))
        self.k_k = nn.Parameter(torch.full((d,), 0.85))
        self.k_a = nn.Parameter(torch.ones(d))
        self.r_k = nn.Parameter(torch.full((self.num_heads, self.head_dim), -0.04))
        self.r_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, self.value_dim, bias=False)
        self.o_proj = nn.Linear(self.value_dim, d, bias=False)
        self.w_lora = _LoRA(d, d, cfg.decay_low_rank_dim, nn.Tanh())
        if layer != 0:
            self.v_lora = _LoRA(d, self.value_dim, cfg.v_low_rank_dim, None)
        self.a_lora = _LoRA(d, d, cfg.a_low_rank_dim, None)
        self.g_lora = _LoRA(d, self.value_dim, cfg.gate_low_rank_dim, nn.Sigmoid(), bias=False)
        self.g_norm = nn.GroupNorm(self.num_heads, self.value_dim, eps=self.head_dim * cfg.norm_eps,
                                   affine=cfg.elementwise_affine)

    def forward(self, h, layer_cache: Optional[LayerCache] = None, state_positions=None,
                v_first: Optional[torch.Tensor] = None):
        """-> (out, LayerCache, v_first): layer 0 returns its values as v_first; later layers need it."""
        if self.layer != 0 and v_first is None:
            raise ValueError(f"RWKV-7 layer {self.layer} needs the first layer's values (v_first); run the model "
                             "from layer 0 (model(tokens)), not one layer alone")
        tail = None if layer_cache is None else layer_cache.conv.get("attn")
        delta, new_tail = token_shift(h, tail)
        xr, xw, xk, xv, xa, xg = (h + delta * m for m in (self.x_r, self.x_w, self.x_k, self.x_v, self.x_a, self.x_g))
        r = self.r_proj(xr)
        logw = -LOG_DECAY_BOUND * torch.sigmoid(self.w_lora(xw))
        k = self.k_proj(xk)
        v = self.v_proj(xv)
        if self.layer == 0:
            v_first = v
        else:
            v = torch.lerp(v, v_first, torch.sigmoid(self.v_lora(xv)))
        iclr = torch.sigmoid(self.a_lora(xa))
        gate = self.g_lora(xg)
        kk = F.normalize(_split_heads(k * self.k_k, self.head_dim), dim=-1, p=2.0)
        k = k * (1 + (iclr - 1) * self.k_a)
        q = self.hook_q(_split_heads(r, self.head_dim))
        k = self.hook_k(_split_heads(k, self.head_dim))
        v = self.hook_v(_split_heads(v, self.head_v))
        g = self.hook_decay(_split_heads(logw, self.head_dim))
        iclr = self.hook_erase_gate(_split_heads(iclr, self.head_dim))
        kk = self.hook_erase(kk)
        init = None if layer_cache is None else layer_cache.state
        o, S = self._recur(q, k, v, g, kk, init, state_positions, self.readout_scale, b=kk * iclr)
        o = self.hook_head_out(o.to(h.dtype))
        B, T = o.shape[:2]
        normed = self.g_norm(o.reshape(B * T, -1)).view(B, T, self.num_heads, self.head_v)
        bonus = (q * k * self.r_k).sum(-1, keepdim=True) * v          # the "bonus" of the current token
        z = self.hook_z((normed + bonus) * _split_heads(gate, self.head_v))
        out = self.o_proj(z.reshape(B, T, -1))
        return out, LayerCache("recurrent", state=S, conv={"attn": new_tail}), v_first


class RWKV7FeedForward(nn.Module):
    """fla's RWKV7FeedForward: value(sqrelu(key(x + (x_{t-1} - x_t) * x_k)))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.hidden_size
        if cfg.intermediate_size is not None:
            inter = int(cfg.intermediate_size)
        else:
            inter = int(d * (4 if cfg.hidden_ratio is None else cfg.hidden_ratio))
            inter = 32 * ((inter + 31) // 32)
        self.x_k = nn.Parameter(torch.zeros(d))
        self.key = nn.Linear(d, inter, bias=False)
        self.value = nn.Linear(inter, d, bias=False)

    def forward(self, x, tail=None):
        delta, new_tail = token_shift(x, tail)
        return self.value(F.relu(self.key(x + delta * self.x_k)).square()), new_tail


class RWKV7Block(nn.Module):
    """fla's RWKV7Block: (layer 0: pre_norm), LayerNorm, time mix, residual, LayerNorm, feed-forward, residual.
    hook_resid_pre reads the residual after layer 0's pre_norm (the stream every later block adds to)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        d = cfg.hidden_size
        norm = lambda: nn.LayerNorm(d, eps=cfg.norm_eps, bias=cfg.norm_bias)  # noqa: E731
        if cfg.norm_first and layer == 0:
            self.pre_norm = norm()
        self.attn_norm = norm()
        self.mixer = RWKV7Mixer(cfg, layer)
        self.ffn_norm = norm()
        self.ffn = RWKV7FeedForward(cfg)
        self.hook_resid_pre = HookPoint()
        self.hook_mixer_out = HookPoint()
        self.hook_resid_mid = HookPoint()
        self.hook_mlp_out = HookPoint()
        self.hook_resid_post = HookPoint()

    is_recurrent = True

    def forward(self, resid, layer_cache=None, state_positions=None, offset=0, carry: Optional[dict] = None):
        """carry: the dict one forward passes through its blocks; layer 0 puts v_first there, later layers read it."""
        if hasattr(self, "pre_norm"):
            resid = self.pre_norm(resid)
        resid = self.hook_resid_pre(resid)
        v_first = None if carry is None else carry.get("v_first")
        mixed, cache, v_first = self.mixer(self.attn_norm(resid), layer_cache, state_positions, v_first)
        if carry is not None:
            carry["v_first"] = v_first
        resid = self.hook_resid_mid(resid + self.hook_mixer_out(mixed))
        tail = None if layer_cache is None else layer_cache.conv.get("ffn")
        ffn_out, cache.conv["ffn"] = self.ffn(self.ffn_norm(resid), tail)
        resid = self.hook_resid_post(resid + self.hook_mlp_out(ffn_out))
        return resid, cache

    def run_alone(self, resid, layer_cache, offset=0):
        """One layer of the layer-by-layer protocol (RecurrentLM.run_layer): the residual between layers carries
        v_first in its trailing value_dim channels (layer 0 takes the bare embedding and appends its values), so
        that rows regrouped between layers (the head scan's growing batch) keep their own v_first."""
        d = self.mixer.o_proj.out_features
        carry = {} if self.layer == 0 else {"v_first": resid[..., d:]}
        out, _ = self(resid if self.layer == 0 else resid[..., :d], layer_cache, None, offset, carry)
        return torch.cat([out, carry["v_first"]], dim=-1)
