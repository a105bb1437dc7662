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

from recurscope.hooks.points import is_intercepted
from recurscope.kernels import l2_normalise
from recurscope.interp.models.mixers import (RecurrentMixer, _repeat_heads, _split_heads, grouped_scores,
                                              grouped_values)


def _adopt(target: torch.nn.Module, source: torch.nn.Module) -> None:
    """Registers `source`'s children and direct parameters on `target` under the same names."""
    for name, child in source.named_children():
        setattr(target, name, child)
    for name, param in source.named_parameters(recurse=False):
        setattr(target, name, param)
    for name, buf in source.named_buffers(recurse=False):   # non-persistent ones (Falcon-H1's mup_vector) stay so
        target.register_buffer(name, buf, persistent=name not in source._non_persistent_buffers_set)


def _packed_conv(mixer, mixed: torch.Tensor, cache) -> torch.Tensor:
    """transformers' causal conv over packed sequences (mixer.cu_seqlens; mixed (1, C, T)): each sequence convolved
    from zeros, as alone; the cache gets each sequence's last conv_kernel_size inputs, (n, C, W), as transformers
    keeps them after a prefill."""
    from recurscope.interp.models.layers import packed_conv

    if mixer.activation not in (None, "silu", "swish"):
        raise ValueError(f"packed sequences: the conv activation {mixer.activation!r} is not supported")
    y, tails = packed_conv(mixed.transpose(1, 2), mixer.conv1d.weight[:, 0], mixer.conv1d.bias, mixer.cu_seqlens,
                           mixer.conv_kernel_size, activation=mixer.activation is not None)
    if cache is not None:
        cache.update_conv_state(tails.transpose(1, 2).contiguous(), mixer.layer_idx,
                                conv_kernel_size=mixer.conv_kernel_size)
    return y.transpose(1, 2)



def _function(fn):
    """transformers' function itself. With Hugging Face's `kernels` installed, transformers wraps its kernel-hub
    functions (causal_conv1d_fn, ...) in a module-level nn.Module; calling its forward keeps the same dispatch but is
    no layer call, so module hooks such as FlopCounterMode's tracker do not register gradient hooks on it."""
    return fn.forward if isinstance(fn, torch.nn.Module) else fn

class BridgedDeltaRule(RecurrentMixer):
    """A transformers (gated) delta-rule layer with the recurrence through `kernels.recurrence`. The shared part:
    the causal conv with transformers' cache, the L2-normalised q and k repeated over the value heads, the kernel
    inputs x = beta v, a = beta k, scale = head_k_dim^-1/2, the hooks, the cache update and the gated output norm.
    A family says how its projections give (q, k, v, beta, g, gate) (`_project`) and names its output norm and
    projection (`norm_attr`, `out_attr`)."""

    copied = ("num_v_heads", "num_k_heads", "head_k_dim", "head_v_dim", "key_dim", "value_dim", "conv_kernel_size",
              "layer_idx", "activation", "hidden_size")
    norm_attr, out_attr = "norm", "out_proj"
    state_dtype: Optional[torch.dtype] = None   # the dtype transformers stores the state in (None: the initial one)

    def __init__(self, hf_layer: torch.nn.Module):
        super().__init__(hf_layer.layer_idx)
        _adopt(self, hf_layer)
        self._dimensions(hf_layer)
        self.head_k, self.head_v = self.head_k_dim, self.head_v_dim
        self.modeling = importlib.import_module(type(hf_layer).__module__)   # its causal conv functions
        self.state_positions: Optional[Sequence[int]] = None                  # set by the bridge for one call

    def _dimensions(self, hf_layer) -> None:
        for attr in self.copied:
            setattr(self, attr, getattr(hf_layer, attr))

    # transformers' conv with its cache: the cache keeps the last conv_kernel_size inputs of the layer
    def _conv(self, mixed: torch.Tensor, cache) -> torch.Tensor:
        if self.cu_seqlens is not None:
            return _packed_conv(self, mixed, cache)
        T = mixed.shape[-1]
        if cache is not None:
            mixed = cache.update_conv_state(mixed, self.layer_idx, conv_kernel_size=self.conv_kernel_size)
        out = _function(self.modeling.causal_conv1d_fn)(mixed, self.conv1d.weight.squeeze(1), self.conv1d.bias,
                                             activation=self.activation)
        return out[:, :, -T:]

    def _conv_qkv(self, mixed: torch.Tensor, cache):
        """(B, T, 2 key_dim + value_dim) -> q, k (B, T, Hk, K) and v (B, T, Hv, V) after the conv and activation."""
        B, T, _ = mixed.shape
        mixed = self._conv(mixed.transpose(1, 2), cache).transpose(1, 2)
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (q.reshape(B, T, -1, self.head_k_dim), k.reshape(B, T, -1, self.head_k_dim),
                v.reshape(B, T, -1, self.head_v_dim))

    def _project(self, h: torch.Tensor, cache):
        """-> q, k (B, T, Hk, K), v (B, T, Hv, V), beta (B, T, Hv), g (B, T, Hv) or per key channel (B, T, Hv, K),
        gate (B, T, Hv, V)."""
        raise NotImplementedError

    def forward(self, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs):
        if attention_mask is not None:   # transformers zeroes padded positions before the layer
            hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
        init = None if cache is None else cache.get_recurrent_state(self.layer_idx)
        q, k, v, beta, g, gate = self._project(hidden_states, cache)
        acc = torch.promote_types(hidden_states.dtype, torch.float32)   # float32, as transformers, or float64
        groups = self.num_v_heads // self.num_k_heads
        q, k = l2_normalise(q.to(acc)), l2_normalise(k.to(acc))
        # Each key head serves `groups` consecutive value heads. The kernel takes q and k with the key heads (no copy);
        # they are repeated over the value heads only when a hook on them would see them, so that hook_q, hook_k and
        # hook_write_key keep one entry per value head.
        grouped = groups > 1 and not any(is_intercepted(p) for p in (self.hook_q, self.hook_k, self.hook_write_key))
        if groups > 1 and not grouped:
            q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
        q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v.to(acc))
        g = self.hook_decay(g.to(acc))
        b = beta.to(acc)[..., None]
        a = self.hook_erase((b.unflatten(2, (-1, groups)) * k[:, :, :, None]).flatten(2, 3) if grouped else b * k)
        o, S = self._recur(q, k, b * v, g, a, None if init is None else init.to(acc), self.state_positions,
                           self.head_k_dim ** -0.5)
        if cache is not None and S is not None:   # None when keep_final_state is off (the scan's suffix rows)
            keep = self.state_dtype or (init.dtype if init is not None else S.dtype)
            cache.update_recurrent_state(S.to(keep), self.layer_idx)
        o = self.hook_head_out(o.to(hidden_states.dtype))
        B, T = hidden_states.shape[:2]
        norm = getattr(self, self.norm_attr)
        zz = self.hook_z(norm(o.reshape(-1, self.head_v_dim), gate.reshape(-1, self.head_v_dim))
                         .reshape(B, T, -1, self.head_v_dim))
        return getattr(self, self.out_attr)(zz.reshape(B, T, -1))


def _gdn_decay(mixer, a: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """g = -exp(A_log) softplus(a + dt_bias) per value head, in at least float32 (as transformers)."""
    acc = torch.promote_types(like.dtype, torch.float32)
    return -mixer.A_log.to(acc).exp() * F.softplus(a.to(acc) + mixer.dt_bias)


class BridgedGatedDeltaNet(BridgedDeltaRule):
    """transformers' Gated DeltaNet layer of Qwen3.5 (dense, MoE): in_proj_qkv -> causal conv + SiLU -> q, k, v;
    beta = sigmoid(in_proj_b), g = -exp(A_log) softplus(in_proj_a + dt_bias); gate z = in_proj_z; the gated
    RMSNorm `norm`, then out_proj."""

    def _project(self, h, cache):
        B, T, _ = h.shape
        q, k, v = self._conv_qkv(self.in_proj_qkv(h), cache)
        z = self.in_proj_z(h).reshape(B, T, -1, self.head_v_dim)
        return q, k, v, self.in_proj_b(h).sigmoid(), _gdn_decay(self, self.in_proj_a(h), h), z


class BridgedQwen3NextGatedDeltaNet(BridgedDeltaRule):
    """Qwen3-Next's Gated DeltaNet: the fused in_proj_qkvz and in_proj_ba, interleaved per key head, are split by
    transformers' own `fix_query_key_value_ordering`; the rest is Qwen3.5's layer."""

    def __init__(self, hf_layer):
        super().__init__(hf_layer)
        self._reorder = type(hf_layer).fix_query_key_value_ordering   # transformers' split, called on this layer

    def _project(self, h, cache):
        B, T, _ = h.shape
        q, k, v, z, b, a = self._reorder(self, self.in_proj_qkvz(h), self.in_proj_ba(h))
        q, k, v = self._conv_qkv(torch.cat([t.reshape(B, T, -1) for t in (q, k, v)], dim=-1), cache)
        return q, k, v, b.sigmoid(), _gdn_decay(self, a, h), z


class BridgedOlmoHybridGatedDeltaNet(BridgedDeltaRule):
    """OLMo-hybrid's Gated DeltaNet: separate q/k/v_proj into the conv; beta = sigmoid(b_proj), doubled when
    linear_allow_neg_eigval (beta in [0, 2]); g from a_proj as in Qwen3.5; gate g_proj; output norm o_norm, o_proj."""

    copied = BridgedDeltaRule.copied + ("allow_neg_eigval",)
    norm_attr, out_attr = "o_norm", "o_proj"

    def _project(self, h, cache):
        B, T, _ = h.shape
        q, k, v = self._conv_qkv(torch.cat([self.q_proj(h), self.k_proj(h), self.v_proj(h)], dim=-1), cache)
        beta = self.b_proj(h).sigmoid()
        if self.allow_neg_eigval:
            beta = beta * 2.0
        return q, k, v, beta, _gdn_decay(self, self.a_proj(h), h), self.g_proj(h).reshape(B, T, -1, self.head_v_dim)


class BridgedKimiDeltaAttention(BridgedDeltaRule):
    """Kimi-Linear's KDA layer: q/k/v_proj into the conv, one head size for keys and values; the per-channel decay
    g (B, T, H, K) is transformers' own `forget_gate` module; beta = sigmoid(b_proj); gate g_b_proj(g_a_proj(h)),
    sigmoid inside o_norm; o_proj. transformers keeps its state in float32."""

    copied = ("num_heads", "head_dim", "qkv_dim", "conv_kernel_size", "layer_idx", "activation", "hidden_size")
    norm_attr, out_attr = "o_norm", "o_proj"
    state_dtype = torch.float32

    def _dimensions(self, hf_layer) -> None:
        super()._dimensions(hf_layer)
        self.num_k_heads = self.num_v_heads = hf_layer.num_heads
        self.head_k_dim = self.head_v_dim = hf_layer.head_dim
        self.key_dim = self.value_dim = hf_layer.qkv_dim

    def _project(self, h, cache):
        B, T, _ = h.shape
        q, k, v = self._conv_qkv(torch.cat([self.q_proj(h), self.k_proj(h), self.v_proj(h)], dim=-1), cache)
        gate = self.g_b_proj(self.g_a_proj(h)).reshape(B, T, -1, self.head_v_dim)
        return q, k, v, self.b_proj(h).sigmoid(), self.forget_gate(h), gate


class BridgedMamba2(RecurrentMixer):
    """transformers' Mamba-2 SSD layer (`Mamba2Mixer`): in_proj -> gate z, the conv input (x, B, C) and dt; after
    transformers' causal conv (with its cache) and SiLU, per head h of group h // (H / n_groups):

        S_t = exp(dt_t A_h) S_{t-1} + B_t (dt_t x_t)^T,    y_t = S_t^T C_t + D_h x_t,    out = out_proj(norm(y, z))

    i.e. the kernel with q = C, k = B (repeated over a group's heads, contiguously, as transformers'
    repeat_interleave), x = dt x, g = dt A per head, no erase, scale 1. dt = clamp(softplus(dt + dt_bias),
    time_step_limit). The state is N x P (state_size x head_dim) per head, key side first; transformers' cache keeps
    its transpose (B, H, P, N), which the layer reads and writes as transformers does. hook_head_out is the readout
    S_t^T C_t alone; the D skip is added after it, then the gated group norm `norm` (hook_z), then out_proj."""

    copied = ("num_heads", "head_dim", "ssm_state_size", "n_groups", "intermediate_size", "conv_dim",
              "conv_kernel_size", "layer_idx", "activation", "time_step_limit", "hidden_size")
    norm_attr, out_attr = "norm", "out_proj"
    readout_scale = 1.0

    def __init__(self, hf_layer: torch.nn.Module):
        super().__init__(hf_layer.layer_idx)
        del self.hook_erase                  # no erase term
        _adopt(self, hf_layer)
        for attr in self.copied:
            setattr(self, attr, getattr(hf_layer, attr))
        self.head_k, self.head_v = self.ssm_state_size, self.head_dim
        self.modeling = importlib.import_module(type(hf_layer).__module__)   # its causal conv functions
        self.state_positions: Optional[Sequence[int]] = None

    def _conv(self, mixed: torch.Tensor, cache) -> torch.Tensor:
        if self.cu_seqlens is not None:
            return _packed_conv(self, mixed, cache)
        T = mixed.shape[-1]
        if cache is not None:
            mixed = cache.update_conv_state(mixed, self.layer_idx, conv_kernel_size=self.conv_kernel_size)
        out = _function(self.modeling.causal_conv1d_fn)(mixed, self.conv1d.weight.squeeze(1), self.conv1d.bias,
                                             activation=self.activation)
        return out[:, :, -T:]

    def _in_proj(self, h: torch.Tensor) -> torch.Tensor:
        """The layer's input projection: gate z, the conv input (x, B, C) and dt, concatenated."""
        return self.in_proj(h)

    def _gated_norm(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """(B, T, H P) readout plus D skip, and the gate z -> what goes into out_proj."""
        return self.norm(y, gate)

    def forward(self, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs):
        if attention_mask is not None:   # transformers zeroes padded positions before the layer and after the conv
            hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
        init = None if cache is None else cache.get_recurrent_state(self.layer_idx)   # (B, H, P, N)
        B, T, _ = hidden_states.shape
        gate, xBC, dt = self._in_proj(hidden_states).split([self.intermediate_size, self.conv_dim, self.num_heads],
                                                           dim=-1)
        xBC = self._conv(xBC.transpose(1, 2), cache).transpose(1, 2)
        if attention_mask is not None:
            xBC = (xBC * attention_mask[:, :, None]).to(xBC.dtype)
        xs, Bm, Cm = xBC.split([self.intermediate_size, self.n_groups * self.ssm_state_size,
                                self.n_groups * self.ssm_state_size], dim=-1)
        acc = torch.promote_types(hidden_states.dtype, torch.float32)   # float32, as transformers, or float64
        per_group = self.num_heads // self.n_groups
        q = self.hook_q(_repeat_heads(_split_heads(Cm.to(acc), self.ssm_state_size), per_group))
        k = self.hook_k(_repeat_heads(_split_heads(Bm.to(acc), self.ssm_state_size), per_group))
        v = self.hook_v(_split_heads(xs.to(acc), self.head_dim))
        dt = F.softplus(dt.to(acc) + self.dt_bias.to(acc)).clamp(*self.time_step_limit)           # (B, T, H)
        g = self.hook_decay(dt * -self.A_log.to(acc).exp())
        o, S = self._recur(q, k, dt[..., None] * v, g, None,
                           None if init is None else init.transpose(-1, -2).to(acc), self.state_positions,
                           self.readout_scale)
        if cache is not None and S is not None:   # None when keep_final_state is off (the scan's suffix rows)
            keep = init.dtype if init is not None else S.dtype
            cache.update_recurrent_state(S.transpose(-1, -2).to(keep).contiguous(), self.layer_idx)
        o = self.hook_head_out(o)
        y = o + self.D.to(acc)[:, None] * v                                                      # the D skip
        z = self._gated_norm(y.reshape(B, T, -1), gate.to(acc))
        z = self.hook_z(z.reshape(B, T, self.num_heads, self.head_dim))
        return self.out_proj(z.reshape(B, T, -1).to(hidden_states.dtype))


class BridgedFalconH1Mamba2(BridgedMamba2):
    """Falcon-H1's Mamba-2 layer (`FalconH1Mixer`, the decoder layer's `mamba`): transformers' Mamba-2 with its muP
    multipliers on the input side, in_proj(h * ssm_in_multiplier) * mup_vector (one multiplier per part: gate z, x,
    B, C, dt; `ssm_multipliers`), and, unless `mamba_rms_norm`, no gated norm: the output is (readout + D x) *
    silu(z). The recurrence, the state N x P and the cache are `BridgedMamba2`'s; the layer's ssm_out_multiplier is
    applied by the block (`BridgeBlock`), after out_proj."""

    copied = BridgedMamba2.copied + ("ssm_in_multiplier", "mamba_rms_norm")

    def _in_proj(self, h):
        return self.in_proj(h * self.ssm_in_multiplier) * self.mup_vector

    def _gated_norm(self, y, gate):
        return self.norm(y, gate) if self.mamba_rms_norm else y * F.silu(gate)


# ---------------------------------------------------------------------------------------------------------------
# Attention: transformers' attention module, with recurscope's eager attention function and its hook points
# ---------------------------------------------------------------------------------------------------------------

ATTENTION_NAME = "recurscope"


def add_attention_hooks(attn: torch.nn.Module) -> None:
    attn.shared_kv = None              # cached (K, V), (1, Hkv, P, D), shared by every row of one call (the scan)
    attn.cu_seqlens = None             # packed sequences of one call (BridgedLM.forward sets it around the call)
    attn.hook_q = HookPoint()          # (B, T, H, D) after norm and RoPE
    attn.hook_k = HookPoint()          # (B, S, Hkv, D) every cached and new key after RoPE
    attn.hook_v = HookPoint()          # (B, S, Hkv, D)
    attn.hook_pattern = HookPoint()    # (B, H, T, S) softmax weights
    attn.hook_head_out = HookPoint()   # (B, T, H, D) per-head output (before any output gate and o_proj)


def hooked_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Softmax attention with recurscope's hook points, in the signature of transformers' attention interface:
    query (B, H, T, D), key/value (B, Hkv, S, D) -> (output (B, T, H, D), weights (B, H, T, S)).

    With module.shared_kv set (BridgedLM.run_layer, for rows that all continue one cached row), key/value
    are the new tokens' alone and the cached ones, shared, come first: every row's queries meet them in one product
    per KV head. A hook on hook_k or hook_v sees every cached and new key, so then they are concatenated as usual."""
    from recurscope.hooks.points import is_intercepted

    past = getattr(module, "shared_kv", None)
    if past is not None and (is_intercepted(module.hook_k) or is_intercepted(module.hook_v)):
        B = query.shape[0]
        key = torch.cat([past[0].expand(B, *past[0].shape[1:]), key], dim=-2)
        value = torch.cat([past[1].expand(B, *past[1].shape[1:]), value], dim=-2)
        past = None
    q = module.hook_q(query.transpose(1, 2))
    k = module.hook_k(key.transpose(1, 2))
    v = module.hook_v(value.transpose(1, 2))
    cu = getattr(module, "cu_seqlens", None)
    if cu is not None and past is None and not is_intercepted(module.hook_pattern):
        # packed sequences (BridgedLM.forward(cu_seqlens=...)) and no hook on the pattern: each sequence's own
        # attention, its block of the block-diagonal mask, so the work is the sum of the squared lengths
        blocks = [_attend(module, q[:, lo:hi], k[:, lo:hi], v[:, lo:hi],
                          None if attention_mask is None else attention_mask[:, :, lo:hi, lo:hi], scaling, None)[0]
                  for lo, hi in zip(cu[:-1], cu[1:]) if hi > lo]
        return module.hook_head_out(torch.cat(blocks, dim=1)).contiguous(), None
    out, pattern = _attend(module, q, k, v, attention_mask, scaling, past)
    return module.hook_head_out(out).contiguous(), pattern


def _attend(module, q, k, v, attention_mask, scaling, past):
    """The softmax attention of hooked_attention on hooked q (B, T, H, D), k, v (B, S, Hkv, D) -> (output
    (B, T, H, Dv) before hook_head_out, the pattern after hook_pattern)."""
    B, T, H, D = q.shape
    Hkv = k.shape[2]
    # Queries grouped by their KV head, as in the native attention (grouped_scores / grouped_values).
    qg = q.transpose(1, 2).reshape(B, Hkv, (H // Hkv) * T, D)
    scale = D ** -0.5 if scaling is None else scaling
    shared = past is not None                    # past: (1, Hkv, P, D), one row for every row of the batch
    scores = grouped_scores(qg, k.transpose(1, 2), past[0] if shared else None, shared)
    S = scores.shape[-1]
    scores = scores.view(B, H, T, S) * scale
    if attention_mask is not None:
        mask = attention_mask[:, :, :, :S]
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    pattern = module.hook_pattern(torch.softmax(scores.float(), dim=-1).to(q.dtype))
    o = grouped_values(pattern.reshape(B, Hkv, (H // Hkv) * T, S), v.transpose(1, 2), past[1] if shared else None,
                       shared)
    return o.reshape(B, H, T, v.shape[-1]).transpose(1, 2), pattern   # MLA: value, key sizes differ


def register_attention() -> None:
    """Makes `attn_implementation="recurscope"` known to transformers (eager-style masks)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ATTENTION_NAME, hooked_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, eager_mask)
